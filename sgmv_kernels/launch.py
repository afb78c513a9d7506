"""Launch shapes of the CUDA LoRA kernels: defaults, and a GPU's own choice where one was measured.

The best shapes differ between GPUs (SM count, memory latency, L2 size), so a sweep on the GPU
(`python -m benchmarks.bench_kernels --sweep --write-tuned`) writes its winner to
`tuned/<device name>.json`, read once per device; a GPU without a file gets the defaults.
The sweep times each shape with the adapters out of L2, as a decode step meets them after
streaming the base weights.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import re
from collections.abc import Iterator
from pathlib import Path

import torch

TUNED_DIR = Path(__file__).parent / "tuned"


@dataclasses.dataclass(frozen=True)
class ShrinkShape:
    block_k: int = 64  # K per step of a program's loop
    split_waves: int = 4  # split K until about this many programs per SM
    num_warps: int = 2
    num_stages: int = 3  # loads in flight in the K loop (software pipelining)


@dataclasses.dataclass(frozen=True)
class ExpandShape:
    column_block: int = 256  # output columns per step of a program, a power of two >= 64
    num_warps: int = 4
    waves: int = 4  # column blocks per program: as many as leave about this many programs per SM
    decode_fma: bool = True  # a few rows' products on the CUDA cores, not in a 16-row tensor tile
    # No software pipelining: the rank loop runs 1-4 times, and staging its loads through shared
    # memory (Triton's default, 3 stages) made a prompt's expand 1.75x slower on an H200.
    num_stages: int = 1


@dataclasses.dataclass(frozen=True)
class LaunchShapes:
    shrink: ShrinkShape = ShrinkShape()
    expand: ExpandShape = ExpandShape()

    @classmethod
    def from_json(cls, data: dict) -> LaunchShapes:
        return cls(ShrinkShape(**data["shrink"]), ExpandShape(**data["expand"]))

    def to_json(self) -> dict:
        return dataclasses.asdict(self)


DEFAULT = LaunchShapes()
_by_device: dict[int, LaunchShapes] = {}
_forced: list[LaunchShapes] = []


def tuned_file(device_name: str) -> Path:
    return TUNED_DIR / (re.sub(r"[^A-Za-z0-9]+", "_", device_name).strip("_") + ".json")


def shapes_for(device: torch.device) -> LaunchShapes:
    """The shapes to launch with on `device`: forced ones (a sweep), its tuned file, or the defaults."""
    if _forced:
        return _forced[-1]
    if device.type != "cuda":
        return DEFAULT
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _by_device:
        path = tuned_file(torch.cuda.get_device_name(index))
        _by_device[index] = LaunchShapes.from_json(json.loads(path.read_text())) if path.exists() else DEFAULT
    return _by_device[index]


@contextlib.contextmanager
def forced(shapes: LaunchShapes) -> Iterator[None]:
    """Launch with `shapes` on every device inside the block (for sweeps and tests)."""
    _forced.append(shapes)
    try:
        yield
    finally:
        _forced.pop()


def write_tuned(device_name: str, shapes: LaunchShapes, measured: dict) -> Path:
    """Record a sweep's choice for `device_name`, with what it measured, for `shapes_for`."""
    path = tuned_file(device_name)
    path.parent.mkdir(exist_ok=True)
    path.write_text(json.dumps({**shapes.to_json(), "device": device_name, "measured": measured}, indent=1) + "\n")
    _by_device.clear()
    return path
