"""grpo-exp: Hydra-configured GRPO experiments (TRL) with an EWC curriculum, sized for CPUs."""

__version__ = "0.1.0"
