"""The `loraserve` command."""

from __future__ import annotations

import argparse
import os
import sys

from loraserve.errors import LoraserveError


def _add_engine_flags(parser: argparse.ArgumentParser) -> None:
    env = os.environ.get
    parser.add_argument("--model", default=env("LORASERVE_MODEL"), help="HF safetensors directory (default: embedded)")
    parser.add_argument("--dtype", default=env("LORASERVE_DTYPE", "auto"), help="auto | float32 | bfloat16")
    parser.add_argument("--device", default=env("LORASERVE_DEVICE", "cpu"), help="cpu | cuda")
    parser.add_argument("--max-num-seqs", type=int, default=128, help="sequences decoding together")
    parser.add_argument("--max-num-batched-tokens", type=int, default=512, help="tokens per step (chunked prefill)")
    parser.add_argument("--kv-cache-memory", type=int, default=2 << 30, help="bytes for the KV cache")


def _generate(args: argparse.Namespace) -> None:
    from loraserve import LLM, SamplingParams

    llm = LLM(
        args.model,
        dtype=args.dtype,
        device=args.device,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        kv_cache_memory=args.kv_cache_memory,
    )
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, seed=args.seed)
    conversations = [[{"role": "user", "content": prompt}] for prompt in args.prompts]
    for prompt, output in zip(args.prompts, llm.chat(conversations, params), strict=True):
        completion = output.outputs[0]
        print(f"### {prompt}\n{completion.text}\n[{len(completion.token_ids)} tokens, {completion.finish_reason}]\n")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="loraserve", description="Serve many LoRA adapters on one base LLM.")
    commands = parser.add_subparsers(dest="command", required=True)
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
