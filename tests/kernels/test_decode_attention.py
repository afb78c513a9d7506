"""The Triton paged decode attention equals attention computed in float32 over the gathered context
(on the CPU under TRITON_INTERPRET=1; on a GPU with the `gpu` marker)."""

from __future__ import annotations

import pytest
import torch

from loraserve.models.cuda.attention import paged_decode_attention

DEVICES = [
    "cpu",
    pytest.param(
        "cuda",
        marks=[pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")],
    ),
]
TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 1e-2}


def reference(queries, k_cache, v_cache, tables, lens, scale) -> torch.Tensor:
    """Each row's context gathered block by block, softmax(q k^T) v in float32, query head h on KV head h // G."""
    rows, num_heads, head_dim = queries.shape
    group = num_heads // k_cache.shape[2]
    out = torch.zeros(rows, num_heads, head_dim)
    for row, context in enumerate(lens.tolist()):
        if context == 0:
            continue
        blocks = tables[row, : -(-context // k_cache.shape[1])]
        keys = k_cache[blocks].flatten(0, 1)[:context].float().repeat_interleave(group, dim=1)  # [L, Hq, D]
        values = v_cache[blocks].flatten(0, 1)[:context].float().repeat_interleave(group, dim=1)
        probs = torch.softmax(torch.einsum("hd,lhd->hl", queries[row].float(), keys) * scale, dim=-1)
        out[row] = torch.einsum("hl,lhd->hd", probs, values)
    return out


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("num_heads", "num_kv_heads", "head_dim"), [(9, 3, 64), (32, 8, 128), (32, 1, 64)])
def test_paged_decode_attention_equals_the_reference(device, dtype, num_heads, num_kv_heads, head_dim):
    gen = torch.Generator().manual_seed(0)
    num_pages, block_size, layers = 40, 16, 2
    # The pool's layout: a layer's K is a strided view, one block every page (memory/pool.py).
    pool = torch.randn(num_pages, 2, layers, block_size, num_kv_heads, head_dim, generator=gen).to(dtype)
    k_cache, v_cache = pool[:, 0, 1], pool[:, 1, 1]
    lens = torch.tensor([0, 1, 15, 16, 17, 70, 5])  # 0: a CUDA graph's padding row
    max_blocks = 6
    tables = torch.stack([torch.randperm(num_pages, generator=gen)[:max_blocks] for _ in lens])
    queries = torch.randn(len(lens), num_heads, head_dim, generator=gen).to(dtype)
    scale = head_dim**-0.5
    expected = reference(queries, k_cache, v_cache, tables, lens, scale)
    on = {"device": device}
    got = paged_decode_attention(
        queries.to(**on), k_cache.to(**on), v_cache.to(**on), tables.to(**on), lens.to(**on), scale
    )
    assert got.dtype == dtype and got.shape == queries.shape
    torch.testing.assert_close(got.float().cpu(), expected, atol=TOLERANCE[dtype], rtol=TOLERANCE[dtype])
