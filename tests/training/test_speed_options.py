"""Every speed option still makes a correct GRPO step (finite loss, moved parameters, the plain path's batch
shapes), and grpo-bench runs end to end. No timing assertions: timings belong to the benchmark."""

from __future__ import annotations

import json
import math
import statistics
import subprocess
import sys
import time

import pytest
import torch

from grpo_exp.training import shared_prefix
from grpo_exp.config.recipe import generation_batch
from tests.conftest import ROOT, compose_cfg
from tests.training.briefly import train_briefly

# debug=smoke: tiny random model, 2 prompts x 2 completions per step; 8 tokens
FAST = ["debug=smoke", "stage.num_train=16", "train.learning_rate=1e-3", "logger=none", "train.max_completion_length=8",
        "reward.funcs=[vowel_fraction]", "reward.weights=[1.0]", "train.save_steps=100"]

OPTIONS = {
    "plain": [],
    "steps_per_generation=2": ["train.steps_per_generation=2"],
    "generation_batch_size=8": ["train.generation_batch_size=8", "train.steps_per_generation=null"],
    "static_cache": ["+train.extra.cache_implementation=static"],
    "precision=fp32": ["train.precision=fp32"],
    "threads=1": ["cpu.threads=1"],
    "train=fast": ["train=fast"],
    "exact_shortcuts=false": ["speed.exact_shortcuts=false"],
    "speed=trl": ["speed=trl"],
    "gradient_checkpointing": ["train.gradient_checkpointing=true"],
    "beta=0.04 (reference model)": ["train.beta=0.04"],
    "logprob_kernel=autocast": ["speed.logprob_kernel=autocast"],
    "saved_tensors=lean (bf16)": (["train.precision=bf16"], {"saved_tensors": "lean"}),
    "saved_tensors=plain (bf16)": (["train.precision=bf16"], {"saved_tensors": "plain"}),
}


pytestmark = pytest.mark.usefixtures("test_rewards")


def one_run(tmp_path, overrides, plan_changes=None):
    """Train for one generation round (>= 1 step): (cfg, trainer, each step's input shapes, losses, moved).
    `overrides`: config overrides, or (overrides, changes of the speed plan's fields)."""
    if isinstance(overrides, tuple):
        overrides, plan_changes = overrides
    cfg = compose_cfg([*FAST, *overrides], tmp_path)
    cfg.train.max_steps = max(generation_batch(cfg.train)[1], 1)  # one round: the buffered (off-policy) steps run too
    trainer, seen, losses, moved = train_briefly(cfg, **(plan_changes or {}))
    shapes = [{k: tuple(v.shape) for k, v in inputs.items() if isinstance(v, torch.Tensor)} for inputs in seen]
    return cfg, trainer, shapes, losses, moved


@pytest.fixture(scope="module")
def plain_run(tmp_path_factory, test_rewards):
    return one_run(tmp_path_factory.mktemp("plain"), OPTIONS["plain"])


@pytest.mark.parametrize("name", list(OPTIONS))
def test_option_makes_a_correct_grpo_step(name, tmp_path, plain_run):
    plain_shapes = plain_run[2][0]
    cfg, trainer, seen, losses, moved = plain_run if name == "plain" else one_run(tmp_path, OPTIONS[name])
    assert losses and all(math.isfinite(x) for x in losses), losses
    assert moved, "no parameter changed: the step did not update the policy"
    assert all(math.isfinite(float(p.detach().abs().max())) for p in trainer.model.parameters())
    # same per-step batch as the plain path: rows = per_device_train_batch_size completions of <= max length
    for shapes in seen:
        assert shapes["completion_ids"][0] == cfg.train.per_device_train_batch_size
        assert shapes["completion_ids"][1] <= cfg.train.max_completion_length
        assert shapes["advantages"] == (cfg.train.per_device_train_batch_size,)
        # the rollout engine's own (the sampler's log-probs, importance weights): absent on TRL's generate
        engine_only = {"old_per_token_logps", "sampling_per_token_logps", "importance_sampling_ratio"}
        common = set(plain_shapes) - engine_only
        assert common <= set(shapes), sorted(common - set(shapes))
    _, spg = generation_batch(cfg.train)
    assert trainer.args.steps_per_generation == spg
    assert len(seen) == max(spg, 1)
    if spg > 1:  # off-policy steps: TRL must carry the old policy's logprobs for the clipped ratio
        assert all("old_per_token_logps" in s for s in seen)
    if name.startswith("beta"):  # TRL loaded a reference model and logged the KL to it
        assert trainer.ref_model is not None
        assert all(math.isfinite(row["kl"]) for row in trainer.state.log_history if "loss" in row)
    if "static" in name:
        assert trainer.args.cache_implementation == "static"


