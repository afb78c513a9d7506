"""A soak run: the server under mixed, hostile traffic for --minutes, watching for failures,
memory growth and one tenant hurting the others.

    loraserve bench soak --minutes 30      # section "soak" of docs/reliability.md + docs/soak-rss.png

loraserve runs as `loraserve serve --slo chat` (past capacity it refuses what it cannot serve
in time) with 4 adapters; every tenant has its own API key made through the admin API:
- `steady-a`, `steady-b`: --rate requests/s each (Poisson), streamed completions over the
  adapters and the base model;
- `flood`: --flood-rate requests/s, past what the machine serves beside the others;
- `limited`: a quota of --rate x 30 requests per minute, sent at --rate: half are refused (429);
- churn: every --churn-seconds an adapter is uploaded, served one request, and deleted;
- disconnects: every 2 s a stream is dropped after its first token;
- every 5 s the server's resident memory (its whole process group) and /health's latency.
A failure is whatever a user should never see: a 5xx other than 503 `overloaded`, a broken or
short stream, a refused upload or delete. Refusals (429, 503 overloaded) are counted apart.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from benchmarks.base_model import BaseModel, resolve_base_model
from benchmarks.load_client import Request, RequestResult, percentile, send_request
from benchmarks.peers.envs import LORASERVE
from benchmarks.plots import memory_over_time
from benchmarks.random_adapters import write_random_adapters
from benchmarks.report import add_report_flags, machine_description, reproduce_command, write_section
from benchmarks.servers import RunningServer, ServerSettings, serve
from benchmarks.workloads import arrival_times, prompt_token_ids
from loraserve.admin_client import AdminClient

SECTION = "soak"
PLOT = "soak-rss.png"
SAMPLE_SECONDS = 5.0
DISCONNECT_SECONDS = 2.0


@dataclass(frozen=True)
class TenantLoad:
    name: str
    rate: float  # requests/s
    requests_per_minute: int | None = None


@dataclass
class Soak:
    """What the run saw, filled in as it goes."""

    results: dict[str, list[RequestResult]] = field(default_factory=dict)
    memory: list[tuple[float, float]] = field(default_factory=list)  # (seconds, RSS bytes)
    health_seconds: list[float] = field(default_factory=list)
    churned: int = 0
    disconnects: int = 0
    failures: list[str] = field(default_factory=list)  # of churn, disconnects and /health


def is_refusal(result: RequestResult) -> bool:
    return result.status == 429 or (result.status == 503 and "overloaded" in (result.error or ""))


def process_group_rss(pgid: int) -> int:
    """Bytes resident in every process of the group (the server and the helpers it started)."""
    total = 0
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            if int(stat.read_text().rsplit(")", 1)[1].split()[2]) == pgid:
                status = (stat.parent / "status").read_text()
                total += next(int(line.split()[1]) * 1024 for line in status.splitlines() if line.startswith("VmRSS"))
        except (OSError, StopIteration, ValueError, IndexError):
            continue  # exited meanwhile, or a kernel thread without VmRSS
    return total


def tenant_requests(base: BaseModel, server: RunningServer, load: TenantLoad, seconds: float, seed: int,
                    models: Sequence[str], max_tokens: int) -> list[Request]:  # fmt: skip
    count = max(1, round(load.rate * seconds))
    times = [t for t in arrival_times(count * 2, load.rate, seed=seed) if t < seconds][:count]
    prompts = prompt_token_ids(base.tokenizer, "chat", len(times), seed=seed)
    rng = random.Random(seed)
    return [Request(at, prompt, rng.choice(models), max_tokens) for at, prompt in zip(times, prompts, strict=True)]


def new_key(server: RunningServer, load: TenantLoad) -> str:
    """An API key for the tenant, made through the admin API, with its quota if it has one."""
    body = {"tenant": load.name, "requests_per_minute": load.requests_per_minute}
    answer = httpx.post(
        f"{server.url}/admin/keys", json=body, headers={"Authorization": f"Bearer {server.admin_token}"}
    )
    answer.raise_for_status()
    return str(answer.json()["key"])


async def run_tenant(server: RunningServer, key: str, requests: list[Request], start: float) -> list[RequestResult]:
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    headers = {"Authorization": f"Bearer {key}"}
    async with httpx.AsyncClient(base_url=server.url, headers=headers, timeout=None, limits=limits) as client:
        return list(await asyncio.gather(*(send_request(client, r, start) for r in requests)))


async def post_until_admitted(client: httpx.AsyncClient, path: str, body: dict, tries: int = 10) -> httpx.Response:
    """POST, and again after Retry-After while the server refuses for load (as a well-behaved client does)."""
    for _ in range(tries - 1):
        answer = await client.post(path, json=body, timeout=300)
        if answer.status_code not in (429, 503) or "Retry-After" not in answer.headers:
            return answer
        await asyncio.sleep(float(answer.headers["Retry-After"]))
    return await client.post(path, json=body, timeout=300)


async def churn(server: RunningServer, key: str, spare: list[Path], every: float, until: float, soak: Soak) -> None:
    """Upload an adapter, serve it one request, delete it; again every `every` seconds."""
    admin = AdminClient(server.url, server.admin_token)
    body = {"prompt": "Hello", "max_tokens": 4, "temperature": 0}
    async with httpx.AsyncClient(base_url=server.url, headers={"Authorization": f"Bearer {key}"}) as client:
        while time.monotonic() + every < until:
            await asyncio.sleep(every)
            name = f"churn-{soak.churned}"
            try:
                await asyncio.to_thread(admin.upload, name, spare[soak.churned % len(spare)], None, None)
                answer = await post_until_admitted(client, "/v1/completions", {**body, "model": name})
                if answer.status_code != 200:
                    soak.failures.append(f"{name}: HTTP {answer.status_code} {answer.text[:200]}")
                await asyncio.to_thread(admin.delete, name)
                soak.churned += 1
            except Exception as error:  # every failure is reported, none stops the run
                soak.failures.append(f"{name}: {type(error).__name__}: {error}")


async def disconnect(server: RunningServer, key: str, model: str, until: float, soak: Soak) -> None:
    """Every DISCONNECT_SECONDS a stream that the client drops after its first event."""
    body = {"model": model, "prompt": "Tell me a long story.", "max_tokens": 256, "stream": True}
    async with httpx.AsyncClient(base_url=server.url, headers={"Authorization": f"Bearer {key}"}) as client:
        while time.monotonic() < until:
            await asyncio.sleep(DISCONNECT_SECONDS)
            try:
                async with client.stream("POST", "/v1/completions", json=body, timeout=300) as response:
                    if response.status_code == 200:
                        async for _ in response.aiter_lines():
                            break
                soak.disconnects += 1
            except httpx.HTTPError as error:
                soak.failures.append(f"disconnect: {type(error).__name__}: {error}")


async def watch(server: RunningServer, start: float, until: float, soak: Soak) -> None:
    """Every SAMPLE_SECONDS: the server's RSS and how long /health takes."""
    async with httpx.AsyncClient(base_url=server.url) as client:
        while time.monotonic() < until:
            soak.memory.append((time.monotonic() - start, process_group_rss(server.pid)))
            sent = time.monotonic()
            try:
                health = await client.get("/health", timeout=30)
                soak.health_seconds.append(time.monotonic() - sent)
                if health.status_code != 200:
                    soak.failures.append(f"/health: HTTP {health.status_code} {health.text[:200]}")
            except httpx.HTTPError as error:
                soak.failures.append(f"/health: {type(error).__name__}: {error}")
            await asyncio.sleep(SAMPLE_SECONDS)


