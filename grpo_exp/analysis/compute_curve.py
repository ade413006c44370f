"""Learning per CPU-hour: validation accuracy against training compute, and a saturating curve fitted per run.

Each point is a periodic evaluation (`eval/<set>/accuracy` in history.jsonl) at the training compute spent so far
(`cpu_s_total`: the process's CPU seconds inside optimizer steps, all threads; core-minutes below), the first one the
starting model's level at zero compute. The curve is ScaleRL's (Khatri et al. 2025, arXiv 2510.13786), in compute C:

    R(C) = R0 + (A - R0) / (1 + (C_mid / C) ** B)

R0 the starting level (measured, not fitted), A the asymptote, B the efficiency (how steeply it rises), C_mid the
compute at which half the gain A - R0 is reached. For each (B, C_mid) on a grid the best A is linear least squares;
the grid point with the smallest squared error is the fit (no optimizer package needed). A run is fitted alone and an
arm's figures are the mean over its seeds with a t interval, so the interval is over training runs.
"""

from __future__ import annotations

import math

import numpy as np
import pandas as pd

from grpo_exp.analysis import aggregates
from grpo_exp.evaluation.stats import mean_interval

MIN_POINTS = 4  # evaluations after the start: fewer cannot fix three parameters
B_GRID = np.geomspace(0.25, 4.0, 33)
MID_GRID_SPAN = (0.05, 20.0)  # C_mid from 0.05x to 20x the largest compute the run reached
MID_GRID_SIZE = 81
# what the default's choice asks of the curve (issue 66): the budget of 10 minutes of training on 2 cores, and the
# test accuracy aimed at; the table reads both off each run's fit
BUDGET_CORE_MIN = 20.0
TARGET = 0.50


def points(job: dict, name: str) -> tuple[float, list[tuple[float, float]]] | None:
    """(R0, [(core-minutes, accuracy), ...]) of a job's periodic evaluations of set `name`; None without the start
    level or the compute record."""
    start = aggregates.validation_start(job, name)
    compute = {}
    for row in job.get("history") or []:
        step = aggregates.step_of(row)
        if step is not None and isinstance(row.get("cpu_s_total"), (int, float)):
            compute[int(step)] = float(row["cpu_s_total"]) / 60.0
    found = [(compute[step], acc) for step, acc, _ in (job.get("periodic") or {}).get(name, [])
             if step in compute and step > 0]
    if start is None or not found:
        return None
    return float(start[1]), sorted(found)


def curve(c: np.ndarray, r0: float, a: float, b: float, mid: float) -> np.ndarray:
    return r0 + (a - r0) / (1.0 + (mid / np.maximum(c, 1e-12)) ** b)


def fit(r0: float, found: list[tuple[float, float]]) -> dict | None:
    """The fitted A, B, C_mid (core-minutes) and the root-mean-square error; None with too few points."""
    if len(found) < MIN_POINTS:
        return None
    c = np.array([p[0] for p in found])
    y = np.array([p[1] for p in found])
    best = None
    for mid in np.geomspace(MID_GRID_SPAN[0] * c.max(), MID_GRID_SPAN[1] * c.max(), MID_GRID_SIZE):
        for b in B_GRID:
            g = 1.0 / (1.0 + (mid / c) ** b)  # R = r0 + (A - r0) g: linear in A
            denom = float(g @ g)
            if denom <= 0:
                continue
            a = r0 + float(g @ (y - r0)) / denom
            a = min(max(a, 0.0), 1.0)  # an accuracy
            err = float(np.sum((curve(c, r0, a, b, mid) - y) ** 2))
            if best is None or err < best[0]:
                best = (err, a, float(b), float(mid))
    err, a, b, mid = best
    return {"asymptote": a, "efficiency": b, "mid_core_min": mid, "rmse": math.sqrt(err / len(found)),
            "points": len(found), "start": r0, "max_core_min": float(c.max()), "last": float(y[-1])}


def at(fitted: dict, core_min: float) -> float:
    """The fitted accuracy after `core_min` core-minutes of training."""
    return float(curve(np.array([core_min]), fitted["start"], fitted["asymptote"], fitted["efficiency"],
                       fitted["mid_core_min"])[0])


def compute_to_reach(fitted: dict, target: float) -> float | None:
    """Core-minutes at which the fitted curve reaches `target` (0 where the start is there already); None where its
    asymptote is not above the target, so no budget reaches it on this curve."""
    r0, a, b, mid = fitted["start"], fitted["asymptote"], fitted["efficiency"], fitted["mid_core_min"]
    if r0 >= target:
        return 0.0
    if a <= target:
        return None
    return mid / ((a - r0) / (target - r0) - 1.0) ** (1.0 / b)


def fits(jobs: list[dict], labels: list[str], name: str) -> list[tuple[str, tuple, dict]]:
    """(variant, its points as `points` gives them, its fit) of every job that can be fitted on set `name`."""
    out = []
    for job, label in zip(jobs, labels):
        found = points(job, name)
        fitted = fit(*found) if found else None
        if fitted:
            out.append((label, found, fitted))
    return out


def by_variant(fitted: list[tuple[str, tuple, dict]]) -> dict[str, list[tuple[tuple, dict]]]:
    """`fits`' output grouped by variant, in order of first appearance: each seed's points and its fit."""
    groups: dict[str, list[tuple[tuple, dict]]] = {}
    for label, found, run_fit in fitted:
        groups.setdefault(label, []).append((found, run_fit))
    return groups


