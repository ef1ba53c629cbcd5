"""Does a factored gradient make the token-chunked linear cross-entropy faster?

    python bench/probe_lce_factored.py [--samples 9]

Per chunk of tokens, ``chunked_tokens`` writes the logits ``z`` (bf16), reads them for the
log-sum-exp, reads them again to write ``d_z = g * (exp(z - lse) - onehot)`` in bf16, and the
two gradient products read ``d_z``. The factored step instead writes ``e = exp(z - m)`` (``m``
the row max) in the pass that sums it, and moves everything else out of the ``[tokens, vocab]``
arrays: ``d_z = (g / s) e - g onehot``, so

    d_hidden = (g / s) * (e @ w^T) - g * w[:, y]^T
    d_weight^T += e^T @ ((g / s) * h) - scatter_add(y, g * h)

(row scales on ``[tokens, d]``, the label term a gather and a scatter of ``d``-vectors). One
read of ``z`` fewer per chunk. No soft cap, no smoothing here: the probe answers whether the
pass structure pays before the kernel takes it. Same shapes and baseline as
``bench_linear_cross_entropy.py``; one interleaved run.
"""

from __future__ import annotations

import argparse
import sys
import time

import jax
import jax.numpy as jnp
from jax import lax
from _timing import time_interleaved


def factored_loss(chunk: int, first_pass: str = "max"):
    """Mean token loss of ``h @ w`` with a custom VJP whose gradient is computed chunk by
    chunk in the forward (as ``chunked_tokens`` does), in the factored form. ``first_pass``:
    ``"max"`` (the row max, then ``e`` and its sum in one pass) or ``"lse"`` (the log-sum-exp
    by ``jax.nn.logsumexp``, then ``e = exp(z - lse)`` already normalised)."""

    def passes(h: jax.Array, w: jax.Array, y: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
        tokens, d = h.shape
        g = 1.0 / tokens  # the mean's cotangent per token
        w_t = w.T  # [vocab, d]: label rows gather and scatter contiguously

        def step(d_weight_t: jax.Array, xs: tuple[jax.Array, jax.Array]) -> tuple[jax.Array, tuple[jax.Array, jax.Array]]:
            h_c, y_c = xs
            z = (h_c @ w).astype(jnp.float32)
            if first_pass == "max":
                m = jnp.max(z, axis=-1)
                e = jnp.exp(z - m[:, None])
                s = jnp.sum(e, axis=-1)
                lse, row = m + jnp.log(s), g / s
            else:
                lse = jax.nn.logsumexp(z, axis=-1)
                e, row = jnp.exp(z - lse[:, None]), jnp.full(lse.shape, g)
            e16 = e.astype(h.dtype)
            picked = jnp.take_along_axis(z, y_c[:, None], axis=-1)[:, 0]
            per_token = lse - picked
            d_hidden = row[:, None] * jnp.dot(e16, w_t, preferred_element_type=jnp.float32) - g * w_t[y_c].astype(jnp.float32)
            scaled = (h_c.astype(jnp.float32) * row[:, None]).astype(h.dtype)
            d_weight_t = d_weight_t + jnp.dot(e16.T, scaled, preferred_element_type=jnp.float32)
            d_weight_t = d_weight_t.at[y_c].add(-g * h_c.astype(jnp.float32))
            return d_weight_t, (per_token, d_hidden.astype(h.dtype))

        n = tokens // chunk
        xs = (h.reshape(n, chunk, d), y.reshape(n, chunk))
        d_weight_t, (per_token, d_hidden) = lax.scan(step, jnp.zeros(w_t.shape, jnp.float32), xs)
        return jnp.mean(per_token), d_hidden.reshape(tokens, d), d_weight_t.T.astype(w.dtype)

    @jax.custom_vjp
    def loss(h: jax.Array, w: jax.Array, y: jax.Array) -> jax.Array:
        return passes(h, w, y)[0]

    def fwd(h: jax.Array, w: jax.Array, y: jax.Array) -> tuple[jax.Array, tuple[jax.Array, jax.Array]]:
        value, d_hidden, d_weight = passes(h, w, y)
        return value, (d_hidden, d_weight)

    def bwd(res: tuple[jax.Array, jax.Array], ct: jax.Array) -> tuple[jax.Array, jax.Array, None]:
        d_hidden, d_weight = res
        return (d_hidden * ct).astype(d_hidden.dtype), (d_weight * ct).astype(d_weight.dtype), None

    loss.defvjp(fwd, bwd)
    return loss


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=16384)
    parser.add_argument("--d", type=int, default=768)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--samples", type=int, default=9)
    parser.add_argument("--chunks", default="4096,8192")
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
        cfg = LinearCrossEntropyConfig("chunked_tokens", chunk_tokens=chunk)
        variants[f"chunked_tokens {chunk}"] = lambda h, w, cfg=cfg: linear_cross_entropy(h, w, labels, ignore_index=None, cfg=cfg)
        for first in ("max", "lse"):
            variants[f"factored ({first} first) {chunk}"] = lambda h, w, f=factored_loss(chunk, first): f(h, w, labels)

    compiled, memory, values = {}, {}, {}
    for name, fn in variants.items():
        exe = jax.jit(jax.value_and_grad(fn, argnums=(0, 1))).lower(hidden, weight).compile()
        compiled[name], memory[name] = exe, exe.memory_analysis().temp_size_in_bytes
        values[name] = exe(hidden, weight)
    base_name = "plain JAX (matmul + logsumexp)"
    ref_loss, (ref_dh, ref_dw) = values[base_name]
    rel = lambda a, b: float(jnp.linalg.norm((a - b).astype(jnp.float32)) / jnp.linalg.norm(b.astype(jnp.float32)))
    times = time_interleaved({name: (lambda exe=exe: exe(hidden, weight)) for name, exe in compiled.items()}, args.samples, 5)
    print(
        f"Device: {jax.devices()[0].device_kind}; jax {jax.__version__}; {time.strftime('%Y-%m-%d')}; "
        f"[{args.tokens}, {args.d}] x [{args.d}, {args.vocab}] {jnp.dtype(dtype).name}; medians of {args.samples} interleaved samples of 5\n"
    )
    print("| variant | fwd+bwd ms | vs plain | temp MiB | loss rel. err | d_hidden rel. err | d_weight rel. err |\n|---|---:|---:|---:|---:|---:|---:|")
    for name in compiled:
        loss, (dh, dw) = values[name]
        print(
            f"| {name} | {times[name]:.3f} | {times[base_name] / times[name]:.2f}x | {memory[name] / 2**20:.1f} | "
            f"{abs(float(loss) - float(ref_loss)) / abs(float(ref_loss)):.1e} | {rel(dh, ref_dh):.1e} | {rel(dw, ref_dw):.1e} |"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
