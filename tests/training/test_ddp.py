"""Data-parallel training: real `torchrun --nproc_per_node=2 -m ...` runs of the train entrypoint on the
tiny model, one thread per process (gloo on the CPU).

The runs use tests/spread_reward_main.py: rewards with spread on random text, per-rank parameter dumps
after training (GRPO_EXP_TEST_PARAM_DUMP) and rollouts sampled per row (GRPO_EXP_TEST_ROW_SEEDED). TRL seeds
every rank differently, so without the latter N processes sample other completions than one process
would and the two runs could only be compared in distribution; with it, a completion depends on its prompt
alone, and everything after sampling (TRL's scoring, advantages over the gathered batch, the loss
normaliser, DDP's gradient all-reduce, AdamW, checkpoints) is the real code on both sides.

Tolerances: float sums in another order. The 2-process gradient is the mean of two half-batch gradients
(all-reduced), the 1-process one a single full-batch sum; after 4 AdamW steps at lr 1e-3 the weights
differed by at most 4e-7 when this test was written, so 2e-5 (a fiftieth of one step) leaves room without
hiding a wrong update (a missed all-reduce moved them by 8e-3). The Fisher is a mean of squared gradients
summed per rank and all-reduced: relative 1e-4 of its largest entry.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from grpo_exp.base.io import read_jsonl
from grpo_exp.training import checkpoints
from tests.conftest import ROOT, compose_cfg

pytestmark = pytest.mark.slow

STEPS = 4
RUN = ["debug=smoke", "logger=none", "reward.funcs=[vowel_fraction]", "reward.weights=[1.0]",
       "train.learning_rate=1e-3", "train.save_total_limit=null", "train.keep_final_checkpoint=true",
       "train.precision=fp32", f"train.max_steps={STEPS}",
       "train.save_steps=2", "ewc.lambda=1", "ewc.fisher_samples=6", "ewc.fisher_batch_size=2",
       "eval.every_steps=2"]
# the same global batch: 2 processes x 2 completions per step, or 1 process x 4
TWO = [*RUN, "cpu.threads=2", "train.per_device_train_batch_size=2"]
ONE = [*RUN, "cpu.threads=1", "train.per_device_train_batch_size=4"]
# The comparisons with one process sample through TRL's `generate`, which GRPO_EXP_TEST_ROW_SEEDED seeds per
# row; the default path (the rollout engine on a CPU) draws from each process's own stream, as TRL's does
# unseeded, and is trained by the `two` run
TRL_PATH = ["speed.generation=trl"]
PARAM_ATOL = 2e-5
FISHER_RTOL = 1e-4


def _env(dump: Path | None, **extra: str) -> dict:
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "PYTHONPATH": str(ROOT), "GRPO_EXP_TEST_ROW_SEEDED": "1", **extra}
    for var in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(var, None)  # a launcher around pytest must not leak into the runs
    if dump is not None:
        env["GRPO_EXP_TEST_PARAM_DUMP"] = str(dump)
    return env


def _torchrun(cwd: Path, args: list[str], dump: Path | None = None, **env: str) -> subprocess.CompletedProcess:
    # --standalone: a free port of its own, so concurrent runs do not collide on torchrun's default one
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
           "-m", "tests.spread_reward_main", *args]
    return subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=600, env=_env(dump, **env))


def _single(cwd: Path, args: list[str], dump: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "tests.spread_reward_main", *args], cwd=cwd, capture_output=True,
                          text=True, timeout=600, env=_env(dump))


def _params(dump: Path, rank: int = 0) -> dict[str, torch.Tensor]:
    return torch.load(dump / f"rank{rank}.pt", weights_only=True)


@pytest.fixture(scope="module")
def two(tmp_path_factory):
    """A 2-process run, launched without hydra.run.dir: the processes must agree on Hydra's timestamped one."""
    cwd = tmp_path_factory.mktemp("two")
    proc = _torchrun(cwd, TWO, dump=cwd / "dump")
    assert proc.returncode == 0, proc.stderr[-4000:]
    runs = list((cwd / "outputs" / "train" / "runs").iterdir())
    assert len(runs) == 1, f"the processes made {len(runs)} run directories: {runs}"
    return runs[0], cwd / "dump", proc


@pytest.fixture(scope="module")
def two_trl(tmp_path_factory):
    """The 2-process run through TRL's `generate`, row-seeded, to compare with `one`."""
    cwd = tmp_path_factory.mktemp("two_trl")
    proc = _torchrun(cwd, [*TWO, *TRL_PATH, f"hydra.run.dir={cwd / 'run'}"], dump=cwd / "dump")
    assert proc.returncode == 0, proc.stderr[-4000:]
    return cwd / "run", cwd / "dump", proc


