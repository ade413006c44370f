"""peft=lora in real GRPO runs on the tiny model: only the adapter trains, model/ is the merged model, the
shared-prefix scoring serves adapters, EWC covers the adapter and a later stage continues it, resume reloads
it, and bad settings fail with one line before any model loads."""

from __future__ import annotations

import copy
import json
import math
import shutil

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoTokenizer

from grpo_exp.apps.train import check as precheck  # the entrypoint's whole pre-check
from grpo_exp.base.errors import ConfigError
from grpo_exp.base.io import read_jsonl, save_model_dir
from grpo_exp.config.checks import validate
from grpo_exp.core import models
from grpo_exp.training import checkpoints, ewc, lora, shared_prefix
from grpo_exp.training.stage import prepare, train
from grpo_exp.training.trainer import build_trainer
from tests.conftest import assert_fails_fast_with_one_line, compose_cfg

# vowel_fraction has spread on random-token text, so advantages and updates are non-zero; lr 1e-3 makes a
# two-step update visible; no KL reference (basic's default beta 0.04 adds TRL's frozen "ref" adapter, which
# test_a_kl_reference_with_an_adapter covers)
LORA = ["debug=smoke", "logger=none", "peft=lora", "reward.funcs=[vowel_fraction]", "reward.weights=[1.0]",
        "train.learning_rate=1e-3", "eval.after_train=false", "eval.every_steps=null", "cpu.threads=1",
        "train.beta=0.0"]
EWC_FAST = ["ewc.fisher_samples=4", "ewc.fisher_batch_size=4"]


def _is_adapter_param(name: str) -> bool:
    return ".lora_A." in name or ".lora_B." in name


def test_grpo_steps_change_only_the_adapter(tmp_path, test_rewards):
    cfg = compose_cfg([*LORA, "train.max_steps=2"], tmp_path)
    validate(cfg)
    parts = prepare(cfg)
    model = parts.model
    assert lora.is_peft(model)
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trainable and all(_is_adapter_param(n) for n in trainable)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}

    trainer = build_trainer(cfg, parts, tmp_path, [])
    assert trainer.speed_plan.shared_prefix  # the shared-prefix scoring serves the adapter, no fallback
    trainer.train()

    after = {n: p.detach() for n, p in model.named_parameters()}
    assert set(after) == set(before)
    changed = {n for n in before if not torch.equal(before[n], after[n])}
    assert any(".lora_B." in n for n in changed), "the adapter did not train"  # B starts at zero
    frozen_changed = sorted(changed - trainable)
    assert not frozen_changed, f"base weights changed: {frozen_changed[:3]}"
    # HF's intermediate checkpoints of a PEFT model hold the adapter only
    ckpt = tmp_path / "checkpoints" / "checkpoint-2"
    assert (ckpt / "adapter_model.safetensors").is_file() and not (ckpt / "model.safetensors").exists()


def test_model_dir_is_the_merged_model_and_loads_and_generates(tmp_path, test_rewards):
    run = tmp_path / "run"
    cfg = compose_cfg([*LORA, "train.max_steps=2", "eval.after_train=true"], run)
    metrics = train(cfg)
    assert metrics["status"] == "completed" and metrics["peft"] == "lora"
    assert 0 < metrics["trainable_params"] < metrics["total_params"] / 10
    assert "accuracy" in json.loads((run / "eval.json").read_text())["sets"]["basic"]  # evaluated the merged model
    assert not (run / "model" / "adapter_config.json").exists()
    assert json.loads((run / "adapter" / lora.PEFT_SETTINGS_FILE).read_text())["r"] == cfg.peft.r

    merged = AutoModelForCausalLM.from_pretrained(run / "model")
    base, _ = models.load(cfg.model, cfg.paths.cache_dir, seed=cfg.train.seed)
    adapter = load_file(str(run / "adapter" / "adapter_model.safetensors"))
    assert any(t.abs().sum() > 0 for k, t in adapter.items() if ".lora_B." in k), "the adapter did not train"
    scale = cfg.peft.alpha / cfg.peft.r
    base_sd, merged_sd = base.state_dict(), merged.state_dict()
    assert set(merged_sd) == set(base_sd)
    targeted = 0
    for name, weight in base_sd.items():
        module = name.removesuffix(".weight")
        a_key, b_key = f"base_model.model.{module}.lora_A.weight", f"base_model.model.{module}.lora_B.weight"
        if a_key in adapter:
            # merged = base + (alpha / r) B A: the base underneath did not move
            torch.testing.assert_close(merged_sd[name], weight + scale * adapter[b_key] @ adapter[a_key],
                                       rtol=1e-5, atol=1e-6, msg=name)
            targeted += 1
        else:
            assert torch.equal(merged_sd[name], weight), f"{name} changed without an adapter on it"
    assert targeted == 7 * cfg.model.tiny_layers  # q, k, v, o, gate, up, down in every layer

    tokenizer = AutoTokenizer.from_pretrained(run / "model")
    enc = tokenizer("What is 2 + 3?", return_tensors="pt")
    out = merged.generate(**enc, max_new_tokens=5, min_new_tokens=5, do_sample=False,
                          pad_token_id=tokenizer.pad_token_id)
    assert out.shape[1] == enc.input_ids.shape[1] + 5

    # adapter/ on its own, over the base, computes what model/ computes
    from peft import PeftModel

    with_adapter = PeftModel.from_pretrained(base, str(run / "adapter")).eval()
    with torch.no_grad():
        torch.testing.assert_close(with_adapter(**enc).logits, merged(**enc).logits, rtol=1e-4, atol=1e-4)


