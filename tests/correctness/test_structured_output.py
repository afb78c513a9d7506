"""Structured output, per row of a mixed LoRA batch: every constrained output validates with `jsonschema`, and the
unconstrained rows beside them get the tokens they get without any grammar in the batch; `min_tokens` equals
transformers' `min_new_tokens`."""

from __future__ import annotations

import json
from pathlib import Path

import jsonschema
import pytest
import torch

from loraserve import SamplingParams
from loraserve.engine.structured_output import StructuredOutput
from loraserve.resources import SAMPLE_ADAPTERS
from tests.conftest import CHAT_PROMPTS

pytestmark = pytest.mark.slow

SCHEMAS = json.loads((Path(__file__).parents[2] / "benchmarks" / "data" / "json_schemas.json").read_text())
PERSONAS = ["pirate", "shakespeare", "robot", "french-tutor"]
TARGETS = [None, *PERSONAS]  # the base model and each sample persona
FREE = SamplingParams(temperature=0, max_tokens=32)


def constrained(schema: dict, **settings) -> SamplingParams:
    output = StructuredOutput.json_schema(schema, "response_format")
    return SamplingParams(**{"temperature": 0, "max_tokens": 160, **settings}, structured_output=output)


def question(text: str) -> list[dict[str, str]]:
    return [{"role": "user", "content": text}]


@pytest.fixture(scope="module")
def personas_llm(make_llm):
    llm = make_llm(num_pages=2048, max_loras=len(PERSONAS), max_lora_rank=8, max_num_seqs=256)
    for name in PERSONAS:
        llm.add_adapter(name, SAMPLE_ADAPTERS / name)
    return llm


def assert_valid(text: str, schema: dict, context: str) -> None:
    try:
        jsonschema.validate(json.loads(text), schema)
    except (ValueError, jsonschema.ValidationError) as error:
        raise AssertionError(f"{context}: {text!r}: {error}") from None


def test_every_schema_validates_for_the_base_model_and_each_persona_in_one_mixed_batch(personas_llm):
    assert len(SCHEMAS) >= 24
    rows = [(entry, target) for entry in SCHEMAS for target in TARGETS]
    free_rows = [(prompt, target) for prompt in CHAT_PROMPTS[:2] for target in TARGETS]
    conversations = [question(entry["prompt"]) for entry, _ in rows] + [prompt for prompt, _ in free_rows]
    params = [constrained(entry["schema"]) for entry, _ in rows] + [FREE] * len(free_rows)
    adapters = [target for _, target in rows] + [target for _, target in free_rows]
    outputs = personas_llm.chat(conversations, params, adapters=adapters, use_tqdm=False)

    for (entry, target), output in zip(rows, outputs, strict=False):
        completion = output.outputs[0]
        assert completion.finish_reason == "stop", (entry["name"], target, completion.text)
        assert_valid(completion.text, entry["schema"], f"{entry['name']} on {target or 'the base model'}")
    alone = personas_llm.chat([p for p, _ in free_rows], FREE, adapters=[t for _, t in free_rows], use_tqdm=False)
    beside_grammars = [o.outputs[0].token_ids for o in outputs[len(rows) :]]
    assert beside_grammars == [o.outputs[0].token_ids for o in alone]


def test_sampled_rows_with_n_seeds_penalties_and_top_k_all_validate(personas_llm):
    """Every sampling parameter still applies within what the grammar allows. Schemas whose every value is bounded
    (a JSON number's digits are not: sampled at temperature 1, this small model may write them until max_tokens)."""
    bounded = ("npc_line", "ticket", "age_range", "person_nested", "const_and_enum", "string_enum_array")
    entries = [e for e in SCHEMAS if e["name"] in bounded]
    params = [
        constrained(e["schema"], temperature=1.0, top_p=0.9, top_k=50, n=3, seed=i, presence_penalty=0.5)
        for i, e in enumerate(entries)
    ]
    outputs = personas_llm.chat([question(e["prompt"]) for e in entries], params, adapters="pirate", use_tqdm=False)
    for entry, output in zip(entries, outputs, strict=True):
        assert len(output.outputs) == 3
        for completion in output.outputs:
            assert_valid(completion.text, entry["schema"], entry["name"])


