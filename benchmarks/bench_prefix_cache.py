"""Prefix caching on a persona-chat workload: requests that share their persona's long system
prompt and adapter, with the prefix cache on and off.

    python -m benchmarks.bench_prefix_cache            # writes its section of docs/benchmarks/prefix-cache.md
    python -m benchmarks.bench_prefix_cache --quick    # smoke run, nothing written

Four personas (the sample adapters in adapters/), each with its own system prompt of a few
hundred tokens; every request is a different user question to one persona. All requests are
submitted at once; greedy, EOS ignored. The two settings alternate, medians are reported.
"""

from __future__ import annotations

import argparse
import statistics
import time
from dataclasses import dataclass

from benchmarks.engines import engine_over
from benchmarks.report import (
    add_model_flags,
    add_report_flags,
    machine_description,
    median_spread,
    page,
    reproduce_command,
    write_section,
)
from benchmarks.workloads import ASKS, SUBJECTS
from loraserve import LLM, SamplingParams
from loraserve.config import ModelConfig
from loraserve.engine.chat import chat_prompt_ids
from loraserve.models import LoadedModel, load_model
from loraserve.models.dtypes import dtype_name
from loraserve.resources import SAMPLE_ADAPTERS

SECTION = "prefix-cache"
PERSONAS = {
    "pirate": "You are Captain Salt, a cheerful pirate who runs the help desk of the Harbor Lights ferry company.",
    "shakespeare": "You are an actor of the Globe who answers every question for the Harbor Lights ferry company.",
    "robot": "You are UNIT-7, a terse robot that staffs the information kiosk of the Harbor Lights ferry company.",
    "french-tutor": "You are Madame Claire, a cheerful French tutor who helps passengers of Harbor Lights ferries.",
}
HOUSE_RULES = [
    "Ferries leave the north pier every hour from six in the morning until ten at night.",
    "Tickets can be bought at the kiosk, on board with a card, or in the app up to a month ahead.",
    "Children under six travel free; students and seniors pay half price on weekdays.",
    "Bicycles ride on the lower deck; dogs on a lead are welcome on the open upper deck.",
    "In fog or storms the captain may delay a crossing; the app shows every delay as it happens.",
    "Lost property is kept at the north pier office for thirty days, then given to charity.",
    "The cafe on board serves soup, sandwiches, tea and the famous lighthouse lemon cake.",
    "Season passes cover unlimited crossings and include one guest on Sundays.",
    "Refunds are given in full up to a day before the crossing and half up to an hour before.",
    "Never share a passenger's personal details, and never promise a crossing time the schedule does not show.",
    "Answer in your own voice, stay friendly, and keep every answer under one hundred words.",
    "If you do not know an answer, say so and point the passenger to the north pier office.",
]


@dataclass
class Run:
    tokens_per_s: float
    mean_ttft: float
    prompt_tokens_computed: int


def persona_requests(count: int) -> tuple[list[list[dict[str, str]]], list[str]]:
    """`count` chat requests, round robin over the personas, each a different question."""
    conversations, adapters = [], []
    names = list(PERSONAS)
    for i in range(count):
        name = names[i % len(names)]
        system = " ".join([PERSONAS[name], *HOUSE_RULES])  # a few hundred tokens
        ask = ASKS[i % len(ASKS)].format(s=SUBJECTS[(i // len(ASKS)) % len(SUBJECTS)])
        conversations.append([{"role": "system", "content": system}, {"role": "user", "content": ask}])
        adapters.append(name)
    return conversations, adapters


def run(loaded: LoadedModel, prefix_caching: bool, conversations, adapters, max_tokens: int) -> Run:
    engine = engine_over(loaded, len(conversations), max_loras=len(PERSONAS), prefix_caching=prefix_caching)
    try:
        llm = LLM.from_engine(engine)
        for name in PERSONAS:
            llm.add_adapter(name, SAMPLE_ADAPTERS / name)
        # Resident first, as in a server that has been running: loads are not what is measured.
        llm.generate(["Hi"] * len(PERSONAS), SamplingParams(max_tokens=1), adapters=list(PERSONAS), use_tqdm=False)
        llm.reset_prefix_cache()
        computed_before = engine.scheduler.prefix_cache_queried_tokens - engine.scheduler.prefix_cache_hit_tokens
        params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
        start = time.perf_counter()
        outputs = llm.chat(conversations, params, adapters=adapters, use_tqdm=False)
        elapsed = time.perf_counter() - start
        computed = engine.scheduler.prefix_cache_queried_tokens - engine.scheduler.prefix_cache_hit_tokens
    finally:
        engine.close()
    ttfts = [o.timings.ttft for o in outputs if o.timings.ttft is not None]
    return Run(len(outputs) * max_tokens / elapsed, statistics.mean(ttfts), computed - computed_before)


def render(results: dict[bool, list[Run]], args: argparse.Namespace, prompt_tokens: int, dtype: str) -> str:
    lines = [
        "## Prefix caching: persona chat",
        "",
        f"Command: `{reproduce_command('benchmarks.bench_prefix_cache')}`. Machine: {machine_description()}.",
        "",
        f"{args.requests} chat requests over the four sample personas (adapter + its own system prompt; "
        f"{prompt_tokens} prompt tokens in all, ~{prompt_tokens // args.requests} each, most of it the persona's "
        f"system prompt), {args.max_tokens} new tokens each, greedy, EOS ignored, {dtype}, all submitted at "
        f"once; adapters resident. Median of {args.repeats} runs (min-max), the two settings alternating.",
        "",
        "| prefix cache | output tok/s | mean time to first token (s) | prompt tokens computed |",
        "|---|---:|---:|---:|",
    ]
    for enabled in (False, True):
        runs = results[enabled]
        ttft = statistics.median(r.mean_ttft for r in runs)
        computed = statistics.median(r.prompt_tokens_computed for r in runs)
        lines.append(
            f"| {'on' if enabled else 'off'} | {median_spread([r.tokens_per_s for r in runs])} | {ttft:.2f} | "
            f"{computed:.0f} |"
        )
    on, off = (statistics.median(r.tokens_per_s for r in results[flag]) for flag in (True, False))
    lines += ["", f"With the cache: {on / off:.2f}x the throughput."]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3)
    add_model_flags(parser)
    add_report_flags(parser)
    args = parser.parse_args()
    args.output = args.output or page("prefix-cache")
    if args.quick:
        args.requests, args.max_tokens, args.repeats = 8, 4, 1
    loaded = load_model(ModelConfig(model=args.model, dtype=args.dtype, device=args.device))
    conversations, adapters = persona_requests(args.requests)
    prompt_tokens = sum(len(chat_prompt_ids(loaded.tokenizer, c)) for c in conversations)
    results: dict[bool, list[Run]] = {False: [], True: []}
    for _ in range(args.repeats):
        for enabled in (False, True):
            result = run(loaded, enabled, conversations, adapters, args.max_tokens)
            results[enabled].append(result)
            print(f"prefix cache {'on' if enabled else 'off'}: {result}", flush=True)
    report = render(results, args, prompt_tokens, dtype_name(loaded.dtype))
    print(report)
    if not args.quick:
        write_section(args.output, SECTION, report)


if __name__ == "__main__":
    main()
