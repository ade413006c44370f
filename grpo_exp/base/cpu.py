"""The machine: thread and OpenMP settings for torch, OMP and MKL (applied before any heavy torch
work), the C library's policy for freed memory, and what the hardware computes natively (the precision
`train.precision=auto` picks)."""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import os
import shutil
import sys
import warnings
from typing import Any

from grpo_exp.base import dist, log
from grpo_exp.base.errors import ConfigError

logger = log.get_logger(__name__)

PRECISIONS = ("auto", "bf16", "fp32")
# OMP_WAIT_POLICY choices; "default" leaves OpenMP's own
WAIT_POLICIES = ("default", "passive", "active")
# cpu.malloc: what glibc does with freed memory (apply_malloc)
MALLOC_POLICIES = ("auto", "retain", "glibc")
# mallopt(3) parameters (malloc.h)
_M_TRIM_THRESHOLD, _M_MMAP_MAX = -1, -4
# the largest M_TRIM_THRESHOLD mallopt's int takes (2 GiB): a free top of the heap larger than this is trimmed
_NEVER_TRIM = 2**31 - 1
# whether this process runs with retain's settings (a sweep runs several jobs in one process)
_retained = False
_applied: dict = {}  # what the last apply() set


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
    # such a process is an AVX2-only machine for this choice too (docs/machines.md, "Emulated AVX2")
    held_below_avx512 = torch.backends.cpu.get_cpu_capability() in ("DEFAULT", "AVX2")
    return "bf16" if native and not held_below_avx512 else "fp32"


def native_dtype():
    """The torch dtype `precision=auto` computes in: bf16 where the hardware computes it natively (CUDA with bf16,
    AVX512-BF16, AMX), fp32 elsewhere, where bf16 is emulated and slower than fp32."""
    import torch

    return torch.bfloat16 if resolve_precision("auto") == "bf16" else torch.float32


def prepare_env(cpu_cfg) -> int:
    """Environment that OpenMP and MKL read once, when torch loads: call it before `import torch`.

    cpu.omp_wait_policy "default" leaves OpenMP's own choice (libgomp: spin briefly, then sleep);
    "passive" sleeps at once (for cores shared with other jobs); "active" always spins. Child
    processes (dataloaders, accelerate) inherit the environment too. In a process where torch is
    already loaded, a changed wait policy cannot take effect, so a warning says so instead. Returns this process's
    threads (process_threads)."""
    threads = process_threads(cpu_cfg.threads)
    for var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS"):
        os.environ[var] = str(threads)
    wanted = resolve_wait_policy(cpu_cfg.get("omp_wait_policy", "default"))
    if wanted is None:
        return threads
    if "torch" in sys.modules and os.environ.get("OMP_WAIT_POLICY", "").upper() != wanted:
        warnings.warn(f"cpu.omp_wait_policy={wanted.lower()} not applied: torch is already loaded in this process "
                      f"(OpenMP read OMP_WAIT_POLICY={os.environ.get('OMP_WAIT_POLICY')!r}); "
                      f"set OMP_WAIT_POLICY={wanted} in the environment instead", stacklevel=2)
        return threads
    os.environ["OMP_WAIT_POLICY"] = wanted
    return threads


def resolve_malloc(policy: Any) -> str:
    """The policy cpu.malloc asks for, checked: auto asks for retain (apply_malloc keeps glibc's own where the C
    library is not glibc)."""
    if policy not in MALLOC_POLICIES:
        raise ConfigError(f"cpu.malloc={policy!r} is not valid; choose one of: {', '.join(MALLOC_POLICIES)}")
    return "retain" if policy == "auto" else str(policy)


@functools.lru_cache(maxsize=1)
def _glibc():
    """The process's glibc (None elsewhere: musl, macOS, Windows), whose mallopt sets the policy."""
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name) if name else None
        if libc is None or not hasattr(libc, "mallopt") or not hasattr(libc, "gnu_get_libc_version"):
            return None
    except OSError:
        return None
    libc.mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    return libc


