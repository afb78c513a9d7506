"""The benchmark harnesses still run end to end (a tiny workload; nothing is timed or written)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.slow
@pytest.mark.parametrize(
    "module",
    ["benchmarks.bench_engine", "benchmarks.bench_lora", "benchmarks.bench_lora_ops", "benchmarks.bench_swapping"],
)
def test_benchmark_smoke_run(module, tmp_path):
    args = [] if module.endswith("lora_ops") else ["--quick", "--output", str(tmp_path / "out.md")]
    result = subprocess.run(
        [sys.executable, "-m", module, *args], cwd=ROOT, capture_output=True, text=True, timeout=600
    )
    assert result.returncode == 0, result.stderr[-2000:]
    assert "tok/s" in result.stdout or " us" in result.stdout or "tokens_per_second" in result.stdout
    assert not (tmp_path / "out.md").exists()
