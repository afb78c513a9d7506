"""openapi.json states this server's limits (--max-n, --max-logprobs, --max-stop, --max-mix-parts, the vocabulary):
what the schema allows is what the server serves."""

from __future__ import annotations

from typing import Any

from loraserve.config import SchedulerConfig
from loraserve.server.app import create_app
from tests.server.conftest import async_engine, server_config_in


def _branches(schema: dict[str, Any], kind: str) -> list[dict[str, Any]]:
    return [branch for branch in [schema, *schema.get("anyOf", [])] if branch.get("type") == kind]


def test_openapi_json_states_the_servers_limits(loaded_model, tmp_path):
    scheduler = SchedulerConfig(max_n=3, max_logprobs=5, max_stop=2)
    engine = async_engine(loaded_model, num_blocks=16, scheduler=scheduler)
    models = create_app(engine, server_config_in(tmp_path)).openapi()["components"]["schemas"]
    completion, chat, lorax = (models[name]["properties"] for name in ("CompletionRequest", "ChatCompletionRequest",
                                                                         "GenerateParameters"))  # fmt: skip
    last_token = loaded_model.model.spec.vocab_size - 1

    assert completion["n"]["maximum"] == chat["n"]["maximum"] == 3
    assert [b["maximum"] for b in _branches(completion["logprobs"], "integer")] == [5]
    assert [b["maximum"] for b in _branches(chat["top_logprobs"], "integer")] == [5]
    assert [b["maximum"] for b in _branches(lorax["return_k_alternatives"], "integer")] == [5]
    for stop in (completion["stop"], chat["stop"], lorax["stop"]):
        assert [b["maxItems"] for b in _branches(stop, "array")] == [2]
    for token_ids in (completion["prompt"], completion["stop_token_ids"], chat["stop_token_ids"]):
        assert [b["items"]["maximum"] for b in _branches(token_ids, "array")] == [last_token]
    max_mix_parts = engine.max_mix_parts
    for mix in (completion["merged_adapters"], lorax["merged_adapters"]):
        assert [b["properties"]["ids"]["maxItems"] for b in _branches(mix, "object")] == [max_mix_parts]
