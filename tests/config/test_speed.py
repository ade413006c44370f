"""The speed plan (config/speed.py): every `auto` resolved once, by precision and machine, into concrete choices;
the settings record and the trainer read the same plan, and speed=trl is plain TRL's path."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from grpo_exp.base import cpu
from grpo_exp.base.errors import ConfigError
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
def test_auto_picks_by_device(device, generation, attention, kernel, monkeypatch):
    monkeypatch.setattr(speed, "vllm_installed", lambda: False)  # with vllm, auto on CUDA is vllm (below)
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


@pytest.mark.parametrize("device,installed,picked", [("cuda", True, "vllm"), ("cuda", False, "trl"),
                                                      ("cpu", True, "engine"), ("cpu", False, "engine")])
def test_auto_samples_with_vllm_only_where_cuda_and_vllm_both_are(monkeypatch, device, installed, picked):
    """Once the vLLM GPU test has passed (speed.VLLM_AUTO); until then, below."""
    monkeypatch.setattr(speed, "VLLM_AUTO", True)
    monkeypatch.setattr(speed, "vllm_installed", lambda: installed)
    plan = plan_of(device=device)
    assert plan.generation == picked
    assert plan.vllm_memory == (0.3 if picked == "vllm" else None)  # recorded only where vLLM samples
    if picked == "vllm":  # TRL's path otherwise: no engine copy, no sampler log-probs as the old ones
        assert (plan.rollout_dtype, plan.old_logps, plan.rollout_compile, plan.rollout_prepack) == (None, None, False,
                                                                                                    False)


@pytest.mark.parametrize("device,installed,why", [
    ("cpu", True, "this machine has no CUDA device"), ("cpu", False, "this machine has no CUDA device"),
    ("cuda", False, "the vllm package is not installed (pip install 'grpo-exp[vllm]')")])
def test_an_explicit_vllm_without_cuda_or_vllm_is_one_line(monkeypatch, device, installed, why):
    monkeypatch.setattr(speed, "vllm_installed", lambda: installed)
    expected = f"speed.generation=vllm needs CUDA and the vllm package; {why}; choose one of: auto, trl, engine"
    with pytest.raises(ConfigError) as info:
        plan_of(device=device, generation="vllm")
    assert str(info.value) == expected
    # validate (every entry, before any model loads) says the same, on this machine's device
    from grpo_exp.config.checks import validate

    monkeypatch.setattr(speed, "_device", lambda: device)
    with pytest.raises(ConfigError) as info:
        validate(compose_cfg(["stage=basic", "speed.generation=vllm"], "/tmp/never-written"))
    assert str(info.value) == expected
    # a run made elsewhere is described, not refused (grpo-export-trl)
    assert resolve(SpeedConfig(generation="vllm"), Train(), device=device, available=False).generation == "vllm"


def test_an_explicit_vllm_plans_trls_colocated_vllm_with_the_speed_corrections(monkeypatch, tmp_path):
    from grpo_exp.training.trainer import grpo_config

    monkeypatch.setattr(speed, "vllm_installed", lambda: True)
    cfg = compose_cfg(["stage=basic", "speed.generation=vllm", "speed.vllm_memory=0.4", "speed.is_mode=token_mask",
                       "speed.is_cap=2.5"], tmp_path)
    plan = resolve(cfg.speed, cfg.train, device="cuda")
    assert (plan.generation, plan.vllm_memory) == ("vllm", 0.4)
    args = grpo_config(cfg.train, tmp_path, [1.0, 0.2], [], plan)
    assert args.use_vllm and args.vllm_mode == "colocate" and args.vllm_gpu_memory_utilization == 0.4
    assert args.vllm_importance_sampling_correction and args.vllm_importance_sampling_mode == "token_mask"
    assert args.vllm_importance_sampling_clip_max == 2.5
    # on the other paths TRL's vLLM stays off (the engine only borrows its correction, trl_hook.enable_is_correction)
    for other in (plan_of(generation="engine"), plan_of(generation="trl", device="cuda"), plan_of(device="cpu")):
        assert not grpo_config(cfg.train, tmp_path, [1.0, 0.2], [], other).use_vllm
    assert "use_vllm" not in {k for k, v in dataclasses.asdict(plan).items()}  # the plan names the sampler, not TRL


def test_vllm_memory_is_a_share(tmp_path):
    from grpo_exp.config.checks import validate

    for bad in ("0.0", "1.0", "1.5"):
        with pytest.raises(ConfigError, match=f"speed.vllm_memory={bad} must be a share"):
            validate(compose_cfg(["stage=basic", f"speed.vllm_memory={bad}"], tmp_path))


def test_a_run_recorded_before_speed_vllm_memory_resumes(tmp_path):
    """Settings recorded before the key existed (no speed.vllm_memory, no resolved one) resume at its default."""
    import json

    from grpo_exp.training.run_dir import SETTINGS_FILE, record_or_compare, training_settings

    recorded = {k: v for k, v in training_settings(compose_cfg(["debug=smoke"], tmp_path)).items()
                if not k.endswith("speed.vllm_memory")}
    (tmp_path / SETTINGS_FILE).write_text(json.dumps(recorded))
    record_or_compare(compose_cfg(["debug=smoke", "resume=true"], tmp_path), tmp_path)  # raises on a change
    assert json.loads((tmp_path / SETTINGS_FILE).read_text()) == recorded  # nothing changed, nothing rewritten
    changed = compose_cfg(["debug=smoke", "resume=true", "speed.vllm_memory=0.5"], tmp_path)
    with pytest.raises(ConfigError, match="speed.vllm_memory"):  # a key it now records is compared
        record_or_compare(changed, tmp_path)


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


def test_auto_keeps_trls_generate_on_cuda_until_vllms_gpu_test_has_passed(monkeypatch):
    """vLLM on CUDA has not run on a GPU yet (docs/scale-out.md): auto does not pick it, an explicit vllm stands."""
    assert speed.VLLM_AUTO is False
    monkeypatch.setattr(speed, "vllm_installed", lambda: True)
    assert plan_of(device="cuda").generation == "trl"
    assert plan_of(device="cuda", generation="vllm").generation == "vllm"


def test_vllm_on_a_head_width_it_does_not_serve_is_one_line_before_the_model_loads(monkeypatch, tmp_path):
    from grpo_exp.config.checks import head_width, validate

    monkeypatch.setattr(speed, "vllm_missing", lambda device: None)  # as on a CUDA machine with vllm
    cfg = compose_cfg(["debug=smoke", "speed.generation=vllm"], tmp_path)
    assert head_width(cfg.model) == 16
    with pytest.raises(ConfigError) as info:
        validate(cfg)
    assert str(info.value).startswith("speed.generation=vllm: model tiny_random has 16-wide attention heads, which "
                                      "vLLM's attention backends do not all serve (widths 32, 64,")
    validate(compose_cfg(["debug=smoke", "speed.generation=vllm", "model.tiny_hidden=256",
                          "model.tiny_intermediate=512"], tmp_path))  # 64-wide heads: served
    local = tmp_path / "model"
    local.mkdir()
    (local / "config.json").write_text('{"hidden_size": 576, "num_attention_heads": 9}')
    assert head_width(compose_cfg(["model=custom", f"model.id={local}"], tmp_path).model) == 64
