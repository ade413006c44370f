"""The rollout copy's kinds (`train.rollout_dtype`) and the dtype of the Linear weights each holds: one map, read
by the config's checks (config/schema.py, before any model loads) and by the engine that makes the copy
(training/rollout/engine.py)."""

from __future__ import annotations

from grpo_exp.base import cpu

KINDS = ("auto", "autocast", "bf16", "fp32")  # train.rollout_dtype


def kind(name: str) -> str:
    """The rollout copy `train.rollout_dtype` asks for.

    autocast: the copy computes what bf16 autocast training computes (bf16 Linear weights, the embedding, norms
    and residual stream in fp32, under bf16 autocast); bf16: every weight in bf16; fp32: the policy's own weights.
    auto: the machine's native dtype (bf16 where it is native, else fp32). The autocast copy is faster under
    bf16 training (its log-probs replace TRL's scoring forward) but is not `auto`'s choice: in its seeds check
    one of the default run's seeds collapsed (docs/log.md, "2026-11-28 — the autocast copy")."""
    if name != "auto":
        return name
    import torch

    return "bf16" if cpu.native_dtype() == torch.bfloat16 else "fp32"


def weight_dtype(copy_kind: str):
    """The torch dtype of a copy's Linear weights: fp32 for the fp32 copy, bf16 for the bf16 and autocast ones."""
    import torch

    return torch.float32 if copy_kind == "fp32" else torch.bfloat16
