"""The Mosaic GPU attention forward (see :mod:`ejlabel.kernels.attention.mosaic`): items are
query tiles of 128 rows, each walking its key/value blocks with an online softmax in float32,
base 2, and saving the log-sum-exp for the backward."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from ...pallas_common import MASK_VALUE
from .budget import fits_exactly, ring_stages, tile_buffers
from .kernel import (
    CONSUMER_REGISTERS, LN2, PRODUCER_REGISTERS, cast, consume_items, key_segments, key_value_items,
    key_value_streams, launch, mma_beside, mma_into, mma_new, per_step, plgpu, produce_items, row_layout,
    smem_tile, tile_ready, tile_segments, visibility,
)
from .plan import CONSUMERS, TILE, WG_ROWS, Mask, Shape, Visit, mask_loops, walk

__all__ = ["P_LOG2_GAIN", "forward_call"]

# The 8-bit forward's probabilities are computed times 2**8 (up to 256 of e4m3's 448): in [0, 1]
# those below 2**-6 would be e4m3 subnormals, with fewer bits.
P_LOG2_GAIN = 8.0


def forward_call(
    q: jax.Array, k: jax.Array, v: jax.Array, plan: jax.Array, segment_ids: jax.Array | None,
    shape: Shape, *, block_k: int, stages: int | None, pingpong: bool = False, persistent: bool = True, pipelined: bool = False,
    descale: jax.Array | None = None, out_dtype: Any = None,
) -> tuple[jax.Array, jax.Array]:
    """``(out [batch, seq_q, heads, dim], lse [batch, heads, seq_q])`` on padded operands.

    ``descale`` (float32 ``[4]``: the scores' and the output's factors, then zeros) makes this
    the 8-bit forward of :mod:`.fp8`: ``q`` and ``k`` in ``float8_e4m3fn``, ``v`` transposed
    to ``[batch, kv_heads, dim, seq_kv]`` in it too (an 8-bit wgmma reads both operands along
    their contraction), ``dim == block_k``; each step's probabilities go to the tensor cores
    in 8 bits through shared memory, and ``out`` comes out in ``out_dtype``.

    Items are query tiles of one head (see :class:`.work.Items`). ``pingpong``: the two consumers
    meet at a two-arrival barrier twice per step (after issuing ``q k^T``, and after the
    softmax), offset by half a step, so one's softmax runs while the other's matrix products
    use the tensor cores. Both walk the same blocks, so their meetings pair up; per item,
    consumer 1 meets once before its loop and consumer 0 once after. ``pipelined``: each
    consumer overlaps its own softmax with its products (:func:`pipelined_walk`); with
    ``pingpong`` as well, the consumers take turns to issue their products instead of meeting
    (a barrier per consumer: each waits on its own before issuing and arrives on the other's
    after, consumer 1 handing the first turn to consumer 0), as FlashAttention-3 combines the
    two.
    """
    batch, seq_q, heads, dim = q.shape
    dtype = q.dtype
    fp8 = descale is not None
    out_dtype = jnp.dtype(out_dtype or dtype)
    if fp8 and (pipelined or dim != block_k):
        raise ValueError(f"descale: the 8-bit forward takes the plain or ping-pong walk with dim == block_k, got dim {dim}, block_k {block_k}")
    segmented = segment_ids is not None
    row_bytes = dim * jnp.dtype(dtype).itemsize
    items, order = key_value_items(plan, heads, persistent, shape, segmented, k)
    # The 8-bit forward also holds each consumer's probabilities and its results' own buffer.
    fp8_bytes = TILE * (block_k + dim * out_dtype.itemsize) if fp8 else 0
    stages = ring_stages(stages, TILE * row_bytes + fp8_bytes, 2 * block_k * row_bytes)
    tile_bytes, ring_bytes = TILE * row_bytes, stages * 2 * block_k * row_bytes + fp8_bytes
    buffers = tile_buffers(tile_bytes, ring_bytes)
    # The small buffers: the log-sum-exp rows and, with segment ids, the ids of the query tiles
    # and of the ring's key blocks.
    small = (4 * CONSUMERS * WG_ROWS,) + ((4 * buffers * CONSUMERS * WG_ROWS, 4 * stages * block_k) if segmented else ())
    # Results in a buffer of their own (see consume_items) where they fit, above head dim 64:
    # there the causal D128 forward ran slightly faster with it, in three interleaved runs on
    # the H100, and the packed D64 forward slower (bench_attention.py section f's shapes).
    turns = pipelined and pingpong  # the consumers take turns to issue their products
    # The 8-bit forward's results (16 bits) never fit its query tile.
    staged_apart = fp8 or (dim > 64 and buffers == 2 and fits_exactly(3 * tile_bytes, ring_bytes, *small))

    def body(q_ref: Any, k_ref: Any, v_ref: Any, plan_ref: Any, order_ref: Any, *refs: Any) -> None:
        refs = list(refs)
        seg_ref = refs.pop(0) if segmented else None
        descale_ref = refs.pop(0) if fp8 else None
        out_ref, lse_ref, scratch, barriers = refs
        q_smem, kv_ring, *rest = scratch
        # Key slots first, value slots after them, in one buffer: the pipelined walk's first
        # step multiplies its zero probabilities by a key slot in place of a value slot.
        k_ring, v_ring = kv_ring.at[pl.ds(0, stages)], kv_ring.at[pl.ds(stages, stages)]
        out_smem = rest.pop(0) if staged_apart else None
        p_smem = rest.pop(0) if fp8 else None
        lse_smem = rest.pop(0)
        qseg_smem, kseg_ring = rest if segmented else (None, None)
        q_ready, k_ready, v_ready, k_used, v_used, kseg_ready, turn = barriers
        wg = lax.axis_index("wg")

        @pl.when(wg < CONSUMERS)
        def _consumer() -> None:
            plgpu.set_max_registers(CONSUMER_REGISTERS, action="increase")
            # The 8-bit products' factors, read once: the scores' scale and the output's.
            score_scale, out_scale = (shape.scale * descale_ref[0], descale_ref[1]) if fp8 else (None, None)

            def meet() -> None:
                plgpu.barrier_arrive(turn)
                plgpu.barrier_wait(turn)

            def take_turn() -> None:
                plgpu.barrier_wait(turn.at[wg])

            def pass_turn() -> None:
                plgpu.barrier_arrive(turn.at[1 - wg])

            def load(visit: Visit, buf: jax.Array) -> None:
                b, h = visit.b, visit.h
                rows = pl.ds(visit.row0(wg), WG_ROWS)
                ready = tile_ready(q_ready, buf, wg)
                plgpu.copy_gmem_to_smem(q_ref.at[b, rows, h], q_smem.at[buf, wg], ready)
                if segmented:
                    plgpu.copy_gmem_to_smem(seg_ref.at[b, rows], qseg_smem.at[buf, wg], ready)

            def process(visit: Visit, buf: jax.Array, t0: jax.Array) -> tuple[jax.Array, Any]:
                b, h = visit.b, visit.h
                row0 = visit.row0(wg)

                def my_q() -> Any:
                    """The item's query tile, picked in each step (see :func:`.kernel.per_step`)."""
                    return q_smem.at[per_step(buf), wg]

                q_seg = tile_segments(shape, qseg_smem.at[buf, wg]) if segmented else None

                segments_of = functools.partial(key_segments, shape, (kseg_ready, kseg_ring) if segmented else None, q_seg=q_seg)
                softmax = functools.partial(
                    online_softmax, shape, row0=row0, block_k=block_k, dtype=dtype, scale=score_scale, log2_gain=P_LOG2_GAIN if fp8 else 0.0,
                )

                def step(j: jax.Array, t: jax.Array, carry: Any, kind: Mask) -> Any:
                    acc, m, l = carry
                    slot = lax.rem(t, stages)
                    segments = segments_of(slot, kind)
                    with jax.named_scope("k_wait"):
                        plgpu.barrier_wait(k_ready.at[slot])
                    s = mma_new(shape, my_q(), k_ring.at[slot], transpose_b=True, between=meet if pingpong else None)
                    plgpu.barrier_arrive(k_used.at[slot])
                    p16, alpha, m, l = softmax(s, m, l, j=j, kind=kind, segments=segments)
                    acc = acc * lax.broadcast_in_dim(alpha, acc.shape, [0])
                    if pingpong:
                        plgpu.barrier_arrive(turn)  # softmax done
                    plgpu.barrier_wait(v_ready.at[slot])
                    if pingpong:
                        plgpu.barrier_wait(turn)  # the other consumer's products are issued
                    if fp8:  # the 8-bit A operand's registers are not the accumulator's layout
                        p_smem.at[wg][...] = p16
                        plgpu.commit_smem()
                        acc = mma_into(shape, acc, p_smem.at[wg], v_ring.at[slot], transpose_b=True)
                    else:
                        acc = mma_into(shape, acc, p16, v_ring.at[slot])
                    plgpu.barrier_arrive(v_used.at[slot])
                    return acc, m, l

                init = (
                    cast(shape, jnp.zeros((WG_ROWS, dim), jnp.float32), plgpu.Layout.WGMMA),
                    cast(shape, jnp.full((WG_ROWS,), MASK_VALUE, jnp.float32), row_layout()),
                    cast(shape, jnp.zeros((WG_ROWS,), jnp.float32), row_layout()),
                )
                if pipelined:
                    ring = Ring(kv_ring, k_ready, v_ready, k_used, v_used, stages)
                    acc, m, l = pipelined_walk(
                        shape, visit, my_q, ring, segments_of, softmax, init, t0, masks=mask_loops(segmented, dim),
                        turns=(take_turn, pass_turn) if pingpong else None,
                    )
                else:
                    if pingpong:
                        pl.when(wg == 1)(meet)
                    acc, m, l = walk(visit, step, init, offset=t0, masks=mask_loops(segmented, dim))
                    if pingpong:
                        pl.when(wg == 0)(meet)
                seen = l > 0.0
                safe_l = jnp.where(seen, l, 1.0)
                inv = jnp.where(seen, (1.0 if out_scale is None else out_scale) / safe_l, 0.0)

                def write() -> None:
                    staging = out_smem.at[wg] if staged_apart else q_smem.at[buf, wg]
                    staging[...] = (acc * lax.broadcast_in_dim(inv, acc.shape, [0])).astype(out_dtype)
                    # Rows that see nothing get any finite value: every use of it is masked.
                    log2_l = jnp.log(safe_l) * (1.0 / LN2)
                    if fp8:  # l holds the probabilities' gain
                        log2_l = log2_l - P_LOG2_GAIN
                    lse_smem.at[wg][...] = jnp.where(seen, m + log2_l, 0.0)
                    plgpu.commit_smem()
                    plgpu.copy_smem_to_gmem(staging, out_ref.at[b, pl.ds(row0, WG_ROWS), h])
                    plgpu.copy_smem_to_gmem(lse_smem.at[wg], lse_ref.at[b, h, pl.ds(row0, WG_ROWS)])

                return t0 + visit.steps, write

            if turns:  # consumer 0 issues first; the last turn passed to it is taken at the end
                pl.when(wg == 1)(lambda: plgpu.barrier_arrive(turn.at[0]))
            consume_items(items, order_ref, plan_ref, buffers, q_ready, load, process, staged_apart=staged_apart)
            if turns:
                pl.when(wg == 0)(lambda: plgpu.barrier_wait(turn.at[0]))

        @pl.when(wg == CONSUMERS)
        def _producer() -> None:
            plgpu.set_max_registers(PRODUCER_REGISTERS, action="decrease")

            streams_of = key_value_streams(
                k_ref, v_ref, seg_ref, (k_ring, v_ring, kseg_ring), (k_ready, v_ready, k_used, v_used, kseg_ready), block_k, shape.group,
                values_transposed=fp8,
            )
            produce_items(items, order_ref, plan_ref, streams_of, [k_used, v_used])

    # The 128-byte-swizzled buffers first (each a multiple of 1024 bytes), the small ones last.
    scratch = (smem_tile((buffers, CONSUMERS, WG_ROWS, dim), dtype), smem_tile((2 * stages, block_k, dim), dtype))
    if staged_apart:
        scratch += (smem_tile((CONSUMERS, WG_ROWS, dim), out_dtype),)
    if fp8:
        scratch += (smem_tile((CONSUMERS, WG_ROWS, block_k), dtype),)
    scratch += (plgpu.SMEM((CONSUMERS, WG_ROWS), jnp.float32),)
    if segmented:
        scratch += (plgpu.SMEM((buffers, CONSUMERS, WG_ROWS), jnp.int32), plgpu.SMEM((stages, block_k), jnp.int32))
    barriers = (
        plgpu.Barrier(num_arrivals=2 if segmented else 1, num_barriers=buffers * CONSUMERS),
        plgpu.Barrier(num_barriers=stages),
        plgpu.Barrier(num_barriers=stages),
        plgpu.Barrier(num_arrivals=CONSUMERS, num_barriers=stages),
        plgpu.Barrier(num_arrivals=CONSUMERS, num_barriers=stages),
        plgpu.Barrier(num_barriers=stages),
        plgpu.Barrier(num_barriers=CONSUMERS) if turns else plgpu.Barrier(num_arrivals=CONSUMERS),
    )
    operands = (q, k, v, plan, order) + ((segment_ids,) if segmented else ()) + ((descale,) if fp8 else ())
    # The log-sum-exp rows over whole tiles: a TMA row stride must be a multiple of 16 bytes.
    out_type = (jax.ShapeDtypeStruct(q.shape, out_dtype), jax.ShapeDtypeStruct((batch, heads, plan.shape[2] * TILE), jnp.float32))
    return launch(body, out_type, (scratch, barriers), items.programs, operands, shape.interpret)


