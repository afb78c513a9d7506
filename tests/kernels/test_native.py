"""The compiled CPU kernel (sgmv_kernels/native.py) equals the torch references; it is built once
per machine, and without a compiler the engine is told why and keeps to the torch path."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch

from sgmv_kernels import sgmv_expand_reference, sgmv_shrink_reference
from sgmv_kernels.build import build
from sgmv_kernels.native import CHUNK_ROWS, SOURCE, LoraKernel, ProjectionGroup, RowChunks, load_kernel
from tests.kernels.test_sgmv import CASES, TOLERANCE, make_pool, make_segments


@pytest.fixture(scope="module")
def kernel(tmp_path_factory: pytest.TempPathFactory) -> LoraKernel:
    built = load_kernel(tmp_path_factory.mktemp("kernels"))
    assert built is not None, "the C++ compiler the project installs could not build the kernel"
    return built


def one_projection(pooled, in_features: int, out_features: int) -> ProjectionGroup:
    return ProjectionGroup(
        pool=pooled.pool,
        a_rows=pooled.a_rows.unsqueeze(0),
        b_rows=pooled.b_rows.unsqueeze(0),
        ranks=pooled.ranks.unsqueeze(0),
        scales=pooled.scales.float().unsqueeze(0),
        widths=torch.tensor([out_features]),
        in_features=in_features,
        out_features=out_features,
    )


def reference(x, pooled, lengths, slots, out):
    """out + LoRA(x) as the Triton kernels' torch references compute it."""
    indptr, seg_slots = make_segments(lengths, slots)
    y = sgmv_shrink_reference(x, pooled.pool, pooled.a_rows, pooled.ranks, indptr, seg_slots)
    result = out.clone()
    sgmv_expand_reference(y, pooled.pool, pooled.b_rows, pooled.ranks, pooled.scales, indptr, seg_slots, result)
    return result


