"""Speculative decoding changes how many tokens a step gives, never which: greedy tokens equal those without it
(a mixed batch of adapters and base rows, prefix cache on, under preemption); a seeded sampled completion is the
same token for token; unseeded sampled tokens follow the same distribution (a chi-square test)."""

from __future__ import annotations

import json
from collections import Counter

import pytest
import torch

from loraserve import SamplingParams
from loraserve.engine.structured_output import StructuredOutput
from loraserve.resources import SAMPLE_ADAPTERS
from tests.conftest import CHAT_PROMPTS

pytestmark = pytest.mark.slow

PERSONAS = ["pirate", "shakespeare", "robot", "french-tutor"]
# Prompts whose answers quote them, so prompt lookup drafts hit.
QUOTING = [
    "Repeat this sentence exactly: The quick brown fox jumps over the lazy dog near the quiet river bank.",
    "Copy this list, one item per line: apples, bananas, cherries, dates, elderberries, figs, grapes.",
    "Rewrite this text in the same words: Alice went to the market. She bought bread, milk and eggs. Then she "
    "went home and made breakfast for her brother.",
    "My earlier message was: 'Meet me at the old station at five, bring the map and the red umbrella.' Repeat it.",
]
CONVERSATIONS = [[{"role": "user", "content": text}] for text in QUOTING] + CHAT_PROMPTS[:12]
TARGETS = [[None, *PERSONAS][i % 5] for i in range(len(CONVERSATIONS))]  # 16 rows: 4 adapters and base rows
GREEDY = SamplingParams(temperature=0, max_tokens=48)


def persona_llm(make_llm, **settings):
    llm = make_llm(max_loras=len(PERSONAS), max_lora_rank=8, max_num_seqs=64, **settings)
    for name in PERSONAS:
        llm.add_adapter(name, SAMPLE_ADAPTERS / name)
    return llm


@pytest.fixture(scope="module")
def plain(make_llm):
    return persona_llm(make_llm)


@pytest.fixture(scope="module")
def speculative(make_llm):
    return persona_llm(make_llm, speculative_tokens=4)


def completions(outputs):
    return [(c.token_ids, c.text, c.finish_reason) for output in outputs for c in output.outputs]


def test_greedy_tokens_equal_decoding_without_drafts_in_a_mixed_batch_with_the_prefix_cache(plain, speculative):
    expected = completions(plain.chat(CONVERSATIONS, GREEDY, adapters=TARGETS, use_tqdm=False))
    for attempt in ("first", "from the prefix cache"):
        got = completions(speculative.chat(CONVERSATIONS, GREEDY, adapters=TARGETS, use_tqdm=False))
        assert got == expected, attempt
    counts = speculative.engine.scheduler.speculation.by_adapter
    assert set(counts) == {"", *PERSONAS}  # every adapter's rows drafted
    assert sum(c.accepted for c in counts.values()) > 0.3 * sum(c.drafted for c in counts.values())


def test_greedy_tokens_equal_under_preemption(plain, make_llm):
    expected = completions(plain.chat(CONVERSATIONS, GREEDY, adapters=TARGETS, use_tqdm=False))
    pressed = persona_llm(make_llm, speculative_tokens=4, num_pages=72)
    got = completions(pressed.chat(CONVERSATIONS, GREEDY, adapters=TARGETS, use_tqdm=False))
    assert pressed.engine.scheduler.num_preemptions > 0
    assert got == expected


