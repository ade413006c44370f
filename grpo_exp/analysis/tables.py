"""The report's tables of held-out results, each labelled with the split it was measured on: accuracy
before and after training per job, each variant over seeds, the reward by fifths of the run and the
validation accuracy at each periodic evaluation. report.md and the results pages (results_page.py)
show the same tables, and `grpo-report <dirs> --table NAME` prints one of them.

Every figure is read from or computed on the runs' files (report.load_job, aggregates); none is typed in.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import pandas as pd

from grpo_exp.analysis import TABLES as NAMES  # the tables' names, as `grpo-report --table` takes them
from grpo_exp.analysis import aggregates, compute_curve, continual, forgetting_fit, seed_summary
from grpo_exp.base.text import markdown_table


@dataclass
class Section:
    """One table with its heading and the lines that say what it measured (split, problems)."""
    name: str  # what `grpo-report --table` takes
    title: str
    intro: str
    table: pd.DataFrame
    notes: list[str] = field(default_factory=list)

    def markdown(self) -> list[str]:
        lines = [self.intro, ""] if self.intro else []
        lines += [to_markdown(self.table), ""]
        return lines + [note for n in self.notes for note in (n, "")]


def fmt(value) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return ""
    if isinstance(value, float):
        return f"{value:.4g}"
    return str(value).replace("|", "\\|").replace("\n", " ")


def to_markdown(df: pd.DataFrame) -> str:
    if df.empty:
        return "_(none)_"
    return markdown_table(list(df.columns), [[fmt(v) for v in row.tolist()] for _, row in df.iterrows()])


def _ci(value, interval, sign: str = "") -> str:
    """`value [low, high]` to three places; sign="+" writes a difference's signs."""
    if not isinstance(value, (int, float)):
        return ""
    if not interval or len(interval) != 2:
        return f"{value:{sign}.3f}"
    return f"{value:{sign}.3f} [{interval[0]:{sign}.3f}, {interval[1]:{sign}.3f}]"


def before_after_table(jobs: list[dict], labels: list[str]) -> pd.DataFrame:
    """One row per job and evaluated set of before_after.json: the starting model's and the trained
    model's greedy accuracy on the same held-out problems of the named split, the paired difference,
    McNemar's p and how long the run took."""
    rows = []
    for job, label in zip(jobs, labels):
        comparison = job["before_after"] or {}
        source = (comparison.get("before_source") or {}).get("from") or ""
        for name, v in (comparison.get("sets") or {}).items():
            rows.append({"job": job["row"]["job"], "variant": label, "seed": job["row"].get("seed"),
                         "split": comparison.get("split") or aggregates.UNRECORDED, "set": name, "n": v.get("n"),
                         "distinct": v.get("distinct"), "before model": comparison.get("before"),
                         "before [95% CI]": _ci(v.get("before"), v.get("before_ci95")),
                         "after [95% CI]": _ci(v.get("after"), v.get("after_ci95")),
                         "difference [paired 95% CI]": _ci(v.get("accuracy_diff"), v.get("accuracy_diff_ci95"), "+"),
                         "McNemar p": f"{v['mcnemar_p']:.2g}" if isinstance(v.get("mcnemar_p"), float) else "",
                         "before figures": source, "run minutes": _minutes(job["row"].get("wall_time_s"))})
    return pd.DataFrame(rows)


def _minutes(seconds) -> str:
    """metrics.json's wall_time_s (training, its evaluations and saves) in minutes."""
    return f"{seconds / 60:.1f}" if isinstance(seconds, (int, float)) else ""


def fifths_table(df: pd.DataFrame, labels: list[str]) -> pd.DataFrame:
    """One row per job that logged a reward: its steps, the mean reward in each fifth of them and overall."""
    columns = [f"reward_fifth_{k}" for k in range(1, aggregates.FIFTHS + 1)] + ["reward_mean_overall"]
    if not set(columns) <= set(df.columns):
        return pd.DataFrame()
    has = df[columns].notna().any(axis=1)
    out = pd.DataFrame({"job": df["job"], "variant": labels, "seed": df.get("seed"), "steps": df.get("steps")})
    out = pd.concat([out, df[columns]], axis=1)[has]
    return out.rename(columns={f"reward_fifth_{k}": f"fifth {k}" for k in range(1, aggregates.FIFTHS + 1)}
                      | {"reward_mean_overall": "overall"}).reset_index(drop=True)


