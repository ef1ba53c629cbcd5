"""The ``"pallas"`` implementation of :func:`ejlabel.kernels.attention.flash_attention`: a
flash-attention-2 forward and backward on Pallas's Triton backend.

Each forward program owns one ``q`` block of one head and walks the key/value blocks with an
online softmax in base 2, skipping the blocks that causal masks or windows leave empty and
building a mask only for the blocks on an edge (the diagonal, a window's border, padded keys).
With segment ids (and ``cu_seqlens``) a per-block table computed before the kernel
(:mod:`.blocks`) narrows the walk to the blocks that share a segment with the program's block,
so a block of another document is never loaded, and blocks holding one and the same document
run without a mask. Backward kernels follow the same recipe: one computes ``dq`` per ``q``
block; the other computes ``dk`` and ``dv`` per key/value block and head, summing over the
query heads of its group inside the program, so grouped-query attention writes no
per-query-head partials. The forward keeps its output and base-2 log-sum-exp ``[batch, heads,
seq]`` for the backward, as flash attention does: one ``[batch, heads, seq]`` float array more
in memory, no forward rerun.

Sequences are padded to whole blocks and the head dimension to a power of two; the padding is
masked out and sliced off.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jaxtyping import Array, Float, Int

from ejlabel import BwdParams, FwdParams

from ..pallas_common import LOG2E, MASK_VALUE, compiler_params, dot, interpret_mode, next_power_of_2, pad_axis, pad_to
from .blocks import segment_block_ranges, uniform_block_ranges
from .defaults import default_bwd, default_fwd
from .masks import Window, visibility_mask

__all__ = ["Geometry", "triton_backward", "triton_forward"]


@dataclasses.dataclass(frozen=True)
class Geometry:
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
        return visibility_mask(q_pos, k_pos, q_seg, k_seg, bounds=self.bounds, kv_len=self.kv_len)


def _split_segments(refs: tuple[Any, ...], has_segments: bool) -> tuple[Any, Any, Any, tuple[Any, ...]]:
    """``(q_seg_ref, kv_seg_ref, table_ref, outputs)``: the segment inputs, or Nones without them."""
    return (refs[0], refs[1], refs[2], refs[3:]) if has_segments else (None, None, None, refs)


def _narrow(lo: jax.Array, hi: jax.Array, unmasked: tuple[jax.Array, jax.Array], table_ref: Any) -> tuple[jax.Array, jax.Array, tuple[jax.Array, jax.Array]]:
    """Position ranges narrowed by this block's row of the segment table.

    The table row is ``(lo, hi, first, last)`` from :mod:`.blocks`: blocks outside
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


def _forward_kernel(q_ref: Any, k_ref: Any, v_ref: Any, *refs: Any, geo: Geometry, has_segments: bool) -> None:
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
    q_ref: Any, k_ref: Any, v_ref: Any, do_ref: Any, lse_ref: Any, delta_ref: Any, *refs: Any, geo: Geometry, has_segments: bool
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
    dq_ref[...] = (dq * (geo.scale / LOG2E)).astype(dq_ref.dtype)


def _dkv_kernel(
    q_ref: Any, k_ref: Any, v_ref: Any, do_ref: Any, lse_ref: Any, delta_ref: Any, *refs: Any, geo: Geometry, has_segments: bool
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
    dk_ref[...] = (dk * (geo.scale / LOG2E)).astype(dk_ref.dtype)
    dv_ref[...] = dv.astype(dv_ref.dtype)


@dataclasses.dataclass(frozen=True)
class _Padded:
    """Operands padded for the Pallas kernels, and what is needed to undo it."""

    q: jax.Array
    k: jax.Array
    v: jax.Array
    segment_ids: jax.Array | None
    geo: Geometry
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
    geo = Geometry(scale * LOG2E, bounds, block_q, block_k, kv_len, heads // k.shape[2])
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


def triton_forward(
    q: Float[Array, "batch sq heads dim"], k: Float[Array, "batch skv kv_heads dim"], v: Float[Array, "batch skv kv_heads dim"],
    segment_ids: Int[Array, "batch seq"] | None, *, scale: float, bounds: Window, params: FwdParams,
) -> tuple[Float[Array, "batch sq heads dim"], Float[Array, "batch heads sq"]]:
    """``(out, lse)``: the attention output and its base-2 log-sum-exp ``[batch, heads, sq]``;
    unset fields of ``params`` get :func:`.defaults.default_fwd`'s."""
    fwd = default_fwd(q.shape[3]).merge(params)
    out, lse = _forward_pallas(_pad(q, k, v, segment_ids, fwd, scale=scale, bounds=bounds), fwd)
    return out[:, : q.shape[1], :, : q.shape[3]], lse[:, :, : q.shape[1]]


def triton_backward(
    q: Float[Array, "batch sq heads dim"], k: Float[Array, "batch skv kv_heads dim"], v: Float[Array, "batch skv kv_heads dim"],
    segment_ids: Int[Array, "batch seq"] | None, out: Float[Array, "batch sq heads dim"], lse: Float[Array, "batch heads sq"],
    g: Float[Array, "batch sq heads dim"], *, scale: float, bounds: Window, params: BwdParams,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """``(dq, dk, dv)`` from the forward's output and base-2 log-sum-exp and the cotangent ``g``;
    unset fields of ``params`` get :func:`.defaults.default_bwd`'s."""
    dim = q.shape[3]
    bwd = default_bwd(dim).merge(params)
    padded = _pad(q, k, v, segment_ids, bwd, scale=scale, bounds=bounds)
    # The forward may have used other tiles: bring its outputs to the backward's padding.
    rows = padded.q.shape[1]
    out, lse = pad_axis(pad_axis(out, 3, padded.q.shape[3]), 1, rows), pad_axis(lse, 2, rows)
    dq, dk, dv = _backward_pallas(padded, out, lse, g, bwd)
    return dq[:, : q.shape[1], :, :dim], dk[:, : k.shape[1], :, :dim], dv[:, : k.shape[1], :, :dim]
