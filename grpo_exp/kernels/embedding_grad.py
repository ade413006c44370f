"""A tied input embedding's gradient as the rows its tokens touch, added into the dense gradient the LM head gives
the same weight: the numbers of torch's dense embedding backward, without its vocabulary-sized buffers.

Why: torch's embedding backward makes a dense [vocab, hidden] gradient for each lookup (113 MB in fp32 for
SmolLM2-135M's 49152 x 576), fills it with zeros, adds each token's row into it, and autograd then adds the whole
buffer into the weight's gradient. The shared-prefix scoring looks up twice per forward (prompts, then completions),
at the end of the backward, where a step's memory peaks. This backward returns the touched rows alone, as a
coalesced sparse gradient: each row summed from 0 in the order of the lookup's tokens, as torch's dense backward
sums it (padding tokens left out, as there), and autograd adds it into the dense gradient the tied LM head gave the
weight earlier in the backward. Each element is then the same sum as before (tests/core/test_embedding_grad.py).

Only for an embedding tied to the LM head, whose dense gradient always arrives first (the head runs last in the
forward): an untied embedding would get a sparse gradient, which torch's fused AdamW does not take.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


class _Lookup(torch.autograd.Function):
    @staticmethod
    def forward(ctx, ids: torch.Tensor, weight: torch.Tensor, padding_idx: int | None) -> torch.Tensor:
        ctx.save_for_backward(ids)
        ctx.shape, ctx.padding_idx = weight.shape, padding_idx
        return F.embedding(ids, weight, padding_idx)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        (ids,) = ctx.saved_tensors
        flat, rows = ids.reshape(-1), grad.reshape(-1, ctx.shape[1])
        if ctx.padding_idx is not None:  # torch's dense backward leaves the padding row's gradient at 0
            kept = flat != ctx.padding_idx
            flat, rows = flat[kept], rows[kept]
        unique, inverse = torch.unique(flat, sorted=True, return_inverse=True)
        values = rows.new_zeros(unique.numel(), rows.shape[1]).index_add_(0, inverse, rows)
        sparse = torch.sparse_coo_tensor(unique[None], values, ctx.shape, is_coalesced=True,
                                         check_invariants=False)  # sorted and unique by construction
        return None, sparse, None


def tied(model) -> bool:
    """Whether the model's input embedding and LM head share one weight."""
    embedding, head = model.get_input_embeddings(), model.get_output_embeddings()
    return embedding is not None and head is not None and embedding.weight is getattr(head, "weight", None)


class TiedEmbedding(torch.nn.Embedding):
    """An nn.Embedding whose weight's gradient comes as the rows its tokens touch (this module's doc); without a
    gradient to take (no_grad, a frozen weight), nn.Embedding's own lookup. `install` swaps the class of an existing
    module, so copies of the model (deepcopy keeps the class) look up their own weights."""

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if torch.is_grad_enabled() and self.weight.requires_grad:
            return _Lookup.apply(ids, self.weight, self.padding_idx)
        return super().forward(ids)


def supported(model) -> bool:
    """Whether `install` takes this model: a plain nn.Embedding tied to the LM head, without max_norm, scaling by
    frequency or sparse gradients of its own."""
    embedding = model.get_input_embeddings()
    return not (type(embedding) is not torch.nn.Embedding or not tied(model) or embedding.max_norm is not None
                or embedding.scale_grad_by_freq or embedding.sparse)


def install(model) -> bool:
    """Make the model's input embedding a TiedEmbedding; returns whether it did (where `supported`)."""
    if not supported(model):
        return False
    model.get_input_embeddings().__class__ = TiedEmbedding
    return True
