"""Fused linear cross-entropy against the plain expression a JAX user writes, in one run.

python bench/bench_linear_cross_entropy.py [--tokens 16384 --d 768 --vocab 32000] [--out FILE]

Baseline: ``logits = hidden @ weight`` (bf16), then ``logsumexp(logits) - logits[label]`` in
float32, mean over tokens, forward and backward by ``jax.value_and_grad``. Ours: the
``"chunked"`` implementation (vocabulary chunks) and the ``"chunked_tokens"`` one (token
chunks, the gradient computed with the loss) at several chunk sizes. Each variant is compiled ahead of time;
times are medians of interleaved samples (a sample = 5 back-to-back steps, synchronised); memory
is the compiled program's temporary allocation (``memory_analysis().temp_size_in_bytes``).
"""

from __future__ import annotations

import argparse
import sys
import time

import jax
import jax.numpy as jnp
from _timing import time_interleaved


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=16384)
    parser.add_argument("--d", type=int, default=768)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--samples", type=int, default=15)
    parser.add_argument("--chunks", default="2048,4096,8192", help="vocabulary chunks of the chunked implementation")
    parser.add_argument("--token-chunks", default="1024,2048,4096", help="token chunks of the chunked_tokens implementation")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()

    from ejlabel.kernels.linear_cross_entropy import LinearCrossEntropyConfig, linear_cross_entropy

    dtype = jnp.bfloat16 if jax.default_backend() == "gpu" else jnp.float32
    kh, kw, ky = jax.random.split(jax.random.key(0), 3)
    hidden = jax.random.normal(kh, (args.tokens, args.d), jnp.float32).astype(dtype)
    weight = (jax.random.normal(kw, (args.d, args.vocab), jnp.float32) / args.d**0.5).astype(dtype)
    labels = jax.random.randint(ky, (args.tokens,), 0, args.vocab, jnp.int32)

    def plain(h: jax.Array, w: jax.Array) -> jax.Array:
        logits = (h @ w).astype(jnp.float32)
        picked = jnp.take_along_axis(logits, labels[:, None], axis=-1)[:, 0]
        return jnp.mean(jax.nn.logsumexp(logits, axis=-1) - picked)

    variants = {"plain JAX (matmul + logsumexp)": plain}
    for chunk in (int(c) for c in args.chunks.split(",")):
        cfg = LinearCrossEntropyConfig("chunked", chunk)
        variants[f"ours, chunked {chunk}"] = lambda h, w, cfg=cfg: linear_cross_entropy(h, w, labels, ignore_index=None, cfg=cfg)
    for chunk in (int(c) for c in args.token_chunks.split(",")):
        cfg = LinearCrossEntropyConfig("chunked_tokens", chunk_tokens=chunk)
        variants[f"ours, token chunks {chunk}"] = lambda h, w, cfg=cfg: linear_cross_entropy(h, w, labels, ignore_index=None, cfg=cfg)

    compiled, memory, values = {}, {}, {}
    for name, fn in variants.items():
        exe = jax.jit(jax.value_and_grad(fn, argnums=(0, 1))).lower(hidden, weight).compile()
        compiled[name] = exe
        memory[name] = exe.memory_analysis().temp_size_in_bytes
        values[name] = exe(hidden, weight)
    ref_loss, (ref_dh, ref_dw) = values["plain JAX (matmul + logsumexp)"]
    rel = lambda a, b: float(jnp.linalg.norm((a - b).astype(jnp.float32)) / jnp.linalg.norm(b.astype(jnp.float32)))

    times = time_interleaved({name: (lambda exe=exe: exe(hidden, weight)) for name, exe in compiled.items()}, args.samples, 5)
    base = times["plain JAX (matmul + logsumexp)"]
    lines = [
        f"Device: {jax.devices()[0].device_kind}; jax {jax.__version__}; {time.strftime('%Y-%m-%d')}; "
        f"[{args.tokens}, {args.d}] x [{args.d}, {args.vocab}] {jnp.dtype(dtype).name}, value_and_grad; "
        f"medians of {args.samples} interleaved samples of 5 steps",
        "",
        "| variant | fwd+bwd ms | speed vs plain | temp memory MiB | vs plain | loss rel. err | d_hidden rel. err | d_weight rel. err |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for name in compiled:
        loss, (dh, dw) = values[name]
        t = times[name]
        lines.append(
            f"| {name} | {t:.3f} | {base / t:.2f}x | {memory[name] / 2**20:.1f} | {memory[name] / memory['plain JAX (matmul + logsumexp)']:.3f} | "
            f"{abs(float(loss) - float(ref_loss)) / abs(float(ref_loss)):.1e} | {rel(dh, ref_dh):.1e} | {rel(dw, ref_dw):.1e} |"
        )
    table = "\n".join(lines)
    print(table)
    if args.out:
        with open(args.out, "w") as f:
            f.write(table + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
