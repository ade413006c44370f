"""A decoding step's grouped-attention softmax as one C++ kernel that computes, bit for bit, what inductor's own
kernel for it computes; and, in bf16, the whole attention of the step as one kernel (decode_attention).

Why: grouped attention (kernels/attention.py) takes a decoding step's scores as [rows, kv heads, L, g], with the g
query heads that share a key/value head innermost. For a softmax along L of that layout, inductor's CPU code opens
one parallel region per (row, key/value head), splits L between the threads, and loads masked 3-wide vectors: about
a sixth of the rollout engine's compiled decoding step for the default model (216 us per layer at 16 rows; docs/log.md,
"2026-11-29 — the decoding softmax as one kernel"). Taking the softmax along the last axis instead was faster and
changed the rounding, and runs trained with it scored lower on six seeds (speed.attention_decode=last_axis).

This kernel runs one parallel loop over (row, key/value head) and repeats inductor's arithmetic: each score plus
its mask in fp32, the maxima, the exponentials through at::vec's exp (inductor's, compiled with inductor's own flags
by its code cache), each sum in the order inductor's kernel adds (from 0, in L order, split into one chunk per
thread where inductor splits the sum between threads: `sum_chunks`), and the division, rounded to the scores' dtype.
It is used only inside a compiled decoding step, where inductor's kernel is what it replaces (eager attention runs
torch's own kernels, which round otherwise), and only where `sum_chunks` knows inductor's choice. Tests compare it
with inductor's kernel on fp32 outputs, where a different order of any sum shows (tests/kernels/test_decode_attention.py).

`decode_attention` goes one step further for a bf16 copy on a CPU with AVX512-BF16: the whole attention of a
decoding step, key @ query^T, this softmax and probs^T @ value, in one kernel per (row, key/value head). Composed
of torch's products, the step spent about 190 us per layer in two bmm calls and the softmax at 16 rows of the
default model; bmm's fixed cost per call is most of that. The kernel repeats oneDNN's bf16 products bit for bit:
each output summed over the inner axis two terms at a time from 0 by vdpbf16ps, rounded to bf16 once, and a value
product over more than VALUE_SPAN rows summed per span. It skips the static cache's masked tail, whose terms are
exactly 0. Before the op uses the kernel at a new size it checks it against the composed products on random values
(`agrees`; elsewhere, say a CPU whose oneDNN adds in another order, the op composes torch's products itself).
"""

from __future__ import annotations

import functools

import torch

from grpo_exp.base import log
from grpo_exp.kernels import small_rows

logger = log.get_logger(__name__)

enabled = True  # tests turn it off to compile inductor's own kernel for comparison

_LIB = torch.library.Library("grpo_exp", "FRAGMENT")
_LIB.define("decode_softmax(Tensor scores, Tensor mask, float scaling, int chunks) -> Tensor")
_LIB.define("decode_attention(Tensor query, Tensor key, Tensor value, Tensor mask, float scaling, int chunks) "
            "-> Tensor")

_C_TYPES = {torch.bfloat16: "at::BFloat16", torch.float32: "float"}
# oneDNN's bf16 products (torch 2.13, AVX512-BF16, measured here) add an inner axis longer than this many terms as a
# sum per this many, each from 0, added to the sum of those before: decode_attention's value product does the same
VALUE_SPAN = 512
_AVX512_BF16 = small_rows.AVX512_BF16  # where oneDNN's bf16 products add in the order the kernel repeats
# The torch release whose inductor kernel sum_chunks describes and the kernel repeats (pyproject pins it). Under
# torch 2.11 (a GPU machine's image) inductor's softmax rounded otherwise in 1 of the test's 7 cases on an AVX2 CPU
# and 4 on an AVX-512 one, so under another release the compiled step keeps inductor's own kernel.
CHECKED_TORCH = "2.13."

