"""One split of a stage node (conf/stage): the problems training, evaluation and `grpo-data` draw, cut with the
stage's split seed and, for the training problems, picked with the training seed."""

from __future__ import annotations


def split_seed(stage, seed: int) -> int:
    """The seed that cuts a stage's splits: its `stage.split_seed`, or, for a run recorded before that key
    existed, the training seed it drew them with."""
    recorded = stage.get("split_seed") if hasattr(stage, "get") else None
    return int(seed if recorded is None else recorded)


def stage_split(stage, split: str, seed: int, size: int | None = None) -> list[dict]:
    """The problems of one split of a stage node: stage.num_<split> of them unless `size` is given (0: all, for a
    GSM8K file). The bands and held-out sets come from the split seed; `seed` (the training seed) picks the
    training problems."""
    from . import build_examples

    size = stage[f"num_{split}"] if size is None else size
    return build_examples(stage.dataset, split, size=size, seed=split_seed(stage, seed), path=stage.path,
                          hub_id=stage.hub_id, hub_config=stage.hub_config,
                          test_fraction=stage.test_fraction, validation_fraction=stage.validation_fraction,
                          sample_seed=seed)
