"""Decode attention (one query token per row over the paged context): SDPA against the two
batched matmuls of `decode_attention`, at SmolLM2's heads (9 query, 3 KV, dim 64).

    python -m benchmarks.bench_attention            # a section of docs/benchmarks.md
    python -m benchmarks.bench_attention --quick    # a smoke run; nothing written

Both get the step's gathered blocks as the engine holds them ([B, L, Hkv, D]); SDPA also
pays the transposes to [B, Hkv, L, D] it needs. Microseconds per layer call, median of 30.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

from benchmarks.report import add_report_flags, machine_description, reproduce_command, write_section
from loraserve.models.attention import decode_attention

SECTION = "decode-attention"
NUM_HEADS, NUM_KV_HEADS, HEAD_DIM = 9, 3, 64


def sdpa(queries, keys, values, bias, scale):
    return F.scaled_dot_product_attention(
        queries.unsqueeze(2), keys.transpose(1, 2), values.transpose(1, 2), attn_mask=bias, scale=scale, enable_gqa=True
    ).squeeze(2)


def microseconds(fn: Callable[[], object], repeats: int) -> float:
    fn()
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - start)
    return statistics.median(samples) * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_report_flags(parser)
    args = parser.parse_args()
    batches, contexts, repeats = ((4,), (64,), 3) if args.quick else ((1, 8, 32, 64), (128, 512, 2048), 30)
    rows = ["| dtype | batch | context | SDPA (us) | two matmuls (us) | speed-up |", "|---|---:|---:|---:|---:|---:|"]
    scale = HEAD_DIM**-0.5
    for dtype in (torch.bfloat16, torch.float32):
        for batch in batches:
            for context in contexts:
                queries = torch.randn(batch, NUM_HEADS, HEAD_DIM).to(dtype)
                keys = torch.randn(batch, context, NUM_KV_HEADS, HEAD_DIM).to(dtype)
                values = torch.randn(batch, context, NUM_KV_HEADS, HEAD_DIM).to(dtype)
                bias = torch.zeros(batch, 1, 1, context, dtype=dtype)
                bias[..., context - context // 8 :] = float("-inf")  # the last block's padding
                inputs = (queries, keys, values, bias, scale)
                reference = microseconds(lambda inputs=inputs: sdpa(*inputs), repeats)
                ours = microseconds(lambda inputs=inputs: decode_attention(*inputs), repeats)
                name = str(dtype).removeprefix("torch.")
                rows.append(
                    f"| {name} | {batch} | {context} | {reference:.0f} | {ours:.0f} | {reference / ours:.1f}x |"
                )
                print(rows[-1], flush=True)
    if args.quick:
        return
    body = "\n".join(
        [
            "## Decode attention: SDPA against two batched matmuls",
            "",
            f"Command: `{reproduce_command('benchmarks.bench_attention')}`. Machine: {machine_description()}.",
            "",
            f"One layer's attention for decode rows, {NUM_HEADS} query heads over {NUM_KV_HEADS} KV heads of "
            f"{HEAD_DIM}; microseconds per call, median of {repeats}.",
            "",
            *rows,
        ]
    )
    write_section(args.output, SECTION, body)
    print(f"wrote section {SECTION} of {args.output}")


if __name__ == "__main__":
    main()
