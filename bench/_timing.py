"""The one timing loop every benchmark here uses: interleaved samples, medians.

Each round takes one sample of every variant in turn (``per_sample`` back-to-back calls, then a
synchronisation), so clock, thermal and neighbour drift hit all variants alike; two warm-up calls
per variant keep compilation and first-run costs out. Medians, never means: one descheduled
sample must not move the figure.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import Any

import jax

__all__ = ["time_interleaved"]


def time_interleaved(steps: dict[str, Callable[[], Any]], samples: int, per_sample: int) -> dict[str, float]:
    """Median milliseconds per call of each zero-argument function, sampled round-robin."""
    if samples < 1 or per_sample < 1:
        raise ValueError(f"samples, per_sample: expected positive counts, got {samples}, {per_sample}")
    for step in steps.values():
        jax.block_until_ready(step())
        jax.block_until_ready(step())
    times: dict[str, list[float]] = {name: [] for name in steps}
    for _ in range(samples):
        for name, step in steps.items():
            start = time.perf_counter()
            out = None
            for _ in range(per_sample):
                out = step()
            jax.block_until_ready(out)
            times[name].append((time.perf_counter() - start) * 1e3 / per_sample)
    return {name: statistics.median(ts) for name, ts in times.items()}
