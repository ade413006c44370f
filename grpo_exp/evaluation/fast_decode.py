"""Greedy evaluation decoded without HF `generate`: the rollout engine's way of decoding, for the argmax.

Why: greedy evaluation through `generate` was about a third of a default training run's wall time on a CPU
(7-12 s per batch of 32 problems of the default model). `GreedyDecoder` decodes as the rollout engine samples
(training/rollout/engine.py), with fp32 weights only: a copy of the model whose parameters are the model's own tensors
(no second set of weights; the optimizer's in-place updates are in it), grouped attention (kernels/attention.py), a
static KV cache, the LM head on the last position only, and a decoding step compiled with `torch.compile` where a
C++ compiler is present. Beyond the engine: the prompts' common prefix (chat template, system prompt) is prefilled
once per call, a batch drops the rows that have ended as it goes, and the prompts are batched by length. Greedy
only: sampled evaluation (pass@k, maj@k, eval.do_sample) stays on `generate`, whose draws its figures are.

One model, one number: a row's tokens do not depend on the rows beside it, how many there are, or where padding
sits (a compiled step's softmax is summed in one pass, never split between threads: kernels/attention.py,
whole_sums), so any batch size gives the same answers; the default model's matched `generate`'s on 400 problems
(docs/evaluation.md, "The decoding path"). A decoder is built on a model's first evaluation (`decoder_for`) and kept
while the model lives; its step is compiled once per architecture in the process, for any number of rows (and again
only for a longer KV cache), and serves every model of that architecture; each call's caches are freed at its end.
generate.py picks this path or `generate` (eval.decode).

Sliding-window layers (Gemma 3) are held as plain layers, the window applied by the model's own mask
(plain_cache); a call whose prompts and new tokens reach past the window prefills each prompt whole, left-padded,
without the shared prefix.
"""

from __future__ import annotations

import copy
import functools
import inspect
import time
import weakref
from collections.abc import Iterator

import torch

from grpo_exp.base import log, stop
from grpo_exp.base.cpu import compiler_missing, release_freed_memory
from grpo_exp.kernels import attention
from grpo_exp.kernels.compiled_step import own_code

logger = log.get_logger(__name__)

_CACHE_BUCKET = 64  # the cache length is rounded up to this, so calls with slightly longer prompts reuse one step
_HEAD_SLICE = 1024  # vocabulary rows of the LM head per product
_COMPILE_MIN_PARAMETERS = 20_000_000  # a model this large or larger gets a compiled decoding step
# settings of a model's generation_config that greedy `generate` applies and this path does not
_GENERATE_PROCESSORS = ("repetition_penalty", "no_repeat_ngram_size", "encoder_no_repeat_ngram_size", "bad_words_ids",
                        "suppress_tokens", "begin_suppress_tokens", "forced_bos_token_id", "forced_eos_token_id",
                        "sequence_bias", "min_new_tokens", "exponential_decay_length_penalty")
# logit scalings transformers' own head applies and the decoder's plain product would not
_LOGIT_SCALINGS = ("final_logit_softcapping", "logit_scale", "output_multiplier", "lm_head_multiplier",
                   "logits_scaling")


@functools.lru_cache(maxsize=None)
def _cache_kwarg(backbone_type: type) -> str:
    """transformers 5 renamed `past_key_values` to `cache` in a minor release; the pin allows both."""
    return "cache" if "cache" in inspect.signature(backbone_type.forward).parameters else "past_key_values"


