"""train.stop_at_accuracy ends a stage at the first periodic validation evaluation that reaches it, and a resume
keeps that end; curriculum.match_accuracy_of gives each stage another run's last validation accuracy there as its
target (the continual study's SFT run matched to plain GRPO), refusing in one line a run it cannot match."""

from __future__ import annotations

import json
import shutil

import pytest

from grpo_exp.analysis.continual import method_label
from grpo_exp.base.errors import ConfigError
from grpo_exp.config.checks import validate
from grpo_exp.training.curriculum import match
from tests.conftest import compose_cfg

SFT = ["debug=smoke", "logger=none", "train.method=sft", "eval.after_train=false"]


def _rows(run_dir):
    return [json.loads(line) for line in (run_dir / "history.jsonl").read_text().splitlines()]


@pytest.mark.slow
def test_a_stage_ends_at_the_first_evaluation_that_reaches_its_target_and_a_resume_keeps_that_end(tmp_path):
    from grpo_exp.training import stage

    run_dir = tmp_path / "run"
    # the tiny random model answers nothing right: accuracy 0 reaches a target of 0 at the first evaluation
    overrides = [*SFT, "train.max_steps=6", "train.save_steps=2", "eval.every_steps=2", "train.stop_at_accuracy=0"]
    metrics = stage.train(compose_cfg(overrides, run_dir))
    assert metrics["status"] == "completed" and metrics["steps"] == 2
    assert metrics["stop_at_accuracy"] == {"target": 0.0, "step": 2, "accuracy": 0.0, "n": 4, "reached": True}
    assert max(row["step"] for row in _rows(run_dir)) == 2
    assert (run_dir / "model" / "config.json").is_file()
    assert "2 steps of at most 6: training ends at the first periodic validation evaluation whose greedy accuracy " \
           "reaches 0" in (run_dir / "model" / "README.md").read_text()

    # killed after the stopping step's checkpoint, before the stage was marked done: the resume trains no further
    (run_dir / "metrics.json").unlink()
    shutil.rmtree(run_dir / "model")
    resumed = stage.train(compose_cfg([*overrides, "resume=true"], run_dir))
    assert resumed["steps"] == 2 and resumed["stop_at_accuracy"]["reached"] is True
    assert max(row["step"] for row in _rows(run_dir)) == 2


@pytest.mark.slow
def test_a_target_never_reached_trains_every_step_and_says_so(tmp_path):
    from grpo_exp.training import stage

    run_dir = tmp_path / "run"
    metrics = stage.train(compose_cfg([*SFT, "train.max_steps=2", "eval.every_steps=1", "train.stop_at_accuracy=1"],
                                      run_dir))
    assert metrics["steps"] == 2
    assert metrics["stop_at_accuracy"] == {"target": 1.0, "step": 2, "accuracy": 0.0, "reached": False}


def _source(root, stages=("basic", "intermediate"), every_limit=50, finished=2):
    """A finished run's files as match.stage_target reads them: curriculum.json, each stage's metrics.json, model/
    and history.jsonl (validation accuracy 0.2, 0.3 at steps 10, 20, on `every_limit` problems)."""
    root.mkdir(parents=True)
    (root / "curriculum.json").write_text(json.dumps({"stages": list(stages)}))
    for i, name in enumerate(stages[:finished]):
        stage_dir = root / f"{i + 1}_{name}"
        (stage_dir / "model").mkdir(parents=True)
        (stage_dir / "model" / "config.json").write_text("{}")
        (stage_dir / "metrics.json").write_text(json.dumps({"status": "completed"}))
        rows = [{"step": 10 * k, "stage": name, f"eval/{name}/accuracy": round(0.1 * (k + 1) + i / 100, 3),
                 f"eval/{name}/n": every_limit} for k in (1, 2)] + [{"step": 21, "stage": name, "loss": 0.5}]
        (stage_dir / "history.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return root


def test_each_stage_is_matched_to_the_other_runs_last_validation_accuracy_there(tmp_path):
    from grpo_exp.training.curriculum.sequential import _stage_config

    source = _source(tmp_path / "grpo")
    # as the continual sweep gives it: the method file sets the run's curriculum.match_accuracy_of
    user = ["curriculum=progressive", "logger=none", "method=sft_matched", f"curriculum.match_accuracy_of={source}"]
    cfg = compose_cfg(user, tmp_path / "run")
    validate(cfg)
    stages = list(cfg.curriculum.stages)
    cfgs = [_stage_config(cfg, user, stages, i, tmp_path / "run") for i in range(2)]
    assert [c.train.stop_at_accuracy for c in cfgs] == [0.3, 0.31]
    assert all(c.curriculum.get("match_accuracy_of") is None for c in cfgs)  # a stage carries its target, not the run
    plain = compose_cfg(["curriculum=progressive"], tmp_path / "plain")
    assert plain.curriculum.match_accuracy_of is None and match.stage_target(plain, stages, 0, cfgs[0]) is None


@pytest.mark.parametrize("source_args, stages, needle", [
    ({"finished": 1}, ["basic", "intermediate"], "its stage 2 (intermediate) has not finished"),
    ({"every_limit": 20}, ["basic", "intermediate"], "scored 20 validation problems during training (eval.every_limit) "
                                                      "and this run would score 50"),
    ({"stages": ("intermediate", "basic")}, ["basic", "intermediate"], "ran the stages ['intermediate', 'basic']"),
    (None, ["basic", "intermediate"], "holds no curriculum.json"),
])
def test_a_run_that_cannot_be_matched_is_one_line_naming_why(tmp_path, source_args, stages, needle):
    source = _source(tmp_path / "grpo", **source_args) if source_args is not None else tmp_path / "missing"
    cfg = compose_cfg(["curriculum=progressive", f"curriculum.match_accuracy_of={source}"], tmp_path / "run")
    with pytest.raises(ConfigError) as err:
        for i in range(len(stages)):
            match.stage_target(cfg, stages, i, compose_cfg([f"stage={stages[i]}"], tmp_path / "stage"))
    assert needle in str(err.value) and "\n" not in str(err.value)
    assert str(err.value).startswith(f"curriculum.match_accuracy_of={source}")


@pytest.mark.parametrize("overrides, needle", [
    (["train.stop_at_accuracy=1.5"], "train.stop_at_accuracy=1.5 must be an accuracy in [0, 1]"),
    (["train.stop_at_accuracy=0.4", "eval.every_steps=null"], "set eval.every_steps=<N>"),
    (["curriculum=adaptive", "curriculum.match_accuracy_of=/x"], "curriculum.mode=adaptive"),
])
def test_bad_matching_settings_are_one_line(tmp_path, overrides, needle):
    cfg = compose_cfg(overrides, tmp_path)
    with pytest.raises(ConfigError) as err:
        validate(cfg)
    assert needle in str(err.value) and "\n" not in str(err.value)


def test_the_report_names_a_matched_run_apart_from_sft_at_the_same_steps():
    record = {"ewc_lambda": 0, "method": "sft", "replay": 0}
    assert method_label(record, "method=sft") == "SFT"
    assert method_label({**record, "match_accuracy_of": "/runs/seed1_grpo"}, "method=sft_matched") == \
        "SFT, stopped at matched accuracy"
