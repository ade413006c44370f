"""Faults injected into real runs: SIGKILL and resume, a kill during a save, NaN rewards, SIGTERM,
unwritable output directories. Each run is the real entrypoint on the tiny model."""

from __future__ import annotations

import json
import math
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
          "train.learning_rate=1e-3", "train.save_total_limit=null", "train.keep_final_checkpoint=true"]


def _start(run_dir: Path, *extra: str, env: dict | None = None, log=subprocess.PIPE) -> subprocess.Popen:
    """`log`: an open file for both streams of a run nobody reads while it goes (a full pipe would stall it)."""
    return subprocess.Popen([sys.executable, "-m", "tests.spread_reward_main", *SPREAD, *extra,
                             f"hydra.run.dir={run_dir}"], cwd=ROOT, stdout=log,
                            stderr=subprocess.STDOUT if log is not subprocess.PIPE else subprocess.PIPE,
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


@pytest.mark.slow
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


def rewards_registry():
    from grpo_exp.core import rewards

    return rewards.REGISTRY


@pytest.mark.slow
def test_nan_reward_stops_with_the_step_and_keeps_the_checkpoint(tmp_path, test_rewards):
    from grpo_exp.training.stage import train

    test_rewards.reset_calls()
    os.environ["GRPO_EXP_TEST_NAN_AFTER"] = "2"
    try:
        cfg = compose_cfg([*SPREAD, "reward.funcs=[vowel_fraction,nan_after]", "reward.weights=[1.0,1.0]",
                           "train.max_steps=5", "train.save_steps=1"], tmp_path / "stop")
        with pytest.raises(TrainingHalted, match="nan_after.*step 3"):
            train(cfg)
        assert [p.name for p in checkpoints.complete_checkpoints(tmp_path / "stop" / "checkpoints")] == [
            "checkpoint-1", "checkpoint-2"]
        assert not (tmp_path / "stop" / "metrics.json").exists()

    finally:
        os.environ.pop("GRPO_EXP_TEST_NAN_AFTER", None)


@pytest.mark.slow
@pytest.mark.parametrize("layout", [
    ["train.gradient_accumulation_steps=1"],
    # the other layouts repeat the case with accumulation and with several steps a round: make test-long's
    pytest.param(["train.gradient_accumulation_steps=2", "train.per_device_train_batch_size=2",
                  "train.steps_per_generation=null"], marks=pytest.mark.long),
    pytest.param(["train.steps_per_generation=2"], marks=pytest.mark.long),
])
def test_a_skipped_step_changes_no_parameter_or_optimizer_state(tmp_path, test_rewards, monkeypatch, layout):
    """on_nonfinite=skip: the round whose rewards hold a NaN trains nothing (every step fed by it, every
    micro-batch), AdamW's state and the LR schedule stay bit-identical, and the run then goes on and learns."""
    from grpo_exp.training.stage import train
    from grpo_exp.training.trainer import GrpoExpTrainer

    spread_reward_main = test_rewards
    spread_reward_main.reset_calls()
    nan_calls = {2}  # the second generation round's rewards hold a NaN; the others are clean

    def nan_on_call(completions, **kwargs):
        spread_reward_main._calls["n"] += 1
        bad = spread_reward_main._calls["n"] in nan_calls
        return [math.nan if bad and i == 0 else 0.0 for i in range(len(completions))]

    monkeypatch.setitem(rewards_registry(), "nan_after", nan_on_call)
    snapshots = []

    def snapshot(trainer):
        opt = trainer.optimizer.optimizer if hasattr(trainer.optimizer, "optimizer") else trainer.optimizer
        return ({n: p.detach().clone() for n, p in trainer.model.named_parameters()},
                {i: {k: (v.clone() if torch.is_tensor(v) else v) for k, v in st.items()} for i, st in opt.state.items()},
                trainer.lr_scheduler.last_epoch)

    real_step = GrpoExpTrainer.training_step

    def recording_step(self, *args, **kwargs):
        snapshots.append((self.state.global_step, self._step, snapshot(self)))
        return real_step(self, *args, **kwargs)

    monkeypatch.setattr(GrpoExpTrainer, "training_step", recording_step)
    cfg = compose_cfg([*SPREAD, "reward.funcs=[vowel_fraction,nan_after]", "reward.weights=[1.0,1.0]",
                       "train.max_steps=6", "on_nonfinite=skip", "train.lr_scheduler_type=linear", *layout],
                      tmp_path / "skip")
    metrics = train(cfg)
    spg = cfg.train.steps_per_generation or cfg.train.gradient_accumulation_steps
    steps_per_round = max(spg // cfg.train.gradient_accumulation_steps, 1)
    assert metrics["steps"] == 6 and metrics["skipped_steps"] == steps_per_round
    # the state before the poisoned round's first step equals the state after its last one
    by_step = {}
    for global_step, _, state in snapshots:
        by_step.setdefault(global_step, state)
    first = steps_per_round  # round 2 starts at this optimizer step
    before, after = by_step[first], by_step[first + steps_per_round]
    for name, value in before[0].items():
        assert torch.equal(value, after[0][name]), name
    assert before[1].keys() == after[1].keys()
    for i, state in before[1].items():
        for key, value in state.items():
            assert torch.equal(value, after[1][i][key]) if torch.is_tensor(value) else value == after[1][i][key]
    assert before[2] == after[2]  # the LR schedule did not advance
    # the clean round before it trained, and so did the run after it
    assert any(not torch.equal(by_step[0][0][n], v) for n, v in before[0].items())
    from safetensors.torch import load_file

    final = load_file(str(tmp_path / "skip" / "model" / "model.safetensors"))
    assert any(not torch.equal(after[0][n], final[n]) for n in final if n in after[0])
    history = read_jsonl(tmp_path / "skip" / "history.jsonl")
    skipped = [r for r in history if r.get("skipped_update")]
    assert len(skipped) == steps_per_round and "returned nan" in skipped[0]["skipped_reason"]


@pytest.mark.slow
def test_nan_reward_through_the_entrypoint_is_one_line_and_exit_3(tmp_path):
    proc = _run(tmp_path / "run", "reward.funcs=[vowel_fraction,nan_after]", "reward.weights=[1.0,1.0]",
                "train.max_steps=3", env={"GRPO_EXP_TEST_NAN_AFTER": "0"})
    assert proc.returncode == 3, proc.stderr[-2000:]
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1 and "step 1" in errors[0]


@pytest.mark.long  # a repeat of a make test case (below)
def test_sigterm_saves_a_checkpoint_and_exits_nonzero(tmp_path):
    """make test-long's: make test's test_stop.py::test_a_stop_in_generation_writes_the_finished_step_and_resumes_to_
    the_uninterrupted_result checks the same (SIGTERM mid-run: exit 128 + 15, the last finished step checkpointed,
    metrics.json `interrupted`)."""
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


@pytest.mark.slow
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


def test_a_full_disk_while_saving_model_dir_changes_nothing(tmp_path, tiny_model):
    from grpo_exp.base.io import save_model_dir

    model, tokenizer = tiny_model
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


@pytest.mark.slow
@pytest.mark.parametrize("kill_at", ["published:checkpoint-4",  # the other two points are make test-long's
                                     pytest.param("published:model", marks=pytest.mark.long),
                                     pytest.param("retired:model", marks=pytest.mark.long)])
def test_a_kill_inside_a_publish_is_repaired_on_resume(tmp_path, kill_at):
    """A fault hook kills the run (no clean-up) at a step of publishing checkpoint-4 or model/; resume
    leaves exactly one complete copy, which loads, and a history with every step once."""
    from transformers import AutoModelForCausalLM

    run_dir = tmp_path / "run"
    args = ("train.max_steps=4", "train.save_steps=2")
    if kill_at.startswith("retired"):  # model/ must already exist to be moved aside: an interrupted first save
        first = _run(run_dir, *args, env={"GRPO_EXP_TEST_KILL_AT": "published:model"})
        assert first.returncode == 137
    proc = _run(run_dir, *args, *(["resume=true"] if kill_at.startswith("retired") else []),
                env={"GRPO_EXP_TEST_KILL_AT": kill_at})
    assert proc.returncode == 137, proc.stderr[-2000:]
    assert not (run_dir / "metrics.json").exists()
    done = _run(run_dir, *args, "resume=true")
    assert done.returncode == 0, done.stderr[-2000:]
    assert json.loads((run_dir / "metrics.json").read_text())["status"] == "completed"
    names = sorted(p.name for p in run_dir.iterdir())
    assert "model" in names and not [n for n in names if n.endswith(".retired") or n.startswith("model.tmp")]
    ckpts = sorted(p.name for p in (run_dir / "checkpoints").iterdir())
    assert ckpts == ["checkpoint-2", "checkpoint-4"], ckpts
    AutoModelForCausalLM.from_pretrained(run_dir / "model")
    AutoModelForCausalLM.from_pretrained(run_dir / "checkpoints" / "checkpoint-4")
    steps = [r["step"] for r in read_jsonl(run_dir / "history.jsonl")]
    assert steps == [1, 2, 3, 4]


@pytest.mark.slow
def test_a_second_run_on_a_locked_directory_fails_naming_the_holder(tmp_path):
    from grpo_exp.training.run_dir import RunLock

    run_dir = tmp_path / "run"
    run_dir.mkdir()
    holder = subprocess.Popen([sys.executable, "-c", "import fcntl, os, sys, time\n"
                               f"fh = open({str(run_dir / '.lock')!r}, 'a+'); fcntl.flock(fh, fcntl.LOCK_EX)\n"
                               "fh.write(str(os.getpid())); fh.flush(); print('locked', flush=True); time.sleep(60)"],
                              stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "locked"
        proc = _run(run_dir, "train.max_steps=1")
        assert proc.returncode == 2
        errors = [line for line in proc.stderr.splitlines() if line.strip()]
        assert len(errors) == 1 and f"in use by another run (PID {holder.pid})" in errors[0]
        assert not (run_dir / "metrics.json").exists() and not (run_dir / "model").exists()
    finally:
        holder.kill()
        holder.wait()
    # the holder is dead: its lock is taken over, with a warning naming it
    lock = RunLock(run_dir).acquire()
    lock.release()


@pytest.mark.slow
def test_resume_with_changed_training_settings_names_each_key(tmp_path, test_rewards):
    from grpo_exp.training.stage import train

    run = [*SPREAD, "train.max_steps=2", "train.save_steps=1"]
    train(compose_cfg([*run[:-2], "train.max_steps=4", "train.save_steps=1"], tmp_path))
    (tmp_path / "metrics.json").unlink()  # as if it had been killed before finishing
    with pytest.raises(ConfigError) as info:
        train(compose_cfg([*SPREAD, "train.max_steps=4", "train.save_steps=1", "train.learning_rate=5e-4",
                           "train.temperature=0.5", "resume=true", "cpu.threads=1"], tmp_path))
    message = str(info.value)
    assert "\n" not in message and "train.learning_rate (0.001 -> 0.0005)" in message
    assert "train.temperature (0.8 -> 0.5)" in message and "cpu.threads" not in message
    assert "resume_allow_changes=true" in message
    metrics = train(compose_cfg([*SPREAD, "train.max_steps=4", "train.save_steps=1", "train.learning_rate=5e-4",
                                 "resume=true", "resume_allow_changes=true"], tmp_path))
    assert metrics["status"] == "completed"


@pytest.mark.long  # the single kills above are make test's; five in a row are make test-long's
def test_soak_five_sigkills_at_random_points_end_where_an_uninterrupted_run_ends(tmp_path, request):
    """SIGKILL at 5 seeded-random moments (mid-step, mid-save, mid-log), resuming after each: the final
    weights and optimizer state equal an uninterrupted run's (atol 1e-5, rtol 1e-4: thread scheduling may
    reorder float sums), the history holds every step once with the same rewards and losses, nothing
    half-written is left, and resuming the finished run trains nothing more."""
    import random

    from safetensors.torch import load_file

    steps = ["train.max_steps=20", "train.save_steps=1", "cpu.threads=1"]  # one thread: no reduction-order noise
    # the uninterrupted run goes on the other core meanwhile (one thread each, so neither waits on the other)
    ref_log = (tmp_path / "ref.log").open("w")
    ref_proc = _start(tmp_path / "ref", *steps, log=ref_log)
    request.addfinalizer(ref_proc.kill)  # a no-op once it has ended; stops it where an assertion below fails
    request.addfinalizer(ref_log.close)
    run_dir, rng = tmp_path / "soak", random.Random(20261126)
    history = run_dir / "history.jsonl"
    for kill in range(5):
        proc = _start(run_dir, *steps, *(["resume=true"] if kill else []))
        target = 3 * kill + rng.randint(1, 2)  # spread over the run, so it cannot finish before the fifth kill
        _wait_for(lambda: len(read_jsonl(history, tolerant=True)) >= target, proc)
        time.sleep(rng.uniform(0.0, 1.0))  # somewhere inside the next step, its save or its log line
        assert proc.poll() is None, "the run finished before it could be killed"
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        assert not (run_dir / "metrics.json").exists()  # a killed run never looks finished
    done = _run(run_dir, *steps, "resume=true")
    assert done.returncode == 0, done.stderr[-3000:]
    assert "resuming from" in done.stdout + done.stderr
    assert json.loads((run_dir / "metrics.json").read_text())["steps"] == 20
    assert ref_proc.wait(timeout=600) == 0, (tmp_path / "ref.log").read_text()[-3000:]
    ref_hist, got_hist = read_jsonl(tmp_path / "ref" / "history.jsonl"), read_jsonl(history)
    assert [r["step"] for r in got_hist] == list(range(1, 21))  # each step once, appended after its checkpoint
    for a, b in zip(ref_hist, got_hist):
        assert b["reward"] == pytest.approx(a["reward"], abs=1e-5)
        assert b["loss"] == pytest.approx(a["loss"], abs=1e-4)
    ref_opt = torch.load(tmp_path / "ref" / "checkpoints" / "checkpoint-20" / "optimizer.pt", weights_only=False)
    got_opt = torch.load(run_dir / "checkpoints" / "checkpoint-20" / "optimizer.pt", weights_only=False)
    for key, state in ref_opt["state"].items():
        torch.testing.assert_close(got_opt["state"][key]["exp_avg"], state["exp_avg"], rtol=1e-3, atol=1e-6)
    assert any(s["exp_avg"].abs().sum() > 0 for s in ref_opt["state"].values())  # training really moved
    ref_weights = load_file(str(tmp_path / "ref" / "model" / "model.safetensors"))
    got_weights = load_file(str(run_dir / "model" / "model.safetensors"))
    assert ref_weights.keys() == got_weights.keys()
    for name, value in ref_weights.items():
        torch.testing.assert_close(got_weights[name], value, atol=1e-5, rtol=1e-4)
    leftovers = [p.name for p in (*run_dir.iterdir(), *(run_dir / "checkpoints").iterdir())
                 if p.name.startswith((".staging-", "model.tmp-")) or p.name.endswith(".retired")]
    assert not leftovers

    again = _run(run_dir, *steps, "resume=true")  # a finished run is never retrained
    assert again.returncode == 0 and "not retrained" in again.stdout
    assert read_jsonl(history) == got_hist


def test_resume_of_a_run_older_than_an_option_left_at_its_default(tmp_path):
    """A run started before speed.generation existed trained with TRL's generation: resuming it with that path
    named is not a change, but with today's default (auto: the engine on a CPU) or the engine it is."""
    from grpo_exp.training.run_dir import SETTINGS_FILE, record_or_compare, training_settings

    cfg = compose_cfg(["debug=smoke"], tmp_path)
    recorded = {k: v for k, v in training_settings(cfg).items()
                if k != "speed.generation" and not k.startswith("resolved.")}  # such a record kept no resolved choices
    (tmp_path / SETTINGS_FILE).write_text(json.dumps(recorded))
    record_or_compare(compose_cfg(["debug=smoke", "resume=true", "speed.generation=trl"], tmp_path), tmp_path)
    for choice in ("auto", "engine"):
        with pytest.raises(ConfigError, match=rf"speed.generation \('<unset>' -> '{choice}'\)"):
            record_or_compare(compose_cfg(["debug=smoke", "resume=true", f"speed.generation={choice}"], tmp_path),
                              tmp_path)
    with pytest.raises(ConfigError, match=r"speed.generation \('<unset>' -> 'auto'\)"):  # the default
        record_or_compare(compose_cfg(["debug=smoke", "resume=true"], tmp_path), tmp_path)


def test_a_record_from_before_the_speed_group_resumes_under_the_new_names(tmp_path):
    """Runs recorded their speed switches as train.* keys: the same settings under speed.* resume, a changed one
    is named by its new key."""
    from grpo_exp.config.speed import MOVED
    from grpo_exp.training.run_dir import SETTINGS_FILE, record_or_compare, training_settings

    old_name = {new: f"train.{old}" for old, new in MOVED.items() if new != "speed.exact_shortcuts"}
    recorded = {}
    for key, value in training_settings(compose_cfg(["debug=smoke"], tmp_path)).items():
        prefix = "resolved." if key.startswith("resolved.") else ""
        base = key[len(prefix):]
        if base in ("speed.name", "speed.exact_shortcuts"):
            continue  # keys the old records did not have
        recorded[prefix + old_name.get(base, base)] = value
    recorded.update({"train.shared_prefix": True, "train.lean_reference": True, "train.rollout_scoring": "batch"})
    assert "train.rollout" in recorded and "speed.generation" not in recorded
    (tmp_path / SETTINGS_FILE).write_text(json.dumps(recorded))
    record_or_compare(compose_cfg(["debug=smoke", "resume=true"], tmp_path), tmp_path)
    with pytest.raises(ConfigError, match=r"speed.rollout_sampler \('cdf' resolved to 'cdf' at the start -> 'multinomial'"):
        record_or_compare(compose_cfg(["debug=smoke", "resume=true", "speed.rollout_sampler=multinomial"],
                                      tmp_path), tmp_path)


def test_a_run_recorded_with_train_extra_options_resumes_under_their_train_keys(tmp_path):
    """train.epsilon_high and the other policy-loss options were train.extra.* before they were train.* keys: a run
    recorded with +train.extra.epsilon_high=0.28 resumes with train.epsilon_high=0.28 (the spelling the config
    check now asks for), and another value is named by its train.* key."""
    from grpo_exp.training.run_dir import SETTINGS_FILE, record_or_compare, training_settings

    recorded = {k: v for k, v in training_settings(compose_cfg(["debug=smoke"], tmp_path)).items()
                if k not in ("train.epsilon_high", "train.importance_sampling_level", "train.entropy_coef",
                             "train.top_entropy_quantile")}  # keys such a record did not have
    recorded["train.extra.epsilon_high"] = 0.28
    (tmp_path / SETTINGS_FILE).write_text(json.dumps(recorded))
    record_or_compare(compose_cfg(["debug=smoke", "resume=true", "train.epsilon_high=0.28"], tmp_path), tmp_path)
    with pytest.raises(ConfigError, match=r"train.epsilon_high \(0.28 -> 0.3\)"):
        record_or_compare(compose_cfg(["debug=smoke", "resume=true", "train.epsilon_high=0.3"], tmp_path), tmp_path)
    with pytest.raises(ConfigError, match=r"train.epsilon_high \(0.28 -> None\)"):
        record_or_compare(compose_cfg(["debug=smoke", "resume=true"], tmp_path), tmp_path)


@pytest.mark.parametrize("key,before", [("speed.attention", "sdpa"), ("speed.logprob_kernel", "trl")])
def test_resume_of_a_run_older_than_an_option_whose_default_changed(tmp_path, key, before):
    """A run recorded before the option existed trained as its first behaviour did (sdpa; TRL's kernel), not
    as today's default `auto`: naming that behaviour resumes it, the default is a change."""
    from grpo_exp.training.run_dir import SETTINGS_FILE, record_or_compare, training_settings

    recorded = {k: v for k, v in training_settings(compose_cfg(["debug=smoke"], tmp_path)).items()
                if k != key and not k.startswith("resolved.")}  # such a record kept no resolved choices
    (tmp_path / SETTINGS_FILE).write_text(json.dumps(recorded))
    record_or_compare(compose_cfg(["debug=smoke", "resume=true", f"{key}={before}"], tmp_path), tmp_path)
    with pytest.raises(ConfigError, match=rf"{key} \('<unset>' -> 'auto'\)"):
        record_or_compare(compose_cfg(["debug=smoke", "resume=true"], tmp_path), tmp_path)


def test_a_resume_compares_what_each_auto_resolved_to(tmp_path):
    """`auto` picks by machine and version: the record keeps what each choice resolved to at the start, and a
    resume where the same setting resolves otherwise (another machine kind, a newer default) is a change, named
    with the value that trains as the run started; naming that value resumes."""
    from grpo_exp.base.cpu import resolve_precision
    from grpo_exp.training.run_dir import SETTINGS_FILE, record_or_compare, resolved_choices

    cfg = compose_cfg(["debug=smoke"], tmp_path)
    record_or_compare(cfg, tmp_path)
    recorded = json.loads((tmp_path / SETTINGS_FILE).read_text())
    here = resolve_precision("auto")
    assert recorded["train.precision"] == "auto" and recorded["resolved.train.precision"] == here
    assert {f"resolved.{k}": v for k, v in resolved_choices(cfg).items()}.items() <= recorded.items()
    record_or_compare(compose_cfg(["debug=smoke", "resume=true"], tmp_path), tmp_path)  # the same machine
    # started where auto picked the other precision and the other log-prob kernel (another machine, an older
    # version)
    other = {"bf16": "fp32", "fp32": "bf16"}[here]
    kernel = recorded["resolved.speed.logprob_kernel"]
    other_kernel = {"trl": "autocast", "autocast": "trl"}[kernel]
    there = resolved_choices(compose_cfg(["debug=smoke", f"train.precision={other}",
                                          f"speed.logprob_kernel={other_kernel}"], tmp_path))
    (tmp_path / SETTINGS_FILE).write_text(json.dumps({**{k: v for k, v in recorded.items()
                                                         if not k.startswith("resolved.")},
                                                      **{f"resolved.{k}": v for k, v in there.items()}}))
    with pytest.raises(ConfigError) as info:
        record_or_compare(compose_cfg(["debug=smoke", "resume=true"], tmp_path), tmp_path)
    message = str(info.value)
    assert "\n" not in message
    assert (f"train.precision ('auto' resolved to '{other}' at the start -> 'auto' resolves to '{here}' here; "
            f"train.precision={other} trains as it started)") in message
    assert f"speed.logprob_kernel={other_kernel} trains as it started" in message
    assert "speed.attention" not in message  # resolved alike: not a change
    # naming what auto picked at the start is no change, though the value as given differs ('auto' -> 'trl')
    record_or_compare(compose_cfg(["debug=smoke", "resume=true", f"train.precision={other}",
                                   f"speed.logprob_kernel={other_kernel}"], tmp_path), tmp_path)
    with pytest.raises(ConfigError, match="train.precision") as info:  # naming one leaves the other's change
        record_or_compare(compose_cfg(["debug=smoke", "resume=true", f"speed.logprob_kernel={other_kernel}"],
                                      tmp_path), tmp_path)
    assert "speed.logprob_kernel" not in str(info.value)
    # resume_allow_changes goes on, and records what this process resolved
    record_or_compare(compose_cfg(["debug=smoke", "resume=true", "resume_allow_changes=true"], tmp_path), tmp_path)
    assert json.loads((tmp_path / SETTINGS_FILE).read_text())["resolved.train.precision"] == here
