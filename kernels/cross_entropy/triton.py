"""The ``"pallas"`` implementation of :func:`ejlabel.kernels.cross_entropy.softmax_cross_entropy`:
two kernels on Pallas's Triton backend.

Each forward program takes ``block_tokens`` rows and walks the vocabulary in chunks of
``chunk_vocab`` columns with an online log-sum-exp (running max and rescaled sum), picking the
label's logit on the way; a row's logits are read once and the float32 softmax never exists in
memory. The forward keeps each token's log-sum-exp (``[tokens]`` floats) for the backward, a
second kernel that writes ``(softmax - onehot) * cotangent`` tile by tile: two reads of the
logits and one write in all, as XLA's program (slower than XLA while the backward recomputed
the log-sum-exp, a third read; ``bench/bench_kernels.py``, cross-entropy, times both against
each other, figures in ``bench/RESULTS.md``). The vocabulary is padded to whole chunks and the
padding masked out of the log-sum-exp. With ``ignore_index`` set the kernels ignore labels
outside the vocabulary (loss 0, no gradient); without, such a label picks no logit (loss: the
log-sum-exp, gradient: the softmax's), as the XLA path's gather reads it, and the caller makes
the loss NaN.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jaxtyping import Array, Float, Int

from ..pallas_common import MASK_VALUE, compiler_params, fast_exp, interpret_mode, pad_to
from .labels import ignored

__all__ = ["cross_entropy_triton", "cross_entropy_triton_backward"]


def _pallas_labels(labels: Int[Array, "tokens"], ignore_index: int | None) -> Int[Array, "tokens"]:
    """The Pallas kernels ignore labels outside ``[0, vocab)``: map ``ignore_index`` there."""
    return labels if ignore_index is None or ignore_index < 0 else jnp.where(labels == ignore_index, -1, labels)


def _forward_kernel(logits_ref: Any, labels_ref: Any, loss_ref: Any, lse_ref: Any, *, vocab: int, chunk: int, masked: bool) -> None:
    labels = labels_ref[...]
    rows = labels.shape[0]

    def step(j: jax.Array, carry: tuple[jax.Array, ...]) -> tuple[jax.Array, ...]:
        running_max, running_sum, picked = carry
        start = pl.multiple_of(j * chunk, chunk)
        cols = start + jnp.arange(chunk)[None, :]
        x = jnp.where(cols < vocab, logits_ref[:, pl.ds(start, chunk)].astype(jnp.float32), MASK_VALUE)
        new_max = jnp.maximum(running_max, jnp.max(x, axis=1))
        # Rescale the sum so far to the new maximum, so exp never overflows.
        running_sum = running_sum * fast_exp(running_max - new_max) + jnp.sum(fast_exp(x - new_max[:, None]), axis=1)
        picked = picked + jnp.sum(jnp.where(cols == labels[:, None], x, 0.0), axis=1)
        return new_max, running_sum, picked

    init = (jnp.full((rows,), MASK_VALUE, jnp.float32), jnp.zeros((rows,), jnp.float32), jnp.zeros((rows,), jnp.float32))
    running_max, running_sum, picked = lax.fori_loop(0, logits_ref.shape[1] // chunk, step, init)
    lse = running_max + jnp.log(running_sum)
    lse_ref[...] = lse
    # Unmasked (no ignore_index), a label outside the vocabulary picks nothing: the loss is the
    # log-sum-exp, which the caller turns into NaN as the XLA path's gather gives it.
    loss_ref[...] = jnp.where(ignored(labels, vocab), 0.0, lse - picked) if masked else lse - picked


def _backward_kernel(
    logits_ref: Any, labels_ref: Any, lse_ref: Any, g_ref: Any, dlogits_ref: Any, *, vocab: int, chunk: int, masked: bool
) -> None:
    labels = labels_ref[...]
    cols = pl.program_id(1) * chunk + jnp.arange(chunk)[None, :]
    probs = fast_exp(logits_ref[...].astype(jnp.float32) - lse_ref[...][:, None])
    scale = jnp.where(ignored(labels, vocab), 0.0, g_ref[...]) if masked else g_ref[...]
    dlogits_ref[...] = ((probs - (cols == labels[:, None])) * scale[:, None]).astype(dlogits_ref.dtype)


def _padded(logits: Float[Array, "tokens vocab"], labels: Int[Array, "tokens"], block_tokens: int, chunk_vocab: int) -> tuple[jax.Array, jax.Array]:
    # Padded rows carry an ignored label, so they have no loss and no gradient.
    return pad_to(pad_to(logits, 0, block_tokens), 1, chunk_vocab), pad_to(labels, 0, block_tokens, value=-1)


def cross_entropy_triton(
    logits: Float[Array, "tokens vocab"], labels: Int[Array, "tokens"], ignore_index: int | None, *,
    block_tokens: int, chunk_vocab: int, num_warps: int,
) -> tuple[Float[Array, "tokens"], Float[Array, "tokens"]]:
    """``(loss, logsumexp)`` per token, float32."""
    labels = _pallas_labels(labels, ignore_index)
    tokens, vocab = logits.shape
    logits_p, labels_p = _padded(logits, labels, block_tokens, chunk_vocab)
    rows = pl.BlockSpec((block_tokens,), lambda i: (i,))
    per_token = jax.ShapeDtypeStruct(labels_p.shape, jnp.float32)
    loss, lse = pl.pallas_call(
        functools.partial(_forward_kernel, vocab=vocab, chunk=chunk_vocab, masked=ignore_index is not None),
        grid=(labels_p.shape[0] // block_tokens,),
        in_specs=[pl.BlockSpec((block_tokens, logits_p.shape[1]), lambda i: (i, 0)), rows],
        out_specs=[rows, rows],
        out_shape=[per_token, per_token],
        compiler_params=compiler_params(num_warps, num_stages=2),
        interpret=interpret_mode(),
        name="cross_entropy",
    )(logits_p, labels_p)
    return loss[:tokens], lse[:tokens]


def cross_entropy_triton_backward(
    logits: Float[Array, "tokens vocab"], labels: Int[Array, "tokens"], ignore_index: int | None, lse: Float[Array, "tokens"],
    g: Float[Array, "tokens"], *, block_tokens: int, chunk_vocab: int, num_warps: int,
) -> Float[Array, "tokens vocab"]:
    """``d logits`` of ``sum(g * loss)``, in the dtype of ``logits``, from the forward's
    log-sum-exp."""
    labels = _pallas_labels(labels, ignore_index)
    tokens, vocab = logits.shape
    logits_p, labels_p = _padded(logits, labels, block_tokens, chunk_vocab)
    lse_p, g_p = (pad_to(t.astype(jnp.float32), 0, block_tokens) for t in (lse, g))
    rows = pl.BlockSpec((block_tokens,), lambda i, j: (i,))
    tile = pl.BlockSpec((block_tokens, chunk_vocab), lambda i, j: (i, j))
    dlogits = pl.pallas_call(
        functools.partial(_backward_kernel, vocab=vocab, chunk=chunk_vocab, masked=ignore_index is not None),
        grid=(logits_p.shape[0] // block_tokens, logits_p.shape[1] // chunk_vocab),
        in_specs=[tile, rows, rows, rows],
        out_specs=tile,
        out_shape=jax.ShapeDtypeStruct(logits_p.shape, logits.dtype),
        compiler_params=compiler_params(num_warps, num_stages=2),
        interpret=interpret_mode(),
        name="cross_entropy_bwd",
    )(logits_p, labels_p, lse_p, g_p)
    return dlogits[:tokens, :vocab]
