"""Response bodies as types, so /openapi.json documents what each route answers.

OpenAI's routes answer with the `openai` package's own types (openai.py; a streamed completion's chunk, below, allows
the null finish_reason OpenAI sends). LoRAX's shapes are its clients' contract, written out here; the admin records and
/admin/pool are derived from the definitions they show (AdapterInfo, ApiKeyInfo, EngineStats), never restated. Bodies
are dumped with `exclude_unset`: a field left unset is absent, one set to None is null.
"""

from __future__ import annotations

from dataclasses import asdict, fields
from datetime import datetime
from typing import Any, Literal, get_type_hints

from openai.types import Completion, CompletionChoice
from pydantic import BaseModel, Field, create_model

from loraserve.engine.stats import EngineStats
from loraserve.lora.residency import Residency
from loraserve.registry import AdapterInfo, ApiKeyInfo
from loraserve.registry.adapter_info import AdapterVersion


class CompletionChunkChoice(CompletionChoice):
    finish_reason: Literal["stop", "length", "content_filter"] | None  # type: ignore[assignment]  # null until the last


class CompletionChunk(Completion):
    """A streamed /v1/completions chunk: OpenAI sends Completion objects whose finish_reason is null until the end."""

    choices: list[CompletionChunkChoice]  # type: ignore[assignment]


class AlternativeToken(BaseModel):
    id: int
    text: str
    logprob: float


class GeneratedToken(AlternativeToken):
    special: bool
    alternative_tokens: list[AlternativeToken] | None = None  # with parameters.return_k_alternatives


class StreamDetails(BaseModel):
    finish_reason: Literal["length", "eos_token", "stop_sequence"]
    prompt_tokens: int
    generated_tokens: int
    seed: int | None


class GenerateDetails(StreamDetails):
    prefill: list[Any]
    tokens: list[GeneratedToken]
    best_of_sequences: None


class GenerateResponse(BaseModel):
    """LoRAX's /generate (and a one-element list of it at /)."""

    generated_text: str
    details: GenerateDetails | None = None  # with parameters.details


class StreamEvent(BaseModel):
    """One event of LoRAX's /generate_stream: a token; the text and details come with the last."""

    token: GeneratedToken
    generated_text: str | None
    details: StreamDetails | None


def _from_dataclass(name: str, source: type, hidden: tuple[str, ...] = (), **extra: Any) -> type[BaseModel]:
    """A model of `source`'s fields but the `hidden` ones (datetimes as ISO 8601 text), and `extra`'s."""
    hints = get_type_hints(source)
    own: dict[str, Any] = {
        f.name: (str if hints[f.name] is datetime else hints[f.name], ...)
        for f in fields(source)
        if f.name not in hidden
    }
    return create_model(name, **own, **extra)


def record_json(record: Any, hidden: tuple[str, ...] = ()) -> dict[str, Any]:
    """A registry record in its model's shape (above): the fields but the `hidden` ones, datetimes as ISO 8601 text."""
    return {k: v.isoformat() if isinstance(v, datetime) else v for k, v in asdict(record).items() if k not in hidden}


AdapterRecord = _from_dataclass("AdapterRecord", AdapterInfo, residency=(Residency, ...))
VersionRecord = _from_dataclass("VersionRecord", AdapterVersion)
# GET /admin/adapters/{name}: the record and every version of its weights, oldest first.
AdapterWithVersions = create_model(
    "AdapterWithVersions",
    __base__=AdapterRecord,
    versions=(list[VersionRecord], ...),  # type: ignore[valid-type]
)


class AdapterList(BaseModel):
    object: Literal["list"]
    data: list[AdapterRecord]  # type: ignore[valid-type]


class Deleted(BaseModel):
    name: str
    deleted: Literal[True]


KEY_SECRETS = ("key_hash",)  # a key's record shows never the key, nor its hash
KeyRecord = _from_dataclass("KeyRecord", ApiKeyInfo, hidden=KEY_SECRETS)
NewKey = create_model("NewKey", __base__=KeyRecord, key=(str, Field(description="shown this once")))


class KeyList(BaseModel):
    object: Literal["list"]
    data: list[KeyRecord]  # type: ignore[valid-type]
    auth: Literal["open", "keys"]  # the inference-auth mode: whether inference needs a key


class AuthMode(BaseModel):
    mode: Literal["open", "keys"]
    keys: int  # stored keys (command-line keys aside)


class KeyRevoked(BaseModel):
    id: int
    tenant: str
    deleted: Literal[True]


def _pool_model() -> type[BaseModel]:
    """/admin/pool: EngineStats' fields nested along their `json` paths, each with its help text."""
    hints, tree = get_type_hints(EngineStats), dict[str, Any]()
    for definition in fields(EngineStats):
        path = definition.metadata["json"]
        if path is not None:
            *parents, leaf = path.split(".")
            node = tree
            for parent in parents:
                node = node.setdefault(parent, {})
            node[leaf] = (hints[definition.name], Field(description=definition.metadata["help"]))

    def build(name: str, node: dict[str, Any]) -> type[BaseModel]:
        members: dict[str, Any] = {
            key: (build(f"{name}_{key}", value), ...) if isinstance(value, dict) else value
            for key, value in node.items()
        }
        return create_model(name, **members)

    return build("Pool", tree)


Pool = _pool_model()
