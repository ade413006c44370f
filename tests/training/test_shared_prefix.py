"""Shared-prefix scoring (speed.exact_shortcuts): the same log-probs, entropies and gradients as TRL's own scoring forward."""

from __future__ import annotations

import contextlib
import copy

import pytest
import torch
from trl.trainer.utils import add_fused_lm_head

from grpo_exp.kernels import attention, lean_saved
from grpo_exp.training import shared_prefix

# bf16 keeps 8 significant bits: a rounding to nearest moves a value by at most U of it
U = 2.0 ** -9


@pytest.fixture(scope="module")
def tiny(tiny_model):
    """A copy of the session's tiny model for the module that imports this (the tests patch in a fused LM head,
    switch the attention, set the padding side)."""
    model, tokenizer = copy.deepcopy(tiny_model)
    add_fused_lm_head(model, temperature=0.7, outputs=("log_probs", "entropy"))  # as GRPOTrainer patches it
    return model, tokenizer


# prompts of different lengths, so the left padding differs between groups
PROMPTS = ["What is 7 + 5?", "Tom has 12 apples and eats 3 of them. How many are left?"]


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


def trl_forward(model, ids, mask, keep: int, **model_kwargs):
    """TRL's own scoring forward (the fused LM head GRPOTrainer patches in): log-probs and entropies of
    the last `keep` tokens."""
    labels = ids.masked_fill(mask == 0, -100)
    labels[:, :-keep] = -100
    out = model(input_ids=ids, attention_mask=mask, labels=labels, fused_lm_head=True, **model_kwargs)
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
    assert attention.use(model, attn)  # speed.attention: the policy scores with either
    ids, mask = grpo_batch(tokenizer, PROMPTS, repeats=3, completion_len=10)
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


def bf16(fn):
    """`fn` under bf16 autocast, as a run trains where the CPU computes bf16 natively (train.precision=auto)."""
    def run():
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return fn()
    return run


def bf16_tolerances(model, ids, mask, keep: int, temperature: float) -> dict[str, float]:
    """How far two bf16 scorings that round differently in attention (and in the LM head's kernel), everything else
    the same, may be apart: log-probs and entropies (absolute), each parameter's gradient (relative, in norm), and
    the losses of two steps (relative to the loss's change: loss_error).

    A rounding is an error <= U of the value rounded. Every logit u_v = h . w_v / T is bounded by
    S = max|g| sqrt(d) max_v |w_v| / T, as h leaves the final RMSNorm (weight g) with norm <= max|g| sqrt(d). A
    rounding beneath reaches h as at most U of |h| (the layers' outputs do not outgrow the residual stream they are
    added to, and RMSNorm rescales it), so it moves each logit by <= U S: a log-prob (u_t less the log-sum-exp) by
    <= 2 U S, and an entropy (by -Cov_p(du, u)) by <= 2 U S times the logits' spread E_p|u - E_p u|. The forward's
    differing roundings: attention's two products and the cast of its fp32 softmax, per layer, and the logits
    product. The backward adds attention's four products and the softmax gradient's cast per layer, and the head's
    two gradient products (fp32 in TRL's kernel, bf16 in speed.logprob_kernel=autocast); each moves a gradient by
    <= U of its norm, added without cancellation. On debug=smoke's model (2 layers, S = 2.5): log-probs 0.068,
    gradients 0.037, losses 0.074, where the tests' paths measured up to 0.003, 0.009 and 0.005."""
    head = model.get_output_embeddings().weight
    norm = model.get_decoder().norm.weight
    bound = (norm.abs().max() * head.size(1) ** 0.5 * head.norm(dim=1).max() / temperature).item()
    with torch.no_grad():  # the fused head's model returns logits without fused_lm_head
        logits = model(input_ids=ids, attention_mask=mask).logits[:, -keep - 1:-1].float() / temperature
    p = logits.softmax(-1)
    spread = (p * (logits - (p * logits).sum(-1, keepdim=True)).abs()).sum(-1).max().item()
    layers = model.config.num_hidden_layers
    forward, backward = 3 * layers + 1, 5 * layers + 2
    grads = (forward + backward) * U
    # Losses: AdamW's first update is about -lr sign(g), so only weights whose gradient's sign the difference flips
    # move differently, each by 2 lr, on a gradient no larger than that difference: to first order the loss's change
    # differs by at most twice the gradients' error. The scoring's own rounding at the second step, a mean over the
    # batch's tokens, adds far less (1e-4 of the change, measured at the same weights).
    return {"logps": 2 * forward * U * bound, "entropies": 2 * forward * U * bound * spread, "grads": grads,
            "losses": 2 * grads}


def score_errors(got, reference) -> dict[str, float]:
    """The largest log-prob and entropy differences, and the largest relative error of a parameter's gradient."""
    assert got[2].keys() == reference[2].keys()
    return {"logps": (got[0] - reference[0]).abs().max().item(),
            "entropies": (got[1] - reference[1]).abs().max().item(),
            "grads": max(relative_error(got[2][name], grad) for name, grad in reference[2].items())}


