"""grpo-exp's own rollout engine (`train.rollout=engine`): GRPO's sampling without HF `generate`.

Why: on a CPU, generation was more than half of a GRPO step, and `generate` under bf16 autocast recasts the
fp32 weights on every op of every token, runs eager Python for each decoding step, and grows its KV cache
with `cat`. The engine instead keeps

- a rollout copy of the policy (core/copy_kinds.py) in the machine's native dtype: bf16 where it is native (every
  weight and the residual stream in bf16), else fp32, the policy's own tensors (shared: nothing to copy).
  `train.rollout_dtype=autocast` asks for a copy that computes what bf16 autocast training computes: its Linear
  weights cast to bf16, the rest the policy's own fp32 tensors, run under the same autocast. A copy is
  refreshed in place before the first generation after an optimizer step; what it shares needs no refresh.
- with a bf16 copy on a CPU with native bf16, its Linear layers swapped for packed ones (`train.rollout_prepack`,
  kernels/packed_linear.py): the same products without a weight reorder on every call; on AVX512-BF16 a decoding
  step's products read the plain weights in place (kernels/small_rows.py), with no packed copy kept; an fp32 copy on a
  CPU whose torch kernels are AVX2's swaps them too, for small_rows' fp32 kernel (nothing laid out: MKL's same
  numbers, faster at a decoding step's few rows);
- a static KV cache (transformers' StaticCache, allocated once per batch shape);
- between rounds, through TRL's hook, the copy's own weights and the cache give their memory back (`release`), since
  the training step between two rounds is where a run's memory peaks; the next round refills them;
- a batched prefill that runs each distinct prompt once (a GRPO batch holds every prompt `num_generations`
  times) and copies its cache rows to the group;
- attention that groups the query heads sharing a key/value head instead of copying the cache per head;
- a decoding step compiled with `torch.compile` where a C++ compiler is present (eager otherwise; a warning
  says which);
- the sampler's own per-token log-probs, after temperature, top-k and top-p (vLLM's "processed" log-probs).

It plugs into TRL through `rollout_func` (GRPOTrainer calls it with the prompts and the trainer, and expects
`prompt_ids`, `completion_ids` and `logprobs`). Sampling follows `generate`'s distribution: fp32 logits,
temperature, then top-k, then top-p, the whole batch every step, pad tokens after EOS. With sampler=multinomial
and an fp32 copy it draws the same tokens as `generate` under the same seed; the default sampler=cdf draws from
the same distribution with one uniform number per row (tests/training/test_rollout.py checks both).

Where the copy computes differently from the trained policy (a bf16 copy of a policy trained in fp32 or under
autocast), the samples come from a slightly different policy. `enable_is_correction` turns on TRL's own truncated
importance-sampling correction (the one it applies to vLLM rollouts) on the sampler's log-probs, and the mismatch
is logged (mean KL, share of clipped tokens): `mismatch_totals` on each process, gathered, `mismatch_from_totals`
over all of them. Where it computes the same (the autocast
copy of a policy trained under bf16 autocast; an fp32 copy of one trained in fp32), the sampler's log-probs are
the policy's own up to kernel rounding, so they serve as PPO's old log-probs and TRL's extra scoring forward over
the round is skipped (`old_logps_source`); the trainer then measures the mismatch on the training forward itself.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import inspect
import time
import types
from types import SimpleNamespace

import torch

from grpo_exp.base import log
from grpo_exp.base.cpu import compiler_missing, native_dtype  # noqa: F401 (imported from here by tests and tools)
from grpo_exp.core import copy_kinds
from grpo_exp.kernels import attention, packed_linear, small_rows
from grpo_exp.training import shared_prefix

logger = log.get_logger(__name__)

CHOICES = ("auto", "trl", "engine")  # train.rollout
IS_MODES = ("token_truncate", "token_mask", "sequence_truncate", "sequence_mask")
SAMPLERS = ("cdf", "multinomial")
OLD_LOGPS = ("auto", "policy", "sampler")  # train.rollout_old_logps
# the cache length is rounded up to this, so prompts of slightly different lengths reuse one compiled step
_CACHE_BUCKET = 64


def resolve(choice: str) -> str:
    """The path `train.rollout=auto` takes: the engine on a CPU, TRL's `generate` on CUDA (where TRL's own fast path
    is vLLM). With native bf16 the engine samples from a bf16 copy, with TRL's correction; without it, from an exact
    fp32 copy whose log-probs stand in for TRL's scoring forward. Why it is the default, with its speed and its
    accuracy over seeds against TRL's path: docs/log.md, "2026-11-27 — the engine with grouped attention", and
    docs/performance.md, "The rollout engine"."""
    if choice != "auto":
        return choice
    return "trl" if torch.cuda.is_available() else "engine"


def old_logps_source(choice: str, rollout_dtype: str, precision: str) -> str:
    """Where PPO's old log-probs come from on the engine's path (`train.rollout_old_logps`).

    policy: TRL scores the round with the trained policy (one no-grad forward over every completion), and the
    importance-sampling correction weighs each token by pi_train / pi_sampler. sampler: the sampler's own
    log-probs are the old log-probs and nothing is corrected (PPO's clipped ratio is then taken against the
    sampler). auto: sampler where the copy computes what the policy computes (an fp32 copy of a policy trained
    in fp32, or the autocast copy of one trained under bf16 autocast, refreshed before the round: the same
    weights and the same arithmetic, so the same log-probs up to kernel rounding; tests/training/test_rollout.py
    and docs/performance.md, "Importance sampling and old log-probs"), policy elsewhere (a plain bf16 copy differs)."""
    from grpo_exp.base.cpu import resolve_precision

    if choice != "auto":
        return choice
    kind, trained = copy_kinds.kind(rollout_dtype), resolve_precision(precision)
    exact = (kind, trained) in {("fp32", "fp32"), ("autocast", "bf16")}
    return "sampler" if exact else "policy"


def padded_logps(rows: list[list[float]], width: int, device) -> torch.Tensor:
    """Per-completion log-probs as TRL's [batch, completion length] tensor, right-padded with 0 as TRL pads
    completions (the completion mask hides the padding)."""
    out = torch.zeros((len(rows), width), dtype=torch.float32)
    for i, row in enumerate(rows):
        if len(row) > width:
            raise RuntimeError(f"a completion of {len(row)} tokens does not fit TRL's {width} completion positions")
        out[i, :len(row)] = torch.tensor(row, dtype=torch.float32)
    return out.to(device)


@functools.lru_cache(maxsize=None)
def _cache_kwarg(model_type: type) -> str:
    """transformers 5 renamed `past_key_values` to `cache` in a minor release; the pin allows both."""
    return "cache" if "cache" in inspect.signature(model_type.forward).parameters else "past_key_values"


def _static_layers_ok(config) -> str | None:
    """The engine writes the prefix into transformers' StaticLayer directly; other layer kinds (sliding
    window, linear attention) or older layers without a tensor length are left to TRL's path."""
    try:
        from transformers import StaticCache
        from transformers.cache_utils import StaticLayer
    except ImportError:
        return "a transformers release without StaticCache"
    cache = StaticCache(config=config, max_cache_len=8)
    if not all(type(layer) is StaticLayer for layer in cache.layers):
        return "a model with sliding-window or other non-static cache layers"
    layer = cache.layers[0]
    if not (hasattr(layer, "cumulative_length") and hasattr(layer, "lazy_initialization")):
        return "a transformers release whose StaticLayer has no cumulative_length"
    return None


