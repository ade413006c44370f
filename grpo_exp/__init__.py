"""grpo-exp: Hydra-configured GRPO experiments (TRL) with an EWC curriculum, sized for CPUs."""

import os as _os

__version__ = "0.1.0"

# OpenMP threads that spin while waiting collapse when the cores are shared: measured on a 2-core machine
# with other jobs running, a 2-thread GRPO step took 100-250 s with spinning (libgomp's default) and 37-58 s
# with PASSIVE (scripts/bench.py). libgomp reads this when torch loads, so it is set on import of the package,
# before torch; an OMP_WAIT_POLICY already in the environment wins (OMP_WAIT_POLICY=ACTIVE restores spinning).
_os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
