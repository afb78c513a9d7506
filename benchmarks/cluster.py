"""`loraserve bench cluster`: one engine replica against two on this machine, adapter-affinity routing against
random, through the cluster's ingress (Ray Serve; `loraserve cluster`).

    loraserve bench cluster                    # a section of docs/benchmarks/cluster.md
    loraserve bench cluster --quick            # a smoke run; nothing written

--adapters (256) random adapters (rank 8 on q_proj and v_proj: small, so the registry database holds them all) with
Zipf(--zipf-alpha) popularity, Poisson arrivals at --rate, greedy streams of --output-len tokens. The replicas share
this machine's cores (--replica-cpus = cores / replicas) and a PostgreSQL registry made for the run (on the server of
--db, dropped after). Per setup: tokens/s, TTFT p50/p99, failed requests, adapter loads per 100 requests (the
replicas' own counters: an adapter copied into a device slot) and the affinity hit rate (requests whose adapter was
already in a slot of the replica that served them: 1 - loads / requests), measured after a warm-up pass of
another draw.
With 128 slots a replica can hold half of the adapters: affinity lets two replicas hold all of them between them,
where random routing needs every replica to hold every adapter its requests name.
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import httpx

from benchmarks.base_model import resolve_base_model
from benchmarks.load_client import SLO, LoadReport, Request, run_load
from benchmarks.postgres import scratch_database
from benchmarks.random_adapters import write_random_adapters
from benchmarks.report import add_report_flags, machine_description, page, reproduce_command, write_section
from benchmarks.workloads import arrival_times, assign_adapters, prompt_token_ids
from loraserve.admin_client import AdminClient
from loraserve.config import EngineConfig, ServerConfig

SECTION = "cluster"
SETUPS = [(1, "affinity"), (2, "affinity"), (2, "random")]  # (replicas, routing)
TOKEN = "cluster-benchmark-admin-token"
BOARD_SECONDS = 3.0  # the replicas post their counters every 2 s


@dataclass
class SetupResult:
    replicas: int
    routing: str
    report: LoadReport
    loads: int


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="loraserve bench cluster", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--adapters", type=int, default=256)
    parser.add_argument("--zipf-alpha", type=float, default=1.0)
    parser.add_argument("--rate", type=float, default=10.0, help="requests/s (Poisson)")
    parser.add_argument("--requests", type=int, default=400)
    parser.add_argument("--output-len", type=int, default=32)
    parser.add_argument("--max-loras", type=int, default=128, help="device slots per replica")
    parser.add_argument("--warmup-passes", type=int, default=1, help="unmeasured passes of other draws first")
    parser.add_argument(
        "--warmup-same", action="store_true",
        help="warm up with the measured requests themselves: only the loads routing can avoid remain (no tail "
        "adapter the warm-up did not draw)",
    )  # fmt: skip
    parser.add_argument(
        "--db", default="postgresql://postgres@127.0.0.1:5432/test", help="a PostgreSQL to make the run's database on"
    )
    parser.add_argument("--port", type=int, default=8765)
    add_report_flags(parser)
    args = parser.parse_args(argv)
    args.output = args.output or page("cluster")
    if args.quick:
        args.adapters, args.requests = 8, 16
    import ray
    from ray import serve

    from loraserve.cluster.deploy import cluster_app

    base = resolve_base_model(None)
    url = f"http://127.0.0.1:{args.port}"
    results: list[SetupResult] = []
    with scratch_database(args.db, prefix="loraserve_bench") as db, tempfile.TemporaryDirectory() as tmp:
        paths = write_random_adapters(base.spec, args.adapters, Path(tmp) / "adapters", ("q_proj", "v_proj"), (8,))
        requests = build_requests(base, args, seed=0)
        warmups = [build_requests(base, args, seed=0 if args.warmup_same else 1 + n) for n in range(args.warmup_passes)]
        ray.init(num_cpus=os.cpu_count(), include_dashboard=False, log_to_driver=False)
        try:
            serve.start(http_options={"host": "127.0.0.1", "port": args.port})
            for index, (replicas, routing) in enumerate(SETUPS):
                engine = EngineConfig.of(max_loras=args.max_loras, max_lora_rank=8, max_num_seqs=64)
                server = ServerConfig(data_dir=Path(tmp) / "node", db_url=db, admin_token=TOKEN, register_samples=False)
                cpus = (os.cpu_count() or 2) / replicas
                app_name = f"bench-{index}"  # a board of its own: no stale posts of the last setup's replicas
                serve.run(cluster_app(engine, server, replicas, cpus, 0, app_name, routing), name=app_name)
                wait_for_replicas(url, replicas)
                if index == 0:
                    upload_all(url, paths)
                results.append(run_setup(url, replicas, routing, warmups, requests, args))
                print(row(results[-1]), flush=True)
                serve.delete(app_name)
        finally:
            serve.shutdown()
            ray.shutdown()
    body = render(results, args)
    print(body)
    if not args.quick:
        write_section(args.output, SECTION, body)


def build_requests(base, args: argparse.Namespace, seed: int) -> list[Request]:
    prompts = prompt_token_ids(base.tokenizer, "chat", args.requests, seed)
    chosen = assign_adapters("zipf", args.requests, args.adapters, seed, args.zipf_alpha)
    times = arrival_times(args.requests, args.rate, seed=seed)
    return [Request(t, p, f"adapter-{k}", args.output_len) for t, p, k in zip(times, prompts, chosen, strict=True)]


def pool(url: str) -> list[dict]:
    answer = httpx.get(f"{url}/admin/pool", headers={"Authorization": f"Bearer {TOKEN}"}, timeout=30)
    return answer.json()["replicas"] if answer.status_code == 200 else []


def wait_for_replicas(url: str, count: int, timeout: float = 180) -> None:
    deadline = time.monotonic() + timeout
    while len(pool(url)) != count:
        if time.monotonic() > deadline:
            raise RuntimeError(f"{count} replicas did not come up within {timeout} s")
        time.sleep(1)


def upload_all(url: str, paths: list[Path]) -> None:
    client = AdminClient(url, TOKEN)
    start = time.perf_counter()
    for path in paths:
        client.upload(path.name, path, None, None)
    print(f"uploaded {len(paths)} adapters in {time.perf_counter() - start:.0f} s", flush=True)


def run_setup(
    url: str, replicas: int, routing: str, warmups: list[list[Request]], requests: list[Request],
    args: argparse.Namespace,
) -> SetupResult:  # fmt: skip
    """The measured pass, after unmeasured passes of other draws from the same popularity: the slots then hold what
    a service that has been running holds, not what a cold start does (every adapter's first request loads it,
    whatever the routing); adapters of the tail the warm-up did not draw still load."""
    for warmup in warmups:
        run_load(url, warmup, args.rate, SLO(1.0, 0.1))
    time.sleep(BOARD_SECONDS)
    loads_before = sum(p["adapter_loads"] for p in pool(url))
    report = run_load(url, requests, args.rate, SLO(1.0, 0.1))
    time.sleep(BOARD_SECONDS)
    return SetupResult(replicas, routing, report, sum(p["adapter_loads"] for p in pool(url)) - loads_before)


def row(result: SetupResult) -> str:
    report = result.report
    count = len(report.results)
    ttft = report.percentiles("ttft")
    hit = max(0.0, 1 - result.loads / count)
    return (
        f"| {result.replicas} | {result.routing} | {report.tokens_per_s:.0f} | {ttft[0] * 1e3:.0f} | "
        f"{ttft[2] * 1e3:.0f} | {report.failures} | {100 * result.loads / count:.1f} | {hit:.0%} |"
    )


def render(results: list[SetupResult], args: argparse.Namespace) -> str:
    return "\n".join(
        [
            "## A cluster: one replica against two, affinity routing against random",
            "",
            f"Command: `{reproduce_command('benchmarks.cluster')}`. Machine: {machine_description()}.",
            "",
            f"{args.adapters} adapters (rank 8, q/v), Zipf({args.zipf_alpha}) popularity, {args.requests} requests "
            f"at {args.rate:g}/s (Poisson), {args.output_len} tokens each, greedy, streamed through the ingress; "
            f"{args.max_loras} device slots per replica; the replicas share this machine's cores; measured after "
            f"{args.warmup_passes} unmeasured pass(es) of "
            f"{'the same requests' if args.warmup_same else 'another draw of as many requests'}.",
            "",
            "| replicas | routing | tokens/s | TTFT p50 ms | TTFT p99 ms | failed | adapter loads / 100 requests | "
            "affinity hit rate |",
            "|---:|---|---:|---:|---:|---:|---:|---:|",
            *(row(result) for result in results),
        ]
    )


if __name__ == "__main__":
    main()
