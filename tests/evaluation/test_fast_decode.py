"""The engine path of greedy evaluation (evaluation/fast_decode.py): the same completions whatever the batch size,
compiled or eager; eval.decode and the fallback to generate; stops, the model handed back, weights followed, memory
given back."""

from __future__ import annotations

import copy
import gc
import logging
import re

import pytest
import torch

from grpo_exp.base import stop
from grpo_exp.base.errors import ConfigError
from grpo_exp.config.checks import validate
from grpo_exp.core.quantization import dynamic_int8
from grpo_exp.evaluation import fast_decode
from grpo_exp.evaluation.generate import decode_path, evaluate, generate_completions
from tests.conftest import compose_cfg
from tests.training.test_rollout import sliding_model

QUESTIONS = ["What is 7 + 5?", "Add 13 and 29.", "What is 9 - 4?", "Multiply 8 by 34.", "What is 40 / 8?",
             "Subtract 17 from 60.", "What is 6 * 7?", "A box holds 6 pears. How many pears are in 5 boxes?"]


def _prompts(n: int = len(QUESTIONS)) -> list[list[dict]]:
    return [[{"role": "system", "content": "Solve the problem."}, {"role": "user", "content": q}]
            for q in QUESTIONS[:n]]


@pytest.fixture
def model(tiny_model):
    """A copy of the shared tiny model (a decoder attaches to it; tests change its weights). Its decoder runs eager,
    as any model's under _COMPILE_MIN_PARAMETERS; the compiled step's own test is marked slow."""
    model, tokenizer = copy.deepcopy(tiny_model)
    assert not fast_decode.decoder_for(model).compiled
    return model, tokenizer


def _complete(model, tokenizer, batch_size: int, decode: str = "engine", n: int = len(QUESTIONS), tokens: int = 12):
    texts, lengths, _, positions = generate_completions(model, tokenizer, _prompts(n), max_new_tokens=tokens,
                                                        batch_size=batch_size, decode=decode)
    return texts, lengths, positions


def _token_prompts(n: int = 7, seed: int = 0) -> list[list[int]]:
    """Prompts of random token ids, 6-14 tokens, sharing their first three (the tiny random model answers the chat
    prompts above with blank lines, which would hide a wrong token)."""
    g = torch.Generator().manual_seed(seed)
    return [[1, 2, 3] + torch.randint(5, 200, (int(k),), generator=g).tolist()
            for k in torch.randint(3, 12, (n,), generator=g)]


def _cut(rows: list[list[int]], ends: list[int]) -> list[list[int]]:
    return [r[:next((i + 1 for i, t in enumerate(r) if t in ends), len(r))] for r in rows]


def _decoded(decoder, prompts, rows: int, ends: list[int], tokens: int = 16) -> list[list[int]]:
    out = [None] * len(prompts)
    for held, new, _ in decoder.batches(prompts, rows=rows, max_new_tokens=tokens, eos_token_ids=ends, pad_token_id=0):
        for i, row in zip(held, new.tolist()):
            out[i] = row
    return _cut(out, ends)


def _generated(model, prompts, ends: list[int], tokens: int = 16) -> list[list[int]]:
    """HF generate's greedy tokens for the same prompts, left-padded in one batch."""
    width = max(map(len, prompts))
    ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    with torch.no_grad():
        out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=tokens, do_sample=False,
                             temperature=None, top_p=None, top_k=None, pad_token_id=0, eos_token_id=ends)
    return _cut(out[:, width:].tolist(), ends)


def _ends(model, prompts) -> list[list[int]]:
    """End tokens to try: none that occurs, and the three commonest tokens of the completions (rows then finish
    at different steps and are dropped from the decoding batch)."""
    free = _generated(model, prompts, [], tokens=16)
    return [[49151], torch.tensor(free).flatten().bincount().topk(3).indices.tolist()]


