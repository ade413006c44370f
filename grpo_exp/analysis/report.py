"""Sweep reports: one row per Hydra job, joining its overrides (`.hydra/overrides.yaml`) with what
it measured (metrics.json, eval.json, curriculum.json, history.jsonl).

`grpo-report <multirun dir or run dirs...> [--out DIR]` writes report.md, report.csv
and PNG plots (throughput and memory vs threads and batch size, reward curves, curriculum accuracy
heatmaps, fp32 vs int8) into the first given directory or --out, and prints the main table; a hyperparameter search
(hparams_search) also gets its study, best trial first (analysis/study.py, study.csv).
Jobs that failed (status.json says so, or no metrics were written) are rows with their error.
"""

from __future__ import annotations

import json
import math
import statistics
import sys
from pathlib import Path

import pandas as pd

from grpo_exp.base.run_files import (BEFORE_AFTER_FILE, CURRICULUM_FILE, ERROR_FILE, EVAL_FILE, HISTORY_FILE, METRICS_FILE,
                                     STATUS_FILE, VALIDATION_START_FILE, skipped_job, training_pid)
from grpo_exp.analysis import aggregates, compute_curve, ewc_summary, plots, seed_summary, study, tables
from grpo_exp.analysis.tables import to_markdown
from grpo_exp.base.io import eval_sets, read_jsonl

# metric -> True when higher is better
MAIN_METRICS = {
    "steps": None,
    "step_time_s_median": False,
    "completion_tokens_per_s": True,
    "peak_rss_mb": False,
    "reward_mean_first": None,
    "reward_mean_last": True,
    "wall_time_s": False,
}
CURRICULUM_METRICS = {"average_accuracy": True, "bwt": True, "forgetting_max": False}
STUDY_CSV = "study.csv"  # a hyperparameter search's trials, best first (analysis/study.py)
# Resolved settings read from .hydra/config.yaml: column -> dotted key
CONFIG_COLUMNS = {
    "model": "model.name",
    "stage": "stage.name",
    "threads": "cpu.threads",
    "batch_size": "train.per_device_train_batch_size",
    "num_generations": "train.num_generations",
    "quantization": "quantization.method",
    "ewc_lambda": "ewc.lambda",
    "seed": "train.seed",
}


# ---------------------------------------------------------------- loading

def _read_json(path: Path):
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def _read_yaml(path: Path):
    from omegaconf import OmegaConf

    try:
        return OmegaConf.to_container(OmegaConf.load(path), resolve=False)
    except Exception:
        return None


def _is_job(path: Path) -> bool:
    return (path / ".hydra").is_dir() or any((path / f).is_file() for f in (METRICS_FILE, STATUS_FILE,
                                                                             CURRICULUM_FILE, EVAL_FILE))


def _sort_key(path: Path):
    return (0, int(path.name), "") if path.name.isdigit() else (1, 0, path.name)


def find_jobs(path: str | Path) -> list[Path]:
    """The job directories under a multirun directory, or the directory itself when it is a run; a sweep job its
    study skipped (curriculum.method_seeds) is not a run."""
    path = Path(path)
    if not path.is_dir():
        raise FileNotFoundError(f"{path} is not a directory")
    if (path / ".hydra").is_dir() or not (path / "multirun.yaml").is_file() and _is_job(path):
        return [path]
    found = sorted({p.parent.parent for p in path.glob("*/.hydra/overrides.yaml")}, key=_sort_key)
    if not found:
        found = sorted((p for p in path.iterdir() if p.is_dir() and _is_job(p)), key=_sort_key)
    if not found:  # one level further down, e.g. a folder of sweeps
        found = sorted({p.parent.parent for p in path.glob("*/*/.hydra/overrides.yaml")})
    return [p for p in found if not skipped_job(p)]


def parse_overrides(items) -> dict[str, str]:
    out = {}
    for item in items or []:
        item = str(item)
        if "=" not in item:
            continue
        key, value = item.split("=", 1)
        out[key.lstrip("+~")] = value
    return out


def _select(data, dotted: str):
    for part in dotted.split("."):
        if not isinstance(data, dict) or part not in data:
            return None
        data = data[part]
    return data


def _stage_dirs(job: Path) -> list[Path]:
    """Curriculum stage directories (1_basic, 2_intermediate, ...) that hold their own metrics."""
    dirs = [p for p in job.iterdir() if p.is_dir() and (p / METRICS_FILE).is_file()]
    return sorted(dirs, key=lambda p: (int(p.name.split("_", 1)[0]) if p.name.split("_", 1)[0].isdigit() else 1e9,
                                       p.name))


