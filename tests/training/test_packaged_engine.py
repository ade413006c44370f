"""Every packaged model (the conf/model options with source packaged_gguf: SmolLM2-135M, and Gemma 3 270M, whose
sliding-window layers the engine path serves) through the rollout engine and greedy evaluation's engine path: neither
refuses it; an fp32 rollout copy draws the tokens `generate` draws under the same seed, with the log-probs TRL's
scoring forward (its fused LM head) gives them; greedy evaluation answers as `generate` does. A few prompts and
tokens: the models are real (Gemma 3's vocabulary is 262144 words), so these are marked slow. A model whose package
is not installed is skipped with the reason. Past a sliding window: tests/training/test_rollout.py and
tests/evaluation/test_fast_decode.py, on tiny random models whose window is 5 positions."""

from __future__ import annotations

import importlib.util
import logging

import pytest
import torch
from omegaconf import OmegaConf

from grpo_exp.evaluation import fast_decode
from grpo_exp.evaluation.generate import generate_completions
from grpo_exp.training import rollout
from tests.conftest import CONF_DIR, compose_cfg

QUESTIONS = ["What is 7 + 5?", "Tom has 12 apples and eats 3 of them. How many are left?"]
TEMPERATURE = 1.0


def _packaged() -> list:
    """One parameter per packaged model option, skipped where its package is missing."""
    params = []
    for path in sorted((CONF_DIR / "model").glob("*.yaml")):
        option = OmegaConf.load(path)
        if option.get("source") != "packaged_gguf":
            continue
        missing = importlib.util.find_spec(option.package) is None
        params.append(pytest.param(path.stem, id=path.stem, marks=pytest.mark.skipif(
            missing, reason=f"the package {option.package} of model={path.stem} is not installed (make setup)")))
    return params


pytestmark = pytest.mark.slow


@pytest.fixture(scope="module", params=_packaged())
def packaged(request, tmp_path_factory):
    """(option, model, tokenizer, chat-templated QUESTIONS): one packaged model at a time, loaded once for the
    module (converted from its GGUF on a machine's first use)."""
    from grpo_exp.core import models

    cfg = compose_cfg([f"model={request.param}"], tmp_path_factory.mktemp(request.param))
    model, tokenizer = models.load(cfg.model, cfg.paths.cache_dir)
    model.eval()
    rows = [tokenizer.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True,
                                          tokenize=True, return_dict=False) for q in QUESTIONS]
    return request.param, model, tokenizer, rows


def _left_padded(rows, completions, pad: int):
    """Left-padded prompts followed by right-padded completions, as TRL lays out its scoring forward."""
    width, longest = max(map(len, rows)), max(map(len, completions))
    ids = torch.tensor([[pad] * (width - len(r)) + r + c + [pad] * (longest - len(c))
                        for r, c in zip(rows, completions)])
    mask = torch.tensor([[0] * (width - len(r)) + [1] * (len(r) + len(c)) + [0] * (longest - len(c))
                         for r, c in zip(rows, completions)])
    return ids, mask, longest


def trl_scoring(model, rows, completions, pad: int) -> torch.Tensor:
    """TRL's scoring forward (GRPOTrainer._get_per_token_logps_and_entropies): the model with TRL's fused LM head
    at the sampling temperature, labels on the completion positions; [rows, longest completion]."""
    from trl.trainer.utils import add_fused_lm_head

    ids, mask, longest = _left_padded(rows, completions, pad)
    labels = ids.masked_fill(mask == 0, -100)
    labels[:, :-longest] = -100
    add_fused_lm_head(model, temperature=TEMPERATURE)
    try:
        with torch.no_grad():
            return model(input_ids=ids, attention_mask=mask, labels=labels, fused_lm_head=True).log_probs[:, -longest:]
    finally:
        del model.forward  # the patch is an attribute of the instance: the class's forward again


def test_the_engine_samples_what_generate_samples_with_trls_log_probs(packaged):
    name, model, tokenizer, prompts = packaged
    assert rollout.model_unsupported_reason(model) is None, name
    rows = [p for p in prompts for _ in range(2)]  # GRPO groups: each prompt twice
    eos, pad = [tokenizer.eos_token_id], tokenizer.pad_token_id
    engine = rollout.RolloutEngine(model, dtype=torch.float32, compile=False, max_new_tokens=6,
                                   temperature=TEMPERATURE, eos_token_ids=eos, pad_token_id=pad,
                                   sampler="multinomial")
    torch.manual_seed(3)
    ours, logps = engine.generate(rows)

    ids, mask, _ = _left_padded(rows, [[]] * len(rows), pad)
    torch.manual_seed(3)
    with torch.no_grad():
        out = model.generate(input_ids=ids, attention_mask=mask, do_sample=True, max_new_tokens=6,
                             temperature=TEMPERATURE, top_k=0, top_p=1.0, pad_token_id=pad, eos_token_id=eos)
    theirs = [r[:next((i + 1 for i, t in enumerate(r) if t in eos), len(r))] for r in out[:, ids.shape[1]:].tolist()]
    assert ours == theirs

    scored = trl_scoring(model, rows, ours, pad)
    for i, (completion, sampled) in enumerate(zip(ours, logps)):
        torch.testing.assert_close(torch.tensor(sampled), scored[i, :len(completion)].float(), atol=1e-4, rtol=1e-4)


def test_greedy_evaluation_takes_the_engine_path_and_answers_as_generate(packaged, monkeypatch, caplog):
    """The engine path's answers (its step eager here: compiling it for a model this size takes a minute) are
    generate's, token for token."""
    name, model, tokenizer, _ = packaged
    assert fast_decode.unsupported_reason(model) is None, name
    monkeypatch.setattr(fast_decode, "_COMPILE_MIN_PARAMETERS", float("inf"))
    monkeypatch.setattr(fast_decode, "_DECODERS", fast_decode.weakref.WeakKeyDictionary())
    chats = [[{"role": "user", "content": q}] for q in QUESTIONS]
    with caplog.at_level(logging.DEBUG, logger="grpo_exp.evaluation.fast_decode"):
        engine = generate_completions(model, tokenizer, chats, max_new_tokens=8, batch_size=2, decode="engine")
    assert "evaluation decoder: decoding step runs eager (compile=False)" in caplog.text
    generate = generate_completions(model, tokenizer, chats, max_new_tokens=8, batch_size=2, decode="generate")
    assert engine[:2] == generate[:2]
