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


def test_a_stage_own_recipe_reaches_that_stage_only_and_wins_over_the_command_line(tmp_path):
    """curriculum.stage_overrides: the ladder's per-stage settings, applied to their stage alone, over the command
    line's (the more specific wins), as run_curriculum composes each stage."""
    from omegaconf import OmegaConf

    from grpo_exp.training.curriculum.sequential import _stage_config
    from tests.conftest import compose_cfg

    user = ["curriculum=progressive", "curriculum.stages=[basic,intermediate,two_step]", "train.max_steps=7",
            "train.learning_rate=1e-5", "logger=none"]
    cfg = compose_cfg(user, tmp_path)
    cfg.curriculum.stage_overrides = OmegaConf.create(
        {"two_step": ["train.dynamic_sampling=true", "train.learning_rate=3e-5"]})
    cfgs = [_stage_config(cfg, user, list(cfg.curriculum.stages), i, tmp_path) for i in range(3)]
    assert [c.train.dynamic_sampling for c in cfgs] == [False, False, True]
    assert [c.train.learning_rate for c in cfgs] == [1e-5, 1e-5, 3e-5]
    assert [c.train.max_steps for c in cfgs] == [7, 7, 7]


def test_an_experiments_stage_recipes_reach_their_stages_and_no_stage_inherits_them(tmp_path):
    """experiment=long_ladder sets curriculum.stage_overrides in its file: each stage run gets its own recipe, and its
    config holds none (Hydra would merge an emptying `{}` override into the experiment's dict, and the stage's check
    would refuse recipes for stages it does not list)."""
    from grpo_exp.training.curriculum.overrides import check_stages
    from grpo_exp.training.curriculum.sequential import _stage_config
    from tests.conftest import compose_cfg

    user = ["experiment=long_ladder", "logger=none"]
    cfg = compose_cfg(user, tmp_path)
    stages = list(cfg.curriculum.stages)
    cfgs = [_stage_config(cfg, user, stages, i, tmp_path) for i in range(len(stages))]
    assert [c.train.dynamic_sampling for c in cfgs] == [False, False, True, True]
    assert all(dict(c.curriculum.stage_overrides) == {} and list(c.curriculum.stages) == [] for c in cfgs)
    check_stages(cfgs, tmp_path)  # what refused the experiment's run before a stage trained


@pytest.mark.parametrize("entry, message", [
    ({"advanced": ["train.max_steps=5"]}, r"curriculum\.stage_overrides\.advanced: 'advanced' is not one of"),
    ({"basic": ["train.max_steps"]}, r"'train\.max_steps' is not a key=value override"),
    ({"basic": ["init_from=/x"]}, r"sets init_from, which the curriculum sets for each stage itself"),
    ({"basic": ["stage.dataset=gsm8k"]}, r"sets stage\.dataset, which makes a stage that stage"),
])
def test_a_bad_stage_override_is_one_line_before_anything_loads(tmp_path, entry, message):
    from omegaconf import OmegaConf

    from grpo_exp.config.checks import validate
    from tests.conftest import compose_cfg

    cfg = compose_cfg(["curriculum=progressive", "logger=none"], tmp_path)
    cfg.curriculum.stage_overrides = OmegaConf.create(entry)
    with pytest.raises(ConfigError, match=message) as err:
        validate(cfg)
    assert "\n" not in str(err.value)


def test_stage_overrides_on_the_command_line(tmp_path):
    from tests.conftest import compose_cfg

    cfg = compose_cfg(["curriculum=progressive", "logger=none",
                       "+curriculum.stage_overrides.intermediate=['train.dynamic_sampling=true']"], tmp_path)
    assert list(cfg.curriculum.stage_overrides["intermediate"]) == ["train.dynamic_sampling=true"]


def test_an_eval_limit_past_a_stages_held_out_split_is_refused_before_any_model_loads(tmp_path, monkeypatch):
    """The matrix scores curriculum.eval_limit problems of every stage after every stage: a stage whose split holds
    fewer (the smoke stages hold 8) is refused in one line naming it, before the base row loads the model."""
    from grpo_exp.core import models
    from grpo_exp.training.curriculum.sequential import run_curriculum
    from tests.conftest import compose_cfg

    monkeypatch.setattr(models, "load", lambda *a, **k: pytest.fail("a model loaded before the check"))
    user = ["model=tiny_random", "debug=smoke", "curriculum=progressive", "logger=none"]
    with pytest.raises(ConfigError, match=r"curriculum\.eval_limit=200") as err:
        run_curriculum(compose_cfg(user, tmp_path), user)
    assert "'basic' holds 8 test problems" in str(err.value) and "\n" not in str(err.value)