@pytest.mark.slow
def test_ewc_over_adapters_and_a_stage_that_continues_the_adapter(tmp_path, test_rewards):
    first_dir, second_dir = tmp_path / "a", tmp_path / "b"
    train(compose_cfg([*LORA, *EWC_FAST, "train.max_steps=2", "ewc.lambda=1"], first_dir))
    state = ewc.EwcState.load(first_dir)
    adapter = load_file(str(first_dir / "adapter" / "adapter_model.safetensors"))
    # the Fisher covers the trained adapter exactly (peft names it "default" in the model, not in the file)
    assert set(state.fisher) == {k.replace(".weight", f".{lora.ADAPTER}.weight") for k in adapter}
    assert all(_is_adapter_param(k) for k in state.fisher)
    assert all(torch.isfinite(f).all() for f in state.fisher.values())
    assert any(f.sum() > 0 for f in state.fisher.values())
    for name, anchor in state.anchor.items():  # the anchor is the adapter the stage ended with
        assert torch.equal(anchor, adapter[name.replace(f".{lora.ADAPTER}.", ".")]), name

    metrics = train(compose_cfg([*LORA, *EWC_FAST, "train.max_steps=2", "ewc.lambda=1000",
                                 f"init_from={first_dir}"], second_dir))
    assert metrics["adapter_from"] == str(first_dir / "adapter")
    penalties = [row["ewc_penalty"] for row in read_jsonl(second_dir / "history.jsonl")]
    assert len(penalties) == 2 and all(math.isfinite(p) for p in penalties)
    # step 1 starts exactly at the anchor (the continued adapter); a fresh adapter's random A would not
    assert penalties[0] == 0.0
    assert penalties[1] > 0  # the first update moved the adapter away from it
    assert math.isfinite(metrics["ewc_weighted_distance"]) and metrics["ewc_weighted_distance"] > 0
    second_state = ewc.EwcState.load(second_dir)
    assert set(second_state.fisher) == set(state.fisher) and second_state.stages == ["basic", "basic"]

    # settings the LoRA run cannot be continued with fail before any model loads
    refusals = [
        (["peft=none", "ewc.lambda=1"], "continue with peft=lora, or with ewc.lambda=0"),
        (["peft=lora", "peft.r=8", "ewc.lambda=0"], "r (16 -> 8)"),
    ]
    for overrides, needle in refusals:
        cfg = compose_cfg([*LORA, *overrides, f"init_from={first_dir}"], tmp_path / "c")
        with pytest.raises(ConfigError) as info:
            precheck(cfg)
        assert needle in str(info.value) and "\n" not in str(info.value)
    # the adapter continues on the base it was trained on; where that base is gone, one line says so
    moved = tmp_path / "moved"
    shutil.copytree(first_dir, moved, ignore=shutil.ignore_patterns("checkpoints"))
    config_path = moved / "adapter" / "adapter_config.json"
    config_path.write_text(json.dumps({**json.loads(config_path.read_text()),
                                       "base_model_name_or_path": str(tmp_path / "gone")}))
    with pytest.raises(ConfigError, match="which is not here"):
        prepare(compose_cfg([*LORA, f"init_from={moved}"], tmp_path / "d"))


