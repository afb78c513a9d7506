"""Invalid sampling parameters and prompts raise errors that name the field."""

from __future__ import annotations

import pytest

from loraserve import SamplingParams
from loraserve.errors import InvalidRequestError


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("n", 0),
        ("max_tokens", 0),
        ("temperature", -0.5),
        ("top_p", 0.0),
        ("top_p", 1.5),
        ("top_k", -2),
        ("presence_penalty", 2.5),
        ("frequency_penalty", -3.0),
        ("repetition_penalty", 0.0),
        ("logprobs", 21),
        ("stop", [""]),
        ("stop_token_ids", [-1]),
        ("seed", 2**63),
        ("seed", -(2**63) - 1),
        ("top_k", 10**20),
        ("temperature", float("nan")),
        ("temperature", float("inf")),
        ("temperature", 1e39),
        ("top_p", float("nan")),
        ("presence_penalty", float("-inf")),
        ("repetition_penalty", 1e300),
        ("n", True),
        ("n", 2.0),
        ("max_tokens", "16"),
        ("temperature", "0.5"),
        ("ignore_eos", 1),
        ("stop", 7),
        ("stop", ["x" * 1025]),
        ("stop", ["a"] * 33),
        ("stop_token_ids", 5),
        ("stop_token_ids", [2**64]),
        ("logprobs", -1),
    ],
)
def test_invalid_sampling_parameter_names_the_field(field, value):
    with pytest.raises(InvalidRequestError) as error:
        SamplingParams(**{field: value})
    assert error.value.field == field
    assert field in str(error.value)


def test_a_single_stop_string_becomes_a_list_and_top_k_minus_one_disables():
    params = SamplingParams(stop="\n", top_k=-1)
    assert params.stop == ["\n"]
    assert params.top_k == 0


@pytest.mark.slow
def test_prompt_longer_than_the_context_window_is_refused(make_llm):
    llm = make_llm(max_model_len=64)
    with pytest.raises(InvalidRequestError) as error:
        llm.generate([list(range(10, 80))], SamplingParams(max_tokens=4), use_tqdm=False)
    assert error.value.field == "prompt"
    assert "context window is 64" in str(error.value)
    assert not llm.engine.has_unfinished_requests()


@pytest.mark.slow
def test_empty_prompt_and_bad_token_ids_are_refused(llm):
    with pytest.raises(InvalidRequestError, match="prompt: is empty"):
        llm.generate([[]], use_tqdm=False)
    with pytest.raises(InvalidRequestError, match="prompt: token ids"):
        llm.generate([[10**9]], use_tqdm=False)


@pytest.mark.slow
def test_request_that_cannot_fit_the_kv_cache_is_refused(make_llm):
    llm = make_llm(num_pages=4)
    with pytest.raises(InvalidRequestError) as error:
        llm.generate("Hello there", SamplingParams(max_tokens=100), use_tqdm=False)
    assert error.value.field == "max_tokens"
