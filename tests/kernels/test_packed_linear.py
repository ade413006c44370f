"""kernels/packed_linear.py: a Linear whose bf16 weight oneDNN lays out once gives the plain Linear's outputs bit for
bit, eager and inside a compiled graph, and follows its weight when packed again. On a CPU without native bf16
the module says why it cannot pack, and oneDNN refuses the layout."""

from __future__ import annotations

import copy

import pytest
import torch

from grpo_exp.kernels import packed_linear, small_rows

CPU = torch.device("cpu")
WHY = packed_linear.unsupported_reason(torch.bfloat16, CPU)
# the tests of packing itself: where nothing can be packed they are skipped (the first test checks that it says why)
needs_packing = pytest.mark.skipif(WHY is not None, reason=f"nothing can be packed on this CPU: {WHY}")


def test_what_cannot_be_packed_says_why():
    fp32 = packed_linear.unsupported_reason(torch.float32, CPU)
    assert (fp32 is None) == small_rows.F32_AVX2  # fp32 layers only where small_rows' fp32 kernel applies
    assert fp32 is None or "float32" in fp32
    assert "cuda" in packed_linear.unsupported_reason(torch.bfloat16, torch.device("cuda"))
    if WHY is not None:  # this CPU: oneDNN has no bf16 layout to pack into, and says so
        assert "native bf16" in WHY
        assert torch.ops.mkldnn._is_mkldnn_bf16_supported() is False
        with pytest.raises(RuntimeError, match="bf16"):
            packed_linear.PackedLinear(torch.nn.Linear(8, 8).bfloat16())


@needs_packing
@pytest.mark.parametrize("bias", [False, True])
def test_packed_outputs_equal_the_plain_linears_bit_for_bit(bias):
    torch.manual_seed(0)
    plain = torch.nn.Linear(96, 160, bias=bias).bfloat16()
    layer = packed_linear.PackedLinear(plain)
    assert layer.weight is plain.weight and layer.bias is plain.bias and layer.packed
    with torch.no_grad():
        for shape in [(16, 1, 96), (3, 96), (2, 40, 96)]:  # a decoding step, single rows, a prefill
            x = torch.randn(*shape).bfloat16()
            assert torch.equal(layer(x), plain(x)), shape
        # under autocast the input arrives in fp32 and is cast as autocast's own linear casts it
        x = torch.randn(4, 96)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            assert torch.equal(layer(x), plain(x))
        if bias:  # the autocast copy: bf16 weight, fp32 bias, which autocast's linear rounds to bf16 first
            mixed = torch.nn.Linear(96, 160)
            mixed.weight = torch.nn.Parameter(plain.weight.detach().clone())
            mixed_packed = packed_linear.PackedLinear(mixed)
            with torch.autocast("cpu", dtype=torch.bfloat16):
                assert mixed.bias.dtype == torch.float32 and torch.equal(mixed_packed(x), mixed(x))
        compiled = torch.compile(lambda t: torch.nn.functional.silu(layer(t)) * 2, dynamic=False)
        x = torch.randn(16, 1, 96).bfloat16()
        assert torch.equal(compiled(x), torch.nn.functional.silu(plain(x)) * 2)
        # a changed weight is used once packed again, by the same compiled graph
        plain.weight.mul_(-0.5)
        layer.pack()
        assert torch.equal(compiled(x), torch.nn.functional.silu(plain(x)) * 2)
        layer.unpack()
        assert not layer.packed
        with pytest.raises(RuntimeError, match="holds no weight"):
            layer(x)


@needs_packing
def test_pack_linears_swaps_every_linear_and_keeps_names_and_ties():
    model = torch.nn.Sequential(torch.nn.Embedding(10, 8), torch.nn.Linear(8, 8), torch.nn.ReLU(),
                                torch.nn.Sequential(torch.nn.Linear(8, 10, bias=False))).bfloat16()
    model[3][0].weight = model[0].weight  # a head tied to the embedding
    names = [n for n, _ in model.named_parameters()]
    swapped = packed_linear.pack_linears(model)
    assert len(swapped) == 2 and all(isinstance(m, packed_linear.PackedLinear) for m in (model[1], model[3][0]))
    assert [n for n, _ in model.named_parameters()] == names
    assert model[3][0].weight is model[0].weight


@needs_packing
def test_a_layer_with_a_forward_of_its_own_is_left_as_it_is():
    """TRL's cast_lm_head_to_fp32 replaces the head's forward on the instance; packing it would drop that."""
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 8)).bfloat16()
    own = model[1]
    own.forward = lambda x: torch.nn.functional.linear(x.float(), own.weight.float())
    swapped = packed_linear.pack_linears(model)
    assert swapped == [model[0]] and model[1] is own and type(own) is torch.nn.Linear
    assert model(torch.randn(2, 8).bfloat16()).dtype == torch.float32


