"""How the rollout engine is plugged into TRL's GRPOTrainer: its `rollout_func`, and TRL's vLLM path.

GRPOTrainer calls `rollout_func(prompts, trainer)` in place of its own generation and expects `prompt_ids`,
`completion_ids` and `logprobs`. Where the copy's samples need correcting, the trainer is made to look as if vLLM
had sampled them, since TRL applies its importance-sampling correction to vLLM rollouts only.
"""

from __future__ import annotations

from types import SimpleNamespace

import torch
from transformers import ProcessorMixin

from grpo_exp.base import log
from grpo_exp.config.speed import IS_MODES, SpeedPlan, engine_declined
from grpo_exp.training.rollout.engine import RolloutEngine, model_unsupported_reason

logger = log.get_logger(__name__)


def model_declined(model, processing_class=None) -> str | None:
    """What the loaded model rules out for the engine (None when it can serve it); the settings' own reasons
    (peft, TRL's generation settings) are config/speed.engine_declined's, which the plan already took."""
    if hasattr(model, "get_base_model") or hasattr(model, "peft_config"):
        return "a PEFT model (the rollout copy would need the adapter merged)"
    if isinstance(processing_class, ProcessorMixin):  # TRL's own test for a vision-language model
        return "a vision-language model"
    if getattr(model.config, "is_encoder_decoder", False):
        return "an encoder-decoder model"
    return model_unsupported_reason(model)


def unsupported_reason(trainer) -> str | None:
    """Why the engine cannot serve this trainer (None when it can): its settings, tools, or its model."""
    if getattr(trainer, "tools", None) or getattr(trainer, "environment_factories", None) is not None:
        return "tools or environments"
    return (engine_declined(trainer.args) or model_declined(trainer.model, getattr(trainer, "processing_class", None))
            or ("a vision-language model" if getattr(trainer, "_is_vlm", False) else None))


def rollout_func(engine: RolloutEngine):
    """TRL's `rollout_func(prompts, trainer)` served by `engine`: prompts tokenized exactly as TRL tokenizes for
    its own generate, the copy refreshed before and its memory given back after."""

    def rollout(prompts: list, trainer) -> dict:
        engine.sync(trainer)
        prompt_ids, _, _ = trainer._tokenize_prompts(prompts)
        device_type = engine.device.type
        with torch.autocast(device_type=device_type, enabled=False):  # the copy sets its own (_last_logits)
            completion_ids, logprobs = engine.generate(prompt_ids)
        engine.release()  # until the next round: the training step comes next
        return {"prompt_ids": prompt_ids, "completion_ids": completion_ids, "logprobs": logprobs}

    return rollout


def enable_is_correction(trainer) -> None:
    """Turn on TRL's own importance-sampling correction for vLLM rollouts, without vLLM, with the settings in
    trainer.args (vllm_importance_sampling_mode and _clip_max; grpo_exp.training.trainer.grpo_config maps
    speed.is_* onto them).

    GRPOTrainer applies it when `use_vllm` and `vllm_importance_sampling_correction` are set: it then always
    scores the batch with the trained policy (`old_per_token_logps`), and weighs each token's loss by
    exp(old - sampling log-prob), truncated or masked at the cap, per token or per sequence. Its only other use
    of `use_vllm` on the rollout_func path is a weight sync of the vLLM engine, a no-op here: the engine
    refreshes its copy itself (RolloutEngine.sync)."""
    if trainer.args.use_vllm:
        # a real vLLM (speed.generation=vllm, train.extra.use_vllm): the stub below would replace its engine, and
        # its weights would never be synced again
        raise RuntimeError("the rollout engine's stand-in for vLLM cannot run beside TRL's own vLLM (use_vllm is set)")
    mode = trainer.args.vllm_importance_sampling_mode
    if mode not in IS_MODES:
        raise ValueError(f"unknown importance-sampling mode {mode!r}; choose one of {', '.join(IS_MODES)}")
    trainer.use_vllm = True
    trainer.vllm_importance_sampling_correction = True
    trainer._last_loaded_step = -1
    trainer.vllm_generation = SimpleNamespace(sync_weights=lambda: None)


def build_engine(trainer, plan: SpeedPlan) -> RolloutEngine:
    """The engine for a plan with `generation=engine` (fitted to this model: training/plan_fit), wired into the
    trainer."""
    why = unsupported_reason(trainer)
    if why:  # the plan was fitted to these settings and this model: a case plan_fit does not know
        raise RuntimeError(f"the speed plan says generation=engine but the engine cannot serve {why}; "
                           f"training/plan_fit.fit should have fitted the plan to it")
    engine = RolloutEngine(
        trainer.model, dtype=plan.weight_dtype(), autocast=plan.rollout_dtype == "autocast",
        compile=plan.rollout_compile, prepack=plan.rollout_prepack,
        max_new_tokens=trainer.max_completion_length, temperature=trainer.temperature, top_k=trainer.top_k,
        top_p=trainer.top_p, eos_token_ids=list(trainer.eos_token_ids),
        pad_token_id=trainer._tokenizer.pad_token_id, sampler=plan.rollout_sampler,
        min_new_tokens=(trainer.args.generation_kwargs or {}).get("min_new_tokens", 0),
        attention_decode=plan.attention_decode)
    trainer.rollout_func = rollout_func(engine)
    if plan.old_logps == "sampler":
        engine.keep_logps = True
        logger.debug("speed.old_logps=sampler: PPO's old log-probs are the sampler's (%s copy); TRL's scoring "
                    "forward over each round is skipped and no importance weights apply", engine.label)
    elif trainer.args.vllm_importance_sampling_correction:
        enable_is_correction(trainer)
    return engine
