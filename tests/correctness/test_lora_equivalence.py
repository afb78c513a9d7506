"""A heterogeneous batch of adapters (LoRA and DoRA) gives each row exactly what peft gives with that adapter alone."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from loraserve import SamplingParams
from loraserve.errors import AdapterError, UnknownAdapterError
from tests.conftest import CHAT_PROMPTS

pytestmark = pytest.mark.slow

MAX_TOKENS = 32
ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
ADAPTERS = {  # ranks 4 to 64, different targets, rsLoRA and plain, rank/alpha patterns, a regex
    "all-r4": dict(r=4, lora_alpha=8, target_modules=ALL),
    "qv-r8": dict(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"]),
    "od-r16-rs": dict(r=16, lora_alpha=16, use_rslora=True, target_modules=["o_proj", "down_proj"]),
    "mlp-r64": dict(r=64, lora_alpha=32, target_modules=["gate_proj", "up_proj", "down_proj"]),
    "patterns": dict(
        r=8, lora_alpha=8, target_modules=["q_proj", "k_proj", "v_proj", "down_proj"],
        rank_pattern={"q_proj": 4, "model.layers.3.self_attn.k_proj": 16}, alpha_pattern={"down_proj": 16},
    ),
    "kv-regex-r16": dict(r=16, lora_alpha=32, target_modules=r".*self_attn\.(k_proj|v_proj)"),
    "all-r4-rs": dict(r=4, lora_alpha=16, use_rslora=True, target_modules=ALL),
    "attn-r64": dict(r=64, lora_alpha=64, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"]),
    # DoRA: rsLoRA on every projection; ranks 8-32 by pattern over q/k/v and gate
    "dora-all-r4-rs": dict(r=4, lora_alpha=16, use_rslora=True, use_dora=True, target_modules=ALL),
    "dora-qkv-gate-r32": dict(
        r=32, lora_alpha=32, use_dora=True, target_modules=["q_proj", "k_proj", "v_proj", "gate_proj"],
        rank_pattern={"k_proj": 8},
    ),
}  # fmt: skip


@pytest.fixture(scope="module")
def peft_references(model_dir, tmp_path_factory, llm):
    """Save each adapter with peft, and record peft's greedy tokens and first-step log-probs for two prompts."""
    from peft import LoraConfig, get_peft_model
    from peft.helpers import DoraCaching
    from transformers import AutoModelForCausalLM

    references = {}
    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    for i, (name, config) in enumerate(ADAPTERS.items()):
        torch.manual_seed(i)
        peft_model = get_peft_model(base, LoraConfig(init_lora_weights=False, **config)).eval()
        # peft's random init makes deltas as large as the base weights; shrink B so answers stay language.
        # DoRA's magnitudes start at the weight norms (a scale of one): move them so the scale counts.
        with torch.no_grad():
            for module_name, param in peft_model.named_parameters():
                if "lora_B" in module_name:
                    param.mul_(0.3)
                if "lora_magnitude_vector" in module_name:
                    param.mul_(1 + 0.1 * torch.randn_like(param))
        path = tmp_path_factory.mktemp(name)
        peft_model.save_pretrained(path)
        prompts = [llm.chat_prompt_ids(CHAT_PROMPTS[(2 * i + j) % len(CHAT_PROMPTS)]) for j in range(2)]
        rows = []
        for prompt in prompts:
            # DoRA's weights (B A, the norms) computed once, not at every token: the same numbers, sooner.
            with torch.inference_mode(), DoraCaching():
                tokens = peft_model.generate(torch.tensor([prompt]), max_new_tokens=MAX_TOKENS, do_sample=False)
                logprobs = peft_model(torch.tensor([prompt])).logits[0, -1].log_softmax(-1)
            rows.append((prompt, tokens[0, len(prompt) :].tolist(), logprobs))
        references[name] = (Path(path), rows)
        base = peft_model.unload()  # the base weights, untouched, for the next adapter
    return references


@pytest.fixture(scope="module")
def lora_llm(make_llm, peft_references):
    llm = make_llm(max_loras=len(ADAPTERS), max_lora_rank=64)
    for name, (path, _) in peft_references.items():
        llm.add_adapter(name, path)
    return llm


def test_heterogeneous_batch_matches_peft_per_row(lora_llm, peft_references, hf_greedy):
    prompts, adapters, expected = [], [], []
    for name, (_, rows) in peft_references.items():
        for prompt, tokens, _ in rows:
            prompts.append(prompt)
            adapters.append(name)
            expected.append(tokens)
    for conv in CHAT_PROMPTS[:2]:  # rows with no adapter in the same batch
        prompt = lora_llm.chat_prompt_ids(conv)
        prompts.append(prompt)
        adapters.append(None)
        expected.append(hf_greedy(prompt, MAX_TOKENS))
    # Interleave so one step mixes every adapter, decode and prefill alike.
    order = sorted(range(len(prompts)), key=lambda i: (i % 3, i))
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, logprobs=5)
    outputs = lora_llm.generate(
        [prompts[i] for i in order], params, adapters=[adapters[i] for i in order], use_tqdm=False
    )
    for i, output in zip(order, outputs, strict=True):
        assert output.outputs[0].token_ids == expected[i], f"row {i} ({adapters[i]}) differs from peft"
    # The comparison has teeth: most adapters change the greedy answer.
    changed = sum(expected[i] != hf_greedy(prompts[i], MAX_TOKENS) for i in range(len(prompts)) if adapters[i])
    assert changed >= len(ADAPTERS), f"only {changed} of {2 * len(ADAPTERS)} adapter rows differ from the base model"


