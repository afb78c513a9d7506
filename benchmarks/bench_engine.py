"""Output tokens/s of `LLM.generate` against transformers `generate`, same prompts and lengths.

transformers runs static batches (every row runs until the longest is done; only the
requested tokens count); loraserve runs the same prompts with continuous batching at
the same maximum batch size. EOS is ignored so both produce exactly the requested
tokens. Runs alternate between the two systems and repeat; medians are reported.

    python -m benchmarks.bench_engine            # full table into docs/benchmarks/engine.md
    python -m benchmarks.bench_engine --quick    # a smoke run, nothing written

--dtypes picks the table's dtypes; --dtype (default auto) the one of the step profile.
"""

from __future__ import annotations

import argparse
import dataclasses
import platform
import statistics
import time
from collections import defaultdict

import torch

from benchmarks.engines import engine_over
from benchmarks.kernel_time import kernel_ms
from benchmarks.random_model import transformers_model
from benchmarks.report import (
    add_model_flags,
    add_report_flags,
    machine_description,
    median_spread,
    model_config_of,
    page,
    reproduce_command,
    write_section,
)
from benchmarks.workloads import Workload, chat_workload, left_padded
from loraserve import LLM, SamplingParams
from loraserve.config import ModelConfig
from loraserve.engine.chat import chat_prompt_ids
from loraserve.models import LoadedModel, load_model
from loraserve.models.dtypes import dtype_name

SECTION = "engine-vs-transformers"


@dataclasses.dataclass
class Result:
    dtype: str
    batch_size: int
    system: str
    tokens_per_s: list[float]


def run_loraserve(loaded: LoadedModel, prompt_ids: list[list[int]], lens: list[int], batch_size: int) -> float:
    engine = engine_over(loaded, batch_size)
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in lens]
    try:
        start = time.perf_counter()
        outputs = LLM.from_engine(engine).generate(prompt_ids, params, use_tqdm=False)
        elapsed = time.perf_counter() - start
    finally:
        engine.close()  # its adapter loader thread would otherwise keep the 1 GiB pool alive
    assert [len(o.outputs[0].token_ids) for o in outputs] == lens
    return sum(lens) / elapsed


def run_transformers(model, tokenizer, prompt_ids: list[list[int]], lens: list[int], batch_size: int) -> float:
    start = time.perf_counter()
    for first in range(0, len(prompt_ids), batch_size):
        rows, row_lens = prompt_ids[first : first + batch_size], lens[first : first + batch_size]
        pad = tokenizer.pad_token_id
        input_ids, attention_mask = left_padded(rows, pad)
        with torch.inference_mode():
            model.generate(
                input_ids=input_ids.to(model.device),
                attention_mask=attention_mask.to(model.device),
                max_new_tokens=max(row_lens),
                min_new_tokens=max(row_lens),
                do_sample=False,
                pad_token_id=pad,
            )
    return sum(lens) / (time.perf_counter() - start)


def bench_dtype(model_config: ModelConfig, batch_sizes: list[int], workload: Workload, repeats: int) -> list[Result]:
    loaded = load_model(model_config)
    dtype = model_config.dtype
    hf_model = transformers_model(loaded.model_dir, loaded.dtype, loaded.device, model_config.random_weights)
    all_ids = [chat_prompt_ids(loaded.tokenizer, conv) for conv in workload.conversations]
    samples: dict[tuple[int, str], list[float]] = defaultdict(list)
    for batch_size in batch_sizes:
        count = max(2 * batch_size, 4)  # two static batches (batch 1: four prompts one after another)
        ids, lens = all_ids[:count], workload.output_lens[:count]
        run_loraserve(loaded, ids[:2], [4, 4], batch_size)  # warm-up
        for _ in range(repeats):
            samples[(batch_size, "loraserve")].append(run_loraserve(loaded, ids, lens, batch_size))
            samples[(batch_size, "transformers")].append(
                run_transformers(hf_model, loaded.tokenizer, ids, lens, batch_size)
            )
        print(
            f"{dtype} batch {batch_size}: loraserve {statistics.median(samples[(batch_size, 'loraserve')]):.0f} tok/s, "
            f"transformers {statistics.median(samples[(batch_size, 'transformers')]):.0f} tok/s",
            flush=True,
        )
    return [Result(dtype, b, system, values) for (b, system), values in samples.items()]