def test_engine_tokens_do_not_depend_on_the_batch_size_and_are_generate_s(model):
    """Greedy tokens of prompts of different lengths, at 1 (decoded beside a copy), 3 and 7 rows, with rows ending
    at different steps: the same at every batch size, and the tokens HF generate decodes (the same positions,
    masks and argmax; float rounding may differ, and the tiny random model's logits are far from ties)."""
    model, _ = model
    prompts = _token_prompts()
    decoder = fast_decode.decoder_for(model)
    for ends in _ends(model, prompts):
        found = {rows: _decoded(decoder, prompts, rows, ends) for rows in (1, 3, 7)}
        assert found[1] == found[3] == found[7], ends
        assert found[7] == _generated(model, prompts, ends), ends
    assert {len(r) for r in found[7]} != {16}  # some rows ended early


def test_a_call_counts_the_work_it_did(model):
    """The decoder's counts of one call (scripts/eval_decode_time.py sets them against the machine's floor): every
    prompt token past the shared prefix prefilled once, one decoding step per new token after the first of each batch,
    and the rows each step held, fewer once finished rows are dropped."""
    model, _ = model
    prompts = _token_prompts()
    decoder = fast_decode.decoder_for(model)
    ends = _ends(model, prompts)[1]
    steps = 0
    for _, new, _ in decoder.batches(prompts, rows=4, max_new_tokens=16, eos_token_ids=ends, pad_token_id=0):
        steps += new.shape[1] - 1  # the first token comes from the prefill's logits
    work = decoder.timings
    prefix = fast_decode.shared_prefix_length(prompts)
    assert work["prefill_tokens"] == sum(len(p) - prefix for p in prompts)
    assert work["decode_steps"] == steps
    assert steps * 2 <= work["row_steps"] <= steps * 4  # batches of 4 and 3 rows, never fewer than 2
    assert work["prefill_s"] > 0 and work["decode_s"] > 0


def test_engine_path_scores_as_generate_does_on_the_tiny_model(model):
    engine, generate = _complete(*model, 3, "engine"), _complete(*model, 3, "generate")
    assert engine == generate


def test_the_switch_and_its_check(model, tmp_path):
    model, _ = model
    assert decode_path(model) == decode_path(model, "auto") == decode_path(model, "engine") == "engine"
    assert decode_path(model, "generate") == "generate"
    assert decode_path(model, "auto", do_sample=True) == decode_path(model, "engine", do_sample=True) == "generate"
    with pytest.raises(ValueError, match="auto, engine, generate"):
        decode_path(model, "fast")
    assert compose_cfg([], tmp_path / "a").eval.decode == "auto"
    with pytest.raises(ConfigError, match=r"eval.decode='fast' is not valid; choose one of: auto, engine, generate"):
        validate(compose_cfg(["eval.decode=fast"], tmp_path / "b"))


def test_evaluate_records_the_path_it_took(model):
    examples = [{"question": q, "answer": "1"} for q in QUESTIONS[:2]]
    for decode, path in (("auto", "engine"), ("generate", "generate")):
        metrics, _ = evaluate(*model, examples, system_prompt="Solve it.", max_new_tokens=4, batch_size=2,
                              decode=decode)
        assert metrics["decoded_by"] == path


