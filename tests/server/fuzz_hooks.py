"""Schemathesis hooks (SCHEMATHESIS_HOOKS) for tests/server/test_api_fuzzing.py: the refusals of schema-valid requests
that no schema can foresee, declared as expected outcomes of positive_data_acceptance. Each names the rule and matches
only the answer that rule gives; any other refusal of a schema-valid request stays a failure."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import schemathesis
from schemathesis.core.failures import Failure
from schemathesis.openapi.checks import RejectedPositiveData

# The upload routes' files and load_lora_adapter's directory are checked as an adapter: their content, not their shape.
_ADAPTER_ROUTES = {("POST", "/admin/adapters"), ("PUT", "/admin/adapters/{name}"), ("POST", "/v1/load_lora_adapter")}
_STRUCTURED_FIELDS = ("response_format", "structured_outputs", "tools", "parameters.response_format")
_MIX_FIELDS = ("merged_adapters", "parameters.merged_adapters")


def _refused(code: Callable[[str], bool], *words: str) -> Callable[[int, dict[str, Any], schemathesis.Case], bool]:
    """A 400 whose code `code` accepts and whose message holds `words`."""
    return lambda status, error, _: (
        status == 400 and code(str(error.get("code"))) and all(word in error.get("message", "") for word in words)
    )


# Each rule: (status, the error object, the case) -> whether the refusal is that rule's.
_RULES: dict[str, Callable[[int, dict[str, Any], schemathesis.Case], bool]] = {
    # The prompt's tokens, after the chat template, must leave room for one in the context window: a token budget,
    # not a length a schema can state.
    "prompt past the context window": _refused(lambda code: code in {"prompt", "inputs", "messages"}, "context window"),
    # What the grammar engine can build (llguidance's JSON Schema subset, its regex syntax) is the engine's to say.
    "grammar the engine cannot build": _refused(lambda code: code.startswith(_STRUCTURED_FIELDS), "as a grammar"),
    # JSON Schema compares no two fields' values: min_tokens against max_tokens (or its default), a mix's weights
    # against its ids, tool_choice's name against tools' names.
    "min_tokens above max_tokens": _refused(lambda code: code == "min_tokens", "at most max_tokens"),
    "a weight per mixed adapter": _refused(lambda code: code.endswith("merged_adapters.weights"), "one per id"),
    "tool_choice names a function of tools": _refused(
        lambda code: code in {"tool_choice.function.name", "tool_choice.name"}, "names no function of tools"
    ),
    # Each function named once: uniqueness of one property across the items of an array.
    "a function named once": _refused(lambda code: code.startswith("tools."), "that an earlier tool names"),
    # One way to ask for structured output: response_format "text" and tool_choice "none" ask for none, so the
    # rule depends on the values, with three fields.
    "one way of structured output": _refused(
        lambda code: code in {"structured_outputs", "tools", "text.format"}, "cannot be combined with"
    ),
    # ignore_eos (LoRAX's ignore_eos_token) with structured output: a document ends with EOS, so one may not ignore it;
    # the rule depends on the value of one field and the presence of several others.
    "ignore_eos with structured output": _refused(
        lambda code: code.endswith(("ignore_eos", "ignore_eos_token")), "cannot be set with structured output"
    ),
    # A mix is made over the base model, whose name the server's model decides.
    "a mix over the base model": _refused(lambda code: code in _MIX_FIELDS, "mixes adapters over the base model"),
    # A seed or priority's int64 range: schemathesis reads the schema's bounds as doubles and sends values just past
    # them, which the schema itself refuses.
    "int64's bounds as doubles": lambda status, error, case: any(
        _refused(lambda code: code in {"seed", "priority", "parameters.seed"}, f"than or equal to {bound}")(
            status, error, case
        )
        for bound in (2**63 - 1, -(2**63))
    ),
    "not an adapter": lambda status, error, case: (
        status == 422
        and error.get("type") == "invalid_adapter_error"
        and (case.operation.method.upper(), case.operation.path) in _ADAPTER_ROUTES
    ),
}


def _error(response: Any) -> dict[str, Any]:
    try:
        body = response.json()
    except ValueError:
        return {}
    error = body.get("error", {}) if isinstance(body, dict) else {}
    return error if isinstance(error, dict) else {}


@schemathesis.hook
def filter_failure(ctx: Any, failure: Failure, case: schemathesis.Case, response: Any) -> bool:
    """False (not a failure) for a schema-valid request refused by a rule the schema cannot state."""
    if not isinstance(failure, RejectedPositiveData):
        return True
    error = _error(response)
    return not any(rule(response.status_code, error, case) for rule in _RULES.values())
