"""A decode step on the CPU in one native call (decode_step.cpp).

At batch 1 a decode step of the default model reads ~143 MB of int8 weights: about 3.5 ms on a
Zen 5 core pair. Run layer by layer from Python, its ~270 kernel calls and the glue between them
cost about as much again. Planned here once (weights, KV caches, adapter tables, kernels), the
step runs every layer in C++ and Python only hands it the rows: the CPU platform's fused step,
what CUDA graphs are to the GPU.

It serves decode-only steps whose every matmul is our own kernel's (`--weights bfloat16` or
`int8`, linear.py) and whose adapters the compiled LoRA kernel applies (no DoRA); any other
step runs layer by layer, as before, with the same kernels in the same order: the same bits.

Built on first use for this machine (sgmv_kernels/build.py); `plan_decode_step` returns None
where it cannot serve (no compiler, torch ops, float32 weights).
"""

from __future__ import annotations

import ctypes
import itertools
from pathlib import Path

import numpy as np
import torch

from loraserve.models.cpu.attention import load_decode_kernel
from loraserve.models.cpu.layer_ops import load_layer_ops
from loraserve.models.cpu.linear import NarrowMatmul
from loraserve.models.decoder import DecoderForCausalLM
from loraserve.models.linear import Linear
from loraserve.models.platform import DecodeRows, StepPlan
from sgmv_kernels.build import load_library
from sgmv_kernels.native import ProjectionGroup, RowChunks, load_kernel

SOURCE = Path(__file__).with_name("decode_step.cpp")
_SUFFIXES = {torch.float32: "float32", torch.bfloat16: "bfloat16"}
_P, _I = ctypes.c_void_p, ctypes.c_int64


class _Matmul(ctypes.Structure):
    _fields_ = [("weights", _P), ("scales", _P), ("mins", _P), ("bias", _P), ("n", _I), ("k", _I)]


class _LoraGroup(ctypes.Structure):
    _fields_ = [("a_rows", _P), ("b_rows", _P), ("ranks", _P), ("scales", _P), ("widths", _P), ("num_projections", _I)]


_MATMULS = ("qkv", "o", "gate_up", "down")
_LORA_GROUPS = {
    "qkv": ("q_proj", "k_proj", "v_proj"),
    "o": ("o_proj",),
    "gate_up": ("gate_proj", "up_proj"),
    "down": ("down_proj",),
}


class _Layer(ctypes.Structure):
    _fields_ = [
        ("input_norm", _P),
        ("post_attention_norm", _P),
        *((name, _Matmul) for name in _MATMULS),
        *((f"lora_{name}", _LoraGroup) for name in _MATMULS),
        ("k_cache", _P),
        ("v_cache", _P),
        ("q_norm", _P),
        ("k_norm", _P),
    ]


_KERNELS = ("add_rms_norm", "silu_mul", "rotary_store_kv", "attention", "lora_add", "linear_bfloat16", "linear_int8")


class _Kernels(ctypes.Structure):
    _fields_ = [(name, _P) for name in _KERNELS]


class _Model(ctypes.Structure):
    _fields_ = [
        ("kernels", _Kernels),
        ("layers", ctypes.POINTER(_Layer)),
        ("num_layers", _I),
        ("embed", _P),
        ("rope_cos", _P),
        ("rope_sin", _P),
        ("final_norm", _P),
        *((name, _I) for name in ("hidden", "intermediate", "num_heads", "num_kv_heads", "head_dim")),
        ("block_size", _I),
        ("block_stride", _I),
        ("eps", ctypes.c_double),
        ("scale", ctypes.c_double),
        ("lora_pool", _P),
        ("lora_num_slots", _I),
        ("lora_max_rank", _I),
    ]


class _Step(ctypes.Structure):
    _fields_ = [
        ("rows", _I),
        *((name, _P) for name in ("token_ids", "positions", "slot_blocks", "slot_offsets", "block_tables")),
        ("max_blocks", _I),
        ("context_lens", _P),
        ("lora_order", _P),
        ("lora_chunks", _P),
        ("lora_num_chunks", _I),
        ("workspace", _P),
        ("out", _P),
        ("threads", _I),
    ]


