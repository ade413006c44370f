"""A curriculum stage's training set when it mixes stages: replay (`curriculum.replay=r`: a later stage trains on
(1 - r) of its own prompts and r drawn from the earlier stages' training sets) and the adaptive curriculum's union
of every stage's training set. Every example is tagged with its stage (the dataset's `stage` column), keeps its
own answer (the rewards read each example's), and is rewarded as its own stage's problems are.

The training sets drawn from are the stages' own, as each stage trained on them: the curriculum hands over the
stage nodes it composed (with the command line's stage.* overrides); a stage run on its own composes them from
conf/stage/<name>.yaml."""

from __future__ import annotations

import random
from typing import Any

from grpo_exp.base import log

logger = log.get_logger(__name__)

# the tag that keys replay's draws apart from the other uses of train.seed
_REPLAY_SALT = 0x5E1A7


def tagged(examples: list[dict], stage: str) -> list[dict]:
    return [{**ex, "stage": stage} for ex in examples]


def replay_mix(own: list[dict], stage: str, earlier: dict[str, list[dict]], fraction: float,
               seed: int) -> list[dict]:
    """As many examples as `own`: round(len(own) * fraction) drawn from the earlier stages' training sets
    (`earlier`: stage name -> its examples; an equal share from each, the later stages taking the remainder) and the
    rest drawn from `own`, each tagged with its stage, in one seeded shuffled order. The draws are without
    replacement where a set is large enough."""
    if not earlier or fraction <= 0:
        return tagged(own, stage)
    rng = random.Random(seed * 1_000_003 + _REPLAY_SALT)
    n_replay = round(len(own) * fraction)
    share, extra = divmod(n_replay, len(earlier))
    mixed = tagged(rng.sample(own, len(own) - n_replay), stage)
    for i, (name, pool) in enumerate(earlier.items()):
        count = share + (1 if i >= len(earlier) - extra else 0)
        if not pool:
            raise ValueError(f"replay: stage {name} has no training examples to replay")
        drawn = rng.sample(pool, count) if count <= len(pool) else rng.choices(pool, k=count)
        mixed += tagged(drawn, name)
    rng.shuffle(mixed)
    return mixed


def stage_nodes(cfg, names: list[str], given: dict[str, Any] | None) -> dict[str, Any]:
    """The stage node of each named stage: the curriculum's (`given`), else conf/stage/<name>.yaml's."""
    from grpo_exp.evaluation.run import set_settings

    given = given or {}
    return {name: given[name] if name in given else set_settings(cfg, name)[0] for name in names}


def training_sets(cfg, nodes: dict[str, Any]) -> dict[str, list[dict]]:
    """Each stage's training set, drawn with the run's data seed (train.seed), as that stage's own run drew it."""
    from grpo_exp.core.data import stage_split

    return {name: stage_split(node, "train", cfg.train.seed) for name, node in nodes.items()}


def mixed_examples(cfg, own: list[dict], pools: dict[str, Any] | None = None) -> list[dict] | None:
    """The examples of a run's training dataset where it mixes stages, each with its `stage`; None where it trains
    on its own stage alone (the dataset then has no stage column, as before these options). `pools`: stage name ->
    stage node, from the curriculum."""
    curriculum = cfg.curriculum
    if curriculum.mode == "adaptive" and curriculum.stages:
        sets = training_sets(cfg, stage_nodes(cfg, list(curriculum.stages), pools))
        return [ex for name, examples in sets.items() for ex in tagged(examples, name)]
    if curriculum.replay > 0 and curriculum.replay_from:
        earlier = training_sets(cfg, stage_nodes(cfg, list(curriculum.replay_from), pools))
        mixed = replay_mix(own, cfg.stage.name, earlier, curriculum.replay, cfg.train.seed)
        logger.info("replay: %d of %d training prompts from %s", sum(ex["stage"] != cfg.stage.name for ex in mixed),
                    len(mixed), ", ".join(earlier))
        return mixed
    return None


def mix_stages(cfg) -> list[str] | None:
    """The stages a run's training set mixes, in a fixed order (the keys of curriculum/mix/<stage>), or None."""
    curriculum = cfg.curriculum
    if curriculum.mode == "adaptive" and curriculum.stages:
        return list(dict.fromkeys(curriculum.stages))
    if curriculum.replay > 0 and curriculum.replay_from:
        return list(dict.fromkeys([*curriculum.replay_from, cfg.stage.name]))
    return None
