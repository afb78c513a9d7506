"""int8 weights are quantized once per model content and kernel build, then read from the cache
beside the model: a restart does not quantize again, changed weights get their own entry, and a
broken cache file is quantized over, never trusted."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM, LlamaConfig

from loraserve.config import ModelConfig
from loraserve.models import load_model
from loraserve.models.cpu import linear as cpu_linear
from loraserve.models.linear import Linear

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("cache")  # one kernel build for the module's tests


@pytest.fixture
def checkpoint(model_dir, tmp_path) -> Path:
    config = LlamaConfig(
        vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, initializer_range=0.5,
    )  # fmt: skip
    torch.manual_seed(0)
    path = tmp_path / tmp_path.name  # its own cache entries in the shared cache directory
    AutoModelForCausalLM.from_config(config).save_pretrained(path)
    for name in TOKENIZER_FILES:
        shutil.copy(model_dir / name, path / name)
    return path


def int8_panels(checkpoint: Path, cache_dir: Path) -> dict[str, torch.Tensor]:
    loaded = load_model(ModelConfig(model=str(checkpoint), dtype="float32", weights="int8", cache_dir=cache_dir))
    panels = {}
    for name, module in loaded.model.named_modules():
        if isinstance(module, Linear):
            panels[name] = module.held.int8.values  # type: ignore[union-attr]
    return panels


def cached_files(cache_dir: Path, checkpoint: Path) -> list[Path]:
    return sorted((cache_dir / "weights").glob(f"{checkpoint.name}-int8-*.safetensors"))


def refuse_to_quantize(monkeypatch) -> None:
    def quantize(weight):
        raise AssertionError("quantized again")

    monkeypatch.setattr(cpu_linear, "quantize_int8", quantize)


def test_a_restart_reads_the_panels_instead_of_quantizing(checkpoint, cache_dir, monkeypatch):
    first = int8_panels(checkpoint, cache_dir)
    assert len(cached_files(cache_dir, checkpoint)) == 1
    refuse_to_quantize(monkeypatch)
    again = int8_panels(checkpoint, cache_dir)
    assert again.keys() == first.keys() and all(torch.equal(again[name], first[name]) for name in first)


def test_changed_weights_are_quantized_into_their_own_entry(checkpoint, cache_dir):
    before = int8_panels(checkpoint, cache_dir)
    weights = checkpoint / "model.safetensors"
    tensors = load_file(weights)
    tensors["model.layers.0.mlp.down_proj.weight"] = tensors["model.layers.0.mlp.down_proj.weight"].flip(1).contiguous()
    save_file(tensors, weights, metadata={"format": "pt"})
    after = int8_panels(checkpoint, cache_dir)
    assert len(cached_files(cache_dir, checkpoint)) == 2
    assert not torch.equal(after["layers.0.mlp.down_proj"], before["layers.0.mlp.down_proj"])
    assert torch.equal(after["layers.1.mlp.down_proj"], before["layers.1.mlp.down_proj"])


@pytest.mark.parametrize("damage", ["garbage", "misfit"])
def test_a_broken_cache_file_is_quantized_over(damage, checkpoint, cache_dir, monkeypatch):
    expected = int8_panels(checkpoint, cache_dir)
    [cached] = cached_files(cache_dir, checkpoint)
    if damage == "garbage":
        cached.write_bytes(b"\x00not a safetensors file")
    else:  # a readable file whose panels are not this model's
        tensors = load_file(cached)
        tensors["lm_head.values"] = tensors["lm_head.values"][:-1]
        save_file(tensors, cached)
    assert int8_panels(checkpoint, cache_dir).keys() == expected.keys()
    refuse_to_quantize(monkeypatch)  # the rewritten file is whole again
    again = int8_panels(checkpoint, cache_dir)
    assert all(torch.equal(again[name], expected[name]) for name in expected)
