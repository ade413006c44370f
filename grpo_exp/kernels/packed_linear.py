"""Linear layers whose bf16 weights are laid out once for oneDNN's CPU matmul, for the rollout copy's decoding.

Why: a bf16 `torch.nn.functional.linear` on a CPU hands oneDNN a plain row-major weight, which it reorders into its
own blocked layout on every call. In decoding (16-32 rows) that reorder costs about as much as the product itself:
`grpo-profile --path engine --batch 16` measured 39.4 ms of Linear products per decoding step of the default model
with plain weights and 27.8 ms with weights reordered once (`torch.ops.mkldnn._reorder_linear_weight`; 2 cores,
avx512_bf16; docs/log.md, "2026-11-28 — packed weights for the rollout copy"). The products are oneDNN's same kernel
either way, so the outputs are equal bit for bit (tests/kernels/test_packed_linear.py).

The packed weight is an opaque MKLDNN tensor, which inductor accepts only as a frozen constant; the rollout copy's
weights change after every optimizer step. So the product is a custom op (`grpo_exp::packed_linear`) that
`torch.compile` calls as an extern kernel, and the packed tensors live in a table keyed by an integer slot that
the op reads: the compiled decoding step stays valid when the weights are packed again.

Products of one input with several packed weights (a layer's q, k and v; gate and up) are one product in the compiled
step (`fuse_shared_inputs`, the compile backend `compile_fused`): the group's weights concatenated along the output
and packed into a slot of the group's own, the outputs sliced back. oneDNN computes each output column from the same
row and column whatever the width, and the outputs were equal bit for bit wherever compared
(tests/kernels/test_packed_linear.py; the default model's decoding rounds, docs/log.md, "2026-11-29 — the decoding
softmax as one kernel and fused products"). A decoding step of the default model makes 121 products instead of 211.

On a CPU with AVX512-BF16 and no AMX (small_rows.AVX512_BF16), the op computes a product of a few rows (a decoding
step's) with kernels/small_rows.py's kernel from the layers' plain weights instead, the same numbers as oneDNN's packed
product (the kernel's span is checked against oneDNN's own product before use), and no packed copy is laid out at
all: `pack` only marks the weights, and an eager call with many rows (the prefill) is `F.linear` on the plain
weight. oneDNN's packed product stays where the kernel does not apply (a bias, a shape it does not match, other
CPUs).

An fp32 copy is laid out for nobody: torch's fp32 product is MKL's, from the plain weight. Where torch's kernels are
AVX2's (small_rows.F32_AVX2), the same op computes a decoding step's products with small_rows' fp32 kernel, which
repeats MKL's order of the terms (checked against MKL's own product before use), and MKL's product of the plain
weights elsewhere (a bias, 1-3 rows, a shape no span matches, many rows).
"""

from __future__ import annotations

import copy
import itertools
import weakref

import torch

from grpo_exp.base import cpu
from grpo_exp.kernels import small_rows

# slot -> the oneDNN-reordered weight of one PackedLinear (or of a group), or _PENDING: reordered from the layer's
# current weight at its first use. A layer whose products the compiled step makes as a group's is left pending: it
# is not used alone there, and its own packed copy would only take memory. A group is laid out at its first use.
_PACKED: dict[int, object] = {}
_PENDING = object()
_SLOTS = itertools.count()
_LAYERS: dict[int, weakref.ref] = {}  # slot -> its PackedLinear, whose weight a group concatenates
_GROUPS: dict[int, tuple[int, ...]] = {}  # a group's slot -> its layers' slots, in output order
_GROUP_OF: dict[tuple[int, ...], int] = {}  # the inverse of _GROUPS
_GROUPS_WITH: dict[int, list[int]] = {}  # a layer's slot -> the groups that hold it (none: not a key)


# Registered through the low-level Library API rather than `torch.library.custom_op`: the latter's Python autograd
# layer added about 14 us per call, and a decoding step of the default model makes 211 of these calls.
_LIB = torch.library.Library("grpo_exp", "FRAGMENT")
_LIB.define("packed_linear(Tensor x, int slot, int out_features, Tensor? bias) -> Tensor")


