"""kernels/decode_attention.py: its C++ kernel computes what inductor's compiled softmax of a decoding step computes, bit
for bit, compared on fp32 outputs, where any other order of a sum shows: bf16 and fp32 scores, one and two threads,
shapes on both sides of the size at which inductor splits each sum between threads. The same kernel with the other
split gives other numbers, so each comparison can fail."""

from __future__ import annotations

import pytest
import torch

from grpo_exp.kernels import decode_attention, small_rows
from grpo_exp.base.cpu import compiler_missing

pytestmark = pytest.mark.skipif(compiler_missing() is not None, reason=f"inductor cannot compile: {compiler_missing()}")
# the bit-for-bit tests: the kernel repeats one torch release's inductor, and under another it is not used
needs_checked_torch = pytest.mark.skipif(
    not decode_attention.TORCH_CHECKED,
    reason=f"the kernel repeats the inductor of torch {decode_attention.CHECKED_TORCH}x (pinned), "
           f"not {torch.__version__}'s")


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
    """Grouped attention's softmax of a decoding step (kernels/attention.py), compiled by inductor, fp32 out."""
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
@needs_checked_torch
def test_the_kernel_computes_inductors_softmax_bit_for_bit(threads, shape, dtype, mask_dtype):
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        scores, mask = _scores_and_mask(*shape, dtype, mask_dtype or dtype)
        b, kv, g, length = shape
        scores = scores.view(b, kv, length, g)
        scaling = 64 ** -0.5
        chunks = decode_attention.sum_chunks(b * kv, g, length)
        assert chunks == (threads if threads > 1 and b * kv * g * length // threads >= 512 else 1)
        expected = _inductors(scores, mask, scaling)
        assert torch.equal(decode_attention.decode_softmax(scores, mask, scaling, chunks, torch.float32), expected)
        other = decode_attention.decode_softmax(scores, mask, scaling, 2 if chunks == 1 else 1, torch.float32)
        assert not torch.equal(other, expected)  # the order of the sums shows in these numbers
        probs = decode_attention.decode_softmax(scores, mask, scaling, chunks)  # the op's own output dtype
        assert probs.dtype == dtype and torch.equal(probs, expected.to(dtype))
    finally:
        torch.set_num_threads(before)


def test_another_torch_release_keeps_inductors_kernel(monkeypatch):
    """Under a torch release other than the one whose inductor the kernel repeats, sum_chunks does not claim to
    know its split, so the compiled step keeps inductor's kernel (torch 2.11's rounded otherwise)."""
    assert decode_attention.checked_torch("2.13.0+cpu") and not decode_attention.checked_torch("2.11.0+cu130")
    monkeypatch.setattr(decode_attention, "TORCH_CHECKED", True)
    assert decode_attention.sum_chunks(16, 3, 128) is not None  # the default model's at 16 rows, on an x86 CPU
    monkeypatch.setattr(decode_attention, "TORCH_CHECKED", False)
    assert decode_attention.sum_chunks(16, 3, 128) is None


def test_a_group_as_wide_as_a_vector_keeps_inductors_kernel():
    """Where g fills a vector, inductor does not split the sum the same way: sum_chunks does not claim to know."""
    from torch._inductor.cpu_vec_isa import pick_vec_isa

    isa = pick_vec_isa()
    width = isa.nelements(torch.float) if isa else 16
    assert decode_attention.sum_chunks(16, width, 128) is None


needs_avx512_bf16 = pytest.mark.skipif(not decode_attention._AVX512_BF16,
                                       reason="decode_attention repeats oneDNN's AVX512-BF16 products (no AMX)")


@needs_avx512_bf16
@pytest.mark.parametrize("threads,b,kv,g,length,dim,mask_dtype,tail", [
    (2, 16, 3, 3, 128, 64, torch.bfloat16, 40),  # the default model's static cache, its unfilled tail masked
    (2, 16, 3, 3, 127, 64, torch.bfloat16, 0),  # an odd length: the last pair of the value product is half zero
    (1, 16, 3, 3, 128, 64, torch.bfloat16, 17),  # one thread
    (2, 4, 2, 7, 300, 128, torch.float32, 101),  # Qwen-like heads, an fp32 mask
    (2, 2, 1, 3, 33, 32, torch.bfloat16, 1),
    (2, 8, 2, 4, 1024, 64, torch.bfloat16, 500),
    # 262,144 outputs and 1.6 million scores: enough that another order of a product's terms shows somewhere
    # (the value product's pairs taken (l + 1, l), or the scores' (d + 1, d), did here)
    (2, 64, 4, 8, 800, 128, torch.bfloat16, 0),  # longer than VALUE_SPAN: the value product summed per span
    (2, 32, 2, 3, 1101, 64, torch.bfloat16, 90),  # and an odd last span
])
def test_the_attention_kernel_computes_the_composed_attention_bit_for_bit(threads, b, kv, g, length, dim, mask_dtype,
                                                                          tail):
    """decode_attention equals torch.matmul, decode_softmax and torch.matmul in turn (what a compiled decoding step
    computes without it), bit for bit, with the keys and values of the masked tail left as junk (a cache's stale
    rows), left padding masked, and one row masked from the start of the tail only."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        torch.manual_seed(1)
        # queries 64 times smaller: the softmax spreads its weight, and the value product's order of terms shows
        query = (small_rows.wide_range(b, kv, g, dim).float() / 64).bfloat16()
        key, value = small_rows.wide_range(b, kv, length, dim), small_rows.wide_range(b, kv, length, dim)
        attended = torch.ones(b, length, dtype=torch.bool)
        attended[:, :3] = False
        attended[:, length - tail:] = False
        attended[0, length - tail:] = True  # a row whose whole cache is filled
        mask = torch.where(attended, 0.0, torch.finfo(mask_dtype).min).to(mask_dtype)[:, None, None, :]
        scaling = dim ** -0.5
        chunks = decode_attention.sum_chunks(b * kv, g, length)
        scores = torch.matmul(key, query.transpose(2, 3))
        probs = decode_attention.decode_softmax(scores, mask, scaling, chunks)
        expected = torch.matmul(probs.transpose(2, 3), value)
        kernel = decode_attention._run_attention(query, key, value, mask, scaling, chunks, decode_attention.VALUE_SPAN)
        assert torch.equal(kernel, expected)
        assert decode_attention.agrees(mask_dtype, g, dim, length, chunks)  # so the op itself runs the kernel
        assert torch.equal(decode_attention.decode_attention(query, key, value, mask, scaling, chunks), expected)
    finally:
        torch.set_num_threads(before)


def test_the_attention_kernel_is_used_for_bf16_heads_of_32_columns_alone():
    assert not decode_attention.attention_usable(torch.float32, 64)
    assert not decode_attention.attention_usable(torch.bfloat16, 16)
    assert decode_attention.attention_usable(torch.bfloat16, 64) == decode_attention._AVX512_BF16


@needs_avx512_bf16
def test_the_probe_finds_a_kernel_that_sums_in_another_order():
    """agrees() checks the kernel against torch's products before the op uses it: a kernel that sums the value product
    per 256 rows (oneDNN here: per 512) agrees below 256 rows and is caught beyond."""
    assert decode_attention.agrees(torch.bfloat16, 3, 64, 200, 2, span=256)
    assert decode_attention.agrees(torch.bfloat16, 3, 64, 800, 2)
    assert not decode_attention.agrees(torch.bfloat16, 3, 64, 800, 2, span=256)
