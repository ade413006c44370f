"""Statistics whose unit is the training run: one seed is one draw of training, so a claim that one setting beats
another is made over seeds (a t interval and a paired t test over the per-seed differences, and a hierarchical
bootstrap that resamples seeds, then problems within each seed), never over pooled problems.

A pooled-over-problems McNemar test conditions on the trained models: it says which problems moved for these
models, not how much another training run would move. It is kept, labelled "given these trained models".
Fewer than MIN_SEEDS seeds: the claim is "not yet shown", whatever the p.
"""

from __future__ import annotations

import math
import random
import statistics

from grpo_exp.evaluation.stats import _t_central, mean_interval, paired_bits

MIN_SEEDS = 5  # below it, a difference over seeds is reported but not claimed
BOOTSTRAP_RESAMPLES = 2000
POOLED_LABEL = "given these trained models"


def t_test_p(values: list[float]) -> float | None:
    """Two-sided p of the one-sample t test that the mean of `values` is 0 (None under two values; 1.0 when all
    are 0, and 0.0 when they are all one nonzero value)."""
    n = len(values)
    if n < 2:
        return None
    mean = statistics.fmean(values)
    sd = statistics.stdev(values)
    if sd == 0:
        return 1.0 if mean == 0 else 0.0
    t = abs(mean) / (sd / math.sqrt(n))
    return max(0.0, 1.0 - _t_central(t, n - 1))


def hierarchical_bootstrap(pairs: list[tuple[list[int], list[int]]], seed: int = 0,
                           resamples: int = BOOTSTRAP_RESAMPLES) -> tuple[float, float] | None:
    """The 95% percentile interval of the mean difference (after minus before) when seeds are resampled, then each
    resampled seed's problems (pairs kept together); None without two seeds."""
    if len(pairs) < 2:
        return None
    rng = random.Random(seed)
    diffs = [[a - b for b, a in zip(before, after)] for before, after in pairs]
    means = []
    for _ in range(resamples):
        total = 0.0
        for _ in range(len(diffs)):
            d = diffs[rng.randrange(len(diffs))]
            total += sum(d[rng.randrange(len(d))] for _ in range(len(d))) / len(d)
        means.append(total / len(diffs))
    means.sort()
    return means[int(0.025 * resamples)], means[min(resamples - 1, int(0.975 * resamples))]


def verdict(n_seeds: int, p: float | None, interval: tuple[float, float] | None) -> str:
    """What a seed-level comparison shows: "not yet shown" under MIN_SEEDS seeds; else "beyond seed noise" when the
    t interval excludes 0 (p < 0.05), "within seed noise" when it does not."""
    if n_seeds < MIN_SEEDS or p is None or interval is None:
        return f"not yet shown ({_seeds(n_seeds)}; {MIN_SEEDS} needed)"
    return "beyond seed noise" if interval[0] > 0 or interval[1] < 0 else "within seed noise"


def seed_level(pairs: list[tuple[list[int], list[int]]], seed: int = 0) -> dict:
    """Per seed, (before, after) per-problem correctness (0/1) of one comparison paired within the seed (the same
    problems, and with a fixed partition the same ones in every seed): the per-seed differences, their mean with the
    t interval and p, the hierarchical bootstrap interval, the verdict, and the pooled McNemar test (given these
    trained models)."""
    per_seed = [sum(a) / len(a) - sum(b) / len(b) for b, a in pairs if len(a)]
    n = len(per_seed)
    mean = statistics.fmean(per_seed) if per_seed else 0.0
    interval = mean_interval(per_seed)
    p = t_test_p(per_seed)
    pooled = paired_bits([x for b, _ in pairs for x in b], [x for _, a in pairs for x in a]) if pairs else None
    return {"seeds": n, "per_seed": per_seed, "diff": mean, "t_ci95": list(interval) if interval else None,
            "t_p": p, "bootstrap_ci95": (list(ci) if (ci := hierarchical_bootstrap(pairs, seed)) else None),
            "verdict": verdict(n, p, interval), "pooled": pooled, "pooled_label": POOLED_LABEL}


def paired_difference(before: list[float], after: list[float]) -> dict:
    """A per-seed figure of two settings paired by seed (after minus before, one value per seed): the per-seed
    differences, their mean with the t interval and p, and the verdict, in seed_level's shape (no per-problem
    pairs, so no bootstrap and no pooled test)."""
    per_seed = [a - b for b, a in zip(before, after)]
    n, interval, p = len(per_seed), mean_interval(per_seed), t_test_p(per_seed)
    return {"seeds": n, "per_seed": per_seed, "diff": statistics.fmean(per_seed) if per_seed else 0.0,
            "t_ci95": list(interval) if interval else None, "t_p": p, "bootstrap_ci95": None,
            "verdict": verdict(n, p, interval), "pooled": None, "pooled_label": POOLED_LABEL}


def cell(result: dict) -> str:
    """A table cell: "+0.045 [t -0.020, +0.110] p 0.28, 3 seeds: not yet shown"."""
    ci = result["t_ci95"]
    interval = f" [t {ci[0]:+.3f}, {ci[1]:+.3f}]" if ci else ""
    p = f" p {result['t_p']:.2g}" if result["t_p"] is not None else ""
    shown = result["verdict"].split(" (")[0]
    return f"{result['diff']:+.3f}{interval}{p}, {_seeds(result['seeds'])}: {shown}"


def _seeds(n: int) -> str:
    return f"{n} seed" if n == 1 else f"{n} seeds"


def pooled_cell(result: dict) -> str:
    """The pooled McNemar figure, labelled as conditional on the trained models."""
    g = result["pooled"]
    return f"{g['diff']:+.3f} p {g['p']:.2g} ({POOLED_LABEL})" if g else ""
