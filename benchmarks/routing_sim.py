"""Routing many replicas by adapter, on paper: a discrete-event simulation of a cluster.

    python -m benchmarks.routing_sim            # measures the engine, simulates, writes its section and a plot
    python -m benchmarks.routing_sim --quick    # 10 replicas x 1,000 adapters, assumed costs, nothing written

Each replica is one engine: a continuous batch of at most `--max-batch` sequences and
`--slots` adapter slots (a cold adapter takes the least recently used idle slot, loading in
`load` seconds; a request whose adapter finds every slot busy waits while later requests
start). A request's service is its prefill, then its tokens at the decode step time of the
batch it joins: `fixed + per_sequence x batch` seconds a step, `per_prompt_token` a prompt
token. Those costs and `load` are measured on this machine's engine first (its own step-cost
fit, engine/step_costs.py, over a mixed-adapter run; the mean adapter load), so the cluster
is many copies of this engine. Adapters have Zipf popularity; arrivals are bursty (Gamma
gaps with a coefficient of variation of 2) at `--load` of the cluster's capacity.

Policies: random; least-loaded (fewest running + waiting); adapter-affinity: the least
loaded replica holding the adapter while it has room in its batch, else the less loaded of
two random replicas (power of two choices) - what a router sees through each replica's
vllm:lora_requests_info and queue gauges.
"""

from __future__ import annotations

import argparse
import heapq
import itertools
import random
import statistics
import tempfile
from collections import OrderedDict, deque
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from benchmarks.plots import bars_by_label
from benchmarks.report import add_report_flags, machine_description, page, reproduce_command, write_section
from benchmarks.workloads import arrival_times, assign_adapters


@dataclass(frozen=True)
class Costs:
    fixed: float  # seconds of a decode step, whatever the batch
    per_sequence: float  # and per sequence in it
    per_prompt_token: float
    load: float  # seconds to bring a cold adapter into a slot


ASSUMED = Costs(fixed=0.011, per_sequence=0.00115, per_prompt_token=0.0003, load=0.05)  # --quick only


@dataclass(frozen=True, eq=False)  # by identity: two alike requests are still two
class Request:
    arrival: float
    adapter: int
    output_tokens: int


@dataclass
class Replica:
    running: int = 0
    waiting: deque[Request] = field(default_factory=deque)
    adapters: OrderedDict[int, int] = field(default_factory=OrderedDict)  # adapter -> running requests; LRU first
    served: int = 0

    @property
    def load(self) -> int:
        return self.running + len(self.waiting)


@dataclass
class Outcome:
    loads_per_1000: float
    imbalance: float  # the busiest replica's requests / the mean
    queue_p99: float  # arrival to the start of its prefill or adapter load: waiting for a batch place or a slot
    wait_p99: float  # arrival to the first prefill step, adapter load included


Policy = Callable[[list[Replica], int, random.Random], int]


def random_policy(replicas: list[Replica], adapter: int, rng: random.Random) -> int:
    return rng.randrange(len(replicas))


def least_loaded(replicas: list[Replica], adapter: int, rng: random.Random) -> int:
    return min(range(len(replicas)), key=lambda i: (replicas[i].load, rng.random()))


def affinity(max_batch: int) -> Policy:
    """The least loaded replica holding the adapter while it has room in its batch; else power of two choices."""

    def pick(replicas: list[Replica], adapter: int, rng: random.Random) -> int:
        holding = [i for i, r in enumerate(replicas) if adapter in r.adapters and r.load < max_batch]
        if holding:
            return min(holding, key=lambda i: replicas[i].load)
        first, second = rng.sample(range(len(replicas)), 2)
        return first if replicas[first].load <= replicas[second].load else second

    return pick


def policies(max_batch: int) -> dict[str, Policy]:
    return {"random": random_policy, "least-loaded": least_loaded, "affinity + p2c": affinity(max_batch)}


