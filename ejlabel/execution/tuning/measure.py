"""Measuring: how every tuner times a program, checks its output, and reports its progress.

:class:`Timing` is a median in milliseconds that carries its statistics; :func:`timed_runs`
times a function with the device synchronised (``jax.block_until_ready`` on every output leaf
before the clock stops); :func:`benchmark` is the stand-alone form, with untimed warm-up runs so
that compilation is never timed. A candidate's output is checked against the reference by
relative error (:func:`relative_error`) under a tolerance set by the output's dtype
(:func:`output_tolerance`). A failure is described in one line, with ``out_of_memory`` told
apart from other runtime errors (:func:`describe_error`). Long tuning shows a progress bar on a
terminal (:class:`Progress`).
"""

from __future__ import annotations

import math
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

__all__ = ["Progress", "Timing", "benchmark", "describe_error", "relative_error", "output_tolerance", "timed_runs"]


class Timing(float):
    """A median time in milliseconds that also carries the full statistics."""

    median_ms: float
    mean_ms: float
    min_ms: float
    iqr_ms: float
    count: int
    samples_ms: tuple[float, ...]

    def __new__(cls, samples_ms: Sequence[float]) -> Timing:
        if not samples_ms:
            raise ValueError("samples_ms: expected at least one sample")
        ordered = sorted(samples_ms)
        timing = super().__new__(cls, statistics.median(ordered))
        timing.median_ms = float(timing)
        timing.mean_ms = statistics.fmean(ordered)
        timing.min_ms = ordered[0]
        quartiles = statistics.quantiles(ordered, n=4) if len(ordered) > 1 else [ordered[0]] * 3
        timing.iqr_ms = quartiles[2] - quartiles[0]
        timing.count = len(ordered)
        timing.samples_ms = tuple(samples_ms)
        return timing

    def to_dict(self) -> dict[str, float | int]:
        return {k: getattr(self, k) for k in ("median_ms", "mean_ms", "min_ms", "iqr_ms", "count")}

    def __repr__(self) -> str:
        return f"Timing(median={self.median_ms:.4g} ms, iqr={self.iqr_ms:.3g} ms, n={self.count})"


def timed_runs(fn: Callable[[], Any], count: int) -> list[float]:
    """Wall times of ``count`` calls of ``fn`` in milliseconds, each waited for on the device."""
    samples = []
    for _ in range(count):
        start = time.perf_counter()
        jax.block_until_ready(fn())
        samples.append((time.perf_counter() - start) * 1e3)
    return samples


def benchmark(
    fn: Callable[..., Any],
    *args: Any,
    num_warmup: int = 3,
    num_iters: int = 10,
    warmup: int | None = None,
    iters: int | None = None,
    **kwargs: Any,
) -> Timing:
    """Median wall time of ``fn(*args, **kwargs)`` in milliseconds, device synchronised.

    At least one untimed call runs first, so compilation is never timed. Every output leaf is
    waited on (``jax.block_until_ready``) before the clock stops. The result is a ``float``
    carrying ``median_ms``, ``mean_ms``, ``min_ms``, ``iqr_ms``, ``count`` and ``samples_ms``.
    ``warmup=`` and ``iters=`` (ejkernel's names) are ``num_warmup`` and ``num_iters``; they are
    never passed to ``fn`` (bind such arguments of ``fn`` with ``functools.partial``).
    """
    if warmup is not None:
        if num_warmup != 3:
            raise TypeError("give either num_warmup or warmup (the same count), not both")
        num_warmup = warmup
    if iters is not None:
        if num_iters != 10:
            raise TypeError("give either num_iters or iters (the same count), not both")
        num_iters = iters
    if num_iters < 1:
        raise ValueError(f"num_iters: expected >= 1, got {num_iters}")
    if num_warmup < 0:
        raise ValueError(f"num_warmup: expected >= 0, got {num_warmup}")
    call = lambda: fn(*args, **kwargs)
    timed_runs(call, max(1, num_warmup))
    return Timing(timed_runs(call, num_iters))


def describe_error(err: BaseException) -> tuple[str, str]:
    text = f"{type(err).__name__}: {err}".strip()
    lowered = text.lower()
    status = "out_of_memory" if ("resource_exhausted" in lowered or "out of memory" in lowered) else "runtime_error"
    return status, text.splitlines()[0][:500]


class Progress:
    """A progress bar on a terminal (rich), silence otherwise."""

    def __init__(self, total: int, description: str, enabled: bool | None) -> None:
        self._bar = None
        if enabled is None:
            enabled = sys.stderr.isatty()
        if enabled and total > 0:
            try:
                from rich.progress import Progress as RichProgress
            except ImportError:
                return
            self._bar = RichProgress(transient=False)
            self._task = self._bar.add_task(description, total=total)
            self._bar.start()

    def advance(self, amount: int = 1) -> None:
        if self._bar is not None:
            self._bar.advance(self._task, amount)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.stop()


_TOLERANCE = {"float64": 1e-9, "float32": 2e-3, "bfloat16": 3e-2, "float16": 5e-3}


def relative_error(out: Any, ref: Any) -> float:
    errors = []
    for o, r in zip(jax.tree_util.tree_leaves(out), jax.tree_util.tree_leaves(ref), strict=True):
        if getattr(o, "dtype", None) == jax.dtypes.float0:  # cotangent of an integer input
            continue
        o64, r64 = np.asarray(o, dtype=np.float64), np.asarray(r, dtype=np.float64)
        if o64.shape != r64.shape:
            return math.inf
        if not np.all(np.isfinite(o64)):
            return math.nan
        scale = np.linalg.norm(r64)
        errors.append(float(np.linalg.norm(o64 - r64) / scale) if scale > 0 else float(np.linalg.norm(o64)))
    return max(errors, default=0.0)


def output_tolerance(out: Any) -> float:
    leaves = [leaf for leaf in jax.tree_util.tree_leaves(out) if hasattr(leaf, "dtype")]
    floats = [np.dtype(leaf.dtype).name for leaf in leaves if leaf.dtype != jax.dtypes.float0 and jnp.issubdtype(leaf.dtype, jnp.inexact)]
    return max((_TOLERANCE.get(name, 3e-2) for name in floats), default=0.0)
