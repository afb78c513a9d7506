"""int8 weights quantized once and kept beside the model, keyed by its content, so a restart reads
them instead of quantizing again (about 1.5 s a GB of float32 weights).

The key hashes the model's weights and config (their SHA-256, itself remembered per file by size,
mtime and inode, so an unchanged model is not read twice either) and the matmul kernel's build,
whose name hashes its source, flags and CPU: the panels' layout is that build's. A cache file
that is unreadable or does not fit the model is ignored with a warning and written again.

Example: cache_dir/weights/SmolLM2-135M-Instruct-int8-3f2a9c0d41b7e6a8.safetensors holds
"layers.0.self_attn.qkv_proj.values", ".scales" and ".mins", for each matmul.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import tempfile
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from loraserve.file_digest import sha256_of_files
from loraserve.models.cpu.linear import LinearKernel, PackedInt8

logger = logging.getLogger(__name__)

DIGESTS = "digests.json"  # file path -> [size, mtime_ns, inode, sha256]
PARTS = ("values", "scales", "mins")  # the tensors of each matmul's panels (linear.PackedInt8)


def content_digest(files: list[Path], remembered: Path) -> str:
    """SHA-256 over the files' digests in order; each file's is read again only when its stat changed."""
    try:
        known = json.loads(remembered.read_text())
    except (OSError, ValueError):
        known = {}
    total, read = hashlib.sha256(), False
    for file in files:
        stat = file.stat()
        identity = [stat.st_size, stat.st_mtime_ns, stat.st_ino]
        entry = known.get(str(file.resolve()))
        if not (isinstance(entry, list) and entry[:3] == identity):
            entry = known[str(file.resolve())] = [*identity, sha256_of_files(file)]
            read = True
        total.update(f"{file.name}:{entry[3]}\n".encode())
    if read:
        _write_atomically(remembered, json.dumps(known).encode())
    return total.hexdigest()


class PackedWeightsCache:
    """The int8 panels of one model for one kernel build: `load` them, else `store` them once made."""

    def __init__(self, cache_dir: Path, model_dir: Path, name: str, kernel: LinearKernel) -> None:
        files = [*sorted(model_dir.glob("*.safetensors")), model_dir / "config.json"]
        key = hashlib.sha256(f"{content_digest(files, cache_dir / DIGESTS)}\n{kernel.build}".encode())
        self.path = cache_dir / f"{name}-int8-{key.hexdigest()[:16]}.safetensors"
        self.kernel = kernel

    def load(self, shapes: dict[str, tuple[int, int]]) -> dict[str, PackedInt8] | None:
        """Each matmul's panels by module name ({name: (out_features, in_features)}), or None."""
        if not self.path.is_file():
            return None
        try:
            tensors = load_file(self.path)
            packed = {}
            for name, (rows, columns) in shapes.items():
                values, scales, mins = (tensors[f"{name}.{part}"] for part in PARTS)
                packed[name] = PackedInt8(values, scales, mins, rows, columns)
        except (OSError, SafetensorError, KeyError) as error:
            logger.warning("ignoring the int8 weights cached in %s (%s); quantizing again", self.path, error)
            return None
        misfits = [name for name, weights in packed.items() if not self.kernel.fits_int8(weights)]
        if misfits:
            logger.warning("ignoring %s: %s does not fit the model; quantizing again", self.path, misfits[0])
            return None
        logger.info("int8 weights read from %s", self.path)
        return packed

    def store(self, packed: dict[str, PackedInt8]) -> None:
        tensors: dict[str, torch.Tensor] = {}
        for name, weights in packed.items():
            tensors.update({f"{name}.{part}": getattr(weights, part) for part in PARTS})
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=self.path.parent) as scratch:  # never half a file under the name
            written = Path(scratch) / self.path.name
            save_file(tensors, written)
            os.replace(written, self.path)
        logger.info("int8 weights quantized once and cached in %s", self.path)


def _write_atomically(path: Path, data: bytes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.NamedTemporaryFile(dir=path.parent, delete=False) as out:
        out.write(data)
    os.replace(out.name, path)
