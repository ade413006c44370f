"""Faults injected into real runs: SIGKILL and resume, a kill during a save, NaN rewards, SIGTERM,
unwritable output directories. Each run is the real entrypoint on the tiny model."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from grpo_exp.training import checkpoints
from grpo_exp.base.errors import ConfigError, DiskFullError, TrainingHalted
from grpo_exp.base.io import read_jsonl
from tests.conftest import ROOT, compose_cfg

SPREAD = ["debug=smoke", "logger=none", "reward.funcs=[vowel_fraction]", "reward.weights=[1.0]",
          "train.learning_rate=1e-3", "train.save_total_limit=null"]


@pytest.fixture
def test_rewards(monkeypatch):
    """The subprocess runner's rewards, registered for in-process runs of this test only."""
    from grpo_exp.core import rewards
    from tests import spread_reward_main

    for name, func in spread_reward_main.TEST_REWARDS.items():
        monkeypatch.setitem(rewards.REGISTRY, name, func)
    spread_reward_main._calls["n"] = 0
    return spread_reward_main


def _start(run_dir: Path, *extra: str, env: dict | None = None) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "tests.spread_reward_main", *SPREAD, *extra,
                             f"hydra.run.dir={run_dir}"], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})})


def _run(run_dir: Path, *extra: str, env: dict | None = None) -> subprocess.CompletedProcess:
    proc = _start(run_dir, *extra, env=env)
    out, err = proc.communicate(timeout=600)
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


def _wait_for(predicate, proc: subprocess.Popen, timeout: float = 300) -> None:
    deadline = time.time() + timeout
    while not predicate():
        if proc.poll() is not None:
            raise AssertionError(f"process ended early ({proc.returncode}): {proc.stderr.read()[-2000:]}")
        if time.time() > deadline:
            proc.kill()
            raise AssertionError("timed out waiting for the run")
        time.sleep(0.2)


def test_sigkill_then_resume_equals_an_uninterrupted_run(tmp_path):
    steps = ["train.max_steps=6", "train.save_steps=2"]
    ref = _run(tmp_path / "ref", *steps)
    assert ref.returncode == 0, ref.stderr[-3000:]

    killed_dir = tmp_path / "killed"
    proc = _start(killed_dir, *steps)
    _wait_for(lambda: checkpoints.last_checkpoint(killed_dir / "checkpoints") is not None
              and checkpoints.checkpoint_step(checkpoints.last_checkpoint(killed_dir / "checkpoints")) >= 4, proc)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert not (killed_dir / "metrics.json").exists()

    resumed = _run(killed_dir, *steps, "resume=true")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "resuming from" in resumed.stdout + resumed.stderr

    ref_metrics = json.loads((tmp_path / "ref" / "metrics.json").read_text())
    got_metrics = json.loads((killed_dir / "metrics.json").read_text())
    assert got_metrics["steps"] == ref_metrics["steps"] == 6
    ref_hist, got_hist = read_jsonl(tmp_path / "ref" / "history.jsonl"), read_jsonl(killed_dir / "history.jsonl")
    assert [r["step"] for r in got_hist] == [1, 2, 3, 4, 5, 6]  # appended after the checkpoint, not restarted
    for a, b in zip(ref_hist, got_hist):
        assert b["reward"] == pytest.approx(a["reward"], abs=1e-5)
        assert b["loss"] == pytest.approx(a["loss"], abs=1e-4)
    ref_opt = torch.load(tmp_path / "ref" / "checkpoints" / "checkpoint-6" / "optimizer.pt", weights_only=False)
    got_opt = torch.load(killed_dir / "checkpoints" / "checkpoint-6" / "optimizer.pt", weights_only=False)
    for key, state in ref_opt["state"].items():
        torch.testing.assert_close(got_opt["state"][key]["exp_avg"], state["exp_avg"], rtol=1e-3, atol=1e-6)
    assert any(s["exp_avg"].abs().sum() > 0 for s in ref_opt["state"].values())  # training really moved

    again = _run(killed_dir, *steps, "resume=true")  # a finished run is never retrained
    assert again.returncode == 0 and "not retrained" in again.stdout
    assert read_jsonl(killed_dir / "history.jsonl") == got_hist


def test_a_kill_during_a_save_leaves_the_previous_checkpoint_loadable(tmp_path, monkeypatch, test_rewards):
    from grpo_exp.training.stage import train

    cfg = compose_cfg([*SPREAD, "train.max_steps=4", "train.save_steps=2"], tmp_path)
    real_publish = checkpoints.publish

    def die_on_second_save(staging, final):
        if final.name == "checkpoint-4":
            raise KeyboardInterrupt("killed while saving")  # the rename never happens, as with SIGKILL
        real_publish(staging, final)

    monkeypatch.setattr(checkpoints, "publish", die_on_second_save)
    with pytest.raises(KeyboardInterrupt):
        train(cfg)
    ckpts = checkpoints.complete_checkpoints(tmp_path / "checkpoints")
    assert [p.name for p in ckpts] == ["checkpoint-2"]
    from transformers import AutoModelForCausalLM

    AutoModelForCausalLM.from_pretrained(ckpts[0])  # loadable
    assert json.loads((ckpts[0] / checkpoints.STATE_FILE).read_text())["stage"] == "basic"

    # What a SIGKILL mid-save leaves (a staging directory) is cleared when resuming.
    leftover = tmp_path / "checkpoints" / ".staging-checkpoint-4" / "checkpoint-4"
    leftover.mkdir(parents=True)
    (leftover / "model.safetensors").write_bytes(b"partial")
    monkeypatch.setattr(checkpoints, "publish", real_publish)
    metrics = train(compose_cfg([*SPREAD, "train.max_steps=4", "train.save_steps=2", "resume=true"], tmp_path))
    assert metrics["steps"] == 4 and metrics["resumed_from"].endswith("checkpoint-2")
    assert not list((tmp_path / "checkpoints").glob(".staging-*"))


