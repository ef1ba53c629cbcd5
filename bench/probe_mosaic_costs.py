"""Where the Mosaic GPU attention forward spends its time: per block, per mask, per program.

    python bench/probe_mosaic_costs.py

Every case launches the same number of programs (B * H * S / 128 = 2048 at H16 D128) on the
same kernel, and differs only in how many key blocks each program walks and how many of them
are masked:

- ``full S4096``: 32 blocks per program, none masked;
- ``full S1024 B16``: 8 blocks per program, none masked;
- ``causal S4096``: 16.5 blocks per program on average, one masked (the diagonal);
- ``4 documents S4096`` (causal): 4.5 blocks on average, one masked.

The two unmasked cases give the cost of a block ``u`` and of a program ``c`` (start, loads of
the query tile, pipeline fill, output); the masked ones then give the cost of masking. Medians of
interleaved samples (bench/_timing.py), forward only, bf16.
"""

from __future__ import annotations

import sys

import jax
import jax.numpy as jnp
from _timing import time_interleaved
from bench_attention import equal_documents
from ejlabel.kernels import attention_mosaic as am

PROGRAMS_PER_SM = 2048 / 132  # programs each of an H100's 132 SMs runs, one at a time


def main() -> int:
    heads, dim = 16, 128
    cases = {}

    def add(name: str, batch: int, seq: int, blocks: float, masked: float, **options: object) -> None:
        keys = jax.random.split(jax.random.key(0), 3)
        q, k, v = (jax.random.normal(key, (batch, seq, heads, dim), jnp.bfloat16) for key in keys)
        fwd = jax.jit(lambda q, k, v: am.mosaic_attention(q, k, v, **options))
        cases[name] = (lambda fwd=fwd, q=q, k=k, v=v: fwd(q, k, v), blocks, masked)

    add("full S4096", 4, 4096, 32, 0)
    add("full S1024 B16", 16, 1024, 8, 0)
    add("causal S4096", 4, 4096, 16.5, 1, causal=True)
    ids = equal_documents(4, 4096, 4)
    add("4 documents S4096", 4, 4096, 4.5, 1, causal=True, segment_ids=ids)
    add("causal S4096, no pingpong", 4, 4096, 16.5, 1, causal=True, pingpong=False)

    times = time_interleaved({name: case[0] for name, case in cases.items()}, samples=9, per_sample=5)
    per_program = {name: times[name] * 1e3 / PROGRAMS_PER_SM for name in times}  # us
    u = (per_program["full S4096"] - per_program["full S1024 B16"]) / 24
    c = per_program["full S1024 B16"] - 8 * u
    print(f"jax {jax.__version__}, {jax.devices()[0].device_kind}")
    print("| case | ms | us per program | blocks | masked | model u*blocks + c | excess (masking) us |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for name, (_, blocks, masked) in cases.items():
        model = u * blocks + c
        print(f"| {name} | {times[name]:.3f} | {per_program[name]:.2f} | {blocks} | {masked} | {model:.2f} | {per_program[name] - model:.2f} |")
    print(f"\nper unmasked block u = {u:.3f} us, per program c = {c:.2f} us ({c / u:.1f} blocks' worth)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
