"""Figures the report computes from a run's own files, so that no summary of a run is made by hand:
the mean training reward by fifths of the run's steps, held-out accuracy at each periodic evaluation,
and the held-out split each accuracy was measured on.

Reward by fifths: steps 1..N (N the run's steps, metrics.json's "steps", else the last step logged)
are cut into five runs of consecutive steps, step s in fifth ceil(5 s / N); each fifth's figure is the
mean of history.jsonl's "reward" over the rows of its steps (a step that logged no reward, e.g. the
second step of a generation when train.steps_per_generation=2, adds nothing). The overall figure is the
mean over every such row, not the mean of the five.
"""

from __future__ import annotations

import math

FIFTHS = 5
VALIDATION = "validation"  # the split settings are chosen on; the test split is reported once
# eval.every_steps scores the first eval.every_limit problems of the validation split (periodic_eval.py)
PERIODIC_SPLIT = VALIDATION
UNRECORDED = "unrecorded"  # runs made before eval.split existed record no split


def step_of(record: dict):
    return record.get("global_step", record.get("step"))


def run_steps(history: list[dict], steps=None) -> int | None:
    """The run's step count: `steps` (metrics.json) when it is a positive whole number, else the last
    step in its history (a run stopped early), else None."""
    if isinstance(steps, int) and steps > 0:
        return steps
    logged = [s for s in map(step_of, history) if isinstance(s, (int, float))]
    return int(max(logged)) if logged else None


def fifth_of(step: int, steps: int) -> int:
    """1..5: the fifth of steps 1..`steps` that `step` falls in (ceil(5 step / steps), kept in range)."""
    return min(FIFTHS, max(1, math.ceil(FIFTHS * step / steps)))


def reward_fifths(history: list[dict], steps=None) -> dict[str, float | None]:
    """{"reward_fifth_1".."reward_fifth_5", "reward_mean_overall"}: mean reward per fifth of the run's
    steps and over all of them; None where no row logged a reward."""
    total = run_steps(history, steps)
    by_fifth: dict[int, list[float]] = {k: [] for k in range(1, FIFTHS + 1)}
    every = []
    for record in history:
        value, step = record.get("reward"), step_of(record)
        if not isinstance(value, (int, float)) or math.isnan(value) or not isinstance(step, (int, float)):
            continue
        by_fifth[fifth_of(step, total)].append(float(value))
        every.append(float(value))
    out = {f"reward_fifth_{k}": (sum(v) / len(v) if v else None) for k, v in by_fifth.items()}
    out["reward_mean_overall"] = sum(every) / len(every) if every else None
    return out


def periodic_accuracy(history: list[dict]) -> dict[str, list[tuple[int, float, int | None]]]:
    """{set: [(step, accuracy, problems scored), ...]} of the periodic (and forgetting) evaluations in
    history.jsonl, `eval/<set>/accuracy`, in step order."""
    out: dict[str, list] = {}
    for record in history:
        step = step_of(record)
        for key, value in record.items():
            parts = key.split("/")
            if len(parts) != 3 or parts[0] != "eval" or parts[2] != "accuracy" or step is None:
                continue
            if isinstance(value, (int, float)):
                n = record.get(f"eval/{parts[1]}/n")
                out.setdefault(parts[1], []).append((int(step), float(value), n if isinstance(n, int) else None))
    return {name: sorted(points) for name, points in sorted(out.items())}


def periodic_columns(periodic: dict[str, list]) -> dict[str, float]:
    """report.csv's columns of the periodic evaluations, named with their split and step:
    validation_<set>_accuracy_step_<step>."""
    return {f"{PERIODIC_SPLIT}_{name}_accuracy_step_{step}": accuracy
            for name, points in periodic.items() for step, accuracy, _ in points}


def job_split(before_after: dict | None, eval_file: dict | None) -> str | None:
    """The held-out split of a job's eval_* figures: before_after.json's "split", else eval.json's
    config.split; "unrecorded" when the job scored sets but names no split, None when it scored none."""
    split = (before_after or {}).get("split") or ((eval_file or {}).get("config") or {}).get("split")
    if split:
        return str(split)
    return UNRECORDED if (before_after or {}).get("sets") or (eval_file or {}).get("sets") else None


def pooled_counts(eval_file: dict | None, before_after: dict | None) -> dict[str, int]:
    """Per-problem counts behind a job's accuracy, for intervals pooled over seeds: problems scored and
    answered right (eval.json), and the pairs only the starting model or only the trained one got right
    (before_after.json). Columns count:<set>_{n,correct,only_before,only_after}."""
    out = {}
    for name, values in ((eval_file or {}).get("sets") or {}).items():
        n, accuracy = values.get("n"), values.get("accuracy")
        if isinstance(n, int) and isinstance(accuracy, (int, float)):
            out[f"count:{name}_n"] = n
            out[f"count:{name}_correct"] = round(accuracy * n)
    for name, values in ((before_after or {}).get("sets") or {}).items():
        if isinstance(values.get("only_first_correct"), int) and isinstance(values.get("only_second_correct"), int):
            out[f"count:{name}_pairs"] = values.get("n")
            out[f"count:{name}_only_before"] = values["only_first_correct"]
            out[f"count:{name}_only_after"] = values["only_second_correct"]
    return out


def validation_start(job: dict, name: str) -> tuple[str, float, int | None] | None:
    """(who, accuracy, n) of the model a job started from on set `name`'s validation problems: the level its
    learning curve starts from. before_after.json's `validation_before` (the very problems the periodic
    evaluation scores), else validation_start.json's (the same, for a run with eval.after_train=false), else its
    before/after figures where it scored the validation split, else the
    periodic evaluation at step 0; None without any of them."""
    comparison = job.get("before_after") or {}
    who = "starting model" if comparison.get("before") == "start" else "base model"
    start = comparison.get("validation_before") or {}
    if start.get("set") == name and isinstance(start.get("accuracy"), (int, float)):
        return who, start["accuracy"], start.get("n")
    alone = job.get("validation_start") or {}  # validation_start.json: a run with no before/after evaluation
    if alone.get("set") == name and isinstance(alone.get("accuracy"), (int, float)):
        return ("starting model" if alone.get("model") == "start" else "base model"), alone["accuracy"], alone.get("n")
    figures = (comparison.get("sets") or {}).get(name) or {}
    if comparison.get("split") == VALIDATION and isinstance(figures.get("before"), (int, float)):
        return who, figures["before"], figures.get("n")
    first = [(accuracy, n) for step, accuracy, n in (job.get("periodic") or {}).get(name, []) if step == 0]
    return ("step 0", first[0][0], first[0][1]) if first else None
