"""Models with random weights, for benchmark runs where the real weights cannot be had.

A lent GPU machine receives at most 64 MiB and downloads nothing: speed does not depend on
what the weights learned, and every benchmark ignores EOS, so each system generates the
same number of tokens.

    python -m benchmarks.random_model SOURCE_DIR OUT_DIR              # SOURCE_DIR's architecture, saved weights
    python -m benchmarks.random_model --shapes llama3-8b OUT_DIR      # config + tokenizer only: run with
                                                                      # --random-weights (made on the device)
    python -m benchmarks.random_model --shapes qwen3-0.6b --weights OUT_DIR   # and random bfloat16 weights
                                                                      # saved, for a peer to convert

SOURCE_DIR holds config.json and tokenizer files (default: the embedded model's). With
--shapes the tokenizer is the embedded model's: ids past its vocabulary decode to nothing.
"""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM, PreTrainedModel

from loraserve.config import default_cache_dir
from loraserve.models.default_model import default_model_dir

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "generation_config.json")

# Llama-3-8B's architecture as its config.json gives it.
SHAPES = {
    "llama3-8b": {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 4096,
        "intermediate_size": 14336, "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
        "head_dim": 128, "vocab_size": 128256, "max_position_embeddings": 8192, "rms_norm_eps": 1e-5,
        "rope_theta": 500000.0, "tie_word_embeddings": False, "attention_bias": False, "mlp_bias": False,
        "hidden_act": "silu", "bos_token_id": 1, "eos_token_id": 2, "torch_dtype": "bfloat16",
    },
    # The model families' small members, as their config.json give them (issue 56's real shapes).
    "qwen3-0.6b": {
        "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "hidden_size": 1024, "intermediate_size": 3072,
        "num_hidden_layers": 28, "num_attention_heads": 16, "num_key_value_heads": 8, "head_dim": 128,
        "vocab_size": 151936, "max_position_embeddings": 40960, "rms_norm_eps": 1e-6, "rope_theta": 1000000.0,
        "tie_word_embeddings": True, "attention_bias": False, "hidden_act": "silu", "torch_dtype": "bfloat16",
    },
    "llama3.2-1b": {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 2048, "intermediate_size": 8192,
        "num_hidden_layers": 16, "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 64,
        "vocab_size": 128256, "max_position_embeddings": 131072, "rms_norm_eps": 1e-5, "rope_theta": 500000.0,
        "rope_scaling": {"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                         "original_max_position_embeddings": 8192},
        "tie_word_embeddings": True, "hidden_act": "silu", "torch_dtype": "bfloat16",
    },
    "gemma3-1b": {
        "architectures": ["Gemma3ForCausalLM"], "model_type": "gemma3_text", "hidden_size": 1152,
        "intermediate_size": 6912, "num_hidden_layers": 26, "num_attention_heads": 4, "num_key_value_heads": 1,
        "head_dim": 256, "vocab_size": 262144, "max_position_embeddings": 32768, "rms_norm_eps": 1e-6,
        "rope_theta": 1000000.0, "rope_local_base_freq": 10000.0, "sliding_window": 512, "sliding_window_pattern": 6,
        "query_pre_attn_scalar": 256, "hidden_activation": "gelu_pytorch_tanh", "tie_word_embeddings": True,
        "torch_dtype": "bfloat16",
    },
    "phi4-mini": {
        "architectures": ["Phi3ForCausalLM"], "model_type": "phi3", "hidden_size": 3072, "intermediate_size": 8192,
        "num_hidden_layers": 32, "num_attention_heads": 24, "num_key_value_heads": 8, "vocab_size": 200064,
        "max_position_embeddings": 131072, "original_max_position_embeddings": 4096, "rms_norm_eps": 1e-5,
        "partial_rotary_factor": 0.75, "rope_theta": 10000.0, "tie_word_embeddings": True, "hidden_act": "silu",
        "rope_scaling": {"rope_type": "longrope", "short_factor": [1.0] * 48, "long_factor": [1.0] * 48},
        "torch_dtype": "bfloat16",
    },
}  # fmt: skip


def transformers_model(model_dir: Path, dtype: torch.dtype, device: str, random_weights: bool) -> PreTrainedModel:
    """The same model in transformers: read from `model_dir`, or built with random weights on the device."""
    if not random_weights:
        return AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).to(device).eval()
    torch.manual_seed(0)
    with torch.device(device):
        return AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(model_dir), dtype=dtype).eval()


def copy_tokenizer(source: Path, out: Path) -> None:
    for name in TOKENIZER_FILES:
        if (source / name).is_file():
            shutil.copy(source / name, out / name)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("source", type=Path, nargs="?", help="default: the embedded model")
    parser.add_argument("out", type=Path)
    parser.add_argument("--shapes", choices=sorted(SHAPES), help="write this architecture's config")
    parser.add_argument("--weights", action="store_true", help="with --shapes: also random bfloat16 weights")
    args = parser.parse_args()
    source = args.source or default_model_dir(default_cache_dir())
    args.out.mkdir(parents=True, exist_ok=True)
    if args.shapes:
        (args.out / "config.json").write_text(json.dumps(SHAPES[args.shapes], indent=2))
        copy_tokenizer(source, args.out)
        if not args.weights:
            print(f"wrote {args.shapes}'s config to {args.out}: load it with --random-weights")
            return
    torch.manual_seed(0)
    config = AutoConfig.from_pretrained(args.out if args.shapes else source)
    dtype = torch.bfloat16 if args.shapes else torch.float32
    model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    model.save_pretrained(args.out)
    copy_tokenizer(source, args.out)
    print(f"saved a random {model.config.model_type} of {model.num_parameters() / 1e6:.0f}M parameters in {args.out}")


if __name__ == "__main__":
    main()
