"""The `lorax-client` package works unchanged; its answers equal `LLM.generate` with the adapter.

lorax-client pins huggingface-hub<1.0, which transformers 5 cannot use, so it lives in a
virtual environment of its own (made once, in .venv-lorax) and runs as a subprocess.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import httpx
import pytest

from loraserve import SamplingParams
from loraserve.resources import SAMPLE_ADAPTERS
from tests.server.conftest import ADMIN, wait_until_idle

pytestmark = pytest.mark.slow


def test_lorax_client_generate_and_stream_with_adapter_id_equal_llm_generate(server, lorax_python, make_llm):
    pirate = SAMPLE_ADAPTERS / "pirate"
    loaded = httpx.post(
        f"{server.url}/v1/load_lora_adapter", json={"lora_name": "pirate", "lora_path": str(pirate)}, headers=ADMIN
    )
    assert loaded.status_code == 200, loaded.text
    prompt = "Arr, the sea is"
    script = Path(__file__).with_name("lorax_client_script.py")
    run = subprocess.run(
        [str(lorax_python), str(script), server.url, "pirate", prompt, "12"], capture_output=True, text=True
    )
    assert run.returncode == 0, run.stderr
    result = json.loads(run.stdout)

    offline = make_llm(max_loras=1)
    offline.add_adapter("pirate", pirate)
    greedy = SamplingParams(temperature=0.0, max_tokens=12)
    (expected,) = offline.generate(prompt, greedy, adapters=["pirate"], use_tqdm=False)
    (base,) = offline.generate(prompt, greedy, use_tqdm=False)
    completion = expected.outputs[0]
    assert result["generated_text"] == completion.text
    assert result["token_ids"] == completion.token_ids
    assert result["generated_tokens"] == len(completion.token_ids)
    assert result["finish_reason"] == ("length" if completion.finish_reason == "length" else "eos_token")
    assert "".join(result["stream_texts"]) == result["stream_final"] == completion.text
    assert result["stream_details"] == len(completion.token_ids)
    assert result["base_text"] == base.outputs[0].text != completion.text
    httpx.post(f"{server.url}/v1/unload_lora_adapter", json={"lora_name": "pirate"}, headers=ADMIN)
    wait_until_idle(server.engine)
