"""What every route needs, attached to the app once at creation."""

from __future__ import annotations

from dataclasses import dataclass

from fastapi import Request
from transformers import PreTrainedTokenizerBase

from loraserve.config import ServerConfig
from loraserve.engine.async_engine import AsyncLLMEngine
from loraserve.server.catalog import AdapterCatalog
from loraserve.server.metrics import Metrics
from loraserve.server.tenants import Tenants
from loraserve.tools.formats import ToolCallFormat


@dataclass
class ServerState:
    engine: AsyncLLMEngine
    catalog: AdapterCatalog
    metrics: Metrics
    tenants: Tenants
    config: ServerConfig
    admin_token: str  # always set: the configured one or one made at start
    model_name: str  # the id clients put in `model` for the base model
    tokenizer: PreTrainedTokenizerBase
    special_token_ids: frozenset[int]
    tool_format: ToolCallFormat  # how the model writes tool calls (--tool-call-parser, else its template's)
    started_at: int  # unix seconds

    def token_text(self, token_id: int) -> str:
        return str(self.tokenizer.decode([token_id]))


def server_state(request: Request) -> ServerState:
    state: ServerState = request.app.state.loraserve
    return state
