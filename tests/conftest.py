"""Shared fixtures: the real default model, loaded once per test session."""

from __future__ import annotations

import dataclasses
import fcntl
import gc
import os
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch

if not torch.cuda.is_available():
    # Before anything imports sgmv_kernels: @triton.jit reads this when a kernel is defined.
    os.environ.setdefault("TRITON_INTERPRET", "1")

from loraserve import LLM
from loraserve.config import (
    CacheConfig,
    EngineConfig,
    LoraConfig,
    ModelConfig,
    SchedulerConfig,
    SpeculativeConfig,
    default_cache_dir,
)
from loraserve.engine import LLMEngine
from loraserve.models import LoadedModel, load_model
from loraserve.models.default_model import default_model_dir

# Varied chat prompts: facts, lists, code, poems, arithmetic, multi-turn, a system prompt.
CHAT_PROMPTS: list[list[dict[str, str]]] = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "user", "content": "Write a haiku about the sea."}],
    [{"role": "user", "content": "Explain gravity to a five-year-old."}],
    [{"role": "user", "content": "List three fruits that are red."}],
    [{"role": "user", "content": "Write a Python function that reverses a string."}],
    [{"role": "user", "content": "What is 17 times 23?"}],
    [{"role": "user", "content": "Translate 'good morning' into Spanish and German."}],
    [{"role": "user", "content": "Give me a name for a pet turtle."}],
    [{"role": "system", "content": "You are a pirate. Answer like one."}, {"role": "user", "content": "Hello!"}],
    [{"role": "user", "content": "Summarize the plot of Romeo and Juliet in two sentences."}],
    [
        {"role": "user", "content": "My name is Ada."},
        {"role": "assistant", "content": "Nice to meet you, Ada!"},
        {"role": "user", "content": "What is my name?"},
    ],
    [{"role": "user", "content": "Why is the sky blue?"}],
    [{"role": "user", "content": "Suggest a healthy breakfast."}],
    [{"role": "user", "content": "hi"}],
    [{"role": "user", "content": "Describe a cat in one long sentence with many adjectives, please, in detail."}],
    [{"role": "user", "content": "What are the first five prime numbers?"}],
]


@pytest.fixture(scope="session")
def model_dir() -> Path:
    return default_model_dir(default_cache_dir())


@pytest.fixture(scope="session")
def loaded_model() -> LoadedModel:
    return load_model(ModelConfig(dtype="float32"))


EngineFactory = Callable[..., LLM]
# Engines `make_llm` made for the module running: closed when it ends, so their threads let go of them and their
# pools are freed (a whole run's engines at once outgrew the machine's 24 GiB).
_module_engines: list[LLM] = []


@pytest.fixture(scope="module", autouse=True)
def _close_module_engines() -> Iterator[None]:
    yield
    for made in _module_engines:
        made.engine.close()
    _module_engines.clear()
    gc.collect()


@pytest.fixture(scope="session")
def make_llm(loaded_model: LoadedModel) -> EngineFactory:
    """An `LLM` over the shared float32 model with its own KV cache and scheduler settings, closed when the module
    that made it ends."""

    def make(
        num_pages: int = 512,
        max_loras: int = 0,
        max_lora_rank: int = 16,
        prefix_caching: bool = True,
        speculative_tokens: int = 0,  # > 0: n-gram speculation with this K, drafting wherever a draft is found
        **scheduler: int,
    ) -> LLM:
        speculation = SpeculativeConfig()
        if speculative_tokens:  # the cost check would make what is drafted depend on the machine's timings
            speculation = SpeculativeConfig("ngram", speculative_tokens, speculative_cost_check=False)
        config = EngineConfig(
            model=ModelConfig(dtype="float32"),
            cache=CacheConfig(num_pages=num_pages, prefix_caching=prefix_caching),
            scheduler=dataclasses.replace(SchedulerConfig(), **scheduler),
            lora=LoraConfig(max_loras=max_loras, max_lora_rank=max_lora_rank),
            speculation=speculation,
        )
        made = LLM.from_engine(LLMEngine(config, loaded=loaded_model))
        _module_engines.append(made)
        return made

    return make


@pytest.fixture(scope="session")
def llm(make_llm: EngineFactory) -> LLM:
    shared = make_llm()
    _module_engines.remove(shared)  # every module's
    return shared


@pytest.fixture(scope="session")
def hf_model(model_dir: Path) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


def memoized_greedy(model: torch.nn.Module) -> Callable[[list[int], int], list[int]]:
    """`model`'s greedy continuation of one prompt, each computed once: references are reused."""
    cache: dict[tuple[tuple[int, ...], int], list[int]] = {}

    def generate(prompt_ids: list[int], max_new_tokens: int) -> list[int]:
        key = (tuple(prompt_ids), max_new_tokens)
        if key not in cache:
            with torch.inference_mode():
                out = model.generate(  # type: ignore[operator]
                    torch.tensor([prompt_ids]), max_new_tokens=max_new_tokens, do_sample=False
                )
            cache[key] = out[0, len(prompt_ids) :].tolist()
        return cache[key]

    return generate


@pytest.fixture(scope="session")
def hf_greedy(hf_model: torch.nn.Module) -> Callable[[list[int], int], list[int]]:
    """transformers' greedy continuation of one prompt (memoized)."""
    return memoized_greedy(hf_model)


LORAX_VENV = Path(__file__).resolve().parents[1] / ".venv-lorax"
LORAX_CLIENT = "lorax-client==0.6.3"


@pytest.fixture(scope="session")
def lorax_python() -> Path:
    """The python of a virtual environment with lorax-client (tests/server/lorax_client_script.py runs in it): the
    client pins huggingface-hub<1.0, which transformers 5 cannot use. Made once, in .venv-lorax."""
    python = LORAX_VENV / "bin" / "python"
    installed = LORAX_VENV / f"installed {LORAX_CLIENT}"  # written last: a failed install is made again
    with LORAX_VENV.with_suffix(".lock").open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # make test's two workers: one makes it, the other waits
        if not installed.exists():
            subprocess.run([sys.executable, "-m", "venv", "--clear", str(LORAX_VENV)], check=True)
            subprocess.run([str(python), "-m", "pip", "install", "--quiet", LORAX_CLIENT], check=True)
            installed.touch()
    return python


@pytest.fixture(scope="session")
def peft_adapter_dir(model_dir, tmp_path_factory) -> Path:
    """A fresh adapter of the base model saved by peft's save_pretrained (random B: it changes answers)."""
    import torch
    from peft import LoraConfig as PeftLoraConfig
    from peft import get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    config = PeftLoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj", "up_proj"], init_lora_weights=False)
    path = tmp_path_factory.mktemp("peft-adapter")
    get_peft_model(base, config).save_pretrained(path)
    return path


# Debian's chromium driven by Playwright (never a browser Playwright downloads).
CHROMIUM = Path("/usr/bin/chromium")
CHROMIUM_FLAGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--no-first-run",
]


@pytest.fixture(scope="module")  # not longer: Playwright's event loop would stay, and asyncio.run() fail, after it
def browser() -> Iterator[object]:
    from playwright.sync_api import sync_playwright

    if not CHROMIUM.exists():  # `make test` installs it; a bare pytest run may not have
        pytest.fail(
            f"{CHROMIUM} is missing: run `make install` (it installs Debian's chromium) or apt-get install chromium"
        )
    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=str(CHROMIUM), args=CHROMIUM_FLAGS)
        yield browser
        browser.close()
