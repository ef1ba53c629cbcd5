"""Trace-time overhead of the executor, and proof that labels cost nothing at run time.

python bench/bench_executor.py

1. A function making 1,000 calls of a small kernel is traced (``jax.make_jaxpr``) twice: once
   through ``executor(kernel, x)`` with the config in the memory cache, once calling the
   kernel's ``run`` directly. The difference divided by 1,000 is the executor's cost per call
   (selection, call key, label, description). Medians of repeated traces.
2. The compiled program of a labelled call and of the same unlabelled computation are compared
   instruction by instruction (opcodes and shapes, attributes and metadata removed).

The row goes to ``bench/results/bench_executor.json`` (``bench/_results.py``), with the load
average: on a shared machine the two medians drift apart by more than the overhead itself.
"""

from __future__ import annotations

import dataclasses
import os
import platform
import re
import statistics
import sys
import time

import jax
import jax.numpy as jnp
from _results import write_results

import ejlabel

CALLS = 1000


@dataclasses.dataclass(frozen=True)
class Cfg:
    scale: float = 2.0


class Axpy(ejlabel.Kernel):
    def __init__(self) -> None:
        super().__init__("axpy")

    def run(self, x, y, *, cfg):
        return cfg.scale * x + y

    def heuristic_cfg(self, inv):
        return Cfg()


def trace_seconds(fn, *args, repeats: int = 7) -> float:
    times = []
    for _ in range(repeats):
        fresh = lambda *a: fn(*a)  # a new function each time: tracing caches cannot answer
        start = time.perf_counter()
        jax.make_jaxpr(fresh)(*args)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def instructions(text: str) -> list[str]:
    """Opcode and shape of each instruction, names, attributes and metadata removed."""
    out = []
    for line in text.splitlines():
        m = re.match(r"\s*(?:ROOT\s+)?%?[\w.\-]+\s*=\s*(\S+)\s+([\w\-]+)\(", line)
        if m:
            out.append(f"{m.group(2)} {m.group(1)}")
    return out


def main() -> int:
    kernel = Axpy()
    selector = ejlabel.ConfigSelectorChain()
    executor = ejlabel.Executor(selector)
    x = jnp.ones((128,), jnp.float32)
    selector.cache.put(*ejlabel.Invocation(kernel, (x, x)).cache_key, Cfg())

    def through_executor(x):
        y = x
        for _ in range(CALLS):
            y = executor(kernel, x, y)
        return y

    def direct(x):
        y = x
        for _ in range(CALLS):
            y = kernel.run(x, y, cfg=Cfg())
        return y

    trace_seconds(through_executor, x, repeats=2)  # warm caches
    t_exec = trace_seconds(through_executor, x)
    t_direct = trace_seconds(direct, x)
    per_call_us = (t_exec - t_direct) / CALLS * 1e6
    decisions = {s.provenance for s in selector._decisions.values()}

    labelled = jax.jit(lambda x: executor(kernel, x, x)).lower(x).compile().as_text()
    plain = jax.jit(lambda x: kernel.run(x, x, cfg=Cfg())).lower(x).compile().as_text()
    same = instructions(labelled) == instructions(plain)

    print(f"machine: {platform.processor() or platform.machine()}, python {sys.version.split()[0]}, jax {jax.__version__}")
    print(f"| trace of {CALLS} calls | seconds |")
    print("|---|---|")
    print(f"| through executor (memory-cache hit: {decisions}) | {t_exec:.4f} |")
    print(f"| kernel.run directly | {t_direct:.4f} |")
    print(f"executor overhead per call: {per_call_us:.1f} µs (goal <= 20 µs)")
    print(f"compiled instructions identical with and without label: {same} ({len(instructions(labelled))} instructions)")
    row = {
        "calls": CALLS,
        "load_average_1min": round(os.getloadavg()[0], 2),
        "through_executor_s": t_exec,
        "direct_s": t_direct,
        "overhead_us_per_call": per_call_us,
        "provenance": sorted(decisions),
        "identical_instructions": same,
        "instructions": len(instructions(labelled)),
    }
    write_results("bench_executor", [row], notes="medians of 7 traces of 1,000 calls; overhead = (executor - direct) / 1,000; instructions compared by opcode and shape")
    return 0


if __name__ == "__main__":
    sys.exit(main())
