"""Score a GRPO batch with each distinct prompt run through the model once.

A GRPO batch holds every prompt `num_generations` times. TRL's scoring forward runs the whole
prompt+completion sequence for every row. On the CPU it also projects every prompt position through the LM
head and masks those positions out afterwards (TRL scores only valid positions on Triton devices). Here the
distinct prompts run once with a KV cache. The cache rows are then gathered back to the batch (`index_select`,
so gradients from every completion of a group add up in the shared prompt). The completions run on top of
that cache, and only completion positions reach the LM head: TRL's own chunked log-prob kernel, or with
`speed.logprob_kernel=autocast` kernels/logprob_head.py (the same maths, gradient GEMMs in the autocast dtype).

The maths is that of TRL's forward: same positions (TRL passes no position ids, so both use 0..L-1), same
masks, same kernel by default. Only float rounding differs. tests/test_shared_prefix.py checks log-probs, entropies
and gradients against TRL's path.

Under DistributedDataParallel (torchrun) the scoring runs as the wrapped module's forward, so DDP sets up
the gradient all-reduce for the backward that follows, as it does for TRL's own forward.

A PEFT (LoRA) policy is served through its inner transformers model: peft injects the adapters into that
model's own Linear layers, so its backbone and LM head already compute with them (and with whichever adapter
TRL makes active, or none, for the reference log-probs); tests/training/test_lora.py checks it against TRL's
path too.
"""

from __future__ import annotations

import functools
import inspect

import torch
from transformers import DynamicCache

from grpo_exp.kernels import lean_saved, logprob_head


def scoring_model(model):
    """The transformers model whose backbone and LM head score: a PEFT wrapper's inner model, which carries
    the adapters in its layers; any other model itself."""
    return model.get_base_model() if hasattr(model, "get_base_model") else model


def unsupported_reason(model) -> str | None:
    """Why this model cannot share prefixes (None when it can); checked once, when the trainer is built."""
    if hasattr(model, "get_base_model"):
        peft_type = getattr(getattr(model, "active_peft_config", None), "peft_type", None)
        if str(getattr(peft_type, "value", peft_type)) != "LORA":
            return f"a PEFT model of type {peft_type} (only LoRA adapters live inside the model's own layers)"
        if type(model.get_output_embeddings()).__module__.startswith("peft."):
            return "a PEFT adapter on the LM head (this path multiplies by the head's base weight)"
        model = scoring_model(model)
    config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    if config is not model.config:
        return "a multimodal model"
    # TRL's fused head applies these; this path passes the defaults, so it must not see a model that sets them.
    for name in ("final_logit_softcapping", "logit_scale", "output_multiplier", "lm_head_multiplier",
                 "logits_scaling"):
        if getattr(config, name, None) is not None:
            return f"a model with {name}"
    if getattr(config, "output_router_logits", False):
        return "a mixture-of-experts model"
    if not hasattr(model, "base_model") or model.get_output_embeddings() is None:
        return "a model without a separate backbone and LM head"
    return None


def checkpointing(model) -> bool:
    """Whether activation checkpointing is on (it runs layers without their KV cache)."""
    return any(getattr(m, "gradient_checkpointing", False) for m in model.modules())


@functools.lru_cache(maxsize=None)
def _cache_kwarg(backbone_type: type) -> str:
    """transformers 5 renamed the backbone's `past_key_values` argument to `cache` in a minor release; the pin
    allows both."""
    return "cache" if "cache" in inspect.signature(backbone_type.forward).parameters else "past_key_values"


def group_rows(prompt_ids: torch.Tensor, prompt_mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Indices of one row per distinct (prompt, mask) and, for every row, which distinct prompt it holds."""
    keys = torch.cat([prompt_ids, prompt_mask.to(prompt_ids.dtype)], dim=1)
    _, inverse = torch.unique(keys, dim=0, return_inverse=True)
    first = torch.full((int(inverse.max()) + 1,), keys.size(0), dtype=torch.long, device=keys.device)
    first.scatter_reduce_(0, inverse, torch.arange(keys.size(0), device=keys.device), reduce="amin")
    return first, inverse


def completion_logps(model, input_ids: torch.Tensor, attention_mask: torch.Tensor, logits_to_keep: int,
                     temperature: float, compute_entropy: bool,
                     kernel: str = "trl") -> tuple[torch.Tensor, torch.Tensor | None] | None:
    """Per-token log-probs (and entropies) of the last `logits_to_keep` tokens, as TRL's
    `_get_per_token_logps_and_entropies` returns them for one chunk; None when no prompt repeats in the chunk."""
    prompt_len = input_ids.size(1) - logits_to_keep
    if prompt_len < 1:
        return None
    first, inverse = group_rows(input_ids[:, :prompt_len], attention_mask[:, :prompt_len])
    if first.numel() == input_ids.size(0):
        return None
    return _as_forward(model, lambda inner: _score(inner, input_ids, attention_mask, prompt_len, first, inverse,
                                                   temperature, compute_entropy, kernel))


def _as_forward(model, fn):
    """`fn(module)` as the forward of a DistributedDataParallel wrapper, for this one call; `fn(model)` for any
    other model. DDP all-reduces gradients only in a backward that its own forward prepared: scoring that
    bypassed the wrapper would leave every process training on its own gradients."""
    from torch.nn.parallel import DistributedDataParallel

    if not isinstance(model, DistributedDataParallel):
        return fn(model)
    inner = model.module
    saved = inner.__dict__.get("forward")  # accelerate may have put an autocast wrapper there
    inner.forward = lambda *args, **kwargs: fn(inner)
    try:
        return model()
    finally:
        if saved is None:
            del inner.forward
        else:
            inner.forward = saved


def _score(model, input_ids: torch.Tensor, attention_mask: torch.Tensor, prompt_len: int, first: torch.Tensor,
           inverse: torch.Tensor, temperature: float, compute_entropy: bool, kernel: str):
    model = scoring_model(model)
    backbone = model.base_model
    cache_kwarg = _cache_kwarg(type(backbone))
    cache = DynamicCache(config=model.config)
    prefix = backbone(input_ids=input_ids[first, :prompt_len], attention_mask=attention_mask[first, :prompt_len],
                      use_cache=True, **{cache_kwarg: cache})
    cache.reorder_cache(inverse)
    with lean_saved.last_pass():  # (no weight is used again in this forward: see kernels/lean_saved.py)
        rest = backbone(input_ids=input_ids[:, prompt_len:], attention_mask=attention_mask, use_cache=True,
                        **{cache_kwarg: cache})
    # The position before each token predicts it: the prompt's last position predicts the first completion token.
    hidden = torch.cat([prefix.last_hidden_state[:, -1:].index_select(0, inverse), rest.last_hidden_state[:, :-1]],
                       dim=1)
    labels = input_ids[:, prompt_len:]
    mask = attention_mask[:, prompt_len:].bool()
    head = model.get_output_embeddings()
    per_token = logprob_head.logprobs(hidden.reshape(-1, hidden.size(-1)), head.weight, head.bias, labels.reshape(-1),
                                      temperature, compute_entropy, kernel)
    logps = per_token[0].view(mask.shape).masked_fill(~mask, 0)
    entropy = per_token[1].view(mask.shape).masked_fill(~mask, 0) if compute_entropy else None
    return logps, entropy
