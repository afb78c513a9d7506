"""Online comparison: loraserve's server against vLLM's OpenAI server, same base weights, same
adapters, same requests, sent over HTTP at a given rate (Poisson, or Gamma with --cv), streamed.

    loraserve bench online               # the rate sweep: a section of docs/benchmarks/online.md + two plots
    loraserve bench online --quick       # a smoke run against loraserve alone; nothing written
    loraserve bench online --url http://127.0.0.1:8000 --adapters 4   # a server already running

For every rate: throughput, TTFT, TPOT (mean time per output token after the first) and ITL
(gaps between streamed tokens) at p50/p90/p99, goodput (requests/s meeting the SLO) and
failures; then the highest rate at which at least --slo-attainment of the requests met the SLO.
Each adapter is loaded on its first request, as in production.
"""

from __future__ import annotations

import argparse
import math
import tempfile
from pathlib import Path

from benchmarks import overload
from benchmarks.base_model import BaseModel, resolve_base_model
from benchmarks.load_client import SLO, LoadReport, Request, run_load
from benchmarks.peers.envs import LLAMA_CPP, LORASERVE, SYSTEMS, VLLM, PeerUnavailable
from benchmarks.plots import goodput_vs_rate, latency_cdfs
from benchmarks.random_adapters import write_random_adapters
from benchmarks.report import (
    add_report_flags,
    machine_description,
    not_run_row,
    page,
    reproduce_command,
    run_suffix,
    write_section,
)
from benchmarks.servers import RunningServer, ServerFailed, ServerSettings, base_model_name, serve
from benchmarks.workloads import ADAPTER_RULES, arrival_times, assign_adapters, draw_lengths, prompt_token_ids

SECTION = "peers-online"
SWEEP_RATES = [2.0, 4.0, 8.0, 12.0, 16.0, 20.0, 24.0]  # the knee on a 2-core Zen 4 is near 12/s
GOODPUT_PLOT = "bench-online-goodput.png"
LATENCY_PLOT = "bench-online-latency.png"


def build_requests(base: BaseModel, server: RunningServer, args: argparse.Namespace, rate: float) -> list[Request]:
    """The same prompts, adapters and lengths at every rate and for every system; only the times scale."""
    count = max(args.requests, round(rate * args.duration))
    prompts = prompt_token_ids(base.tokenizer, args.prompt_len, count)
    chosen = assign_adapters(args.rule if args.adapters else "none", count, args.adapters, 0, args.zipf_alpha)
    lens = draw_lengths(args.output_len, count, seed=1)
    times = arrival_times(count, rate, args.cv)
    models = [server.base_model if k is None else f"adapter-{k}" for k in chosen]
    return [
        Request(at, prompt, model, length, server.request_fields(model))
        for at, prompt, model, length in zip(times, prompts, models, lens, strict=True)
    ]


def sweep(base: BaseModel, server: RunningServer, args: argparse.Namespace, slo: SLO, label: str) -> list[LoadReport]:
    warmup = [Request(0.0, r.prompt, r.model, 2, r.fields) for r in build_requests(base, server, args, 1.0)[:4]]
    run_load(server.url, warmup, math.inf, slo)
    reports = []
    for rate in args.rates:
        report = run_load(server.url, build_requests(base, server, args, rate), rate, slo)
        ttft, tpot = report.percentiles("ttft")[0], report.percentiles("tpot")[0]
        print(
            f"{label} at {rate}/s: {report.tokens_per_s:.1f} tok/s, TTFT p50 {ttft:.2f} s, TPOT p50 "
            f"{tpot * 1e3:.0f} ms, goodput {report.goodput:.2f} req/s ({report.attainment:.0%}), "
            f"{report.failures} failed",
            flush=True,
        )
        reports.append(report)
    return reports


def highest_rate(reports: list[LoadReport], attainment: float) -> float | None:
    """The highest rate at which at least `attainment` of the requests met the SLO."""
    passing = [r.rate for r in reports if r.attainment >= attainment]
    return max(passing) if passing else None


def run_servers(
    systems: list[str], base: BaseModel, args: argparse.Namespace, slo: SLO, pythons: dict[str, str]
) -> dict[str, list[LoadReport] | str]:
    """Start each system's server in turn with the same adapters and sweep the rates against it."""
    results: dict[str, list[LoadReport] | str] = {}
    with tempfile.TemporaryDirectory() as tmp:
        work_dir = Path(tmp)
        paths = write_random_adapters(base.spec, args.adapters, work_dir / "adapters")
        settings = ServerSettings(base.path, args.dtype, paths, args.max_num_seqs, args.max_loras)
        for name in systems:
            try:
                with serve(SYSTEMS[name], settings, work_dir, pythons.get(name)) as server:
                    results[name] = sweep(base, server, args, slo, name)
            except (PeerUnavailable, ServerFailed) as error:
                results[name] = str(error)
                print(f"{name}: not run: {error}", flush=True)
    return results