async def soak_run(base: BaseModel, server: RunningServer, args: argparse.Namespace, spare: list[Path]) -> Soak:
    seconds = args.minutes * 60
    loads = [
        TenantLoad("steady-a", args.rate),
        TenantLoad("steady-b", args.rate),
        TenantLoad("flood", args.flood_rate),
        TenantLoad("limited", args.rate, requests_per_minute=max(1, round(args.rate * 30))),
    ]
    keys = {load.name: new_key(server, load) for load in loads}
    models = [server.base_model, *(f"adapter-{i}" for i in range(args.adapters))]
    soak = Soak()
    start = time.perf_counter()
    until = time.monotonic() + seconds
    tenants = {
        load.name: run_tenant(
            server, keys[load.name], tenant_requests(base, server, load, seconds, i, models, args.max_tokens), start
        )
        for i, load in enumerate(loads)
    }
    background = [
        churn(server, keys["steady-a"], spare, args.churn_seconds, until, soak),
        disconnect(server, keys["steady-b"], models[-1], until, soak),
        watch(server, time.monotonic(), until, soak),
    ]
    answers, _ = await asyncio.gather(asyncio.gather(*tenants.values()), asyncio.gather(*background))
    soak.results = dict(zip(tenants, answers, strict=True))
    soak.memory.append((time.monotonic() - (until - seconds), process_group_rss(server.pid)))
    return soak


