"""Loading: the cached default model, any HF Llama-family directory, clear errors otherwise."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM, LlamaConfig, Qwen2Config

from loraserve import LLM, SamplingParams
from loraserve.config import ModelConfig
from loraserve.errors import ConfigError, ModelLoadError
from loraserve.models import load_model
from loraserve.models.default_model import default_model_dir

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")
TINY = dict(
    vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, max_position_embeddings=64,
)  # fmt: skip


def test_default_model_is_converted_once_and_reused(model_dir, tmp_path):
    weights = model_dir / "model.safetensors"
    before = weights.stat().st_mtime_ns
    assert default_model_dir(model_dir.parent.parent) == model_dir
    assert weights.stat().st_mtime_ns == before
    assert (model_dir / "config.json").is_file() and (model_dir / "tokenizer.json").is_file()


def _tiny_checkpoint(config, model_dir, path):
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config).eval()
    model.save_pretrained(path)
    for name in TOKENIZER_FILES:
        shutil.copy(model_dir / name, path / name)
    return model


@pytest.mark.parametrize(
    "config",
    [
        Qwen2Config(  # q/k/v biases, untied LM head
            vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False, initializer_range=0.5,
        ),
        LlamaConfig(  # Llama 3 RoPE scaling, no GQA
            vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=4, initializer_range=0.5,
            rope_parameters={
                "rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
                "high_freq_factor": 4.0, "original_max_position_embeddings": 64,
            },
        ),
    ],
    ids=["qwen2-bias-untied", "llama3-rope"],
)  # fmt: skip
def test_hf_directory_loads_and_matches_transformers(config, model_dir, tmp_path):
    reference = _tiny_checkpoint(config, model_dir, tmp_path)
    llm = LLM(str(tmp_path), dtype="float32", num_pages=64)
    prompts = [[5, 17, 300, 4000, 12], [9, 8, 7, 6, 5, 4, 3, 2, 1, 99, 123]]
    outputs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True), use_tqdm=False)
    for prompt, output in zip(prompts, outputs, strict=True):
        with torch.inference_mode():
            expected = reference.generate(
                torch.tensor([prompt]), max_new_tokens=20, min_new_tokens=20, do_sample=False
            )[0, len(prompt) :]
        assert output.outputs[0].token_ids == expected.tolist()


def test_missing_model_directory_names_the_flag(tmp_path):
    with pytest.raises(ConfigError, match="--model"):
        ModelConfig(model=str(tmp_path / "nope"))


def test_directory_without_config_or_weights_is_refused(model_dir, tmp_path):
    with pytest.raises(ModelLoadError, match=r"no config\.json"):
        load_model(ModelConfig(model=str(tmp_path)))
    shutil.copy(model_dir / "config.json", tmp_path / "config.json")
    (tmp_path / "pytorch_model.bin").write_bytes(b"not loaded")
    with pytest.raises(ModelLoadError, match=r"no \*\.safetensors"):
        load_model(ModelConfig(model=str(tmp_path)))


def test_unsupported_architecture_is_refused(tmp_path):
    (tmp_path / "config.json").write_text('{"model_type": "gpt2"}')
    with pytest.raises(ModelLoadError, match="model_type 'gpt2' is not supported"):
        load_model(ModelConfig(model=str(tmp_path)))


REFUSED = {
    "mixtral": ({"model_type": "mixtral", "num_local_experts": 8}, "'mixtral' is not supported: a mixture-of-experts"),
    "qwen3-moe": (
        {"model_type": "qwen3_moe", "num_experts": 128},
        "'qwen3_moe' is not supported: a mixture-of-experts",
    ),
    "gemma3-multimodal": (
        {"model_type": "gemma3", "text_config": {"hidden_size": 64}, "vision_config": {}},
        r"'gemma3' is not supported: a multimodal model \(vision_config\)",
    ),
    "unknown": ({"model_type": "no-such-family"}, "model_type 'no-such-family' is not supported"),
    "activation": ({"model_type": "llama", "hidden_act": "gelu", **TINY}, "llama: hidden_act='gelu' is not supported"),
    "bidirectional": (
        {"model_type": "gemma3_text", "use_bidirectional_attention": True, **TINY},
        "use_bidirectional_attention=True is not supported",
    ),
    "layer-type": (
        {"model_type": "qwen3", "layer_types": ["chunked_attention"] * 2, **TINY},
        r"layer_types \['chunked_attention'\] are not supported",
    ),
    "dynamic-rope": (
        {"model_type": "llama", "rope_scaling": {"rope_type": "dynamic", "factor": 2.0}, **TINY},
        "rope_type 'dynamic' is not supported",
    ),
}


@pytest.mark.parametrize("config, says", REFUSED.values(), ids=REFUSED.keys())
def test_a_model_the_forward_would_get_wrong_is_refused_by_name_at_start(config, says, tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelLoadError, match=says):
        load_model(ModelConfig(model=str(tmp_path), random_weights=True))


def test_a_checkpoint_tensor_the_forward_has_no_place_for_is_refused(model_dir, tmp_path):
    _tiny_checkpoint(LlamaConfig(**TINY), model_dir, tmp_path)
    weights = tmp_path / "model.safetensors"
    tensors = load_file(weights)
    tensors["model.layers.0.self_attn.q_proj.bias"] = torch.zeros(64)  # a bias the config does not declare
    save_file(tensors, weights)
    with pytest.raises(ModelLoadError, match=r"holds model\.layers\.0\.self_attn\.q_proj\.bias, which the llama"):
        load_model(ModelConfig(model=str(tmp_path)))


def test_the_default_block_size_grows_until_a_page_holds_an_adapter_row(model_dir, tmp_path):
    """One narrow KV head and a wide MLP (as Gemma-3-1B: one head of 256, 6,912 wide): a 16-token page
    is narrower than an adapter's row. The default grows to fit; a size asked for by name is refused."""
    narrow = {**TINY, "num_key_value_heads": 1, "intermediate_size": 512}  # 16 tokens x 16 = 256 < 512
    _tiny_checkpoint(LlamaConfig(**narrow), model_dir, tmp_path)
    with LLM(str(tmp_path), dtype="float32", num_pages=32) as llm:
        assert llm.engine.block_manager.block_size == 32
        output = llm.generate([[5, 17, 300]], SamplingParams(temperature=0.0, max_tokens=4), use_tqdm=False)
        assert len(output[0].outputs[0].token_ids) == 4
    with pytest.raises(ConfigError, match="use at least 32") as refused:
        LLM(str(tmp_path), dtype="float32", num_pages=32, block_size=8)
    assert refused.value.field == "--block-size"
