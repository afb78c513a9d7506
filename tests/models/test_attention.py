"""decode_attention (the decode rows' path) against SDPA, which prefill rows still use."""

import pytest
import torch
import torch.nn.functional as F

from loraserve.models.attention import decode_attention


@pytest.mark.parametrize(("num_heads", "num_kv_heads"), [(9, 3), (4, 4), (8, 2)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_decode_attention_equals_sdpa(num_heads: int, num_kv_heads: int, dtype: torch.dtype) -> None:
    generator = torch.Generator().manual_seed(num_heads * 10 + num_kv_heads)
    rows, context_len, head_dim = 5, 48, 64
    queries = torch.randn(rows, num_heads, head_dim, generator=generator).to(dtype)
    keys = torch.randn(rows, context_len, num_kv_heads, head_dim, generator=generator).to(dtype)
    values = torch.randn(rows, context_len, num_kv_heads, head_dim, generator=generator).to(dtype)
    # Each row sees a different number of keys; the rest is padding it must ignore (even NaN-free
    # garbage: the padded keys hold large values here).
    lengths = torch.tensor([1, 7, 16, 33, 48])
    keys[torch.arange(context_len) >= lengths.unsqueeze(1)] = 1e4
    bias = torch.zeros(rows, 1, 1, context_len, dtype=dtype)
    bias.masked_fill_((torch.arange(context_len) >= lengths.unsqueeze(1)).view(rows, 1, 1, -1), float("-inf"))

    got = decode_attention(queries, keys, values, bias, scale=head_dim**-0.5)

    expected = F.scaled_dot_product_attention(
        queries.float().unsqueeze(2),
        keys.float().transpose(1, 2),
        values.float().transpose(1, 2),
        attn_mask=bias.float(),
        scale=head_dim**-0.5,
        enable_gqa=True,
    ).squeeze(2)
    tolerance = 1e-5 if dtype == torch.float32 else 3e-2
    assert got.shape == (rows, num_heads, head_dim)
    assert got.dtype == dtype
    torch.testing.assert_close(got.float(), expected, atol=tolerance, rtol=tolerance)
