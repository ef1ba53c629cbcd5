"""The ``"chunked_tokens"`` implementation of
:func:`ejlabel.kernels.linear_cross_entropy.linear_cross_entropy`, in XLA: a ``lax.scan`` over
chunks of ``chunk_tokens`` tokens, each against the whole vocabulary, so every product is as
large as the plain program's along the vocabulary.

When the output is reduced (``"mean"``/``"sum"``) its cotangent is one scalar, so the forward,
run under differentiation, also computes each chunk's gradient while its logits are at hand,
and the backward only scales it: three passes of the matmul in all, as in the plain program,
but the logits of one chunk at a time. The gradient is factored (:func:`factored_chunk`): the
one ``[chunk, vocab]`` array written besides the logits is ``exp(z - max)``, in the pass that
sums it, with the label's gradient in the label's column; the softmax's ``1 / sum`` and the
smoothing term act on ``[chunk, d]`` rows around the two products, and ``d_weight``'s label
rows take a float32 correction (:func:`tokens_pass`). With ``reduction="none"`` the backward
recomputes the chunks instead.

Written in XLA, a chunk holds two ``[chunk, vocab]`` arrays, the logits and ``e``: XLA writes
``e`` beside the logits, not over them, and fuses it into neither product (three variants
tried). One XLA pass over the logits would do, shifting each row by its label's logit instead
of its max (faster), but that is exact only while the label lies within ~40 nats of the
max, and redoing the other rows costs more than the pass saves in every form XLA offers, a loop
whose count the host reads or a conditional that copies ``e``; the rows kernel
(:mod:`.triton`) keeps the max online instead.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax import lax
from jaxtyping import Array, Float, Int

from .loss import Loss, TokenPass, over_token_chunks

__all__ = ["Factored", "factored_chunk", "tokens_pass"]


class Factored(NamedTuple):
    """``d loss / d raw logits`` of one chunk as ``r * dense - k``: the one ``[tokens, vocab]``
    array is ``dense``; ``r`` scales its rows and ``k`` (smoothing without a cap) is taken from
    every column. ``label`` is ``dense``'s label column in float32, before its rounding."""

    per_token: Float[Array, "tokens"]
    dense: Float[Array, "tokens vocab"] | None  # in the input dtype; None for the loss alone
    r: Float[Array, "tokens"] | None
    k: Float[Array, "tokens"] | None
    label: Float[Array, "tokens"] | None


def _row_reductions(*pairs: tuple[jax.Array, str]) -> tuple[jax.Array, ...]:
    """Per-row ``max`` or ``sum`` of each ``[tokens, vocab]`` operand, as one reduction: one pass
    over what the operands are computed from, where separate reductions may read it once each."""
    inits = tuple(jnp.float32(-jnp.inf if kind == "max" else 0.0) for _, kind in pairs)
    combine = lambda a, b: tuple(jnp.maximum(x, y) if kind == "max" else x + y for x, y, (_, kind) in zip(a, b, pairs))
    return lax.reduce(tuple(operand for operand, _ in pairs), inits, combine, (1,))


def factored_chunk(
    z: Float[Array, "tokens vocab"], labels: Int[Array, "tokens"], token_g: Float[Array, "tokens"] | None, loss: Loss, dtype: Any
) -> Factored:
    """The loss and (given ``token_g``) the factored gradient of capped float32 logits ``z``,
    each token's row scaled by ``token_g``.

    The gradient is ``g cg (p - (1 - eps) onehot - eps / V)``, ``p`` the softmax and ``cg`` the
    cap's derivative. A first pass over ``z`` finds each row's max ``m``; the second writes the
    one dense array ``cg e`` with ``e = exp(z - m)`` and sums ``e``, all of it (``s``) and off the
    label (``others``), in one reduction; ``g / s`` scales the rows of the products and, without
    a cap, ``g eps / V`` is taken from every column beside them (``k``). A cap with smoothing
    puts ``eps / V`` inside the dense array, ``cg (e / s - eps / V)``, which needs ``s`` first: a
    pass of its own (``e`` is then ``p`` and its sum 1).

    The label's column is written last, ``cg (eps e_y - (1 - eps) others)``: the gradient
    ``p_y - (1 - eps)`` as ``eps p_y - (1 - eps)(1 - p_y)``, for a confident prediction the small
    ``p_y - 1`` with no cancellation before its rounding to ``dtype`` (``g p_y`` rounded with
    ``-g`` added beside it keeps the rounding of ``g p_y``: d_weight 10% off at p = 0.996, 96% at
    p = 0.99998; test_confident_predictions_keep_their_gradient). In an untrained model this
    entry, ``-(s - e_y)``, is the row's largest and its rounding shows in ``d_hidden`` (further
    from float32 than the plain program's, whose ``p_y - 1`` is close to -1, nearly exact in
    bf16; the error columns of ``bench/bench_linear_cross_entropy.py``); writing ``p`` instead
    needs the sum before the dense pass, which ran slower. The log-sum-exp is not
    ``jax.nn.logsumexp``: on the H100 that form ran the whole loss slower."""
    eps, vocab = loss.label_smoothing, z.shape[1]
    capped = loss.logit_soft_cap is not None
    picked = jnp.take_along_axis(z, labels[:, None], axis=-1)[:, 0]
    m, *total = _row_reductions((z, "max"), *(((z, "sum"),) if eps else ()))
    e = jnp.exp(z - m[:, None])
    if token_g is None:  # the loss only
        per_token = loss.per_token(m + jnp.log(jnp.sum(e, axis=-1)), picked, lambda: total[0] / vocab)
        return Factored(per_token, None, None, None, None)
    normalised = capped and bool(eps)
    e_label = jnp.exp(picked - m)
    if normalised:
        total_e = jnp.sum(e, axis=-1)
        e, e_label = e / total_e[:, None], e_label / total_e
    is_label = jnp.arange(vocab)[None, :] == labels[:, None]
    s, others = _row_reductions((e, "sum"), (jnp.where(is_label, 0.0, e), "sum"))
    per_token = loss.per_token(m + jnp.log(total_e if normalised else s), picked, lambda: total[0] / vocab)
    uniform = eps / vocab if capped else 0.0  # the smoothing term inside the dense array
    dense = loss.cap_grad(z) * (e - uniform)
    label = loss.cap_grad(picked) * (eps * e_label - (1.0 - eps) * others - uniform)
    dense = dense.astype(dtype).at[jnp.arange(z.shape[0]), labels].set(label.astype(dtype))
    r = token_g if normalised else token_g / s
    k = token_g * (eps / vocab) if eps and not capped else None
    return Factored(per_token, dense, r, k, label)


