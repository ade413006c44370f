"""Recipes scored over seeds: for a sweep that crosses its variants with `train.seed`, each variant's
held-out accuracy (and its difference from the base model) as mean, minimum and maximum over seeds.

One training seed is one draw. The default recipe scored 0.485 with seed 42 and 0.245 with seed 3
(README, "How the default was chosen"), so a recipe is chosen by its worst seed as well as its mean.
"""

from __future__ import annotations

import pandas as pd

SEED_KEY = "override:train.seed"
DEFAULTS = "(defaults)"  # the label of jobs that set none of the swept overrides


def _scored_columns(df: pd.DataFrame) -> list[str]:
    return [c for c in df.columns if c.startswith("eval_") and c.endswith(("_accuracy", "_diff"))]


def per_variant(df: pd.DataFrame, labels: list[str]) -> pd.DataFrame | None:
    """One row per variant label (report.variant_labels of the swept overrides other than the seed) over the
    completed jobs, or None when no variant was scored on two seeds or more."""
    done = df[df["status"] == "completed"] if "status" in df.columns else df
    scored = _scored_columns(done)
    if done.empty or "seed" not in done.columns or not scored:
        return None
    labels = pd.Series(labels, index=df.index)[done.index]
    rows = []
    for label, jobs in done.groupby(labels, sort=False):
        row = {"variant": label, "seeds": jobs["seed"].nunique(),
               "seed_list": " ".join(str(s) for s in sorted(jobs["seed"].dropna().unique()))}
        for column in scored:
            values = pd.to_numeric(jobs[column], errors="coerce").dropna()
            row[f"{column}_mean"] = values.mean() if len(values) else None
            row[f"{column}_min"] = values.min() if len(values) else None
            row[f"{column}_max"] = values.max() if len(values) else None
        rows.append(row)
    table = pd.DataFrame(rows)
    if table["seeds"].max() < 2:
        return None
    first = f"{scored[0]}_mean"
    return table.sort_values(first, ascending=False, na_position="last").reset_index(drop=True)