@pytest.mark.slow
def test_lora_stages_after_a_fully_fine_tuned_model(tmp_path, test_rewards):
    cfg = compose_cfg(["debug=smoke"], tmp_path / "full")
    model, tokenizer = models.load(cfg.model, cfg.paths.cache_dir, seed=cfg.train.seed)
    with torch.no_grad():  # stands in for full fine-tuning: weights no adapter touches differ from the base
        model.model.norm.weight.add_(0.5)
    save_model_dir(model, tokenizer, tmp_path / "full" / "model")
    names = list(ewc.fisher_parameters(model, False))[:1]
    ewc.EwcState({n: torch.ones(1) for n in names}, {n: torch.zeros(1) for n in names}, ["basic"]).save(
        tmp_path / "full")
    lora_cfg = compose_cfg(["debug=smoke", "peft=lora", "ewc.lambda=1", f"init_from={tmp_path / 'full'}"],
                           tmp_path / "next")
    with pytest.raises(ConfigError, match="was fully fine-tuned") as info:
        precheck(lora_cfg)
    assert "\n" not in str(info.value)
    # without EWC a LoRA stage starts a fresh adapter on the fully fine-tuned model, and the stage after it
    # continues that adapter on the same weights (not on the `model` option's base)
    first = train(compose_cfg([*LORA, "train.max_steps=1", f"init_from={tmp_path / 'full'}"], tmp_path / "lora1"))
    second = train(compose_cfg([*LORA, "train.max_steps=1", f"init_from={tmp_path / 'lora1'}"], tmp_path / "lora2"))
    assert first["adapter_from"] is None and second["adapter_from"] == str(tmp_path / "lora1" / "adapter")
    adapter_config = json.loads((tmp_path / "lora2" / "adapter" / "adapter_config.json").read_text())
    assert adapter_config["base_model_name_or_path"] == str(tmp_path / "full" / "model")
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "lora2" / "model")
    assert torch.equal(merged.model.norm.weight, model.model.norm.weight)


@pytest.mark.slow
def test_resume_reloads_the_adapter_from_the_checkpoint(tmp_path, test_rewards, monkeypatch):
    steps = [*LORA, "train.max_steps=4", "train.save_steps=2", "train.save_total_limit=null"]
    train(compose_cfg(steps, tmp_path / "ref"))

    real_publish = checkpoints.publish

    def die_at_second_save(staging, final):
        if final.name == "checkpoint-4":
            raise KeyboardInterrupt("killed while saving")  # as a kill: checkpoint-2 is the last complete one
        real_publish(staging, final)

    monkeypatch.setattr(checkpoints, "publish", die_at_second_save)
    with pytest.raises(KeyboardInterrupt):
        train(compose_cfg(steps, tmp_path / "cut"))
    monkeypatch.setattr(checkpoints, "publish", real_publish)
    metrics = train(compose_cfg([*steps, "resume=true"], tmp_path / "cut"))
    assert metrics["steps"] == 4 and metrics["resumed_from"].endswith("checkpoint-2")

    ref = load_file(str(tmp_path / "ref" / "adapter" / "adapter_model.safetensors"))
    got = load_file(str(tmp_path / "cut" / "adapter" / "adapter_model.safetensors"))
    assert set(ref) == set(got)
    # a resume that lost the checkpoint's adapter would start again from a fresh one and end elsewhere
    for name in ref:
        torch.testing.assert_close(got[name], ref[name], rtol=1e-4, atol=1e-6, msg=name)


def test_shared_prefix_matches_trls_forward_with_an_adapter(tmp_path, tiny_model):
    from peft import get_peft_model
    from trl.trainer.utils import add_fused_lm_head

    from tests.training.test_shared_prefix import grpo_batch, score, trl_forward

    cfg = compose_cfg(["debug=smoke", "peft=lora"], tmp_path)
    base, tokenizer = copy.deepcopy(tiny_model)
    model = get_peft_model(base, lora.lora_config(cfg.peft))
    with torch.no_grad():  # a trained-looking adapter: B = 0 would leave A without gradients
        gen = torch.Generator().manual_seed(0)
        for name, p in model.named_parameters():
            if ".lora_B." in name:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.05)
    add_fused_lm_head(model.get_base_model(), temperature=0.7, outputs=("log_probs", "entropy"))  # as TRL does
    assert shared_prefix.unsupported_reason(model) is None
    ids, mask = grpo_batch(tokenizer, ["What is 7 + 5?", "Tom has 12 apples and eats 3 of them. How many left?"],
                           repeats=3, completion_len=10)
    keep = 10

    def trl():
        return trl_forward(model, ids, mask, keep)

    def shared():
        return shared_prefix.completion_logps(model, ids, mask, keep, 0.7, True)

    reference, ours = score(model, trl), score(model, shared)
    torch.testing.assert_close(ours[0], reference[0], atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(ours[1], reference[1], atol=1e-4, rtol=1e-4)
    assert reference[2] and set(ours[2]) == set(reference[2])
    assert all(_is_adapter_param(n) for n in reference[2])  # gradients reach the adapter only
    for name, grad in reference[2].items():
        torch.testing.assert_close(ours[2][name], grad, atol=1e-5, rtol=1e-3, msg=name)
    # with the adapter off (TRL's reference log-probs for beta > 0) both paths see the base model
    with torch.no_grad(), model.disable_adapter():
        off_ref, off_ours = trl()[0], shared()[0]
    torch.testing.assert_close(off_ours, off_ref, atol=1e-4, rtol=1e-4)
    assert not torch.allclose(off_ours, ours[0], atol=1e-3)  # the adapter mattered


def test_an_adapter_on_the_lm_head_is_named_as_unsupported():
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaConfig, LlamaForCausalLM

    tiny = LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                        num_attention_heads=2, num_key_value_heads=1, tie_word_embeddings=False))
    model = get_peft_model(tiny, LoraConfig(r=2, target_modules=["q_proj", "lm_head"]))
    assert "LM head" in shared_prefix.unsupported_reason(model)


