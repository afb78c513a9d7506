"""Triton SGMV/BGMV kernels equal their torch references (on the CPU under TRITON_INTERPRET=1)."""

from __future__ import annotations

import contextlib

import pytest
import torch

from sgmv_kernels import (
    PooledLora,
    bgmv_expand,
    bgmv_expand_reference,
    bgmv_shrink,
    bgmv_shrink_reference,
    gather_rows,
    lora_expand,
    lora_shrink,
    pool_from_dense,
    sgmv_expand,
    sgmv_expand_group,
    sgmv_expand_reference,
    sgmv_shrink,
    sgmv_shrink_group,
    sgmv_shrink_reference,
)
from sgmv_kernels.cpu import bgmv_expand_gathered, bgmv_shrink_gathered
from sgmv_kernels.launch import ExpandShape, LaunchShapes, ShrinkShape, forced
from sgmv_kernels.layout import row_alignment

RANKS = [1, 4, 8, 16, 64, 128]  # mixed in every pool
MAX_RANK = 128
TOLERANCE = {torch.float32: 1e-4, torch.bfloat16: 2e-2}


def make_pool(num_slots: int, in_features: int, out_features: int, dtype, gen: torch.Generator):
    """Adapters of mixed ranks, their rows scattered over one pool (as the engine keeps them).

    Returns the pooled weights and the dense A [slots, max_rank, H_in] / B [slots, H_out,
    max_rank], zero past each rank, for checks against plain math.
    """
    ranks = torch.tensor([RANKS[i % len(RANKS)] for i in range(num_slots)], dtype=torch.int32)
    lora_a = torch.zeros(num_slots, MAX_RANK, in_features)
    lora_b = torch.zeros(num_slots, out_features, MAX_RANK)
    for slot, rank in enumerate(ranks.tolist()):
        lora_a[slot, :rank] = torch.randn(rank, in_features, generator=gen) / in_features**0.5
        lora_b[slot, :, :rank] = torch.randn(out_features, rank, generator=gen) / rank**0.5
    scales = torch.rand(num_slots, generator=gen) * 2
    lora_a, lora_b = lora_a.to(dtype), lora_b.to(dtype)
    return pool_from_dense(lora_a, lora_b, ranks, scales, gen), lora_a, lora_b


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
    w, _, _ = make_pool(6, in_features, out_features, dtype, gen)
    indptr, seg_slots = make_segments(lengths, slots)
    x = torch.randn(sum(lengths), in_features, generator=gen).to(dtype)
    longest = max(lengths, default=None)  # a prompt's rows spread over programs
    y = sgmv_shrink(x, w.pool, w.a_rows, w.ranks, indptr, seg_slots, longest)
    y_ref = sgmv_shrink_reference(x, w.pool, w.a_rows, w.ranks, indptr, seg_slots)
    torch.testing.assert_close(y, y_ref, atol=TOLERANCE[dtype], rtol=TOLERANCE[dtype])
    out = torch.randn(sum(lengths), out_features, generator=gen).to(dtype)
    out_ref = out.clone()
    sgmv_expand(y_ref, w.pool, w.b_rows, w.ranks, w.scales, indptr, seg_slots, out, longest)
    sgmv_expand_reference(y_ref, w.pool, w.b_rows, w.ranks, w.scales, indptr, seg_slots, out_ref)
    torch.testing.assert_close(out, out_ref, atol=TOLERANCE[dtype], rtol=TOLERANCE[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize(("in_features", "out_features"), [(576, 1536), (4096, 576), (1536, 4096)])
def test_bgmv_with_interleaved_adapters_equals_the_reference(in_features, out_features, dtype):
    gen = torch.Generator().manual_seed(in_features + out_features)
    w, _, _ = make_pool(6, in_features, out_features, dtype, gen)
    row_slots = torch.tensor([0, 3, 0, -1, 5, 3, 1, 2, 4, 0, -1, 5], dtype=torch.int32)  # interleaved, some none
    x = torch.randn(len(row_slots), in_features, generator=gen).to(dtype)
    y = bgmv_shrink(x, w.pool, w.a_rows, w.ranks, row_slots)
    y_ref = bgmv_shrink_reference(x, w.pool, w.a_rows, w.ranks, row_slots)
    torch.testing.assert_close(y, y_ref, atol=TOLERANCE[dtype], rtol=TOLERANCE[dtype])
    out = torch.randn(len(row_slots), out_features, generator=gen).to(dtype)
    out_ref = out.clone()
    bgmv_expand(y_ref, w.pool, w.b_rows, w.ranks, w.scales, row_slots, out)
    bgmv_expand_reference(y_ref, w.pool, w.b_rows, w.ranks, w.scales, row_slots, out_ref)
    torch.testing.assert_close(out, out_ref, atol=TOLERANCE[dtype], rtol=TOLERANCE[dtype])


def group_of(pooled: list[PooledLora]) -> tuple[torch.Tensor, ...]:
    """Projections' weights in one pool and [P, slots, rank] tables, as lora/slots.py keeps a layer's."""
    offsets = torch.tensor([0, *[w.pool.numel() for w in pooled]]).cumsum(0).tolist()
    pool = torch.cat([w.pool for w in pooled])
    a_rows = torch.stack([w.a_rows + offset for w, offset in zip(pooled, offsets, strict=False)])
    b_rows = torch.stack([w.b_rows + offset for w, offset in zip(pooled, offsets, strict=False)])
    return pool, a_rows, b_rows, torch.stack([w.ranks for w in pooled]), torch.stack([w.scales for w in pooled])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("widths", [[576, 192, 192], [1536, 1536], [576]], ids=["qkv", "gate-up", "one"])
@pytest.mark.parametrize(
    ("lengths", "slots", "longest"),
    [
        ([2, 1, 3, 2], [0, 3, -1, 5], None),
        ([1] * 8, [0, 3, 0, -1, 5, 3, 1, 2], None),
        ([20, 1], [4, 2], None),
        ([20, 1], [4, 2], 20),
    ],
    ids=["decode-sorted", "decode-interleaved", "prompt-in-one-program", "prompt-spread"],
)
def test_a_projection_group_in_one_launch_equals_each_projection_alone(dtype, widths, lengths, slots, longest):
    """The engine's form: a segment's rows share their adapter (decode rows sorted by adapter, or a
    prompt); the last of a tile's K splits sums them for the expand. A segment's rows go to
    one program (CUDA graphs) or are spread over several (given the longest segment)."""
    check_group_launch(dtype, widths, lengths, slots, "cpu", longest)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("widths", [[576, 192, 192], [1536, 1536], [576]], ids=["qkv", "gate-up", "one"])
def test_a_projection_group_on_cuda_equals_each_projection_alone(dtype, widths):
    """Compiled for the GPU: sorted decode rows, a lone row, a base row and a prompt in one launch,
    with this GPU's launch shapes and the sweep's extremes."""
    for shapes in (None, *OTHER_SHAPES):
        for longest in (None, 40):  # as in a CUDA graph, and spread over programs
            check_group_launch(dtype, widths, [2, 1, 3, 2, 40], [0, 3, -1, 5, 1], "cuda", longest, shapes)


# Launch shapes unlike the defaults at both ends of the sweep's grid (benchmarks/bench_kernels.py).
OTHER_SHAPES = [
    LaunchShapes(ShrinkShape(block_k=256, split_waves=16, num_warps=4, num_stages=4), ExpandShape(512, 8, 1)),
    LaunchShapes(
        ShrinkShape(block_k=128, split_waves=8, num_warps=2, num_stages=2), ExpandShape(128, 2, 16, decode_fma=False)
    ),
]


@pytest.mark.parametrize("shapes", OTHER_SHAPES, ids=["wide", "narrow"])
def test_any_launch_shape_computes_the_same(shapes, monkeypatch):
    """A GPU's tuned shapes change how work is cut, never the result (K split over programs, and
    several column blocks per expand program, as on a GPU of 8 SMs)."""
    from sgmv_kernels import expand, shrink

    monkeypatch.setattr(shrink, "num_sms", lambda device: 8)
    monkeypatch.setattr(expand, "num_sms", lambda device: 8)
    check_group_launch(torch.float32, [1536, 1536], [2, 1, 3, 20], [0, 3, -1, 5], "cpu", None, shapes)
    check_group_launch(torch.bfloat16, [576, 192, 192], [2, 1, 3, 20], [0, 3, -1, 5], "cpu", 20, shapes)


def check_group_launch(dtype, widths, lengths, slots, device, longest, shapes=None):
    with forced(shapes) if shapes else contextlib.nullcontext():
        launch_group(dtype, widths, lengths, slots, device, longest)


def launch_group(dtype, widths, lengths, slots, device, longest):
    gen = torch.Generator().manual_seed(sum(widths))
    pooled = [make_pool(6, 576, width, dtype, gen)[0] for width in widths]
    indptr, seg_slots = make_segments(lengths, slots)
    x = torch.randn(sum(lengths), 576, generator=gen).to(dtype)
    out = torch.randn(sum(lengths), sum(widths), generator=gen).to(dtype)
    expected = out.clone()
    on_device = [t.to(device) for t in (*group_of(pooled), indptr, seg_slots, x, out)]
    pool, a_rows, b_rows, ranks, scales, indptr_d, slots_d, x_d, out_d = on_device
    aligned = row_alignment(*a_rows.flatten().tolist(), *b_rows.flatten().tolist())  # what the engine promises
    y = sgmv_shrink_group(x_d, pool, a_rows, ranks, indptr_d, slots_d, longest, True, aligned).cpu()
    tolerance = {"atol": TOLERANCE[dtype], "rtol": TOLERANCE[dtype]}
    for p, w in enumerate(pooled):
        want = sgmv_shrink_reference(x, w.pool, w.a_rows, w.ranks, indptr, seg_slots)
        torch.testing.assert_close(y[p], want, **tolerance)
    tables = (pool, b_rows, ranks, scales, indptr_d, slots_d, out_d, widths, longest, aligned)
    sgmv_expand_group(y.to(device), *tables)
    column = 0
    for p, (w, width) in enumerate(zip(pooled, widths, strict=True)):
        part = expected[:, column : column + width]
        sgmv_expand_reference(y[p], w.pool, w.b_rows, w.ranks, w.scales, indptr, seg_slots, part)
        column += width
    torch.testing.assert_close(out_d.cpu(), expected, **tolerance)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
def test_cpu_gathered_bgmv_equals_the_reference(dtype):
    gen = torch.Generator().manual_seed(3)
    w, _, _ = make_pool(6, 576, 1536, dtype, gen)
    row_slots = torch.tensor([1, 3, -1, 1, 5, 0, 2, 4], dtype=torch.int32)
    x = torch.randn(len(row_slots), 576, generator=gen).to(dtype)
    y = bgmv_shrink_gathered(x, w.pool, w.a_rows, w.ranks, row_slots)
    torch.testing.assert_close(
        y, bgmv_shrink_reference(x, w.pool, w.a_rows, w.ranks, row_slots), atol=TOLERANCE[dtype], rtol=0
    )
    out = torch.randn(len(row_slots), 1536, generator=gen).to(dtype)
    out_ref = out.clone()
    bgmv_expand_gathered(y, w.pool, w.b_rows, w.ranks, w.scales, row_slots, out)
    bgmv_expand_reference(y, w.pool, w.b_rows, w.ranks, w.scales, row_slots, out_ref)
    torch.testing.assert_close(out, out_ref, atol=TOLERANCE[dtype], rtol=TOLERANCE[dtype])
    empty = torch.full((3,), -1, dtype=torch.int32)
    assert torch.count_nonzero(bgmv_shrink_gathered(x[:3], w.pool, w.a_rows, w.ranks, empty)) == 0


def test_split_k_partials_sum_to_the_reference(monkeypatch):
    """As on a large GPU: few rows spread over many programs, each summing part of the hidden size;
    the last split of each tile adds the partials up (and leaves its counter at zero for the next
    launch); the expand leaves rows without an adapter alone."""
    from sgmv_kernels import expand, shrink

    monkeypatch.setattr(shrink, "num_sms", lambda device: 64)
    monkeypatch.setattr(expand, "num_sms", lambda device: 64)
    gen = torch.Generator().manual_seed(11)
    w, _, _ = make_pool(6, 4096, 576, torch.float32, gen)
    assert shrink._split_k(4096, 8, 128, 4, torch.device("cpu"))[0] > 1
    row_slots = torch.tensor([5, -1, 2], dtype=torch.int32)
    x = torch.randn(3, 4096, generator=gen)
    expected = bgmv_shrink_reference(x, w.pool, w.a_rows, w.ranks, row_slots)
    tolerance = {"atol": TOLERANCE[torch.float32], "rtol": TOLERANCE[torch.float32]}
    torch.testing.assert_close(bgmv_shrink(x, w.pool, w.a_rows, w.ranks, row_slots), expected, **tolerance)
    indptr, seg_slots = make_segments([2, 1], [5, 2])
    expected = sgmv_shrink_reference(x, w.pool, w.a_rows, w.ranks, indptr, seg_slots)
    torch.testing.assert_close(sgmv_shrink(x, w.pool, w.a_rows, w.ranks, indptr, seg_slots), expected, **tolerance)
    indptr, seg_slots = make_segments([2, 1], [5, -1])
    y = sgmv_shrink_group(x, w.pool, w.a_rows[None], w.ranks[None], indptr, seg_slots)  # not zeroed
    assert torch.count_nonzero(shrink._counters[x.device]) == 0
    out = torch.randn(3, 576, generator=gen)
    expected = out.clone()
    y_ref = sgmv_shrink_reference(x, w.pool, w.a_rows, w.ranks, indptr, seg_slots)
    torch.testing.assert_close(y[0, :2, : w.ranks[5]], y_ref[:2, : w.ranks[5]], **tolerance)
    sgmv_expand_reference(y_ref, w.pool, w.b_rows, w.ranks, w.scales, indptr, seg_slots, expected)
    sgmv_expand_group(y, w.pool, w.b_rows[None], w.ranks[None], w.scales[None], indptr, seg_slots, out, [576])
    torch.testing.assert_close(out, expected, **tolerance)
    # A CUDA graph's tables: a segment per row, most empty; K is split for the busy ones.
    indptr, seg_slots = make_segments([2, 1, 0, 0, 0, 0, 0, 0], [5, 2] + [-1] * 6)
    expected = sgmv_shrink_reference(x, w.pool, w.a_rows, w.ranks, indptr, seg_slots)
    tables = (w.pool, w.a_rows[None], w.ranks[None], indptr, seg_slots)
    assert shrink._split_k(4096, 2 * 8, 128, 4, x.device)[0] > shrink._split_k(4096, 8 * 8, 128, 4, x.device)[0]
    for busy in (None, 2):  # K split for all eight segments, or for the two that hold rows
        y = sgmv_shrink_group(x, *tables, zeroed=True, busy_segments=busy)
        torch.testing.assert_close(y[0], expected, **tolerance)


def test_references_compute_the_lora_delta_at_each_rows_adapter():
    """Against plain per-row math: delta_t = scale_w * B_w[:, :r] @ (A_w[:r] @ x_t); none for slot -1."""
    gen = torch.Generator().manual_seed(7)
    w, lora_a, lora_b = make_pool(3, 64, 32, torch.float32, gen)
    row_slots = torch.tensor([2, -1, 0, 2, 1], dtype=torch.int32)
    x = torch.randn(5, 64, generator=gen)
    out = torch.zeros(5, 32)
    lora_expand(lora_shrink(x, w, row_slots=row_slots), w, out, row_slots=row_slots)
    for t, slot in enumerate(row_slots.tolist()):
        if slot < 0:
            assert torch.count_nonzero(out[t]) == 0
            continue
        r = w.ranks[slot]
        expected = w.scales[slot] * (lora_b[slot, :, :r] @ (lora_a[slot, :r] @ x[t]))
        torch.testing.assert_close(out[t], expected)


def test_pool_rows_are_scattered_and_padding_points_at_zeros():
    gen = torch.Generator().manual_seed(5)
    w, lora_a, _ = make_pool(3, 64, 32, torch.float32, gen)
    rank = int(w.ranks[1])
    offsets = w.a_rows[1, :rank]
    assert not torch.equal(offsets.diff(), torch.full((rank - 1,), 64)), "rows should not sit back to back"
    torch.testing.assert_close(gather_rows(w.pool, offsets, 64), lora_a[1, :rank])
    assert torch.count_nonzero(gather_rows(w.pool, w.a_rows[1, rank:], 64)) == 0


def test_launchers_refuse_mismatched_shapes_and_dtypes():
    pool = torch.zeros(1000)
    rows = torch.zeros(2, 8, dtype=torch.int64)
    ranks = torch.tensor([8, 8], dtype=torch.int32)
    slots = torch.tensor([0], dtype=torch.int32)
    with pytest.raises(ValueError, match="int64"):
        bgmv_shrink(torch.zeros(1, 64), pool, rows.int(), ranks, slots)
    with pytest.raises(ValueError, match="int32"):
        bgmv_shrink(torch.zeros(1, 64), pool, rows, ranks.long(), slots)
    with pytest.raises(ValueError, match="dtype"):
        bgmv_shrink(torch.zeros(1, 64, dtype=torch.bfloat16), pool, rows, ranks, slots)
    with pytest.raises(ValueError, match="num_slots"):
        bgmv_shrink(torch.zeros(1, 64), pool, rows, ranks[:1], slots)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
def test_dispatch_uses_the_kernels_on_cuda(dtype):
    """The compiled kernels (not the interpreter) on a GPU equal the CPU reference: SGMV and BGMV."""
    gen = torch.Generator().manual_seed(1)
    w, _, _ = make_pool(6, 576, 1536, dtype, gen)
    on_gpu = PooledLora(*(t.cuda() for t in (w.pool, w.a_rows, w.b_rows, w.ranks, w.scales)))
    tolerance = {"atol": TOLERANCE[dtype], "rtol": TOLERANCE[dtype]}
    for indptr, seg_slots in (
        make_segments([5, 11, 1, 40], [0, 3, -1, 5]),
        make_segments([1] * 9, [4, 0, -1, 4, 2, 3, 1, 5, 0]),
    ):
        x = torch.randn(int(indptr[-1]), 576, generator=gen).to(dtype)
        out = torch.randn(int(indptr[-1]), 1536, generator=gen).to(dtype)
        y_ref = sgmv_shrink_reference(x, w.pool, w.a_rows, w.ranks, indptr, seg_slots)
        out_ref = out.clone()
        sgmv_expand_reference(y_ref, w.pool, w.b_rows, w.ranks, w.scales, indptr, seg_slots, out_ref)
        decode = bool((indptr.diff() == 1).all())
        rows = (
            {"row_slots": seg_slots.cuda()} if decode else {"seg_indptr": indptr.cuda(), "seg_slots": seg_slots.cuda()}
        )
        y = lora_shrink(x.cuda(), on_gpu, **rows)
        torch.testing.assert_close(y.cpu(), y_ref, **tolerance)
        out_gpu = out.cuda()
        lora_expand(y_ref.cuda(), on_gpu, out_gpu, **rows)
        torch.testing.assert_close(out_gpu.cpu(), out_ref, **tolerance)