def online_softmax(
    shape: Shape, s: jax.Array, m: jax.Array, l: jax.Array, *, j: jax.Array, kind: Mask, segments: Any, row0: jax.Array, block_k: int, dtype: Any,
    scale: jax.Array | None = None, log2_gain: float = 0.0,
) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
    """One key block's step of the online softmax, base 2: from the raw scores ``s [64, block_k]``
    of key block ``j`` and the running row max ``m`` and sum ``l``, the probabilities in 16 bits
    for ``P V``, the factor ``alpha`` that rescales the output rows, and the new ``m`` and
    ``l``. ``segments``: from :func:`.kernel.key_segments`. ``scale``: a traced scale of the
    scores in place of ``shape.scale`` (the 8-bit forward's, positive by construction).
    ``log2_gain``: the probabilities and ``l`` come out multiplied by ``2**log2_gain`` (which
    cancels in ``out = acc / l``), so that 8-bit probabilities use e4m3's normal range."""
    if scale is None:
        scale = shape.scale
        if scale <= 0:  # the row max below commutes with a positive scale only
            s, scale = s * scale, 1.0
    mask = visibility(shape, row0, j * block_k, WG_ROWS, block_k, segments, transpose=False) if kind is not Mask.NONE else None
    if mask is not None:
        # -inf, not a finite floor: the probabilities below come out exact zeros without a
        # second select, as the running max stays finite (it starts at MASK_VALUE).
        s = jnp.where(mask, s, -jnp.inf)
    # The raw scores' row max, scaled once: rounding keeps x -> x * scale monotone, so this is
    # the scaled scores' max exactly, without a product per score on the softmax's longest
    # chain; each score's product is left to the exponent's argument (one fused multiply-add).
    m_new = jnp.maximum(m, s.max(axis=1) * scale)
    alpha = jnp.exp2(m - m_new)
    p = jnp.exp2(s * scale - lax.broadcast_in_dim(m_new - log2_gain if log2_gain else m_new, s.shape, [0]))
    return p.astype(dtype), alpha, m_new, l * alpha + p.sum(axis=1)


