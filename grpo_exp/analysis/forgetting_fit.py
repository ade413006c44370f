"""Forgetting against KL (RL's Razor, arXiv 2509.04259): does how far a stage moved the policy predict what it forgot?

One point per curriculum job, later stage and earlier stage: the earlier stage's forgetting (its held-out accuracy
when the later stage began minus when it ended, from curriculum.json's matrix) against two distances the later
stage logged at its end (its history.jsonl, the last value): the KL from the previous stage's model on the later
stage's own validation prompts (`drift/<stage>/kl`, the quantity the paper fits) and on the earlier stage's prompts
(`forgetting/<earlier>/kl`). Both are KL(previous || now), summed over a completion's tokens (training/forgetting.py).

A least-squares line per family (GRPO, SFT) and over all points: slope with its 95% t interval, intercept, R^2 and
the number of points. The points of one job share its seed and model, so the interval is conditional on them; the
line says whether one axis orders GRPO and SFT alike, not that the distance causes the forgetting.
"""

from __future__ import annotations

import math
from pathlib import Path

import pandas as pd

from grpo_exp.analysis import continual
from grpo_exp.base.io import read_jsonl
from grpo_exp.base.run_files import HISTORY_FILE, stage_dir_name

KL_AXES = {"drift": "KL on the new stage's prompts", "earlier": "KL on the earlier stage's prompts"}


def _last_values(history_file: Path) -> dict:
    """The last value of each numeric key in a stage's history.jsonl (a torn last line is skipped)."""
    last: dict = {}
    for record in read_jsonl(history_file, tolerant=True):
        last.update({k: v for k, v in record.items() if isinstance(v, (int, float)) and not isinstance(v, bool)})
    return last


def family(cur: dict) -> str:
    """GRPO or SFT: what trained the job's stages (records from before train.method are GRPO's)."""
    return "SFT" if cur.get("method") == "sft" else "GRPO"


def points(jobs: list[dict], labels: list[str]) -> pd.DataFrame:
    """One row per (job, later stage, earlier stage) of every finished sequential curriculum job: forgetting and both
    KLs (NaN where the stage logged none: forgetting tracking off, or a record from before drift was logged)."""
    rows = []
    for method, cur, job in continual._finished(jobs, labels):
        if continual._adaptive(cur):  # one run over every stage: no stage follows another
            continue
        root, stages, matrix = Path(job["row"]["dir"]), cur["stages"], cur["matrix"]
        for i in range(1, len(stages)):
            logged = _last_values(root / stage_dir_name(i, stages[i]) / HISTORY_FILE)
            for j in range(i):
                rows.append({"method": method, "family": family(cur), "seed": cur.get("seed"), "stage": stages[i],
                             "earlier": stages[j], "forgetting": matrix[i - 1][j] - matrix[i][j],
                             "drift": logged.get(f"drift/{stages[i]}/kl", math.nan),
                             "kl_earlier": logged.get(f"forgetting/{stages[j]}/kl", math.nan)})
    return pd.DataFrame(rows)


def line_fit(x: list[float], y: list[float]) -> dict | None:
    """Least squares y = a + b x: slope b with its 95% t interval, a, R^2 and n; None under 3 points or no spread."""
    from scipy import stats

    pairs = [(a, b) for a, b in zip(x, y) if not (math.isnan(a) or math.isnan(b))]
    if len(pairs) < 3 or len({a for a, _ in pairs}) < 2:
        return None
    xs, ys = zip(*pairs)
    fit = stats.linregress(xs, ys)
    half = stats.t.ppf(0.975, len(pairs) - 2) * fit.stderr
    return {"n": len(pairs), "slope": fit.slope, "slope_ci95": [fit.slope - half, fit.slope + half],
            "intercept": fit.intercept, "r2": fit.rvalue ** 2, "p": fit.pvalue}


def fit_table(table: pd.DataFrame) -> pd.DataFrame:
    """Per KL axis and family (and all points together, where both families ran): the fitted line."""
    rows = []
    if table.empty:
        return pd.DataFrame()
    families = sorted(table["family"].unique())
    groups = [(f, table[table["family"] == f]) for f in families] + ([("all", table)] if len(families) > 1 else [])
    for axis, column in (("drift", "drift"), ("earlier", "kl_earlier")):
        for name, part in groups:
            fit = line_fit(list(part[column]), list(part["forgetting"]))
            if fit is None:
                continue
            low, high = fit["slope_ci95"]
            rows.append({"x": KL_AXES[axis], "family": name, "points": fit["n"],
                         "slope [95% t CI]": f"{fit['slope']:+.3g} [{low:+.3g}, {high:+.3g}]",
                         "intercept": f"{fit['intercept']:+.3f}", "R^2": f"{fit['r2']:.2f}", "p": f"{fit['p']:.2g}"})
    return pd.DataFrame(rows)


def plot(table: pd.DataFrame, path: Path) -> Path | None:
    """Forgetting against the KL on the new stage's prompts, one colour per method, the fitted line per family
    dashed; None without two points that have both."""
    from grpo_exp.analysis.plots import _plt, _save

    have = table.dropna(subset=["drift"]) if not table.empty else table
    if len(have) < 2:
        return None
    plt = _plt()
    fig, ax = plt.subplots(figsize=(8, 5))
    for method, part in have.groupby("method", sort=True):
        ax.scatter(part["drift"], part["forgetting"], label=method, s=22, alpha=0.8)
    for name, part in have.groupby("family"):
        fit = line_fit(list(part["drift"]), list(part["forgetting"]))
        if fit:
            xs = [part["drift"].min(), part["drift"].max()]
            ax.plot(xs, [fit["intercept"] + fit["slope"] * x for x in xs], "--", lw=1,
                    label=f"{name} fit (R^2 {fit['r2']:.2f})")
    ax.axhline(0.0, color="grey", lw=0.5)
    ax.set_xlabel("KL(previous stage || now) on the new stage's validation prompts, nats per completion")
    ax.set_ylabel("forgetting of an earlier stage (accuracy points)")
    ax.set_title("Forgetting against the KL a stage moved the policy")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    return _save(plt, fig, path)
