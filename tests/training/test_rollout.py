"""speed.generation=engine (training/rollout/): it samples what `generate` samples, its importance weights are
TRL's correction computed by hand, and a GRPO step through either rollout path trains. No timing assertions:
speed belongs to grpo-bench."""

from __future__ import annotations

import contextlib
import copy
import math
from types import SimpleNamespace

import pytest
import torch

from grpo_exp.config.checks import validate
from grpo_exp.base import cpu
from grpo_exp.base.errors import ConfigError
from grpo_exp.config import speed
from grpo_exp.core import models
from grpo_exp.kernels import attention, decode_attention, packed_linear, small_rows
from grpo_exp.training import rollout
from tests.conftest import compose_cfg
from tests.kernels.test_decode_attention import needs_checked_torch
from tests.training.briefly import train_briefly

FAST = ["debug=smoke", "stage.num_train=16", "train.learning_rate=1e-3", "logger=none",
        "train.max_completion_length=8", "reward.funcs=[vowel_fraction]", "reward.weights=[1.0]",
        "train.save_steps=100", "train.max_steps=1", "speed.rollout_compile=false"]
PROMPTS = ["What is 7 + 5?", "Tom has 12 apples and eats 3 of them. How many are left?"]


pytestmark = pytest.mark.usefixtures("test_rewards")


@pytest.fixture(scope="module")
def tiny(tiny_model):
    """This module's own copy of the session's tiny model (its tests move the policy's weights, replace its head's
    tensor and switch its attention), with the chat-templated PROMPTS."""
    model, tokenizer = copy.deepcopy(tiny_model)
    rows = [tokenizer.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True,
                                          tokenize=True, return_dict=False) for p in PROMPTS]
    return model, tokenizer, rows


def engine_for(model, tokenizer, eos, **kw):
    settings = dict(dtype=torch.float32, compile=False, max_new_tokens=12, temperature=0.8,
                    eos_token_ids=eos, pad_token_id=tokenizer.pad_token_id, sampler="multinomial")
    settings.update(kw)
    return rollout.RolloutEngine(model, **settings)


@contextlib.contextmanager
def policy_moved(model, move):
    """`move` applied in place to every parameter of the (module-scoped) policy, undone afterwards; yields the
    values from before the move."""
    with torch.no_grad():
        originals = {n: p.clone() for n, p in model.named_parameters()}
        for p in model.parameters():
            move(p)
    try:
        yield originals
    finally:
        with torch.no_grad():
            for n, p in model.named_parameters():
                p.copy_(originals[n])


def hf_generate(model, tokenizer, rows, eos, max_new_tokens=12, **sampling):
    """TRL's transformers path: left-padded prompts into `generate`, cut after the first EOS."""
    width = max(len(r) for r in rows)
    ids = torch.full((len(rows), width), tokenizer.pad_token_id)
    mask = torch.zeros_like(ids)
    for i, r in enumerate(rows):
        ids[i, width - len(r):] = torch.tensor(r)
        mask[i, width - len(r):] = 1
    with torch.no_grad():
        out = model.generate(input_ids=ids, attention_mask=mask, do_sample=True, max_new_tokens=max_new_tokens,
                             pad_token_id=tokenizer.pad_token_id, eos_token_id=eos, **sampling)
    completions = []
    for row in out[:, width:].tolist():
        cut = next((i for i, t in enumerate(row) if t in eos), len(row) - 1)
        completions.append(row[:cut + 1])
    return completions


@pytest.mark.parametrize("sampling", [dict(temperature=0.8, top_k=0, top_p=1.0),
                                      dict(temperature=1.0, top_k=50, top_p=0.9),
                                      dict(temperature=0.8, top_k=0, top_p=1.0, min_new_tokens=5)],
                         ids=["temperature", "top_k_p", "min_new_tokens"])
def test_fp32_copy_draws_the_tokens_generate_draws(tiny, sampling):
    model, tokenizer, prompts = tiny
    rows = [p for p in prompts for _ in range(4)]  # GRPO groups: each prompt 4 times
    # a tenth of the vocabulary ends a sequence, so rows finish at different steps (generate pads them after)
    eos = list(range(0, len(tokenizer), 10))
    engine = engine_for(model, tokenizer, eos, **sampling)
    torch.manual_seed(3)
    ours, logps = engine.generate(rows)
    torch.manual_seed(3)
    theirs = hf_generate(model, tokenizer, rows, eos, **sampling)
    assert ours == theirs
    assert len({len(c) for c in ours}) > 1  # some rows stopped early
    assert [len(lp) for lp in logps] == [len(c) for c in ours]
    assert all(lp <= 0 and math.isfinite(lp) for row in logps for lp in row)
    assert all(len(c) >= sampling.get("min_new_tokens", 1) for c in ours)
    assert model.config._attn_implementation != attention.GROUPED  # only the copy uses the grouped attention


@pytest.mark.parametrize("compile", [False, "auto"], ids=["eager", "compiled"])
def test_the_last_axis_decoding_layout_samples_what_the_default_samples(tiny, compile):
    """speed.attention_decode=last_axis reaches the rollout copy, and an fp32 copy with it draws the same tokens
    with the same log-probs (to rounding) as with the default layout, eager and compiled."""
    model, tokenizer, prompts = tiny
    rows = [p for p in prompts for _ in range(4)]
    eos = list(range(0, len(tokenizer), 10))
    runs = {}
    for decode in attention.DECODE_LAYOUTS:
        engine = engine_for(model, tokenizer, eos, compile=compile, attention_decode=decode)
        assert engine.model.config._attn_implementation == {"cache_axis": attention.GROUPED,
                                                            "last_axis": attention.GROUPED_LAST_AXIS}[decode]
        runs[decode] = engine.generate(rows, torch.Generator().manual_seed(5))
    (ours, our_logps), (base, base_logps) = runs["last_axis"], runs["cache_axis"]
    assert ours == base and len({len(c) for c in ours}) > 1
    torch.testing.assert_close(torch.tensor(sum(our_logps, [])), torch.tensor(sum(base_logps, [])),
                               rtol=1e-5, atol=1e-5)


