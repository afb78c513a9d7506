"""Triton SGMV/BGMV kernels equal their torch references (on the CPU under TRITON_INTERPRET=1)."""

from __future__ import annotations

import pytest
import torch

from sgmv_kernels import (
    bgmv_expand,
    bgmv_expand_reference,
    bgmv_shrink,
    bgmv_shrink_reference,
    lora_expand,
    lora_shrink,
    sgmv_expand,
    sgmv_expand_reference,
    sgmv_shrink,
    sgmv_shrink_reference,
)
from sgmv_kernels.cpu import bgmv_expand_gathered, bgmv_shrink_gathered

RANKS = [1, 4, 8, 16, 64, 128]  # mixed in every pool
MAX_RANK = 128
TOLERANCE = {torch.float32: 1e-4, torch.bfloat16: 2e-2}


def make_pool(num_slots: int, in_features: int, out_features: int, dtype, gen: torch.Generator):
    """A pool of adapters of mixed ranks, zero past each one's rank (as the pool keeps them)."""
    ranks = torch.tensor([RANKS[i % len(RANKS)] for i in range(num_slots)], dtype=torch.int32)
    lora_a = torch.zeros(num_slots, MAX_RANK, in_features)
    lora_b = torch.zeros(num_slots, out_features, MAX_RANK)
    for slot, rank in enumerate(ranks.tolist()):
        lora_a[slot, :rank] = torch.randn(rank, in_features, generator=gen) / in_features**0.5
        lora_b[slot, :, :rank] = torch.randn(out_features, rank, generator=gen) / rank**0.5
    scales = torch.rand(num_slots, generator=gen) * 2
    return lora_a.to(dtype), lora_b.to(dtype), ranks, scales


def make_segments(lengths: list[int], slots: list[int]):
    indptr = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    return indptr, torch.tensor(slots, dtype=torch.int32)


