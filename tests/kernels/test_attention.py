"""grpo_exp.kernels.attention: the grouped attention computes what transformers' eager attention computes, in
the forward and the backward, with padding; the trainer puts the chosen attention on the policy."""

from __future__ import annotations

import copy
import math

import pytest
import torch

from grpo_exp.base.errors import ConfigError
from grpo_exp.config.checks import validate
from grpo_exp.kernels import attention
from grpo_exp.training import rollout
from tests.conftest import compose_cfg
from tests.training.briefly import train_briefly
from tests.training.test_shared_prefix import tiny  # noqa: F401 (fixture)
from tests.training.test_shared_prefix import (PROMPTS, bf16_comparison, grpo_batch, needs_native_bf16, trl_forward,
                                               without_first_prompt_token)


def _left_padded(model, seed: int, width: int, pads: tuple[int, ...]):
    """Random token ids [len(pads), width] and their mask, row i left-padded by pads[i] positions, as TRL pads."""
    torch.manual_seed(seed)
    ids = torch.randint(5, model.config.vocab_size, (len(pads), width))
    mask = torch.ones_like(ids)
    for row, pad in enumerate(pads):
        mask[row, :pad] = 0
    return ids, mask


def _loss_and_grads(model, ids, mask):
    model.zero_grad(set_to_none=True)
    logits = model(input_ids=ids, attention_mask=mask).logits
    # only real positions count: padded rows' outputs are whatever the mask leaves there
    loss = (logits.log_softmax(-1).amax(-1) * mask).sum()
    loss.backward()
    return logits.detach() * mask[..., None], {n: p.grad.clone() for n, p in model.named_parameters()}


def test_grouped_attention_equals_eager_in_forward_and_backward(tiny_model):
    model, _ = copy.deepcopy(tiny_model)
    assert model.config.num_key_value_heads < model.config.num_attention_heads  # the grouping is exercised
    ids, mask = _left_padded(model, seed=0, width=11, pads=(0, 4, 7))
    model.set_attn_implementation("eager")
    eager_logits, eager_grads = _loss_and_grads(model, ids, mask)
    assert attention.use(model, "grouped") == attention.GROUPED
    assert model.config._attn_implementation == attention.GROUPED
    grouped_logits, grouped_grads = _loss_and_grads(model, ids, mask)
    torch.testing.assert_close(grouped_logits, eager_logits, rtol=1e-5, atol=1e-5)
    for name, grad in eager_grads.items():
        torch.testing.assert_close(grouped_grads[name], grad, rtol=1e-4, atol=1e-6, msg=name)


@needs_native_bf16
def test_grouped_attention_under_bf16_autocast_matches_sdpa_in_trls_forward_and_two_steps(tiny):
    """TRL's scoring forward with grouped attention against the same with sdpa (the attention TRL runs), both under
    bf16 autocast as training on this CPU: log-probs, entropies, gradients, the losses of two AdamW steps, within
    bf16_tolerances (tests/training/test_shared_prefix.py), where a key the mask should let through is not."""
    model, tokenizer = tiny
    ids, mask = grpo_batch(tokenizer, PROMPTS, repeats=3, completion_len=10)
    keep = 10

    def trls(choice, scored_mask=mask):
        def run():
            attention.use(model, choice)
            return trl_forward(model, ids, scored_mask, keep)
        return run

    tolerances, errors, wrong = bf16_comparison(model, ids, mask, keep, trls("sdpa"), trls("grouped"),
                                                trls("grouped", without_first_prompt_token(mask, keep)))
    assert all(errors[k] <= tolerances[k] for k in tolerances), (errors, tolerances)
    # the tolerances catch a real bug (entropies aside: see the shared-prefix test)
    assert all(wrong[k] > tolerances[k] for k in ("logps", "grads", "losses")), (wrong, tolerances)


def test_greedy_generation_is_the_same_with_grouped_attention(tiny_model):
    """generate's path (a growing cache, left padding, one query per step) picks the same tokens."""
    model, tokenizer = copy.deepcopy(tiny_model)
    ids, mask = _left_padded(model, seed=1, width=9, pads=(0, 3, 6))
    runs = {}
    for choice in ("eager", "grouped"):
        attention.use(model, choice)
        with torch.no_grad():
            runs[choice] = model.generate(input_ids=ids, attention_mask=mask, do_sample=False, max_new_tokens=12,
                                          pad_token_id=tokenizer.pad_token_id, eos_token_id=None)
    assert torch.equal(runs["grouped"], runs["eager"])