# One (row, key/value head)'s softmax: scores s [length, G], mask m [length], probs out [length, G]; x and e
# are scratch of length * G floats. Only the first `valid` positions are read and written: decode_attention passes
# the positions before the mask's masked tail, whose terms are exactly 0 (valid_length), and the sums keep
# inductor's split of the whole length.
_SOFTMAX_HEAD = r"""
template <typename S, typename M, typename P, int64_t G>
static inline void softmax_head(const S* s, const M* m, P* out, const int64_t length, const int64_t valid,
                                const float scaling, const int64_t chunks, float* x, float* e)
{
    const int64_t n = valid * G;
    constexpr int64_t vec = at::vec::Vectorized<float>::size();
    float max1[G], max2[G], total[G];
    bool bad[G];
    for (int64_t j = 0; j < G; ++j) {
        max1[j] = max2[j] = -std::numeric_limits<float>::infinity();
        bad[j] = false;
    }
    for (int64_t l = 0; l < valid; ++l) {
        const float mv = static_cast<float>(m[l]);
        for (int64_t j = 0; j < G; ++j) {
            const float v = static_cast<float>(s[l * G + j]) + mv;
            const float vs = v * scaling;
            x[l * G + j] = v;
            bad[j] = bad[j] || !((vs == vs) && (std::abs(vs) != std::numeric_limits<float>::infinity()));
            max1[j] = max_propagate_nan(max1[j], v * 1.0f);
            max2[j] = max_propagate_nan(max2[j], vs);
        }
    }
    // inductor's two forms of softmax(v * scaling): (v - max v) * scaling unless a scaled score is not finite
    for (int64_t l = 0; l < valid; ++l) {
        for (int64_t j = 0; j < G; ++j) {
            const float v = x[l * G + j];
            x[l * G + j] = bad[j] ? v * scaling - max2[j] : (v * 1.0f - max1[j]) * scaling;
        }
    }
    for (int64_t i = 0; i < n; i += vec) {  // lane by lane: any grouping of lanes gives the same values
        const int64_t count = std::min(vec, n - i);
        at::vec::Vectorized<float>::loadu(x + i, count).exp().store(e + i, count);
    }
    // each sum as inductor's kernel adds it: a chunk per thread of an OpenMP static schedule, each from 0
    for (int64_t j = 0; j < G; ++j) total[j] = 0.0f;
    const int64_t base = length / chunks, extra = length % chunks;
    int64_t begin = 0;
    for (int64_t c = 0; c < chunks; ++c) {
        const int64_t end = begin + base + (c < extra ? 1 : 0);
        float part[G];
        for (int64_t j = 0; j < G; ++j) part[j] = 0.0f;
        for (int64_t l = begin; l < std::min(end, valid); ++l) {
            for (int64_t j = 0; j < G; ++j) part[j] = part[j] + e[l * G + j];
        }
        for (int64_t j = 0; j < G; ++j) total[j] = total[j] + part[j];
        begin = end;
    }
    for (int64_t l = 0; l < valid; ++l) {
        for (int64_t j = 0; j < G; ++j) out[l * G + j] = c10::convert<P>(e[l * G + j] / total[j]);
    }
}
"""

_SOURCE = "#include <torch/csrc/inductor/cpp_prefix.h>\n" + _SOFTMAX_HEAD + r"""
// scores [heads, length, G] (one head: a row's key/value head), mask [rows, length], probs like scores
extern "C" void kernel(const SCALAR* scores, const MASK* mask, PROB* probs, const int64_t heads,
                       const int64_t kv, const int64_t length, const float scaling, const int64_t chunks)
{
    const int64_t n = length * GROUP;
    #pragma omp parallel
    {
        std::vector<float> x(n), e(n);
        #pragma omp for
        for (int64_t h = 0; h < heads; ++h) {
            softmax_head<SCALAR, MASK, PROB, GROUP>(scores + h * n, mask + (h / kv) * length, probs + h * n, length,
                                                    length, scaling, chunks, x.data(), e.data());
        }
    }
}
"""

