"""What narrower weights cost in quality: teacher-forced over a fixed text, per weights mode.

For every position of benchmarks/data/quality_text.txt, loraserve's next-token distribution (the
logits of its own prefill, read off the model's output) against float32 transformers' (with peft
for an adapter): mean KL divergence KL(reference || loraserve), how often both put the same token
on top, and loraserve's perplexity on the text. Base model and each sample adapter.

    loraserve bench quality                          # writes its section of docs/benchmarks/weights.md
    loraserve bench quality --modes float32:int8     # compute:weights pairs
    loraserve bench quality --quick                  # base model, 256 tokens, nothing written
"""

from __future__ import annotations

import argparse
import math
from dataclasses import dataclass
from pathlib import Path

import torch

from benchmarks.report import (
    add_report_flags,
    bench_command,
    cpu_class_suffix,
    cpu_class_title,
    machine_description,
    page,
    weights_modes,
    write_section,
)
from loraserve import LLM, SamplingParams
from loraserve.config import default_cache_dir
from loraserve.models.default_model import default_model_dir
from loraserve.resources import SAMPLE_ADAPTERS

TEXT = Path(__file__).with_name("data") / "quality_text.txt"
ADAPTERS = ("pirate", "shakespeare", "robot", "french-tutor")
# The reference's two most likely tokens this close in log-probability (probabilities within 10%): a
# disagreement there is a coin the reference itself barely tossed.
NEAR_TIE_NATS = 0.1


@dataclass(frozen=True)
class Quality:
    mean_kl: float  # nats a token, KL(reference || loraserve)
    same_top: float  # share of positions whose most likely next token agrees
    perplexity: float  # loraserve's, on the text
    reference_perplexity: float
    disagreements: int  # positions whose most likely next token differs
    near_tie_disagreements: int  # of those, where the reference's top two are within NEAR_TIE_NATS


def text_token_ids(llm: LLM, limit: int | None = None) -> list[int]:
    ids: list[int] = llm.tokenizer(TEXT.read_text())["input_ids"]
    return ids[:limit]


def teacher_forced_logprobs(llm: LLM, token_ids: list[int], adapter: str | None = None) -> torch.Tensor:
    """loraserve's log-probabilities of the next token at every position but the last, [T - 1, vocab],
    from one prefill of the text: the model's output rows for all positions, through its lm_head."""
    model = llm.engine.loaded.model
    hidden: list[torch.Tensor] = []
    hook = model.register_forward_hook(lambda _module, _inputs, output: hidden.append(output.detach().clone()))
    try:
        llm.generate([token_ids], SamplingParams(temperature=0.0, max_tokens=1), adapters=[adapter], use_tqdm=False)
    finally:
        hook.remove()
    rows = torch.cat(hidden)[: len(token_ids) - 1]
    with torch.inference_mode():
        return model.lm_head(rows.contiguous()).float().log_softmax(-1)