def apply_malloc(policy: Any) -> str:
    """What the C library does with memory torch frees (cpu.malloc); returns the policy in effect.

    glibc's own policy maps every block above a threshold (128 KiB at first, raised to the largest block freed,
    at most 32 MiB) with its own mmap and unmaps it when freed, and gives the free top of its heap back to the
    kernel. A GRPO step allocates and frees the same large tensors every step (autocast's bf16 weight copies, fp32
    gradients, the 113 MB embedding gradient), so each step faults hundreds of MB of fresh, zeroed pages back in.
    retain serves every block from the heap (mmap off) and never trims it, so freed memory is reused in place. It
    changes no number a run computes (the arithmetic does not depend on where a tensor lives; tests/base/test_cpu.py
    checks a training step's result), only how fast it runs and how long memory stays with the process: once freed,
    memory stays resident until the process ends (docs/performance.md, "Freed memory kept for reuse").
    Allocations made before the call keep their place. Without glibc there is nothing to set: auto says so in the log,
    retain in a warning."""
    global _retained
    chosen = resolve_malloc(policy)
    if chosen == "glibc":
        if _retained:  # glibc's dynamic thresholds cannot be turned back on once a mallopt set them
            logger.warning("cpu.malloc=glibc: not applied, an earlier run in this process set retain, which stays "
                           "until the process ends")
            return "retain"
        return "glibc"
    libc = _glibc()
    if libc is None:
        (logger.warning if policy == "retain" else logger.info)(
            "cpu.malloc=%s: not applied, this process's C library is not glibc (no mallopt); its own policy stays",
            policy)
        return "glibc"
    if not (libc.mallopt(_M_MMAP_MAX, 0) and libc.mallopt(_M_TRIM_THRESHOLD, _NEVER_TRIM)):
        logger.warning("cpu.malloc=%s: glibc's mallopt refused the setting; its own policy stays", policy)
        return "glibc"
    _retained = True
    return "retain"


def release_freed_memory() -> bool:
    """Give the pages of every free block back to the kernel (glibc's malloc_trim(0)), where one stage or job of a
    process has ended and the next has not begun. Under retain nothing else does: the blocks a finished stage freed
    (its model, optimizer, trainer and evaluation copies) would stay resident for the rest of the process, and the
    next stage, whose tensors have other sizes, would grow the heap beside them. The address space stays; a page used
    again is faulted in again, once per stage instead of once per step. Under glibc's own policy it gives back the
    free pages inside the heap, which glibc trims only at its top. False where the C library is not glibc or nothing
    was released."""
    libc = _glibc()
    if libc is None:
        return False
    import gc

    # cycles (a trainer and its callbacks) hold tensors until collected; the second pass takes what the first one's
    # weakref callbacks let go (a model's decoder, evaluation/fast_decode.py)
    gc.collect()
    gc.collect()
    return bool(libc.malloc_trim(0))


def apply(cpu_cfg) -> dict:
    """Set intra-op/inter-op threads and the malloc policy; returns what was applied (recorded in
    metrics.json), which `applied()` gives to later readers (the run's logger names its threads)."""
    global _applied
    threads = prepare_env(cpu_cfg)  # cpu.threads resolved once, here
    malloc = apply_malloc(cpu_cfg.get("malloc", "auto"))
    import torch

    torch.set_num_threads(threads)
    try:
        torch.set_num_interop_threads(int(cpu_cfg.interop_threads))
    except RuntimeError:
        # Only settable before the first parallel region; a second stage in the same process keeps it.
        pass
    _applied = {"threads": torch.get_num_threads(), "interop_threads": torch.get_num_interop_threads(),
                # as OpenMP read it when torch loaded (unset: OpenMP's default)
                "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY"), "malloc": malloc}
    return dict(_applied)


def applied() -> dict:
    """What the last `apply` in this process set (empty before one): cpu.threads as resolved, for its readers."""
    return dict(_applied)


def compiler_missing() -> str | None:
    """Why inductor cannot build C++ here (None when it can): the rollout engine's compiled decoding step and
    grpo-exp's C++ kernels (kernels/small_rows.py, kernels/decode_attention.py) are compiled by it."""
    try:
        import torch._inductor  # noqa: F401
    except Exception as err:  # a stripped build
        return f"torch._inductor is not importable ({err})"
    cxx = os.environ.get("CXX")
    if not any(shutil.which(c) for c in ([cxx] if cxx else []) + ["g++", "clang++"]):
        return "no C++ compiler (g++ or clang++) on PATH"
    return None
