"""Multi-LoRA throughput: 64 requests over 32 distinct adapters vs the same requests on the base model
vs peft's mixed-adapter batch (`generate(..., adapter_names=...)`); and the same requests over 32 DoRA
adapters (peft refuses DoRA in a mixed-adapter batch, so it has no DoRA row) and over 32 two-part mixes
(`merged_adapters`, linear: adapters i and i + 2, which share a rank), made before the timed run as a
cached mix is.

    python -m benchmarks.bench_lora            # writes its section of docs/benchmarks/multi-lora.md
    python -m benchmarks.bench_lora --quick    # smoke run, nothing written

Adapters: ranks 8 and 16 alternating, all seven projections, seeded random weights in
PEFT files (throughput does not depend on what the weights learned). Greedy, EOS ignored, in the dtype the server picks
(--dtype auto: bfloat16 on CUDA or a CPU with AMX, else float32).
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import torch
from peft import PeftModel

from benchmarks.engines import engine_over
from benchmarks.random_adapters import write_random_adapters
from benchmarks.random_model import transformers_model
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
from benchmarks.workloads import chat_workload, left_padded
from loraserve import LLM, SamplingParams
from loraserve.engine.chat import chat_prompt_ids
from loraserve.lora.mix_spec import MixSpec
from loraserve.models import LoadedModel, load_model
from loraserve.models.dtypes import dtype_name

SECTION = "multi-lora"


def run_loraserve(
    loaded: LoadedModel, prompts, adapters, max_tokens: int, paths: list[Path], mixes: dict[str, MixSpec] | None = None
) -> float:
    """Output tokens/s; `mixes`: names in `adapters` that stand for these mixes of the adapters in `paths`."""
    engine = engine_over(loaded, len(prompts), max_loras=len(paths))
    try:
        llm = LLM.from_engine(engine)
        for i, path in enumerate(paths):
            llm.add_adapter(f"adapter-{i}", path)
        served_as = {name: engine.mix_adapters(spec) for name, spec in (mixes or {}).items()}
        adapters = [served_as.get(name, name) for name in adapters]
        # Resident first, as peft's adapters are: loading them from disk is not what is measured.
        llm.generate(prompts, SamplingParams(max_tokens=1), adapters=adapters, use_tqdm=False)
        llm.reset_prefix_cache()  # the warm-up computed these prompts: the timed run computes them again
        params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
        start = time.perf_counter()
        llm.generate(prompts, params, adapters=adapters, use_tqdm=False)
        return len(prompts) * max_tokens / (time.perf_counter() - start)
    finally:
        engine.close()  # its adapter loader thread would otherwise keep the 1 GiB pool alive


def run_peft(model: PeftModel, tokenizer, prompts, adapters, max_tokens: int) -> float:
    pad = tokenizer.pad_token_id
    input_ids, attention_mask = left_padded(prompts, pad)
    start = time.perf_counter()
    with torch.inference_mode():
        model.generate(
            input_ids=input_ids.to(model.device),
            attention_mask=attention_mask.to(model.device),
            adapter_names=[a if a is not None else "__base__" for a in adapters],
            max_new_tokens=max_tokens,
            min_new_tokens=max_tokens,
            do_sample=False,
            pad_token_id=pad,
        )
    return len(prompts) * max_tokens / (time.perf_counter() - start)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--adapters", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=2)
    add_model_flags(parser)
    add_report_flags(parser)
    args = parser.parse_args()
    args.output = args.output or page("gpu" if args.device == "cuda" else "multi-lora")
    if args.quick:
        args.requests, args.adapters, args.max_tokens, args.repeats = 4, 2, 4, 1
    loaded = load_model(model_config_of(args))
    workload = chat_workload(args.requests, args.max_tokens, args.max_tokens)
    prompts = [chat_prompt_ids(loaded.tokenizer, conv) for conv in workload.conversations]
    names = [f"adapter-{i % args.adapters}" for i in range(args.requests)]
    with tempfile.TemporaryDirectory() as tmp:
        paths = write_random_adapters(loaded.model.spec, args.adapters, Path(tmp))
        base = transformers_model(loaded.model_dir, loaded.dtype, loaded.device, args.random_weights)
        peft_model = PeftModel.from_pretrained(base, paths[0], adapter_name="adapter-0")
        for i, path in enumerate(paths[1:], start=1):
            peft_model.load_adapter(path, adapter_name=f"adapter-{i}")
        peft_model.eval()
        dora_paths = write_random_adapters(loaded.model.spec, args.adapters, Path(tmp), dora=True)
        mixes = {
            f"adapter-{i}": MixSpec(ids=(f"adapter-{i}", f"adapter-{(i + 2) % args.adapters}"), weights=(0.6, 0.4))
            for i in range(args.adapters)
        }
        samples: dict[str, list[float]] = {"lora": [], "dora": [], "mix": [], "base": [], "peft": []}
        for _ in range(args.repeats):
            samples["lora"].append(run_loraserve(loaded, prompts, names, args.max_tokens, paths))
            samples["dora"].append(run_loraserve(loaded, prompts, names, args.max_tokens, dora_paths))
            samples["mix"].append(run_loraserve(loaded, prompts, names, args.max_tokens, paths, mixes))
            samples["base"].append(run_loraserve(loaded, prompts, [None] * len(prompts), args.max_tokens, paths))
            samples["peft"].append(run_peft(peft_model, loaded.tokenizer, prompts, names, args.max_tokens))
            print({k: f"{v[-1]:.0f} tok/s" for k, v in samples.items()}, flush=True)
    if args.quick:
        return
    median = {k: statistics.median(v) for k, v in samples.items()}
    command = reproduce_command("benchmarks.bench_lora")
    body = "\n".join(
        [
            f"## Multi-LoRA throughput{', on a GPU' if args.device == 'cuda' else ''}",
            "",
            f"Command: `{command}`. Machine: {machine_description(args.device)}.",
            "",
            f"{args.requests} requests of ~60 prompt tokens over {args.adapters} distinct adapters (ranks 8 and 16 "
            f"alternating, all seven projections), {args.max_tokens} new tokens each, greedy, EOS ignored, "
            f"{dtype_name(loaded.dtype)}, all requests in one batch, the adapters already loaded (a one-token pass "
            f"first), as peft's are. Output tokens/s, median of {args.repeats} runs (min-max).",
            "",
            "| system | tok/s | ratio |",
            "|---|---:|---:|",
            f"| loraserve, base model only (same requests) | {median_spread(samples['base'])} | 1.00 |",
            f"| loraserve, {args.adapters} adapters | {median_spread(samples['lora'])} | "
            f"{median['lora'] / median['base']:.2f} of base |",
            f"| loraserve, {args.adapters} DoRA adapters (same ranks and targets) | {median_spread(samples['dora'])} | "
            f"{median['dora'] / median['lora']:.2f} of LoRA |",
            f"| loraserve, {args.adapters} two-part mixes (linear, cached) | {median_spread(samples['mix'])} | "
            f"{median['mix'] / median['lora']:.2f} of LoRA |",
            f"| peft mixed-adapter batch | {median_spread(samples['peft'])} | loraserve is "
            f"{median['lora'] / median['peft']:.1f}x peft |",
        ]
    )
    write_section(args.output, SECTION if args.device == "cpu" else f"{SECTION}-{args.device}", body)
    print(body)


if __name__ == "__main__":
    main()
