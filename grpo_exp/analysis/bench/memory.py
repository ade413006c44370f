"""A rough estimate of one bench point's peak memory, before any model loads: the model's shape comes from its
config (config.json of the model directory, the converted packaged model or the hub cache; a packaged model
not converted yet from KNOWN_SHAPES; tiny_random from conf/model), never from its weights. `grpo-bench
--matrix` refuses a point whose estimate is over the machine's available memory.

The estimate (bytes; fp32, the heavier of the bench's two kinds of variant, since each runs in a process of its
own, one after another):

    state       = 4 P (1 weights + 1 gradients + 2 Adam moments [+ 1 KL reference when beta != 0])
    logits      = 4 B (L + 1) V          one full-vocabulary fp32 copy of the completion positions
    layer       = 4 B T (6 h + 4 I)      what one decoder layer keeps for its backward (norm inputs and outputs,
                                         q k v, attention output, gate, up, their product)
    kv cache    = 4 x 2 layers kv_heads head_dim R T      sampling a generation round
    plain TRL   = state + 3 logits (the logits, their temperature-scaled copy and their gradient)
                  + 4 B T h layers (gradient checkpointing: each layer's input) + 1 layer + kv cache + runtime
    grpo-exp    = state + 1 logits (its log-prob head keeps each block's product) + layers x layer + kv cache
                  + runtime (no gradient checkpointing)

with P the parameters, B the completions of one optimizer step (prompts per step x group), R those of a
generation round, L the completion length, T = PROMPT_TOKENS + L, V the vocabulary, h the hidden size, I the
MLP's, and runtime RUNTIME_MB (Python, torch, the tokenizer, the data). At the bench's default shape on SmolLM2
(2 x 4 completions of 64 tokens, beta 0) it gives 4.7 GB where the bench measured 3.6-4.2 GB of peak RSS
(docs/log.md): an estimate on the high side, to refuse points that cannot fit, not to predict a peak.
"""

from __future__ import annotations

import json
from pathlib import Path

RUNTIME_MB = 1024.0
# prompt tokens per completion row: the basic stage's chat-templated prompts average about 55 tokens
PROMPT_TOKENS = 96
# config.json figures of the packaged models once converted (models.convert_packaged_gguf), for a model whose
# conversion has not run yet: the estimate must not convert (load) it
KNOWN_SHAPES = {
    "smollm2_135m": {"vocab_size": 49152, "hidden_size": 576, "intermediate_size": 1536, "num_hidden_layers": 30,
                     "num_attention_heads": 9, "num_key_value_heads": 3, "head_dim": 64, "tie_word_embeddings": True},
    "gemma3_270m": {"vocab_size": 262144, "hidden_size": 640, "intermediate_size": 2048, "num_hidden_layers": 18,
                    "num_attention_heads": 4, "num_key_value_heads": 1, "head_dim": 256, "tie_word_embeddings": True},
}
TINY_VOCAB = 49152  # tiny_random shares SmolLM2's tokenizer


class ShapeError(ValueError):
    """A model whose config cannot be read without loading it; the message says why, in a line."""