def test_a_seeded_sampled_completion_is_the_same_token_for_token(plain, speculative):
    """With top-p, top-k, penalties, logprobs, a stop string and n = 2: a seeded token's noise depends on its
    position alone, so drafts verified in one step sample what plain decoding samples."""
    params = [
        SamplingParams(
            temperature=0.9,
            top_p=0.9,
            top_k=40,
            presence_penalty=0.3,
            seed=seed,
            logprobs=2,
            n=2,
            max_tokens=40,
            stop=["\n\n"],
        )
        for seed in range(8)
    ]
    conversations, targets = CONVERSATIONS[:8], TARGETS[:8]
    expected = plain.chat(conversations, params, adapters=targets, use_tqdm=False)
    got = speculative.chat(conversations, params, adapters=targets, use_tqdm=False)
    assert completions(got) == completions(expected)
    for output, reference in zip(got, expected, strict=True):
        for completion, want in zip(output.outputs, reference.outputs, strict=True):
            assert [lp.top.keys() for lp in completion.logprobs] == [lp.top.keys() for lp in want.logprobs]
            torch.testing.assert_close(
                [lp.logprob for lp in completion.logprobs], [lp.logprob for lp in want.logprobs], atol=1e-4, rtol=0
            )


def test_unseeded_sampled_tokens_follow_the_distribution_of_decoding_without_drafts(plain, speculative):
    """Temperature 1 on a prompt whose answer quotes it: the 5th token of 256 completions each way, by a chi-square
    test of homogeneity (the rows' noise comes from the engines' fixed seeds, so the test is deterministic)."""
    conversation = [{"role": "user", "content": QUOTING[0]}]
    params = SamplingParams(temperature=1.0, max_tokens=5, n=64, ignore_eos=True)
    counts = speculative.engine.scheduler.speculation.by_adapter
    accepted_before = counts[""].accepted if "" in counts else 0
    samples = {}
    for name, llm in (("plain", plain), ("speculative", speculative)):
        outputs = llm.chat([conversation] * 4, params, use_tqdm=False)
        samples[name] = Counter(c.token_ids[4] for output in outputs for c in output.outputs)
    assert counts[""].accepted > accepted_before
    assert chi_square_p_value(samples["plain"], samples["speculative"]) > 1e-3


def chi_square_p_value(first: Counter, second: Counter, min_count: int = 10) -> float:
    """Whether two samples come from one distribution: categories seen fewer than `min_count` times in both
    together are pooled."""
    pooled = first + second
    common = [token for token, count in pooled.items() if count >= min_count]
    rows = [
        [sample[t] for t in common] + [sum(sample.values()) - sum(sample[t] for t in common)]
        for sample in (first, second)
    ]
    table = torch.tensor(rows, dtype=torch.float64)
    table = table[:, table.sum(0) > 0]
    expected = table.sum(1, keepdim=True) * table.sum(0, keepdim=True) / table.sum()
    statistic = ((table - expected) ** 2 / expected).sum()
    degrees = table.shape[1] - 1
    assert degrees >= 2, "too few distinct tokens for a test"
    return float(torch.special.gammaincc(torch.tensor(degrees / 2, dtype=torch.float64), statistic / 2))


def test_grammar_constrained_rows_draft_only_what_their_grammar_allows_and_decode_the_same(plain, speculative):
    """Drafts are cut to what the row's grammar allows, and each draft row's mask is its grammar's after the
    drafts before it: every document validates and equals the one decoded without drafts."""
    schema = {
        "type": "object",
        "properties": {"sentence": {"type": "string", "maxLength": 120}, "words": {"type": "integer"}},
        "required": ["sentence", "words"],
        "additionalProperties": False,
    }
    output = StructuredOutput.json_schema(schema, "response_format")
    params = SamplingParams(temperature=0, max_tokens=80, structured_output=output, min_tokens=3)
    asks = [
        [{"role": "user", "content": f"{text} Answer in JSON with the sentence and its word count."}]
        for text in QUOTING
    ]
    counts = speculative.engine.scheduler.speculation.by_adapter
    drafted_before = sum(c.drafted for c in counts.values())
    expected = plain.chat(asks, params, adapters=TARGETS[:4], use_tqdm=False)
    got = speculative.chat(asks, params, adapters=TARGETS[:4], use_tqdm=False)
    assert completions(got) == completions(expected)
    for result in got:
        document = json.loads(result.outputs[0].text)
        assert set(document) == {"sentence", "words"}
    assert sum(c.drafted for c in counts.values()) > drafted_before
