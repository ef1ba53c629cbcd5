"""The ejkernel compatibility helpers: sequence bookkeeping and small numerics that ejkernel's
``ops`` package gives its users, with the same names and meanings, so that porting code to
``ejlabel.kernels`` is a change of import (``ejlabel.kernels.prepare_lens``, ...).

No kernel here uses them; the attention op takes ``segment_ids`` or ``cu_seqlens`` itself
(:mod:`ejlabel.kernels.attention.masks`). They are for the code around the kernels.

Packed (variable-length) batches are described three interchangeable ways:

- ``cu_seqlens``: cumulative lengths ``[0, l0, l0 + l1, ...]``, shape ``[n + 1]``;
- a validity mask ``[batch, seq]`` (True for real tokens);
- segment ids ``[batch, seq]``: tokens attend only within the same positive id, and ids
  ``<= 0`` mark padding.

This module converts between them, recovers segment ids from a dense attention mask, and holds
the few numerically careful helpers (log-sum-exp, division by zero, chunking an axis).
Everything here is traceable: no function branches in Python on array values, so all of it
runs under :func:`jax.jit` and :func:`jax.vmap`. Shape checks happen at trace time and raise
:class:`ValueError` naming the argument.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, ArrayLike, Bool, Float, Int, Shaped

__all__ = [
    "chunk_array",
    "identity_dtype_convert",
    "log_sum_exp",
    "mask_to_segment_ids",
    "prepare_cu_seqlens_from_mask",
    "prepare_lens",
    "prepare_lens_from_mask",
    "safe_divide",
    "segment_ids_to_mask",
    "unchunk_array",
]

# Row comparison below multiplies 0/1 matrices in bfloat16 with float32 accumulation: exact
# while a row has fewer than 2**24 ones, and fast on every backend. Longer rows fall back to
# int32, which is exact but not tensor-core friendly.
_EXACT_F32_COUNT = 2**24


def _check_ndim(name: str, x: Any, allowed: Sequence[int]) -> None:
    ndim = np.ndim(x)
    if ndim not in allowed:
        if len(allowed) == 1:
            expected = f"{allowed[0]}-D"
        else:
            expected = ", ".join(f"{d}-D" for d in allowed[:-1]) + f" or {allowed[-1]}-D"
        raise ValueError(f"{name} must be {expected}, got shape {tuple(np.shape(x))}")


# --------------------------------------------------------------------------------------------
# Lengths and cumulative lengths


def prepare_lens(cu_seqlens: Int[ArrayLike, "n+1"]) -> Int[Array, "n"]:
    """Per-sequence lengths ``cu_seqlens[1:] - cu_seqlens[:-1]`` of a packed batch.

    Args:
        cu_seqlens: ``[n + 1]`` cumulative lengths starting at 0.

    Returns:
        ``[n]`` lengths, same dtype as ``cu_seqlens``.
    """
    _check_ndim("cu_seqlens", cu_seqlens, (1,))
    cu_seqlens = jnp.asarray(cu_seqlens)
    if cu_seqlens.shape[0] < 1:
        raise ValueError("cu_seqlens must have at least one entry (the leading 0), got shape (0,)")
    return cu_seqlens[1:] - cu_seqlens[:-1]


def prepare_lens_from_mask(mask: Bool[ArrayLike, "batch seq"]) -> Int[Array, "batch"]:
    """Number of valid tokens per row of a ``[batch, seq]`` validity mask, as int32.

    Non-boolean masks count their nonzero entries.
    """
    _check_ndim("mask", mask, (2,))
    return jnp.sum(jnp.asarray(mask).astype(jnp.bool_), axis=-1, dtype=jnp.int32)


def prepare_cu_seqlens_from_mask(
    mask: Bool[ArrayLike, "batch seq"], out_dtype: Any = jnp.int32
) -> Int[Array, "batch+1"]:
    """Cumulative lengths ``[0, l0, l0 + l1, ...]`` of a ``[batch, seq]`` validity mask.

    This is the ``cu_seqlens`` of the packed batch obtained by dropping the masked tokens.

    Returns:
        ``[batch + 1]`` array of ``out_dtype``.
    """
    lens = prepare_lens_from_mask(mask)
    cu = jnp.cumsum(lens, dtype=out_dtype)
    return jnp.concatenate([jnp.zeros((1,), dtype=out_dtype), cu])


# --------------------------------------------------------------------------------------------
# Segment ids and attention masks


def segment_ids_to_mask(
    segment_ids: Int[ArrayLike, "batch seq"]
    | tuple[Int[ArrayLike, "batch q"], Int[ArrayLike, "batch k"]],
    dtype: Any = jnp.bool_,
    return_separate_masks: bool = False,
) -> (
    Shaped[Array, "batch q k"]
    | tuple[Shaped[Array, "batch q"], Shaped[Array, "batch k"], Shaped[Array, "batch q k"]]
):
    """Dense attention mask from segment ids: query ``i`` sees key ``j`` iff their ids match.

    Ids ``<= 0`` are padding and attend to nothing, so a padded query row is all False (it is
    *not* matched with padded keys of the same id).

    Args:
        segment_ids: ``[batch, seq]`` ids for self-attention, or a tuple
            ``(q_segment_ids [batch, q], kv_segment_ids [batch, k])``.
        dtype: dtype of the returned masks.
        return_separate_masks: also return the per-token validity masks.

    Returns:
        ``[batch, q, k]`` attention mask, or ``(q_mask [batch, q], kv_mask [batch, k],
        attention_mask [batch, q, k])`` when ``return_separate_masks``.
    """
    if isinstance(segment_ids, tuple):
        if len(segment_ids) != 2:
            raise ValueError(
                "segment_ids must be an array or a (q_segment_ids, kv_segment_ids) pair, "
                f"got a tuple of length {len(segment_ids)}"
            )
        q_ids, kv_ids = segment_ids
        _check_ndim("q_segment_ids", q_ids, (2,))
        _check_ndim("kv_segment_ids", kv_ids, (2,))
        q_ids, kv_ids = jnp.asarray(q_ids), jnp.asarray(kv_ids)
        if q_ids.shape[0] != kv_ids.shape[0]:
            raise ValueError(
                "q_segment_ids and kv_segment_ids must have the same batch size, got shapes "
                f"{q_ids.shape} and {kv_ids.shape}"
            )
    else:
        _check_ndim("segment_ids", segment_ids, (2,))
        q_ids = kv_ids = jnp.asarray(segment_ids)

    q_valid = q_ids > 0
    kv_valid = kv_ids > 0
    attention = (
        (q_ids[:, :, None] == kv_ids[:, None, :]) & q_valid[:, :, None] & kv_valid[:, None, :]
    )
    attention = attention.astype(dtype)
    if return_separate_masks:
        return q_valid.astype(dtype), kv_valid.astype(dtype), attention
    return attention


def _first_appearance_ids(m: Bool[Array, "r c"]) -> Int[Array, "r"]:
    """Group identical rows of ``m``: ids 1, 2, ... in order of first appearance, -1 if empty.

    Two 0/1 rows are equal iff their Hamming distance ``|a| + |b| - 2 a.b`` is zero, so all
    pairwise comparisons come from one ``[r, r]`` matrix product instead of an ``[r, r, c]``
    boolean tensor.
    """
    rows, cols = m.shape
    if cols < _EXACT_F32_COUNT:
        mf = m.astype(jnp.bfloat16)
        acc = jnp.float32
    else:
        mf = m.astype(jnp.int32)
        acc = jnp.int32
    dots = jnp.matmul(mf, mf.T, preferred_element_type=acc)
    counts = jnp.sum(m, axis=-1, dtype=acc)
    same = (counts[:, None] + counts[None, :] - 2 * dots) == 0  # [r, r]

    # argmax returns the first True: the index of the earliest identical row.
    first = jnp.argmax(same, axis=-1).astype(jnp.int32)
    nonempty = counts > 0
    is_new_group = (first == jnp.arange(rows, dtype=jnp.int32)) & nonempty
    group_of_row = jnp.cumsum(is_new_group, dtype=jnp.int32)
    return jnp.where(nonempty, group_of_row[first], -1)


def _mask_to_segment_ids_2d(m: Bool[Array, "q k"]) -> tuple[Int[Array, "q"], Int[Array, "k"]]:
    return _first_appearance_ids(m), _first_appearance_ids(m.T)


def mask_to_segment_ids(
    mask: Bool[ArrayLike, "*batch q k"], per_head: bool = False
) -> tuple[Int[Array, "*batch q"], Int[Array, "*batch k"]]:
    """Recover query and key segment ids from a dense attention mask.

    Queries whose mask rows are identical get the same id, and so do keys whose mask columns
    are identical. Ids are int32, contiguous from 1 in order of first appearance along the
    sequence, and -1 marks a query (key) that attends to (is attended by) nothing. For a
    block-diagonal mask built by :func:`segment_ids_to_mask` the recovered ids induce the same
    mask again, provided the segments appear in the same order along queries and keys (always
    true for self-attention; the two sides are numbered independently). For other masks
    (causal, sliding window) every distinct row is its own segment, so the ids describe the
    mask's structure but do not reproduce it.

    Cost is one ``[q, q]`` and one ``[k, k]`` matrix product per mask, and the whole function
    is traceable (no data-dependent Python control flow).

    Args:
        mask: ``[q, k]``, ``[batch, q, k]`` or ``[batch, heads, q, k]``; nonzero means attend.
        per_head: for a 4-D mask, compute ids per head. When False a 4-D mask is taken to be
            the same for all heads and only head 0 is read (heads are commonly broadcast);
            pass ``per_head=True`` if heads differ.

    Returns:
        ``(q_segment_ids, kv_segment_ids)`` with shapes ``([q], [k])``, ``([batch, q],
        [batch, k])``, or for 4-D masks ``([batch, q], [batch, k])`` and with
        ``per_head=True`` ``([batch, heads, q], [batch, heads, k])``.
    """
    _check_ndim("mask", mask, (2, 3, 4))
    m = jnp.asarray(mask).astype(jnp.bool_)
    if m.ndim == 4:
        if per_head:
            return jax.vmap(jax.vmap(_mask_to_segment_ids_2d))(m)
        m = m[:, 0]
    if m.ndim == 3:
        return jax.vmap(_mask_to_segment_ids_2d)(m)
    return _mask_to_segment_ids_2d(m)


# --------------------------------------------------------------------------------------------
# Gradients and reshapes


def identity_dtype_convert(dtype: Any) -> Callable[[Any], Any]:
    """An identity function whose backward pass casts the cotangent to ``dtype``.

    Mixed-precision kernels take inputs in a low precision but may produce gradients in
    another; wrapping an input with this makes the gradient that flows back to it come out in
    ``dtype`` (e.g. the dtype of the original parameter) without changing the forward values.
    Works on arrays and pytrees of arrays.

    Returns:
        ``f`` with ``f(x) is x`` in value and ``grad`` of anything through ``f`` cast to
        ``dtype``.
    """

    @jax.custom_vjp
    def identity(x: Any) -> Any:
        return x

    def identity_fwd(x: Any) -> tuple[Any, None]:
        return x, None

    def identity_bwd(_: None, g: Any) -> tuple[Any]:
        return (jax.tree_util.tree_map(lambda t: t.astype(dtype), g),)

    identity.defvjp(identity_fwd, identity_bwd)
    return identity


def _normalize_axis(name: str, axis: int, ndim: int) -> int:
    if not -ndim <= axis < ndim:
        raise ValueError(f"{name}={axis} is out of range for an array with {ndim} dimensions")
    return axis % ndim


def chunk_array(
    x: Shaped[ArrayLike, "..."], chunk_size: int, axis: int = 1
) -> Shaped[Array, "..."]:
    """Split ``axis`` of length ``n`` into two axes ``[n // chunk_size, chunk_size]``.

    Shape ``[*pre, n, *post]`` becomes ``[*pre, n // chunk_size, chunk_size, *post]``.

    No padding is added: ``n`` must be a multiple of ``chunk_size``, because silently padded
    positions would then need masking that the caller might forget.

    Args:
        x: array with at least one axis.
        chunk_size: positive length of each chunk.
        axis: the axis to split (negative counts from the end).

    Returns:
        ``x`` reshaped to ``x.shape[:axis] + (n // chunk_size, chunk_size) + x.shape[axis+1:]``.
    """
    x = jnp.asarray(x)
    if x.ndim == 0:
        raise ValueError("x must have at least one dimension, got shape ()")
    if isinstance(chunk_size, bool) or not isinstance(chunk_size, (int, np.integer)):
        raise ValueError(f"chunk_size must be a positive int, got {chunk_size!r}")
    if chunk_size <= 0:
        raise ValueError(f"chunk_size must be a positive int, got {chunk_size}")
    ax = _normalize_axis("axis", axis, x.ndim)
    n = x.shape[ax]
    if n % chunk_size:
        raise ValueError(
            f"axis {axis} has length {n}, which is not divisible by chunk_size={chunk_size}"
        )
    return x.reshape(x.shape[:ax] + (n // chunk_size, int(chunk_size)) + x.shape[ax + 1 :])


def unchunk_array(x: Shaped[ArrayLike, "..."], axis: int = 1) -> Shaped[Array, "..."]:
    """Inverse of :func:`chunk_array`: merge axes ``axis`` and ``axis + 1``.

    Shape ``[*pre, num_chunks, chunk_size, *post]`` becomes ``[*pre, n, *post]``.

    ``axis`` names the axis as :func:`chunk_array` saw it, so a negative ``axis`` counts from
    the end of the *unchunked* shape and ``unchunk_array(chunk_array(x, c, a), a)`` is ``x`` for
    every valid ``a``.
    """
    x = jnp.asarray(x)
    if x.ndim < 2:
        raise ValueError(f"x must have at least two dimensions, got shape {x.shape}")
    ax = _normalize_axis("axis", axis, x.ndim - 1)
    merged = x.shape[ax] * x.shape[ax + 1]
    return x.reshape(x.shape[:ax] + (merged,) + x.shape[ax + 2 :])


# --------------------------------------------------------------------------------------------
# Numerics


def log_sum_exp(
    x: Float[ArrayLike, "..."],
    axis: int | tuple[int, ...] | None = -1,
    keepdims: bool = False,
) -> Float[Array, "..."]:
    """``log(sum(exp(x), axis))`` without overflow, and -inf (not NaN) for all -inf slices.

    Fully masked rows are routine in attention (a padded query sees no key), so an all -inf
    slice returns -inf with a zero gradient instead of NaN. Integer inputs are promoted to the
    default float dtype.

    Args:
        x: input array.
        axis: axis or axes to reduce; None reduces everything.
        keepdims: keep reduced axes with length 1.
    """
    x = jnp.asarray(x)
    if not jnp.issubdtype(x.dtype, jnp.inexact):
        x = x.astype(jnp.result_type(float))
    # The max is only a shift for stability; its gradient contribution cancels exactly.
    shift = jax.lax.stop_gradient(jnp.max(x, axis=axis, keepdims=True))
    shift = jnp.where(jnp.isfinite(shift), shift, jnp.zeros_like(shift))
    total = jnp.sum(jnp.exp(x - shift), axis=axis, keepdims=True)
    # Double where: log never sees 0, so the backward pass has no 0 * inf. Testing == 0
    # rather than > 0 lets NaN inputs propagate as NaN.
    empty = total == 0
    out = jnp.where(
        empty,
        jnp.full_like(total, -jnp.inf),
        jnp.log(jnp.where(empty, jnp.ones_like(total), total)) + shift,
    )
    if not keepdims:
        out = jnp.squeeze(out, axis=axis)
    return out


def safe_divide(
    a: Float[ArrayLike, "..."], b: Float[ArrayLike, "..."], eps: float = 0.0
) -> Float[Array, "..."]:
    """``a / b`` with 0 wherever ``|b| <= eps``, and finite gradients there too.

    Used to normalise by counts or softmax denominators that can be zero for fully padded
    rows. The denominator is replaced before dividing (double-where), so neither the value nor
    the gradient with respect to ``a`` or ``b`` is ever NaN or inf at those positions.

    Args:
        a: numerator; broadcasts against ``b``.
        b: denominator.
        eps: non-negative threshold below which ``|b|`` counts as zero.
    """
    if not eps >= 0:
        raise ValueError(f"eps must be a non-negative number, got {eps!r}")
    a, b = jnp.asarray(a), jnp.asarray(b)
    is_zero = jnp.abs(b) <= eps
    safe_b = jnp.where(is_zero, jnp.ones_like(b), b)
    quotient = a / safe_b
    return jnp.where(is_zero, jnp.zeros_like(quotient), quotient)
