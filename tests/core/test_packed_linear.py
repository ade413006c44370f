"""core/packed_linear.py: a packed Linear layer computes what the plain one computes, at the row count it was
packed for and at others, and a packed weight is a copy that only a new `pack` brings up to date."""

from __future__ import annotations

import pytest
import torch

from grpo_exp.core import packed_linear

CPU = torch.device("cpu")
DTYPES = [pytest.param(d, marks=pytest.mark.skipif(packed_linear.unavailable_reason(d, CPU) is not None,
                                                   reason=str(packed_linear.unavailable_reason(d, CPU))))
          for d in (torch.float32, torch.bfloat16)]


def model(dtype, bias=True):
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(24, 40, bias=bias), torch.nn.ReLU(),
                               torch.nn.Linear(40, 8, bias=False)).to(dtype)


def plain(net, x):
    """The network through plain `F.linear`, whatever its layers' class."""
    hidden = torch.relu(torch.nn.functional.linear(x, net[0].weight, net[0].bias))
    return torch.nn.functional.linear(hidden, net[2].weight)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(4, 24), (2, 2, 24), (7, 24), (1, 24)], ids=["packed_rows", "3d", "7_rows", "1_row"])
def test_packed_layers_compute_what_plain_ones_compute(dtype, shape):
    net = model(dtype)
    x = torch.randn(*shape).to(dtype)
    expected = plain(net, x)
    packer = packed_linear.Packer(net)
    assert len(packer.layers) == 2 and all(isinstance(m, packed_linear.PackedLinear) for m in packer.layers)
    packer.pack(4)
    assert packer.packed and all(m.packed is not None for m in packer.layers)
    with torch.no_grad():
        got = net(x)
    assert got.shape == expected.shape and got.dtype == dtype
    tol = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else {}
    torch.testing.assert_close(got, expected, **tol)


@pytest.mark.parametrize("dtype", DTYPES)
def test_a_packed_weight_is_a_copy_until_packed_again(dtype):
    net = model(dtype)
    x = torch.randn(4, 24).to(dtype)
    packer = packed_linear.Packer(net)
    packer.pack(4)
    with torch.no_grad():
        before = net(x)
        for layer in packer.layers:  # the weights change; a bias is read where it lives
            layer.weight.mul_(-1.5)
        changed = plain(net, x)
        stale = net(x)
        packer.pack(4)
        fresh = net(x)
        packer.drop()
        dropped = net(x)
    assert not torch.allclose(before.float(), changed.float())
    torch.testing.assert_close(stale, before)  # the packed copy still held the old weights
    tol = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else {}
    torch.testing.assert_close(fresh, changed, **tol)
    assert not packer.packed and all(m.packed is None for m in packer.layers)
    torch.testing.assert_close(dropped, changed, **tol)


def test_packing_keeps_parameters_names_and_ties():
    net = torch.nn.Sequential(torch.nn.Embedding(10, 6), torch.nn.Linear(6, 10, bias=False))
    net[1].weight = net[0].weight  # a tied LM head
    names = [n for n, _ in net.named_parameters()]
    packed_linear.Packer(net)
    assert [n for n, _ in net.named_parameters()] == names
    assert net[1].weight is net[0].weight


def test_what_cannot_be_packed_is_named():
    assert "CPU" in packed_linear.unavailable_reason(torch.float32, torch.device("cuda"))
    assert "float16" in packed_linear.unavailable_reason(torch.float16, CPU)
