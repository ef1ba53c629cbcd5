"""Which key/value blocks a query block must visit under segment ids, computed before the kernel.

Flash-attention kernels tile queries into blocks of ``block_q`` rows and keys/values into blocks
of ``block_k`` rows. With packed documents (segment ids) most pairs of blocks belong to different
documents and every score between them is masked: a kernel that loads and computes them does
several times the visible work. This module turns the ids into small per-block tables that a
kernel reads with one scalar load per program, on any backend (pure ``jnp``, no Pallas):

- :func:`segment_block_ranges` gives each query block the half-open range ``[kv_lo, kv_hi)`` of
  key/value blocks that may hold a visible pair, and each key/value block the range
  ``[q_lo, q_hi)`` of query blocks (the backward's walk); every block outside is fully masked.
  It also says which blocks hold a single segment (``q_uniform``, ``kv_uniform``).
- :func:`uniform_block_ranges` gives, within those ranges, the sub-range of blocks where both
  blocks hold one and the same segment: there no segment mask is needed at all.
- :func:`window_block_ranges` / :func:`intersect_window` do the same for causal masks and
  sliding windows, so a kernel can walk the intersection.

How: each block is summarised by the minimum and maximum of its non-padding ids (ids ``<= 0``
are padding and see nothing). Two blocks can share a visible pair only if their ``[min, max]``
intervals overlap; the range of a query block spans the first to the last key/value block whose
interval overlaps its own. That is correct for any ids (it never skips a block holding a visible
pair). When the non-padding ids are non-decreasing along the sequence (packed documents,
``cu_seqlens``) and queries and keys carry the same ids, it is tight: exactly the blocks holding
a visible pair. For other orders it may include fully masked blocks; the kernel masks them.

Cost: the overlap test runs over all ``n_q x n_k`` block pairs, as compares fused into a few
reductions (``argmax`` for the first and last overlap). That is a handful of small device
kernels and no loop: a binary search over sorted running extremes needs fewer operations on
paper, but as a device loop it syncs with the host at every step (with such loops, the
segment-id forward at B4 S4096 H16 D128 ran over what its share of the work predicts by
several times the attention itself, on the H100), and unrolled it is dozens of kernels.
``n_q x n_k`` stays small: 2^21 pairs per row at 128k tokens with 128 x 64 blocks.

Uniform blocks: ``q_uniform[b, i]`` is the id shared by every token of the block when that id is
positive, else -1 (a block with any padding token, or two segments, is not uniform). A query
block and a key/value block that are uniform with the same id see each other whole. For sorted
ids such blocks form one contiguous run inside ``[kv_lo, kv_hi)``; :func:`uniform_block_ranges`
finds it and checks that it is contiguous (the count of such blocks equals its length),
returning an empty run otherwise, so it too is correct for any ids.

Sequences must already be padded to whole blocks (padding id 0). Every range comes as
``lo <= hi``; an empty range has ``lo == hi``.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool, Int

__all__ = ["BlockRanges", "UniformRanges", "intersect_window", "segment_block_ranges", "uniform_block_ranges", "window_block_ranges"]

_NO_MIN = jnp.iinfo(jnp.int32).max  # the minimum of a block without a non-padding token


class BlockRanges(NamedTuple):
    """Per-block visit ranges under segment ids; all int32, ``lo <= hi``.

    Attributes:
      kv_lo, kv_hi: ``[batch, num_q_blocks]``: query block ``i`` visits key/value blocks
        ``kv_lo[b, i] <= j < kv_hi[b, i]``; every other block is fully masked for it.
      q_lo, q_hi: ``[batch, num_kv_blocks]``: the query blocks that may see key/value block ``j``.
      q_uniform: ``[batch, num_q_blocks]``: the id of every token of the block if they share one
        positive id, else -1.
      kv_uniform: ``[batch, num_kv_blocks]``: the same for key/value blocks.
    """

    kv_lo: Int[Array, "batch num_q_blocks"]
    kv_hi: Int[Array, "batch num_q_blocks"]
    q_lo: Int[Array, "batch num_kv_blocks"]
    q_hi: Int[Array, "batch num_kv_blocks"]
    q_uniform: Int[Array, "batch num_q_blocks"]
    kv_uniform: Int[Array, "batch num_kv_blocks"]


class UniformRanges(NamedTuple):
    """Sub-ranges of :class:`BlockRanges` that need no segment mask; all int32, ``first <= last``.

    Attributes:
      kv_first, kv_last: ``[batch, num_q_blocks]``: key/value blocks ``kv_first <= j < kv_last``
        hold the same single segment as query block ``i`` (empty when block ``i`` is not
        uniform); ``kv_lo <= kv_first <= kv_last <= kv_hi``.
      q_first, q_last: ``[batch, num_kv_blocks]``: the same for the query blocks of key/value
        block ``j``, within ``[q_lo, q_hi)``.
    """

    kv_first: Int[Array, "batch num_q_blocks"]
    kv_last: Int[Array, "batch num_q_blocks"]
    q_first: Int[Array, "batch num_kv_blocks"]
    q_last: Int[Array, "batch num_kv_blocks"]


class _Summary(NamedTuple):
    """Per-block facts of one side: min and max of the non-padding ids, and the uniform id."""

    low: Int[Array, "batch blocks"]  # _NO_MIN when the block is all padding
    high: Int[Array, "batch blocks"]  # 0 when the block is all padding
    uniform: Int[Array, "batch blocks"]


def _summarise(ids: Int[Array, "batch seq"], block: int, name: str) -> _Summary:
    batch, seq = ids.shape
    if seq % block:
        raise ValueError(f"{name}: expected a length that is a multiple of the block size {block}, got shape {ids.shape}")
    blocks = ids.astype(jnp.int32).reshape(batch, seq // block, block)
    real = blocks > 0
    low = jnp.min(jnp.where(real, blocks, _NO_MIN), axis=2)
    high = jnp.max(jnp.where(real, blocks, 0), axis=2)
    first = blocks[:, :, 0]
    uniform = jnp.where((first > 0) & jnp.all(blocks == first[:, :, None], axis=2), first, -1)
    return _Summary(low, high, uniform)


def _first_and_last(table: Bool[Array, "batch a b"]) -> tuple[Int[Array, "batch a"], Int[Array, "batch a"]]:
    """For each row of ``table``, ``[first True, last True + 1)``, or ``(0, 0)`` for a row of False."""
    count = table.shape[2]
    found = jnp.any(table, axis=2)
    first = jnp.argmax(table, axis=2).astype(jnp.int32)
    last = (count - jnp.argmax(table[:, :, ::-1], axis=2)).astype(jnp.int32)
    return jnp.where(found, first, 0), jnp.where(found, last, 0)


def _overlap_ranges(a: _Summary, b: _Summary) -> tuple[Int[Array, "batch a"], Int[Array, "batch a"]]:
    """For each block of ``a``, the range ``[lo, hi)`` spanning every block of ``b`` whose id
    interval overlaps its own (see the module docstring)."""
    overlap = (a.low[:, :, None] <= b.high[:, None, :]) & (b.low[:, None, :] <= a.high[:, :, None])
    return _first_and_last(overlap)


def segment_block_ranges(
    q_segments: Int[Array, "batch seq_q"], kv_segments: Int[Array, "batch seq_kv"], block_q: int, block_k: int
) -> BlockRanges:
    """The key/value blocks each query block must visit, and the reverse, under segment ids.

    Args:
      q_segments: ``[batch, seq_q]`` ids of the queries, ``seq_q`` a multiple of ``block_q``;
        ids ``<= 0`` are padding.
      kv_segments: ``[batch, seq_kv]`` ids of the keys, ``seq_kv`` a multiple of ``block_k``.
      block_q, block_k: the kernel's block sizes.

    Returns:
      :class:`BlockRanges`; see the module docstring for what is guaranteed.
    """
    if q_segments.ndim != 2 or kv_segments.ndim != 2 or q_segments.shape[0] != kv_segments.shape[0]:
        raise ValueError(f"q_segments, kv_segments: expected [batch, seq] arrays of one batch, got {q_segments.shape} and {kv_segments.shape}")
    q = _summarise(q_segments, block_q, "q_segments")
    kv = _summarise(kv_segments, block_k, "kv_segments")
    kv_lo, kv_hi = _overlap_ranges(q, kv)
    q_lo, q_hi = _overlap_ranges(kv, q)
    return BlockRanges(kv_lo, kv_hi, q_lo, q_hi, q.uniform, kv.uniform)


def _uniform_runs(
    own: Int[Array, "batch a"], other: Int[Array, "batch b"], lo: Int[Array, "batch a"]
) -> tuple[Int[Array, "batch a"], Int[Array, "batch a"]]:
    """The blocks of ``other`` uniform with each block's own id, when they are one contiguous
    run (always, for sorted ids); else the empty run ``(lo, lo)``."""
    same = (own[:, :, None] == other[:, None, :]) & (own[:, :, None] > 0)
    first, last = _first_and_last(same)
    contiguous = jnp.sum(same, axis=2, dtype=jnp.int32) == last - first
    whole = contiguous & (first < last)
    return jnp.where(whole, first, lo), jnp.where(whole, last, lo)


def uniform_block_ranges(ranges: BlockRanges) -> UniformRanges:
    """The blocks inside each visit range that need no segment mask (same single segment)."""
    kv_first, kv_last = _uniform_runs(ranges.q_uniform, ranges.kv_uniform, ranges.kv_lo)
    q_first, q_last = _uniform_runs(ranges.kv_uniform, ranges.q_uniform, ranges.q_lo)
    return UniformRanges(kv_first, kv_last, q_first, q_last)


def window_block_ranges(
    num_q_blocks: int, num_kv_blocks: int, block_q: int, block_k: int, left: int | None, right: int | None
) -> tuple[Int[Array, "num_q_blocks"], Int[Array, "num_q_blocks"], Int[Array, "num_kv_blocks"], Int[Array, "num_kv_blocks"]]:
    """``(kv_lo, kv_hi, q_lo, q_hi)`` under positions alone: query ``p`` sees keys
    ``p - left <= j <= p + right`` (None: unbounded; causal is ``right=0``). Ranges are clipped
    to the blocks that exist and come as ``lo <= hi``."""
    q_block = jnp.arange(num_q_blocks, dtype=jnp.int32)
    kv_block = jnp.arange(num_kv_blocks, dtype=jnp.int32)

    def ceil_div(x: jax.Array, d: int) -> jax.Array:
        return (jnp.maximum(x, 0) + d - 1) // d

    kv_lo = jnp.zeros_like(q_block) if left is None else jnp.maximum(q_block * block_q - left, 0) // block_k
    kv_hi = jnp.full_like(q_block, num_kv_blocks) if right is None else jnp.minimum(ceil_div((q_block + 1) * block_q + right, block_k), num_kv_blocks)
    q_lo = jnp.zeros_like(kv_block) if right is None else jnp.maximum(kv_block * block_k - right, 0) // block_q
    q_hi = jnp.full_like(kv_block, num_q_blocks) if left is None else jnp.minimum(ceil_div((kv_block + 1) * block_k + left, block_q), num_q_blocks)
    kv_lo, q_lo = jnp.minimum(kv_lo, num_kv_blocks), jnp.minimum(q_lo, num_q_blocks)
    return kv_lo, jnp.maximum(kv_hi, kv_lo), q_lo, jnp.maximum(q_hi, q_lo)


def intersect_window(ranges: BlockRanges, block_q: int, block_k: int, left: int | None, right: int | None) -> BlockRanges:
    """``ranges`` narrowed to the blocks a causal mask or window leaves visible (see
    :func:`window_block_ranges`); the uniform ids are kept."""
    kv_lo, kv_hi, q_lo, q_hi = window_block_ranges(ranges.kv_lo.shape[1], ranges.q_lo.shape[1], block_q, block_k, left, right)

    def meet(lo: jax.Array, hi: jax.Array, lo2: jax.Array, hi2: jax.Array) -> tuple[jax.Array, jax.Array]:
        lo = jnp.maximum(lo, lo2[None, :])
        return lo, jnp.maximum(jnp.minimum(hi, hi2[None, :]), lo)

    kv_lo, kv_hi = meet(ranges.kv_lo, ranges.kv_hi, kv_lo, kv_hi)
    q_lo, q_hi = meet(ranges.q_lo, ranges.q_hi, q_lo, q_hi)
    return ranges._replace(kv_lo=kv_lo, kv_hi=kv_hi, q_lo=q_lo, q_hi=q_hi)