def test_nan_reward_stops_with_the_step_and_keeps_the_checkpoint(tmp_path, test_rewards):
    from grpo_exp.training.stage import train

    spread_reward_main = test_rewards
    os.environ["GRPO_EXP_TEST_NAN_AFTER"] = "2"
    try:
        cfg = compose_cfg([*SPREAD, "reward.funcs=[vowel_fraction,nan_after]", "reward.weights=[1.0,1.0]",
                           "train.max_steps=5", "train.save_steps=1"], tmp_path / "stop")
        with pytest.raises(TrainingHalted, match="nan_after.*step 3"):
            train(cfg)
        assert [p.name for p in checkpoints.complete_checkpoints(tmp_path / "stop" / "checkpoints")] == [
            "checkpoint-1", "checkpoint-2"]
        assert not (tmp_path / "stop" / "metrics.json").exists()

        spread_reward_main._calls["n"] = 0
        cfg = compose_cfg([*SPREAD, "reward.funcs=[vowel_fraction,nan_after]", "reward.weights=[1.0,1.0]",
                           "train.max_steps=4", "on_nonfinite=skip"], tmp_path / "skip")
        metrics = train(cfg)
        assert metrics["steps"] == 4 and metrics["skipped_batches"] == 2
    finally:
        os.environ.pop("GRPO_EXP_TEST_NAN_AFTER", None)


def test_nan_reward_through_the_entrypoint_is_one_line_and_exit_3(tmp_path):
    proc = _run(tmp_path / "run", "reward.funcs=[vowel_fraction,nan_after]", "reward.weights=[1.0,1.0]",
                "train.max_steps=3", env={"GRPO_EXP_TEST_NAN_AFTER": "0"})
    assert proc.returncode == 3, proc.stderr[-2000:]
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1 and "step 1" in errors[0]


def test_sigterm_saves_a_checkpoint_and_exits_nonzero(tmp_path):
    run_dir = tmp_path / "run"
    proc = _start(run_dir, "train.max_steps=50", "train.save_steps=100")
    _wait_for(lambda: len(read_jsonl(run_dir / "history.jsonl")) >= 1, proc)
    proc.send_signal(signal.SIGTERM)
    proc.communicate(timeout=300)
    assert proc.returncode == 128 + signal.SIGTERM
    last = checkpoints.last_checkpoint(run_dir / "checkpoints")
    assert last is not None and 1 <= checkpoints.checkpoint_step(last) < 50
    assert json.loads((run_dir / "metrics.json").read_text())["status"] == "interrupted"


def test_unwritable_output_directory_is_a_clear_error(tmp_path):
    from grpo_exp.training.stage import train

    blocker = tmp_path / "a_file"
    blocker.write_text("not a directory")
    with pytest.raises(ConfigError, match="cannot write to the output directory"):
        train(compose_cfg(["debug=smoke", "logger=none"], blocker / "run"))


def test_a_full_disk_during_a_save_is_one_line_and_keeps_the_last_checkpoint(tmp_path, test_rewards):
    """A real ENOSPC: checkpoint-4's trainer_state.json is a link to /dev/full, where every write fails."""
    from grpo_exp.training.stage import train

    cfg = compose_cfg([*SPREAD, "train.max_steps=4", "train.save_steps=2"], tmp_path)
    doomed = checkpoints.staging_dir(tmp_path / "checkpoints" / "checkpoint-4") / "checkpoint-4"
    doomed.mkdir(parents=True)
    (doomed / "trainer_state.json").symlink_to("/dev/full")
    with pytest.raises(DiskFullError, match=r"checkpoint-4 not written: the disk holding .* is full") as info:
        train(cfg)
    assert "\n" not in str(info.value) and "last complete checkpoint is kept" in str(info.value)
    ckpts = checkpoints.complete_checkpoints(tmp_path / "checkpoints")
    assert [p.name for p in ckpts] == ["checkpoint-2"]
    assert not list((tmp_path / "checkpoints").glob(".staging-*"))  # the partial write is gone
    from transformers import AutoModelForCausalLM

    AutoModelForCausalLM.from_pretrained(ckpts[0])  # loadable


def test_a_full_disk_while_saving_model_dir_changes_nothing(tmp_path):
    from grpo_exp.core import models
    from grpo_exp.base.io import save_model_dir

    cfg = compose_cfg(["debug=smoke"], tmp_path / "run")
    model, tokenizer = models.load(cfg.model, cfg.paths.cache_dir, seed=0)
    target = save_model_dir(model, tokenizer, tmp_path / "model")
    before = {p.name: p.read_bytes() for p in target.iterdir()}

    class FullDisk:  # a tokenizer whose files land on a full disk, as a real one would fail there
        def save_pretrained(self, directory):
            with open("/dev/full", "w") as fh:
                fh.write("x" * 65536)
                fh.flush()

    with pytest.raises(DiskFullError, match="model not written: the disk holding .* is full"):
        save_model_dir(model, FullDisk(), target)
    assert {p.name: p.read_bytes() for p in target.iterdir()} == before
    assert [p.name for p in tmp_path.iterdir()] == ["model"]  # no temporary directory left
