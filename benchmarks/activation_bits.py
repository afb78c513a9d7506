"""What int8 weights would cost with x in 8 bits: emulated in transformers on the quality text.

`--weights int8` multiplies its bytes by x quantized to int16 blocks of 32 (linear.cpp). x in
int8 would let AVX512-VNNI's `vpdpbusd` do twice the products an instruction, so this measures
what that costs, per projection kind and with the K-blocks that matter most kept in 16 bits (their
x's squared block maximum times the weights' squared norm over the block, on the text's first half).
Every config holds the weights as the int8 mode's blocks of scale and minimum (quantize_int8) and
scores the text's second half against float32 transformers: mean KL and same top token, as the
quality meter does.

    python -m benchmarks.activation_bits
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F
from torch import nn

from benchmarks.quality import TEXT, compare
from loraserve.config import default_cache_dir
from loraserve.models.cpu.linear import BLOCK, quantize_int8
from loraserve.models.default_model import default_model_dir

INT16_LEVELS = 32639.0  # linear.cpp's kInt16Range
INT8_LEVELS = 127.0
KINDS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "lm_head")
KIND_CONFIGS = {
    "none (the int8 mode as it is)": (),
    "all": KINDS,
    "all but down_proj": tuple(k for k in KINDS if k != "down_proj"),
    "q, k, v, gate, up": ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj"),
    "down_proj only": ("down_proj",),
    "o_proj only": ("o_proj",),
    "lm_head only": ("lm_head",),
}
WIDE_FRACTIONS = (0.05, 0.1, 0.2, 0.3, 0.5)


def blocks_of(x: torch.Tensor) -> torch.Tensor:
    """[..., K] -> [..., K / 32, 32], zero-padded."""
    return F.pad(x, (0, -x.shape[-1] % BLOCK)).view(*x.shape[:-1], -1, BLOCK)


def quantized(x: torch.Tensor, levels: torch.Tensor) -> torch.Tensor:
    """x rounded to `levels` (per block of 32) steps of its block's absolute maximum, as the kernel does."""
    blocks = blocks_of(x)
    scale = blocks.abs().amax(-1, keepdim=True) / levels.unsqueeze(-1)
    values = torch.where(scale > 0, torch.round(blocks / scale), torch.zeros_like(blocks))
    return (values * scale).view(*x.shape[:-1], -1)[..., : x.shape[-1]]


def kind_of(name: str) -> str:
    return next((kind for kind in KINDS if name.endswith(kind)), name)


class Emulation:
    def __init__(self, threads: int) -> None:
        from transformers import AutoModelForCausalLM, AutoTokenizer

        torch.set_num_threads(threads)
        path = default_model_dir(default_cache_dir())
        ids = AutoTokenizer.from_pretrained(path)(TEXT.read_text())["input_ids"]
        half = len(ids) // 2
        self.calibration, self.scored = torch.tensor([ids[:half]]), torch.tensor([ids[half:]])
        self.model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
        self.linears = {n: m for n, m in self.model.named_modules() if isinstance(m, nn.Linear)}
        self.originals = {n: m.weight.detach().clone() for n, m in self.linears.items()}
        with torch.inference_mode():
            self.reference = self.model(self.scored).logits[0, :-1].log_softmax(-1)
        self.block_scores = self._block_scores()
        for name, module in self.linears.items():  # the int8 mode's weights from here on
            module.weight = nn.Parameter(
                quantize_int8(self.originals[name]).widened(torch.float32), requires_grad=False
            )

    def _block_scores(self) -> dict[str, torch.Tensor]:
        """Per linear, per K-block: mean squared block maximum of x on the calibration half, times the
        weights' squared norm over the block (how much an 8-bit x step there moves the outputs)."""
        squared_maxima: dict[str, torch.Tensor] = {}

        def record(name: str, x: torch.Tensor) -> None:
            maxima = blocks_of(x).abs().amax(-1)
            squared_maxima[name] = maxima.pow(2).reshape(-1, maxima.shape[-1]).mean(0)

        hooks = [m.register_forward_pre_hook(lambda _m, a, n=n: record(n, a[0])) for n, m in self.linears.items()]
        with torch.inference_mode():
            self.model(self.calibration)
        for hook in hooks:
            hook.remove()
        return {n: squared_maxima[n] * blocks_of(w).pow(2).sum(dim=(0, 2)) for n, w in self.originals.items()}

    def score(self, wide: dict[str, torch.Tensor]) -> tuple[float, float]:
        """Mean KL and same-top-token % with x in 16 bits where `wide[name]` (per K-block) says so, else 8."""
        hooks = []
        for name, module in self.linears.items():
            levels = torch.where(wide[name], INT16_LEVELS, INT8_LEVELS)
            hooks.append(module.register_forward_pre_hook(lambda _m, a, levels=levels: (quantized(a[0], levels),)))
        try:
            with torch.inference_mode():
                ours = self.model(self.scored).logits[0, :-1].log_softmax(-1)
        finally:
            for hook in hooks:
                hook.remove()
        quality = compare(ours, self.reference, self.scored[0, 1:].tolist())
        return quality.mean_kl, quality.same_top * 100

    def by_kind(self, narrow_kinds: tuple[str, ...]) -> dict[str, torch.Tensor]:
        return {
            n: torch.full_like(s, kind_of(n) not in narrow_kinds, dtype=torch.bool)
            for n, s in self.block_scores.items()
        }

    def widest_blocks(self, fraction: float) -> dict[str, torch.Tensor]:
        wide = {}
        for name, scores in self.block_scores.items():
            mask = torch.zeros_like(scores, dtype=torch.bool)
            mask[scores.topk(round(fraction * scores.numel())).indices] = True
            wide[name] = mask
        return wide


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    args = parser.parse_args(argv)
    emulation = Emulation(args.threads)
    print(f"{emulation.scored.shape[1] - 1} positions scored, int8 weights (blocks of scale and minimum)\n")
    print("| x in 8 bits for | mean KL | same top token % |\n|---|---:|---:|")
    for label, kinds in KIND_CONFIGS.items():
        kl, same = emulation.score(emulation.by_kind(kinds))
        print(f"| {label} | {kl:.5f} | {same:.2f} |", flush=True)
    print("\n| x in 16 bits for the top K-blocks | mean KL | same top token % |\n|---|---:|---:|")
    for fraction in WIDE_FRACTIONS:
        kl, same = emulation.score(emulation.widest_blocks(fraction))
        print(f"| {fraction:.0%} | {kl:.5f} | {same:.2f} |", flush=True)


if __name__ == "__main__":
    main()
