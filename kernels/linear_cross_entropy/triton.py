"""The ``"chunked_tokens_triton"`` implementation of
:func:`ejlabel.kernels.linear_cross_entropy.linear_cross_entropy`: the token chunks of
:mod:`.xla_chunked_tokens`, each chunk's logits read once by a kernel on Pallas's Triton
backend (:func:`softmax_rows`) that writes the gradient over them (:func:`triton_tokens_pass`).

One pass over a chunk's logits: each token's loss and the gradient with respect to them.
The token-chunked linear cross-entropy multiplies a
chunk of hidden states by the whole unembedding, ``z = h W`` (``[chunk, vocab]`` in the input
dtype, the library's product), and needs from ``z`` each token's loss and the ``[chunk,
vocab]`` gradient its two products read. Written in XLA that is two passes over ``z``
(the row max; then the exponentials, their sums and the dense write), a second buffer beside
``z`` and a scatter for the label's column. Here a program takes one row: a first walk over
its blocks keeps the online max, the sums of exponentials (all, and off the label) and the
sum of logits (the label's logit is one load); a second walk (the row's 64 KB were just
read, so from the L2 cache) writes the gradient over ``z``: the output aliases ``z``'s
buffer, one ``[chunk, vocab]`` array in all: faster than the XLA passes it replaces, and half
their memory (``bench/bench_linear_cross_entropy.py``, the rows kernel's rows against the token
chunks'; figures in ``bench/RESULTS.md``).

Per token, with capped logits ``c = cap(z)`` (``cap * tanh(z / cap)`` or ``z``), the cap's
derivative ``cg = 1 - (c / cap)^2``, ``p = softmax(c)``, label ``y``, smoothing ``eps`` and
the cotangent ``g`` of the token's loss::

    loss  = lse(c) - c_y + eps * (c_y - mean(c))
    dense = g cg * (p - eps / vocab)                           off the label
    dense = g cg_y * (eps p_y - (1 - eps) q_y - eps / vocab)   at the label, q_y = sum_{j != y} p_j

``dense`` is the gradient of ``sum(g * loss)`` with respect to ``z``, rounded once to ``z``'s
dtype, as the plain program rounds its own: the products take it as they are (``d_hidden =
dense W^T``, ``d_weight = h^T dense``), nothing scales their rows or corrects their label
rows. The label's entry is written from ``q_y``, the sum off the label, not as ``p_y - 1``:
for a confident prediction that difference cancels before its rounding (see
``test_confident_predictions_keep_their_gradient``).

Written for Pallas's Triton backend, although that backend is deprecated: a row is one
token's logits (32000 here), reduced whole, which Triton's blocks express directly. Pallas
Mosaic GPU's register layouts are built for warpgroup tiles (64-row ``wgmma`` fragments, or
strided vectors whose reductions across warps go through shared memory), and its copies want
boxes of at most 256 elements a side, rows 16-byte aligned: a row would need a ``[125, 256]``
view padded to 128 rows and a reduction across warps written by hand, and a vocabulary that
is not a multiple of 8 could not be copied at all. The kernel is bound by its arithmetic per
element (it ran as fast on an H200, with 1.4x the H100's memory bandwidth; ``exp2`` for
``exp`` and one load for the label's logit made it faster), never by the tensor cores Mosaic
GPU exists to reach.
"""

from __future__ import annotations

import functools
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton
from jaxtyping import Array, Float, Int

from ..pallas_common import MASK_VALUE, compiler_params, fast_exp, interpret_mode, next_power_of_2
from .loss import Loss, TokenPass, over_token_chunks

__all__ = ["RowPass", "softmax_rows", "triton_tokens_pass"]


class RowPass(NamedTuple):
    """What :func:`softmax_rows` gives: the gradient over ``z``'s buffer and each token's loss."""

    dense: Float[Array, "tokens vocab"]  # the gradient, in z's dtype, over z's buffer
    per_token: Float[Array, "tokens"]  # float32


