"""Where a multi-LoRA decode step's time goes: the same batch decoding on the base model, with one
adapter for every row, and with N distinct adapters, in alternating rounds (this machine's
speed drifts by tens of percent over a minute; alternating keeps the comparison fair); then
the time of the compiled CPU kernels and the torch profiler's top ops in the N-adapter step.

    python -m benchmarks.profile_lora_step                 # a section of docs/benchmarks/multi-lora.md
    python -m benchmarks.profile_lora_step --quick         # a smoke run; nothing written

Adapters: ranks 8 and 16 alternating, all seven projections (as in the peer comparison).
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import torch

from benchmarks.engines import engine_over
from benchmarks.kernel_time import kernel_ms
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
from benchmarks.workloads import prompt_token_ids
from loraserve import SamplingParams
from loraserve.engine import LLMEngine
from loraserve.models import LoadedModel, load_model
from loraserve.models.dtypes import dtype_name

SECTION = "lora-step-profile"


def decoding_engine(
    loaded: LoadedModel, batch: int, adapters: list[Path], num_adapters: int, pool_bytes: int, prefix_caching: bool
) -> LLMEngine:
    """An engine with `batch` sequences past their prefill, request i on adapter i % num_adapters."""
    engine = engine_over(loaded, batch, max(1, num_adapters), prefix_caching, pool_bytes)
    for path in adapters[:num_adapters]:
        engine.add_adapter(path.name, path)
    prompts = prompt_token_ids(loaded.tokenizer, "chat", batch)
    # Every adapter on the device first: else the rows whose adapter came first decode while the rest
    # wait, and the LoRA step attends over longer contexts than the base step (2.9x its attention time
    # on an H200 at Llama-8B's shapes).
    for i in range(num_adapters):
        engine.add_request(f"load{i}", prompts[0], SamplingParams(max_tokens=1), adapter=f"adapter-{i}")
    while engine.has_unfinished_requests():
        engine.step()
    params = SamplingParams(temperature=0.0, max_tokens=10_000, ignore_eos=True)
    for i, prompt in enumerate(prompts):
        engine.add_request(f"r{i}", prompt, params, adapter=f"adapter-{i % num_adapters}" if num_adapters else None)
    while engine.scheduler.waiting or any(
        s.num_computed_tokens < s.num_prompt_tokens for s in engine.scheduler.running
    ):
        engine.step()
    for _ in range(3):  # warm: stacks gathered, caches hot
        engine.step()
    return engine


def alternating_step_ms(engines: dict[int, LLMEngine], steps: int, rounds: int = 5) -> dict[int, float]:
    """Median ms per step of each engine, `steps` in all, run a few steps each in turn."""
    samples: dict[int, list[float]] = {count: [] for count in engines}
    for _ in range(rounds):
        for count, engine in engines.items():
            for _ in range(max(1, steps // rounds)):
                start = time.perf_counter()
                engine.step()
                samples[count].append((time.perf_counter() - start) * 1e3)
    return {count: statistics.median(values) for count, values in samples.items()}


def top_ops(engine: LLMEngine, steps: int, count: int) -> list[tuple[str, float, int]]:
    """(op, ms per step, calls per step) by self CPU time; on CUDA, the GPU kernels (those a CUDA
    graph replays included) by device time, and a first row summing them all."""
    on_cuda = engine.config.model.device.startswith("cuda")
    activities = [torch.profiler.ProfilerActivity.CPU]
    if on_cuda:
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    with torch.profiler.profile(activities=activities) as profile:
        for _ in range(steps):
            engine.step()
        if on_cuda:
            torch.cuda.synchronize()
    if not on_cuda:
        events = sorted(profile.key_averages(), key=lambda e: -e.self_cpu_time_total)[:count]
        return [(e.key, e.self_cpu_time_total / 1e3 / steps, e.count // steps) for e in events]
    kernels = [e for e in profile.key_averages() if e.device_type == torch.autograd.DeviceType.CUDA]
    kernels.sort(key=lambda e: -e.self_device_time_total)
    rows = [(e.key[:90], e.self_device_time_total / 1e3 / steps, e.count // steps) for e in kernels]
    total = ("all GPU kernels", sum(ms for _, ms, _ in rows), sum(calls for _, _, calls in rows))
    return [total, *rows[:count]]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--adapters", type=int, default=32)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--pool-gib", type=float, default=1.0, help="memory pool: KV blocks and adapters")
    parser.add_argument(
        "--prefix-caching", action=argparse.BooleanOptionalAction, default=True,
        help="on (default): the base model's rows share their prompts' common blocks; an adapter's rows share theirs",
    )  # fmt: skip
    add_model_flags(parser)
    add_report_flags(parser)
    args = parser.parse_args()
    args.output = args.output or page("gpu" if args.device == "cuda" else "multi-lora")
    if args.quick:
        args.batch, args.adapters, args.steps = 4, 2, 2
    loaded = load_model(model_config_of(args))
    on_cuda = args.device.startswith("cuda")
    with tempfile.TemporaryDirectory() as tmp:
        paths = write_random_adapters(loaded.model.spec, args.adapters, Path(tmp))
        pool_bytes = int(args.pool_gib * 2**30)
        engines = {
            count: decoding_engine(loaded, args.batch, paths, count, pool_bytes, args.prefix_caching)
            for count in (0, 1, args.adapters)
        }
        timings = alternating_step_ms(engines, args.steps)
        for count, ms in timings.items():
            print(f"{count} adapters: {ms:.1f} ms per step ({args.batch / ms * 1e3:.0f} tok/s)", flush=True)
        kernels = {} if on_cuda else kernel_ms(engines[args.adapters], max(2, args.steps // 4))
        ops = top_ops(engines[args.adapters], max(2, args.steps // 4), 12)
        base_ops = top_ops(engines[0], max(2, args.steps // 4), 12)
        for engine in engines.values():
            engine.close()
    base = timings[0]
    lines = [
        "## Where a multi-LoRA decode step goes",
        "",
        f"Command: `{reproduce_command('benchmarks.profile_lora_step')}`. Machine: {machine_description(args.device)}.",
        "",
        f"Batch {args.batch}, every sequence past its ~60-token prompt, {dtype_name(loaded.dtype)}, prefix "
        f"caching {'on' if args.prefix_caching else 'off'}; median of "
        f"{args.steps} steps per row, the three batches decoding in alternating rounds.",
        "",
        "| adapters in the batch | ms per step | tokens/s | vs base | LoRA's share of the step |",
        "|---|---:|---:|---:|---:|",
    ]
    for count, ms in timings.items():
        label = "none (base model)" if count == 0 else f"{count} ({'one for every row' if count == 1 else 'distinct'})"
        lines.append(f"| {label} | {ms:.1f} | {args.batch / ms * 1e3:.0f} | {base / ms:.2f} | {(ms - base) / ms:.0%} |")
    if not on_cuda:
        lines += [
            "",
            f"Inside the compiled CPU kernels in the {args.adapters}-adapter step (ms per step): "
            + ", ".join(f"{name} {ms:.1f}" for name, ms in kernels.items() if ms > 0)  # the ones it called
            + ".",
        ]
    what = "GPU kernels (device time; CUDA graph replays included)" if on_cuda else "torch ops (self CPU time)"
    base_ms = {name: ms for name, ms, _ in base_ops}
    lines += [
        "",
        f"Top {what} of the {args.adapters}-adapter step, beside the base step's, by the torch profiler"
        + ("" if on_cuda else "; the kernels above are not torch ops (`_linear_pointwise`: oneDNN's float32 matmuls)")
        + ":",
        "",
        f"| {'kernel' if on_cuda else 'op'} | ms per step, {args.adapters} adapters | ms per step, base "
        "| calls per step |",
        "|---|---:|---:|---:|",
        *(f"| `{name}` | {ms:.2f} | {base_ms.get(name, 0.0):.2f} | {calls} |" for name, ms, calls in ops),
    ]
    body = "\n".join(lines)
    print(body)
    if not args.quick:
        write_section(args.output, SECTION + ("-gpu" if on_cuda else ""), body)


if __name__ == "__main__":
    main()
