"""Building the CPU kernels (C++ sources beside the modules that call them) with the host's compiler.

A kernel is built on first use with `$CXX`, else `c++` (a few seconds, once), for this very
CPU (-march=native; LORASERVE_CPU_MARCH=x86-64-v3 builds for AVX2 + FMA only, so an AVX-512
machine runs and tests the AVX2 paths), and kept in a cache directory under a name that hashes
the source, the flags and the CPU's features, so a changed kernel or another machine sharing
the directory gets its own build. Without a compiler `load_library` says why and returns None, and the
caller keeps to its torch path.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

# -fno-math-errno: expf and friends need not set errno, so loops over them vectorize.
FLAGS = ("-O3", "-fno-math-errno", "-fopenmp", "-shared", "-fPIC", "-std=c++17")
MARCH_VARIABLE = "LORASERVE_CPU_MARCH"


SHARED_HEADER = Path(__file__).with_name("cpu_vectors.h")  # the helpers every kernel includes


class KernelBuildError(RuntimeError):
    pass


def entry_point(function: Any) -> int:  # a loaded ctypes function
    """A loaded function's address, for native code that calls it (loraserve/models/cpu/decode_step.py)."""
    return ctypes.cast(function, ctypes.c_void_p).value or 0


def target_march() -> str:
    """The -march the kernels are built for: `native` unless LORASERVE_CPU_MARCH names another."""
    return os.environ.get(MARCH_VARIABLE) or "native"


def load_library(source: Path, cache_dir: Path, fallback: str, march: str | None = None) -> ctypes.CDLL | None:
    """The library built from `source` for this machine (building it if needed) and `march`
    (default: target_march()), or None with a warning that names `fallback` (what runs instead)
    and the reason."""
    return _load_library(source, cache_dir, fallback, march or target_march())


@functools.cache
def _load_library(source: Path, cache_dir: Path, fallback: str, march: str) -> ctypes.CDLL | None:
    try:
        return ctypes.CDLL(str(build(source, cache_dir, march)))
    except (KernelBuildError, OSError) as error:
        log.warning("%s: %s", fallback, error)
        return None


def build(source: Path, cache_dir: Path, march: str = "native") -> Path:
    """Compile `source` for `march` into cache_dir unless this exact build is there already."""
    compiler = shutil.which(os.environ.get("CXX", "c++"))
    if compiler is None:
        raise KernelBuildError("no C++ compiler found (set CXX, or install g++)")
    flags = (*FLAGS, f"-march={march}", *(("-mtune=native",) if march != "native" else ()))
    key = hashlib.sha256(source.read_bytes() + SHARED_HEADER.read_bytes())
    key.update(" ".join((compiler, *flags, platform.machine(), _cpu_features())).encode())
    target = cache_dir / f"{source.stem}-{key.hexdigest()[:16]}.so"
    if target.exists():
        return target
    cache_dir.mkdir(parents=True, exist_ok=True)
    log.info("building %s for this machine (once) into %s", source.name, cache_dir)
    # Built under a temporary name and renamed: processes building at once never load half a file.
    with tempfile.TemporaryDirectory(dir=cache_dir) as scratch:
        built = Path(scratch) / target.name
        command = [compiler, *flags, f"-I{SHARED_HEADER.parent}", "-o", str(built), str(source)]
        result = subprocess.run(command, capture_output=True, text=True)
        if result.returncode != 0:
            raise KernelBuildError(f"{compiler} failed on {source.name}:\n{result.stderr[-2000:]}")
        os.replace(built, target)
    return target


def _cpu_features() -> str:
    """The CPU's feature flags (what -march=native compiles for), or '' where /proc says nothing."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return line
    except OSError:
        pass
    return ""
