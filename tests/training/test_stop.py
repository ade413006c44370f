"""Ctrl-C and SIGTERM stop a run within 30 s wherever it is (compilation, generation, reward scoring, evaluation,
saving), on the tiny model and on the default one: status.json says `stopped`, the exit code is 128 + signal, the
last complete checkpoint is in place and nothing is half-written; a checkpoint is written on a stop only if a step
finished since the last one; the run resumes (`resume=true`) from what the stop left, and a run stopped and resumed
ends where an uninterrupted one ends. A second signal exits at once.

Each run is the real entrypoint (tests/stop_main.py: the train app with hooks that mark when a phase starts and
stretch the tiny model's phases, so that a signal can be sent inside one)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from grpo_exp.base import stop
from grpo_exp.base.io import read_jsonl
from grpo_exp.training import checkpoints
from tests.conftest import ROOT
from tests.training.test_reliability import SPREAD

STOP_WITHIN_S = 30
TINY = [*SPREAD, "eval.after_train=false"]
# the default model, kept small: 4 completions of 32 tokens a step, one round a step, no evaluation unless asked for
DEFAULT = ["model=smollm2_135m", "logger=none", "train.max_completion_length=32", "train.num_generations=2",
           "train.per_device_train_batch_size=4", "train.steps_per_generation=1", "eval.after_train=false",
           "eval.every_steps=null"]


class Run:
    """One run of tests/stop_main.py in `run_dir`, its output in <run_dir>.log, its phase marks in <run_dir>.marks."""

    def __init__(self, run_dir: Path, *overrides: str, slow: str = "", env: dict | None = None):
        self.run_dir, self.marks = run_dir, run_dir.with_name(run_dir.name + ".marks")
        self.log_path = run_dir.with_name(run_dir.name + ".log")
        self.log = self.log_path.open("a")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "tests.stop_main", *overrides, f"hydra.run.dir={run_dir}"], cwd=ROOT,
            stdout=self.log, stderr=subprocess.STDOUT, start_new_session=True,  # its own group, as a terminal's job
            env={**os.environ, "PYTHONUNBUFFERED": "1", "HF_HUB_OFFLINE": "1", "GRPO_EXP_TEST_MARKS": str(self.marks),
                 "GRPO_EXP_TEST_SLOW": slow, **(env or {})})

    def read(self) -> str:
        return self.log_path.read_text(errors="replace")

    def wait_for_mark(self, name: str, timeout: float = 300) -> None:
        """Until the phase `name` has started (test_reliability's _wait_for, reading the log file)."""
        deadline = time.time() + timeout
        while not (self.marks / name).exists():
            if self.proc.poll() is not None:
                raise AssertionError(f"the run ended ({self.proc.returncode}) before {name}:\n{self.read()[-3000:]}")
            if time.time() > deadline:
                self.proc.kill()
                raise AssertionError(f"timed out waiting for {name}")
            time.sleep(0.1)

    def signal(self, signum: int, group: bool = False) -> float:
        """Send `signum` (to the process group, as Ctrl-C in a terminal does); returns when it was sent."""
        os.killpg(self.proc.pid, signum) if group else self.proc.send_signal(signum)
        return time.time()

    def ended_within(self, sent: float, limit: float = STOP_WITHIN_S) -> float:
        """Seconds from `sent` to the process's end, failing past `limit`."""
        try:
            self.proc.wait(timeout=limit + 30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            raise AssertionError(f"still running {limit + 30} s after the signal:\n{self.read()[-3000:]}")
        took = time.time() - sent
        self.log.close()
        assert took <= limit, f"the run took {took:.1f} s to stop after the signal (limit {limit} s)"
        return took

    def finish(self, timeout: float = 600) -> int:
        code = self.proc.wait(timeout=timeout)
        self.log.close()
        return code


def _checkpoint_names(run_dir: Path) -> list[str]:
    return [p.name for p in checkpoints.complete_checkpoints(run_dir / "checkpoints")]


def assert_stopped(run: Run, signum: int, where: str) -> None:
    """Exit 128 + signal, status.json `stopped`, the log line saying where (`where` and what it kept), nothing
    half-written."""
    run_dir = run.run_dir
    assert run.proc.returncode == 128 + signum, run.read()[-3000:]
    status = json.loads((run_dir / "status.json").read_text())
    assert status["status"] == "stopped" and status["error"].startswith(f"stopped by {signal.Signals(signum).name}")
    assert f"stopped by {signal.Signals(signum).name} {where}" in (run_dir / "train.log").read_text()
    assert_nothing_half_written(run_dir)


def assert_nothing_half_written(run_dir: Path) -> None:
    """No staging or retired directory, no temporary file, every checkpoint directory complete."""
    leftovers = [str(p.relative_to(run_dir)) for p in run_dir.rglob("*")
                 if p.name.startswith(checkpoints.STAGING_PREFIX) or p.name.endswith((".retired", ".tmp"))
                 or ".tmp-" in p.name]
    assert not leftovers, leftovers
    ckpt_dir = run_dir / "checkpoints"
    every = sorted(p.name for p in ckpt_dir.iterdir()) if ckpt_dir.is_dir() else []
    assert every == sorted(_checkpoint_names(run_dir)), every


def resume(run_dir: Path, *overrides: str) -> dict:
    """Resume the run to its end; returns its metrics.json."""
    run = Run(run_dir, *overrides, "resume=true")
    assert run.finish() == 0, run.read()[-3000:]
    assert json.loads((run_dir / "status.json").read_text())["status"] == "completed"
    assert_nothing_half_written(run_dir)
    return json.loads((run_dir / "metrics.json").read_text())


def _steps(run_dir: Path) -> list[int]:
    return [row["step"] for row in read_jsonl(run_dir / "history.jsonl")]


def _compiler_or_skip() -> None:
    from grpo_exp.base.cpu import compiler_missing

    why = compiler_missing()
    if why:
        pytest.skip(f"no compilation to stop: {why}")


# ------------------------------------------------------------------------------------------- the stop request


def test_a_signal_is_a_stop_request_that_polls_raise_where_a_step_may_be_abandoned():
    before = signal.getsignal(signal.SIGTERM)
    with stop.handling():
        stop.check("nothing asked yet")
        os.kill(os.getpid(), signal.SIGTERM)
        assert stop.requested() == signal.SIGTERM
        with pytest.raises(stop.Stopped, match="stopped by SIGTERM during generation") as info:
            stop.check("generation")
        assert info.value.code == 128 + signal.SIGTERM and isinstance(info.value, SystemExit)
    assert signal.getsignal(signal.SIGTERM) is before and stop.requested() is None  # nothing left pending
    with stop.handling(abandon=False):  # data-parallel: the step is finished, GracefulStop ends the run after it
        stop.request()
        stop.check("generation")
        assert stop.requested() == signal.SIGTERM


def test_a_signal_inside_an_urgent_region_raises_out_of_it_at_once():
    """A region that cannot poll (torch.compile, a reward function): the handler raises Stopped itself."""
    with stop.handling():
        started = time.time()
        with pytest.raises(stop.Stopped, match="during compilation"):
            with stop.urgent("compilation"):
                os.kill(os.getpid(), signal.SIGINT)
                time.sleep(30)  # what compiling would do, polling nothing
        assert time.time() - started < 5
        with pytest.raises(stop.Stopped):  # a region entered after the request raises on entry
            with stop.urgent("reward scoring"):
                pass


# ------------------------------------------------------------------------------------------------ tiny model


@pytest.mark.slow
def test_a_stop_in_generation_writes_the_finished_step_and_resumes_to_the_uninterrupted_result(tmp_path):
    """Step 3 is abandoned in its rollout; step 2 had finished and had no checkpoint, so checkpoint-2 is written,
    with the RNG states step 2 left: the resumed run's rewards and weights are the uninterrupted run's."""
    exact = [*TINY, "train.learning_rate=1e-3", "train.max_steps=4", "train.save_steps=100", "cpu.threads=1"]
    whole = Run(tmp_path / "whole", *exact)  # one thread each: on a second core while the other run is stopped
    run = Run(tmp_path / "run", *exact, slow="generation-3=0.2")  # the round the signal is sent in
    run.wait_for_mark("generation-3")
    took = run.ended_within(run.signal(signal.SIGTERM))
    assert_stopped(run, signal.SIGTERM, "during generation in step 3 (abandoned); checkpoint-2 written")
    assert _checkpoint_names(run.run_dir) == ["checkpoint-2"] and _steps(run.run_dir) == [1, 2]
    assert not (run.run_dir / "model").exists()  # resuming needs the checkpoint alone
    assert json.loads((run.run_dir / "metrics.json").read_text())["status"] == "interrupted"
    print(f"tiny model, SIGTERM in generation: ended {took:.1f} s after it")

    resumed = resume(run.run_dir, *exact)
    assert resumed["resumed_from"].endswith("checkpoint-2") and _steps(run.run_dir) == [1, 2, 3, 4]
    assert whole.finish() == 0, whole.read()[-3000:]
    rewards = [[row["reward"] for row in read_jsonl(d / "history.jsonl")] for d in (run.run_dir, whole.run_dir)]
    assert rewards[0] == rewards[1]
    from safetensors.torch import load_file

    stopped, uninterrupted = (load_file(str(d / "model" / "model.safetensors")) for d in (run.run_dir, whole.run_dir))
    assert all((stopped[k] - uninterrupted[k]).abs().max() <= 1e-6 for k in uninterrupted)


@pytest.mark.slow
def test_a_stop_in_generation_after_a_checkpointed_step_keeps_that_checkpoint_as_it_is(tmp_path):
    args = [*TINY, "train.max_steps=4", "train.save_steps=2"]
    run = Run(tmp_path / "run", *args, slow="generation-3=0.2")
    run.wait_for_mark("generation-3")
    before = (run.run_dir / "checkpoints" / "checkpoint-2" / "trainer_state.json").stat().st_mtime_ns
    run.ended_within(run.signal(signal.SIGTERM))
    assert_stopped(run, signal.SIGTERM, "during generation in step 3 (abandoned); the last checkpoint is checkpoint-2")
    assert _checkpoint_names(run.run_dir) == ["checkpoint-2"]
    assert (run.run_dir / "checkpoints" / "checkpoint-2" / "trainer_state.json").stat().st_mtime_ns == before
    assert resume(run.run_dir, *args)["steps"] == 4


@pytest.mark.slow
def test_ctrl_c_in_a_reward_function_that_never_returns_stops_the_first_step(tmp_path):
    """Ctrl-C reaches the run's whole process group; the reward function sleeps two minutes without polling, so the
    signal handler itself raises out of it. No step finished: no checkpoint, and resuming starts afresh."""
    args = [*TINY, "reward.funcs=[vowel_fraction,sleepy]", "reward.weights=[1.0,1.0]", "train.max_steps=2"]
    run = Run(tmp_path / "run", *args, slow="reward-1=120")
    run.wait_for_mark("reward-1")
    time.sleep(1)
    took = run.ended_within(run.signal(signal.SIGINT, group=True))
    assert_stopped(run, signal.SIGINT, "during reward scoring in step 1 (abandoned); no checkpoint")
    assert _checkpoint_names(run.run_dir) == [] and _steps(run.run_dir) == []
    print(f"tiny model, Ctrl-C in reward scoring: ended {took:.1f} s after it")
    assert resume(run.run_dir, *args)["steps"] == 2


@pytest.mark.slow
def test_a_stop_in_the_held_out_evaluation_saves_the_step_it_follows(tmp_path):
    args = [*TINY, "train.max_steps=3", "train.save_steps=100", "eval.every_steps=1"]
    run = Run(tmp_path / "run", *args, slow="hold-eval-during=120")
    run.wait_for_mark("eval-during")
    took = run.ended_within(run.signal(signal.SIGTERM))
    assert_stopped(run, signal.SIGTERM, "at the end of step 1")
    assert "during evaluation at step 1: the step finished, so it is saved" in run.read()
    assert _checkpoint_names(run.run_dir) == ["checkpoint-1"] and _steps(run.run_dir) == [1]
    print(f"tiny model, SIGTERM in the held-out evaluation: ended {took:.1f} s after it")
    assert resume(run.run_dir, *args)["steps"] == 3 and _steps(run.run_dir) == [1, 2, 3]


@pytest.mark.slow
def test_a_stop_in_the_evaluation_after_training_keeps_the_final_checkpoint(tmp_path):
    args = [*SPREAD, "train.max_steps=2"]  # debug=smoke evaluates after training
    run = Run(tmp_path / "run", *args, slow="hold-eval-after=120")
    run.wait_for_mark("eval-after")
    took = run.ended_within(run.signal(signal.SIGTERM))
    assert_stopped(run, signal.SIGTERM, "during evaluation after training (step 2)")
    assert _checkpoint_names(run.run_dir) == ["checkpoint-2"] and not (run.run_dir / "metrics.json").exists()
    print(f"tiny model, SIGTERM in the evaluation after training: ended {took:.1f} s after it")
    metrics = resume(run.run_dir, *args)
    assert metrics["steps"] == 2 and (run.run_dir / "eval.json").is_file()


@pytest.mark.slow
def test_a_stop_during_compilation_raises_out_of_torch_compile(tmp_path):
    """A cold compile cache, so that the decoding step really compiles when the signal comes."""
    _compiler_or_skip()
    args = [*TINY, "train.max_steps=2", "speed.rollout_compile=true"]
    run = Run(tmp_path / "run", *args, env={"TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "inductor")})
    run.wait_for_mark("compilation")
    time.sleep(1)
    took = run.ended_within(run.signal(signal.SIGTERM))
    assert_stopped(run, signal.SIGTERM, "during compilation in step 1 (abandoned); no checkpoint")
    assert "decoding step compiled in" not in run.read()
    print(f"tiny model, SIGTERM in compilation: ended {took:.1f} s after it")


@pytest.mark.slow
def test_a_second_signal_exits_at_once_and_resume_repairs_what_it_cut_short(tmp_path):
    """The first SIGTERM comes while checkpoint-2 is being published (made to take a minute): a save is not
    abandoned, so the run would wait for it; the second exits at once. checkpoint-1 stays whole, the staging
    directory of checkpoint-2 is what resume removes."""
    args = [*TINY, "train.max_steps=3", "train.save_steps=1", "train.save_total_limit=null"]
    run = Run(tmp_path / "run", *args, slow="save-checkpoint-2=60")
    run.wait_for_mark("save-checkpoint-2")
    run.signal(signal.SIGTERM)
    time.sleep(2)
    assert run.proc.poll() is None  # still saving
    took = run.ended_within(run.signal(signal.SIGTERM), limit=5)
    assert run.proc.returncode == 128 + signal.SIGTERM
    assert "SIGTERM again: exiting at once" in run.read()
    assert _checkpoint_names(run.run_dir) == ["checkpoint-1"]
    assert list((run.run_dir / "checkpoints").glob(checkpoints.STAGING_PREFIX + "*"))
    print(f"tiny model, second SIGTERM: ended {took:.1f} s after it")
    metrics = resume(run.run_dir, *args)
    assert metrics["resumed_from"].endswith("checkpoint-1") and _steps(run.run_dir) == [1, 2, 3]


# --------------------------------------------------------------------------------------------- default model


@pytest.mark.long  # minutes of SmolLM2-135M on two cores: make test-long (the tiny model's stops stay in make test)
def test_the_default_model_stops_during_compilation_and_resumes(tmp_path):
    """SmolLM2-135M compiling its decoding step from a cold cache (half a minute or more on two cores)."""
    _compiler_or_skip()
    args = [*DEFAULT, "train.max_steps=1"]
    env = {"TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "inductor")}
    run = Run(tmp_path / "run", *args, env=env)
    run.wait_for_mark("compilation")
    time.sleep(3)
    took = run.ended_within(run.signal(signal.SIGTERM))
    assert_stopped(run, signal.SIGTERM, "during compilation in step 1 (abandoned); no checkpoint")
    assert not (run.run_dir / "model").exists()
    print(f"default model, SIGTERM in compilation: ended {took:.1f} s after it")
    again = Run(run.run_dir, *args, "resume=true", env=env)
    assert again.finish() == 0, again.read()[-3000:]
    assert json.loads((run.run_dir / "status.json").read_text())["status"] == "completed"
    assert _steps(run.run_dir) == [1] and _checkpoint_names(run.run_dir) == ["checkpoint-1"]


@pytest.mark.long
def test_the_default_model_stops_during_evaluation_then_during_generation(tmp_path):
    """The held-out evaluation after step 1 is stopped (step 1 saved); the resumed run, stopped in step 2's rollout,
    keeps checkpoint-1 as it is."""
    args = [*DEFAULT, "train.max_steps=2", "train.save_steps=100", "eval.every_steps=1", "eval.every_limit=8",
            "eval.batch_size=4"]
    run = Run(tmp_path / "run", *args, slow="hold-eval-during=120")
    run.wait_for_mark("eval-during")
    took = run.ended_within(run.signal(signal.SIGTERM))
    assert_stopped(run, signal.SIGTERM, "at the end of step 1")
    assert _checkpoint_names(run.run_dir) == ["checkpoint-1"] and not (run.run_dir / "model").exists()
    print(f"default model, SIGTERM in the held-out evaluation: ended {took:.1f} s after it (checkpoint written)")

    for mark in run.marks.iterdir():
        mark.unlink()
    again = Run(run.run_dir, *args, "resume=true")
    again.wait_for_mark("generation-1")  # the resumed run's first round: step 2's
    took = again.ended_within(again.signal(signal.SIGTERM))
    assert "resuming from" in again.read() and _steps(run.run_dir) == [1]
    assert_stopped(again, signal.SIGTERM, "during generation in step 2 (abandoned); the last checkpoint is "
                                          "checkpoint-1")
    print(f"default model, SIGTERM in generation: ended {took:.1f} s after it")