def static_cache_unsupported(config) -> str | None:
    """Why a static KV cache cannot hold this model's decoding (None when it can): the decoders write the prompt
    into transformers' StaticLayer directly, a sliding-window layer's too (plain_cache). Other layer kinds
    (chunked or linear attention, a layer reading another's cache) or older layers without a tensor length are
    not served."""
    try:
        from transformers import StaticCache
        from transformers.cache_utils import StaticLayer
    except ImportError:
        return "a transformers release without StaticCache"
    if getattr(config, "use_bidirectional_attention", False):
        return "a model with bidirectional attention"
    cache = StaticCache(config=config, max_cache_len=8)
    kinds = list(getattr(config, "layer_types", None) or [])
    for index, layer in enumerate(cache.layers):
        if type(layer) is StaticLayer:
            continue
        kind = kinds[index] if index < len(kinds) else None
        # a window the model's mask builds from config.sliding_window (plain_cache), not a chunk or another kind
        if not (type(layer).__name__ == "StaticSlidingWindowLayer" and kind in ("sliding_attention", None)
                and not getattr(config, "attention_chunk_size", None)
                and isinstance(getattr(config, "sliding_window", None), int)):
            return f"a model with {kind or type(layer).__name__} cache layers (the engine path serves full and " \
                   f"sliding-window attention)"
    layer = cache.layers[0]
    if not (hasattr(layer, "cumulative_length") and hasattr(layer, "lazy_initialization")):
        return "a transformers release whose StaticLayer has no cumulative_length"
    return None


def sliding_window(config) -> int | None:
    """The window of the model's sliding-window layers; None where no layer slides."""
    from transformers import DynamicCache

    if not any(getattr(layer, "is_sliding", False) for layer in DynamicCache(config=config).layers):
        return None
    return int(config.sliding_window)


def plain_cache(config, max_cache_len: int | None = None):
    """transformers' cache for `config` (a StaticCache of `max_cache_len` positions, or a DynamicCache) with every
    layer a plain one: a sliding-window layer keeps every position, and the window is the model's own mask's, which
    transformers builds from config.sliding_window over the cache's positions, as over a whole sequence in TRL's
    scoring forward and in `generate` (a row's positions contiguous, left-padded: exact at any length). Its memory
    is the full length's where transformers' sliding layer would keep the window's. Why not that layer: the
    decoders write the prefill into each layer and set its tensor length, and a StaticSlidingWindowLayer also
    counts in a Python int (which a compiled step is specialised to) and rolls its tensors once full."""
    from transformers import DynamicCache, StaticCache
    from transformers.cache_utils import DynamicLayer, StaticLayer

    if max_cache_len is None:
        cache = DynamicCache(config=config)
        cache.layers = [DynamicLayer() if getattr(layer, "is_sliding", False) else layer for layer in cache.layers]
    else:
        cache = StaticCache(config=config, max_cache_len=max_cache_len)
        cache.layers = [StaticLayer(max_cache_len=max_cache_len) if getattr(layer, "is_sliding", False) else layer
                        for layer in cache.layers]
    return cache


def unsupported_reason(model) -> str | None:
    """Why GreedyDecoder cannot decode `model` as greedy `generate` does (None when it can)."""
    if hasattr(model, "get_base_model"):
        return "a PEFT model (its adapters are decoded by generate)"
    if any(hasattr(m, "_packed_params") or type(m).__module__.startswith("torch.ao") for m in model.modules()):
        return "a quantized model"
    params = list(model.parameters())
    devices = sorted({p.device.type for p in params})
    if devices != ["cpu"]:
        return f"a model on {', '.join(devices) or 'no device'} (the engine path decodes on the CPU)"
    dtypes = sorted({str(p.dtype) for p in params if p.dtype != torch.float32})
    if dtypes:
        return f"a model with {', '.join(dtypes)} weights (the engine path decodes fp32 weights)"
    config = getattr(model, "config", None)
    if config is None or not hasattr(model, "base_model") or not hasattr(model, "get_output_embeddings"):
        return "not a transformers model with a backbone and an LM head"
    if hasattr(config, "get_text_config") and config.get_text_config() is not config:
        return "a multimodal model"
    for name in _LOGIT_SCALINGS:
        if getattr(config, name, None) is not None:
            return f"a model with {name}"
    if getattr(config, "output_router_logits", False):
        return "a mixture-of-experts model"
    if model.get_output_embeddings() is None:
        return "a model without a separate LM head"
    generation = getattr(model, "generation_config", None)
    for name in _GENERATE_PROCESSORS:
        value = getattr(generation, name, None)
        if value is not None and value != (1.0 if name == "repetition_penalty" else 0) and value not in ([], {}):
            return f"a generation_config with {name}={value!r} (greedy generate applies it)"
    return attention.unsupported_reason(model) or static_cache_unsupported(config)


