"""Flash attention: softmax(q k^T * scale + mask) v over ``[batch, seq, heads, dim]`` arrays.

Features, in every implementation that accepts them:

- grouped-query attention: ``k`` and ``v`` may have fewer heads than ``q``; query head ``h``
  reads key/value head ``h // (heads_q // heads_kv)``;
- ``causal``: query ``i`` sees keys ``j <= i`` (positions counted from 0 in both);
- ``sliding_window=(left, right)``: query ``i`` sees keys ``i - left <= j <= i + right``
  (with ``causal`` the right side is 0);
- ``segment_ids [batch, seq]``: tokens see only tokens with the same id; ids ``<= 0`` are
  padding, which sees nothing and gets output 0;
- ``cu_seqlens [n + 1]``: a packed batch; ``q``, ``k`` and ``v`` are ``[1, total, heads,
  dim]`` and sequence ``s`` is ``tokens cu_seqlens[s]:cu_seqlens[s + 1]``; tokens past
  ``cu_seqlens[-1]`` are padding. It is turned into segment ids ``1..n`` (padding 0), so
  causal masks and windows act within each sequence.

A query that sees no key gets output 0 and gradient 0, never NaN.

Implementations, chosen by :class:`AttentionConfig.impl`:

- ``"xla"``: what a JAX user writes, differentiated by JAX itself (no custom VJP):
  ``jax.nn.dot_product_attention(implementation="xla")`` for causal or full attention, with
  segment ids (or ``cu_seqlens``) as a dense block-diagonal ``mask``; the masked softmax in
  float32 with a window.
- ``"cudnn"``: ``jax.nn.dot_product_attention(implementation="cudnn")``, differentiated by JAX;
  GPU, 16-bit inputs, causal or not, segment ids as the same dense mask (which cuDNN takes as a
  bias), no windows. ``use_implementation("xla")`` and the untuned default pick it on a GPU
  wherever cuDNN takes the call, as ``jax.nn.dot_product_attention`` would, so a labelled
  packed-documents model is never slower than the plain one.
- ``"mosaic"``: the same algorithm on the Pallas Mosaic GPU backend for Hopper (TMA, wgmma,
  warp specialisation; kernels/attention_mosaic.py), 16-bit inputs, head dim <= 256 (above 128
  the dk/dv kernel walks once for dv and once for dk). Where it runs, the tuning space offers
  it and not the Triton kernels below, which it beat at every shape measured.
- ``"pallas"``: a flash-attention-2 forward on the Triton backend (tuned on other GPUs and for
  float32 inputs; selectable everywhere). Each program owns one
  ``q`` block of one head and walks the key/value blocks with an online softmax in base 2,
  skipping the blocks that causal masks or windows leave empty and building a mask only for
  the blocks on an edge (the diagonal, a window's border, padded keys). With segment ids (and
  ``cu_seqlens``) a per-block table computed before the kernel (:mod:`._attention_blocks`)
  narrows the walk to the blocks that share a segment with the program's block, so a block of
  another document is never loaded, and blocks holding one and the same document run without a
  mask. Backward kernels follow the same recipe: one computes ``dq`` per ``q``
  block; the other computes ``dk`` and ``dv`` per key/value block and head, summing over the
  query heads of its group inside the program, so grouped-query attention writes no
  per-query-head partials. The forward keeps its output and base-2 log-sum-exp
  ``[batch, heads, seq]`` for the backward (``fwd_with_residuals``/``vjp``), as flash attention
  does: one ``[batch, heads, seq]`` float array more in memory, no forward rerun.

Sequences are padded to whole blocks and the head dimension to a power of two; the padding is
masked out and sliced off.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import math
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jaxtyping import Array, Float, Int

from ejlabel import BwdParams, FwdParams, Invocation, Kernel

from .blocks import segment_block_ranges, uniform_block_ranges
from ..checks import check_config, check_floating, check_integer, check_same_dtype
from .mosaic import mosaic_backward, mosaic_fits, mosaic_forward, mosaic_supports, on_hopper
from ..pallas_common import MASK_VALUE, compiler_params, dot, interpret_mode, next_power_of_2, on_gpu, pad_axis, pad_to

__all__ = ["AttentionConfig", "AttentionKernel", "cu_seqlens_to_segment_ids", "flash_attention"]

_IMPLS = ("xla", "cudnn", "pallas", "mosaic")
_LOG2E = math.log2(math.e)
Window = tuple[int | None, int | None]


@dataclasses.dataclass(frozen=True)
class AttentionConfig:
    """How to run one attention call.

    Attributes:
      impl: ``"xla"``, ``"cudnn"``, ``"pallas"`` or ``"mosaic"`` (Hopper; kernels/attention_mosaic.py).
      fwd: tiles and launch parameters of the Pallas forward (unset fields get defaults).
      bwd: the same for the Pallas backward kernels.
    """

    impl: str = "xla"
    fwd: FwdParams = FwdParams()
    bwd: BwdParams = BwdParams()

    def __post_init__(self) -> None:
        if self.impl not in _IMPLS:
            raise ValueError(f"impl: expected one of {_IMPLS}, got {self.impl!r}")


# --------------------------------------------------------------------------------------------
# Masks


def cu_seqlens_to_segment_ids(cu_seqlens: Int[Array, "n+1"], total: int) -> Int[Array, "1 total"]:
    """Segment ids ``[1, total]`` of a packed batch: ``s + 1`` for tokens of sequence ``s``, 0 past the end."""
    positions = jnp.arange(total, dtype=jnp.int32)
    # Unrolled: the default method is a device loop, which syncs with the host per step on a GPU.
    ids = jnp.searchsorted(cu_seqlens[1:].astype(jnp.int32), positions, side="right", method="scan_unrolled").astype(jnp.int32) + 1
    return jnp.where(positions < cu_seqlens[-1], ids, 0)[None, :]


def _bounds(causal: bool, window: Window | None) -> Window:
    """How far left and right of itself a query sees (None: unbounded)."""
    left, right = window if window is not None else (None, None)
    if causal:
        right = 0 if right is None else min(right, 0)
    return left, right


def _mask(
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


# --------------------------------------------------------------------------------------------
# XLA


def _attention_xla(
    q: Float[Array, "batch sq heads dim"], k: Float[Array, "batch skv kv_heads dim"], v: Float[Array, "batch skv kv_heads dim"],
    segment_ids: Int[Array, "batch seq"] | None, *, scale: float, bounds: Window,
) -> Float[Array, "batch sq heads dim"]:
    batch, sq, heads, dim = q.shape
    kv_heads = k.shape[2]
    qg = q.reshape(batch, sq, kv_heads, heads // kv_heads, dim)
    scores = jnp.einsum("bqhgd,bkhd->bhgqk", qg, k, preferred_element_type=jnp.float32) * scale
    positions_q, positions_k = jnp.arange(sq), jnp.arange(k.shape[1])
    if segment_ids is None:
        mask = _mask(positions_q, positions_k, None, None, bounds=bounds, kv_len=None)
        mask = None if mask is None else mask[None]
    else:
        mask = jax.vmap(lambda s: _mask(positions_q, positions_k, s, s, bounds=bounds, kv_len=None))(segment_ids)
    if mask is not None:
        mask = mask[:, None, None]  # [batch, 1, 1, sq, skv] against [batch, kv_heads, group, sq, skv]
        scores = jnp.where(mask, scores, MASK_VALUE)
    probs = jnp.exp(scores - jnp.max(scores, axis=-1, keepdims=True))
    if mask is not None:
        probs = jnp.where(mask, probs, 0.0)
    total = jnp.sum(probs, axis=-1, keepdims=True)
    probs = probs / jnp.where(total == 0.0, 1.0, total)  # rows that see nothing stay 0
    out = jnp.einsum("bhgqk,bkhd->bqhgd", probs.astype(v.dtype), v, preferred_element_type=jnp.float32)
    return out.reshape(q.shape).astype(q.dtype)


def _attention_plain(
    q: Float[Array, "batch sq heads dim"], k: Float[Array, "batch skv kv_heads dim"], v: Float[Array, "batch skv kv_heads dim"],
    segment_ids: Int[Array, "batch seq"] | None, *, scale: float, causal: bool, implementation: str,
) -> Float[Array, "batch sq heads dim"]:
    """What a JAX user writes: ``jax.nn.dot_product_attention`` on ``implementation`` (``"xla"``
    or ``"cudnn"``), with packed documents as a dense ``[batch, 1, seq, seq]`` block-diagonal
    mask beside ``is_causal``.

    A padding query sees no key, so the softmax spreads it over every key; its output is set to
    0 afterwards (which also stops its gradient), to keep this module's contract.
    """
    if segment_ids is None:
        return jax.nn.dot_product_attention(q, k, v, scale=scale, is_causal=causal, implementation=implementation)
    real = segment_ids > 0
    mask = (segment_ids[:, :, None] == segment_ids[:, None, :]) & real[:, :, None]
    out = jax.nn.dot_product_attention(q, k, v, mask=mask[:, None], scale=scale, is_causal=causal, implementation=implementation)
    return jnp.where(real[:, :, None, None], out, jnp.zeros((), out.dtype))


# --------------------------------------------------------------------------------------------
# Pallas


@dataclasses.dataclass(frozen=True)
class _Geometry:
    """Static facts every Pallas kernel of one call needs."""

    scale: float  # softmax scale times log2(e): the kernels work in base 2
    bounds: Window
    block_q: int
    block_k: int
    kv_len: int | None  # the true key length when the keys are padded without segment ids
    group: int

    def kv_blocks(self, q_block: jax.Array, num_kv_blocks: int) -> tuple[jax.Array, jax.Array]:
        """Key/value blocks ``[lo, hi)`` that query block ``q_block`` can see."""
        left, right = self.bounds
        lo = jnp.int32(0) if left is None else lax.div(jnp.maximum(q_block * self.block_q - left, 0), self.block_k)
        if right is None:
            return lo, jnp.int32(num_kv_blocks)
        last = (q_block + 1) * self.block_q + right  # one past the last visible position
        return lo, jnp.minimum(lax.div(jnp.maximum(last, 0) + self.block_k - 1, self.block_k), num_kv_blocks)

    def q_blocks(self, kv_block: jax.Array, num_q_blocks: int) -> tuple[jax.Array, jax.Array]:
        """Query blocks ``[lo, hi)`` that can see key/value block ``kv_block``."""
        left, right = self.bounds
        lo = jnp.int32(0) if right is None else lax.div(jnp.maximum(kv_block * self.block_k - right, 0), self.block_q)
        if left is None:
            return lo, jnp.int32(num_q_blocks)
        last = (kv_block + 1) * self.block_k + left
        return lo, jnp.minimum(lax.div(last + self.block_q - 1, self.block_q), num_q_blocks)

    def unmasked_kv_blocks(self, q_block: jax.Array, lo: jax.Array, hi: jax.Array) -> tuple[jax.Array, jax.Array]:
        """The blocks ``[a, b)`` within ``[lo, hi)`` that every query of ``q_block`` sees whole
        by position (segments are the segment table's business: see :func:`_narrow`).

        Those blocks skip the mask entirely; on long causal sequences that is nearly all of them.
        """
        hi = jnp.maximum(hi, lo)  # an empty range may come as lo > hi
        left, right = self.bounds
        first, last = lo, hi
        if left is not None:  # the block's first key is within reach of the block's last query
            first = jnp.maximum(first, lax.div(jnp.maximum((q_block + 1) * self.block_q - 1 - left, 0) + self.block_k - 1, self.block_k))
        if right is not None:  # the block's last key is visible to the block's first query
            last = jnp.minimum(last, lax.div(jnp.maximum(q_block * self.block_q + right + 1, 0), self.block_k))
        if self.kv_len is not None:
            last = jnp.minimum(last, self.kv_len // self.block_k)
        first = jnp.minimum(first, hi)
        return first, jnp.maximum(last, first)

    def unmasked_q_blocks(self, kv_block: jax.Array, lo: jax.Array, hi: jax.Array) -> tuple[jax.Array, jax.Array]:
        """The query blocks ``[a, b)`` within ``[lo, hi)`` that see all of ``kv_block`` by position."""
        hi = jnp.maximum(hi, lo)  # an empty range may come as lo > hi
        left, right = self.bounds
        first, last = lo, hi
        if self.kv_len is not None:  # a block holding padded keys is masked for every query
            last = jnp.where((kv_block + 1) * self.block_k > self.kv_len, lo, last)
        if right is not None:
            first = jnp.maximum(first, lax.div(jnp.maximum((kv_block + 1) * self.block_k - 1 - right, 0) + self.block_q - 1, self.block_q))
        if left is not None:
            last = jnp.minimum(last, lax.div(jnp.maximum(kv_block * self.block_k + 1 + left, 0), self.block_q))
        first = jnp.minimum(first, hi)
        return first, jnp.maximum(last, first)

    def mask(self, q_start: jax.Array, k_start: jax.Array, q_seg: jax.Array | None, k_seg: jax.Array | None) -> jax.Array | None:
        q_pos = q_start + jnp.arange(self.block_q, dtype=jnp.int32)
        k_pos = k_start + jnp.arange(self.block_k, dtype=jnp.int32)
        return _mask(q_pos, k_pos, q_seg, k_seg, bounds=self.bounds, kv_len=self.kv_len)


def _split_segments(refs: tuple[Any, ...], has_segments: bool) -> tuple[Any, Any, Any, tuple[Any, ...]]:
    """``(q_seg_ref, kv_seg_ref, table_ref, outputs)``: the segment inputs, or Nones without them."""
    return (refs[0], refs[1], refs[2], refs[3:]) if has_segments else (None, None, None, refs)


def _narrow(lo: jax.Array, hi: jax.Array, unmasked: tuple[jax.Array, jax.Array], table_ref: Any) -> tuple[jax.Array, jax.Array, tuple[jax.Array, jax.Array]]:
    """Position ranges narrowed by this block's row of the segment table.

    The table row is ``(lo, hi, first, last)`` from :mod:`._attention_blocks`: blocks outside
    ``[lo, hi)`` hold no pair of one segment, and blocks in ``[first, last)`` hold a single
    segment shared with this block. A block runs without a mask only where both its position and
    its segments let every pair through, so the unmasked range is the intersection of the two.
    """
    if table_ref is None:
        return lo, hi, unmasked
    lo = jnp.maximum(lo, table_ref[0])
    hi = jnp.maximum(jnp.minimum(hi, table_ref[1]), lo)
    first = jnp.minimum(jnp.maximum(jnp.maximum(unmasked[0], table_ref[2]), lo), hi)
    last = jnp.minimum(jnp.maximum(jnp.minimum(unmasked[1], table_ref[3]), first), hi)
    return lo, hi, (first, last)


def _blocks_loop(lo: jax.Array, hi: jax.Array, unmasked: tuple[jax.Array, jax.Array], step: Any, carry: Any) -> Any:
    """``step(j, carry, masked=...)`` over blocks ``[lo, hi)``: masked only outside ``unmasked``.

    Three loops instead of one so the blocks in the middle run without building or applying a
    mask, which is most of the work of a long causal sequence.
    """
    first, last = unmasked
    carry = lax.fori_loop(lo, first, functools.partial(step, masked=True), carry)
    carry = lax.fori_loop(first, last, functools.partial(step, masked=False), carry)
    return lax.fori_loop(last, hi, functools.partial(step, masked=True), carry)


def _forward_kernel(q_ref: Any, k_ref: Any, v_ref: Any, *refs: Any, geo: _Geometry, has_segments: bool) -> None:
    q_seg_ref, kv_seg_ref, table_ref, (o_ref, lse_ref) = _split_segments(refs, has_segments)
    bq, bk = geo.block_q, geo.block_k
    i = pl.program_id(0)
    q = q_ref[...]
    q_seg = None if q_seg_ref is None else q_seg_ref[...]

    def step(j: jax.Array, carry: tuple[jax.Array, jax.Array, jax.Array], masked: bool) -> tuple[jax.Array, jax.Array, jax.Array]:
        acc, running_max, running_sum = carry
        start = pl.multiple_of(j * bk, bk)
        keys = pl.ds(start, bk)
        scores = dot(q, k_ref[keys, :], trans_b=True) * geo.scale
        mask = geo.mask(i * bq, start, q_seg, None if kv_seg_ref is None else kv_seg_ref[keys]) if masked else None
        if mask is not None:
            scores = jnp.where(mask, scores, MASK_VALUE)
        new_max = jnp.maximum(running_max, jnp.max(scores, axis=1))
        probs = jnp.exp2(scores - new_max[:, None])
        if mask is not None:
            # A row with nothing visible yet has new_max == MASK_VALUE and exp2(0) == 1 above.
            probs = jnp.where(mask, probs, 0.0)
        correction = jnp.exp2(running_max - new_max)
        running_sum = running_sum * correction + jnp.sum(probs, axis=1)
        acc = acc * correction[:, None] + dot(probs.astype(v_ref.dtype), v_ref[keys, :])
        return acc, new_max, running_sum

    lo, hi = geo.kv_blocks(i, k_ref.shape[0] // bk)
    lo, hi, unmasked = _narrow(lo, hi, geo.unmasked_kv_blocks(i, lo, hi), table_ref)
    init = (jnp.zeros(q.shape, jnp.float32), jnp.full((bq,), MASK_VALUE, jnp.float32), jnp.zeros((bq,), jnp.float32))
    acc, running_max, running_sum = _blocks_loop(lo, hi, unmasked, step, init)
    seen = running_sum > 0.0
    o_ref[...] = (acc / jnp.where(seen, running_sum, 1.0)[:, None]).astype(o_ref.dtype)
    # Rows that see nothing get any finite value: every use of it is masked.
    lse_ref[...] = jnp.where(seen, running_max + jnp.log2(jnp.where(seen, running_sum, 1.0)), 0.0)


def _dq_kernel(
    q_ref: Any, k_ref: Any, v_ref: Any, do_ref: Any, lse_ref: Any, delta_ref: Any, *refs: Any, geo: _Geometry, has_segments: bool
) -> None:
    q_seg_ref, kv_seg_ref, table_ref, (dq_ref,) = _split_segments(refs, has_segments)
    bq, bk = geo.block_q, geo.block_k
    i = pl.program_id(0)
    q, do, lse, delta = q_ref[...], do_ref[...], lse_ref[...], delta_ref[...]
    q_seg = None if q_seg_ref is None else q_seg_ref[...]

    def step(j: jax.Array, dq: jax.Array, masked: bool) -> jax.Array:
        start = pl.multiple_of(j * bk, bk)
        keys = pl.ds(start, bk)
        k = k_ref[keys, :]
        probs = jnp.exp2(dot(q, k, trans_b=True) * geo.scale - lse[:, None])
        mask = geo.mask(i * bq, start, q_seg, None if kv_seg_ref is None else kv_seg_ref[keys]) if masked else None
        if mask is not None:
            probs = jnp.where(mask, probs, 0.0)
        dscores = probs * (dot(do, v_ref[keys, :], trans_b=True) - delta[:, None])
        return dq + dot(dscores.astype(k.dtype), k)

    lo, hi = geo.kv_blocks(i, k_ref.shape[0] // bk)
    lo, hi, unmasked = _narrow(lo, hi, geo.unmasked_kv_blocks(i, lo, hi), table_ref)
    dq = _blocks_loop(lo, hi, unmasked, step, jnp.zeros(q.shape, jnp.float32))
    dq_ref[...] = (dq * (geo.scale / _LOG2E)).astype(dq_ref.dtype)


def _dkv_kernel(
    q_ref: Any, k_ref: Any, v_ref: Any, do_ref: Any, lse_ref: Any, delta_ref: Any, *refs: Any, geo: _Geometry, has_segments: bool
) -> None:
    q_seg_ref, kv_seg_ref, table_ref, (dk_ref, dv_ref) = _split_segments(refs, has_segments)
    bq, bk = geo.block_q, geo.block_k
    j = pl.program_id(0)
    k, v = k_ref[...], v_ref[...]
    kv_seg = None if kv_seg_ref is None else kv_seg_ref[...]
    lo, hi = geo.q_blocks(j, q_ref.shape[0] // bq)
    lo, hi, unmasked = _narrow(lo, hi, geo.unmasked_q_blocks(j, lo, hi), table_ref)
    dk = dv = jnp.zeros(k.shape, jnp.float32)
    # The query heads of this key/value head's group, unrolled: the group is small and static.
    for head in range(geo.group):

        def step(i: jax.Array, grads: tuple[jax.Array, jax.Array], masked: bool, head: int = head) -> tuple[jax.Array, jax.Array]:
            dk, dv = grads
            start = pl.multiple_of(i * bq, bq)
            rows = pl.ds(start, bq)
            q, do = q_ref[rows, head, :], do_ref[rows, head, :]
            probs = jnp.exp2(dot(q, k, trans_b=True) * geo.scale - lse_ref[head, rows][:, None])
            mask = geo.mask(start, j * bk, None if q_seg_ref is None else q_seg_ref[rows], kv_seg) if masked else None
            if mask is not None:
                probs = jnp.where(mask, probs, 0.0)
            dv = dv + dot(probs.astype(do.dtype), do, trans_a=True)
            dscores = probs * (dot(do, v, trans_b=True) - delta_ref[head, rows][:, None])
            return dk + dot(dscores.astype(q.dtype), q, trans_a=True), dv

        dk, dv = _blocks_loop(lo, hi, unmasked, step, (dk, dv))
    dk_ref[...] = (dk * (geo.scale / _LOG2E)).astype(dk_ref.dtype)
    dv_ref[...] = dv.astype(dv_ref.dtype)


@dataclasses.dataclass(frozen=True)
class _Padded:
    """Operands padded for the Pallas kernels, and what is needed to undo it."""

    q: jax.Array
    k: jax.Array
    v: jax.Array
    segment_ids: jax.Array | None
    geo: _Geometry
    seq_q: int
    dim: int
    # With segment ids, each block's row (lo, hi, first, last) for :func:`_narrow`.
    q_table: jax.Array | None = None  # [batch, q blocks, 4]: key/value blocks of each query block
    kv_table: jax.Array | None = None  # [batch, kv blocks, 4]: query blocks of each key/value block


def _resolve_blocks(params: FwdParams | BwdParams, seq_q: int, seq_kv: int) -> tuple[int, int]:
    # Triton dots need sides of at least 16; tiles far longer than the sequence are wasted.
    return (min(params.q_blocksize, max(16, next_power_of_2(seq_q))), min(params.kv_blocksize, max(16, next_power_of_2(seq_kv))))


def _pad(
    q: jax.Array, k: jax.Array, v: jax.Array, segment_ids: jax.Array | None, params: FwdParams | BwdParams,
    *, scale: float, bounds: Window,
) -> _Padded:
    batch, seq_q, heads, dim = q.shape
    seq_kv = k.shape[1]
    block_q, block_k = _resolve_blocks(params, seq_q, seq_kv)
    padded_dim = max(16, next_power_of_2(dim))
    q, k, v = (pad_axis(t, 3, padded_dim) for t in (q, k, v))
    q, (k, v) = pad_to(q, 1, block_q), (pad_to(t, 1, block_k) for t in (k, v))
    if segment_ids is not None:
        # Both roles read one array: pad it to the longer of the two padded lengths.
        segment_ids = pad_axis(segment_ids.astype(jnp.int32), 1, max(q.shape[1], k.shape[1]))
    kv_len = seq_kv if segment_ids is None and k.shape[1] != seq_kv else None
    geo = _Geometry(scale * _LOG2E, bounds, block_q, block_k, kv_len, heads // k.shape[2])
    if segment_ids is None:
        return _Padded(q, k, v, None, geo, seq_q, dim)
    ranges = segment_block_ranges(segment_ids[:, : q.shape[1]], segment_ids[:, : k.shape[1]], block_q, block_k)
    uniform = uniform_block_ranges(ranges)
    q_table = jnp.stack([ranges.kv_lo, ranges.kv_hi, uniform.kv_first, uniform.kv_last], axis=-1)
    kv_table = jnp.stack([ranges.q_lo, ranges.q_hi, uniform.q_first, uniform.q_last], axis=-1)
    return _Padded(q, k, v, segment_ids, geo, seq_q, dim, q_table, kv_table)


def _segment_inputs(
    p: _Padded, q_spec: pl.BlockSpec, kv_spec: pl.BlockSpec, *, per_kv_block: bool = False
) -> tuple[list[jax.Array], list[pl.BlockSpec]]:
    """The query ids, key ids and segment table a kernel reads, and their specs.

    The table row belongs to the program's own block: a query block (grid axis 0 walks query
    blocks) or, with ``per_kv_block``, a key/value block.
    """
    if p.segment_ids is None:
        return [], []
    seq_q, seq_kv = p.q.shape[1], p.k.shape[1]
    table = p.kv_table if per_kv_block else p.q_table
    table_spec = pl.BlockSpec((None, None, 4), lambda n, b, h: (b, n, 0))
    return [p.segment_ids[:, :seq_q], p.segment_ids[:, :seq_kv], table], [q_spec, kv_spec, table_spec]


def _forward_pallas(p: _Padded, params: FwdParams) -> tuple[jax.Array, jax.Array]:
    """``(out [batch, seq_q_padded, heads, dim_padded], lse [batch, heads, seq_q_padded])``, lse in base 2."""
    batch, seq_q, heads, dim = p.q.shape
    seq_kv, geo = p.k.shape[1], p.geo
    q_block = pl.BlockSpec((None, geo.block_q, None, dim), lambda i, b, h: (b, i, h, 0))
    kv_whole = pl.BlockSpec((None, seq_kv, None, dim), lambda i, b, h: (b, 0, lax.div(h, geo.group), 0))
    segments, segment_specs = _segment_inputs(
        p, pl.BlockSpec((None, geo.block_q), lambda i, b, h: (b, i)), pl.BlockSpec((None, seq_kv), lambda i, b, h: (b, 0))
    )
    return pl.pallas_call(
        functools.partial(_forward_kernel, geo=geo, has_segments=p.segment_ids is not None),
        grid=(seq_q // geo.block_q, batch, heads),
        in_specs=[q_block, kv_whole, kv_whole, *segment_specs],
        out_specs=[q_block, pl.BlockSpec((None, None, geo.block_q), lambda i, b, h: (b, h, i))],
        out_shape=[jax.ShapeDtypeStruct(p.q.shape, p.q.dtype), jax.ShapeDtypeStruct((batch, heads, seq_q), jnp.float32)],
        compiler_params=compiler_params(params.num_warps, params.num_stages),
        interpret=interpret_mode(),
        name="flash_attention_fwd",
    )(p.q, p.k, p.v, *segments)


def _backward_pallas(p: _Padded, out: jax.Array, lse: jax.Array, g: jax.Array, params: BwdParams) -> tuple[jax.Array, jax.Array, jax.Array]:
    batch, seq_q, heads, dim = p.q.shape
    seq_kv, kv_heads, geo = p.k.shape[1], p.k.shape[2], p.geo
    do = pad_axis(pad_axis(g.astype(p.q.dtype), 3, dim), 1, seq_q)
    # delta_i = sum_d out_id * dout_id, the row term of the softmax backward.
    delta = jnp.einsum("bqhd,bqhd->bhq", out.astype(jnp.float32), do.astype(jnp.float32))
    launch = dict(compiler_params=compiler_params(params.num_warps, params.num_stages), interpret=interpret_mode())
    has_segments = p.segment_ids is not None

    q_block = pl.BlockSpec((None, geo.block_q, None, dim), lambda i, b, h: (b, i, h, 0))
    kv_whole = pl.BlockSpec((None, seq_kv, None, dim), lambda i, b, h: (b, 0, lax.div(h, geo.group), 0))
    row_block = pl.BlockSpec((None, None, geo.block_q), lambda i, b, h: (b, h, i))
    segments, segment_specs = _segment_inputs(
        p, pl.BlockSpec((None, geo.block_q), lambda i, b, h: (b, i)), pl.BlockSpec((None, seq_kv), lambda i, b, h: (b, 0))
    )
    dq = pl.pallas_call(
        functools.partial(_dq_kernel, geo=geo, has_segments=has_segments),
        grid=(seq_q // geo.block_q, batch, heads),
        in_specs=[q_block, kv_whole, kv_whole, q_block, row_block, row_block, *segment_specs],
        out_specs=q_block,
        out_shape=jax.ShapeDtypeStruct(p.q.shape, p.q.dtype),
        name="flash_attention_bwd_dq",
        **launch,
    )(p.q, p.k, p.v, do, lse, delta, *segments)

    # One program per key/value block and key/value head; it reads its group's query heads.
    q_group = pl.BlockSpec((None, seq_q, geo.group, dim), lambda j, b, h: (b, 0, h, 0))
    kv_block = pl.BlockSpec((None, geo.block_k, None, dim), lambda j, b, h: (b, j, h, 0))
    rows_group = pl.BlockSpec((None, geo.group, seq_q), lambda j, b, h: (b, h, 0))
    segments, segment_specs = _segment_inputs(
        p, pl.BlockSpec((None, seq_q), lambda j, b, h: (b, 0)), pl.BlockSpec((None, geo.block_k), lambda j, b, h: (b, j)), per_kv_block=True
    )
    dk, dv = pl.pallas_call(
        functools.partial(_dkv_kernel, geo=geo, has_segments=has_segments),
        grid=(seq_kv // geo.block_k, batch, kv_heads),
        in_specs=[q_group, kv_block, kv_block, q_group, rows_group, rows_group, *segment_specs],
        out_specs=[kv_block, kv_block],
        out_shape=[jax.ShapeDtypeStruct(p.k.shape, p.k.dtype)] * 2,
        name="flash_attention_bwd_dkv",
        **launch,
    )(p.q, p.k, p.v, do, lse, delta, *segments)
    return dq, dk, dv


# --------------------------------------------------------------------------------------------
# The kernel


# Defaults and tuning space from a sweep of every tile shape on the H100 (causal, B4 S4096 H16
# D128, bench/sweep_attention.py): four warps beat eight for head dims up to 128.
def _default_fwd(dim: int) -> FwdParams:
    return FwdParams(q_blocksize=128, kv_blocksize=64, num_warps=4 if dim <= 128 else 8, num_stages=2)


def _default_bwd(dim: int) -> BwdParams:
    return BwdParams(q_blocksize=64, kv_blocksize=64, num_warps=4 if dim <= 128 else 8, num_stages=2)


# The leaders of that sweep; the tuner tries every pairing, since forward and backward add up.
_FWD_TILES = ((128, 64, 4, 2), (128, 128, 8, 3), (128, 64, 8, 3), (64, 32, 4, 3), (64, 64, 4, 3), (128, 32, 4, 3))
_BWD_TILES = ((64, 64, 4, 2), (64, 64, 4, 1), (128, 64, 8, 2), (64, 32, 4, 2), (128, 32, 4, 2))
# Mosaic GPU tiles: forward (kv block, stages); backward (q block, kv block) with 2 stages.
_MOSAIC_FWD = ((128, 2), (64, 3))
_MOSAIC_BWD = ((64, 128, None, 2), (128, 64, None, 2), (64, 64, None, 2))


class AttentionKernel(Kernel[AttentionConfig, jax.Array]):
    """Flash attention with masks, segments and grouped heads; see the module docstring."""

    version = "1"

    def __init__(self) -> None:
        super().__init__("flash_attention")

    def run(
        self, q: Float[Array, "batch sq heads dim"], k: Float[Array, "batch skv kv_heads dim"], v: Float[Array, "batch skv kv_heads dim"],
        *, cfg: AttentionConfig, causal: bool = False, softmax_scale: float | None = None, sliding_window: Window | None = None,
        segment_ids: Int[Array, "batch seq"] | None = None, cu_seqlens: Int[Array, "n+1"] | None = None,
    ) -> Float[Array, "batch sq heads dim"]:
        segment_ids = _segments(q, k, segment_ids, cu_seqlens)
        scale = _scale(q, softmax_scale)
        bounds = _bounds(causal, sliding_window)
        if cfg.impl in ("xla", "cudnn"):
            if sliding_window is None:
                return _attention_plain(q, k, v, segment_ids, scale=scale, causal=causal, implementation=cfg.impl)
            if cfg.impl == "cudnn":
                raise ValueError("the cudnn implementation takes no sliding window")
            return _attention_xla(q, k, v, segment_ids, scale=scale, bounds=bounds)
        return self.fwd_with_residuals(
            q, k, v, cfg=cfg, causal=causal, softmax_scale=softmax_scale, sliding_window=sliding_window, segment_ids=segment_ids
        )[0]

    def fwd_with_residuals(
        self, q: Float[Array, "batch sq heads dim"], k: Float[Array, "batch skv kv_heads dim"], v: Float[Array, "batch skv kv_heads dim"],
        *, cfg: AttentionConfig, causal: bool = False, softmax_scale: float | None = None, sliding_window: Window | None = None,
        segment_ids: Int[Array, "batch seq"] | None = None, cu_seqlens: Int[Array, "n+1"] | None = None,
    ) -> tuple[Float[Array, "batch sq heads dim"], Float[Array, "batch heads sq"]]:
        """The output and its base-2 log-sum-exp ``[batch, heads, seq_q]``, which the backward
        keeps (with the output) instead of rerunning the forward.

        Only the Pallas and Mosaic paths get here: XLA's and cuDNN's are differentiated by JAX.
        """
        segment_ids = _segments(q, k, segment_ids, cu_seqlens)
        scale, bounds = _scale(q, softmax_scale), _bounds(causal, sliding_window)
        if cfg.impl == "mosaic":
            return mosaic_forward(q, k, v, segment_ids, scale=scale, bounds=bounds, params=cfg.fwd)
        fwd = _default_fwd(q.shape[3]).merge(cfg.fwd)
        out, lse = _forward_pallas(_pad(q, k, v, segment_ids, fwd, scale=scale, bounds=bounds), fwd)
        return out[:, : q.shape[1], :, : q.shape[3]], lse[:, :, : q.shape[1]]

    def vjp(
        self, lse: Float[Array, "batch heads sq"], out: Float[Array, "batch sq heads dim"], g: Float[Array, "batch sq heads dim"],
        q: Float[Array, "batch sq heads dim"], k: Float[Array, "batch skv kv_heads dim"], v: Float[Array, "batch skv kv_heads dim"],
        *, cfg: AttentionConfig, causal: bool = False, softmax_scale: float | None = None, sliding_window: Window | None = None,
        segment_ids: Int[Array, "batch seq"] | None = None, cu_seqlens: Int[Array, "n+1"] | None = None,
    ) -> tuple[jax.Array, jax.Array, jax.Array]:
        segment_ids = _segments(q, k, segment_ids, cu_seqlens)
        scale, bounds = _scale(q, softmax_scale), _bounds(causal, sliding_window)
        if cfg.impl == "mosaic":
            return mosaic_backward(q, k, v, segment_ids, out, lse, g, scale=scale, bounds=bounds, params=cfg.bwd)
        dim = q.shape[3]
        bwd = _default_bwd(dim).merge(cfg.bwd)
        padded = _pad(q, k, v, segment_ids, bwd, scale=scale, bounds=bounds)
        # The forward may have used other tiles: bring its outputs to the backward's padding.
        rows = padded.q.shape[1]
        out, lse = pad_axis(pad_axis(out, 3, padded.q.shape[3]), 1, rows), pad_axis(lse, 2, rows)
        dq, dk, dv = _backward_pallas(padded, out, lse, g, bwd)
        return dq[:, : q.shape[1], :, :dim], dk[:, : k.shape[1], :, :dim], dv[:, : k.shape[1], :, :dim]

    def differentiated_by_jax(self, cfg: AttentionConfig) -> bool:
        return cfg.impl not in ("pallas", "mosaic")

    def config_for(self, inv: Invocation[AttentionConfig, jax.Array], implementation: str) -> AttentionConfig | None:
        """``"xla"`` means what ``jax.nn.dot_product_attention`` gives a JAX user: cuDNN on a GPU
        where cuDNN takes the call (bf16/fp16, head dim <= 256 on Hopper and <= 128 elsewhere, no window; segment ids and
        ``cu_seqlens`` as a dense mask), XLA's own expression otherwise (always on the CPU)."""
        if implementation == "xla":
            cudnn = AttentionConfig("cudnn")
            return cudnn if self.candidate_is_valid(inv, cudnn) else AttentionConfig("xla")
        if implementation in _IMPLS:
            return AttentionConfig(implementation)
        return None

    def reference(
        self, q: Float[Array, "batch sq heads dim"], k: Float[Array, "batch skv kv_heads dim"], v: Float[Array, "batch skv kv_heads dim"],
        *, causal: bool = False, softmax_scale: float | None = None, sliding_window: Window | None = None,
        segment_ids: Int[Array, "batch seq"] | None = None, cu_seqlens: Int[Array, "n+1"] | None = None,
    ) -> Float[Array, "batch sq heads dim"]:
        segment_ids = _segments(q, k, segment_ids, cu_seqlens)
        return _attention_xla(q, k, v, segment_ids, scale=_scale(q, softmax_scale), bounds=_bounds(causal, sliding_window))

    def make_inputs(self, inv: Invocation[AttentionConfig, jax.Array], key: jax.Array) -> tuple[tuple[Any, ...], dict[str, Any]]:
        keys = jax.random.split(key, 3)
        args = tuple(jax.random.normal(kk, a.shape, jnp.float32).astype(a.dtype) for kk, a in zip(keys, inv.args))
        kwargs = dict(inv.kwargs)
        batch, seq = inv.args[0].shape[:2]
        if kwargs.get("segment_ids") is not None:
            # Four contiguous segments per row, the last eighth of each row padding.
            ids = 1 + (jnp.arange(seq) * 4) // seq
            ids = jnp.where(jnp.arange(seq) < seq - seq // 8, ids, 0)
            kwargs["segment_ids"] = jnp.broadcast_to(ids, (batch, seq)).astype(kwargs["segment_ids"].dtype)
        if kwargs.get("cu_seqlens") is not None:
            count = kwargs["cu_seqlens"].shape[0] - 1
            used = seq - seq // 8
            kwargs["cu_seqlens"] = ((jnp.arange(count + 1) * used) // max(count, 1)).astype(kwargs["cu_seqlens"].dtype)
        return args, kwargs

    def heuristic_cfg(self, inv: Invocation[AttentionConfig, jax.Array]) -> AttentionConfig:
        # The plain-JAX path until tuning in context shows something faster: an untuned
        # labelled model compiles to the plain model's program, never to a slower one.
        return self.config_for(inv, "xla")

    def config_space(self, inv: Invocation[AttentionConfig, jax.Array]) -> list[AttentionConfig]:
        if not on_gpu():
            small = BwdParams(16, 16, 4, 1)
            return [AttentionConfig("xla"), AttentionConfig("pallas", FwdParams(16, 16, 4, 1), small), AttentionConfig("pallas", FwdParams(32, 16, 4, 1), small)]
        q = inv.args[0]
        mosaic = [AttentionConfig("mosaic", FwdParams(kv_blocksize=bk, num_stages=st), BwdParams(*bwd)) for bk, st in _MOSAIC_FWD for bwd in _MOSAIC_BWD]
        if q.shape[3] > 128:  # none of those fit shared memory: the kernels' own defaults do
            mosaic = [AttentionConfig("mosaic")]
        # Where the Mosaic kernels run, the Triton ones beat them nowhere we measured: over 14 shapes
        # Mosaic ran 1.16x to 1.70x Triton's speed, forward and forward+backward (H100,
        # bench_attention.py sections a-e, bench/RESULTS.md runs 136-144). Their 30 tiles would only
        # cost tuning time (one Triton backward compiled for 267 s at 16:1 grouped heads). Still
        # selectable by config.
        pairs = () if on_hopper() and mosaic_supports(q.dtype, q.shape[3]) else itertools.product(_FWD_TILES, _BWD_TILES)
        pallas = [AttentionConfig("pallas", FwdParams(*fwd), BwdParams(*bwd)) for fwd, bwd in pairs]
        return [AttentionConfig("xla"), AttentionConfig("cudnn")] + pallas + mosaic

    def candidate_is_valid(self, inv: Invocation[AttentionConfig, jax.Array], cfg: AttentionConfig) -> bool:
        q = inv.args[0]
        if cfg.impl == "cudnn":
            masked = any(inv.kwargs.get(name) is not None for name in ("segment_ids", "cu_seqlens"))
            # cuDNN trains with a mask (a bias to it) only on even sequence lengths.
            # Head dims up to 256 on Hopper (H100, run 135: values and gradients with and without
            # a mask, bf16 and fp16), up to 128 on the GPUs we have not run it on.
            widest = 256 if on_hopper() else 128
            shapes = q.shape[3] % 8 == 0 and q.shape[3] <= widest and not (masked and (q.shape[1] % 2 or inv.args[1].shape[1] % 2))
            return on_gpu() and inv.kwargs.get("sliding_window") is None and q.dtype in (jnp.bfloat16, jnp.float16) and shapes
        if cfg.impl == "mosaic":  # Hopper, 16-bit, head dim <= 256, tiles that fit shared memory
            return on_hopper() and mosaic_supports(q.dtype, q.shape[3]) and mosaic_fits(q.shape[3], cfg.fwd, cfg.bwd)
        if cfg.impl == "pallas":
            fwd = _default_fwd(q.shape[3]).merge(cfg.fwd)
            return fwd.q_blocksize <= max(16, 2 * q.shape[1]) and fwd.kv_blocksize <= max(16, 2 * inv.args[1].shape[1])
        return True


def _segments(q: jax.Array, k: jax.Array, segment_ids: jax.Array | None, cu_seqlens: jax.Array | None) -> jax.Array | None:
    if segment_ids is not None and cu_seqlens is not None:
        raise ValueError("pass segment_ids or cu_seqlens, not both")
    if cu_seqlens is not None:
        if q.shape[0] != 1:
            raise ValueError(f"with cu_seqlens, q, k and v are [1, total, heads, dim]; got q of shape {q.shape}")
        segment_ids = cu_seqlens_to_segment_ids(cu_seqlens, q.shape[1])
    if segment_ids is not None and (segment_ids.shape != q.shape[:2] or q.shape[1] != k.shape[1]):
        raise ValueError(f"segment_ids: expected shape {q.shape[:2]} with equal q and kv lengths, got {segment_ids.shape} (kv {k.shape[1]})")
    return segment_ids


def _scale(q: jax.Array, softmax_scale: float | None) -> float:
    return 1.0 / math.sqrt(q.shape[3]) if softmax_scale is None else float(softmax_scale)


def _check_shapes(q: jax.Array, k: jax.Array, v: jax.Array) -> None:
    if q.ndim != 4 or k.shape != v.shape or k.ndim != 4:
        raise ValueError(f"q, k, v: expected [batch, seq, heads, dim] with k and v alike, got {q.shape}, {k.shape}, {v.shape}")
    if q.shape[0] != k.shape[0] or q.shape[3] != k.shape[3] or q.shape[2] % k.shape[2]:
        raise ValueError(f"q, k: batch and dim must match and kv heads divide q heads, got {q.shape} and {k.shape}")


_ATTENTION = AttentionKernel()


def flash_attention(
    q: Float[Array, "batch sq heads dim"], k: Float[Array, "batch skv kv_heads dim"], v: Float[Array, "batch skv kv_heads dim"],
    *, causal: bool = False, segment_ids: Int[Array, "batch seq"] | None = None, cu_seqlens: Int[Array, "n+1"] | None = None,
    softmax_scale: float | None = None, sliding_window: tuple[int, int] | None = None, cfg: AttentionConfig | None = None,
) -> Float[Array, "batch sq heads dim"]:
    """Multi-head attention with optional causal mask, window, segments and grouped heads.

    Args:
      q: ``[batch, seq_q, heads, dim]`` queries.
      k, v: ``[batch, seq_kv, kv_heads, dim]``; ``kv_heads`` divides ``heads``.
      causal: query ``i`` sees keys ``j <= i``.
      segment_ids: ``[batch, seq]`` int; tokens see only equal ids; ids ``<= 0`` are padding
        (output 0). Needs ``seq_q == seq_kv``.
      cu_seqlens: ``[n + 1]`` int cumulative lengths of a packed batch; ``q``, ``k``, ``v``
        are then ``[1, total, ...]``. Exclusive with ``segment_ids``.
      softmax_scale: multiplies ``q k^T``; default ``1 / sqrt(dim)``.
      sliding_window: ``(left, right)``: query ``i`` sees keys ``i - left .. i + right``.
      cfg: force a config; by default the executor picks one.

    Returns:
      ``[batch, seq_q, heads, dim]`` in the dtype of ``q``.
    """
    _check_shapes(q, k, v)
    for name, array in (("q", q), ("k", k), ("v", v)):
        check_floating(array, name)
    check_same_dtype({"q": q, "k": k, "v": v})
    for name, ids in (("segment_ids", segment_ids), ("cu_seqlens", cu_seqlens)):
        if ids is not None:
            check_integer(ids, name)
    check_config(cfg, AttentionConfig)
    window = None if sliding_window is None else (int(sliding_window[0]), int(sliding_window[1]))
    scale = None if softmax_scale is None else float(softmax_scale)
    return _ATTENTION(
        q, k, v, causal=bool(causal), softmax_scale=scale, sliding_window=window, segment_ids=segment_ids, cu_seqlens=cu_seqlens, cfg=cfg
    )
