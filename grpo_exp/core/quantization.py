"""Quantized copies of a policy for evaluation and serving; the policy being trained is never touched.

`dynamic_int8`: int8 dynamic quantization of the nn.Linear layers (weights int8 per tensor, stored
packed; activations quantized on the fly per batch) with PyTorch's eager `quantize_dynamic`
(torch.ao, `x86` engine: FBGEMM/oneDNN kernels).

Chosen over torchao on speed, measured on this 2-core AVX2 CPU (shared with other jobs; 1 thread;
SmolLM2-135M, batch 8, 16 forced greedy tokens, 3 interleaved runs): fp32 31-38 tok/s,
`quantize_dynamic` 51-63 tok/s (~1.6x), torchao 0.18 `Int8DynamicActivationInt8WeightConfig`
0.8-0.9 tok/s (~40x slower than fp32: without AVX512-VNNI/AMX its int8 matmul takes a slow
fallback path). torchao would also be an extra dependency, so it is not one. On 50 basic problems
(grpo-compare --int8, 1 thread): decode speed x1.46, size in memory 513 -> 209 MB (x0.41),
accuracy 0.20 -> 0.12 (paired McNemar p=0.34). Per-channel weight scales measured no better (0.10).

The LM head stays fp32. SmolLM2 ties `lm_head.weight` to `embed_tokens.weight`; the embedding lookup
needs the fp32 matrix anyway, so an int8 head is a second copy of the largest matrix (+27 MB here)
and cuts the tie (generation still works: the copy's head simply stops sharing the embedding). It
would be ~25% faster (the head is ~20% of the FLOPs per token) and puts quantization error straight
into the logits; `dynamic_int8(model, skip=())` quantizes it for whoever wants that trade.
"""

from __future__ import annotations

import copy
import warnings

import torch

from grpo_exp.base.errors import ConfigError

METHODS = ("none", "dynamic_int8")
# Layers kept in floating point: the (usually tied) output projection.
SKIP_MODULES = ("lm_head",)


def quantize_for_eval(model: torch.nn.Module, method: str) -> torch.nn.Module:
    """The model to evaluate for `quantization.method`.

    `none` returns `model` itself (nothing is changed); `dynamic_int8` returns a quantized deep
    copy in eval mode and leaves `model` exactly as it was.
    """
    if method == "none":
        return model
    if method != "dynamic_int8":
        raise ConfigError(f"quantization.method={method!r} is not valid; choose one of: {', '.join(METHODS)}")
    return dynamic_int8(model)


def dynamic_int8(model: torch.nn.Module, skip: tuple[str, ...] = SKIP_MODULES) -> torch.nn.Module:
    """A deep copy with every nn.Linear except those named in `skip` replaced by an int8 dynamic Linear."""
    qmodel = copy.deepcopy(model).float().eval()
    spec = {name: torch.ao.quantization.default_dynamic_qconfig for name, module in qmodel.named_modules()
            if isinstance(module, torch.nn.Linear) and name.rsplit(".", 1)[-1] not in skip}
    with warnings.catch_warnings():
        # torch.ao's eager quantization warns that it will move to torchao; the API still works and
        # torchao's CPU int8 path is several times slower here (see the module docstring).
        warnings.simplefilter("ignore")
        return torch.ao.quantization.quantize_dynamic(qmodel, spec, dtype=torch.qint8, inplace=True)


def quantized_linear_count(model: torch.nn.Module) -> int:
    """How many Linear layers of `model` run as int8 dynamic Linear."""
    from torch.ao.nn.quantized.dynamic import Linear as DynamicQuantizedLinear

    return sum(isinstance(m, DynamicQuantizedLinear) for m in model.modules())