def _combine_stage_metrics(stages: list[dict]) -> dict:
    """One job-level summary of a curriculum's per-stage metrics.json files."""
    def values(key):
        return [m[key] for m in stages if isinstance(m.get(key), (int, float))]

    out = {"steps": sum(values("steps")) if values("steps") else None}
    if values("step_time_s_median"):
        out["step_time_s_median"] = statistics.median(values("step_time_s_median"))
    if values("completion_tokens_per_s"):
        out["completion_tokens_per_s"] = statistics.mean(values("completion_tokens_per_s"))
    if values("peak_rss_mb"):
        out["peak_rss_mb"] = max(values("peak_rss_mb"))
    if values("wall_time_s"):
        out["wall_time_s"] = sum(values("wall_time_s"))
    out["reward_mean_first"] = stages[0].get("reward_mean_first") if stages else None
    out["reward_mean_last"] = stages[-1].get("reward_mean_last") if stages else None
    out["status"] = stages[-1].get("status") if stages else None
    return out


def load_job(job: Path, root: Path | None = None) -> dict:
    """Everything the report needs about one job: its table row and the data behind the plots."""
    overrides = parse_overrides(_read_yaml(job / ".hydra" / "overrides.yaml") or [])
    config = _read_yaml(job / ".hydra" / "config.yaml") or {}
    metrics = _read_json(job / METRICS_FILE)
    status_info = _read_json(job / STATUS_FILE) or {}
    curriculum = _read_json(job / CURRICULUM_FILE)
    eval_file = _read_json(job / EVAL_FILE)
    stage_dirs = _stage_dirs(job) if curriculum is not None else []

    try:
        label = str(job.relative_to(root)) if root is not None and job != root else job.name
    except ValueError:
        label = job.name
    row: dict = {"job": label}
    if metrics is None and stage_dirs:
        metrics = _combine_stage_metrics([_read_json(d / METRICS_FILE) or {} for d in stage_dirs])
    # an evaluation-only run (grpo_exp.evaluate) has eval.json and no metrics.json
    has_results = metrics is not None or bool((curriculum or {}).get("matrix")) or bool(eval_sets(eval_file))

    status = status_info.get("status") or (metrics or {}).get("status")
    if status is None:
        status = "completed" if has_results else "failed"
    running = status != "completed" and training_pid(job) is not None
    if running:  # training now (a first attempt, or one resumed after a failure or a stop): not a failure
        status = "running"
    row["status"] = status
    error = None if running else status_info.get("error")
    if status == "failed" and not error:
        error = _last_error_line(job / ERROR_FILE) or "no metrics.json (the job did not finish)"
    row["error"] = error

    for key, value in overrides.items():
        row[f"override:{key}"] = value
    for column, dotted in CONFIG_COLUMNS.items():
        value = _select(config, dotted)
        row[column] = value if not isinstance(value, (dict, list)) else str(value)
    metrics = metrics or {}
    if isinstance(metrics.get("cpu_threads"), int):
        row["threads"] = metrics["cpu_threads"]  # "auto" resolved to a number
    for key in MAIN_METRICS:
        row[key] = metrics.get(key)

    evaluation = dict(eval_sets(metrics.get("eval")))
    evaluation.update(eval_sets(eval_file))
    for name, values in evaluation.items():
        row[f"eval_{name}_accuracy"] = values.get("accuracy")
    before_after = _read_json(job / BEFORE_AFTER_FILE) or {}
    row["split"] = aggregates.job_split(before_after, eval_file)
    for name, values in (before_after.get("sets") or {}).items():
        row[f"eval_{name}_before"] = values.get("before")
        row[f"eval_{name}_diff"] = values.get("accuracy_diff")
        row[f"eval_{name}_mcnemar_p"] = values.get("mcnemar_p")
    row.update(aggregates.pooled_counts(eval_file, before_after))
    if curriculum:
        for key in CURRICULUM_METRICS:
            row[key] = curriculum.get(key)

    history = read_jsonl(job / HISTORY_FILE, tolerant=True)
    for stage_dir in stage_dirs:
        history += read_jsonl(stage_dir / HISTORY_FILE, tolerant=True)
    history.sort(key=lambda r: (r.get("global_step", r.get("step", 0))))
    for record in history:  # the last value wins: the KL at the end of the run
        for key, value in record.items():
            if key.startswith("forgetting/") and key.endswith("/kl"):
                row[f"forgetting_kl_{key.split('/')[1]}"] = value
    if any("reward" in r for r in history):
        row.update(aggregates.reward_fifths(history, metrics.get("steps")))
    periodic = aggregates.periodic_accuracy(history)
    row.update(aggregates.periodic_columns(periodic))
    row["dir"] = str(job)
    return {"row": row, "history": history, "curriculum": curriculum, "eval": evaluation, "before_after": before_after,
            "validation_start": _read_json(job / VALIDATION_START_FILE),
            "periodic": periodic, "quantization": (eval_file or {}).get("quantization") or row.get("quantization")}


