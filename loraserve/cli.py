"""The `loraserve` command."""

from __future__ import annotations

import argparse
import os
import sys

from loraserve.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from loraserve.errors import LoraserveError


def _add_engine_flags(parser: argparse.ArgumentParser) -> None:
    env = os.environ.get
    parser.add_argument("--model", default=env("LORASERVE_MODEL"), help="HF safetensors directory (default: embedded)")
    parser.add_argument("--dtype", default=env("LORASERVE_DTYPE", "auto"), help="auto | float32 | bfloat16")
    parser.add_argument("--device", default=env("LORASERVE_DEVICE", "cpu"), help="cpu | cuda")
    parser.add_argument("--max-num-seqs", type=int, default=128, help="sequences decoding together")
    parser.add_argument("--max-num-batched-tokens", type=int, default=512, help="tokens per step (chunked prefill)")
    parser.add_argument("--kv-cache-memory", type=int, default=2 << 30, help="bytes for the KV cache")


def _engine_config(args: argparse.Namespace) -> EngineConfig:
    return EngineConfig(
        model=ModelConfig(model=args.model, dtype=args.dtype, device=args.device),
        cache=CacheConfig(kv_cache_memory=args.kv_cache_memory),
        scheduler=SchedulerConfig(max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens),
    )


def _serve(args: argparse.Namespace) -> None:
    import uvicorn

    from loraserve.engine import LLMEngine
    from loraserve.engine.async_engine import AsyncLLMEngine
    from loraserve.server.app import create_app

    engine = AsyncLLMEngine(LLMEngine(_engine_config(args)))
    app = create_app(engine, api_keys=frozenset(args.api_key))
    print(f"loraserve: serving {engine.engine.loaded.name} on http://{args.host}:{args.port}", flush=True)
    uvicorn.run(app, host=args.host, port=args.port, log_level="warning")


def _generate(args: argparse.Namespace) -> None:
    from loraserve import LLM, SamplingParams
    from loraserve.engine import LLMEngine

    llm = LLM.from_engine(LLMEngine(_engine_config(args)))
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, seed=args.seed)
    conversations = [[{"role": "user", "content": prompt}] for prompt in args.prompts]
    for prompt, output in zip(args.prompts, llm.chat(conversations, params), strict=True):
        completion = output.outputs[0]
        print(f"### {prompt}\n{completion.text}\n[{len(completion.token_ids)} tokens, {completion.finish_reason}]\n")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="loraserve", description="Serve many LoRA adapters on one base LLM.")
    commands = parser.add_subparsers(dest="command", required=True)
    serve = commands.add_parser("serve", help="start the HTTP server (OpenAI-compatible API)")
    _add_engine_flags(serve)
    serve.add_argument("--host", default=os.environ.get("LORASERVE_HOST", "127.0.0.1"))
    serve.add_argument("--port", type=int, default=int(os.environ.get("LORASERVE_PORT", "8000")))
    serve.add_argument(
        "--api-key",
        action="append",
        default=[k for k in os.environ.get("LORASERVE_API_KEYS", "").split(",") if k],
        help="require this bearer key on inference routes (repeatable; env LORASERVE_API_KEYS, comma-separated)",
    )
    serve.set_defaults(run=_serve)
    generate = commands.add_parser("generate", help="answer chat prompts offline and print the replies")
    _add_engine_flags(generate)
    generate.add_argument("prompts", nargs="+", help="one user message per prompt")
    generate.add_argument("--max-tokens", type=int, default=128)
    generate.add_argument("--temperature", type=float, default=0.0)
    generate.add_argument("--seed", type=int, default=None)
    generate.set_defaults(run=_generate)
    args = parser.parse_args(argv)
    try:
        args.run(args)
    except LoraserveError as error:
        sys.exit(f"loraserve: {error}")


if __name__ == "__main__":
    main()
