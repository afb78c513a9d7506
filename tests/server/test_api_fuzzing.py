"""Schemathesis against /openapi.json: whatever it generates, no 5xx, and responses match the schema.

With and without the admin token. The server runs with --max-model-len 24 so that any generated
request ends in a few steps: the fuzzing stays bounded in time (max_examples per operation).
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from schemathesis.specs.openapi.checks import positive_data_acceptance

from loraserve.config import SchedulerConfig
from tests.server.conftest import ADMIN, RunningServer, start_server

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def fuzzed_server(loaded_model, tmp_path_factory) -> Iterator[RunningServer]:
    scheduler = SchedulerConfig(max_model_len=24, max_n=4)
    yield from start_server(loaded_model, tmp_path_factory.mktemp("data"), scheduler=scheduler)


FUZZ = settings(max_examples=25, deadline=None, suppress_health_check=list(HealthCheck), database=None)


def fuzz(url: str, headers: dict[str, str] | None) -> list[str]:
    """Every operation of the schema, `FUZZ.max_examples` generated cases each; what failed, by operation."""
    failures = []
    for result in schemathesis.openapi.from_url(f"{url}/openapi.json").get_all_operations():
        operation = result.ok()

        @FUZZ
        @given(case=operation.as_strategy())
        def run(case: schemathesis.Case) -> None:
            # Schema-valid is not always servable: a model must exist, token ids lie in the vocabulary.
            case.call_and_validate(headers=headers, timeout=60, excluded_checks=[positive_data_acceptance])

        try:
            run()
        except (Exception, BaseExceptionGroup) as error:  # every operation's findings, reported together
            failures.append(f"{operation.method.upper()} {operation.path}: {error}")
    return failures


@pytest.mark.parametrize("headers", [None, ADMIN], ids=["no-token", "admin-token"])
def test_no_generated_request_gets_a_5xx_or_an_answer_off_its_schema(fuzzed_server, headers):
    failures = fuzz(fuzzed_server.url, headers)
    assert not failures, "\n\n".join(failures)
