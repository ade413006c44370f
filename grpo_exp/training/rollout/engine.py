"""The rollout engine: GRPO's completions sampled from a rollout copy of the policy, without HF `generate`.

Why: on a CPU, generation was more than half of a GRPO step, and `generate` under bf16 autocast recasts the fp32
weights on every op of every token, runs eager Python for each decoding step, and grows its KV cache with `cat`.
The engine samples from a rollout copy of the policy (its kind: config/speed.py) in the machine's native dtype or as
autocast computes, its Linear layers packed where the machine allows (kernels/packed_linear.py,
kernels/small_rows.py), with a static KV cache, a prefill that runs each distinct prompt once, grouped attention,
and a decoding step compiled with `torch.compile` where a C++ compiler is present. Between rounds the copy's own
weights and the cache give their memory back (`release`): the training step between two rounds is where a run's
memory peaks.

Sampling follows `generate`'s distribution: fp32 logits, temperature, then top-k, then top-p, pad tokens after
EOS, and each drawn token's log-prob under it (vLLM's "processed" log-probs). With sampler=multinomial and an
fp32 copy it draws the same tokens as `generate` under the same seed; sampler=cdf draws from the same
distribution with one uniform number per row (tests/training/test_rollout.py checks both). How the engine is
plugged into TRL: trl_hook.py.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import inspect
import time

import torch

from grpo_exp.base import log, stop
from grpo_exp.base.cpu import compiler_missing
from grpo_exp.config.speed import ROLLOUT_SAMPLERS
from grpo_exp.evaluation.fast_decode import drop_forward_wrappers, plain_cache, static_cache_unsupported
from grpo_exp.kernels import attention, packed_linear, small_rows
from grpo_exp.kernels.compiled_step import compile_own_step
from grpo_exp.training import shared_prefix

logger = log.get_logger(__name__)

# the cache length is rounded up to this, so prompts of slightly different lengths reuse one compiled step
_CACHE_BUCKET = 64


@functools.lru_cache(maxsize=None)
def _cache_kwarg(model_type: type) -> str:
    """transformers 5 renamed `past_key_values` to `cache` in a minor release; the pin allows both."""
    return "cache" if "cache" in inspect.signature(model_type.forward).parameters else "past_key_values"


def model_unsupported_reason(model) -> str | None:
    """Why the engine cannot decode this model (None when it can)."""
    # the engine applies the LM head itself, as shared-prefix scoring does: the same models qualify
    return (shared_prefix.unsupported_reason(model) or attention.unsupported_reason(model)
            or static_cache_unsupported(model.config))


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
    drop_forward_wrappers(shell)  # accelerate's autocast wrapper, if the model was prepared already
    shell.eval()
    attention.use(shell, "grouped", attention_decode)  # decoding steps laid out as speed.attention_decode says
    return shell


class RolloutEngine:
    """Samples GRPO completions from a rollout copy of the policy (trl_hook.rollout_func serves them to TRL)."""

    def __init__(self, policy: torch.nn.Module, *, dtype: torch.dtype, autocast: bool = False,
                 compile: bool = True, prepack: bool = False,
                 max_new_tokens: int, temperature: float = 1.0, top_k: int | None = 0, top_p: float = 1.0,
                 eos_token_ids: list[int], pad_token_id: int, sampler: str = "cdf", min_new_tokens: int = 0,
                 attention_decode: str = "cache_axis"):
        if sampler not in ROLLOUT_SAMPLERS:
            raise ValueError(f"unknown sampler {sampler!r}; choose one of {', '.join(ROLLOUT_SAMPLERS)}")
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
        # speed.old_logps=sampler: the last round's log-probs under the policy (tempered, unfiltered),
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
        self._compiled_once = False  # the compiled step has run: its first call compiled it
        # compile: the plan's speed.rollout_compile; a CPU without a C++ compiler decodes eager all the same
        why = "speed.rollout_compile=false" if not compile else (
            compiler_missing() if self.device.type == "cpu" else None)
        if why is None:
            # with packed weights, products that share an input are one product (packed_linear.compile_fused)
            backend = packed_linear.compile_fused if self.packed else "inductor"
            # Without dynamo's guards on the copy's modules: evaluating them was most of what dynamo spent before
            # each decoding step (docs/log.md, "2026-11-29 — around the decoding step's kernels"). Nothing changes a
            # module of the copy after it is built (refresh and release change tensor contents and storages in
            # place); the guards on the step's own inputs (shapes, the cache) and on global state stay.
            # compiled for this engine alone (kernels/compiled_step.py)
            self._step = compile_own_step(self, RolloutEngine._eager_step, dynamic=False, backend=backend,
                                          options={"guard_filter_fn": torch.compiler.skip_guard_on_all_nn_modules_unsafe})
            self.compiled = True
            logger.debug("rollout engine: %s copy of the policy%s, decoding step compiled with torch.compile "
                         "(inductor); the first round includes compilation", self.label, self._packed_note)
        else:
            self._step = self._eager_step
            # running eager for lack of a compiler is slower than the user was promised: say so; asked for, not
            say = logger.warning if "compiler" in str(why) else logger.debug
            say("rollout engine: %s copy of the policy%s, decoding step runs eager (%s)", self.label,
                self._packed_note, why)

    @property
    def _packed_note(self) -> str:
        if not self.packed:
            return ""
        how = "products of a few rows by grpo-exp's kernel, " if small_rows.applies(self.dtype) else ""
        library = "MKL's" if self.dtype == torch.float32 else "oneDNN's products packed once per refresh"
        return f" ({len(self.packed)} Linear layers: {how}{library} elsewhere)"

    def _pack_linears(self, prepack: bool) -> list:
        """The copy's Linear layers swapped for packed ones where `prepack` asks (the speed plan asks only where the
        machine allows them; a request that cannot be met is an error)."""
        if not prepack:
            return []
        why = packed_linear.unsupported_reason(self.dtype, self.device)
        if why:
            raise ValueError(f"packed rollout weights cannot be used here: {why}")
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
        expands the head's weight to a [B, H, V] copy: the whole head once per row."""
        # the autocast copy computes under autocast, as the policy trains; other copies in their own dtype
        with torch.autocast(self.device.type, dtype=self.dtype) if self.autocast else contextlib.nullcontext():
            out = self.backbone(input_ids=input_ids, position_ids=position_ids, attention_mask=attention_mask,
                                use_cache=True, **{self._cache_kwarg: cache})
            hidden = out.last_hidden_state[:, -1]
            return self.head(hidden).float()

    def _eager_step(self, input_ids, position_ids, attention_mask, cache) -> torch.Tensor:
        """One decoding step: the next-token logits (fp32) of every row."""
        return self._last_logits(input_ids, position_ids, attention_mask, cache)

    def _sample(self, logits: torch.Tensor, generator=None) -> tuple[torch.Tensor, torch.Tensor]:
        """`generate`'s sampling distribution (temperature, then top-k, then top-p) and the log-prob of each drawn
        token under the distribution it was drawn from.

        sampler="cdf" draws one uniform number per row and inverts the cumulative distribution:
        the same distribution as `torch.multinomial`, which `generate` uses, but that draws an exponential
        variate for every vocabulary entry of every row, a large share of a decoding step on a CPU.
        sampler="multinomial" draws exactly as `generate` does (the same tokens under the same seed;
        tests/training/test_rollout.py)."""
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
        step, so it is not recompiled). A sliding-window layer is a plain one, the window the model's mask's
        (fast_decode.plain_cache: each row's positions are contiguous, so exact at any length)."""
        if self._cache_key != (batch, max_len):
            self._cache = plain_cache(self.model.config, max_len)
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
        if self._released:
            raise RuntimeError("the rollout copy was released after its last round; sync(trainer) refills it")
        stop.check("generation")

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
        prefix_cache = plain_cache(self.model.config)
        # one forward over every prompt, seconds in a first round (the packed kernels' first calls): a stop during
        # it raises at once, as the round is abandoned anyway
        with stop.urgent("generation"):
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
            stop.check("generation")  # a stop abandons the round: its completions would train nothing
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
            if not self._compiled_once:
                return self._compile_step(token, position, attention, cache)
            # a call of the compiled step may recompile (dynamo's guards): a stop raises out of it at once
            with stop.urgent("generation"):
                return self._step(token, position, attention, cache)
        except Exception as err:  # an inductor failure must not end the run; eager gives the same numbers
            logger.warning("rollout engine: the compiled decoding step failed (%s: %s); decoding eager from now on",
                           type(err).__name__, str(err).splitlines()[0] if str(err) else "")
            self._step, self.compiled = self._eager_step, False
            # the failed call may have advanced the cache's length: the round starts again
            raise _RetryRound from err

    def _compile_step(self, token, position, attention, cache) -> torch.Tensor:
        """The compiled step's first call, which compiles it: a minute or more for a larger model on a CPU, in
        torch.compile, which cannot poll a stop request, so a stop during it raises from the signal handler."""
        logger.info("rollout engine: compiling the decoding step (torch.compile, the first round only)")
        t0 = time.perf_counter()
        with stop.urgent("compilation"):
            logits = self._step(token, position, attention, cache)
        self._compiled_once = True
        self.timings["compile_s"] = time.perf_counter() - t0
        logger.debug("rollout engine: decoding step compiled in %.1f s", self.timings["compile_s"])
        return logits


class _RetryRound(Exception):
    """The compiled step failed mid-round; the round is generated again on the eager path."""
