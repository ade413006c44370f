"""A run with a periodic evaluation and no before/after one (eval.after_train=false, as the compute curve and the
probes run) records the level its learning curve starts from in validation_start.json, also when a finished run is
run again; the report reads it as the curve's start."""

from __future__ import annotations

import json

import pytest

from grpo_exp.analysis import aggregates, report
from grpo_exp.config.checks import validate
from grpo_exp.training import stage
from tests.conftest import compose_cfg


@pytest.mark.slow
def test_the_starting_level_is_recorded_without_a_before_after_evaluation_and_on_a_rerun(tmp_path):
    run_dir = tmp_path / "run"
    args = ["debug=smoke", "logger=none", "eval.after_train=false", "eval.every_steps=1", "eval.every_limit=4",
            "train.save_steps=2", "resume=true"]
    cfg = compose_cfg(args, run_dir)
    validate(cfg)
    stage.train(cfg)
    start = json.loads((run_dir / "validation_start.json").read_text())
    assert start["set"] == "basic" and start["n"] == 4 and start["model"] == "base"
    assert not (run_dir / "before_after.json").exists()
    job = report.load_job(run_dir)
    assert aggregates.validation_start(job, "basic") == ("base model", start["accuracy"], 4)

    (run_dir / "validation_start.json").unlink()  # as a run finished before the file existed
    metrics = stage.train(compose_cfg(args, run_dir))
    assert metrics["status"] == "completed" and (run_dir / "validation_start.json").is_file()
