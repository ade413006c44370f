"""One speed plan, fitted once (training/plan_fit.py): config/speed.plan_for resolves the settings' part (peft, TRL's
generation settings), plan_fit.fit the model's, before the trainer is built; the trainer never replaces its plan, and
the settings record (training_settings.json) and speed_plan.json agree on who sampled."""

from __future__ import annotations

import ast
import dataclasses
import json

from grpo_exp.config.checks import validate
from grpo_exp.config.speed import SpeedPlan, plan_for
from grpo_exp.training import plan_fit
from grpo_exp.training.stage import prepare, train
from grpo_exp.training.trainer import build_trainer
from tests.conftest import ROOT, compose_cfg

# the tiny model, one step, the engine asked for explicitly (auto's choice differs by machine)
TINY = ["debug=smoke", "logger=none", "reward.funcs=[vowel_fraction]", "reward.weights=[1.0]", "eval.after_train=false",
        "eval.every_steps=null", "cpu.threads=1", "train.max_steps=1", "speed.generation=engine"]


def test_a_lora_run_records_one_sampler_in_both_files(tmp_path, test_rewards):
    """peft=lora: the engine cannot sample for an adapter, so TRL's generate does; the settings record said engine
    and speed_plan.json trl before the plan was resolved against peft."""
    run = tmp_path / "run"
    metrics = train(compose_cfg([*TINY, "peft=lora", "train.beta=0.0"], run))
    assert metrics["status"] == "completed"
    settings = json.loads((run / "training_settings.json").read_text())
    plan = json.loads((run / "speed_plan.json").read_text())
    assert settings["speed.generation"] == "engine"  # what was asked for
    assert settings["resolved.speed.generation"] == plan["speed.generation"] == "trl"  # what ran, in both files
    # every speed key the settings record resolved is the plan's
    for key, value in settings.items():
        if key.startswith("resolved.speed."):
            assert plan[key.removeprefix("resolved.")] == value, key
    assert settings["resolved.train.precision"] == plan["speed.precision"] == metrics["precision"]


def test_the_settings_decide_the_sampler_before_any_model_loads(tmp_path):
    engine = compose_cfg(["debug=smoke", "speed.generation=engine"], tmp_path)
    assert plan_for(engine).generation == "engine"
    for override in ("peft=lora", "train.repetition_penalty=1.1", "+train.extra.min_p=0.1"):
        plan = plan_for(compose_cfg(["debug=smoke", "speed.generation=engine", override], tmp_path))
        assert (plan.generation, plan.rollout_dtype, plan.old_logps, plan.rollout_compile) == ("trl", None, None,
                                                                                               False), override


def _replaces_of_a_plan(monkeypatch) -> list:
    """Every dataclasses.replace of a SpeedPlan from now on."""
    calls, original = [], dataclasses.replace

    def recording(obj, **changes):
        if isinstance(obj, SpeedPlan):
            calls.append(changes)
        return original(obj, **changes)

    monkeypatch.setattr(dataclasses, "replace", recording)
    return calls


def test_the_trainer_runs_the_plan_fitted_before_it_and_never_replaces_it(tmp_path, test_rewards, monkeypatch):
    cfg = compose_cfg([*TINY, "peft=lora", "train.beta=0.0"], tmp_path)
    validate(cfg)
    parts = prepare(cfg)
    fitted = plan_fit.fit(plan_for(cfg), cfg, parts.model, parts.tokenizer)
    fits = []
    monkeypatch.setattr(plan_fit, "fit", lambda *a, _fit=plan_fit.fit: fits.append(_fit(*a)) or fits[-1])
    calls = _replaces_of_a_plan(monkeypatch)
    trainer = build_trainer(cfg, parts, tmp_path, [])
    assert len(fits) == 1 and trainer.speed_plan is fits[0] and trainer.speed_plan == fitted  # fitted once
    # a LoRA policy: no KL reference to make lean (and no engine: the settings said so before the model loaded)
    assert (fitted.generation, fitted.lean_reference) == ("trl", False)
    assert all("generation" not in c for c in calls)  # only the model's own part was fitted
    calls.clear()
    trainer.train()
    assert calls == []  # training replaces nothing either
    # and the trainer's code has no replace of a plan at all
    tree = ast.parse((ROOT / "grpo_exp" / "training" / "trainer.py").read_text())
    replaces = [node.lineno for node in ast.walk(tree) if isinstance(node, ast.Call) and (
        getattr(node.func, "attr", None) == "replace" or getattr(node.func, "id", None) == "replace")]
    assert replaces == [], f"trainer.py calls replace at lines {replaces}"


def test_what_the_model_rules_out_is_fitted_and_logged(tmp_path, caplog):
    """The tiny model supports every shortcut; a cast LM head rules out the shared-prefix scoring and the lean
    reference, fp32 training or beta 0 the lean reference; the fit says why."""
    cfg = compose_cfg(["debug=smoke", "train.precision=bf16", "train.beta=0.04"], tmp_path)
    parts = prepare(cfg)
    plan = plan_for(cfg)
    assert plan.shared_prefix and plan.lean_reference and plan.embedding_grad
    assert plan_fit.fit(plan, cfg, parts.model, parts.tokenizer) == plan  # nothing ruled out
    cast = compose_cfg(["debug=smoke", "train.precision=bf16", "train.beta=0.04",
                        "+train.extra.cast_lm_head_to_fp32=true"], tmp_path)
    with caplog.at_level("DEBUG", logger="grpo_exp"):  # the fit's reasons are detail, at DEBUG
        fitted = plan_fit.fit(plan_for(cast), cast, parts.model, parts.tokenizer)
    assert not fitted.shared_prefix and not fitted.lean_reference and fitted.embedding_grad
    assert "shared-prefix scoring off for train.extra.cast_lm_head_to_fp32" in caplog.text
    fp32 = compose_cfg(["debug=smoke", "train.precision=fp32", "train.beta=0.04"], tmp_path)
    assert "fp32 training" in plan_fit.reference_declined(plan_for(fp32), fp32.train, parts.model, False)
    no_kl = compose_cfg(["debug=smoke", "train.precision=bf16", "train.beta=0.0"], tmp_path)
    assert "no reference model" in plan_fit.reference_declined(plan_for(no_kl), no_kl.train, parts.model, False)
