"""Adapter swapping under load: 1,000 adapters with Zipf(1.0) popularity through a device pool
with room for 32 of them, Poisson arrivals, against the same workload over 8 adapters that all
stay resident.

The pool (KV blocks and adapter weights share its pages) is sized to the KV of a full
batch plus the pages of N rank-16 adapters, and there are N slots: memory, not a slot
count, is what makes adapters leave.

    python -m benchmarks.bench_swapping            # writes its section of docs/benchmarks/adapter-swapping.md
    python -m benchmarks.bench_swapping --quick    # smoke run, nothing written

Adapters: ranks 8 and 16 alternating on q_proj and v_proj, random weights written as PEFT
safetensors files (loads read them from disk: disk -> host cache -> device slot). Greedy,
EOS ignored, the engine driven in-process with each request added at its arrival time.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from collections import deque
from dataclasses import dataclass
from pathlib import Path

from benchmarks.random_adapters import write_random_adapters
from benchmarks.report import (
    add_report_flags,
    machine_description,
    median_spread,
    page,
    reproduce_command,
    write_section,
)
from benchmarks.workloads import arrival_times, assign_adapters, chat_workload
from loraserve import SamplingParams
from loraserve.config import CacheConfig, EngineConfig, LoraConfig, ModelConfig, SchedulerConfig
from loraserve.engine import LLMEngine
from loraserve.engine.chat import chat_prompt_ids
from loraserve.models import LoadedModel, load_model
from loraserve.models.dtypes import dtype_name

SECTION = "adapter-swapping"


@dataclass(frozen=True)
class Arrival:
    at: float  # seconds after the start
    prompt: list[int]
    adapter: str


@dataclass(frozen=True)
class RunResult:
    tokens_per_second: float
    ttft_p50: float
    ttft_p99: float
    loads: int
    evictions: int
    failed: int


def zipf_arrivals(prompts: list[list[int]], num_adapters: int, rate: float, seed: int = 0) -> list[Arrival]:
    """Adapters by Zipf(1.0) popularity, Poisson arrivals at `rate`/s."""
    adapters = assign_adapters("zipf", len(prompts), num_adapters, seed)
    times = arrival_times(len(prompts), rate, seed=seed)
    return [Arrival(at, prompt, f"adapter-{k}") for at, prompt, k in zip(times, prompts, adapters, strict=True)]


MAX_NUM_SEQS = 64


def pool_pages(loaded: LoadedModel, rank16_path: Path, room_for: int, longest: int) -> int:
    """Pages for the KV of MAX_NUM_SEQS sequences of `longest` tokens plus `room_for` rank-16 adapters."""
    probe = LLMEngine(EngineConfig(cache=CacheConfig(num_pages=1), lora=LoraConfig(max_loras=1)), loaded=loaded)
    adapter_pages = probe.model_runner.adapter_slots.pages_needed(probe.read_adapter(rank16_path))
    probe.close()
    return MAX_NUM_SEQS * -(-longest // CacheConfig.block_size) + room_for * adapter_pages


def run(
    loaded: LoadedModel, paths: list[Path], arrivals: list[Arrival], room_for: int, max_tokens: int, pages: int
) -> RunResult:
    config = EngineConfig(
        model=ModelConfig(dtype=dtype_name(loaded.dtype)),
        cache=CacheConfig(num_pages=pages),
        lora=LoraConfig(max_loras=room_for, max_lora_rank=16),
        scheduler=SchedulerConfig(max_num_seqs=MAX_NUM_SEQS),
    )
    engine = LLMEngine(config, loaded=loaded)
    for path in paths:
        engine.register_adapter(path.name, path, sha256=None)
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    pending = deque(arrivals)
    finished = []
    start = time.monotonic()
    while pending or engine.has_unfinished_requests():
        now = time.monotonic() - start
        while pending and pending[0].at <= now:
            arrival = pending.popleft()
            engine.add_request(f"r{len(pending)}", arrival.prompt, params, start + arrival.at, arrival.adapter)
        if not engine.has_unfinished_requests():
            time.sleep(max(0.0, pending[0].at - now))
            continue
        finished += [output for output in engine.step() if output.finished]
    elapsed = time.monotonic() - start
    engine.close()
    ttfts = sorted(o.timings.ttft for o in finished if o.timings.ttft is not None)
    stats = engine.stats()
    return RunResult(
        tokens_per_second=sum(len(o.outputs[0].token_ids) for o in finished) / elapsed,
        ttft_p50=statistics.median(ttfts),
        ttft_p99=ttfts[min(len(ttfts) - 1, int(0.99 * len(ttfts)))],
        loads=stats.adapter_loads,
        evictions=stats.adapter_evictions,
        failed=sum(o.outputs[0].finish_reason == "error" for o in finished),
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--adapters", type=int, default=1000)
    parser.add_argument("--pool-adapters", type=int, default=32, help="rank-16 adapters the pool has room for")
    parser.add_argument("--requests", type=int, default=200)
    parser.add_argument("--rate", type=float, default=4.0, help="Poisson arrivals per second")
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=2)
    add_report_flags(parser)
    args = parser.parse_args()
    args.output = args.output or page("adapter-swapping")
    if args.quick:
        args.adapters, args.pool_adapters, args.requests, args.rate, args.max_tokens, args.repeats = (
            12,
            4,
            12,
            50.0,
            4,
            1,
        )
    loaded = load_model(ModelConfig())
    workload = chat_workload(args.requests, args.max_tokens, args.max_tokens)
    prompts = [chat_prompt_ids(loaded.tokenizer, conv) for conv in workload.conversations]
    resident = min(8, args.pool_adapters)
    cases = {
        f"{args.adapters} adapters, Zipf(1.0), pool with room for {args.pool_adapters}": (
            args.adapters,
            args.pool_adapters,
        ),
        f"{resident} adapters, all resident": (resident, resident),
    }
    longest = max(len(p) for p in prompts) + args.max_tokens
    results: dict[str, list[RunResult]] = {name: [] for name in cases}
    with tempfile.TemporaryDirectory() as tmp:
        paths = write_random_adapters(loaded.model.spec, args.adapters, Path(tmp), ("q_proj", "v_proj"))
        pages = {room: pool_pages(loaded, paths[1], room, longest) for _, room in cases.values()}
        for _ in range(args.repeats):
            for name, (num_adapters, room) in cases.items():
                arrivals = zipf_arrivals(prompts, num_adapters, args.rate)
                results[name].append(run(loaded, paths[:num_adapters], arrivals, room, args.max_tokens, pages[room]))
                print(name, results[name][-1], flush=True)
    if args.quick:
        return
    baseline = statistics.median(r.tokens_per_second for r in results[f"{resident} adapters, all resident"])
    rows = []
    for name, runs in results.items():
        tps = [r.tokens_per_second for r in runs]
        median = statistics.median(tps)
        last = runs[-1]
        rows.append(
            f"| {name} | {median_spread(tps)} | {median / baseline:.2f} | "
            f"{statistics.median(r.ttft_p50 for r in runs):.2f} | {statistics.median(r.ttft_p99 for r in runs):.2f} | "
            f"{last.loads} | {last.evictions} | {sum(r.failed for r in runs)} |"
        )
    command = reproduce_command("benchmarks.bench_swapping")
    body = "\n".join(
        [
            "## Adapter swapping under load",
            "",
            f"Command: `{command}`. Machine: {machine_description()}. Dtype: {loaded.dtype}.",
            "",
            f"{args.requests} chat requests of ~60 prompt tokens, {args.max_tokens} new tokens each (greedy, EOS "
            f"ignored), Poisson arrivals at {args.rate}/s; adapters of ranks 8 and 16 on q_proj and v_proj read "
            f"from disk on first use. The memory pool holds the KV of {MAX_NUM_SEQS} full sequences plus N rank-16 "
            f"adapters ({pages[args.pool_adapters]} pages for N = {args.pool_adapters}, {pages[resident]} for "
            f"N = {resident}), with N slots. Output tokens/s: median of {args.repeats} runs (min-max); TTFT in "
            "seconds; loads and evictions of the last run.",
            "",
            "| workload | tok/s | vs all resident | TTFT p50 | TTFT p99 | loads | evictions | failed |",
            "|---|---:|---:|---:|---:|---:|---:|---:|",
            *rows,
        ]
    )
    write_section(args.output, SECTION, body)
    print(body)


if __name__ == "__main__":
    main()