def _row_kernel(
    z_ref: Any, labels_ref: Any, token_g_ref: Any, dense_ref: Any, per_token_ref: Any, *, vocab: int, block: int, loss: Loss,
) -> None:
    """One program's row of ``z`` (a ``[1, width]`` block), walked twice in blocks of ``block``
    columns."""
    label = labels_ref[0, 0]
    steps = pl.cdiv(vocab, block)
    eps = loss.label_smoothing

    def capped(j: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
        """Block ``j`` of the row: capped float32 logits, the real columns, the label's column."""
        cols = j * block + jnp.arange(block)[None, :]
        real = cols < vocab
        raw = pltriton.load(z_ref.at[:, pl.ds(j * block, block)], mask=real, other=0.0).astype(jnp.float32)
        return loss.cap(raw), real, cols == label

    def stats(j: jax.Array, carry: tuple[jax.Array, ...]) -> tuple[jax.Array, ...]:
        """Online over the blocks: the max, and rescaled to it the sum of exponentials and
        their sum off the label; the sum of logits."""
        m, s, others, total = carry
        c, real, is_label = capped(j)
        new_m = jnp.maximum(m, jnp.max(jnp.where(real, c, MASK_VALUE), axis=1, keepdims=True))
        e = jnp.where(real, fast_exp(c - new_m), 0.0)
        rescale = fast_exp(m - new_m)
        return (
            new_m, s * rescale + jnp.sum(e, axis=1, keepdims=True),
            others * rescale + jnp.sum(jnp.where(is_label, 0.0, e), axis=1, keepdims=True),
            (total + jnp.sum(jnp.where(real, c, 0.0), axis=1, keepdims=True)) if eps else total,
        )

    zero = jnp.zeros((1, 1), jnp.float32)
    m, s, others, total = lax.fori_loop(0, steps, stats, (jnp.full((1, 1), MASK_VALUE, jnp.float32), zero, zero, zero))
    # One load, not a reduction per block; a label outside the vocabulary (traced, unchecked)
    # reads inside the row and gives NaN, as the XLA path's gather: no column is its own.
    in_range = (label >= 0) & (label < vocab)
    c_y = loss.cap(pltriton.load(z_ref.at[:, pl.ds(jnp.clip(label, 0, vocab - 1), 1)]).astype(jnp.float32))
    c_y = jnp.where(in_range, c_y, jnp.nan)
    lse = m + jnp.log(s)
    uniform = eps / vocab
    q_y = others / s  # the probability off the label
    g = token_g_ref[...]
    at_label = g * loss.cap_grad(c_y) * (eps * (1.0 - q_y) - (1.0 - eps) * q_y - uniform)

    def write(j: jax.Array, carry: None) -> None:
        c, real, is_label = capped(j)  # a second read of the row, from L2: the block was just read
        dense = jnp.where(is_label, at_label, g * loss.cap_grad(c) * (fast_exp(c - lse) - uniform))
        pltriton.store(dense_ref.at[:, pl.ds(j * block, block)], dense.astype(dense_ref.dtype), mask=real)

    lax.fori_loop(0, steps, write, None)
    per_token_ref[...] = loss.per_token(lse, c_y, lambda: total / vocab)


def softmax_rows(
    z: Float[Array, "tokens vocab"], labels: Int[Array, "tokens"], token_g: Float[Array, "tokens"], loss: Loss, *,
    block: int = 8192, num_warps: int = 4,
) -> RowPass:
    """Each row's loss, and the gradient of ``sum(token_g * loss)``, from raw logits ``z`` (see
    the module docstring), with ``loss``'s smoothing, cap and per-token formula.

    ``labels`` should lie in ``[0, vocab)`` (the caller maps ignored tokens to a real class and
    gives them a zero ``token_g``); one outside gives that row a NaN loss and the gradient of its
    log-sum-exp alone, as the XLA path does, and is never read out of bounds. ``z``'s buffer becomes the result's where nothing else holds
    it. A program per row (more rows per program ran slower), ``block`` columns per step,
    ``num_warps``: the defaults ran fastest on the H100.
    """
    tokens, vocab = z.shape
    if labels.shape != (tokens,) or token_g.shape != (tokens,):
        raise ValueError(f"labels, token_g: expected [{tokens}] each, got {labels.shape} and {token_g.shape}")
    block = min(block, next_power_of_2(vocab))
    width = pl.cdiv(vocab, block) * block
    row = pl.BlockSpec((1, width), lambda i: (i, 0))
    one = pl.BlockSpec((1, 1), lambda i: (i, 0))
    kernel = functools.partial(_row_kernel, vocab=vocab, block=block, loss=loss)
    dense, per_token = pl.pallas_call(
        kernel,
        grid=(tokens,),
        in_specs=[row, one, one],
        out_specs=[row, one],
        out_shape=[jax.ShapeDtypeStruct(z.shape, z.dtype), jax.ShapeDtypeStruct((tokens, 1), jnp.float32)],
        input_output_aliases={0: 0},
        interpret=interpret_mode(),
        compiler_params=compiler_params(num_warps, num_stages=1),
        name="softmax_rows",
    )(z, labels.astype(jnp.int32)[:, None], token_g.astype(jnp.float32)[:, None])
    return RowPass(dense, per_token[:, 0])


def triton_tokens_pass(
    hidden: jax.Array, weight: jax.Array, labels: jax.Array, loss: Loss, chunk: int, token_g: jax.Array,
) -> TokenPass:
    """:func:`.xla_chunked_tokens.tokens_pass` with each chunk's logits read once by :func:`softmax_rows`, which
    writes over them the gradient itself, ``token_g`` and the smoothing inside, rounded once as
    the plain program's: the two products are the plain program's own, ``d_hidden = dense @
    w^T`` and ``d_weight += h^T @ dense`` (float32 across chunks), with nothing around them."""

    def step(d_weight: jax.Array, xs: tuple[jax.Array, ...]) -> tuple[jax.Array, tuple[jax.Array, ...]]:
        h_c, y_c, g_c = xs
        rows = softmax_rows(h_c @ weight, y_c, g_c, loss)
        d_weight = d_weight + jnp.dot(h_c.T, rows.dense, preferred_element_type=jnp.float32)
        return d_weight, (rows.per_token, rows.dense @ weight.T)

    d_weight, per_token, d_hidden = over_token_chunks(step, jnp.zeros(weight.shape, jnp.float32), hidden, labels, loss, chunk, token_g)
    return TokenPass(per_token, d_hidden, d_weight)