class CpuDecodeStep:
    """The model's decode steps as one native call each; plan once with `plan_decode_step`."""

    def __init__(
        self, library: ctypes.CDLL, model: DecoderForCausalLM, plan: _Model, keep: list[object], has_dora: list[bool]
    ) -> None:
        self._model, self._plan, self._keep = model, plan, keep  # keep: what the plan points into
        self._has_dora = has_dora  # AdapterSlots.has_dora, by slot
        self._run = getattr(library, f"decode_step_{_SUFFIXES[model.dtype]}")
        self._run.restype, self._run.argtypes = None, [ctypes.POINTER(_Model), ctypes.POINTER(_Step)]
        self._workspace = library.decode_step_workspace
        self._workspace.restype, self._workspace.argtypes = _I, [ctypes.POINTER(_Model), _I]
        self._scratch = torch.empty(0, dtype=model.dtype)  # the step's workspace

    def run(self, decodes: DecodeRows) -> torch.Tensor | None:
        """[rows, hidden] after the final norm, as the model's forward returns it; None where the
        step's LoRA needs more than the compiled kernel (DoRA)."""
        adapted = [slot for slot in decodes.lora_slots if slot >= 0]  # as RowChunks reads them: -1 is no adapter
        if any(self._has_dora[slot] for slot in adapted):
            return None
        lora = RowChunks.of_segments([1] * len(decodes), decodes.lora_slots) if adapted else None
        model, rows, tables = self._model, len(decodes), decodes.block_tables
        _check_rows(decodes.input_ids, model.embed_tokens.shape[0], "token id", "vocabulary")  # read unchecked
        _check_rows(decodes.positions, model.rope.cos.shape[0], "position", "rotary table")
        max_blocks = max(len(table) for table in tables)
        # Every integer of the step in one array (numpy: ~1 us, where each torch.tensor of a list took ~7).
        integers = np.fromiter(
            itertools.chain(
                decodes.input_ids, decodes.positions, decodes.slot_blocks, decodes.slot_offsets, decodes.context_lens,
                *(itertools.chain(table, itertools.repeat(0, max_blocks - len(table))) for table in tables),
            ),
            dtype=np.int64, count=rows * (5 + max_blocks),
        )  # fmt: skip
        first = integers.ctypes.data
        at = [first + part * rows * integers.itemsize for part in range(6)]
        needed = self._workspace(ctypes.byref(self._plan), rows)
        if self._scratch.numel() < needed:  # kept between steps: the largest batch's
            self._scratch = torch.empty(needed, dtype=model.dtype)
        out = torch.empty(rows, model.spec.hidden_size, dtype=model.dtype)
        step = _Step(
            rows, at[0], at[1], at[2], at[3], at[5], max_blocks, at[4], lora.order.data_ptr() if lora else None,
            lora.chunks.data_ptr() if lora else None, lora.chunks.shape[0] if lora else 0, self._scratch.data_ptr(),
            out.data_ptr(), torch.get_num_threads(),
        )  # fmt: skip
        self._run(ctypes.byref(self._plan), ctypes.byref(step))
        return out


def _check_rows(values: list[int], rows: int, what: str, table: str) -> None:
    if min(values) < 0 or max(values) >= rows:
        raise IndexError(f"a {what} is outside the {table} of {rows}")


