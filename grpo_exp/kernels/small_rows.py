"""bf16 products of a few rows (a decoding step's Linear layers) as a C++ kernel that reads the plain weight in place
and computes what oneDNN's packed product computes, bit for bit.

Why: at 16 rows, oneDNN's packed bf16 product of the default model's layers took about 20 ms per decoding step with
the weights streamed from memory, against about 15 ms for this kernel (a one-off chain of the model's 121 products,
2 cores, native bf16 (avx512_bf16/amx; lscpu: avx512_bf16, no amx_bf16); docs/performance.md, "Packed weights and small-row products"). And it needs no
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

# C++ shared with core/decode_attention.py's attention kernel: the target attribute for AVX512-BF16 code, and a 16 x 16
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


# The fp32 kernel, for a CPU whose torch kernels are AVX2's (no AVX-512, or held to AVX2): rows in the lanes again, 8
# rows a vector, each weight broadcast, one fused multiply-add chain per output over its inputs from 0. MKL's fp32
# product (what torch computes there) sums a few rows' outputs the same way, per 192 inputs, each span's sum added to
# those before (4-64 rows, the default model's shapes; AMD EPYC, AVX2 only, MKL 2024.2; measured here), and at 16
# rows it reached about a quarter of the machine's fp32 GEMM peak (2 cores, AVX2 only; docs/performance.md, "Packed weights and small-row products"). 1-3
# rows take MKL's other path, whose order span_for finds no span for: MKL's product is kept there.
F32_AVX2 = torch.backends.cpu.get_cpu_capability() == "AVX2"

_F32_SOURCE = r"""
#include <torch/csrc/inductor/cpp_prefix.h>
#include <immintrin.h>
#define F32_TARGET __attribute__((target("avx2,fma")))

// 16 rows a block, two vectors of 8; NB = 6 weight rows a block: 12 accumulators of 16 registers. (A block of 8 rows
// and 12 weight rows ran 8 rows at about a third of this one's rate: its 12 weight pointers left too few registers.)
F32_TARGET static void product(const float* xt, const float* w, float* y, const int64_t M, const int64_t N,
                               const int64_t K, const int64_t ldy, const int64_t span)
{
    constexpr int64_t NB = 6, RV = 2, ROWS = 8 * RV;
    const int64_t RB = (M + ROWS - 1) / ROWS, blocks = (N + NB - 1) / NB;
    #pragma omp parallel for schedule(static)
    for (int64_t t = 0; t < blocks * RB; ++t) {
        const int64_t nb = t / RB, rb = t % RB, n0 = nb * NB, count = std::min(NB, N - n0);
        const float* xr = xt + rb * K * ROWS;
        const float* wr[NB];
        for (int64_t j = 0; j < NB; ++j) wr[j] = w + (n0 + std::min(j, count - 1)) * K;  // past N: a row again
        // the next block's NB weight rows are NB * K floats in a row: NB / 2 cache lines into L2 per 8 steps
        const char* next = reinterpret_cast<const char*>(w + (n0 + NB) * K);
        const bool ahead = rb == RB - 1 && n0 + 2 * NB <= N;
        __m256 total[NB][RV], acc[NB][RV];
        for (int64_t start = 0; start < K; start += span) {
            const int64_t stop = std::min(start + span, K);
            for (int64_t j = 0; j < NB; ++j)
                for (int v = 0; v < RV; ++v) acc[j][v] = _mm256_setzero_ps();
            for (int64_t k = start; k < stop; ++k) {
                if (ahead && (k & 7) == 0)
                    for (int64_t l = 0; l < NB / 2; ++l) _mm_prefetch(next + (k / 8) * NB * 32 + 64 * l, _MM_HINT_T1);
                __m256 xv[RV];
                for (int v = 0; v < RV; ++v) xv[v] = _mm256_loadu_ps(xr + k * ROWS + 8 * v);
                for (int64_t j = 0; j < NB; ++j) {
                    const __m256 b = _mm256_broadcast_ss(wr[j] + k);
                    for (int v = 0; v < RV; ++v) acc[j][v] = _mm256_fmadd_ps(xv[v], b, acc[j][v]);
                }
            }
            for (int64_t j = 0; j < NB; ++j)
                for (int v = 0; v < RV; ++v)
                    total[j][v] = start == 0 ? acc[j][v] : _mm256_add_ps(total[j][v], acc[j][v]);
        }
        alignas(32) float out[NB][ROWS];
        for (int64_t j = 0; j < NB; ++j)
            for (int v = 0; v < RV; ++v) _mm256_store_ps(out[j] + 8 * v, total[j][v]);
        const int64_t live_rows = std::min<int64_t>(ROWS, M - rb * ROWS);
        for (int64_t r = 0; r < live_rows; ++r)
            for (int64_t j = 0; j < count; ++j) y[(rb * ROWS + r) * ldy + n0 + j] = out[j][r];
    }
}

