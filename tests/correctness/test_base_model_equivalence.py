"""Greedy tokens equal transformers' `generate` on the same float32 weights."""

from __future__ import annotations

import pytest

from loraserve import SamplingParams
from tests.conftest import CHAT_PROMPTS

MAX_TOKENS = 40
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS)

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def references(llm, hf_greedy) -> list[list[int]]:
    return [hf_greedy(llm.chat_prompt_ids(conv), MAX_TOKENS) for conv in CHAT_PROMPTS]


def test_chat_as_one_batch_matches_transformers(llm, references):
    outputs = llm.chat(CHAT_PROMPTS, GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outputs] == references


def test_chat_one_at_a_time_matches_transformers(llm, references):
    # Batches of one take the same kernels whatever the prompt: four prompts of different lengths suffice.
    for conv, reference in zip(CHAT_PROMPTS[:4], references[:4], strict=True):
        (output,) = llm.chat(conv, GREEDY, use_tqdm=False)
        assert output.outputs[0].token_ids == reference


def test_staggered_arrivals_while_others_decode_match_transformers(llm, references):
    """Requests join the running batch at different steps, some while others are mid-decode."""
    engine = llm.engine
    prompts = [llm.chat_prompt_ids(conv) for conv in CHAT_PROMPTS]
    finished = {}
    next_prompt = 0
    step = 0
    while next_prompt < len(prompts) or engine.has_unfinished_requests():
        # Two new requests every third step.
        if step % 3 == 0:
            for _ in range(2):
                if next_prompt < len(prompts):
                    engine.add_request(f"staggered-{next_prompt}", prompts[next_prompt], GREEDY)
                    next_prompt += 1
        for output in engine.step():
            if output.finished:
                finished[int(output.request_id.split("-")[1])] = output.outputs[0].token_ids
        step += 1
    assert [finished[i] for i in range(len(prompts))] == references


def test_chunked_prefill_matches_transformers(make_llm, references):
    """A 16-token budget splits every prompt into chunks computed over several steps."""
    llm = make_llm(max_num_batched_tokens=16)
    outputs = llm.chat(CHAT_PROMPTS[:6], GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outputs] == references[:6]


def test_generate_on_text_matches_transformers(llm, hf_greedy):
    texts = [
        llm.tokenizer.apply_chat_template(conv, tokenize=False, add_generation_prompt=True) for conv in CHAT_PROMPTS
    ]
    outputs = llm.generate(texts, GREEDY, use_tqdm=False)
    for text, output in zip(texts, outputs, strict=True):
        prompt_ids = llm.tokenizer(text)["input_ids"]
        assert output.prompt_token_ids == prompt_ids
        assert output.outputs[0].token_ids == hf_greedy(prompt_ids, MAX_TOKENS)
        assert output.outputs[0].text == llm.tokenizer.decode(output.outputs[0].token_ids, skip_special_tokens=True)


def test_preemption_under_kv_pressure_matches_transformers_and_frees_every_block(make_llm, references):
    """24 blocks of 16 tokens cannot hold 8 sequences of ~70 tokens: some are preempted and recomputed."""
    llm = make_llm(num_pages=24)
    outputs = llm.chat(CHAT_PROMPTS[:8], GREEDY, use_tqdm=False)
    engine = llm.engine
    assert engine.scheduler.num_preemptions > 0
    assert [o.outputs[0].token_ids for o in outputs] == references[:8]
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
    assert not engine.has_unfinished_requests()


def test_n_greater_than_one_shares_prompt_blocks_and_each_copy_matches(llm, references):
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, n=3)
    engine = llm.engine
    request = engine.add_request("fork", llm.chat_prompt_ids(CHAT_PROMPTS[1]), params)
    engine.step()  # prefill: the siblings fork off the prompt's blocks
    parent, *children = request.seqs
    assert len(children) == 2
    num_prompt_blocks = engine.block_manager.blocks_for_tokens(parent.num_prompt_tokens)
    assert all(c.block_table[:num_prompt_blocks] == parent.block_table[:num_prompt_blocks] for c in children)
    shared = [engine.block_manager.ref_count(b) for b in parent.block_table[:num_prompt_blocks]]
    assert shared == [3] * num_prompt_blocks
    outputs = []
    while engine.has_unfinished_requests():
        outputs += [o for o in engine.step() if o.finished]
    (output,) = outputs
    assert [c.token_ids for c in output.outputs] == [references[1]] * 3
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


def test_prompts_found_in_the_prefix_cache_match_transformers_and_a_cache_miss(make_llm, references, hf_greedy):
    """A second round of the same prompts starts on cached blocks; so does a follow-up turn that
    repeats the first turn's prompt and answer. Hits give the tokens and log-probs a miss gives."""
    cached, uncached = make_llm(), make_llm(prefix_caching=False)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, logprobs=0)
    misses = uncached.chat(CHAT_PROMPTS, params, use_tqdm=False)
    cached.chat(CHAT_PROMPTS, params, use_tqdm=False)
    scheduler, block_size = cached.engine.scheduler, cached.engine.block_manager.block_size
    hits_before = scheduler.prefix_cache_hit_tokens
    hits = cached.chat(CHAT_PROMPTS, params, use_tqdm=False)
    full_blocks = [(len(output.prompt_token_ids) - 1) // block_size * block_size for output in hits]
    assert scheduler.prefix_cache_hit_tokens - hits_before == sum(full_blocks)
    assert uncached.engine.scheduler.prefix_cache_hit_tokens == 0
    for hit, miss, reference in zip(hits, misses, references, strict=True):
        assert hit.outputs[0].token_ids == miss.outputs[0].token_ids == reference
        hit_logprobs = [entry.logprob for entry in hit.outputs[0].logprobs]
        assert hit_logprobs == pytest.approx([entry.logprob for entry in miss.outputs[0].logprobs], abs=1e-4)
    follow_up = [
        *CHAT_PROMPTS[3],
        {"role": "assistant", "content": hits[3].outputs[0].text},
        {"role": "user", "content": "Now say it in five words."},
    ]
    hits_before = scheduler.prefix_cache_hit_tokens
    (output,) = cached.chat(follow_up, GREEDY, use_tqdm=False)
    assert output.outputs[0].token_ids == hf_greedy(cached.chat_prompt_ids(follow_up), MAX_TOKENS)
    assert scheduler.prefix_cache_hit_tokens - hits_before >= full_blocks[3]
