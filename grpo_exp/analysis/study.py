"""The study of a hyperparameter search (`hparams_search=<option>`, Hydra's Optuna sweeper) in a report: one row per
trial, best first, with the values it tried and the objective its job returned (status.json's `objective`: the
validation accuracy after training). The rows come from the trials' directories; the Optuna study the sweeper keeps
(its sqlite storage, study.db in the sweep directory) adds each trial's number and what the study holds beyond them
(trials of directories since removed), where optuna is installed."""

from __future__ import annotations

import math
from pathlib import Path

import pandas as pd

from grpo_exp.analysis.tables import Section
from grpo_exp.base import log
from grpo_exp.config.search_check import SQLITE
from grpo_exp.config.sweep_check import BASIC_SWEEPER

logger = log.get_logger(__name__)
NAME = "study"  # the section's name


def search_of(job_dir: Path) -> dict | None:
    """The search a job ran under: its sweeper's node of .hydra/hydra.yaml, or None for a single run or a grid."""
    from omegaconf import OmegaConf

    try:
        sweeper = OmegaConf.to_container(OmegaConf.load(Path(job_dir) / ".hydra" / "hydra.yaml").hydra.sweeper,
                                         resolve=False)
    except Exception:
        return None
    if not isinstance(sweeper, dict) or sweeper.get("_target_", BASIC_SWEEPER) == BASIC_SWEEPER:
        return None
    return sweeper


def study_section(jobs: list[dict], df: pd.DataFrame) -> Section | None:
    """The study table of the jobs that ran under a search (None where none did); the first search's study where
    the report was given several."""
    searched = [(i, search) for i, job in enumerate(jobs) if (search := search_of(Path(job["row"]["dir"])))]
    if not searched:
        return None
    search = searched[0][1]
    maximize = str(search.get("direction", "minimize")).lower() != "minimize"
    rows = df.iloc[[i for i, _ in searched]]
    keys = list(search.get("params") or {})
    swept = [c.split(":", 1)[1] for c in rows.columns if c.startswith("override:")
             and rows[c].astype(str).nunique(dropna=False) > 1]
    keys += [k for k in swept if k not in keys]
    trials = study_trials(search, Path(jobs[searched[0][0]]["row"]["dir"]).parent)
    table = pd.DataFrame({"job": rows["job"].values, "status": rows["status"].values,
                          **{k: [_number(v) for v in rows.get(f"override:{k}", pd.Series([None] * len(rows)))]
                             for k in keys},
                          "objective": [_objective(Path(d)) for d in rows["dir"]]})
    if trials is not None:
        table.insert(1, "trial", match_trials(trials["params"], rows))
    scored = pd.to_numeric(table["objective"], errors="coerce")
    order = scored.sort_values(ascending=not maximize, na_position="last", kind="stable").index
    table = table.loc[order].reset_index(drop=True)
    ranked = scored.loc[order].notna().to_numpy()
    table.insert(0, "rank", [str(n + 1) if ok else "" for n, ok in enumerate(ranked)])
    name = search.get("study_name") or "(unnamed)"
    sampler = str((search.get("sampler") or {}).get("_target_", "")).rsplit(".", 1)[-1]
    intro = (f"Study `{name}` ({str(search.get('_target_')).rsplit('.', 1)[-1]}, {sampler or 'its default sampler'}, "
             f"{'maximize' if maximize else 'minimize'}): {len(table)} trial(s) here, {int(ranked.sum())} with an "
             f"objective (each job's status.json: its validation accuracy after training), best first; a trial "
             f"without one failed (its error under Failed or unfinished jobs).")
    notes = []
    if trials is not None:
        notes.append(f"The study in `{trials['path']}` holds {trials['summary']}.")
    return Section(NAME, "Hyperparameter search", intro, table, notes)


def _objective(job_dir: Path):
    import json

    try:
        value = json.loads((job_dir / "status.json").read_text()).get("objective")
    except (OSError, ValueError, AttributeError):
        return None
    return value if isinstance(value, (int, float)) and math.isfinite(value) else None


def _number(value):
    """An override's value as a number where it is one (so the table writes 1.412e-05, not 17 digits)."""
    try:
        number = float(value)
    except (TypeError, ValueError):
        return value
    return int(number) if number.is_integer() and "." not in str(value) and "e" not in str(value) else number


def match_trials(trials: list[tuple[int, dict]], rows: pd.DataFrame) -> list:
    """Each job's trial number in the study: the first trial not yet matched whose values are the job's overrides."""
    numbers, taken = [], set()
    for _, row in rows.iterrows():
        found = next((number for number, params in trials if number not in taken and params and all(
            _same(row.get(f"override:{k}"), v) for k, v in params.items())), None)
        taken.add(found)
        numbers.append(found)
    return numbers


def _same(given, value) -> bool:
    """An override as the job's command line wrote it against the value Optuna recorded."""
    if given is None:
        return False
    try:
        return math.isclose(float(given), float(value), rel_tol=1e-12)
    except (TypeError, ValueError):
        return str(given) == str(value)


def study_trials(search: dict, sweep_dir: Path) -> dict | None:
    """The Optuna study in the sweep directory's sqlite file: each trial's number and the values it tried, and a
    count of its trials by state; None where optuna is not installed or the study is not there."""
    storage = str(search.get("storage") or "")
    if not storage.startswith(SQLITE):
        return None
    # the storage names the sweep directory as it was given then (relative to where the command ran); the
    # file is looked for beside the trials, wherever the directory is now
    path = sweep_dir / Path(storage[len(SQLITE):]).name
    if not path.is_file():
        return None
    try:
        import optuna
    except ImportError:
        return None
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    try:
        study = optuna.load_study(study_name=search.get("study_name"), storage=f"{SQLITE}{path.resolve()}")
    except Exception as err:  # another study name, a file of another optuna version
        logger.warning("could not read the study in %s: %s", path, err)
        return None
    states: dict[str, int] = {}
    for trial in study.trials:
        states[trial.state.name.lower()] = states.get(trial.state.name.lower(), 0) + 1
    summary = f"{len(study.trials)} trial(s): " + ", ".join(f"{n} {state}" for state, n in sorted(states.items()))
    return {"params": [(trial.number, trial.params) for trial in study.trials], "summary": summary, "path": path}
