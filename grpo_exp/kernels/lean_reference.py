"""The KL reference model held lean: its Linear weights stored in the autocast dtype, and none of its tensors left
on the model file's memory map.

Why: TRL loads the reference from the model's files (`create_model_from_path`), and safetensors hands transformers
tensors that are views of a private memory map of the file. The first reference forward reads every page of it,
and those pages then count in the process's resident memory for the whole run: the default model's 540 MB of fp32
weights (the bench's profile charged a 562 MB rise of the peak RSS to the first scoring forward with the KL penalty
on). Under bf16 autocast, which every reference forward of a bf16 run goes through (accelerate wraps the prepared
reference's forward in it; the shared-prefix scoring enters it itself), each Linear product casts its weight to bf16
first, rounding to nearest even. A weight stored in bf16 is that same rounded weight, and autocast uses it as it is,
so every log-prob is the same bit for bit (tests/core/test_lean_reference.py), from half the bytes.

Only Linear layers are stored in bf16: the input embedding, a tied LM head and the norms are read in fp32 under
autocast too (a lookup and elementwise maths), so they keep their dtype. Those are copied off the map, and the
map goes when its last tensor does.
"""

from __future__ import annotations

import torch


def unsupported_reason(reference: torch.nn.Module | None, *, autocast_dtype: torch.dtype | None,
                       syncs_with_policy: bool, head_in_fp32: bool) -> str | None:
    """Why the reference is kept as TRL made it (None: `shrink` may take it). The reference's forwards must run
    under autocast to `autocast_dtype`, and nothing may write into its weights (TRL's sync_ref_model mixes the
    policy's in)."""
    if reference is None:
        return "no reference model (beta 0, or a PEFT policy whose adapter is turned off instead)"
    if autocast_dtype is None:
        return "its forwards run without autocast (fp32 training)"
    if syncs_with_policy:
        return "train.extra.sync_ref_model mixes the policy's weights into it"
    if head_in_fp32:
        return "train.extra.cast_lm_head_to_fp32"
    if any(p.dtype != torch.float32 for p in reference.parameters()):
        return "its weights are not all fp32 (a quantized or half-precision model)"
    return None


@torch.no_grad()
def shrink(reference: torch.nn.Module, dtype: torch.dtype) -> tuple[int, int]:
    """Store the reference's Linear weights (and biases) in `dtype`, copy every other tensor it holds into memory of
    its own, in place; returns the bytes of its parameters before and after. The output embedding stays as it is
    (tied to the input embedding, it is read in fp32 by the lookup)."""
    head = reference.get_output_embeddings()
    keep = {id(reference.get_input_embeddings().weight), id(head.weight) if head is not None else None}
    before = sum(p.numel() * p.element_size() for p in reference.parameters())
    for module in reference.modules():
        if not isinstance(module, torch.nn.Linear) or id(module.weight) in keep:
            continue
        for param in (module.weight, module.bias):
            if param is not None and param.dtype != dtype:
                param.data = param.data.to(dtype)
    for param in reference.parameters():  # once each, tied ones too
        if param.dtype == torch.float32:
            param.data = param.data.clone()
    for module in reference.modules():
        for name, buffer in list(module.named_buffers(recurse=False)):
            if buffer is not None:
                setattr(module, name, buffer.clone())
    return before, sum(p.numel() * p.element_size() for p in reference.parameters())