def unsupported_reason(trainer) -> str | None:
    """Why the engine cannot serve this trainer (None when it can); TRL's generation then runs."""
    model = trainer.model
    args = trainer.args
    if hasattr(model, "get_base_model") or hasattr(model, "peft_config"):
        return "a PEFT model (the rollout copy would need the adapter merged)"
    if getattr(trainer, "_is_vlm", False):
        return "a vision-language model"
    if getattr(trainer, "tools", None) or getattr(trainer, "environment_factories", None) is not None:
        return "tools or environments"
    if args.use_vllm or getattr(args, "use_transformers_continuous_batching", False):
        return "use_vllm or continuous batching (another generation backend)"
    if trainer.repetition_penalty != 1.0:
        return f"repetition_penalty={trainer.repetition_penalty}"
    if trainer.min_p is not None:
        return f"min_p={trainer.min_p}"
    unhonoured = set(args.generation_kwargs or {}) - {"min_new_tokens"}  # the one generate setting it honours
    if unhonoured:
        return f"generation_kwargs {sorted(unhonoured)}"
    if getattr(model.config, "is_encoder_decoder", False):
        return "an encoder-decoder model"
    return model_unsupported_reason(model)


def model_unsupported_reason(model) -> str | None:
    """Why the engine cannot decode this model (None when it can)."""
    # the engine applies the LM head itself, as train.shared_prefix does: the same models qualify
    return shared_prefix.unsupported_reason(model) or _static_layers_ok(model.config)