def _rounded(x: jax.Array, dtype: Any) -> jax.Array:
    """``x`` rounded to ``dtype``'s precision, kept in float32: a rounding XLA may not skip, as
    it may a convert there and back."""
    info = jnp.finfo(dtype)
    return lax.reduce_precision(x, exponent_bits=info.nexp, mantissa_bits=info.nmant)


def tokens_pass(
    hidden: jax.Array, weight: jax.Array, labels: jax.Array, loss: Loss, chunk: int, token_g: jax.Array | None = None,
) -> TokenPass:
    """Per-token losses, one chunk of tokens against the whole vocabulary at a time, and with
    ``token_g [tokens]`` the gradient of ``sum(token_g * loss)`` from the same logits, its
    terms from :func:`factored_chunk`.

    The gradient products take :class:`Factored` terms: ``d_hidden = r (dense @ w^T) - k
    sum_j w_j`` and ``d_weight^T += dense^T @ (r h) - sum_t k_t h_t``, the label's column inside
    ``dense``, so ``d_hidden`` needs no gathered row of the weight (nor a transposed copy of it
    to gather from). ``d_weight`` is kept transposed so that each label's row takes a float32
    correction contiguously: the exact ``label r h`` less what the product added from the two
    rounded operands, so the label's term, the largest in a confident or an untrained model's
    gradient, is not rounded twice."""
    d = hidden.shape[1]
    smoothed = bool(loss.label_smoothing) and loss.logit_soft_cap is None
    weight_sum = jnp.sum(weight.astype(jnp.float32), axis=1) if smoothed and token_g is not None else None

    def step(carry: tuple[jax.Array, jax.Array] | None, xs: tuple[jax.Array, ...]) -> tuple[tuple[jax.Array, jax.Array] | None, tuple[jax.Array, ...]]:
        h_c, y_c, g_c = xs
        product = h_c @ weight  # the plain program's logits, one chunk
        f = factored_chunk(loss.cap(product.astype(jnp.float32)), y_c, None if carry is None else g_c, loss, hidden.dtype)
        if carry is None:  # the loss only
            return None, (f.per_token,)
        d_weight_t, smoothing = carry  # smoothing: sum_t k_t h_t, taken from every row at the end
        h32 = h_c.astype(jnp.float32)
        rh = h32 * f.r[:, None]
        d_hidden = f.r[:, None] * jnp.dot(f.dense, weight.T, preferred_element_type=jnp.float32)
        d_weight_t = d_weight_t + jnp.dot(f.dense.T, rh.astype(hidden.dtype), preferred_element_type=jnp.float32)
        d_weight_t = d_weight_t.at[y_c].add(f.label[:, None] * rh - _rounded(f.label, hidden.dtype)[:, None] * _rounded(rh, hidden.dtype))
        if f.k is not None:
            d_hidden = d_hidden - f.k[:, None] * weight_sum[None, :]
            smoothing = smoothing + jnp.sum(f.k[:, None] * h32, axis=0)
        return (d_weight_t, smoothing), (f.per_token, d_hidden.astype(hidden.dtype))

    init = None if token_g is None else (jnp.zeros((weight.shape[1], d), jnp.float32), jnp.zeros((d,), jnp.float32))
    carry, per_token, d_hidden = over_token_chunks(step, init, hidden, labels, loss, chunk, token_g)
    if carry is None:
        return TokenPass(per_token, None, None)
    d_weight_t, smoothing = carry
    return TokenPass(per_token, d_hidden, (d_weight_t - smoothing[None, :]).T)
