"""Training layer: one GRPO stage (stage), its trainer and the pieces it uses, and the curriculum."""