def test_sampler_log_probs_are_the_models_tempered_log_probs(tiny):
    """The log-prob of every drawn token is log softmax(logits / T) of the model at that position."""
    model, tokenizer, prompts = tiny
    engine = engine_for(model, tokenizer, [tokenizer.eos_token_id])
    torch.manual_seed(0)
    (completion,), (logps,) = engine.generate(prompts[:1])
    ids = torch.tensor([prompts[0] + completion])
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0, len(prompts[0]) - 1:-1] / 0.8
    expected = torch.log_softmax(logits, -1).gather(1, torch.tensor(completion)[:, None]).squeeze(1)
    torch.testing.assert_close(torch.tensor(logps), expected, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("settings", [dict(temperature=0.7, top_k=0, top_p=1.0),
                                      dict(temperature=1.3, top_k=6, top_p=0.8)], ids=["temperature", "top_k_p"])
def test_cdf_sampler_draws_the_processed_distribution(tiny, settings):
    """The fast sampler (one uniform number per row) against the distribution `generate` samples from:
    a chi-square test on 40000 draws, and log-probs equal to that distribution's."""
    model, tokenizer, _ = tiny
    engine = engine_for(model, tokenizer, [0], sampler="cdf", **settings)
    logits = torch.tensor([[2.0, 1.5, 1.0, 0.5, 0.0, -0.5, -1.0, -3.0, -6.0, -30.0]])
    # the processed distribution, by hand: temperature, keep the top k, then the smallest set above top_p
    scores = logits[0] / settings["temperature"]
    order = torch.argsort(scores, descending=True)
    keep = torch.zeros_like(scores, dtype=torch.bool)
    mass = 0.0
    probs_all = torch.softmax(scores, -1)
    top_k = settings["top_k"] or len(scores)
    kept_probs = torch.softmax(scores[order[:top_k]], -1)
    for rank, idx in enumerate(order[:top_k]):
        keep[idx] = True
        mass += float(kept_probs[rank])
        if mass >= settings["top_p"]:
            break
    expected = torch.where(keep, probs_all, torch.zeros_like(probs_all))
    expected = expected / expected.sum()

    draws = 40000
    gen = torch.Generator().manual_seed(0)
    tokens, logps = engine._sample(logits.expand(draws, -1), gen)
    counts = torch.bincount(tokens, minlength=logits.size(1)).double()
    assert counts[~keep].sum() == 0  # never a token outside the kept set
    exp_counts = expected[keep].double() * draws
    chi2 = float(((counts[keep] - exp_counts) ** 2 / exp_counts).sum())
    dof = int(keep.sum()) - 1
    # 99.9% quantile of chi-square (Wilson-Hilferty): a seeded test, so it either always passes or never does
    z = 3.09
    bound = dof * (1 - 2 / (9 * dof) + z * math.sqrt(2 / (9 * dof))) ** 3
    assert chi2 < bound, (chi2, bound, counts.tolist(), exp_counts.tolist())
    torch.testing.assert_close(logps, expected.log()[tokens].float(), atol=1e-5, rtol=1e-5)


def test_cdf_sampler_matches_the_models_first_token_distribution(tiny):
    """End to end through the model: the engine's first tokens (cdf sampler) follow softmax(logits / T). The
    random model spreads its mass thinly, so tokens are pooled into 20 cells by id modulo 20."""
    model, tokenizer, prompts = tiny
    engine = engine_for(model, tokenizer, [0], sampler="cdf", max_new_tokens=1, top_k=0)
    torch.manual_seed(1)
    rows = [prompts[0]] * 1200
    completions, _ = engine.generate(rows)
    cells = torch.tensor([c[0] for c in completions]) % 20
    with torch.no_grad():
        probs = torch.softmax(model(input_ids=torch.tensor([prompts[0]])).logits[0, -1] / 0.8, -1).double()
    expect = torch.zeros(20, dtype=torch.float64).index_add_(0, torch.arange(len(probs)) % 20, probs) * len(rows)
    observed = torch.bincount(cells, minlength=20).double()
    chi2 = float(((observed - expect) ** 2 / expect).sum())
    dof = 19
    assert chi2 < dof * (1 - 2 / (9 * dof) + 3.09 * math.sqrt(2 / (9 * dof))) ** 3, chi2


# a tiny random model of each family whose layers (all, or some, as Gemma 3's) attend over a sliding window
SLIDING = {"gemma3": ("Gemma3TextConfig", dict(head_dim=16, query_pre_attn_scalar=16,
                                               layer_types=["sliding_attention", "full_attention"])),
           "mistral": ("MistralConfig", {}),
           "qwen2": ("Qwen2Config", dict(use_sliding_window=True, max_window_layers=1))}


def sliding_model(family: str, window: int):
    """A 2-layer random model of `family` (SLIDING) with a sliding window of `window` positions, its weights scaled
    up so that its next-token distributions are far from uniform (the window then changes what it draws)."""
    import transformers

    name, settings = SLIDING[family]
    config = getattr(transformers, name)(vocab_size=300, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                                         pad_token_id=0, eos_token_id=1, bos_token_id=2, sliding_window=window,
                                         **settings)
    with torch.random.fork_rng():
        torch.manual_seed(0)
        model = transformers.AutoModelForCausalLM.from_config(config).eval()
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() > 1:
                p.mul_(4.0)
    return model


def sampled_by_generate(model, rows, eos, seed: int, max_new_tokens: int = 10, temperature: float = 0.9):
    """`generate`'s draws (multinomial, temperature only) for left-padded `rows` (pad 0), cut after the first EOS."""
    width = max(len(r) for r in rows)
    ids = torch.tensor([[0] * (width - len(r)) + r for r in rows])
    torch.manual_seed(seed)
    with torch.no_grad():
        out = model.generate(input_ids=ids, attention_mask=(ids != 0).long(), do_sample=True, top_k=0, top_p=1.0,
                             max_new_tokens=max_new_tokens, temperature=temperature, pad_token_id=0, eos_token_id=eos)
    return [r[:next((i + 1 for i, t in enumerate(r) if t in eos), len(r))] for r in out[:, width:].tolist()]


def scored_whole(model, rows, completions, temperature: float = 0.9) -> list[list[float]]:
    """The tempered log-probs of each completion token in one forward over left-padded prompt + completion, right-
    padded (TRL's scoring forward: the positions, masks and window over the whole sequence)."""
    width, longest = max(len(r) for r in rows), max(len(c) for c in completions)
    ids = torch.tensor([[0] * (width - len(r)) + r + c + [0] * (longest - len(c)) for r, c in zip(rows, completions)])
    mask = torch.tensor([[0] * (width - len(r)) + [1] * (len(r) + len(c)) + [0] * (longest - len(c))
                         for r, c in zip(rows, completions)])
    with torch.no_grad():
        logits = model(input_ids=ids, attention_mask=mask).logits[:, width - 1:-1].float() / temperature
    logps = torch.log_softmax(logits, -1).gather(2, ids[:, width:, None]).squeeze(2)
    return [logps[i, :len(c)].tolist() for i, c in enumerate(completions)]


@pytest.mark.parametrize("family", SLIDING)
def test_a_sliding_window_model_samples_what_generate_samples_past_its_window(family):
    """Sliding-window layers (Gemma 3's 512 positions; 5 here) are held as plain cache layers, the window the model's
    own mask's: prompts of 4-8 tokens and 10 new tokens reach past the window, and an fp32 copy still draws
    `generate`'s tokens, with the log-probs a forward over the whole sequence gives (TRL's scoring). The window
    matters here: without it `generate` draws other tokens."""
    from transformers.cache_utils import StaticLayer

    model = sliding_model(family, 5)
    assert rollout.model_unsupported_reason(model) is None
    g = torch.Generator().manual_seed(0)
    prompts = [[2] + torch.randint(5, 300, (int(k),), generator=g).tolist() for k in (3, 7, 5)]
    rows = [p for p in prompts for _ in range(2)]
    engine = rollout.RolloutEngine(model, dtype=torch.float32, compile=False, max_new_tokens=10, temperature=0.9,
                                   eos_token_ids=[299], pad_token_id=0, sampler="multinomial")
    torch.manual_seed(3)
    ours, logps = engine.generate(rows)
    assert ours == sampled_by_generate(model, rows, [299], seed=3)
    for got, want in zip(logps, scored_whole(model, rows, ours)):
        torch.testing.assert_close(torch.tensor(got), torch.tensor(want), atol=1e-4, rtol=1e-4)
    assert all(type(layer) is StaticLayer for layer in engine._cache.layers)
    assert ours != sampled_by_generate(sliding_model(family, 10**4), rows, [299], seed=3)


@pytest.mark.skipif(rollout.compiler_missing() is not None, reason=f"{rollout.compiler_missing()}")
def test_the_compiled_step_of_a_sliding_window_model_samples_what_the_eager_step_samples():
    """The window's mask inside the compiled step: past Gemma 3-like layers' window, the same draws."""
    model = sliding_model("gemma3", 5)
    settings = dict(dtype=torch.float32, max_new_tokens=10, temperature=0.9, eos_token_ids=[299], pad_token_id=0,
                    sampler="multinomial")
    eager = rollout.RolloutEngine(model, compile=False, **settings)
    compiled = rollout.RolloutEngine(model, compile=True, **settings)
    g = torch.Generator().manual_seed(1)
    rows = [[2] + torch.randint(5, 300, (int(k),), generator=g).tolist() for k in (6, 2, 4, 8)]
    assert_same_draws(eager, compiled, rows)


def assert_same_draws(eager, compiled, rows, seed: int = 5) -> list[list[int]]:
    """Both engines, each from `seed`, draw the same tokens for `rows` with the same log-probs (to float rounding),
    the compiled one still compiled; returns the tokens."""
    torch.manual_seed(seed)
    a, a_logps = eager.generate(rows)
    torch.manual_seed(seed)
    b, b_logps = compiled.generate(rows)
    assert compiled.compiled, "the compiled step failed and fell back to eager"
    assert a == b
    for x, y in zip(a_logps, b_logps):
        torch.testing.assert_close(torch.tensor(x), torch.tensor(y), atol=1e-4, rtol=1e-4)
    return a


@pytest.mark.skipif(rollout.compiler_missing() is not None, reason=f"{rollout.compiler_missing()}")
def test_compiled_and_eager_decoding_agree(tiny):
    model, tokenizer, prompts = tiny
    rows = [p for p in prompts for _ in range(2)]
    eos = [tokenizer.eos_token_id]
    eager = engine_for(model, tokenizer, eos)
    compiled = engine_for(model, tokenizer, eos, compile=True)
    assert compiled.compiled and not eager.compiled
    a = assert_same_draws(eager, compiled, rows)
    # a released and refilled engine decodes the same tokens with the same compiled step, not a recompiled one
    frames = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    compiled.release()
    compiled.materialize()
    compiled.refresh(model)
    torch.manual_seed(5)
    c, _ = compiled.generate(rows)
    assert compiled.compiled and c == a
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == frames, "release/refill recompiled the step"


@pytest.mark.skipif(rollout.compiler_missing() is not None, reason=f"{rollout.compiler_missing()}")
def test_the_compiled_step_follows_moved_weights_and_new_batch_sizes(tiny):
    """The compiled step runs without dynamo's guards on the copy's modules (rollout/engine.py): after the policy moves
    it decodes what an eager engine of the moved policy decodes, and a batch of another size gets a step of its own
    (the guards on the step's inputs stay; dropping those too, the smaller batch reused the first graph)."""
    model, tokenizer, prompts = tiny
    eos = [tokenizer.eos_token_id]
    rows = [p for p in prompts for _ in range(2)]
    compiled = engine_for(model, tokenizer, eos, compile=True)
    torch.manual_seed(5)
    before, _ = compiled.generate(rows)
    with policy_moved(model, lambda p: p.mul_(1.1)):
        compiled.refresh(model)
        eager = engine_for(model, tokenizer, eos)
        moved = [assert_same_draws(eager, compiled, batch) for batch in (rows, rows[:3])]
        # the same rows and seed as `before`: only the policy differs
        assert moved[0] != before, "moving the policy changed no token: the test cannot tell stale weights"


@pytest.mark.skipif(rollout.compiler_missing() is not None, reason=f"{rollout.compiler_missing()}")
@needs_checked_torch
def test_the_decoding_softmax_kernel_samples_what_inductors_own_samples(tiny, monkeypatch):
    """A compiled decoding step whose grouped-attention softmax runs kernels/decode_attention.py's kernel draws the same
    tokens, with the same log-probs bit for bit, as the step compiled with inductor's own softmax."""
    model, tokenizer, prompts = tiny
    rows = [p for p in prompts for _ in range(4)]
    eos = [tokenizer.eos_token_id]
    kernel = decode_attention.decode_softmax
    calls = []
    monkeypatch.setattr(decode_attention, "decode_softmax", lambda *a, **k: calls.append(1) or kernel(*a, **k))
    draws = {}
    for enabled in (True, False):
        monkeypatch.setattr(decode_attention, "enabled", enabled)
        torch._dynamo.reset()
        engine = engine_for(model, tokenizer, eos, compile=True, temperature=1.0)
        torch.manual_seed(7)
        draws[enabled] = engine.generate(rows)
        assert engine.compiled, "the compiled step failed and fell back to eager"
        assert bool(calls) == enabled  # one call per layer and decoding step, with the kernel alone
        calls.clear()
    assert draws[True] == draws[False]



@pytest.mark.skipif(rollout.compiler_missing() is not None, reason=f"{rollout.compiler_missing()}")
@pytest.mark.skipif(not decode_attention._AVX512_BF16,
                    reason="decode_attention repeats oneDNN's AVX512-BF16 products (no AMX)")
@needs_checked_torch
def test_the_decoding_attention_kernel_samples_what_the_composed_attention_samples(tmp_path, monkeypatch):
    """A compiled bf16 decoding step whose attention is kernels/decode_attention.py's one kernel (heads of 32 columns:
    the tiny model made 128 wide) draws the same tokens with the same log-probs, bit for bit, as the step that
    composes torch's products around the softmax kernel."""
    cfg = compose_cfg(["debug=smoke", "model.tiny_hidden=128"], tmp_path)
    model, tokenizer = models.load(cfg.model, cfg.paths.cache_dir, seed=0)
    rows = [tokenizer.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True,
                                          tokenize=True, return_dict=False) for p in PROMPTS for _ in range(4)]
    kernel, calls = decode_attention._run_attention, []
    monkeypatch.setattr(decode_attention, "_run_attention", lambda *a, **k: calls.append(1) or kernel(*a, **k))
    draws = {}
    for fused in (True, False):
        monkeypatch.setattr(decode_attention, "_AVX512_BF16", fused)
        torch._dynamo.reset()
        engine = engine_for(model, tokenizer, [tokenizer.eos_token_id], dtype=torch.bfloat16, compile=True,
                            temperature=1.0)
        torch.manual_seed(7)
        draws[fused] = engine.generate(rows)
        assert engine.compiled, "the compiled step failed and fell back to eager"
        assert bool(calls) == fused
        calls.clear()
    assert draws[True] == draws[False]

