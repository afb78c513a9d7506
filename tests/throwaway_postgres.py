"""A PostgreSQL server of a test's own (initdb + pg_ctl on a free port), for tests that stop it.

The shared server at 127.0.0.1:5432 must never be stopped; this one lives in a temporary
directory and goes with the test. PostgreSQL refuses to run as root, so as root it runs as
the `postgres` user. Without the binaries the test is skipped, saying so.
"""

from __future__ import annotations

import glob
import os
import pwd
import shutil
import signal
import subprocess
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.server.conftest import free_port


@dataclass
class ThrowawayPostgres:
    url: str
    data_dir: Path

    def pids(self) -> list[int]:
        """The postmaster and every process it started."""
        postmaster = int((self.data_dir / "postmaster.pid").read_text().split()[0])
        children = []
        for stat in glob.glob("/proc/[0-9]*/stat"):
            try:
                fields = Path(stat).read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[1]) == postmaster:
                children.append(int(Path(stat).parent.name))
        return [postmaster, *children]

    def hang(self) -> None:
        """Stop every process of the server: it accepts connections and answers nothing, as a hung database does."""
        for pid in self.pids():
            os.kill(pid, signal.SIGSTOP)

    def resume(self) -> None:
        for pid in self.pids():
            os.kill(pid, signal.SIGCONT)


def _binary(name: str) -> str | None:
    found = shutil.which(name) or next(iter(sorted(glob.glob(f"/usr/lib/postgresql/*/bin/{name}"))[-1:]), None)
    return found


@contextmanager
def throwaway_postgres() -> Iterator[ThrowawayPostgres]:
    initdb, pg_ctl = _binary("initdb"), _binary("pg_ctl")
    if initdb is None or pg_ctl is None:
        pytest.skip("no PostgreSQL binaries (initdb, pg_ctl): apt-get install postgresql")
    root = Path(tempfile.mkdtemp(prefix="loraserve-pg-"))
    as_user: list[str] = []
    if os.geteuid() == 0:  # PostgreSQL will not run as root
        user = pwd.getpwnam("postgres")
        os.chown(root, user.pw_uid, user.pw_gid)
        as_user = ["runuser", "-u", "postgres", "--"]
    root.chmod(0o755)
    data, port = root / "data", free_port()
    run = lambda *args: subprocess.run([*as_user, *args], check=True, capture_output=True, timeout=120)  # noqa: E731
    run(initdb, "-D", str(data), "-A", "trust", "-U", "postgres", "--no-sync")
    options = f"-p {port} -k {root} -c listen_addresses=127.0.0.1 -c fsync=off"
    run(pg_ctl, "-D", str(data), "-o", options, "-l", str(root / "log"), "-w", "start")
    server = ThrowawayPostgres(f"postgresql://postgres@127.0.0.1:{port}/postgres", data)
    try:
        yield server
    finally:
        server.resume()
        run(pg_ctl, "-D", str(data), "-m", "immediate", "-w", "stop")
        shutil.rmtree(root, ignore_errors=True)
