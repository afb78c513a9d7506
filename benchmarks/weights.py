"""Decode tok/s per way of holding the weights (--weights), against the memory floor.

A decode step reads every matmul weight once: its floor is the weights' bytes over the memory
bandwidth, measured here as the best of a few streaming reads of 1 GiB just before each of a mode's
one-chat runs. Per mode: one chat (base, and with an adapter), and 32 chats over 8 adapters (rank
16, all projections), 64 tokens each, greedy, EOS ignored, prefix cache off, best of --repeats; the
modes are loaded at once and take turns, so that the VM's drift moves them alike. Then
llama.cpp's llama-server on the same token ids, per weights type of the same bytes (f32, f16, bf16, q8_0).

    loraserve bench weights            # writes its section of docs/benchmarks/weights.md
    loraserve bench weights --quick    # a smoke run, nothing written
    loraserve bench weights --model DIR --modes bfloat16:bfloat16 --peer-types bf16   # another base model
                                       # (random weights at a real family's shapes: benchmarks/random_model.py),
                                       # its section of docs/benchmarks/families.md
"""

from __future__ import annotations

import argparse
import functools
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from benchmarks.engines import engine_over
from benchmarks.offline import run_system
from benchmarks.peers.envs import LLAMA_CPP
from benchmarks.peers.job import JobWorkload
from benchmarks.random_adapters import write_random_adapters
from benchmarks.report import (
    add_report_flags,
    bench_command,
    cpu_class_suffix,
    cpu_class_title,
    machine_description,
    page,
    weights_modes,
    write_section,
)
from loraserve import LLM, SamplingParams
from loraserve.config import ModelConfig
from loraserve.models import LoadedModel
from loraserve.models.cpu.linear import NarrowMatmul
from loraserve.models.cpu.platform import OneDnnWeight
from loraserve.models.linear import Linear
from loraserve.models.loader import load_model

CHATS = 32
# llama.cpp's weights types, and ours of the same bytes a weight.
LLAMA_CPP_TYPES = {"f32": "float32", "f16": "bfloat16", "bf16": "bfloat16", "q8_0": "int8"}
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
            held = module.held
            total += held.nbytes if isinstance(held, NarrowMatmul | OneDnnWeight) else module.weight.nbytes
    return total


def workloads(llm: LLM, names: list[str], tokens: int) -> list[JobWorkload]:
    """One chat (base), one chat with an adapter, and 32 chats over the adapters, as token ids."""
    one = [llm.tokenizer.encode(PROMPT)]
    many = [llm.tokenizer.encode(f"{PROMPT} ({i})") for i in range(CHATS)]
    return [
        JobWorkload("one", one, [tokens], [None]),
        JobWorkload("one-adapter", one, [tokens], names[:1]),
        JobWorkload("mixed", many, [tokens] * CHATS, [names[i % len(names)] for i in range(CHATS)]),
    ]


@dataclass
class ModeRun:
    """One weights mode, loaded for the whole run: the modes take turns at each workload."""

    mode: str
    llm: LLM
    jobs: list[JobWorkload]
    megabytes: float  # of the matmul weights a decode step reads
    bandwidth: float = 0.0  # GB/s: the best streaming read just before its one-chat runs


def paired_best_seconds(
    runs: list[ModeRun], job: int, repeats: int, max_tokens: int | None = None, probe: bool = False
) -> dict[str, float]:
    """Each mode's best of `repeats` runs of its workload `job` (each prompt `max_tokens` tokens, default its
    own), after a warm-up run each (kernels built, adapters loaded). The modes take turns, the order reversed
    every other round, so that this VM's drift moves them alike: run one after another, the same mode's 32
    chats varied by 15% between runs, more than two modes differ. `probe`: a streaming read just before
    each run, each mode keeping its best."""
    calls = {}
    for run in runs:
        workload = run.jobs[job]
        params = SamplingParams(temperature=0.0, max_tokens=max_tokens or workload.output_lens[0], ignore_eos=True)
        generate = functools.partial(
            run.llm.generate, workload.prompts, params, adapters=workload.adapters, use_tqdm=False
        )  # fmt: skip
        generate()
        calls[run.mode] = generate
    best = dict.fromkeys(calls, float("inf"))
    for repeat in range(repeats):
        for run in runs if repeat % 2 == 0 else runs[::-1]:
            if probe:
                run.bandwidth = max(run.bandwidth, streaming_read_gbs())
            start = time.perf_counter()
            calls[run.mode]()
            best[run.mode] = min(best[run.mode], time.perf_counter() - start)
    return best


