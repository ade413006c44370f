"""kernels/small_rows.py's fp32 kernel: each output is one chain of fused multiply-adds per span, as computed here by
hand; where torch's kernels are AVX2's it repeats MKL's product of a decoding step's rows bit for bit (with the span
span_for finds); and the fp32 layers of kernels/packed_linear.py give the plain Linear's outputs, eager and compiled,
alone and in groups, with or without the kernel. The kernel needs only AVX2 and FMA, so it runs on every x86 CPU
torch picks AVX2 or AVX-512 kernels for; `F32_AVX2` says where it is used."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from grpo_exp.kernels import packed_linear, small_rows
from grpo_exp.base.cpu import compiler_missing

pytestmark = [
    pytest.mark.skipif(compiler_missing() is not None, reason=f"inductor cannot compile: {compiler_missing()}"),
    pytest.mark.skipif(torch.backends.cpu.get_cpu_capability() not in ("AVX2", "AVX512"),
                       reason="the fp32 kernel is AVX2 and FMA code"),
]


def _chain(x: np.ndarray, w: np.ndarray, span: int) -> np.float32:
    """One output as the kernel is meant to sum it: fused multiply-adds from 0, per span, the spans' sums added in
    turn. (Each fma is the exact product plus the sum in float64, rounded to float32 once: a float32 product is
    exact in float64.)"""
    total = None
    for start in range(0, len(x), span):
        acc = np.float32(0)
        for k in range(start, min(start + span, len(x))):
            acc = np.float32(np.float64(x[k]) * np.float64(w[k]) + np.float64(acc))
        total = acc if total is None else np.float32(total + acc)
    return total


@pytest.mark.parametrize("rows,span", [(16, 16), (5, 40), (20, 24), (1, 7)])
def test_each_output_is_one_fma_chain_per_span(rows, span):
    """Rows past a block of 16, a span that does not divide the inputs, weights past a block of 6: every output as
    the hand computation has it; a group's outputs land side by side."""
    generator = torch.Generator().manual_seed(rows)
    weights = [small_rows.wide_range(n, 40, generator=generator, dtype=torch.float32) for n in (7, 5)]
    x = small_rows.wide_range(rows, 40, generator=generator, dtype=torch.float32)
    y = small_rows.product(x, weights, span).numpy()
    w = torch.cat(weights).numpy()
    expected = np.array([[_chain(x[m].numpy(), w[n], span) for n in range(12)] for m in range(rows)])
    assert y.dtype == np.float32 and np.array_equal(y, expected)


# the default model's products at a decoding step (SmolLM2-135M: q/k/v as one group, o_proj, gate/up, down, LM head)
SHAPES = [(576, [576, 192, 192]), (576, [576]), (576, [1536, 1536]), (1536, [576]), (576, [49152])]


def _mkl(x, weights):
    return torch.cat([torch.nn.functional.linear(x, w) for w in weights], -1)


@pytest.mark.parametrize("rows", [16, 4, 20, 64])
def test_where_torchs_kernels_are_avx2_the_kernel_repeats_mkls_product(rows):
    """With the span span_for finds, fresh rows give MKL's outputs bit for bit. Where torch's kernels are AVX2's
    (small_rows.F32_AVX2) a span must be found for every shape: 192, as MKL 2024.2 sums there (measured on an
    AMD EPYC with AVX2 only); elsewhere MKL's AVX-512 products may add in another order, and none need be."""
    torch.manual_seed(rows)
    for inputs, outputs in SHAPES:
        weights = [small_rows.wide_range(n, inputs, dtype=torch.float32) for n in outputs]
        span = small_rows.span_for(rows, weights, lambda ws: lambda x: _mkl(x, ws))
        if small_rows.F32_AVX2:
            assert span == 192, (inputs, outputs)
        if span is not None:
            x = small_rows.wide_range(rows, 1, inputs, dtype=torch.float32)
            assert torch.equal(small_rows.product(x, weights, span), _mkl(x, weights))


