"""Sampling behaviour users rely on, on the real model."""

from __future__ import annotations

import math

import pytest
import torch

from loraserve import SamplingParams
from loraserve.engine.sampler import Sampler
from tests.conftest import CHAT_PROMPTS
from tests.engine.helpers import make_sequence

pytestmark = pytest.mark.slow

PROMPT = CHAT_PROMPTS[2]


def greedy(llm, max_tokens=24):
    return llm.chat(PROMPT, SamplingParams(temperature=0.0, max_tokens=max_tokens), use_tqdm=False)[0].outputs[0]


def test_seeded_sampling_is_reproducible_whatever_the_batch(llm):
    params = SamplingParams(temperature=1.0, seed=1234, max_tokens=24)
    alone = llm.chat(PROMPT, params, use_tqdm=False)[0].outputs[0].token_ids
    busy = (
        llm.chat(
            [*CHAT_PROMPTS[:5], PROMPT],
            [SamplingParams(temperature=0.9, max_tokens=30)] * 5 + [params],
            use_tqdm=False,
        )[-1]
        .outputs[0]
        .token_ids
    )
    assert alone == busy
    other_seed = llm.chat(PROMPT, SamplingParams(temperature=1.0, seed=99, max_tokens=24), use_tqdm=False)
    assert other_seed[0].outputs[0].token_ids != alone


def test_top_k_one_is_greedy(llm):
    sampled = llm.chat(PROMPT, SamplingParams(temperature=1.5, top_k=1, max_tokens=24), use_tqdm=False)
    assert sampled[0].outputs[0].token_ids == greedy(llm).token_ids


def test_stop_string_truncates_the_text(llm):
    reference = greedy(llm, max_tokens=40)
    words = reference.text.split()
    stop = words[len(words) // 2]
    output = llm.chat(PROMPT, SamplingParams(temperature=0.0, max_tokens=40, stop=[stop]), use_tqdm=False)[0]
    completion = output.outputs[0]
    assert completion.finish_reason == "stop"
    assert stop not in completion.text
    assert reference.text.startswith(completion.text)
    assert len(completion.token_ids) < len(reference.token_ids)


def test_stop_token_id_ends_the_sequence_on_that_token(llm):
    reference = greedy(llm).token_ids
    stop_token = reference[5]
    first = reference.index(stop_token)
    output = llm.chat(
        PROMPT, SamplingParams(temperature=0.0, max_tokens=24, stop_token_ids=[stop_token]), use_tqdm=False
    )
    assert output[0].outputs[0].token_ids == reference[: first + 1]
    assert output[0].outputs[0].finish_reason == "stop"


def test_eos_stops_unless_ignored(llm):
    conv = CHAT_PROMPTS[0]  # answered in a few tokens, then <|im_end|>
    stopped = llm.chat(conv, SamplingParams(temperature=0.0, max_tokens=64), use_tqdm=False)[0].outputs[0]
    assert stopped.finish_reason == "stop"
    assert stopped.token_ids[-1] in llm.engine.loaded.eos_token_ids
    ignored = llm.chat(conv, SamplingParams(temperature=0.0, max_tokens=64, ignore_eos=True), use_tqdm=False)
    assert ignored[0].outputs[0].finish_reason == "length"
    assert len(ignored[0].outputs[0].token_ids) == 64


def test_logprobs_of_greedy_tokens_are_the_top_alternative(llm):
    output = llm.chat(PROMPT, SamplingParams(temperature=0.0, max_tokens=8, logprobs=3), use_tqdm=False)[0].outputs[0]
    assert output.logprobs is not None and len(output.logprobs) == 8
    for token_id, entry in zip(output.token_ids, output.logprobs, strict=True):
        assert entry.token_id == token_id
        assert len(entry.top) == 3
        assert entry.logprob <= 0.0
        assert max(entry.top.values()) == pytest.approx(entry.logprob)


def test_timings_are_recorded(llm):
    output = llm.chat(PROMPT, SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True), use_tqdm=False)[0]
    timings = output.timings
    assert timings.queue_time is not None and timings.queue_time >= 0
    assert timings.ttft is not None and timings.ttft >= timings.queue_time
    assert len(timings.inter_token_latencies) == 9
    assert all(latency > 0 for latency in timings.inter_token_latencies)
    assert timings.e2e is not None and timings.e2e >= timings.ttft


def test_penalties_lower_the_logits_of_repeated_tokens():
    sampler = Sampler(seed=0, device="cpu")
    seq = make_sequence(3, SamplingParams(presence_penalty=0.5, frequency_penalty=0.25, repetition_penalty=2.0))
    seq.token_ids += [5, 5, 6]  # generated: token 5 twice, token 6 once; prompt is tokens 1..3
    logits = torch.full((1, 10), 4.0)
    logits[0, 2] = -4.0
    penalized = sampler._apply_penalties(logits, [seq])[0]
    assert penalized[5].item() == pytest.approx((4.0 - 0.5 - 0.5) / 2.0)  # presence + 2 x frequency, then / 2
    assert penalized[6].item() == pytest.approx((4.0 - 0.5 - 0.25) / 2.0)
    assert penalized[1].item() == pytest.approx(4.0 / 2.0)  # prompt token: repetition penalty only
    assert penalized[2].item() == pytest.approx(-4.0 * 2.0)  # negative logits are multiplied
    assert penalized[9].item() == pytest.approx(4.0)  # never seen


def test_top_p_keeps_the_smallest_set_reaching_the_mass():
    sampler = Sampler(seed=0, device="cpu")
    probs = torch.tensor([[0.5, 0.3, 0.15, 0.05]])
    seqs = [make_sequence(2, SamplingParams(top_p=0.7, seed=s), seq_id=s) for s in range(200)]
    draws = sampler._sample(probs.log().expand(200, 4), seqs).tolist()
    assert set(draws) == {0, 1}
    assert math.isclose(draws.count(0) / 200, 0.5 / 0.8, abs_tol=0.12)
