"""wandb tracking (offline, in-process) and the psutil resource monitor."""

from __future__ import annotations

import json
import mmap
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from grpo_exp.training import tracking
from grpo_exp.base.monitor import MonitorCallback, ResourceSampler, peak_rss_mb
from tests.conftest import compose_cfg


@pytest.fixture
def wandb_env(tmp_path, monkeypatch):
    """Offline wandb whose caches and settings stay inside the test's temporary directory."""
    monkeypatch.setenv("WANDB_MODE", "offline")
    for var, sub in (("WANDB_DATA_DIR", "data"), ("WANDB_CACHE_DIR", "cache"), ("WANDB_CONFIG_DIR", "config")):
        monkeypatch.setenv(var, str(tmp_path / "wandb_home" / sub))


def _run_file(run_dir: Path, run_id: str) -> list[Path]:
    return sorted(run_dir.glob(f"wandb/offline-run-*-{run_id}/run-{run_id}.wandb"))


def _records(run_file: Path, kind: str) -> list:
    return [r for r in tracking.offline_records(run_file) if r.WhichOneof("record_type") == kind]


def _wait_written(run_file: Path, timeout: float = 30.0) -> Path:
    """wandb-core writes the offline file asynchronously: wait for its exit record."""
    deadline = time.monotonic() + timeout
    while not _records(run_file, "exit") and time.monotonic() < deadline:
        time.sleep(0.2)
    return run_file


def test_monitor_reports_plausible_rss():
    sampler = ResourceSampler()
    before = sampler.rss_mb()
    size_mb = 128
    # An anonymous mmap of our own, every page written: its pages cannot be ones that an allocator kept resident
    # after an earlier test freed them. Both torch's allocator and numpy's malloc were seen doing that in
    # full-suite runs, which left RSS unchanged (order-dependent failures).
    block = mmap.mmap(-1, size_mb * 2**20)
    for _ in range(size_mb):
        block.write(b"\x01" * 2**20)
    sampler.sample()
    after = sampler.rss_mb()
    assert 50 < after < 16_000
    assert after - before >= 0.8 * size_mb
    assert sampler.max_rss_mb >= after - 1 and peak_rss_mb() >= after - 1
    block.close()


def test_monitor_row_carries_cumulative_step_and_resources(tmp_path):
    monitor = MonitorCallback(tmp_path / "history.jsonl", completions_per_step=4, step_offset=10, stage="basic")
    state = SimpleNamespace(global_step=3)
    monitor.on_step_begin(None, state, None)
    monitor.on_step_end(None, state, None)
    monitor.on_log(None, state, None, logs={"reward": 0.5, "completions/mean_length": 8.0})
    row = monitor.rows[-1]
    assert row["step"] == 3 and row["global_step"] == 13 and row["completion_tokens"] == 32
    assert 50 < row["rss_mb"] <= row["peak_rss_mb"] and "cpu_percent/core0" in row
    metrics = tracking.resource_metrics(row)
    assert {"resources/rss_mb", "resources/peak_rss_mb", "resources/cpu_percent/core0",
            "resources/completion_tokens_per_s"} <= metrics.keys()
    assert json.loads((tmp_path / "history.jsonl").read_text())["global_step"] == 13


def test_mode_follows_config_then_environment(monkeypatch):
    monkeypatch.delenv("WANDB_MODE", raising=False)
    assert tracking.resolve_mode(SimpleNamespace(mode="offline")) == "offline"
    monkeypatch.setenv("WANDB_MODE", "online")
    assert tracking.resolve_mode(SimpleNamespace(mode="offline")) == "online"
    assert tracking.resolve_mode(SimpleNamespace(mode="disabled")) == "disabled"
    monkeypatch.setenv("WANDB_MODE", "offline")
    assert tracking.resolve_mode(SimpleNamespace(mode="online")) == "online"


def test_offline_run_summary_tables_and_resume(tmp_path, wandb_env):
    run_dir = tmp_path / "run"
    cfg = compose_cfg(["debug=smoke", "logger=wandb", "logger.tags=[mine]"], run_dir)
    tracker = tracking.start(cfg, run_dir, step_offset=5)
    assert tracker is not None
    run_id = (run_dir / tracking.RUN_ID_FILE).read_text().strip()
    assert run_id == tracker.run.id
    (run_dir / "completions.jsonl").write_text(json.dumps(
        {"step": 1, "prompt": "What is 2 + 2?", "completion": "4", "rewards": {"correctness": 1.0}, "advantage": 0.5}
    ) + "\n")
    tracking.finish(tracker, {"steps": 2, "peak_rss_mb": 900.0, "eval": {"basic": {"accuracy": 0.5, "n": 4}}},
                    failed=False)

    [first] = _run_file(run_dir, run_id)
    _wait_written(first)
    [run] = _records(first, "run")
    assert run.run.job_type == "basic" and "model:tiny_random" in run.run.tags and "mine" in run.run.tags
    summary = {"/".join(i.nested_key) or i.key: json.loads(i.value_json)
               for r in _records(first, "summary") for i in r.summary.update}
    assert summary["steps"] == 2 and summary["eval/basic/accuracy"] == 0.5
    logged = {k for row in tracking.offline_history(first) for k in row}
    assert {"eval/results/_type", "completions/_type"} <= logged
    assert _records(first, "exit")[0].exit.exit_code == 0

    # A second start in the same run directory continues the same wandb run; a failure is recorded.
    time.sleep(1.1)  # wandb names run folders by the second: keep the two apart
    again = tracking.start(cfg, run_dir)
    assert again is not None and again.run.id == run_id
    tracking.finish(again, None, failed=True)
    files = _run_file(run_dir, run_id)
    assert len(files) == 2
    assert _records(_wait_written(files[-1]), "exit")[0].exit.exit_code == 1


def test_wandb_that_cannot_start_leaves_training_untracked(tmp_path, wandb_env, monkeypatch, caplog):
    import wandb

    def broken_init(**kwargs):
        raise PermissionError("dir is not writable")

    monkeypatch.setattr(wandb, "init", broken_init)
    cfg = compose_cfg(["debug=smoke", "logger=wandb"], tmp_path / "run")
    assert tracking.start(cfg, tmp_path / "run") is None
    assert any("wandb did not start" in r.getMessage() and r.levelname == "WARNING" for r in caplog.records)
    tracking.finish(None, {"steps": 1}, failed=False)  # a no-op

    disabled = compose_cfg(["debug=smoke", "logger=wandb", "logger.mode=disabled"], tmp_path / "run2")
    assert tracking.start(disabled, tmp_path / "run2") is None
