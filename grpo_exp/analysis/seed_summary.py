"""Recipes scored over seeds: for a sweep that crosses its variants with `train.seed`, each variant's
held-out accuracy (and its difference from the base model) over its seeds: mean, minimum, maximum, the
95% t interval of the mean over seeds, and the 95% interval of all its seeds' problems pooled.

One training seed is one draw: four seeds of one recipe once scored from 0.245 to 0.510 (docs/log.md,
"2026-11-27 — a KL penalty of 0.04 raises the worst of four seeds from 0.245 to 0.410"), so a recipe is chosen by its worst seed as well as its mean, and
the interval over seeds (which widens with that spread) is the one to compare recipes by; the pooled
interval counts problems only, given these trained models, so it is narrower. A difference from the start model
is tested over seeds (t over the per-seed differences) and claimed only with at least five seeds
(evaluation/seed_stats.py).

Variants are ranked on the validation split only: the test split is reported once, never chosen on,
and figures from different splits are different problems, so they are not ranked against each other.
"""

from __future__ import annotations

import pandas as pd

from grpo_exp.analysis.aggregates import UNRECORDED, VALIDATION
from grpo_exp.evaluation.seed_stats import POOLED_LABEL, t_test_p, verdict
from grpo_exp.evaluation.stats import mean_interval, paired_difference_interval, wilson_interval

SEED_KEY = "override:train.seed"
DEFAULTS = "(defaults)"  # the label of jobs that set none of the swept overrides
ONE_VARIANT = "all"  # the label of every job of a sweep that swept nothing but the seed


def _scored_columns(df: pd.DataFrame) -> list[str]:
    return [c for c in df.columns if c.startswith("eval_") and c.endswith(("_accuracy", "_diff"))]


def _pooled(jobs: pd.DataFrame, column: str) -> tuple[float, float] | None:
    """The 95% interval of `column` over every problem of these jobs together, from report.csv's count:
    columns: Wilson for an accuracy, the paired interval for a difference; None without the counts."""
    name = column[len("eval_"):].rsplit("_", 1)[0]
    wanted = ([f"count:{name}_correct", f"count:{name}_n"] if column.endswith("_accuracy")
              else [f"count:{name}_only_before", f"count:{name}_only_after", f"count:{name}_pairs"])
    if not set(wanted) <= set(jobs.columns):
        return None
    counts = jobs[wanted].apply(pd.to_numeric, errors="coerce")
    if counts.isna().any().any():
        return None  # a seed without counts would leave its problems out of the pool
    sums = [int(v) for v in counts.sum()]
    return wilson_interval(*sums) if column.endswith("_accuracy") else paired_difference_interval(*sums)


def per_variant(df: pd.DataFrame, labels: list[str]) -> pd.DataFrame | None:
    """One row per variant label (report.variant_labels of the swept overrides other than the seed) and
    held-out split over the completed jobs, ranked (see `rank`); None when no variant was scored on two
    seeds or more."""
    done = df[df["status"] == "completed"] if "status" in df.columns else df
    scored = _scored_columns(done)
    if done.empty or "seed" not in done.columns or not scored:
        return None
    labels = pd.Series(labels, index=df.index)[done.index]
    splits = (done["split"] if "split" in done.columns else pd.Series(None, index=done.index)).fillna(UNRECORDED)
    rows = []
    for (label, split), jobs in done.groupby([labels, splits], sort=False):
        row = {"variant": label, "split": split, "seeds": jobs["seed"].nunique(),
               "seed_list": " ".join(str(s) for s in sorted(jobs["seed"].dropna().unique()))}
        for column in scored:
            values = pd.to_numeric(jobs[column], errors="coerce").dropna()
            row[f"{column}_mean"] = values.mean() if len(values) else None
            row[f"{column}_min"] = values.min() if len(values) else None
            row[f"{column}_max"] = values.max() if len(values) else None
            row[f"{column}_n"] = len(values)
            over_seeds, pooled = mean_interval(values.tolist()), _pooled(jobs.loc[values.index], column)
            row[f"{column}_t95_low"], row[f"{column}_t95_high"] = over_seeds or (None, None)
            row[f"{column}_pooled95_low"], row[f"{column}_pooled95_high"] = pooled or (None, None)
            if column.endswith("_diff"):  # against the start model, paired by seed: the seed-level test
                p = t_test_p(values.tolist())
                row[f"{column}_t_p"] = p
                row[f"{column}_claim"] = verdict(len(values), p, over_seeds)
        rows.append(row)
    table = pd.DataFrame(rows)
    if table["seeds"].max() < 2:
        return None
    return rank(table, f"{scored[0]}_mean")


def rank(table: pd.DataFrame, by: str) -> pd.DataFrame:
    """The validation split's variants first, best `by` first, numbered in `rank`; the rows of any other
    split after them in sweep order, unranked: a variant is never ranked against another split's."""
    validation = table[table["split"] == VALIDATION].sort_values(by, ascending=False, na_position="last")
    validation = validation.assign(rank=range(1, len(validation) + 1))
    rest = table[table["split"] != VALIDATION].assign(rank=None)
    out = pd.concat([validation, rest]) if not rest.empty else validation
    return out[["rank", *table.columns]].reset_index(drop=True)


def split_note(splits) -> str | None:
    """The one line a report gives when its jobs' splits keep it from ranking them all, else None."""
    counts = pd.Series(list(splits)).value_counts()
    if counts.empty or list(counts.index) == [VALIDATION]:
        return None
    listed = ", ".join(f"{name}: {count} job{'s' * (count != 1)}" for name, count in counts.items())
    if len(counts) > 1:
        return (f"These jobs mix held-out splits ({listed}); variants are ranked on the validation split only, "
                "never across splits.")
    return f"Measured on the {counts.index[0]} split ({listed}): listed in sweep order, not ranked " \
           "(settings are chosen on the validation split)."


def display(table: pd.DataFrame) -> pd.DataFrame:
    """The table as report.md shows it: per scored column its mean, min..max, the t interval over seeds
    and the pooled per-problem interval."""
    scored = [c[: -len("_mean")] for c in table.columns if c.endswith("_mean")]
    out = table[["rank", "variant", "split", "seeds", "seed_list"]].copy()
    out["rank"] = [("" if pd.isna(r) else str(int(r))) for r in out["rank"]]
    for column in scored:
        out[f"{column} mean"] = table[f"{column}_mean"]
        out[f"{column} min..max"] = [_range(lo, hi) for lo, hi in zip(table[f"{column}_min"], table[f"{column}_max"])]
        out[f"{column} 95% CI over seeds (t)"] = [
            _interval(lo, hi) for lo, hi in zip(table[f"{column}_t95_low"], table[f"{column}_t95_high"])]
        if f"{column}_t_p" in table.columns:
            out[f"{column} p over seeds (t)"] = ["" if v is None or pd.isna(v) else f"{v:.2g}"
                                                 for v in table[f"{column}_t_p"]]
            out[f"{column} claim"] = table[f"{column}_claim"].fillna("")
        out[f"{column} 95% CI pooled problems ({POOLED_LABEL})"] = [
            _interval(lo, hi) for lo, hi in zip(table[f"{column}_pooled95_low"], table[f"{column}_pooled95_high"])]
    return out


def _range(low, high) -> str:
    return "" if pd.isna(low) else f"{low:.3f}..{high:.3f}"


def _interval(low, high) -> str:
    return "" if low is None or pd.isna(low) else f"[{low:.3f}, {high:.3f}]"
