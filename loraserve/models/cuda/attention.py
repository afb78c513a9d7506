"""Decode attention on CUDA: a Triton kernel that reads K and V blocks where they lie in the paged cache.

One program per (row, KV head) walks the row's context in tiles of TILE tokens, looking each token's block up in the
block table, and keeps FlashAttention's online softmax (a running max and sum) for the G query heads that share the
KV head, so each K and V element is read once for all of them. Nothing is gathered or padded in memory: the work
follows `context_lens`, which the kernel reads on the device, so one launch serves any mix of context lengths and a
CUDA graph replays it as the contexts grow. A row of context 0 (a CUDA graph's padding) gives zeros.

Example, block_size 16, block table [7, 2], context 20: tokens 0-15 are block 7's slots 0-15, tokens 16-19 block
2's slots 0-3; TILE 64 covers them in one pass, the last 44 lanes masked.
Prompt chunks keep SDPA (attention.py). Checked against the torch reference on the CPU under TRITON_INTERPRET=1
and on a GPU (tests/kernels/test_decode_attention.py).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from sgmv_kernels.shrink import tensor_cores, tile_dot

TILE = 64  # tokens per pass: four 16-token blocks (an H200 read a long context 1.5x faster than with 32)
MIN_DOT_ROWS = 16  # a tile product's least rows: the query heads of a group are padded to them


@triton.jit
def _paged_decode_kernel(
    q_ptr, k_ptr, v_ptr, out_ptr, tables_ptr, lens_ptr, scale,
    stride_q_row, stride_q_head, stride_page, stride_slot, stride_kv_head,
    stride_table, stride_out_row, stride_out_head,
    GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    TILE: tl.constexpr, TENSOR_CORES: tl.constexpr,
):  # fmt: skip
    # q K^T and P V as tile products (tensor cores for 16-bit caches) of the G query heads padded to
    # GROUP_PAD >= 16 rows: summing broadcast [G, TILE, D] products took 253 registers a thread.
    row = tl.program_id(0)
    kv_head = tl.program_id(1)
    context = tl.load(lens_ptr + row)
    heads = kv_head * GROUP + tl.arange(0, GROUP_PAD)
    head_ok = tl.arange(0, GROUP_PAD) < GROUP
    dims = tl.arange(0, HEAD_DIM)
    q = tl.load(
        q_ptr + row * stride_q_row + heads[:, None] * stride_q_head + dims[None, :], mask=head_ok[:, None], other=0.0
    )  # [GROUP_PAD, D]
    running_max = tl.full((GROUP_PAD,), float("-inf"), dtype=tl.float32)
    running_sum = tl.zeros((GROUP_PAD,), dtype=tl.float32)
    acc = tl.zeros((GROUP_PAD, HEAD_DIM), dtype=tl.float32)
    for start in range(0, context, TILE):
        tokens = start + tl.arange(0, TILE)
        valid = tokens < context
        blocks = tl.load(tables_ptr + row * stride_table + tokens // BLOCK_SIZE, mask=valid, other=0)
        slots = blocks.to(tl.int64) * stride_page + (tokens % BLOCK_SIZE) * stride_slot + kv_head * stride_kv_head
        k = tl.load(k_ptr + slots[:, None] + dims[None, :], mask=valid[:, None], other=0.0)  # [TILE, D]
        v = tl.load(v_ptr + slots[:, None] + dims[None, :], mask=valid[:, None], other=0.0)
        scores = tile_dot(q, tl.trans(k), TENSOR_CORES) * scale  # [GROUP_PAD, TILE]
        scores = tl.where(valid[None, :], scores, float("-inf"))
        new_max = tl.maximum(running_max, tl.max(scores, axis=1))
        correction = tl.exp(running_max - new_max)
        probs = tl.exp(scores - new_max[:, None])
        running_sum = running_sum * correction + tl.sum(probs, axis=1)
        acc = acc * correction[:, None] + tile_dot(probs.to(v.dtype), v, TENSOR_CORES)
        running_max = new_max
    out = acc / tl.maximum(running_sum, 1e-30)[:, None]  # context 0: zeros
    tl.store(
        out_ptr + row * stride_out_row + heads[:, None] * stride_out_head + dims[None, :],
        out.to(out_ptr.dtype.element_ty),
        mask=head_ok[:, None],
    )


def paged_decode_attention(
    queries: torch.Tensor,  # [B, Hq, D], one token per row
    k_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D], any page stride (the pool's strided view)
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,  # [B, max_blocks] int
    context_lens: torch.Tensor,  # [B] int: keys each row attends to
    scale: float,
) -> torch.Tensor:  # [B, Hq, D]
    rows, num_heads, head_dim = queries.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    assert k_cache.stride() == v_cache.stride() and k_cache.stride(3) == 1, "K and V share one layout"
    assert head_dim == triton.next_power_of_2(head_dim), "head_dim must be a power of two"
    group = num_heads // num_kv_heads
    out = torch.empty_like(queries)
    if rows == 0:
        return out
    _paged_decode_kernel[(rows, num_kv_heads)](
        queries, k_cache, v_cache, out, block_tables, context_lens, scale,
        queries.stride(0), queries.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        block_tables.stride(0), out.stride(0), out.stride(1),
        GROUP=group, GROUP_PAD=max(MIN_DOT_ROWS, triton.next_power_of_2(group)), HEAD_DIM=head_dim,
        BLOCK_SIZE=block_size, TILE=max(TILE, triton.next_power_of_2(block_size)),
        TENSOR_CORES=tensor_cores(queries),
    )  # fmt: skip
    return out
