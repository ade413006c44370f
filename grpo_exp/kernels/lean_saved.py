"""A training forward under autocast that keeps for its backward no bf16 copy of the weights, no cast twice, and
no output it can compute again from what it keeps anyway.

Why: under bf16 autocast every Linear layer casts its fp32 weight to bf16 and saves the cast for its backward.
Autocast caches these casts until its region ends, and autograd then keeps them until the backward has passed
each layer: for the default model a second, bf16 copy of its body's weights (about 212 MB) is held across the
training step's memory peak. An activation that feeds several Linear layers (the normed input of q, k and v; of
gate and up) is cast once per layer, and each cast is saved apart.

`lean_forward(model)` changes what is kept, not what is computed:
- each trainable fp32 Linear weight is cast once per forward, as autocast's cache casts it, and the cast is dropped
  after its last use (`last_pass()` marks the pass after which none is needed; without it the casts live as long
  as autocast's would);
- autograd's saved-tensor hooks save the parameter instead of its cast, and cast it again when the backward
  unpacks it;
- a later cast of an activation already cast and saved (same dtype, shape and layout) is saved as the first one;
- the output of an elementwise op whose node keeps all of its inputs anyway (RMSNorm's x * rsqrt(...), SwiGLU's
  silu(gate)) is saved as that op, computed again when unpacked.

The backward runs the same operations on equal tensors (a cast is a deterministic rounding; an elementwise op
run again on the same tensors gives the same bits), so gradients are the same bit for bit
(tests/core/test_lean_saved.py). The cost is one more cast of each weight, and one more of each of those ops, per
use in the backward (docs/log.md, "2026-11-28 — lean saved tensors").
"""

from __future__ import annotations

import contextlib
import threading

import torch

CHOICES = ("lean", "plain")  # what the speed plan resolved (lean: under bf16 with the exact shortcuts)

_active = threading.local()  # .casts: the innermost lean_forward's _WeightCasts


class _SavedView:
    """A saved tensor kept as a recipe: `_make()` remakes the tensor it is a view of, from `sources`, which must
    not have been modified in place since the forward (autograd's own check, which saved-tensor hooks bypass)."""

    __slots__ = ("sources", "versions", "size", "stride", "offset")

    def __init__(self, view: torch.Tensor, sources: tuple[torch.Tensor, ...]):
        self.sources, self.versions = sources, tuple(t._version for t in sources)
        self.size, self.stride, self.offset = view.size(), view.stride(), view.storage_offset()

    def _make(self) -> torch.Tensor:
        raise NotImplementedError

    def unpack(self) -> torch.Tensor:
        if any(t._version != v for t, v in zip(self.sources, self.versions)):
            raise RuntimeError("a tensor the backward needs (saved by lean_forward) was modified in "
                               "place after the forward; speed.exact_shortcuts=false keeps copies instead")
        return self._make().as_strided(self.size, self.stride, self.offset)


class _Recast(_SavedView):
    """A saved view of the cast of a parameter to `dtype`, made again on unpack."""

    __slots__ = ("dtype",)

    def __init__(self, param: torch.Tensor, dtype: torch.dtype, view: torch.Tensor):
        super().__init__(view, (param,))
        self.dtype = dtype

    def _make(self) -> torch.Tensor:
        return self.sources[0].detach().to(self.dtype)


class _Shared(_SavedView):
    """A saved view of a cast that an earlier saved tensor already holds (its `base`)."""

    __slots__ = ()

    def __init__(self, base: torch.Tensor, view: torch.Tensor):
        super().__init__(view, (base,))

    def _make(self) -> torch.Tensor:
        return self.sources[0]


class _WeightCasts:
    """The bf16 casts of trainable Linear weights for one forward: made at first use, shared by later uses (as
    autocast's cache shares them), dropped after a use in the last pass."""

    def __init__(self, model: torch.nn.Module):
        # (a module with a forward of its own, set by a wrapper such as accelerate's hooks, keeps it)
        self.linears = [m for m in model.modules() if type(m) is torch.nn.Linear and "forward" not in m.__dict__
                        and m.weight.requires_grad and m.weight.is_floating_point()]
        self.sharing: dict[torch.nn.Parameter, int] = {}  # how many of these modules hold each weight (ties)
        for m in self.linears:
            self.sharing[m.weight] = self.sharing.get(m.weight, 0) + 1
        self.casts: dict[torch.nn.Parameter, torch.Tensor] = {}
        self.last_pass = False
        self.earlier: dict[torch.nn.Parameter, int] = {}  # uses before the last pass (one pass: its uses)
        self.used: dict[torch.nn.Parameter, int] = {}  # uses in the last pass so far

    def weight(self, module: torch.nn.Linear, dtype: torch.dtype) -> torch.Tensor:
        param = module.weight
        cast = self.casts.get(param)
        if cast is None or cast.dtype != dtype:
            cast = param.to(dtype)  # the op autocast casts with: the same autograd node, the same rounding
        self.casts[param] = cast
        if not self.last_pass:
            self.earlier[param] = self.earlier.get(param, 0) + 1
            return cast
        self.used[param] = self.used.get(param, 0) + 1
        # the last pass uses it as often as the pass before did (a module may call its layer twice: PEFT's DoRA),
        # or, with no pass before, once per module holding it. After more than one earlier pass the count is too
        # high and the cast lives to the forward's end: more memory, never a second cast.
        if self.used[param] >= self.earlier.get(param, self.sharing[param]):
            del self.casts[param]
        return cast

    def forward(self, module: torch.nn.Linear, x: torch.Tensor) -> torch.Tensor:
        device = x.device.type
        if not (torch.is_autocast_enabled(device) and torch.is_grad_enabled()) or module.weight.dtype != torch.float32:
            return torch.nn.Linear.forward(module, x)
        # autocast passes a bf16 weight through and casts the input and bias as it would have
        return torch.nn.functional.linear(x, self.weight(module, torch.get_autocast_dtype(device)), module.bias)


