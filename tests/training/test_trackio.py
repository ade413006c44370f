"""logger=trackio: a real tiny sweep writes one local trackio project that trackio's own CLI reads back;
the step offset, resume, end-of-run tables and a trackio that cannot start, in-process."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

pytest.importorskip("trackio", reason="the trackio extra is not installed: pip install -e '.[trackio]'")

from grpo_exp.training import trackio_tracking  # noqa: E402
from tests.conftest import compose_cfg, run_module  # noqa: E402

PROJECT = "grpo-exp"


@pytest.fixture
def trackio_env(tmp_path, monkeypatch):
    """TRACKIO_DIR pointing elsewhere (the run must not write there); restored after the test."""
    elsewhere = tmp_path / "default_trackio_dir"
    monkeypatch.setenv("TRACKIO_DIR", str(elsewhere))
    return elsewhere


def trackio_cli(storage: Path, *args: str) -> dict:
    """`trackio <args> --json` as a user would run it on that storage directory."""
    trackio_bin = Path(sys.executable).with_name("trackio")
    proc = subprocess.run([str(trackio_bin), *args, "--json"], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "TRACKIO_DIR": str(storage)})
    assert proc.returncode == 0, proc.stderr[-2000:]
    return json.loads(proc.stdout)


@pytest.mark.slow
def test_sweep_jobs_land_in_one_trackio_project(tmp_path, trackio_env):
    sweep_dir = tmp_path / "trackio_sweep"
    proc = run_module("grpo_exp.train", "-m", "debug=smoke", "cpu.threads=1", "train.seed=1,2", "logger=trackio",
                      "eval.every_steps=1", f"hydra.sweep.dir={sweep_dir}", timeout=500,
                      env={"TRACKIO_DIR": str(trackio_env)})
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "trackio did not start" not in proc.stderr
    storage = sweep_dir / "trackio"
    assert (storage / f"{PROJECT}.db").is_file()
    assert not trackio_env.exists(), "the run must store under the sweep directory, not TRACKIO_DIR"
    for job in ("0", "1"):
        assert json.loads((sweep_dir / job / trackio_tracking.RUN_FILE).read_text())["dir"] == str(storage.resolve())

    runs = trackio_cli(storage, "list", "runs", "--project", PROJECT)["runs"]
    assert sorted(runs) == ["tiny_random-basic-math-t1-job0", "tiny_random-basic-math-t1-job1"]
    for name in runs:
        run = trackio_cli(storage, "get", "run", "--project", PROJECT, "--run", name)
        assert {"train/reward", "train/loss", "train/rewards/correctness/mean", "train/global_step",
                "train/stage_step", "resources/rss_mb", "resources/completion_tokens_per_s",
                "eval/basic/accuracy", "eval/results", "completions", "summary"} <= set(run["metrics"])
        config = run["config"]
        assert config["_Group"] == "trackio_sweep"  # the sweep, as wandb's group
        assert {"model:tiny_random", "stage:basic", "multirun", "debug:smoke"} <= set(config["tags"])
        assert config["job_type"] == "basic" and config["model"]["name"] == "tiny_random"
        assert config["train"]["max_steps"] == 2 and config["step_offset"] == 0
        steps = trackio_cli(storage, "get", "metric", "--project", PROJECT, "--run", name,
                            "--metric", "train/global_step")["values"]
        assert [v["value"] for v in steps] == [1, 2] and [v["step"] for v in steps] == [1, 2]
        rewards = trackio_cli(storage, "get", "metric", "--project", PROJECT, "--run", name,
                              "--metric", "train/reward")["values"]
        assert len(rewards) == 2 and all(0.0 <= v["value"] <= 2.0 for v in rewards)


def _logs(storage: Path, run: str) -> list[dict]:
    trackio_tracking.use_storage(storage)
    from trackio.sqlite_storage import SQLiteStorage

    return SQLiteStorage.get_logs(PROJECT, run)


def _table(rows: list[dict], key: str) -> list[dict]:
    [value] = [r[key] for r in rows if key in r]
    assert value["_type"] == "trackio.table"
    return value["_value"]


def test_stage_offset_tables_and_resume(tmp_path, trackio_env):
    import trackio

    run_dir = tmp_path / "run"
    cfg = compose_cfg(["debug=smoke", "logger=trackio", "logger.tags=[mine]"], run_dir)
    tracker = trackio_tracking.start(cfg, run_dir, step_offset=5)
    assert tracker is not None and tracker.storage == (run_dir / "trackio").resolve()
    callback = trackio_tracking._make_callback(tracker, None)
    state = SimpleNamespace(global_step=1, is_world_process_zero=True)
    callback.on_log(None, state, None, logs={"loss": 0.25, "reward": 0.5, "eval/basic/accuracy": 0.75,
                                             "skipped_reason": "none"})
    trackio.log({"profiling/Time taken: generate": 0.1}, step=1)  # as TRL's timers log: a stage step
    callback.on_log(None, state, None, logs={"train_runtime": 3.0, "train_loss": 0.25})  # HF's closing line
    (run_dir / "completions.jsonl").write_text(json.dumps(
        {"step": 1, "prompt": "What is 2 + 2?", "completion": "4", "rewards": {"correctness": 1.0}, "advantage": 0.5}
    ) + "\n")
    trackio_tracking.finish(tracker, {"steps": 1, "eval": {"basic": {"accuracy": 0.5, "n": 4}}}, failed=False)

    name = tracker.run.name
    assert name.startswith("tiny_random-basic-math-t")
    rows = _logs(tracker.storage, name)
    [train_row] = [r for r in rows if "train/loss" in r]
    assert train_row["step"] == 6 and train_row["train/global_step"] == 6 and train_row["train/stage_step"] == 1
    assert train_row["train/reward"] == 0.5 and train_row["eval/basic/accuracy"] == 0.75
    assert "train/skipped_reason" not in train_row and "train/train_runtime" not in train_row
    [profiling] = [r for r in rows if "profiling/Time taken: generate" in r]
    assert profiling["step"] == 6, "TRL's per-stage steps go onto the cumulative axis"
    assert _table(rows, "eval/results") == [{"set": "basic", "accuracy": 0.5, "n": 4}]
    assert _table(rows, "completions")[0]["global_step"] == 6
    summary = {r["key"]: r["value"] for r in _table(rows, "summary")}
    assert summary["steps"] == 1 and summary["train_runtime"] == 3.0 and summary["eval/basic/accuracy"] == 0.5
    from trackio.sqlite_storage import SQLiteStorage

    config = SQLiteStorage.get_run_config(PROJECT, name)
    assert "mine" in config["tags"] and config["step_offset"] == 5

    # The same run directory continues its run; a failure is recorded in the summary.
    again = trackio_tracking.start(cfg, run_dir, step_offset=5)
    assert again is not None and again.run.id == tracker.run.id
    trackio_tracking.finish(again, None, failed=True)
    summaries = [{r["key"]: r["value"] for r in t["summary"]["_value"]} for t in _logs(tracker.storage, name)
                 if "summary" in t]
    assert [s.get("status") for s in summaries] == [None, "failed"]

    # Another run directory sharing the database is a new run, though its name is the same.
    other_dir = tmp_path / "other"
    shared = compose_cfg(["debug=smoke", "logger=trackio", f"logger.dir={tracker.storage}"], other_dir)
    other = trackio_tracking.start(shared, other_dir)
    assert other is not None and other.run.id != tracker.run.id
    other.log_step({"train/loss": 1.0}, 1)  # trackio records a run with its first row
    trackio_tracking.finish(other, None)
    assert len(SQLiteStorage.get_run_records(PROJECT)) == 2
    assert not trackio_env.exists()


def test_trackio_that_cannot_start_leaves_training_untracked(tmp_path, trackio_env, caplog):
    blocker = tmp_path / "a_file"
    blocker.write_text("not a directory")
    cfg = compose_cfg(["debug=smoke", "logger=trackio", f"logger.dir={blocker}/trackio"], tmp_path / "run")
    with caplog.at_level(logging.WARNING, logger="grpo_exp"):
        assert trackio_tracking.start(cfg, tmp_path / "run") is None
    assert any("trackio did not start" in r.getMessage() and r.levelname == "WARNING" for r in caplog.records)
    trackio_tracking.finish(None, {"steps": 1}, failed=False)  # a no-op

    disabled = compose_cfg(["debug=smoke", "logger=trackio", "logger.mode=disabled"], tmp_path / "run2")
    assert trackio_tracking.start(disabled, tmp_path / "run2") is None
    assert not (tmp_path / "run2" / "trackio").exists()


@pytest.mark.slow
@pytest.mark.parametrize("args,needle", [
    (["logger=trackoi"], "unknown logger option 'trackoi' (did you mean 'trackio'?); valid choices: none, trackio, wandb"),
    (["logger=trackio", "logger.mode=online"], "logger.mode='online' is not valid with logger=trackio"),
])
def test_bad_logger_options_fail_in_one_line(tmp_path, args, needle):
    proc = run_module("grpo_exp.train", *args, f"hydra.run.dir={tmp_path / 'run'}", timeout=120)
    assert proc.returncode != 0
    assert needle in proc.stderr, proc.stderr[-2000:]
    assert len([line for line in proc.stderr.splitlines() if line.strip()]) == 1, proc.stderr
    assert not (tmp_path / "run" / "model").exists()
