"""The ``"chunked"`` implementation of :func:`ejlabel.kernels.linear_cross_entropy.linear_cross_entropy`,
in XLA: a ``lax.scan`` over vocabulary chunks of ``chunk_vocab`` columns.

The forward keeps the running max, the rescaled sum of exponentials, the label's logit and the
sum of logits, and saves the per-token log-sum-exp (``[tokens]`` floats); the backward
recomputes each chunk's logits from ``hidden`` and that log-sum-exp and accumulates ``d_hidden
+= d_z @ w_c^T`` and ``d_weight[:, c] = hidden^T @ d_z``: the logits never exist whole in either
direction, the cost being one more pass of the matmul. The least memory; many small matrix
products.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from .loss import Loss

__all__ = ["backward_chunked", "forward_chunked"]


def _chunks(weight: jax.Array, chunk: int) -> tuple[jax.Array, int]:
    """``weight [d, vocab]`` as ``[n, d, chunk]`` zero-padded chunks, and the true vocab size."""
    d, vocab = weight.shape
    n = -(-vocab // chunk)
    padded = jnp.pad(weight, ((0, 0), (0, n * chunk - vocab)))
    return jnp.moveaxis(padded.reshape(d, n, chunk), 1, 0), vocab


def _chunk_logits(hidden: jax.Array, w_chunk: jax.Array, start: jax.Array, vocab: int, loss: Loss) -> tuple[jax.Array, jax.Array]:
    """Capped float32 logits of one chunk ``[tokens, chunk]`` and the mask of real columns."""
    z = loss.cap(jnp.dot(hidden, w_chunk, preferred_element_type=jnp.float32))
    real = (start + jnp.arange(w_chunk.shape[1])) < vocab
    return z, real


def forward_chunked(hidden: jax.Array, weight: jax.Array, labels: jax.Array, loss: Loss, chunk: int) -> tuple[jax.Array, jax.Array]:
    """Per-token loss and log-sum-exp, one vocabulary chunk at a time."""
    chunks, vocab = _chunks(weight, chunk)
    tokens = hidden.shape[0]

    def step(carry: tuple[jax.Array, ...], xs: tuple[jax.Array, jax.Array]) -> tuple[tuple[jax.Array, ...], None]:
        running_max, running_sum, picked, total = carry
        index, w_chunk = xs
        start = index * chunk
        z, real = _chunk_logits(hidden, w_chunk, start, vocab, loss)
        masked = jnp.where(real, z, -jnp.inf)
        new_max = jnp.maximum(running_max, jnp.max(masked, axis=-1))
        running_sum = running_sum * jnp.exp(running_max - new_max) + jnp.sum(jnp.exp(masked - new_max[:, None]), axis=-1)
        local = labels - start
        inside = (local >= 0) & (local < chunk)
        picked = picked + jnp.where(inside, jnp.take_along_axis(z, jnp.clip(local, 0, chunk - 1)[:, None], axis=-1)[:, 0], 0.0)
        total = total + jnp.sum(jnp.where(real, z, 0.0), axis=-1)
        return (new_max, running_sum, picked, total), None

    init = (jnp.full((tokens,), -jnp.inf, jnp.float32), jnp.zeros((tokens,), jnp.float32), jnp.zeros((tokens,), jnp.float32), jnp.zeros((tokens,), jnp.float32))
    (running_max, running_sum, picked, total), _ = lax.scan(step, init, (jnp.arange(chunks.shape[0]), chunks))
    lse = running_max + jnp.log(running_sum)
    per_token = loss.per_token(lse, picked, lambda: total / vocab)
    counts = loss.counts(labels)
    return jnp.where(counts, per_token, 0.0), lse


def backward_chunked(
    hidden: jax.Array, weight: jax.Array, labels: jax.Array, lse: jax.Array, g: jax.Array, loss: Loss, chunk: int
) -> tuple[jax.Array, jax.Array]:
    """``(d_hidden, d_weight)`` of ``sum(g * loss)``, recomputing each chunk's logits."""
    chunks, vocab = _chunks(weight, chunk)
    scale = jnp.where(loss.counts(labels), g.astype(jnp.float32), 0.0)

    def step(d_hidden: jax.Array, xs: tuple[jax.Array, jax.Array]) -> tuple[jax.Array, jax.Array]:
        index, w_chunk = xs
        start = index * chunk
        z, real = _chunk_logits(hidden, w_chunk, start, vocab, loss)
        onehot = (labels - start)[:, None] == jnp.arange(chunk)[None, :]
        d_z = loss.d_logits(z, lse, onehot, scale, vocab, hidden.dtype, real)
        d_hidden = d_hidden + jnp.dot(d_z, w_chunk.T, preferred_element_type=jnp.float32)
        return d_hidden, jnp.dot(hidden.T, d_z, preferred_element_type=jnp.float32).astype(weight.dtype)

    d_hidden, d_chunks = lax.scan(step, jnp.zeros(hidden.shape, jnp.float32), (jnp.arange(chunks.shape[0]), chunks))
    d_weight = jnp.moveaxis(d_chunks, 0, 1).reshape(weight.shape[0], -1)[:, :vocab]
    return d_hidden.astype(hidden.dtype), d_weight
