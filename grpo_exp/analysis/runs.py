"""The runs and sweeps under an outputs folder, as the web app browses them: where they are, their
metrics table (through analysis.report, so the figures are the report's), their curves from
history.jsonl, the curriculum matrix, and completions.jsonl filtered by step and reward.

Everything here reads files only; a half-written or unreadable file is skipped, never an error, because
the app reads runs while they train."""

from __future__ import annotations

import os
from pathlib import Path

import pandas as pd

from grpo_exp.base.run_files import (COMPLETIONS_FILE, CURRICULUM_FILE, EVAL_FILE, METRICS_FILE, STATUS_FILE,
                                     skipped_job)
from grpo_exp.analysis import report
from grpo_exp.base.io import read_jsonl

# Folders inside a run that hold no runs of their own; walking them costs time on a big outputs tree.
SKIP_DIRS = {"model", "adapter", "checkpoints", "wandb", "trackio", ".hydra", "__pycache__", "base_eval"}
MAX_DEPTH = 6  # outputs/train/multiruns/<sweep>/<job>/<stage>: deeper than any layout the project writes
JOB_FILES = (METRICS_FILE, STATUS_FILE, CURRICULUM_FILE, EVAL_FILE)
OVERVIEW_COLUMNS = ["job", "status", "model", "stage", "steps", "reward_mean_first", "reward_mean_last",
                    "step_time_s_median", "peak_rss_mb", "wall_time_s", "average_accuracy", "bwt"]


def is_job(path: Path) -> bool:
    """A run directory: Hydra's .hydra/ or one of the files a run writes."""
    return (path / ".hydra").is_dir() or any((path / f).is_file() for f in JOB_FILES)


def is_sweep(path: Path) -> bool:
    return (path / "multirun.yaml").is_file()


def _walk(root: Path):
    """(directory, is a sweep, is a job) below root, not descending into a job (its curriculum stages are
    part of it) nor into hidden or model/checkpoint folders."""
    root = Path(root)
    for dirpath, dirnames, _ in os.walk(root):
        path = Path(dirpath)
        depth = len(path.relative_to(root).parts)
        job = path != root and is_job(path) or path == root and (root / ".hydra").is_dir()
        sweep = is_sweep(path)
        yield path, sweep, job
        if job or depth >= MAX_DEPTH:
            dirnames[:] = []
        else:
            dirnames[:] = sorted(d for d in dirnames if d not in SKIP_DIRS and not d.startswith("."))


def find_runs(root: str | Path) -> list[Path]:
    """Every run (job) directory under root, the sweeps' jobs included (not one its study skipped), oldest path
    first."""
    root = Path(root)
    if not root.is_dir():
        return []
    return [path for path, _, job in _walk(root) if job and not skipped_job(path)]


def find_sweeps(root: str | Path) -> list[Path]:
    root = Path(root)
    if not root.is_dir():
        return []
    return [path for path, sweep, _ in _walk(root) if sweep]


def label(path: Path, root: str | Path) -> str:
    """A run's name in the app: its path relative to the outputs folder."""
    try:
        return str(Path(path).relative_to(root)) or "."
    except ValueError:
        return str(path)


def empty_message(root: str | Path) -> str:
    root = Path(root)
    if not root.exists():
        return f"No runs: {root} does not exist yet. Start one in the Launch tab, or run `python -m grpo_exp.train`."
    return (f"No runs under {root} yet (no directory with .hydra/, metrics.json or status.json). "
            f"Start one in the Launch tab, or point the app at another folder with --outputs.")


def load(paths: list[Path], root: str | Path) -> list[dict]:
    """report.load_job for each run directory, labelled relative to root (a run still training is "running")."""
    return [report.load_job(Path(path), root=Path(root)) for path in paths]


def overview(root: str | Path) -> pd.DataFrame:
    """One row per run under root: status, model, stage and the report's main metrics (empty when none)."""
    jobs = load(find_runs(root), root)
    if not jobs:
        return pd.DataFrame(columns=OVERVIEW_COLUMNS)
    df = report.build_frame(jobs)
    evals = [c for c in df.columns if c.startswith("eval_") and c.endswith("_accuracy")]
    cols = [c for c in OVERVIEW_COLUMNS if c in df.columns] + evals
    if "error" in df.columns and df["error"].notna().any():
        cols.append("error")
    return df[cols]


def metrics_table(jobs: list[dict]) -> pd.DataFrame:
    """The report's main table for these runs (one row each; a sweep's swept overrides as columns)."""
    df = report.build_frame(jobs)
    return report.main_table(df) if not df.empty else df


