"""loraserve: many LoRA adapters on one base LLM, in one batch."""

from __future__ import annotations

from importlib import import_module
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from loraserve.engine import CompletionOutput, RequestOutput, SamplingParams
    from loraserve.llm import LLM

__all__ = ["LLM", "CompletionOutput", "RequestOutput", "SamplingParams"]


def __getattr__(name: str) -> Any:
    """The public names, imported on first use: the engine and torch stay out of the CLI's HTTP clients."""
    if name not in __all__:
        raise AttributeError(f"module 'loraserve' has no attribute {name!r}")
    return getattr(import_module("loraserve.llm" if name == "LLM" else "loraserve.engine"), name)
