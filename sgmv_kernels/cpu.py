"""The fastest torch paths on the CPU, chosen by `benchmarks/bench_lora_ops.py`.

Measured here (2 cores, one 576 -> 1536 projection, ranks 8 and 16): for decode rows
with 32 distinct adapters, gathering each row's A and B up to the batch's largest rank
and using two bmm calls beats the per-segment loop (about 1.2x in float32, 3x in
bfloat16); for prefill segments of many rows the per-segment loop (the SGMV reference)
is 6-30x faster than gathering per row, so SGMV keeps it.
Same semantics as the references in shrink.py and expand.py; rows come from the pool
(layout.py): entries past a rank point at zeros, so gathering to the batch's largest
rank adds nothing.
"""

from __future__ import annotations

import torch

from sgmv_kernels.layout import gather_rows


def bgmv_shrink_gathered(
    x: torch.Tensor, pool: torch.Tensor, a_rows: torch.Tensor, ranks: torch.Tensor, row_slots: torch.Tensor
) -> torch.Tensor:
    """y [T, max_rank] float32; rows with slot -1 stay zero."""
    y = torch.zeros(x.shape[0], a_rows.shape[1], dtype=torch.float32, device=x.device)
    rows = (row_slots >= 0).nonzero().squeeze(1)
    if rows.numel() == 0:
        return y
    slots = row_slots[rows].long()
    rank = int(ranks[slots].max())
    a = gather_rows(pool, a_rows[slots, :rank], x.shape[1])  # [R, r, H_in]
    y[rows, :rank] = torch.bmm(a, x[rows].unsqueeze(2)).squeeze(2).float()
    return y


def bgmv_expand_gathered(
    y: torch.Tensor,
    pool: torch.Tensor,
    b_rows: torch.Tensor,
    ranks: torch.Tensor,
    scales: torch.Tensor,
    row_slots: torch.Tensor,
    out: torch.Tensor,
) -> None:
    """out [T, H_out] += (y @ B^T) * scale per row, in place."""
    rows = (row_slots >= 0).nonzero().squeeze(1)
    if rows.numel() == 0:
        return
    slots = row_slots[rows].long()
    rank = int(ranks[slots].max())
    b_t = gather_rows(pool, b_rows[slots, :rank], out.shape[1])  # [R, r, H_out]
    delta = torch.bmm(y[rows, :rank].to(b_t.dtype).unsqueeze(1), b_t).squeeze(1)  # [R, H_out]
    delta = delta.float() * scales[slots].unsqueeze(1)
    out.index_add_(0, rows, delta.to(out.dtype))