@pytest.mark.slow
def test_the_lean_reference_gives_the_same_kl_and_losses(tmp_path):
    """The lean reference (one of speed.exact_shortcuts) under bf16 autocast: the reference's Linear weights in bf16,
    and the run logs the KL and losses of the fp32 reference bit for bit (the same seed, the same samples)."""
    runs = {}
    for lean in (True, False):
        cfg = compose_cfg([*FAST, "train.beta=0.04", "train.precision=bf16"], tmp_path / str(lean))
        cfg.train.max_steps = 3  # the policy moves away from the reference after the first step
        trainer, _, _, moved = train_briefly(cfg, lean_reference=lean)
        q_proj = trainer.accelerator.unwrap_model(trainer.ref_model).model.layers[0].self_attn.q_proj
        assert q_proj.weight.dtype == (torch.bfloat16 if lean else torch.float32)
        assert moved
        runs[lean] = [(row["kl"], row["loss"]) for row in trainer.state.log_history if "loss" in row]
    assert runs[True] and all(math.isfinite(kl) for kl, _ in runs[True])
    assert len(runs[True]) == 3 and all(kl > 0 for kl, _ in runs[True][1:])  # a KL was measured, not a constant
    assert runs[True] == runs[False]


@pytest.mark.parametrize("loaded", ["as TRL loads it", "with transformers' own attention"])
def test_the_kl_reference_attends_as_the_policy_so_the_first_kl_is_zero(loaded, tmp_path, monkeypatch):
    """On-policy (steps_per_generation=1) in fp32, the first step's policy and KL reference hold the same weights,
    so its logged KL is exactly 0, not a rounding difference: the trainer gives the reference the policy's attention
    (speed.attention=auto: grouped on a CPU). TRL releases that load the reference with transformers' own attention
    are what the second case stands for; this release passes the policy's attention name on."""
    from trl.trainer import grpo_trainer

    if loaded != "as TRL loads it":
        create = grpo_trainer.create_model_from_path

        def without_attention(*args, **kwargs):
            kwargs.pop("attn_implementation", None)
            return create(*args, **kwargs)

        monkeypatch.setattr(grpo_trainer, "create_model_from_path", without_attention)
    cfg = compose_cfg([*FAST, "train.beta=0.04", "train.precision=fp32", "train.steps_per_generation=1"], tmp_path)
    cfg.train.max_steps = 1
    trainer, _, _, _ = train_briefly(cfg)
    policy = shared_prefix.scoring_model(trainer.accelerator.unwrap_model(trainer.model))
    reference = trainer.accelerator.unwrap_model(trainer.ref_model)
    assert reference.config._attn_implementation == policy.config._attn_implementation
    first = next(row for row in trainer.state.log_history if "kl" in row)
    assert first["kl"] == 0.0


