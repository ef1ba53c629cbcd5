"""The loss's per-row pass alone: the Triton kernel that reads a chunk's logits once against
the XLA passes it replaces, at the token-chunked loss's chunk shapes.

python bench/probe_softmax_rows.py [--tokens 2048,4096] [--vocab 32000] [--samples 9] [--configs B:W,...]
    [--variant NAME=FILE ...]

Per chunk, the logits product ``z = h W`` (bf16 ``[tokens, vocab]``, d 768) and then:
``kernel, B columns, W warps``, ``kernels._softmax_rows.softmax_rows`` (one read of
``z``, the gradient written over it, in ``z``'s buffer); ``XLA passes``,
``kernels.linear_cross_entropy._factored_chunk`` (the row max, then the exponentials, their
sums and the dense write beside ``z``, then the label's column). ``product only`` times the
product alone; each pass's time is its row's less that one, and GB/s counts one read and one
write of ``z`` in that time. The product is inside each program so that the kernel, as in the
loss, takes over a buffer nothing else holds (a caller's array would be copied first). Each
``--variant`` is another version of ``kernels/_softmax_rows.py`` (the current file with a
diff of ``runs/`` applied), timed at its defaults beside the current one.
"""

from __future__ import annotations

import argparse
import functools
import importlib
import sys
import time
from typing import Any

import jax
import jax.numpy as jnp

from _timing import time_interleaved
from _variants import load_variant


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", default="2048,4096")
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--samples", type=int, default=9)
    parser.add_argument("--configs", default="8192:8,4096:8,8192:4", help="kernel block:warps")
    parser.add_argument("--variant", action="append", default=[], metavar="NAME=FILE", help="another version of kernels/_softmax_rows.py")
    args = parser.parse_args()
    lce = importlib.import_module("ejlabel.kernels.linear_cross_entropy")
    from ejlabel.kernels._softmax_rows import softmax_rows

    others = {name: load_variant("_softmax_rows", name, path).softmax_rows for name, path in (v.split("=", 1) for v in args.variant)}

    loss = lce._Loss(None, 0.0, None, "mean")
    print(f"{jax.devices()[0].device_kind}; jax {jax.__version__}; {time.strftime('%Y-%m-%d')}")
    print("| tokens | variant | us (+ over the product) | GB/s | max abs diff of the gradient vs XLA (x g) | loss diff |\n|---:|---|---:|---:|---:|---:|")
    for tokens in (int(t) for t in args.tokens.split(",")):
        kh, kw, ky = jax.random.split(jax.random.key(tokens), 3)
        h = jax.random.normal(kh, (tokens, 768), jnp.float32).astype(jnp.bfloat16)
        w = (2.0 * jax.random.normal(kw, (768, args.vocab), jnp.float32) / 768**0.5).astype(jnp.bfloat16)
        labels = jax.random.randint(ky, (tokens,), 0, args.vocab, jnp.int32)
        g = jnp.full((tokens,), 1.0 / tokens, jnp.float32)

        def xla(h: jax.Array, w: jax.Array) -> tuple[jax.Array, ...]:
            z = h @ w
            f = lce._factored_chunk(z.astype(jnp.float32), labels, g, loss, z.dtype)
            return f.dense, f.r, f.per_token

        variants = {"product only": jax.jit(lambda h, w: (h @ w, g, g)), "XLA passes": jax.jit(xla)}
        for block, warps in (map(int, c.split(":")) for c in args.configs.split(",")):
            def ours(h: jax.Array, w: jax.Array, block: int = block, warps: int = warps) -> tuple[jax.Array, ...]:
                out = softmax_rows(h @ w, labels, g, loss, block=block, num_warps=warps)
                return out.dense, jnp.ones_like(g), out.per_token  # g is inside dense
            variants[f"kernel, {block} columns, {warps} warps"] = jax.jit(ours)
        for name, other in others.items():
            def theirs(h: jax.Array, w: jax.Array, other: Any = other) -> tuple[jax.Array, ...]:
                out = other(h @ w, labels, g, loss)
                return out.dense, jnp.ones_like(g), out.per_token
            variants[f"variant {name}"] = jax.jit(theirs)
        dense_ref, r_ref, loss_ref = variants["XLA passes"](h, w)
        grad_ref = dense_ref.astype(jnp.float32) * r_ref[:, None]
        times = time_interleaved({name: functools.partial(fn, h, w) for name, fn in variants.items()}, args.samples, per_sample=20)
        base = times["product only"]
        for name, fn in variants.items():
            dense, r, per_token = fn(h, w)
            diff = float(jnp.max(jnp.abs(dense.astype(jnp.float32) * r[:, None] - grad_ref)))
            ms, extra = times[name], times[name] - base
            rate = f"{2 * dense.size * 2 / extra / 1e6:.0f}" if name != "product only" and extra > 0 else "-"
            errors = "- | -" if name == "product only" else f"{diff:.2e} | {float(jnp.max(jnp.abs(per_token - loss_ref))):.1e}"
            print(f"| {tokens} | {name} | {ms * 1e3:.1f} (+{extra * 1e3:.1f}) | {rate} | {errors} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
