"""core/decode_softmax.py: its C++ kernel computes what inductor's compiled softmax of a decoding step computes, bit
for bit, compared on fp32 outputs, where any other order of a sum shows: bf16 and fp32 scores, one and two threads,
shapes on both sides of the size at which inductor splits each sum between threads. The same kernel with the other
split gives other numbers, so each comparison can fail."""

from __future__ import annotations

import pytest
import torch

from grpo_exp.core import decode_softmax
from grpo_exp.training.rollout import compiler_missing

pytestmark = pytest.mark.skipif(compiler_missing() is not None, reason=f"inductor cannot compile: {compiler_missing()}")


def _scores_and_mask(b: int, kv: int, g: int, length: int, dtype: torch.dtype, mask_dtype: torch.dtype):
    """Decoding-step scores [b, kv, L, g] and transformers' additive mask [b, 1, 1, L] (padding on the left, the
    static cache's unused tail masked), as the rollout engine's compiled step sees them."""
    torch.manual_seed(0)
    scores = (torch.randn(b, kv, length, g) * 3).to(dtype)
    attended = torch.ones(b, length, dtype=torch.bool)
    attended[:, :3] = False
    attended[b // 2, :9] = False
    attended[:, length - 5:] = False
    mask = torch.where(attended, 0.0, torch.finfo(mask_dtype).min).to(mask_dtype)[:, None, None, :]
    return scores, mask


def _inductors(scores, mask, scaling):
    """Grouped attention's softmax of a decoding step (core/attention.py), compiled by inductor, fp32 out."""
    b, kv, length, g = scores.shape

    def softmax(s, m):
        x = s.view(b, kv, length, g, 1) + m.transpose(2, 3)[:, :, :, None, :]
        return torch.softmax(x * scaling, dim=2, dtype=torch.float32).view(b, kv, length, g)

    torch._dynamo.reset()
    return torch.compile(softmax, dynamic=False)(scores, mask)


@pytest.mark.parametrize("threads,shape,dtype,mask_dtype", [
    (2, (16, 3, 3, 128), torch.bfloat16, None),  # the default model at 16 rows: each sum split between the threads
    (2, (16, 3, 3, 128), torch.float32, None),  # an fp32 copy (a CPU without native bf16)
    (2, (16, 3, 3, 128), torch.bfloat16, torch.float32),  # the autocast copy: bf16 scores, the fp32 model's mask
    (1, (16, 3, 3, 128), torch.bfloat16, None),  # one thread: no split
    (2, (1, 3, 3, 64), torch.float32, None),  # too small for inductor to split
    (2, (4, 2, 2, 64), torch.bfloat16, None),  # just large enough
    (2, (8, 5, 3, 192), torch.float32, None),
])
def test_the_kernel_computes_inductors_softmax_bit_for_bit(threads, shape, dtype, mask_dtype):
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        scores, mask = _scores_and_mask(*shape, dtype, mask_dtype or dtype)
        b, kv, g, length = shape
        scores = scores.view(b, kv, length, g)
        scaling = 64 ** -0.5
        chunks = decode_softmax.sum_chunks(b * kv, g, length)
        assert chunks == (threads if threads > 1 and b * kv * g * length // threads >= 512 else 1)
        expected = _inductors(scores, mask, scaling)
        assert torch.equal(decode_softmax.decode_softmax(scores, mask, scaling, chunks, torch.float32), expected)
        other = decode_softmax.decode_softmax(scores, mask, scaling, 2 if chunks == 1 else 1, torch.float32)
        assert not torch.equal(other, expected)  # the order of the sums shows in these numbers
        probs = decode_softmax.decode_softmax(scores, mask, scaling, chunks)  # the op's own output dtype
        assert probs.dtype == dtype and torch.equal(probs, expected.to(dtype))
    finally:
        torch.set_num_threads(before)


def test_a_group_as_wide_as_a_vector_keeps_inductors_kernel():
    """Where g fills a vector, inductor does not split the sum the same way: sum_chunks does not claim to know."""
    from torch._inductor.cpu_vec_isa import pick_vec_isa

    isa = pick_vec_isa()
    width = isa.nelements(torch.float) if isa else 16
    assert decode_softmax.sum_chunks(16, width, 128) is None