def drop_forward_wrappers(shell: torch.nn.Module) -> None:
    """Take accelerate's autocast wrapper (`forward`) and the method it saved (`_original_forward`) off a deep copy of
    a model prepared for training: their closures hold the original model, so a copy that kept them would keep it
    alive, and a decoder (kept in a weak dictionary under that model) its model for good. The copy runs its class's
    forward."""
    for name in ("forward", "_original_forward"):
        shell.__dict__.pop(name, None)


def _shared_copy(model: torch.nn.Module) -> torch.nn.Module:
    """A copy of `model` whose parameters are the model's own tensors (tied ones stay tied) and whose attention is
    grouped: the model's own attention setting and its training state are left as they are."""
    memo = {id(p): torch.nn.Parameter(p.detach(), requires_grad=False) for p in model.parameters()}
    shell = copy.deepcopy(model, memo)
    drop_forward_wrappers(shell)
    shell.eval()
    attention.use(shell, "grouped", whole_sums=True)
    return shell


class GreedyDecoder:
    """Greedy completions of one model, batch after batch, its decoding step compiled once for any number of rows."""

    def __init__(self, model: torch.nn.Module, *, compile: bool | None = None):
        """compile: None compiles the decoding step for a model of at least _COMPILE_MIN_PARAMETERS parameters
        (a smaller one decodes faster than it compiles: the tiny test model in milliseconds against about ten
        seconds), where a C++ compiler is present."""
        self.source = weakref.ref(model)
        self.model = _shared_copy(model)
        self.backbone = self.model.base_model
        self.head = self.model.get_output_embeddings()
        self._cache_kwarg = _cache_kwarg(type(self.backbone))
        self._cache = None  # the last batch's StaticCache
        self.window = sliding_window(self.model.config)  # the sliding-window layers' window, if any (batches)
        self._length = 0  # the cache length of the last call
        self._prefix: tuple[tuple[int, ...], list] | None = None  # the call's shared prefix and its keys and values
        self.timings: dict[str, float] = {}
        if compile is None:
            compile = sum(p.numel() for p in model.parameters()) >= _COMPILE_MIN_PARAMETERS
        why = "compile=False" if not compile else compiler_missing()
        self.compiled = why is None
        if self.compiled:
            # one compiled step for every model of this architecture in the process (the trained model, the one it
            # started from, each stage of a curriculum): the decoder is its argument, its tensors inputs
            self._shared = _shared_step(self.model)
            self._step = functools.partial(self._shared.step, self)
        else:
            self._step = self._eager_step
            # for lack of a compiler a larger model decodes slower than it could: say so; chosen, not
            say = logger.warning if "compiler" in str(why) else logger.debug
            say("evaluation decoder: decoding step runs eager (%s)", why)

    # ------------------------------------------------------------------------------------------------- weights

    def sync(self) -> None:
        """Point the copy at the model's current tensors: a parameter replaced since (not updated in place, which
        the copy shares) is taken over by storage, not copied."""
        source = self.source()
        if source is None:
            raise RuntimeError("the model this decoder was built for is gone")
        src = dict(source.named_parameters(remove_duplicate=False))
        for name, param in self.model.named_parameters(remove_duplicate=False):
            if param.data_ptr() != src[name].data_ptr() or param.shape != src[name].shape:
                param.data = src[name].detach()

    def release(self) -> None:
        """Forget the last call's KV cache and shared prefix (each batch makes its own): their memory goes back."""
        self._cache, self._prefix = None, None

    # ------------------------------------------------------------------------------------------------ decoding

    def _eager_step(self, input_ids, position_ids, attention_mask, cache) -> torch.Tensor:
        """Next-token logits (fp32) after the last position of every row: the head on a 2-D hidden state, in slices
        of _HEAD_SLICE vocabulary rows (the same numbers as one product; with 49152 rows of the default model, a
        sixth less time at 32 rows)."""
        out = self.backbone(input_ids=input_ids, position_ids=position_ids, attention_mask=attention_mask,
                            use_cache=True, **{self._cache_kwarg: cache})
        hidden = out.last_hidden_state[:, -1]
        weight, bias = self.head.weight, self.head.bias
        biases = [None] * -(-weight.shape[0] // _HEAD_SLICE) if bias is None else bias.split(_HEAD_SLICE)
        return torch.cat([torch.nn.functional.linear(hidden, w, b) for w, b in zip(weight.split(_HEAD_SLICE), biases)],
                         dim=-1).float()

    def cache_length(self, prompts: list[list[int]], max_new_tokens: int) -> int:
        """The KV cache's positions for a call on these prompts. StaticLayer's length is a Python int, which the
        compiled step is specialised to: it only grows (a longer one compiles the step again), and a row's numbers
        do not depend on it (masked positions add 0)."""
        length = -(-(max(len(p) for p in prompts) + max_new_tokens) // _CACHE_BUCKET) * _CACHE_BUCKET
        return max(length, self._length)

    def row_bytes(self, prompts: list[list[int]], max_new_tokens: int) -> int:
        """The decoding cache's bytes per row of a call on these prompts: fp32 keys and values of every layer."""
        config = self.model.config
        heads = config.num_attention_heads
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
        kv_heads = getattr(config, "num_key_value_heads", None) or heads
        return 2 * config.num_hidden_layers * kv_heads * head_dim * 4 * self.cache_length(prompts, max_new_tokens)

    def batches(self, prompts: list[list[int]], *, rows: int, max_new_tokens: int, eos_token_ids: list[int],
                pad_token_id: int) -> Iterator[tuple[list[int], torch.Tensor, float]]:
        """Greedy completions of `prompts` (token ids), `rows` at a time: for each batch, which prompts it holds
        (indices into `prompts`), their new tokens [rows, steps] (`pad_token_id` after a row's EOS, as `generate`
        returns them; steps: until the batch's last row ends) and the seconds spent. The prompts are batched by
        length (less padding in the prefill, and similar problems, whose answers end alike, together); every batch
        shares the prompts' common prefix (computed once) and one cache length; the call's memory goes back at
        the end."""
        # this call's time and work (scripts/eval_decode_time.py sets them against the machine's floor)
        self.timings.update(prefill_s=0.0, decode_s=0.0, decode_steps=0, row_steps=0, prefill_tokens=0)
        prefix = shared_prefix_length(prompts)
        if self.window is not None and max(len(p) for p in prompts) + max_new_tokens > self.window:
            # past a sliding window the padding between the shared prefix and a row's own part would count in the
            # row's distances: each prompt is prefilled whole, left-padded, as generate lays it out
            prefix = 0
        order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]))
        self._length = length = self.cache_length(prompts, max_new_tokens)
        try:
            for start in range(0, len(prompts), rows):
                held = order[start:start + rows]
                tokens, seconds = self.decode([prompts[i] for i in held], prefix=prefix, length=length,
                                              max_new_tokens=max_new_tokens, eos_token_ids=eos_token_ids,
                                              pad_token_id=pad_token_id)
                yield held, tokens, seconds
        finally:
            self.release()
            # the batches' caches (a KV cache of eval.engine_cache_mb) go back to the kernel: under cpu.malloc=retain
            # they would stay resident, and the next call's, of other sizes, would grow the heap beside them
            release_freed_memory()

    @torch.no_grad()
    def decode(self, prompts: list[list[int]], *, prefix: int, length: int, max_new_tokens: int,
               eos_token_ids: list[int], pad_token_id: int) -> tuple[torch.Tensor, float]:
        """One batch of `batches`: the first `prefix` tokens are the same in every prompt, the KV cache holds
        `length` positions (at least the longest prompt and max_new_tokens)."""
        if not prompts:
            raise ValueError("no prompts to decode")
        self.sync()
        t0 = time.perf_counter()
        # a batch of one gets a copy beside it: dynamo would compile a step of its own for one row
        padded = prompts + [prompts[-1]] * (_MIN_ROWS - len(prompts))
        try:
            tokens = self._decode(padded, prefix, length, max_new_tokens, eos_token_ids, pad_token_id)
        except _Retry:  # the compiled step failed: this batch again, eager
            tokens = self._decode(padded, prefix, length, max_new_tokens, eos_token_ids, pad_token_id)
        return tokens[:len(prompts)], time.perf_counter() - t0

    def _prefix_states(self, ids: tuple[int, ...]) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Each layer's keys and values of the prompts' shared prefix, computed once per call (release forgets
        them: the weights may change before the next)."""
        if self._prefix is None or self._prefix[0] != ids:
            cache = plain_cache(self.model.config)
            tokens = torch.tensor([ids])
            self._eager_step(tokens, torch.arange(len(ids))[None], torch.ones_like(tokens), cache)
            self._prefix = (ids, [(layer.keys, layer.values) for layer in cache.layers])
        return self._prefix[1]

    def _prefill(self, prompts: list[list[int]], prefix: int, pad_token_id: int):
        """One forward over the prompts' own parts on top of their shared prefix: (last logits [n, vocab], the
        cache, the 2-D mask of its positions, each row's next position). Laid out as [prefix | padding | own part],
        each row's positions counting its real tokens from 0, as `generate` counts them."""
        own = [p[prefix:] for p in prompts]
        width = max(len(p) for p in own)
        ids = torch.full((len(own), width), pad_token_id, dtype=torch.long)
        mask = torch.zeros((len(own), width), dtype=torch.long)
        for i, row in enumerate(own):
            ids[i, width - len(row):] = torch.tensor(row)
            mask[i, width - len(row):] = 1
        positions = (prefix + mask.cumsum(-1) - 1).masked_fill(mask == 0, 0)
        cache = plain_cache(self.model.config)
        if prefix:
            for index, (keys, values) in enumerate(self._prefix_states(tuple(prompts[0][:prefix]))):
                cache.update(keys.expand(len(own), -1, -1, -1), values.expand(len(own), -1, -1, -1), index)
        full_mask = torch.cat([torch.ones((len(own), prefix), dtype=torch.long), mask], dim=1)
        with stop.urgent("evaluation"):  # one forward over every prompt of the batch
            logits = self._eager_step(ids, positions, full_mask, cache)
        return logits, cache, full_mask, positions[:, -1:] + 1

    def _decode(self, prompts, prefix, length, max_new_tokens, eos_token_ids, pad_token_id) -> torch.Tensor:
        stop.check("evaluation")
        t0 = time.perf_counter()
        logits, prefilled, prompt_mask, position = self._prefill(prompts, prefix, pad_token_id)
        rows, width = prompt_mask.shape
        if width + max_new_tokens > length:
            raise ValueError(f"a cache of {length} positions cannot hold {width} + {max_new_tokens}")
        cache = self._static_cache(prefilled, length)
        del prefilled
        attention_mask = torch.ones((rows, length), dtype=torch.long)
        attention_mask[:, :width] = prompt_mask
        self.timings["prefill_s"] = self.timings.get("prefill_s", 0.0) + time.perf_counter() - t0
        self.timings["prefill_tokens"] = self.timings.get("prefill_tokens", 0) + int(prompt_mask[:, prefix:].sum())
        t1 = time.perf_counter()

        eos = torch.tensor(sorted(set(eos_token_ids)), dtype=torch.long)
        tokens = torch.full((rows, max_new_tokens), pad_token_id, dtype=torch.long)
        live = torch.arange(rows)  # the prompt each row of the decoding batch answers
        done = torch.zeros(rows, dtype=torch.bool)  # rows past their EOS, decoding padding until compacted away
        steps = 0
        for t in range(max_new_tokens):
            stop.check("evaluation")  # every decoded token, as generate's StopRequested
            token = torch.where(done, pad_token_id, logits.argmax(-1))
            tokens[live, t] = token
            steps = t + 1
            done |= torch.isin(token, eos)
            if t + 1 == max_new_tokens or bool(done.all()):
                break
            if _worth_compacting(done, max_new_tokens - t - 1):
                keep = _rows_kept(done)
                live, done, token, position = live[keep], done[keep], token[keep], position[keep]
                attention_mask = attention_mask[keep]
                self._compact(cache, keep)
            logits = self._call_step(token[:, None], position, attention_mask, cache)
            position = position + 1
            self.timings["decode_steps"] = self.timings.get("decode_steps", 0) + 1
            self.timings["row_steps"] = self.timings.get("row_steps", 0) + len(token)
        self.timings["decode_s"] = self.timings.get("decode_s", 0.0) + time.perf_counter() - t1
        return tokens[:, :steps]

    def _static_cache(self, prefilled, length: int):
        """The decoding cache for this batch, holding the prefill's keys and values: a new one per batch (its rows
        are the batch's, a dynamic size in the compiled step)."""
        cache = plain_cache(self.model.config, length)
        width = prefilled.layers[0].keys.shape[2]
        for big, small in zip(cache.layers, prefilled.layers):
            big.lazy_initialization(small.keys, small.values)
            big.keys[:, :, :width].copy_(small.keys)
            big.values[:, :, :width].copy_(small.values)
            big.cumulative_length.fill_(width)
            small.keys = small.values = None  # layer by layer: the two caches are never whole side by side
        self._cache = cache
        return cache

    @staticmethod
    def _compact(cache, keep: torch.Tensor) -> None:
        """Keep rows `keep` (ascending) of every layer, moved to the front of its own tensors: new tensors for them
        would sit beside the old ones (a second cache's worth of heap, resident under cpu.malloc=retain)."""
        n = len(keep)
        for layer in cache.layers:
            for name in ("keys", "values"):
                whole = getattr(layer, name)
                whole[:n].copy_(whole.index_select(0, keep))  # one layer's rows at a time beside them
                setattr(layer, name, whole[:n])
            layer.batch_size = n

    def _call_step(self, token, position, attention_mask, cache) -> torch.Tensor:
        if not self.compiled:
            return self._step(token, position, attention_mask, cache)
        # any number of rows: one compiled step (rows >= 2: dynamo specialises a size of 1)
        for tensor in (token, position, attention_mask, *(t for layer in cache.layers for t in (layer.keys, layer.values))):
            torch._dynamo.maybe_mark_dynamic(tensor, 0)
        try:
            if self._length not in self._shared.lengths:  # the first call compiles the step: it cannot poll a stop
                logger.info("evaluation decoder: compiling the decoding step for a cache of %d positions (once per "
                            "architecture and length)", self._length)
                t0 = time.perf_counter()
                with stop.urgent("compilation"):
                    logits = self._step(token, position, attention_mask, cache)
                self._shared.lengths.add(self._length)
                self.timings["compile_s"] = self.timings.get("compile_s", 0.0) + time.perf_counter() - t0
                return logits
            with stop.urgent("evaluation"):
                return self._step(token, position, attention_mask, cache)
        except Exception as err:  # an inductor failure must not end an evaluation
            logger.warning("evaluation decoder: the compiled decoding step failed (%s: %s); decoding eager from now "
                           "on", type(err).__name__, str(err).splitlines()[0] if str(err) else "")
            self._step, self.compiled = self._eager_step, False
            raise _Retry from err