// y [M, ldy] (N columns from `column`) = x [M, K] @ w [N, K]^T, fp32: each output a chain of fused multiply-adds
// over K from 0, per `span` terms, each span's sum added to those before. xt: room for 16 * ceil(M / 16) * K floats
extern "C" F32_TARGET void kernel(const float* x, const float* w, float* y, float* xt, const int64_t M,
                                  const int64_t N, const int64_t K, const int64_t ldy, const int64_t column,
                                  const int64_t span)
{
    constexpr int64_t ROWS = 16;
    const int64_t RB = (M + ROWS - 1) / ROWS;
    // x's columns, ROWS rows a group: xt[(rb * K + k) * ROWS + r] = x[rb * ROWS + r, k], 0 past the last row
    for (int64_t rb = 0; rb < RB; ++rb)
        for (int64_t r = 0; r < ROWS; ++r) {
            const int64_t m = rb * ROWS + r;
            float* const to = xt + rb * K * ROWS + r;
            if (m < M) {
                const float* from = x + m * K;
                for (int64_t k = 0; k < K; ++k) to[k * ROWS] = from[k];
            } else {
                for (int64_t k = 0; k < K; ++k) to[k * ROWS] = 0.f;
            }
        }
    product(xt, w, y + column, M, N, K, ldy, span);
}
"""

_compiled: dict[torch.dtype, object] = {}  # dtype -> its kernel, compiled by inductor's code cache at its first use


def _kernel(dtype: torch.dtype):
    if dtype not in _compiled:
        from torch._inductor.codecache import CppPythonBindingsCodeCache

        # the fp32 kernel lays the rows out in a buffer it is handed, freed after the call: one kept by the kernel
        # would be a small block pinned in the heap wherever the first call found room
        pointers = (["const at::BFloat16*", "const at::BFloat16*", "at::BFloat16*"] if dtype == torch.bfloat16
                    else ["const float*", "const float*", "float*", "float*"])
        _compiled[dtype] = CppPythonBindingsCodeCache.load_pybinding(
            pointers + ["const int64_t"] * 6, _SOURCE if dtype == torch.bfloat16 else _F32_SOURCE)
    return _compiled[dtype]


def applies(dtype: torch.dtype) -> bool:
    """Whether products of this dtype take a kernel here: bf16 on AVX512-BF16 without AMX, fp32 where torch's kernels
    are AVX2's."""
    return (dtype == torch.bfloat16 and AVX512_BF16) or (dtype == torch.float32 and F32_AVX2)


def usable(x: torch.Tensor, weights: list[torch.Tensor]) -> bool:
    """Whether a kernel can take this product here: bf16 (of an even inner size) or fp32 as `applies` says,
    contiguous weights of the same dtype, a few rows."""
    rows = x.numel() // x.shape[-1] if x.shape[-1] else 0
    return (applies(x.dtype) and 0 < rows <= MAX_ROWS and (x.dtype != torch.bfloat16 or x.shape[-1] % 2 == 0)
            and all(w.dtype == x.dtype and w.is_contiguous() for w in weights))


