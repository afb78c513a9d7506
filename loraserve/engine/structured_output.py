"""What a request's output must match: a JSON schema, a regular expression or one of a list of strings.

Built from each API's own fields (server/structured.py) and checked for its size here; the grammar engine
checks the rest when it compiles it (grammar.py). `field` names the request field it came from, so that a
refusal names what the client sent.
"""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass
from typing import Any, Literal

from loraserve.errors import InvalidRequestError

MAX_GRAMMAR_CHARS = 64 * 1024  # a schema's JSON text, a regex, or the choices together
MAX_CHOICES = 256
# JSON as any JSON object: what OpenAI's {"type": "json_object"} asks for.
ANY_JSON_OBJECT: dict[str, Any] = {"type": "object"}

Kind = Literal["json_schema", "regex", "choice", "lark"]


@dataclass(frozen=True)
class StructuredOutput:
    kind: Kind
    # The schema as JSON text (its keys in the order given: they set the order generated), the regex, or a grammar
    # in llguidance's Lark syntax (which loraserve writes: tools/formats.py; never taken from a request).
    text: str
    field: str  # the request field it came from

    @classmethod
    def json_schema(cls, schema: Any, field: str) -> StructuredOutput:
        if isinstance(schema, str):  # vLLM takes a schema as JSON text as well
            try:
                schema = json.loads(schema)
            except ValueError:
                raise InvalidRequestError(field, "is not valid JSON") from None
        if not isinstance(schema, dict):
            raise InvalidRequestError(field, f"must be a JSON schema (an object), got {type(schema).__name__}")
        try:
            text = json.dumps(schema, separators=(",", ":"), allow_nan=False)
        except (ValueError, RecursionError):
            raise InvalidRequestError(field, "must hold only finite numbers and nest less deeply") from None
        return cls("json_schema", _bounded(text, field), field)

    @classmethod
    def regex(cls, pattern: Any, field: str) -> StructuredOutput:
        if not isinstance(pattern, str) or not pattern:
            raise InvalidRequestError(field, "must be a non-empty regular expression")
        return cls("regex", _bounded(pattern, field), field)

    @classmethod
    def choice(cls, choices: Any, field: str) -> StructuredOutput:
        """Exactly one of `choices`, as a regex of the escaped strings."""
        if not isinstance(choices, list) or not choices or not all(isinstance(c, str) and c for c in choices):
            raise InvalidRequestError(field, "must be a non-empty list of non-empty strings")
        if len(choices) > MAX_CHOICES:
            raise InvalidRequestError(field, f"at most {MAX_CHOICES} choices, got {len(choices)}")
        return cls("choice", _bounded("|".join(f"({re.escape(c)})" for c in choices), field), field)

    @classmethod
    def lark(cls, grammar: str, field: str) -> StructuredOutput:
        """A grammar loraserve wrote around a request's schemas (tool calls), bounded as they are."""
        return cls("lark", _bounded(grammar, field), field)

    @property
    def key(self) -> str:
        """What a compiled grammar is cached under."""
        return hashlib.sha256(f"{self.kind}\0{self.text}".encode()).hexdigest()


def _bounded(text: str, field: str) -> str:
    if len(text) > MAX_GRAMMAR_CHARS:
        raise InvalidRequestError(field, f"is {len(text)} characters; at most {MAX_GRAMMAR_CHARS} are accepted")
    return text
