"""Thread settings for torch, OpenMP and MKL, applied before any heavy torch work."""

from __future__ import annotations

import os

import torch

from grpo_exp.config import resolve_threads


def apply(cpu_cfg) -> dict:
    """Set intra-op/inter-op threads; returns what was applied (recorded in metrics.json)."""
    threads = resolve_threads(cpu_cfg.threads)
    # OMP/MKL read these when their pools start; child processes (dataloaders, accelerate) inherit them.
    for var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS"):
        os.environ[var] = str(threads)
    torch.set_num_threads(threads)
    try:
        torch.set_num_interop_threads(int(cpu_cfg.interop_threads))
    except RuntimeError:
        # Only settable before the first parallel region; a second stage in the same process keeps it.
        pass
    return {"threads": torch.get_num_threads(), "interop_threads": torch.get_num_interop_threads(),
            # as read by OpenMP when torch loaded (grpo_exp/__init__.py defaults it to PASSIVE)
            "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY")}
