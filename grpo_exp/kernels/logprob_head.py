"""Per-token log-probs (and entropies) of `hidden @ weight.T / T`, with a backward of two GEMMs in the autocast dtype.

Why: TRL's chunked log-prob kernel (trl.kernels.ChunkedLogProbFunction), which the shared-prefix scoring uses,
accumulates its two gradient GEMMs in fp32. On CUDA it asks the GEMM for an fp32 output of bf16 inputs; on a CPU,
where torch has no such GEMM, it upcasts both operands and runs the GEMMs in fp32, at about a fifth of the bf16
rate on a CPU with native bf16 (the bench's machine limits: 209 against 945 GFLOP/s). With this function the
bench's default step spent 1.07 s in its backward instead of 1.72 s (docs/log.md, "2026-11-27 —
grpo-exp's LM-head kernel shortens the backward").

This function keeps TRL's forward maths (fp32 log-sum-exp over the whole vocabulary, tokens in blocks so that
no N x V fp32 logits are kept) and its logits gradient (fp32, stored in the autocast dtype as TRL stores it).
The forward keeps each block's logits product (in the autocast dtype) for the backward, which uses it instead of
computing it again. The backward runs each weight gradient as one GEMM in that dtype, over the whole vocabulary and
every token, rounded once, as autocast's backward does for every other Linear layer of the model. TRL's note
against rounding each vocabulary chunk's product before summing does not apply: nothing is summed across chunks,
except `grad_weight` across token blocks of `GRAD_ROWS` (one block up to 2048 tokens).

Without autocast (fp32 training on a CPU without native bf16) every GEMM is fp32, as in TRL's kernel; the kept
products and the fp32 maths in spans (below) still shorten the step there.
"""

from __future__ import annotations

import torch
from trl.trainer.utils import _CHUNKED_LOGPROB_CHUNK_SIZE, _ChunkedLogProbFunction

CHOICES = ("trl", "autocast")  # speed.logprob_kernel, as the speed plan resolved it
ROWS = 256  # tokens per forward block: 256 x 49152 fp32 logits are 50 MB
# tokens per forward block in fp32 (no autocast): there every block's product is kept for the backward anyway, so a
# larger block holds no more memory in training (a no-grad forward holds one 200 MB block at a time), and MKL's fp32
# product of the default head ran 15-30% faster on 1024 rows than on 256 (2 cores, AVX2-only: 427-475 against
# 509-634 ms per 1024 tokens). Its rows equal the same rows of a smaller block bit for bit unless that block has
# 1-3, 5-7 or 9-11 rows (MKL's small-row kernels there), which a batch of 8 completions never makes
FP32_ROWS = 1024
GRAD_ROWS = 2048  # tokens whose logits gradient is held at once for the weight-gradient GEMM (bf16: 200 MB)
# tokens per span of a block's fp32 maths: 32 x 49152 fp32 logits are 6 MB, which stay in cache between the span's
# passes (cast, log-sum-exp, entropy; log p, p, the gradient), where a whole block's 50 MB went to memory and back
# on every pass (one-off, 512 tokens with entropy, 2 cores: forward 139 -> 116 ms, backward 188 -> 178 ms)
SPAN_ROWS = 32


def _spans(start: int, end: int):
    """[start, end) in spans of SPAN_ROWS tokens, the last one never a single token unless the block is one.

    Every operation of the spans' maths treats each token's row alone, so a span computes what its block computed
    bit for bit, with one exception: torch splits the row of a single-row tensor between its threads (its
    "two-pass" reduction) but sums each row of a larger tensor whole on one thread. A one-token remainder is
    therefore joined to the span before it, so that no row is summed otherwise than in the block."""
    cuts = list(range(start, end, SPAN_ROWS)) + [end]
    if len(cuts) > 2 and cuts[-1] - cuts[-2] == 1:
        del cuts[-2]
    return list(zip(cuts[:-1], cuts[1:]))


def _rows(dtype: torch.dtype) -> int:
    """Tokens per forward block in `dtype`; never more than GRAD_ROWS, whose blocks the backward walks in the same
    steps to find the forward's kept products."""
    return min(FP32_ROWS if dtype == torch.float32 else ROWS, GRAD_ROWS)


def _compute_dtype(hidden: torch.Tensor) -> torch.dtype:
    device = hidden.device.type
    return torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else hidden.dtype


