"""A persona reaches the prompt whatever the chat template: Gemma 2's (which raises on a system role) gets it folded
into the first user turn, as Gemma 3's own template folds it; a template with a system role renders as before."""

from __future__ import annotations

import pytest
from transformers import AutoTokenizer

from loraserve.engine.chat import chat_prompt_ids
from loraserve.engine.system_role import fold_system_messages
from tests.chat_templates import GEMMA2_TEMPLATE, GEMMA3_TEMPLATE, gemma_prompt, with_template
from tests.conftest import CHAT_PROMPTS

# A template that drops system messages without a word.
SILENT_TEMPLATE = (
    "{% for message in messages %}{% if message['role'] != 'system' %}<{{ message['role'] }}>{{ message['content'] }}"
    "\n{% endif %}{% endfor %}{% if add_generation_prompt %}<assistant>{% endif %}"
)

PERSONA = "You are a pirate captain. Answer in one sentence."
QUESTION = "Where is the treasure?"
MULTI_TURN = [
    {"role": "system", "content": PERSONA},
    {"role": "user", "content": QUESTION},
    {"role": "assistant", "content": "Buried on the island."},
    {"role": "user", "content": "Which island?"},
]


def first_user_turn(text: str) -> str:
    return text.split("<start_of_turn>user\n", 1)[1].split("<end_of_turn>", 1)[0]


@pytest.mark.parametrize("template", [GEMMA2_TEMPLATE, GEMMA3_TEMPLATE], ids=["gemma2", "gemma3"])
def test_a_persona_opens_the_first_user_turn_on_gemma_templates_once(model_dir, template):
    tokenizer = with_template(model_dir, template)
    ids = chat_prompt_ids(tokenizer, MULTI_TURN)
    text = tokenizer.decode(ids)
    assert text.count(PERSONA) == 1
    assert first_user_turn(text) == f"{PERSONA}\n\n{QUESTION}"
    # Gemma 2 folded by us and Gemma 3 by its own template: the same prompt, token for token.
    assert ids == gemma_prompt(
        tokenizer, ("user", f"{PERSONA}\n\n{QUESTION}"), ("model", "Buried on the island."), ("user", "Which island?")
    )


def test_a_template_that_drops_system_messages_gets_the_persona_folded(model_dir):
    tokenizer = with_template(model_dir, SILENT_TEMPLATE)
    text = tokenizer.decode(chat_prompt_ids(tokenizer, MULTI_TURN[:2]))
    assert text == f"<user>{PERSONA}\n\n{QUESTION}\n<assistant>"


def test_a_template_with_a_system_role_renders_exactly_as_apply_chat_template(model_dir):
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    for conversation in (CHAT_PROMPTS[8], MULTI_TURN):
        expected = tokenizer.apply_chat_template(conversation, tokenize=True, add_generation_prompt=True)
        assert chat_prompt_ids(tokenizer, conversation) == list(expected["input_ids"])
        assert tokenizer.decode(expected["input_ids"]).startswith(f"<|im_start|>system\n{conversation[0]['content']}")


def test_every_system_message_folds_into_the_first_user_message_in_order():
    conversation = [
        {"role": "assistant", "content": "Ahoy."},
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hi", "name": "ada"},
        {"role": "developer", "content": "Rhyme."},
        {"role": "user", "content": "Bye"},
    ]
    assert fold_system_messages(conversation) == [
        {"role": "assistant", "content": "Ahoy."},
        {"role": "user", "content": "Be brief.\n\nRhyme.\n\nHi", "name": "ada"},
        {"role": "user", "content": "Bye"},
    ]
    assert fold_system_messages([{"role": "system", "content": "Be brief."}]) == [
        {"role": "user", "content": "Be brief."}
    ]
    assert fold_system_messages(conversation[2:3]) == conversation[2:3]
