"""Grouped-query attention that reads the key/value heads in place, and the choice of a model's attention.

Why: transformers' `sdpa` on a CPU, with a mask, first copies every key/value head to each query head that shares it
(`repeat_kv`), and CPU flash attention's backward is slow at GRPO's short sequences. Grouping the query heads that
share a key/value head instead, with two matmuls and an fp32 softmax (as transformers' eager attention), trained the
default model's 8 x 120-token scoring pass (forward and backward, bf16 autocast, 2 threads) in 1.43 s against 1.78 s
for sdpa and 1.47 s for eager, and 3.88 s against 4.26 / 4.36 s at 256 tokens (docs/performance.md, "Grouped
attention"). The same function serves the rollout engine's static-cache decoding; inside its compiled step, the
softmax is kernels/decode_attention.py's C++ kernel, which computes inductor's numbers in one pass, and in bf16 on a CPU
with AVX512-BF16 the whole attention (both products and the softmax) is one kernel there, which computes the same
numbers as the products and that softmax in turn.

`speed.attention=auto` (the default since 2026-11-27, later) takes it on a CPU and transformers' sdpa on CUDA,
where fused attention kernels are the fast path. A run's result is sensitive to such rounding changes: without
the basic stage's KL penalty, seed 42 of the default run scored 0.250 with it where sdpa scored 0.485, greedy
generation token-for-token the same; with the penalty and the rollout engine, seeds were scored again before it
became the default (docs/log.md, "2026-11-27 — the engine with grouped attention").
"""

from __future__ import annotations

import torch

from grpo_exp.base import log
from grpo_exp.kernels import decode_attention

logger = log.get_logger(__name__)

GROUPED = "grpo_grouped"
# grouped attention whose decoding steps take their scores as [b, kv, g, L] (speed.attention_decode=last_axis)
GROUPED_LAST_AXIS = "grpo_grouped_last_axis"
# the choices of `use`: sdpa and eager are transformers' own (the speed plan resolves speed.attention=auto)
CHOICES = ("sdpa", "grouped", "eager")


def grouped_attention(module, query, key, value, attention_mask, scaling, dropout=0.0, *, whole_sums: bool = False,
                      **kwargs):
    """Attention in transformers' attention interface, query heads grouped by the key/value head they share.

    The products are taken as key @ query^T and probs^T @ value so that the large operand (a long or static
    cache) is read in place: a transposed cache operand makes `bmm` copy it. Softmax in fp32. No dropout:
    GRPO trains without it, and the models grpo-exp loads have attention dropout 0.

    whole_sums: a compiled decoding step's softmax sums each row along L in one pass, never split between threads
    as inductor splits it for many rows (decode_attention.sum_chunks): a row's numbers then do not depend on how
    many rows decode beside it, nor on the thread count (greedy evaluation, evaluation/fast_decode.py)."""
    b, h, q, d = query.shape
    kv = key.shape[1]
    g = h // kv
    # query head j*g + i uses key/value head j (repeat_kv's order): group them along the query axis
    grouped = query.reshape(b, kv, g * q, d)
    chunks = _decode_attention_chunks(query, key, value, attention_mask, whole_sums)
    if chunks is not None:  # a compiled decoding step in bf16: the whole attention, one C++ kernel
        out = torch.ops.grpo_exp.decode_attention(grouped, key, value, attention_mask, scaling, chunks)
        return out.view(b, h, q, d).transpose(1, 2).contiguous(), None
    scores = torch.matmul(key, grouped.transpose(2, 3)).view(b, kv, -1, g, q)  # [b, kv, L, g, q]
    chunks = _decode_kernel_chunks(scores, attention_mask, q, whole_sums)
    if chunks is not None:  # a compiled decoding step: inductor's softmax, computed by one C++ kernel
        probs = torch.ops.grpo_exp.decode_softmax(scores.view(b, kv, -1, g), attention_mask, scaling, chunks)
        out = torch.matmul(probs.transpose(2, 3), value)
        return out.view(b, h, q, d).transpose(1, 2).contiguous(), None
    if attention_mask is not None:  # [b, 1, q, L], additive, the same for every head
        scores = scores + attention_mask.transpose(2, 3)[:, :, :, None, :]
    probs = torch.softmax(scores * scaling, dim=2, dtype=torch.float32).to(query.dtype)
    out = torch.matmul(probs.view(b, kv, -1, g * q).transpose(2, 3), value)  # [b, kv, g*q, d]
    return out.view(b, h, q, d).transpose(1, 2).contiguous(), None