def test_first_step_logprobs_match_peft(lora_llm, peft_references):
    params = SamplingParams(temperature=0.0, max_tokens=1, logprobs=20)
    for name, (_, rows) in peft_references.items():
        prompts = [prompt for prompt, _, _ in rows]
        outputs = lora_llm.generate(prompts, params, adapters=[name] * len(prompts), use_tqdm=False)
        for (_, _, reference), output in zip(rows, outputs, strict=True):
            for token_id, logprob in output.outputs[0].logprobs[0].top.items():
                assert logprob == pytest.approx(reference[token_id].item(), abs=1e-3), name


def test_adapters_change_the_answer_and_removal_frees_the_slot(lora_llm, peft_references):
    prompt = peft_references["all-r4"][1][0][0]
    greedy = SamplingParams(temperature=0.0, max_tokens=12, logprobs=0)
    base, adapted = lora_llm.generate([prompt, prompt], greedy, adapters=[None, "all-r4"], use_tqdm=False)
    base_logprobs = [e.logprob for e in base.outputs[0].logprobs]
    adapted_logprobs = [e.logprob for e in adapted.outputs[0].logprobs]
    assert base_logprobs != pytest.approx(adapted_logprobs, abs=1e-3)
    lora_llm.remove_adapter("all-r4")
    with pytest.raises(Exception, match="no adapter named"):
        lora_llm.generate([prompt], greedy, adapters=["all-r4"], use_tqdm=False)
    lora_llm.add_adapter("all-r4", peft_references["all-r4"][0])
    again = lora_llm.generate([prompt], greedy, adapters=["all-r4"], use_tqdm=False)
    assert again[0].outputs[0].token_ids == adapted.outputs[0].token_ids
    assert [e.logprob for e in again[0].outputs[0].logprobs] == pytest.approx(adapted_logprobs, abs=1e-5)


def test_the_prefix_cache_reuses_kv_only_under_the_same_adapter_weights(lora_llm, peft_references):
    """Keys hold the adapter's content hash, not its name: the base model, another adapter, or a
    name re-uploaded with other weights compute their own K/V; the same weights under any name reuse it."""
    path, [(prompt, expected, _), _] = peft_references["kv-regex-r16"]  # adapts k and v: its K/V are its own
    other_path = peft_references["qv-r8"][0]
    scheduler, block_size = lora_llm.engine.scheduler, lora_llm.engine.block_manager.block_size
    greedy = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS)

    def run(adapter: str | None) -> tuple[list[int], int]:
        hits_before = scheduler.prefix_cache_hit_tokens
        (output,) = lora_llm.generate([prompt], greedy, adapters=[adapter], use_tqdm=False)
        return output.outputs[0].token_ids, scheduler.prefix_cache_hit_tokens - hits_before

    lora_llm.reset_prefix_cache()
    assert run(None)[1] == 0
    assert run("kv-regex-r16") == (expected, 0)
    assert run("kv-regex-r16") == (expected, (len(prompt) - 1) // block_size * block_size)
    lora_llm.add_adapter("renamed", other_path)
    assert run("renamed")[1] == 0
    lora_llm.remove_adapter("renamed")
    lora_llm.add_adapter("renamed", path)  # the name again, now with kv-regex-r16's weights
    assert run("renamed") == (expected, (len(prompt) - 1) // block_size * block_size)
    lora_llm.remove_adapter("renamed")


def test_a_refused_adapter_loads_nothing(lora_llm, peft_references, tmp_path):
    broken = tmp_path / "broken"
    broken.mkdir()
    source = peft_references["qv-r8"][0]
    for file in source.iterdir():
        (broken / file.name).write_bytes(file.read_bytes())
    config = (broken / "adapter_config.json").read_text().replace('"use_dora": false', '"use_dora": true')
    (broken / "adapter_config.json").write_text(config)
    before = list(lora_llm.engine.adapter_names)
    with pytest.raises(AdapterError, match="use_dora"):
        lora_llm.add_adapter("broken", broken)
    with pytest.raises(AdapterError, match="already loaded"):
        lora_llm.add_adapter("qv-r8", source)
    assert lora_llm.engine.adapter_names == before
    with pytest.raises(UnknownAdapterError):
        lora_llm.generate("hi", adapters=["broken"], use_tqdm=False)
