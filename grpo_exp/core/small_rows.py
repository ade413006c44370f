"""bf16 products of a few rows (a decoding step's Linear layers) as a C++ kernel that reads the plain weight in place
and computes what oneDNN's packed product computes, bit for bit.

Why: at 16 rows, oneDNN's packed bf16 product of the default model's layers took about 20 ms per decoding step with
the weights streamed from memory, against about 15 ms for this kernel (a one-off chain of the model's 121 products,
2 cores, native bf16 (avx512_bf16/amx; lscpu: avx512_bf16, no amx_bf16); README, Performance). And it needs no
packed copy of the weights: oneDNN's took about as much memory as the bf16 copy itself.

The kernel puts rows in the vector lanes: 16 rows' (k, k + 1) pairs of x in one vector, each weight pair broadcast,
vdpbf16ps adding both products to each row's sum. oneDNN's bf16 product on a CPU with AVX512-BF16 sums an output the
same way, two terms at a time from 0, but splits a long inner axis into spans whose sums are added in turn (576
inputs: 512 + 64; 1536: 1024 + 512, measured here). Which span a shape takes is not documented, so `span_for` finds
it: before the kernel computes a shape, it is run against oneDNN's own product on random rows over a wide range of
magnitudes with each candidate span, and the first that agrees everywhere is used; where none does, the caller keeps
oneDNN's product. The next block's weights are prefetched into L2 a cache line per step, in order: without that the
16 weight rows read side by side ran no faster than oneDNN.
"""

from __future__ import annotations

import math

import torch

from grpo_exp.base import log

logger = log.get_logger(__name__)

# whether this CPU multiplies bf16 with AVX512-BF16 and torch's kernels use it (not held to AVX2), without AMX: where
# oneDNN's bf16 products add in the order the kernels here repeat, as measured (a CPU with AMX tiles multiplies
# through them, in an order not checked; it keeps oneDNN's products). A constant, so that dynamo never traces the test
AVX512_BF16 = (torch.cpu._is_avx512_bf16_supported() and not torch.cpu._is_amx_tile_supported()
               and torch.backends.cpu.get_cpu_capability() not in ("DEFAULT", "AVX2"))
MAX_ROWS = 64  # beyond, the weight is read once per 16 rows: oneDNN's blocked product is the better one

# C++ shared with core/decode_softmax.py's attention kernel: the target attribute for AVX512-BF16 code, and a 16 x 16
# transpose of 32-bit words
BF16_HEADER = r"""
#include <torch/csrc/inductor/cpp_prefix.h>
#include <immintrin.h>
#define BF16_TARGET __attribute__((target("avx512f,avx512bw,avx512vl,avx512bf16")))

// rows [16] of 16 32-bit words each -> rows[c] holds word c of every row
BF16_TARGET static inline void transpose16(__m512i* r)
{
    __m512i t[16], u[16];
    for (int i = 0; i < 8; ++i) {
        t[2 * i] = _mm512_unpacklo_epi32(r[2 * i], r[2 * i + 1]);
        t[2 * i + 1] = _mm512_unpackhi_epi32(r[2 * i], r[2 * i + 1]);
    }
    for (int i = 0; i < 4; ++i) {  // u[4i + j]: word 4k + j of rows 4i..4i+3, in 128-bit lane k
        u[4 * i] = _mm512_unpacklo_epi64(t[4 * i], t[4 * i + 2]);
        u[4 * i + 1] = _mm512_unpackhi_epi64(t[4 * i], t[4 * i + 2]);
        u[4 * i + 2] = _mm512_unpacklo_epi64(t[4 * i + 1], t[4 * i + 3]);
        u[4 * i + 3] = _mm512_unpackhi_epi64(t[4 * i + 1], t[4 * i + 3]);
    }
    for (int j = 0; j < 4; ++j) {
        const __m512i a = _mm512_shuffle_i32x4(u[j], u[4 + j], 0x88), b = _mm512_shuffle_i32x4(u[j], u[4 + j], 0xDD);
        const __m512i c = _mm512_shuffle_i32x4(u[8 + j], u[12 + j], 0x88);
        const __m512i d = _mm512_shuffle_i32x4(u[8 + j], u[12 + j], 0xDD);
        r[j] = _mm512_shuffle_i32x4(a, c, 0x88);
        r[8 + j] = _mm512_shuffle_i32x4(a, c, 0xDD);
        r[4 + j] = _mm512_shuffle_i32x4(b, d, 0x88);
        r[12 + j] = _mm512_shuffle_i32x4(b, d, 0xDD);
    }
}
"""

