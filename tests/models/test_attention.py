"""The decode rows' two paths - the compiled kernel over the paged cache and, without a compiler,
decode_attention over gathered blocks - against SDPA, which prefill rows use."""

import pytest
import torch
import torch.nn.functional as F

from loraserve.models.attention import decode_attention
from loraserve.models.cpu.attention import DecodeAttentionKernel, load_decode_kernel


@pytest.fixture(scope="module")
def kernel(tmp_path_factory: pytest.TempPathFactory) -> DecodeAttentionKernel:
    built = load_decode_kernel(tmp_path_factory.mktemp("kernels"))
    assert built is not None, "the C++ compiler the project installs could not build the kernel"
    return built


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


@pytest.mark.parametrize(
    ("num_heads", "num_kv_heads", "head_dim"), [(9, 3, 64), (4, 4, 128), (16, 2, 128), (8, 2, 40), (16, 1, 64)]
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    "context_lens",
    [[1, 16, 17, 50, 64], [1000], [256, 257, 600, 3, 513]],
    ids=["blocks", "one-long-row", "rows-split-into-spans"],
)
def test_the_kernel_reads_the_paged_cache_as_sdpa_reads_gathered_blocks(
    kernel, num_heads, num_kv_heads, head_dim, dtype, context_lens
):
    """Blocks scattered over a page-major pool (a layer's blocks a page apart), contexts from one
    token to several blocks. head_dim 64 and 128 with up to 8 query heads per KV head take the
    blocked path; head_dim 40 (a tail past the vector length) and 16 heads per KV head the general one.
    Contexts past 256 tokens are cut into spans that the threads share and whose softmaxes are merged."""
    generator = torch.Generator().manual_seed(num_heads + head_dim)
    block_size, layers, rows = 16, 3, len(context_lens)
    max_blocks = -(-max(context_lens) // block_size)
    num_blocks = rows * max_blocks
    pool = torch.randn(num_blocks, 2, layers, block_size, num_kv_heads, head_dim, generator=generator).to(dtype)
    k_cache, v_cache = pool[:, 0, 1], pool[:, 1, 1]
    lens = torch.tensor(context_lens)
    tables = torch.randperm(num_blocks, generator=generator).view(rows, max_blocks)
    queries = torch.randn(rows, num_heads, head_dim, generator=generator).to(dtype)
    scale = head_dim**-0.5

    got = kernel(queries, k_cache, v_cache, tables, lens, scale)

    keys = k_cache[tables].flatten(1, 2).float().transpose(1, 2)  # [B, Hkv, L, D]
    values = v_cache[tables].flatten(1, 2).float().transpose(1, 2)
    mask = torch.arange(keys.shape[2]) < lens.unsqueeze(1)
    expected = F.scaled_dot_product_attention(
        queries.float().unsqueeze(2), keys, values, attn_mask=mask.view(rows, 1, 1, -1), scale=scale, enable_gqa=True
    ).squeeze(2)
    tolerance = 1e-5 if dtype == torch.float32 else 1e-2
    assert got.shape == queries.shape and got.dtype == dtype
    torch.testing.assert_close(got.float(), expected, atol=tolerance, rtol=tolerance)


def test_a_row_s_result_does_not_depend_on_the_rows_beside_it_or_the_threads(kernel):
    """A long row's spans are cut by its own length: alone, in a batch, on one thread or two, the same bits."""
    generator = torch.Generator().manual_seed(7)
    block_size, num_kv_heads, head_dim, num_heads = 16, 3, 64, 9
    pool = torch.randn(200, block_size, num_kv_heads, head_dim, generator=generator)
    k_cache, v_cache = pool[:100], pool[100:]
    tables = torch.randperm(100, generator=generator)[:96].view(2, 48)
    queries = torch.randn(2, num_heads, head_dim, generator=generator)
    batch = kernel(queries, k_cache, v_cache, tables, torch.tensor([700, 300]), 0.125)
    alone = kernel(queries[:1], k_cache, v_cache, tables[:1], torch.tensor([700]), 0.125)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        one_thread = kernel(queries[:1], k_cache, v_cache, tables[:1], torch.tensor([700]), 0.125)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(batch[0], alone[0]) and torch.equal(alone, one_thread)


def test_the_kernel_refuses_what_it_cannot_read(kernel):
    cache = torch.zeros(4, 16, 1, 8)
    tables, lens = torch.zeros(1, 1, dtype=torch.long), torch.ones(1, dtype=torch.long)
    with pytest.raises(ValueError, match="dtype"):
        kernel(torch.zeros(1, 2, 8, dtype=torch.bfloat16), cache, cache, tables, lens, 1.0)
    with pytest.raises(ValueError, match="int64"):
        kernel(torch.zeros(1, 2, 8), cache, cache, tables.int(), lens, 1.0)
    with pytest.raises(ValueError, match="contiguous"):
        kernel(torch.zeros(1, 8, 2).transpose(1, 2), cache, cache, tables, lens, 1.0)
