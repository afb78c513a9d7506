"""CPU candidates for the LoRA shrink + expand of one projection, at decode and prefill shapes.

    python -m benchmarks.bench_lora_ops

Candidates: the per-segment loop (the SGMV reference), gather + bmm (sgmv_kernels.cpu:
each row's A and B gathered up to the batch's largest rank), a loop over distinct
adapters (rows of an adapter gathered together), and rows regrouped by adapter over
dense float32 stacks of the distinct adapters (`grouped_lora`), with the stacks gathered
in the call or reused (as that fallback reuses them while the same adapters run), and the
compiled kernel the engine runs (native.py). Prints microseconds per shrink + expand,
median of 30 calls.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial

import torch

from benchmarks.timing import median_microseconds
from loraserve.config import default_cache_dir
from loraserve.models.dtypes import dtype_name
from sgmv_kernels import PooledLora, gather_rows, pool_from_dense, sgmv_expand_reference, sgmv_shrink_reference
from sgmv_kernels.cpu import RowGroups, bgmv_expand_gathered, bgmv_shrink_gathered, grouped_lora
from sgmv_kernels.native import LoraKernel, ProjectionGroup, RowChunks, load_kernel


def per_segment_loop(x, w: PooledLora, indptr, slots, out):
    y = sgmv_shrink_reference(x, w.pool, w.a_rows, w.ranks, indptr, slots)
    sgmv_expand_reference(y, w.pool, w.b_rows, w.ranks, w.scales, indptr, slots, out)


def gather_bmm(x, w: PooledLora, row_slots, out):
    y = bgmv_shrink_gathered(x, w.pool, w.a_rows, w.ranks, row_slots)
    bgmv_expand_gathered(y, w.pool, w.b_rows, w.ranks, w.scales, row_slots, out)


def per_adapter_loop(x, w: PooledLora, row_slots, out):
    for slot in row_slots.unique().tolist():
        if slot < 0:
            continue
        rows = (row_slots == slot).nonzero().squeeze(1)
        r = int(w.ranks[slot])
        a = gather_rows(w.pool, w.a_rows[slot, :r], x.shape[1])
        b_t = gather_rows(w.pool, w.b_rows[slot, :r], out.shape[1])
        out.index_add_(0, rows, ((x[rows] @ a.T) @ b_t * w.scales[slot]).to(out.dtype))


def grouped_stacks(w: PooledLora, row_slots, h_in: int, h_out: int):
    """The distinct adapters' dense float32 stacks and the rows regrouped by adapter."""
    distinct = sorted(set(row_slots.tolist()) - {-1})
    group_of = {slot: group for group, slot in enumerate(distinct)}
    groups = RowGroups.of_segments([1] * len(row_slots), [group_of.get(s, -1) for s in row_slots.tolist()], "cpu")
    slots = torch.tensor(distinct)
    rank = int(w.ranks[slots].max())
    a = gather_rows(w.pool, w.a_rows[slots, :rank], h_in).float()
    b = gather_rows(w.pool, w.b_rows[slots, :rank], h_out).float()
    scales = w.scales[slots].unsqueeze(1).expand(-1, rank).contiguous()
    return a, b, scales, groups


def grouped(x, w: PooledLora, row_slots, out, stacks=None):
    a, b, scales, groups = stacks or grouped_stacks(w, row_slots, x.shape[1], out.shape[1])
    grouped_lora(x, a, [b], scales, groups, out)


def compiled(kernel: LoraKernel, x, w: PooledLora, lengths, slots, out) -> Callable[[], None]:
    """The kernel's call, its row chunks and tables built beforehand (once per step in the engine)."""
    group = ProjectionGroup(
        w.pool, w.a_rows[None], w.b_rows[None], w.ranks[None], w.scales[None], torch.tensor([out.shape[1]]),
        in_features=x.shape[1], out_features=out.shape[1],
    )  # fmt: skip
    return partial(kernel.add, x, group, RowChunks.of_segments(lengths, slots), out)


def main() -> None:
    torch.manual_seed(0)
    kernel = load_kernel(default_cache_dir() / "kernels")
    h_in, h_out, num_slots, max_rank = 576, 1536, 32, 16
    for dtype in (torch.float32, torch.bfloat16):
        ranks = torch.tensor([8, 16] * (num_slots // 2), dtype=torch.int32)
        lora_a = torch.randn(num_slots, max_rank, h_in).to(dtype)
        lora_b = torch.randn(num_slots, h_out, max_rank).to(dtype)
        pooled = pool_from_dense(lora_a, lora_b, ranks, torch.ones(num_slots), torch.Generator().manual_seed(0))
        for label, num_rows, rows_per_adapter in (
            ("decode 32 rows / 32 adapters", 32, 1),
            ("prefill 512 rows / 8", 512, 64),
        ):
            x = torch.randn(num_rows, h_in).to(dtype)
            out = torch.zeros(num_rows, h_out, dtype=dtype)
            row_slots = (torch.arange(num_rows, dtype=torch.int32) // rows_per_adapter) % num_slots
            lengths = [rows_per_adapter] * (num_rows // rows_per_adapter)
            indptr = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
            seg_slots = row_slots[indptr[:-1].long()]
            results = {
                "compiled kernel": (
                    median_microseconds(compiled(kernel, x, pooled, lengths, seg_slots.tolist(), out))
                    if kernel
                    else float("nan")
                ),
                "per-segment loop": median_microseconds(partial(per_segment_loop, x, pooled, indptr, seg_slots, out)),
                "gather + bmm": median_microseconds(partial(gather_bmm, x, pooled, row_slots, out)),
                "per-adapter loop": median_microseconds(partial(per_adapter_loop, x, pooled, row_slots, out)),
                "grouped, stacks gathered": median_microseconds(partial(grouped, x, pooled, row_slots, out)),
                "grouped, stacks reused": median_microseconds(
                    partial(grouped, x, pooled, row_slots, out, grouped_stacks(pooled, row_slots, h_in, h_out))
                ),
            }
            cells = ", ".join(f"{name} {us:.0f} us" for name, us in results.items())
            print(f"{dtype_name(dtype)} {label}: {cells}")


if __name__ == "__main__":
    main()