CASES = [
    # (in_features, out_features, segment lengths, segment slots): -1 = rows without an adapter
    (576, 1536, [3, 1, 17, 5], [0, -1, 4, 5]),
    (1536, 576, [1, 1, 1, 1, 1, 1], [5, 4, 3, 2, 1, 0]),
    (4096, 576, [33, 2], [4, 1]),
    (576, 4096, [7, 9], [5, -1]),
    (576, 576, [4, 4], [-1, -1]),  # no adapter rows at all
    (576, 576, [], []),  # an empty batch
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize(("in_features", "out_features", "lengths", "slots"), CASES)
def test_sgmv_shrink_and_expand_equal_the_reference(in_features, out_features, lengths, slots, dtype):
    gen = torch.Generator().manual_seed(len(lengths) * 1000 + in_features)
    lora_a, lora_b, ranks, scales = make_pool(6, in_features, out_features, dtype, gen)
    indptr, seg_slots = make_segments(lengths, slots)
    x = torch.randn(sum(lengths), in_features, generator=gen).to(dtype)
    y = sgmv_shrink(x, lora_a, ranks, indptr, seg_slots)
    y_ref = sgmv_shrink_reference(x, lora_a, ranks, indptr, seg_slots)
    torch.testing.assert_close(y, y_ref, atol=TOLERANCE[dtype], rtol=TOLERANCE[dtype])
    out = torch.randn(sum(lengths), out_features, generator=gen).to(dtype)
    out_ref = out.clone()
    sgmv_expand(y_ref, lora_b, ranks, scales, indptr, seg_slots, out)
    sgmv_expand_reference(y_ref, lora_b, ranks, scales, indptr, seg_slots, out_ref)
    torch.testing.assert_close(out, out_ref, atol=TOLERANCE[dtype], rtol=TOLERANCE[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize(("in_features", "out_features"), [(576, 1536), (4096, 576), (1536, 4096)])
def test_bgmv_with_interleaved_adapters_equals_the_reference(in_features, out_features, dtype):
    gen = torch.Generator().manual_seed(in_features + out_features)
    lora_a, lora_b, ranks, scales = make_pool(6, in_features, out_features, dtype, gen)
    row_slots = torch.tensor([0, 3, 0, -1, 5, 3, 1, 2, 4, 0, -1, 5], dtype=torch.int32)  # interleaved, some none
    x = torch.randn(len(row_slots), in_features, generator=gen).to(dtype)
    y = bgmv_shrink(x, lora_a, ranks, row_slots)
    y_ref = bgmv_shrink_reference(x, lora_a, ranks, row_slots)
    torch.testing.assert_close(y, y_ref, atol=TOLERANCE[dtype], rtol=TOLERANCE[dtype])
    out = torch.randn(len(row_slots), out_features, generator=gen).to(dtype)
    out_ref = out.clone()
    bgmv_expand(y_ref, lora_b, ranks, scales, row_slots, out)
    bgmv_expand_reference(y_ref, lora_b, ranks, scales, row_slots, out_ref)
    torch.testing.assert_close(out, out_ref, atol=TOLERANCE[dtype], rtol=TOLERANCE[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
def test_cpu_gathered_bgmv_equals_the_reference(dtype):
    gen = torch.Generator().manual_seed(3)
    lora_a, lora_b, ranks, scales = make_pool(6, 576, 1536, dtype, gen)
    row_slots = torch.tensor([1, 3, -1, 1, 5, 0, 2, 4], dtype=torch.int32)
    x = torch.randn(len(row_slots), 576, generator=gen).to(dtype)
    y = bgmv_shrink_gathered(x, lora_a, ranks, row_slots)
    torch.testing.assert_close(y, bgmv_shrink_reference(x, lora_a, ranks, row_slots), atol=TOLERANCE[dtype], rtol=0)
    out = torch.randn(len(row_slots), 1536, generator=gen).to(dtype)
    out_ref = out.clone()
    bgmv_expand_gathered(y, lora_b, ranks, scales, row_slots, out)
    bgmv_expand_reference(y, lora_b, ranks, scales, row_slots, out_ref)
    torch.testing.assert_close(out, out_ref, atol=TOLERANCE[dtype], rtol=TOLERANCE[dtype])
    empty = torch.full((3,), -1, dtype=torch.int32)
    assert torch.count_nonzero(bgmv_shrink_gathered(x[:3], lora_a, ranks, empty)) == 0


def test_references_compute_the_lora_delta_at_each_rows_adapter():
    """Against plain per-row math: delta_t = scale_w * B_w[:, :r] @ (A_w[:r] @ x_t); none for slot -1."""
    gen = torch.Generator().manual_seed(7)
    lora_a, lora_b, ranks, scales = make_pool(3, 64, 32, torch.float32, gen)
    row_slots = torch.tensor([2, -1, 0, 2, 1], dtype=torch.int32)
    x = torch.randn(5, 64, generator=gen)
    out = torch.zeros(5, 32)
    lora_expand(lora_shrink(x, lora_a, ranks, row_slots=row_slots), lora_b, ranks, scales, out, row_slots=row_slots)
    for t, w in enumerate(row_slots.tolist()):
        if w < 0:
            assert torch.count_nonzero(out[t]) == 0
            continue
        r = ranks[w]
        expected = scales[w] * (lora_b[w, :, :r] @ (lora_a[w, :r] @ x[t]))
        torch.testing.assert_close(out[t], expected)


def test_launchers_refuse_mismatched_shapes_and_dtypes():
    lora_a = torch.zeros(2, 8, 64)
    ranks = torch.tensor([8, 8], dtype=torch.int32)
    slots = torch.tensor([0], dtype=torch.int32)
    with pytest.raises(ValueError, match="features"):
        bgmv_shrink(torch.zeros(1, 32), lora_a, ranks, slots)
    with pytest.raises(ValueError, match="int32"):
        bgmv_shrink(torch.zeros(1, 64), lora_a, ranks.long(), slots)
    with pytest.raises(ValueError, match="dtype"):
        bgmv_shrink(torch.zeros(1, 64, dtype=torch.bfloat16), lora_a, ranks, slots)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_dispatch_uses_the_kernels_on_cuda():
    gen = torch.Generator().manual_seed(1)
    lora_a, lora_b, ranks, scales = make_pool(4, 576, 1536, torch.bfloat16, gen)
    indptr, seg_slots = make_segments([5, 11, 1], [0, 3, -1])
    x = torch.randn(17, 576, generator=gen).to(torch.bfloat16)
    out = torch.randn(17, 1536, generator=gen).to(torch.bfloat16)
    y_ref = sgmv_shrink_reference(x, lora_a, ranks, indptr, seg_slots)
    out_ref = out.clone()
    sgmv_expand_reference(y_ref, lora_b, ranks, scales, indptr, seg_slots, out_ref)
    cuda = [t.cuda() for t in (x, lora_a, lora_b, ranks, scales, indptr, seg_slots, out)]
    x_c, a_c, b_c, ranks_c, scales_c, indptr_c, slots_c, out_c = cuda
    y = lora_shrink(x_c, a_c, ranks_c, seg_indptr=indptr_c, seg_slots=slots_c)
    torch.testing.assert_close(y.cpu(), y_ref, atol=2e-2, rtol=2e-2)
    lora_expand(y_ref.cuda(), b_c, ranks_c, scales_c, out_c, seg_indptr=indptr_c, seg_slots=slots_c)
    torch.testing.assert_close(out_c.cpu(), out_ref, atol=2e-2, rtol=2e-2)
