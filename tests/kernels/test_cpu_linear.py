"""The CPU matmuls with narrow weights (linear.cpp) against float64 torch references, for every
decode row count 1..64 and odd shapes, in the build for this CPU and the AVX2 + FMA build
(LORASERVE_CPU_MARCH=x86-64-v3), which an AVX-512 machine runs too, the scalar paths (x86-64), and
on a CPU with AMX the AVX-512 build without it (cooperlake), whose vector tiles take every row count
the AMX build gives to its tiles."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from loraserve.models.cpu.linear import (
    BLOCK,
    Int8Weights,
    LinearKernel,
    NarrowMatmul,
    load_linear_kernel,
    quantize_int8,
)

pytestmark = pytest.mark.serial  # our OpenMP kernels over their threads, as users run them

CPU_FLAGS = next(
    (line.split() for line in Path("/proc/cpuinfo").read_text().splitlines() if line.startswith("flags")), []
)
MARCHES = ["native", *(["x86-64-v3"] if {"avx2", "fma", "f16c"} <= set(CPU_FLAGS) else [])]
# and the scalar paths, for a CPU without AVX2; with AMX, the vector tiles for every row count (the
# model-level tests need not: their small batches take the vector tiles in the native build too)
KERNEL_MARCHES = [*MARCHES, *(["cooperlake"] if "amx_bf16" in CPU_FLAGS else []), "x86-64"]
SHAPES = [(576, 960), (1536, 576), (33, 7), (130, 70)]  # (in, out): the default model's, and odd ones
ROWS = range(1, 65)


@pytest.fixture(scope="module", params=KERNEL_MARCHES)
def kernel(request, tmp_path_factory) -> LinearKernel:
    built = load_linear_kernel(tmp_path_factory.mktemp("kernels"), request.param)
    assert built is not None, "the kernel must build where g++ is installed"
    return built


def accumulation_bound(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """What float32 sums of these products may be off by, in any order: K * 2^-24 * sum |x w|."""
    return x.shape[1] * 2.0**-24 * (x.abs().double() @ w.abs().double().T) + 1e-30


def int8_reference(x: torch.Tensor, weights: Int8Weights) -> torch.Tensor:
    """x quantized as the kernel does (int16 blocks of 32, float32 scale absmax / 32639, nearest),
    integer dot products per block scaled by both blocks' scales, plus each weight block's min
    times the block's sum of x, summed in float64."""
    rows, in_features = x.shape
    padded = weights.values.shape[1]
    blocks = F.pad(x, (0, padded - in_features)).view(rows, -1, BLOCK)
    scale = blocks.abs().amax(dim=-1) / 32639
    inverse = torch.where(scale > 0, 1 / scale, torch.zeros_like(scale))
    values = torch.round(blocks * inverse.unsqueeze(-1)).double()
    dots = torch.einsum("rbk,obk->rob", values, weights.values.view(weights.values.shape[0], -1, BLOCK).double())
    scaled = dots * scale.double().unsqueeze(1) * weights.scales.double().unsqueeze(0)
    return (scaled + weights.mins.double().unsqueeze(0) * blocks.double().sum(-1).unsqueeze(1)).sum(-1)


def int8_tiles_reference(x: torch.Tensor, weights: Int8Weights) -> tuple[torch.Tensor, torch.Tensor]:
    """What AMX tiles compute for int8 weights: x and every weight (scale * q + min) rounded to bfloat16,
    the products summed in float64; and the bound: float32 sums in any order, and a weight one
    bfloat16 step off (the kernel's fused multiply-add rounds once, the reference twice)."""
    x16, w16 = x.bfloat16().double(), weights.widened(torch.float32).bfloat16().double()
    products = x16.abs() @ w16.abs().T
    return x16 @ w16.T, products * (x.shape[1] * 2.0**-24 + 2.0**-8) + 1e-30


def uses_int8_tiles(kernel: LinearKernel, rows: int) -> bool:
    return "int8" in kernel.tile_rows_from and rows >= kernel.tile_rows_from["int8"]