def render(soak: Soak, args: argparse.Namespace) -> str:
    failed = sum(1 for results in soak.results.values() for r in results if not r.ok and not is_refusal(r))
    rss = [b for _, b in soak.memory]
    warm = [b for t, b in soak.memory if t >= 60] or rss  # after the first minute: allocators and caches warmed
    lines = [
        f"Soak run of {args.minutes:g} minutes ({machine_description()}): `{args.command}`.",
        "",
        f"**{failed + len(soak.failures)} failures.** {soak.churned} adapters uploaded, served and deleted; "
        f"{soak.disconnects} streams dropped by their client; /health answered in at most "
        f"{max(soak.health_seconds, default=float('nan')) * 1e3:.0f} ms.",
        f"Server RSS: {rss[0] / 2**20:.0f} MiB at the start, {warm[0] / 2**20:.0f} MiB after a minute, "
        f"{max(rss) / 2**20:.0f} MiB at most, {rss[-1] / 2**20:.0f} MiB at the end (the pool's pages count from their "
        "first use: growth up to the pool's size is KV blocks and adapters coming in, not a leak).",
        "",
        "| tenant | rate (req/s) | sent | answered | refused 429 | refused 503 | failed | TTFT p50 | TTFT p99 |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    rates = {"flood": args.flood_rate}
    for name, results in soak.results.items():
        ok = [r for r in results if r.ok]
        ttfts = [r.ttft for r in ok if r.ttft is not None]
        lines.append(
            f"| {name} | {rates.get(name, args.rate):g} | {len(results)} | {len(ok)} | "
            f"{sum(r.status == 429 for r in results)} | {sum(r.status == 503 for r in results)} | "
            f"{sum(not r.ok and not is_refusal(r) for r in results)} | "
            f"{percentile(ttfts, 50) * 1e3:.0f} ms | {percentile(ttfts, 99) * 1e3:.0f} ms |"
        )
    problems = [f"{r.status}: {r.error}" for rs in soak.results.values() for r in rs if not r.ok and not is_refusal(r)]
    for problem in (problems + soak.failures)[:10]:
        lines.append(f"\n- failure: {problem}")
    lines += ["", f"![server RSS over the soak run]({PLOT})"]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="loraserve bench soak", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--minutes", type=float, default=30.0)
    parser.add_argument("--rate", type=float, default=1.0, help="requests/s of each well-behaved tenant")
    parser.add_argument("--flood-rate", type=float, default=20.0, help="requests/s of the flooding tenant")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--adapters", type=int, default=4)
    parser.add_argument("--churn-seconds", type=float, default=20.0)
    parser.add_argument("--model", default=None, help="HF safetensors directory (default: the embedded model)")
    add_report_flags(parser)
    parser.set_defaults(output=Path("docs/reliability.md"))
    args = parser.parse_args(argv)
    args.command = reproduce_command("benchmarks.soak") if argv is None else " ".join([parser.prog, *argv])
    if args.quick:
        args.minutes, args.churn_seconds = 0.5, 5.0
    base = resolve_base_model(args.model)
    with tempfile.TemporaryDirectory() as tmp:
        work_dir = Path(tmp)
        paths = write_random_adapters(base.spec, args.adapters + 2, work_dir / "adapters")
        settings = ServerSettings(base.path, "auto", paths[: args.adapters], max_num_seqs=64, max_loras=8,
                                  loraserve_flags=("--slo", "chat"))  # fmt: skip
        with serve(LORASERVE, settings, work_dir) as server:
            soak = asyncio.run(soak_run(base, server, args, paths[args.adapters :]))
    body = render(soak, args)
    print(body)
    if args.quick:
        return
    write_section(args.output, SECTION, body)
    memory_over_time(soak.memory, args.output.parent / PLOT, f"{args.minutes:g} minutes, {machine_description()}")
    print(f"wrote {args.output} and {PLOT}")


if __name__ == "__main__":
    main()
