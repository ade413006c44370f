"""PPO's old log-probs on the engine's path: the sampler's own, or a scoring forward by the trained policy.

Where the rollout copy computes what the policy computes (an fp32 copy of a policy trained in fp32; the autocast
copy of one trained under bf16 autocast), the sampler's log-probs are the policy's up to kernel rounding, so they
serve as the old log-probs and TRL's scoring forward over the round is skipped. Elsewhere the policy scores the
round and importance weights (importance.py) correct for the copy's mismatch.
"""

from __future__ import annotations

import torch

from grpo_exp.core import copy_kinds


def old_logps_source(choice: str, rollout_dtype: str, precision: str) -> str:
    """Where PPO's old log-probs come from on the engine's path (`train.rollout_old_logps`).

    policy: TRL scores the round with the trained policy (one no-grad forward over every completion), and the
    importance-sampling correction weighs each token by pi_train / pi_sampler. sampler: the sampler's own
    log-probs are the old log-probs and nothing is corrected (PPO's clipped ratio is then taken against the
    sampler). auto: sampler where the copy computes what the policy computes (an fp32 copy of a policy trained
    in fp32, or the autocast copy of one trained under bf16 autocast, refreshed before the round: the same
    weights and the same arithmetic, so the same log-probs up to kernel rounding; tests/training/test_rollout.py
    and docs/performance.md, "Importance sampling and old log-probs"), policy elsewhere (a plain bf16 copy differs)."""
    from grpo_exp.base.cpu import resolve_precision

    if choice != "auto":
        return choice
    kind, trained = copy_kinds.kind(rollout_dtype), resolve_precision(precision)
    exact = (kind, trained) in {("fp32", "fp32"), ("autocast", "bf16")}
    return "sampler" if exact else "policy"


def padded_logps(rows: list[list[float]], width: int, device) -> torch.Tensor:
    """Per-completion log-probs as TRL's [batch, completion length] tensor, right-padded with 0 as TRL pads
    completions (the completion mask hides the padding)."""
    out = torch.zeros((len(rows), width), dtype=torch.float32)
    for i, row in enumerate(rows):
        if len(row) > width:
            raise RuntimeError(f"a completion of {len(row)} tokens does not fit TRL's {width} completion positions")
        out[i, :len(row)] = torch.tensor(row, dtype=torch.float32)
    return out.to(device)