@pytest.mark.parametrize(("in_features", "out_features"), SHAPES)
def test_bfloat16_weights_give_the_float32_sums_of_their_products(kernel, in_features, out_features):
    generator = torch.Generator().manual_seed(in_features)
    w = torch.randn(out_features, in_features, generator=generator).bfloat16()
    dot = kernel.bfloat16_dot_products
    packed, packed16 = kernel.pack_bfloat16(w, dot_products=False), kernel.pack_bfloat16(w, dot_products=dot)
    x_all = torch.randn(max(ROWS), in_features, generator=generator)
    for rows in ROWS:
        x = x_all[:rows]
        reference = x.double() @ w.double().T
        error = (kernel.bfloat16_weights(x, packed).double() - reference).abs()
        assert (error <= accumulation_bound(x, w)).all(), (rows, error.max())
        # bfloat16 activations: widened (or multiplied in bfloat16 dot products, whose products are exact),
        # summed alike, the result rounded once to bfloat16
        x16 = x.bfloat16()
        y16 = kernel.bfloat16_weights(x16, packed16)
        assert y16.dtype == torch.bfloat16
        reference16 = x16.double() @ w.double().T
        bound16 = accumulation_bound(x16, w) + reference16.abs() * 2.0**-8
        assert ((y16.double() - reference16).abs() <= bound16).all(), rows
        if dot:  # float32 rows on the dot products' panels: rounded to bfloat16 as read, summed in float32
            y = kernel.bfloat16_weights(x, packed16)
            assert y.dtype == torch.float32
            assert ((y.double() - reference16).abs() <= accumulation_bound(x16, w)).all(), rows


@pytest.mark.parametrize(("in_features", "out_features"), SHAPES)
def test_int8_weights_give_their_blocks_dot_products(kernel, in_features, out_features):
    generator = torch.Generator().manual_seed(out_features)
    weights = quantize_int8(torch.randn(out_features, in_features, generator=generator) + 0.3)  # min != -max
    packed = kernel.pack_int8(weights)
    x_all = torch.randn(max(ROWS), in_features, generator=generator) * 3
    for rows in ROWS:
        x = x_all[:rows]
        if uses_int8_tiles(kernel, rows):
            reference, bound = int8_tiles_reference(x, weights)
        else:
            reference = int8_reference(x, weights)
            bound = accumulation_bound(x, weights.widened(torch.float32)) * 4 + reference.abs() * 1e-6
        error = (kernel.int8_weights(x, packed).double() - reference).abs()
        assert (error <= bound).all(), (rows, error.max())


def test_each_build_uses_the_best_instructions_of_its_march(kernel, request):
    march = request.node.callspec.params["kernel"]
    if march == "x86-64":
        assert kernel.int8_path == "scalar"
    elif march == "x86-64-v3":
        assert kernel.int8_path == "avx2"
    elif {"avx512_vnni", "avx512bw"} <= set(CPU_FLAGS):
        assert kernel.int8_path == "avx512-vnni"
    # AMX tiles in the native build of a CPU with them (Linux 5.16 and later lend them), in no other
    has_tiles = march == "native" and {"amx_tile", "amx_bf16"} <= set(CPU_FLAGS)
    assert kernel.tile_rows_from == ({"bfloat16": 8, "int8": 16} if has_tiles else {})


def test_int8_blocks_span_their_min_to_max_in_255_steps():
    weight = torch.zeros(2, 70)
    weight[0, :32] = torch.linspace(-2.0, 3.1, 32)  # min -2, range 5.1: scale 0.02, -2 -> 0, 3.1 -> 255
    weight[1, 40] = 5.0  # a lone value in the second block; the third is padded with zeros
    weights = quantize_int8(weight)
    assert weights.values.shape == (2, 96) and weights.scales.shape == weights.mins.shape == (2, 3)
    assert weights.scales[0, 0].item() == pytest.approx(0.02, rel=1e-3) and weights.mins[0, 0] == -2.0
    assert weights.values[0, 0] == 0 and weights.values[0, 31] == 255
    assert weights.scales[1].tolist() == [0.0, pytest.approx(5 / 255, rel=1e-3), 0.0]
    assert weights.values[1, 40] == 255 and int(weights.values[1].sum()) == 255
    widened = weights.widened(torch.float32)
    assert widened.shape == (2, 70)
    assert ((widened - weight).abs() <= weights.scales.float().repeat_interleave(BLOCK, 1)[:, :70] / 2 + 1e-6).all()


