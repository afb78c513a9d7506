"""Goodput past capacity: loraserve without and with SLO-aware admission, and vLLM, on the same
Poisson workload of streamed requests at rates up to twice the knee.

    loraserve bench online --sweep          # section "overload" of docs/benchmarks.md + a plot

Past its capacity a server that admits everything makes every token slow and every first
token late, and its goodput (requests per second within the SLO) collapses; one that
refuses what it cannot serve in time (503, Retry-After) keeps serving its best goodput.
"""

from __future__ import annotations

import argparse
import tempfile
from collections.abc import Callable
from pathlib import Path

from benchmarks.base_model import BaseModel
from benchmarks.load_client import SLO, LoadReport, percentile
from benchmarks.peers.envs import LORASERVE, VLLM, PeerUnavailable, System
from benchmarks.plots import goodput_vs_rate
from benchmarks.random_adapters import write_random_adapters
from benchmarks.report import machine_description, not_run_row, write_section
from benchmarks.servers import RunningServer, ServerFailed, ServerSettings, serve

Measure = Callable[[RunningServer, str], list[LoadReport]]  # a rate sweep against one server, labelled

SECTION = "overload"
PLOT = "bench-overload-goodput.png"
SLO_MARGIN = 1.1  # "every answered stream meets the SLO within 10%"


def configurations(slo: SLO) -> list[tuple[str, System, tuple[str, ...]]]:
    flags = ("--ttft-slo", f"{slo.ttft:g}", "--tpot-slo", f"{slo.tpot:g}")
    return [("loraserve", LORASERVE, ()), (f"loraserve {' '.join(flags)}", LORASERVE, flags), (VLLM.name, VLLM, ())]


def run(
    base: BaseModel, args: argparse.Namespace, slo: SLO, pythons: dict[str, str], measure: Measure
) -> dict[str, list[LoadReport] | str]:
    results: dict[str, list[LoadReport] | str] = {}
    with tempfile.TemporaryDirectory() as tmp:
        work_dir = Path(tmp)
        paths = write_random_adapters(base.spec, args.adapters, work_dir / "adapters")
        for label, system, flags in configurations(slo):
            if system.name not in args.systems:
                continue
            settings = ServerSettings(base.path, args.dtype, paths, args.max_num_seqs, args.max_loras,
                                      loraserve_flags=flags)  # fmt: skip
            try:
                with serve(system, settings, work_dir, pythons.get(system.name)) as server:
                    results[label] = measure(server, label)
            except (PeerUnavailable, ServerFailed) as error:
                results[label] = str(error)
                print(f"{label}: not run: {error}", flush=True)
    return results


def render(results: dict[str, list[LoadReport] | str], args: argparse.Namespace, slo: SLO) -> str:
    lines = [
        "## Past capacity: goodput with and without admission",
        "",
        f"Command: `{args.command}`. Machine: {machine_description()}.",
        "",
        f"Poisson arrivals for {args.duration:g} s per rate (at least {args.requests} requests), {args.adapters} "
        f"adapters chosen `{args.rule}`, {args.prompt_len} prompts, {args.output_len} new tokens (EOS ignored), "
        f"streamed `/v1/completions`, `--max-num-seqs {args.max_num_seqs}`, {args.dtype}. SLO: TTFT <= "
        f"{slo.ttft:g} s, TPOT <= {slo.tpot * 1e3:g} ms; goodput = requests per second within it; a refusal "
        "(503) counts as a miss.",
        "",
        "| system | rate (req/s) | goodput (req/s) | met SLO | refused | refusal answered p99 (ms) "
        "| answered within SLO +10% | TTFT p50/p99 (ms) | TPOT p50/p99 (ms) |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for label, reports in results.items():
        if isinstance(reports, str):
            lines.append(not_run_row(label, reports, num_columns=9))
            continue
        for r in reports:
            ttft, tpot = r.percentiles("ttft"), r.percentiles("tpot")
            lines.append(
                f"| {label} | {r.rate:g} | {r.goodput:.2f} | {r.attainment:.0%} | {len(r.refused)} | "
                f"{_refusal_p99_ms(r)} | {_answered_within(r, slo):.0%} | {ttft[0] * 1e3:.0f} / {ttft[2] * 1e3:.0f} | "
                f"{tpot[0] * 1e3:.0f} / {tpot[2] * 1e3:.0f} |"
            )
    lines += ["", "Goodput at twice the rate of each system's best goodput, against that best:", ""]
    for label, reports in results.items():
        if not isinstance(reports, str):
            lines.append(f"- {label}: {_past_the_knee(reports)}")
    lines += ["", f"![goodput vs rate, with and without admission]({PLOT})"]
    return "\n".join(lines)


def _refusal_p99_ms(report: LoadReport) -> str:
    times = [r.answered for r in report.refused if r.answered is not None]
    return f"{percentile(times, 99) * 1e3:.0f}" if times else "-"


def _answered_within(report: LoadReport, slo: SLO) -> float:
    """Of the requests answered 200, the share within the SLO widened by 10%."""
    loose = SLO(slo.ttft * SLO_MARGIN, slo.tpot * SLO_MARGIN)
    answered = [r for r in report.results if r.status == 200]
    return sum(loose.met(r) for r in answered) / len(answered) if answered else 0.0


def _past_the_knee(reports: list[LoadReport]) -> str:
    best = max(reports, key=lambda r: r.goodput)
    past = [r for r in reports if r.rate >= 2 * best.rate]
    if not past:
        return f"best {best.goodput:.2f} req/s at {best.rate:g}/s; no rate of twice that was tried"
    at_twice = min(past, key=lambda r: r.rate)
    return (
        f"best {best.goodput:.2f} req/s at {best.rate:g}/s; at {at_twice.rate:g}/s {at_twice.goodput:.2f} req/s, "
        f"{at_twice.goodput / best.goodput:.2f} of the best"
        if best.goodput
        else "no request met the SLO"
    )


def main(base: BaseModel, args: argparse.Namespace, slo: SLO, pythons: dict[str, str], measure: Measure) -> None:
    results = run(base, args, slo, pythons, measure)
    body = render(results, args, slo)
    print(body)
    write_section(args.output, SECTION, body)
    measured = {k: {r.rate: r.goodput for r in v} for k, v in results.items() if not isinstance(v, str)}
    subtitle = (
        f"{args.adapters} adapters, {args.output_len} tokens; SLO TTFT <= {slo.ttft:g} s, TPOT <= {slo.tpot * 1e3:g} ms"
    )
    goodput_vs_rate(measured, args.output.parent / PLOT, subtitle)
    print(f"wrote {args.output} and {PLOT}")
