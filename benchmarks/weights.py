"""Decode tok/s per way of holding the weights (--weights), against the memory floor.

A decode step reads every matmul weight once: its floor is the weights' bytes over the memory
bandwidth, measured here as the best of a few streaming reads of 1 GiB. Per mode: one chat
(base, and with an adapter), and 32 chats over 8 adapters (rank 16, all projections), 64
tokens each, greedy, EOS ignored, prefix cache off, best of --repeats.

    loraserve bench weights            # writes its section of docs/benchmarks.md
    loraserve bench weights --quick    # a smoke run, nothing written
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import torch

from benchmarks.engines import engine_over
from benchmarks.random_adapters import write_random_adapters
from benchmarks.report import add_report_flags, machine_description, write_section
from loraserve import LLM, SamplingParams
from loraserve.config import ModelConfig
from loraserve.models import LoadedModel
from loraserve.models.cpu_linear import NarrowMatmul
from loraserve.models.dtypes import cpu_has_native_bf16
from loraserve.models.linear import Linear
from loraserve.models.loader import load_model

PROMPT = "Write a short story about a lighthouse keeper and the storm that changed everything."


def streaming_read_gbs(gib: int = 1, repeats: int = 5) -> float:
    """The best GB/s of reading `gib` GiB once: a sum, a max and a matrix-vector product (what torch
    does fastest differs by CPU)."""
    data = torch.ones(gib << 28)  # float32
    matrix, vector = data.view(-1, 4096), torch.ones(4096)
    best = 0.0
    for read in (data.sum, data.amax, lambda: matrix @ vector):
        read()
        for _ in range(repeats):
            start = time.perf_counter()
            read()
            best = max(best, data.nbytes / (time.perf_counter() - start) / 1e9)
    return best


def weight_bytes(loaded: LoadedModel) -> int:
    """Bytes of every matmul weight a decode step reads (the lm_head included)."""
    total = 0
    for module in loaded.model.modules():
        if isinstance(module, Linear):
            narrow = module.narrow
            total += narrow.nbytes if isinstance(narrow, NarrowMatmul) else module.weight.nbytes
    return total


def tokens_per_second(llm: LLM, prompts: list[str], adapters: list[str] | None, tokens: int, repeats: int) -> float:
    params = SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True)
    llm.generate(prompts, params, adapters=adapters, use_tqdm=False)  # warm: kernels built, adapters loaded
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        llm.generate(prompts, params, adapters=adapters, use_tqdm=False)
        best = min(best, time.perf_counter() - start)
    return len(prompts) * tokens / best


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--modes", nargs="+", default=None, help="dtype:weights pairs (default: all this CPU runs)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--tokens", type=int, default=64)
    add_report_flags(parser)
    args = parser.parse_args(argv)
    modes = args.modes or ["float32:float32", "float32:bfloat16", "float32:int8"]
    if args.modes is None and cpu_has_native_bf16():
        modes += ["bfloat16:bfloat16", "bfloat16:int8"]
    tokens, repeats = (8, 1) if args.quick else (args.tokens, args.repeats)
    bandwidth = streaming_read_gbs()
    print(f"streaming read: {bandwidth:.1f} GB/s", flush=True)
    rows = []
    with tempfile.TemporaryDirectory() as scratch:
        adapter_dirs: list[Path] = []
        for mode in modes:
            dtype, weights = mode.split(":")
            loaded = load_model(ModelConfig(dtype=dtype, weights=weights))
            if not adapter_dirs:
                adapter_dirs = write_random_adapters(loaded.model.spec, 8, Path(scratch), ranks=(16,))
            llm = LLM.from_engine(engine_over(loaded, max_num_seqs=32, max_loras=8, prefix_caching=False))
            names = [f"adapter-{i}" for i in range(len(adapter_dirs))]
            for name, path in zip(names, adapter_dirs, strict=True):
                llm.add_adapter(name, path)
            megabytes = weight_bytes(loaded) / 1e6
            floor = bandwidth * 1e3 / megabytes
            one = tokens_per_second(llm, [PROMPT], None, tokens, repeats)
            one_adapter = tokens_per_second(llm, [PROMPT], names[:1], tokens, repeats)
            prompts = [f"{PROMPT} ({i})" for i in range(32)]
            mixed = tokens_per_second(llm, prompts, [names[i % len(names)] for i in range(32)], tokens, repeats)
            row = f"| {dtype} | {weights} | {megabytes:.0f} | {floor:.0f} | {one:.1f} ({one / floor:.2f}) "
            row += f"| {one_adapter:.1f} | {mixed:.0f} |"
            print(row, flush=True)
            rows.append(row)
            llm.engine.close()  # its adapter loader thread would keep the engine, and the model, alive
            del llm, loaded
    body = "\n".join(
        [
            "## Weights: float32, bfloat16 and int8 (q8_0) on the CPU",
            "",
            f"Command: `loraserve bench weights {' '.join(argv or [])}`. Machine: {machine_description()}.",
            "",
            f"Streaming read: {bandwidth:.1f} GB/s (best of a sum, a max and a matrix-vector product over 1 GiB). "
            "Floor: that bandwidth over the bytes of the matmul weights (one decode step reads each once). "
            f"{tokens} tokens a chat, greedy, EOS ignored, prefix cache off, best of {repeats}; "
            "8 random adapters of rank 16 on all projections.",
            "",
            "| compute | weights | weight MB | floor tok/s | 1 chat tok/s (of floor) | 1 chat, adapter "
            "| 32 chats, 8 adapters |",
            "|---|---|---:|---:|---:|---:|---:|",
            *rows,
        ]
    )
    if not args.quick:
        write_section(args.output, "bench-weights", body)
    print(body)


if __name__ == "__main__":
    main()
