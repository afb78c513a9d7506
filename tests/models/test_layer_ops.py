"""The compiled per-layer CPU ops against the torch ops they replace (the path without a compiler)."""

import pytest
import torch
import torch.nn.functional as F

from loraserve import SamplingParams
from loraserve.models.cpu.layer_ops import LayerOpsKernel, load_layer_ops
from loraserve.models.decoder import RMSNorm
from loraserve.models.rope import apply_rotary
from tests.conftest import CHAT_PROMPTS

DTYPES = [torch.float32, torch.bfloat16]


@pytest.fixture(scope="module")
def ops(tmp_path_factory: pytest.TempPathFactory) -> LayerOpsKernel:
    built = load_layer_ops(tmp_path_factory.mktemp("kernels"))
    assert built is not None, "the C++ compiler the project installs could not build the kernel"
    return built


def assert_within_one_rounding(got: torch.Tensor, expected: torch.Tensor) -> None:
    """float32: a few ulps (a sum's order, exp's last bit); bfloat16: at most one bfloat16 step."""
    assert got.dtype == expected.dtype and got.shape == expected.shape
    relative = 1e-6 if got.dtype == torch.float32 else 2**-7
    torch.testing.assert_close(got.float(), expected.float(), rtol=relative, atol=1e-6)


def randn(*shape: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


@pytest.mark.parametrize("hidden", [576, 100])  # 100: a tail past the vector length
@pytest.mark.parametrize("dtype", DTYPES)
def test_add_rms_norm_equals_the_torch_norm(ops, hidden, dtype):
    norm = RMSNorm(hidden, 1e-5, dtype, "cpu")
    norm.weight.data = randn(hidden, dtype=dtype, seed=1) + 1
    x, residual = randn(7, hidden, dtype=dtype, seed=2), randn(7, hidden, dtype=dtype, seed=3) * 4

    expected_out, expected_sum = norm(x, residual.clone())
    got_out, got_sum = ops.add_rms_norm(x, residual, norm.weight, norm.eps)

    assert torch.equal(got_sum, expected_sum) and got_sum is residual, "the sum is exact and written in place"
    assert_within_one_rounding(got_out, expected_out)
    first_out, first_residual = ops.add_rms_norm(x, None, norm.weight, norm.eps)
    assert first_residual is x
    assert_within_one_rounding(first_out, norm(x, None)[0])


@pytest.mark.parametrize("width", [1536, 40])
@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_mul_equals_silu_times_up(ops, width, dtype):
    gate_up = randn(9, 2 * width, dtype=dtype, seed=4) * 6  # reaches deep into both tails of SiLU
    gate, up = gate_up.split(width, dim=1)
    assert_within_one_rounding(ops.silu_mul(gate_up), F.silu(gate) * up)


@pytest.mark.parametrize(("num_heads", "num_kv_heads", "head_dim"), [(9, 3, 64), (8, 2, 40), (4, 4, 128)])
@pytest.mark.parametrize("dtype", DTYPES)
def test_rotary_store_kv_equals_apply_rotary_then_store_bit_for_bit(ops, num_heads, num_kv_heads, head_dim, dtype):
    tokens, num_blocks, block_size, layers = 11, 12, 4, 2
    width = (num_heads + 2 * num_kv_heads) * head_dim
    qkv = randn(tokens, width + 8, dtype=dtype, seed=5)[:, :width]  # rows a stride apart, as LoRA leaves them
    angles = randn(tokens, head_dim, dtype=torch.float32, seed=6) * 3
    cos, sin = angles.cos().to(dtype), angles.sin().to(dtype)
    pool = torch.zeros(num_blocks, 2, layers, block_size, num_kv_heads, head_dim, dtype=dtype)  # page-major
    slots = torch.randperm(num_blocks * block_size, generator=torch.Generator().manual_seed(7))[:tokens]

    heads = qkv.reshape(tokens, -1, head_dim)
    rotated = apply_rotary(heads[:, : num_heads + num_kv_heads], cos, sin)
    expected_pool = pool.clone()
    expected_k, expected_v = expected_pool[:, :, 1].unbind(1)
    expected_k.index_put_((slots // block_size, slots % block_size), rotated[:, num_heads:])
    expected_v.index_put_((slots // block_size, slots % block_size), heads[:, num_heads + num_kv_heads :])

    ops.rotary_store_kv(qkv, cos, sin, num_heads, pool[:, 0, 1], pool[:, 1, 1], slots // block_size, slots % block_size)

    assert torch.equal(qkv.reshape(tokens, -1, head_dim)[:, : num_heads + num_kv_heads], rotated)
    assert torch.equal(pool, expected_pool), "k and v land in their slots, nothing else changes"


def test_the_ops_refuse_what_they_cannot_read(ops):
    weight = torch.ones(8)
    with pytest.raises(ValueError, match="contiguous"):
        ops.add_rms_norm(torch.zeros(8, 2).t(), None, weight, 1e-5)
    with pytest.raises(ValueError, match="bfloat16"):
        ops.add_rms_norm(torch.zeros(2, 8, dtype=torch.bfloat16), None, weight, 1e-5)
    with pytest.raises(ValueError, match="gate_up"):
        ops.silu_mul(torch.zeros(2, 7))
    cache = torch.zeros(4, 4, 1, 8)
    qkv, cos, slots = torch.zeros(2, 32), torch.zeros(2, 8), torch.zeros(2, dtype=torch.long)
    with pytest.raises(ValueError, match="int64"):
        ops.rotary_store_kv(qkv, cos, cos, 2, cache, cache, slots.int(), slots)


def test_the_engine_gives_the_same_answers_with_and_without_the_ops(llm):
    """Greedy tokens and their logprobs through the whole float32 model, both paths."""
    prompts = [llm.chat_prompt_ids(conv) for conv in CHAT_PROMPTS[:4]]
    params = SamplingParams(temperature=0.0, max_tokens=8, logprobs=1)
    model = llm.engine.model_runner.model
    layer_ops = model.layers[0].mlp.layer_ops
    assert isinstance(layer_ops, LayerOpsKernel), "the engine runs the compiled ops on the CPU"
    with_ops = llm.generate(prompts, params, use_tqdm=False)
    try:
        model.use_layer_ops(None)
        without_ops = llm.generate(prompts, params, use_tqdm=False)
    finally:
        model.use_layer_ops(layer_ops)
    for ours, theirs in zip(with_ops, without_ops, strict=True):
        assert ours.outputs[0].token_ids == theirs.outputs[0].token_ids
        for a, b in zip(ours.outputs[0].logprobs, theirs.outputs[0].logprobs, strict=True):
            assert a.logprob == pytest.approx(b.logprob, abs=1e-4)
