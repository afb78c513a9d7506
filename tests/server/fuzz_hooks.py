"""Schemathesis hooks (SCHEMATHESIS_HOOKS) for tests/server/test_api_fuzzing.py: the refusals of schema-valid requests
that no schema can foresee, declared as expected outcomes of positive_data_acceptance. Each names the rule and matches
only the answer that rule gives; any other refusal of a schema-valid request stays a failure."""

from __future__ import annotations

from typing import Any

import schemathesis
from schemathesis.core.failures import Failure
from schemathesis.openapi.checks import RejectedPositiveData

# The prompt's tokens, after the chat template, must leave room for one in the context window: a token budget, not a
# length a schema can state.
_PROMPT_FIELDS = {"prompt", "inputs", "messages"}
# The upload routes' files and load_lora_adapter's directory are checked as an adapter: their content, not their shape.
_ADAPTER_ROUTES = {("POST", "/admin/adapters"), ("PUT", "/admin/adapters/{name}"), ("POST", "/v1/load_lora_adapter")}


def _error(response: Any) -> dict[str, Any]:
    try:
        body = response.json()
    except ValueError:
        return {}
    return body.get("error", {}) if isinstance(body, dict) else {}


@schemathesis.hook
def filter_failure(ctx: Any, failure: Failure, case: schemathesis.Case, response: Any) -> bool:
    """False (not a failure) for a schema-valid request refused by a rule the schema cannot state."""
    if not isinstance(failure, RejectedPositiveData):
        return True
    error = _error(response)
    too_long = (
        response.status_code == 400
        and error.get("code") in _PROMPT_FIELDS
        and ("context window" in error.get("message", ""))
    )
    not_an_adapter = (
        response.status_code == 422
        and error.get("type") == "invalid_adapter_error"
        and ((case.operation.method.upper(), case.operation.path) in _ADAPTER_ROUTES)
    )
    return not (too_long or not_an_adapter)
