"""The ``"xla"`` implementation of :func:`ejlabel.kernels.matmul.matmul`: ``a @ b``, the
expression a JAX user writes, differentiated by JAX itself (XLA's GPU dot accumulates
half-precision inputs in float32); with it the compiled program is the one plain JAX gives.
"""

from __future__ import annotations

from jaxtyping import Array, Float

__all__ = ["matmul_xla"]


def matmul_xla(a: Float[Array, "*batch m k"], b: Float[Array, "*batch k n"]) -> Float[Array, "*batch m n"]:
    """``a @ b``, nothing else: the program plain JAX gives."""
    return a @ b
