"""loraserve: many LoRA adapters on one base LLM, in one batch."""

from loraserve.engine import CompletionOutput, RequestOutput, SamplingParams
from loraserve.llm import LLM

__all__ = ["LLM", "CompletionOutput", "RequestOutput", "SamplingParams"]
