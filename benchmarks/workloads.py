"""Deterministic benchmark workloads: chat prompts of ~60 tokens and mixed output lengths."""

from __future__ import annotations

import random
from dataclasses import dataclass

import torch

SUBJECTS = [
    "a lighthouse keeper",
    "a retired astronaut",
    "a bakery in Lyon",
    "the history of paper",
    "coral reefs",
    "a chess tournament",
    "volcanoes in Iceland",
    "a jazz pianist",
    "the first bicycle",
    "honeybees",
    "a night train to Vienna",
    "ancient Roman roads",
    "a robot gardener",
    "the Moon landing",
    "tea ceremonies",
    "a lost violin",
    "glaciers",
    "a desert caravan",
    "the printing press",
    "migrating whales",
]
ASKS = [
    "Tell me a short story about {s}, with a surprising ending and at least one line of dialogue.",
    "Explain to a curious teenager what is most interesting about {s}, using two concrete examples.",
    "Write a friendly letter to a friend describing {s}, and ask them two questions at the end.",
    "Give me five facts about {s} that most people do not know, each with one sentence of detail.",
]


@dataclass(frozen=True)
class Workload:
    """Prompts as chat conversations and the number of tokens to generate for each."""

    conversations: list[list[dict[str, str]]]
    output_lens: list[int]


def chat_workload(num_prompts: int, min_output: int, max_output: int, seed: int = 0) -> Workload:
    """`num_prompts` distinct prompts; output lengths uniform in [min_output, max_output]."""
    rng = random.Random(seed)
    conversations = []
    for i in range(num_prompts):
        ask = ASKS[i % len(ASKS)].format(s=SUBJECTS[(i // len(ASKS) + i) % len(SUBJECTS)])
        conversations.append([{"role": "user", "content": f"Request {i}. {ask}"}])
    return Workload(conversations, [rng.randint(min_output, max_output) for _ in range(num_prompts)])


def left_padded(prompts: list[list[int]], pad_token_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """input_ids and attention_mask [B, longest] for transformers' `generate`, padded on the left."""
    width = max(map(len, prompts))
    input_ids = torch.tensor([[pad_token_id] * (width - len(p)) + p for p in prompts])
    attention_mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    return input_ids, attention_mask