def rollout_copy(model: torch.nn.Module, dtype: torch.dtype, autocast: bool = False,
                 attention_decode: str = "cache_axis") -> torch.nn.Module:
    """A frozen copy of `model` with its parameters in `dtype`, built without a transient full-precision copy
    (each parameter is cast straight into the copy; tied parameters stay tied). A parameter already in `dtype`
    is not copied: the copy's parameter shares the policy's storage (an fp32 copy of an fp32 policy holds no
    second set of weights, and the optimizer's in-place updates are in it without a refresh). Buffers stay as
    they are: the rotary frequencies keep their fp32 values, as the trained policy uses them.

    autocast: only what autocast casts is copied into `dtype`, every Linear's weight; the embedding, norms and
    biases are the policy's own tensors. An LM head tied to the embedding gets a `dtype` copy of its own, since
    autocast casts it for the head and not for the lookup."""
    embedding = model.get_input_embeddings().weight
    cast = ({id(m.weight) for m in model.modules() if isinstance(m, torch.nn.Linear) and m.weight is not embedding}
            if autocast else {id(p) for p in model.parameters()})
    memo = {id(p): torch.nn.Parameter(p.detach().to(dtype, copy=True) if id(p) in cast and p.dtype != dtype
                                      else p.detach(), requires_grad=False)
            for p in model.parameters()}
    shell = copy.deepcopy(model, memo)
    head = shell.get_output_embeddings()
    if autocast and head.weight.dtype != dtype:
        head.weight = torch.nn.Parameter(head.weight.detach().to(dtype, copy=True), requires_grad=False)
    shell.__dict__.pop("forward", None)  # accelerate's autocast wrapper, if the model was prepared already
    shell.eval()
    attention.use(shell, "grouped", attention_decode)  # decoding steps laid out as train.attention_decode says
    return shell


