"""Checking adapter files not yet trusted in a child process, with CPU, memory and wall-time limits.

A hostile adapter_config.json can hold a regex that backtracks for hours, or JSON nested
deep enough to overflow the stack; a weights file can lie about its tensors. Python cannot
interrupt a running `re` match, and in the server it would hold the interpreter, and so
every request, while it ran. So uploads and `load_lora_adapter` paths are checked in a
child forked from a clean fork server with loraserve preloaded (~20 ms a child once the
server runs). The child says which pattern field it is about to match; the parent kills
it when one field takes longer than `pattern_seconds` or the whole check longer than
`wall_seconds`; the kernel stops it past `cpu_seconds` of CPU or its memory allowance.
The verdict comes back as JSON (AdapterConfig.to_json), never as a pickle.
"""

from __future__ import annotations

import functools
import json
import multiprocessing
import os
import resource
import signal
import time
from dataclasses import dataclass
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

from loraserve.errors import AdapterError
from loraserve.lora.adapter import WEIGHTS_FILE, read_adapter
from loraserve.lora.adapter_config import CONFIG_FILE, AdapterConfig, parse_config
from loraserve.models.decoder_spec import DecoderSpec


@dataclass(frozen=True)
class SandboxLimits:
    pattern_seconds: float = 1.0  # matching one pattern field against the base model's module names
    wall_seconds: float = 60.0  # the whole check
    cpu_seconds: int = 60
    memory_bytes: int = 1 << 30  # beyond the child's own start and four times the files' size


def check_untrusted_adapter(
    path: Path, spec: DecoderSpec, max_rank: int, max_scale: float, limits: SandboxLimits = SandboxLimits()
) -> AdapterConfig:
    """Check the adapter in directory `path` in a child process; its parsed config, or AdapterError naming why not.
    Blocks the calling thread (not the interpreter) while the child works."""
    context = _context()
    receiver, sender = context.Pipe(duplex=False)
    files_bytes = sum(p.stat().st_size for p in path.iterdir() if p.is_file())
    memory = limits.memory_bytes + 4 * files_bytes
    child = context.Process(
        target=_check_in_child,
        args=(sender, path, spec, max_rank, max_scale, limits.cpu_seconds, memory),
        name="loraserve-adapter-check",
        daemon=True,
    )
    child.start()
    sender.close()
    try:
        return _await_verdict(receiver, child, limits)
    finally:
        if child.is_alive():
            child.kill()
        child.join()
        receiver.close()


def _await_verdict(receiver: Connection, child: Any, limits: SandboxLimits) -> AdapterConfig:
    started = time.monotonic()
    field: str | None = None  # the pattern field being matched, and since when
    field_started = started
    while True:
        deadline = started + limits.wall_seconds
        if field is not None:
            deadline = min(deadline, field_started + limits.pattern_seconds)
        if not receiver.poll(max(0.0, deadline - time.monotonic())):
            if field is not None:
                raise AdapterError(
                    field, f"the pattern did not finish matching in {limits.pattern_seconds:g} s ({CONFIG_FILE})"
                )
            raise AdapterError("files", f"checking the adapter took longer than {limits.wall_seconds:g} s")
        try:
            message = json.loads(receiver.recv_bytes())
        except EOFError:
            raise _death(child, field, limits) from None
        if "field" in message:
            field, field_started = message["field"], time.monotonic()
        elif "config" in message:
            return AdapterConfig.from_json(message["config"])
        else:
            raise AdapterError(*message["error"])


def _death(child: Any, field: str | None, limits: SandboxLimits) -> AdapterError:
    child.join()
    where = field or "files"
    if child.exitcode == -signal.SIGXCPU:
        return AdapterError(where, f"checking the adapter used more than {limits.cpu_seconds} s of CPU")
    return AdapterError(
        where, f"checking the adapter ran out of memory or crashed (exit {child.exitcode}); the files are not accepted"
    )


def _check_in_child(
    sender: Connection, path: Path, spec: DecoderSpec, max_rank: int, max_scale: float, cpu_seconds: int, memory: int
) -> None:
    """In the child: limit this process, check the files, send the verdict as JSON."""
    os.nice(19)  # the engine's steps come first on the cores it shares with this check
    resource.setrlimit(resource.RLIMIT_CPU, (cpu_seconds, cpu_seconds + 1))  # SIGXCPU at the soft limit
    hard = resource.getrlimit(resource.RLIMIT_AS)[1]
    soft = _mapped_bytes() + memory
    resource.setrlimit(resource.RLIMIT_AS, (soft if hard == resource.RLIM_INFINITY else min(soft, hard), hard))

    def send(message: dict[str, Any]) -> None:
        sender.send_bytes(json.dumps(message).encode())

    try:
        config = parse_config(path, spec, max_rank, max_scale, report=lambda field: send({"field": field}))
        read_adapter(path, spec, max_rank, max_scale=max_scale, config=config)  # the weights: names, shapes, values
        send({"config": config.to_json()})
    except AdapterError as error:
        send({"error": [error.field, error.message]})
    except MemoryError:
        send({"error": [WEIGHTS_FILE, "checking the adapter needs more memory than it may use"]})
    except RecursionError:
        send({"error": [CONFIG_FILE, "is nested too deeply"]})


def _mapped_bytes() -> int:
    """The child's virtual memory now (the fork server's modules): the allowance comes on top."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmSize:"):
            return int(line.split()[1]) * 1024
    return 0


def warm_up() -> None:
    """Start the fork server now (it imports torch: ~3 s of CPU), not at the first upload."""
    _context().Process(target=os.getpid, name="loraserve-adapter-check-warm-up", daemon=True).start()


@functools.cache
def _context() -> Any:
    """The fork-server context, made once: children fork from a process that has no threads."""
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(["loraserve.lora.adapter_sandbox"])
    return context
