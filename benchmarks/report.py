"""Writing results into docs/benchmarks.md: one marked section per benchmark, the rest kept."""

from __future__ import annotations

import os
import platform
from pathlib import Path

import torch

from loraserve.models.dtypes import cpu_has_native_bf16


def machine_description() -> str:
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    bf16 = "native bf16" if cpu_has_native_bf16() else "no native bf16"
    return f"{cpu}, {os.cpu_count()} cores ({bf16}), torch {torch.__version__}, {torch.get_num_threads()} threads"


def write_section(path: Path, name: str, body: str) -> None:
    """Replace the section between `<!-- name:start -->` and `<!-- name:end -->`, or append it."""
    start, end = f"<!-- {name}:start -->", f"<!-- {name}:end -->"
    text = path.read_text() if path.exists() else "# Benchmarks\n"
    block = f"{start}\n{body.rstrip()}\n{end}"
    if start in text and end in text:
        before, rest = text.split(start, 1)
        text = before + block + rest.split(end, 1)[1]
    else:
        text = text.rstrip() + "\n\n" + block + "\n"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
