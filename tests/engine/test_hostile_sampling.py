"""No value of any sampling field breaks the engine: it is refused naming the field, or served.

After every hostile request a normal greedy one still gets transformers' tokens.
"""

from __future__ import annotations

import dataclasses

import pytest
from hypothesis import HealthCheck, given, settings

from loraserve import SamplingParams
from loraserve.errors import InvalidRequestError
from tests.hostile_values import hostile_fields

pytestmark = pytest.mark.slow

FIELDS = [field.name for field in dataclasses.fields(SamplingParams)]
PROMPT = [{"role": "user", "content": "What is the capital of France?"}]
NORMAL = SamplingParams(temperature=0.0, max_tokens=8)


@pytest.fixture(scope="module")
def bounded_llm(make_llm):
    """A short context and --max-n 4, so that a hostile request that is served ends soon."""
    return make_llm(max_model_len=96, max_n=4)


@pytest.fixture(scope="module")
def prompt_ids(bounded_llm) -> list[int]:
    return bounded_llm.chat_prompt_ids(PROMPT)


@pytest.fixture(scope="module")
def reference(prompt_ids, hf_greedy) -> list[int]:
    return hf_greedy(prompt_ids, NORMAL.max_tokens)


@settings(max_examples=60, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck))
@given(fields=hostile_fields(FIELDS))
def test_any_sampling_values_are_refused_by_name_or_served(bounded_llm, prompt_ids, reference, fields):
    try:
        (output,) = bounded_llm.generate([prompt_ids], SamplingParams(**fields), use_tqdm=False)
    except InvalidRequestError as error:
        assert error.field in fields, (error, fields)
    else:
        assert output.finished and output.error is None
        assert all(c.finish_reason in ("stop", "length") for c in output.outputs)
    assert not bounded_llm.engine.has_unfinished_requests()
    (normal,) = bounded_llm.generate([prompt_ids], NORMAL, use_tqdm=False)
    assert normal.outputs[0].token_ids == reference
