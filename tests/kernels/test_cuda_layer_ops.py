"""The Triton per-layer ops (CUDA's) compute what the model's torch ops compute: residual add +
RMSNorm, SiLU * up, rotary + K/V cache write (on the CPU under TRITON_INTERPRET=1; on a GPU with `gpu`)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from loraserve.models.cuda.layer_ops import CudaLayerOps
from loraserve.models.decoder import RMSNorm
from loraserve.models.rope import apply_rotary

DEVICES = [
    "cpu",
    pytest.param(
        "cuda",
        marks=[pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")],
    ),
]
DTYPES = [torch.float32, torch.bfloat16]
OPS = CudaLayerOps()


def close(got: torch.Tensor, expected: torch.Tensor) -> None:
    """fp32 sums in another order: in bfloat16 a rounding flipped before a product, two units in the last place."""
    tolerance = 1e-5 if expected.dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got.cpu(), expected.cpu(), atol=tolerance, rtol=tolerance)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_add_rms_norm_equals_the_torch_norm(device, dtype):
    gen = torch.Generator().manual_seed(0)
    norm = RMSNorm(576, 1e-5, dtype, device)
    norm.weight.data.copy_(torch.rand(576, generator=gen))
    x, residual = (torch.randn(5, 576, generator=gen).to(device=device, dtype=dtype) for _ in range(2))
    expected_out, expected_sum = norm(x, residual.clone())
    got_residual = residual.clone()
    out, total = OPS.add_rms_norm(x, got_residual, norm.weight, norm.eps)
    assert total is got_residual, "the sum is written into the residual"
    close(total, expected_sum)
    close(out, expected_out)
    first_out, first_sum = OPS.add_rms_norm(x, None, norm.weight, norm.eps)  # the first layer: no residual
    assert first_sum is x
    close(first_out, norm(x, None)[0])


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_mul_equals_torch(device, dtype):
    gate_up = torch.randn(3, 2 * 1536, generator=torch.Generator().manual_seed(1)).to(device=device, dtype=dtype)
    gate, up = gate_up.split(1536, dim=-1)
    close(OPS.silu_mul(gate_up), F.silu(gate) * up)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_rotary_store_kv_rotates_q_in_place_and_writes_k_and_v_to_their_slots(device, dtype):
    gen = torch.Generator().manual_seed(2)
    tokens, num_heads, num_kv_heads, head_dim, layers = 4, 9, 3, 64, 2
    on = {"device": device, "dtype": dtype}
    qkv = torch.randn(tokens, (num_heads + 2 * num_kv_heads) * head_dim, generator=gen).to(**on)
    angles = torch.rand(tokens, head_dim // 2, generator=gen) * 6
    cos, sin = torch.cat([angles.cos()] * 2, dim=-1).to(**on), torch.cat([angles.sin()] * 2, dim=-1).to(**on)
    pool = torch.zeros(6, 2, layers, 16, num_kv_heads, head_dim, **on)  # the memory pool's layout
    k_cache, v_cache = pool[:, 0, 1], pool[:, 1, 1]
    blocks = torch.tensor([5, 5, 2, 0], device=device)
    offsets = torch.tensor([3, 4, 15, 0], device=device)
    heads = qkv.view(tokens, -1, head_dim)
    rotated = apply_rotary(heads[:, : num_heads + num_kv_heads], cos, sin)
    expected_v = heads[:, num_heads + num_kv_heads :].clone()
    got = qkv.clone()
    OPS.rotary_store_kv(got, cos, sin, num_heads, k_cache, v_cache, blocks, offsets)
    close(got.view(tokens, -1, head_dim)[:, :num_heads], rotated[:, :num_heads])
    close(got.view(tokens, -1, head_dim)[:, num_heads:], heads[:, num_heads:])  # k and v rows left as they were
    close(k_cache[blocks, offsets], rotated[:, num_heads:])
    close(v_cache[blocks, offsets], expected_v)
    assert pool[:, :, 0].abs().sum() == 0, "the other layer's blocks untouched"
