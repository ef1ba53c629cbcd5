"""The ``"xla"`` implementation of :func:`ejlabel.kernels.norms.rms_norm` and
:func:`~ejlabel.kernels.norms.layer_norm`: the formula in ``jax.numpy`` as a JAX user writes it,
run without a custom VJP, so that JAX differentiates it and XLA fuses it exactly as in a plain
model.
"""

from __future__ import annotations

import jax.numpy as jnp
from jax import lax
from jaxtyping import Array, Float

__all__ = ["norm_xla"]


def norm_xla(x: Float[Array, "*batch width"], w: Float[Array, "width"], b: Float[Array, "width"] | None, eps: float) -> Float[Array, "*batch width"]:
    """RMS norm, or with ``b`` layer norm, of the last axis; statistics in float32."""
    x32 = x.astype(jnp.float32)
    if b is not None:
        x32 = x32 - jnp.mean(x32, axis=-1, keepdims=True)
    x_hat = x32 * lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    y = x_hat * w.astype(jnp.float32)
    if b is not None:
        y = y + b.astype(jnp.float32)
    return y.astype(x.dtype)