def test_regex_and_choice_hold_and_a_stop_string_still_ends_the_output(personas_llm):
    ticket = StructuredOutput.regex(r"[A-Z]{3}-[0-9]{4}", "structured_outputs.regex")
    answer = StructuredOutput.choice(["yes, certainly", "no"], "structured_outputs.choice")
    outputs = personas_llm.chat(
        [question("Make up a ticket id."), question("Is the sky blue?"), question("Is the sky blue?")],
        [
            SamplingParams(temperature=0, max_tokens=20, structured_output=ticket),
            SamplingParams(temperature=0, max_tokens=20, structured_output=answer),
            SamplingParams(temperature=0, max_tokens=20, structured_output=answer, stop=[", "]),
        ],
        use_tqdm=False,
    )
    ticket_text, choice_text, stopped = (o.outputs[0] for o in outputs)
    assert len(ticket_text.text) == 8 and ticket_text.text[3] == "-", ticket_text.text
    assert choice_text.text in ("yes, certainly", "no")
    assert stopped.text in ("yes", "no") and stopped.finish_reason == "stop"


def test_preempted_and_prefix_cached_sequences_replay_their_grammar(make_llm):
    """Under KV pressure sequences are preempted and recomputed: the outputs equal an unpressed run's (greedy),
    and a prompt found in the prefix cache follows its grammar the same way."""
    entries = SCHEMAS[:8]
    conversations = [question(e["prompt"]) for e in entries]
    params = [constrained(e["schema"], max_tokens=60) for e in entries]
    roomy = make_llm(num_pages=512).chat(conversations, params, use_tqdm=False)
    pressed_llm = make_llm(num_pages=24)
    pressed = pressed_llm.chat(conversations, params, use_tqdm=False)
    assert pressed_llm.engine.scheduler.num_preemptions > 0
    texts = [o.outputs[0].text for o in roomy]
    assert [o.outputs[0].text for o in pressed] == texts
    again = pressed_llm.chat(conversations[:1], params[:1], use_tqdm=False)[0]
    assert again.num_cached_tokens > 0 and again.outputs[0].text == texts[0]


def test_logit_bias_forces_and_bans_tokens(llm):
    prompt = question("What is the capital of France?")
    (plain,) = llm.chat(prompt, SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)
    first = plain.outputs[0].token_ids[0]
    (banned,) = llm.chat(prompt, SamplingParams(temperature=0, max_tokens=4, logit_bias={first: -100}), use_tqdm=False)
    assert banned.outputs[0].token_ids[0] != first
    forced_token = llm.tokenizer.encode(" Banana", add_special_tokens=False)[0]
    forced_params = SamplingParams(temperature=0, max_tokens=4, logit_bias={str(forced_token): 100})
    (forced,) = llm.chat(prompt, forced_params, use_tqdm=False)
    assert set(forced.outputs[0].token_ids) == {forced_token}


MIN_TOKENS_PROMPTS = [question("hi"), question("Say only 'yes'."), question("What is 2 + 2? Answer with a number.")]


def test_min_tokens_matches_transformers_min_new_tokens(llm, hf_model):
    for conversation in MIN_TOKENS_PROMPTS:
        prompt_ids = llm.chat_prompt_ids(conversation)
        (free,) = llm.chat(conversation, SamplingParams(temperature=0, max_tokens=40), use_tqdm=False)
        min_tokens = len(free.outputs[0].token_ids) + 5  # past where it would stop
        params = SamplingParams(temperature=0, max_tokens=min_tokens + 10, min_tokens=min_tokens)
        (output,) = llm.chat(conversation, params, use_tqdm=False)
        with torch.inference_mode():
            reference = hf_model.generate(
                torch.tensor([prompt_ids]), max_new_tokens=min_tokens + 10, min_new_tokens=min_tokens, do_sample=False
            )[0, len(prompt_ids) :].tolist()
        assert output.outputs[0].token_ids == reference
        assert len(output.outputs[0].token_ids) >= min_tokens
