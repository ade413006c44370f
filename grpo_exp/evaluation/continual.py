"""Continual-learning metrics of a curriculum's accuracy matrix R[trained stage][evaluated stage]: average accuracy,
backward transfer (BWT, Lopez-Paz & Ranzato 2017), forgetting (Chaudhry et al. 2018), and each stage's gain on its
own held-out problems, paired over problems (interval and McNemar p). Pure functions of the recorded results, so a
report reads them without loading the training stack."""

from __future__ import annotations

from grpo_exp.base.text import markdown_table
from grpo_exp.evaluation.stats import paired_bits


def transfer_metrics(matrix: list[list[float]]) -> dict:
    """Average accuracy, BWT and forgetting from R[i][j] (row i: after training stage i).

    Only entries with j <= i are read, so rows may stop at the diagonal.
    """
    t = len(matrix)
    final = matrix[-1]
    out = {"average_accuracy": sum(final[:t]) / t}
    if t < 2:
        return {**out, "bwt": None, "forgetting_max": None, "forgetting_mean": None}
    bwt = sum(final[j] - matrix[j][j] for j in range(t - 1)) / (t - 1)
    forgetting = [max(matrix[i][j] for i in range(j, t - 1)) - final[j] for j in range(t - 1)]
    return {**out, "bwt": bwt, "forgetting_max": max(forgetting), "forgetting_mean": sum(forgetting) / len(forgetting),
            "forgetting_per_stage": forgetting}


def forward_transfer(matrix: list[list[float]], base: list[float] | None) -> float | None:
    """FWT (Lopez-Paz & Ranzato 2017): each later stage's accuracy before it trained (the previous stage's model,
    R[j-1][j]) against the start model's (base[j]), averaged over stages 2..T; None without the start row or a
    second stage."""
    if not base or len(matrix) < 2:
        return None
    gains = [matrix[j - 1][j] - base[j] for j in range(1, len(matrix)) if j < len(matrix[j - 1])]
    return sum(gains) / len(gains) if gains else None


def turnover(rows: list[list[list[int]]]) -> dict | None:
    """Correct-set turnover: over every stage after the first, the earlier stages' held-out problems the entering
    model solved and the stage's model lost, and those it gained, as shares of the earlier problems scored (summed
    over the stages: a problem lost at stage 2 and regained at 3 counts once in each). Accuracy can hold while
    many problems change hands; None with one stage."""
    lost = gained = scored = 0
    for i in range(1, len(rows)):
        for j in range(i):
            before, after = rows[i - 1][j], rows[i][j]
            lost += sum(1 for b, a in zip(before, after) if b and not a)
            gained += sum(1 for b, a in zip(before, after) if a and not b)
            scored += len(before)
    return {"lost": lost / scored, "gained": gained / scored, "scored": scored} if scored else None


def stage_gains(stages: list[str], before_first: list[list[int]] | None, rows: list[list[list[int]]]) -> list[dict]:
    """Each stage's gain on its own held-out problems: after training it (rows[i][i]) against before (the
    previous stage's model, rows[i-1][i]; for the first stage the start model, `before_first`), paired over the
    same problems. Entries are per-problem correctness (0/1) in one fixed order."""
    return [paired_gain(stage, *pair) for i, stage in enumerate(stages)
            if (pair := stage_pair(i, before_first, rows)) is not None]


def stage_pair(i: int, before_first: list[list[int]] | None,
               rows: list[list[list[int]]]) -> tuple[list[int], list[int]] | None:
    """Stage i's (before, after) per-problem results: the model that entered it (the previous stage's, or for the
    first stage the start model, `before_first`), then the one it left; None where either was not scored."""
    before = rows[i - 1][i] if i else (before_first[i] if before_first else None)
    return None if before is None or i >= len(rows) else (before, rows[i][i])


def paired_gain(stage: str, before: list[int], after: list[int]) -> dict:
    """after - before on the same problems (per-problem correctness, 0/1), with its paired interval and McNemar p."""
    pair = paired_bits(before, after)
    return {"stage": stage, "n": pair["n"], "before": pair["before"], "after": pair["after"], "gain": pair["diff"],
            "gain_ci95": [pair["low"], pair["high"]], "mcnemar_p": pair["p"]}


def format_gains(gains: list[dict]) -> str:
    return markdown_table(["stage", "n", "before", "after", "gain [paired 95% CI]", "McNemar p"],
                          [[g["stage"], g["n"], f"{g['before']:.3f}", f"{g['after']:.3f}",
                            f"{g['gain']:+.3f} [{g['gain_ci95'][0]:+.3f}, {g['gain_ci95'][1]:+.3f}]",
                            f"{g['mcnemar_p']:.2g}"] for g in gains])