def test_the_engine_path_batches_as_many_rows_as_its_cache_budget_holds(model, monkeypatch):
    """eval.engine_cache_mb sets the engine path's rows (the KV cache's bytes per row from the model's shape and the
    call's cache length); without it, eval.batch_size's; generate keeps batch_size. The answers are the same."""
    from grpo_exp.evaluation.generate import prompt_messages

    model, tokenizer = model
    examples = [{"question": q, "answer": "1"} for q in QUESTIONS[:5]]
    decoder = fast_decode.decoder_for(model)
    encoded = tokenizer.apply_chat_template([prompt_messages(ex, "Solve it.") for ex in examples],
                                            add_generation_prompt=True, return_dict=True)["input_ids"]
    per_row = decoder.row_bytes(encoded, 6)
    config = model.config
    kv_width = config.num_key_value_heads * (getattr(config, "head_dim", None) or
                                             config.hidden_size // config.num_attention_heads)
    assert per_row == 2 * config.num_hidden_layers * kv_width * 4 * decoder.cache_length(encoded, 6)
    rows_asked, batches = [], decoder.batches

    def recording(prompts, *, rows, **kwargs):
        rows_asked.append(rows)
        return batches(prompts, rows=rows, **kwargs)

    monkeypatch.setattr(decoder, "batches", recording)
    answers = []
    for cache_mb in (None, 2.5 * per_row / 2**20, 1024):
        _, rows = evaluate(model, tokenizer, examples, system_prompt="Solve it.", max_new_tokens=6, batch_size=1,
                           engine_cache_mb=cache_mb)
        answers.append([r["completion"] for r in rows])
    assert rows_asked == [1, 2, 5]  # batch_size's 1; room for 2 rows (5 problems: 2, 2, 1); all 5 in one
    assert answers[0] == answers[1] == answers[2]
    _, rows = evaluate(model, tokenizer, examples, system_prompt="Solve it.", max_new_tokens=6, batch_size=1,
                       engine_cache_mb=1024, decode="generate")
    assert rows_asked == [1, 2, 5] and [r["completion"] for r in rows] == answers[0]


def _peft(model):
    from peft import LoraConfig, get_peft_model

    return get_peft_model(model, LoraConfig(r=2, target_modules=["q_proj"]))


@pytest.mark.parametrize("make,reason", [
    (dynamic_int8, "a quantized model"),
    (lambda m: m.to(torch.bfloat16), "torch.bfloat16 weights"),
    (_peft, "a PEFT model"),
    (lambda m: torch.nn.Linear(2, 2), "not a transformers model"),
])
def test_an_unsupported_model_falls_back_to_generate_with_the_reason_logged_once(model, make, reason, caplog):
    other = make(copy.deepcopy(model[0]))
    assert reason in fast_decode.unsupported_reason(other)
    with caplog.at_level(logging.INFO, logger="grpo_exp.evaluation.generate"):
        assert decode_path(other, "auto") == decode_path(other, "auto") == "generate"
    told = [r for r in caplog.records if reason in r.getMessage()]
    assert len(told) <= 1  # once per process: an earlier test may have logged it already
    with pytest.raises(ValueError, match=f"eval.decode=engine cannot decode this model: .*{re.escape(reason)}"):
        decode_path(other, "engine")


@pytest.mark.parametrize("window", [5, 512], ids=["past_the_window", "within_the_window"])
def test_a_sliding_window_model_decodes_generate_s_greedy_tokens(window):
    """Gemma 3-like layers, half of them sliding: within the window the prompts share their prefix (laid out
    [prefix | padding | own part]); past it each prompt is prefilled whole, left-padded, as generate lays it out
    (the padding would otherwise count in the window). The same tokens as generate, with rows ending at different
    steps."""
    model = sliding_model("gemma3", window)
    assert fast_decode.unsupported_reason(model) is None
    prompts = _token_prompts()
    decoder = fast_decode.GreedyDecoder(model, compile=False)
    assert decoder.window == window
    ends = _ends(model, prompts)[1]
    assert _decoded(decoder, prompts, 3, ends) == _generated(model, prompts, ends)


def _tiny(name: str, **settings):
    import transformers

    config = getattr(transformers, name)(vocab_size=300, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                         num_attention_heads=4, num_key_value_heads=2, head_dim=16, **settings)
    return transformers.AutoModelForCausalLM.from_config(config)


@pytest.mark.parametrize("make,reason", [
    (lambda: _tiny("Llama4TextConfig", attention_chunk_size=8), "a model with chunked_attention cache layers"),
    (lambda: _tiny("Qwen3NextConfig"), "a model with linear_attention cache layers"),
    (lambda: _tiny("Gemma3TextConfig", use_bidirectional_attention=True), "a model with bidirectional attention"),
    (lambda: _tiny("GptOssConfig", num_local_experts=2, num_experts_per_tok=1), "a model with attention sinks"),
    (lambda: _tiny("Gemma2Config", final_logit_softcapping=None),
     "a model whose attention caps its scores (attn_logit_softcapping)"),
], ids=["chunked", "linear", "bidirectional", "sinks", "softcapping"])
def test_what_neither_decoder_serves_is_named(make, reason):
    """Hub models the engine path does not serve, past the sliding windows it does: the reason names what it is (the
    rollout engine's and greedy evaluation's alike), and grouped attention leaves a model's own attention where it
    cannot compute it."""
    from grpo_exp.kernels import attention
    from grpo_exp.training import rollout

    model = make()
    assert fast_decode.unsupported_reason(model).startswith(reason)
    assert rollout.model_unsupported_reason(model).startswith(reason)
    if reason.startswith(("a model with attention sinks", "a model whose attention")):
        own = model.config._attn_implementation
        assert attention.use(model, "grouped") is None and model.config._attn_implementation == own


def test_the_quantized_model_is_scored_through_generate(model):
    quantized = dynamic_int8(model[0])
    metrics, _ = evaluate(quantized, model[1], [{"question": "What is 7 + 5?", "answer": "12"}],
                          system_prompt="Solve it.", max_new_tokens=4, batch_size=1)
    assert metrics["decoded_by"] == "generate"


def test_the_model_is_handed_back_as_it_came_and_a_stop_is_polled_every_token(model, monkeypatch):
    model, tokenizer = model
    model.train()
    tokenizer.padding_side = "right"
    decoder = fast_decode.decoder_for(model)
    polls = []
    check = stop.check
    monkeypatch.setattr(stop, "check", lambda where: (polls.append(where), check(where)))
    texts, lengths, positions = _complete(model, tokenizer, 8, tokens=10)
    steps = positions // len(QUESTIONS)
    assert polls.count("evaluation") >= steps >= max(lengths)  # every decoded token, and each batch
    assert model.training and tokenizer.padding_side == "right"
    assert decoder._cache is None and decoder._prefix is None  # the call's KV cache and prefix given back

    step = decoder._call_step
    calls = []

    def stop_after_three(*args):
        calls.append(1)
        if len(calls) == 3:
            stop.request()
        return step(*args)

    monkeypatch.setattr(decoder, "_call_step", stop_after_three)
    with stop.handling():
        with pytest.raises(stop.Stopped, match="during evaluation"):
            _complete(model, tokenizer, 8, tokens=10)
    assert len(calls) == 3  # the next token's poll raised
    assert model.training and tokenizer.padding_side == "right"
    assert decoder._cache is None and decoder._prefix is None


def test_the_decoder_follows_the_model_s_weights(model):
    """Updated in place (an optimizer step) or replaced by another tensor: the next evaluation decodes the model's
    current weights, as a decoder built now would."""
    model, _ = model
    prompts, ends = _token_prompts(), [49151]
    decoder = fast_decode.decoder_for(model)
    before = _decoded(decoder, prompts, 7, ends)
    weight = model.model.layers[0].mlp.down_proj.weight
    saved = weight.detach().clone()
    with torch.no_grad():
        weight.mul_(-3.0)  # in place: the copy shares the storage
    moved = _decoded(decoder, prompts, 7, ends)
    assert moved != before
    assert moved == _decoded(fast_decode.GreedyDecoder(model, compile=False), prompts, 7, ends)
    weight.data = saved  # another tensor, holding the old values
    assert _decoded(decoder, prompts, 7, ends) == before


def test_a_decoder_goes_with_its_model(tiny_model):
    """Built on a model's first evaluation, freed with the model (a curriculum loads and drops one per stage)."""
    import weakref

    model, tokenizer = copy.deepcopy(tiny_model)
    _complete(model, tokenizer, 4)
    gone = weakref.ref(fast_decode._DECODERS[model])
    del model
    gc.collect()
    assert gone() is None


def test_a_decoder_goes_with_a_model_accelerate_prepared(tiny_model):
    """The trainer's policy, prepared by accelerate for bf16 autocast, carries a forward wrapper and the method it
    saved, whose closures hold the model: a decoder copy that kept them kept the policy, its decoder and the copy's
    parameters alive for the rest of the process (one model more after every stage of a curriculum)."""
    import weakref

    from accelerate import Accelerator

    model, tokenizer = copy.deepcopy(tiny_model)
    model = Accelerator(mixed_precision="bf16", cpu=True).prepare_model(model)
    assert {"forward", "_original_forward"} <= set(model.__dict__)
    _complete(model, tokenizer, 4)
    gone, decoder = weakref.ref(model), weakref.ref(fast_decode._DECODERS[model])
    assert "_original_forward" not in decoder().model.__dict__
    del model
    gc.collect()
    gc.collect()  # the decoder leaves the weak dictionary as the first pass collects its model
    assert gone() is None and decoder() is None


def test_shared_prefix_length():
    assert fast_decode.shared_prefix_length([[1, 2, 3, 4], [1, 2, 5], [1, 2, 3]]) == 2
    assert fast_decode.shared_prefix_length([[1, 2, 3]]) == 2  # the last token is each prompt's own
    assert fast_decode.shared_prefix_length([[7], [7]]) == 0


@pytest.mark.slow
def test_the_compiled_step_serves_every_batch_size_and_matches_eager(tiny_model):
    """One compiled step (rows and cache length dynamic) for batches of 1 (decoded as 2), 3 and 7 rows and rows
    dropped as they finish; the same tokens as the eager step."""
    from torch._dynamo.utils import counters

    model, _ = copy.deepcopy(tiny_model)
    compiled = fast_decode.GreedyDecoder(model, compile=True)
    if not compiled.compiled:
        pytest.skip("no C++ compiler: the step runs eager")
    eager = fast_decode.GreedyDecoder(model, compile=False)
    prompts = _token_prompts()
    for i, ends in enumerate(_ends(model, prompts)):
        want = _decoded(eager, prompts, 7, ends)
        graphs = counters["stats"]["unique_graphs"]
        for rows in (7, 3, 1):
            assert _decoded(compiled, prompts, rows, ends) == want, (rows, ends)
        if i:
            assert counters["stats"]["unique_graphs"] == graphs  # compiled once, in the first round
    assert compiled.timings["compile_s"] > 0


@pytest.mark.slow
def test_models_of_one_architecture_share_one_compiled_step_each_with_its_own_weights(tiny_model):
    """The trained model and the one it started from (a curriculum's every stage) decode through the step compiled
    for the first: no second compilation, yet each decoder's tokens are its own model's (the weights are read from
    the decoder at every call, not kept from the first), and a model dropped goes with its decoder."""
    import weakref

    from torch._dynamo.utils import counters

    first, _ = copy.deepcopy(tiny_model)
    second, _ = copy.deepcopy(tiny_model)
    with torch.no_grad():
        for p in second.parameters():
            p.add_(torch.randn(p.shape, generator=torch.Generator().manual_seed(p.numel())) * 0.05)
    prompts, ends = _token_prompts(), [10_000]  # no end token: every row decodes all its tokens
    one = fast_decode.GreedyDecoder(first, compile=True)
    if not one.compiled:
        pytest.skip("no C++ compiler: the step runs eager")
    two = fast_decode.GreedyDecoder(second, compile=True)
    assert two._shared is one._shared
    want_first = _decoded(fast_decode.GreedyDecoder(first, compile=False), prompts, 7, ends)
    want_second = _decoded(fast_decode.GreedyDecoder(second, compile=False), prompts, 7, ends)
    assert want_first != want_second  # the test would not see the first model's weights used for the second
    assert _decoded(one, prompts, 7, ends) == want_first
    graphs = counters["stats"]["unique_graphs"]
    assert _decoded(two, prompts, 7, ends) == want_second
    assert counters["stats"]["unique_graphs"] == graphs and "compile_s" not in two.timings
    assert _decoded(one, prompts, 3, ends) == want_first  # and the first model's own again
    gone = weakref.ref(first)
    del first, one
    gc.collect()
    assert gone() is None


def test_the_architecture_key_tells_apart_what_a_compiled_step_is_specialised_to(tiny_model):
    """Equal for two models that differ in weights only; different for another width, dtype or configuration."""
    model, _ = copy.deepcopy(tiny_model)
    other, _ = copy.deepcopy(tiny_model)
    with torch.no_grad():
        next(other.parameters()).add_(1.0)
    assert fast_decode.architecture_key(model) == fast_decode.architecture_key(other)
    assert fast_decode.architecture_key(model) != fast_decode.architecture_key(copy.deepcopy(model).to(torch.float64))
    changed = copy.deepcopy(model)
    changed.config.rms_norm_eps = 1e-3  # not in any parameter's shape, still in the compiled step
    assert fast_decode.architecture_key(model) != fast_decode.architecture_key(changed)