# A decoding step's whole grouped attention for one query position, bf16 throughout: the two products as oneDNN's
# bf16 bmm computes them on a CPU with AVX512-BF16 (each output a sum over the inner axis taken two terms at a time
# from 0, (k, k+1) by vdpbf16ps, rounded to bf16 once) and the softmax between them as softmax_head.
#
# Positions after the last one the mask lets through (the static cache's unfilled tail) are skipped: there the
# mask is the dtype's lowest value, the softmax's term is exp of about -1e37, exactly 0, and so is each product
# term it weighs, so skipping them leaves every sum as it was.
_ATTENTION_SOURCE = small_rows.BF16_HEADER + _SOFTMAX_HEAD + r"""
// the positions up to and including the last one the mask lets through (all of them where it lets none through)
template <typename M> static inline int64_t valid_length(const M* m, const int64_t length)
{
    int64_t valid = length;
    while (valid > 0 && static_cast<float>(m[valid - 1]) < -1e30f) --valid;
    return valid > 0 ? valid : length;
}

// query [heads, G, D], key and value [heads, length, D], mask [rows, length], out [heads, G, D]
extern "C" BF16_TARGET
void kernel(const at::BFloat16* query, const at::BFloat16* key, const at::BFloat16* value, const MASK* mask,
            at::BFloat16* out, const int64_t heads, const int64_t kv, const int64_t length, const float scaling,
            const int64_t chunks)
{
    constexpr int64_t G = GROUP, D = DIM, PAIRS = D / 2, BLOCKS = D / 32, SPAN = ROWS_PER_SUM;
    static_assert(SPAN % 2 == 0, "a pair of value rows never straddles two sums");
    static_assert(D % 32 == 0, "the products take 32 columns (16 pairs) at a time");
    // (row l, row l + 1) interleaved column by column: the pairs vdpbf16ps multiplies for 16 output columns
    alignas(64) static const int16_t low_pairs[32] = {0, 32, 1, 33, 2, 34, 3, 35, 4, 36, 5, 37, 6, 38, 7, 39,
        8, 40, 9, 41, 10, 42, 11, 43, 12, 44, 13, 45, 14, 46, 15, 47};
    alignas(64) static const int16_t high_pairs[32] = {16, 48, 17, 49, 18, 50, 19, 51, 20, 52, 21, 53, 22, 54,
        23, 55, 24, 56, 25, 57, 26, 58, 27, 59, 28, 60, 29, 61, 30, 62, 31, 63};
    const __m512i low = _mm512_load_si512(low_pairs), high = _mm512_load_si512(high_pairs);
    const int64_t n = length * G;
    #pragma omp parallel
    {
        std::vector<float> x(n), e(n);
        std::vector<at::BFloat16> scores(n), probs(n);
        #pragma omp for
        for (int64_t h = 0; h < heads; ++h) {
            const MASK* m = mask + (h / kv) * length;
            const int64_t valid = valid_length(m, length);
            const at::BFloat16* k = key + h * length * D;
            const uint32_t* q2 = reinterpret_cast<const uint32_t*>(query + h * G * D);
            // scores [valid, G] = key @ query^T: 16 key rows at a time, their (d, d + 1) pairs transposed into
            // one vector per pair
            for (int64_t l0 = 0; l0 < valid; l0 += 16) {
                const int64_t count = std::min<int64_t>(16, valid - l0);
                __m512 acc[G];
                for (int64_t i = 0; i < G; ++i) acc[i] = _mm512_setzero_ps();
                for (int64_t block = 0; block < PAIRS / 16; ++block) {
                    __m512i pairs[16];
                    for (int64_t t = 0; t < 16; ++t) {
                        pairs[t] = t < count ? _mm512_loadu_si512(k + (l0 + t) * D + 32 * block)
                                             : _mm512_setzero_si512();
                    }
                    transpose16(pairs);
                    for (int64_t p = 0; p < 16; ++p) {
                        for (int64_t i = 0; i < G; ++i) {
                            const __m512bh qp = (__m512bh)_mm512_set1_epi32(q2[i * PAIRS + 16 * block + p]);
                            acc[i] = _mm512_dpbf16_ps(acc[i], (__m512bh)pairs[p], qp);
                        }
                    }
                }
                for (int64_t i = 0; i < G; ++i) {
                    alignas(32) uint16_t rounded[16];
                    _mm256_store_si256(reinterpret_cast<__m256i*>(rounded), (__m256i)_mm512_cvtneps_pbh(acc[i]));
                    for (int64_t t = 0; t < count; ++t) {
                        scores[(l0 + t) * G + i] = c10::BFloat16(rounded[t], c10::BFloat16::from_bits());
                    }
                }
            }
            softmax_head<at::BFloat16, MASK, at::BFloat16, G>(scores.data(), m, probs.data(), length, valid, scaling,
                                                              chunks, x.data(), e.data());
            // out [G, D] = probs^T @ value, two value rows a step (a zero row after an odd last one), summed as
            // oneDNN sums a long inner axis: a sum per SPAN rows from 0, each added to the sum of those before
            const at::BFloat16* v = value + h * length * D;
            const uint16_t* pb = reinterpret_cast<const uint16_t*>(probs.data());
            __m512 total[G][2 * BLOCKS], acc[G][2 * BLOCKS];
            for (int64_t start = 0; start < valid; start += SPAN) {
                const int64_t stop = std::min(start + SPAN, valid);
                for (int64_t i = 0; i < G; ++i) {
                    for (int64_t c = 0; c < 2 * BLOCKS; ++c) acc[i][c] = _mm512_setzero_ps();
                }
                for (int64_t l = start; l < stop; l += 2) {
                    const bool pair = l + 1 < stop;
                    __m512i cols[2 * BLOCKS];
                    for (int64_t c = 0; c < BLOCKS; ++c) {
                        const __m512i a = _mm512_loadu_si512(v + l * D + 32 * c);
                        const __m512i b = pair ? _mm512_loadu_si512(v + (l + 1) * D + 32 * c) : _mm512_setzero_si512();
                        cols[2 * c] = _mm512_permutex2var_epi16(a, low, b);
                        cols[2 * c + 1] = _mm512_permutex2var_epi16(a, high, b);
                    }
                    for (int64_t i = 0; i < G; ++i) {
                        const uint32_t next = pair ? static_cast<uint32_t>(pb[(l + 1) * G + i]) : 0u;
                        const uint32_t w = pb[l * G + i] | next << 16;
                        const __m512bh weights = (__m512bh)_mm512_set1_epi32(static_cast<int>(w));
                        for (int64_t c = 0; c < 2 * BLOCKS; ++c) {
                            acc[i][c] = _mm512_dpbf16_ps(acc[i][c], (__m512bh)cols[c], weights);
                        }
                    }
                }
                for (int64_t i = 0; i < G; ++i) {
                    for (int64_t c = 0; c < 2 * BLOCKS; ++c) {
                        total[i][c] = start == 0 ? acc[i][c] : _mm512_add_ps(total[i][c], acc[i][c]);
                    }
                }
            }
            at::BFloat16* o = out + h * G * D;
            for (int64_t i = 0; i < G; ++i) {
                for (int64_t c = 0; c < 2 * BLOCKS; ++c) {
                    _mm256_storeu_si256(reinterpret_cast<__m256i*>(o + i * D + 16 * c),
                                        (__m256i)_mm512_cvtneps_pbh(total[i][c]));
                }
            }
        }
    }
}
"""