@pytest.mark.slow
def test_shared_prefix_step_matches_trls_own_forward(tmp_path, monkeypatch):
    """Same seed, same completions: the shared-prefix step logs TRL's entropy and gradient norm."""
    used = []
    real = shared_prefix.completion_logps

    def counting(*args, **kwargs):
        out = real(*args, **kwargs)
        used.append(out is not None)
        return out

    monkeypatch.setattr(shared_prefix, "completion_logps", counting)
    on = one_run(tmp_path / "on", [])
    off = one_run(tmp_path / "off", [], {"shared_prefix": False})
    assert on[1].speed_plan.shared_prefix and not off[1].speed_plan.shared_prefix
    assert used and all(used), "the default path did not share the prompts"
    first_on, first_off = on[1].state.log_history[0], off[1].state.log_history[0]
    assert first_on["completions/mean_length"] == first_off["completions/mean_length"]
    assert first_on["entropy"] == pytest.approx(first_off["entropy"], rel=1e-4)
    assert first_on["grad_norm"] > 0
    assert first_on["grad_norm"] == pytest.approx(first_off["grad_norm"], rel=1e-3)


@pytest.mark.slow
def test_generation_profile_script_lists_ops_and_bandwidth(tmp_path):
    out = tmp_path / "prof"
    proc = subprocess.run([sys.executable, "-m", "grpo_exp.apps.profile", "--model", "tiny_random", "--tokens", "4",
                           "--batch", "2", "--threads", "1", "--precision", "bf16", "--out", str(out)],
                          cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads((out / "profile.json").read_text())
    assert result["batch"] == 2 and result["tokens"] == 4 and result["threads"] == 1
    # profiled as TRL generates under bf16 training (autocast), not in fp32
    assert result["precision"] == "bf16" and "under bf16 autocast" in result["decoding"]
    assert result["generate_s"] > 0 and result["top_ops"]
    assert 0 < sum(o["share"] for o in result["top_ops"]) <= 1.0 + 1e-6
    assert result["lm_head_weight_gb_per_s"] > 0 and result["memory_read_gb_per_s"] > 0
    assert "ms per decoding step" in (out / "profile.md").read_text()

    bad = subprocess.run([sys.executable, "-m", "grpo_exp.apps.profile", "--batch", "0"], cwd=ROOT,
                         capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "--batch" in bad.stderr
    bad = subprocess.run([sys.executable, "-m", "grpo_exp.apps.profile", "--precision", "fp16"], cwd=ROOT,
                         capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "fp16" in bad.stderr and "bf16" in bad.stderr


@pytest.mark.slow
def test_generation_profile_of_the_rollout_engine_times_its_rounds(tmp_path, tiny_model):
    # a model directory as --model (model=custom): the tiny random model's, saved in the cache
    model_dir = tiny_model[0].name_or_path
    out = tmp_path / "prof"
    proc = subprocess.run([sys.executable, "-m", "grpo_exp.apps.profile", "--path", "engine", "--model", model_dir,
                           "--tokens", "4", "--batch", "2", "--threads", "1", "--repeats", "2", "--attention-decode",
                           "last_axis", "--out", str(out)],
                          cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads((out / "profile.json").read_text())
    assert result["path"] == "engine" and "rollout engine" in result["decoding"] and result["model"] == model_dir
    assert "attention_decode=last_axis" in result["decoding"]
    assert len(result["rounds_s"]) == 2 and result["generate_s"] == statistics.median(result["rounds_s"])
    assert result["top_ops"] and result["lm_head_weight_gb_per_s"] > 0
    assert "rollout engine" in (out / "profile.md").read_text()

    bad = subprocess.run([sys.executable, "-m", "grpo_exp.apps.profile", "--path", "vllm"], cwd=ROOT,
                         capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "vllm" in bad.stderr and "engine" in bad.stderr


def test_monitor_counts_tokens_of_generation_rounds(tmp_path):
    """steps_per_generation=4: the generating step logs the mean length of 4 steps' completions, the other
    three log none; tokens and time must both cover all four steps."""
    from grpo_exp.base.monitor import MonitorCallback

    monitor = MonitorCallback(tmp_path / "history.jsonl", completions_per_step=8, completions_per_generation=32)
    state = type("State", (), {"global_step": 0})()
    for step in range(8):
        monitor.on_step_begin(None, state, None)
        monitor.on_step_end(None, state, None)
        monitor._last_step_time = monitor.step_times[-1] = 1.0
        state.global_step = step + 1
        monitor.on_log(None, state, None, logs={"completions/mean_length": 10.0} if step % 4 == 0 else {"loss": 0.1})
    monitor.sampler.stop()
    summary = monitor.summary([])
    assert summary["completion_tokens_total"] == 2 * 32 * 10.0
    assert summary["completion_tokens_per_s"] == 2 * 32 * 10.0 / 8


def test_the_profile_apps_choices_are_the_trainings_own():
    """grpo-profile lists its choices as literals (argparse runs before torch loads); they must stay the ones a
    training run accepts, so that a profile can be taken of every setting a run can have."""
    from grpo_exp.apps.profile import build_parser
    from grpo_exp.base.cpu import PRECISIONS
    from grpo_exp.config import speed
    from grpo_exp.kernels import attention

    choices = {action.dest: tuple(action.choices) for action in build_parser()._actions if action.choices}
    assert choices["attention_decode"] == speed.ATTENTION_DECODES == attention.DECODE_LAYOUTS
    assert set(choices["precision"]) == set(PRECISIONS)
    assert choices["prepack"] == ("auto", "true", "false")


def test_the_profile_reads_the_plan_on_a_machine_that_cannot_pack(monkeypatch, tmp_path, tiny_model):
    """--prepack auto resolves as a run's plan does: where the machine cannot pack Linear weights it decodes
    with plain ones (it once passed the string "auto" on to the engine, which demanded packing and raised)."""
    from grpo_exp.analysis.profile import engine_plan
    from grpo_exp.kernels import packed_linear
    from grpo_exp.training import rollout
    from tests.conftest import compose_cfg

    monkeypatch.setattr(packed_linear, "unsupported_reason", lambda dtype, device: "no packing on this machine")
    cfg = compose_cfg([], tmp_path)
    plan = engine_plan(cfg, "auto")
    assert plan.rollout_prepack is False and isinstance(plan.rollout_compile, bool)
    assert engine_plan(cfg, "true").rollout_prepack is True and engine_plan(cfg, "false").rollout_prepack is False
    model, tokenizer = tiny_model
    engine = rollout.RolloutEngine(model, dtype=plan.weight_dtype(), compile=False, prepack=plan.rollout_prepack,
                                   max_new_tokens=2, eos_token_ids=[tokenizer.eos_token_id],
                                   pad_token_id=tokenizer.eos_token_id)
    assert not engine.packed  # the Linear layers it packed: none


def test_monitor_records_the_cpu_seconds_of_each_step_and_their_sum(tmp_path):
    """cpu_s: this process's CPU time inside a step (a busy step counts, time outside steps does not);
    cpu_s_total: their running sum, which a resumed run continues from its history."""
    from grpo_exp.base.monitor import MonitorCallback

    def busy(seconds: float) -> None:
        end = time.process_time() + seconds
        while time.process_time() < end:
            pass

    monitor = MonitorCallback(tmp_path / "history.jsonl", completions_per_step=8)
    state = type("State", (), {"global_step": 0})()
    step_windows = []  # the process's CPU time around each step: other threads of a long test session count too
    for step in range(2):
        before = time.process_time()
        monitor.on_step_begin(None, state, None)
        busy(0.3)
        monitor.on_step_end(None, state, None)
        step_windows.append(time.process_time() - before)
        busy(0.5)  # between steps (evaluation, saving): not training compute
        state.global_step = step + 1
        monitor.on_log(None, state, None, logs={"loss": 0.1})
    monitor.sampler.stop()
    rows = monitor.rows
    assert all(0.3 <= r["cpu_s"] <= window + 2e-3 for r, window in zip(rows, step_windows)), (rows, step_windows)
    assert rows[1]["cpu_s_total"] == pytest.approx(rows[0]["cpu_s"] + rows[1]["cpu_s"], abs=2e-3)
    resumed = MonitorCallback(tmp_path / "resumed.jsonl", completions_per_step=8)
    resumed.continue_from(rows)
    assert resumed.cpu_s_total == rows[-1]["cpu_s_total"]
    resumed.sampler.stop()
