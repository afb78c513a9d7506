"""20 adapters through a pool with room for 4: 200 requests, every answer equal to peft's for its adapter."""

from __future__ import annotations

import random

import pytest
import torch

from loraserve import SamplingParams
from tests.conftest import CHAT_PROMPTS

pytestmark = pytest.mark.slow

NUM_ADAPTERS, ROOM_FOR, NUM_REQUESTS, MAX_TOKENS = 20, 4, 200, 4
NUM_PROMPTS = 3  # each adapter's answers to these are peft's references; every request asks one
MAX_NUM_SEQS = 8


@pytest.fixture(scope="module")
def adapters_with_references(model_dir, tmp_path_factory, llm):
    """Save 20 random peft adapters; peft's greedy tokens for each of NUM_PROMPTS prompts."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    prompts = [llm.chat_prompt_ids(conversation) for conversation in CHAT_PROMPTS[:NUM_PROMPTS]]
    adapters = []
    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    for i in range(NUM_ADAPTERS):
        torch.manual_seed(100 + i)
        config = LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"], init_lora_weights=False)
        peft_model = get_peft_model(base, config).eval()
        with torch.no_grad():  # peft's random B is as large as the base weights; keep answers language
            for name, param in peft_model.named_parameters():
                if "lora_B" in name:
                    param.mul_(0.3)
        path = tmp_path_factory.mktemp(f"adapter-{i}")
        peft_model.save_pretrained(path)
        with torch.inference_mode():
            answers = [
                peft_model.generate(torch.tensor([p]), max_new_tokens=MAX_TOKENS, do_sample=False)[0, len(p) :].tolist()
                for p in prompts
            ]
        adapters.append((path, answers))
        base = peft_model.unload()  # the base weights, untouched, for the next adapter
    return prompts, adapters


def test_200_requests_over_20_adapters_through_a_pool_with_room_for_4_equal_peft(make_llm, adapters_with_references):
    """Slots are plenty; memory is not: the pool holds the running sequences' KV and 4 adapters."""
    prompts, adapters = adapters_with_references
    probe = make_llm(max_loras=1).engine
    adapter_pages = probe.model_runner.adapter_slots.pages_needed(probe.read_adapter(adapters[0][0]))
    longest = max(len(p) for p in prompts) + MAX_TOKENS
    kv_pages = MAX_NUM_SEQS * -(-longest // probe.block_manager.block_size)
    llm = make_llm(max_loras=NUM_ADAPTERS, num_pages=kv_pages + ROOM_FOR * adapter_pages, max_num_seqs=MAX_NUM_SEQS)
    for i, (path, _) in enumerate(adapters):
        llm.add_adapter(f"a{i}", path)
    jobs = [(i % NUM_ADAPTERS, (i // NUM_ADAPTERS) % len(prompts)) for i in range(NUM_REQUESTS)]
    random.Random(0).shuffle(jobs)  # adapters interleave: the pool must turn over
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    outputs = llm.generate([prompts[p] for _, p in jobs], params, adapters=[f"a{a}" for a, _ in jobs], use_tqdm=False)
    for (adapter, prompt), output in zip(jobs, outputs, strict=True):
        assert output.outputs[0].finish_reason == "length", "nothing failed"
        assert output.outputs[0].token_ids == adapters[adapter][1][prompt], f"adapter a{adapter}, prompt {prompt}"
    stats = llm.engine.stats()
    assert stats.adapter_evictions > 0 and stats.adapter_loads >= NUM_ADAPTERS
    assert stats.kv_pages == 0
    assert stats.adapter_pages == adapter_pages * len(stats.device_adapters) <= stats.pool_pages
    for i in range(NUM_ADAPTERS):
        llm.remove_adapter(f"a{i}")
    stats = llm.engine.stats()
    assert (stats.adapter_pages, stats.free_pages) == (0, stats.pool_pages), "every page back: the baseline"
