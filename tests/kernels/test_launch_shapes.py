"""Launch shapes of the CUDA LoRA kernels: a GPU's tuned file, read back as it was written."""

from __future__ import annotations

import json

import pytest
import torch

from sgmv_kernels import launch
from sgmv_kernels.launch import DEFAULT, ExpandShape, LaunchShapes, ShrinkShape, forced, shapes_for, tuned_file


def test_a_tuned_file_is_named_for_its_gpu_and_reads_back_what_was_written(tmp_path, monkeypatch):
    monkeypatch.setattr(launch, "TUNED_DIR", tmp_path)
    assert tuned_file("NVIDIA H100 80GB HBM3").name == "NVIDIA_H100_80GB_HBM3.json"
    shapes = LaunchShapes(ShrinkShape(256, 8, 4, 4), ExpandShape(512, 8))
    path = launch.write_tuned("NVIDIA H100 80GB HBM3", shapes, {"layer_cold_us": {"defaults": 90.0, "tuned": 60.0}})
    assert LaunchShapes.from_json(json.loads(path.read_text())) == shapes


@pytest.mark.parametrize("path", sorted(launch.TUNED_DIR.glob("*.json")), ids=lambda path: path.stem)
def test_every_committed_tuned_file_reads(path):
    data = json.loads(path.read_text())
    shapes = LaunchShapes.from_json(data)
    assert tuned_file(data["device"]) == path, "named for the GPU it was measured on"
    assert shapes.expand.column_block >= 64 and shapes.expand.column_block & (shapes.expand.column_block - 1) == 0


def test_the_cpu_launches_with_the_defaults_unless_a_sweep_forces_shapes():
    cpu = torch.device("cpu")
    other = LaunchShapes(ShrinkShape(block_k=128), ExpandShape(column_block=128))
    assert shapes_for(cpu) == DEFAULT
    with forced(other):
        assert shapes_for(cpu) == other
    assert shapes_for(cpu) == DEFAULT