@functools.lru_cache(maxsize=None)
def _kernel(scalar: torch.dtype, mask: torch.dtype, group: int, prob: torch.dtype):
    """The kernel for these dtypes and group size, compiled once by inductor's code cache (with its flags)."""
    from torch._inductor.codecache import CppPythonBindingsCodeCache

    source = (_SOURCE.replace("SCALAR", _C_TYPES[scalar]).replace("MASK", _C_TYPES[mask])
              .replace("PROB", _C_TYPES[prob]).replace("GROUP", str(group)))
    argtypes = [f"const {_C_TYPES[scalar]}*", f"const {_C_TYPES[mask]}*", f"{_C_TYPES[prob]}*",
                "const int64_t", "const int64_t", "const int64_t", "const float", "const int64_t"]
    return CppPythonBindingsCodeCache.load_pybinding(argtypes, source)


def decode_softmax(scores: torch.Tensor, mask: torch.Tensor, scaling: float, chunks: int,
                   out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """softmax((scores + mask) * scaling) along L, in scores' dtype (or `out_dtype`: tests take the fp32 values,
    before rounding); scores [b, kv, L, g], mask [b, 1, 1, L]."""
    b, kv, length, group = scores.shape
    scores = scores.contiguous()
    mask = mask.expand(b, 1, 1, length).contiguous()
    probs = torch.empty_like(scores, dtype=out_dtype or scores.dtype)
    _kernel(scores.dtype, mask.dtype, group, probs.dtype)(scores, mask, probs, b * kv, kv, length, scaling, chunks)
    return probs


def _decode_softmax_op(scores: torch.Tensor, mask: torch.Tensor, scaling: float, chunks: int) -> torch.Tensor:
    return decode_softmax(scores, mask, scaling, chunks)


_LIB.impl("decode_softmax", _decode_softmax_op, "CPU")


@torch.library.register_fake("grpo_exp::decode_softmax")
def _decode_softmax_shape(scores, mask, scaling, chunks):
    return torch.empty_like(scores, memory_format=torch.contiguous_format)



@functools.lru_cache(maxsize=None)
def _attention_kernel(mask: torch.dtype, group: int, dim: int, span: int):
    """The whole attention's kernel for this mask dtype, group size and head size, the value product summed per
    `span` rows (compiled once, as _kernel)."""
    from torch._inductor.codecache import CppPythonBindingsCodeCache

    source = (_ATTENTION_SOURCE.replace("MASK", _C_TYPES[mask]).replace("GROUP", str(group))
              .replace("DIM", str(dim)).replace("ROWS_PER_SUM", str(span)))
    argtypes = ["const at::BFloat16*"] * 3 + [f"const {_C_TYPES[mask]}*", "at::BFloat16*", "const int64_t",
                                              "const int64_t", "const int64_t", "const float", "const int64_t"]
    return CppPythonBindingsCodeCache.load_pybinding(argtypes, source)


def decode_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: torch.Tensor, scaling: float,
                     chunks: int) -> torch.Tensor:
    """softmax((key @ query^T + mask) * scaling)^T @ value for one query position, all bf16: query [b, kv, g, d],
    key and value [b, kv, L, d], mask [b, 1, 1, L]; [b, kv, g, d] out. The numbers of `composed_attention` (what
    grouped attention's compiled decoding step computes without this op), by one kernel where a probe found the
    kernel computing them bit for bit on this machine at these sizes (`agrees`); by composed_attention elsewhere."""
    b, kv, length, dim = key.shape
    group = query.shape[2]
    if not agrees(mask.dtype, group, dim, length, chunks):
        return composed_attention(query, key, value, mask, scaling, chunks)
    return _run_attention(query, key, value, mask, scaling, chunks, VALUE_SPAN)