def _cell(values: list[float], digits: int = 3) -> str:
    mean = sum(values) / len(values)
    interval = mean_interval(values) if len(values) >= 2 else None
    ci = f" [{interval[0]:.{digits}f}, {interval[1]:.{digits}f}]" if interval else ""
    return f"{mean:.{digits}f}{ci}"


def _reach_cell(found: list[dict], target: float) -> str:
    """The core-minutes to `target` over the seeds, or how many seeds' curves never reach it; a reach past the
    compute a seed trained is the curve's extrapolation, and the cell says on how many seeds it is one."""
    reach = [compute_to_reach(f, target) for f in found]
    never = sum(r is None for r in reach)
    if never:
        return f"not reached: asymptote <= {target:.2f} on {never} of {len(found)} seeds"
    beyond = sum(r > f["max_core_min"] for r, f in zip(reach, found))
    return _cell(reach, 1) + (f" (extrapolated on {beyond} of {len(found)} seeds)" if beyond else "")


def curve_table(jobs: list[dict], labels: list[str], name: str = "basic", budget_core_min: float = BUDGET_CORE_MIN,
                target: float = TARGET) -> pd.DataFrame:
    """One row per variant: seeds, and the mean over seeds (95% t interval) of the asymptote, efficiency, midpoint
    compute, the fitted accuracy at `budget_core_min`, the core-minutes the fit needs to reach `target` (or on how
    many seeds it never does), the last measured accuracy and the compute it took."""
    rows = []
    for label, runs in by_variant(fits(jobs, labels, name)).items():
        found = [fitted for _, fitted in runs]
        rows.append({"variant": label, "set": name, "seeds": len(found),
                     "start": _cell([f["start"] for f in found]),
                     "asymptote A": _cell([f["asymptote"] for f in found]),
                     "efficiency B": _cell([f["efficiency"] for f in found], 2),
                     "midpoint (core-min)": _cell([f["mid_core_min"] for f in found], 1),
                     f"fitted at {budget_core_min:g} core-min": _cell([at(f, budget_core_min) for f in found]),
                     f"core-min to {target:.2f}": _reach_cell(found, target),
                     "last accuracy": _cell([f["last"] for f in found]),
                     "core-min trained": _cell([f["max_core_min"] for f in found], 1),
                     "fit rmse": _cell([f["rmse"] for f in found])})
    return pd.DataFrame(rows)


def trained_set(jobs: list[dict]) -> str:
    """The set the jobs trained on (their stage), where the most of them evaluated it periodically; basic if none."""
    counts: dict[str, int] = {}
    for job in jobs:
        stage = job.get("row", {}).get("stage")
        if stage and stage in (job.get("periodic") or {}):
            counts[stage] = counts.get(stage, 0) + 1
    return max(counts, key=counts.get) if counts else "basic"


def arm_means(fitted: list[tuple[str, tuple, dict]]) -> dict[str, tuple[list[float], list[float], int]]:
    """Per variant, the mean over its seeds of the k-th evaluation's compute and accuracy (k up to the fewest any seed
    has, the start included), and the number of seeds: the arm's line."""
    means = {}
    for label, seeds in by_variant(fitted).items():
        runs = [run_points for run_points, _ in seeds]
        k = min(len(found) for _, found in runs)
        xs = [0.0] + [float(np.mean([found[i][0] for _, found in runs])) for i in range(k)]
        ys = [float(np.mean([r0 for r0, _ in runs]))] + [float(np.mean([found[i][1] for _, found in runs]))
                                                         for i in range(k)]
        means[label] = (xs, ys, len(runs))
    return means


def plot(jobs: list[dict], labels: list[str], path, name: str | None = None):
    """Accuracy against core-minutes on set `name` (None: the stage the jobs trained on): per variant one colour and
    one thick line (the mean over its seeds of each evaluation, at their mean compute), each seed a thin line, its fit
    dashed."""
    name = name or trained_set(jobs)
    fitted = fits(jobs, labels, name)
    if not fitted:
        return None
    from grpo_exp.analysis.plots import _plt, _save

    plt = _plt()
    fig, ax = plt.subplots(figsize=(7, 4.5))
    colours = {label: f"C{i}" for i, label in enumerate(dict.fromkeys(label for label, _, _ in fitted))}
    for label, (r0, found), f in fitted:
        xs, ys = [0.0] + [p[0] for p in found], [r0] + [p[1] for p in found]
        ax.plot(xs, ys, color=colours[label], linewidth=0.7, alpha=0.5, marker="o", markersize=2)
        grid = np.linspace(max(xs[1] / 4, 1e-3), f["max_core_min"], 200)
        ax.plot(grid, curve(grid, r0, f["asymptote"], f["efficiency"], f["mid_core_min"]), color=colours[label],
                linestyle="--", linewidth=1.2)
    for label, (xs, ys, seeds) in arm_means(fitted).items():
        ax.plot(xs, ys, color=colours[label], linewidth=2.4, label=f"{label} (mean of {seeds} seeds)")
    ax.set_xlabel("training compute (core-minutes: CPU seconds in optimizer steps / 60)")
    ax.set_ylabel(f"validation accuracy ({name})")
    ax.set_title("Accuracy against training compute\n"
                 "(thin: each seed, dashed: its fitted curve; thick: the mean over seeds)", fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    return _save(plt, fig, path)
