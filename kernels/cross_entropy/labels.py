"""Labels outside the vocabulary, read alike by every implementation.

With ``ignore_index`` set, a cross-entropy ignores the tokens whose label lies outside
``[0, vocab)`` (:func:`ignored`; ``ignore_index`` is mapped outside): loss 0, no gradient.
Without, it reads labels as the XLA path's gather (NumPy's indexing) does: a label in
``[-vocab, 0)`` is ``label + vocab`` (:func:`wrapped`), any other outside ``[0, vocab)`` gives a
NaN loss (:func:`nan_where_out_of_range`) and the gradient of the log-sum-exp alone.
"""

from __future__ import annotations

import jax.numpy as jnp
from jaxtyping import Array, Bool, Float, Int

__all__ = ["ignored", "nan_where_out_of_range", "wrapped"]


def ignored(labels: Int[Array, "tokens"], vocab: int) -> Bool[Array, "tokens"]:
    """Whether each token's label is outside ``[0, vocab)``."""
    return (labels < 0) | (labels >= vocab)


def wrapped(labels: Int[Array, "tokens"], vocab: int) -> Int[Array, "tokens"]:
    """Labels in ``[-vocab, 0)`` as ``label + vocab``, the class the XLA path's gather reads."""
    return jnp.where((labels < 0) & (labels >= -vocab), labels + vocab, labels)


def nan_where_out_of_range(loss: Float[Array, "tokens"], labels: Int[Array, "tokens"], vocab: int) -> Float[Array, "tokens"]:
    """``loss`` with NaN where the (wrapped) label is outside ``[0, vocab)``, as the XLA path gives it."""
    return jnp.where(ignored(labels, vocab), jnp.nan, loss)
