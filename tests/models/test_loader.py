"""Loading: the cached default model, any HF Llama-family directory, clear errors otherwise."""

from __future__ import annotations

import shutil

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig, Qwen2Config

from loraserve import LLM, SamplingParams
from loraserve.config import ModelConfig
from loraserve.errors import ConfigError, ModelLoadError
from loraserve.models import load_model
from loraserve.models.default_model import default_model_dir

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")


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
