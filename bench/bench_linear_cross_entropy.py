"""Fused linear cross-entropy against the plain expression a JAX user writes, in one run.

python bench/bench_linear_cross_entropy.py [--tokens 16384 --d 768 --vocab 32000]

Baseline: ``logits = hidden @ weight`` (bf16), then ``logsumexp(logits) - logits[label]`` in
float32, mean over tokens, forward and backward by ``jax.value_and_grad``. Ours: the
``"chunked"`` implementation (vocabulary chunks) and the ``"chunked_tokens"`` one (token
chunks, the gradient computed with the loss) at several chunk sizes, with the XLA passes over
each chunk's logits and with the kernel that reads them once (``"chunked_tokens_triton"``).
Each variant is compiled ahead of time; times are medians of interleaved samples (a sample = 5
back-to-back steps, synchronised); memory is the compiled program's temporary allocation
(``memory_analysis().temp_size_in_bytes``); errors are against the plain program run in
float32, so the plain row's own is the bar. The rows go to
``bench/results/bench_linear_cross_entropy.json`` (``bench/_results.py``; another shape than the
default to ``bench_linear_cross_entropy.<tokens>x<d>x<vocab>.json``).
"""

from __future__ import annotations

import argparse
import importlib
import sys
import time
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from _results import write_results
from _timing import time_interleaved


PLAIN = "plain JAX (matmul + logsumexp)"


def problem(tokens: int, d: int, vocab: int) -> tuple[jax.Array, jax.Array, jax.Array]:
    """``(hidden [tokens, d], weight [d, vocab], labels [tokens])``, bf16 on a GPU (float32
    elsewhere), the weight scaled as an initialised unembedding."""
    dtype = jnp.bfloat16 if jax.default_backend() == "gpu" else jnp.float32
    kh, kw, ky = jax.random.split(jax.random.key(0), 3)
    hidden = jax.random.normal(kh, (tokens, d), jnp.float32).astype(dtype)
    weight = (jax.random.normal(kw, (d, vocab), jnp.float32) / d**0.5).astype(dtype)
    return hidden, weight, jax.random.randint(ky, (tokens,), 0, vocab, jnp.int32)


