"""Decode attention (one query token per row over the paged context): SDPA, the two batched
matmuls of `decode_attention` and the compiled kernel (models/cpu/attention.py), at SmolLM2's heads
(9 query, 3 KV, dim 64).

    python -m benchmarks.bench_attention            # a section of docs/benchmarks/kernels.md
    python -m benchmarks.bench_attention --quick    # a smoke run; nothing written

All start from one layer of a paged cache with each row's blocks scattered: the torch paths
gather the blocks first (as attention.py does), SDPA also pays the transposes it needs, the
kernel reads the blocks where they lie. Microseconds per layer call, median of 30.
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F

from benchmarks.report import add_report_flags, machine_description, page, reproduce_command, write_section
from benchmarks.timing import median_microseconds
from loraserve.config import default_cache_dir
from loraserve.models.attention import decode_attention
from loraserve.models.cpu.attention import load_decode_kernel
from loraserve.models.dtypes import dtype_name

SECTION = "decode-attention"
NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE = 9, 3, 64, 16


def gathered(cache, tables):
    rows, blocks = tables.shape
    return cache.index_select(0, tables.view(-1)).view(rows, blocks * BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM)


def sdpa(queries, k_cache, v_cache, tables, bias, scale):
    keys, values = gathered(k_cache, tables).transpose(1, 2), gathered(v_cache, tables).transpose(1, 2)
    return F.scaled_dot_product_attention(
        queries.unsqueeze(2), keys, values, attn_mask=bias, scale=scale, enable_gqa=True
    ).squeeze(2)


def matmuls(queries, k_cache, v_cache, tables, bias, scale):
    return decode_attention(queries, gathered(k_cache, tables), gathered(v_cache, tables), bias, scale)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_report_flags(parser)
    args = parser.parse_args()
    args.output = args.output or page("kernels")
    batches, contexts, repeats = ((4,), (64,), 3) if args.quick else ((1, 8, 32, 64), (128, 512, 2048), 30)
    rows = [
        "| dtype | batch | context | SDPA (us) | two matmuls (us) | compiled kernel (us) | kernel vs SDPA |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    scale = HEAD_DIM**-0.5
    kernel = load_decode_kernel(default_cache_dir() / "kernels")
    for dtype in (torch.bfloat16, torch.float32):
        for batch in batches:
            for context in contexts:
                blocks = context // BLOCK_SIZE
                k_cache, v_cache = (
                    torch.randn(4 * batch * blocks, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM).to(dtype) for _ in range(2)
                )
                tables = torch.randperm(4 * batch * blocks)[: batch * blocks].view(batch, blocks)
                queries = torch.randn(batch, NUM_HEADS, HEAD_DIM).to(dtype)
                bias = torch.zeros(batch, 1, 1, context, dtype=dtype)
                bias[..., context - BLOCK_SIZE // 2 :] = float("-inf")  # the last block half filled
                lens = torch.full((batch,), context - BLOCK_SIZE // 2)
                inputs = (queries, k_cache, v_cache, tables, bias, scale)
                reference = median_microseconds(lambda inputs=inputs: sdpa(*inputs), repeats)
                ours = median_microseconds(lambda inputs=inputs: matmuls(*inputs), repeats)
                compiled = float("nan")
                if kernel is not None:
                    call = (queries, k_cache, v_cache, tables, lens, scale)
                    compiled = median_microseconds(lambda call=call: kernel(*call), repeats)
                name = dtype_name(dtype)
                rows.append(
                    f"| {name} | {batch} | {context} | {reference:.0f} | {ours:.0f} | {compiled:.0f} "
                    f"| {reference / compiled:.1f}x |"
                )
                print(rows[-1], flush=True)
    if args.quick:
        return
    body = "\n".join(
        [
            "## Decode attention: SDPA, two batched matmuls, the compiled kernel",
            "",
            f"Command: `{reproduce_command('benchmarks.bench_attention')}`. Machine: {machine_description()}.",
            "",
            f"One layer's attention for decode rows, {NUM_HEADS} query heads over {NUM_KV_HEADS} KV heads of "
            f"{HEAD_DIM}, from a paged cache of {BLOCK_SIZE}-token blocks; microseconds per call, median of "
            f"{repeats} (the same layer again and again: caches warmer than in a step, where each layer's K "
            "and V come from memory once).",
            "",
            *rows,
        ]
    )
    write_section(args.output, SECTION, body)
    print(f"wrote section {SECTION} of {args.output}")


if __name__ == "__main__":
    main()
