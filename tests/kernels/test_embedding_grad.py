"""kernels/embedding_grad.py: a tied embedding whose gradient comes as the rows its tokens touch gives every parameter
the same gradient, bit for bit, as torch's dense embedding backward, through the shared-prefix scoring (two lookups
a forward, left padding, repeated tokens); the weight's gradient stays dense; untied embeddings are left alone."""

from __future__ import annotations

import copy

import torch
import transformers

from grpo_exp.kernels import embedding_grad
from grpo_exp.training import shared_prefix


def _scoring_grads(model, pad: int) -> dict[str, torch.Tensor]:
    """The gradients of a weighted sum of the shared-prefix scoring's log-probs (4 prompts x 4 completions, prompts
    left padded, completions ending in padding, token ids repeating within and across rows)."""
    g = torch.Generator().manual_seed(1)
    prompts = torch.randint(0, 300, (4, 20), generator=g)
    prompts[:, :3] = pad
    prompts[1, :7] = pad
    completions = torch.randint(0, 300, (16, 12), generator=g)
    completions[:, -2:] = pad
    ids = torch.cat([prompts.repeat_interleave(4, 0), completions], 1)
    mask = (ids != pad).long()
    weights = torch.randn(16, 12, generator=g)
    model.zero_grad(set_to_none=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        logps, _ = shared_prefix.completion_logps(model, ids, mask, 12, 1.0, False, "autocast")
    (logps * weights).sum().backward()
    return {name: p.grad for name, p in model.named_parameters()}


def test_the_tied_embeddings_gradients_equal_torchs_bit_for_bit(tiny_model):
    model, tokenizer = copy.deepcopy(tiny_model)
    model.train()
    touched = copy.deepcopy(model)
    assert embedding_grad.install(touched) and isinstance(touched.get_input_embeddings(), embedding_grad.TiedEmbedding)
    expected, got = _scoring_grads(model, tokenizer.pad_token_id), _scoring_grads(touched, tokenizer.pad_token_id)
    for name, grad in expected.items():
        assert torch.equal(got[name], grad), name
    assert got["model.embed_tokens.weight"].layout == torch.strided  # fused AdamW takes it as before


def test_a_copy_looks_up_its_own_weight_and_no_grad_is_the_plain_lookup(tiny_model):
    model, _ = copy.deepcopy(tiny_model)
    embedding_grad.install(model)
    clone = copy.deepcopy(model)
    with torch.no_grad():
        clone.get_input_embeddings().weight.mul_(2)
    ids = torch.tensor([[3, 4, 3]])
    for m in (model, clone):
        embedding = m.get_input_embeddings()
        expected = torch.nn.functional.embedding(ids, embedding.weight.detach(), embedding.padding_idx)
        assert torch.equal(embedding(ids).detach(), expected)
        with torch.no_grad():
            assert torch.equal(embedding(ids), expected)


def test_an_untied_embedding_is_left_alone():
    config = transformers.LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                      num_attention_heads=2, num_key_value_heads=1, tie_word_embeddings=False)
    model = transformers.LlamaForCausalLM(config)
    assert not embedding_grad.install(model)
    assert type(model.get_input_embeddings()) is torch.nn.Embedding


def test_the_lookups_backward_sums_as_torchs_and_skips_the_padding_row():
    """The backward alone, against torch's dense one: repeated ids over a wide range of magnitudes (the order of each
    row's sum shows) and padding ids whose positions get a gradient (torch leaves the padding row's part at 0), added
    to a dense gradient of the same weight, as the tied LM head's."""
    torch.manual_seed(0)
    weight = torch.randn(50, 8)
    ids = torch.randint(0, 6, (5, 40))  # ids 0-5, each many times; 2 is the padding id
    upstream = torch.randn(5, 40, 8) * torch.exp2(torch.randint(-8, 9, (5, 40, 8)).float())
    dense = torch.randn(50, 8)

    def grad(lookup):
        w = weight.clone().requires_grad_()
        ((lookup(ids, w) * upstream).sum() + (w * dense).sum()).backward()
        return w.grad

    expected = grad(lambda i, w: torch.nn.functional.embedding(i, w, 2))
    got = grad(lambda i, w: embedding_grad._Lookup.apply(i, w, 2))
    assert torch.equal(got, expected) and got.layout == torch.strided
    assert not torch.equal(grad(lambda i, w: embedding_grad._Lookup.apply(i, w, None)), expected)