def test_compile_off_or_no_compiler_decodes_eager_with_a_warning(tiny, monkeypatch, caplog):
    model, tokenizer, _ = tiny
    monkeypatch.setattr(rollout.engine, "compiler_missing", lambda: "no C++ compiler (g++ or clang++) on PATH")
    with caplog.at_level("WARNING", logger="grpo_exp"):
        engine = engine_for(model, tokenizer, [0], compile=True)
    assert not engine.compiled
    assert "decoding step runs eager (no C++ compiler" in caplog.text


def test_an_fp32_copy_shares_the_fp32_policys_weights_and_release_keeps_them(tiny):
    """An fp32 copy of an fp32 policy holds no second set of weights: it samples from the policy's current ones
    (an in-place update is seen without a refresh, as the optimizer's are), and `release` gives back only the
    cache, never the policy's storage."""
    model, tokenizer, prompts = tiny
    rows = [p for p in prompts for _ in range(2)]
    eos = list(range(0, len(tokenizer), 10))
    engine = engine_for(model, tokenizer, eos)
    policy = dict(model.named_parameters())
    assert engine.shared == set(policy)
    for name, param in engine.model.named_parameters():
        assert param.data_ptr() == policy[name].data_ptr() and not param.requires_grad
    assert all(p.requires_grad for p in policy.values())  # the policy still trains
    with policy_moved(model, lambda p: p.mul_(1.5)) as originals:
        torch.manual_seed(3)
        ours, _ = engine.generate(rows)
        torch.manual_seed(3)
        assert ours == hf_generate(model, tokenizer, rows, eos, temperature=0.8, top_k=0, top_p=1.0)  # no refresh
        engine.release()
        assert engine.released and all(p.untyped_storage().nbytes() > 0 for p in model.parameters())
        assert all(torch.equal(p, originals[n] * 1.5) for n, p in model.named_parameters())
        # a policy parameter replaced by another tensor (not in place): refresh points the copy at it
        head = model.get_output_embeddings().weight
        head.data = head.detach().clone()
        engine.sync(SimpleNamespace(state=SimpleNamespace(global_step=1), model=model))
        assert engine.model.get_output_embeddings().weight.data_ptr() == head.data_ptr()
        torch.manual_seed(3)
        again, _ = engine.generate(rows)
        assert again == ours