@pytest.fixture(scope="module")
def one(tmp_path_factory):
    cwd = tmp_path_factory.mktemp("one")
    proc = _single(cwd, [*ONE, *TRL_PATH, f"hydra.run.dir={cwd / 'run'}"], dump=cwd / "dump")
    assert proc.returncode == 0, proc.stderr[-4000:]
    return cwd / "run", cwd / "dump"


def test_both_ranks_hold_identical_parameters(two):
    run_dir, dump, _ = two
    rank0, rank1 = _params(dump, 0), _params(dump, 1)
    assert rank0.keys() == rank1.keys()
    different = [name for name in rank0 if not torch.equal(rank0[name], rank1[name])]
    assert not different, f"ranks disagree on {different[:5]}"
    # and what rank 0 saved is what both hold
    saved = load_file(str(run_dir / "model" / "model.safetensors"))
    for name, value in rank0.items():
        torch.testing.assert_close(saved[name], value, rtol=0, atol=0)
    initial = load_file(str(run_dir / "checkpoints" / "checkpoint-2" / "model.safetensors"))
    assert any(not torch.equal(initial[n], v) for n, v in rank0.items() if n in initial)  # training moved them


def test_two_processes_match_one_process_with_the_same_global_batch(two_trl, one):
    (run2, dump2, _), (run1, dump1) = two_trl, one
    p2, p1 = _params(dump2), _params(dump1)
    worst = max((p2[n] - p1[n]).abs().max().item() for n in p1)
    assert worst <= PARAM_ATOL, f"parameters differ by {worst:.2e} (tolerance {PARAM_ATOL:.0e})"
    h2, h1 = read_jsonl(run2 / "history.jsonl"), read_jsonl(run1 / "history.jsonl")
    assert [r["step"] for r in h2] == [r["step"] for r in h1] == list(range(1, STEPS + 1))
    for a, b in zip(h2, h1):
        assert a["reward"] == pytest.approx(b["reward"], abs=1e-6)  # the same completions, all of them
        assert a["grad_norm"] == pytest.approx(b["grad_norm"], rel=1e-4)
    m2, m1 = (json.loads((d / "metrics.json").read_text()) for d in (run2, run1))
    assert m2["processes"] == 2 and m1["processes"] == 1
    # TRL gathers its figures over the processes: the step's tokens are the global batch's
    assert m2["completion_tokens_total"] == pytest.approx(m1["completion_tokens_total"])


def test_rank0_alone_writes_the_run_files(two):
    run_dir, _, proc = two
    metrics = json.loads((run_dir / "metrics.json").read_text())
    assert metrics["status"] == "completed" and metrics["cpu_threads"] == 1  # cpu.threads=2 over 2 processes
    assert json.loads((run_dir / "status.json").read_text())["status"] == "completed"
    assert [r["step"] for r in read_jsonl(run_dir / "history.jsonl")] == list(range(1, STEPS + 1))  # once each
    assert any("eval/basic/accuracy" in r for r in read_jsonl(run_dir / "history.jsonl"))  # rank 0's evaluation
    sampled = read_jsonl(run_dir / "completions.jsonl")  # step 1's, gathered from both ranks, written once
    assert [r["step"] for r in sampled] == [1] * 4
    assert (run_dir / "eval.json").is_file() and (run_dir / "before_after.md").is_file()
    assert "rank 1 of 2 done: peak RSS" in (run_dir / "train.rank1.log").read_text()  # rank 1's own log
    assert not (run_dir / "train.rank0.log").exists()
    assert (run_dir / ".hydra" / "config.yaml").is_file()
    ckpt = run_dir / "checkpoints" / "checkpoint-4"
    assert {"rng_state_0.pth", "rng_state_1.pth", "optimizer.pt", "grpo_exp_state.json"} <= {
        p.name for p in ckpt.iterdir()}
    assert not list((run_dir / "checkpoints").glob(".staging-*"))
    # the before/after table is printed once, by rank 0
    assert proc.stdout.count("| set (n) |") == 1


def test_the_samplers_mismatch_is_logged_from_both_processes(two):
    """The engine's fp32 copy samples for each process; the mismatch every process measures in its training
    forward is gathered (a collective each process reaches) and logged once: finite and, for an exact copy, tiny."""
    run_dir, _, _ = two
    logged = [r["rollout/kl"] for r in read_jsonl(run_dir / "history.jsonl") if "rollout/kl" in r]
    assert logged and all(0.0 <= kl < 1e-5 for kl in logged), logged


