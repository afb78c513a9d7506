"""Sliding windows: how many chats of a given length run together in a fixed number of pages, with the KV
blocks behind the window going back to the pool and with every block held to the end (as before the release).

    python -m benchmarks.bench_sliding_window            # writes its section of docs/benchmarks/sliding-window.md
    python -m benchmarks.bench_sliding_window --quick    # smoke run, nothing written

A random Mistral v0.1 with every layer windowed, shrunk to 2 layers of width 64: a page is one block of
`--block-size` tokens whatever the model, so what fits is the model's window and the chat's length alone.
N chats of distinct prompts, `--prompt-tokens` each, generate the rest of their length (greedy, EOS ignored),
all submitted at once with max_num_seqs = N. The pool holds N when all N run in one step and none is
preempted; the largest such N is found by walking from the block count's estimate until N holds and N + 1
does not. The throughput is the held run's, on this CPU: CPU time per step, not memory, bounds it here.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from transformers import MistralConfig

from benchmarks.random_model import copy_tokenizer
from benchmarks.report import add_report_flags, machine_description, page, reproduce_command, write_section
from loraserve.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig, default_cache_dir
from loraserve.engine import LLMEngine, SamplingParams
from loraserve.models import LoadedModel, load_model
from loraserve.models.default_model import default_model_dir

SECTION = "sliding-window"


@dataclass(frozen=True)
class Setting:
    window: int
    block_size: int
    num_pages: int
    prompt_tokens: int


@dataclass
class Capacity:
    chats: int  # the most that run together, no preemption
    tokens_per_s: float  # output tokens per second of that run


def windowed_model(window: int, max_positions: int) -> LoadedModel:
    """A random Mistral v0.1 whose 2 layers attend to the last `window` positions, with the embedded tokenizer."""
    directory = Path(tempfile.mkdtemp(prefix="windowed-"))
    MistralConfig(
        vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=max_positions, sliding_window=window,
    ).save_pretrained(directory)  # fmt: skip
    copy_tokenizer(default_model_dir(default_cache_dir()), directory)
    return load_model(ModelConfig(model=str(directory), dtype="float32", random_weights=True))


def run_chats(loaded: LoadedModel, setting: Setting, chat_tokens: int, count: int, release: bool) -> float | None:
    """Output tokens per second when `count` chats run together without a preemption; None when they do not."""
    config = EngineConfig(
        model=ModelConfig(dtype="float32"),
        cache=CacheConfig(block_size=setting.block_size, num_pages=setting.num_pages),
        scheduler=SchedulerConfig(max_num_seqs=count),
    )
    engine = LLMEngine(config, loaded=loaded)
    if not release:
        engine.block_manager.window = None  # no block is behind a window: each is held until its chat ends
    try:
        params = SamplingParams(temperature=0.0, max_tokens=chat_tokens - setting.prompt_tokens, ignore_eos=True)
        vocab = loaded.model.spec.vocab_size
        for i in range(count):  # distinct from the first token: no prefix is shared
            engine.add_request(str(i), [(i * 7919 + j * 104729) % vocab for j in range(setting.prompt_tokens)], params)
        most_running, start = 0, time.perf_counter()
        while engine.has_unfinished_requests() and engine.scheduler.num_preemptions == 0:
            engine.step()
            most_running = max(most_running, len(engine.scheduler.running))
        seconds = time.perf_counter() - start
    finally:
        engine.close()
    if engine.scheduler.num_preemptions or most_running < count:
        return None
    return count * params.max_tokens / seconds


def capacity(loaded: LoadedModel, setting: Setting, chat_tokens: int, release: bool) -> Capacity:
    """The most chats of `chat_tokens` that run together: walked from what the pages hold at each chat's peak."""
    blocks = -(-chat_tokens // setting.block_size)
    if release:  # the blocks the window reaches, and the one the next token is written to
        blocks = min(blocks, -(-setting.window // setting.block_size) + 1)
    count = max(1, setting.num_pages // blocks)
    held = run_chats(loaded, setting, chat_tokens, count, release)
    while held is None and count > 1:
        count -= 1
        held = run_chats(loaded, setting, chat_tokens, count, release)
    while held is not None and (more := run_chats(loaded, setting, chat_tokens, count + 1, release)) is not None:
        count, held = count + 1, more
    assert held is not None, "not even one chat runs"
    return Capacity(count, held)


def render(setting: Setting, results: dict[int, dict[bool, Capacity]]) -> str:
    lines = [
        "## Sliding windows: chats held in a fixed pool",
        "",
        f"Command: `{reproduce_command('benchmarks.bench_sliding_window')}`. Machine: {machine_description()}.",
        "",
        f"A random Mistral v0.1 (every layer's window {setting.window} tokens; 2 layers of width 64: a page is a "
        f"block of {setting.block_size} tokens whatever the model), {setting.num_pages} pages "
        f"({setting.num_pages * setting.block_size} tokens of KV). Chats of {setting.prompt_tokens} prompt tokens "
        "generating the rest of their length, greedy, all submitted at once; held: all run together, none "
        "preempted. Output tok/s of the held run, float32 on the CPU.",
        "",
        "| chat tokens | chats held, every block kept | chats held, blocks behind the window released | "
        "gain | output tok/s, kept | output tok/s, released |",
        "|---:|---:|---:|---:|---:|---:|",
    ]
    for chat_tokens, by_release in results.items():
        kept, released = by_release[False], by_release[True]
        lines.append(
            f"| {chat_tokens} | {kept.chats} | {released.chats} | {released.chats / kept.chats:.1f}x | "
            f"{kept.tokens_per_s:.0f} | {released.tokens_per_s:.0f} |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--window", type=int, default=256)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--pages", type=int, default=256)
    parser.add_argument("--prompt-tokens", type=int, default=128)
    parser.add_argument("--chat-tokens", default="512,1024,2048", help="comma-separated chat lengths")
    add_report_flags(parser)
    args = parser.parse_args()
    args.output = args.output or page(SECTION)
    if args.quick:
        args.window, args.block_size, args.pages, args.prompt_tokens, args.chat_tokens = 16, 4, 24, 8, "48"
    setting = Setting(args.window, args.block_size, args.pages, args.prompt_tokens)
    lengths = [int(length) for length in args.chat_tokens.split(",")]
    loaded = windowed_model(args.window, max(lengths))
    results: dict[int, dict[bool, Capacity]] = {}
    for chat_tokens in lengths:
        results[chat_tokens] = {release: capacity(loaded, setting, chat_tokens, release) for release in (False, True)}
        print(f"{chat_tokens} tokens: {results[chat_tokens]}", flush=True)
    report = render(setting, results)
    print(report)
    if not args.quick:
        write_section(args.output, SECTION, report)


if __name__ == "__main__":
    main()
