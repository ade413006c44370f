"""The statistics behind every accuracy figure: Wilson intervals, unbiased pass@k, majority votes and seeded
bootstrap intervals for sampled figures, and the paired exact McNemar test for two models scored on the same
problems."""

from __future__ import annotations

import math


def wilson_interval(successes: int, n: int, z: float = 1.96) -> tuple[float, float]:
    """95% Wilson score interval; sensible at 0% and 100% where the normal interval is not."""
    if n == 0:
        return 0.0, 0.0
    p = successes / n
    denom = 1 + z * z / n
    centre = (p + z * z / (2 * n)) / denom
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / denom
    return max(0.0, centre - half), min(1.0, centre + half)


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k from n samples of which c are correct (Chen et al., 2021): the chance that at
    least one of k samples drawn without replacement from the n is correct."""
    if k > n:
        raise ValueError(f"pass@{k} needs at least {k} samples, got {n}")
    if n - c < k:
        return 1.0
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)


def majority_vote(answers: list[float | None]) -> tuple[float | None, int]:
    """(the answer most samples gave, its votes) among parsed numeric answers; (None, 0) when none parsed.

    Unparsable answers (None) never vote, so they never win. Answers equal within answers_match's tolerance
    are one answer (the first one given stands for it). A tie goes to the tied answer given first: the
    earliest sample among the tied answers wins."""
    groups: list[list] = []  # [answer as first given, votes], in order of first appearance
    for answer in answers:
        if answer is None:
            continue
        for group in groups:
            if math.isclose(float(answer), float(group[0]), rel_tol=1e-6, abs_tol=1e-6):
                group[1] += 1
                break
        else:
            groups.append([answer, 1])
    if not groups:
        return None, 0
    best = max(groups, key=lambda g: g[1])  # max keeps the first of equals: the earliest answer
    return best[0], best[1]


BOOTSTRAP_RESAMPLES = 1000


def bootstrap_interval(values: list[float], seed: int, resamples: int = BOOTSTRAP_RESAMPLES,
                       level: float = 0.95) -> tuple[float, float]:
    """Percentile bootstrap interval of the mean of per-problem `values` (problems resampled with
    replacement, `resamples` times, from a generator seeded with `seed`): the same values and seed give the
    same interval. For figures that have no closed-form interval (pass@k, maj@k, pass@1 from samples)."""
    import numpy as np

    n = len(values)
    if n == 0:
        return 0.0, 0.0
    data = np.asarray(values, dtype=np.float64)
    rng = np.random.default_rng(seed)
    means = data[rng.integers(0, n, size=(resamples, n))].mean(axis=1)
    tail = (1 - level) / 2
    low, high = np.quantile(means, [tail, 1 - tail])
    return float(low), float(high)


def mcnemar_exact_p(b: int, c: int) -> float:
    """Two-sided exact McNemar p-value from the discordant counts b and c."""
    n = b + c
    if n == 0:
        return 1.0
    tail = sum(math.comb(n, i) for i in range(min(b, c) + 1)) / 2**n
    return min(1.0, 2 * tail)


def paired_difference_interval(b: int, c: int, n: int, z: float = 1.96) -> tuple[float, float]:
    """95% Wald interval of a paired accuracy difference (c - b) / n from the discordant counts b (only the
    first model right) and c (only the second): its variance comes from the discordant pairs alone, so
    it is narrower than two independent intervals would suggest (Agresti, Categorical Data Analysis, 10.1)."""
    if n == 0:
        return 0.0, 0.0
    diff = (c - b) / n
    half = z * math.sqrt(max(b + c - (c - b) ** 2 / n, 0.0)) / n
    return diff - half, diff + half


def paired(a: list[dict], b: list[dict]) -> dict:
    """Per-problem comparison of two sample lists of the same problems (b relative to a)."""
    if [s["question"] for s in a] != [s["question"] for s in b]:
        raise ValueError("paired comparison needs the same problems in the same order")
    only_a = sum(x["correct"] and not y["correct"] for x, y in zip(a, b))
    only_b = sum(y["correct"] and not x["correct"] for x, y in zip(a, b))
    n = len(a)
    diff = (sum(y["correct"] for y in b) - sum(x["correct"] for x in a)) / n if n else 0.0
    return {"accuracy_diff": diff, "accuracy_diff_ci95": list(paired_difference_interval(only_a, only_b, n)),
            "only_first_correct": only_a, "only_second_correct": only_b, "mcnemar_p": mcnemar_exact_p(only_a, only_b)}


def paired_bits(before: list[int], after: list[int]) -> dict:
    """Paired comparison of two per-problem correctness lists (0/1) of the same problems: `after` minus `before`,
    its 95% interval and McNemar's exact p."""
    n = len(after)
    only_before = sum(bool(b) and not a for b, a in zip(before, after))
    only_after = sum(bool(a) and not b for b, a in zip(before, after))
    low, high = paired_difference_interval(only_before, only_after, n)
    return {"n": n, "before": sum(before) / n, "after": sum(after) / n, "diff": (sum(after) - sum(before)) / n,
            "low": low, "high": high, "p": mcnemar_exact_p(only_before, only_after)}


def t_quantile(p: float, df: int) -> float:
    """The p quantile (p > 0.5) of Student's t with `df` degrees of freedom, by bisection on its exact
    distribution function for whole df (Abramowitz and Stegun 26.7.3-4), so no scipy is needed."""
    if not 0.5 < p < 1 or df < 1:
        raise ValueError(f"t_quantile needs 0.5 < p < 1 and df >= 1, got p={p}, df={df}")
    target = 2 * p - 1  # P(|T| < t)
    low, high = 0.0, 1.0
    while _t_central(high, df) < target:
        high *= 2
    for _ in range(200):
        mid = (low + high) / 2
        low, high = (mid, high) if _t_central(mid, df) < target else (low, mid)
    return (low + high) / 2


def _t_central(t: float, df: int) -> float:
    """P(|T| < t) for Student's t with whole df: a finite series in theta = atan(t / sqrt(df))."""
    theta = math.atan(t / math.sqrt(df))
    s, c2 = math.sin(theta), math.cos(theta) ** 2
    if df % 2 == 0:
        term = total = 1.0
        for k in range(1, df // 2):
            term *= c2 * (2 * k - 1) / (2 * k)
            total += term
        return s * total
    if df == 1:
        return 2 * theta / math.pi
    term = total = math.cos(theta)
    for k in range(1, (df - 1) // 2):
        term *= c2 * (2 * k) / (2 * k + 1)
        total += term
    return 2 / math.pi * (theta + s * total)


def mean_interval(values: list[float], level: float = 0.95) -> tuple[float, float] | None:
    """The t interval of the mean of `values` (e.g. one accuracy per training seed), or None for fewer
    than two values: it treats each value as one draw, so it widens with the spread between seeds."""
    n = len(values)
    if n < 2:
        return None
    mean = sum(values) / n
    sd = math.sqrt(sum((v - mean) ** 2 for v in values) / (n - 1))
    half = t_quantile(0.5 + level / 2, n - 1) * sd / math.sqrt(n)
    return mean - half, mean + half
