"""How long a server takes to check stored adapters no check has recorded, at its first start and at a restart.

    python -m benchmarks.stored_checks [--adapters 200]

Writes a registry as a loraserve from before the checks left it (schema 0005, no check recorded) holding `--adapters`
copies of the pirate sample, each of its own content (its config's `revision` differs), then starts `loraserve serve` on
it twice. Each start prints the seconds until /ready answers and until /v1/models lists every adapter: at the first
start each adapter is served once its files passed their check in a child process; at the second, all at once.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterable
from pathlib import Path

import httpx

from benchmarks.report import machine_description
from loraserve.file_digest import sha256_of_files
from loraserve.lora.adapter import CONFIG_FILE, WEIGHTS_FILE, LoraAdapter
from loraserve.registry import FileStore, Registry, downgrade_database, sqlite_url, upgrade_database
from loraserve.resources import SAMPLE_ADAPTERS

MODEL = "SmolLM2-135M-Instruct"
BEFORE_CHECKS = "0005"  # the registry's last schema without recorded checks


def store_unchecked(url: str, store: Path, adapters: Iterable[tuple[str, Path]]) -> dict[str, str]:
    """A registry at `url`, files in `store`, holding `adapters` ((name, PEFT directory), registered in order as they
    are, unread; a name again is a new version of it) as a loraserve from before the checks left it. Returns each
    name's current sha256."""
    upgrade_database(url)
    registry = Registry(url, FileStore(store))
    try:
        hashes = {name: _register(registry, name, files) for name, files in adapters}
    finally:
        registry.close()
    downgrade_database(url, BEFORE_CHECKS)
    return hashes


def _register(registry: Registry, name: str, files: Path) -> str:
    config = json.loads((files / CONFIG_FILE).read_text())
    modules = config["target_modules"]
    sha256 = sha256_of_files(files / CONFIG_FILE, files / WEIGHTS_FILE)
    adapter = LoraAdapter(
        rank=config["r"], alpha=config["lora_alpha"], use_rslora=False,
        target_modules=tuple(modules) if isinstance(modules, list) else (), weights={}, base_model_name=None,
        sha256=sha256, num_bytes=(files / WEIGHTS_FILE).stat().st_size,
    )  # fmt: skip
    if registry.get(name) is None:
        registry.create(name, files, adapter, MODEL)
    else:
        registry.replace(name, files, adapter)
    return sha256


def copies_of_pirate(directory: Path, count: int) -> dict[str, Path]:
    """`count` PEFT directories of the pirate sample, each of its own content."""
    copies = {}
    for i in range(count):
        path = directory / f"pirate-{i}"
        path.mkdir()
        shutil.copy(SAMPLE_ADAPTERS / "pirate" / WEIGHTS_FILE, path / WEIGHTS_FILE)
        config = json.loads((SAMPLE_ADAPTERS / "pirate" / CONFIG_FILE).read_text())
        (path / CONFIG_FILE).write_text(json.dumps({**config, "revision": f"copy-{i}"}))
        copies[f"pirate-{i}"] = path
    return copies


def timed_start(data_dir: Path, count: int) -> tuple[float, float]:
    """Seconds from starting `loraserve serve` to /ready, and to every one of `count` adapters listed by /v1/models."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    command = [sys.executable, "-m", "loraserve.cli", "serve", "--port", str(port), "--data-dir", str(data_dir),
               "--admin-token", secrets.token_urlsafe(24), "--no-samples"]  # fmt: skip
    url, started, ready = f"http://127.0.0.1:{port}", time.monotonic(), 0.0
    with (data_dir.parent / "server.log").open("ab") as log:
        process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        while True:
            if process.poll() is not None:
                tail = Path(log.name).read_text().splitlines()[-5:]
                raise RuntimeError("the server exited: " + " / ".join(tail))
            with contextlib.suppress(httpx.TransportError):
                if not ready and httpx.get(f"{url}/ready").status_code == 200:
                    ready = time.monotonic() - started
                if ready and len(httpx.get(f"{url}/v1/models").json()["data"]) == count + 1:  # and the base model
                    return ready, time.monotonic() - started
            time.sleep(0.05)
    finally:
        os.killpg(process.pid, signal.SIGTERM)
        process.wait(timeout=60)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--adapters", type=int, default=200, help="stored adapters, each of its own content")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as work:
        data_dir = Path(work) / "data"
        data_dir.mkdir()
        adapters = copies_of_pirate(Path(work), args.adapters)
        store_unchecked(sqlite_url(data_dir), data_dir / "adapters", adapters.items())
        starts = [timed_start(data_dir, args.adapters) for _ in ("first", "restart")]
    print(f"{machine_description()}: python -m benchmarks.stored_checks --adapters {args.adapters}")
    print("| start | /ready | every adapter served |\n|---|---|---|")
    for label, (ready, served) in zip(("first: each checked", "restart: none checked again"), starts, strict=True):
        print(f"| {label} | {ready:.1f} s | {served:.1f} s |")


if __name__ == "__main__":
    main()