def step_profile(model_config: ModelConfig, batch_size: int, workload: Workload) -> str:
    """Where a decode step's time goes: torch profiler self time grouped by kind of op."""
    loaded = load_model(model_config)
    dtype = dtype_name(loaded.dtype)
    engine = engine_over(loaded, batch_size)
    params = SamplingParams(temperature=0.0, max_tokens=128, ignore_eos=True)
    for i, conv in enumerate(workload.conversations[:batch_size]):
        engine.add_request(f"p{i}", chat_prompt_ids(loaded.tokenizer, conv), params)
    while (
        any(s.num_computed_tokens < s.num_prompt_tokens for s in engine.scheduler.running) or engine.scheduler.waiting
    ):
        engine.step()
    for _ in range(5):
        engine.step()
    num_steps = 20
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        start = time.perf_counter()
        for _ in range(num_steps):
            engine.step()
        wall = (time.perf_counter() - start) / num_steps * 1e3
    groups: dict[str, float] = defaultdict(float)
    for event in prof.key_averages():
        groups[_op_group(event.key)] += event.self_cpu_time_total / 1e3 / num_steps
    # The compiled CPU kernels are not torch ops: timed on their own, over as many more steps.
    groups.update({name: ms for name, ms in kernel_ms(engine, num_steps).items() if ms > 0})
    total = sum(groups.values())
    lines = [
        f"Decode step, batch {batch_size}, {dtype}, context ~60-190 tokens: {wall:.1f} ms per step with the "
        f"profiler on ({batch_size / wall * 1e3:.0f} tokens/s); torch ops and compiled kernels {total:.1f} ms, "
        "the rest is Python.",
        "",
        "| where | ms per step | share |",
        "|---|---:|---:|",
    ]
    for name, ms in sorted(groups.items(), key=lambda kv: -kv[1]):
        lines.append(f"| {name} | {ms:.2f} | {ms / wall:.0%} |")
    lines.append(f"| Python: scheduler, input preparation, sampling bookkeeping | {wall - total:.2f} | "
                 f"{(wall - total) / wall:.0%} |")  # fmt: skip
    return "\n".join(lines)


def _op_group(op: str) -> str:
    if "linear" in op or op in ("aten::mm", "aten::addmm"):
        return "matmuls (q/k/v, o, gate/up, down, LM head)"
    if "scaled_dot_product" in op:
        return "attention (SDPA, prompt chunks)"
    if op in ("aten::index_select", "aten::index_copy_", "aten::index_put_"):
        return "paged KV cache: gather blocks, write new K/V (torch paths)"
    if op in ("aten::max", "aten::argmax", "aten::softmax", "aten::topk", "aten::sort"):
        return "sampling"
    return "other torch ops (embedding, copies, elementwise on the torch paths)"


def render(results: list[Result], args: argparse.Namespace, profile: str | None, command: str) -> str:
    repeats, device = args.repeats, args.device
    by_key = {(r.dtype, r.batch_size, r.system): r.tokens_per_s for r in results}
    lines = [
        f"## Engine vs transformers (no LoRA){', on a GPU' if device == 'cuda' else ''}",
        "",
        f"Command: `{command}`. Machine: {machine_description(device)}.",
        "",
        "Each batch size runs `max(2 x batch, 4)` chat prompts of ~60 tokens with output lengths drawn from "
        f"[{args.min_output}, {args.max_output}] (seeded), greedy, EOS ignored. transformers runs static batches of "
        "that size; loraserve runs "
        f"continuous batching with `max_num_seqs` = batch. Useful output tokens per second, median of {repeats} "
        "runs (min-max in brackets), the two systems alternating.",
        "",
        "| dtype | batch | loraserve tok/s | transformers tok/s | ratio |",
        "|---|---:|---:|---:|---:|",
    ]
    for dtype, batch_size in sorted({(r.dtype, r.batch_size) for r in results}):
        ours, theirs = by_key[(dtype, batch_size, "loraserve")], by_key[(dtype, batch_size, "transformers")]
        lines.append(
            f"| {dtype} | {batch_size} | {median_spread(ours)} | {median_spread(theirs)} | "
            f"{statistics.median(ours) / statistics.median(theirs):.2f}x |"
        )
    if profile is not None:
        lines += ["", "### Where the step time goes", "", profile, ""]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8, 32, 64])
    parser.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--min-output", type=int, default=32)
    parser.add_argument("--max-output", type=int, default=128)
    add_model_flags(parser)
    add_report_flags(parser)
    args = parser.parse_args()
    args.output = args.output or page("gpu" if args.device == "cuda" else "engine")
    if args.quick:
        args.batch_sizes, args.dtypes, args.repeats, args.min_output, args.max_output = [2], ["float32"], 1, 4, 8
    workload = chat_workload(max(2 * max(args.batch_sizes), 4), args.min_output, args.max_output)
    configs = {dtype: model_config_of(args, dtype) for dtype in args.dtypes}
    results = [r for config in configs.values() for r in bench_dtype(config, args.batch_sizes, workload, args.repeats)]
    if args.quick:
        return
    profile = None
    if args.device == "cpu":  # the profile counts CPU time: on a GPU the ops run asynchronously
        profile = step_profile(model_config_of(args), 32, workload)
        print(profile)
    command = reproduce_command("benchmarks.bench_engine")
    section = SECTION if args.device == "cpu" else f"{SECTION}-{args.device}"
    write_section(args.output, section, render(results, args, profile, command))
    print(f"wrote {args.output} ({platform.node()})")


if __name__ == "__main__":
    main()