def product(x: torch.Tensor, weights: list[torch.Tensor], span: int) -> torch.Tensor:
    """x @ cat(weights).T, the weights' outputs side by side, each summed per `span` inputs."""
    inputs = x.shape[-1]
    rows = x.numel() // inputs
    total = sum(w.shape[0] for w in weights) if len(weights) > 1 else weights[0].shape[0]
    if not x.is_contiguous():
        x = x.contiguous()
    y = x.new_empty(*x.shape[:-1], total)
    kernel, column = _kernel(x.dtype), 0
    scratch = (x.new_empty(-(-rows // 16) * 16 * inputs),) if x.dtype == torch.float32 else ()
    for w in weights:
        kernel(x, w, y, *scratch, rows, w.shape[0], inputs, total, column, span)
        column += w.shape[0]
    return y


def _candidates(inputs: int, dtype: torch.dtype) -> list[int]:
    """Spans to try, the likeliest first: oneDNN split bf16 sums of 576 inputs per 512 and 1536 or 2048 per 1024 here;
    MKL's fp32 sums, per 192."""
    if dtype == torch.float32:
        likely = min(192, inputs)
        return [likely] + [s for s in (inputs, 256, 128, 384, 512) if s != likely and s <= inputs]
    likely = inputs if inputs <= 512 else min(1024, 2 ** int(math.log2(inputs)))
    return [likely] + [s for s in (inputs, 512, 1024, 2048, 256) if s != likely and s <= inputs and s % 2 == 0]


def wide_range(*shape: int, generator: torch.Generator | None = None,
               dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """Random values of `dtype` whose magnitudes span 2^-4..2^4 (normal values times a random power of 2): there the
    order in which a product adds its terms shows in its outputs. The probes here and in decode_softmax use it."""
    normal = torch.randn(*shape, generator=generator)
    return (normal * torch.exp2(torch.randint(-4, 5, shape, generator=generator).float())).to(dtype)


def span_for(rows: int, weights: list[torch.Tensor], library_of) -> int | None:
    """The span with which the kernel computes the library's product of weights of these shapes (`library_of(ws)(x)`:
    oneDNN's for bf16, MKL's for fp32) bit for bit for `rows` rows, or None (a warning says so): found once per
    shape, on random weights and rows whose magnitudes span 2^-4..2^4, enough of them that another order of the
    terms shows. Not on the layer's own weights: weights all zero (a fresh LoRA B, say) or too even would let any
    order pass, and the span found is kept for the shape and the thread count (the library may split its sums
    otherwise under another count, and a sweep over cpu.threads runs in one process)."""
    key = (rows, weights[0].dtype, tuple(tuple(w.shape) for w in weights), torch.get_num_threads())
    if key not in _SPANS:
        _SPANS[key] = _find_span(rows, weights, library_of)
    return _SPANS[key]


_SPANS: dict[tuple, int | None] = {}


def _random_like(weight: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """wide_range values in a weight's shape and dtype, made 4096 rows at a time (the LM head's whole draw would
    take about 0.5 GB of temporaries)."""
    out = torch.empty(weight.shape, dtype=weight.dtype)
    for start in range(0, weight.shape[0], 4096):
        part = out[start:start + 4096]
        part.copy_(wide_range(*part.shape, generator=generator, dtype=weight.dtype))
    return out


@torch.no_grad()
def _find_span(rows: int, shapes: list[torch.Tensor], library_of) -> int | None:
    inputs, outputs, dtype = shapes[0].shape[1], sum(w.shape[0] for w in shapes), shapes[0].dtype
    generator = torch.Generator().manual_seed(0)
    weights = [_random_like(w, generator) for w in shapes]
    library = library_of(weights)
    draws = max(1, min(16, 2**17 // (rows * outputs)))
    x = wide_range(draws, rows, inputs, generator=generator, dtype=dtype)
    expected = [library(x[i]) for i in range(draws)]
    for span in _candidates(inputs, dtype):
        if all(torch.equal(product(x[i], weights, span), expected[i]) for i in range(draws)):
            return span
    # 1-3 fp32 rows take MKL's matrix-vector path, which no span matches: expected, so not a warning there
    say = logger.debug if dtype == torch.float32 and rows < 4 else logger.warning
    say("small-row products: no span makes the kernel compute the library's %s product of %d rows x %s; its own "
        "product is kept there", str(dtype).replace("torch.", ""), rows, [tuple(w.shape) for w in weights])
    return None