class RolloutEngine:
    """Samples GRPO completions from a rollout copy of the policy; `rollout` is TRL's `rollout_func`."""

    def __init__(self, policy: torch.nn.Module, *, dtype: torch.dtype, autocast: bool = False,
                 compile: bool | str = "auto", prepack: bool | str = "auto",
                 max_new_tokens: int, temperature: float = 1.0, top_k: int | None = 0, top_p: float = 1.0,
                 eos_token_ids: list[int], pad_token_id: int, sampler: str = "cdf", min_new_tokens: int = 0,
                 attention_decode: str = "cache_axis"):
        if sampler not in SAMPLERS:
            raise ValueError(f"unknown sampler {sampler!r}; choose one of {', '.join(SAMPLERS)}")
        self.sampler = sampler
        self.dtype = dtype
        self.autocast = autocast  # compute under `dtype` autocast, as the policy trains (rollout_copy)
        self.label = f"{str(dtype).replace('torch.', '')}{' autocast' if autocast else ''}"
        self.model = rollout_copy(policy, dtype, autocast, attention_decode)
        self.device = next(self.model.parameters()).device
        # the copy's parameters that are the policy's own storage (rollout_copy): never released, never copied
        self.shared = self._shared_with(policy)
        self.max_new_tokens = int(max_new_tokens)
        # generate's min_new_tokens: no EOS can be drawn before this many tokens (its MinNewTokens processor)
        self.min_new_tokens = int(min_new_tokens or 0)
        self.temperature = float(temperature)
        self.top_k = int(top_k or 0)
        self.top_p = float(top_p if top_p is not None else 1.0)
        self.eos = torch.tensor(sorted(set(eos_token_ids)), device=self.device)
        self.pad = int(pad_token_id)
        self.synced_step: int | None = None
        # train.rollout_old_logps=sampler: the last round's log-probs under the policy (tempered, unfiltered),
        # until TRL's old-log-prob scoring takes them
        self.keep_logps = False
        self.pending_logps: list[list[float]] | None = None
        self._cache = None  # (batch, max_len) -> StaticCache, kept so the compiled step sees the same tensors
        self._cache_key: tuple[int, int] | None = None
        self._max_len = 0
        # oneDNN's weight layout made once per refresh instead of on every product (kernels/packed_linear.py)
        self.packed = self._pack_linears(prepack)
        self.backbone = self.model.base_model  # the decoder without its LM head
        self.head = self.model.get_output_embeddings()
        self._cache_kwarg = _cache_kwarg(type(self.backbone))
        self.timings: dict[str, float] = {}
        # (tensor, bytes, is_cache) for each storage given back by `release`; empty while the engine is usable
        self._released: list[tuple[torch.Tensor, int, bool]] = []
        self.compiled = False
        why = None
        if compile in ("auto", True):
            why = compiler_missing() if self.device.type == "cpu" else None
        if compile is False:
            why = "train.rollout_compile=false"
        if why is None:
            # with packed weights, products that share an input are one product (packed_linear.compile_fused)
            backend = packed_linear.compile_fused if self.packed else "inductor"
            # Without dynamo's guards on the copy's modules: evaluating them took about 1.2 of the 1.6 ms dynamo
            # spent before each decoding step (under torch's profiler; docs/log.md, "2026-11-29 — around the decoding
            # step's kernels"). Nothing changes a module of the copy after it is built (refresh and release change
            # tensor contents and storages in place); the guards on the step's own inputs (shapes, the cache) and
            # on global state stay.
            self._step = torch.compile(self._own_step(), dynamic=False, backend=backend,
                                       options={"guard_filter_fn": torch.compiler.skip_guard_on_all_nn_modules_unsafe})
            self.compiled = True
            logger.warning("rollout engine: %s copy of the policy%s, decoding step compiled with torch.compile "
                           "(inductor); the first round includes compilation", self.label, self._packed_note)
        else:
            self._step = self._eager_step
            logger.warning("rollout engine: %s copy of the policy%s, decoding step runs eager (%s)", self.label,
                           self._packed_note, why)

    @property
    def _packed_note(self) -> str:
        if not self.packed:
            return ""
        how = "products of a few rows by grpo-exp's kernel, " if small_rows.applies(self.dtype) else ""
        library = "MKL's" if self.dtype == torch.float32 else "oneDNN's products packed once per refresh"
        return f" ({len(self.packed)} Linear layers: {how}{library} elsewhere)"

    def _pack_linears(self, prepack: bool | str) -> list:
        """The copy's Linear layers swapped for packed ones where `prepack` asks and the machine allows (auto: bf16
        copies on a CPU with native bf16); a forced request that cannot be met is an error."""
        if prepack not in ("auto", True, False):
            raise ValueError(f"prepack={prepack!r} is not valid; choose one of: auto, true, false")
        if prepack is False:
            return []
        why = packed_linear.unsupported_reason(self.dtype, self.device)
        if why:
            if prepack is True:
                raise ValueError(f"train.rollout_prepack=true cannot be met: {why}")
            logger.info("rollout engine: Linear weights not packed (%s)", why)
            return []
        return packed_linear.pack_linears(self.model)

    # ------------------------------------------------------------------------------------------------- weights

    def _shared_with(self, policy: torch.nn.Module) -> set[str]:
        src = dict(policy.named_parameters(remove_duplicate=False))  # a tied head untied in the copy has its name
        return {name for name, param in self.model.named_parameters()
                if param.untyped_storage().data_ptr() == src[name].untyped_storage().data_ptr()}

    @torch.no_grad()
    def refresh(self, policy: torch.nn.Module) -> None:
        """Copy the policy's current weights into the rollout copy, in place (cast to its dtype). A parameter
        that shares the policy's storage has them already; should the policy's parameter have been replaced by
        another tensor since, the copy's takes the new one's storage."""
        src = dict(policy.named_parameters(remove_duplicate=False))
        for name, param in self.model.named_parameters():
            if name not in self.shared:
                param.copy_(src[name].detach())
            elif param.data_ptr() != src[name].data_ptr():
                param.data = src[name].detach()
        for layer in self.packed:
            layer.pack()

    def sync(self, trainer) -> None:
        """Refresh once per optimizer step, before that step's first generation (TRL's vLLM sync does the same),
        and whenever the copy was released since."""
        step = trainer.state.global_step
        if self.synced_step != step or self.released:
            policy = trainer.model
            policy = getattr(policy, "module", policy)  # DDP wrapper
            t0 = time.perf_counter()
            self.materialize()
            self.refresh(policy)
            self.timings["refresh_s"] = time.perf_counter() - t0
            self.synced_step = step

    # -------------------------------------------------------------------------------------------------- memory

    @property
    def released(self) -> bool:
        return bool(self._released)

    def release(self) -> None:
        """Give the copy's own weights (not those it shares with the policy) and the decoding cache back until the
        next round. They are used only while sampling; the training step between two rounds (activations,
        gradients, optimizer state, autocast's bf16 weights) is where a run's resident memory peaks. Each tensor
        keeps its shape and identity, with an empty storage, so the compiled step is not recompiled; `sync`
        refills them."""
        if self._released:
            return
        cache = [t for layer in (self._cache.layers if self._cache is not None else [])
                 if getattr(layer, "is_initialized", False) for t in (layer.keys, layer.values)]
        seen: set[int] = set()
        weights = [p for name, p in self.model.named_parameters() if name not in self.shared]  # not the policy's
        for tensor, is_cache in [*((p, False) for p in weights), *((t, True) for t in cache)]:
            storage = tensor.untyped_storage()
            if storage.nbytes() == 0 or storage.data_ptr() in seen:  # tied weights share one storage
                continue
            seen.add(storage.data_ptr())
            self._released.append((tensor, storage.nbytes(), is_cache))
        for tensor, _, _ in self._released:
            tensor.untyped_storage().resize_(0)
        for layer in self.packed:
            layer.unpack()

    def materialize(self) -> None:
        """Storage back for everything `release` gave up: the cache zeroed (a masked position must hold a finite
        number: softmax gives it weight 0, and 0 x NaN would still be NaN), the weights for `refresh` to fill."""
        for tensor, nbytes, is_cache in self._released:
            tensor.untyped_storage().resize_(nbytes)
            if is_cache:
                tensor.zero_()
        self._released = []

    # ------------------------------------------------------------------------------------------------ sampling

    @property
    def filters(self) -> bool:
        """Whether sampling renormalises over fewer tokens than the policy's tempered distribution (top-k, top-p,
        min_new_tokens): its log-probs then differ from the policy's where a filter removed mass."""
        return self.top_k > 0 or self.top_p < 1.0 or self.min_new_tokens > 0

    def _last_logits(self, input_ids, position_ids, attention_mask, cache) -> torch.Tensor:
        """The next-token logits (fp32) after the last position of every row. The LM head is applied to a 2-D
        hidden state: `logits_to_keep=1` slices [B, 1, H] out of a longer sequence, and torch's matmul then
        expands the head's weight to a [B, H, V] copy (0.6 s for 4 prompts of the default model)."""
        # the autocast copy computes under autocast, as the policy trains; other copies in their own dtype
        with torch.autocast(self.device.type, dtype=self.dtype) if self.autocast else contextlib.nullcontext():
            out = self.backbone(input_ids=input_ids, position_ids=position_ids, attention_mask=attention_mask,
                                use_cache=True, **{self._cache_kwarg: cache})
            hidden = out.last_hidden_state[:, -1]
            return self.head(hidden).float()

    def _own_step(self):
        """`_eager_step` bound to this engine through a code object of its own.

        Why: dynamo keeps what it compiled on the code object it traced, and the step is compiled without guards
        on the copy's modules. Another engine in the same process (a sweep's next job under Hydra's basic launcher)
        then matched this engine's compiled step, with this engine's module constants (its packed layers' slots)
        baked in: it failed on a released slot and decoded eager from then on. An engine's own code object keeps
        its own."""
        fn = RolloutEngine._eager_step
        own = types.FunctionType(fn.__code__.replace(), fn.__globals__, fn.__name__, fn.__defaults__, fn.__closure__)
        return types.MethodType(own, self)

    def _eager_step(self, input_ids, position_ids, attention_mask, cache) -> torch.Tensor:
        """One decoding step: the next-token logits (fp32) of every row."""
        return self._last_logits(input_ids, position_ids, attention_mask, cache)

    def _sample(self, logits: torch.Tensor, generator=None) -> tuple[torch.Tensor, torch.Tensor]:
        """`generate`'s sampling distribution (temperature, then top-k, then top-p) and the log-prob of each drawn
        token under the distribution it was drawn from.

        sampler="cdf" draws one uniform number per row and inverts the cumulative distribution:
        the same distribution as `torch.multinomial`, which `generate` uses, but that draws an exponential
        variate for every vocabulary entry: about 25 ms per step for 32 rows x 49152 tokens on one core, a
        large share of a decoding step. sampler="multinomial" draws exactly as `generate` does (the same tokens
        under the same seed; tests/training/test_rollout.py)."""
        scores = logits / self.temperature if self.temperature != 1.0 else logits
        if self.top_k > 0:
            kth = torch.topk(scores, min(self.top_k, scores.size(-1)))[0][..., -1, None]
            scores = scores.masked_fill(scores < kth, -float("inf"))
        if self.top_p < 1.0:
            sorted_logits, sorted_idx = torch.sort(scores, descending=False)
            cumulative = sorted_logits.softmax(dim=-1).cumsum(dim=-1)
            remove = cumulative <= (1 - self.top_p)
            remove[..., -1:] = False  # keep at least one token
            scores = scores.masked_fill(remove.scatter(1, sorted_idx, remove), -float("inf"))
        probs = torch.softmax(scores, dim=-1)
        if self.sampler == "multinomial":
            tokens = torch.multinomial(probs, num_samples=1, generator=generator)
        else:
            cdf = probs.cumsum(dim=-1)
            u = torch.rand((probs.size(0), 1), device=probs.device, generator=generator)
            # the first index whose cumulative mass exceeds u * total: a token of zero mass is never drawn
            tokens = torch.searchsorted(cdf, u * cdf[:, -1:], right=True).clamp_(max=probs.size(-1) - 1)
        logps = probs.gather(1, tokens).log().squeeze(1)
        return tokens.squeeze(1), logps

    def _static_cache(self, batch: int, max_len: int):
        """The decoding cache for this shape: made once, reset between rounds (same tensors for the compiled
        step, so it is not recompiled)."""
        from transformers import StaticCache

        if self._cache_key != (batch, max_len):
            self._cache = StaticCache(config=self.model.config, max_cache_len=max_len)
            self._cache_key = (batch, max_len)
        return self._cache

    def generate(self, prompt_ids: list[list[int]], generator: torch.Generator | None = None
                 ) -> tuple[list[list[int]], list[list[float]]]:
        """Completions (cut after the first EOS, which is kept) and their per-token sampling log-probs."""
        rng = generator.get_state() if generator is not None else torch.get_rng_state()
        try:
            return self._generate(prompt_ids, generator)
        except _RetryRound:  # the compiled step failed: the same draws again, eager
            generator.set_state(rng) if generator is not None else torch.set_rng_state(rng)
            return self._generate(prompt_ids, generator)

    @torch.no_grad()
    def _generate(self, prompt_ids: list[list[int]], generator: torch.Generator | None):
        from transformers import DynamicCache

        if self._released:
            raise RuntimeError("the rollout copy was released after its last round; sync(trainer) refills it")

        t0 = time.perf_counter()
        rows = len(prompt_ids)
        index: dict[tuple[int, ...], int] = {}
        inverse = [index.setdefault(tuple(ids), len(index)) for ids in prompt_ids]
        distinct = list(index)
        width = max(len(ids) for ids in distinct)
        ids = torch.full((len(distinct), width), self.pad, dtype=torch.long)
        mask = torch.zeros((len(distinct), width), dtype=torch.long)
        for i, row in enumerate(distinct):  # left padding, as TRL pads for generate
            ids[i, width - len(row):] = torch.tensor(row)
            mask[i, width - len(row):] = 1
        ids, mask = ids.to(self.device), mask.to(self.device)
        inv = torch.tensor(inverse, device=self.device)
        # generate's positions: count real tokens; padding sits at 0
        positions = (mask.cumsum(-1) - 1).masked_fill(mask == 0, 0)

        # Prefill each distinct prompt once, then give every completion of its group the same cache rows.
        prefix_cache = DynamicCache(config=self.model.config)
        logits = self._last_logits(ids, positions, mask, prefix_cache).index_select(0, inv)
        # only grows, so that one compiled step serves every round
        self._max_len = max(self._max_len, -(-(width + self.max_new_tokens) // _CACHE_BUCKET) * _CACHE_BUCKET)
        cache = self._static_cache(rows, self._max_len)
        for big, small in zip(cache.layers, prefix_cache.layers):
            keys, values = small.keys.index_select(0, inv), small.values.index_select(0, inv)
            if not big.is_initialized:
                big.lazy_initialization(keys, values)
            big.keys[:, :, :width].copy_(keys)
            big.values[:, :, :width].copy_(values)
            big.cumulative_length.fill_(width)
        del prefix_cache
        attention = torch.ones((rows, self._max_len), dtype=torch.long, device=self.device)
        attention[:, :width] = mask.index_select(0, inv)
        position = positions[:, -1:].index_select(0, inv) + 1
        self.timings["prefill_s"] = time.perf_counter() - t0

        t1 = time.perf_counter()
        tokens = torch.full((rows, self.max_new_tokens), self.pad, dtype=torch.long, device=self.device)
        logps = torch.zeros((rows, self.max_new_tokens), dtype=torch.float32, device=self.device)
        # keep_logps: the policy's plain tempered log-probs of the drawn tokens, which PPO's old log-probs are
        # (TRL scores without top-k, top-p or min_new_tokens); the sampling ones above are renormalised over the
        # tokens those filters keep, so they differ wherever a filter removed mass
        score_unfiltered = self.keep_logps and self.filters
        policy_logps = torch.zeros_like(logps) if score_unfiltered else None
        unfinished = torch.ones(rows, dtype=torch.bool, device=self.device)
        steps = 0
        for t in range(self.max_new_tokens):
            unfiltered = logits
            if t < self.min_new_tokens:
                logits = logits.index_fill(1, self.eos, -float("inf"))
            token, logp = self._sample(logits, generator)
            if score_unfiltered:
                policy_logps[:, t] = torch.log_softmax(unfiltered / self.temperature, -1).gather(
                    1, token[:, None]).squeeze(1)
            token = torch.where(unfinished, token, self.pad)  # finished rows continue with padding, as generate's
            tokens[:, t], logps[:, t] = token, logp
            steps = t + 1
            unfinished &= ~torch.isin(token, self.eos)
            if t + 1 == self.max_new_tokens or not bool(unfinished.any()):
                break
            logits = self._call_step(token[:, None], position, attention, cache)
            position = position + 1
        self.timings["decode_s"] = time.perf_counter() - t1
        self.timings["decode_steps"] = steps

        tokens, logps = tokens[:, :steps].cpu(), logps[:, :steps].cpu()
        is_eos = torch.isin(tokens, self.eos.cpu())
        lengths = torch.where(is_eos.any(1), is_eos.int().argmax(1) + 1, torch.tensor(steps))
        completion_ids = [tokens[i, :n].tolist() for i, n in enumerate(lengths.tolist())]
        completion_logps = [logps[i, :n].tolist() for i, n in enumerate(lengths.tolist())]
        if score_unfiltered:
            kept = policy_logps[:, :steps].cpu()
            self.pending_logps = [kept[i, :n].tolist() for i, n in enumerate(lengths.tolist())]
        elif self.keep_logps:  # nothing filtered: the sampling log-probs are the policy's
            self.pending_logps = completion_logps
        return completion_ids, completion_logps

    def _call_step(self, token, position, attention, cache) -> torch.Tensor:
        if not self.compiled:
            return self._step(token, position, attention, cache)
        try:
            return self._step(token, position, attention, cache)
        except Exception as err:  # an inductor failure must not end the run; eager gives the same numbers
            logger.warning("rollout engine: the compiled decoding step failed (%s: %s); decoding eager from now on",
                           type(err).__name__, str(err).splitlines()[0] if str(err) else "")
            self._step, self.compiled = self._eager_step, False
            # the failed call may have advanced the cache's length: the round starts again
            raise _RetryRound from err

    # ---------------------------------------------------------------------------------------------- TRL's hook

    def rollout(self, prompts: list, trainer) -> dict:
        """TRL's `rollout_func(prompts, trainer)`: tokenized exactly as TRL tokenizes for its own generate."""
        self.sync(trainer)
        prompt_ids, _, _ = trainer._tokenize_prompts(prompts)
        device_type = self.device.type
        with torch.autocast(device_type=device_type, enabled=False):  # the copy sets its own (_last_logits)
            completion_ids, logprobs = self.generate(prompt_ids)
        self.release()  # until the next round: the training step comes next
        return {"prompt_ids": prompt_ids, "completion_ids": completion_ids, "logprobs": logprobs}


class _RetryRound(Exception):
    """The compiled step failed mid-round; the round is generated again on the eager path."""


# ---------------------------------------------------------------------------------------- importance sampling


def enable_is_correction(trainer) -> None:
    """Turn on TRL's own importance-sampling correction for vLLM rollouts, without vLLM, with the settings in
    trainer.args (vllm_importance_sampling_mode and _clip_max; grpo_exp.training.trainer.grpo_config maps
    train.rollout_is_* onto them).

    GRPOTrainer applies it when `use_vllm` and `vllm_importance_sampling_correction` are set: it then always
    scores the batch with the trained policy (`old_per_token_logps`), and weighs each token's loss by
    exp(old - sampling log-prob), truncated or masked at the cap, per token or per sequence. Its only other use
    of `use_vllm` on the rollout_func path is a weight sync of the vLLM engine, a no-op here: the engine
    refreshes its copy itself (RolloutEngine.sync)."""
    mode = trainer.args.vllm_importance_sampling_mode
    if mode not in IS_MODES:
        raise ValueError(f"unknown importance-sampling mode {mode!r}; choose one of {', '.join(IS_MODES)}")
    trainer.use_vllm = True
    trainer.vllm_importance_sampling_correction = True
    trainer._last_loaded_step = -1
    trainer.vllm_generation = SimpleNamespace(sync_weights=lambda: None)


def is_weights(old_logps: torch.Tensor, sampling_logps: torch.Tensor, mask: torch.Tensor, mode: str,
               cap: float | None, floor: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The truncated/masked importance weights pi_train / pi_sampler and which tokens the cap changed, by the
    definition TRL applies (tests check TRL's weights against this): token modes weigh each token by its own
    ratio, sequence modes every token by the product of its sequence's ratios."""
    diff = torch.nan_to_num((old_logps - sampling_logps) * mask, nan=0.0)
    if mode.startswith("sequence"):
        diff = diff.sum(-1, keepdim=True)
    ratio = torch.exp(diff)
    low = -float("inf") if floor is None else floor
    high = float("inf") if cap is None else cap
    outside = (ratio < low) | (ratio > high)
    if mode.endswith("truncate"):
        weights = ratio.clamp(min=floor, max=cap)
    else:
        weights = ratio.masked_fill(outside, 0.0)
    return weights, outside.expand_as(mask) & mask.bool()


# what mismatch_totals adds up on one process, in its order; mismatch_from_totals combines processes' rows
MISMATCH_TOTALS = ("k3_sum", "clipped", "abs_sum", "tokens", "abs_max", "ratio_min", "ratio_sum", "ratios",
                   "ratio_max")


def mismatch_totals(old_logps: torch.Tensor, sampling_logps: torch.Tensor, mask: torch.Tensor, mode: str,
                    cap: float | None, floor: float | None = None) -> torch.Tensor:
    """One process's sums, counts and extremes of the sampler's mismatch on its valid tokens (MISMATCH_TOTALS, a
    float64 vector): what processes can gather and combine into the run's figures (mismatch_from_totals).
    The importance weights are counted per valid token in token modes and per sequence in sequence modes, as TRL
    reports them."""
    valid = mask.bool() & ~torch.isnan(sampling_logps)
    log_r = (old_logps - sampling_logps).masked_fill(~valid, 0.0)
    k3 = (torch.exp(log_r) - 1 - log_r).masked_fill(~valid, 0.0)
    weights, clipped = is_weights(old_logps, sampling_logps, mask, mode, cap, floor)
    ratios = weights.flatten() if mode.startswith("sequence") else weights[valid]
    abs_r = log_r.abs()[valid]
    inf = float("inf")
    return torch.tensor([float(k3.sum()), float((clipped & valid).sum()), float(abs_r.sum()), float(valid.sum()),
                         float(abs_r.max()) if abs_r.numel() else -inf,
                         float(ratios.min()) if ratios.numel() else inf, float(ratios.sum()), float(ratios.numel()),
                         float(ratios.max()) if ratios.numel() else -inf], dtype=torch.float64)


def mismatch_from_totals(totals: torch.Tensor) -> dict[str, float]:
    """The mismatch over every process's tokens from their `mismatch_totals` rows ([processes, len(MISMATCH_TOTALS)]):
    rollout/kl, rollout/clipped_frac, rollout/logp_diff_abs, and, where a process had a valid token, TRL's
    sampling/* figures (the largest log-prob difference; the weights' min, mean and max)."""
    t = dict(zip(MISMATCH_TOTALS, totals.reshape(-1, len(MISMATCH_TOTALS)).double().unbind(-1)))
    tokens = float(t["tokens"].sum())
    n = max(tokens, 1.0)
    stats = {"rollout/kl": float(t["k3_sum"].sum()) / n, "rollout/clipped_frac": float(t["clipped"].sum()) / n,
             "rollout/logp_diff_abs": float(t["abs_sum"].sum()) / n}
    ratios = float(t["ratios"].sum())
    if tokens and ratios:
        stats.update({"sampling/sampling_logp_difference/mean": stats["rollout/logp_diff_abs"],
                      "sampling/sampling_logp_difference/max": float(t["abs_max"].max()),
                      "sampling/importance_sampling_ratio/min": float(t["ratio_min"].min()),
                      "sampling/importance_sampling_ratio/mean": float(t["ratio_sum"].sum()) / ratios,
                      "sampling/importance_sampling_ratio/max": float(t["ratio_max"].max())})
    return stats


def mismatch_metrics(old_logps: torch.Tensor, sampling_logps: torch.Tensor, mask: torch.Tensor, mode: str,
                     cap: float | None, floor: float | None = None) -> dict[str, float]:
    """How far the sampler is from the trained policy on the sampled tokens of one process: the mean per-token
    KL(sampler || trained) by the k3 estimator (r - 1 - log r with r = pi_train / pi_sampler, unbiased and >= 0),
    the share of completion tokens whose weight the cap truncated or masked, the mean absolute log-prob
    difference, and TRL's sampling/* figures (mismatch_from_totals)."""
    return mismatch_from_totals(mismatch_totals(old_logps, sampling_logps, mask, mode, cap, floor)[None])


def build_engine(trainer, train_cfg) -> RolloutEngine | None:
    """The engine for `train.rollout=engine`, wired into the trainer; None (TRL's path) with a warning naming
    why when it cannot serve this trainer."""
    why = unsupported_reason(trainer)
    if why:
        # asked for by name, its absence is news; under auto, falling back is what auto means
        log = logger.warning if train_cfg.rollout == "engine" else logger.info
        log("train.rollout=%s: the engine is not used for %s; TRL's generation runs", train_cfg.rollout, why)
        return None
    kind = copy_kinds.kind(train_cfg.rollout_dtype)
    engine = RolloutEngine(
        trainer.model, dtype=copy_kinds.weight_dtype(kind), autocast=kind == "autocast",
        compile=train_cfg.rollout_compile, prepack=train_cfg.rollout_prepack,
        max_new_tokens=trainer.max_completion_length, temperature=trainer.temperature, top_k=trainer.top_k,
        top_p=trainer.top_p, eos_token_ids=list(trainer.eos_token_ids),
        pad_token_id=trainer._tokenizer.pad_token_id, sampler=train_cfg.rollout_sampler,
        min_new_tokens=(trainer.args.generation_kwargs or {}).get("min_new_tokens", 0),
        attention_decode=train_cfg.attention_decode)
    trainer.rollout_func = engine.rollout
    source = old_logps_source(train_cfg.rollout_old_logps, train_cfg.rollout_dtype, train_cfg.precision)
    if source == "sampler":
        engine.keep_logps = True
        logger.info("train.rollout_old_logps=%s: PPO's old log-probs are the sampler's (%s copy); TRL's scoring "
                    "forward over each round is skipped and no importance weights apply", train_cfg.rollout_old_logps,
                    engine.label)
    elif trainer.args.vllm_importance_sampling_correction:
        enable_is_correction(trainer)
    return engine
