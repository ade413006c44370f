"""What an EWC strength buys and costs: per-job and per-lambda forgetting figures of a sweep over `ewc.lambda`.

A job is either a curriculum (curriculum.json: the accuracy matrix) or a later stage trained from an
earlier one's model (`init_from`, with `eval.sets` naming the earlier stages too): its before_after.json
then holds, per set, the starting model's accuracy (the earlier stage's matrix entry) and the trained
one's, on the same held-out problems. Both give, per evaluated set, the final accuracy with its 95%
interval and how much of the starting accuracy was lost (forgetting) on every earlier set.
"""

from __future__ import annotations

import math
import statistics
from pathlib import Path

from grpo_exp.evaluation.stats import wilson_interval


def job_sets(job: dict, before_after: dict | None) -> dict[str, dict] | None:
    """{set: {"start", "final", "ci", "new", "diff_ci"}} of one job, or None when it measured no transfer.

    "new" marks the set the job's last stage trained on; the other sets are earlier stages, whose
    start - final is their forgetting; "diff_ci" is the paired 95% interval of final - start where known."""
    curriculum = job.get("curriculum")
    if curriculum and curriculum.get("matrix"):
        stages, matrix = curriculum["stages"], curriculum["matrix"]
        n = curriculum.get("eval_limit") or 0
        final = matrix[-1]
        out = {}
        if curriculum.get("mode") == "adaptive":  # one run trained every stage: each set's reference is the base
            base = curriculum.get("base") or [None] * len(final)
            return {name: {"start": base[j], "final": final[j], "new": True,
                           "ci": wilson_interval(round(final[j] * n), n) if n else (math.nan, math.nan)}
                    for j, name in enumerate(stages[: len(final)])}
        for j, name in enumerate(stages[: len(final)]):
            ci = wilson_interval(round(final[j] * n), n) if n else (math.nan, math.nan)
            # an earlier stage's reference is its accuracy right after it was trained (the matrix diagonal)
            out[name] = {"start": matrix[j][j] if j < len(final) - 1 else None, "final": final[j], "ci": ci,
                         "new": j == len(final) - 1}
        return out
    sets = (before_after or {}).get("sets") or {}
    if (before_after or {}).get("before") != "start" or len(sets) < 2:
        return None  # from the base model, or only the new stage scored: nothing earlier to forget
    stage = job["row"].get("stage")
    return {name: {"start": v["before"], "final": v["after"], "ci": tuple(v["after_ci95"]), "new": name == stage,
                   "diff_ci": v.get("accuracy_diff_ci95")}
            for name, v in sets.items()}


def job_row(sets: dict[str, dict]) -> dict:
    """Flat per-job figures: final accuracy per set, forgetting per earlier set, BWT and max forgetting."""
    row = {}
    earlier = []
    for name, v in sets.items():
        row[f"{name}_final"] = v["final"]
        row[f"{name}_ci95"] = f"[{v['ci'][0]:.3f}, {v['ci'][1]:.3f}]"
        if not v["new"] and v["start"] is not None:
            row[f"{name}_forgetting"] = v["start"] - v["final"]
            if v.get("diff_ci"):  # the paired interval of final - start, turned around
                row[f"{name}_forgetting_ci95"] = f"[{-v['diff_ci'][1]:.3f}, {-v['diff_ci'][0]:.3f}]"
            earlier.append(v["final"] - v["start"])
        elif v["new"] and v["start"] is not None:
            row[f"{name}_gain"] = v["final"] - v["start"]
    if earlier:
        row["bwt"] = sum(earlier) / len(earlier)
        row["forgetting_max"] = max(-e for e in earlier)
    return row


def per_lambda(rows: list[dict]) -> list[dict]:
    """Mean (and min..max over seeds) of every per-job figure, one row per ewc_lambda, in lambda order."""
    by_lambda: dict[float, list[dict]] = {}
    for row in rows:
        by_lambda.setdefault(float(row["ewc_lambda"]), []).append(row)
    out = []
    for lam in sorted(by_lambda):
        group = by_lambda[lam]
        summary = {"ewc_lambda": lam, "seeds": len(group)}
        keys = [k for k in group[0] if k.endswith(("_final", "_forgetting", "_gain"))
                or k.startswith("forgetting_kl_") or k in ("bwt", "forgetting_max")]
        for key in keys:
            values = [r[key] for r in group if isinstance(r.get(key), (int, float)) and not math.isnan(r[key])]
            if values:
                summary[key] = statistics.mean(values)
                summary[f"{key}_range"] = f"{min(values):.3f}..{max(values):.3f}" if len(values) > 1 else ""
        out.append(summary)
    return out


def plot_accuracy_by_lambda(jobs: list[tuple[float, dict[str, dict]]], path: Path) -> Path | None:
    """Final accuracy per set against lambda, from (lambda, job_sets) pairs: each job a point with its 95%
    interval, the mean over jobs a line, the mean starting accuracy a dotted line."""
    if not jobs:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    lambdas = sorted({float(lam) for lam, _ in jobs})
    names = sorted({name for _, sets in jobs for name in sets})
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for k, name in enumerate(names):
        points = [(float(lam), sets[name]) for lam, sets in jobs if name in sets]
        xs = [lambdas.index(lam) + (k - (len(names) - 1) / 2) * 0.12 for lam, _ in points]
        ys = [v["final"] for _, v in points]
        errors = [[v["final"] - v["ci"][0] for _, v in points], [v["ci"][1] - v["final"] for _, v in points]]
        ax.errorbar(xs, ys, yerr=errors, fmt="o", capsize=3, alpha=0.7, color=f"C{k}")
        means = [statistics.mean([v["final"] for l, v in points if l == lam] or [math.nan]) for lam in lambdas]
        ax.plot(range(len(lambdas)), means, "-", color=f"C{k}", label=f"{name} (mean over seeds)")
        starts = [v["start"] for _, v in points if v["start"] is not None]
        if starts:
            ax.axhline(statistics.mean(starts), ls=":", color=f"C{k}", label=f"{name} at the stage's start")
    ax.set_xticks(range(len(lambdas)), [f"{lam:g}" for lam in lambdas])
    ax.set_xlabel("ewc.lambda")
    ax.set_ylabel("greedy held-out accuracy (95% CI)")
    ax.set_title("Final accuracy per stage vs EWC strength")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
