"""A run's start line says about how long its steps take here, from the last finished run of the same shape on the
same machine (training/pace.py)."""

from __future__ import annotations

import logging

from grpo_exp.training import pace
from grpo_exp.training.stage import train
from tests.conftest import compose_cfg


def test_no_record_no_estimate_then_the_median_of_the_steps_after_the_first(tmp_path):
    assert pace.estimate(tmp_path, "shape", 90).startswith("no time estimate yet")
    assert pace.record(tmp_path, "shape", [40.0, 8.0, 10.0, 9.0]) == 9.0  # the first step compiles: left out
    said = pace.estimate(tmp_path, "shape", 90)
    assert said.startswith("its steps take about 14 min here (9.0 s each") and said.endswith(")"), said
    assert pace.estimate(tmp_path, "another shape", 90).startswith("no time estimate yet")
    assert pace.estimate(tmp_path, "shape", 3).startswith("its steps take under a minute here")


def test_the_latest_run_of_a_shape_replaces_its_record_and_old_shapes_fall_off(tmp_path, monkeypatch):
    pace.record(tmp_path, "shape", [1.0, 2.0])
    pace.record(tmp_path, "shape", [1.0, 4.0])
    assert "(4.0 s each" in pace.estimate(tmp_path, "shape", 60)
    monkeypatch.setattr(pace, "KEEP", 2)
    pace.record(tmp_path, "b", [1.0, 1.0])
    pace.record(tmp_path, "c", [1.0, 1.0])
    assert pace.estimate(tmp_path, "shape", 60).startswith("no time estimate yet")  # the oldest went
    assert pace.record(tmp_path, "d", [5.0]) is None  # one step: nothing to say


def test_a_damaged_or_unwritable_record_costs_the_estimate_not_the_run(tmp_path):
    pace.pace_path(tmp_path).write_text("{not json")
    assert pace.estimate(tmp_path, "shape", 90).startswith("no time estimate yet")
    blocked = tmp_path / "file"
    blocked.write_text("")
    assert pace.record(blocked, "shape", [1.0, 2.0]) == 2.0  # the cache 'directory' is a file: not recorded
    assert pace.estimate(blocked, "shape", 90).startswith("no time estimate yet")


def test_the_key_holds_what_decides_a_step_time(tmp_path):
    cfg = compose_cfg(["debug=smoke"], tmp_path)
    key = pace.shape_key(cfg, "fp32 on cpu, sampling with TRL's generate")
    assert pace.cpu_name() in key and "tiny_random; basic; fp32 on cpu" in key
    cfg.train.max_completion_length += 1
    assert pace.shape_key(cfg, "fp32 on cpu, sampling with TRL's generate") != key
    longer = pace.shape_key(cfg, "fp32 on cpu, sampling with TRL's generate")
    cfg.train.dynamic_sampling = True  # extra generation rounds a step
    assert pace.shape_key(cfg, "fp32 on cpu, sampling with TRL's generate") != longer


def test_a_second_run_of_the_same_shape_starts_with_the_first_runs_pace(tmp_path, caplog, monkeypatch):
    monkeypatch.setattr(pace, "pace_path", lambda cache_dir: tmp_path / "pace.json")
    lines = []
    for name in ("first", "second"):
        caplog.clear()
        with caplog.at_level(logging.INFO, logger="grpo_exp"):
            train(compose_cfg(["debug=smoke", "logger=none", "eval.after_train=false"], tmp_path / name))
        lines += [r.getMessage() for r in caplog.records if r.getMessage().startswith("training tiny_random on ")]
    assert "; no time estimate yet (no run of this shape has finished on this machine); files in " in lines[0]
    assert "; its steps take under a minute here (" in lines[1], lines
