"""A stand-in for llama.cpp's `llama-server` (outside us, and too slow to build in a test): it
answers /health and /completion as the real one does, checks each completion asks for what the
benchmark needs (greedy, EOS ignored, no prompt cache, token ids back) and answers with tokens
derived from the prompt and the LoRA it names, so a test can tell requests apart."""

from __future__ import annotations

import json
import sys
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

EXPECTED = {"temperature": 0.0, "ignore_eos": True, "cache_prompt": False, "return_tokens": True}


class Handler(BaseHTTPRequestHandler):
    def do_GET(self) -> None:
        self._answer(200 if self.path == "/health" else 404, {"status": "ok"})

    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        wrong = {key: body.get(key) for key, value in EXPECTED.items() if body.get(key) != value}
        if self.path != "/completion" or wrong:
            self._answer(400, {"error": f"unexpected {self.path} {wrong}"})
            return
        lora = next((adapter["id"] + 1 for adapter in body["lora"] if adapter["scale"]), 0)
        tokens = [(body["prompt"][-1] + lora + step) % 1000 for step in range(body["n_predict"])]
        self._answer(200, {"tokens": tokens, "content": ""})

    def _answer(self, status: int, payload: dict) -> None:
        data = json.dumps(payload).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args) -> None:
        pass


def main() -> None:
    if "--version" in sys.argv:
        print("version: 0 (fake)", file=sys.stderr)
        return
    port = int(sys.argv[sys.argv.index("--port") + 1])
    ThreadingHTTPServer(("127.0.0.1", port), Handler).serve_forever()


if __name__ == "__main__":
    main()
