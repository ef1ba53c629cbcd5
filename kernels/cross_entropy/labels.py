"""Which tokens a cross-entropy ignores: those whose label lies outside ``[0, vocab)``. Every
implementation counts them alike (loss 0, no gradient); ``ignore_index`` is mapped outside.
"""

from __future__ import annotations

from jaxtyping import Array, Bool, Int

__all__ = ["ignored"]


def ignored(labels: Int[Array, "tokens"], vocab: int) -> Bool[Array, "tokens"]:
    """Whether each token's label is outside ``[0, vocab)``."""
    return (labels < 0) | (labels >= vocab)