_SOURCE = BF16_HEADER + r"""
// y [M, ldy] (N columns from `column`) = x [M, K] @ w [N, K]^T, bf16, K even: each output summed over K two terms
// at a time from 0 (vdpbf16ps), per `span` terms, each span's sum added to those before, rounded to bf16 once
extern "C" BF16_TARGET void kernel(const at::BFloat16* x, const at::BFloat16* w, at::BFloat16* y, const int64_t M,
                                   const int64_t N, const int64_t K, const int64_t ldy, const int64_t column,
                                   const int64_t span)
{
    y += column;
    constexpr int64_t NB = 16;  // outputs a block: 16 accumulators, one per weight row, lanes the 16 rows of x
    const int64_t K2 = K / 2, S2 = span / 2, RB = (M + 15) / 16, blocks = (N + NB - 1) / NB;
    // x's pairs, 16 rows a vector: xt[(rb * K2 + p) * 16 + lane] = (x[16 rb + lane, 2p], x[16 rb + lane, 2p + 1]),
    // 0 past the last row; made 16 x 16 pairs at a time (a scalar loop took about 7 us per 16 rows of 1536 inputs).
    // Kept between calls: every word is written before the product reads it
    static thread_local std::vector<uint32_t> buffer;
    if (buffer.size() < static_cast<size_t>(RB * K2 * 16)) buffer.resize(RB * K2 * 16);
    uint32_t* const xt = buffer.data();
    const uint32_t* x2 = reinterpret_cast<const uint32_t*>(x);
    for (int64_t rb = 0; rb < RB; ++rb) {
        for (int64_t p = 0; p < K2; p += 16) {
            const int64_t width = std::min<int64_t>(16, K2 - p);
            const __mmask16 cols = static_cast<__mmask16>((1u << width) - 1u);
            __m512i pairs[16];
            for (int64_t r = 0; r < 16; ++r) {
                const int64_t m = rb * 16 + r;
                pairs[r] = m < M ? _mm512_maskz_loadu_epi32(cols, x2 + m * K2 + p) : _mm512_setzero_si512();
            }
            transpose16(pairs);
            for (int64_t c = 0; c < width; ++c) _mm512_storeu_si512(xt + (rb * K2 + p + c) * 16, pairs[c]);
        }
    }
    const uint32_t* w2 = reinterpret_cast<const uint32_t*>(w);
    #pragma omp parallel for schedule(static)
    for (int64_t t = 0; t < blocks * RB; ++t) {
        const int64_t nb = t / RB, rb = t % RB, n0 = nb * NB, count = std::min(NB, N - n0);
        const uint32_t* xr = xt + rb * K2 * 16;
        // the next block's 16 weight rows are K2 cache lines in a row: one into L2 per step, in order
        const char* next = reinterpret_cast<const char*>(w2 + (n0 + NB) * K2);
        const bool ahead = rb == RB - 1 && n0 + 2 * NB <= N;
        __m512 total[NB], acc[NB];
        for (int64_t start = 0; start < K2; start += S2) {
            const int64_t stop = std::min(start + S2, K2);
            for (int64_t j = 0; j < NB; ++j) acc[j] = _mm512_setzero_ps();
            if (count == NB) {
                for (int64_t p = start; p < stop; ++p) {
                    if (ahead) _mm_prefetch(next + 64 * p, _MM_HINT_T1);
                    const __m512bh xv = (__m512bh)_mm512_loadu_si512(xr + p * 16);
                    for (int64_t j = 0; j < NB; ++j) {
                        acc[j] = _mm512_dpbf16_ps(acc[j], xv, (__m512bh)_mm512_set1_epi32(w2[(n0 + j) * K2 + p]));
                    }
                }
            } else {
                for (int64_t p = start; p < stop; ++p) {
                    const __m512bh xv = (__m512bh)_mm512_loadu_si512(xr + p * 16);
                    for (int64_t j = 0; j < count; ++j) {
                        acc[j] = _mm512_dpbf16_ps(acc[j], xv, (__m512bh)_mm512_set1_epi32(w2[(n0 + j) * K2 + p]));
                    }
                }
            }
            for (int64_t j = 0; j < NB; ++j) total[j] = start == 0 ? acc[j] : _mm512_add_ps(total[j], acc[j]);
        }
        // lanes are rows: transposed, each row's outputs of this block are one vector, rounded and stored in place
        __m512i rows[16];
        for (int64_t j = 0; j < 16; ++j) rows[j] = _mm512_castps_si512(total[j]);
        transpose16(rows);
        const int64_t live_rows = std::min<int64_t>(16, M - rb * 16);
        const __mmask16 live = static_cast<__mmask16>((1u << count) - 1u);
        for (int64_t r = 0; r < live_rows; ++r) {
            const __m256i rounded = (__m256i)_mm512_cvtneps_pbh(_mm512_castsi512_ps(rows[r]));
            _mm256_mask_storeu_epi16(y + (rb * 16 + r) * ldy + n0, live, rounded);
        }
    }
}
"""


