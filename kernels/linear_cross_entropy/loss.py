"""What every implementation of the linear cross-entropy computes, and the scan over token chunks
the two token-chunked implementations share.

:class:`Loss` holds the static parts of the loss (ignored label, smoothing, soft cap,
reduction) and its formulas, read while tracing on float32 values; :func:`over_token_chunks`
runs a step over chunks of tokens, each against the whole vocabulary, and returns what the
steps give as a :class:`TokenPass`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax import lax
from jaxtyping import Array, Float, Int

from ..pallas_common import pad_axis

__all__ = ["Loss", "TokenPass", "over_token_chunks", "token_chunks"]


@dataclasses.dataclass(frozen=True)
class Loss:
    """The static parts of the loss: what every implementation computes."""

    ignore_index: int | None
    label_smoothing: float
    logit_soft_cap: float | None
    reduction: str = "none"

    def cap(self, z: jax.Array) -> jax.Array:
        return z if self.logit_soft_cap is None else self.logit_soft_cap * jnp.tanh(z / self.logit_soft_cap)

    def cap_grad(self, capped: jax.Array) -> jax.Array | float:
        """d capped / d raw, from the capped value: ``1 - tanh^2``."""
        return 1.0 if self.logit_soft_cap is None else 1.0 - jnp.square(capped / self.logit_soft_cap)

    def counts(self, labels: jax.Array) -> jax.Array:
        return jnp.ones(labels.shape, bool) if self.ignore_index is None else labels != self.ignore_index

    def wrapped(self, labels: Int[Array, "tokens"], vocab: int) -> Int[Array, "tokens"]:
        """Counting labels in ``[-vocab, 0)`` as ``label + vocab``: the class the XLA path's
        gather reads (NumPy's indexing), for the implementations that read labels otherwise."""
        return jnp.where(self.counts(labels) & (labels < 0) & (labels >= -vocab), labels + vocab, labels)

    def nan_where_out_of_range(self, per_token: Float[Array, "tokens"], labels: Int[Array, "tokens"], vocab: int) -> Float[Array, "tokens"]:
        """``per_token`` with NaN where a counting (wrapped) label is outside ``[0, vocab)``, as
        the XLA path's gather gives it."""
        return jnp.where(self.counts(labels) & ((labels < 0) | (labels >= vocab)), jnp.nan, per_token)

    def per_token(self, lse: jax.Array, picked: jax.Array, mean_logit: Callable[[], jax.Array]) -> jax.Array:
        """Each token's loss from its log-sum-exp, its label's logit and (only read with
        smoothing) ``mean_logit()``, the mean of its logits, all ``[tokens]`` float32."""
        per_token = lse - picked
        if self.label_smoothing:
            per_token = per_token + self.label_smoothing * (picked - mean_logit())
        return per_token

    def from_logits(self, z: Float[Array, "tokens vocab"], safe_labels: Int[Array, "tokens"]) -> tuple[jax.Array, jax.Array]:
        """``(per-token loss, log-sum-exp)`` from capped float32 logits over the whole vocabulary."""
        picked = jnp.take_along_axis(z, safe_labels[:, None], axis=-1)[:, 0]
        lse = jax.nn.logsumexp(z, axis=-1)
        return self.per_token(lse, picked, lambda: jnp.mean(z, axis=-1)), lse

    def d_logits(
        self, z: Float[Array, "tokens cols"], lse: Float[Array, "tokens"], onehot: jax.Array, token_g: Float[Array, "tokens"],
        vocab: int, dtype: Any, real: jax.Array | None = None,
    ) -> jax.Array:
        """``d loss / d raw logits`` of columns ``z`` (capped float32), each token's row scaled
        by ``token_g``, in ``dtype``; ``real`` masks padded columns (zero gradient)."""
        eps = self.label_smoothing
        probs = jnp.exp(z - lse[:, None])
        smoothing = eps / vocab
        if real is not None:
            probs, smoothing = jnp.where(real, probs, 0.0), jnp.where(real, smoothing, 0.0)
        d_z = probs - (1.0 - eps) * onehot - smoothing
        return (d_z * token_g[:, None] * self.cap_grad(z)).astype(dtype)

    def reduce(self, per_token: jax.Array, labels: jax.Array) -> jax.Array:
        """The call's output from the ``[tokens]`` losses: the one home of the reduction."""
        if self.reduction == "none":
            return per_token
        if self.ignore_index is None:  # every token counts: the expression a JAX user writes
            return jnp.mean(per_token) if self.reduction == "mean" else jnp.sum(per_token)
        total = jnp.sum(per_token)
        return total if self.reduction == "sum" else self.mean_of_sum(total, labels)

    def mean_of_sum(self, total: jax.Array, labels: jax.Array) -> jax.Array:
        """The mean loss from the summed one: divided by the tokens that count (at least 1)."""
        if self.ignore_index is None:
            return total / labels.shape[0]
        return total / jnp.maximum(jnp.sum(self.counts(labels)), 1)

    def token_cotangent(self, g: jax.Array | float, labels: jax.Array) -> Float[Array, "tokens"]:
        """The cotangent of each token's loss, given the output's cotangent ``g``: the pullback
        of :meth:`reduce` (linear in the losses), zero where a token does not count."""
        _, pullback = jax.vjp(lambda per_token: self.reduce(per_token, labels), jnp.zeros(labels.shape, jnp.float32))
        (per_token_g,) = pullback(jnp.asarray(g, jnp.float32))
        return jnp.where(self.counts(labels), per_token_g, 0.0)


class TokenPass(NamedTuple):
    """A token-chunked pass: each token's loss and, when the pass computed them, the gradients."""

    per_token: Float[Array, "tokens"]
    d_hidden: Float[Array, "tokens d"] | None
    d_weight: Float[Array, "d vocab"] | None  # float32


def token_chunks(x: jax.Array, chunk: int) -> jax.Array:
    """``x [tokens, ...]`` as ``[n, chunk, ...]``, zero-padded to whole chunks."""
    n = -(-x.shape[0] // chunk)
    return pad_axis(x, 0, n * chunk).reshape(n, chunk, *x.shape[1:])


def over_token_chunks(
    step: Callable[[Any, tuple[jax.Array, ...]], tuple[Any, tuple[jax.Array, ...]]], init: Any,
    hidden: jax.Array, labels: jax.Array, loss: Loss, chunk: int, token_g: jax.Array | None,
) -> tuple[Any, jax.Array, jax.Array | None]:
    """``lax.scan`` of ``step(carry, (h_c, y_c, g_c)) -> (carry, (per_token_c[, d_hidden_c]))``
    over chunks of ``chunk`` tokens (the last one zero-padded, its cotangent zero; ignored
    labels mapped to class 0 with a zero cotangent). Returns the carry, the ``[tokens]`` losses
    (zero where a token does not count) and, when ``step`` gives it, ``d_hidden``."""
    tokens, d = hidden.shape
    chunk = min(chunk, tokens)
    safe = jnp.where(loss.counts(labels), labels, 0)
    g = jnp.zeros(labels.shape, jnp.float32) if token_g is None else token_g.astype(jnp.float32)
    carry, outs = lax.scan(step, init, (token_chunks(hidden, chunk), token_chunks(safe, chunk), token_chunks(g, chunk)))
    per_token = jnp.where(loss.counts(labels), outs[0].reshape(-1)[:tokens], 0.0)
    return carry, per_token, outs[1].reshape(-1, d)[:tokens] if len(outs) > 1 else None