def packed_linear(x: torch.Tensor, slot: int, out_features: int, bias: torch.Tensor | None) -> torch.Tensor:
    """x @ W.T + bias for the layer (or the group of layers) in slot `slot`: by kernels/small_rows.py's kernel from the
    plain weights where it computes oneDNN's numbers for these rows; otherwise by oneDNN from the weight packed in
    the slot (a group's: its layers' weights, packed at first use)."""
    weight = _PACKED.get(slot)
    if weight is None and slot in _GROUPS and all(member in _PACKED for member in _GROUPS[slot]):
        weight = _PENDING  # every layer of the group holds a weight to pack
    if weight is _PENDING and bias is None and small_rows.applies(x.dtype):
        plan = _PLANS.get(slot, {}).get((x.numel() // x.shape[-1], x.dtype))
        if plan is None:
            plan = _plan(x, slot)
        if plan[1] is not None:
            return small_rows.product(x, plan[0], plan[1])
    if weight is _PENDING and not _lays_out(x.dtype):
        return _plain_product(slot, x, bias)
    if weight is _PENDING:
        weight = _reorder(slot)
    if weight is None:
        raise RuntimeError(f"packed linear slot {slot} holds no weight (released and not packed again)")
    return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")


_LIB.impl("packed_linear", packed_linear, "CPU")


def _lays_out(dtype: torch.dtype) -> bool:
    """Whether weights of this dtype are laid out for oneDNN: bf16's are (a plain bf16 product reorders the weight on
    every call); fp32's never are, since torch's fp32 product is MKL's, from the plain weight."""
    return dtype != torch.float32


# slot -> (rows, dtype) -> (the slot's plain weights, small_rows' span for them), the span None where the kernel does
# not apply (oneDNN's product then): worked out at a slot's first product, and dropped when the slot is packed again
_PLANS: dict[int, dict[tuple, tuple[list, int | None]]] = {}


def _plan(x: torch.Tensor, slot: int) -> tuple[list, int | None]:
    rows = x.numel() // x.shape[-1]
    weights = _weights(slot)
    span = None
    if weights is not None and small_rows.usable(x, weights):
        span = small_rows.span_for(rows, weights, _library_of)
    _PLANS.setdefault(slot, {})[rows, x.dtype] = weights, span
    return weights, span


def _weights(slot: int) -> list[torch.Tensor] | None:
    """The plain weights of a slot's layer, or of its group's layers in output order (None where one is gone)."""
    layers = [_LAYERS.get(member) for member in _GROUPS.get(slot, (slot,))]
    layers = [ref() if ref is not None else None for ref in layers]
    return None if any(layer is None for layer in layers) else [layer.weight for layer in layers]


@torch.no_grad()
def _laid_out(weights: list[torch.Tensor]) -> torch.Tensor:
    """The weights, concatenated along the output where there are several, in oneDNN's blocked layout."""
    return torch.ops.mkldnn._reorder_linear_weight(torch.cat(weights) if len(weights) > 1 else weights[0].detach())


def _library_of(weights: list[torch.Tensor]):
    """What this op computes for these weights without the kernel, for span_for: oneDNN's packed product of bf16
    weights, torch's (MKL's) product of each plain fp32 weight."""
    if weights[0].dtype == torch.float32:
        return lambda x: _products(x, weights, None)
    packed = _laid_out(weights)
    return lambda x: torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], "")


def _products(x: torch.Tensor, weights: list[torch.Tensor], bias: torch.Tensor | None) -> torch.Tensor:
    """x @ W.T + b of each weight (and its part of a group's bias), side by side: what the layers compute alone."""
    # the rows as one dense 2-D matrix, as inductor hands them to MKL: a 3-D input with other strides (a decoding
    # step's [rows, 1, inputs] can have them) took another path through MKL that adds in another order
    rows = x.reshape(-1, x.shape[-1]).contiguous()
    biases = [None] * len(weights) if bias is None else bias.split([w.shape[0] for w in weights])
    outputs = [torch.nn.functional.linear(rows, w, b) for w, b in zip(weights, biases)]
    y = outputs[0] if len(outputs) == 1 else torch.cat(outputs, -1)
    return y.view(*x.shape[:-1], y.shape[-1])