_compiled = None  # the kernel, compiled by inductor's code cache at its first use (a decoding step calls it 121 times)


def _kernel():
    global _compiled
    if _compiled is None:
        from torch._inductor.codecache import CppPythonBindingsCodeCache

        _compiled = CppPythonBindingsCodeCache.load_pybinding(
            ["const at::BFloat16*", "const at::BFloat16*", "at::BFloat16*"] + ["const int64_t"] * 6, _SOURCE)
    return _compiled


def usable(x: torch.Tensor, weights: list[torch.Tensor]) -> bool:
    """Whether the kernel can take this product: bf16, contiguous weights of an even inner size, a few rows."""
    rows = x.numel() // x.shape[-1] if x.shape[-1] else 0
    return (AVX512_BF16 and x.dtype == torch.bfloat16 and 0 < rows <= MAX_ROWS and x.shape[-1] % 2 == 0
            and all(w.dtype == torch.bfloat16 and w.is_contiguous() for w in weights))


def product(x: torch.Tensor, weights: list[torch.Tensor], span: int) -> torch.Tensor:
    """x @ cat(weights).T, the weights' outputs side by side, each summed per `span` inputs."""
    inputs = x.shape[-1]
    rows = x.numel() // inputs
    total = sum(w.shape[0] for w in weights) if len(weights) > 1 else weights[0].shape[0]
    if not x.is_contiguous():
        x = x.contiguous()
    y = x.new_empty(*x.shape[:-1], total)
    kernel, column = _kernel(), 0
    for w in weights:
        kernel(x, w, y, rows, w.shape[0], inputs, total, column, span)
        column += w.shape[0]
    return y


def _candidates(inputs: int) -> list[int]:
    """Spans to try, the likeliest first: oneDNN split 576 inputs per 512 and 1536 or 2048 per 1024 here."""
    likely = inputs if inputs <= 512 else min(1024, 2 ** int(math.log2(inputs)))
    return [likely] + [s for s in (inputs, 512, 1024, 2048, 256) if s != likely and s <= inputs and s % 2 == 0]


def wide_range(*shape: int, generator: torch.Generator | None = None) -> torch.Tensor:
    """Random bf16 values whose magnitudes span 2^-4..2^4 (normal values times a random power of 2): there the order
    in which a product adds its terms shows in its bf16 outputs. The probes here and in decode_softmax use it."""
    normal = torch.randn(*shape, generator=generator)
    return (normal * torch.exp2(torch.randint(-4, 5, shape, generator=generator).float())).bfloat16()


def span_for(rows: int, weights: list[torch.Tensor], onednn_of) -> int | None:
    """The span with which the kernel computes oneDNN's product of these weights (`onednn_of(weights)(x)`) bit for
    bit for `rows` rows of these weights' shapes, or None (a warning says so): found once per shape, on these weights
    and random rows whose magnitudes span 2^-4..2^4, enough of them that another order of the terms shows."""
    key = (rows, tuple(tuple(w.shape) for w in weights))
    if key not in _SPANS:
        _SPANS[key] = _find_span(rows, weights, onednn_of(weights))
    return _SPANS[key]


_SPANS: dict[tuple, int | None] = {}


@torch.no_grad()
def _find_span(rows: int, weights: list[torch.Tensor], onednn) -> int | None:
    inputs, outputs = weights[0].shape[1], sum(w.shape[0] for w in weights)
    generator = torch.Generator().manual_seed(0)
    draws = max(1, min(16, 2**17 // (rows * outputs)))
    x = wide_range(draws, rows, inputs, generator=generator)
    expected = [onednn(x[i]) for i in range(draws)]
    for span in _candidates(inputs):
        if all(torch.equal(product(x[i], weights, span), expected[i]) for i in range(draws)):
            return span
    logger.warning("small-row products: no span makes the kernel compute oneDNN's product of %d rows x %s; "
                   "oneDNN's own product is kept there", rows, [tuple(w.shape) for w in weights])
    return None
