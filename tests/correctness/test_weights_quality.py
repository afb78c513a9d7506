"""What narrower weights cost, from the quality meter (loraserve bench quality): teacher-forced over
the shipped text against float32 transformers (+ peft)."""

from __future__ import annotations

import pytest

from benchmarks.quality import measure

pytestmark = pytest.mark.slow

TOKENS = 512  # of benchmarks/data/quality_text.txt: prose, then chat


def test_bfloat16_weights_keep_the_top_token_and_a_tiny_kl_for_base_and_adapter():
    qualities, scored = measure("float32", "bfloat16", [None, "pirate"], TOKENS)
    assert scored == TOKENS - 1  # every position but the last predicts a token of the text
    for adapter, quality in qualities.items():
        assert quality.same_top >= 0.99 and quality.mean_kl <= 0.002, (adapter, quality)
        assert quality.perplexity == pytest.approx(quality.reference_perplexity, rel=0.01)


def test_int8_weights_stay_within_what_q8_0_costs_this_model():
    """q8_0 (weights and activations in blocks of 32) costs SmolLM2-135M about 0.03 nats a token and
    one top token in twelve (docs/benchmarks.md); a broken block or scale costs far more."""
    qualities, _ = measure("float32", "int8", [None], TOKENS)
    quality = qualities[None]
    assert quality.same_top >= 0.88 and quality.mean_kl <= 0.05, quality
    assert quality.perplexity == pytest.approx(quality.reference_perplexity, rel=0.05)
