"""kernels/small_rows.py: its kernel computes oneDNN's packed bf16 product bit for bit at a decoding step's few rows, for
the default model's shapes (with the span span_for finds), and a group's weights side by side; the comparison can
fail: summed without the span, the LM head's outputs differ from oneDNN's."""

from __future__ import annotations

import pytest
import torch

from grpo_exp.kernels import small_rows
from grpo_exp.base.cpu import compiler_missing

pytestmark = [
    pytest.mark.skipif(compiler_missing() is not None, reason=f"inductor cannot compile: {compiler_missing()}"),
    pytest.mark.skipif(not small_rows.AVX512_BF16,
                       reason="the kernel repeats oneDNN's AVX512-BF16 products (a CPU with them and no AMX)"),
]


def _onednn(x, weights):
    return torch.ops.mkldnn._linear_pointwise(
        x, torch.ops.mkldnn._reorder_linear_weight(torch.cat(weights)), None, "none", [], "")


@pytest.mark.parametrize("rows", [16, 1, 8, 20, 33])
@pytest.mark.parametrize("inputs,outputs", [
    (576, [576, 192, 192]),  # SmolLM2-135M's q/k/v as one group (oneDNN here sums 16 rows' 576 inputs per 512)
    (576, [576]),  # o_proj
    (576, [1536, 1536]),  # gate/up
    (1536, [576]),  # down_proj (16 rows: per 1024; one row: all 1536 at once)
    (64, [80]),  # short: one sum
])
def test_the_kernel_computes_onednns_product_bit_for_bit(rows, inputs, outputs):
    """With the span span_for finds, on fresh rows: the same outputs as oneDNN's packed product."""
    torch.manual_seed(rows)
    weights = [small_rows.wide_range(n, inputs) for n in outputs]
    span = small_rows.span_for(rows, weights, lambda ws: lambda x: _onednn(x, ws))
    assert span is not None
    for _ in range(3):
        x = small_rows.wide_range(rows, 1, inputs)  # a decoding step's [rows, 1, inputs]
        assert small_rows.usable(x, weights)
        assert torch.equal(small_rows.product(x, weights, span), _onednn(x, weights))


def test_summed_without_oneDNNs_span_the_lm_heads_outputs_differ():
    """The default model's tied LM head at 16 rows: 786,432 outputs, where summing all 576 inputs at once (no span)
    differs from oneDNN somewhere, and the span span_for finds does not."""
    torch.manual_seed(0)
    weights = [small_rows.wide_range(49152, 576)]
    x = small_rows.wide_range(16, 1, 576)
    expected = _onednn(x, weights)
    assert not torch.equal(small_rows.product(x, weights, 576), expected)
    assert torch.equal(small_rows.product(x, weights, 512), expected)


def test_the_kernel_takes_bf16_products_of_a_few_rows_alone():
    w = torch.zeros(8, 64, dtype=torch.bfloat16)
    assert small_rows.usable(torch.zeros(16, 64, dtype=torch.bfloat16), [w])
    assert not small_rows.usable(torch.zeros(16, 64), [w.float()])  # fp32
    assert not small_rows.usable(torch.zeros(small_rows.MAX_ROWS + 1, 64, dtype=torch.bfloat16), [w])
    assert not small_rows.usable(torch.zeros(16, 63, dtype=torch.bfloat16), [torch.zeros(8, 63).bfloat16()])
    assert not small_rows.usable(torch.zeros(16, 64, dtype=torch.bfloat16), [torch.zeros(64, 8).bfloat16().t()])