class _Recomputed(_SavedView):
    """A saved view of an elementwise op's output, computed again on unpack from the inputs that op saved itself."""

    __slots__ = ("op",)

    def __init__(self, op, inputs: tuple[torch.Tensor, ...], view: torch.Tensor):
        super().__init__(view, inputs)
        self.op = op

    def _make(self) -> torch.Tensor:
        return self.op(*self.sources)


# Elementwise ops whose autograd node saves every input: (op, the node's attributes holding them). The output is
# the same op of the same tensors again, bit for bit (same kernel, same shapes and layouts).
_RECOMPUTABLE = {
    "MulBackward0": (torch.mul, ("_saved_self", "_saved_other")),  # RMSNorm's x * rsqrt(mean(x^2) + eps)
    "SiluBackward0": (torch.nn.functional.silu, ("_saved_self",)),  # SwiGLU's silu(gate)
}


def _recomputed(base: torch.Tensor, saved: torch.Tensor) -> _Recomputed | None:
    """`saved` as a recipe, when `base` is the contiguous output of a _RECOMPUTABLE op whose inputs its node
    holds anyway (and are no casts this module saves in another form)."""
    fn = base.grad_fn
    entry = _RECOMPUTABLE.get(type(fn).__name__) if fn is not None else None
    if entry is None or not base.is_contiguous():
        return None
    op, names = entry
    try:
        inputs = tuple(getattr(fn, name) for name in names)
    except (AttributeError, RuntimeError):  # not saved (an input that needs no gradient), or already freed
        return None
    if not all(isinstance(t, torch.Tensor) and t.dtype.is_floating_point for t in inputs):
        return None
    if any(t.grad_fn is not None and type(t.grad_fn).__name__ == "ToCopyBackward0" for t in inputs):
        return None
    if torch.broadcast_shapes(*(t.shape for t in inputs)) != base.shape:
        return None
    dtype = torch.result_type(*inputs) if len(inputs) > 1 else inputs[0].dtype
    if dtype != base.dtype:
        return None
    return _Recomputed(op, inputs, saved)


def _cast_source(base: torch.Tensor):
    """(the node that made the tensor `base` was cast from, its output index), or None when `base` is no cast."""
    fn = base.grad_fn
    if fn is None or type(fn).__name__ != "ToCopyBackward0":
        return None
    return fn.next_functions[0]


def _saved_hooks():
    """Saved-tensor hooks: parameters' casts saved as the parameter, repeated casts of an activation once."""
    casts: dict[tuple, torch.Tensor] = {}  # (source node, output index, dtype, shape, layout) -> first cast saved

    def pack(saved: torch.Tensor):
        base = saved if saved._base is None else saved._base
        source = _cast_source(base)
        if source is None or source[0] is None:
            return _recomputed(base, saved) or saved
        node, index = source
        if type(node).__name__ == "AccumulateGrad":
            param = node.variable
            # a cast of the whole parameter (a slice or reshape before the cast would not be `base`)
            if param.shape == base.shape and param.dtype != base.dtype and base.is_contiguous():
                return _Recast(param, base.dtype, saved)
            return saved
        key = (node, index, base.dtype, tuple(base.shape), base.stride(), base.storage_offset())
        first = casts.setdefault(key, base)
        return saved if first is base else _Shared(first, saved)

    def unpack(packed):
        return packed.unpack() if isinstance(packed, _SavedView) else packed

    return casts, torch.autograd.graph.saved_tensors_hooks(pack, unpack)


@contextlib.contextmanager
def lean_forward(model: torch.nn.Module):
    """A forward of `model` (and the backward of what it computes) that keeps less; see the module docstring. The
    backward may run after the context has ended."""
    weights = _WeightCasts(model)
    casts, hooks = _saved_hooks()
    for module in weights.linears:
        module.forward = lambda x, module=module: weights.forward(module, x)
    outer = getattr(_active, "casts", None)
    _active.casts = weights
    try:
        with hooks:
            yield
    finally:
        _active.casts = outer
        for module in weights.linears:
            del module.forward  # back to the class's
        weights.casts.clear()
        casts.clear()  # what was packed holds its own references


@contextlib.contextmanager
def last_pass():
    """Inside a `lean_forward`: the pass through the model after which no weight is used again in this forward,
    so each cast is dropped after its use here. Elsewhere: nothing."""
    weights = getattr(_active, "casts", None)
    if weights is None:
        yield
        return
    weights.last_pass = True
    try:
        yield
    finally:
        weights.last_pass = False
        weights.used.clear()
        weights.earlier.clear()