Rates = tuple[float, float, float]  # one chat, one chat with an adapter, 32 chats over the adapters


def llama_cpp_rates(
    model_dir: Path, adapter_dirs: list[Path], jobs: list[JobWorkload], repeats: int, work: Path, outtypes: list[str]
) -> tuple[list[str], dict[str, Rates]]:
    """llama.cpp's llama-server on the same workloads, per weights type of the same bytes, best of `repeats`:
    its table rows, and its rates by type."""
    rows, rates = [], {}
    for outtype in outtypes:
        job = {
            "model": str(model_dir), "dtype": "bfloat16", "adapters": {p.name: str(p) for p in adapter_dirs},
            "workloads": [asdict(w) for w in jobs], "repeats": repeats, "max_num_seqs": CHATS,
            "max_lora_rank": 16, "options": {"outtype": outtype},
        }  # fmt: skip
        outcome = run_system(f"llama.cpp-{outtype}", LLAMA_CPP, job, None, work)
        if outcome.error:
            print(f"llama.cpp {outtype}: {outcome.error}", flush=True)
            rows.append(f"| llama.cpp {outtype} | {outcome.error} | | |")
            continue
        best = [max(outcome.rates[w.name]) for w in jobs]
        one, adapter, mixed = rates[outtype] = (best[0], best[1], best[2])
        row = f"| llama.cpp {outtype} ({LLAMA_CPP_TYPES[outtype]}) | {one:.1f} | {adapter:.1f} | {mixed:.0f} |"
        print(row, flush=True)
        rows.append(row)
    return rows, rates


