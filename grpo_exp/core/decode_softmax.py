"""A decoding step's grouped-attention softmax as one C++ kernel that computes, bit for bit, what inductor's own
kernel for it computes.

Why: grouped attention (core/attention.py) takes a decoding step's scores as [rows, kv heads, L, g], with the g
query heads that share a key/value head innermost. For a softmax along L of that layout, inductor's CPU code opens
one parallel region per (row, key/value head), splits L between the threads, and loads masked 3-wide vectors: about
a sixth of the rollout engine's compiled decoding step for the default model (216 us per layer at 16 rows; README,
Performance, "The decoding softmax as one kernel"). Taking the softmax along the last axis instead was faster and
changed the rounding, and runs trained with it scored lower on six seeds (train.attention_decode=last_axis).

This kernel runs one parallel loop over (row, key/value head) and repeats inductor's arithmetic: each score plus
its mask in fp32, the maxima, the exponentials through at::vec's exp (inductor's, compiled with inductor's own flags
by its code cache), each sum in the order inductor's kernel adds (from 0, in L order, split into one chunk per
thread where inductor splits the sum between threads: `sum_chunks`), and the division, rounded to the scores' dtype.
It is used only inside a compiled decoding step, where inductor's kernel is what it replaces (eager attention runs
torch's own kernels, which round otherwise), and only where `sum_chunks` knows inductor's choice. Tests compare it
with inductor's kernel on fp32 outputs, where a different order of any sum shows (tests/core/test_decode_softmax.py).
"""

from __future__ import annotations

import functools

import torch

enabled = True  # tests turn it off to compile inductor's own kernel for comparison

_LIB = torch.library.Library("grpo_exp", "FRAGMENT")
_LIB.define("decode_softmax(Tensor scores, Tensor mask, float scaling, int chunks) -> Tensor")

_C_TYPES = {torch.bfloat16: "at::BFloat16", torch.float32: "float"}

_SOURCE = r"""
#include <torch/csrc/inductor/cpp_prefix.h>
// scores [heads, length, G] (one head: a row's key/value head), mask [rows, length], probs like scores
extern "C" void kernel(const SCALAR* scores, const MASK* mask, PROB* probs, const int64_t heads,
                       const int64_t kv, const int64_t length, const float scaling, const int64_t chunks)
{
    constexpr int64_t G = GROUP;
    const int64_t n = length * G;
    constexpr int64_t vec = at::vec::Vectorized<float>::size();
    #pragma omp parallel
    {
        std::vector<float> x(n), e(n);
        #pragma omp for
        for (int64_t h = 0; h < heads; ++h) {
            const SCALAR* s = scores + h * n;
            const MASK* m = mask + (h / kv) * length;
            float max1[G], max2[G], total[G];
            bool bad[G];
            for (int64_t j = 0; j < G; ++j) {
                max1[j] = max2[j] = -std::numeric_limits<float>::infinity();
                bad[j] = false;
            }
            for (int64_t l = 0; l < length; ++l) {
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
            for (int64_t l = 0; l < length; ++l) {
                for (int64_t j = 0; j < G; ++j) {
                    const float v = x[l * G + j];
                    x[l * G + j] = bad[j] ? v * scaling - max2[j] : (v * 1.0f - max1[j]) * scaling;
                }
            }
            for (int64_t i = 0; i < n; i += vec) {  // lane by lane: any grouping of lanes gives the same values
                const int64_t count = std::min(vec, n - i);
                at::vec::Vectorized<float>::loadu(x.data() + i, count).exp().store(e.data() + i, count);
            }
            // each sum as inductor's kernel adds it: a chunk per thread of an OpenMP static schedule, each from 0
            for (int64_t j = 0; j < G; ++j) total[j] = 0.0f;
            const int64_t base = length / chunks, extra = length % chunks;
            int64_t begin = 0;
            for (int64_t c = 0; c < chunks; ++c) {
                const int64_t end = begin + base + (c < extra ? 1 : 0);
                float part[G];
                for (int64_t j = 0; j < G; ++j) part[j] = 0.0f;
                for (int64_t l = begin; l < end; ++l) {
                    for (int64_t j = 0; j < G; ++j) part[j] = part[j] + e[l * G + j];
                }
                for (int64_t j = 0; j < G; ++j) total[j] = total[j] + part[j];
                begin = end;
            }
            PROB* out = probs + h * n;
            for (int64_t l = 0; l < length; ++l) {
                for (int64_t j = 0; j < G; ++j) out[l * G + j] = c10::convert<PROB>(e[l * G + j] / total[j]);
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


@torch._dynamo.assume_constant_result  # called while dynamo traces the decoding step: a constant of the graph
def sum_chunks(heads: int, group: int, length: int) -> int | None:
    """Into how many chunks inductor's kernel for this softmax splits each sum along L (one per thread, when it
    parallelizes the sum), or None where this module does not know (the attention then keeps inductor's kernel).

    Inductor (torch 2.13, codegen/cpp.py: max_parallel_depth, decide_parallel_depth) parallelizes a reduction
    along L when the loops outside it make no whole vector step (g narrower than a float vector) and each
    thread's share of the kernel's iterations reaches cpp.min_chunk_size."""
    from torch._inductor import config
    from torch._inductor.cpu_vec_isa import VecAVX2, VecAVX512, pick_vec_isa
    from torch._inductor.utils import parallel_num_threads

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
