"""Schemathesis against /openapi.json with every check and every phase (examples, coverage, fuzzing, stateful): no 5xx,
responses on their schema, schema-valid requests served and schema-invalid ones refused, 405 with Allow.

Run as its CLI, since only the CLI runs the coverage phase (which sends the undeclared methods). Refusals no schema can
state are declared, rule by rule, in tests/server/fuzz_hooks.py. With the admin token every phase, without it fuzzing
and stateful (PHASES). The server runs with --max-model-len 24 so that any generated request ends in a few steps, and
the run is bounded in time.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from loraserve.config import SchedulerConfig
from tests.server.conftest import ADMIN, RunningServer, start_server

pytestmark = pytest.mark.slow

MAX_EXAMPLES = 10  # per operation and phase
# The admin-token run sees every operation past auth, so it runs every phase; the coverage phase (the schema's
# bounds, each at its edges: 2,731 cases, 207 s of the 245 s run on a Zen 3) is not repeated without the token,
# whose run checks that the admin operations refuse it in the documented shape.
PHASES = {"no-token": "fuzzing,stateful", "admin-token": "examples,coverage,fuzzing,stateful"}
# One seed, so that a failure found is found again (set LORASERVE_FUZZ_SEED to another to explore further).
SEED = os.environ.get("LORASERVE_FUZZ_SEED", "54")
TIMEOUT_S = 480  # twice the admin-token run on a Zen 3 beside the other test worker
REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def fuzzed_server(loaded_model, tmp_path_factory) -> Iterator[RunningServer]:
    scheduler = SchedulerConfig(max_model_len=24, max_n=4)
    yield from start_server(loaded_model, tmp_path_factory.mktemp("data"), scheduler=scheduler)


@pytest.mark.parametrize("run_name, headers", [("no-token", {}), ("admin-token", ADMIN)], ids=PHASES)
def test_every_schemathesis_check_passes(fuzzed_server, run_name, headers):
    command = [sys.executable, "-m", "schemathesis.cli", "run", f"{fuzzed_server.url}/openapi.json",
               "--checks", "all", "--phases", PHASES[run_name], "--max-examples", str(MAX_EXAMPLES), "--workers", "1",
               "--request-timeout", "60", "--seed", SEED,
               *(f"--header={name}: {value}" for name, value in headers.items())]  # fmt: skip
    env = {**os.environ, "SCHEMATHESIS_HOOKS": "tests.server.fuzz_hooks", "PYTHONPATH": str(REPO)}
    run = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=TIMEOUT_S)
    assert run.returncode == 0, run.stdout + run.stderr
