"""Speculative decoding by prompt lookup against plain decoding, in the same run: TPOT and tokens/s.

    python -m benchmarks.bench_speculative            # writes its section of docs/benchmarks/speculative.md
    python -m benchmarks.bench_speculative --quick    # smoke run, nothing written

Two workloads of chat prompts on the default model, greedy (in float32 both systems write the same
tokens; in bfloat16 a verification step's kernels round differently from a decode step's, so a few
answers part ways, as they do after a preemption's recompute):
- drafts hit: rewrite or copy a given text, and chats that ask to repeat an earlier turn;
- drafts miss: open questions, whose answers quote nothing.
At batch B (1, 4, 16) B requests run together (max_num_seqs = B), each for at most 128 tokens, one
batch after another over the workload's prompts. TPOT = (end - first token) / (tokens - 1) per
request, median; tokens/s = output tokens / wall time. Acceptance = kept drafts / drafts verified.
Each engine first runs the workload once untimed: a server's steady state, in which the step costs
that decide whether drafts pay for themselves are measured (a fresh engine drafts for its first
few dozen steps before it knows them).
"""

from __future__ import annotations

import argparse
import statistics
import time

from benchmarks.engines import engine_over
from benchmarks.report import (
    add_model_flags,
    add_report_flags,
    machine_description,
    median_spread,
    model_config_of,
    page,
    reproduce_command,
    write_section,
)
from loraserve import LLM, SamplingParams
from loraserve.engine.chat import Conversation
from loraserve.models import LoadedModel, load_model
from loraserve.models.dtypes import dtype_name

SECTION = "speculative-decoding"
K = 4

TEXTS = [
    "The old lighthouse stood on the cliff for two hundred years. Every night its keeper climbed the ninety "
    "steps, trimmed the wick and watched the ships pass safely into the harbour below.",
    "To make bread, mix flour, water, salt and yeast. Knead the dough for ten minutes, let it rise for an "
    "hour, shape it into a loaf, and bake it in a hot oven until the crust is brown.",
    "The meeting is moved to Thursday at three in the afternoon, in room twelve on the second floor. Please "
    "bring the quarterly report and the budget figures for the new office.",
    "Our return policy is simple: any item may be returned within thirty days with its receipt, in its "
    "original packaging, for a full refund or an exchange.",
]
ASKS = [
    "Rewrite the following text exactly as it is, word for word:\n\n{text}",
    "Copy this paragraph without changing anything:\n\n{text}",
]
OPEN_QUESTIONS = [
    "What would you do with a free afternoon in a new city?",
    "Invent a new board game and explain how to win it.",
    "Why do people enjoy music?",
    "Describe an imaginary animal that lives in the desert.",
    "What makes a good teacher?",
    "Tell me about a dream you might have had.",
    "How could a small town attract more visitors?",
    "Write a short story about a robot who learns to paint.",
]


def hit_workload(count: int) -> list[Conversation]:
    conversations: list[Conversation] = []
    for i in range(count):
        text = TEXTS[i % len(TEXTS)]
        if i % 3 == 2:  # a chat that quotes an earlier turn
            conversations.append([
                {"role": "user", "content": f"Remember this note: {text}"},
                {"role": "assistant", "content": "I will remember it."},
                {"role": "user", "content": "Repeat the note I gave you, word for word."},
            ])  # fmt: skip
        else:
            conversations.append([{"role": "user", "content": ASKS[i % len(ASKS)].format(text=text)}])
    return conversations


def miss_workload(count: int) -> list[Conversation]:
    return [[{"role": "user", "content": OPEN_QUESTIONS[i % len(OPEN_QUESTIONS)]}] for i in range(count)]