def test_release_gives_the_memory_back_and_a_refill_samples_as_before(tiny):
    model, tokenizer, prompts = tiny
    rows = [p for p in prompts for _ in range(2)]
    engine = engine_for(model, tokenizer, [tokenizer.eos_token_id], dtype=torch.bfloat16)
    torch.manual_seed(3)
    first, first_logps = engine.generate(rows)
    params = list(engine.model.parameters())
    cache = [t for layer in engine._cache.layers for t in (layer.keys, layer.values)]
    by_storage = {t.untyped_storage().data_ptr(): t for t in params + cache}  # tied weights: one entry
    held = sum(t.untyped_storage().nbytes() for t in by_storage.values())
    engine.release()
    assert engine.released and all(t.untyped_storage().nbytes() == 0 for t in params + cache)
    assert sum(n for _, n, _ in engine._released) == held  # every storage once (tied weights share one)
    with pytest.raises(RuntimeError, match="released"):
        engine.generate(rows)
    engine.materialize()
    engine.refresh(model)
    assert not engine.released and all(not t.any() for t in cache)  # the cache comes back zeroed, not garbage
    torch.manual_seed(3)
    again, again_logps = engine.generate(rows)
    assert again == first and again_logps == first_logps


def test_refresh_copies_in_place_into_the_bf16_copy(tiny):
    model, tokenizer, _ = tiny
    engine = engine_for(model, tokenizer, [0], dtype=torch.bfloat16)
    params = dict(engine.model.named_parameters())
    assert all(p.dtype == torch.bfloat16 and not p.requires_grad for p in params.values())
    # buffers (rotary frequencies) keep the policy's precision
    assert all(b.dtype == torch.float32 for b in engine.model.buffers() if b.is_floating_point())
    pointers = {n: p.data_ptr() for n, p in params.items()}
    with policy_moved(model, lambda p: p.add_(0.01)):
        engine.refresh(model)
        for name, param in engine.model.named_parameters():
            assert param.data_ptr() == pointers[name]  # no re-allocation
            torch.testing.assert_close(param, dict(model.named_parameters())[name].detach().bfloat16())


CANNOT_PACK = packed_linear.unsupported_reason(torch.bfloat16, torch.device("cpu"))


@pytest.mark.skipif(CANNOT_PACK is None, reason="this CPU packs bf16 weights (the next test packs them)")
def test_without_native_bf16_the_plan_leaves_the_copy_plain_and_the_engine_refuses_to_pack(tiny):
    """Packed weights where the CPU has no native bf16: the speed plan does not ask for them, and the engine
    refuses a request for them."""
    model, tokenizer, _ = tiny
    eos = [tokenizer.eos_token_id]
    train = type("T", (), {"precision": "bf16", "gradient_checkpointing": False})()
    assert not speed.resolve(speed.SpeedConfig(rollout_dtype="bf16"), train, device="cpu").rollout_prepack
    with pytest.raises(ValueError, match="packed rollout weights cannot be used here"):
        engine_for(model, tokenizer, eos, dtype=torch.bfloat16, prepack=True)


@pytest.mark.skipif(CANNOT_PACK is not None, reason=f"nothing can be packed on this CPU: {CANNOT_PACK}")
def test_a_packed_bf16_copy_samples_what_the_plain_copy_samples(tiny):
    """Packed weights (with speed.exact_shortcuts): the bf16 copy with its Linear weights packed for oneDNN (the decoding step compiled,
    products that share an input fused) draws the plain copy's tokens with the same log-probs, and again after the
    policy moved, a release and a refill."""
    model, tokenizer, prompts = tiny
    rows = [p for p in prompts for _ in range(2)]
    eos = [tokenizer.eos_token_id]
    plain = engine_for(model, tokenizer, eos, dtype=torch.bfloat16, compile=True, prepack=False)
    packed = engine_for(model, tokenizer, eos, dtype=torch.bfloat16, compile=True, prepack=True)
    linears = sum(isinstance(m, torch.nn.Linear) for m in model.modules())
    assert not plain.packed and len(packed.packed) == linears
    assert isinstance(packed.head, packed_linear.PackedLinear)

    def draw(engine, seed):
        torch.manual_seed(seed)
        return engine.generate(rows)

    groups = len(packed_linear._GROUPS)
    before = draw(packed, 3)
    assert before == draw(plain, 3) and packed.compiled
    # each layer's q/k/v and gate/up products were one product each (packed_linear.compile_fused)
    assert len(packed_linear._GROUPS) - groups == 2 * model.config.num_hidden_layers
    if small_rows.AVX512_BF16:  # the products read the plain weights: no packed copy was laid out
        slots = {layer.slot for layer in packed.packed}
        slots |= {group for slot in slots for group in packed_linear._GROUPS_WITH.get(slot, ())}
        assert all(packed_linear._PACKED.get(slot, packed_linear._PENDING) is packed_linear._PENDING for slot in slots)
    with policy_moved(model, lambda p: p.mul_(1.5)):
        for engine in (plain, packed):
            engine.release()
            assert not any(layer.packed for layer in engine.packed)  # the packed copies are given back too
            engine.sync(SimpleNamespace(state=SimpleNamespace(global_step=1), model=model))
        after = draw(packed, 3)
        assert after == draw(plain, 3) and packed.compiled
    assert after != before  # the repacked weights are the moved policy's


@pytest.mark.skipif(rollout.compiler_missing() is not None, reason=f"{rollout.compiler_missing()}")
def test_a_second_engine_in_the_process_compiles_a_step_of_its_own(tiny, tmp_path, monkeypatch):
    """As a curriculum's next stage does: a new engine over another policy, its layers packed, after the first
    engine's round and release. Its compiled step runs its own layers (it draws what its eager twin draws), and
    does not pick up the first engine's compiled step, whose packed slots are gone."""
    monkeypatch.setattr(small_rows, "F32_AVX2", True)  # the fp32 copy's layers packed on any x86 CPU
    first_model, tokenizer, prompts = tiny
    cfg = compose_cfg(["debug=smoke"], tmp_path)
    second_model, _ = models.load(cfg.model, cfg.paths.cache_dir, seed=1)
    rows = [p for p in prompts for _ in range(4)]
    eos = [tokenizer.eos_token_id]
    first = engine_for(first_model, tokenizer, eos, compile=True, prepack=True)
    first_drawn = assert_same_draws(engine_for(first_model, tokenizer, eos), first, rows)
    first.release()
    second = engine_for(second_model, tokenizer, eos, compile=True, prepack=True)
    assert second.packed and {m.slot for m in second.packed}.isdisjoint(m.slot for m in first.packed)
    drawn = assert_same_draws(engine_for(second_model, tokenizer, eos), second, rows)
    assert drawn != first_drawn  # the two policies draw differently: the test can tell them apart


