"""The Mosaic GPU attention backward (see :mod:`ejlabel.kernels.attention.mosaic`): a ``dq``
kernel over query tiles and a ``dk, dv`` kernel over key/value tiles.

Two other schedules were built, measured slower and removed (their code is in the history
before this docstring's commit): a fused backward, whose dk/dv kernel added each step's share
of ``dq`` to a float32 ``dq`` in global memory with TMA reduce-adds (slower than the split at
causal B4 S4096 H16 D128 and at the packed model's shape, H100: the reduce-adds were the
cost), and a dq kernel that issued each step's ``q k^T`` with the previous step's ``dq += dS
k`` (slower forward+backward in every H100 run, ``bench/bench_attention.py`` section g). The
figures are in ``bench/RESULTS.md``.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jaxtyping import Array, Float

from ...pallas_common import LOG2E, pad_axis
from .budget import ring_depths, tile_buffers
from .kernel import (
    CONSUMER_REGISTERS, PRODUCER_REGISTERS, cast, col_layout, consume_items, ids_smem, ids_views, key_segments, key_value_items,
    key_value_streams, launch, load_smem, mma_into, mma_new, per_step, plgpu, produce_items, row_layout,
    smem_tile, tile_ready, tile_segments, visibility,
)
from .plan import CONSUMERS, TILE, WG_ROWS, Mask, Shape, Visit, mask_loops, walk
from .work import deal_items

__all__ = [
    "SOFTMAX_BESIDE_DP_MAX_DIM", "check_turns", "dkv_call", "dkv_passes", "dq_call", "dq_tiles", "softmax_delta",
]


# Up to this head dim the dq kernel's softmax runs while the tensor cores compute dP; above it,
# before dP is issued. Beside dP, the probabilities, dP's accumulator and the 64 x 256 float32 dq
# exceed a consumer's registers: at head dim 256 the kernel spilled more with the softmax beside
# dP than with it before, and causal B2 S4096 H8 D256 fwd+bwd ran slower (H100). Since each step
# picks its tiles (kernel.per_step) the registers suffice either way: beside dP the dq kernel
# ran a little faster, but the whole backward level (H200, D256; bench/bench_backward.py, and
# bench/ptxas_report.py for the spills; figures in bench/RESULTS.md): left as it was.
SOFTMAX_BESIDE_DP_MAX_DIM = 128


def check_turns(pingpong: bool, stages: int) -> None:
    """Raise unless a kernel whose consumers take turns has two slots at least of the blocks a
    step holds to its end (``stages``; see :func:`.budget.ring_depths`): offset by half a step,
    the two consumers work on consecutive blocks, and with one slot the one ahead waits for a
    block that the one behind, waiting to meet it, never frees (both kernels hung so, on the GPU
    and in the interpreter). A block freed mid-step, before the consumers' second meeting, needs
    no second slot: the one behind has freed it when the one ahead meets it."""
    if pingpong and stages < 2:
        raise ValueError(f"pingpong: the consumers take turns over two ring stages at least, got stages={stages}")


def dq_tiles(dim: int, dtype: Any, block_k: int, depths: tuple[int, int]) -> tuple[int, bool]:
    """``(buffers, computes_delta)`` of the dq kernel's tiles beside a ring of these ``(keys,
    values)`` depths: the kernel reads the forward's output tile beside ``q`` and ``dO`` and
    computes ``delta`` itself only where the three still fit twice beside the ring (see
    :func:`dq_call`); else ``delta`` comes in."""
    row_bytes = dim * jnp.dtype(dtype).itemsize
    ring_bytes = sum(depths) * block_k * row_bytes
    if tile_buffers(3 * TILE * row_bytes, ring_bytes) == 2:
        return 2, True
    return tile_buffers(2 * TILE * row_bytes, ring_bytes), False


def softmax_delta(out: jax.Array, do: jax.Array, rows: int) -> Float[Array, "batch heads rows"]:
    """``delta_i = sum_d out_id * dO_id``, the row term of the softmax backward, in float32,
    over ``rows`` (whole tiles: a TMA row stride must be a multiple of 16 bytes)."""
    return pad_axis(jnp.einsum("bqhd,bqhd->bhq", out.astype(jnp.float32), do.astype(jnp.float32)), 2, rows)


def dq_call(
    q: jax.Array, k: jax.Array, v: jax.Array, do: jax.Array, lse: jax.Array, out: jax.Array,
    plan: jax.Array, segment_ids: jax.Array | None, shape: Shape, *, block_k: int, stages: int | None, persistent: bool = True,
    pingpong: bool = False,
) -> tuple[jax.Array, jax.Array]:
    """``(dq [batch, seq_q, heads, dim], delta [batch, heads, seq_q])``: items are 128-row query
    tiles of one head, walking the key/value blocks of the plan; ``p`` is rebuilt from the saved
    log-sum-exp; ``delta`` (see :func:`softmax_delta`) goes on to the dk/dv kernel.

    ``pingpong``: the two consumers take turns as the forward's do (see
    :func:`.forward.forward_call`): they meet after issuing ``q k^T`` and before issuing
    ``dq += dS k``, offset by half a step, so one's probabilities and ``dS`` run while the
    other's products use the tensor cores (both walk the same key blocks, so their meetings
    pair up).

    Where :func:`dq_tiles` says so, each item computes its rows' ``delta`` from its tile of
    ``out`` (loaded beside ``q`` and ``dO``) and writes it out: that replaces a reduction over
    all of ``out`` and ``dO`` before the kernel, a cost paid in every layer (measured at the
    packed model's shape on the H100). Else that reduction runs first and the kernel loads
    ``delta``.
    """
    batch, seq_q, heads, dim = q.shape
    dtype = q.dtype
    segmented = segment_ids is not None
    items, order = key_value_items(plan, heads, persistent, shape, segmented, k)
    row_bytes = dim * jnp.dtype(dtype).itemsize
    # Row terms (log-sum-exp, delta) of one tile buffer; ids of one tile buffer and two key slots.
    small = (2 * 4 * CONSUMERS * WG_ROWS,) + ((4 * (CONSUMERS + 2) * block_k,) if segmented else ())
    key_depth, value_depth = ring_depths(stages, 2 * TILE * row_bytes, block_k * row_bytes, block_k * row_bytes, *small)
    check_turns(pingpong, key_depth)
    buffers, computes_delta = dq_tiles(dim, dtype, block_k, (key_depth, value_depth))
    out_or_delta = out if computes_delta else softmax_delta(out, do, lse.shape[2])

    def body(q_ref: Any, k_ref: Any, v_ref: Any, do_ref: Any, lse_ref: Any, in_ref: Any, plan_ref: Any, order_ref: Any, *refs: Any) -> None:
        refs = list(refs)
        seg_ref = refs.pop(0) if segmented else None
        dq_ref = refs.pop(0)
        delta_out_ref = refs.pop(0) if computes_delta else None
        scratch, barriers = refs
        q_smem, do_smem, k_ring, v_ring, row_terms, *rest = scratch
        lse_smem, delta_smem = row_terms.at[0], row_terms.at[1]
        tile_ids, kseg_ring = ids_views(rest.pop(0), buffers) if segmented else (None, None)
        o_smem = rest[0] if computes_delta else None
        q_ready, k_ready, v_ready, k_used, v_used, kseg_ready, *turns = barriers
        wg = lax.axis_index("wg")

        @pl.when(wg < CONSUMERS)
        def _consumer() -> None:
            plgpu.set_max_registers(CONSUMER_REGISTERS, action="increase")

            def meet() -> None:
                plgpu.barrier_arrive(turns[0])
                plgpu.barrier_wait(turns[0])

            def load(visit: Visit, buf: jax.Array) -> None:
                b, h = visit.b, visit.h
                rows = pl.ds(visit.row0(wg), WG_ROWS)
                # One barrier, several copies: it expects one arrival per copy.
                ready = tile_ready(q_ready, buf, wg)
                plgpu.copy_gmem_to_smem(q_ref.at[b, rows, h], q_smem.at[buf, wg], ready)
                plgpu.copy_gmem_to_smem(do_ref.at[b, rows, h], do_smem.at[buf, wg], ready)
                plgpu.copy_gmem_to_smem(lse_ref.at[b, h, rows], lse_smem.at[buf, wg], ready)
                if computes_delta:
                    plgpu.copy_gmem_to_smem(in_ref.at[b, rows, h], o_smem.at[buf, wg], ready)
                else:
                    plgpu.copy_gmem_to_smem(in_ref.at[b, h, rows], delta_smem.at[buf, wg], ready)
                if segmented:
                    plgpu.copy_gmem_to_smem(seg_ref.at[b, rows], tile_ids(buf, wg), ready)

            def own_delta(visit: Visit, buf: jax.Array) -> jax.Array:
                """This item's rows of ``delta`` from its output and ``dO`` tiles, also sent
                out to the dk/dv kernel."""
                with jax.named_scope("delta"):
                    out = load_smem(shape, o_smem.at[buf, wg], plgpu.Layout.WGMMA).astype(jnp.float32)
                    do = load_smem(shape, do_smem.at[buf, wg], plgpu.Layout.WGMMA).astype(jnp.float32)
                    delta = cast(shape, (out * do).sum(axis=1), row_layout())
                    delta_smem.at[buf, wg][...] = delta
                    plgpu.commit_smem()
                    plgpu.copy_smem_to_gmem(delta_smem.at[buf, wg], delta_out_ref.at[visit.b, visit.h, pl.ds(visit.row0(wg), WG_ROWS)])
                return delta

            def process(visit: Visit, buf: jax.Array, t0: jax.Array) -> tuple[jax.Array, Any]:
                b, h = visit.b, visit.h
                row0 = visit.row0(wg)
                lse = load_smem(shape, lse_smem.at[buf, wg], row_layout())
                delta = own_delta(visit, buf) if computes_delta else load_smem(shape, delta_smem.at[buf, wg], row_layout())
                q_seg = tile_segments(shape, tile_ids(buf, wg)) if segmented else None
                segments_of = functools.partial(key_segments, shape, (kseg_ready, kseg_ring) if segmented else None, q_seg=q_seg)

                def probabilities_of(s: jax.Array, j: jax.Array, kind: Mask, segments: Any) -> jax.Array:
                    """``P`` of key block ``j`` from its raw scores and the saved log-sum-exp."""
                    p = jnp.exp2(s * shape.scale - lax.broadcast_in_dim(lse, s.shape, [0]))
                    if kind is not Mask.NONE:
                        mask = visibility(shape, row0, j * block_k, WG_ROWS, block_k, segments, transpose=False)
                        if mask is not None:
                            p = jnp.where(mask, p, 0.0)
                    return p

                def scores_gradient(p: jax.Array, dp: jax.Array) -> jax.Array:
                    """``dS = P (dP - delta)``, in the inputs' dtype for its product with the keys."""
                    return (p * (dp - lax.broadcast_in_dim(delta, dp.shape, [0]))).astype(dtype)

                def step(j: jax.Array, t: jax.Array, dq: jax.Array, kind: Mask) -> jax.Array:
                    # A one-slot ring's slot is a constant: per_step keeps its descriptors in the step too.
                    slot, value_slot = per_step(lax.rem(t, key_depth)), per_step(lax.rem(t, value_depth))
                    tile = per_step(buf)
                    my_q, my_do = q_smem.at[tile, wg], do_smem.at[tile, wg]
                    segments = segments_of(slot, kind)
                    plgpu.barrier_wait(k_ready.at[slot])
                    s = mma_new(shape, my_q, k_ring.at[slot], transpose_b=True, between=meet if pingpong else None)
                    probabilities = functools.partial(probabilities_of, s, j, kind, segments)
                    if dim <= SOFTMAX_BESIDE_DP_MAX_DIM:
                        plgpu.barrier_wait(v_ready.at[value_slot])
                        # The softmax runs while the tensor cores compute dP.
                        dp, p = mma_new(shape, my_do, v_ring.at[value_slot], transpose_b=True, between=probabilities)
                    else:
                        p = probabilities()
                        plgpu.barrier_wait(v_ready.at[value_slot])
                        dp = mma_new(shape, my_do, v_ring.at[value_slot], transpose_b=True)
                    plgpu.barrier_arrive(v_used.at[value_slot])
                    ds = scores_gradient(p, dp)
                    if pingpong:
                        plgpu.barrier_arrive(turns[0])  # dS done
                        plgpu.barrier_wait(turns[0])  # the other consumer's products are issued
                    dq = mma_into(shape, dq, ds, k_ring.at[slot])
                    plgpu.barrier_arrive(k_used.at[slot])
                    return dq

                zeros = cast(shape, jnp.zeros((WG_ROWS, dim), jnp.float32), plgpu.Layout.WGMMA)
                if pingpong:
                    pl.when(wg == 1)(meet)
                dq = walk(visit, step, zeros, offset=t0, masks=mask_loops(segmented, dim))
                if pingpong:
                    pl.when(wg == 0)(meet)

                def write() -> None:
                    my_q = q_smem.at[buf, wg]
                    my_q[...] = (dq * (shape.scale / LOG2E)).astype(dtype)
                    plgpu.commit_smem()
                    plgpu.copy_smem_to_gmem(my_q, dq_ref.at[b, pl.ds(row0, WG_ROWS), h])

                return t0 + visit.steps, write

            consume_items(items, order_ref, plan_ref, buffers, q_ready, load, process)

        @pl.when(wg == CONSUMERS)
        def _producer() -> None:
            plgpu.set_max_registers(PRODUCER_REGISTERS, action="decrease")

            streams_of = key_value_streams(
                k_ref, v_ref, seg_ref, (k_ring, v_ring, kseg_ring), (k_ready, v_ready, k_used, v_used, kseg_ready), block_k, shape.group,
                values_first=key_depth == 1,  # see _produce
            )
            produce_items(items, order_ref, plan_ref, streams_of, [k_used, v_used])

    copies = 5 if segmented else 4
    scratch = (
        smem_tile((buffers, CONSUMERS, WG_ROWS, dim), dtype),
        smem_tile((buffers, CONSUMERS, WG_ROWS, dim), dtype),
        smem_tile((key_depth, block_k, dim), dtype),
        smem_tile((value_depth, block_k, dim), dtype),
        plgpu.SMEM((2, buffers, CONSUMERS, WG_ROWS), jnp.float32),  # log-sum-exp, delta
    )
    if segmented:
        scratch += (ids_smem(buffers, key_depth, block_k),)
    if computes_delta:
        scratch += (smem_tile((buffers, CONSUMERS, WG_ROWS, dim), dtype),)
    barriers = (
        plgpu.Barrier(num_arrivals=copies, num_barriers=buffers * CONSUMERS),
        plgpu.Barrier(num_barriers=key_depth),
        plgpu.Barrier(num_barriers=value_depth),
        plgpu.Barrier(num_arrivals=CONSUMERS, num_barriers=key_depth),
        plgpu.Barrier(num_arrivals=CONSUMERS, num_barriers=value_depth),
        plgpu.Barrier(num_barriers=key_depth),
    ) + ((plgpu.Barrier(num_arrivals=CONSUMERS),) if pingpong else ())
    operands = (q, k, v, do, lse, out_or_delta, plan, order) + ((segment_ids,) if segmented else ())
    out_type = (jax.ShapeDtypeStruct(q.shape, dtype),) + ((jax.ShapeDtypeStruct(lse.shape, jnp.float32),) if computes_delta else ())
    results = launch(body, out_type, (scratch, barriers), items.programs, operands, shape.interpret)
    return results[0], (results[1] if computes_delta else out_or_delta)


def dkv_call(
    q: jax.Array, k: jax.Array, v: jax.Array, do: jax.Array, lse: jax.Array, delta: jax.Array,
    plan: jax.Array, segment_ids: jax.Array | None, shape: Shape, *, block_q: int, stages: int | None, persistent: bool = True,
    grads: tuple[str, ...] = ("dk", "dv"), pingpong: bool = False,
) -> tuple[jax.Array | None, jax.Array | None]:
    """``(dk, dv)``, the gradients ``[batch, seq_kv, kv_heads, dim]``: items are 128-row
    key/value tiles of one key/value head, walking the planned query blocks once per query head
    of its group, so the group's sum stays in registers (no per-query-head partials, no atomics).

    ``grads``: which of ``dk`` and ``dv`` the walk accumulates (None for the other; see
    :func:`dkv_passes`). ``dv`` alone needs neither the value tile nor ``delta``.

    ``pingpong``: the two consumers take turns as in :func:`dq_call`, meeting after issuing
    ``k q^T`` and before issuing the step's ``dV`` and ``dK`` products.
    """
    kv_heads, dim = k.shape[2], k.shape[3]
    seq_q, heads = q.shape[1], q.shape[2]
    dtype = k.dtype
    segmented = segment_ids is not None
    group = shape.group
    if not grads or set(grads) - {"dk", "dv"}:
        raise ValueError(f"grads: expected dk, dv or both, got {grads}")
    with_dk = "dk" in grads  # dk needs dP = dO v^T, so the value tile and delta
    row_bytes = dim * jnp.dtype(dtype).itemsize
    # A batch row's queries, their gradients, log-sum-exps and deltas.
    items, order = deal_items(
        plan, kv_heads, persistent, shape.interpret, segmented=segmented, kv_heads=kv_heads, batch_row_bytes=heads * seq_q * (2 * row_bytes + 8),
    )
    tile_bytes = (2 if with_dk else 1) * TILE * row_bytes  # key (and value) rows of one tile
    # Row terms per query slot (log-sum-exp, delta); ids of one tile buffer and two query slots.
    small = (2 * 4 * 2 * block_q,) + ((4 * (CONSUMERS + 2) * block_q,) if segmented else ())
    query_depth, do_depth = ring_depths(stages, tile_bytes, block_q * row_bytes, block_q * row_bytes, *small)
    check_turns(pingpong, query_depth)
    ring_bytes = (query_depth + do_depth) * block_q * row_bytes
    buffers = tile_buffers(tile_bytes, ring_bytes)

    def body(q_ref: Any, k_ref: Any, v_ref: Any, do_ref: Any, lse_ref: Any, delta_ref: Any, plan_ref: Any, order_ref: Any, *refs: Any) -> None:
        refs = list(refs)
        seg_ref = refs.pop(0) if segmented else None
        grad_refs = dict(zip(grads, (refs.pop(0) for _ in grads)))
        scratch, barriers = refs
        scratch = list(scratch)
        k_smem = scratch.pop(0)
        v_smem = scratch.pop(0) if with_dk else None
        q_ring, do_ring, row_terms, *ids = scratch
        lse_ring, delta_ring = row_terms.at[0], row_terms.at[1]
        tile_ids, qseg_ring = ids_views(ids[0], buffers) if segmented else (None, None)
        kv_ready, q_ready, do_ready, lse_ready, delta_ready, qseg_ready, q_used, do_used, *turns = barriers
        wg = lax.axis_index("wg")

        @pl.when(wg < CONSUMERS)
        def _consumer() -> None:
            plgpu.set_max_registers(CONSUMER_REGISTERS, action="increase")

            def meet() -> None:
                plgpu.barrier_arrive(turns[0])
                plgpu.barrier_wait(turns[0])

            def load(visit: Visit, buf: jax.Array) -> None:
                b, hk = visit.b, visit.h
                rows = pl.ds(visit.row0(wg), WG_ROWS)
                ready = tile_ready(kv_ready, buf, wg)
                plgpu.copy_gmem_to_smem(k_ref.at[b, rows, hk], k_smem.at[buf, wg], ready)
                if with_dk:
                    plgpu.copy_gmem_to_smem(v_ref.at[b, rows, hk], v_smem.at[buf, wg], ready)
                if segmented:
                    plgpu.copy_gmem_to_smem(seg_ref.at[b, rows], tile_ids(buf, wg), ready)

            def process(visit: Visit, buf: jax.Array, t0: jax.Array) -> tuple[jax.Array, Any]:
                b, hk = visit.b, visit.h
                row0 = visit.row0(wg)
                k_seg = tile_segments(shape, tile_ids(buf, wg)) if segmented else None

                def step(r: jax.Array, j: jax.Array, t: jax.Array, acc: dict[str, jax.Array], kind: Mask) -> dict[str, jax.Array]:
                    acc = dict(acc)
                    # A one-slot ring's slot is a constant: per_step keeps its descriptors in the step too.
                    slot, do_slot = per_step(lax.rem(t, query_depth)), per_step(lax.rem(t, do_depth))
                    tile = per_step(buf)
                    my_k, my_v = k_smem.at[tile, wg], (v_smem.at[tile, wg] if with_dk else None)
                    for barrier in (lse_ready,) + ((delta_ready,) if with_dk else ()) + ((qseg_ready,) if segmented else ()):
                        plgpu.barrier_wait(barrier.at[slot])
                    plgpu.barrier_wait(q_ready.at[slot])
                    s_t = mma_new(shape, my_k, q_ring.at[slot], transpose_b=True, between=meet if pingpong else None)
                    lse = load_smem(shape, lse_ring.at[slot], col_layout())
                    p_t = jnp.exp2(s_t * shape.scale - lax.broadcast_in_dim(lse, s_t.shape, [1]))
                    if kind is not Mask.NONE:
                        segments = (load_smem(shape, qseg_ring.at[slot], col_layout()), k_seg) if kind is Mask.SEGMENTS else None
                        mask = visibility(shape, j * block_q, row0, WG_ROWS, block_q, segments, transpose=True)
                        if mask is not None:
                            p_t = jnp.where(mask, p_t, 0.0)
                    # dP before the dV product (delta loaded only now): P and dP in float32 die
                    # into 16-bit P and dS before dV and dK accumulate. Before kernel.per_step it
                    # spilled less at head dim 128 than the other way round; nothing since
                    # (causal; bench/ptxas_report.py).
                    plgpu.barrier_wait(do_ready.at[do_slot])
                    if with_dk:
                        dp_t = mma_new(shape, my_v, do_ring.at[do_slot], transpose_b=True)
                        delta = load_smem(shape, delta_ring.at[slot], col_layout())
                        ds_t = (p_t * (dp_t - lax.broadcast_in_dim(delta, dp_t.shape, [1]))).astype(dtype)
                    if pingpong:
                        plgpu.barrier_arrive(turns[0])  # dS done
                        plgpu.barrier_wait(turns[0])  # the other consumer's products are issued
                    if "dv" in acc:
                        acc["dv"] = mma_into(shape, acc["dv"], p_t.astype(dtype), do_ring.at[do_slot])
                    plgpu.barrier_arrive(do_used.at[do_slot])
                    if with_dk:
                        acc["dk"] = mma_into(shape, acc["dk"], ds_t, q_ring.at[slot])
                    plgpu.barrier_arrive(q_used.at[slot])
                    return acc

                zeros = cast(shape, jnp.zeros((WG_ROWS, dim), jnp.float32), plgpu.Layout.WGMMA)
                n = visit.steps
                if pingpong:
                    pl.when(wg == 1)(meet)
                # A loop, not an unrolled one: every copy of the walk is more code to compile.
                acc = lax.fori_loop(
                    0, group, lambda r, acc: walk(visit, functools.partial(step, r), acc, offset=t0 + r * n, masks=mask_loops(segmented, dim)),
                    {name: zeros for name in grads},
                )
                if pingpong:
                    pl.when(wg == 0)(meet)

                def write() -> None:
                    # The tiles just walked hold the results (dv in the key tile when alone).
                    my_k = k_smem.at[buf, wg]
                    staging = {"dk": my_k, "dv": v_smem.at[buf, wg] if with_dk else my_k}
                    scales = {"dk": shape.scale / LOG2E, "dv": 1.0}
                    for name in grads:
                        staging[name][...] = (acc[name] * scales[name]).astype(dtype)
                    plgpu.commit_smem()
                    rows = pl.ds(row0, WG_ROWS)
                    for name in grads:
                        plgpu.copy_smem_to_gmem(staging[name], grad_refs[name].at[b, rows, hk])

                return t0 + group * n, write

            consume_items(items, order_ref, plan_ref, buffers, kv_ready, load, process)

        @pl.when(wg == CONSUMERS)
        def _producer() -> None:
            plgpu.set_max_registers(PRODUCER_REGISTERS, action="decrease")

            def streams_of(b: jax.Array, hk: jax.Array) -> list[Any]:
                def block(j: jax.Array) -> Any:
                    return pl.ds(j * block_q, block_q)

                def head(r: jax.Array) -> jax.Array:
                    return hk * group + r

                streams = [
                    (lambda j, r: lse_ref.at[b, head(r), block(j)], lse_ring, lse_ready, q_used),
                    (lambda j, r: q_ref.at[b, block(j), head(r)], q_ring, q_ready, None),
                    (lambda j, r: do_ref.at[b, block(j), head(r)], do_ring, do_ready, do_used),
                ]
                if segmented:
                    streams.insert(1, (lambda j, r: seg_ref.at[b, block(j)], qseg_ring, qseg_ready, None))
                if with_dk:
                    streams.insert(1, (lambda j, r: delta_ref.at[b, head(r), block(j)], delta_ring, delta_ready, None))
                return streams[-1:] + streams[:-1] if query_depth == 1 else streams  # dO first: see _produce

            produce_items(items, order_ref, plan_ref, streams_of, [q_used, do_used], repeats=group)

    tile = smem_tile((buffers, CONSUMERS, WG_ROWS, dim), dtype)
    scratch = (tile,) * (2 if with_dk else 1) + (
        smem_tile((query_depth, block_q, dim), dtype),
        smem_tile((do_depth, block_q, dim), dtype),
        plgpu.SMEM((2, query_depth, block_q), jnp.float32),  # log-sum-exp, delta
    )
    if segmented:
        scratch += (ids_smem(buffers, query_depth, block_q),)
    queries = functools.partial(plgpu.Barrier, num_barriers=query_depth)
    barriers = (
        plgpu.Barrier(num_arrivals=1 + with_dk + segmented, num_barriers=buffers * CONSUMERS),
        queries(), plgpu.Barrier(num_barriers=do_depth), queries(), queries(), queries(),
        queries(num_arrivals=CONSUMERS),
        plgpu.Barrier(num_arrivals=CONSUMERS, num_barriers=do_depth),
    ) + ((plgpu.Barrier(num_arrivals=CONSUMERS),) if pingpong else ())
    operands = (q, k, v, do, lse, delta, plan, order) + ((segment_ids,) if segmented else ())
    out_type = tuple(jax.ShapeDtypeStruct(k.shape, dtype) for _ in grads)
    got = dict(zip(grads, launch(body, out_type, (scratch, barriers), items.programs, operands, shape.interpret)))
    return got.get("dk"), got.get("dv")


def dkv_passes(dim: int) -> tuple[tuple[str, ...], ...]:
    """The walks of the dk/dv kernel at this (padded) head dim: one accumulating both up to
    dim 128; above, a consumer's two float32 accumulators of ``64 x dim`` (256 registers per
    thread at dim 256) exceed its 240, so ``dv`` and ``dk`` take a walk each, the ``dv`` walk
    without the value tile, ``dP`` and ``delta``."""
    return (("dk", "dv"),) if dim <= 128 else (("dv",), ("dk",))
