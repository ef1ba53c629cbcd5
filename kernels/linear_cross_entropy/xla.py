"""The ``"xla"`` implementation of :func:`ejlabel.kernels.linear_cross_entropy.linear_cross_entropy`:
the plain expression a JAX user writes (matmul, then a logsumexp loss), differentiated by JAX
itself: the floor every other implementation is measured against.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from .loss import Loss

__all__ = ["loss_xla"]


def loss_xla(hidden: jax.Array, weight: jax.Array, labels: jax.Array, loss: Loss) -> jax.Array:
    """Each token's loss ``[tokens]`` (0 where a token does not count), the logits whole."""
    logits = loss.cap((hidden @ weight).astype(jnp.float32))
    safe = labels if loss.ignore_index is None else jnp.where(loss.counts(labels), labels, 0)
    per_token, _ = loss.from_logits(logits, safe)
    return per_token if loss.ignore_index is None else jnp.where(loss.counts(labels), per_token, 0.0)