def _suffix(args: argparse.Namespace) -> str:
    """Of the section and plots: a run of other systems than loraserve and vLLM gets its own."""
    return run_suffix([s.strip() for s in args.systems.split(",") if s.strip()], {LORASERVE.name, VLLM.name})


def _plots(args: argparse.Namespace) -> tuple[str, str]:
    return GOODPUT_PLOT.replace(".png", f"{_suffix(args)}.png"), LATENCY_PLOT.replace(".png", f"{_suffix(args)}.png")


def _ratio(ours: float, theirs: float) -> str:
    if theirs:
        return f"{ours / theirs:.2f}x"
    return "only loraserve meets the SLO" if ours else "neither meets the SLO"


def _ms(values: tuple[float, ...]) -> str:
    return " / ".join("-" if math.isnan(v) else f"{v * 1e3:.0f}" for v in values)


def render(results: dict[str, list[LoadReport] | str], args: argparse.Namespace, slo: SLO) -> str:
    arrivals = "Poisson" if args.cv == 1.0 else f"Gamma (CV {args.cv})"
    adapters = (
        f"{args.adapters} adapters (ranks 8 and 16, all seven projections) chosen `{args.rule}`"
        + (f" (alpha {args.zipf_alpha})" if args.rule == "zipf" else "")
        if args.adapters
        else "the base model only"
    )
    lines = [
        "## Against the peers, online" + (f": {', '.join(results)}" if _suffix(args) else ""),
        "",
        f"Command: `{args.command}`. Machine: {machine_description()}.",
        "",
        f"{args.requests} requests per rate over {adapters}; {args.prompt_len} prompts, {args.output_len} new "
        f"tokens (EOS ignored, greedy), {arrivals} arrivals, streamed `/v1/completions`; loraserve and vLLM with "
        f"`--max-num-seqs {args.max_num_seqs} --max-loras {args.max_loras}`, llama.cpp with `-np {args.max_num_seqs}` "
        f"and every adapter loaded at start, {args.dtype}. SLO: TTFT <= "
        f"{slo.ttft:g} s and TPOT <= {slo.tpot * 1e3:g} ms; goodput counts the requests per second that met it.",
        "",
        "| system | rate (req/s) | tok/s | TTFT p50/p90/p99 (ms) | TPOT p50/p90/p99 (ms) | ITL p50/p90/p99 (ms) "
        "| goodput (req/s) | met SLO | failed |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for label, reports in results.items():
        if isinstance(reports, str):
            lines.append(not_run_row(label, reports, num_columns=9))
            continue
        for r in reports:
            lines.append(
                f"| {label} | {r.rate:g} | {r.tokens_per_s:.1f} | {_ms(r.percentiles('ttft'))} | "
                f"{_ms(r.percentiles('tpot'))} | {_ms(r.percentiles('itl'))} | {r.goodput:.2f} | "
                f"{r.attainment:.1%} | {r.failures} |"
            )
    lines += ["", f"Highest rate with at least {args.slo_attainment:.0%} of the requests within the SLO:", ""]
    for label, reports in results.items():
        if not isinstance(reports, str):
            best = highest_rate(reports, args.slo_attainment)
            lines.append(f"- {label}: {'none of the rates tried' if best is None else f'{best:g} req/s'}")
    measured = {k: v for k, v in results.items() if not isinstance(v, str)}
    for peer in [name for name in measured if name != LORASERVE.name] if LORASERVE.name in measured else []:
        ratios = [
            f"{ours.rate:g}/s: " + _ratio(ours.goodput, theirs.goodput)
            for ours, theirs in zip(measured[LORASERVE.name], measured[peer], strict=True)
        ]
        lines += ["", f"loraserve's goodput divided by {peer}'s, per rate: {', '.join(ratios)}."]
    goodput, latency = _plots(args)
    lines += ["", f"![goodput vs rate]({goodput})", "", f"![latency CDFs]({latency})"]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="loraserve bench online", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--systems", default=f"{LORASERVE.name},{VLLM.name}", help="comma-separated")
    parser.add_argument("--url", default=None, help="measure this running server instead of starting any")
    parser.add_argument("--adapters", type=int, default=256, help="adapter-0..N-1; 0: base model only")
    parser.add_argument("--rule", choices=ADAPTER_RULES[:3], default="zipf")
    parser.add_argument("--zipf-alpha", type=float, default=1.0)
    parser.add_argument("--rates", type=float, nargs="+", default=[0.5, 1.0, 2.0, 4.0, 8.0], help="requests/s")
    parser.add_argument("--cv", type=float, default=1.0, help="coefficient of variation of the gaps (1: Poisson)")
    parser.add_argument("--requests", type=int, default=48, help="per rate (at least)")
    parser.add_argument("--duration", type=float, default=0.0, help="seconds of arrivals per rate (more requests)")
    parser.add_argument(
        "--sweep", action="store_true",
        help="past capacity: loraserve with its defaults and with --slo off, and vLLM, at rates up to twice the "
        "knee (defaults: 4 adapters, 15 s a rate, rates 2-24/s), then loraserve's --burst; writes the section "
        "'overload'",
    )  # fmt: skip
    parser.add_argument(
        "--burst", type=int, default=1000,
        help="--sweep: non-streamed requests sent at once from the openai client after each loraserve sweep (0: none)",
    )  # fmt: skip
    parser.add_argument("--burst-tokens", type=int, default=32, help="--sweep: new tokens of each burst request")
    parser.add_argument("--prompt-len", default="chat", help='"chat", N tokens, or uniform:LOW-HIGH')
    parser.add_argument("--output-len", default="64", help="N tokens, or uniform:LOW-HIGH")
    parser.add_argument("--slo-ttft", type=float, default=1.0, help="seconds")
    parser.add_argument("--slo-tpot", type=float, default=0.1, help="seconds")
    parser.add_argument("--slo-attainment", type=float, default=0.9, help="share of requests that must meet the SLO")
    parser.add_argument("--max-num-seqs", type=int, default=64)
    parser.add_argument("--max-loras", type=int, default=32)
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument("--python", action="append", default=[], help="SYSTEM=PATH: run it with this interpreter")
    parser.add_argument("--model", default=None, help="HF safetensors directory (default: the embedded model)")
    add_report_flags(parser)
    args = parser.parse_args(argv)
    args.output = args.output or page("overload" if args.sweep else "online")
    # As typed: `loraserve bench online ...` passes argv, `python -m benchmarks.online ...` does not.
    args.command = reproduce_command("benchmarks.online") if argv is None else " ".join([parser.prog, *argv])
    systems = [s.strip() for s in args.systems.split(",") if s.strip()]
    if unknown := [s for s in systems if s not in SYSTEMS or SYSTEMS[s] is SYSTEMS["transformers+peft"]]:
        parser.error(f"--systems: no server for {unknown}; choose from {LORASERVE.name}, {VLLM.name}, {LLAMA_CPP.name}")
    if args.quick:
        systems, args.adapters, args.rates, args.requests, args.output_len = [LORASERVE.name], 3, [8.0], 6, "4"
    slo = SLO(args.slo_ttft, args.slo_tpot)
    pythons = dict(value.split("=", 1) for value in args.python)
    base = resolve_base_model(args.model)
    if args.sweep:
        defaults = parser.parse_args([])
        for name, value in (("adapters", 4), ("duration", 15.0), ("rates", SWEEP_RATES), ("rule", "uniform")):
            if getattr(args, name) == getattr(defaults, name):
                setattr(args, name, value)
        overload.main(base, args, slo, pythons, lambda server, label: sweep(base, server, args, slo, label))
        return
    results: dict[str, list[LoadReport] | str] = {}
    if args.url:
        server = RunningServer(args.url.rstrip("/"), base_model_name(args.url.rstrip("/")))
        results[args.url] = sweep(base, server, args, slo, args.url)
    else:
        results = run_servers(systems, base, args, slo, pythons)
    body = render(results, args, slo)
    print(body)
    if args.quick:
        return
    write_section(args.output, SECTION + _suffix(args), body)
    goodput, latency = _plots(args)
    measured = {k: v for k, v in results.items() if not isinstance(v, str)}
    subtitle = f"{args.requests} requests per rate, {args.adapters} adapters ({args.rule}), {args.output_len} tokens"
    goodput_vs_rate({k: {r.rate: r.goodput for r in v} for k, v in measured.items()}, args.output.parent / goodput,
                    f"{subtitle}; SLO TTFT <= {slo.ttft:g} s, TPOT <= {slo.tpot * 1e3:g} ms")  # fmt: skip
    rate = args.rates[len(args.rates) // 2]
    latency_cdfs(
        {
            k: {m: next(r for r in v if r.rate == rate).samples(m) for m in ("ttft", "tpot")}
            for k, v in measured.items()
        },
        args.output.parent / latency,
        f"{subtitle}, at {rate:g} requests/s",
    )
    print(f"wrote {args.output}, {goodput} and {latency}")


if __name__ == "__main__":
    main()