def test_an_fp32_copy_through_the_fp32_kernel_samples_what_the_plain_copy_samples(tiny, monkeypatch):
    """An fp32 copy whose Linear layers take small_rows' fp32 kernel (forced on here; auto where torch's kernels are
    AVX2's), its decoding step compiled with the products that share an input grouped, draws the plain copy's tokens
    with the same log-probs, and again after the policy moved in place (the copy shares its weights: nothing to
    refresh). Where the kernel applies natively, it computed the step's products."""
    monkeypatch.setattr(small_rows, "F32_AVX2", True)
    model, tokenizer, prompts = tiny
    rows = [p for p in prompts for _ in range(4)]  # 8 rows: MKL's blocked product, whose order the kernel repeats
    eos = [tokenizer.eos_token_id]
    plain = engine_for(model, tokenizer, eos, compile=True, prepack=False)
    fast = engine_for(model, tokenizer, eos, compile=True, prepack=True)
    linears = sum(isinstance(m, torch.nn.Linear) for m in model.modules())
    assert not plain.packed and len(fast.packed) == linears and fast.shared == plain.shared != set()

    def draw(engine, seed):
        torch.manual_seed(seed)
        return engine.generate(rows)

    before = draw(fast, 5)
    assert before == draw(plain, 5) and fast.compiled
    slots = {group for layer in fast.packed for group in packed_linear._GROUPS_WITH.get(layer.slot, ())}
    spans = [span for slot in slots for (count, _), (_, span) in packed_linear._PLANS.get(slot, {}).items()
             if count == len(rows)]
    assert len(slots) == 2 * model.config.num_hidden_layers and spans
    if torch.backends.cpu.get_cpu_capability() == "AVX2":
        assert all(span is not None for span in spans)
    with policy_moved(model, lambda p: p.mul_(1.5)):
        after = draw(fast, 5)
        assert after == draw(plain, 5)
    assert after != before


def test_the_autocast_copy_casts_what_autocast_casts_and_shares_the_rest(tiny):
    """speed.rollout_dtype=autocast: every Linear weight a bf16 copy (the tied LM head one of its own), the
    embedding, norms and buffers the policy's own fp32 tensors; a refresh recasts the Linear weights in place."""
    model, tokenizer, _ = tiny
    engine = engine_for(model, tokenizer, [0], dtype=torch.bfloat16, autocast=True)
    policy = dict(model.named_parameters(remove_duplicate=False))
    linear = {f"{n}.weight" for n, m in engine.model.named_modules() if isinstance(m, torch.nn.Linear)}
    params = dict(engine.model.named_parameters())
    assert "lm_head.weight" in linear and "lm_head.weight" in params  # untied in the copy
    for name, param in params.items():
        assert not param.requires_grad
        if name in linear:
            assert param.dtype == torch.bfloat16 and param.data_ptr() != policy[name].data_ptr(), name
        else:  # embedding and norms: the policy's storage, never copied or released
            assert param.dtype == torch.float32 and param.data_ptr() == policy[name].data_ptr(), name
    assert engine.shared == set(params) - linear
    pointers = {n: p.data_ptr() for n, p in params.items()}
    with policy_moved(model, lambda p: p.add_(0.01)):
        engine.refresh(model)
        for name, param in engine.model.named_parameters():
            assert param.data_ptr() == pointers[name]  # no re-allocation
            torch.testing.assert_close(param, policy[name].detach().to(param.dtype), atol=0, rtol=0)
        engine.release()  # gives back the bf16 copies only
        assert all(params[n].untyped_storage().nbytes() == 0 for n in linear)
        assert all(p.untyped_storage().nbytes() > 0 for p in model.parameters())


def test_the_autocast_copy_computes_what_the_autocast_policy_computes(tiny):
    """The autocast copy's prefill logits are the policy's under bf16 autocast, bit for bit (the same ops in the
    same dtypes), where a plain bf16 copy (bf16 embedding and residual stream) differs; and the log-probs it
    samples with are the autocast policy's tempered log-probs up to the rounding of another batch shape."""
    from transformers import DynamicCache

    model, tokenizer, prompts = tiny
    eos = [tokenizer.eos_token_id]
    ids = torch.tensor([prompts[1]])
    positions = torch.arange(ids.size(1))[None]
    own = model.config._attn_implementation
    attention.use(model, "grouped")  # the copy's attention, as training sets it for the policy (speed.attention)
    try:
        with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):  # the head on the last position only
            hidden = model.model(input_ids=ids, position_ids=positions).last_hidden_state[:, -1]
            expected = model.lm_head(hidden).float()
        logits = {}
        for autocast in (True, False):
            engine = engine_for(model, tokenizer, eos, dtype=torch.bfloat16, autocast=autocast)
            with torch.no_grad():
                logits[autocast] = engine._last_logits(ids, positions, torch.ones_like(ids),
                                                       DynamicCache(config=model.config))
        torch.testing.assert_close(logits[True], expected, atol=0, rtol=0)
        assert (logits[False] - expected).abs().max() > 1e-3  # a plain bf16 copy is another arithmetic

        rows = [p for p in prompts for _ in range(2)]
        engine = engine_for(model, tokenizer, eos, dtype=torch.bfloat16, autocast=True, max_new_tokens=8)
        torch.manual_seed(2)
        completions, logps = engine.generate(rows)
        for row, completion, sampled in zip(rows, completions, logps):
            with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
                scores = model(input_ids=torch.tensor([row + completion])).logits[0, len(row) - 1:-1].float() / 0.8
            policy = torch.log_softmax(scores, -1).gather(1, torch.tensor(completion)[:, None]).squeeze(1)
            torch.testing.assert_close(torch.tensor(sampled), policy, atol=0.05, rtol=0)
    finally:
        model.set_attn_implementation(own)


# ------------------------------------------------------------------------------------------ importance sampling


def by_hand(old, samp, mask, mode, cap):
    """TRL's truncated / masked importance weights, one number at a time."""
    rows, cols = old.shape
    weights = torch.ones(rows, cols if mode.startswith("token") else 1)
    clipped = torch.zeros(rows, cols, dtype=torch.bool)
    for i in range(rows):
        if mode.startswith("sequence"):
            r = math.exp(sum(float(old[i, t] - samp[i, t]) for t in range(cols) if mask[i, t]))
            over = r > cap
            weights[i, 0] = (min(r, cap) if mode.endswith("truncate") else (0.0 if over else r))
            for t in range(cols):
                clipped[i, t] = bool(over and mask[i, t])
            continue
        for t in range(cols):
            r = math.exp(float(old[i, t] - samp[i, t])) if mask[i, t] else 1.0
            over = r > cap
            weights[i, t] = min(r, cap) if mode.endswith("truncate") else (0.0 if over else r)
            clipped[i, t] = bool(over and mask[i, t])
    return weights, clipped