def _last_error_line(path: Path) -> str | None:
    try:
        lines = [line.strip() for line in path.read_text().splitlines() if line.strip()]
    except OSError:
        return None
    return lines[-1] if lines else None


def load_jobs(paths) -> list[dict]:
    jobs = []
    for path in paths:
        path = Path(path)
        for job in find_jobs(path):
            jobs.append(load_job(job, root=path))
    return jobs


# ---------------------------------------------------------------- table

# overrides that say where a job's inputs came from, not what it trains: never part of a variant's label
NOT_A_VARIANT = ("override:curriculum.branch_from",)


def swept_keys(df: pd.DataFrame) -> list[str]:
    """Override columns whose value differs between jobs."""
    cols = [c for c in df.columns if c.startswith("override:") and c not in NOT_A_VARIANT]
    if len(df) < 2:
        return cols
    return [c for c in cols if df[c].astype(str).nunique(dropna=False) > 1]


def build_frame(jobs: list[dict]) -> pd.DataFrame:
    df = pd.DataFrame([j["row"] for j in jobs])
    if df.empty:
        return df
    overrides = [c for c in df.columns if c.startswith("override:")]
    front = ["job", "status"]
    metric_cols = [c for c in [*MAIN_METRICS, *CURRICULUM_METRICS] if c in df.columns]
    eval_cols = sorted(c for c in df.columns if c.startswith("eval_"))
    config_cols = [c for c in CONFIG_COLUMNS if c in df.columns]
    fifths = [c for c in df.columns if c.startswith(("reward_fifth_", "reward_mean_overall"))]
    periodic = sorted((c for c in df.columns if c.startswith(f"{aggregates.PERIODIC_SPLIT}_") and "_step_" in c),
                      key=_periodic_order)
    order = front + overrides + config_cols + metric_cols + fifths + ["split"] + eval_cols + periodic
    order += ["error", "dir"]
    order += [c for c in df.columns if c not in order]
    df = df[[c for c in order if c in df.columns]]
    # Drop metric columns that no job has (e.g. curriculum figures in a plain sweep).
    empty = [c for c in metric_cols + eval_cols if df[c].isna().all() and c not in MAIN_METRICS]
    return df.drop(columns=empty)


def _periodic_order(column: str):
    head, step = column.rsplit("_step_", 1)
    return head, int(step) if step.isdigit() else 0


def variant_labels(df: pd.DataFrame, keys: list[str] | None = None, unset: str | None = None) -> list[str]:
    """Each job's "key=value, ..." of the given override columns (default: the swept ones). A job that sets
    none of them is labelled `unset`, or by its job name when `unset` is None."""
    keys = swept_keys(df) if keys is None else keys
    labels = []
    for _, row in df.iterrows():
        parts = [f"{k.split(':', 1)[1]}={row[k]}" for k in keys if isinstance(row[k], str)]
        labels.append(", ".join(parts) or (str(row["job"]) if unset is None else unset))
    return labels


def main_table(df: pd.DataFrame) -> pd.DataFrame:
    keys = swept_keys(df)
    metric_cols = [c for c in [*MAIN_METRICS, *CURRICULUM_METRICS] if c in df.columns]
    eval_cols = [c for c in df.columns if c.startswith(("eval_", "forgetting_kl_"))]
    # the split the eval_* figures were measured on, beside them
    split = ["split"] if "split" in df.columns and df["split"].notna().any() else []
    cols = ["job", "status", *keys, *metric_cols, *split, *eval_cols]
    table = df[cols].rename(columns={k: k.split(":", 1)[1] for k in keys})
    if "error" in df.columns and df["error"].notna().any():
        table = table.assign(error=df["error"].fillna(""))
    return table


