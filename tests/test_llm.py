"""The offline `LLM` as a context manager: leaving it returns the memory of the model it loaded."""

from __future__ import annotations

import gc
import weakref

import pytest

from loraserve import LLM, SamplingParams

pytestmark = pytest.mark.slow  # loads a model of its own


def test_closing_an_llm_frees_its_model():
    with LLM(dtype="float32", num_pages=64) as llm:
        (output,) = llm.generate("Hi", SamplingParams(max_tokens=2), use_tqdm=False)
        assert output.outputs[0].token_ids
        model = llm.engine.loaded.model
        tensors = [weakref.ref(t) for t in (*model.parameters(), *model.buffers())]
        held = weakref.ref(model)
        del model
    gc.collect()
    assert held() is None, "the model outlived close()"
    assert tensors and not [t for t in tensors if t() is not None], "some of the model's tensors outlived close()"
    llm.close()  # a second close does nothing
