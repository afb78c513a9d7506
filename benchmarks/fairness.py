"""One API key flooding, another polite: the polite key's TTFT alone and beside the flood.

    python -m benchmarks.fairness          # section "fairness" of docs/reliability.md

For each server configuration (with `--slo chat`, and without SLO targets) loraserve starts
with two keys made through its admin API. The polite key sends --polite-rate streamed
completions a second (Poisson) for --seconds alone, then again beside the flooder's
--flood-rate; both ask --max-tokens tokens of the same chat prompts.
"""

from __future__ import annotations

import argparse
import asyncio
import tempfile
import time
from pathlib import Path

from benchmarks.base_model import BaseModel, resolve_base_model
from benchmarks.load_client import Request, RequestResult, percentile
from benchmarks.peers.envs import LORASERVE
from benchmarks.report import add_report_flags, machine_description, reproduce_command, write_section
from benchmarks.servers import RunningServer, ServerSettings, serve
from benchmarks.soak import TenantLoad, new_key, run_tenant, tenant_requests

SECTION = "fairness"
CONFIGURATIONS = {"--slo chat": ("--slo", "chat"), "no SLO targets": ("--slo", "off")}


async def measure(
    server: RunningServer, keys: dict[str, str], loads: dict[str, list[Request]]
) -> dict[str, list[RequestResult]]:
    start = time.perf_counter()
    answers = await asyncio.gather(
        *(run_tenant(server, keys[name], requests, start) for name, requests in loads.items())
    )
    return dict(zip(loads, answers, strict=True))


def summary(results: list[RequestResult]) -> tuple[list[float], int]:
    """(TTFTs of the answered, how many were refused or failed)."""
    return [r.ttft for r in results if r.ok and r.ttft is not None], sum(not r.ok for r in results)


def run(base: BaseModel, args: argparse.Namespace, flags: tuple[str, ...]) -> list[str]:
    with tempfile.TemporaryDirectory() as tmp:
        settings = ServerSettings(base.path, "auto", [], max_num_seqs=128, max_loras=8, loraserve_flags=flags)
        with serve(LORASERVE, settings, Path(tmp)) as server:
            keys = {name: new_key(server, TenantLoad(name, 0.0)) for name in ("polite", "flood")}
            models = [server.base_model]
            polite = tenant_requests(base, server, TenantLoad("polite", args.polite_rate), args.seconds, 0, models,
                                     args.max_tokens)  # fmt: skip
            flood = tenant_requests(base, server, TenantLoad("flood", args.flood_rate), args.seconds, 1, models,
                                    args.max_tokens)  # fmt: skip
            asyncio.run(measure(server, keys, {"polite": polite[:4]}))  # warm up
            alone = asyncio.run(measure(server, keys, {"polite": polite}))["polite"]
            beside = asyncio.run(measure(server, keys, {"polite": polite, "flood": flood}))
    alone_ttfts, _ = summary(alone)
    polite_ttfts, polite_refused = summary(beside["polite"])
    flood_ttfts, flood_refused = summary(beside["flood"])
    ms = lambda values, q: f"{percentile(values, q) * 1e3:.0f}"  # noqa: E731 - a formatter used in one place
    return [
        f"{ms(alone_ttfts, 50)} ms",
        f"{ms(polite_ttfts, 50)} / {ms(polite_ttfts, 90)} / {ms(polite_ttfts, 99)} ms",
        f"{polite_refused} of {len(polite)}",
        f"{len(flood) - flood_refused} of {len(flood)}, p50 TTFT {ms(flood_ttfts, 50)} ms",
    ]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.fairness", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--polite-rate", type=float, default=2.0, help="requests/s")
    parser.add_argument("--flood-rate", type=float, default=20.0, help="requests/s")
    parser.add_argument("--seconds", type=float, default=30.0)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--model", default=None, help="HF safetensors directory (default: the embedded model)")
    add_report_flags(parser)
    parser.set_defaults(output=Path("docs/reliability.md"))
    args = parser.parse_args(argv)
    command = reproduce_command("benchmarks.fairness") if argv is None else " ".join([parser.prog, *argv])
    if args.quick:
        args.seconds, args.flood_rate = 3.0, 5.0
    base = resolve_base_model(args.model)
    lines = [
        f"{machine_description()}: `{command}`. A polite key at {args.polite_rate:g} requests/s beside a flooding "
        f"key at {args.flood_rate:g}/s, {args.max_tokens} tokens each, {args.seconds:g} s.",
        "",
        "| server | polite alone p50 | beside the flood p50 / p90 / p99 | polite refused | flood answered |",
        "|---|---|---|---|---|",
    ]
    for label, flags in CONFIGURATIONS.items():
        lines.append(f"| {label} | " + " | ".join(run(base, args, flags)) + " |")
    body = "\n".join(lines)
    print(body)
    if not args.quick:
        write_section(args.output, SECTION, body)
        print(f"wrote {args.output}")


if __name__ == "__main__":
    main()
