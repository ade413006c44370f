"""Listing runs and sweeps under an outputs folder, and reading their completions and curves (what the web
app shows), on files laid out as training runs and Hydra sweeps write them."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from grpo_exp.analysis import report, runs


def write_run(path: Path, *, history=(), completions=(), status="completed", funcs=("correctness", "answer_format"),
              weights=(1.0, 0.05)) -> Path:
    (path / ".hydra").mkdir(parents=True)
    (path / ".hydra" / "overrides.yaml").write_text("- model=tiny_random\n")
    (path / ".hydra" / "config.yaml").write_text(
        "model:\n  name: tiny_random\nreward:\n  funcs: [%s]\n  weights: [%s]\n" % (", ".join(funcs),
                                                                               ", ".join(map(str, weights))))
    (path / "status.json").write_text(json.dumps({"status": status}))
    (path / "metrics.json").write_text(json.dumps({"status": status, "steps": len(history)}))
    (path / "history.jsonl").write_text("".join(json.dumps(r) + "\n" for r in history))
    if completions:
        (path / "completions.jsonl").write_text("".join(json.dumps(r) + "\n" for r in completions))
    (path / "model").mkdir()
    (path / "checkpoints" / "checkpoint-2").mkdir(parents=True)
    (path / "checkpoints" / "checkpoint-2" / "status.json").write_text("{}")  # not a run of its own
    return path


def test_runs_and_sweeps_are_found_and_nothing_else(tmp_path):
    single = write_run(tmp_path / "train" / "runs" / "2026-01-01_00-00-00.000001")
    sweep = tmp_path / "train" / "multiruns" / "2026-01-02_00-00-00.000001"
    sweep.mkdir(parents=True)
    (sweep / "multirun.yaml").write_text("{}")
    jobs = [write_run(sweep / str(i), status="failed" if i else "completed") for i in range(2)]
    curriculum = write_run(tmp_path / "curriculum_run")
    write_run(curriculum / "1_basic")  # a stage belongs to its run
    (tmp_path / ".app").mkdir()
    (tmp_path / ".app" / "status.json").write_text("{}")  # the app's own folder is not a run

    assert set(runs.find_runs(tmp_path)) == {single, *jobs, curriculum}
    assert runs.find_sweeps(tmp_path) == [sweep]
    assert runs.label(jobs[1], tmp_path) == "train/multiruns/2026-01-02_00-00-00.000001/1"
    table = runs.overview(tmp_path)
    assert len(table) == 4 and sorted(table["status"]) == ["completed", "completed", "completed", "failed"]


def test_an_empty_or_missing_folder_is_an_empty_table_and_says_so(tmp_path):
    assert runs.find_runs(tmp_path) == [] and runs.overview(tmp_path).empty
    assert "No runs under" in runs.empty_message(tmp_path)
    assert "does not exist" in runs.empty_message(tmp_path / "nowhere") and runs.find_runs(tmp_path / "nowhere") == []


def test_completions_carry_the_weighted_reward_and_filter_by_step_and_reward(tmp_path):
    rows = [{"step": s, "prompt": f"q{s}", "completion": f"c{s}{k}",
             "rewards": {"correctness": float(k), "answer_format": 1.0}, "advantage": k - 0.5}
            for s in (1, 6) for k in (0, 1)]
    run = write_run(tmp_path / "run", completions=rows)
    df = runs.read_completions(run)
    assert list(df.columns) == ["step", "prompt", "completion", "reward", "reward:answer_format",
                                "reward:correctness", "advantage"]
    assert df["reward"].tolist() == pytest.approx([0.05, 1.05, 0.05, 1.05])  # correctness + 0.05 x format
    assert len(runs.filter_completions(df, step=6)) == 2
    assert runs.filter_completions(df, min_reward=1.0)["completion"].tolist() == ["c11", "c61"]
    assert runs.filter_completions(df, step=1, max_reward=0.5)["completion"].tolist() == ["c10"]
    assert runs.completion_dirs(tmp_path) == [run]


def test_curves_pick_keys_and_patterns(tmp_path):
    history = [{"step": 1, "reward": 0.1, "eval/basic/accuracy": 0.2, "eval/basic/n": 4},
               {"step": 2, "reward": 0.3, "eval/basic/accuracy": 0.4, "eval/gsm8k/accuracy": 0.0}]
    jobs = runs.load([write_run(tmp_path / "run", history=history)], tmp_path)
    reward = runs.curves(jobs, "reward")
    assert reward["value"].tolist() == [0.1, 0.3] and set(reward["series"]) == {"run"}
    heldout = runs.curves(jobs, "eval/*/accuracy")
    assert sorted(zip(heldout["series"], heldout["step"])) == [("basic", 1), ("basic", 2), ("gsm8k", 2)]
    assert runs.curriculum_table(jobs[0]) is None


def test_a_run_still_training_is_running_not_failed(tmp_path):
    import os

    run = tmp_path / "run"
    (run / ".hydra").mkdir(parents=True)  # no metrics.json yet
    (run / ".lock").write_text(str(os.getpid()))  # what the trainer writes while it holds the lock
    assert runs.load([run], tmp_path)[0]["row"]["status"] == "running"
    # resumed after a failed attempt: running, without the old error; grpo-report reads it the same way
    (run / "status.json").write_text('{"status": "failed", "error": "ValueError: boom"}')
    row = report.load_job(run, root=tmp_path)["row"]
    assert (row["status"], row["error"]) == ("running", None)
    (run / ".lock").write_text("")  # released
    assert runs.load([run], tmp_path)[0]["row"]["status"] == "failed"
    assert report.load_job(run, root=tmp_path)["row"]["error"] == "ValueError: boom"