@pytest.mark.skipif(not small_rows.F32_AVX2, reason="MKL sums per 192 where torch's kernels are AVX2's")
def test_summed_without_mkls_span_the_lm_heads_outputs_differ():
    """The comparison can fail: the LM head's 786,432 outputs at 16 rows, summed over all 576 inputs at once."""
    torch.manual_seed(0)
    weights = [small_rows.wide_range(49152, 576, dtype=torch.float32)]
    x = small_rows.wide_range(16, 1, 576, dtype=torch.float32)
    assert not torch.equal(small_rows.product(x, weights, 576), _mkl(x, weights))
    assert torch.equal(small_rows.product(x, weights, 192), _mkl(x, weights))


def test_the_span_is_found_on_random_weights_not_the_layers_own(monkeypatch):
    """Weights all zero (a fresh LoRA B) give zero outputs in any order of the terms: probed on them, every span would
    pass and be kept for the shape. At 2 rows, where MKL takes its matrix-vector path and adds in another order,
    span_for finds none for zero weights as for any others."""
    monkeypatch.setattr(small_rows, "_SPANS", {})
    zeros = [torch.zeros(200, 100)]
    assert torch.equal(small_rows.product(torch.randn(2, 100), zeros, 100), torch.zeros(2, 200))
    assert small_rows.span_for(2, zeros, lambda ws: lambda x: _mkl(x, ws)) is None


def test_the_fp32_kernel_applies_where_torchs_kernels_are_avx2():
    assert small_rows.applies(torch.float32) == small_rows.F32_AVX2
    w = torch.zeros(8, 63)
    assert small_rows.usable(torch.zeros(16, 63), [w]) == small_rows.F32_AVX2  # an odd inner size is fine in fp32
    assert not small_rows.usable(torch.zeros(16, 63), [w.bfloat16()])  # dtypes differ
    assert not small_rows.usable(torch.zeros(small_rows.MAX_ROWS + 1, 63), [w])


@pytest.mark.parametrize("avx2", [True, False])
def test_fp32_layers_give_the_plain_linears_outputs_bit_for_bit(monkeypatch, avx2):
    """fp32 PackedLinear layers, with the kernel (F32_AVX2 forced on) or without it: the plain Linear's outputs for a
    decoding step's rows, a few rows, a prefill, with a bias, and in a compiled graph whose products that share an
    input are one group; an in-place change of the weights (the optimizer's, on weights the copy shares) is used at
    once, with nothing packed again."""
    monkeypatch.setattr(small_rows, "F32_AVX2", avx2)
    assert packed_linear.unsupported_reason(torch.float32, torch.device("cpu")) is None or not avx2
    torch.manual_seed(0)
    plain = [torch.nn.Linear(96, n, bias=False) for n in (64, 32, 32)] + [torch.nn.Linear(96, 40)]
    layers = [packed_linear.PackedLinear(layer) for layer in plain]
    assert all(layer.packed and layer.weight is p.weight for layer, p in zip(layers, plain))

    def block(modules, t):
        q, k, v, b = (m(t) for m in modules)
        return torch.cat([q, k * 2, v - 1, b], -1)

    with torch.no_grad():
        for shape in [(16, 1, 96), (3, 96), (2, 40, 96), (8, 96)]:
            x = torch.randn(*shape)
            assert torch.equal(block(layers, x), block(plain, x)), shape
        compiled = torch.compile(lambda t: block(layers, t), backend=packed_linear.compile_fused, dynamic=False)
        x = torch.randn(16, 1, 96)
        groups = len(packed_linear._GROUPS)
        assert torch.equal(compiled(x), block(plain, x))
        assert len(packed_linear._GROUPS) == groups + 1  # q, k and v as one product
        plans = [plan for slot in packed_linear._GROUPS for plan in packed_linear._PLANS.get(slot, {}).values()]
        found = any(span is not None for _, span in plans)
        if not avx2:
            assert not found
        elif torch.backends.cpu.get_cpu_capability() == "AVX2":  # MKL's AVX2 order: the kernel computed them
            assert found
        for p in plain:
            p.weight.mul_(-0.5)
        assert torch.equal(compiled(x), block(plain, x))
