"""What a run trained on, in words, for the model card and grpo-export-trl: one stage's own prompts, that stage with
a replayed share of the earlier stages' (curriculum.replay), or the adaptive curriculum's one run over every stage's
training set at once. Read from the run's recorded config alone."""

from __future__ import annotations

from omegaconf import OmegaConf


def trained_on(cfg) -> str | None:
    """A sentence for a run whose training set mixed stages, else None (a stage's own prompts only)."""
    curriculum = OmegaConf.select(cfg, "curriculum") or {}
    stages = list(curriculum.get("stages") or [])
    if curriculum.get("mode") == "adaptive" and stages:
        return (f"the adaptive curriculum: one run of {cfg.train.max_steps} steps over the training sets of "
                f"{', '.join(stages)} at once, each group's stage drawn by that stage's recent pass rate "
                f"(curriculum=adaptive), every prompt rewarded as its own stage's")
    replay, earlier = curriculum.get("replay") or 0, list(curriculum.get("replay_from") or [])
    if replay > 0 and earlier:
        return (f"the {cfg.stage.name} stage's training set with {replay:.0%} of its prompts replayed from the earlier "
                f"stages' training sets ({', '.join(earlier)}; curriculum.replay={replay:g}), each replayed prompt "
                f"rewarded as its own stage's")
    return None
