"""Per-request mixes of adapters (merged_adapters) compute what peft's add_weighted_adapter computes.

Each deterministic strategy is served in one heterogeneous batch (mixes, a plain adapter, the base
model) and every row's greedy tokens equal peft's with the merged adapter. DARE draws random masks:
peft draws them from the global generator after its own adapter initialisation has drawn from it,
so for DARE the merged weights are compared with peft's merge functions given the same masks.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from loraserve import SamplingParams
from loraserve.errors import InvalidRequestError, UnknownAdapterError
from loraserve.lora.adapter import PROJECTIONS
from loraserve.lora.mix_spec import MixSpec, mix_seed
from tests.conftest import CHAT_PROMPTS

pytestmark = pytest.mark.slow

MAX_TOKENS = 24
PARTS = {  # rank 8 (so every strategy applies), different targets, an rsLoRA part that is not the first
    "all-r8": dict(r=8, lora_alpha=16, target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "up_proj"]),
    "qv-r8-rs": dict(r=8, lora_alpha=8, use_rslora=True, target_modules=["q_proj", "v_proj", "down_proj"]),
    "mlp-r8": dict(r=8, lora_alpha=32, target_modules=["gate_proj", "up_proj", "down_proj"]),
    "qk-r16": dict(r=16, lora_alpha=16, target_modules=["q_proj", "k_proj"]),  # another rank: cat only
    "dora-r8": dict(r=8, lora_alpha=16, use_dora=True, target_modules=["q_proj", "v_proj"]),
}  # fmt: skip
WEIGHTS = [0.8, 0.6, -0.5]
MIXES = {  # name -> (merged_adapters, peft's combination_type)
    "linear": (dict(ids=["all-r8", "qv-r8-rs", "mlp-r8"], weights=WEIGHTS), "linear"),
    "cat": (dict(ids=["all-r8", "qv-r8-rs", "mlp-r8"], weights=WEIGHTS, merge_strategy="cat"), "cat"),
    "ties": (dict(ids=["all-r8", "qv-r8-rs", "mlp-r8"], weights=WEIGHTS, merge_strategy="ties", density=0.6), "ties"),
    "ties-frequency": (
        dict(ids=["all-r8", "mlp-r8"], weights=[1.0, 0.7], merge_strategy="ties", density=0.4,
             majority_sign_method="frequency"),
        "ties",
    ),
    "magnitude_prune": (
        dict(ids=["all-r8", "qv-r8-rs"], weights=[0.9, 0.9], merge_strategy="magnitude_prune", density=0.5),
        "magnitude_prune",
    ),
    "linear-ranks-differ": (dict(ids=["all-r8", "qk-r16"], weights=[0.7, 1.2]), "cat"),  # served as cat
}  # fmt: skip


@pytest.fixture(scope="module")
def part_dirs(model_dir, tmp_path_factory) -> dict[str, Path]:
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    dirs = {}
    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    for i, (name, config) in enumerate(PARTS.items()):
        torch.manual_seed(100 + i)
        peft_model = get_peft_model(base, LoraConfig(init_lora_weights=False, **config))
        with torch.no_grad():
            for param_name, param in peft_model.named_parameters():
                if "lora_B" in param_name:
                    param.mul_(0.3)
        dirs[name] = tmp_path_factory.mktemp(name)
        peft_model.save_pretrained(dirs[name])
        base = peft_model.unload()  # the base weights, untouched, for the next part
    return dirs


@pytest.fixture(scope="module")
def mix_llm(make_llm, part_dirs):
    llm = make_llm(max_loras=8, max_lora_rank=24)
    for name, path in part_dirs.items():
        llm.add_adapter(name, path)
    return llm


@pytest.fixture(scope="module")
def peft_with_parts(model_dir, part_dirs):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    names = [name for name in PARTS if name != "dora-r8"]
    model = PeftModel.from_pretrained(base, part_dirs[names[0]], adapter_name=names[0])
    for name in names[1:]:
        model.load_adapter(part_dirs[name], adapter_name=name)
    return model.eval()


def peft_greedy(model, prompt: list[int]) -> list[int]:
    with torch.inference_mode():
        tokens = model.generate(torch.tensor([prompt]), max_new_tokens=MAX_TOKENS, do_sample=False)
    return tokens[0, len(prompt) :].tolist()


def test_each_strategy_in_one_batch_gives_peft_s_tokens_row_by_row(mix_llm, peft_with_parts, hf_greedy):
    engine = mix_llm.engine
    prompts, adapters, expected = [], [], []
    for i, (label, (merged, combination)) in enumerate(MIXES.items()):
        spec = MixSpec.parse(merged, max_parts=4)
        name = engine.mix_adapters(spec)
        prompt = mix_llm.chat_prompt_ids(CHAT_PROMPTS[i % len(CHAT_PROMPTS)])
        peft_with_parts.add_weighted_adapter(
            list(spec.ids), list(spec.weights), label, combination_type=combination, density=spec.density,
            majority_sign_method=spec.majority_sign_method,
        )  # fmt: skip
        peft_with_parts.set_adapter(label)
        prompts.append(prompt)
        adapters.append(name)
        expected.append(peft_greedy(peft_with_parts, prompt))
    peft_with_parts.set_adapter("mlp-r8")
    for adapter in ("mlp-r8", None):  # a plain adapter and the base model in the same batch
        prompt = mix_llm.chat_prompt_ids(CHAT_PROMPTS[len(prompts) % len(CHAT_PROMPTS)])
        prompts.append(prompt)
        adapters.append(adapter)
        expected.append(peft_greedy(peft_with_parts, prompt) if adapter else hf_greedy(prompt, MAX_TOKENS))
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS)
    outputs = mix_llm.generate(prompts, params, adapters=adapters, use_tqdm=False)
    labels = [*MIXES, "mlp-r8", "base"]
    for label, output, want in zip(labels, outputs, expected, strict=True):
        assert output.outputs[0].token_ids == want, f"{label} differs from peft"
    mixed_rows = zip(prompts[: len(MIXES)], expected[: len(MIXES)], strict=True)
    changed = sum(want != hf_greedy(prompt, MAX_TOKENS) for prompt, want in mixed_rows)
    assert changed >= len(MIXES) - 1, "the mixes must change the answer for the comparison to mean anything"


@pytest.mark.parametrize("strategy", ["dare_linear", "dare_ties"])
def test_dare_mixes_equal_peft_s_merge_given_the_same_masks(mix_llm, strategy):
    from peft.utils import merge_utils

    engine = mix_llm.engine
    spec = MixSpec.parse(dict(ids=["all-r8", "qv-r8-rs"], weights=[0.9, -0.4], merge_strategy=strategy,
                              density=0.5, majority_sign_method="frequency"), max_parts=4)  # fmt: skip
    name = engine.mix_adapters(spec)
    mixed = engine.read_source(engine.adapters.record(name).source)
    parts = [engine.read_adapter(engine.adapters.record(part).source.path) for part in spec.ids]
    torch.manual_seed(mix_seed(mixed.sha256))  # peft's masks come from the global generator, in this order
    merge = getattr(merge_utils, strategy)
    extra = {} if strategy == "dare_linear" else {"majority_sign_method": "frequency"}
    for layer in range(engine.loaded.model.spec.num_layers):
        for projection in PROJECTIONS:
            module = (layer, projection)
            present = [(p.weights[module], w) for p, w in zip(parts, spec.weights, strict=True) if module in p.weights]
            if not present:
                assert (layer, projection) not in mixed.weights
                continue
            scaled = [w * module.scale for module, w in present]
            a_weights = torch.tensor([math.sqrt(abs(w)) * (1 if w >= 0 else -1) for w in scaled])
            b_weights = torch.tensor([math.sqrt(abs(w)) for w in scaled])
            a = merge([m.a for m, _ in present], a_weights, spec.density, **extra)
            b = merge([m.b for m, _ in present], b_weights, spec.density, **extra)
            got = mixed.weights[(layer, projection)]
            assert torch.equal(got.a, a) and torch.equal(got.b, b) and got.scale == 1.0, (layer, projection)
    (output,) = mix_llm.generate([mix_llm.chat_prompt_ids(CHAT_PROMPTS[0])], SamplingParams(max_tokens=4),
                                 adapters=[name], use_tqdm=False)  # fmt: skip
    assert len(output.outputs[0].token_ids) == 4


def test_a_mix_is_one_adapter_named_by_its_content_and_goes_with_its_parts(mix_llm, part_dirs):
    engine = mix_llm.engine
    merged = dict(ids=["all-r8", "mlp-r8"], weights=[0.5, 0.5], merge_strategy="cat")
    first = engine.mix_adapters(MixSpec.parse(merged, max_parts=4))
    assert engine.mix_adapters(MixSpec.parse(dict(merged), max_parts=4)) == first  # made once
    part_hashes = {engine.adapters.record(part).source.sha256 for part in merged["ids"]}
    assert engine.adapters.record(first).source.sha256 not in part_hashes
    assert first not in engine.adapter_names  # a mix is not a registered adapter
    other = engine.mix_adapters(MixSpec.parse({**merged, "weights": [0.5, 0.6]}, max_parts=4))
    assert other != first
    mix_llm.remove_adapter("mlp-r8")
    assert engine.adapters.record(first) is None and engine.adapters.record(other) is None
    mix_llm.add_adapter("mlp-r8", part_dirs["mlp-r8"])
    assert engine.mix_adapters(MixSpec.parse(merged, max_parts=4)) == first  # same contents, same name


@pytest.mark.parametrize(
    ("merged", "field", "message"),
    [
        ({"ids": ["all-r8", "dora-r8"], "weights": [1, 1]}, "merged_adapters.ids", "DoRA"),
        ({"ids": ["all-r8", "qk-r16"], "weights": [1, 1], "merge_strategy": "ties"}, "merged_adapters.merge_strategy",
         "one rank"),
        ({"ids": ["all-r8", "qk-r16", "qv-r8-rs"], "weights": [1, 1, 1], "merge_strategy": "cat"}, "merged_adapters",
         "at most 24"),
        ({"ids": ["all-r8", "nope"], "weights": [1, 1]}, "merged_adapters.ids", "nope"),
        ({"ids": ["all-r8"], "weights": [1, 2]}, "merged_adapters.weights", "one per id"),
        ({"ids": ["all-r8"], "weights": [math.inf]}, "merged_adapters.weights", "finite"),
        ({"ids": ["all-r8", "mlp-r8"], "weights": [1e39, 1.0], "merge_strategy": "cat"}, "merged_adapters.weights",
         "overflow"),
        ({"ids": ["all-r8", "all-r8"], "weights": [1, 1]}, "merged_adapters.ids", "twice"),
        ({"ids": ["a", "b", "c", "d", "e"], "weights": [1] * 5}, "merged_adapters.ids", "at most 4"),
        ({"ids": ["all-r8"], "weights": [1], "density": 0}, "merged_adapters.density", r"\(0, 1\]"),
        ({"ids": ["all-r8"], "weights": [1], "merge_strategy": "svd"}, "merged_adapters.merge_strategy", "one of"),
        ({"ids": ["all-r8"], "weights": [1], "majority_sign_method": "x"}, "merged_adapters.majority_sign_method",
         "one of"),
        ({"ids": ["all-r8"], "weights": [1], "seed": 3}, "merged_adapters.seed", "not a field"),
        ([1, 2], "merged_adapters", "object"),
    ],
)  # fmt: skip
def test_a_mix_that_cannot_be_made_is_refused_naming_the_field(mix_llm, merged, field, message):
    with pytest.raises(InvalidRequestError, match=message) as error:
        mix_llm.engine.mix_adapters(MixSpec.parse(merged, max_parts=4))
    assert error.value.field == field
    assert isinstance(error.value, UnknownAdapterError) == (message == "nope")
