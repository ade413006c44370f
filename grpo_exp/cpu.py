"""Thread and OpenMP settings for torch, OMP and MKL, applied before any heavy torch work."""

from __future__ import annotations

import os
import sys
import warnings

from grpo_exp.config import resolve_threads, resolve_wait_policy


def prepare_env(cpu_cfg) -> None:
    """Environment that OpenMP and MKL read once, when torch loads: call it before `import torch`.

    cpu.omp_wait_policy "default" leaves OpenMP's own choice (libgomp: spin briefly, then sleep);
    "passive" sleeps at once (for cores shared with other jobs); "active" always spins. Child
    processes (dataloaders, accelerate) inherit the environment too. In a process where torch is
    already loaded, a changed wait policy cannot take effect, so a warning says so instead."""
    threads = resolve_threads(cpu_cfg.threads)
    for var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS"):
        os.environ[var] = str(threads)
    wanted = resolve_wait_policy(cpu_cfg.get("omp_wait_policy", "default"))
    if wanted is None:
        return
    if "torch" in sys.modules and os.environ.get("OMP_WAIT_POLICY", "").upper() != wanted:
        warnings.warn(f"cpu.omp_wait_policy={wanted.lower()} not applied: torch is already loaded in this process "
                      f"(OpenMP read OMP_WAIT_POLICY={os.environ.get('OMP_WAIT_POLICY')!r}); "
                      f"set OMP_WAIT_POLICY={wanted} in the environment instead", stacklevel=2)
        return
    os.environ["OMP_WAIT_POLICY"] = wanted


def apply(cpu_cfg) -> dict:
    """Set intra-op/inter-op threads; returns what was applied (recorded in metrics.json)."""
    prepare_env(cpu_cfg)
    import torch

    torch.set_num_threads(resolve_threads(cpu_cfg.threads))
    try:
        torch.set_num_interop_threads(int(cpu_cfg.interop_threads))
    except RuntimeError:
        # Only settable before the first parallel region; a second stage in the same process keeps it.
        pass
    return {"threads": torch.get_num_threads(), "interop_threads": torch.get_num_interop_threads(),
            # as OpenMP read it when torch loaded (unset: OpenMP's default)
            "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY")}