@needs_packing
def test_a_deep_copy_packs_into_a_slot_of_its_own():
    """copy.deepcopy of a packed layer (or a model holding one) must not share the original's packed weight: the
    copy's weight is its own tensor, packing one must not change the other's products, and the original's end must
    not empty the copy's slot."""
    import gc

    torch.manual_seed(0)
    original = packed_linear.PackedLinear(torch.nn.Linear(32, 48).bfloat16())
    clone = copy.deepcopy(torch.nn.Sequential(original))[0]
    assert isinstance(clone, packed_linear.PackedLinear) and clone.packed
    assert clone.slot != original.slot and clone.weight.data_ptr() != original.weight.data_ptr()
    x = torch.randn(4, 32).bfloat16()
    with torch.no_grad():
        expected = torch.nn.functional.linear(x, clone.weight, clone.bias)
        assert torch.equal(clone(x), expected)
        original.weight.mul_(2.0)
        original.pack()
        assert torch.equal(clone(x), expected)  # the original's new weight is not the copy's
        assert not torch.equal(original(x), expected)
    unpacked = packed_linear.PackedLinear(torch.nn.Linear(8, 8).bfloat16())
    unpacked.unpack()
    assert not copy.deepcopy(unpacked).packed  # packed again only if the original was
    del original
    gc.collect()
    with torch.no_grad():
        assert torch.equal(clone(x), expected)  # still packed after the original is gone


class _SharedInputs(torch.nn.Module):
    """q, k, v read one input (as an attention layer's do), o reads another; `bias` gives q, k and v biases."""

    def __init__(self, bias: bool):
        super().__init__()
        self.q, self.k, self.v = (torch.nn.Linear(96, n, bias=bias) for n in (96, 32, 32))
        self.o = torch.nn.Linear(96, 96, bias=False)

    def forward(self, x):
        return self.o(torch.nn.functional.silu(self.q(x)) * 2) + self.k(x).sum(-1, keepdim=True) - self.v(x)[..., :1]


def _compiled_with_fusion(model) -> tuple[object, list[int]]:
    """model compiled through compile_fused's rewrite; also the number of groups each compilation made."""
    from torch._inductor.compile_fx import compile_fx

    groups = []

    def backend(gm, example_inputs):
        groups.append(packed_linear.fuse_shared_inputs(gm))
        return compile_fx(gm, example_inputs)

    return torch.compile(model, backend=backend, dynamic=False), groups


@needs_packing
@pytest.mark.parametrize("bias", [False, True])
def test_products_that_share_an_input_are_one_product_with_the_same_outputs(bias):
    """compile_fused: q, k and v become one product of their concatenated weights, and the compiled module gives
    what the plain module compiled by inductor gives, bit for bit; after the weights changed and were packed
    again, the group's weight is made again from them; a layer of the group that holds no packed weight is an
    error, not a stale product."""
    torch.manual_seed(0)
    plain = _SharedInputs(bias).bfloat16()
    model = copy.deepcopy(plain)
    layers = packed_linear.pack_linears(model)
    compiled, groups = _compiled_with_fusion(model)
    reference = torch.compile(plain, dynamic=False)
    x = torch.randn(16, 1, 96).bfloat16()
    with torch.no_grad():
        assert torch.equal(compiled(x), reference(x))
        assert groups == [1]  # q, k, v; o reads another input
        for module in (plain, model):
            for layer in (module.q, module.k, module.v, module.o):
                layer.weight.mul_(-0.5)
        for layer in layers:
            layer.pack()
        assert torch.equal(compiled(x), reference(x))
        model.k.unpack()
        with pytest.raises(RuntimeError, match="holds no weight"):
            compiled(x)
    assert groups == [1]  # the same compiled graph throughout


@needs_packing
def test_products_whose_bias_the_graph_casts_are_left_apart():
    """The autocast copy keeps fp32 biases, cast inside the compiled graph: those products are not fused (the fused
    one would come before the casts), and the outputs are still autocast's."""
    torch.manual_seed(0)
    plain = _SharedInputs(bias=True)
    for layer in (plain.q, plain.k, plain.v, plain.o):
        layer.weight = torch.nn.Parameter(layer.weight.detach().bfloat16())
    model = copy.deepcopy(plain)
    packed_linear.pack_linears(model)
    compiled, groups = _compiled_with_fusion(model)
    x = torch.randn(16, 1, 96).bfloat16()
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        assert torch.equal(compiled(x), torch.compile(plain, dynamic=False)(x))
    assert groups == [0]
