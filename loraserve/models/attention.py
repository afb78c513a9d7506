"""Attention over the paged KV cache, in torch, with a kernel for one-token rows where there is one.

The KV cache of one layer is two tensors `[num_blocks, block_size, num_kv_heads, head_dim]`. A token at position p
of a sequence lives in block `block_table[p // block_size]` at offset `p % block_size`. Each step writes the new
tokens' K and V into their slots (layer_ops.py), then every row attends over its whole context.

The rows of a step form at most two groups, each one padded batch: the decodes (one query token each) and the
prefill chunks (many each), so a long prompt never pads a decode row to its length. Prefill chunks go through SDPA.
Decodes go through the platform's kernel reading K and V in the cache where they lie, Triton on CUDA
(cuda/attention.py) and compiled on the CPU (cpu/attention.py); without one, in bfloat16, through two batched
matmuls over the gathered blocks (`decode_attention`). On a 2-core AMD EPYC both CPU paths run several times
faster than SDPA's bfloat16 kernel (benchmarks/bench_attention.py, docs/benchmarks.md).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch
import torch.nn.functional as F


class DecodeAttention(Protocol):
    """A kernel for one-token rows reading K and V in the paged cache where they lie: the CPU's
    compiled one (cpu/attention.py) or the Triton one on CUDA (cuda/attention.py)."""

    def __call__(
        self,
        queries: torch.Tensor,  # [B, Hq, D]
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        block_tables: torch.Tensor,  # [B, max_blocks]
        context_lens: torch.Tensor,  # [B]
        scale: float,
    ) -> torch.Tensor: ...


@dataclass
class AttentionGroup:
    """Rows that attend as one padded batch; built once per step, shared by every layer."""

    token_start: int  # this group's tokens are [token_start, token_end) of the step's tokens
    token_end: int
    max_query_len: int  # Lq: query tokens of the longest row
    block_tables: torch.Tensor  # [B, max_blocks] int64, padded with block 0 (masked out)
    attend_bias: torch.Tensor  # [B, 1, Lq, max_blocks * block_size] model dtype: 0 = may attend, -inf = may not
    window_tables: torch.Tensor | None  # for the windowed layers: each row's blocks its window reaches, padded
    window_bias: torch.Tensor | None  # and their mask (the last W keys of each query); None: no layer has a window
    padded_index: torch.Tensor | None  # [token_end - token_start] int64 row in [B * Lq]; None = no padding
    context_lens: torch.Tensor  # [B] int64 keys each row attends to (its last position + 1)


@dataclass
class AttentionMetadata:
    """Per-step attention inputs, built by the model runner once per step."""

    slot_blocks: torch.Tensor  # [T] int64 the block each token of the step writes its K and V to
    slot_offsets: torch.Tensor  # [T] int64 and its position in that block
    groups: list[AttentionGroup]
    decode_kernel: DecodeAttention | None = None  # for one-token rows; None: the torch paths below
    row_ends: torch.Tensor | None = None  # [T] int64 each token's row's last position + 1 (LongRoPE's choice)


def paged_attention(
    q: torch.Tensor,  # [T, Hq, D]
    k_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D], holding this step's K already
    v_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
    metadata: AttentionMetadata,
    scale: float,
    window: int | None = None,  # the layer's sliding window: the last `window` keys only
    softcap: float | None = None,  # scores soft-capped by tanh (Gemma 2)
) -> torch.Tensor:  # [T, Hq, D]
    """Attend each row over its cached context (its window's part of it)."""
    _, block_size, num_kv_heads, head_dim = k_cache.shape
    num_heads = q.shape[1]
    outputs = []
    for group in metadata.groups:
        queries = q[group.token_start : group.token_end]
        tables, bias = (
            (group.block_tables, group.attend_bias) if window is None else (group.window_tables, group.window_bias)
        )
        assert tables is not None and bias is not None, "a windowed layer needs the window's blocks"
        kernel_serves = window is None and softcap is None  # the kernels attend whole contexts, uncapped
        if group.max_query_len == 1 and metadata.decode_kernel is not None and kernel_serves:
            outputs.append(
                metadata.decode_kernel(queries, k_cache, v_cache, group.block_tables, group.context_lens, scale)
            )
            continue
        num_rows, max_blocks = tables.shape
        context_len = max_blocks * block_size
        tables = tables.reshape(-1)
        # keys, values: [B, context_len, Hkv, D], each row's blocks one after the other
        keys = k_cache.index_select(0, tables).view(num_rows, context_len, num_kv_heads, head_dim)
        values = v_cache.index_select(0, tables).view(num_rows, context_len, num_kv_heads, head_dim)
        if group.max_query_len == 1 and q.dtype != torch.float32 and softcap is None:
            outputs.append(decode_attention(queries, keys, values, bias, scale))
            continue
        if group.padded_index is not None:
            padded = queries.new_zeros(num_rows * group.max_query_len, num_heads, head_dim)
            queries = padded.index_copy_(0, group.padded_index, queries)
        queries = queries.view(num_rows, group.max_query_len, num_heads, head_dim).transpose(1, 2)  # [B, Hq, Lq, D]
        keys, values = keys.transpose(1, 2), values.transpose(1, 2)  # [B, Hkv, context_len, D]
        if softcap is None:
            attended = F.scaled_dot_product_attention(
                queries, keys, values, attn_mask=bias, scale=scale, enable_gqa=num_heads != num_kv_heads
            )
        else:
            attended = softcapped_attention(queries, keys, values, bias, scale, softcap)
        attended = attended.transpose(1, 2).reshape(num_rows * group.max_query_len, num_heads, head_dim)
        if group.padded_index is not None:
            attended = attended.index_select(0, group.padded_index)
        outputs.append(attended)
    return outputs[0] if len(outputs) == 1 else torch.cat(outputs)


def decode_attention(
    queries: torch.Tensor,  # [B, Hq, D], one token per row
    keys: torch.Tensor,  # [B, L, Hkv, D]
    values: torch.Tensor,  # [B, L, Hkv, D]
    bias: torch.Tensor,  # [B, 1, 1, L] additive mask
    scale: float,
) -> torch.Tensor:  # [B, Hq, D]
    """Attention of one query token per row in two batched matmuls over the gathered blocks as
    they lie: every query head meets every KV head (3x the FLOPs with 3 KV heads, still tiny),
    and only the pairs that GQA pairs are kept. Transposing K and V to pair heads first costs
    more than those FLOPs. Scores in the model dtype and softmax in float32, as transformers'
    eager attention computes them.

    Example, Hq = 4, Hkv = 2 (G = 2): query head h uses KV head h // G, so scores[b, h, l, j] is
    kept where j = h // G: the diagonal of the [Hkv, G, L, Hkv] view.
    """
    rows, context_len, num_kv_heads, head_dim = keys.shape
    num_heads = queries.shape[1]
    per_kv_head = num_heads // num_kv_heads
    every_pair = torch.bmm(queries, keys.view(rows, context_len * num_kv_heads, head_dim).transpose(1, 2))
    # [B, Hkv, G, L, Hkv] -> the GQA pairs: [B, Hkv, G, L]
    scores = every_pair.view(rows, num_kv_heads, per_kv_head, context_len, num_kv_heads)
    scores = scores.diagonal(dim1=1, dim2=4).permute(0, 3, 1, 2).float()
    probs = torch.softmax(scores.mul_(scale).add_(bias), dim=-1)
    # Zero weight for the other pairs, so one matmul over all of [L, Hkv] sums the right values.
    pair_probs = queries.new_zeros(rows, num_kv_heads, per_kv_head, context_len, num_kv_heads)
    pair_probs.diagonal(dim1=1, dim2=4).copy_(probs.permute(0, 2, 3, 1))
    return torch.bmm(pair_probs.view(rows, num_heads, -1), values.view(rows, context_len * num_kv_heads, head_dim))


def softcapped_attention(
    queries: torch.Tensor,  # [B, Hq, Lq, D]
    keys: torch.Tensor,  # [B, Hkv, L, D]
    values: torch.Tensor,  # [B, Hkv, L, D]
    bias: torch.Tensor,  # [B, 1, Lq, L] additive mask
    scale: float,
    softcap: float,
) -> torch.Tensor:  # [B, Hq, Lq, D]
    """Attention with scores soft-capped, softcap * tanh(scores / softcap), before the mask: SDPA has no
    such step, so this is transformers' eager attention (Gemma 2), in the same order of operations."""
    per_kv_head = queries.shape[1] // keys.shape[1]
    keys, values = keys.repeat_interleave(per_kv_head, dim=1), values.repeat_interleave(per_kv_head, dim=1)
    scores = torch.matmul(queries, keys.transpose(2, 3)) * scale
    scores = torch.tanh(scores / softcap) * softcap + bias
    probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(queries.dtype)
    return torch.matmul(probs, values)
