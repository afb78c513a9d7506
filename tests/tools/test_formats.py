"""Each tool-call format's grammar, held against llguidance over the embedded model's tokenizer: free text passes, a
call must name a function and give it arguments its schema allows; and its reading of replies back into calls, whole
or streamed in any pieces (what a stream sends adds up to what the whole reply reads)."""

from __future__ import annotations

import json

import llguidance
import llguidance.hf
import pytest
from pydantic import BaseModel
from transformers import AutoTokenizer

from loraserve.errors import InvalidRequestError
from loraserve.tools.choice import chat_tool_plan
from loraserve.tools.formats import FORMATS, format_of_template
from loraserve.tools.functions import Function
from loraserve.tools.stream import ReplyStream
from tests.chat_templates import GEMMA3_TEMPLATE

WEATHER = Function(
    "get_weather",
    {
        "type": "object",
        "properties": {"city": {"type": "string"}, "unit": {"enum": ["celsius", "fahrenheit"]}},
        "required": ["city", "unit"],
        "additionalProperties": False,
    },
    "The weather in a city",
)
TIME = Function("get_time")  # no parameters: an empty object


def call(fmt_name: str, name: str, arguments: dict) -> str:
    return json.dumps({"name": name, FORMATS[fmt_name].arguments_key: arguments}, separators=(",", ":"))


PARIS = {"city": "Paris", "unit": "celsius"}
# Per format: replies its grammar allows (with auto choice, parallel calls), as (text, content, [(name, arguments)]).
REPLIES = {
    "hermes": [
        ("It is sunny.", "It is sunny.", []),
        (f"Let me check.\n<tool_call>\n{call('hermes', 'get_weather', PARIS)}\n</tool_call>", "Let me check.",
         [("get_weather", PARIS)]),
        (f"<tool_call>\n{call('hermes', 'get_weather', PARIS)}\n</tool_call>\n<tool_call>\n"
         f"{call('hermes', 'get_time', {})}\n</tool_call>", "", [("get_weather", PARIS), ("get_time", {})]),
    ],
    "llama3_json": [
        ("It is sunny.", "It is sunny.", []),
        (call("llama3_json", "get_weather", PARIS), "", [("get_weather", PARIS)]),
        (f"{call('llama3_json', 'get_weather', PARIS)}; {call('llama3_json', 'get_time', {})}", "",
         [("get_weather", PARIS), ("get_time", {})]),
    ],
    "mistral": [
        ("It is sunny.", "It is sunny.", []),
        (f"[TOOL_CALLS][{call('mistral', 'get_weather', PARIS)},{call('mistral', 'get_time', {})}]", "",
         [("get_weather", PARIS), ("get_time", {})]),
    ],
}  # fmt: skip
# Per format: replies its grammar refuses somewhere along the way.
REFUSED = {
    "hermes": [
        '<tool_call>\n{"name":"get_wind","arguments":{}}',  # no such function
        '<tool_call>\n{"name":"get_weather","arguments":{"city":"Paris","unit":"kelvin"}}',  # not in the enum
        '<tool_call>\n{"name":"get_weather","arguments":{"city":"Paris"}}',  # a required argument missing
        "Done. <tool_call> not really",  # the opening can only open a call
        f"<tool_call>\n{call('hermes', 'get_time', {})}\n</tool_call>\nAnd more text.",  # calls end the turn
    ],
    "llama3_json": ['{"name":"get_weather","parameters":{"city":3}}', '{"note": "text"}'],
    "mistral": ['[TOOL_CALLS][{"name":"get_weather","arguments":{}}]', '[{"free": "text"}]'],
}


@pytest.fixture(scope="module")
def tokenizer(model_dir):
    return AutoTokenizer.from_pretrained(model_dir)


@pytest.fixture(scope="module")
def llg_tokenizer(tokenizer):
    return llguidance.hf.from_tokenizer(tokenizer, n_vocab=len(tokenizer), eos_token=[tokenizer.eos_token_id])


def matcher(tokenizer, llg_tokenizer, fmt_name: str, required=False, parallel=True, functions=(WEATHER, TIME)):
    grammar = FORMATS[fmt_name].grammar(tokenizer, list(functions), required, parallel)
    built = llguidance.LLMatcher(llg_tokenizer, grammar, log_level=0)
    assert not built.is_error(), built.get_error()
    return built


def accepts(built, tokenizer, text: str) -> bool:
    """Whether the grammar takes `text` in full and may end there (its tokens fed one by one)."""
    return all(built.consume_token(token) for token in tokenizer.encode(text)) and built.is_accepting()


