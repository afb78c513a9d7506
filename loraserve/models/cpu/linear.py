"""Base-model matmuls on the CPU with weights narrower than the activations (linear.cpp).

A decode step's time is the weights' bytes over the memory bandwidth. With float32 activations
(what `auto` computes in on a CPU without AMX) the weights need not be float32: bfloat16 weights
are widened in registers (half of float32's bytes), or, where the CPU has bfloat16 dot products,
multiplied by them, each row rounded to bfloat16 as it is read (bfloat16-dot: twice an FMA's
products, which batches need); int8 blocks hold a byte per weight with a scale and a minimum per
block of 32 (a little over a quarter; integer dot products against x in int16). A block's
minimum and range, not its absolute maximum, set its grid: the default model's weights are 4-bit
blocks of that form (its GGUF is Q4_1), which this grid holds exactly, where q8_0's absmax / 127
would round each again (measured: 95% of top tokens kept against 99%). Prompts go through the
kernel too: its tiles are a GEMM's, and keep up with torch's float32 GEMM.

On a CPU with AMX, batches run in its tiles on the same panels: bfloat16 dot products from 8
rows, int8 from 16, each block widened to bfloat16 as it is read and x rounded to bfloat16 (twice
the vector tiles' speed at 32 rows, for 97.9-98.8% of top tokens against 99.0-99.4%:
docs/benchmarks.md).

Built on first use for this machine (sgmv_kernels/build.py); without a compiler
`load_linear_kernel` says why and returns None.
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from loraserve.models.dtypes import BFLOAT16_DOT
from sgmv_kernels.build import entry_point, load_library

SOURCE = Path(__file__).with_name("linear.cpp")
BLOCK = 32  # int8 weights: elements one scale and minimum cover
_ACTIVATIONS = {torch.float32: "float32", torch.bfloat16: "bfloat16"}
_P, _I, _THREADS, _FLAG = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, ctypes.c_int


@dataclass(frozen=True)
class PackedBfloat16:
    """A [out_features, in_features] bfloat16 weight in the kernel's panels (linear.cpp)."""

    packed: torch.Tensor  # bfloat16, flat
    out_features: int
    in_features: int
    dot_products: bool  # panels of pairs for bfloat16 dot products (rows read as bfloat16), else widened to float32

    @property
    def nbytes(self) -> int:
        return self.packed.nbytes


@dataclass(frozen=True)
class PackedInt8:
    """A [out_features, in_features] weight as int8 blocks in the kernel's panels (linear.cpp)."""

    values: torch.Tensor  # uint8, flat
    scales: torch.Tensor  # float16, flat
    mins: torch.Tensor  # float16, flat
    out_features: int
    in_features: int

    @property
    def nbytes(self) -> int:
        return self.values.nbytes + self.scales.nbytes + self.mins.nbytes


@dataclass(frozen=True)
class Int8Weights:
    """A [out_features, in_features] weight as int8 blocks, row by row, the last block zero-padded:
    each byte q stands for scale * q + min of its block."""

    values: torch.Tensor  # uint8 [N, padded]
    scales: torch.Tensor  # float16 [N, padded / BLOCK]: each block's (max - min) / 255
    mins: torch.Tensor  # float16 [N, padded / BLOCK]
    in_features: int

    def widened(self, dtype: torch.dtype) -> torch.Tensor:
        """The weight the blocks stand for, [N, in_features] in `dtype`."""
        rows = self.values.shape[0]
        values = self.values.view(rows, -1, BLOCK).float()
        blocks = values * self.scales.float().unsqueeze(-1) + self.mins.float().unsqueeze(-1)
        return blocks.view(rows, -1)[:, : self.in_features].to(dtype)


