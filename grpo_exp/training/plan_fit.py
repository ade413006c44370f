"""The speed plan fitted to the loaded model, once, before the trainer is built.

config/speed.py resolves every `auto` against the machine and the run's settings (peft, TRL's generation settings):
that plan is what the settings record (training_settings.json, `resolved.speed.*`) holds. What only the loaded
model can say is fitted here, in one function, before the trainer is built: the trainer, the rollout engine and
speed_plan.json then read the fitted plan and nothing changes it again (the trainer never replaces it).

Only the exact shortcuts depend on the model in practice (each distinct prompt scored once, the bf16 KL reference,
the tied embedding's gradient as rows): they are speed_plan.json's alone. The one recorded setting a model can
change is the sampler: a model the rollout engine cannot decode (an encoder-decoder, a vision-language model, a
model with logit soft-capping, ...) samples with TRL's `generate`; the log says so, and speed_plan.json records it.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from grpo_exp.base import log
from grpo_exp.config.speed import SpeedPlan, auto_generation, engine_declined, trl_setting
from grpo_exp.kernels import embedding_grad, lean_reference
from grpo_exp.training import shared_prefix
from grpo_exp.training.rollout import trl_hook

logger = log.get_logger(__name__)

# the engine's fields of a plan whose completions another sampler draws
OFF_ENGINE = {"generation": "trl", "rollout_dtype": None, "rollout_compile": False, "rollout_prepack": False,
              "old_logps": None}


def fit(plan: SpeedPlan, cfg: Any, model: torch.nn.Module, processing_class: Any = None) -> SpeedPlan:
    """`plan` (config/speed.plan_for(cfg)) less what `model` (the policy, a PEFT wrapper too) and `cfg.train`
    rule out, each change logged with its reason."""
    train = cfg.train
    changes: dict[str, Any] = {}
    requested = cfg.speed.generation if cfg.speed.generation != "auto" else auto_generation(plan.device)
    declined = engine_declined(train, getattr(getattr(cfg, "peft", None), "name", None) or "none")
    if requested == "engine" and plan.generation == "trl" and declined:
        logger.warning("speed.generation: the rollout engine is not used for %s; TRL's generation runs", declined)
    if plan.generation == "engine":
        why = trl_hook.model_declined(model, processing_class)
        if why:
            logger.warning("speed.generation: the rollout engine is not used for %s; TRL's generation runs (the "
                           "settings record says engine, speed_plan.json what ran)", why)
            changes.update(OFF_ENGINE)
    head_in_fp32 = bool(trl_setting(train, "cast_lm_head_to_fp32", False))
    if plan.shared_prefix:
        why = shared_prefix.unsupported_reason(model) or ("train.extra.cast_lm_head_to_fp32" if head_in_fp32 else None)
        if why:
            logger.debug("shared-prefix scoring off for %s; TRL's own forward scores the batch", why)
            changes["shared_prefix"] = False
    if plan.lean_reference:
        why = reference_declined(plan, train, model, head_in_fp32)
        if why:
            logger.debug("lean reference: the KL reference kept as TRL loads it (%s)", why)
            changes["lean_reference"] = False
    if plan.embedding_grad and not embedding_grad.supported(shared_prefix.scoring_model(model)):
        changes["embedding_grad"] = False
    return dataclasses.replace(plan, **changes) if changes else plan


def reference_declined(plan: SpeedPlan, train: Any, model: torch.nn.Module, head_in_fp32: bool) -> str | None:
    """Why TRL's KL reference will not take bf16 Linear weights (kernels/lean_reference.py), known before TRL loads
    it: TRL loads none for beta 0 or a PEFT policy, and loads it in the policy's dtype; its forwards run under bf16
    autocast where training does."""
    has_reference = float(trl_setting(train, "beta", 0.0)) != 0.0 and not hasattr(model, "get_base_model")
    return lean_reference.unsupported_reason(
        model if has_reference else None, autocast_dtype=torch.bfloat16 if plan.precision == "bf16" else None,
        syncs_with_policy=bool(trl_setting(train, "sync_ref_model", False)), head_in_fp32=head_in_fp32)
