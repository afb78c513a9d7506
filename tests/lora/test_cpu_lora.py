"""The LoRA backends equal plain math - the compiled CPU kernel over the pool (native.py), without a
compiler rows regrouped by adapter over dense stacks of the step's adapters (grouped_lora), and the
GPU's Triton kernels under the interpreter - for fused projections, mixed ranks and targets, rows
without an adapter, and a slot reused."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from loraserve.lora.adapter import LoraAdapter, LoraWeights, projection_shapes
from loraserve.lora.backends import CompiledCpuLora, GroupedRows, LoraBackend, TorchCpuLora, TritonLora
from loraserve.lora.batch import NO_ADAPTER, LoraBatch
from loraserve.lora.slots import AdapterSlots
from loraserve.memory.pool import MemoryPool
from sgmv_kernels import lora_expand, lora_shrink
from sgmv_kernels.cpu import RowGroups
from sgmv_kernels.native import RowChunks, load_kernel
from tests.lora.tiny_adapters import TINY_BLOCK_SIZE, TINY_SPEC

SHAPES = projection_shapes(TINY_SPEC)
QKV = ("q_proj", "k_proj", "v_proj")


def adapter(seed: int, rank: int, targets: tuple[str, ...], scale: float) -> LoraAdapter:
    generator = torch.Generator().manual_seed(seed)
    weights = {
        (layer, p): LoraWeights(
            a=torch.randn(rank, SHAPES[p][0], generator=generator),
            b=torch.randn(SHAPES[p][1], rank, generator=generator),
            scale=scale,
        )
        for layer in range(TINY_SPEC.num_layers)
        for p in targets
    }
    return LoraAdapter(
        rank=rank, alpha=scale * rank, use_rslora=False, target_modules=targets, weights=weights,
        base_model_name=None, sha256=f"{seed:064x}", num_bytes=0,
    )  # fmt: skip


def load(slots: AdapterSlots, weights: LoraAdapter) -> int:
    slot = slots.reserve(slots.pages_needed(weights))
    assert slot is not None
    slots.write(slot, weights)
    slots.activate(slot)
    return slot


def expected(x, out, adapters_by_row, layer, projections):
    """out + per row: x @ A^T @ B^T * scale for each projection, side by side."""
    result = out.clone()
    column = 0
    for p in projections:
        width = SHAPES[p][1]
        for row, weights in enumerate(adapters_by_row):
            if weights is not None and (layer, p) in weights.weights:
                w = weights.weights[(layer, p)]
                result[row, column : column + width] += (x[row] @ w.a.T @ w.b.T) * w.scale
        column += width
    return result


@pytest.fixture(scope="module", params=["native", "torch"])
def cpu_backend(request, tmp_path_factory) -> LoraBackend:
    if request.param == "torch":
        return TorchCpuLora()
    kernel = load_kernel(tmp_path_factory.mktemp("kernels"))
    assert kernel is not None
    return CompiledCpuLora(kernel)


def add_with_references(batch: LoraBatch, layer: int, projections, x, out) -> None:
    """The kernels' torch references (sgmv_kernels on the CPU), a projection at a time."""
    column = 0
    for projection in projections:
        weights, width = batch.slots.layers[layer][projection], SHAPES[projection][1]
        segments = {"seg_indptr": batch.seg_indptr, "seg_slots": batch.seg_slots}
        lora_expand(lora_shrink(x, weights, **segments), weights, out[:, column : column + width], **segments)
        column += width


