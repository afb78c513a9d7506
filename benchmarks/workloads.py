"""Deterministic benchmark workloads: chat prompts of ~60 tokens, output lengths, which adapter
each request names, and when it arrives."""

from __future__ import annotations

import random
from dataclasses import dataclass

import torch

from loraserve.engine.chat import chat_prompt_ids

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


ADAPTER_RULES = ("distinct", "uniform", "zipf", "identical", "none")


def assign_adapters(
    rule: str, count: int, num_adapters: int, seed: int = 0, zipf_alpha: float = 1.0
) -> list[int | None]:
    """Which adapter (0-based) each of `count` requests names.

    distinct: round robin, so `num_adapters` requests name `num_adapters` different adapters;
    uniform: drawn uniformly; zipf: adapter k drawn with probability proportional to
    1/(k+1)^alpha; identical: all adapter 0; none: the base model for every request.
    """
    rng = random.Random(seed)
    if rule == "distinct":
        return [i % num_adapters for i in range(count)]
    if rule == "uniform":
        return [rng.randrange(num_adapters) for _ in range(count)]
    if rule == "zipf":
        weights = [1 / (k + 1) ** zipf_alpha for k in range(num_adapters)]
        return list(rng.choices(range(num_adapters), weights, k=count))
    if rule == "identical":
        return [0] * count
    if rule == "none":
        return [None] * count
    raise ValueError(f"adapter rule {rule!r}: expected one of {ADAPTER_RULES}")


def draw_lengths(spec: str, count: int, seed: int = 0) -> list[int]:
    """Lengths from a spec: "128" (fixed) or "uniform:32-128" (inclusive, seeded)."""
    rng = random.Random(seed)
    kind, _, bounds = spec.partition(":")
    if not bounds and kind.isdigit():
        return [int(kind)] * count
    low, _, high = bounds.partition("-")
    if kind != "uniform" or not (low.isdigit() and high.isdigit()) or int(low) > int(high):
        raise ValueError(f"length {spec!r}: expected N or uniform:LOW-HIGH")
    return [rng.randint(int(low), int(high)) for _ in range(count)]


def arrival_times(count: int, rate: float, cv: float = 1.0, seed: int = 0) -> list[float]:
    """Seconds after the start: gaps drawn from a Gamma with mean 1/rate and coefficient of variation
    `cv` (cv = 1 is a Poisson process; larger is burstier)."""
    rng = random.Random(seed)
    shape = 1 / cv**2
    at, times = 0.0, []
    for _ in range(count):
        at += rng.gammavariate(shape, 1 / (rate * shape))
        times.append(at)
    return times


def left_padded(prompts: list[list[int]], pad_token_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """input_ids and attention_mask [B, longest] for transformers' `generate`, padded on the left."""
    width = max(map(len, prompts))
    input_ids = torch.tensor([[pad_token_id] * (width - len(p)) + p for p in prompts])
    attention_mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    return input_ids, attention_mask


def prompt_token_ids(tokenizer, spec: str, count: int, seed: int = 0) -> list[list[int]]:
    """`count` distinct prompts: "chat" gives the chat prompts above (~60 tokens with the template);
    a length spec ("512", "uniform:32-256") cuts each chat prompt's tokens, repeated as needed, to
    the drawn length."""
    chats = [chat_prompt_ids(tokenizer, c) for c in chat_workload(count, 1, 1, seed).conversations]
    if spec == "chat":
        return chats
    return [(ids * (n // len(ids) + 1))[:n] for ids, n in zip(chats, draw_lengths(spec, count, seed), strict=True)]
