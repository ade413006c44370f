"""The `curriculum` group's schema: stages in sequence or mixed adaptively (training/curriculum/), replay, branching
from another run, each stage's own recipe; its fields and the checks beside them."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional

from grpo_exp.config.rules import require, require_choice, require_positive


# Overrides that the curriculum sets per stage itself (training/curriculum/overrides.py).
_PER_STAGE_KEYS = ("stage", "curriculum", "init_from", "paths.output_dir", "resume", "eval.forgetting_sets",
                   "push_to_hub")


# what makes a stage that stage: an override of these would turn every stage of a curriculum into one (a prompts
# stage's eval_reward judges its own rows; on any other stage it is refused)
_STAGE_IDENTITY = ("name", "dataset", "path", "hub_id", "hub_config", "eval_reward")


def override_key(override: str) -> str:
    return override.lstrip("+~").split("=", 1)[0]


def set_per_stage(key: str) -> bool:
    """Whether the curriculum sets `key` for each stage itself (a stage.<setting> is the user's, for every stage)."""
    return (key.startswith(_PER_STAGE_KEYS) and not key.startswith("stage.")) or key.startswith("hydra")


def own_override_problem(override: str) -> str | None:
    """What is wrong with `override` as one of a stage's own (curriculum.stage_overrides), or None."""
    if "=" not in override or not override.split("=", 1)[0].strip():
        return "is not a key=value override"
    key = override_key(override)
    if key.startswith("stage.") and key.split(".")[1] in _STAGE_IDENTITY:
        return f"sets {key}, which makes a stage that stage: list another stage in curriculum.stages instead"
    if set_per_stage(key):
        return f"sets {key}, which the curriculum sets for each stage itself"
    return None


@dataclass
class CurriculumConfig:
    name: str = "none"
    # stage option names, each continuing from the last (sequential); adaptive: the stages whose training sets
    # one run mixes; empty: a single-stage run
    stages: List[str] = field(default_factory=list)
    # sequential: the stages in order; adaptive: one run drawing each group's stage by its recent pass rate
    # (training/adaptive.py)
    mode: str = "sequential"
    eval_limit: int = 100  # held-out problems per stage in the accuracy matrix
    eval_batch_size: int = 16
    eval_base: bool = True  # also evaluate the starting model (row "base" of the matrix)
    # each later stage logs the KL from the previous stage's policy and accuracy on every earlier
    # stage while it trains (eval.forgetting_sets, every eval.every_steps)
    track_forgetting: bool = True
    # share of each later stage's training prompts drawn from the earlier stages' training sets (training/replay.py)
    replay: float = 0.0
    # the earlier stages a stage replays; the curriculum fills it per stage, as it fills eval.forgetting_sets
    replay_from: List[str] = field(default_factory=list)
    # a run of these stages (its directory) whose finished stages this one shares instead of training them again:
    # every stage up to the first whose training settings differ, e.g. the first stage for another ewc.lambda or
    # curriculum.replay on the same seed (training/branch.py)
    branch_from: Optional[str] = None
    # where branch_from has nothing to share yet (no curriculum.json, no finished stage trained as this run's, or it
    # is this run's own directory): error, or train every stage (a sweep whose first job per seed is the source)
    branch_from_missing: str = "error"
    # sequential: another run of these stages (its directory) whose accuracy each stage is matched to: a stage ends at
    # its first periodic validation evaluation that reaches that run's last one there (train.stop_at_accuracy,
    # training/curriculum/match.py), e.g. the continual study's SFT job matched to plain GRPO on the same seed
    match_accuracy_of: Optional[str] = None
    # sequential: a stage's own recipe, as overrides applied to that stage only, after the command line's, e.g.
    # {two_step: ["train.dynamic_sampling=true"]}: the ladder's per-stage settings, which stage=<name> alone keeps
    stage_overrides: Dict[str, List[str]] = field(default_factory=dict)
    # a study's seeds per method (experiment=continual): per conf/method option, the train.seed values its sweep jobs
    # run; a sweep job of that method on another seed is skipped before any model loads (status.json `skipped`,
    # nothing trained, left out of reports), so one command gives some methods fewer seeds; a method not named here
    # runs on every seed of the sweep
    method_seeds: Dict[str, List[int]] = field(default_factory=dict)
    # adaptive: the target band [low, high] of a stage's pass rate (its zone of proximal development)
    band: List[float] = field(default_factory=lambda: [0.2, 0.8])
    pass_rate_decay: float = 0.8  # adaptive: EMA of each stage's pass rate, p <- decay p + (1 - decay) p_round
    below_band_weight: float = 0.2  # adaptive: a stage below the band (in-band stages weigh 1): exploration floor
    above_band_weight: float = 0.1  # adaptive: a stage above the band (mastered)

    MODES = ("sequential", "adaptive")
    BRANCH_MISSING = ("error", "train")
    # the 0/1 rewards an adaptive curriculum reads a pass from, the first one present
    PASS_REWARDS = ("correctness", "stated_correctness")

    @staticmethod
    def check(curriculum: Any) -> None:
        from grpo_exp.config.options import group_options

        valid = tuple(group_options("stage"))
        for stage in curriculum.stages:
            require_choice("curriculum.stages entry", stage, valid)
        for stage in curriculum.replay_from:
            require_choice("curriculum.replay_from entry", stage, valid)
        require_choice("curriculum.mode", curriculum.mode, CurriculumConfig.MODES)
        require_choice("curriculum.branch_from_missing", curriculum.branch_from_missing, CurriculumConfig.BRANCH_MISSING)
        require_positive("curriculum", curriculum, "eval_limit", "eval_batch_size")
        replay = curriculum.replay
        require(math.isfinite(replay) and 0 <= replay < 1,
                f"curriculum.replay={replay!r} must be in [0, 1) (the share of a later stage's prompts drawn from "
                f"earlier stages)")
        if replay > 0:
            require(curriculum.mode != "adaptive",
                    f"curriculum.replay={replay!r} mixes earlier stages into later ones of a sequential curriculum; "
                    f"curriculum.mode=adaptive mixes every stage already: set curriculum.replay=0")
            stages = list(curriculum.stages)
            require(len(stages) >= 2 or bool(curriculum.replay_from),
                    f"curriculum.replay={replay!r} needs earlier stages to replay, but curriculum.stages={stages} "
                    f"has {'a single stage' if stages else 'none'}; list two or more stages (curriculum=progressive) "
                    f"or set curriculum.replay=0")
        if curriculum.branch_from:
            require(curriculum.mode == "sequential" and len(curriculum.stages) >= 2,
                    f"curriculum.branch_from={curriculum.branch_from} takes the first stages of a sequential "
                    f"curriculum from another run, but this run has curriculum.mode={curriculum.mode} and "
                    f"curriculum.stages={list(curriculum.stages)}; use it with curriculum=progressive (two or more "
                    f"stages), or drop it")
        if curriculum.get("match_accuracy_of"):
            require(curriculum.mode == "sequential" and len(curriculum.stages) >= 1,
                    f"curriculum.match_accuracy_of={curriculum.match_accuracy_of} ends each stage of a sequential "
                    f"curriculum at another run's accuracy there, but this run has curriculum.mode={curriculum.mode} "
                    f"and curriculum.stages={list(curriculum.stages)}; use it with curriculum=progressive, or drop it")
        CurriculumConfig._check_stage_overrides(curriculum)
        methods = tuple(group_options("method"))
        for method, seeds in dict(curriculum.get("method_seeds") or {}).items():
            require_choice("curriculum.method_seeds entry", method, methods)
            require(bool(seeds) and all(isinstance(s, int) and not isinstance(s, bool) for s in seeds),
                    f"curriculum.method_seeds.{method}={list(seeds or [])!r} must be a non-empty list of train.seed "
                    f"values (integers)")
        band = list(curriculum.band)
        require(len(band) == 2, f"curriculum.band={band} must be two pass rates [low, high] in [0, 1]")
        require(all(math.isfinite(b) and 0 <= b <= 1 for b in band),
                f"curriculum.band={band} lies outside [0, 1]; give two pass rates [low, high] in [0, 1]")
        require(band[0] < band[1], f"curriculum.band={band} is empty: its low end must be below its high end "
                                   f"(two pass rates in [0, 1], e.g. [0.2, 0.8])")
        decay = curriculum.pass_rate_decay
        require(math.isfinite(decay) and 0 <= decay < 1, f"curriculum.pass_rate_decay={decay!r} must be in [0, 1)")
        for key in ("below_band_weight", "above_band_weight"):
            value = curriculum[key]
            require(math.isfinite(value) and 0 <= value <= 1,
                    f"curriculum.{key}={value!r} must be in [0, 1] (a stage inside the band weighs 1)")

    @staticmethod
    def _check_stage_overrides(curriculum: Any) -> None:
        """Each entry names a stage of the curriculum and holds key=value overrides of settings a stage may have
        of its own (not the keys the curriculum sets per stage, nor what makes a stage that stage)."""
        per_stage = dict(curriculum.stage_overrides or {})
        if not per_stage:
            return
        stages = list(curriculum.stages)
        require(curriculum.mode == "sequential",
                f"curriculum.stage_overrides gives stages recipes of their own, which a sequential curriculum trains "
                f"one after another; curriculum.mode={curriculum.mode} trains one run: drop them")
        for stage, overrides in per_stage.items():
            require(stage in stages, f"curriculum.stage_overrides.{stage}: {stage!r} is not one of "
                                     f"curriculum.stages={stages}")
            for override in overrides or []:
                problem = own_override_problem(str(override))
                require(problem is None, f"curriculum.stage_overrides.{stage}: {override!r} {problem}")