def shape_from_config(config: dict) -> dict:
    """The figures the estimate needs from a transformers config.json (a multimodal one's text_config), with the
    parameter count of a decoder of that shape: embeddings, attention and gated MLP projections, norms, and an
    untied LM head."""
    config = config.get("text_config") or config
    try:
        h, layers, vocab = config["hidden_size"], config["num_hidden_layers"], config["vocab_size"]
        inter = config.get("intermediate_size") or 4 * h
        heads = config.get("num_attention_heads") or max(1, h // 64)
    except KeyError as err:
        raise ShapeError(f"its config.json has no {err.args[0]}") from None
    kv = config.get("num_key_value_heads") or heads
    head_dim = config.get("head_dim") or h // heads
    tied = config.get("tie_word_embeddings", True)
    per_layer = h * heads * head_dim * 2 + 2 * h * kv * head_dim + 3 * h * inter + 2 * h
    params = vocab * h * (1 if tied else 2) + layers * per_layer + h
    return {"params": params, "vocab": vocab, "hidden": h, "intermediate": inter, "layers": layers,
            "kv_heads": kv, "head_dim": head_dim}


def _read(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError) as err:
        raise ShapeError(f"{path} cannot be read ({type(err).__name__})") from None


def _hub_config(repo_id: str, revision: str | None) -> Path:
    """config.json of a hub model: the local hub cache's, else downloaded (a few kB, no weights)."""
    from huggingface_hub import hf_hub_download, try_to_load_from_cache

    cached = try_to_load_from_cache(repo_id, "config.json", revision=revision)
    if isinstance(cached, str):
        return Path(cached)
    try:
        return Path(hf_hub_download(repo_id, "config.json", revision=revision))
    except Exception as err:  # offline, unknown repo, gated: the model could not load either
        first = str(err).strip().splitlines()[0][:160] if str(err).strip() else "no answer"
        raise ShapeError(f"its config.json is not in the local hub cache and cannot be downloaded "
                         f"({type(err).__name__}: {first})") from None


def model_shape(model_cfg, cache_dir: str | Path) -> dict:
    """The shape of a composed model option (cfg.model), read without loading it; `source` says from where."""
    from grpo_exp.core import models

    if model_cfg.source == "tiny_random":
        config = {"vocab_size": TINY_VOCAB, "hidden_size": model_cfg.tiny_hidden,
                  "intermediate_size": model_cfg.tiny_intermediate, "num_hidden_layers": model_cfg.tiny_layers,
                  "num_attention_heads": model_cfg.tiny_heads, "num_key_value_heads": model_cfg.tiny_kv_heads,
                  "tie_word_embeddings": True}
        return {**shape_from_config(config), "source": "conf/model/tiny_random.yaml"}
    if model_cfg.source == "packaged_gguf":
        path = models.converted_dir(model_cfg.package, cache_dir) / "config.json"
        if path.is_file():
            return {**shape_from_config(_read(path)), "source": str(path)}
        if model_cfg.name in KNOWN_SHAPES:
            return {**shape_from_config(KNOWN_SHAPES[model_cfg.name]), "source": "memory.KNOWN_SHAPES (not converted yet)"}
        raise ShapeError(f"{path} does not exist yet (the model converts when it first loads)")
    ident = str(model_cfg.id)
    local = Path(ident).expanduser()
    path = local / "config.json" if local.is_dir() else _hub_config(ident, model_cfg.get("revision"))
    return {**shape_from_config(_read(path)), "source": str(path)}


def estimate_mb(shape: dict, rows: int, generation_rows: int, length: int, beta: float) -> dict:
    """The estimate of the module docstring, in MB: each kind of variant's and their peak (`peak_mb`)."""
    mb = 1024.0 ** 2
    p, v, h, layers = shape["params"], shape["vocab"], shape["hidden"], shape["layers"]
    tokens = rows * (PROMPT_TOKENS + length)
    state = 4 * p * (4 + (1 if beta else 0))
    logits = 4 * rows * (length + 1) * v
    layer = 4 * tokens * (6 * h + 4 * shape["intermediate"])
    kv = 4 * 2 * layers * shape["kv_heads"] * shape["head_dim"] * generation_rows * (PROMPT_TOKENS + length)
    runtime = RUNTIME_MB * mb
    trl = state + 3 * logits + 4 * tokens * h * layers + layer + kv + runtime
    ours = state + logits + layers * layer + kv + runtime
    parts = {"state_mb": state, "logits_mb": logits, "layer_mb": layer, "kv_cache_mb": kv, "plain_trl_mb": trl,
             "grpo_exp_mb": ours, "peak_mb": max(trl, ours)}
    return {k: round(x / mb, 1) for k, x in parts.items()}