def relative_error(x, ref) -> float:
    return ((x.double() - ref.double()).norm() / ref.double().norm()).item()


def without_first_prompt_token(mask, keep: int):
    """A deliberately wrong mask: each row's first prompt token hidden, as if the prefix lost a position."""
    bad = mask.clone()
    bad[torch.arange(mask.size(0)), mask[:, :-keep].argmax(1)] = 0
    return bad


ADVANTAGES = torch.tensor([1.0, -0.5, -0.5, 0.8, 0.4, -1.2])  # one per row: groups' rewards, centred and scaled
# AdamW's first steps move every weight by about lr: 1e-2 is half the random model's weight scale (0.02), so the loss
# moves by ~0.13, far above the bf16 noise, and a wrong scoring's steps go visibly elsewhere
LEARNING_RATE = 1e-2


def two_steps_losses(model, fn, completion_mask) -> list[float]:
    """The losses of two AdamW steps on one batch scored by `fn` under bf16 autocast, as each generation round of
    the default trains (steps_per_generation=2): TRL's DAPO loss (eps 0.2), the ratio's old log-probs from a no-grad
    scoring before the first step. The model's weights are put back afterwards."""
    saved = {name: t.clone() for name, t in model.state_dict().items()}
    optimizer = torch.optim.AdamW(model.parameters(), lr=LEARNING_RATE, weight_decay=0.0)  # TRL's default optimizer
    advantages, mask = ADVANTAGES[:, None], completion_mask.float()
    losses = []
    try:
        with torch.no_grad():
            old = bf16(fn)()[0]
        for _ in range(2):
            ratio = torch.exp(bf16(fn)()[0] - old)
            per_token = -torch.min(ratio * advantages, ratio.clamp(0.8, 1.2) * advantages)
            loss = (per_token * mask).sum() / mask.sum()
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            losses.append(loss.item())
    finally:
        model.load_state_dict(saved)
        model.zero_grad(set_to_none=True)
    return losses


def loss_error(got: list[float], reference: list[float]) -> float:
    """The two steps' largest loss difference, relative to the reference loss's change over the first step (what
    the update did: the first loss is the advantages' mean, ratio 1, on either path)."""
    return max(abs(a - b) for a, b in zip(got, reference)) / abs(reference[1] - reference[0])


def bf16_comparison(model, ids, mask, keep: int, reference_fn, fn, wrong_fn) -> tuple[dict, dict, dict]:
    """(tolerances, errors of `fn`, errors of `wrong_fn`) against `reference_fn`, each a scoring of the last `keep`
    tokens under bf16 autocast: log-probs, entropies, gradients and the losses of two steps."""
    completion_mask = mask[:, -keep:]
    tolerances = bf16_tolerances(model, ids, mask, keep, 0.7)
    reference = score(model, bf16(reference_fn)), two_steps_losses(model, reference_fn, completion_mask)
    errors = [{**score_errors(score(model, bf16(f)), reference[0]),
               "losses": loss_error(two_steps_losses(model, f, completion_mask), reference[1])} for f in (fn, wrong_fn)]
    return tolerances, errors[0], errors[1]


# as cpu.resolve_precision decides for a CPU: without native bf16 a run trains in fp32, and emulated bf16 is slow
# (each test below took 27 s with torch held to AVX2, against 9 s natively, on 2 cores)
needs_native_bf16 = pytest.mark.skipif(
    not (torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported())
    or torch.backends.cpu.get_cpu_capability() in ("DEFAULT", "AVX2"),
    reason="bf16 is emulated on this CPU (train.precision=auto trains in fp32 here)")


# TRL's attention and LM head; and this CPU's default: speed.attention, speed.logprob_kernel, the plan's saved tensors
@needs_native_bf16
@pytest.mark.parametrize("attn,kernel,lean", [("sdpa", "trl", False), ("grouped", "autocast", True)],
                         ids=["trl_attention_and_head", "cpu_default"])
def test_under_bf16_autocast_matches_trls_forward_and_two_steps(tiny, attn, kernel, lean):
    model, tokenizer = tiny
    ids, mask = grpo_batch(tokenizer, PROMPTS, repeats=3, completion_len=10)
    keep = 10

    def shared(scored_mask=mask):
        attention.use(model, attn)
        with lean_saved.lean_forward(model) if lean else contextlib.nullcontext():
            return shared_prefix.completion_logps(model, ids, scored_mask, keep, 0.7, True, kernel)

    def trls():
        attention.use(model, "sdpa")  # TRL's: the model's own attention
        return trl_forward(model, ids, mask, keep)

    tolerances, errors, wrong = bf16_comparison(model, ids, mask, keep, trls, shared,
                                                lambda: shared(without_first_prompt_token(mask, keep)))
    assert all(errors[k] <= tolerances[k] for k in tolerances), (errors, tolerances)
    # the tolerances catch a real bug: a prefix that lost a token is beyond them (not in the entropies: the random
    # model's sit near log V whatever it reads, and the lost token moves them by 2e-4)
    assert all(wrong[k] > tolerances[k] for k in ("logps", "grads", "losses")), (wrong, tolerances)


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
