"""`loraserve chat [ADAPTER]`: an interactive terminal chat, streamed from a running server."""

from __future__ import annotations

import json
from collections.abc import Iterator

import httpx

from loraserve.admin_client import error_of
from loraserve.errors import LoraserveError


def stream_reply(http: httpx.Client, body: dict[str, object]) -> Iterator[str]:
    """The assistant's reply, piece by piece, from /v1/chat/completions with stream=true."""
    with http.stream("POST", "/v1/chat/completions", json={**body, "stream": True}) as response:
        if response.is_error:
            response.read()
            raise error_of(response)
        for line in response.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            for choice in json.loads(line[len("data: ") :])["choices"]:
                if content := choice["delta"].get("content"):
                    yield content


def chat(url: str, model: str | None, api_key: str | None, max_tokens: int, temperature: float) -> None:
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    with httpx.Client(base_url=url.rstrip("/"), headers=headers, timeout=600) as http:
        try:
            models = [m["id"] for m in http.get("/v1/models").raise_for_status().json()["data"]]
        except httpx.HTTPError as error:
            raise LoraserveError(f"cannot reach the server at {url}: {error}") from error
        model = model or models[0]  # the base model is listed first
        if model not in models:
            raise LoraserveError(f"{model!r} is not served; choose one of: {', '.join(models)}")
        print(f"chatting with {model} (Ctrl-D to quit)")
        history: list[dict[str, str]] = []
        while True:
            try:
                question = input("you> ").strip()
            except (EOFError, KeyboardInterrupt):
                print()
                return
            if not question:
                continue
            history.append({"role": "user", "content": question})
            body = {"model": model, "messages": history, "max_tokens": max_tokens, "temperature": temperature}
            print(f"{model}> ", end="", flush=True)
            pieces = []
            for piece in stream_reply(http, body):
                print(piece, end="", flush=True)
                pieces.append(piece)
            print()
            history.append({"role": "assistant", "content": "".join(pieces)})


def ask_mix(url: str, token: str | None, merged: dict[str, object], prompt: str, max_tokens: int) -> Iterator[str]:
    """One greedy reply of the mix `merged` (a merged_adapters object) over the base model, piece by piece."""
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    with httpx.Client(base_url=url.rstrip("/"), headers=headers, timeout=600) as http:
        try:
            base = http.get("/v1/models").raise_for_status().json()["data"][0]["id"]
        except httpx.HTTPError as error:
            raise LoraserveError(f"cannot reach the server at {url}: {error}") from error
        messages = [{"role": "user", "content": prompt}]
        body = {"model": base, "messages": messages, "max_tokens": max_tokens, "temperature": 0}
        yield from stream_reply(http, {**body, "merged_adapters": merged})
