"""speed.logprob_kernel=autocast (kernels/logprob_head.py): TRL's log-probs, entropies and gradients, within rounding.

In fp32 it must agree with an fp64 log-softmax to float precision, through every block of its loops; under
bf16 autocast its gradient error against fp64 must be of the size of TRL's own kernel's (which also rounds the
logits gradient to bf16), not larger by more than the one rounding of each gradient GEMM's output.
"""

from __future__ import annotations

import pytest
import torch

from grpo_exp.kernels import logprob_head

N, H, V = 37, 16, 300  # N not a multiple of the (patched) block sizes: partial blocks run too


@pytest.fixture(autouse=True)
def small_blocks(monkeypatch):
    monkeypatch.setattr(logprob_head, "ROWS", 8)
    monkeypatch.setattr(logprob_head, "GRAD_ROWS", 16)


def inputs(seed: int = 0, bias: bool = True):
    gen = torch.Generator().manual_seed(seed)
    hidden = torch.randn(N, H, generator=gen)
    weight = torch.randn(V, H, generator=gen) * 0.3
    b = torch.randn(V, generator=gen) * 0.1 if bias else None
    targets = torch.randint(0, V, (N,), generator=gen)
    grad_logps, grad_entropy = torch.randn(N, generator=gen), torch.randn(N, generator=gen)
    return hidden, weight, b, targets, grad_logps, grad_entropy


def reference(hidden, weight, bias, targets, temperature, round_to=None):
    """fp64 log-softmax: (log-probs, entropies) with autograd, on inputs rounded as autocast would round them."""
    cast = (lambda x: x.to(round_to).double()) if round_to else (lambda x: x.double())
    h, w = cast(hidden).requires_grad_(), cast(weight).requires_grad_()
    b = cast(bias).requires_grad_() if bias is not None else None
    z = h @ w.t() + (b if b is not None else 0)
    log_p = torch.log_softmax(z / temperature, -1)
    return h, w, b, log_p.gather(-1, targets[:, None]).squeeze(-1), -(log_p.exp() * log_p).sum(-1)


def run(kernel, hidden, weight, bias, targets, temperature, grad_logps, grad_entropy, autocast=False):
    h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    b = bias.clone().requires_grad_() if bias is not None else None
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        logps, entropy = logprob_head.logprobs(h, w, b, targets, temperature, True, kernel)
    ((logps * grad_logps).sum() + (entropy * grad_entropy).sum()).backward()
    return logps.detach(), entropy.detach(), h.grad, w.grad, None if b is None else b.grad


