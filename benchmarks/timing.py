"""Timing a small call: one warm-up, then the median of many runs (the VM's noise is one-sided)."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable


def median_microseconds(fn: Callable[[], object], repeats: int = 30) -> float:
    fn()
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - start)
    return statistics.median(samples) * 1e6