@pytest.mark.parametrize("mode", speed.IS_MODES)
def test_is_weights_equal_a_hand_computation(mode):
    gen = torch.Generator().manual_seed(0)
    old = -torch.rand(3, 5, generator=gen) * 3
    samp = old + torch.randn(3, 5, generator=gen) * 0.6
    mask = torch.tensor([[1, 1, 1, 1, 1], [1, 1, 1, 0, 0], [1, 0, 0, 0, 0]])
    cap = 1.5 if mode.startswith("token") else 1.01  # sequence ratios here: 0.14, 0.28, 1.015
    weights, clipped = rollout.is_weights(old, samp, mask, mode, cap)
    expect_w, expect_c = by_hand(old, samp, mask, mode, cap)
    torch.testing.assert_close(weights, expect_w)
    assert torch.equal(clipped, expect_c)
    assert expect_c.any() and not expect_c.all()  # the cap bites somewhere, not everywhere


def test_mismatch_metrics_by_hand():
    old = torch.tensor([[-1.0, -2.0, -0.5], [-0.1, -3.0, -9.0]])
    samp = torch.tensor([[-1.2, -1.0, -0.5], [-0.1, -5.0, 0.0]])
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]])
    stats = rollout.mismatch_metrics(old, samp, mask, "token_truncate", 3.0)
    valid = [(0, 0), (0, 1), (0, 2), (1, 0), (1, 1)]
    logr = [float(old[i, t] - samp[i, t]) for i, t in valid]
    assert stats["rollout/kl"] == pytest.approx(sum(math.exp(x) - 1 - x for x in logr) / 5, rel=1e-6)
    assert stats["rollout/clipped_frac"] == pytest.approx(1 / 5)  # only exp(2.0) > 3
    assert stats["rollout/logp_diff_abs"] == pytest.approx(sum(abs(x) for x in logr) / 5, rel=1e-6)
    # TRL's names: the largest difference, and the truncated weights min(exp(log r), 3) of the valid tokens
    weights = [min(math.exp(x), 3.0) for x in logr]
    assert stats["sampling/sampling_logp_difference/max"] == pytest.approx(2.0)
    assert stats["sampling/sampling_logp_difference/mean"] == stats["rollout/logp_diff_abs"]
    assert stats["sampling/importance_sampling_ratio/min"] == pytest.approx(min(weights), rel=1e-6)
    assert stats["sampling/importance_sampling_ratio/mean"] == pytest.approx(sum(weights) / 5, rel=1e-6)
    assert stats["sampling/importance_sampling_ratio/max"] == pytest.approx(3.0)


def test_mismatch_totals_of_two_processes_combine_into_the_figures_of_both_batches():
    """A data-parallel run logs the mismatch over every process's tokens: the totals of two batches (of different
    widths, as two processes' completions are) combine into what one batch holding both rows gives, TRL's
    sampling/* figures included; a process without a valid token adds nothing."""
    torch.manual_seed(0)
    first_old, first_samp = torch.randn(3, 5) - 2, torch.randn(3, 5) - 2
    second_old, second_samp = torch.randn(2, 3) - 2, torch.randn(2, 3) - 2
    first_mask, second_mask = (torch.rand(3, 5) > 0.3).long(), (torch.rand(2, 3) > 0.3).long()
    first_samp[0, 1] = float("nan")  # a token the sampler could not score is left out, as TRL leaves it out
    pad = torch.zeros(2, 2)
    both = [torch.cat([first_old, torch.cat([second_old, pad], 1)]),
            torch.cat([first_samp, torch.cat([second_samp, pad], 1)]),
            torch.cat([first_mask, torch.cat([second_mask, pad.long()], 1)])]
    empty = [torch.zeros(1, 4), torch.zeros(1, 4), torch.zeros(1, 4, dtype=torch.long)]
    batches = [(first_old, first_samp, first_mask), (second_old, second_samp, second_mask), empty]
    for mode, cap in [("token_truncate", 1.5), ("sequence_mask", 2.0)]:
        rows = [rollout.mismatch_totals(*batch, mode, cap) for batch in batches]
        combined = rollout.mismatch_from_totals(torch.stack(rows))
        expected = rollout.mismatch_metrics(*both, mode, cap)
        # the weights TRL reports: each valid token's in token modes, each row's in sequence modes (the row of the
        # process without a valid token too)
        weights = []
        for old, samp, mask in batches:
            w = rollout.is_weights(old, samp, mask, mode, cap)[0]
            weights.append(w.flatten() if mode.startswith("sequence") else w[mask.bool() & ~torch.isnan(samp)])
        weights = torch.cat(weights)
        expected.update({"sampling/importance_sampling_ratio/min": float(weights.min()),
                         "sampling/importance_sampling_ratio/mean": float(weights.mean()),
                         "sampling/importance_sampling_ratio/max": float(weights.max())})
        assert set(combined) == set(expected) and len(combined) == 8, mode
        for key, value in expected.items():
            assert combined[key] == pytest.approx(value, rel=1e-5), (mode, key)
        assert rollout.mismatch_from_totals(rows[2][None]) == {"rollout/kl": 0.0, "rollout/clipped_frac": 0.0,
                                                               "rollout/logp_diff_abs": 0.0}


# ----------------------------------------------------------------------------------------------- GRPO steps


def one_step(tmp_path, overrides: list[str]):
    """One GRPO step: (trainer, the batches compute_loss saw, losses, whether parameters moved)."""
    return train_briefly(compose_cfg([*FAST, *overrides], tmp_path))


@pytest.mark.parametrize("path", ["trl", "engine"])
def test_one_grpo_step_through_each_rollout_path(tmp_path, path):
    trainer, seen, losses, moved = one_step(tmp_path, [f"speed.generation={path}"])
    assert losses and all(math.isfinite(x) for x in losses), losses
    assert moved, "no parameter changed: the step did not update the policy"
    assert (trainer.rollout_engine is not None) == (path == "engine")
    row = trainer.state.log_history[0]
    if path == "engine":
        assert trainer.rollout_engine.dtype == rollout.native_dtype()
        assert "sampling_per_token_logps" in seen[0]
        # the mismatch is logged either way: from TRL's scoring forward, or measured on the training forward
        corrected = trainer.speed_plan.old_logps == "policy"
        assert ("importance_sampling_ratio" in seen[0]) == corrected
        keys = ("rollout/kl", "rollout/clipped_frac", "sampling/importance_sampling_ratio/mean") if corrected else (
            "rollout/kl", "rollout/logp_diff_abs")
        for key in keys:
            assert math.isfinite(row[key]), key
        assert row["rollout/kl"] >= 0
    else:
        assert "sampling_per_token_logps" not in seen[0] and "rollout/kl" not in row


@pytest.mark.parametrize("mode", speed.IS_MODES)
def test_trls_weights_in_the_loss_equal_the_hand_computation(tmp_path, mode):
    """The weights TRL multiplies into the loss, from the sampler's own log-probs (a bf16 copy, so they
    differ from the trained fp32 policy's), equal the hand computation. The tiny model's mismatch is small, so
    the cap is 1: every ratio above 1 is truncated or masked."""
    cap = 1.0
    trainer, seen, losses, _ = one_step(tmp_path, ["speed.generation=engine", "speed.rollout_dtype=bf16",
                                                   "train.precision=fp32", f"speed.is_mode={mode}",
                                                   f"speed.is_cap={cap}"])
    inputs = seen[0]
    old, samp, mask = inputs["old_per_token_logps"], inputs["sampling_per_token_logps"], inputs["completion_mask"]
    assert not torch.equal(old * mask, samp * mask)  # bf16 sampler, fp32 policy: there is a mismatch to correct
    expect_w, expect_c = by_hand(old, samp, mask, mode, cap)
    assert expect_c.any() and not expect_c[mask.bool()].all()  # the cap changed some weights, not all
    torch.testing.assert_close(inputs["importance_sampling_ratio"], expect_w, atol=1e-6, rtol=1e-5)
    row = trainer.state.log_history[0]
    assert row["rollout/clipped_frac"] == pytest.approx(float(expect_c.sum() / mask.sum()), abs=1e-6)
    assert math.isfinite(losses[0])


