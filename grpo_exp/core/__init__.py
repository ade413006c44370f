"""Core layer: problems (data/), rewards, models and quantized evaluation copies."""
