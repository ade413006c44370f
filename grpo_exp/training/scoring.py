"""The trainer's scoring forward (TRL's `_get_per_token_logps_and_entropies`, which every old, reference and training
log-prob passes through) as the speed plan runs it: each distinct prompt scored once (training/shared_prefix.py),
lean saved tensors on the training forward (kernels/lean_saved.py), else TRL's own forward; and the KL reference
made lean (kernels/lean_reference.py) where the plan says so."""

from __future__ import annotations

import torch

from grpo_exp.base import log
from grpo_exp.kernels import lean_reference, lean_saved
from grpo_exp.training import shared_prefix

logger = log.get_logger(__name__)


def forward(trainer, trl_forward, model, input_ids, attention_mask, logits_to_keep, batch_size=None,
            compute_entropy=False, compute_aux_loss=False, **model_kwargs):
    """`trainer`'s (a GrpoExpTrainer) scoring forward; `trl_forward` is TRL's own (GRPOTrainer's method, bound)."""
    plan = trainer.speed_plan
    if plan.saved_tensors == "lean" and model.training and torch.is_grad_enabled():
        with lean_saved.lean_forward(trainer.accelerator.unwrap_model(model)):
            return _forward(trainer, trl_forward, model, input_ids, attention_mask, logits_to_keep, batch_size,
                            compute_entropy, compute_aux_loss, **model_kwargs)
    return _forward(trainer, trl_forward, model, input_ids, attention_mask, logits_to_keep, batch_size,
                    compute_entropy, compute_aux_loss, **model_kwargs)


def _forward(trainer, trl_forward, model, input_ids, attention_mask, logits_to_keep, batch_size=None,
             compute_entropy=False, compute_aux_loss=False, **model_kwargs):
    """The shared-prefix scoring, or TRL's."""
    # Gradient checkpointing drops the KV cache the completions need; TRL itself turns it off under no_grad.
    checkpointing = model.training and torch.is_grad_enabled() and shared_prefix.checkpointing(model)
    if (not trainer.speed_plan.shared_prefix or checkpointing or compute_aux_loss
            or any(v is not None for v in model_kwargs.values())):
        return trl_forward(model, input_ids, attention_mask, logits_to_keep, batch_size, compute_entropy,
                           compute_aux_loss, **model_kwargs)
    batch_size = batch_size or input_ids.size(0)
    logps, entropies = [], []
    for start in range(0, input_ids.size(0), batch_size):
        ids, mask = input_ids[start:start + batch_size], attention_mask[start:start + batch_size]
        with trainer.accelerator.autocast():
            scored = shared_prefix.completion_logps(model, ids, mask, logits_to_keep, trainer.temperature,
                                                    compute_entropy, trainer.speed_plan.logprob_kernel)
        if scored is None:  # no prompt repeats in this chunk
            scored = trl_forward(model, ids, mask, logits_to_keep, compute_entropy=compute_entropy)[:2]
        logps.append(scored[0])
        entropies.append(scored[1])
    return torch.cat(logps), torch.cat(entropies) if compute_entropy else None, None


def shrink_reference(trainer) -> None:
    """speed.exact_shortcuts: the KL reference's Linear weights in bf16, off the model file's map, where its forwards
    run under bf16 autocast (kernels/lean_reference.py). The plan (training/plan_fit) decided it before TRL loaded
    the reference; a reference that turns out otherwise is a case plan_fit does not know, and fails here."""
    amp = trainer.accelerator.native_amp and trainer.accelerator.mixed_precision == "bf16"
    reference = trainer.accelerator.unwrap_model(trainer.ref_model) if trainer.ref_model is not None else None
    why_not = lean_reference.unsupported_reason(
        reference, autocast_dtype=torch.bfloat16 if amp else None,
        syncs_with_policy=bool(trainer.args.sync_ref_model), head_in_fp32=bool(trainer.args.cast_lm_head_to_fp32))
    if why_not:
        raise RuntimeError(f"the speed plan says lean_reference=true but TRL's KL reference cannot take it ({why_not}); "
                           f"training/plan_fit.reference_declined should have said so")
    before, after = lean_reference.shrink(reference, torch.bfloat16)
    logger.info("lean reference: the KL reference's Linear weights in bf16 (%.0f MB of parameters, "
                "%.0f before), off the model file's memory map", after / 2**20, before / 2**20)