def _plain_product(slot: int, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    weights = _weights(slot)
    if weights is None:
        raise RuntimeError(f"linear slot {slot}: a layer of it is gone")
    return _products(x, weights, bias)


@torch.library.register_fake("grpo_exp::packed_linear")
def _packed_linear_shape(x, slot, out_features, bias):
    return x.new_empty((*x.shape[:-1], out_features))


def unsupported_reason(dtype: torch.dtype, device: torch.device) -> str | None:
    """Why weights of `dtype` on `device` cannot be packed here (None when they can)."""
    if device.type != "cpu":
        return f"weights on {device.type}, not the CPU"
    if dtype == torch.float32:  # nothing laid out: small_rows' fp32 kernel, where it repeats MKL's products
        if not small_rows.F32_AVX2:
            return "float32 weights (oneDNN packing is used for bf16; grpo-exp's fp32 kernel where torch's kernels " \
                   "are AVX2's)"
        why = cpu.compiler_missing()
        return f"float32 weights, whose kernel inductor cannot build here: {why}" if why else None
    if dtype != torch.bfloat16:
        return f"{str(dtype).replace('torch.', '')} weights (oneDNN packing is used for bf16)"
    if not torch.backends.mkldnn.is_available():
        return "this torch build has no oneDNN"
    # oneDNN reports bf16 support on any AVX-512 CPU, emulated or not; the training's own test is stricter
    if not torch.ops.mkldnn._is_mkldnn_bf16_supported() or cpu.resolve_precision("auto") != "bf16":
        return "the CPU has no native bf16 for oneDNN to pack into"
    return None


class PackedLinear(torch.nn.Linear):
    """A Linear computing with a packed copy of its weight. It holds the Linear's own `weight` and `bias`
    parameters under the same names (ties and in-place refreshes keep working; code that looks for Linear layers
    still finds it); `pack` takes the weight again after it changed (laid out at the next use), `unpack` frees the
    packed copy."""

    def __init__(self, linear: torch.nn.Linear):
        torch.nn.Module.__init__(self)  # not Linear's: it would allocate a weight of its own
        self.weight = linear.weight
        self.bias = linear.bias
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self._take_slot()
        self.pack()

    def _take_slot(self) -> None:
        """A slot of the table for this layer alone, emptied when the layer is gone."""
        self.slot = next(_SLOTS)
        _LAYERS[self.slot] = weakref.ref(self)
        weakref.finalize(self, _release_slot, self.slot)

    def __deepcopy__(self, memo: dict) -> PackedLinear:
        """A copy with a slot of its own: sharing the original's would let either one's `pack` overwrite the
        other's weight, and the original's end would empty the copy's slot. Packed again if the original was."""
        clone = PackedLinear.__new__(PackedLinear)
        memo[id(self)] = clone
        state = {key: value for key, value in self.__dict__.items() if key != "slot"}
        clone.__dict__.update(copy.deepcopy(state, memo))
        clone._take_slot()
        if self.packed:
            clone.pack()
        return clone

    def pack(self) -> None:
        """Lay the weight out as it is now; a layer whose compiled products are its group's only marks it, for its
        group's first use (and its own, if it is used alone)."""
        _drop_groups_of(self.slot)
        _PACKED[self.slot] = _PENDING
        if self.slot not in _GROUPS_WITH and _lays_out(self.weight.dtype) and not small_rows.applies(self.weight.dtype):
            _reorder(self.slot)

    def unpack(self) -> None:
        _drop_groups_of(self.slot)
        _PACKED.pop(self.slot, None)

    @property
    def packed(self) -> bool:
        return self.slot in _PACKED

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        bias = self.bias
        if x.dtype != self.weight.dtype:  # under autocast: the casts autocast's own linear makes
            x = x.to(self.weight.dtype)
        if bias is not None and bias.dtype != self.weight.dtype:  # the autocast copy keeps fp32 biases
            bias = bias.to(self.weight.dtype)
        if (not torch.compiler.is_compiling() and _PACKED.get(self.slot) is _PENDING
                and (self.slot in _GROUPS_WITH or x.numel() > small_rows.MAX_ROWS * x.shape[-1])):
            # called eager with more rows than the small-row kernel takes (the prefill, once a round), a layer not
            # laid out yet, or one whose compiled products are its group's: the same product from the plain weight
            # (oneDNN lays it out for this call), and no packed copy of its own kept
            return torch.nn.functional.linear(x, self.weight, bias)
        return torch.ops.grpo_exp.packed_linear(x, self.slot, self.out_features, bias)


def pack_linears(model: torch.nn.Module) -> list[PackedLinear]:
    """Replace every nn.Linear in `model` with a PackedLinear over the same parameters (in place); returns them.
    A layer whose forward was replaced on the instance (TRL's `cast_lm_head_to_fp32` does so to the LM head)
    keeps it, unpacked: packing would drop what that forward computes."""
    swapped = []
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if type(child) is torch.nn.Linear and "forward" not in child.__dict__:
                packed = PackedLinear(child)
                setattr(parent, name, packed)
                swapped.append(packed)
    return swapped


# ------------------------------------------------------------------------------------------------ fused products

def _release_slot(slot: int) -> None:
    _drop_groups_of(slot)
    _PACKED.pop(slot, None)
    _LAYERS.pop(slot, None)


def _drop_groups_of(slot: int) -> None:
    for group in _GROUPS_WITH.get(slot, ()):
        _PACKED.pop(group, None)
    for held in (slot, *_GROUPS_WITH.get(slot, ())):
        _PLANS.pop(held, None)  # its weights may be other tensors when next used (a deep copy, a released layer)


@torch.no_grad()
def _reorder(slot: int) -> torch.Tensor | None:
    """The packed weight of a slot marked _PENDING: its layer's weight, or a group's layers' weights concatenated;
    None where a layer is gone."""
    weights = _weights(slot)
    if weights is None:
        return None
    _PACKED[slot] = _laid_out(weights)
    return _PACKED[slot]


def group_slot(slots: tuple[int, ...]) -> int:
    """The slot of the group whose product is the products of `slots`' layers, concatenated in that order."""
    if slots not in _GROUP_OF:
        group = next(_SLOTS)
        _GROUPS[group], _GROUP_OF[slots] = slots, group
        for slot in slots:  # the group's product replaces theirs: their own packed copies go (laid out again if used)
            _GROUPS_WITH.setdefault(slot, []).append(group)
            if slot in _PACKED:
                _PACKED[slot] = _PENDING
    return _GROUP_OF[slots]


def fuse_shared_inputs(gm: torch.fx.GraphModule) -> int:
    """Rewrite `gm` in place so that the packed products of one input with several weights are one product with the
    weights concatenated (group_slot), each former output a slice of it; returns how many groups were made.
    Products whose bias is computed inside the graph (the autocast copy casts its fp32 biases) are left as they
    are: the fused product would come before the cast."""
    op = torch.ops.grpo_exp.packed_linear
    by_input: dict[tuple, list[torch.fx.Node]] = {}
    for node in gm.graph.nodes:
        if node.op != "call_function" or node.target not in (op, op.default) or node.kwargs or len(node.args) != 4:
            continue
        x, slot, out_features, bias = node.args
        if not isinstance(x, torch.fx.Node) or not isinstance(slot, int) or not isinstance(out_features, int):
            continue
        if bias is not None and not (isinstance(bias, torch.fx.Node) and bias.op in ("placeholder", "get_attr")):
            continue
        by_input.setdefault((x, bias is None), []).append(node)
    groups = 0
    for (x, no_bias), nodes in by_input.items():
        if len(nodes) < 2:
            continue
        sizes = [node.args[2] for node in nodes]
        group = group_slot(tuple(node.args[1] for node in nodes))
        with gm.graph.inserting_before(nodes[0]):  # nodes are in graph order: before the first use of any output
            bias = None if no_bias else gm.graph.call_function(torch.cat, ([node.args[3] for node in nodes],))
            whole = gm.graph.call_function(op.default, (x, group, sum(sizes), bias))
            ends = list(itertools.accumulate(sizes))
            parts = [gm.graph.call_function(torch.ops.aten.slice.Tensor, (whole, -1, end - size, end))
                     for size, end in zip(sizes, ends)]
        for node, part in zip(nodes, parts):
            node.replace_all_uses_with(part)
            gm.graph.erase_node(node)
        groups += 1
    if groups:
        gm.graph.lint()
        gm.recompile()
    return groups


def compile_fused(gm: torch.fx.GraphModule, example_inputs):
    """A torch.compile backend: inductor, after fuse_shared_inputs."""
    from torch._inductor.compile_fx import compile_fx

    fuse_shared_inputs(gm)
    return compile_fx(gm, example_inputs)