def periodic_table(jobs: list[dict], labels: list[str]) -> pd.DataFrame:
    """One row per job and set of the periodic evaluations: the problems scored, the starting model's
    figure on the validation split where the job has one (before_after.json), and the accuracy at each
    evaluated step (columns `step <s>`, blank where a job did not evaluate at that step)."""
    rows, steps = [], set()
    for job, label in zip(jobs, labels):
        for name, points in (job.get("periodic") or {}).items():
            start = aggregates.validation_start(job, name)
            row = {"job": job["row"]["job"], "variant": label, "seed": job["row"].get("seed"), "set": name,
                   "n": next((n for _, _, n in points if n), None),
                   "base (n)": f"{start[1]:.3f} ({start[2]})" if start else ""}
            for step, accuracy, _ in points:
                row[f"step {step}"] = accuracy
                steps.add(step)
            rows.append(row)
    if not rows:
        return pd.DataFrame()
    front = ["job", "variant", "seed", "set", "n", "base (n)"]
    return pd.DataFrame(rows)[front + [f"step {s}" for s in sorted(steps)]]


def seed_table(df: pd.DataFrame, seed_labels: list[str]) -> pd.DataFrame | None:
    """seed_summary.per_variant of the report's frame (None when no variant has two seeds)."""
    return seed_summary.per_variant(df, seed_labels)


def sections(jobs: list[dict], df: pd.DataFrame, labels: list[str], seed_labels: list[str]) -> list[Section]:
    """The held-out and reward tables these runs can fill, in the order report.md and the pages give them."""
    out = []
    comparison = before_after_table(jobs, labels)
    if not comparison.empty:
        splits = sorted(set(comparison["split"]))
        named = f"{splits[0]} split" if len(splits) == 1 else f"splits: {', '.join(splits)}"
        out.append(Section("before_after", f"Accuracy before and after training ({named})",
                           "Greedy accuracy of the starting model (`before model`: the base model, or the earlier "
                           "stage's for `start`) and the trained one on the same held-out problems of the split "
                           "named in `split` (before_after.json); the difference is paired, with McNemar's exact p. "
                           "`run minutes`: the run's wall time (metrics.json), its evaluations included; a speed "
                           "figure only where the page's machine ran nothing else beside it.",
                           comparison))
    seeds = seed_table(df, seed_labels)
    if seeds is not None:
        # the one line on mixed splits stands at the top of the report or page (report.split_note)
        out.append(Section("seeds", "Each variant over seeds",
                           "Held-out accuracy (`eval_<set>_accuracy`, on the split in `split`) and its difference "
                           "from the base model on the same problems (`eval_<set>_diff`) over the variant's seeds "
                           "(`seeds`: n training runs, which score the same held-out problems where they share "
                           "`stage.split_seed`): mean, min..max and the 95% t interval of the mean over the n seeds "
                           "(n - 1 degrees of freedom); for the difference, the t test's p over seeds and the claim "
                           "it supports (under 5 seeds: not yet shown); and the 95% interval of all its seeds' "
                           "problems pooled, which holds the trained models fixed (Wilson; paired for the "
                           "difference). Ranked on the validation split only.", seed_summary.display(seeds)))
    out += continual_sections(jobs, seed_labels)
    fifths = fifths_table(df, labels)
    if not fifths.empty:
        out.append(Section("reward_fifths", "Training reward by fifths of the run",
                           "Mean of history.jsonl's `reward` (training prompts, sampled completions) over each fifth "
                           "of the run's steps (step s of N in fifth ceil(5 s / N)) and over the whole run.", fifths))
    periodic = periodic_table(jobs, labels)
    if not periodic.empty:
        out.append(Section("validation_accuracy", "Validation accuracy during training (validation split)",
                           "Greedy accuracy every `eval.every_steps` on the first `eval.every_limit` (`n`) problems of "
                           "the validation split (`eval/<set>/accuracy` in history.jsonl); `base (n)`: the starting "
                           "model's accuracy on n validation problems: the periodic evaluation's own "
                           "(before_after.json `validation_before`), else the n the job scored after training.",
                           periodic))
    for name in sorted({n for job in jobs for n in (job.get("periodic") or {})}):
        curves = compute_curve.curve_table(jobs, seed_labels, name)
        if not curves.empty:
            out.append(Section(f"compute_curve_{name}", f"Validation accuracy against training compute ({name})",
                               "Each job's periodic validation accuracy against its training compute (`cpu_s_total` "
                               "in history.jsonl: CPU seconds inside optimizer steps, all threads, / 60 = core-minutes), "
                               "fitted with R(C) = R0 + (A - R0) / (1 + (C_mid / C)^B) (ScaleRL; R0 the starting level, "
                               "measured): per variant the mean over its seeds and the 95% t interval of the asymptote "
                               "A, the efficiency B and the midpoint C_mid (core-minutes to half the gain), the fitted "
                               f"accuracy at {compute_curve.BUDGET_CORE_MIN:g} core-minutes (10 minutes of training on "
                               f"2 cores), the core-minutes the fit needs to reach {compute_curve.TARGET:.2f} (none "
                               "where its asymptote is not above it; past the compute a run trained, the curve's "
                               "extrapolation), and the last accuracy measured. Only jobs with "
                               "at least 4 evaluations after the start.",
                               curves))
    return out


