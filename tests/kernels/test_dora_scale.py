"""DoRA's output scale: the Triton kernel (TRITON_INTERPRET=1 on the CPU) equals its torch reference,
and the reference is the plain per-row product."""

from __future__ import annotations

import pytest
import torch

from sgmv_kernels.dora import sgmv_dora_scale, sgmv_dora_scale_reference

WIDTHS = [96, 32, 32]  # q/k/v side by side, narrower than one column block and wider than none


def scaled_batch(dtype: torch.dtype, generator: torch.Generator):
    """4 slots: 0 DoRA at q and v, 1 plain LoRA, 2 DoRA at all three, 3 free; segments of 1-5 rows
    with base rows between them."""
    num_slots, widths = 4, WIDTHS
    scales = {(0, 0): None, (0, 2): None, (2, 0): None, (2, 1): None, (2, 2): None}  # (slot, projection)
    chunks, offsets, position = [torch.zeros(7, dtype=dtype)], {}, 7  # rows start anywhere in the pool
    for slot, projection in scales:
        vector = (1 + 0.2 * torch.randn(widths[projection], generator=generator)).to(dtype)
        scales[(slot, projection)], offsets[(slot, projection)] = vector, position
        chunks.append(vector)
        position += vector.numel()
    pool = torch.cat(chunks)
    dora_rows = torch.full((len(widths), num_slots), -1, dtype=torch.int64)
    for (slot, projection), offset in offsets.items():
        dora_rows[projection, slot] = offset
    lengths, slots = [3, 1, 5, 2, 1, 4], [0, -1, 2, 1, 0, 2]
    seg_indptr = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    out = torch.randn(sum(lengths), sum(widths), generator=generator).to(dtype)
    return pool, dora_rows, scales, seg_indptr, torch.tensor(slots, dtype=torch.int32), out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_triton_dora_scale_equals_the_reference_and_scales_only_dora_rows(dtype):
    pool, dora_rows, scales, seg_indptr, seg_slots, out = scaled_batch(dtype, torch.Generator().manual_seed(0))
    expected = out.clone()
    sgmv_dora_scale_reference(pool, dora_rows, WIDTHS, seg_indptr, seg_slots, expected)
    got = out.clone()
    sgmv_dora_scale(pool, dora_rows, WIDTHS, seg_indptr, seg_slots, got)
    # float32 to the bit; bfloat16 to its rounding (the interpreter truncates where a GPU rounds)
    assert torch.allclose(got.float(), expected.float(), rtol=0 if dtype == torch.float32 else 2**-7, atol=0)
    starts = [0, 96, 128]
    bounds = seg_indptr.tolist()
    for segment, slot in enumerate(seg_slots.tolist()):
        rows = slice(bounds[segment], bounds[segment + 1])
        for projection, width in enumerate(WIDTHS):
            columns = slice(starts[projection], starts[projection] + width)
            vector = scales.get((slot, projection))
            want = out[rows, columns] if vector is None else (out[rows, columns].float() * vector.float()).to(dtype)
            assert torch.equal(expected[rows, columns], want), (segment, projection)
