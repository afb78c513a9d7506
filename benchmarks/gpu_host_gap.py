"""Where a decode step's time goes on a CUDA GPU: the captured graph replayed alone (GPU time)
against the engine's whole step (GPU plus the host's scheduling, sampling and input filling), at
batch 1 and at batch 64 with and without 32 adapters of rank 16, then the kernels of one LoRA replay.

    python -m benchmarks.random_model --shapes llama3-8b /tmp/llama3-8b
    python -m benchmarks.gpu_host_gap /tmp/llama3-8b

Prints its figures (docs/benchmarks/gpu.md quotes them in its hand-written GPU readings).
"""

from __future__ import annotations

import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

from benchmarks.engines import engine_over
from benchmarks.random_adapters import write_random_adapters
from loraserve import LLM, SamplingParams
from loraserve.config import ModelConfig
from loraserve.models import load_model
from loraserve.models.cuda.graphs import DecodeGraphs, GraphLora

BATCH, ADAPTERS, RANK, STEPS = 64, 32, 16, 64


def generate_seconds(llm: LLM, prompts: list[list[int]], adapters: list[str | None], max_tokens: int) -> float:
    llm.reset_prefix_cache()
    torch.cuda.synchronize()
    start = time.perf_counter()
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    llm.generate(prompts, params, adapters=adapters, use_tqdm=False)
    torch.cuda.synchronize()
    return time.perf_counter() - start


def engine_step_ms(llm: LLM, prompts: list[list[int]], adapters: list[str | None]) -> float:
    """A decode step of the whole engine: (1 + STEPS tokens - 1 token) / STEPS, median of 2."""
    generate_seconds(llm, prompts, adapters, 4)  # warm-up: adapters resident
    samples = [
        (generate_seconds(llm, prompts, adapters, 1 + STEPS) - generate_seconds(llm, prompts, adapters, 1)) / STEPS
        for _ in range(2)
    ]
    return statistics.median(samples) * 1e3


def replay_ms(graphs: DecodeGraphs, bucket: int, kind: GraphLora, replays: int = 30) -> float:
    """GPU time of one replay of a captured step, over the inputs its last run left in place."""
    graph, _ = graphs._graphs[(bucket, kind)]
    graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(replays):
        graph.replay()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / replays


def main() -> None:
    loaded = load_model(ModelConfig(model=sys.argv[1], dtype="bfloat16", device="cuda", random_weights=True))
    prompts = [[(17 * i + j) % 1000 + 100 for j in range(32)] for i in range(BATCH)]
    names: list[str | None] = [f"adapter-{i % ADAPTERS}" for i in range(BATCH)]
    paths = write_random_adapters(loaded.model.spec, ADAPTERS, Path(tempfile.mkdtemp()), ranks=(RANK,))
    engine = engine_over(loaded, BATCH, max_loras=ADAPTERS, pool_bytes=8 << 30)
    try:
        llm = LLM.from_engine(engine)
        for i, path in enumerate(paths):
            llm.add_adapter(f"adapter-{i}", path)
        graphs = engine.model_runner.fused_step
        assert isinstance(graphs, DecodeGraphs), "no CUDA graphs captured"
        cases = [
            ("batch 1 base", prompts[:1], [None], 1, GraphLora.NONE),
            (f"batch {BATCH} base", prompts, [None] * BATCH, BATCH, GraphLora.NONE),
            (f"batch {BATCH} lora", prompts, names, BATCH, GraphLora.LORA),
        ]
        for label, rows, adapters, bucket, kind in cases:  # each replay reuses the inputs its case left
            step = engine_step_ms(llm, rows, adapters)
            alone = replay_ms(graphs, bucket, kind)
            print(f"{label}: engine step {step:.2f} ms, graph replay alone {alone:.2f} ms", flush=True)
        graph, _ = graphs._graphs[(BATCH, GraphLora.LORA)]
        with profile(activities=[ProfilerActivity.CUDA]) as profiler:
            for _ in range(5):
                graph.replay()
            torch.cuda.synchronize()
        print(profiler.key_averages().table(sort_by="cuda_time_total", row_limit=14, max_name_column_width=60))
    finally:
        engine.close()


if __name__ == "__main__":
    main()