def run_batches(llm: LLM, conversations: list[Conversation], batch: int, max_tokens: int) -> tuple[float, float, int]:
    """(median TPOT in seconds, tokens/s, output tokens), the conversations run `batch` at a time."""
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens)
    tpots, tokens, start = [], 0, time.perf_counter()
    for first in range(0, len(conversations), batch):
        for output in llm.chat(conversations[first : first + batch], params, use_tqdm=False):
            count, timings = len(output.outputs[0].token_ids), output.timings
            tokens += count
            if count > 1 and timings.e2e is not None and timings.ttft is not None:
                tpots.append((timings.e2e - timings.ttft) / (count - 1))
    return statistics.median(tpots), tokens / (time.perf_counter() - start), tokens


def measure(
    loaded: LoadedModel, batch: int, workload: list[Conversation], repeats: int, max_tokens: int
) -> dict[str, object]:
    """Both systems on one workload at one batch size, alternating, each repeat on a fresh prefix cache."""
    llms = {k: LLM.from_engine(engine_over(loaded, batch, max_loras=0, speculative_tokens=k)) for k in (0, K)}
    try:
        for llm in llms.values():  # warm-up: kernels built, the step costs drafting weighs against learnt
            run_batches(llm, workload, batch, max_tokens)
        runs: dict[int, list[tuple[float, float, int]]] = {0: [], K: []}
        for _ in range(repeats):
            for k, llm in llms.items():
                llm.reset_prefix_cache()
                runs[k].append(run_batches(llm, workload, batch, max_tokens))
        counts = llms[K].engine.scheduler.speculation.by_adapter.get("")
    finally:
        for llm in llms.values():
            llm.engine.close()
    return {"runs": runs, "counts": counts}


def row(label: str, batch: int, result: dict[str, object]) -> str:
    runs = result["runs"]
    assert isinstance(runs, dict)
    tpot = {k: [r[0] * 1e3 for r in v] for k, v in runs.items()}
    rate = {k: [r[1] for r in v] for k, v in runs.items()}
    counts = result["counts"]
    acceptance = "no drafts" if counts is None or not counts.drafted else f"{counts.accepted / counts.drafted:.0%}"
    return (
        f"| {label} | {batch} | {median_spread(tpot[0])} | {median_spread(tpot[K])} | "
        f"{statistics.median(tpot[0]) / statistics.median(tpot[K]):.2f}x | {median_spread(rate[0])} | "
        f"{median_spread(rate[K])} | {statistics.median(rate[K]) / statistics.median(rate[0]):.2f}x | {acceptance} |"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 4, 16])
    parser.add_argument("--prompts", type=int, default=16, help="conversations per workload")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--max-tokens", type=int, default=128)
    add_model_flags(parser)
    add_report_flags(parser)
    args = parser.parse_args()
    args.output = args.output or page("speculative")
    if args.quick:
        args.batch_sizes, args.prompts, args.repeats, args.max_tokens = [2], 2, 1, 16
    loaded = load_model(model_config_of(args))
    rows = []
    for label, make in (("drafts hit (rewrite, quote)", hit_workload), ("drafts miss (open questions)", miss_workload)):
        for batch in args.batch_sizes:
            result = measure(loaded, batch, make(max(args.prompts, batch)), args.repeats, args.max_tokens)
            rows.append(row(label, batch, result))
            print(rows[-1], flush=True)
    body = "\n".join(
        [
            "## Speculative decoding (prompt lookup)",
            "",
            f"Command: `{reproduce_command('benchmarks.bench_speculative')}`. Machine: {machine_description()}.",
            "",
            f"{dtype_name(loaded.dtype)}, the default model, greedy, at most {args.max_tokens} tokens per request, "
            f"`--speculative ngram --speculative-tokens {K}` (n-grams of 2 to 4 tokens) against plain decoding in "
            f"the same run, alternating, median of {args.repeats} (min-max). {max(args.prompts, 1)} chat prompts "
            "per workload, run `batch` at a time. Acceptance: drafts kept / drafts verified.",
            "",
            "| workload | batch | TPOT ms, plain | TPOT ms, speculative | TPOT lower by | tok/s, plain "
            "| tok/s, speculative | throughput ratio | acceptance |",
            "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
            *rows,
        ]
    )
    print(body)
    if not args.quick:
        write_section(args.output, SECTION, body)


if __name__ == "__main__":
    main()
