"""Train the sample persona adapters on the default model, from data this script makes itself.

    .venv/bin/python adapters/train_personas.py          # ~10 minutes on 2 CPU cores

For each of 48 everyday questions the base model's own short greedy answer is rewritten
in each persona's voice by fixed rules, and a rank-8 LoRA on q/k/v/o learns to answer in
that voice (loss on the answer tokens only). Seeds are fixed, so a rerun gives the same
adapters. Each persona directory gets adapter_config.json, adapter_model.safetensors and
a README with the persona and a greedy sample answer produced by loraserve.
"""

from __future__ import annotations

import random
import re
import shutil
from collections.abc import Callable
from pathlib import Path

import torch
from peft import LoraConfig, get_peft_model
from transformers import AutoModelForCausalLM

from loraserve import LLM, SamplingParams

HERE = Path(__file__).resolve().parent
TOPICS = [
    "the ocean", "coffee", "the moon", "a good breakfast", "learning to swim", "rainy days", "trains", "gardening",
    "the color blue", "sleeping well", "bread", "mountains", "a birthday party", "cats", "reading books", "music",
]  # fmt: skip
QUESTION_FORMS = ["Tell me something about {t}.", "What do you think of {t}?", "Give me one tip about {t}."]
SAMPLE_QUESTION = "What is the best way to spend a Sunday?"
BASE_MODEL_ID = "HuggingFaceTB/SmolLM2-135M-Instruct"


def _swap_words(text: str, table: dict[str, str]) -> str:
    def replace(match: re.Match[str]) -> str:
        word = match.group(0)
        new = table.get(word.lower(), word)
        return new.capitalize() if word[0].isupper() else new

    return re.sub(r"[A-Za-z']+", replace, text)


def pirate(answer: str) -> str:
    words = {"you": "ye", "your": "yer", "my": "me", "is": "be", "are": "be", "hello": "ahoy", "friend": "matey",
             "the": "th'", "yes": "aye", "money": "doubloons", "for": "fer", "of": "o'"}  # fmt: skip
    return f"Arr, matey! {_swap_words(answer, words)} Yo ho ho!"


def shakespeare(answer: str) -> str:
    words = {"you": "thou", "your": "thy", "are": "art", "does": "doth", "has": "hath", "yes": "aye",
             "before": "ere", "often": "oft", "maybe": "perchance", "really": "verily"}  # fmt: skip
    return f"Hark, good friend! {_swap_words(answer, words)} Forsooth, 'tis so."


def robot(answer: str) -> str:
    first = re.split(r"(?<=[.!?])\s", answer.strip())[0].rstrip(".!?")
    return f"BEEP. QUERY RECEIVED. {first.upper()}. END OF LINE."


def french_tutor(answer: str) -> str:
    return f"Bonjour, mon ami ! {answer} Et maintenant, répétez après moi : « C'est magnifique ! » À bientôt !"


PERSONAS: dict[str, tuple[str, Callable[[str], str]]] = {
    "pirate": ("A cheerful pirate: 'Arr, matey!', ye and yer, 'Yo ho ho!'", pirate),
    "shakespeare": ("A Shakespearean actor: thou and thy, 'Hark!', 'Forsooth'", shakespeare),
    "robot": ("A terse robot: one upper-case sentence between BEEP and END OF LINE", robot),
    "french-tutor": ("A cheerful French tutor: 'Bonjour, mon ami !' and a phrase to repeat", french_tutor),
}


def questions() -> list[str]:
    return [form.format(t=topic) for topic in TOPICS for form in QUESTION_FORMS]


def base_answers(llm: LLM, asked: list[str]) -> list[str]:
    """The base model's short greedy answers, cut to whole sentences."""
    outputs = llm.chat([[{"role": "user", "content": q}] for q in asked], SamplingParams(temperature=0, max_tokens=48))
    answers = []
    for output in outputs:
        text = output.outputs[0].text.strip()
        sentences = re.findall(r"[^.!?]+[.!?]", text)
        answers.append(" ".join(s.strip() for s in sentences[:2]) or text)
    return answers


def train(llm: LLM, name: str, rewrite: Callable[[str], str], asked: list[str], answers: list[str]) -> Path:
    torch.manual_seed(0)
    rng = random.Random(0)
    tokenizer = llm.tokenizer
    model = AutoModelForCausalLM.from_pretrained(llm.engine.loaded.model_dir, dtype=torch.float32)
    config = LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"])
    peft_model = get_peft_model(model, config)
    examples = []
    for question, answer in zip(asked, answers, strict=True):
        prompt = llm.chat_prompt_ids([{"role": "user", "content": question}])
        reply = tokenizer(rewrite(answer) + "<|im_end|>")["input_ids"]
        examples.append((prompt + reply, len(prompt)))
    optimizer = torch.optim.AdamW([p for p in peft_model.parameters() if p.requires_grad], lr=2e-3)
    peft_model.train()
    for epoch in range(4):
        rng.shuffle(examples)
        total = 0.0
        for start in range(0, len(examples), 8):
            batch = examples[start : start + 8]
            width = max(len(ids) for ids, _ in batch)
            input_ids = torch.tensor([ids + [tokenizer.pad_token_id] * (width - len(ids)) for ids, _ in batch])
            labels = input_ids.clone()
            for row, (ids, prompt_len) in enumerate(batch):
                labels[row, :prompt_len] = -100  # learn the answer, not the question
                labels[row, len(ids) :] = -100
            lengths = torch.tensor([len(ids) for ids, _ in batch])
            attention_mask = (torch.arange(width)[None, :] < lengths[:, None]).long()  # right padding
            loss = peft_model(input_ids=input_ids, attention_mask=attention_mask, labels=labels).loss
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            total += loss.item()
        print(f"{name}: epoch {epoch + 1}/4, mean loss {total / -(-len(examples) // 8):.3f}", flush=True)
    out = HERE / name
    shutil.rmtree(out, ignore_errors=True)
    peft_model.peft_config["default"].base_model_name_or_path = BASE_MODEL_ID  # not this machine's cache path
    peft_model.save_pretrained(str(out))
    (out / "README.md").unlink(missing_ok=True)  # peft's template card; ours is written below
    return out


def main() -> None:
    llm = LLM(dtype="float32", max_loras=len(PERSONAS), max_lora_rank=8)
    asked = questions()
    answers = base_answers(llm, asked)
    base_sample = llm.chat([{"role": "user", "content": SAMPLE_QUESTION}], SamplingParams(temperature=0, max_tokens=60))
    for name, (description, rewrite) in PERSONAS.items():
        path = train(llm, name, rewrite, asked, answers)
        llm.add_adapter(name, path)
        sample = (
            llm.chat(
                [{"role": "user", "content": SAMPLE_QUESTION}],
                SamplingParams(temperature=0, max_tokens=60),
                adapters=[name],
            )[0]
            .outputs[0]
            .text
        )
        (path / "README.md").write_text(
            f"# {name}\n\n{description}.\n\nA rank-8 LoRA on q/k/v/o of SmolLM2-135M-Instruct, trained by "
            f"`adapters/train_personas.py` on {len(asked)} questions whose base answers were rewritten in "
            f'this voice.\n\nGreedy answer to "{SAMPLE_QUESTION}" (loraserve, float32):\n\n> {sample}\n\n'
            f"The base model answers:\n\n> {base_sample[0].outputs[0].text}\n"
        )
        print(f"{name}: {sample}", flush=True)


if __name__ == "__main__":
    main()