@pytest.mark.parametrize("fmt_name", FORMATS)
def test_each_grammar_takes_text_and_valid_calls_and_refuses_invalid_ones(tokenizer, llg_tokenizer, fmt_name):
    for text, _, _ in REPLIES[fmt_name]:
        assert accepts(matcher(tokenizer, llg_tokenizer, fmt_name), tokenizer, text), text
    for text in REFUSED[fmt_name]:
        assert not accepts(matcher(tokenizer, llg_tokenizer, fmt_name), tokenizer, text), text


@pytest.mark.parametrize("fmt_name", FORMATS)
def test_required_refuses_text_and_one_call_refuses_a_second(tokenizer, llg_tokenizer, fmt_name):
    text_reply, _, _ = REPLIES[fmt_name][0]
    two_calls = next(text for text, _, calls in REPLIES[fmt_name] if len(calls) == 2)
    assert not accepts(matcher(tokenizer, llg_tokenizer, fmt_name, required=True), tokenizer, text_reply)
    assert accepts(matcher(tokenizer, llg_tokenizer, fmt_name, required=True), tokenizer, two_calls)
    assert not accepts(matcher(tokenizer, llg_tokenizer, fmt_name, parallel=False), tokenizer, two_calls)


@pytest.mark.parametrize("fmt_name", FORMATS)
def test_a_reply_reads_the_same_whole_or_streamed_in_any_pieces(fmt_name):
    fmt = FORMATS[fmt_name]
    for text, content, calls in REPLIES[fmt_name]:
        reply = fmt.read(text, final=True)
        made = [(c.name, json.loads(c.arguments)) for c in reply.complete_calls()]
        assert made == calls and (reply.content.rstrip() if calls else reply.content) == content
        for size in (1, 3, 7):
            stream, sent, names, arguments = ReplyStream(fmt), "", {}, {}
            pieces = [text[i : i + size] for i in range(0, len(text), size)]
            for i, piece in enumerate(pieces):
                delta = stream.update(piece, final=i == len(pieces) - 1)
                sent += delta.content
                for call_delta in delta.calls:
                    if call_delta.name is not None:
                        assert call_delta.index not in names and call_delta.id.startswith("call_")
                        names[call_delta.index] = call_delta.name
                    arguments[call_delta.index] = arguments.get(call_delta.index, "") + call_delta.arguments
            assert sent == content, (fmt_name, size, text)
            assert [(names[i], json.loads(arguments[i])) for i in sorted(names)] == calls


def test_markup_is_never_streamed_as_content():
    stream = ReplyStream(FORMATS["hermes"])
    sent = "".join(stream.update(piece, final=False).content for piece in ["Sure", ".", " <", "tool", "_call>", "\n{"])
    assert sent == "Sure."


class Address(BaseModel):
    street: str
    city: str


class Order(BaseModel):
    item: str
    ship_to: Address


def test_nested_models_reference_their_definitions_and_hold_to_their_properties_in_a_call(tokenizer, llg_tokenizer):
    order = Function("place_order", Order.model_json_schema())
    assert "$defs" in order.parameters
    valid = call("hermes", "place_order", {"item": "tea", "ship_to": {"street": "1 Main St", "city": "Oslo"}})
    invalid = call("hermes", "place_order", {"item": "tea", "ship_to": {"street": "1 Main St"}})
    # pydantic's schemas say nothing of other properties: a call holds to the declared ones (as xgrammar's strict mode)
    invented = call("hermes", "place_order", {"item": "tea", "ship_to": {"street": "1", "city": "Oslo", "zip": "1"}})
    for text, taken in ((valid, True), (invalid, False), (invented, False)):
        built = matcher(tokenizer, llg_tokenizer, "hermes", functions=(WEATHER, order))
        assert accepts(built, tokenizer, f"<tool_call>\n{text}\n</tool_call>") is taken


def test_the_format_follows_the_template():
    assert format_of_template("{{ '<tool_call>' }}").name == "hermes"
    assert format_of_template('{"name": function name, "parameters": dictionary}').name == "llama3_json"
    assert format_of_template("[TOOL_CALLS]").name == "mistral"
    assert format_of_template(GEMMA3_TEMPLATE).name == "hermes"


def test_a_schema_nested_past_the_stack_is_refused_naming_tools(tokenizer):
    deep: dict = {"type": "object"}
    for _ in range(3000):
        deep = {"type": "object", "properties": {"a": deep}}
    plan = chat_tool_plan([{"type": "function", "function": {"name": "f", "parameters": deep}}], "auto", None)
    with pytest.raises(InvalidRequestError) as refused:
        plan.output(tokenizer, FORMATS["hermes"])
    assert refused.value.field == "tools"
