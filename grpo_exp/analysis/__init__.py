"""Analysis layer: sweep reports, the benchmark and the generation profile."""
