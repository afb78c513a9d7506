"""The runner side of a benchmark job: read it, time the workloads, write the result.

Standard library only: this module runs inside every peer's virtual environment.
"""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any


@dataclass(frozen=True)
class JobWorkload:
    """Requests as token ids, how many tokens each must generate, and the adapter each names (None = base)."""

    name: str
    prompts: list[list[int]]
    output_lens: list[int]
    adapters: list[str | None]

    def head(self, count: int, max_tokens: int) -> JobWorkload:
        """The first `count` requests, at most `max_tokens` each: a warm-up."""
        return JobWorkload(
            f"{self.name}-warmup",
            self.prompts[:count],
            [min(n, max_tokens) for n in self.output_lens[:count]],
            self.adapters[:count],
        )


@dataclass(frozen=True)
class Job:
    model: str  # an HF safetensors directory with its tokenizer
    dtype: str
    adapters: dict[str, str]  # name -> PEFT directory
    workloads: list[JobWorkload]
    repeats: int
    max_num_seqs: int
    max_lora_rank: int
    options: dict[str, Any]  # system-specific settings, e.g. vLLM's enable_lora

    @classmethod
    def read(cls, path: Path) -> Job:
        raw = json.loads(path.read_text())
        raw["workloads"] = [JobWorkload(**w) for w in raw["workloads"]]
        return cls(**raw)


Generate = Callable[[JobWorkload], list[list[int]]]


def run_job(setup: Callable[[Job], tuple[Generate, str]]) -> None:
    """Entry point of every runner: `setup(job)` loads the system and returns its generate function and
    version. Every workload is warmed up once (adapters loaded, lazy initialisation done), then all
    workloads run in turn, `repeats` times, each checked to produce exactly the asked lengths."""
    job_path, result_path = (Path(arg) for arg in sys.argv[1:3])
    job = Job.read(job_path)
    start = time.perf_counter()
    generate, version = setup(job)
    for workload in job.workloads:
        generate(workload.head(len(workload.prompts), 2))
    setup_seconds = time.perf_counter() - start
    seconds: dict[str, list[float]] = {w.name: [] for w in job.workloads}
    tokens: dict[str, list[list[int]]] = {}
    for repeat in range(job.repeats):
        for workload in job.workloads:
            start = time.perf_counter()
            tokens[workload.name] = generate(workload)
            seconds[workload.name].append(time.perf_counter() - start)
            lens = [len(t) for t in tokens[workload.name]]
            if lens != workload.output_lens:
                raise RuntimeError(f"{workload.name}: generated {lens}, asked {workload.output_lens}")
            rate = sum(lens) / seconds[workload.name][-1]
            print(f"  run {repeat + 1}/{job.repeats} {workload.name}: {rate:.1f} tok/s", flush=True)
    result = {"version": version, "setup_seconds": setup_seconds, "seconds": seconds, "tokens": tokens}
    result_path.write_text(json.dumps(result))