def test_correction_off_leaves_trls_loss_unweighted(tmp_path):
    trainer, seen, losses, moved = one_step(tmp_path, ["speed.generation=engine", "speed.is_correction=false"])
    assert not trainer.use_vllm and "importance_sampling_ratio" not in seen[0]
    assert "sampling_per_token_logps" in seen[0] and moved and math.isfinite(losses[0])


EXACT_COPY = ["speed.generation=engine", "speed.rollout_dtype=fp32", "train.precision=fp32", "train.max_steps=2",
              "train.steps_per_generation=2"]  # two steps per round: TRL needs old log-probs for the second


@pytest.mark.parametrize("sampling", [[], ["train.top_k=5", "train.top_p=0.9"]], ids=["unfiltered", "top_k_p"])
def test_an_exact_copys_log_probs_stand_in_for_trls_scoring_forward(tmp_path, sampling):
    """fp32 copy, fp32 policy: rollout_old_logps=auto takes the sampler's log-probs as PPO's old ones, and they
    are what TRL's scoring forward computes (the same round, drawn under the same seed, scored by the policy):
    the policy's tempered log-probs, not the renormalised ones top-k/top-p sampled from."""
    trainer, seen, losses, moved = one_step(tmp_path / "sampler", [*EXACT_COPY, *sampling])
    assert trainer.rollout_engine.keep_logps and not trainer.use_vllm
    first = seen[0]
    mask = first["completion_mask"].bool()
    assert "importance_sampling_ratio" not in first
    # the mismatch, measured on the training forward of the round's first step: none beyond kernel rounding
    assert 0 <= trainer.state.log_history[0]["rollout/kl"] < 1e-6
    if not sampling:  # unfiltered: the sampling log-probs themselves
        assert torch.equal(first["old_per_token_logps"][mask], first["sampling_per_token_logps"][mask])
    else:  # the filters removed mass: sampling log-probs are higher than the policy's
        assert (first["sampling_per_token_logps"][mask] > first["old_per_token_logps"][mask] + 1e-3).any()
    assert trainer.rollout_engine.pending_logps is None  # taken by the scoring it replaced
    assert len(losses) == 2 and all(math.isfinite(x) for x in losses) and moved

    scored, seen_p, losses_p, _ = one_step(tmp_path / "policy",
                                           [*EXACT_COPY, *sampling, "speed.old_logps=policy"])
    assert not scored.rollout_engine.keep_logps and scored.use_vllm  # the forward, and TRL's correction
    assert torch.equal(seen_p[0]["completion_ids"], first["completion_ids"])
    torch.testing.assert_close(seen_p[0]["old_per_token_logps"][mask], first["old_per_token_logps"][mask],
                               atol=1e-4, rtol=1e-4)
    if not sampling:  # (with filters TRL's correction weighs the policy run's loss by the kept mass)
        assert losses_p == pytest.approx(losses, rel=1e-3, abs=1e-5)


@pytest.mark.parametrize("choice,dtype,precision,expected", [
    ("auto", "fp32", "fp32", "sampler"), ("auto", "bf16", "fp32", "policy"), ("auto", "fp32", "bf16", "policy"),
    ("auto", "autocast", "bf16", "sampler"), ("auto", "auto", "bf16", "policy"), ("auto", "bf16", "bf16", "policy"),
    ("auto", "autocast", "fp32", "policy"), ("policy", "fp32", "fp32", "policy"),
    ("sampler", "bf16", "bf16", "sampler")])
def test_old_log_probs_come_from_the_sampler_only_where_the_copy_is_exact(choice, dtype, precision, expected):
    assert speed.old_logps_source(choice, speed.copy_kind(dtype, precision), precision) == expected


@pytest.mark.parametrize("native,expected", [("bf16", "bf16"), ("fp32", "fp32")])
def test_auto_copies_the_policy_in_the_machines_native_dtype(native, expected):
    assert speed.copy_kind("auto", native) == expected
    assert all(speed.copy_kind(kind, native) == kind for kind in ("autocast", "bf16", "fp32"))


AUTOCAST_COPY = ["speed.generation=engine", "speed.rollout_dtype=autocast", "train.precision=bf16", "train.max_steps=2",
                 "train.steps_per_generation=2"]


def test_the_autocast_copys_log_probs_stand_in_for_trls_scoring_forward_under_bf16_training(tmp_path):
    """Under bf16 autocast training the autocast copy's log-probs are PPO's old ones (no scoring forward, no
    importance weights), the mismatch is measured on the round's first training forward, and the same round
    scored by the policy gives the same old log-probs up to bf16 rounding."""
    trainer, seen, losses, moved = one_step(tmp_path / "sampler", AUTOCAST_COPY)
    engine = trainer.rollout_engine
    assert engine.autocast and engine.keep_logps and not trainer.use_vllm
    first = seen[0]
    mask = first["completion_mask"].bool()
    assert "importance_sampling_ratio" not in first
    assert torch.equal(first["old_per_token_logps"][mask], first["sampling_per_token_logps"][mask])
    kl = trainer.state.log_history[0]["rollout/kl"]
    assert 0 <= kl < 1e-3 and len(losses) == 2 and all(math.isfinite(x) for x in losses) and moved

    scored, seen_p, _, _ = one_step(tmp_path / "policy", [*AUTOCAST_COPY, "speed.old_logps=policy"])
    assert scored.use_vllm and "importance_sampling_ratio" in seen_p[0]
    assert torch.equal(seen_p[0]["completion_ids"], first["completion_ids"])
    torch.testing.assert_close(seen_p[0]["old_per_token_logps"][mask], first["old_per_token_logps"][mask],
                               atol=0.05, rtol=0)


def test_a_bf16_copy_keeps_trls_scoring_and_correction(tmp_path):
    trainer, seen, _, _ = one_step(tmp_path, ["speed.generation=engine", "speed.rollout_dtype=bf16",
                                              "train.precision=fp32"])
    assert not trainer.rollout_engine.keep_logps and "importance_sampling_ratio" in seen[0]


def test_engine_refreshes_after_each_optimizer_step(tmp_path):
    trainer, _, _, _ = one_step(tmp_path, ["speed.generation=engine", "train.max_steps=2"])
    engine = trainer.rollout_engine
    assert engine.synced_step == 1  # the second step's generation saw the first step's weights
    assert engine.released  # given back after its last round, through TRL's hook
    engine.sync(trainer)  # after step 2: refreshed to the final weights
    policy = dict(trainer.model.named_parameters(remove_duplicate=False))
    for name, param in engine.model.named_parameters():
        torch.testing.assert_close(param, policy[name].detach().to(param.dtype))


