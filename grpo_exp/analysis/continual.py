"""The continual-learning table: curriculum runs (curriculum.json) grouped by method, over seeds.

A method is named by what its curriculum.json says it ran (plain GRPO, EWC and its lambda, replay and its share),
then the job's other swept settings but the seed. Per method: each stage's final accuracy, average accuracy,
backward transfer (BWT), maximum forgetting and each stage's gain against the model that entered it. Gains are
seed-level (evaluation/seed_stats.py): the mean of the per-seed gains with a t interval and p over seeds, claimed
only with at least five seeds; the McNemar test over every seed's problems pooled is shown beside it, labelled as
conditional on these trained models. An adaptive curriculum
(curriculum.mode=adaptive) trains every stage in one run: its one row is its final model, and each stage's gain is
against the start model (it has no order, so no BWT or forgetting). Then each method against plain GRPO (or,
without it, the first method) on the final model's accuracy per stage, paired problem by problem over the seeds
both ran, at the seed level: the test of whether a method's difference is beyond the seed-to-seed noise.
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path

import pandas as pd

from grpo_exp.base.run_files import STATUS_FILE
from grpo_exp.analysis.seed_summary import DEFAULTS, ONE_VARIANT
from grpo_exp.evaluation import seed_stats
from grpo_exp.evaluation.continual import forward_transfer, paired_gain, stage_pair, turnover
from grpo_exp.evaluation.stats import mean_interval


def curriculum_jobs(jobs: list[dict], labels: list[str]) -> list[tuple[str, dict]]:
    """(method label, curriculum.json) of each finished curriculum job with per-problem results."""
    return [(label, cur) for label, cur, _ in _finished(jobs, labels)]


def _finished(jobs: list[dict], labels: list[str]):
    for job, label in zip(jobs, labels):
        cur = job.get("curriculum") or {}
        rows = (cur.get("correct") or {}).get("rows") or []
        if cur.get("stages") and len(rows) == (1 if _adaptive(cur) else len(cur["stages"])):
            yield method_label(cur, label or "default"), cur, job


def method_labels(jobs: list[dict], labels: list[str]) -> list[str]:
    """Each job's label, as a method name (method_label) for a curriculum job."""
    return [method_label(job["curriculum"], label) if job.get("curriculum") else label
            for job, label in zip(jobs, labels)]


def _adaptive(cur: dict) -> bool:
    return cur.get("mode") == "adaptive"


PLAIN = "plain GRPO"
# the variant-label parts that method_label says in words (report.variant_labels: "key=value, ..."); `method=` is the
# conf/method option, which sets only these
_METHOD_KEYS = ("ewc.lambda=", "curriculum.replay=", "train.method=", "ewc.fisher=", "method=",
                "curriculum.match_accuracy_of=")


def method_label(cur: dict, variant: str) -> str:
    """The method a curriculum job ran, from its curriculum.json (SFT or GRPO, EWC strength and Fisher, replay share,
    adaptive mode), then
    whatever else its variant label (its swept settings) names; the variant label as it is for a record that does
    not say its EWC strength."""
    if "ewc_lambda" not in cur:
        return variant
    lam, replay = cur.get("ewc_lambda") or 0, cur.get("replay") or 0
    pull = "uniform-Fisher L2" if cur.get("ewc_fisher") == "uniform" else "EWC"  # the Fisher ablation says so
    sft = cur.get("method") == "sft"  # records from before train.method are GRPO's
    method = " + ".join([*(["SFT"] if sft else []), *([f"{pull} lambda {lam:g}"] if lam else []),
                         *([f"replay {replay:g}"] if replay else [])])
    method = (method or PLAIN) + (" (adaptive curriculum)" if _adaptive(cur) else "")
    if cur.get("match_accuracy_of"):  # each stage stopped at another run's validation accuracy (curriculum/match.py)
        method += ", stopped at matched accuracy"
    rest = [p for p in variant.split(", ")
            if not p.startswith(_METHOD_KEYS) and p not in (DEFAULTS, ONE_VARIANT)
            and not (_adaptive(cur) and p == "curriculum=adaptive")]
    return ", ".join([method, *rest])


