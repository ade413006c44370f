"""The scale of EWC's Fisher: its normalisation (`ewc.fisher_norm`), the uniform Fisher of the Anchored Weight
Decay ablation (`ewc.fisher=uniform`), and how far two estimates agree (their rank correlation over parameters).

The raw diagonal Fisher of a sequence's log-likelihood grows with the completion's length (a sum over its tokens)
and with the model and its parameterisation, while GRPO's loss is a mean per token: a lambda chosen on one
stage's length and one model holds nowhere else. `mean` divides each stage's estimate by its mean over the
parameters it covers, so its mean is 1 whatever the length and the model; lambda then weighs the squared
distance to the anchor as an L2 pull of strength lambda would, shared out by importance, and the uniform
Fisher (every entry 1) is the same pull without the sharing: the ablation that shows whether the Fisher matters.
"""

from __future__ import annotations

import torch

from grpo_exp.config.schema import EWC_FISHER_NORMS, EWC_FISHERS

NORMS = EWC_FISHER_NORMS  # ("mean", "none")
KINDS = EWC_FISHERS  # ("sampled", "uniform")


def mean_value(fisher: dict[str, torch.Tensor]) -> float:
    """Mean entry over every parameter the Fisher covers (each element counts once, in float64)."""
    total = sum(float(f.double().sum()) for f in fisher.values())
    count = sum(f.numel() for f in fisher.values())
    if count == 0:
        raise ValueError("the Fisher covers no parameters")
    return total / count


def normalise(fisher: dict[str, torch.Tensor], norm: str) -> dict[str, torch.Tensor]:
    """One stage's estimate in the normalisation `norm`: `mean` divides by its mean (so the mean is 1), `none`
    leaves the raw Fisher (the scale of runs from before the option)."""
    if norm == "none":
        return fisher
    if norm != "mean":
        raise ValueError(f"unknown Fisher normalisation {norm!r}; valid: {', '.join(NORMS)}")
    scale = mean_value(fisher)
    if not scale > 0:
        raise ValueError(f"the Fisher's mean is {scale!r}; a Fisher with no positive entry cannot be normalised")
    return {name: f / scale for name, f in fisher.items()}


def uniform(params: dict[str, torch.nn.Parameter]) -> dict[str, torch.Tensor]:
    """Every entry 1, on the CPU where the EWC state lives: lambda/2 * sum (theta - theta*)^2, an L2 pull to the
    anchor. It is its own mean-1 normalisation, so it shares EWC's lambda scale under `mean`."""
    return {name: torch.ones(p.shape, dtype=torch.float32) for name, p in params.items()}


def stage_weight(stages: int, gamma: float) -> float:
    """What one entry of a uniform (or mean-1) Fisher accumulated over `stages` stages holds under online EWC:
    1 + gamma + ... + gamma^(stages - 1)."""
    return float(sum(gamma ** k for k in range(max(stages, 1))))


def _average_ranks(values: torch.Tensor) -> torch.Tensor:
    """1-based ranks with ties sharing their average rank (Spearman's convention; a Fisher has many exact zeros)."""
    order = torch.argsort(values)
    _, inverse, counts = torch.unique_consecutive(values[order], return_inverse=True, return_counts=True)
    ends = torch.cumsum(counts, 0).double()
    ranks = torch.empty(values.numel(), dtype=torch.float64)
    ranks[order] = (ends - (counts.double() - 1) / 2)[inverse]
    return ranks


def rank_correlation(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor], max_values: int = 2_000_000,
                     seed: int = 0) -> float:
    """Spearman correlation over parameters of two Fisher estimates of the same parameters (from two seeds,
    say): 1 when they order the parameters' importance alike. Beyond `max_values` entries it is computed on a
    seeded random subset of them (the same for both), which estimates the full figure closely and keeps a
    100M-parameter model's ranking within memory."""
    if a.keys() != b.keys():
        raise ValueError(f"the two Fishers cover different parameters: {sorted(a.keys() ^ b.keys())[:3]}")
    names = sorted(a)
    x = torch.cat([a[n].detach().float().flatten().cpu() for n in names])
    y = torch.cat([b[n].detach().float().flatten().cpu() for n in names])
    if x.numel() != y.numel():
        raise ValueError("the two Fishers' tensors differ in shape")
    if x.numel() > max_values:
        pick = torch.randint(x.numel(), (max_values,), generator=torch.Generator().manual_seed(seed))
        x, y = x[pick], y[pick]
    rx, ry = _average_ranks(x), _average_ranks(y)
    rx, ry = rx - rx.mean(), ry - ry.mean()
    denominator = float(rx.norm() * ry.norm())
    return float((rx * ry).sum()) / denominator if denominator > 0 else float("nan")