def best_variants(df: pd.DataFrame) -> list[dict]:
    """The best completed job for each metric with a direction (higher or lower is better). Held-out
    accuracy and gain are compared within one split: when the jobs mix splits, on validation only."""
    done = df[df["status"] == "completed"]
    labels = dict(zip(df.index, variant_labels(df)))
    scored = {c: True for c in df.columns if c.startswith("eval_") and c.endswith(("_accuracy", "_diff"))}
    known = set(done["split"].dropna()) if "split" in done.columns else set()
    within = next(iter(known)) if len(known) == 1 else (aggregates.VALIDATION if known else None)
    out = []
    for metric, higher in {**MAIN_METRICS, **CURRICULUM_METRICS, **scored}.items():
        if higher is None or metric not in done.columns:
            continue
        values = pd.to_numeric(done[metric], errors="coerce").dropna()
        split = within if metric in scored else None
        if split:
            values = values[done.loc[values.index, "split"] == split]
        if values.empty:
            continue
        idx = values.idxmax() if higher else values.idxmin()
        out.append({"metric": metric, "best": "highest" if higher else "lowest", "value": values[idx],
                    **({"split": split} if split else {}), "job": df.loc[idx, "job"], "variant": labels[idx]})
    return out


def _short(text: str, width: int = 70) -> str:
    return text if len(text) <= width else text[: width - 1] + "…"


# ---------------------------------------------------------------- report

def seed_labels(df: pd.DataFrame) -> list[str]:
    """Each job's variant over seeds: its swept overrides other than the seed. Jobs that override none of
    them (the default recipe beside its levers) are one variant, not one per job: they differ only in seed."""
    keys = [k for k in swept_keys(df) if k != seed_summary.SEED_KEY]
    return variant_labels(df, keys, unset=seed_summary.DEFAULTS) if keys else [seed_summary.ONE_VARIANT] * len(df)


def load_report(paths) -> dict:
    """The jobs under `paths` with the report's frame and labels: {"jobs", "df", "labels", "sections"}."""
    paths = [Path(p) for p in paths]
    jobs = load_jobs(paths)
    df = build_frame(jobs)
    if df.empty:
        raise SystemExit(f"no runs found under {', '.join(map(str, paths))}")
    labels = variant_labels(df)
    return {"paths": paths, "jobs": jobs, "df": df, "labels": labels,
            "sections": tables.sections(jobs, df, labels, seed_labels(df))}


def split_note(df: pd.DataFrame) -> str | None:
    """The one line saying the completed jobs' held-out figures are not all on the validation split."""
    if "split" not in df.columns:
        return None
    return seed_summary.split_note(df.loc[df["status"] == "completed", "split"].dropna())


def write_report(paths, out: str | Path | None = None) -> tuple[pd.DataFrame, Path]:
    """Build the table and plots for the given multirun/run directories; returns (DataFrame, out dir)."""
    loaded = load_report(paths)
    paths, jobs, df, labels = loaded["paths"], loaded["jobs"], loaded["df"], loaded["labels"]
    out = Path(out) if out else paths[0]
    out.mkdir(parents=True, exist_ok=True)
    df.to_csv(out / "report.csv", index=False)
    made = [plots.plot_throughput_memory(df, out), plots.plot_reward_curves(jobs, labels, out),
            plots.plot_learning_curve(jobs, labels, out / "learning_curve.png"),
            plots.plot_forgetting_kl(jobs, labels, out), plots.plot_quantization(jobs, out),
            compute_curve.plot(jobs, seed_labels(df), out / "compute_curve.png")]
    curriculum_plots = []
    for job, label in zip(jobs, labels):
        if job["curriculum"]:
            name = "curriculum_" + "".join(c if c.isalnum() else "_" for c in str(job["row"]["job"])) + ".png"
            plot = plots.plot_curriculum(job["curriculum"], _short(f"Accuracy matrix: {label}"), out / name)
            curriculum_plots.append((job, plot))

    table = main_table(df)
    keys = swept_keys(df)
    common = {c.split(":", 1)[1]: df[c].iloc[0] for c in df.columns
              if c.startswith("override:") and c not in keys and df[c].notna().all()}
    failed = df[df["status"] != "completed"]
    lines = [
        "# Sweep report", "",
        f"Source: {', '.join(f'`{p}`' for p in paths)}  ",
        f"Jobs: {len(df)} ({(df['status'] == 'completed').sum()} completed, {len(failed)} not completed)",
    ]
    if common:
        lines.append("Common overrides: " + ", ".join(f"`{k}={v}`" for k, v in common.items()))
    if split_note(df):
        lines += ["", split_note(df)]
    lines += ["", *study_lines(jobs, df, out)]
    lines += ["## Results", "", to_markdown(table), ""]
    best = best_variants(df)
    if best:
        lines += ["## Best variant per metric", "", to_markdown(pd.DataFrame(best)), ""]
    if not failed.empty:
        lines += ["## Failed or unfinished jobs", "",
                  to_markdown(pd.DataFrame({"job": failed["job"], "status": failed["status"],
                                            "variant": [labels[i] for i in failed.index],
                                            "error": failed["error"].fillna(""), "dir": failed["dir"]})), ""]
    for job, plot in curriculum_plots:
        cur = job["curriculum"]
        lines += [f"## Curriculum: {job['row']['job']}", ""]
        if cur.get("table"):
            lines += [cur["table"], ""]
        if plot:
            lines += [f"![curriculum]({plot.name})", ""]
    for section in loaded["sections"]:
        lines += [f"## {section.title}", "", *section.markdown()]
    seeds = tables.seed_table(df, seed_labels(df))
    if seeds is not None:
        seeds.to_csv(out / "seed_summary.csv", index=False)
    lines += ewc_section(jobs, out)
    made = [p for p in made if p]
    if made:
        lines += ["## Plots", ""] + [f"![{p.stem}]({p.name})" for p in made] + [""]
    (out / "report.md").write_text("\n".join(lines))
    return df, out


