"""On a CUDA GPU: decode against the memory bound, and multi-LoRA decode against the base model,
with the decode CUDA graphs and without (--enforce-eager).

    python -m benchmarks.random_model --shapes llama3-8b /tmp/llama3-8b
    python -m benchmarks.bench_gpu --model /tmp/llama3-8b --random-weights

- Batch 1: seconds per decoded token against the HBM bound, the weight bytes a step reads
  (every matrix and the LM head; one embedding row) over the measured copy bandwidth.
- Batch B (64) over N (32) adapters of rank R (16) on all seven projections, against the same
  requests on the base model: decode tokens/s, from a run of 1 token and one of 1 + T tokens,
  so prompt steps cancel out.
Writes the section `gpu-decode` of docs/benchmarks/gpu.md.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import torch

from benchmarks.bench_kernels import peak_bandwidth
from benchmarks.engines import engine_over
from benchmarks.random_adapters import write_random_adapters
from benchmarks.report import (
    add_model_flags,
    add_report_flags,
    machine_description,
    model_config_of,
    page,
    reproduce_command,
    write_section,
)
from loraserve import LLM, SamplingParams
from loraserve.models import LoadedModel, load_model
from loraserve.models.dtypes import dtype_name

SECTION = "gpu-decode"
PROMPT_LEN = 32


def weight_bytes(loaded: LoadedModel) -> int:
    """Bytes one decode step reads: every weight but the embedding table, of which it reads a row."""
    model = loaded.model
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    if model.lm_head.weight is not model.embed_tokens:
        total -= model.embed_tokens.numel() * model.embed_tokens.element_size()
    return total


def decode_seconds_per_step(llm: LLM, prompts: list[list[int]], adapters: list[str | None], steps: int) -> float:
    """Seconds per decode step: (time for 1 + steps tokens - time for 1 token) / steps, median of 3."""

    def timed(max_tokens: int) -> float:
        params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
        llm.reset_prefix_cache()
        torch.cuda.synchronize()
        start = time.perf_counter()
        llm.generate(prompts, params, adapters=adapters, use_tqdm=False)
        return time.perf_counter() - start

    timed(4)  # warm-up: adapters resident, Triton compiled
    samples = [(timed(1 + steps) - timed(1)) / steps for _ in range(3)]
    return statistics.median(samples)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--adapters", type=int, default=32)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--steps", type=int, default=64, help="decode steps timed")
    parser.add_argument("--pool-gib", type=float, default=8.0, help="memory pool: KV blocks and adapters")
    parser.add_argument("--modes", nargs="+", default=["graphs", "eager"], choices=["graphs", "eager"])
    add_model_flags(parser)
    add_report_flags(parser)
    args = parser.parse_args()
    args.output = args.output or page("gpu")
    args.device = "cuda"
    if args.quick:
        args.batch, args.adapters, args.steps = 4, 2, 4
    loaded = load_model(model_config_of(args))
    bandwidth = peak_bandwidth()  # bytes/s
    step_bound = weight_bytes(loaded) / bandwidth
    prompts = [[(17 * i + j) % 1000 + 100 for j in range(PROMPT_LEN)] for i in range(args.batch)]
    names = [f"adapter-{i % args.adapters}" for i in range(args.batch)]
    rows: list[str] = []
    with tempfile.TemporaryDirectory() as tmp:
        paths = write_random_adapters(loaded.model.spec, args.adapters, Path(tmp), ranks=(args.rank,))
        for graphs in [mode == "graphs" for mode in args.modes]:
            engine = engine_over(
                loaded, args.batch, max_loras=args.adapters, pool_bytes=int(args.pool_gib * 2**30),
                enforce_eager=not graphs,
            )  # fmt: skip
            try:
                llm = LLM.from_engine(engine)
                for i, path in enumerate(paths):
                    llm.add_adapter(f"adapter-{i}", path)
                single = decode_seconds_per_step(llm, prompts[:1], [None], args.steps)
                base = decode_seconds_per_step(llm, prompts, [None] * args.batch, args.steps)
                lora = decode_seconds_per_step(llm, prompts, names, args.steps)
            finally:
                engine.close()
            label = "CUDA graphs" if graphs else "eager (--enforce-eager)"
            rows.append(
                f"| {label} | {single * 1e3:.2f} | {step_bound / single:.0%} | {args.batch / base:.0f} | "
                f"{args.batch / lora:.0f} | {base / lora:.2f} |"
            )
            print(rows[-1], flush=True)
    body = "\n".join(
        [
            "## Decode on a GPU: the memory bound, and multi-LoRA against the base model",
            "",
            f"Command: `{reproduce_command('benchmarks.bench_gpu')}`. Machine: {machine_description('cuda')}.",
            "",
            f"{dtype_name(loaded.dtype)}, {'random weights' if args.random_weights else 'the weights given'} of "
            f"{loaded.model_dir.name}'s shapes ({weight_bytes(loaded) / 1e9:.2f} GB read per step). Bound: those "
            f"bytes over the measured copy bandwidth ({bandwidth / 1e9:.0f} GB/s, read + write) = "
            f"{step_bound * 1e3:.2f} ms a step. Decode time per step = (time for 1 + {args.steps} tokens - time "
            f"for 1 token) / {args.steps}, median of 3, {PROMPT_LEN}-token prompts. LoRA: {args.batch} rows over "
            f"{args.adapters} adapters of rank {args.rank} on all seven projections; base: the same rows, no adapter.",
            "",
            f"| decode | batch 1 ms/token | of the HBM bound | batch {args.batch} base tok/s | "
            f"batch {args.batch} LoRA tok/s | LoRA / base |",
            "|---|---:|---:|---:|---:|---:|",
            *rows,
        ]
    )
    print(body)
    if not args.quick:
        write_section(args.output, SECTION, body)


if __name__ == "__main__":
    main()