@pytest.mark.parametrize("bias", [True, False])
def test_fp32_values_and_gradients_equal_a_log_softmax(bias):
    hidden, weight, b, targets, gl, ge = inputs(bias=bias)
    h, w, rb, lp, ent = reference(hidden, weight, b, targets, 0.7)
    ((lp * gl.double()).sum() + (ent * ge.double()).sum()).backward()
    got = run("autocast", hidden, weight, b, targets, 0.7, gl, ge)
    torch.testing.assert_close(got[0].double(), lp.detach(), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(got[1].double(), ent.detach(), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(got[2].double(), h.grad, atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(got[3].double(), w.grad, atol=1e-5, rtol=1e-4)
    if bias:
        torch.testing.assert_close(got[4].double(), rb.grad, atol=1e-5, rtol=1e-4)


def test_fp32_agrees_with_trls_kernel():
    hidden, weight, b, targets, gl, ge = inputs(seed=1)
    ours = run("autocast", hidden, weight, b, targets, 0.8, gl, ge)
    trls = run("trl", hidden, weight, b, targets, 0.8, gl, ge)
    for a, t in zip(ours, trls):
        torch.testing.assert_close(a, t, atol=1e-5, rtol=1e-4)


def test_only_the_log_prob_gradient_when_entropy_is_for_logging():
    hidden, weight, b, targets, gl, _ = inputs(seed=2)
    h, w, _, lp, _ = reference(hidden, weight, b, targets, 1.0)
    (lp * gl.double()).sum().backward()
    hh, ww = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    logps, entropy = logprob_head.logprobs(hh, ww, b, targets, 1.0, True, "autocast")
    (logps * gl).sum().backward()  # the entropy gets no gradient: backward sees None for it
    torch.testing.assert_close(hh.grad.double(), h.grad, atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(ww.grad.double(), w.grad, atol=1e-5, rtol=1e-4)
    assert logprob_head.logprobs(hh, ww, b, targets, 1.0, False, "autocast")[1] is None


def relative_error(x, ref):
    return ((x.double() - ref).norm() / ref.norm()).item()


def test_bf16_autocast_gradients_are_as_close_as_trls():
    hidden, weight, b, targets, gl, _ = inputs(seed=3, bias=False)
    zero = torch.zeros(N)
    h, w, _, lp, _ = reference(hidden, weight, None, targets, 0.7, round_to=torch.bfloat16)
    (lp * gl.double()).sum().backward()
    ours = run("autocast", hidden, weight, None, targets, 0.7, gl, zero, autocast=True)
    trls = run("trl", hidden, weight, None, targets, 0.7, gl, zero, autocast=True)
    torch.testing.assert_close(ours[0], trls[0], atol=1e-5, rtol=1e-5)  # the same bf16 GEMM, fp32 softmax
    for i, ref in ((2, h.grad), (3, w.grad)):
        assert relative_error(ours[i], ref) < 2 * relative_error(trls[i], ref) + 1e-3
        assert relative_error(ours[i], ref) < 1e-2
        assert ours[i].dtype == torch.float32


@pytest.mark.parametrize("autocast", [True, False], ids=["bf16_autocast", "fp32"])
def test_the_backward_uses_the_forwards_products_with_the_same_gradients(monkeypatch, autocast):
    """The forward keeps each block's logits product for the backward, under bf16 autocast and in fp32: the backward
    then makes no product of its own, and every gradient equals, bit for bit, the one from products computed
    again."""
    hidden, weight, b, targets, gl, ge = inputs(seed=4)
    products = []
    real = logprob_head._product

    def counted(*a):
        products.append(1)
        return real(*a)

    monkeypatch.setattr(logprob_head, "_product", counted)
    blocks = -(-N // logprob_head._rows(torch.bfloat16 if autocast else torch.float32))
    grads = {}
    for keep in (True, False):
        h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
        bb = b.clone().requires_grad_()
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            logps, entropy = logprob_head.AutocastLogProbHead.apply(h, w, bb, targets, 0.7, True, keep)
        assert len(products) == blocks
        products.clear()
        ((logps * gl).sum() + (entropy * ge).sum()).backward()
        assert len(products) == (0 if keep else blocks)
        products.clear()
        grads[keep] = (logps.detach(), entropy.detach(), h.grad, w.grad, bb.grad)
    for kept, again in zip(grads[True], grads[False]):
        assert torch.equal(kept, again)


def test_products_are_kept_only_where_a_backward_can_come(monkeypatch):
    """Scoring runs under no_grad: nothing is kept for a backward that never comes; with a graph retained, a second
    backward computes the products again and gives the first one's gradients."""
    hidden, weight, b, targets, gl, _ = inputs(seed=5)
    kept = []
    apply = logprob_head.AutocastLogProbHead.apply
    monkeypatch.setattr(logprob_head.AutocastLogProbHead, "apply", lambda *a: kept.append(a[-1]) or apply(*a))
    h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        logprob_head.logprobs(h, w, None, targets, 0.7, False, "autocast")
    with torch.autocast("cpu", dtype=torch.bfloat16):
        logps, _ = logprob_head.logprobs(h, w, None, targets, 0.7, False, "autocast")
    assert kept == [False, True]
    (logps * gl).sum().backward(retain_graph=True)
    first = (h.grad.clone(), w.grad.clone())
    h.grad = w.grad = None
    (logps * gl).sum().backward()
    assert torch.equal(h.grad, first[0]) and torch.equal(w.grad, first[1])


def test_spans_cover_a_block_without_a_single_token_remainder(monkeypatch):
    monkeypatch.setattr(logprob_head, "SPAN_ROWS", 4)
    assert logprob_head._spans(0, 8) == [(0, 4), (4, 8)]
    assert logprob_head._spans(8, 17) == [(8, 12), (12, 17)]  # 16..17 alone would be one token: joined
    assert logprob_head._spans(8, 18) == [(8, 12), (12, 16), (16, 18)]
    assert logprob_head._spans(3, 4) == [(3, 4)]  # a one-token block stays one


@pytest.mark.parametrize("n", [5, 9])
def test_spans_compute_what_whole_blocks_compute(monkeypatch, n):
    """The fp32 maths a span at a time gives every output and gradient of the maths over whole blocks, bit for bit,
    at a vocabulary wide enough (49152, the default model's) that torch sums a single row on two threads: with the
    one-token remainder not joined to the span before it, the 5-token case (spans of 4 and 1) differs."""
    monkeypatch.setattr(logprob_head, "ROWS", 9)
    monkeypatch.setattr(logprob_head, "GRAD_ROWS", 9)
    gen = torch.Generator().manual_seed(n)
    vocab, hidden_size = 49152, 16
    hidden = torch.randn(n, hidden_size, generator=gen) * 4
    weight = torch.randn(vocab, hidden_size, generator=gen)
    targets = torch.randint(0, vocab, (n,), generator=gen)
    gl, ge = torch.randn(n, generator=gen), torch.randn(n, generator=gen)
    results = {}
    for span in (logprob_head.ROWS, 4):
        monkeypatch.setattr(logprob_head, "SPAN_ROWS", span)
        results[span] = run("autocast", hidden, weight, None, targets, 0.7, gl, ge, autocast=True)[:4]
    for whole, spans in zip(results[logprob_head.ROWS], results[4]):
        assert torch.equal(whole, spans)


def test_fp32_blocks_of_any_size_give_the_same_numbers(monkeypatch):
    """In fp32 the forward multiplies FP32_ROWS tokens a block (one GEMM for the default run's batches) where it
    multiplied ROWS: at the default model's head, 768 tokens in one block and in three of 256 give every output and
    gradient bit for bit, so the larger block changes no number of a run."""
    monkeypatch.setattr(logprob_head, "ROWS", 256)
    monkeypatch.setattr(logprob_head, "GRAD_ROWS", 2048)
    gen = torch.Generator().manual_seed(7)
    n, vocab, hidden_size = 768, 49152, 576
    hidden = torch.randn(n, hidden_size, generator=gen)
    weight = torch.randn(vocab, hidden_size, generator=gen) * 0.05
    targets = torch.randint(0, vocab, (n,), generator=gen)
    gl, ge = torch.randn(n, generator=gen), torch.randn(n, generator=gen)
    products = []
    real = logprob_head._product
    monkeypatch.setattr(logprob_head, "_product", lambda h, *a: products.append(h.shape[0]) or real(h, *a))
    results = {}
    for rows in (1024, 256):
        monkeypatch.setattr(logprob_head, "FP32_ROWS", rows)
        results[rows] = run("autocast", hidden, weight, None, targets, 0.7, gl, ge, autocast=False)[:4]
    assert products == [768, 256, 256, 256]  # one block, then three
    for one_block, three in zip(results[1024], results[256]):
        assert torch.equal(one_block, three)
