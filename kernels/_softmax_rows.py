"""One read of a chunk's logits: each token's loss and the dense factor of its gradient.

The token-chunked linear cross-entropy (:mod:`kernels.linear_cross_entropy`) multiplies a
chunk of hidden states by the whole unembedding, ``z = h W`` (``[chunk, vocab]`` in the input
dtype, the library's product), and needs from ``z`` each token's loss and the ``[chunk,
vocab]`` array its two gradient products read. Written in XLA that is two reads of ``z`` (the
row max, then the exponentials with their sums and the dense write), a second buffer beside
``z`` and a scatter for the label's column (bench/RESULTS.md, run 78: 1.2 ms of a 4.9 ms
loss). Here one program holds a whole row on chip (the vocabulary padded to a power of two
and masked), so ``z`` is read once and the gradient is written over it: the output aliases
``z``'s buffer, one ``[chunk, vocab]`` array in all.

Per token, with capped logits ``c = cap(z)`` (``cap * tanh(z / cap)`` or ``z``), the cap's
derivative ``cg = 1 - (c / cap)^2``, ``p = softmax(c)``, label ``y`` and smoothing ``eps``::

    loss  = lse(c) - c_y + eps * (c_y - mean(c))
    dense = cg * (p - eps / vocab)                        off the label
    dense = cg_y * (eps p_y - (1 - eps) q_y - eps / vocab)   at the label, q_y = sum_{j != y} p_j

so the gradient of ``g * loss`` with respect to ``z`` is ``g * dense``: the products scale
rows by the cotangent and nothing else. The label's entry is written from ``q_y``, the sum off
the label, not as ``p_y - 1``: for a confident prediction that difference cancels before its
rounding (see ``test_confident_predictions_keep_their_gradient``). Its float32 value is
returned too, for the float32 correction of ``d_weight``'s label rows.

Written for Pallas's Triton backend, although that backend is deprecated: the row is one
token's 32000 logits, a one-dimensional block reduced whole, which Triton's block model holds
in registers across the program's warps. Pallas Mosaic GPU's register layouts are built for
warpgroup tiles (64-row ``wgmma`` fragments, or strided vectors whose cross-warp reductions
go through shared memory), and its copies want boxes of at most 256 elements a side in
multiples of 8 rows: the row would need a ``[125, 256]`` view padded to 128 rows and a
hand-written reduction across warps. The kernel is bound by memory, not by the tensor cores
that Mosaic GPU exists to reach, so nothing is lost by the choice but the backend's future.
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

from ._pallas import MASK_VALUE, compiler_params, interpret_mode, next_power_of_2

__all__ = ["RowPass", "softmax_rows"]


class RowPass(NamedTuple):
    dense: Float[Array, "tokens vocab"]  # in z's dtype, over z's buffer
    per_token: Float[Array, "tokens"]  # float32
    label: Float[Array, "tokens"]  # the label's entry of ``dense`` in float32, before rounding


def _row_kernel(
    z_ref: Any, labels_ref: Any, dense_ref: Any, per_token_ref: Any, label_ref: Any, *, vocab: int, block: int, eps: float,
    cap: float | None,
) -> None:
    label_col = labels_ref[0]
    steps = pl.cdiv(vocab, block)
    cap_grad = (lambda x: 1.0) if cap is None else (lambda x: 1.0 - jnp.square(x / cap))

    def capped(j: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
        """Block ``j`` of the row: capped float32 logits, its real columns, its label column."""
        cols = j * block + jnp.arange(block)
        real = cols < vocab
        raw = pltriton.load(z_ref.at[pl.ds(j * block, block)], mask=real, other=0.0).astype(jnp.float32)
        return (raw if cap is None else cap * jnp.tanh(raw / cap)), real, cols == label_col

    def stats(j: jax.Array, carry: tuple[jax.Array, ...]) -> tuple[jax.Array, ...]:
        m, s, total = carry
        c, real, _ = capped(j)
        new_m = jnp.maximum(m, jnp.max(jnp.where(real, c, MASK_VALUE)))
        s = s * jnp.exp(m - new_m) + jnp.sum(jnp.where(real, jnp.exp(c - new_m), 0.0))
        if eps:
            total = total + jnp.where(real, c, 0.0)
        return new_m, s, total

    zero = jnp.float32(0.0)
    m, s, total = lax.fori_loop(0, steps, stats, (jnp.float32(MASK_VALUE), zero, jnp.zeros((block,))))
    lse = m + jnp.log(s)
    raw_y = pltriton.load(z_ref.at[pl.ds(label_col, 1)]).astype(jnp.float32)[0]
    c_y = raw_y if cap is None else cap * jnp.tanh(raw_y / cap)
    uniform = eps / vocab

    def write(j: jax.Array, others: jax.Array) -> jax.Array:
        c, real, is_label = capped(j)  # a second read of the row, from L2: the block was just read
        p = jnp.exp(c - lse)
        # The mask is the columns' range only, so the stores stay vectorised; the label's entry
        # is written again below, once the sum off the label is known.
        pltriton.store(dense_ref.at[pl.ds(j * block, block)], (cap_grad(c) * (p - uniform)).astype(dense_ref.dtype), mask=real)
        return others + jnp.where(real & ~is_label, p, 0.0)

    # The probability off the label; its sum across the program's warps also orders every
    # thread's stores above before the one below (a barrier), so the label's entry is final.
    q_y = jnp.sum(lax.fori_loop(0, steps, write, jnp.zeros((block,))))
    label = cap_grad(c_y) * (eps * (1.0 - q_y) - (1.0 - eps) * q_y - uniform)
    pltriton.store(dense_ref.at[pl.ds(label_col, 1)], jnp.full((1,), label, dense_ref.dtype))
    per_token = lse - c_y
    if eps:
        per_token = per_token + eps * (c_y - jnp.sum(total) / vocab)
    per_token_ref[...] = jnp.full(per_token_ref.shape, per_token, jnp.float32)
    label_ref[...] = jnp.full(label_ref.shape, label, jnp.float32)


def softmax_rows(
    z: Float[Array, "tokens vocab"], labels: Int[Array, "tokens"], *, label_smoothing: float, logit_soft_cap: float | None,
    block: int = 8192, num_warps: int = 8,
) -> RowPass:
    """Each row's loss and gradient factor from raw logits ``z`` (see the module docstring).

    ``labels`` must lie in ``[0, vocab)`` (the caller maps ignored tokens to a real class and
    gives them a zero cotangent). ``z`` is donated to the result where the caller lets it go.
    """
    tokens, vocab = z.shape
    block = min(block, next_power_of_2(vocab))
    width = pl.cdiv(vocab, block) * block
    row = pl.BlockSpec((None, width), lambda i: (i, 0))
    one = pl.BlockSpec((None, 1), lambda i: (i, 0))
    kernel = functools.partial(_row_kernel, vocab=vocab, block=block, eps=float(label_smoothing), cap=logit_soft_cap)
    dense, per_token, label = pl.pallas_call(
        kernel,
        grid=(tokens,),
        in_specs=[row, one],
        out_specs=[row, one, one],
        out_shape=[
            jax.ShapeDtypeStruct(z.shape, z.dtype),
            jax.ShapeDtypeStruct((tokens, 1), jnp.float32),
            jax.ShapeDtypeStruct((tokens, 1), jnp.float32),
        ],
        input_output_aliases={0: 0},
        interpret=interpret_mode(),
        compiler_params=compiler_params(num_warps, num_stages=1),
        name="softmax_rows",
    )(z, labels.astype(jnp.int32)[:, None])
    return RowPass(dense, per_token[:, 0], label[:, 0])