def test_what_the_engine_cannot_serve_falls_back_to_trl(tmp_path, caplog):
    with caplog.at_level("WARNING", logger="grpo_exp"):
        trainer, _, losses, _ = one_step(tmp_path, ["speed.generation=engine", "train.repetition_penalty=1.1"])
    assert trainer.rollout_engine is None and trainer.rollout_func is None
    assert "speed.generation: the rollout engine is not used for repetition_penalty=1.1" in caplog.text
    assert trainer.speed_plan.generation == "trl"  # what ran, as speed_plan.json records it
    assert math.isfinite(losses[0])


def test_a_grpo_step_with_rollout_auto_samples_through_what_auto_resolves_to(tmp_path):
    """On this machine: the engine on a CPU (TRL's correction on for a bf16 copy, off for an exact fp32 one),
    TRL's vLLM on CUDA where vllm is installed (corrected too), else TRL's `generate`."""
    trainer, seen, losses, moved = one_step(tmp_path, ["speed.generation=auto"])
    engine_expected = not torch.cuda.is_available()
    assert (trainer.rollout_engine is not None) == engine_expected == (trainer.speed_plan.generation == "engine")
    vllm = trainer.speed_plan.generation == "vllm"
    assert vllm == (torch.cuda.is_available() and speed.vllm_installed()) == bool(trainer.args.use_vllm)
    corrected = (engine_expected and trainer.speed_plan.old_logps == "policy") or vllm
    assert ("importance_sampling_ratio" in seen[0]) == corrected
    assert losses and math.isfinite(losses[0]) and moved


@pytest.mark.parametrize("override,message", [
    ("speed.generation=sglang", "speed.generation='sglang' is not valid; choose one of: auto, trl, engine, vllm"),
    ("speed.is_mode=token", "speed.is_mode='token' is not valid"),
    ("speed.is_cap=0.5", "speed.is_cap=0.5 must be"),
    ("speed.rollout_compile=maybe", "speed.rollout_compile='maybe' is not valid"),
    ("speed.old_logps=vllm", "speed.old_logps='vllm' is not valid; choose one of: auto, policy, sampler"),
    ("speed.generation=engine,train.loss_type=vespo,speed.is_mode=sequence_mask",
     "train.loss_type=vespo needs a token-level speed.is_mode"),
    # auto is held to the engine's rules on every machine, so a config valid on one machine is valid on all
    ("speed.generation=auto,train.loss_type=vespo,speed.is_mode=sequence_truncate",
     "train.loss_type=vespo needs a token-level speed.is_mode"),
])
def test_bad_rollout_settings_fail_with_one_line(tmp_path, override, message):
    cfg = compose_cfg([*FAST, *override.split(",")], tmp_path)
    with pytest.raises(ConfigError, match=message.replace("(", r"\(")):
        validate(cfg)


@pytest.mark.parametrize("avx2,compiler", [(True, True), (False, True), (True, False)])
def test_an_fp32_copy_is_packed_only_where_the_fp32_kernel_applies(monkeypatch, avx2, compiler):
    """An fp32 copy's layers are swapped only for small_rows' fp32 kernel (torch's kernels AVX2's, a C++ compiler to
    build it): the plan packs them there and nowhere else."""
    monkeypatch.setattr(small_rows, "F32_AVX2", avx2)
    monkeypatch.setattr(cpu, "compiler_missing", lambda: None if compiler else "no C++ compiler")
    train = type("T", (), {"precision": "fp32", "gradient_checkpointing": False})()
    assert speed.resolve(speed.SpeedConfig(rollout_dtype="fp32"), train, device="cpu").rollout_prepack == (
        avx2 and compiler)


# ------------------------------------------------------------------------------ scoring the round batch by batch

BF16_COPY = ["speed.generation=engine", "speed.rollout_dtype=bf16", "train.precision=fp32", "train.max_steps=2",
             "train.steps_per_generation=2"]  # two steps per round: the second trains a moved policy


def scored_round(tmp_path, scoring: str, extra=()):
    """One round of two steps: (trainer, the round's batches after training, the rows of each no-grad scoring)."""
    scorings = []
    cfg = compose_cfg([*FAST, *BF16_COPY, *extra], tmp_path)
    from grpo_exp.training import scoring as scoring_module

    original = scoring_module.forward  # the forward itself (a deferred scoring runs none)

    def counting(trainer, trl_forward, model, input_ids, *a, **kw):
        if not torch.is_grad_enabled() and model is trainer.model:  # the policy's, not the reference model's
            scorings.append(input_ids.size(0))
        return original(trainer, trl_forward, model, input_ids, *a, **kw)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(scoring_module, "forward", counting)
        trainer, seen, losses, moved = train_briefly(cfg, scoring=scoring)
    assert moved and all(math.isfinite(x) for x in losses)
    return trainer, trainer._buffered_inputs, scorings


def test_scoring_by_batch_gives_trls_old_log_probs_and_weights_with_half_the_scoring(tmp_path):
    """Old log-probs by batch (the plan's scoring=batch): the first step's batch takes its old log-probs from its own training forward, the
    second's from a forward before the first update. Same round, same seed as TRL's scoring of the whole round:
    the same old log-probs (to float rounding: other batch shapes), the weights TRL's rule gives for them, and
    one scoring forward over half the rows instead of all."""
    _, by_round, round_scorings = scored_round(tmp_path / "round", "round")
    trainer, by_batch, batch_scorings = scored_round(tmp_path / "batch", "batch")
    rows = sum(b["completion_ids"].size(0) for b in by_batch)
    assert round_scorings == [rows] and batch_scorings == [rows // 2]
    for batch, reference in zip(by_batch, by_round):
        assert torch.equal(batch["completion_ids"], reference["completion_ids"])  # the same round, the same order
        mask = batch["completion_mask"]
        old, samp = batch["old_per_token_logps"], batch["sampling_per_token_logps"]
        torch.testing.assert_close(old * mask, reference["old_per_token_logps"] * mask, atol=1e-5, rtol=1e-5)
        assert not torch.equal(old * mask, samp * mask)  # a bf16 sampler: there is a mismatch to weigh
        expect, _ = by_hand(old, samp, mask, "token_truncate", 3.0)
        torch.testing.assert_close(batch["importance_sampling_ratio"], expect, atol=1e-6, rtol=1e-5)
    row = next(r for r in trainer.state.log_history if "loss" in r)
    for key in ("rollout/kl", "rollout/clipped_frac", "sampling/importance_sampling_ratio/mean"):
        assert math.isfinite(row[key]), key


def test_with_accumulation_over_the_round_no_batch_is_scored_before_training(tmp_path):
    """Both batches of a round go into one optimizer step: each one's training forward scores it."""
    trainer, batches, scorings = scored_round(tmp_path, "batch", ["train.gradient_accumulation_steps=2",
                                                                  "train.max_steps=1"])
    assert scorings == []
    assert all("importance_sampling_ratio" in b and "old_per_token_logps" in b for b in batches)


def test_rounds_that_do_not_line_up_with_optimizer_steps_are_scored_whole(tmp_path):
    """3 batches a round, 2 per optimizer step: which batches meet the sampling policy varies from round to
    round, so TRL's scoring of the whole round is kept."""
    cfg = compose_cfg([*FAST, *BF16_COPY, "train.steps_per_generation=3",
                       "train.gradient_accumulation_steps=2", "train.max_steps=1"], tmp_path)
    trainer, seen, losses, moved = train_briefly(cfg)
    assert not trainer.old_logps.by_batch and moved
    assert all("importance_sampling_ratio" in b for b in seen)
