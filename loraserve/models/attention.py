"""Attention over the paged KV cache, in torch (the CPU path; CUDA uses the same code today).

The KV cache of one layer is two tensors `[num_blocks, block_size, num_kv_heads, head_dim]`.
A token at position p of a sequence lives in slot `block_table[p // block_size] * block_size
+ p % block_size`. Each step writes the new tokens' K and V into their slots, then every
row attends over its whole context gathered block by block from its block table.

The rows of a step form at most two groups, each computed as one padded batch: the
decodes (one query token each) and the prefill chunks (many query tokens each), so a long
prompt never pads a decode row to its length.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass
class AttentionGroup:
    """Rows that attend as one padded batch; built once per step, shared by every layer."""

    token_start: int  # this group's tokens are [token_start, token_end) of the step's tokens
    token_end: int
    max_query_len: int  # Lq: query tokens of the longest row
    block_tables: torch.Tensor  # [B, max_blocks] int64, padded with block 0 (masked out)
    attend_bias: torch.Tensor  # [B, 1, Lq, max_blocks * block_size] model dtype: 0 = may attend, -inf = may not
    padded_index: torch.Tensor | None  # [token_end - token_start] int64 row in [B * Lq]; None = no padding


@dataclass
class AttentionMetadata:
    """Per-step attention inputs, built by the model runner once per step."""

    slot_mapping: torch.Tensor  # [T] int64 flat KV slot of each token of the step
    groups: list[AttentionGroup]


def paged_attention(
    q: torch.Tensor,  # [T, Hq, D]
    k: torch.Tensor,  # [T, Hkv, D]
    v: torch.Tensor,  # [T, Hkv, D]
    k_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
    v_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
    metadata: AttentionMetadata,
    scale: float,
) -> torch.Tensor:  # [T, Hq, D]
    """Store this step's K/V in the cache, then attend each row over its cached context."""
    _, block_size, num_kv_heads, head_dim = k_cache.shape
    num_heads = q.shape[1]
    k_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, metadata.slot_mapping, k)
    v_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, metadata.slot_mapping, v)
    outputs = []
    for group in metadata.groups:
        num_rows, max_blocks = group.block_tables.shape
        context_len = max_blocks * block_size
        tables = group.block_tables.view(-1)
        # keys, values: [B, Hkv, context_len, D]
        keys = k_cache.index_select(0, tables).view(num_rows, context_len, num_kv_heads, head_dim).transpose(1, 2)
        values = v_cache.index_select(0, tables).view(num_rows, context_len, num_kv_heads, head_dim).transpose(1, 2)
        queries = q[group.token_start : group.token_end]
        if group.padded_index is not None:
            padded = queries.new_zeros(num_rows * group.max_query_len, num_heads, head_dim)
            queries = padded.index_copy_(0, group.padded_index, queries)
        # queries: [B, Hq, Lq, D]
        queries = queries.view(num_rows, group.max_query_len, num_heads, head_dim).transpose(1, 2)
        attended = F.scaled_dot_product_attention(
            queries, keys, values, attn_mask=group.attend_bias, scale=scale, enable_gqa=num_heads != num_kv_heads
        )
        attended = attended.transpose(1, 2).reshape(num_rows * group.max_query_len, num_heads, head_dim)
        if group.padded_index is not None:
            attended = attended.index_select(0, group.padded_index)
        outputs.append(attended)
    return outputs[0] if len(outputs) == 1 else torch.cat(outputs)
