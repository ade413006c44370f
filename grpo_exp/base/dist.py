"""Data-parallel runs (`torchrun --nproc_per_node=N` or `accelerate launch`): which process this is, and
the few collectives a stage needs beyond what TRL and accelerate do themselves.

The launcher's environment (WORLD_SIZE, RANK, LOCAL_WORLD_SIZE) says whether this process is one of N;
it is read without importing torch, so the thread settings and the bad-input checks can use it before
torch loads. The process group is accelerate's (`PartialState`: gloo on the CPU, NCCL on CUDA), the one
the HF Trainer then reuses. Rank 0 is the main process: it alone writes the run's files. Every helper is
a no-op in a single process.
"""

from __future__ import annotations

import os
from datetime import timedelta
from typing import Any, Callable

from grpo_exp.base.errors import ConfigError, TrainingHalted

TIMEOUT_S = 1800  # transformers' TrainingArguments.ddp_timeout default


def _env_int(name: str, default: int) -> int:
    try:
        return int(os.environ.get(name, default))
    except ValueError:
        return default


def world_size() -> int:
    """Processes training this run (1 unless a distributed launcher started this one)."""
    return max(1, _env_int("WORLD_SIZE", 1))


def rank() -> int:
    return _env_int("RANK", 0)


def local_world_size() -> int:
    """Processes of this run on this machine: they share its cores."""
    return max(1, _env_int("LOCAL_WORLD_SIZE", world_size()))


def is_distributed() -> bool:
    return world_size() > 1


def is_main() -> bool:
    return rank() == 0


def init() -> None:
    """Join the run's process group (once): accelerate's PartialState picks gloo on the CPU and NCCL on
    CUDA, as the HF Trainer would, and the Trainer reuses the group."""
    if not is_distributed():
        return
    import torch
    from accelerate import PartialState

    if not torch.distributed.is_initialized():
        # cpu=True where there is no CUDA: without it accelerate treats a CPU-only machine as not distributed.
        # The timeout is the HF Trainer's (ddp_timeout), which it can no longer pass once the group exists:
        # ranks wait that long for rank 0's evaluations (NCCL's own default is 10 minutes).
        PartialState(cpu=not torch.cuda.is_available(), timeout=timedelta(seconds=TIMEOUT_S))


def _device():
    import torch

    return torch.device("cuda", torch.cuda.current_device()) if torch.distributed.get_backend() == "nccl" \
        else torch.device("cpu")


def broadcast(obj: Any) -> Any:
    """Rank 0's picklable `obj`, on every process."""
    if not is_distributed():
        return obj
    import torch

    init()
    box = [obj if is_main() else None]
    torch.distributed.broadcast_object_list(box, src=0, device=_device())
    return box[0]


def barrier() -> None:
    if is_distributed():
        import torch

        init()
        torch.distributed.barrier()


def any_rank(flag: bool) -> bool:
    """True on every process when `flag` is true on any: a decision all ranks must take together (stop
    after this step, drop this update), or they would leave the lockstep of their collectives."""
    if not is_distributed():
        return bool(flag)
    import torch

    init()
    value = torch.tensor([1.0 if flag else 0.0], device=_device())
    torch.distributed.all_reduce(value, op=torch.distributed.ReduceOp.MAX)
    return bool(value.item())


def all_reduce_sum(tensors: list) -> None:
    """Sum each tensor over the processes, in place."""
    if not is_distributed():
        return
    import torch

    for tensor in tensors:
        torch.distributed.all_reduce(tensor, op=torch.distributed.ReduceOp.SUM)


def on_main(fn: Callable[[], Any], share: bool = True) -> Any:
    """`fn()` on the main process alone (it writes the run's files); with `share` every process gets its
    (picklable) result, else the others get None. If it raises, every process raises: a ConfigError or
    TrainingHalted as itself (the entrypoint's one line and exit code), anything else as a RuntimeError
    naming it, so no rank trains on while another has failed."""
    if not is_distributed():
        return fn()
    outcome, error, result = None, None, None
    if is_main():
        try:
            result = fn()
            outcome = ("ok", result if share else None)
        except BaseException as err:  # noqa: BLE001  (re-raised below, after the others have heard of it)
            error = err
            kind = "config" if isinstance(err, ConfigError) else "halted" if isinstance(err, TrainingHalted) else "error"
            outcome = (kind, str(err) if kind != "error" else f"{type(err).__name__}: {err}")
    outcome = broadcast(outcome)
    if error is not None:
        raise error
    if outcome[0] == "ok":
        return result if is_main() else outcome[1]
    if outcome[0] == "config":
        raise ConfigError(outcome[1])
    if outcome[0] == "halted":
        raise TrainingHalted(outcome[1])
    raise RuntimeError(f"the main process (rank 0) failed: {outcome[1]}")
