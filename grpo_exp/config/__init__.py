"""Configuration: typed schemas with their checks (schema), whole-config validation (checks) and
Hydra composition with one-line errors (compose)."""
