"""Grammars are built once per spec, refused naming the request's field when they cannot be served, and each
sequence's matcher follows its own tokens."""

from __future__ import annotations

import json

import pytest

from loraserve.engine import grammar
from loraserve.engine.grammar import GrammarCompiler
from loraserve.engine.structured_output import MAX_GRAMMAR_CHARS, StructuredOutput
from loraserve.errors import InvalidRequestError

NAME_SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 8}}, "required": ["name"]}


@pytest.fixture(scope="module")
def compiler(loaded_model) -> GrammarCompiler:
    spec = loaded_model.model.spec
    return GrammarCompiler(loaded_model.tokenizer, spec.vocab_size, loaded_model.eos_token_ids)


def test_a_spec_is_built_once_and_its_copies_advance_apart(compiler, loaded_model):
    spec = StructuredOutput.json_schema(NAME_SCHEMA, "response_format")
    built = compiler.compile(spec)
    count = compiler.num_compiled
    assert compiler.compile(StructuredOutput.json_schema(dict(NAME_SCHEMA), "other_field")) is built
    assert compiler.num_compiled == count
    first, second = built.matcher(), built.matcher()
    assert first.consume_tokens(loaded_model.tokenizer.encode('{"name":"Ada"}', add_special_tokens=False))
    assert first.is_accepting() and not second.is_accepting()


@pytest.mark.parametrize(
    ("spec", "field", "message"),
    [
        (lambda: StructuredOutput.json_schema({"type": "array", "uniqueItems": True}, "response_format"),
         "response_format", "uniqueItems"),
        (lambda: StructuredOutput.regex("(unclosed", "structured_outputs.regex"), "structured_outputs.regex", ""),
        (lambda: StructuredOutput.json_schema("{not json", "structured_outputs.json"), "structured_outputs.json",
         "not valid JSON"),
        (lambda: StructuredOutput.json_schema({"a": float("nan")}, "x"), "x", "finite"),
        (lambda: StructuredOutput.regex("a" * (MAX_GRAMMAR_CHARS + 1), "structured_outputs.regex"),
         "structured_outputs.regex", "at most"),
        (lambda: StructuredOutput.choice([], "structured_outputs.choice"), "structured_outputs.choice", "non-empty"),
        (lambda: StructuredOutput.json_schema(json.loads('{"items":' * 300 + "{}" + "}" * 300), "response_format"),
         "response_format", "recursion limit"),
    ],
)  # fmt: skip
def test_what_cannot_be_built_is_refused_naming_the_field(compiler, spec, field, message):
    with pytest.raises(InvalidRequestError) as refused:
        compiler.compile(spec())
    assert refused.value.field == field and message in refused.value.message


def test_a_grammar_slower_to_build_than_the_budget_is_refused(compiler, monkeypatch):
    monkeypatch.setattr(grammar, "COMPILE_BUDGET_SECONDS", 0.0)
    with pytest.raises(InvalidRequestError, match="over the budget") as refused:
        compiler.compile(StructuredOutput.regex("[a-z]{1,50}@[a-z]{1,50}", "structured_outputs.regex"))
    assert refused.value.field == "structured_outputs.regex"


def test_choices_are_matched_literally(compiler, loaded_model):
    choices = ["a+b", "(x)", "tab\there", "naïve"]
    built = compiler.compile(StructuredOutput.choice(choices, "structured_outputs.choice"))
    for choice in choices:
        matcher = built.matcher()
        assert matcher.consume_tokens(loaded_model.tokenizer.encode(choice, add_special_tokens=False))
        assert matcher.is_accepting(), choice
    assert not built.matcher().consume_tokens(loaded_model.tokenizer.encode("ab", add_special_tokens=False))