def reference_logprobs(sequences: list[list[int]], adapter: str | None = None) -> list[torch.Tensor]:
    """float32 transformers' (and peft's, for an adapter) log-probabilities, [T - 1, vocab] for each
    sequence, from one load of the model."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(default_model_dir(default_cache_dir()), dtype=torch.float32)
    if adapter is not None:
        from peft import PeftModel

        model = PeftModel.from_pretrained(model, SAMPLE_ADAPTERS / adapter)
    model.eval()
    with torch.inference_mode():
        return [model(torch.tensor([ids])).logits[0, :-1].float().log_softmax(-1) for ids in sequences]


def scored_windows(token_ids: list[int], window: int | None) -> list[tuple[list[int], int]]:
    """The sequences run and the first position scored in each: the whole text from its second
    token, or (as llama-perplexity scores) windows of `window` tokens, each on its second half."""
    if window is None:
        return [(token_ids, 1)]
    return [(token_ids[start : start + window], window // 2) for start in range(0, len(token_ids) - window + 1, window)]


def compare(ours: torch.Tensor, reference: torch.Tensor, next_tokens: list[int]) -> Quality:
    """Quality of `ours` against `reference`, [N, vocab] log-probabilities of the N `next_tokens`."""
    targets = torch.tensor(next_tokens).unsqueeze(1)
    kl = (reference.exp() * (reference - ours)).sum(-1)
    differ = ours.argmax(-1) != reference.argmax(-1)
    top_two = reference.topk(2, dim=-1).values
    near_tie = top_two[:, 0] - top_two[:, 1] < NEAR_TIE_NATS
    return Quality(
        mean_kl=max(0.0, float(kl.mean())),  # float error can take a zero KL a hair below
        same_top=1.0 - float(differ.float().mean()),
        perplexity=math.exp(-float(ours.gather(1, targets).mean())),
        reference_perplexity=math.exp(-float(reference.gather(1, targets).mean())),
        disagreements=int(differ.sum()),
        near_tie_disagreements=int((differ & near_tie).sum()),
    )


def measure(
    dtype: str, weights: str, adapters: list[str | None], limit: int | None = None, window: int | None = None
) -> tuple[dict[str | None, Quality], int]:
    """Quality of one compute:weights mode for the base model (None) and each adapter named, and the
    number of positions scored."""
    llm = LLM(
        dtype=dtype, weights=weights, max_loras=len(adapters), max_lora_rank=16, prefix_caching=False, num_pages=512
    )  # 512 pages hold the text and the adapters; the default pool would take 2 GiB
    for adapter in adapters:
        if adapter is not None:
            llm.add_adapter(adapter, SAMPLE_ADAPTERS / adapter)
    windows = scored_windows(text_token_ids(llm, limit), window)
    next_tokens = [token for sequence, first in windows for token in sequence[first:]]
    qualities = {}
    try:
        for adapter in adapters:
            ours = [teacher_forced_logprobs(llm, sequence, adapter)[first - 1 :] for sequence, first in windows]
            whole = reference_logprobs([sequence for sequence, _ in windows], adapter)
            reference = [logprobs[first - 1 :] for logprobs, (_, first) in zip(whole, windows, strict=True)]
            qualities[adapter] = compare(torch.cat(ours), torch.cat(reference), next_tokens)
    finally:
        llm.engine.close()  # its adapter loader thread would keep the engine, and the model, alive
    return qualities, len(next_tokens)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--modes", nargs="+", default=None, help="compute:weights pairs (default: all this CPU runs)")
    parser.add_argument(
        "--window", type=int, default=None,
        help="score as `llama-perplexity -c WINDOW` does: windows of this many tokens, each on its second half "
        "(default: the whole text as one sequence, every position)",
    )  # fmt: skip
    add_report_flags(parser)
    args = parser.parse_args(argv)
    args.output = args.output or page("weights")
    modes = args.modes or weights_modes()
    adapters: list[str | None] = [None] if args.quick else [None, *ADAPTERS]
    limit = 256 if args.quick else None
    rows, scored = [], 0
    for mode in modes:
        dtype, weights = mode.split(":")
        qualities, scored = measure(dtype, weights, adapters, limit, args.window)
        for adapter, quality in qualities.items():
            row = (
                f"| {dtype} | {weights} | {adapter or 'base'} | {quality.mean_kl:.5f} | {100 * quality.same_top:.1f} "
                f"| {quality.disagreements} / {quality.near_tie_disagreements} "
                f"| {quality.perplexity:.3f} | {quality.reference_perplexity:.3f} |"
            )
            print(row, flush=True)
            rows.append(row)
    body = "\n".join(
        [
            "## Quality of the weights modes (teacher-forced"
            + ("" if args.window is None else f", windows of {args.window} as llama-perplexity scores")
            + ")"
            + cpu_class_title(),
            "",
            f"Command: `{bench_command('quality', argv)}`. Machine: {machine_description()}.",
            "",
            "Text: `benchmarks/data/quality_text.txt` (public-domain prose and chat, see benchmarks/data/README.md), "
            + ("as one sequence" if args.window is None else f"in windows of {args.window} tokens")
            + f", {scored} positions scored. Reference: "
            "float32 transformers, with peft for an adapter. KL: mean KL(reference || loraserve) in nats a token. "
            "Disagreements: positions whose top token differs, and how many of them are near ties (the "
            f"reference's top two within {NEAR_TIE_NATS} nats).",
            "",
            "| compute | weights | adapter | mean KL | same top token % | disagreements / at near ties | perplexity "
            "| reference perplexity |",
            "|---|---|---|---:|---:|---:|---:|---:|",
            *rows,
        ]
    )
    if not args.quick:
        section = "bench-quality" + ("" if args.window is None else f"-{args.window}") + cpu_class_suffix()
        write_section(args.output, section, body)
    print(body)


if __name__ == "__main__":
    main()