_MIN_ROWS = 2  # dynamo specializes a dimension of size 1: the decoding batch is never compacted below 2 rows


def _worth_compacting(done: torch.Tensor, steps_left: int) -> bool:
    """Whether to drop the finished rows before the next step: a quarter or more of the batch is done, some steps
    remain (each compaction copies the KV cache's live rows), and the batch would shrink."""
    finished = int(done.sum())
    kept = max(len(done) - finished, _MIN_ROWS)
    return steps_left >= 2 and finished * 4 >= len(done) and kept < len(done)


def _rows_kept(done: torch.Tensor) -> torch.Tensor:
    """The unfinished rows, with finished ones added back to make _MIN_ROWS."""
    keep = (~done).nonzero().squeeze(1)
    if len(keep) < _MIN_ROWS:
        keep = torch.cat([keep, done.nonzero().squeeze(1)[:_MIN_ROWS - len(keep)]]).sort().values
    return keep


class _Retry(Exception):
    """The compiled step failed mid-batch; the batch is decoded again, eager."""


def shared_prefix_length(prompts: list[list[int]]) -> int:
    """How many leading tokens every prompt shares (the chat template and system prompt), at most all but the last
    token of the shortest: each prompt's own part is at least one token, the one whose logits come first."""
    shortest = min(len(p) for p in prompts)
    first = prompts[0]
    n = 0
    while n < shortest - 1 and all(p[n] == first[n] for p in prompts):
        n += 1
    return n


