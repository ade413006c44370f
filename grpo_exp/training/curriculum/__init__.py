"""The curriculum: stages trained in sequence, each from the last one's model and EWC state, with replay and
branching (sequential.py, replay.py, branch.py), or all at once with an adaptive stage mix (adaptive.py, mix.py;
the mix also serves replay's per-stage figures); what it records (record.py: curriculum.json, the accuracy
matrix); how each stage's config is composed (overrides.py); what a run trained on, in words (describe.py). The continual-learning metrics are evaluation's
(grpo_exp/evaluation/continual.py), so that a report loads no training code.

Nothing is imported here: the trainer imports mix.py and replay.py, and the runners import the trainer."""

from __future__ import annotations


def run(cfg, user_overrides: list[str]) -> dict:
    """Train cfg.curriculum.stages with the runner cfg.curriculum.mode names (adaptive, else sequential)."""
    if cfg.curriculum.mode == "adaptive":
        from grpo_exp.training.curriculum.adaptive import run_adaptive

        return run_adaptive(cfg, user_overrides)
    from grpo_exp.training.curriculum.sequential import run_curriculum

    return run_curriculum(cfg, user_overrides)
