"""A normal run starts quietly: one INFO line says what will run (model, stage, steps, the speed plan in a few words,
where the files go); the plan's detail is at DEBUG and in speed_plan.json, and nothing of a healthy start is a
WARNING."""

from __future__ import annotations

import logging

from grpo_exp.config.speed import plan_for
from grpo_exp.training.stage import train
from tests.conftest import compose_cfg


def test_the_plan_in_a_few_words(tmp_path):
    cfg = compose_cfg(["debug=smoke", "train.precision=fp32", "speed=trl"], tmp_path)
    assert plan_for(cfg).summary() == "fp32 on cpu, sampling with TRL's generate"


def test_a_smoke_run_says_what_it_runs_in_one_info_line_and_warns_of_nothing(tmp_path, caplog):
    cfg = compose_cfg(["debug=smoke", "logger=none"], tmp_path / "run")
    with caplog.at_level(logging.INFO, logger="grpo_exp"):
        train(cfg)
    starts = [r.getMessage() for r in caplog.records if r.getMessage().startswith("training tiny_random on basic: ")]
    assert len(starts) == 1, starts
    assert f": {cfg.train.max_steps} steps, " in starts[0] and starts[0].endswith(f"; files in {tmp_path / 'run'}")
    assert "sampling with" in starts[0]
    warnings = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING and r.name.startswith("grpo_exp")]
    assert not warnings, warnings
    assert not [r for r in caplog.records if r.getMessage().startswith("speed plan: ")]  # the whole plan is DEBUG
