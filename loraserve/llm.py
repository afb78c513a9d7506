"""Offline batch inference: `LLM().generate(prompts, SamplingParams(...))`."""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from pathlib import Path
from typing import Any, TypeVar, cast

from tqdm import tqdm
from transformers import PreTrainedTokenizerBase

from loraserve.config import EngineConfig
from loraserve.engine import LLMEngine, RequestOutput, SamplingParams
from loraserve.engine.chat import Conversation, chat_prompt_ids
from loraserve.errors import InvalidRequestError

Prompt = str | list[int]  # text, or token ids
T = TypeVar("T")


class LLM:
    """The engine with a blocking, whole-batch interface."""

    def __init__(self, model: str | None = None, **settings: Any) -> None:
        """`model`: an HF safetensors directory (default: the embedded model); `settings`: any field of
        ModelConfig, CacheConfig, SchedulerConfig or LoraConfig (config.py), and `seed`."""
        self.engine = LLMEngine(EngineConfig.of(model=model, **settings))
        self._request_ids = itertools.count()

    @classmethod
    def from_engine(cls, engine: LLMEngine) -> LLM:
        """Wrap an existing engine (for example one sharing an already loaded model)."""
        llm = cls.__new__(cls)
        llm.engine = engine
        llm._request_ids = itertools.count()
        return llm

    @property
    def tokenizer(self) -> PreTrainedTokenizerBase:
        return self.engine.tokenizer

    def add_adapter(self, name: str, path: str | Path) -> None:
        """Serve the PEFT adapter in directory `path`; requests name it in `adapters=`. Any number may be
        added; `max_loras` bounds how many distinct ones run in one step."""
        self.engine.add_adapter(name, path)

    def remove_adapter(self, name: str) -> None:
        self.engine.remove_adapter(name)

    def close(self) -> None:
        """Stop the engine's threads, which hold it, and let go of it: the model, the pool and the KV cache are freed
        (a model shared with another engine stays). The LLM serves nothing after; closing twice does nothing."""
        if hasattr(self, "engine"):
            self.engine.close()
            del self.engine

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def reset_prefix_cache(self) -> None:
        """Forget every cached prompt prefix (to time prompts computed in full, for example)."""
        self.engine.reset_prefix_cache()

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        adapters: str | Sequence[str | None] | None = None,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        """Complete every prompt (with `adapters`: one for all or one per prompt, None = base model), in order."""
        single = isinstance(prompts, str) or (
            isinstance(prompts, list) and bool(prompts) and isinstance(prompts[0], int)
        )
        batch = [cast(Prompt, prompts)] if single else list(cast(Sequence[Prompt], prompts))
        return self._run(batch, sampling_params, adapters, use_tqdm)

    def chat(
        self,
        conversations: Conversation | Sequence[Conversation],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        adapters: str | Sequence[str | None] | None = None,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        """Answer each conversation, tokenized as `chat_prompt_ids` does."""
        single = bool(conversations) and isinstance(conversations[0], dict)
        batch = [cast(Conversation, conversations)] if single else list(cast(Sequence[Conversation], conversations))
        prompts: list[Prompt] = [self.chat_prompt_ids(conv) for conv in batch]
        return self._run(prompts, sampling_params, adapters, use_tqdm)

    def chat_prompt_ids(self, conversation: Conversation) -> list[int]:
        """The prompt's token ids, as `apply_chat_template(..., tokenize=True)` returns them (for a template without a
        system role, after folding the system messages into the first user message: engine/system_role.py)."""
        return chat_prompt_ids(self.tokenizer, conversation)

    def _run(
        self,
        prompts: list[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None,
        adapters: str | Sequence[str | None] | None,
        use_tqdm: bool,
    ) -> list[RequestOutput]:
        params = _per_prompt(
            SamplingParams() if sampling_params is None else sampling_params, len(prompts), "sampling_params"
        )
        adapters = _per_prompt(adapters, len(prompts), "adapters")
        ids = [str(next(self._request_ids)) for _ in prompts]
        try:
            for request_id, prompt, p, adapter in zip(ids, prompts, params, adapters, strict=True):
                self.engine.add_request(request_id, prompt, p, adapter=adapter)
        except Exception:
            for request_id in ids:
                self.engine.abort_request(request_id)
            raise
        finished: dict[str, RequestOutput] = {}
        with tqdm(total=len(prompts), desc="Generating", unit="req", disable=not use_tqdm) as progress:
            while self.engine.has_unfinished_requests():
                for output in self.engine.step():
                    if output.finished:
                        finished[output.request_id] = output
                        progress.update()
        return [finished[request_id] for request_id in ids]


def _per_prompt(value: T | Sequence[T], num_prompts: int, field: str) -> list[T]:
    """`value` for every prompt, or a sequence of one value per prompt."""
    if isinstance(value, str) or not isinstance(value, Sequence):
        return [cast(T, value)] * num_prompts
    if len(value) != num_prompts:
        raise InvalidRequestError(field, f"got {len(value)} for {num_prompts} prompts; give one or one per prompt")
    return list(value)
