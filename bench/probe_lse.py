"""Log-sum-exp over the vocabulary: two reductions (max, then sum of exponentials) against one
variadic reduction carrying ``(max, rescaled sum)``, the choice inside ``linear_cross_entropy``.

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


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=4096)
    parser.add_argument("--vocab", type=int, default=32000)
    args = parser.parse_args()
    from ejlabel.kernels.linear_cross_entropy import logsumexp_one_pass

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
