"""The one timing loop every benchmark here uses: interleaved samples, medians.

Each round takes one sample of every variant in turn (back-to-back calls, then a
synchronisation), so clock, thermal and neighbour drift hit all variants alike; two warm-up calls
per variant keep compilation and first-run costs out. Medians, never means: one descheduled
sample must not move the figure.

A sample is at least ``per_sample`` calls and at least ``min_sample_ms`` of work (the count taken
from the second warm-up call's time). The synchronisation that ends a sample, and the idle
device at its start, cost a fixed 0.3-0.4 ms on the H100 (four calls of a 0.35 ms program
measured 0.41 ms each, twelve 0.345 ms; run 48 of the journal, git tag bench-journal); spread
over too few calls it would weigh on short programs more than on long ones, and a kernel runs
inside a larger program, without it.
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable
from typing import Any

import jax

__all__ = ["time_interleaved"]


def time_interleaved(
    steps: dict[str, Callable[[], Any]], samples: int, per_sample: int, min_sample_ms: float = 10.0,
) -> dict[str, float]:
    """Median milliseconds per call of each zero-argument function, sampled round-robin."""
    if samples < 1 or per_sample < 1 or min_sample_ms < 0:
        raise ValueError(f"samples, per_sample, min_sample_ms: expected positive counts and a time >= 0, got {samples}, {per_sample}, {min_sample_ms}")
    calls: dict[str, int] = {}
    for name, step in steps.items():
        jax.block_until_ready(step())
        start = time.perf_counter()
        jax.block_until_ready(step())
        once_ms = (time.perf_counter() - start) * 1e3
        calls[name] = max(per_sample, math.ceil(min_sample_ms / max(once_ms, 1e-3)))
    times: dict[str, list[float]] = {name: [] for name in steps}
    for _ in range(samples):
        for name, step in steps.items():
            start = time.perf_counter()
            out = None
            for _ in range(calls[name]):
                out = step()
            jax.block_until_ready(out)
            times[name].append((time.perf_counter() - start) * 1e3 / calls[name])
    return {name: statistics.median(ts) for name, ts in times.items()}
