"""Linear layers whose weights are prepacked for the CPU's GEMM kernels, for a model that only runs inference
between weight updates (the rollout engine's copy of the policy).

Why: a plain `F.linear` on a CPU hands the weight to oneDNN (bf16) or MKL (fp32) in its stored layout, and the
library works from that layout on every call. A decoding step multiplies a few rows by every weight of the model.
Packing once per weight update and reusing the packed weight for a round's decoding steps made the default model's
Linear layers 1.2-2.5x faster at 16 rows on this machine, and an eager decoding round 1.1x faster, with the same
tokens (README, Performance). Inductor's compiled step gets about as far by other means, so the engine packs only
where its step runs eager.

The packed kernels are those inductor uses for frozen CPU graphs (`mkldnn._linear_pointwise` on a oneDNN-packed
bf16 weight; `mkl._mkl_linear` on an MKL-packed fp32 weight, packed for one row count, plain `linear` at others).
Inductor cannot trace a packed weight that changes after compilation, so a packed model runs eager.
"""

from __future__ import annotations

import torch

CHOICES = ("auto", True, False)  # train.rollout_pack


def unavailable_reason(dtype: torch.dtype, device: torch.device) -> str | None:
    """Why weights of `dtype` on `device` cannot be packed here (None when they can)."""
    if device.type != "cpu":
        return f"packing is for CPU kernels, the copy is on {device.type}"
    if dtype == torch.bfloat16:
        ok = torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")
        return None if ok else "this torch build has no oneDNN packed linear"
    if dtype == torch.float32:
        ok = torch.backends.mkl.is_available() and hasattr(torch.ops.mkl, "_mkl_linear")
        return None if ok else "this torch build has no MKL packed linear"
    return f"no packed CPU linear for {dtype}"


class PackedLinear(torch.nn.Linear):
    """An `nn.Linear` that multiplies by its packed weight while one is set (`packed`), and by its plain weight
    otherwise. Its parameters are the plain ones, so names, state dicts and tied weights are unchanged."""

    packed: torch.Tensor | None = None
    packed_rows = 0  # the row count an MKL-packed fp32 weight was packed for

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        packed = self.packed
        if packed is None:
            return super().forward(x)
        if packed.dtype == torch.bfloat16:  # oneDNN: any number of rows
            return torch.ops.mkldnn._linear_pointwise(x, packed, self.bias, "none", [], "")
        rows = x.reshape(-1, x.shape[-1])
        if rows.shape[0] != self.packed_rows:  # MKL's packing fixes the row count (a prefill, here)
            return super().forward(x)
        out = torch.ops.mkl._mkl_linear(rows, packed, self.weight, self.bias, self.packed_rows)
        return out.reshape(*x.shape[:-1], self.out_features)


class Packer:
    """Packs every Linear layer of `model` (each module turned into a PackedLinear in place) and drops the packed
    weights again; `pack` after each weight update, since a packed weight is a copy."""

    def __init__(self, model: torch.nn.Module):
        self.layers: list[PackedLinear] = []
        for module in model.modules():
            if type(module) is torch.nn.Linear:
                module.__class__ = PackedLinear
                self.layers.append(module)
        self.rows = 0  # the row count the current packing serves; 0: nothing packed

    @property
    def packed(self) -> bool:
        return self.rows > 0

    @torch.no_grad()
    def pack(self, rows: int) -> None:
        """Pack every layer's current weight for `rows` rows per call (the decoding batch)."""
        self.drop()
        for layer in self.layers:
            weight = layer.weight.detach()
            if weight.dtype == torch.bfloat16:
                layer.packed = torch.ops.mkldnn._reorder_linear_weight(weight, rows)
            else:
                layer.packed = torch.ops.mkl._mkl_reorder_linear_weight(weight, rows)
            layer.packed_rows = rows
        self.rows = rows

    def drop(self) -> None:
        """Forget the packed weights (their memory goes back); the layers multiply by their plain weights."""
        for layer in self.layers:
            layer.packed, layer.packed_rows = None, 0
        self.rows = 0