def test_int8_blocks_hold_4_bit_blocks_of_scale_and_min_to_float16_s_rounding():
    """A Q4_1 block (the default model's GGUF): 16 levels min + d * i, which 255 steps of d / 17 contain;
    only the float16 rounding of d / 17 is left, under a fifth of q8_0's half step (absmax / 254)."""
    generator = torch.Generator().manual_seed(0)
    levels = torch.randint(0, 16, (4, 64), generator=generator).float()
    levels[:, 0], levels[:, 32], levels[:, 31], levels[:, 63] = 0, 0, 15, 15  # each block spans all 16
    weight = -0.75 + 0.125 * levels  # d and min exact in float16, as Q4_1 stores them
    error = (quantize_int8(weight).widened(torch.float32) - weight).abs().max().item()
    assert error <= 255 * (0.125 / 17) * 2**-11 and error < (1.125 / 254) / 5


@pytest.mark.parametrize(("rows", "in_features", "out_features"), [(300, 96, 48), (600, 1536, 40)])
def test_a_prompt_of_many_rows_goes_through_the_same_tiles(kernel, rows, in_features, out_features):
    """Prompts' row counts; 600 rows of K 1536 are three blocks of rows for AMX tiles (256 a block)."""
    generator = torch.Generator().manual_seed(1)
    weight = torch.randn(out_features, in_features, generator=generator)
    x = torch.randn(rows, in_features, generator=generator)
    int8 = NarrowMatmul(kernel, weight, "int8", torch.float32)
    if uses_int8_tiles(kernel, len(x)):
        reference, bound = int8_tiles_reference(x, quantize_int8(weight))
        assert ((int8(x).double() - reference).abs() <= bound).all()
    else:
        reference = int8_reference(x, quantize_int8(weight))
        assert ((int8(x).double() - reference).abs() <= 1e-4 * reference.abs().max()).all()
    w16 = weight.bfloat16()
    bfloat16 = NarrowMatmul(kernel, weight, "bfloat16", torch.float32)
    if out_features % 16 == 0:  # half of float32's bytes (whole panels of 8 or 16 outputs)
        assert bfloat16.nbytes == out_features * in_features * 2
    error = (bfloat16(x).double() - x.double() @ w16.double().T).abs()
    assert (error <= accumulation_bound(x, w16)).all()
    x16 = x.bfloat16()  # bfloat16 rows: the dot products' panels (AMX tiles where the build has them)
    reference16 = x16.double() @ w16.double().T
    y16 = NarrowMatmul(kernel, weight, "bfloat16", torch.bfloat16)(x16).double()
    assert ((y16 - reference16).abs() <= accumulation_bound(x16, w16) + reference16.abs() * 2.0**-8).all()


def test_bfloat16_rows_refuse_widened_panels_where_they_take_dot_products_and_no_build_fakes_them(kernel):
    weight = torch.randn(16, 32)
    if not kernel.bfloat16_dot_products:
        with pytest.raises(ValueError, match="no bfloat16 dot products"):
            kernel.pack_bfloat16(weight, dot_products=True)
        return
    with pytest.raises(ValueError, match="pack the weight for them"):
        kernel.bfloat16_weights(torch.randn(2, 32).bfloat16(), kernel.pack_bfloat16(weight, dot_products=False))
    # pairs along K: an odd K's last pair is padded with a zero; for AMX tiles, to whole tiles of 32
    assert kernel.pack_bfloat16(weight, dot_products=True).packed.numel() == 16 * 32
    padded = 64 if kernel.tile_rows_from else 34
    assert kernel.pack_bfloat16(torch.randn(16, 33), dot_products=True).packed.numel() == 16 * padded
