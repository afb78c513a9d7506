"""The inference engine: sequences, paged KV blocks, continuous batching, sampling."""

from loraserve.engine.llm_engine import LLMEngine
from loraserve.engine.outputs import CompletionOutput, RequestError, RequestOutput, RequestTimings, TokenLogprob
from loraserve.engine.sampling_params import SamplingParams

__all__ = [
    "CompletionOutput",
    "LLMEngine",
    "RequestError",
    "RequestOutput",
    "RequestTimings",
    "SamplingParams",
    "TokenLogprob",
]
