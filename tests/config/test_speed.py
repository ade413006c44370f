"""The speed plan (config/speed.py): every `auto` resolved once, by precision and machine, into concrete choices;
the settings record and the trainer read the same plan, and speed=trl is plain TRL's path."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from grpo_exp.base import cpu
from grpo_exp.config import speed
from grpo_exp.config.speed import SpeedConfig, resolve
from grpo_exp.training.run_dir import resolved_choices
from tests.conftest import compose_cfg


class Train:
    def __init__(self, precision="fp32", gradient_checkpointing=False):
        self.precision, self.gradient_checkpointing = precision, gradient_checkpointing


def plan_of(precision="fp32", device="cpu", checkpointing=False, **speed_keys):
    node = SpeedConfig(**speed_keys)
    return resolve(node, Train(precision, checkpointing), device=device)


def test_no_field_of_a_plan_is_auto():
    for device in ("cpu", "cuda"):
        for precision in ("fp32", "bf16"):
            for name in ("auto", "trl"):
                node = SpeedConfig() if name == "auto" else SpeedConfig(generation="trl", attention="sdpa",
                                                                        logprob_kernel="trl", exact_shortcuts=False)
                plan = resolve(node, Train(precision), device=device)
                assert "auto" not in dataclasses.asdict(plan).values(), plan


@pytest.mark.parametrize("device,generation,attention,kernel", [("cpu", "engine", "grouped", "autocast"),
                                                                 ("cuda", "trl", "sdpa", "trl")])
def test_auto_picks_by_device(device, generation, attention, kernel):
    plan = plan_of(device=device)
    assert (plan.generation, plan.attention, plan.logprob_kernel) == (generation, attention, kernel)
    # explicit choices stand on either device
    plan = plan_of(device=device, generation="trl", attention="eager", logprob_kernel="autocast")
    assert (plan.generation, plan.attention, plan.logprob_kernel) == ("trl", "eager", "autocast")


@pytest.mark.parametrize("native", ["bf16", "fp32"])
def test_the_copy_is_the_machines_native_dtype_and_old_log_probs_follow_it(monkeypatch, native):
    monkeypatch.setattr(cpu, "resolve_precision", lambda p: native if p == "auto" else p)
    fp32, bf16 = plan_of("fp32"), plan_of("bf16")
    assert fp32.rollout_dtype == bf16.rollout_dtype == native  # the machine's dtype, whatever training runs in
    # an exact copy (fp32 under fp32 training): its log-probs serve; a bf16 copy differs: scored and corrected
    assert fp32.old_logps == ("sampler" if native == "fp32" else "policy")
    assert bf16.old_logps == "policy"
    monkeypatch.undo()
    assert plan_of("bf16", rollout_dtype="autocast").old_logps == "sampler"
    assert plan_of("bf16", old_logps="policy", rollout_dtype="autocast").old_logps == "policy"
    assert plan_of(generation="trl").rollout_dtype is None and plan_of(generation="trl").old_logps is None


def test_exact_shortcuts_switch_six_shortcuts_together():
    on, off = plan_of("bf16"), plan_of("bf16", exact_shortcuts=False)
    assert on.shared_prefix and on.lean_reference and on.embedding_grad and on.saved_tensors == "lean"
    assert on.scoring == "batch"
    assert not (off.shared_prefix or off.lean_reference or off.embedding_grad or off.rollout_prepack)
    assert (off.saved_tensors, off.scoring) == ("plain", "round")
    # lean saved tensors only under bf16, and neither they nor shared-prefix scoring under gradient checkpointing
    assert plan_of("fp32").saved_tensors == "plain"
    checkpointed = plan_of("bf16", checkpointing=True)
    assert checkpointed.saved_tensors == "plain" and not checkpointed.shared_prefix


def test_packed_weights_only_where_the_machine_supports_them():
    from grpo_exp.kernels import packed_linear

    for precision in ("fp32", "bf16"):
        plan = plan_of(precision)
        dtype = torch.float32 if plan.rollout_dtype == "fp32" else torch.bfloat16
        supported = packed_linear.unsupported_reason(dtype, torch.device("cpu")) is None
        assert plan.rollout_prepack == supported
    assert not plan_of(device="cuda").rollout_prepack


def test_compile_auto_is_where_a_compiler_is(monkeypatch):
    monkeypatch.setattr(cpu, "compiler_missing", lambda: "no C++ compiler")
    assert not plan_of().rollout_compile and plan_of(rollout_compile=True).rollout_compile
    monkeypatch.setattr(cpu, "compiler_missing", lambda: None)
    assert plan_of().rollout_compile and not plan_of(rollout_compile=False).rollout_compile


def test_the_settings_record_holds_what_the_plan_resolved(tmp_path):
    cfg = compose_cfg(["stage=basic"], tmp_path)
    plan = resolve(cfg.speed, cfg.train)
    record = resolved_choices(cfg)
    assert record["train.precision"] == plan.precision == cpu.resolve_precision("auto")
    assert record["speed.generation"] == plan.generation and record["speed.attention"] == plan.attention
    assert set(record) == {"train.precision", *(f"speed.{k}" for k in cfg.speed if k != "name"
                                                and k != "exact_shortcuts")}


def test_an_old_override_names_its_new_key():
    from grpo_exp.base.errors import ConfigError

    for old, new in speed.MOVED.items():
        with pytest.raises(ConfigError, match=f"train.{old} has moved: set {new} instead"):
            speed.check_moved([f"train.{old}=x"])
    speed.check_moved(["train.max_steps=3", "speed.generation=trl"])  # the keys that stay pass
