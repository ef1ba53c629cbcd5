"""What a query sees: the masks every attention implementation shares.

Positions are counted from 0 in queries and keys alike. A query sees the keys within its
bounds (:func:`window_bounds`: ``causal`` and ``sliding_window=(left, right)`` as one pair,
None for unbounded) and, with segment ids, only keys of its own segment; ids ``<= 0`` are
padding, which sees nothing. ``cu_seqlens`` of a packed batch become segment ids
(:func:`cu_seqlens_to_segment_ids`), so causal masks and windows act within each sequence.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jaxtyping import Array, Int

__all__ = ["Window", "cu_seqlens_to_segment_ids", "visibility_mask", "window_bounds"]

Window = tuple[int | None, int | None]
"""``(left, right)``: how far left and right of itself a query sees (None: unbounded)."""


def cu_seqlens_to_segment_ids(cu_seqlens: Int[Array, "n+1"], total: int) -> Int[Array, "1 total"]:
    """Segment ids ``[1, total]`` of a packed batch: ``s + 1`` for tokens of sequence ``s``, 0 past the end."""
    positions = jnp.arange(total, dtype=jnp.int32)
    # Unrolled: the default method is a device loop, which syncs with the host per step on a GPU.
    ids = jnp.searchsorted(cu_seqlens[1:].astype(jnp.int32), positions, side="right", method="scan_unrolled").astype(jnp.int32) + 1
    return jnp.where(positions < cu_seqlens[-1], ids, 0)[None, :]


def window_bounds(causal: bool, window: Window | None) -> Window:
    """How far left and right of itself a query sees (None: unbounded)."""
    left, right = window if window is not None else (None, None)
    if causal:
        right = 0 if right is None else min(right, 0)
    return left, right


def visibility_mask(
    q_pos: Int[Array, "bq"], k_pos: Int[Array, "bk"], q_seg: Int[Array, "bq"] | None, k_seg: Int[Array, "bk"] | None,
    *, bounds: Window, kv_len: int | None,
) -> jax.Array | None:
    """``[bq, bk]`` visibility of keys to queries, or None when every key is visible."""
    left, right = bounds
    conditions = []
    if kv_len is not None:
        conditions.append(k_pos[None, :] < kv_len)
    if right is not None:
        conditions.append(k_pos[None, :] <= q_pos[:, None] + right)
    if left is not None:
        conditions.append(k_pos[None, :] >= q_pos[:, None] - left)
    if q_seg is not None:
        conditions.append((q_seg[:, None] == k_seg[None, :]) & (q_seg[:, None] > 0))
    return functools.reduce(jnp.logical_and, conditions) if conditions else None