def _product(hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """The head's logits in the compute dtype: hidden @ weight.T (+ bias)."""
    z = hidden @ weight.t()
    return z + bias if bias is not None else z


def _scaled(product: torch.Tensor, temperature: float) -> torch.Tensor:
    """The logits in fp32, divided by the temperature (a new tensor: the product may be kept for the backward)."""
    return product.div(temperature) if product.dtype == torch.float32 else product.float().div_(temperature)


class AutocastLogProbHead(torch.autograd.Function):
    """(log-probs, entropies or None) of `targets`, each [N]; `hidden` [N, H], `weight` [V, H], `bias` [V] or None."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, targets, temperature: float, want_entropy: bool, keep_products: bool):
        dtype = _compute_dtype(hidden)
        w = weight.to(dtype)
        b = bias.to(dtype) if bias is not None else None
        n = hidden.shape[0]
        logps = torch.empty(n, dtype=torch.float32, device=hidden.device)
        log_z = torch.empty_like(logps)
        entropy = torch.empty_like(logps) if want_entropy else None
        # Each block's product is kept for the backward, which would otherwise compute it again: the same GEMM of the
        # same operands (the same numbers), about a third of the backward's time for the default model (85 of 270 ms
        # for 512 tokens). It holds 25 MB a block (bf16) from here to the backward, which frees each block as it
        # uses it, before the weight-gradient GEMMs where the backward's memory peaks.
        ctx.products = {}  # (first token, end) -> the block's product
        rows = _rows(dtype)
        for s in range(0, n, rows):
            e = min(s + rows, n)
            product = _product(hidden[s:e].to(dtype), w, b)
            if keep_products:
                ctx.products[s, e] = product
            for a, c in _spans(s, e):
                z = _scaled(product[a - s:c - s], temperature)
                lz = torch.logsumexp(z, dim=-1)
                log_z[a:c] = lz
                logps[a:c] = z.gather(-1, targets[a:c, None]).squeeze(-1) - lz
                if want_entropy:
                    # H = log Z - sum_v p_v z_v, as TRL's kernel computes it
                    entropy[a:c] = lz - (torch.exp(z - lz[:, None]) * z).sum(-1)
            product = z = None
        ctx.save_for_backward(hidden, weight, bias, targets, log_z, entropy if want_entropy else log_z)
        ctx.dtype, ctx.temperature = dtype, temperature
        ctx.set_materialize_grads(False)  # the entropy is usually for logging only: no gradient comes back
        if want_entropy:
            return logps, entropy
        return logps, None

    @staticmethod
    def backward(ctx, grad_logps, grad_entropy):
        hidden, weight, bias, targets, log_z, entropy = ctx.saved_tensors
        if grad_logps is None and grad_entropy is None:
            return None, None, None, None, None, None, None
        dtype, inv_t = ctx.dtype, 1.0 / ctx.temperature
        w = weight.to(dtype)
        b = bias.to(dtype) if bias is not None else None
        n = hidden.shape[0]
        need_h, need_w, need_b = ctx.needs_input_grad[:3]
        rows = _rows(dtype)  # the forward's blocks, whose kept products are looked up by (first token, end)
        grad_hidden = torch.empty(hidden.shape, dtype=dtype, device=hidden.device) if need_h else None
        grad_weight = grad_bias = None
        # This backward is where a training step's memory peaks (the whole graph's activations are still held), so
        # each N x V and V x H temporary is dropped as soon as it is used: the last fp32 block of log p before
        # the GEMMs, the cast weight after its last GEMM, the logits gradient before its weight-gradient product
        # is widened to fp32. The first block's weight gradient is that product itself rather than a sum onto
        # zeros, which is the same number (0 + x = x; only a -0.0 turns +0.0, which changes no update).
        for gs in range(0, n, GRAD_ROWS):
            ge = min(gs + GRAD_ROWS, n)
            h_block = hidden[gs:ge].to(dtype)
            grad_z = torch.empty((ge - gs, weight.shape[0]), dtype=dtype, device=hidden.device)
            for s in range(gs, ge, rows):
                e = min(s + rows, ge)
                # log p, then p, in place, a span at a time: each pass over N x V fp32 costs as much as a small GEMM
                product = ctx.products.pop((s, e), None)
                if product is None:  # not kept, or used by an earlier backward through a retained graph
                    product = _product(h_block[s - gs:e - gs], w, b)
                for a, c in _spans(s, e):
                    log_p = _scaled(product[a - s:c - s], ctx.temperature).sub_(log_z[a:c, None])
                    g = None
                    if grad_entropy is not None:
                        # d H / dz_j = -p_j (log p_j + H)
                        g = log_p.add(entropy[a:c, None]).mul_(-grad_entropy[a:c, None] * inv_t)
                    p = log_p.exp_()
                    if g is not None:
                        g.mul_(p)
                    if grad_logps is not None:
                        # d log p_target / dz_j = 1[j = target] - p_j
                        scale = grad_logps[a:c, None].float() * inv_t
                        term = p.mul_(-scale).scatter_add_(-1, targets[a:c, None], scale)
                        g = term if g is None else g.add_(term)
                    grad_z[a - gs:c - gs] = g
                    log_p = p = g = term = None
                product = None
            if need_h:
                grad_hidden[gs:ge] = grad_z @ w
            if ge == n:
                w = b = None
            if need_b:
                part = grad_z.sum(0, dtype=torch.float32)
                grad_bias = part if grad_bias is None else grad_bias.add_(part)
            if need_w:
                part = grad_z.t() @ h_block
                grad_z = None
                grad_weight = part.float() if grad_weight is None else grad_weight.add_(part.float())
            part = grad_z = None
        if need_w and grad_weight is None:  # no tokens
            grad_weight = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device)
        if need_b and grad_bias is None:
            grad_bias = torch.zeros(bias.shape, dtype=torch.float32, device=bias.device)
        return (grad_hidden.to(hidden.dtype) if need_h else None,
                grad_weight.to(weight.dtype) if need_w else None,
                grad_bias.to(bias.dtype) if need_b else None, None, None, None, None)


def logprobs(hidden, weight, bias, targets, temperature: float, want_entropy: bool, kernel: str = "trl"):
    """(log-probs, entropies or None) per token through `kernel`: "trl" (TRL's chunked kernel) or "autocast"."""
    if kernel == "autocast":
        # the products are kept for a backward only where one can come (scoring runs under no_grad)
        keep = torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (hidden, weight, bias))
        return AutocastLogProbHead.apply(hidden, weight, bias, targets, temperature, want_entropy, keep)
    # the per-token fields TRL's GRPO trainer asks its fused head for (grpo_trainer.add_fused_lm_head(outputs=...))
    fields = ("log_probs", "entropy") if want_entropy else ("log_probs",)
    per_token = _ChunkedLogProbFunction.apply(hidden, weight, bias, targets, temperature, _CHUNKED_LOGPROB_CHUNK_SIZE,
                                              None, 1.0, fields)
    return per_token[0], per_token[1] if want_entropy else None