@pytest.mark.parametrize("overrides,needle", [
    (["peft.r=0"], "peft.r=0 must be a positive integer"),
    (["peft.r=-4"], "peft.r=-4"),
    (["peft.alpha=0"], "peft.alpha=0"),
    (["peft.dropout=1.0"], "peft.dropout=1.0"),
    (["peft.target_modules=[]"], "peft.target_modules=[]"),
    (["peft.target_modules=attention"], "peft.target_modules='attention'"),
    (["peft.target_modules=[q_proj,lm_head]"], "lm_head"),
])
def test_bad_lora_settings_are_one_line(tmp_path, overrides, needle):
    cfg = compose_cfg(["debug=smoke", "peft=lora", *overrides], tmp_path)
    with pytest.raises(ConfigError) as info:
        validate(cfg)
    assert needle in str(info.value) and "\n" not in str(info.value)


def test_lora_defaults_validate_and_none_is_the_default(tmp_path):
    assert compose_cfg([], tmp_path).peft.name == "none"
    cfg = compose_cfg(["peft=lora"], tmp_path)
    validate(cfg)
    assert cfg.peft.r >= 1 and list(cfg.peft.target_modules) == ["q_proj", "k_proj", "v_proj", "o_proj",
                                                                   "gate_proj", "up_proj", "down_proj"]
    validate(compose_cfg(["peft=lora", "peft.target_modules=all-linear"], tmp_path))
    validate(compose_cfg(["peft=none", "peft.r=0"], tmp_path))  # no adapter: its settings are not used


# Through the real entrypoint: exit code 2, one line naming the value, no run directory.
BAD_CLI = [
    (["peft=qlora"], "unknown peft option 'qlora' (did you mean 'lora'?); valid choices: lora, none"),
    (["peft=lora", "peft.r=0"], "peft.r=0 must be a positive integer"),
    (["peft=lora", "peft.r=1.5"], "peft.r"),
    (["peft.rank=8"], "unknown config key 'peft.rank' (did you mean 'peft.r'?); valid keys under peft: alpha, dropout, name, r"),
]


@pytest.mark.slow
@pytest.mark.parametrize("args,needle", BAD_CLI, ids=[" ".join(a) for a, _ in BAD_CLI])
def test_bad_peft_overrides_fail_fast_with_one_line(tmp_path, args, needle):
    assert_fails_fast_with_one_line(tmp_path / "run", ["model=tiny_random", *args], needle)


def test_a_kl_reference_with_an_adapter(tmp_path, test_rewards):
    """train.beta > 0: TRL scores the reference with a frozen copy of the starting adapter ("ref")."""
    run = tmp_path / "run"
    metrics = train(compose_cfg([*LORA, "train.max_steps=2", "train.beta=0.04"], run))
    assert metrics["status"] == "completed"
    kl = [row["kl"] for row in read_jsonl(run / "history.jsonl")]
    assert kl[0] == pytest.approx(0.0, abs=1e-6)  # step 1: the policy is its starting point
    assert all(math.isfinite(k) for k in kl) and kl[1] > 0  # after an update it has moved away
    assert not (run / "adapter" / "ref").exists()  # only the trained adapter is saved
    saved = load_file(str(run / "adapter" / "adapter_model.safetensors"))
    assert metrics["trainable_params"] == sum(t.numel() for t in saved.values())  # the "ref" copy is frozen