def _job_minutes(job: dict) -> float | None:
    """The whole job's wall time (status.json, written by the task wrapper), evaluations included."""
    path = Path(job["row"]["dir"]) / STATUS_FILE
    try:
        duration = json.loads(path.read_text()).get("duration_s")
    except (OSError, ValueError):
        return None
    return duration / 60 if duration else None


def gains_by_job(jobs: list[dict], labels: list[str]) -> pd.DataFrame:
    """One row per job and stage: the stage's accuracy before it trained and after, paired, and the job's minutes
    (on its first row; a branch's stages taken from another run (curriculum.branch_from) say so instead, and its
    minutes go on the first stage it trained)."""
    rows = []
    for method, cur, job in _finished(jobs, labels):
        minutes = _job_minutes(job)
        taken = len((cur.get("branched_from") or {}).get("stages") or [])
        gains = [paired_gain(stage, *pair) for i, stage in enumerate(cur["stages"])
                 if (pair := _stage_pairs(cur, i)) is not None]
        for i, g in enumerate(gains):
            low, high = g["gain_ci95"]
            if i < taken:
                time = "taken from " + "/".join(Path(cur["branched_from"]["dir"]).parts[-2:])
            else:
                time = f"{minutes:.1f}" if minutes is not None and i == taken else ""
            rows.append({"method": method, "seed": cur.get("seed"), "stage": g["stage"], "n": g["n"],
                         "before": f"{g['before']:.3f}", "after": f"{g['after']:.3f}",
                         "gain [paired 95% CI]": f"{g['gain']:+.3f} [{low:+.3f}, {high:+.3f}]",
                         "McNemar p": f"{g['mcnemar_p']:.2g}",
                         "job minutes": time})
    return pd.DataFrame(rows)


def _seed_pair(pairs: list[tuple[list[int], list[int]]]) -> dict:
    """Seed-level comparison of (before, after) per-problem results, one pair per seed (seed_stats.seed_level)."""
    return seed_stats.seed_level(pairs)


def _spread(values: list[float]) -> str:
    """The mean over seeds with its 95% t interval over seeds (each seed one draw of training)."""
    mean, interval = statistics.fmean(values), mean_interval(values)
    return f"{mean:.3f}" + (f" [t {interval[0]:.3f}, {interval[1]:.3f}]" if interval else "")


def by_method(jobs: list[dict], labels: list[str]) -> dict[str, list[dict]]:
    """Each method's finished curriculum records (curriculum.json), one per seed, in sweep order."""
    out: dict[str, list[dict]] = {}
    for label, cur in curriculum_jobs(jobs, labels):
        out.setdefault(label, []).append(cur)
    return out


# the continual-learning metrics, each one value per seed (seed_metrics)
METRICS = ("average accuracy", "BWT", "FWT", "max forgetting", "earlier solved, lost", "earlier unsolved, gained")


def seed_metrics(curs: list[dict]) -> dict[str, list[float]]:
    """Per metric of METRICS that every seed's record has, its value on each seed: average accuracy, BWT, FWT,
    maximum forgetting, and the correct-set turnover (the earlier stages' problems lost and gained; not for an
    adaptive curriculum, which has no order)."""
    values = {"average accuracy": [c.get("average_accuracy") for c in curs], "BWT": [c.get("bwt") for c in curs],
              "FWT": [forward_transfer(c["matrix"], c.get("base")) for c in curs],
              "max forgetting": [c.get("forgetting_max") for c in curs]}
    turns = [turnover(c["correct"]["rows"]) for c in curs]
    if not _adaptive(curs[0]):
        values["earlier solved, lost"] = [t and t["lost"] for t in turns]
        values["earlier unsolved, gained"] = [t and t["gained"] for t in turns]
    return {k: v for k, v in values.items() if v and all(x is not None for x in v)}