@pytest.mark.parametrize("decode", attention.DECODE_LAYOUTS)
def test_a_decoding_step_through_grouped_attention_equals_eager(tiny_model, decode):
    """One query per row after a padded prefix in the cache: the layout the rollout engine decodes with, in both
    of speed.attention_decode's layouts."""
    from transformers import DynamicCache

    model, _ = copy.deepcopy(tiny_model)
    ids, mask = _left_padded(model, seed=2, width=10, pads=(0, 2, 5))
    step = torch.randint(5, model.config.vocab_size, (3, 1))
    kw = rollout._cache_kwarg(type(model))  # transformers renamed past_key_values in a minor release
    logits = {}
    for choice in ("eager", "grouped"):
        attention.use(model, choice, decode)
        cache = DynamicCache(config=model.config)
        with torch.no_grad():
            model(input_ids=ids, attention_mask=mask, use_cache=True, **{kw: cache})
            full = torch.cat([mask, torch.ones_like(step)], 1)
            logits[choice] = model(input_ids=step, attention_mask=full, use_cache=True, **{kw: cache}).logits
    assert logits["eager"].shape[1] == 1
    torch.testing.assert_close(logits["grouped"], logits["eager"], rtol=1e-5, atol=1e-5)


def test_bad_choices_are_named(tiny_model):
    model, _ = copy.deepcopy(tiny_model)
    with pytest.raises(ValueError, match="unknown attention 'flash'; choose one of sdpa, grouped, eager"):
        attention.use(model, "flash")
    with pytest.raises(ValueError, match="unknown decoding layout 'rows'; choose one of cache_axis, last_axis"):
        attention.use(model, "grouped", "rows")


def test_the_last_axis_layout_is_grouped_attention_itself_beyond_one_query(tiny_model):
    """speed.attention_decode=last_axis changes only one-query steps: a training forward and backward over many
    positions is grouped attention's, bit for bit; its greedy decoding picks eager's tokens."""
    model, tokenizer = copy.deepcopy(tiny_model)
    ids, mask = _left_padded(model, seed=0, width=11, pads=(0, 4, 7))
    assert attention.use(model, "grouped") == attention.GROUPED
    logits, grads = _loss_and_grads(model, ids, mask)
    assert attention.use(model, "grouped", "last_axis") == attention.GROUPED_LAST_AXIS
    last_logits, last_grads = _loss_and_grads(model, ids, mask)
    assert torch.equal(last_logits, logits)
    assert all(torch.equal(last_grads[name], grad) for name, grad in grads.items())
    runs = {}
    for choice, decode in (("eager", "cache_axis"), ("grouped", "last_axis")):
        attention.use(model, choice, decode)
        with torch.no_grad():
            runs[choice] = model.generate(input_ids=ids, attention_mask=mask, do_sample=False, max_new_tokens=12,
                                          pad_token_id=tokenizer.pad_token_id, eos_token_id=None)
    assert torch.equal(runs["grouped"], runs["eager"])


# None: the default (speed.attention=auto), which resolves by machine
ON_THIS_MACHINE = attention.GROUPED if not torch.cuda.is_available() else "sdpa"


@pytest.mark.parametrize("choice,expected", [("grouped", attention.GROUPED), ("sdpa", "sdpa"),
                                             (None, ON_THIS_MACHINE)])
def test_the_trainer_gives_the_policy_the_chosen_attention(tmp_path, test_rewards, choice, expected):
    chosen = [f"speed.attention={choice}"] if choice else []
    cfg = compose_cfg(["debug=smoke", "train.max_steps=1", *chosen, *test_rewards.SPREAD_REWARD], tmp_path)
    assert cfg.speed.attention == (choice or "auto")
    trainer, _, losses, moved = train_briefly(cfg)
    assert trainer.model.config._attn_implementation == expected
    assert math.isfinite(losses[0]) and moved


def test_bad_attention_fails_with_one_line(tmp_path):
    cfg = compose_cfg(["debug=smoke", "speed.attention=flash"], tmp_path)
    with pytest.raises(ConfigError, match="speed.attention='flash' is not valid"):
        validate(cfg)


def test_bad_decoding_layout_fails_with_one_line(tmp_path):
    cfg = compose_cfg(["debug=smoke", "speed.attention_decode=rows"], tmp_path)
    with pytest.raises(ConfigError, match="speed.attention_decode='rows' is not valid; choose one of: cache_axis, "
                                          "last_axis"):
        validate(cfg)
