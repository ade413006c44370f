"""What a curriculum does with the command line's overrides: stage settings (stage.num_train, ...) reach every
stage over its own conf/stage/<name>.yaml; what names a stage (stage.dataset, ...) is refused in one line."""

from __future__ import annotations

import pytest

from grpo_exp.base.errors import ConfigError
from grpo_exp.training.curriculum.overrides import compose_stage, stage_overrides


def test_a_stage_setting_reaches_every_stage_and_each_keeps_its_own_data(tmp_path):
    user = ["curriculum=progressive", "stage.num_train=12", "stage.num_test=5", "train.seed=3"]
    cfgs = [compose_stage(stage_overrides(user, s, tmp_path / s, None)) for s in ("basic", "intermediate")]
    assert [c.stage.name for c in cfgs] == ["basic", "intermediate"]
    assert [c.stage.dataset for c in cfgs] == ["basic", "intermediate"]
    assert [(c.stage.num_train, c.stage.num_test, c.train.seed) for c in cfgs] == [(12, 5, 3)] * 2
    # each stage's own settings where the command line says nothing: intermediate's longer completions
    assert [c.train.max_completion_length for c in cfgs] == [48, 64]


@pytest.mark.parametrize("override", ["stage.dataset=gsm8k", "stage.name=x", "+stage.path=/tmp/a.jsonl"])
def test_an_override_that_names_a_stage_is_refused_in_one_line(tmp_path, override):
    with pytest.raises(ConfigError, match=r"a curriculum's stages are curriculum\.stages") as err:
        stage_overrides(["curriculum=progressive", override], "basic", tmp_path, None)
    assert override in str(err.value) and "\n" not in str(err.value)


def test_the_supervised_arm_reaches_every_stage_of_a_curriculum(tmp_path):
    user = ["curriculum=progressive", "train.method=sft"]
    cfgs = [compose_stage(stage_overrides(user, s, tmp_path / s, None)) for s in ("basic", "intermediate")]
    assert [c.train.method for c in cfgs] == ["sft", "sft"]