def test_the_fisher_of_two_processes_is_the_one_process_estimate(two_trl, one, tmp_path):
    """Each rank sampled and differentiated its share of the Fisher's batches; the all-reduced estimate is
    the one a single process computes on the same model (rank 0's model/), and the one-process run's."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from grpo_exp.core.data import stage_split
    from grpo_exp.training.ewc import consolidate_fisher

    run_dir, _, _ = two_trl
    got = load_file(str(run_dir / "fisher.safetensors"))
    cfg = compose_cfg([*ONE], tmp_path)
    model = AutoModelForCausalLM.from_pretrained(run_dir / "model")
    tokenizer = AutoTokenizer.from_pretrained(run_dir / "model")
    consolidate_fisher(cfg, model, tokenizer, stage_split(cfg.stage, "train", cfg.train.seed), None, tmp_path)
    want = load_file(str(tmp_path / "fisher.safetensors"))
    single_run = load_file(str(one[0] / "fisher.safetensors"))
    assert got.keys() == want.keys() == single_run.keys()
    for reference in (want, single_run):
        for name, value in reference.items():
            if name.startswith("fisher."):
                torch.testing.assert_close(got[name], value, rtol=0, atol=FISHER_RTOL * float(value.abs().max()))
    assert any(float(v.abs().max()) > 0 for n, v in got.items() if n.startswith("fisher."))


@pytest.mark.long  # a killed one-process run's resume is make test's (test_reliability.py)
def test_a_killed_two_process_run_resumes_to_the_uninterrupted_result(two, tmp_path):
    """Rank 0 dies (no clean-up) right after publishing checkpoint-2, torchrun takes rank 1 down; a 2-process
    resume takes over the lock, continues from checkpoint-2 with each rank's RNG state, and ends where the
    uninterrupted run ended."""
    run_dir = tmp_path / "run"
    killed = _torchrun(ROOT, [*TWO, f"hydra.run.dir={run_dir}"], GRPO_EXP_TEST_KILL_AT="published:checkpoint-2")
    assert killed.returncode != 0
    assert not (run_dir / "metrics.json").exists()
    assert [p.name for p in checkpoints.complete_checkpoints(run_dir / "checkpoints")] == ["checkpoint-2"]

    dump = tmp_path / "dump"
    resumed = _torchrun(ROOT, [*TWO, f"hydra.run.dir={run_dir}", "resume=true"], dump=dump)
    assert resumed.returncode == 0, resumed.stderr[-4000:]
    log = resumed.stdout + resumed.stderr
    assert "resuming from" in log and "took over the lock" in log
    assert [r["step"] for r in read_jsonl(run_dir / "history.jsonl")] == list(range(1, STEPS + 1))
    assert not list((run_dir / "checkpoints").glob(".staging-*"))  # the kill's leftover, removed by resume
    reference = _params(two[1])
    for rank in (0, 1):
        got = _params(dump, rank)
        worst = max((got[n] - reference[n]).abs().max().item() for n in reference)
        assert worst <= PARAM_ATOL, f"rank {rank} ends {worst:.2e} from the uninterrupted run"


def test_processes_that_do_not_divide_the_generation_batch_are_one_line(tmp_path):
    """Checked by every process before any model loads or the process group forms: rank 0 prints one line
    naming both numbers, the others exit silently with the same code."""
    args = ["-m", "grpo_exp.train", "debug=smoke", "logger=none", "train.steps_per_generation=null",
            "train.generation_batch_size=12", f"hydra.run.dir={tmp_path / 'run'}"]
    for rank in (0, 1):
        env = {**_env(None), "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2", "RANK": str(rank), "LOCAL_RANK": str(rank)}
        proc = subprocess.run([sys.executable, *args], cwd=ROOT, capture_output=True, text=True, timeout=300, env=env)
        assert proc.returncode == 2, proc.stderr[-2000:]
        lines = [line for line in proc.stderr.splitlines() if line.strip()]
        if rank == 0:
            assert len(lines) == 1, lines
            assert "2 processes do not divide the generation batch of 12 completions" in lines[0]
        else:
            assert lines == []
    assert not (tmp_path / "run").exists()


def test_threads_are_divided_among_the_processes_of_a_machine(monkeypatch):
    from grpo_exp.base import cpu

    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    assert cpu.process_threads(4) == 2
    assert cpu.process_threads(1) == 1  # never below one
    assert cpu.process_threads("auto") == max(1, cpu.resolve_threads("auto") // 2)
    monkeypatch.delenv("LOCAL_WORLD_SIZE")
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    assert cpu.process_threads(4) == 4