class Ring(NamedTuple):
    """A consumer's side of the forward's ring: ``kv`` holds the key slots, then the value slots
    (``[2 * stages, block_k, dim]``); their ready barriers (completed by TMA) and consumed
    barriers (one arrival per consumer)."""

    kv: Any
    k_ready: Any
    v_ready: Any
    k_used: Any
    v_used: Any
    stages: int

    def keys(self, slot: jax.Array) -> Any:
        return self.kv.at[slot]

    def values(self, slot: jax.Array) -> Any:
        return self.kv.at[self.stages + slot]


def pipelined_walk(
    shape: Shape, visit: Visit, q: Callable[[], Any], ring: Ring, segments_of: Any, softmax: Any, init: tuple[jax.Array, jax.Array, jax.Array],
    t0: jax.Array, *, masks: tuple[Mask, ...], turns: tuple[Any, Any] | None = None,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """One item's walk with a consumer's softmax overlapped with its own products
    (FlashAttention-3's intra-warpgroup pipelining), returning ``(out, m, l)`` as the plain
    walk does. Step ``t`` issues ``S_t = q k_t^T`` and then the previous step's ``P_{t-1}
    v_{t-1}`` (:func:`.kernel.mma_beside`), waits for ``S_t`` alone and runs the softmax
    while ``P_{t-1} v_{t-1}`` is on the tensor cores; the last step's product follows the
    walk. Every product is awaited within its step: the loop carries registers only, the
    probabilities included. ``q()``: the item's query tile, picked in each step
    (:func:`.kernel.per_step`). ``segments_of``, ``softmax``: :func:`.kernel.key_segments` and
    :func:`online_softmax` bound to the item; ``turns``: ``(take_turn, pass_turn)``, called
    before and after a step issues its products, or None.

    Both products are issued at every step, the first included: there the probabilities are
    zeros (the carry's start) and the key slot just awaited stands in for the value slot that
    does not exist yet, which adds exact zeros. A product issued under a condition made ptxas
    serialize every wgmma of the kernel (its warning C7514: accumulator registers read
    between the start and the end of a pipeline stage), which made this walk slower than the
    plain one; issued always, it runs as fast as ping-pong at head dim 128 and slower at 64
    (``bench/bench_attention.py`` section f; figures in ``bench/RESULTS.md``), so ping-pong
    stays the default."""
    out0, m0, l0 = init
    end = t0 + visit.steps
    p0 = cast(shape, jnp.zeros((WG_ROWS, ring.kv.shape[-2]), ring.kv.dtype), plgpu.Layout.WGMMA)

    def step(j: jax.Array, t: jax.Array, carry: Any, kind: Mask) -> Any:
        out, p_prev, m, l = carry
        slot, prev, first = lax.rem(t, ring.stages), lax.rem(t - 1, ring.stages), t == t0
        plgpu.barrier_wait(ring.k_ready.at[slot])
        pl.when(~first)(lambda: plgpu.barrier_wait(ring.v_ready.at[prev]))
        values = ring.kv.at[jnp.where(first, slot, ring.stages + prev)]
        take_turn, pass_turn = turns if turns is not None else (None, None)
        if take_turn is not None:
            take_turn()

        def free_keys() -> None:
            plgpu.barrier_arrive(ring.k_used.at[slot])

        def beside(s: jax.Array) -> tuple[jax.Array, ...]:
            segments = segments_of(slot, kind)
            pl.when(~first)(free_keys)  # the first step's second product still reads them
            return softmax(s, m, l, j=j, kind=kind, segments=segments)

        (p16, alpha, m, l), out = mma_beside(shape, q(), ring.keys(slot), out, p_prev, values, between=beside, issued=pass_turn)
        pl.when(first)(free_keys)
        pl.when(~first)(lambda: plgpu.barrier_arrive(ring.v_used.at[prev]))
        return out * lax.broadcast_in_dim(alpha, out.shape, [0]), p16, m, l

    out, p_last, m, l = walk(visit, step, (out0, p0, m0, l0), offset=t0, masks=masks)

    def last_values(out: jax.Array) -> jax.Array:
        slot = lax.rem(end - 1, ring.stages)
        plgpu.barrier_wait(ring.v_ready.at[slot])
        out = mma_into(shape, out, p_last, ring.values(slot))
        plgpu.barrier_arrive(ring.v_used.at[slot])
        return out

    return lax.cond(t0 < end, last_values, lambda out: out, out), m, l
