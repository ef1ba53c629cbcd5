"""The ``"xla"`` implementation of :func:`ejlabel.kernels.cross_entropy.softmax_cross_entropy`:
``logsumexp`` and a gather in ``jax.numpy``, the expression a JAX user writes, run without a
custom VJP (JAX differentiates it, XLA fuses it as in a plain model).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int

from .labels import ignored

__all__ = ["cross_entropy_xla"]


def cross_entropy_xla(
    logits: Float[Array, "tokens vocab"], labels: Int[Array, "tokens"], ignore_index: int | None = -100
) -> Float[Array, "tokens"]:
    """Per-token ``logsumexp(logits) - logits[label]`` in float32; with ``ignore_index`` set,
    0 for the tokens :func:`.labels.ignored` names (out of range, ``ignore_index`` among them)."""
    logits = logits.astype(jnp.float32)
    if ignore_index is None:
        picked = jnp.take_along_axis(logits, labels[:, None], axis=-1)[:, 0]
        return jax.nn.logsumexp(logits, axis=-1) - picked
    vocab = logits.shape[1]
    picked = jnp.take_along_axis(logits, jnp.clip(labels, 0, vocab - 1)[:, None], axis=1)[:, 0]
    return jnp.where(ignored(labels, vocab), 0.0, jax.nn.logsumexp(logits, axis=1) - picked)