def problem_parser(description: str, samples: int) -> argparse.ArgumentParser:
    """The command line of a script timing :func:`problem`: its shape and the sample count."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--tokens", type=int, default=16384)
    parser.add_argument("--d", type=int, default=768)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--samples", type=int, default=samples)
    return parser


def plain_loss(labels: jax.Array) -> Callable[[jax.Array, jax.Array], jax.Array]:
    """The baseline: the mean loss as a JAX user writes it."""

    def plain(h: jax.Array, w: jax.Array) -> jax.Array:
        logits = (h @ w).astype(jnp.float32)
        picked = jnp.take_along_axis(logits, labels[:, None], axis=-1)[:, 0]
        return jnp.mean(jax.nn.logsumexp(logits, axis=-1) - picked)

    return plain


def our_loss(labels: jax.Array, cfg: Any, module: Any = None) -> Callable[[jax.Array, jax.Array], jax.Array]:
    """Ours as every script here calls it: the mean loss by ``linear_cross_entropy`` on ``cfg``,
    no label ignored; ``module``: another version of the kernel module (default the current)."""
    module = module or importlib.import_module("ejlabel.kernels.linear_cross_entropy")
    return lambda h, w: module.linear_cross_entropy(h, w, labels, ignore_index=None, cfg=cfg)


def compare(
    variants: dict[str, Callable[[jax.Array, jax.Array], jax.Array]], hidden: jax.Array, weight: jax.Array, samples: int,
) -> tuple[str, list[dict[str, Any]]]:
    """The table and the rows of ``value_and_grad`` of each variant (the first is the baseline):
    time, memory, and errors against the baseline run in float32 (so the baseline's own row is
    the bar: the rounding of its bf16 logits and gradients)."""
    compiled, memory, values = {}, {}, {}
    for name, fn in variants.items():
        exe = jax.jit(jax.value_and_grad(fn, argnums=(0, 1))).lower(hidden, weight).compile()
        compiled[name], memory[name] = exe, exe.memory_analysis().temp_size_in_bytes
        values[name] = exe(hidden, weight)
    base = next(iter(variants))
    f32 = jnp.float32
    ref_loss, (ref_dh, ref_dw) = jax.jit(jax.value_and_grad(variants[base], argnums=(0, 1)))(hidden.astype(f32), weight.astype(f32))
    rel = lambda a, b: float(jnp.linalg.norm(a.astype(f32) - b) / jnp.linalg.norm(b))
    times = time_interleaved({name: (lambda exe=exe: exe(hidden, weight)) for name, exe in compiled.items()}, samples, 5)
    (tokens, d), vocab = hidden.shape, weight.shape[1]
    lines = [
        f"Device: {jax.devices()[0].device_kind}; jax {jax.__version__}; {time.strftime('%Y-%m-%d')}; "
        f"[{tokens}, {d}] x [{d}, {vocab}] {jnp.dtype(hidden.dtype).name}, value_and_grad; "
        f"medians of {samples} interleaved samples of 5 steps; errors against the plain program in float32",
        "",
        "| variant | fwd+bwd ms | speed vs plain | temp memory MiB | vs plain | loss rel. err | d_hidden rel. err | d_weight rel. err |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    rows = []
    for name in compiled:
        loss, (dh, dw) = values[name]
        row = {
            "variant": name, "ms": times[name], "speed_vs_plain": times[base] / times[name],
            "temp_memory_mib": memory[name] / 2**20, "memory_vs_plain": memory[name] / memory[base],
            "loss_rel_err": abs(float(loss) - float(ref_loss)) / abs(float(ref_loss)),
            "d_hidden_rel_err": rel(dh, ref_dh), "d_weight_rel_err": rel(dw, ref_dw),
        }
        rows.append(row)
        lines.append(
            f"| {name} | {row['ms']:.3f} | {row['speed_vs_plain']:.2f}x | {row['temp_memory_mib']:.1f} | {row['memory_vs_plain']:.3f} | "
            f"{row['loss_rel_err']:.1e} | {row['d_hidden_rel_err']:.1e} | {row['d_weight_rel_err']:.1e} |"
        )
    return "\n".join(lines), rows


def main() -> int:
    parser = problem_parser(__doc__.splitlines()[0], samples=15)
    parser.add_argument("--chunks", default="2048,4096,8192", help="vocabulary chunks of the chunked implementation")
    parser.add_argument("--token-chunks", default="2048,4096,8192", help="token chunks of the two token-chunked implementations")
    args = parser.parse_args()

    from ejlabel.kernels.linear_cross_entropy import LinearCrossEntropyConfig

    hidden, weight, labels = problem(args.tokens, args.d, args.vocab)
    variants = {PLAIN: plain_loss(labels)}
    for chunk in (int(c) for c in args.chunks.split(",")):
        variants[f"ours, chunked {chunk}"] = our_loss(labels, LinearCrossEntropyConfig("chunked", chunk))
    for impl, suffix in (("chunked_tokens", ""), ("chunked_tokens_triton", ", rows kernel")):
        for chunk in (int(c) for c in args.token_chunks.split(",")):
            variants[f"ours, token chunks {chunk}{suffix}"] = our_loss(labels, LinearCrossEntropyConfig(impl, chunk_tokens=chunk))
    table, rows = compare(variants, hidden, weight, args.samples)
    print(table)
    shape = (args.tokens, args.d, args.vocab)
    write_results(
        "bench_linear_cross_entropy" + ("" if shape == (16384, 768, 32000) else ".{}x{}x{}".format(*shape)), rows,
        notes=f"value_and_grad of the mean loss, [{args.tokens}, {args.d}] x [{args.d}, {args.vocab}]; medians of {args.samples} interleaved "
        "samples of 5 steps; memory: the compiled program's temporary allocation; errors against the plain program in float32",
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