def ratio_rows(ours: dict[str, Rates], theirs: dict[str, Rates]) -> list[str]:
    """Our rates over llama.cpp's, for each of our modes and each llama.cpp type of the same bytes a weight
    (whatever our compute dtype: a mode run by name is compared, as with bfloat16 compute on a CPU where
    `--dtype auto` picks float32)."""
    rows = []
    for mode, rates in ours.items():
        weights = mode.split(":")[1]
        for outtype, their_weights in LLAMA_CPP_TYPES.items():
            if weights.removesuffix("-dot") == their_weights and outtype in theirs:
                ratios = " | ".join(f"{a / b:.2f}x" for a, b in zip(rates, theirs[outtype], strict=True))
                rows.append(f"| {mode} / {outtype} | {ratios} |")
    return rows


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", type=Path, default=None, help="an HF directory (default: the embedded model)")
    parser.add_argument("--modes", nargs="+", default=None, help="dtype:weights pairs (default: all this CPU runs)")
    parser.add_argument(
        "--peer-types", nargs="+", choices=list(LLAMA_CPP_TYPES), default=list(LLAMA_CPP_TYPES),
        help="llama.cpp's weights types to run (default: all)",
    )  # fmt: skip
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument(
        "--peer", choices=["llama.cpp", "none"], default=None,
        help="run llama.cpp's llama-server beside us (default: yes, but not with --quick; built on first use)",
    )  # fmt: skip
    add_report_flags(parser)
    args = parser.parse_args(argv)
    args.output = args.output or page("weights" if args.model is None else "families")
    modes = args.modes or weights_modes()
    tokens, repeats = (8, 1) if args.quick else (args.tokens, args.repeats)
    peer = (args.peer or ("none" if args.quick else "llama.cpp")) == "llama.cpp"
    rows, peer_rows, ours, theirs = [], [], {}, {}
    with tempfile.TemporaryDirectory() as scratch:
        adapter_dirs: list[Path] = []
        runs: list[ModeRun] = []
        for mode in modes:
            dtype, weights = mode.split(":")
            loaded = load_model(
                ModelConfig(model=None if args.model is None else str(args.model), dtype=dtype, weights=weights)
            )
            if not adapter_dirs:
                adapter_dirs = write_random_adapters(loaded.model.spec, 8, Path(scratch), ranks=(16,))
            model_dir, model_type = loaded.model_dir, loaded.model.spec.model_type
            llm = LLM.from_engine(engine_over(loaded, max_num_seqs=CHATS, max_loras=8, prefix_caching=False))
            for path in adapter_dirs:
                llm.add_adapter(path.name, path)
            jobs = workloads(llm, [path.name for path in adapter_dirs], tokens)
            runs.append(ModeRun(mode, llm, jobs, weight_bytes(loaded) / 1e6))
            del loaded
        whole = paired_best_seconds(runs, 0, repeats, probe=True)
        first = paired_best_seconds(runs, 0, repeats, max_tokens=1)  # the prompt and first token alone
        one_adapter, mixed = (paired_best_seconds(runs, job, repeats) for job in (1, 2))
        for run in runs:
            dtype, weights = run.mode.split(":")
            floor = run.bandwidth * 1e3 / run.megabytes
            # one chat over its whole time; its decode: the tokens after the first over their own time,
            # which the memory floor bounds (a decode step reads the weights once; a prompt step is
            # bound by its products)
            one, decode = tokens / whole[run.mode], (tokens - 1) / (whole[run.mode] - first[run.mode])
            adapted, many = (sum(run.jobs[job].output_lens) / t[run.mode] for job, t in ((1, one_adapter), (2, mixed)))
            ours[run.mode] = (one, adapted, many)
            row = f"| {dtype} | {weights} | {run.megabytes:.0f} | {run.bandwidth:.1f} | {floor:.0f} "
            row += f"| {one:.1f} ({one / floor:.2f}) | {decode:.1f} ({decode / floor:.2f}) "
            row += f"| {adapted:.1f} | {many:.0f} |"
            print(row, flush=True)
            rows.append(row)
            run.llm.engine.close()  # its adapter loader thread would keep the engine, and the model, alive
        del runs, llm  # the models go before llama.cpp runs
        if peer:
            peer_rows, theirs = llama_cpp_rates(model_dir, adapter_dirs, jobs, repeats, Path(scratch), args.peer_types)
    title = "Weights: float32, bfloat16 and int8" if args.model is None else f"{model_dir.name} ({model_type})"
    body = [
        f"## {title} on the CPU" + cpu_class_title(),
        "",
        f"Command: `{bench_command('weights', argv)}`. Machine: {machine_description()}.",
        "",
        "All modes loaded at once, taking turns at each workload (the order reversed every other round). "
        "Streaming read: the best taken just before each of a mode's one-chat runs (read GB/s; best of a sum, "
        "a max and a matrix-vector product over 1 GiB). Floor: that bandwidth over the bytes of the matmul "
        "weights (one decode step reads each once). "
        "Tok/s: a chat's tokens over its whole time, prompt included; decode: the tokens after the first over "
        "their own time (the run's best less the best of its prompt and first token alone). "
        f"{tokens} tokens a chat, greedy, EOS ignored, prefix cache off, best of {repeats}; "
        f"{len(adapter_dirs)} random adapters of rank 16 on all projections.",
        "",
        "| compute | weights | weight MB | read GB/s | floor tok/s | 1 chat tok/s (of floor) "
        "| its decode tok/s (of floor) | 1 chat, adapter | 32 chats, 8 adapters |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|",
        *rows,
    ]
    if peer_rows:
        body += [
            "",
            "llama.cpp in the same run: `llama-server` built by the peers' harness (benchmarks/peers), the same "
            "model and adapters converted by its own converters (adapters bf16 over q8_0), a slot per chat, "
            "the same token ids over HTTP, best of the same repeats.",
            "",
            "| llama.cpp weights (as ours) | 1 chat tok/s | 1 chat, adapter | 32 chats, 8 adapters |",
            "|---|---:|---:|---:|",
            *peer_rows,
            "",
            "loraserve over llama.cpp, same run (compute:weights / llama.cpp type of the same bytes a weight):",
            "",
            "| pair | 1 chat | 1 chat, adapter | 32 chats, 8 adapters |",
            "|---|---:|---:|---:|",
            *ratio_rows(ours, theirs),
        ]
    text = "\n".join(body)
    if not args.quick:
        section = "bench-weights" if args.model is None else f"bench-{model_dir.name}"
        write_section(args.output, section + cpu_class_suffix(), text)
    print(text)


if __name__ == "__main__":
    main()
