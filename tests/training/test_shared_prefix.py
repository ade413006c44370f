"""train.shared_prefix: the same log-probs, entropies and gradients as TRL's own scoring forward."""

from __future__ import annotations

import pytest
import torch
from trl.trainer.utils import add_fused_lm_head

from grpo_exp.core import attention, models
from grpo_exp.training import shared_prefix
from tests.conftest import compose_cfg


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    cfg = compose_cfg(["debug=smoke"], tmp_path_factory.mktemp("run"))
    model, tokenizer = models.load(cfg.model, cfg.paths.cache_dir, seed=0)
    add_fused_lm_head(model, temperature=0.7, outputs=("log_probs", "entropy"))  # as GRPOTrainer patches it
    return model, tokenizer


def grpo_batch(tokenizer, prompts: list[str], repeats: int, completion_len: int, seed: int = 0):
    """Left-padded prompts, each `repeats` times in a row, then random completions of different lengths."""
    tokenizer.padding_side = "left"
    enc = tokenizer([p for p in prompts for _ in range(repeats)], return_tensors="pt", padding=True)
    gen = torch.Generator().manual_seed(seed)
    rows = enc.input_ids.size(0)
    completions = torch.randint(0, len(tokenizer), (rows, completion_len), generator=gen)
    lengths = torch.randint(1, completion_len + 1, (rows,), generator=gen)
    completion_mask = (torch.arange(completion_len)[None] < lengths[:, None]).long()
    return torch.cat([enc.input_ids, completions], 1), torch.cat([enc.attention_mask, completion_mask], 1)


def trl_forward(model, ids, mask, keep: int):
    """TRL's own scoring forward (the fused LM head GRPOTrainer patches in): log-probs and entropies of
    the last `keep` tokens."""
    labels = ids.masked_fill(mask == 0, -100)
    labels[:, :-keep] = -100
    out = model(input_ids=ids, attention_mask=mask, labels=labels, fused_lm_head=True)
    return out.log_probs[:, -keep:], out.entropy[:, -keep:]


def score(model, fn):
    model.zero_grad(set_to_none=True)
    logps, entropy = fn()
    logps.sum().backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return logps.detach(), entropy.detach(), grads


@pytest.mark.parametrize("attn,kernel", [("sdpa", "trl"), ("grouped", "trl"), ("sdpa", "autocast")])
def test_matches_trls_forward_values_and_gradients(tiny, attn, kernel):
    model, tokenizer = tiny
    assert attention.use(model, attn)  # train.attention: the policy scores with either
    # prompts of different lengths, so the left padding differs between groups
    ids, mask = grpo_batch(tokenizer, ["What is 7 + 5?", "Tom has 12 apples and eats 3 of them. How many are left?"],
                           repeats=3, completion_len=10)
    keep = 10

    reference = score(model, lambda: trl_forward(model, ids, mask, keep))
    shared = score(model, lambda: shared_prefix.completion_logps(model, ids, mask, keep, 0.7, True, kernel))
    valid = mask[:, -keep:].bool()
    assert reference[0][valid].abs().min() > 0  # real log-probs, not masked zeros
    torch.testing.assert_close(shared[0], reference[0], atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(shared[1], reference[1], atol=1e-4, rtol=1e-4)
    assert set(shared[2]) == set(reference[2])
    for name, grad in reference[2].items():
        torch.testing.assert_close(shared[2][name], grad, atol=1e-5, rtol=1e-3, msg=name)


def test_a_batch_without_repeated_prompts_is_left_to_trl(tiny):
    model, tokenizer = tiny
    ids, mask = grpo_batch(tokenizer, ["What is 1 + 1?", "What is 2 + 2?"], repeats=1, completion_len=4)
    assert shared_prefix.completion_logps(model, ids, mask, 4, 1.0, False) is None


def test_group_rows_finds_each_distinct_prompt():
    prompts = torch.tensor([[0, 5, 6], [0, 5, 6], [7, 8, 9], [0, 5, 6], [7, 8, 9]])
    masks = torch.tensor([[0, 1, 1], [0, 1, 1], [1, 1, 1], [1, 1, 1], [1, 1, 1]])  # row 3: same ids, other mask
    first, inverse = shared_prefix.group_rows(prompts, masks)
    assert sorted(first.tolist()) == [0, 2, 3]
    assert torch.equal(first[inverse], torch.tensor([0, 0, 2, 3, 2]))


def test_checkpointing_is_detected(tiny):
    model, _ = tiny
    assert not shared_prefix.checkpointing(model)
    model.gradient_checkpointing_enable()
    try:
        assert shared_prefix.checkpointing(model)
    finally:
        model.gradient_checkpointing_disable()
    assert not shared_prefix.checkpointing(model)


def test_models_it_cannot_serve_are_named(tiny):
    model, _ = tiny
    assert shared_prefix.unsupported_reason(model) is None
    model.config.final_logit_softcapping = 30.0
    try:
        assert shared_prefix.unsupported_reason(model) == "a model with final_logit_softcapping"
    finally:
        model.config.final_logit_softcapping = None