@pytest.fixture
def slots_and_adapters():
    pool = MemoryPool(TINY_SPEC, TINY_BLOCK_SIZE, 256, torch.float32, "cpu")
    slots = AdapterSlots(TINY_SPEC, num_slots=4, max_rank=8, pool=pool)
    adapters = {
        "attention-r2": adapter(1, 2, ("q_proj", "v_proj"), 2.0),
        "all-r8": adapter(2, 8, ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"), 0.5),
        "mlp-r4": adapter(3, 4, ("gate_proj", "up_proj", "down_proj"), 1.5),
    }
    slot_of = {name: load(slots, weights) for name, weights in adapters.items()}
    return slots, adapters, slot_of


@pytest.mark.parametrize(
    ("lengths", "names"),
    [
        ([1] * 6, ["all-r8", "attention-r2", None, "all-r8", "mlp-r4", "attention-r2"]),  # decode, interleaved
        ([3, 1, 4], ["mlp-r4", None, "all-r8"]),  # prefill chunks and a base row
        ([1] * 4, ["all-r8"] * 4),  # one adapter: the rows already are the grid
        ([3, 2], ["mlp-r4", "all-r8"]),  # grouped rows, but the second group is padded
    ],
)
@pytest.mark.parametrize(("layer", "projections"), [(0, QKV), (1, ("gate_proj", "up_proj")), (1, ("down_proj",))])
def test_cpu_paths_equal_plain_math(slots_and_adapters, cpu_backend, lengths, names, layer, projections):
    slots, adapters, slot_of = slots_and_adapters
    slot_ids = [slot_of[n] if n else NO_ADAPTER for n in names]
    batch = LoraBatch.build(slots, lengths, slot_ids, cpu_backend)
    assert batch is not None
    assert isinstance(batch.plan, RowChunks if isinstance(cpu_backend, CompiledCpuLora) else GroupedRows)
    rows = [adapters[n] if n else None for n, length in zip(names, lengths, strict=True) for _ in range(length)]
    generator = torch.Generator().manual_seed(7)
    x = torch.randn(sum(lengths), SHAPES[projections[0]][0], generator=generator)
    out = torch.randn(sum(lengths), sum(SHAPES[p][1] for p in projections), generator=generator)
    want = expected(x, out, rows, layer, projections)
    batch.add(layer, projections, x, out)
    torch.testing.assert_close(out, want, atol=1e-5, rtol=1e-5)
    # The other path (the kernels' torch references, the GPU path's semantics) adds the same delta.
    delta = torch.zeros_like(out)
    add_with_references(batch, layer, projections, x, delta)
    zero_based = expected(x, torch.zeros_like(out), rows, layer, projections)
    torch.testing.assert_close(delta, zero_based, atol=1e-5, rtol=1e-5)
    # And the GPU path itself: the Triton kernels, under the interpreter here.
    kernels = torch.zeros_like(out)
    dataclasses.replace(batch, backend=TritonLora()).add(layer, projections, x, kernels)
    torch.testing.assert_close(kernels, zero_based, atol=1e-5, rtol=1e-5)


def test_a_reused_slot_gets_the_new_weights(slots_and_adapters, cpu_backend):
    slots, _, slot_of = slots_and_adapters
    x, out = torch.ones(2, 8), torch.zeros(2, 16)
    LoraBatch.build(slots, [1, 1], [slot_of["all-r8"]] * 2, cpu_backend).add(0, QKV, x, out)
    slots.unload(slot_of["all-r8"])
    replacement = adapter(9, 8, QKV, 1.0)
    assert load(slots, replacement) == slot_of["all-r8"]
    out = torch.zeros(2, 16)
    LoraBatch.build(slots, [1, 1], [slot_of["all-r8"]] * 2, cpu_backend).add(0, QKV, x, out)
    torch.testing.assert_close(out, expected(x, torch.zeros(2, 16), [replacement] * 2, 0, QKV), atol=1e-5, rtol=1e-5)


def test_row_groups_place_each_adapter_rows_together():
    groups = RowGroups.of_segments([1, 1, 3], [1, -1, 0], "cpu")
    assert groups.rows is not None and groups.flat is not None
    assert (groups.rows.tolist(), groups.flat.tolist(), groups.groups, groups.size) == (
        [0, 2, 3, 4],
        [3, 0, 1, 2],
        2,
        3,
    )
    in_place = RowGroups.of_segments([2, 2], [0, 0], "cpu")
    assert in_place.rows is None and in_place.flat is None and (in_place.groups, in_place.size) == (1, 4)
    padded = RowGroups.of_segments([3, 2], [0, 1], "cpu")
    assert padded.flat is not None and padded.flat.tolist() == [0, 1, 2, 3, 4] and padded.groups * padded.size == 6