def simulate(
    policy: Policy,
    requests: list[Request],
    num_replicas: int,
    max_batch: int,
    slots: int,
    prompt_tokens: int,
    costs: Costs,
    seed: int,
) -> Outcome:
    rng = random.Random(seed)
    replicas = [Replica() for _ in range(num_replicas)]
    done: list[tuple[float, int, int, Request]] = []  # (finish time, tie-break, replica, request)
    tie = itertools.count()
    loads, queued, waits = 0, [], []

    def start_what_fits(index: int, now: float) -> None:
        nonlocal loads
        replica = replicas[index]
        for request in list(replica.waiting):
            if replica.running >= max_batch:
                return
            cold = request.adapter not in replica.adapters
            if cold:
                idle = [a for a, users in replica.adapters.items() if users == 0]
                if len(replica.adapters) >= slots and not idle:
                    continue  # every slot busy: it waits, later requests may start
                if len(replica.adapters) >= slots:
                    del replica.adapters[idle[0]]
                loads += 1
            replica.waiting.remove(request)
            replica.adapters[request.adapter] = replica.adapters.get(request.adapter, 0) + 1
            replica.adapters.move_to_end(request.adapter)
            replica.running += 1
            load = costs.load if cold else 0.0
            queued.append(now - request.arrival)
            waits.append(now - request.arrival + load)
            step = costs.fixed + costs.per_sequence * replica.running
            service = load + costs.per_prompt_token * prompt_tokens + request.output_tokens * step
            heapq.heappush(done, (now + service, next(tie), index, request))

    for request in requests:
        while done and done[0][0] <= request.arrival:
            finished_at, _, index, finished = heapq.heappop(done)
            finish(replicas[index], finished)
            start_what_fits(index, finished_at)
        index = policy(replicas, request.adapter, rng)
        replicas[index].waiting.append(request)
        replicas[index].served += 1
        start_what_fits(index, request.arrival)
    while done:
        finished_at, _, index, finished = heapq.heappop(done)
        finish(replicas[index], finished)
        start_what_fits(index, finished_at)
    served = [r.served for r in replicas]
    return Outcome(
        loads_per_1000=1000 * loads / len(requests),
        imbalance=max(served) / statistics.mean(served),
        queue_p99=p99(queued),
        wait_p99=p99(waits),
    )


def p99(values: list[float]) -> float:
    return sorted(values)[int(0.99 * (len(values) - 1))]


def finish(replica: Replica, request: Request) -> None:
    replica.running -= 1
    replica.adapters[request.adapter] -= 1


def workload(num_requests: int, num_adapters: int, rate: float, output_mean: int, seed: int) -> list[Request]:
    rng = random.Random(seed)
    times = arrival_times(num_requests, rate, cv=2.0, seed=seed)
    adapters = assign_adapters("zipf", num_requests, num_adapters, seed=seed + 1)
    lengths = [1 + int(rng.expovariate(1 / output_mean)) for _ in range(num_requests)]
    return [Request(t, a, n) for t, a, n in zip(times, adapters, lengths, strict=True) if a is not None]


def capacity(costs: Costs, max_batch: int, prompt_tokens: int, output_mean: int) -> float:
    """Requests a second one full replica finishes."""
    step = costs.fixed + costs.per_sequence * max_batch
    return max_batch / (costs.per_prompt_token * prompt_tokens + output_mean * step)