def curves(jobs: list[dict], keys: list[str] | str) -> pd.DataFrame:
    """Long-format (step, value, series) points of history.jsonl keys for plotting: `keys` is a key
    ("reward") or a pattern with one `*` ("eval/*/accuracy"); series names the run and, for a
    pattern, the set."""
    rows = []
    single = len(jobs) == 1
    for job in jobs:
        name = str(job["row"]["job"])
        for record in job["history"]:
            step = record.get("global_step", record.get("step"))
            for key, value in record.items():
                match = _match(key, keys)
                if match is None or not isinstance(value, (int, float)) or step is None:
                    continue
                series = match if single and match else f"{name} {match}".strip()
                rows.append({"step": int(step), "value": float(value), "series": series or name})
    return pd.DataFrame(rows, columns=["step", "value", "series"])


def _match(key: str, pattern: list[str] | str) -> str | None:
    """'' when key is the pattern, the `*` part when it matches a one-star pattern, else None."""
    if "*" not in pattern:
        return "" if key == pattern else None
    head, tail = pattern.split("*", 1)
    if key.startswith(head) and key.endswith(tail) and len(key) > len(head) + len(tail):
        middle = key[len(head):len(key) - len(tail)]
        return middle if "/" not in middle else None
    return None


def curriculum_table(job: dict) -> pd.DataFrame | None:
    """R[after stage][evaluated on] of a curriculum run (with the base model's row), None for a plain run."""
    cur = job.get("curriculum") or {}
    stages, matrix = cur.get("stages") or [], cur.get("matrix") or []
    if not stages or not matrix:
        return None
    rows = ([["base", *cur["base"]]] if cur.get("base") else [])
    rows += [[f"after {name}", *row] for name, row in zip(cur.get("row_labels") or stages, matrix)]
    width = len(stages) + 1
    rows = [r + [None] * (width - len(r)) for r in rows]
    return pd.DataFrame(rows, columns=["after \\ evaluated", *stages])


# ---------------------------------------------------------------- completions

def completion_dirs(root: str | Path) -> list[Path]:
    """Directories with a completions.jsonl: runs, and each stage of a curriculum run."""
    found = []
    for job in find_runs(root):
        if (job / COMPLETIONS_FILE).is_file():
            found.append(job)
        found += sorted(p.parent for p in job.glob("*/completions.jsonl"))
    return found


def _reward_weights(run_dir: Path) -> dict[str, float]:
    """reward.funcs -> reward.weights of the run (a curriculum stage reads its run's config)."""
    from omegaconf import OmegaConf

    for saved in (run_dir / ".hydra" / "config.yaml", run_dir.parent / ".hydra" / "config.yaml"):
        if saved.is_file():
            try:
                cfg = OmegaConf.load(saved)
                funcs = list(OmegaConf.select(cfg, "reward.funcs") or [])
                weights = OmegaConf.select(cfg, "reward.weights")
                weights = list(weights) if weights is not None else [1.0] * len(funcs)
                return {str(f): float(w) for f, w in zip(funcs, weights)}
            except Exception:
                return {}
    return {}


def read_completions(run_dir: str | Path) -> pd.DataFrame:
    """completions.jsonl as a table: step, prompt, completion, reward (the weighted sum the trainer
    optimised, from the run's reward.weights), one column per reward function, advantage."""
    run_dir = Path(run_dir)
    records = read_jsonl(run_dir / COMPLETIONS_FILE, tolerant=True)
    weights = _reward_weights(run_dir)
    rows = []
    for rec in records:
        per_function = rec.get("rewards") or {}
        total = sum(weights.get(name, 1.0) * float(v) for name, v in per_function.items()
                    if isinstance(v, (int, float)))
        rows.append({"step": rec.get("step"), "prompt": rec.get("prompt", ""), "completion": rec.get("completion", ""),
                     "reward": total, **{f"reward:{k}": v for k, v in per_function.items()},
                     "advantage": rec.get("advantage")})
    base = ["step", "prompt", "completion", "reward"]
    df = pd.DataFrame(rows)
    if df.empty:
        return pd.DataFrame(columns=[*base, "advantage"])
    functions = sorted(c for c in df.columns if c.startswith("reward:"))
    return df[[*base, *functions, "advantage"]]


def filter_completions(df: pd.DataFrame, step: int | None = None, min_reward: float | None = None,
                       max_reward: float | None = None) -> pd.DataFrame:
    """Rows of one step (None: every step) with min_reward <= reward <= max_reward (None: no bound)."""
    keep = pd.Series(True, index=df.index)
    if step is not None:
        keep &= df["step"] == step
    if min_reward is not None:
        keep &= df["reward"] >= min_reward
    if max_reward is not None:
        keep &= df["reward"] <= max_reward
    return df[keep]
