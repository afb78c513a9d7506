"""How long GET /health takes while adapters are being uploaded: the event loop must not parse, hash or unpack them.

    python -m benchmarks.upload_health [--uploads 20] [--rounds 3]

Starts `loraserve serve` (no sample adapters), then, per round, uploads the sample adapters (adapters/*)
`--uploads` times at once, each under a name of its own, while one client asks /health back to back; the adapters are
deleted between rounds. Prints the CPU, /health's p50 / p99 / max over every round, and what the uploads answered.
"""

from __future__ import annotations

import argparse
import os
import secrets
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx

from benchmarks.load_client import percentile
from benchmarks.report import machine_description
from loraserve.admin_client import AdminClient
from loraserve.resources import SAMPLE_ADAPTERS


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def serve(data_dir: Path, token: str) -> tuple[subprocess.Popen[bytes], str]:
    """`loraserve serve` on a free loopback port, once /ready answers."""
    port = free_port()
    command = [sys.executable, "-m", "loraserve.cli", "serve", "--port", str(port), "--data-dir", str(data_dir),
               "--admin-token", token, "--no-samples"]  # fmt: skip
    log = (data_dir.parent / "server.log").open("wb")
    process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 300
    while True:
        if process.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError(f"the server did not start; its log: {log.name}")
        try:
            if httpx.get(f"{url}/ready", timeout=2).status_code == 200:
                return process, url
        except httpx.TransportError:
            pass
        time.sleep(0.5)


def health_during(url: str, work: threading.Thread) -> list[float]:
    """/health's latencies (seconds) from `work`'s start to its end, asked back to back."""
    latencies = []
    with httpx.Client(timeout=30) as client:
        work.start()
        while work.is_alive():
            start = time.perf_counter()
            client.get(f"{url}/health").raise_for_status()
            latencies.append(time.perf_counter() - start)
    return latencies


def upload_round(url: str, token: str, uploads: int, round_index: int) -> list[str]:
    """`uploads` uploads at once, the samples in turn; what each answered ("201" or the error); then all deleted."""
    samples = sorted(path for path in SAMPLE_ADAPTERS.iterdir() if path.is_dir())

    def upload(i: int) -> str:
        admin = AdminClient(url, token)
        try:
            admin.upload(f"load-{round_index}-{i}", samples[i % len(samples)], None, None)
            return "201"
        except Exception as error:
            return str(error)

    with ThreadPoolExecutor(uploads) as pool:
        answers = list(pool.map(upload, range(uploads)))
    admin = AdminClient(url, token)
    for record in admin.list():
        admin.delete(record["name"])
    return answers


def measure(url: str, token: str, uploads: int, rounds: int) -> tuple[list[float], list[str]]:
    """/health's latencies (ms) during every round, and what every upload answered."""
    latencies: list[float] = []
    answers: list[str] = []
    for round_index in range(rounds):
        answered: list[str] = []
        uploading = threading.Thread(
            target=lambda r=round_index, a=answered: a.extend(upload_round(url, token, uploads, r))
        )
        latencies += [1000 * seconds for seconds in health_during(url, uploading)]
        answers += answered
    return latencies, answers


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--uploads", type=int, default=20, help="uploads at once")
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    token = secrets.token_urlsafe(24)
    with tempfile.TemporaryDirectory() as work:
        process, url = serve(Path(work) / "data", token)
        try:
            ms, answers = measure(url, token, args.uploads, args.rounds)
        finally:
            os.killpg(process.pid, signal.SIGTERM)
            process.wait(timeout=60)
    failed = [answer for answer in answers if answer != "201"]
    command = f"python -m benchmarks.upload_health --uploads {args.uploads} --rounds {args.rounds}"
    print(f"{machine_description()}: {command}")
    print(f"/health during {args.rounds} x {args.uploads} concurrent uploads of the samples: {len(ms)} answers,",
          f"p50 {percentile(ms, 50):.1f} ms, p99 {percentile(ms, 99):.1f} ms, max {max(ms):.1f} ms")  # fmt: skip
    print(
        f"uploads: {len(answers) - len(failed)} of {len(answers)} stored",
        *(["; first failure:", failed[0]] if failed else []),
    )


if __name__ == "__main__":
    main()
