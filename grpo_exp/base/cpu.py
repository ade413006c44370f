"""The machine: thread and OpenMP settings for torch, OMP and MKL (applied before any heavy torch
work), and what the hardware computes natively (the precision `train.precision=auto` picks)."""

from __future__ import annotations

import os
import sys
import warnings
from typing import Any

from grpo_exp.base import dist
from grpo_exp.base.errors import ConfigError

PRECISIONS = ("auto", "bf16", "fp32")
# OMP_WAIT_POLICY choices; "default" leaves OpenMP's own
WAIT_POLICIES = ("default", "passive", "active")


def resolve_threads(threads: Any) -> int:
    """`auto` means every core this process may run on."""
    if str(threads) == "auto":
        return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    try:
        n = int(threads)
    except (TypeError, ValueError):
        n = 0
    if n < 1 or str(n) != str(threads).strip():
        raise ConfigError(f"cpu.threads={threads!r} is not valid; use 'auto' or a positive integer")
    return n


def process_threads(threads: Any) -> int:
    """Threads for this process: `cpu.threads` (auto: every core) is what the run may use on this machine,
    so under `torchrun --nproc_per_node=N` each of the N processes takes threads // N (at least one);
    more threads than cores only spin against each other."""
    total = resolve_threads(threads)
    return max(1, total // dist.local_world_size())


def resolve_wait_policy(policy: Any) -> str | None:
    """OMP_WAIT_POLICY for cpu.omp_wait_policy; None for "default" (leave OpenMP's own)."""
    if policy not in WAIT_POLICIES:
        raise ConfigError(f"cpu.omp_wait_policy={policy!r} is not valid; choose one of: {', '.join(WAIT_POLICIES)}")
    return None if policy == "default" else str(policy).upper()


def resolve_precision(precision: str) -> str:
    """bf16 only pays where the hardware has bf16 arithmetic: without it (AVX2-only CPUs) torch
    emulates bf16 matmuls and a training step runs tens of times slower than in fp32."""
    if precision != "auto":
        return precision
    import torch

    if torch.cuda.is_available():
        return "bf16" if torch.cuda.is_bf16_supported() else "fp32"
    native = torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported()
    # ATEN_CPU_CAPABILITY=avx2 (or default) holds torch's own kernels to AVX2, where bf16 is emulated, on any CPU:
    # such a process is an AVX2-only machine for this choice too (README: the emulated AVX2 runs)
    held_below_avx512 = torch.backends.cpu.get_cpu_capability() in ("DEFAULT", "AVX2")
    return "bf16" if native and not held_below_avx512 else "fp32"


def prepare_env(cpu_cfg) -> None:
    """Environment that OpenMP and MKL read once, when torch loads: call it before `import torch`.

    cpu.omp_wait_policy "default" leaves OpenMP's own choice (libgomp: spin briefly, then sleep);
    "passive" sleeps at once (for cores shared with other jobs); "active" always spins. Child
    processes (dataloaders, accelerate) inherit the environment too. In a process where torch is
    already loaded, a changed wait policy cannot take effect, so a warning says so instead."""
    threads = process_threads(cpu_cfg.threads)
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

    torch.set_num_threads(process_threads(cpu_cfg.threads))
    try:
        torch.set_num_interop_threads(int(cpu_cfg.interop_threads))
    except RuntimeError:
        # Only settable before the first parallel region; a second stage in the same process keeps it.
        pass
    return {"threads": torch.get_num_threads(), "interop_threads": torch.get_num_interop_threads(),
            # as OpenMP read it when torch loaded (unset: OpenMP's default)
            "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY")}