NATIVE_CASES = [
    *CASES,
    (576, 192, [20, 3, 9], [1, 2, 1]),  # a slot's rows over several chunks, and split by another slot
    (100, 40, [2, 5], [3, 0]),  # widths that are no multiple of the vector length: the scalar tails
    (576, 1536, [1], [2]),  # one chat: fewer chunks than threads, so the threads split the chunk
    (100, 40, [5], [3]),  # a split chunk's scalar tails
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize(("in_features", "out_features", "lengths", "slots"), NATIVE_CASES)
def test_native_kernel_equals_the_reference(kernel, in_features, out_features, lengths, slots, dtype):
    gen = torch.Generator().manual_seed(len(lengths) * 1000 + in_features + out_features)
    pooled, _, _ = make_pool(6, in_features, out_features, dtype, gen)
    x = torch.randn(sum(lengths), in_features, generator=gen).to(dtype)
    out = torch.randn(sum(lengths), out_features, generator=gen).to(dtype)
    want = reference(x, pooled, lengths, slots, out)
    kernel.add(x, one_projection(pooled, in_features, out_features), RowChunks.of_segments(lengths, slots), out)
    torch.testing.assert_close(out, want, atol=TOLERANCE[dtype], rtol=TOLERANCE[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
def test_a_chunk_split_over_threads_gives_the_bits_of_one_thread(kernel, dtype):
    """One chat's row: each thread takes part of A's rows and of B's columns, each sum in the same order."""
    gen = torch.Generator().manual_seed(11)
    pooled, _, _ = make_pool(6, 576, 1536, dtype, gen)
    x = torch.randn(1, 576, generator=gen).to(dtype)
    start = torch.randn(1, 1536, generator=gen).to(dtype)
    results = []
    threads = torch.get_num_threads()
    try:
        for count in (1, 2, 3):
            torch.set_num_threads(count)
            out = start.clone()
            kernel.add(x, one_projection(pooled, 576, 1536), RowChunks.of_segments([1], [4]), out)
            results.append(out)
    finally:
        torch.set_num_threads(threads)
    assert all(torch.equal(results[0], other) for other in results[1:])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
def test_projections_that_share_an_input_land_side_by_side(kernel, dtype):
    """q/k/v-like: one call, three projections of different widths, outputs in one tensor."""
    gen = torch.Generator().manual_seed(5)
    widths = [576, 192, 192]
    pools = [make_pool(6, 576, width, dtype, gen)[0] for width in widths]
    # One pool for the three, as the engine has it: each projection's rows shifted past the others'.
    shifts = torch.tensor([0, *[p.pool.numel() for p in pools]]).cumsum(0)
    group = ProjectionGroup(
        pool=torch.cat([p.pool for p in pools]),
        a_rows=torch.stack([p.a_rows + int(shift) for p, shift in zip(pools, shifts, strict=False)]),
        b_rows=torch.stack([p.b_rows + int(shift) for p, shift in zip(pools, shifts, strict=False)]),
        ranks=torch.stack([p.ranks for p in pools]),
        scales=torch.stack([p.scales.float() for p in pools]),
        widths=torch.tensor(widths),
        in_features=576,
        out_features=sum(widths),
    )
    lengths, slots = [1, 1, 12, 1], [3, -1, 0, 3]
    x = torch.randn(sum(lengths), 576, generator=gen).to(dtype)
    out = torch.randn(sum(lengths), sum(widths), generator=gen).to(dtype)
    want = torch.cat(
        [reference(x, p, lengths, slots, part) for p, part in zip(pools, out.split(widths, dim=1), strict=True)], dim=1
    )
    kernel.add(x, group, RowChunks.of_segments(lengths, slots), out)
    torch.testing.assert_close(out, want, atol=TOLERANCE[dtype], rtol=TOLERANCE[dtype])


def test_mismatched_tensors_are_refused_before_the_kernel_runs(kernel):
    gen = torch.Generator().manual_seed(1)
    pooled, _, _ = make_pool(2, 64, 32, torch.float32, gen)
    group, rows = one_projection(pooled, 64, 32), RowChunks.of_segments([2], [0])
    with pytest.raises(ValueError, match="do not fit"):
        kernel.add(torch.zeros(2, 48), group, rows, torch.zeros(2, 32))
    with pytest.raises(ValueError, match="dtype"):
        kernel.add(torch.zeros(2, 64, dtype=torch.bfloat16), group, rows, torch.zeros(2, 32))
    with pytest.raises(ValueError, match="contiguous rows"):
        kernel.add(torch.zeros(64, 2).T, group, rows, torch.zeros(2, 32))


def test_row_chunks_sort_rows_by_slot_and_cut_long_runs():
    rows = RowChunks.of_segments([1, 1, 3], [2, -1, 2])
    assert rows.order.tolist() == [0, 2, 3, 4] and rows.chunks.tolist() == [[0, 4, 2]]
    rows = RowChunks.of_segments([1, CHUNK_ROWS + 2, 1], [1, 0, 1])
    assert rows.order.tolist() == [*range(1, CHUNK_ROWS + 3), 0, CHUNK_ROWS + 3]
    assert rows.chunks.tolist() == [
        [0, CHUNK_ROWS, 0],
        [CHUNK_ROWS, CHUNK_ROWS + 2, 0],
        [CHUNK_ROWS + 2, CHUNK_ROWS + 4, 1],
    ]


def test_the_kernel_is_built_once_and_reused(tmp_path: Path):
    first = build(SOURCE, tmp_path)
    built_at = first.stat().st_mtime_ns
    assert build(SOURCE, tmp_path) == first and first.stat().st_mtime_ns == built_at
    assert [p.name for p in tmp_path.iterdir()] == [first.name], "no scratch files left behind"


def test_without_a_compiler_the_torch_path_is_kept_and_the_reason_logged(tmp_path, monkeypatch, caplog):
    monkeypatch.setenv("CXX", "no-such-compiler")
    with caplog.at_level(logging.WARNING):
        assert load_kernel(tmp_path) is None
    assert "falls back to the slower torch path" in caplog.text and "no C++ compiler" in caplog.text
