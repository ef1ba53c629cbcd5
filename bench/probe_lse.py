"""Log-sum-exp over the vocabulary: two reductions (max, then sum of exponentials) against one
variadic reduction carrying ``(max, rescaled sum)``: which one ``linear_cross_entropy``'s
token-chunked pass should use. Measured on the H100 (bench/RESULTS.md): the variadic reduction
reads the logits once but runs 7% slower, so the kernel keeps ``jax.nn.logsumexp``.

    python bench/probe_lse.py [--rows 4096 --vocab 32000]

Input: bf16 logits ``[rows, vocab]`` (what the unembedding matmul writes), reduced in float32.
Medians of interleaved samples (bench/_timing.py); GB/s counts one read of the logits.
"""

from __future__ import annotations

import argparse
import sys

import jax
import jax.numpy as jnp
from _timing import time_interleaved
from jax import lax


def logsumexp_one_pass(z: jax.Array) -> jax.Array:
    """``logsumexp(z, axis=-1)`` in one read of ``z``: a variadic reduction carrying the running
    max and the sum of exponentials rescaled to it (``jax.nn.logsumexp`` reads ``z`` twice: the
    max, then the sum). Rows of ``-inf`` give ``-inf``."""
    def combine(a: tuple[jax.Array, jax.Array], b: tuple[jax.Array, jax.Array]) -> tuple[jax.Array, jax.Array]:
        (m_a, s_a), (m_b, s_b) = a, b
        m = jnp.maximum(m_a, m_b)
        # A side that has seen only -inf adds nothing (and -inf - -inf would be NaN).
        scale = lambda m_x: jnp.where(m_x == -jnp.inf, 0.0, jnp.exp(m_x - m))
        return m, s_a * scale(m_a) + s_b * scale(m_b)

    init = (jnp.array(-jnp.inf, z.dtype), jnp.array(0.0, z.dtype))
    m, total = lax.reduce((z, jnp.ones_like(z)), init, combine, (z.ndim - 1,))
    return m + jnp.log(total)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=4096)
    parser.add_argument("--vocab", type=int, default=32000)
    args = parser.parse_args()
    logits = jax.random.normal(jax.random.key(0), (args.rows, args.vocab), jnp.float32).astype(jnp.bfloat16)
    two = jax.jit(lambda z: jax.nn.logsumexp(z.astype(jnp.float32), axis=-1))
    one = jax.jit(lambda z: logsumexp_one_pass(z.astype(jnp.float32)))
    err = float(jnp.max(jnp.abs(one(logits) - two(logits))))
    times = time_interleaved({"two passes (jax.nn.logsumexp)": lambda: two(logits), "one pass (variadic reduce)": lambda: one(logits)}, 15, 10)
    gb = logits.size * 2 / 1e9
    print(f"jax {jax.__version__}, {jax.devices()[0].device_kind}; [{args.rows}, {args.vocab}] bf16 -> f32; max abs difference {err:.1e}")
    print("| variant | ms | GB/s (one read) |\n|---|---:|---:|")
    for name, ms in times.items():
        print(f"| {name} | {ms:.4f} | {gb / ms * 1e3:.0f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