def plan_decode_step(plan: StepPlan, kernel_dir: Path) -> CpuDecodeStep | None:
    """The native step for the plan's model, over the kernels the model runs (each built in `kernel_dir`),
    or None where it cannot serve (see the module's docstring)."""
    model, kv_caches, lora_tables = plan.model, plan.kv_caches, plan.adapter_slots.projection_group
    layer_ops, attention, lora = load_layer_ops(kernel_dir), load_decode_kernel(kernel_dir), load_kernel(kernel_dir)
    dtype = model.dtype
    narrow = [module.held for module in model.modules() if isinstance(module, Linear)]
    if dtype not in _SUFFIXES or not all(isinstance(matmul, NarrowMatmul) for matmul in narrow):
        return None
    if model.embed_tokens.dtype != torch.bfloat16 or model.rope.cos.dtype != dtype:  # as narrow weights leave them
        return None
    if not (layer_ops and layer_ops.supports(dtype) and attention and attention.supports(dtype)):
        return None
    if lora is None or not lora.supports(dtype):
        return None
    library = load_library(SOURCE, kernel_dir, "decode steps run layer by layer")
    if library is None:
        return None
    linear, weights = narrow[0].kernel, narrow[0].weights  # type: ignore[union-attr]
    kernels = _Kernels(
        layer_ops.entry_point("add_rms_norm", dtype), layer_ops.entry_point("silu_mul", dtype),
        layer_ops.entry_point("rotary_store_kv", dtype), attention.entry_point(dtype), lora.entry_point(dtype),
        linear.entry_point("bfloat16" if weights == "int8" else weights, dtype), linear.entry_point("int8", dtype),
    )  # fmt: skip
    keep: list[object] = []  # every table a plan points into, alive as long as the plan
    layers = []
    for index, (layer, (k_cache, v_cache)) in enumerate(zip(model.decoder_layers, kv_caches, strict=True)):
        attn, mlp = layer.self_attn, layer.mlp
        linears = {"qkv": attn.qkv_proj, "o": attn.o_proj, "gate_up": mlp.gate_up_proj, "down": mlp.down_proj}
        groups = {name: lora_tables(index, projections) for name, projections in _LORA_GROUPS.items()}
        keep += [*linears.values(), *groups.values()]
        planned = _Layer(
            layer.input_layernorm.weight.data_ptr(), layer.post_attention_layernorm.weight.data_ptr(),
            *(_matmul(linears[name]) for name in _MATMULS), *(_lora_group(groups[name]) for name in _MATMULS),
            k_cache.data_ptr(), v_cache.data_ptr(),
            *((attn.q_norm.weight.data_ptr(), attn.k_norm.weight.data_ptr()) if hasattr(attn, "q_norm") else ()),
        )  # fmt: skip
        layers.append(planned)
    table = (_Layer * len(layers))(*layers)
    spec, (k_cache, _), first = model.spec, kv_caches[0], lora_tables(0, _LORA_GROUPS["qkv"])
    pool = first.pool
    _, num_slots, max_rank = first.a_rows.shape
    native = _Model(
        kernels, ctypes.cast(table, ctypes.POINTER(_Layer)), len(layers), model.embed_tokens.data_ptr(),
        model.rope.cos.data_ptr(), model.rope.sin.data_ptr(), model.norm.weight.data_ptr(),
        spec.hidden_size, spec.intermediate_size, spec.num_heads, spec.num_kv_heads, spec.head_dim,
        k_cache.shape[1], k_cache.stride(0), model.norm.eps, model.decoder_layers[0].self_attn.scale,
        pool.data_ptr(), num_slots, max_rank,
    )  # fmt: skip
    keep += [model.embed_tokens, model.rope.cos, model.rope.sin]
    return CpuDecodeStep(library, model, native, [table, pool, *keep], plan.adapter_slots.has_dora)


def _matmul(linear: Linear) -> _Matmul:
    matmul = linear.held
    assert isinstance(matmul, NarrowMatmul)
    bias = None if linear.bias is None else linear.bias.data_ptr()
    if matmul.int8 is not None:
        int8 = matmul.int8
        pointers = (int8.values.data_ptr(), int8.scales.data_ptr(), int8.mins.data_ptr())
        return _Matmul(*pointers, bias, int8.out_features, int8.in_features)
    assert matmul.bfloat16 is not None
    bfloat16 = matmul.bfloat16
    return _Matmul(bfloat16.packed.data_ptr(), None, None, bias, bfloat16.out_features, bfloat16.in_features)


def _lora_group(group: ProjectionGroup) -> _LoraGroup:
    tables = (group.a_rows, group.b_rows, group.ranks, group.scales, group.widths)
    assert all(table.is_contiguous() for table in tables), "lora_cpu.cpp reads the tables as they lie"
    return _LoraGroup(*(table.data_ptr() for table in tables), group.widths.shape[0])