def study_lines(jobs: list[dict], df: pd.DataFrame, out: Path) -> list[str]:
    """report.md's study of a hyperparameter search (hparams_search), best trial first, and study.csv; no lines
    (and no study.csv) where no job ran under a search."""
    section = study.study_section(jobs, df)
    path = out / STUDY_CSV
    if section is None:
        path.unlink(missing_ok=True)  # a study.csv left from an earlier report of other runs
        return []
    section.table.to_csv(path, index=False)
    return [f"## {section.title}", "", *section.markdown()]


def ewc_section(jobs: list[dict], out: Path) -> list[str]:
    """report.md's per-lambda forgetting tables and plot (and ewc_summary.csv), for sweeps over ewc.lambda
    whose jobs measured accuracy on earlier stages (ewc_summary.csv per job, ewc_lambda_summary.csv per lambda);
    no lines otherwise."""
    rows, measured = [], []
    for job in jobs:
        sets = ewc_summary.job_sets(job, job["before_after"]) if job["row"]["status"] == "completed" else None
        if sets is None or job["row"].get("ewc_lambda") is None:
            continue
        kl = {k: v for k, v in job["row"].items() if k.startswith("forgetting_kl_")}
        rows.append({"job": job["row"]["job"], "ewc_lambda": job["row"]["ewc_lambda"], "seed": job["row"].get("seed"),
                     **ewc_summary.job_row(sets), **kl})
        measured.append((job["row"]["ewc_lambda"], sets))
    if len({r["ewc_lambda"] for r in rows}) < 2:
        return []
    per_job = pd.DataFrame(rows).sort_values(["ewc_lambda", "seed"])
    per_job.to_csv(out / "ewc_summary.csv", index=False)
    means = pd.DataFrame(ewc_summary.per_lambda(rows))
    means.to_csv(out / "ewc_lambda_summary.csv", index=False)
    plot = ewc_summary.plot_accuracy_by_lambda(measured, out / "ewc_lambda.png")
    lines = ["## EWC: final accuracy, forgetting and KL per lambda", "",
             "Per job (forgetting = accuracy when the earlier stage finished - final accuracy; gain = the new "
             "stage's final - start accuracy; forgetting_kl_*: KL from the earlier stage's policy at the last "
             "evaluation):", "", to_markdown(per_job), "",
             "Mean over seeds (range in the `_range` columns):", "",
             to_markdown(means), ""]
    if plot:
        lines += [f"![ewc_lambda]({plot.name})", ""]
    return lines


def run(dirs: list[str], out: str | None = None) -> int:
    """Write the report of `dirs` and print its main table; returns the exit code."""
    try:
        df, out_dir = write_report(dirs, out)
    except (FileNotFoundError, KeyError) as err:
        print(f"error: {err.args[0] if err.args else err}", file=sys.stderr)
        return 2
    with pd.option_context("display.max_columns", None, "display.width", 200, "display.max_colwidth", 60):
        print(main_table(df).to_string(index=False))
        if (out_dir / STUDY_CSV).is_file():  # a search: its trials, best first
            print("\nHyperparameter search, best trial first:")
            print(to_markdown(pd.read_csv(out_dir / STUDY_CSV)))
    print(f"\nreport: {out_dir / 'report.md'}  table: {out_dir / 'report.csv'}")
    failed = int((df["status"] != "completed").sum())
    if failed:
        print(f"{failed} job(s) did not complete; see the 'Failed or unfinished jobs' section", file=sys.stderr)
    return 0
