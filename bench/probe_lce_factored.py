"""Does a factored gradient make the token-chunked linear cross-entropy faster?

    python bench/probe_lce_factored.py [--samples 9]

Per chunk of tokens, ``chunked_tokens`` wrote the logits ``z`` (bf16), read them for the
log-sum-exp, read them again to write ``d_z = g * (exp(z - lse) - onehot)`` in bf16, and the
two gradient products read ``d_z``. The factored step instead writes ``e = exp(z - m)`` (``m``
the row max) in the pass that sums it, and moves everything else out of the ``[tokens, vocab]``
arrays: ``d_z = (g / s) e - g onehot``, so

    d_hidden = (g / s) * (e @ w^T) - g * w[:, y]^T
    d_weight^T += e^T @ ((g / s) * h) - scatter_add(y, g * h)

(row scales on ``[tokens, d]``, the label term a gather and a scatter of ``d``-vectors). No
soft cap, no smoothing here. Two first passes are compared: the row max (then ``e`` and its sum
in one pass) and ``jax.nn.logsumexp`` (then ``e`` already normalised). Runs 28-29
(bench/RESULTS.md) compared them with the unfactored kernel of the time: the max first won,
and the kernel has computed its gradient that way since (``_factored_chunk``), so today its
``chunked_tokens`` rows and the max-first rows are the same algorithm. Same problem, baseline
and table as ``bench_linear_cross_entropy.py``; one interleaved run.
"""

from __future__ import annotations

import sys

import jax
import jax.numpy as jnp
from jax import lax
from bench_linear_cross_entropy import PLAIN, compare, plain_loss, problem, problem_parser


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
    parser = problem_parser(__doc__.splitlines()[0], samples=9)
    parser.add_argument("--chunks", default="4096,8192")
    args = parser.parse_args()

    from ejlabel.kernels.linear_cross_entropy import LinearCrossEntropyConfig, linear_cross_entropy

    hidden, weight, labels = problem(args.tokens, args.d, args.vocab)
    variants = {PLAIN: plain_loss(labels)}
    for chunk in (int(c) for c in args.chunks.split(",")):
        cfg = LinearCrossEntropyConfig("chunked_tokens", chunk_tokens=chunk)
        variants[f"chunked_tokens {chunk}"] = lambda h, w, cfg=cfg: linear_cross_entropy(h, w, labels, ignore_index=None, cfg=cfg)
        for first in ("max", "lse"):
            variants[f"factored ({first} first) {chunk}"] = lambda h, w, f=factored_loss(chunk, first): f(h, w, labels)
    print(compare(variants, hidden, weight, args.samples))
    return 0


if __name__ == "__main__":
    sys.exit(main())
