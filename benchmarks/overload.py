"""Goodput past capacity: loraserve with its default admission (`--slo chat`) and with plain queueing
(`--slo off`), and vLLM, on the same Poisson workload of streamed requests at rates up to twice the
knee; then, against each loraserve, an offline burst of non-streamed requests sent at once from the
`openai` client with its default retries (burst.py).

    loraserve bench online --sweep          # section "overload" of docs/benchmarks/overload.md + a plot

Past its capacity a server that admits everything makes every token slow and every first
token late, and its goodput (requests per second within the SLO) collapses; one that
refuses what it cannot serve in time (503, Retry-After) keeps serving its best goodput. The
burst checks that refusing so does not fail a batch client, whose requests may wait.
"""

from __future__ import annotations

import argparse
import tempfile
from collections.abc import Callable
from pathlib import Path

import openai

from benchmarks.base_model import BaseModel
from benchmarks.burst import BurstReport, run_burst
from benchmarks.load_client import SLO, LoadReport, percentile
from benchmarks.peers.envs import LORASERVE, VLLM, PeerUnavailable, System
from benchmarks.plots import goodput_vs_rate
from benchmarks.random_adapters import write_random_adapters
from benchmarks.report import machine_description, not_run_row, write_section
from benchmarks.servers import RunningServer, ServerFailed, ServerSettings, serve
from benchmarks.workloads import prompt_token_ids

Measure = Callable[[RunningServer, str], list[LoadReport]]  # a rate sweep against one server, labelled

SECTION = "overload"
PLOT = "bench-overload-goodput.png"
SLO_MARGIN = 1.1  # "every answered stream meets the SLO within 10%"


DEFAULTS, OFF = "loraserve (defaults)", "loraserve --slo off"


def configurations() -> list[tuple[str, System, tuple[str, ...]]]:
    return [(DEFAULTS, LORASERVE, ()), (OFF, LORASERVE, ("--slo", "off")), (VLLM.name, VLLM, ())]


def run(
    base: BaseModel, args: argparse.Namespace, pythons: dict[str, str], measure: Measure
) -> tuple[dict[str, list[LoadReport] | str], dict[str, BurstReport]]:
    """Each configuration's sweep and (loraserve's) burst."""
    results: dict[str, list[LoadReport] | str] = {}
    bursts: dict[str, BurstReport] = {}
    prompts = prompt_token_ids(base.tokenizer, args.prompt_len, args.burst)
    with tempfile.TemporaryDirectory() as tmp:
        work_dir = Path(tmp)
        paths = write_random_adapters(base.spec, args.adapters, work_dir / "adapters")
        for label, system, flags in configurations():
            if system.name not in args.systems:
                continue
            settings = ServerSettings(base.path, args.dtype, paths, args.max_num_seqs, args.max_loras,
                                      loraserve_flags=flags)  # fmt: skip
            try:
                with serve(system, settings, work_dir, pythons.get(system.name)) as server:
                    results[label] = measure(server, label)
                    if system is LORASERVE and args.burst:
                        bursts[label] = burst = run_burst(server, prompts, args.burst_tokens)
                        print(f"{label}: burst of {args.burst}: {_burst_summary(burst)}", flush=True)
            except (PeerUnavailable, ServerFailed) as error:
                results[label] = str(error)
                print(f"{label}: not run: {error}", flush=True)
    return results, bursts


def _burst_summary(burst: BurstReport) -> str:
    return (
        f"{burst.num_completed} of {burst.num_requests} completed in {burst.seconds:.0f} s, {burst.num_refusals} "
        f"refusals answered (503), latency p50 {burst.latency(50):.0f} s / p99 {burst.latency(99):.0f} s"
    )


def render(
    results: dict[str, list[LoadReport] | str], bursts: dict[str, BurstReport], args: argparse.Namespace, slo: SLO
) -> str:
    lines = [
        "## Past capacity: goodput with and without admission, and a batch client's burst",
        "",
        f"Command: `{args.command}`. Machine: {machine_description()}.",
        "",
        f"Poisson arrivals for {args.duration:g} s per rate (at least {args.requests} requests), {args.adapters} "
        f"adapters chosen `{args.rule}`, {args.prompt_len} prompts, {args.output_len} new tokens (EOS ignored), "
        f"streamed `/v1/completions`, `--max-num-seqs {args.max_num_seqs}`, {args.dtype}. SLO: TTFT <= "
        f"{slo.ttft:g} s, TPOT <= {slo.tpot * 1e3:g} ms (the defaults' targets); goodput = requests per second "
        "within it; a refusal (503) counts as a miss.",
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
    lines += _at_twice_capacity(results)
    if bursts:
        lines += [
            "",
            f"A burst of {args.burst} non-streamed `/v1/completions` ({args.prompt_len} prompts, "
            f"{args.burst_tokens} new tokens, EOS ignored) sent at once after the sweep from the `openai` "
            f"{openai.__version__} client with its defaults (two retries, each after the server's Retry-After; a "
            "600 s timeout):",
            "",
            "| system | completed | gave up | refusals (503, retried) | burst served in (s) | latency p50 / p99 (s) |",
            "|---|---:|---:|---:|---:|---:|",
        ]
        for label, burst in bursts.items():
            lines.append(
                f"| {label} | {burst.num_completed} | {len(burst.errors)} | {burst.num_refusals} | {burst.seconds:.0f} "
                f"| {burst.latency(50):.0f} / {burst.latency(99):.0f} |"
            )
        for label, burst in bursts.items():
            if burst.errors:
                lines += ["", f"{label}: the first error the client gave up on: `{burst.errors[0]}`"]
    lines += ["", f"![goodput vs rate, with and without admission]({PLOT})"]
    return "\n".join(lines)


def _at_twice_capacity(results: dict[str, list[LoadReport] | str]) -> list[str]:
    """Capacity = the rate of plain queueing's best goodput: each configuration's goodput at twice it, against
    the best goodput any configuration reached at any rate."""
    off = results.get(OFF)
    measured = {label: reports for label, reports in results.items() if not isinstance(reports, str)}
    if isinstance(off, str) or not off or not measured:
        return []
    capacity = max(off, key=lambda r: r.goodput).rate
    best = max(r.goodput for reports in measured.values() for r in reports)
    lines = ["", f"Capacity (the rate of `--slo off`'s best goodput): {capacity:g}/s; at twice it, against the best "
             f"goodput of any configuration at any rate ({best:.2f} req/s):", ""]  # fmt: skip
    for label, reports in measured.items():
        at_twice = [r for r in reports if r.rate == 2 * capacity]
        lines.append(
            f"- {label}: {at_twice[0].goodput:.2f} req/s, {at_twice[0].goodput / best:.2f} of the best"
            if at_twice and best
            else f"- {label}: {2 * capacity:g}/s was not tried"
        )
    return lines


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
    results, bursts = run(base, args, pythons, measure)
    body = render(results, bursts, args, slo)
    print(body)
    write_section(args.output, SECTION, body)
    measured = {k: {r.rate: r.goodput for r in v} for k, v in results.items() if not isinstance(v, str)}
    subtitle = (
        f"{args.adapters} adapters, {args.output_len} tokens; SLO TTFT <= {slo.ttft:g} s, TPOT <= {slo.tpot * 1e3:g} ms"
    )
    goodput_vs_rate(measured, args.output.parent / PLOT, subtitle)
    print(f"wrote {args.output} and {PLOT}")
