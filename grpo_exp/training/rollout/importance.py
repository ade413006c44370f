"""Importance weights pi_train / pi_sampler for samples drawn by a sampler other than the trained policy.

TRL's truncated or masked correction of vLLM rollouts, by its own definition (per token, or per sequence as the
product of its tokens' ratios), and the mismatch figures it and grpo-exp log: the k3 KL estimate, the share of
tokens the cap changed, TRL's sampling/* figures, combinable over data-parallel processes.
"""

from __future__ import annotations

import torch


def is_weights(old_logps: torch.Tensor, sampling_logps: torch.Tensor, mask: torch.Tensor, mode: str,
               cap: float | None, floor: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The truncated/masked importance weights pi_train / pi_sampler and which tokens the cap changed, by the
    definition TRL applies (tests check TRL's weights against this): token modes weigh each token by its own
    ratio, sequence modes every token by the product of its sequence's ratios."""
    diff = torch.nan_to_num((old_logps - sampling_logps) * mask, nan=0.0)
    if mode.startswith("sequence"):
        diff = diff.sum(-1, keepdim=True)
    ratio = torch.exp(diff)
    low = -float("inf") if floor is None else floor
    high = float("inf") if cap is None else cap
    outside = (ratio < low) | (ratio > high)
    if mode.endswith("truncate"):
        weights = ratio.clamp(min=floor, max=cap)
    else:
        weights = ratio.masked_fill(outside, 0.0)
    return weights, outside.expand_as(mask) & mask.bool()


# what mismatch_totals adds up on one process, in its order; mismatch_from_totals combines processes' rows
MISMATCH_TOTALS = ("k3_sum", "clipped", "abs_sum", "tokens", "abs_max", "ratio_min", "ratio_sum", "ratios",
                   "ratio_max")


def mismatch_totals(old_logps: torch.Tensor, sampling_logps: torch.Tensor, mask: torch.Tensor, mode: str,
                    cap: float | None, floor: float | None = None) -> torch.Tensor:
    """One process's sums, counts and extremes of the sampler's mismatch on its valid tokens (MISMATCH_TOTALS, a
    float64 vector): what processes can gather and combine into the run's figures (mismatch_from_totals).
    The importance weights are counted per valid token in token modes and per sequence in sequence modes, as TRL
    reports them."""
    valid = mask.bool() & ~torch.isnan(sampling_logps)
    log_r = (old_logps - sampling_logps).masked_fill(~valid, 0.0)
    k3 = (torch.exp(log_r) - 1 - log_r).masked_fill(~valid, 0.0)
    weights, clipped = is_weights(old_logps, sampling_logps, mask, mode, cap, floor)
    ratios = weights.flatten() if mode.startswith("sequence") else weights[valid]
    abs_r = log_r.abs()[valid]
    inf = float("inf")
    return torch.tensor([float(k3.sum()), float((clipped & valid).sum()), float(abs_r.sum()), float(valid.sum()),
                         float(abs_r.max()) if abs_r.numel() else -inf,
                         float(ratios.min()) if ratios.numel() else inf, float(ratios.sum()), float(ratios.numel()),
                         float(ratios.max()) if ratios.numel() else -inf], dtype=torch.float64)


def mismatch_from_totals(totals: torch.Tensor) -> dict[str, float]:
    """The mismatch over every process's tokens from their `mismatch_totals` rows ([processes, len(MISMATCH_TOTALS)]):
    rollout/kl, rollout/clipped_frac, rollout/logp_diff_abs, and, where a process had a valid token, TRL's
    sampling/* figures (the largest log-prob difference; the weights' min, mean and max)."""
    t = dict(zip(MISMATCH_TOTALS, totals.reshape(-1, len(MISMATCH_TOTALS)).double().unbind(-1)))
    tokens = float(t["tokens"].sum())
    n = max(tokens, 1.0)
    stats = {"rollout/kl": float(t["k3_sum"].sum()) / n, "rollout/clipped_frac": float(t["clipped"].sum()) / n,
             "rollout/logp_diff_abs": float(t["abs_sum"].sum()) / n}
    ratios = float(t["ratios"].sum())
    if tokens and ratios:
        stats.update({"sampling/sampling_logp_difference/mean": stats["rollout/logp_diff_abs"],
                      "sampling/sampling_logp_difference/max": float(t["abs_max"].max()),
                      "sampling/importance_sampling_ratio/min": float(t["ratio_min"].min()),
                      "sampling/importance_sampling_ratio/mean": float(t["ratio_sum"].sum()) / ratios,
                      "sampling/importance_sampling_ratio/max": float(t["ratio_max"].max())})
    return stats


def mismatch_metrics(old_logps: torch.Tensor, sampling_logps: torch.Tensor, mask: torch.Tensor, mode: str,
                     cap: float | None, floor: float | None = None) -> dict[str, float]:
    """How far the sampler is from the trained policy on the sampled tokens of one process: the mean per-token
    KL(sampler || trained) by the k3 estimator (r - 1 - log r with r = pi_train / pi_sampler, unbiased and >= 0),
    the share of completion tokens whose weight the cap truncated or masked, the mean absolute log-prob
    difference, and TRL's sampling/* figures (mismatch_from_totals)."""
    return mismatch_from_totals(mismatch_totals(old_logps, sampling_logps, mask, mode, cap, floor)[None])