def measure_costs(num_adapters: int = 16, num_requests: int = 96) -> Costs:
    """This machine's engine: its fitted step costs over a run of mixed adapters and batch sizes, and its
    mean adapter load (read, check, copy into a slot)."""
    from benchmarks.engines import engine_over
    from benchmarks.random_adapters import write_random_adapters
    from loraserve import SamplingParams
    from loraserve.config import ModelConfig
    from loraserve.models import load_model

    loaded = load_model(ModelConfig())
    engine = engine_over(loaded, max_num_seqs=64)
    with tempfile.TemporaryDirectory() as scratch:
        for i, path in enumerate(write_random_adapters(loaded.model.spec, num_adapters, Path(scratch))):
            engine.add_adapter(f"adapter-{i}", path)
        rng = random.Random(0)
        for i in range(num_requests):  # staggered lengths: the batch shrinks as they finish, so the fit sees sizes
            params = SamplingParams(max_tokens=8 + (i % 8) * 8, ignore_eos=True)
            prompt = [rng.randrange(100, 10_000) for _ in range(60)]
            engine.add_request(f"r{i}", prompt, params, adapter=f"adapter-{i % num_adapters}")
        while engine.has_unfinished_requests():
            engine.step()
        costs, stats = engine.scheduler.costs, engine.adapters.stats
        engine.close()
    fixed = costs.decode_seconds(0) - (costs.decode_seconds(2) - costs.decode_seconds(1))
    per_sequence = costs.decode_seconds(2) - costs.decode_seconds(1)
    return Costs(fixed, per_sequence, costs.prompt_seconds(1), stats.load_seconds_total / max(1, stats.loads))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--replicas", type=int, default=100)
    parser.add_argument("--adapters", type=int, default=10_000)
    parser.add_argument("--requests", type=int, default=200_000)
    parser.add_argument("--loads", default="0.7,0.95", help="mean arrival rates as shares of capacity")
    parser.add_argument("--max-batch", type=int, default=64)
    parser.add_argument("--slots", type=int, default=32, help="adapter slots per replica (--max-loras)")
    parser.add_argument("--prompt-tokens", type=int, default=60)
    parser.add_argument("--output-tokens", type=int, default=64, help="mean (exponential)")
    add_report_flags(parser)
    args = parser.parse_args(argv)
    args.output = args.output or page("cluster")
    if args.quick:
        args.replicas, args.adapters, args.requests = 10, 1000, 5000
    costs = ASSUMED if args.quick else measure_costs()
    full = args.replicas * capacity(costs, args.max_batch, args.prompt_tokens, args.output_tokens)
    shape = (args.replicas, args.max_batch, args.slots, args.prompt_tokens, costs)
    outcomes: dict[str, Outcome] = {}
    for share in (float(x) for x in args.loads.split(",")):
        requests = workload(args.requests, args.adapters, share * full, args.output_tokens, seed=0)
        for name, policy in policies(args.max_batch).items():
            outcomes[f"{name}, {share:.0%}"] = simulate(policy, requests, *shape, seed=1)
    rows = [
        f"| {label} | {o.loads_per_1000:.0f} | {o.imbalance:.2f} | {o.queue_p99 * 1000:.0f} | {o.wait_p99 * 1000:.0f} |"
        for label, o in outcomes.items()
    ]
    body = "\n".join([
        "## Routing across replicas, simulated",
        "",
        f"Command: `{reproduce_command('benchmarks.routing_sim')}`. Costs measured on {machine_description()}: "
        f"decode step {costs.fixed * 1000:.1f} ms + {costs.per_sequence * 1000:.2f} ms a sequence, "
        f"{costs.per_prompt_token * 1000:.2f} ms a prompt token, {costs.load * 1000:.0f} ms an adapter load.",
        "",
        f"{args.replicas} replicas (batch {args.max_batch}, {args.slots} adapter slots each), {args.adapters:,} "
        f"adapters with Zipf(1.0) popularity, {args.requests:,} requests of {args.prompt_tokens} prompt tokens and "
        f"{args.output_tokens} output tokens on average, bursty arrivals (Gamma gaps, CV 2) at a share of the "
        f"cluster's capacity ({full:,.0f} requests/s).",
        "",
        "| routing, load | adapter loads per 1,000 requests | imbalance (max / mean requests) "
        "| queueing p99 (ms) | wait p99, load included (ms) |",
        "|---|---:|---:|---:|---:|",
        *rows,
        "",
        "![Adapter loads and p99 waits by routing](routing-sim.png)",
    ])  # fmt: skip
    print(body)
    if not args.quick:
        write_section(args.output, "routing-sim", body)
        panels = {
            "adapter loads per 1,000 requests": {n: o.loads_per_1000 for n, o in outcomes.items()},
            "queueing p99 (ms)": {n: o.queue_p99 * 1000 for n, o in outcomes.items()},
            "wait p99, adapter load included (ms)": {n: o.wait_p99 * 1000 for n, o in outcomes.items()},
        }
        subtitle = f"{args.replicas} replicas x {args.adapters:,} adapters, Zipf(1.0), bursty arrivals"
        bars_by_label(panels, args.output.parent / "routing-sim.png", subtitle)


if __name__ == "__main__":
    main()
