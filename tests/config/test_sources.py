"""config/sources.py: each value of a composed config named with the conf/ file that set it last, the schema's
default, or the command line; and its command, python -m grpo_exp.apps.sources."""

from __future__ import annotations

import pytest

from grpo_exp.config.sources import COMMAND_LINE, SCHEMA, format_sources, value_sources


def _by_key(overrides):
    return {key: (value, source) for key, value, source in value_sources("train", overrides)}


def test_each_value_names_the_file_that_set_it_last():
    rows = _by_key(["stage=intermediate"])
    # the recipe is conf/train/default.yaml's; a stage sets only its completion length over it
    assert rows["train.beta"] == (0.04, "conf/train/default.yaml")
    assert rows["train.learning_rate"][1] == "conf/train/default.yaml"
    assert rows["train.max_completion_length"] == (64, "conf/stage/intermediate.yaml")
    assert rows["stage.name"] == ("intermediate", "conf/stage/intermediate.yaml")
    assert rows["task_name"] == ("train", "conf/train.yaml")
    assert rows["train.warmup_steps"] == (0, SCHEMA)  # no file sets it
    assert not any(key.startswith("hydra.") for key in rows)


def test_global_package_files_and_the_command_line_win_in_merge_order():
    rows = _by_key(["debug=smoke", "train.max_steps=5", "++ewc.lambda=2"])
    assert rows["model.name"] == ("tiny_random", "conf/model/tiny_random.yaml")  # debug's `override /model`
    assert rows["train.num_generations"] == (2, "conf/debug/smoke.yaml")  # @package _global_, after the stage
    assert rows["train.max_steps"] == (5, f"{COMMAND_LINE} (train.max_steps=5)")
    assert rows["ewc.lambda"][1] == f"{COMMAND_LINE} (++ewc.lambda=2)"


def test_the_command_prints_one_line_a_key_and_fails_in_one_line(capsys):
    from grpo_exp.apps.sources import main

    main(["stage=basic"])
    out = capsys.readouterr().out.splitlines()
    assert any(line.startswith("train.max_completion_length = 48 ") and line.endswith("<- conf/stage/basic.yaml")
               for line in out)
    assert len(out) == len(value_sources("train", ["stage=basic"]))
    with pytest.raises(SystemExit) as exit_info:
        main(["stage=basics"])
    err = capsys.readouterr().err.strip().splitlines()
    assert exit_info.value.code == 2 and len(err) == 1 and "unknown stage option 'basics'" in err[0]
    assert "..." in format_sources([("k", "x" * 100, "s")])  # a long value is cut