def continual_sections(jobs: list[dict], seed_labels: list[str]) -> list[Section]:
    """The continual-learning tables of curriculum runs (analysis/continual.py), if any."""
    table = continual.continual_table(jobs, seed_labels)
    if table.empty:
        return []
    out = [Section("stage_gains", "Each stage's gain, job by job",
                   "Each curriculum job's stages: greedy accuracy on the stage's held-out problems before it "
                   "trained (the model that entered it: the start model for the first stage, the previous "
                   "stage's for the others; for an adaptive curriculum, which trains every stage in one run, the "
                   "start model) and after, paired over the same problems, with McNemar's exact p. "
                   "`job minutes`: the whole job's wall time (status.json), every evaluation included; a stage "
                   "a job took from another run (`curriculum.branch_from`) names that run instead, and the job's "
                   "minutes are those of the stages it trained.",
                   continual.gains_by_job(jobs, seed_labels)),
           Section("continual", "Continual learning: each method over seeds",
                   "From each curriculum run's curriculum.json (greedy accuracy on its held-out problems, "
                   "`curriculum.eval_limit` per stage, `eval.split`'s split). `<stage> final`: after the last stage, "
                   "the mean over seeds [its 95% t interval over seeds, each seed one training run]; `<stage> gain`: after "
                   "training the stage minus before it (the model that entered it), the mean of the per-seed gains "
                   "[95% t interval over seeds], the one-sample t test's p and its verdict; `<stage> gain, pooled`: "
                   "the same pooled over the seeds' problems with McNemar's exact p (given these trained models); "
                   "average accuracy, BWT and maximum forgetting as the curriculum's page defines them, "
                   "FWT (each later stage's accuracy before it trained minus the start model's), and the correct-set "
                   "turnover: of the earlier stages' held-out problems, the share the entering model solved and the "
                   "stage's model lost (`earlier solved, lost`) and the share it gained, summed over the stages; "
                   "each the mean over seeds [95% t interval over seeds] (continual_metrics.png draws every seed).",
                   table)]
    versus = continual.against_baseline(jobs, seed_labels)
    if not versus.empty:
        out.append(Section("continual_vs_baseline", "Continual learning: each method against the baseline",
                           "Each method minus the baseline (`against`: plain GRPO where it ran, else the first "
                           "method), paired by seed over the seeds both ran (a seed scores the same problems in every "
                           "method): each stage's final accuracy and each metric of the table above, as the mean of "
                           "the per-seed differences [95% t interval over seeds], the paired t test's p and its "
                           "verdict (beyond or within seed noise; not yet shown under 5 seeds); `final, pooled`: the "
                           "final accuracies' problems pooled over seeds with McNemar's exact p, which holds the "
                           "trained models fixed.", versus))
    fits = forgetting_fit.fit_table(forgetting_fit.points(jobs, seed_labels))
    if not fits.empty:
        out.append(Section("forgetting_kl", "Forgetting against KL",
                           "Each earlier stage's forgetting during a later stage (its held-out accuracy when the later "
                           "stage began minus when it ended) against the KL from the previous stage's model at the "
                           "later stage's end, on the later stage's own validation prompts (`drift/<stage>/kl`) and on "
                           "the earlier stage's (`forgetting/<stage>/kl`): a least-squares line per family and over all "
                           "points, its slope with the 95% t interval, R^2 and p. One point per job, later stage and "
                           "earlier stage; a job's points share its seed, so the interval is conditional on them.",
                           fits))
    return out
