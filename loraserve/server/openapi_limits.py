"""openapi.json with this server's limits: the request models state the largest bounds any server takes (bounds.py);
the flags (--max-n, --max-logprobs, --max-stop, --max-mix-parts) and the model's vocabulary lower them here, so that
what the schema allows is what this server serves."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from fastapi import FastAPI

from loraserve.engine.async_engine import AsyncLLMEngine

JsonDict = dict[str, Any]


@dataclass(frozen=True)
class SchemaLimits:
    """The per-request limits of one server."""

    max_n: int
    max_logprobs: int
    max_stop: int
    max_mix_parts: int
    vocab_size: int

    @classmethod
    def of(cls, engine: AsyncLLMEngine) -> SchemaLimits:
        limits = engine.scheduler_config
        return cls(limits.max_n, limits.max_logprobs, limits.max_stop, engine.max_mix_parts, engine.vocab_size)

    def bounds(self) -> list[Bound]:
        """Each bound this server sets."""
        openai = ("CompletionRequest", "ChatCompletionRequest")
        logprobs = (
            ("CompletionRequest", "logprobs"),
            ("ChatCompletionRequest", "top_logprobs"),
            ("GenerateParameters", "return_k_alternatives"),
        )
        token_ids = (("CompletionRequest", "prompt"), *((model, "stop_token_ids") for model in openai))
        lorax_too = (*openai, "GenerateParameters")
        return [
            *(Bound(model, "n", "integer", (), {"maximum": self.max_n}) for model in openai),
            *(Bound(model, field, "integer", (), {"maximum": self.max_logprobs}) for model, field in logprobs),
            *(Bound(model, "stop", "array", (), {"maxItems": self.max_stop}) for model in lorax_too),
            *(Bound(model, field, "array", ("items",), {"maximum": self.vocab_size - 1}) for model, field in token_ids),
            *(Bound(model, "merged_adapters", "object", ("properties", "ids"), {"maxItems": self.max_mix_parts})
              for model in lorax_too),
        ]  # fmt: skip


@dataclass(frozen=True)
class Bound:
    """JSON Schema `keywords` for `model`'s `field`: on each of its subschemas of type `kind`, at `path` within."""

    model: str
    field: str
    kind: str
    path: tuple[str, ...]
    keywords: JsonDict


def _of_type(schema: JsonDict, kind: str) -> Iterator[JsonDict]:
    """The subschemas of `schema` (itself, its anyOf's) whose type is `kind`."""
    if schema.get("type") == kind:
        yield schema
    for branch in schema.get("anyOf", []):
        yield from _of_type(branch, kind)


def with_limits(schema: JsonDict, limits: SchemaLimits) -> JsonDict:
    """`schema` (an openapi.json, changed in place), its request models bounded by `limits`."""
    models = schema["components"]["schemas"]
    for bound in limits.bounds():
        found = list(_of_type(models[bound.model]["properties"][bound.field], bound.kind))
        assert found, f"{bound.model}.{bound.field} has no {bound.kind}: bounds() must follow the request models"
        for subschema in found:
            for key in bound.path:
                subschema = subschema[key]
            subschema.update(bound.keywords)
    return schema


def openapi_with_limits(app: FastAPI, limits: SchemaLimits) -> Callable[[], JsonDict]:
    """An `app.openapi` for `app.openapi`: FastAPI's schema, built once, with `limits`."""
    build = app.openapi

    def openapi() -> JsonDict:
        return app.openapi_schema or with_limits(build(), limits)  # build() keeps its schema in app.openapi_schema

    return openapi
