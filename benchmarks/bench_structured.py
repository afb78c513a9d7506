"""Structured output: the grammar libraries compared, what constraining costs the batch, and a first request's wait.

    python -m benchmarks.bench_structured            # writes its section of docs/benchmarks/structured-output.md
    python -m benchmarks.bench_structured --quick    # smoke run, nothing written

1. xgrammar against llguidance, over the default model's tokenizer and the 28 test schemas of
   benchmarks/data/json_schemas.json: the time to build each schema's grammar (no cache), the time to
   compute the token masks of a batch of 64 rows (one matcher per row, walking random allowed tokens;
   row by row, and with the library's own batch call), and which JSON Schema keywords each refuses,
   enforces or ignores (a keyword ignored lets through a document the schema forbids: the probes below
   give one such document each).
2. Throughput of a batch of 64 chat requests with half the rows constrained to a schema, against the
   same requests with none (each unconstrained twin generates as many tokens as its constrained row did).
3. A first constrained request's extra wait: indexing the vocabulary once per server, then each new schema.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from importlib import metadata
from pathlib import Path
from typing import Any

import llguidance
import llguidance.hf
import llguidance.torch
import torch
import xgrammar

from benchmarks.engines import engine_over
from benchmarks.report import (
    add_model_flags,
    add_report_flags,
    machine_description,
    median_spread,
    model_config_of,
    page,
    reproduce_command,
    write_section,
)
from benchmarks.workloads import chat_workload
from loraserve import LLM, SamplingParams
from loraserve.engine.chat import chat_prompt_ids
from loraserve.engine.grammar import JSON_OPTIONS, GrammarCompiler
from loraserve.engine.structured_output import StructuredOutput
from loraserve.engine.token_masks import allowed_tokens
from loraserve.models import load_model
from loraserve.models.dtypes import dtype_name

SECTION = "structured-output"
SCHEMAS = json.loads((Path(__file__).parent / "data" / "json_schemas.json").read_text())

# (keyword, schema, a compact document the keyword forbids, a compact document it allows)
PROBES: list[tuple[str, dict[str, Any], str, str]] = [
    ("uniqueItems", {"type": "array", "items": {"type": "integer"}, "uniqueItems": True}, "[1,1]", "[1,2]"),
    ("minItems/maxItems", {"type": "array", "items": {"type": "integer"}, "maxItems": 2}, "[1,2,3]", "[1,2]"),
    ("minLength/maxLength", {"type": "string", "maxLength": 3}, '"abcd"', '"abc"'),
    ("maxLength with format", {"type": "string", "format": "email", "maxLength": 8}, '"abcdef@ghi.com"', '"a@b.com"'),
    ("pattern", {"type": "string", "pattern": "^[0-9]+$"}, '"12a"', '"123"'),
    ("format: date", {"type": "string", "format": "date"}, '"2024-13-45"', '"2024-01-31"'),
    ("minimum/maximum", {"type": "integer", "minimum": 1, "maximum": 5}, "6", "5"),
    ("exclusiveMinimum", {"type": "number", "exclusiveMinimum": 0}, "0", "0.5"),
    ("multipleOf", {"type": "integer", "multipleOf": 5}, "7", "10"),
    ("enum", {"enum": ["a", "b"]}, '"c"', '"a"'),
    ("const", {"const": 3}, "4", "3"),
    ("required", {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}, "{}", '{"a":1}'),
    ("additionalProperties: false", {"type": "object", "properties": {"a": {"type": "integer"}},
     "additionalProperties": False}, '{"a":1,"b":2}', '{"a":1}'),
    ("minProperties", {"type": "object", "minProperties": 1}, "{}", '{"a":1}'),
    ("anyOf", {"anyOf": [{"type": "integer"}, {"type": "boolean"}]}, '"x"', "true"),
    ("oneOf", {"oneOf": [{"type": "integer"}, {"type": "string"}]}, "true", "1"),
    ("allOf", {"allOf": [{"type": "integer"}, {"minimum": 3}]}, "2", "3"),
    ("not", {"not": {"type": "integer"}}, "1", '"a"'),
    ("if/then/else", {"if": {"type": "integer"}, "then": {"minimum": 5}, "else": {"type": "string"}}, "1", "7"),
    ("prefixItems", {"type": "array", "prefixItems": [{"type": "integer"}, {"type": "string"}], "items": False},
     '[1,2]', '[1,"a"]'),
    ("$ref (recursive)", {"$defs": {"n": {"type": "object", "properties": {"next": {"$ref": "#/$defs/n"}},
     "additionalProperties": False}}, "$ref": "#/$defs/n"}, '{"next":{"x":1}}', '{"next":{}}'),
    ("patternProperties", {"type": "object", "patternProperties": {"^x": {"type": "integer"}},
     "additionalProperties": False}, '{"y":1}', '{"x1":2}'),
    ("dependentRequired", {"type": "object", "dependentRequired": {"a": ["b"]}}, '{"a":1}', '{"a":1,"b":2}'),
]  # fmt: skip


class Library:
    """One grammar library behind the few calls compared."""

    name = ""

    def compile(self, schema: str) -> Any: ...
    def matcher(self, grammar: Any) -> Any: ...
    def bitmask(self, rows: int) -> torch.Tensor: ...
    def fill_rows(self, matchers: list[Any], bitmask: torch.Tensor) -> None: ...
    def fill_batch(self, matchers: list[Any], bitmask: torch.Tensor) -> None: ...
    def accept(self, matcher: Any, token: int) -> bool: ...
    def done(self, matcher: Any) -> bool: ...
    def accepts_document(self, grammar: Any, tokens: list[int]) -> bool: ...


class XGrammar(Library):
    name = "xgrammar"

    def __init__(self, tokenizer: Any, vocab: int) -> None:
        self.version = metadata.version("xgrammar")
        self.vocab = vocab
        self.info = xgrammar.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab)
        self.compiler = xgrammar.GrammarCompiler(self.info, max_threads=1, cache_enabled=False)
        self.batch = xgrammar.BatchGrammarMatcher(max_threads=2)

    def compile(self, schema: str) -> Any:
        # Compact, as llguidance is asked for: xgrammar's default separators are json.dumps' (", ", ": ").
        return self.compiler.compile_json_schema(schema, any_whitespace=False, separators=(",", ":"))

    def matcher(self, grammar: Any) -> Any:
        return xgrammar.GrammarMatcher(grammar)

    def bitmask(self, rows: int) -> torch.Tensor:
        return xgrammar.allocate_token_bitmask(rows, self.vocab)

    def fill_rows(self, matchers: list[Any], bitmask: torch.Tensor) -> None:
        for i, matcher in enumerate(matchers):
            matcher.fill_next_token_bitmask(bitmask, i)

    def fill_batch(self, matchers: list[Any], bitmask: torch.Tensor) -> None:
        self.batch.batch_fill_next_token_bitmask(matchers, bitmask)

    def accept(self, matcher: Any, token: int) -> bool:
        return bool(matcher.accept_token(token))

    def done(self, matcher: Any) -> bool:
        return bool(matcher.is_terminated())

    def accepts_document(self, grammar: Any, tokens: list[int]) -> bool:
        matcher = self.matcher(grammar)
        return all(matcher.accept_token(t) for t in tokens) and bool(matcher.is_completed())


class LLGuidance(Library):
    name = "llguidance"

    def __init__(self, tokenizer: Any, vocab: int) -> None:
        self.version = metadata.version("llguidance")
        self.vocab = vocab
        self.tokenizer = llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab)
        self.executor = llguidance.LLExecutor(num_threads=2)

    def compile(self, schema: str) -> Any:
        grammar = llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=JSON_OPTIONS)
        matcher = llguidance.LLMatcher(self.tokenizer, grammar, log_level=0)  # the grammar is built here
        if matcher.is_error():
            raise ValueError(matcher.get_error())
        return matcher

    def matcher(self, grammar: Any) -> Any:
        return grammar.deep_copy()

    def bitmask(self, rows: int) -> torch.Tensor:
        return llguidance.torch.allocate_token_bitmask(rows, self.vocab)

    def fill_rows(self, matchers: list[Any], bitmask: torch.Tensor) -> None:
        for i, matcher in enumerate(matchers):
            llguidance.torch.fill_next_token_bitmask(matcher, bitmask, i)

    def fill_batch(self, matchers: list[Any], bitmask: torch.Tensor) -> None:
        llguidance.torch.fill_next_token_bitmask_par(self.executor, [(m, i) for i, m in enumerate(matchers)], bitmask)

    def accept(self, matcher: Any, token: int) -> bool:
        return bool(matcher.consume_token(token))

    def done(self, matcher: Any) -> bool:
        return bool(matcher.is_stopped())

    def accepts_document(self, grammar: Any, tokens: list[int]) -> bool:
        matcher = self.matcher(grammar)
        return bool(matcher.consume_tokens(tokens)) and bool(matcher.is_accepting())


def compile_times(library: Library, schemas: list[dict[str, Any]]) -> list[float]:
    times = []
    for entry in schemas:
        started = time.perf_counter()
        library.compile(json.dumps(entry["schema"]))
        times.append(time.perf_counter() - started)
    return times


def mask_time(library: Library, schemas: list[dict[str, Any]], rows: int, batched: bool, steps: int) -> float:
    """Seconds to fill the masks of `rows` rows, mean over `steps` steps of random allowed tokens."""
    grammars = [library.compile(json.dumps(entry["schema"])) for entry in schemas]
    matchers = [library.matcher(grammars[i % len(grammars)]) for i in range(rows)]
    bitmask, rng, spent = library.bitmask(rows), random.Random(0), 0.0
    for _ in range(steps):
        started = time.perf_counter()
        (library.fill_batch if batched else library.fill_rows)(matchers, bitmask)
        spent += time.perf_counter() - started
        allowed = allowed_tokens(bitmask, library.vocab)
        for i, matcher in enumerate(matchers):
            choices = allowed[i].nonzero().flatten()
            library.accept(matcher, int(choices[rng.randrange(len(choices))]))
            if library.done(matcher):
                matchers[i] = library.matcher(grammars[i % len(grammars)])
    return spent / steps


def probe(library: Library, tokenizer: Any, probes: list[tuple[str, dict[str, Any], str, str]]) -> dict[str, str]:
    """keyword -> "refused", "enforced", "ignored" (a forbidden document got through) or wrong (a valid one did not)."""
    verdicts = {}
    for keyword, schema, forbidden, allowed in probes:
        try:
            grammar = library.compile(json.dumps(schema))
        except Exception:
            verdicts[keyword] = "refused"
            continue
        encode = lambda text: tokenizer.encode(text, add_special_tokens=False)  # noqa: E731
        lets_through = library.accepts_document(grammar, encode(forbidden))
        keeps_valid = library.accepts_document(grammar, encode(allowed))
        wrong = "wrong: refuses a valid document"
        verdicts[keyword] = "ignored" if lets_through else "enforced" if keeps_valid else wrong
    return verdicts


def throughput(llm: LLM, prompts: list[list[int]], constrained: dict[int, SamplingParams], free: SamplingParams):
    """(tok/s with the constrained rows, tok/s with none, each row's tokens) over the same token counts."""
    params = [constrained.get(i, free) for i in range(len(prompts))]
    llm.reset_prefix_cache()
    started = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    with_grammars = time.perf_counter() - started
    counts = [len(o.outputs[0].token_ids) for o in outputs]
    twins = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in counts]
    llm.reset_prefix_cache()
    started = time.perf_counter()
    llm.generate(prompts, twins, use_tqdm=False)
    without = time.perf_counter() - started
    return sum(counts) / with_grammars, sum(counts) / without, counts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=int, default=64, help="rows of the masks timed and of the batch run")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--mask-steps", type=int, default=40)
    add_model_flags(parser)
    add_report_flags(parser)
    args = parser.parse_args()
    args.output = args.output or page("structured-output")
    if args.quick:
        args.batch, args.max_tokens, args.repeats, args.mask_steps = 8, 8, 1, 2
    loaded = load_model(model_config_of(args))
    vocab = loaded.model.spec.vocab_size
    schemas, probes = (SCHEMAS[:3], PROBES[:3]) if args.quick else (SCHEMAS, PROBES)

    libraries: list[Library] = [XGrammar(loaded.tokenizer, vocab), LLGuidance(loaded.tokenizer, vocab)]
    rows = []
    verdicts = {}
    for library in libraries:
        compiles = compile_times(library, schemas)
        rows.append(
            f"| {library.name} {library.version} | {statistics.median(compiles) * 1e3:.1f} | {max(compiles) * 1e3:.0f} "
            f"| {mask_time(library, schemas, args.batch, False, args.mask_steps) * 1e3:.1f} "
            f"| {mask_time(library, schemas, args.batch, True, args.mask_steps) * 1e3:.1f} |"
        )
        verdicts[library.name] = probe(library, loaded.tokenizer, probes)
        print(rows[-1], flush=True)

    started = time.perf_counter()
    compiler = GrammarCompiler(loaded.tokenizer, vocab, loaded.eos_token_ids)
    index_time = time.perf_counter() - started
    first_compiles = []
    for entry in schemas:
        started = time.perf_counter()
        compiler.compile(StructuredOutput.json_schema(entry["schema"], "schema"))
        first_compiles.append(time.perf_counter() - started)

    engine = engine_over(loaded, args.batch)
    llm = LLM.from_engine(engine)
    workload = chat_workload(args.batch, args.max_tokens, args.max_tokens)
    prompts = [chat_prompt_ids(loaded.tokenizer, conversation) for conversation in workload.conversations]
    free = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)
    constrained = {}
    for i in range(0, args.batch, 2):  # every other row, each with a schema of the test set
        entry = schemas[(i // 2) % len(schemas)]
        prompts[i] = chat_prompt_ids(loaded.tokenizer, [{"role": "user", "content": entry["prompt"]}])
        output = StructuredOutput.json_schema(entry["schema"], "schema")
        constrained[i] = SamplingParams(temperature=0, max_tokens=args.max_tokens * 3, structured_output=output)
    llm.generate(prompts, [constrained.get(i, free) for i in range(args.batch)], use_tqdm=False)  # warm-up
    runs = [throughput(llm, prompts, constrained, free) for _ in range(args.repeats)]
    for with_grammars, without, _ in runs:
        print(f"half constrained {with_grammars:.0f} tok/s, none {without:.0f} tok/s", flush=True)
    engine.close()
    if args.quick:
        return
    ratios = [w / wo for w, wo, _ in runs]
    counts = runs[0][2]
    constrained_tokens = [counts[i] for i in constrained]
    table = "\n".join(
        f"| {keyword} | " + " | ".join(verdicts[lib.name][keyword] for lib in libraries) + " |"
        for keyword, *_ in PROBES
    )
    body = f"""## Structured output

Command: `{reproduce_command("benchmarks.bench_structured")}`. Machine: {machine_description(args.device)}.
Model: the default SmolLM2-135M-Instruct in {dtype_name(loaded.dtype)}, vocabulary {vocab} tokens.

### The grammar libraries: xgrammar against llguidance

The 28 schemas of `benchmarks/data/json_schemas.json` (nested objects, arrays with bounds, enums, integer and
number ranges, patterns, formats, optional properties, `anyOf`, `$ref`), compact JSON (no free whitespace),
the default model's tokenizer. Build: one schema's grammar from nothing, no cache (xgrammar's `compile_json_schema`;
llguidance's matcher, which builds its grammar when made). Masks: the token masks of {args.batch} rows, one
matcher per row over the 28 schemas, each row taking a random allowed token after each step, mean over
{args.mask_steps} steps; row by row, and through the library's own batch call (2 threads).

| library | build, median (ms) | build, slowest (ms) | {args.batch} masks, row by row (ms) | batch call (ms) |
|---|---:|---:|---:|---:|
{chr(10).join(rows)}

JSON Schema keywords: "refused" (the library says it does not implement it), "enforced" (a document that
breaks the keyword is not let through, one that keeps it is), "ignored" (the breaking document is let through:
the output may break the schema that was asked for), "wrong" (the keeping document is not let through).

| keyword | {" | ".join(lib.name for lib in libraries)} |
|---|{"---|" * len(libraries)}
{table}

**loraserve uses llguidance**: it builds a grammar in about a millisecond where xgrammar needs up to half a
second, its masks cost less, and what it cannot enforce it refuses, which loraserve turns into a 400 naming the
field; xgrammar ignores such keywords (with a log line at most), so a client would get a document that breaks
its schema with a 200.

### What constraining costs the batch

{args.batch} chat requests in one batch, greedy, the adapters of none; every other row constrained to one of the
28 schemas (up to {args.max_tokens * 3} tokens; they wrote {min(constrained_tokens)}-{max(constrained_tokens)}),
the others free ({args.max_tokens} tokens, EOS ignored). Against the same {args.batch} prompts with no grammar,
each row generating as many tokens as in the constrained run. The masks are computed on a thread of their own
while the forward pass runs.

| run | tok/s, median of {args.repeats} (min-max) |
|---|---:|
| half the rows constrained | {median_spread([w for w, _, _ in runs])} |
| no grammar | {median_spread([wo for _, wo, _ in runs])} |
| ratio (target >= 0.9) | {statistics.median(ratios):.2f} ({min(ratios):.2f}-{max(ratios):.2f}) |

### A first constrained request's wait

- Indexing the vocabulary for llguidance, once per server at its first constrained request:
  {index_time * 1e3:.0f} ms.
- Building a schema's grammar the first time it is asked for: median {statistics.median(first_compiles) * 1e3:.1f} ms,
  slowest {max(first_compiles) * 1e3:.1f} ms over the 28 schemas; afterwards it comes from the cache (by the
  schema's hash), and each request's matcher is a copy of the built one.
"""
    write_section(args.output, SECTION, body)


if __name__ == "__main__":
    main()
