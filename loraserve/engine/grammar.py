"""Grammars for structured output, compiled by llguidance, and the matcher each constrained sequence carries.

llguidance over xgrammar (measured in docs/benchmarks.md, "Structured output"): it builds a grammar in under
a millisecond where xgrammar took 0.16 s (median; up to 0.9 s) for the same schemas, computes a batch's token
masks in under half the time, and refuses the JSON Schema keywords it does not implement where xgrammar ignores
some (`uniqueItems`, `not`, `maxLength` beside `format`) and would let through output that the schema forbids.

A grammar is built once per distinct spec (cached by its hash) into a matcher at its start state; each
sequence gets a copy of it and replays the tokens it already has (a preempted sequence keeps its matcher,
so this happens only once).
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import TYPE_CHECKING

import llguidance
import llguidance.hf
from transformers import PreTrainedTokenizerBase

from loraserve.engine.structured_output import StructuredOutput
from loraserve.errors import InvalidRequestError

if TYPE_CHECKING:
    from llguidance._lib import JsonCompileOptions  # in the type stubs only

    from loraserve.engine.sequence import Sequence

# JSON without free whitespace: a small model left free to write spaces and newlines may write them forever,
# and the separators cost tokens. Property order is the schema's.
JSON_OPTIONS: JsonCompileOptions = {"whitespace_flexible": False}
COMPILE_BUDGET_SECONDS = 2.0  # a grammar slower to build is refused (the parser's fuel limits bound it anyway)
CACHE_SIZE = 512  # distinct grammars kept built


@dataclass(frozen=True)
class CompiledGrammar:
    spec: StructuredOutput
    start: llguidance.LLMatcher  # at the start state; never advanced: sequences advance copies

    def matcher(self) -> llguidance.LLMatcher:
        return self.start.deep_copy()


class GrammarCompiler:
    """Builds and caches grammars over one tokenizer. Thread-safe: requests compile before taking the engine's
    lock (a first request pays the build there, not the running batch)."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase, vocab_size: int, eos_token_ids: frozenset[int]) -> None:
        self.tokenizer = llguidance.hf.from_tokenizer(
            tokenizer,  # type: ignore[arg-type]  # any fast tokenizer: what transformers 5 loads
            n_vocab=vocab_size,
            eos_token=sorted(eos_token_ids),
        )
        self._cache: OrderedDict[str, CompiledGrammar] = OrderedDict()
        self._lock = threading.Lock()
        self.num_compiled = 0

    def compile(self, spec: StructuredOutput) -> CompiledGrammar:
        """The spec's grammar; InvalidRequestError naming `spec.field` if it cannot be built (an unsupported
        JSON Schema keyword, an invalid regex) or takes longer than the budget."""
        with self._lock:
            if (cached := self._cache.get(spec.key)) is not None:
                self._cache.move_to_end(spec.key)
                return cached
        started = time.perf_counter()
        try:
            matcher = llguidance.LLMatcher(self.tokenizer, _grammar_of(spec), log_level=0)  # drops the GIL to build
        except ValueError as error:  # a schema nested past llguidance's JSON parser's depth limit, say
            raise InvalidRequestError(spec.field, f"cannot be used as a grammar: {_first_line(str(error))}") from None
        if matcher.is_error():
            raise InvalidRequestError(spec.field, f"cannot be used as a grammar: {_first_line(matcher.get_error())}")
        elapsed = time.perf_counter() - started
        if elapsed > COMPILE_BUDGET_SECONDS:
            raise InvalidRequestError(
                spec.field, f"took {elapsed:.1f} s to build, over the budget of {COMPILE_BUDGET_SECONDS} s: simplify it"
            )
        compiled = CompiledGrammar(spec, matcher)
        with self._lock:
            self.num_compiled += 1
            self._cache[spec.key] = compiled
            while len(self._cache) > CACHE_SIZE:
                self._cache.popitem(last=False)
        return compiled


def advance(seq: Sequence, token_id: int) -> str | None:
    """Feed the sampled token to the sequence's matcher; why not, if its grammar cannot go on (it ran out of the
    parser's fuel computing the mask, which then allowed nothing)."""
    if seq.request.grammar is None:
        return None
    matcher = matcher_of(seq, upto=-1)  # made before the step's mask, unless the step ran without one
    if matcher.consume_token(token_id) and not matcher.is_error():
        return None
    return f"its grammar cannot go on after {seq.num_output_tokens} tokens: {matcher.get_error() or 'no token fits'}"


def matcher_of(seq: Sequence, upto: int | None = None) -> llguidance.LLMatcher:
    """The sequence's matcher, made at its first use from the request's grammar and its output tokens[:upto]."""
    if seq.matcher is None:
        assert seq.request.grammar is not None
        seq.matcher = seq.request.grammar.matcher()
        if replayed := seq.output_token_ids[:upto]:
            seq.matcher.consume_tokens(replayed)
    return seq.matcher


def valid_drafts(seq: Sequence, drafts: list[int]) -> list[int]:
    """The leading drafts the sequence's grammar allows (all of them without a grammar)."""
    if seq.request.grammar is None:
        return drafts
    return drafts[: matcher_of(seq).validate_tokens(drafts)]


def matcher_after(seq: Sequence, drafts: list[int]) -> llguidance.LLMatcher:
    """Where the sequence's grammar stands after its output and then `drafts` (a copy when there are drafts)."""
    matcher = matcher_of(seq)
    if not drafts:
        return matcher
    matcher = matcher.deep_copy()
    matcher.consume_tokens(drafts)
    return matcher


def _grammar_of(spec: StructuredOutput) -> str:
    if spec.kind == "lark":
        return spec.text
    if spec.kind == "json_schema":
        return str(llguidance.LLMatcher.grammar_from_json_schema(spec.text, defaults=JSON_OPTIONS))
    return str(llguidance.LLMatcher.grammar_from_regex(spec.text))


def _first_line(error: str) -> str:
    return error.strip().splitlines()[0][:500] if error.strip() else "unknown error"