class _SharedStep:
    """The decoding step compiled for one architecture: `step(decoder, ...)` and the cache lengths it was compiled
    for. It holds no decoder and no tensor: the decoder is an argument, and its modules' tensors are read from it at
    each call (dynamo's guards on modules are off, so a model of another architecture must never reach it)."""

    def __init__(self):
        # the copy's modules are never changed in place: dynamo's guards on them would only cost time
        self.step = torch.compile(own_code(GreedyDecoder._eager_step), dynamic=False, fullgraph=True, options={
            "guard_filter_fn": torch.compiler.skip_guard_on_all_nn_modules_unsafe})
        self.lengths: set[int] = set()


_SHARED_STEPS: dict[tuple, _SharedStep] = {}


def architecture_key(model: torch.nn.Module) -> tuple:
    """What a compiled step is specialised to: the classes, the whole configuration (bar its name and versions) and
    each parameter's name, shape and dtype. Two models with equal keys differ in their weights' values only."""
    config = {k: v for k, v in model.config.to_dict().items()
              if k not in ("_name_or_path", "transformers_version", "architectures")}
    params = tuple((name, tuple(p.shape), p.dtype, p.device.type)
                   for name, p in model.named_parameters(remove_duplicate=False))
    return type(model), repr(sorted(config.items(), key=lambda item: item[0])), params


def _shared_step(model: torch.nn.Module) -> _SharedStep:
    key = architecture_key(model)
    if key not in _SHARED_STEPS:
        _SHARED_STEPS[key] = _SharedStep()
    return _SHARED_STEPS[key]


_DECODERS: "weakref.WeakKeyDictionary[torch.nn.Module, GreedyDecoder]" = weakref.WeakKeyDictionary()


def decoder_for(model: torch.nn.Module) -> GreedyDecoder:
    """The decoder of `model`, built on its first evaluation and kept while the model lives (its compiled steps with
    it); the caller checked unsupported_reason."""
    decoder = _DECODERS.get(model)
    if decoder is None:
        decoder = _DECODERS[model] = GreedyDecoder(model)
    return decoder
