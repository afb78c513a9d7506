"""The conversation shaped to what the model's chat template shows: tools through a template that renders them (earlier
calls' arguments as objects), else through the fallback prompt; content parts to a template that renders lists, else
joined; `developer` as `system`."""

from __future__ import annotations

import json

import pytest
from transformers import AutoTokenizer

from loraserve.engine.chat import chat_prompt_ids
from loraserve.tools.formats import FORMATS
from loraserve.tools.functions import Function
from loraserve.tools.prompt import model_tool_format
from tests.chat_templates import GEMMA3_TEMPLATE, with_template

WEATHER = Function("get_weather", {"type": "object", "properties": {"city": {"type": "string"}}}, "The weather.")
CALL = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}
TOOL_TURNS = [
    {"role": "user", "content": "Weather in Oslo?"},
    {"role": "assistant", "content": "", "tool_calls": [CALL]},
    {"role": "tool", "tool_call_id": "call_1", "content": '{"celsius": -3}'},
]
# A tool-aware template in the manner of Qwen's: the tools as JSON, calls with `tojson` arguments, tool results.
TOOL_TEMPLATE = (
    "{% if tools %}<tools>{% for tool in tools %}{{ tool | tojson }}{% endfor %}</tools>\n{% endif %}"
    "{% for m in messages %}<{{ m.role }}>{{ m.content }}"
    "{% for call in m.tool_calls or [] %}<tool_call>{{ call.function.arguments | tojson }}</tool_call>{% endfor %}"
    "\n{% endfor %}{% if add_generation_prompt %}<assistant>{% endif %}"
)


@pytest.fixture(scope="module")
def smollm(model_dir):
    return AutoTokenizer.from_pretrained(model_dir)


def text(tokenizer, conversation, functions=()) -> str:
    return tokenizer.decode(chat_prompt_ids(tokenizer, conversation, list(functions)))


def test_a_template_that_shows_tools_gets_them_and_calls_arguments_as_objects(model_dir):
    tokenizer = with_template(model_dir, TOOL_TEMPLATE)
    prompt = text(tokenizer, TOOL_TURNS, [WEATHER])
    assert prompt.count('"name": "get_weather"') == 1 and "# Tools" not in prompt  # the template's, not the fallback
    assert '<tool_call>{"city": "Oslo"}</tool_call>' in prompt  # an object, not JSON text quoted again
    assert "<tool>" in prompt and '{"celsius": -3}' in prompt
    assert model_tool_format(tokenizer).name == "hermes"


def test_a_template_without_tools_gets_the_fallback_prompt(smollm):
    prompt = text(smollm, [{"role": "system", "content": "Be brief."}, *TOOL_TURNS], [WEATHER])
    system = prompt.split("<|im_start|>system\n", 1)[1].split("<|im_end|>", 1)[0]
    assert system.startswith("Be brief.\n\n# Tools") and json.dumps(WEATHER.as_tool()) in system
    assert (
        '<|im_start|>assistant\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>'
        in (prompt)
    )
    assert '<|im_start|>user\n<tool_response>\n{"celsius": -3}\n</tool_response><|im_end|>' in prompt
    assert "<|im_start|>tool" not in prompt
    assert model_tool_format(smollm) is FORMATS["hermes"]
    assert model_tool_format(smollm, "llama3_json") is FORMATS["llama3_json"]


def test_content_parts_are_joined_for_a_template_of_strings_and_kept_for_one_of_parts(smollm, model_dir):
    parts = [{"role": "user", "content": [{"type": "text", "text": "Hello"}, {"type": "text", "text": "there"}]}]
    assert text(smollm, parts) == text(smollm, [{"role": "user", "content": "Hello\nthere"}])
    gemma = with_template(model_dir, GEMMA3_TEMPLATE)
    assert "<start_of_turn>user\nHellothere<end_of_turn>" in text(gemma, parts)  # Gemma 3 renders each part itself


def test_developer_is_system_where_the_template_has_no_developer_role(smollm):
    developer = text(smollm, [{"role": "developer", "content": "Be brief."}, {"role": "user", "content": "Hi"}])
    assert developer == text(smollm, [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}])


def test_parts_meet_the_fallback_prompt_as_text(model_dir):
    gemma = with_template(model_dir, GEMMA3_TEMPLATE)  # renders parts, shows no tools
    results = [*TOOL_TURNS, {"role": "tool", "tool_call_id": "call_1", "content": [{"type": "text", "text": "Snow"}]}]
    prompt = text(gemma, [{"role": "system", "content": [{"type": "text", "text": "Be brief."}]}, *results], [WEATHER])
    assert "Be brief.\n\n# Tools" in prompt and "'type'" not in prompt
    assert '<tool_response>\n{"celsius": -3}\n</tool_response>\n<tool_response>\nSnow\n</tool_response>' in prompt