def quantize_int8(weight: torch.Tensor) -> Int8Weights:
    """Per block of 32: min and scale = (max - min) / 255, both kept as float16, and q = round((w - min) / scale)
    against the rounded two, so the bytes fit the grid the kernel multiplies by."""
    rows, in_features = weight.shape
    padded = -(-in_features // BLOCK) * BLOCK
    blocks = F.pad(weight.float(), (0, padded - in_features)).view(rows, -1, BLOCK)
    low = blocks.amin(dim=-1).half()
    scale = ((blocks.amax(dim=-1) - low.float()) / 255).half()
    inverse = torch.where(scale > 0, 1 / scale.float(), torch.zeros_like(scale, dtype=torch.float32))
    values = torch.round((blocks - low.float().unsqueeze(-1)) * inverse.unsqueeze(-1)).clamp(0, 255)
    return Int8Weights(values.to(torch.uint8).view(rows, padded).contiguous(), scale, low, in_features)


class NarrowMatmul:
    """x @ W^T (+ bias) for one weight held narrow: what a Linear calls instead of F.linear."""

    def __init__(
        self,
        kernel: LinearKernel,
        weight: torch.Tensor,
        weights: str,
        rows_dtype: torch.dtype,
        packed: PackedInt8 | None = None,
    ) -> None:
        """`weight` held as `weights` ("bfloat16", "bfloat16-dot" or "int8") for rows of `rows_dtype`; `packed`: its
        int8 panels made before."""
        self.kernel = kernel
        self.weights = weights
        self.int8 = None
        if weights == "int8":
            self.int8 = packed if packed is not None else kernel.pack_int8(quantize_int8(weight))
        dot_products = weights == BFLOAT16_DOT or (rows_dtype == torch.bfloat16 and kernel.bfloat16_dot_products)
        self.bfloat16 = kernel.pack_bfloat16(weight, dot_products) if self.int8 is None else None

    def __call__(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        x = x.contiguous()
        if self.int8 is not None:
            out = self.kernel.int8_weights(x, self.int8)
        else:
            assert self.bfloat16 is not None
            out = self.kernel.bfloat16_weights(x, self.bfloat16)
        return out if bias is None else out.add_(bias)

    @property
    def nbytes(self) -> int:
        return (self.int8 or self.bfloat16).nbytes  # type: ignore[union-attr]


class LinearKernel:
    """The compiled library's matmuls, with torch's thread count."""

    def __init__(self, library: ctypes.CDLL) -> None:
        self.build = Path(library._name).name  # hashes the source, flags and CPU: the panels' layout
        self._functions: dict[tuple[str, torch.dtype], Callable[..., None]] = {}
        # bfloat16 rows take bfloat16 dot products (AVX512-BF16), in panels of their own; float32 rows may.
        self.bfloat16_dot_products = bool(library.bf16_dot_products())
        bf16_arguments = [_P, _I, _I, _P, _I, _P, _THREADS]
        matmuls = [(weights, dtype) for weights in ("bf16", "int8") for dtype in _ACTIVATIONS]
        for weights, dtype in matmuls + ([("bf16_dot", torch.float32)] if self.bfloat16_dot_products else []):
            function = getattr(library, f"linear_{weights}_{_ACTIVATIONS[dtype]}")
            function.restype = None
            function.argtypes = [_P, _I, _I, _P, _P, _P, _I, _P, _THREADS] if weights == "int8" else bf16_arguments
            self._functions[(weights, dtype)] = function
        # From how many rows a matmul of bfloat16 / int8 weights runs in AMX tiles; {} where none.
        library.tile_rows_from.restype, library.tile_rows_from.argtypes = ctypes.c_int64, [_FLAG]
        self.tile_rows_from = {
            weights: library.tile_rows_from(int(weights == "int8"))
            for weights in ("bfloat16", "int8") if library.tile_rows_from(0)
        }  # fmt: skip
        library.int8_path.restype = ctypes.c_char_p
        self.int8_path: str = library.int8_path().decode()  # which instructions do the int8 dot products
        self._packed_elements = library.bf16_packed_elements
        self._packed_elements.restype, self._packed_elements.argtypes = ctypes.c_int64, [_I, _I, _FLAG]
        self._pack = library.bf16_pack
        self._pack.restype, self._pack.argtypes = None, [_P, _I, _I, _P, _FLAG]
        self._int8_outputs = library.int8_packed_outputs
        self._int8_outputs.restype, self._int8_outputs.argtypes = ctypes.c_int64, [_I]
        self._pack_int8 = library.int8_pack
        self._pack_int8.restype, self._pack_int8.argtypes = None, [_P, _P, _P, _I, _I, _P, _P, _P]

    def entry_point(self, weights: str, dtype: torch.dtype) -> int:
        """The address of the matmul for `weights` ("bfloat16", "bfloat16-dot" or "int8") and `dtype` rows."""
        key = ("int8", dtype) if weights == "int8" else self._bfloat16_matmul(dtype, weights == BFLOAT16_DOT)
        return entry_point(self._functions[key])

    def _bfloat16_matmul(self, dtype: torch.dtype, dot_products: bool) -> tuple[str, torch.dtype]:
        return ("bf16_dot" if dot_products and dtype == torch.float32 else "bf16", dtype)

    def pack_bfloat16(self, weight: torch.Tensor, dot_products: bool) -> PackedBfloat16:
        """`weight` [N, K] rounded to bfloat16 and laid out for the kernel's bfloat16 dot products (the panels
        bfloat16 rows need where the build has them) or for widening to float32."""
        if dot_products and not self.bfloat16_dot_products:
            raise ValueError("this build of the kernel has no bfloat16 dot products (AVX512-BF16)")
        weight = weight.to(torch.bfloat16).contiguous()
        rows, in_features = weight.shape
        packed = weight.new_empty(self._packed_elements(rows, in_features, int(dot_products)))
        self._pack(weight.data_ptr(), rows, in_features, packed.data_ptr(), int(dot_products))
        return PackedBfloat16(packed, rows, in_features, dot_products)

    def bfloat16_weights(self, x: torch.Tensor, weight: PackedBfloat16) -> torch.Tensor:
        """x @ W^T, by dot products of x rounded to bfloat16 where W's panels are for them, else W widened."""
        _check(x, weight.in_features)
        if x.dtype == torch.bfloat16 and self.bfloat16_dot_products and not weight.dot_products:
            raise ValueError("bfloat16 rows take bfloat16 dot products here: pack the weight for them")
        y = x.new_empty(x.shape[0], weight.out_features)
        self._functions[self._bfloat16_matmul(x.dtype, weight.dot_products)](
            x.data_ptr(), x.shape[0], x.shape[1], weight.packed.data_ptr(), weight.out_features, y.data_ptr(),
            _threads(),
        )  # fmt: skip
        return y

    def pack_int8(self, weight: Int8Weights) -> PackedInt8:
        """int8 rows laid out as the kernel reads them."""
        rows, padded = weight.values.shape
        outputs = self._int8_outputs(rows)
        values = weight.values.new_empty(outputs * padded)
        scales, mins = (weight.scales.new_empty(outputs * (padded // BLOCK)) for _ in range(2))
        self._pack_int8(
            weight.values.data_ptr(), weight.scales.data_ptr(), weight.mins.data_ptr(), rows, padded // BLOCK,
            values.data_ptr(), scales.data_ptr(), mins.data_ptr(),
        )  # fmt: skip
        return PackedInt8(values, scales, mins, rows, weight.in_features)

    def fits_int8(self, packed: PackedInt8) -> bool:
        """Whether `packed` has the sizes this build's panels of its shape take."""
        padded = -(-packed.in_features // BLOCK) * BLOCK
        outputs = self._int8_outputs(packed.out_features)
        blocks = outputs * (padded // BLOCK)
        return (
            packed.values.dtype == torch.uint8 and packed.values.numel() == outputs * padded
            and all(t.dtype == torch.float16 and t.numel() == blocks for t in (packed.scales, packed.mins))
        )  # fmt: skip

    def int8_weights(self, x: torch.Tensor, weight: PackedInt8) -> torch.Tensor:
        """x @ W^T for the weight the blocks stand for, x quantized to int16 blocks of 32."""
        _check(x, weight.in_features)
        y = x.new_empty(x.shape[0], weight.out_features)
        self._functions[("int8", x.dtype)](
            x.data_ptr(), x.shape[0], x.shape[1], weight.values.data_ptr(), weight.scales.data_ptr(),
            weight.mins.data_ptr(), weight.out_features, y.data_ptr(), _threads(),
        )  # fmt: skip
        return y


def _check(x: torch.Tensor, in_features: int) -> None:
    if x.dim() != 2 or not x.is_contiguous() or x.shape[1] != in_features or x.dtype not in _ACTIVATIONS:
        raise ValueError(f"expected contiguous [T, {in_features}] float32 or bfloat16 rows, got {x.dtype} {x.shape}")


def _threads() -> int:
    return torch.get_num_threads()


def load_linear_kernel(cache_dir: Path, march: str | None = None) -> LinearKernel | None:
    """The kernel built for this machine (or `march`), or None with a warning saying why."""
    library = load_library(SOURCE, cache_dir, "16-bit and int8 weights need the CPU matmul kernel", march)
    return LinearKernel(library) if library is not None else None