def _run_attention(query, key, value, mask, scaling: float, chunks: int, span: int) -> torch.Tensor:
    b, kv, length, dim = key.shape
    group = query.shape[2]
    mask = mask.expand(b, 1, 1, length).contiguous()
    out = query.new_empty(b, kv, group, dim)
    _attention_kernel(mask.dtype, group, dim, span)(query.contiguous(), key.contiguous(), value.contiguous(), mask,
                                                    out, b * kv, kv, length, scaling, chunks)
    return out


def composed_attention(query, key, value, mask, scaling: float, chunks: int) -> torch.Tensor:
    """What decode_attention computes, op by op: torch's two products (oneDNN's on a CPU) around decode_attention."""
    scores = torch.matmul(key, query.transpose(2, 3))
    probs = decode_softmax(scores, mask, scaling, chunks)
    return torch.matmul(probs.transpose(2, 3), value)


@functools.lru_cache(maxsize=None)
def agrees(mask_dtype: torch.dtype, group: int, dim: int, length: int, chunks: int, span: int | None = None) -> bool:
    """Whether the kernel (its value product summed per `span` rows; default VALUE_SPAN) computes composed_attention
    bit for bit at these sizes on this machine, checked once: a probe of enough heads of bf16 values over a wide range
    of magnitudes that another order of a product's terms shows (tests/kernels/test_decode_attention.py). Where it does
    not, a warning says so and the op composes torch's products instead."""
    span = span or VALUE_SPAN
    heads = max(8, min(2**17 // (group * dim), 2**24 // (length * dim)))
    generator = torch.Generator().manual_seed(0)
    # queries 64 times smaller: moderate scores, so the softmax spreads its weight over many value rows, where the
    # value product's order of terms shows
    query = (small_rows.wide_range(heads, 1, group, dim, generator=generator).float() / 64).bfloat16()
    key = small_rows.wide_range(heads, 1, length, dim, generator=generator)
    value = small_rows.wide_range(heads, 1, length, dim, generator=generator)
    mask = torch.zeros(heads, 1, 1, length, dtype=mask_dtype)
    scaling = dim ** -0.5
    same = torch.equal(_run_attention(query, key, value, mask, scaling, chunks, span),
                       composed_attention(query, key, value, mask, scaling, chunks))
    if not same and span == VALUE_SPAN:
        logger.warning("decode_attention: on this machine torch's bf16 products add their terms in another order than "
                       "the kernel at group %d, head size %d, length %d; the decoding step composes torch's products "
                       "instead", group, dim, length)
    return same


_LIB.impl("decode_attention", decode_attention, "CPU")


@torch.library.register_fake("grpo_exp::decode_attention")
def _decode_attention_shape(query, key, value, mask, scaling, chunks):
    return query.new_empty(query.shape)


def checked_torch(version: str = torch.__version__) -> bool:
    """Whether a torch release is the one whose inductor kernel this module repeats (CHECKED_TORCH)."""
    return str(version).startswith(CHECKED_TORCH)


# read once here: sum_chunks runs while dynamo traces a decoding step
TORCH_CHECKED = checked_torch()


@torch._dynamo.assume_constant_result  # called while dynamo traces the decoding step: a constant of the graph
def sum_chunks(heads: int, group: int, length: int) -> int | None:
    """Into how many chunks inductor's kernel for this softmax splits each sum along L (one per thread, when it
    parallelizes the sum), or None where this module does not know (the attention then keeps inductor's kernel).

    Inductor (torch 2.13, codegen/cpp.py: max_parallel_depth, decide_parallel_depth) parallelizes a reduction
    along L when the loops outside it make no whole vector step (g narrower than a float vector) and each
    thread's share of the kernel's iterations reaches cpp.min_chunk_size. None under another torch release
    (CHECKED_TORCH)."""
    from torch._inductor import config
    from torch._inductor.cpu_vec_isa import VecAVX2, VecAVX512, pick_vec_isa
    from torch._inductor.utils import parallel_num_threads

    if not TORCH_CHECKED:
        return None
    isa = pick_vec_isa()  # checked on x86 (AVX-512, and AVX2 through ATEN_CPU_CAPABILITY=avx2) alone
    if not isinstance(isa, (VecAVX2, VecAVX512)) or group >= isa.nelements(torch.float):
        return None
    threads = parallel_num_threads()
    if threads <= 1 or heads * group * length // threads < config.cpp.min_chunk_size:
        return 1
    return threads


def usable(scores_dtype: torch.dtype, mask: torch.Tensor | None, device: torch.device) -> bool:
    """Whether a compiled decoding step's softmax can go through this kernel."""
    return (enabled and device.type == "cpu" and mask is not None and scores_dtype in _C_TYPES
            and mask.dtype in _C_TYPES and torch.compiler.is_compiling())


def attention_usable(dtype: torch.dtype, head_dim: int) -> bool:
    """Whether a compiled decoding step's whole attention can go through decode_attention: bf16 on a CPU whose
    bf16 products are oneDNN's AVX512-BF16 ones (the order the kernel repeats), head size a multiple of 32."""
    return dtype == torch.bfloat16 and head_dim % 32 == 0 and _AVX512_BF16
