"""Save a randomly initialised model with another model's architecture and tokenizer.

For benchmark runs where the real weights cannot travel (a lent GPU machine receives at
most 64 MiB): speed does not depend on what the weights learned, and every benchmark
ignores EOS, so each system generates the same number of tokens.

    python -m benchmarks.random_model SOURCE_DIR OUT_DIR   # SOURCE_DIR: config.json + tokenizer files
"""

from __future__ import annotations

import argparse
import shutil
from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "generation_config.json")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("source", type=Path)
    parser.add_argument("out", type=Path)
    args = parser.parse_args()
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(args.source), dtype=torch.float32)
    model.save_pretrained(args.out)
    for name in TOKENIZER_FILES:
        if (args.source / name).is_file():
            shutil.copy(args.source / name, args.out / name)
    print(f"saved a random {model.config.model_type} of {model.num_parameters() / 1e6:.0f}M parameters in {args.out}")


if __name__ == "__main__":
    main()