def _gain_cell(g: dict) -> str:
    return seed_stats.cell(g)


def _stage_pairs(cur: dict, i: int) -> tuple[list[int], list[int]] | None:
    """Stage i's (before, after) per-problem results: the model that entered it, then the one it left (for an
    adaptive curriculum, which trains every stage at once, the start model and its final model)."""
    base, rows = cur["correct"].get("base"), cur["correct"]["rows"]
    if _adaptive(cur):
        return (base[i], rows[-1][i]) if base else None
    return stage_pair(i, base, rows)


def continual_table(jobs: list[dict], labels: list[str]) -> pd.DataFrame:
    """One row per method; empty when no job is a curriculum run with per-problem results."""
    rows = []
    for method, curs in by_method(jobs, labels).items():
        stages = curs[0]["stages"]
        row = {"method": method, "seeds": " ".join(str(c.get("seed")) for c in curs)}
        for j, stage in enumerate(stages):
            row[f"{stage} final"] = _spread([c["matrix"][-1][j] for c in curs])
        for j, stage in enumerate(stages):
            pairs = [p for c in curs if (p := _stage_pairs(c, j)) is not None]
            gain = _seed_pair(pairs) if pairs else None
            row[f"{stage} gain"] = _gain_cell(gain) if gain else ""
            row[f"{stage} gain, pooled"] = seed_stats.pooled_cell(gain) if gain else ""
        values = seed_metrics(curs)
        for metric in ("average accuracy", "BWT", "max forgetting", "FWT"):
            row[metric] = _spread(values[metric]) if metric in values else ""
        for metric in ("earlier solved, lost", "earlier unsolved, gained"):
            if metric in values:
                row[metric] = _spread(values[metric])
        rows.append(row)
    return pd.DataFrame(rows)


def against_baseline(jobs: list[dict], labels: list[str]) -> pd.DataFrame:
    """Each method against plain GRPO (else the first method), paired by seed over the seeds both ran: each stage's
    final accuracy (per-problem pairs within a seed: the same seed scores the same problems) and each metric of
    METRICS (one value per seed), each as the mean difference with its seed-level t interval, p and verdict; empty
    with fewer than two methods."""
    by_method: dict[str, dict] = {}
    for label, cur in curriculum_jobs(jobs, labels):
        by_method.setdefault(label, {})[cur.get("seed")] = cur
    if len(by_method) < 2:
        return pd.DataFrame()
    base_name = next((m for m in by_method if m.split(", ")[0] == PLAIN), next(iter(by_method)))
    base = by_method[base_name]
    others = [(m, curs) for m, curs in by_method.items() if m != base_name]
    rows = []
    for method, curs in others:
        seeds = [s for s in curs if s in base]
        if not seeds:
            continue
        row = {"method": method, "against": base_name, "seeds": " ".join(map(str, seeds))}
        for j, stage in enumerate(curs[seeds[0]]["stages"]):
            pairs = [(base[s]["correct"]["rows"][-1][j], curs[s]["correct"]["rows"][-1][j]) for s in seeds]
            diff = _seed_pair(pairs)
            row[f"{stage} final, difference"] = _gain_cell(diff)
            row[f"{stage} final, pooled"] = seed_stats.pooled_cell(diff)
        mine, theirs = [seed_metrics([curs[s]]) for s in seeds], [seed_metrics([base[s]]) for s in seeds]
        for metric in METRICS:
            if all(metric in m for m in mine + theirs):
                diff = seed_stats.paired_difference([t[metric][0] for t in theirs], [m[metric][0] for m in mine])
                row[f"{metric}, difference"] = _gain_cell(diff)
        rows.append(row)
    return pd.DataFrame(rows)
