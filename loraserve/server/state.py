"""What every route needs, attached to the app once at creation."""

from __future__ import annotations

from dataclasses import dataclass

from fastapi import Request
from transformers import PreTrainedTokenizerBase

from loraserve.engine.async_engine import AsyncLLMEngine


@dataclass
class ServerState:
    engine: AsyncLLMEngine
    model_name: str  # the id clients put in `model` for the base model
    tokenizer: PreTrainedTokenizerBase
    started_at: int  # unix seconds
    api_keys: frozenset[str]  # empty: inference routes are open


def server_state(request: Request) -> ServerState:
    state: ServerState = request.app.state.loraserve
    return state
