"""The benchmark workloads are what the reports say they are: adapter rules, lengths, arrivals."""

from __future__ import annotations

import statistics
from collections import Counter

import pytest

from benchmarks.load_client import SLO, RequestResult, percentile
from benchmarks.workloads import arrival_times, assign_adapters, draw_lengths


def test_distinct_names_every_adapter_before_repeating_one():
    chosen = assign_adapters("distinct", 64, 32)
    assert sorted(chosen[:32]) == list(range(32))
    assert Counter(chosen) == dict.fromkeys(range(32), 2)


def test_zipf_popularity_falls_with_rank_as_one_over_k():
    counts = Counter(assign_adapters("zipf", 20_000, 256, seed=3))
    harmonic = sum(1 / (k + 1) for k in range(256))
    assert counts[0] / 20_000 == pytest.approx(1 / harmonic, rel=0.1)
    assert counts[1] / counts[0] == pytest.approx(0.5, rel=0.15)
    assert counts[0] > counts[9] > 0


def test_identical_uniform_and_none():
    assert set(assign_adapters("identical", 10, 5)) == {0}
    assert assign_adapters("none", 3, 5) == [None, None, None]
    assert set(assign_adapters("uniform", 1000, 4)) == {0, 1, 2, 3}
    with pytest.raises(ValueError, match="adapter rule 'random'"):
        assign_adapters("random", 3, 2)


def test_length_specs():
    assert draw_lengths("128", 3) == [128, 128, 128]
    lengths = draw_lengths("uniform:3-5", 200)
    assert set(lengths) == {3, 4, 5}
    for bad in ("uniform:5-3", "normal:3-5", "lots"):
        with pytest.raises(ValueError, match="expected N or uniform:LOW-HIGH"):
            draw_lengths(bad, 1)


@pytest.mark.parametrize("cv", [1.0, 2.0])
def test_arrivals_have_the_asked_rate_and_burstiness(cv):
    times = arrival_times(20_000, rate=4.0, cv=cv, seed=1)
    gaps = [b - a for a, b in zip([0.0, *times], times, strict=False)]
    assert statistics.mean(gaps) == pytest.approx(0.25, rel=0.05)
    assert statistics.stdev(gaps) / statistics.mean(gaps) == pytest.approx(cv, rel=0.1)


def test_slo_needs_both_the_first_token_and_the_pace():
    slo = SLO(ttft=1.0, tpot=0.1)
    fast = RequestResult(sent=0.0, ttft=0.5, chunk_times=[0.5, 0.55, 0.6], output_tokens=3)
    slow_start = RequestResult(sent=0.0, ttft=1.5, chunk_times=[1.5, 1.55, 1.6], output_tokens=3)
    slow_pace = RequestResult(sent=0.0, ttft=0.5, chunk_times=[0.5, 0.8, 1.1], output_tokens=3)
    failed = RequestResult(sent=0.0, ttft=0.5, error="HTTP 500")
    assert [slo.met(r) for r in (fast, slow_start, slow_pace, failed)] == [True, False, False, False]
    assert fast.tpot == pytest.approx(0.05)
    assert fast.itls == pytest.approx([0.05, 0.05])


def test_percentiles():
    values = [float(v) for v in range(1, 101)]
    assert percentile(values, 50) == pytest.approx(50.5)
    assert percentile(values, 99) == pytest.approx(99.01)
    assert percentile([7.0], 90) == 7.0