def _decode_attention_chunks(query, key, value, attention_mask, whole_sums: bool = False) -> int | None:
    """How decode_softmax's kernel splits each sum, where a compiled decoding step's whole attention can go through
    decode_attention's kernel (bf16 query, key and value, one query position; kernels/decode_attention.py); None
    elsewhere."""
    b, h, q, d = query.shape
    if (q != 1 or not all(t.dtype == torch.bfloat16 for t in (query, key, value))
            or not decode_attention.attention_usable(query.dtype, d)
            or not decode_attention.usable(query.dtype, attention_mask, query.device)):
        return None
    kv = key.shape[1]
    if whole_sums:  # asked for one row of length 1: whether the kernel is known here, whatever the sizes
        return None if decode_attention.sum_chunks(1, h // kv, 1) is None else 1
    return decode_attention.sum_chunks(b * kv, h // kv, key.shape[2])


def _decode_kernel_chunks(scores: torch.Tensor, attention_mask, q: int, whole_sums: bool = False) -> int | None:
    """How decode_softmax's kernel splits each sum, where a compiled decoding step's softmax can go through it
    (kernels/decode_attention.py); None where inductor's own kernel is kept. whole_sums: 1 wherever the kernel is
    known, asked without the row count (which a step compiled for any number of rows does not fix)."""
    if q != 1 or not decode_attention.usable(scores.dtype, attention_mask, scores.device):
        return None
    b, kv, length, g, _ = scores.shape
    if whole_sums:  # asked for one row of length 1: whether the kernel is known here, whatever the sizes
        return None if decode_attention.sum_chunks(1, g, 1) is None else 1
    return decode_attention.sum_chunks(b * kv, g, length)


def grouped_attention_last_axis(module, query, key, value, attention_mask, scaling, dropout=0.0, **kwargs):
    """grouped_attention, except that a decoding step (one query position) takes its scores as [b, kv, g, L]:
    query @ key^T, a softmax along the last axis, probs @ value.

    Why: with one query position grouped_attention's scores are [b, kv, L, g] with g (3 for the default model)
    innermost, and inductor's CPU code for a softmax along L then opens one parallel region per row and
    key/value head, about a sixth of the rollout engine's compiled decoding step at 16 rows. The maths is the
    same, the rounding is not (another GEMM layout and summation order in bf16), so it is opt-in: docs/log.md,
    "2026-11-28 — train.attention_decode=last_axis"."""
    b, h, q, d = query.shape
    if q != 1:
        return grouped_attention(module, query, key, value, attention_mask, scaling, dropout, **kwargs)
    kv = key.shape[1]
    grouped = query.reshape(b, kv, h // kv, d)  # query head j*g + i is row i of group j (repeat_kv's order)
    scores = torch.matmul(grouped, key.transpose(2, 3))  # [b, kv, g, L]
    if attention_mask is not None:  # [b, 1, 1, L], additive
        scores = scores + attention_mask
    probs = torch.softmax(scores * scaling, dim=-1, dtype=torch.float32).to(query.dtype)
    return torch.matmul(probs, value).view(b, q, h, d), None  # [b, kv, g, d] is [b, h, d] in head order


# speed.attention_decode -> the grouped attention registered for it: (its name in transformers, its function)
_GROUPED_BY_LAYOUT = {"cache_axis": (GROUPED, grouped_attention),
                      "last_axis": (GROUPED_LAST_AXIS, grouped_attention_last_axis)}
# speed.attention_decode's choices: how grouped attention lays out a decoding step's scores
DECODE_LAYOUTS = tuple(_GROUPED_BY_LAYOUT)
# grouped attention whose decoding steps sum each softmax in one pass (`use(..., whole_sums=True)`)
GROUPED_WHOLE_SUMS = "grpo_grouped_whole_sums"


def _grouped_whole_sums(module, query, key, value, attention_mask, scaling, dropout=0.0, **kwargs):
    return grouped_attention(module, query, key, value, attention_mask, scaling, dropout, whole_sums=True, **kwargs)


def unsupported_reason(model: torch.nn.Module) -> str | None:
    """Why grouped attention cannot compute this model's attention (None when it can): it computes softmax(scores *
    scaling + mask) @ value, with the window of a sliding-window layer in the mask; a model whose attention caps its
    scores (Gemma 2's attn_logit_softcapping) or adds sink logits (gpt-oss) needs its own."""
    for module in model.modules():
        if getattr(module, "attn_logit_softcapping", None) is not None:
            return "a model whose attention caps its scores (attn_logit_softcapping)"
        if getattr(module, "sinks", None) is not None:
            return "a model with attention sinks"
    return None


def use(model: torch.nn.Module, choice: str, decode: str = "cache_axis", whole_sums: bool = False) -> str | None:
    """Set `model`'s attention to `choice` (see CHOICES), grouped attention's decoding steps laid out as
    `decode` says (DECODE_LAYOUTS), their softmax sums unsplit with `whole_sums` (grouped_attention; the cache axis
    layout only); returns the implementation now in use, or None where this transformers release or the model's
    attention (unsupported_reason) cannot take it (the model keeps its own, logged)."""
    if choice not in CHOICES:
        raise ValueError(f"unknown attention {choice!r}; choose one of {', '.join(CHOICES)}")
    if decode not in DECODE_LAYOUTS:
        raise ValueError(f"unknown decoding layout {decode!r}; choose one of {', '.join(DECODE_LAYOUTS)}")
    if whole_sums and (choice, decode) != ("grouped", "cache_axis"):
        raise ValueError("whole_sums applies to grouped attention with the cache_axis layout")
    why = unsupported_reason(model) if choice == "grouped" else None
    if why:
        logger.info("attention grouped not set (%s); the model's own is used", why)
        return None
    name, function = _GROUPED_BY_LAYOUT[decode] if choice == "grouped" else (choice, None)
    if whole_sums:
        name, function = GROUPED_WHOLE_SUMS, _grouped_whole_sums
    try:
        if function is not None:
            from transformers import AttentionInterface
            from transformers.masking_utils import AttentionMaskInterface, eager_mask

            AttentionInterface.register(name, function)
            AttentionMaskInterface.register(name, eager_mask)  # additive 0 / -inf masks, never skipped
        model.set_attn_implementation(name)
    except Exception as err:  # another transformers release or model class: keep the model's own attention
        logger.info("attention %s not set (%s: %s); the model's own is used", choice, type(err).__name__, err)
        return None
    return name
