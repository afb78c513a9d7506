"""The base-model matmuls of one decode step on the CPU kernel (linear.cpp), per weights mode and row count.

The default model's four layer shapes (qkv, o, gate_up, down) times its 30 layers, random weights,
x of `rows` rows: ms for the 120 matmuls, best and median of --repeats, the modes (and, with
--against, another version of the kernel's source; with --activations bfloat16, oneDNN's packed
bfloat16 matmul, which bfloat16 compute used before the kernel had AMX tiles) taking turns in one
process, so that a VM's drift moves them alike, first and last in turn.

    python -m benchmarks.cpu_matmuls --rows 1 32 512
    python -m benchmarks.cpu_matmuls --against /tmp/old_linear.cpp   # this source against another
    python -m benchmarks.cpu_matmuls --activations bfloat16              # bfloat16 compute's rows
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch

from loraserve.config import default_cache_dir
from loraserve.models.cpu.linear import SOURCE, LinearKernel, NarrowMatmul
from loraserve.models.cpu.platform import OneDnnWeight, onednn_reorders_bfloat16
from loraserve.models.dtypes import BFLOAT16_DOT
from sgmv_kernels.build import load_library

HIDDEN, INTERMEDIATE, KV, LAYERS = 576, 1536, 192, 30
SHAPES = [(HIDDEN + 2 * KV, HIDDEN), (HIDDEN, HIDDEN), (2 * INTERMEDIATE, HIDDEN), (HIDDEN, INTERMEDIATE)] * LAYERS


def kernel_from(source: Path) -> LinearKernel:
    library = load_library(source, default_cache_dir() / "kernels", f"{source} does not build")
    if library is None:
        raise SystemExit(f"{source} did not build (the warning above says why)")
    return LinearKernel(library)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 8, 32, 64])
    parser.add_argument("--repeats", type=int, default=12)
    parser.add_argument("--against", type=Path, help="another linear.cpp, timed in turn with this one")
    parser.add_argument("--activations", choices=["float32", "bfloat16"], default="float32", help="x's dtype")
    args = parser.parse_args(argv)
    torch.manual_seed(0)
    dtype = getattr(torch, args.activations)
    weights = [torch.randn(n, k) * 0.05 for n, k in SHAPES]
    sources = {"this": SOURCE} | ({"against": args.against} if args.against else {})
    runs: dict[str, list[Callable[[torch.Tensor], torch.Tensor]]] = {}
    for label, source in sources.items():
        kernel = kernel_from(source)
        sixteen_bits = BFLOAT16_DOT if kernel.bfloat16_dot_products and dtype == torch.float32 else "bfloat16"
        for mode in ["int8", sixteen_bits]:
            runs[f"{mode} ({label})" if args.against else mode] = [
                NarrowMatmul(kernel, w, mode, dtype) for w in weights
            ]
    if dtype == torch.bfloat16 and onednn_reorders_bfloat16():  # with AVX-512
        runs["oneDNN bfloat16"] = [OneDnnWeight.of(w.to(torch.bfloat16)) for w in weights]
    print(f"the {len(SHAPES)} layer matmuls of a decode step, {args.activations} rows, ms "
          f"(best / median of {args.repeats}), {torch.get_num_threads()} threads")  # fmt: skip
    for rows in args.rows:
        xs = {k: torch.randn(rows, k, dtype=dtype) for k in (HIDDEN, INTERMEDIATE)}
        times: dict[str, list[float]] = {name: [] for name in runs}
        for repeat in range(args.repeats):  # the order turns round each repeat: who goes first gains a few %
            for name, matmuls in (reversed if repeat % 2 else iter)(list(runs.items())):
                start = time.perf_counter()
                for matmul, (_, k) in zip(matmuls, SHAPES, strict=True):
                    matmul(xs[k])
                times[name].append((time.perf_counter() - start) * 1e3)
        cells = [f"{name} {min(t):.2f} / {statistics.median(t):.2f}" for name, t in times.items()]
        print(f"{rows} rows: " + ", ".join(cells), flush=True)


if __name__ == "__main__":
    main()
