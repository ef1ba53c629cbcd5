"""Flash attention on the Pallas Mosaic GPU backend, for Hopper (sm_90a).

Same function and conventions as :mod:`kernels.attention` (``[batch, seq, heads, dim]``,
grouped-query attention, causal, sliding window, segment ids with ids ``<= 0`` as padding; a
query that sees nothing gets output 0 and gradient 0; the log-sum-exp is kept in base 2 for
the backward), written for what the Triton backend cannot express:

- **Warp specialisation.** Each program (CTA) runs three warpgroups: two consumers that each
  own 64 rows of the program's 128-row tile and do the math with ``wgmma``, and one producer
  that only issues TMA copies. The producer gives most of its registers to the consumers.
- **A ring of shared-memory stages.** The producer streams the blocks the tile must visit into
  ``stages`` slots; a "ready" barrier per slot (completed by the TMA engine) and a "consumed"
  barrier per slot (two arrivals, one per consumer) keep the two sides in step. Keys and values
  have separate barriers so the next key block can land while the current ``P V`` runs.
- **A visiting plan instead of a mask over everything.** Outside the kernel, each tile gets the
  range ``[lo, hi)`` of blocks it must visit (from causal bounds, windows, padded keys and
  segment ids), inside it the run ``[a, c)`` of blocks that every row sees whole, and around
  that the run ``[u_lo, u_hi)`` of blocks that hold the tile's one document only. The kernel
  walks the blocks that need the segment ids' mask first, then those masked by positions alone
  (a document's diagonal; up to head dim 64, where the registers allow a third loop), then
  ``[a, c)`` without a mask: one loop per kind of mask, so the step's code is in the kernel
  once per kind, not once per range. Blocks outside ``[lo, hi)``
  are never loaded. With packed documents that skips every block pair of two different
  documents. Without segment ids the plan is a constant of the program. The plans, the kinds of
  mask and the walk live in :mod:`._mosaic_plan`.

- **Persistent programs.** At most one program per SM, each walking several tiles (dealt in
  sections whose blocks stay in L2, the costliest first within each, see :mod:`._mosaic_work`);
  the ring runs on from one tile to the next, and the next tile loads while the last one's
  results are written (:class:`Items`).

Kernels (an item is one tile of one head of one batch row):

- forward: items are query tiles of 128 rows; each walks key/value blocks with an online
  softmax in float32, base 2;
- backward, split in two kernels (the simplest split that needs no atomics and no
  per-query-head partials): ``dq`` over query tiles walking key/value blocks, and ``dk, dv``
  over key/value tiles of 128 rows walking, for each query head of its group, the query blocks
  that see it (above head dim 128, where a consumer cannot hold both accumulators, one walk
  for ``dv`` and one for ``dk``: :func:`_dkv_passes`). Where its tiles fit, the ``dq`` kernel
  also computes the softmax backward's row term ``delta = sum_d out * dO`` from the tiles it
  loads and hands it to ``dk, dv`` (see :func:`_dq_call`). The fused alternative (``fused_backward=True``) saves recomputing ``q k^T`` and
  ``dO v^T`` by adding each step's share of ``dq`` to float32 in global memory with TMA
  reduce-adds; it measured slower (see :func:`mosaic_backward`), so the split is the default.

The head dimension is padded to a multiple of 64 (the width of a 128-byte swizzled row of 16-bit
elements) outside the kernels. Sequences are walked in whole tiles without being copied to them:
TMA reads a tile's rows past the end as zeros and does not write them back (see :func:`_pad`).
Keys past the end are masked; queries past the end are never written.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import math
import os
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax
from jax._src import source_info_util  # no public API sets the location ops are traced with
from jax.experimental import pallas as pl
from jaxtyping import Array, Float, Int

from ejlabel import BwdParams, FwdParams

from ._mosaic_modules import share_modules_across_call_sites
from ._mosaic_plan import CONSUMERS, TILE, WG_ROWS, Mask, Shape, Visit, Window, mask_loops, visit_plan, walk
from ._mosaic_work import Items, deal_items
from ._pallas import MASK_VALUE, pad_axis

try:  # The Mosaic GPU backend may be missing from a JAX build; the module still imports.
    from jax.experimental.pallas import mosaic_gpu as plgpu
except ImportError:  # pragma: no cover - depends on the JAX build
    plgpu = None

if plgpu is not None:
    # Every layer's launch of a kernel shares one compiled module (see _mosaic_modules).
    share_modules_across_call_sites()

__all__ = [
    "WG_ROWS",
    "mosaic_attention",
    "mosaic_available",
    "mosaic_backward",
    "mosaic_fits",
    "mosaic_forward",
    "mosaic_supports",
    "on_hopper",
]

_LOG2E = math.log2(math.e)
_LN2 = math.log(2.0)
_DIM_MULTIPLE = 64  # 128-byte swizzle of 16-bit elements
_MAX_DIM = 256


def mosaic_available() -> bool:
    """Whether this JAX has the Mosaic GPU backend of Pallas."""
    return plgpu is not None


def on_hopper() -> bool:
    """Whether the default device is a Hopper GPU (compute capability 9.x), where wgmma runs."""
    if plgpu is None or jax.default_backend() != "gpu":
        return False
    capability = str(getattr(jax.devices()[0], "compute_capability", ""))
    return capability.startswith("9.")


def mosaic_supports(dtype: Any, dim: int) -> bool:
    """Whether the kernels, forward and backward, take this dtype and head dimension: 16-bit
    inputs, head dims up to 256 (above 128 the dk/dv kernel walks twice, see :func:`_dkv_passes`)."""
    padded = -(-dim // _DIM_MULTIPLE) * _DIM_MULTIPLE
    return jnp.dtype(dtype) in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16)) and 0 < padded <= _MAX_DIM


# --------------------------------------------------------------------------------------------
# Shared kernel pieces


def _smem_tile(shape: tuple[int, ...], dtype: Any) -> Any:
    """A shared-memory buffer laid out for TMA and wgmma: 8-row tiles, 128-byte swizzle."""
    elems = 128 // jnp.dtype(dtype).itemsize
    return plgpu.SMEM(shape, dtype, transforms=(plgpu.TilingTransform((8, elems)), plgpu.SwizzleTransform(128)))


def _row_layout() -> Any:
    return plgpu.Layout.WGMMA.reduce(1)


def _col_layout() -> Any:
    return plgpu.Layout.WGMMA.reduce(0)


def _cast(shape: Shape, x: jax.Array, layout: Any) -> jax.Array:
    """``x`` in a register layout; the interpreter has no layouts, so there it is ``x``."""
    return x if shape.interpret else plgpu.layout_cast(x, layout)


# Newer JAX releases take the index as part of the ref (``ref.at[idx]``) and deprecate passing it
# to ``load``; older ones require it.
_LOAD_INDEX = None if plgpu is None else inspect.signature(plgpu.load).parameters.get("idx")
_LOAD_INDEX_OPTIONAL = _LOAD_INDEX is None or _LOAD_INDEX.default is not inspect.Parameter.empty


def _load(shape: Shape, ref: Any, layout: Any) -> jax.Array:
    """A whole shared-memory ref, loaded into ``layout``."""
    if shape.interpret:
        return ref[...]
    return plgpu.load(ref, layout=layout) if _LOAD_INDEX_OPTIONAL else plgpu.load(ref, (), layout=layout)


def _visibility(
    shape: Shape, q_start: jax.Array, k_start: jax.Array, rows: int, cols: int,
    segments: tuple[jax.Array, jax.Array] | None, *, transpose: bool,
) -> jax.Array | None:
    """``[rows, cols]`` mask in the wgmma layout: rows are queries (keys with ``transpose``);
    ``segments`` are the query and key ids, in the row and column layouts of that matrix."""
    r = _cast(shape, lax.broadcasted_iota(jnp.int32, (rows, cols), 0), plgpu.Layout.WGMMA)
    c = _cast(shape, lax.broadcasted_iota(jnp.int32, (rows, cols), 1), plgpu.Layout.WGMMA)
    q_pos, k_pos = (c + q_start, r + k_start) if transpose else (r + q_start, c + k_start)
    conditions = []
    left, right = shape.bounds
    if right is not None:
        conditions.append(k_pos <= q_pos + right)
    if left is not None:
        conditions.append(k_pos >= q_pos - left)
    if shape.kv_len is not None:
        conditions.append(k_pos < shape.kv_len)
    if segments is not None:
        q_seg, k_seg = segments
        q_dim, k_dim = (1, 0) if transpose else (0, 1)
        qs = lax.broadcast_in_dim(q_seg, (rows, cols), [q_dim])
        ks = lax.broadcast_in_dim(k_seg, (rows, cols), [k_dim])
        conditions.append((qs == ks) & (qs > 0))
    return functools.reduce(jnp.logical_and, conditions) if conditions else None


def _tile_ready(barriers: Any, buf: jax.Array, wg: jax.Array) -> Any:
    """The barrier of consumer ``wg``'s tile in buffer ``buf`` (``buffers x consumers`` of them)."""
    return barriers.at[buf * CONSUMERS + wg]


def _wait_for_tile(barriers: Any, buf: jax.Array, wg: jax.Array) -> None:
    """Wait until consumer ``wg``'s tile in buffer ``buf`` has arrived (a profiler region)."""
    with jax.named_scope("tile_wait"):
        plgpu.barrier_wait(_tile_ready(barriers, buf, wg))


def _key_value_streams(
    k_ref: Any, v_ref: Any, seg_ref: Any, rings: tuple[Any, ...], barriers: tuple[Any, ...], block_k: int, group: int, *, values_first: bool = False,
) -> Any:
    """``streams_of(b, h)`` for :func:`_produce_items` of the kernels that walk key/value blocks
    (forward and dq): the key, value and (with ``seg_ref``) key segment-id blocks of query head
    ``h``'s key/value head. ``rings``: ``(k, v, kseg)``; ``barriers``: ``(k_ready, v_ready,
    k_used, v_used, kseg_ready)``. Slots of the segment ring are freed with the key slots."""
    k_ring, v_ring, kseg_ring = rings
    k_ready, v_ready, k_used, v_used, kseg_ready = barriers

    def streams_of(b: jax.Array, h: jax.Array) -> list[Any]:
        kv_head = lax.div(h, jnp.int32(group))
        streams = [
            (lambda j, _: k_ref.at[b, pl.ds(j * block_k, block_k), kv_head], k_ring, k_ready, k_used),
            (lambda j, _: v_ref.at[b, pl.ds(j * block_k, block_k), kv_head], v_ring, v_ready, v_used),
        ]
        if seg_ref is not None:
            streams.insert(1, (lambda j, _: seg_ref.at[b, pl.ds(j * block_k, block_k)], kseg_ring, kseg_ready, None))
        return streams[-1:] + streams[:-1] if values_first else streams

    return streams_of


def _produce(
    visit: Visit, stages: int,
    streams: list[tuple[Any, Any, Any, Any]], *, offset: jax.Array, repeats: int = 1,
) -> jax.Array:
    """The producer warpgroup's part of one item: for every planned block, TMA each stream's
    block into its ring; returns the steps taken.

    ``streams``: ``(source(j, r) -> gmem ref, ring, ready barriers, consumed barriers)``; a slot
    is refilled only after both consumers arrived on its consumed barrier (streams with None
    there are freed with the stream before them), in the order of ``streams``. With one stage
    the kernels put first the stream their consumers free mid-step (values in the dq kernel,
    ``dO`` in the dk walk), so its next block loads during the rest of the step, not after it:
    fwd+bwd 2.8% faster at causal B2 S4096 H8 D256 on the H100 (bench/RESULTS.md run 141).
    The planned blocks are walked ``repeats`` times, ``r`` counting the walks (the query heads
    of a group in the backward). ``offset`` counts the steps of the program's earlier items:
    the ring runs on across items.
    """
    n = visit.steps

    def body(t: jax.Array, carry: Any) -> Any:
        step = offset + t
        slot = lax.rem(step, stages)
        r, j = (jnp.int32(0), visit.block(t)) if repeats == 1 else (lax.div(t, n), visit.block(lax.rem(t, n)))
        for source, ring, ready, consumed in streams:
            if consumed is not None:
                with jax.named_scope("slot_wait"):
                    pl.when(step >= stages)(functools.partial(plgpu.barrier_wait, consumed.at[slot]))
            plgpu.copy_gmem_to_smem(source(j, r), ring.at[slot], ready.at[slot])
        return carry

    steps = repeats * n
    lax.fori_loop(0, steps, body, None)
    return steps


def _drain(consumed: list[Any], stages: int, steps: jax.Array) -> None:
    """Wait for the consumers' last ``stages`` consumptions, so every barrier phase is observed
    before the program's shared memory goes away (the interpreter checks it; on the GPU it is free)."""

    def body(t: jax.Array, carry: Any) -> Any:
        for barrier in consumed:
            plgpu.barrier_wait(barrier.at[lax.rem(t, stages)])
        return carry

    lax.fori_loop(jnp.maximum(steps - stages, 0), steps, body, None)


def _key_value_items(plan: jax.Array, heads: int, persistent: bool, shape: Shape, segmented: bool, k: jax.Array) -> tuple[Items, jax.Array]:
    """:func:`deal_items` of the kernels that walk key/value blocks (forward and dq): a batch row
    streams its keys and values, ``k`` of ``[batch, seq_kv, kv_heads, dim]`` and as many values."""
    streamed = 2 * math.prod(k.shape[1:]) * jnp.dtype(k.dtype).itemsize
    return deal_items(plan, heads, persistent, shape.interpret, segmented=segmented, kv_heads=k.shape[2], batch_row_bytes=streamed)


def _fits_exactly(*buffer_bytes: int) -> bool:
    """Whether a kernel's buffers of these sizes (every one of them) fit in shared memory, each
    aligned to 1 KiB as Pallas places them, with 1 KiB to spare for the barriers."""
    return sum(-(-n // 1024) * 1024 for n in buffer_bytes) + 1024 <= _SMEM_LIMIT


def _tile_buffers(tile_bytes: int, ring_bytes: int) -> int:
    """Buffers for a program's tile: two (the next item's tile loads during this one) when they
    fit in shared memory beside the ring, else one."""
    return 2 if 2 * tile_bytes + ring_bytes <= _SMEM_BYTES else 1


def _consume_items(
    items: Items, order_ref: Any, plan_ref: Any, buffers: int, ready: Any, load: Any, process: Any, *, staged_apart: bool = False,
) -> None:
    """A consumer warpgroup's walk over its program's items.

    ``load(visit, buf)`` starts the copies of an item's tile into buffer ``buf``, completing
    ``ready`` (see :func:`_tile_ready`); ``process(visit, buf, t0) -> (t1, write)`` walks the
    item's blocks (producer steps ``t0 .. t1``) and returns ``write()``, which puts the item's
    results into the buffer's shared memory and starts their copies out. With two buffers the
    next item's tile is requested as soon as this one has arrived (once the previous item's
    results have left the other buffer), so it loads during this item's walk; with one buffer
    it follows the results. Requesting it early instead of after the walk took the wait for a
    tile from about 3000 SM cycles per item to 140 (H100, bench/profile_mosaic.py), at the
    price of waiting for the previous item's results to leave (about 500).
    With ``staged_apart`` the results have a shared-memory buffer of their own, so the next
    tile is requested without that wait, and the results' buffer is checked free just before
    the next write, a whole walk later.
    """
    mine = items.mine()
    wg = lax.axis_index("wg")
    first = items.visit(order_ref, plan_ref, 0)
    pl.when(mine > 0)(lambda: load(first, jnp.int32(0)))

    def results_left() -> None:
        # Results leave shared memory asynchronously: before a buffer is reused (the other
        # tile buffer, or the one-row outputs every item writes), the reads must be done.
        with jax.named_scope("out_wait"):
            plgpu.wait_smem_to_gmem(0, wait_read_only=True)

    def body(i: jax.Array, carry: tuple[jax.Array, ...]) -> tuple[jax.Array, ...]:
        t0, visit = carry[0], Visit(*carry[1:])
        upcoming = items.visit(order_ref, plan_ref, i + 1)
        buf = lax.rem(i, buffers)

        def prefetch() -> None:
            load(upcoming, lax.rem(i + 1, buffers))

        _wait_for_tile(ready, buf, wg)
        if buffers > 1:
            if not staged_apart:
                results_left()
            pl.when(i + 1 < mine)(prefetch)
        t1, write = process(visit, buf, t0)
        if staged_apart:
            results_left()
        with jax.named_scope("write"):
            write()
        if buffers == 1:
            results_left()
            pl.when(i + 1 < mine)(prefetch)
        return (t1, *upcoming)

    lax.fori_loop(0, mine, body, (jnp.int32(0), *first))
    plgpu.wait_smem_to_gmem(0)


def _produce_items(
    items: Items, order_ref: Any, plan_ref: Any, stages: int, streams_of: Any, consumed: list[Any], repeats: int = 1,
) -> None:
    """The producer warpgroup's walk: ``streams_of(b, h)`` gives an item's streams (see
    :func:`_produce`), ``consumed`` the barriers the consumers free ring slots on."""

    def body(i: jax.Array, carry: tuple[jax.Array, ...]) -> tuple[jax.Array, ...]:
        t0, visit = carry[0], Visit(*carry[1:])
        upcoming = items.visit(order_ref, plan_ref, i + 1)
        t1 = t0 + _produce(visit, stages, streams_of(visit.b, visit.h), offset=t0, repeats=repeats)
        return (t1, *upcoming)

    steps = lax.fori_loop(0, items.mine(), body, (jnp.int32(0), *items.visit(order_ref, plan_ref, 0)))[0]
    _drain(consumed, stages, steps)


def _operand(x: Any) -> jax.Array:
    return x if isinstance(x, jax.Array) else x[...]


def _mma_new(shape: Shape, a: Any, b: Any, *, transpose_b: bool, between: Any = None) -> jax.Array | tuple[jax.Array, Any]:
    """``a @ b`` (``b^T`` with ``transpose_b``) into a fresh float32 accumulator: ``a`` in
    shared memory or registers, ``b`` in shared memory, the product with wgmma. ``between()``,
    if given, runs after the wgmma is issued and before its result is awaited (CUDA-core work
    beside the tensor cores'); what it returns, if not None, comes back as ``(product, it)``."""
    return _mma_sum(shape, [(a, b)], transpose_b=transpose_b, between=between)


def _mma_sum(
    shape: Shape, products: list[tuple[Any, Any]], *, transpose_b: bool, transpose_a: bool = False, between: Any = None,
) -> jax.Array | tuple[jax.Array, Any]:
    """The sum of ``a @ b`` over ``products`` in one fresh float32 accumulator, one wgmma each
    (operands as in :func:`_mma_new`; ``a^T`` with ``transpose_a``, then from shared memory).

    The interpreter cannot take transposed shared-memory operands, so there the same products
    are ordinary dots of the loaded values.
    """
    if shape.interpret:
        dims = (((0 if transpose_a else 1,), (1 if transpose_b else 0,)), ((), ()))
        out = sum(lax.dot_general(_operand(a), b[...], dims, preferred_element_type=jnp.float32) for a, b in products)
        extra = between() if between is not None else None
        return out if extra is None else (out, extra)
    a, b = products[0]
    rows = a.shape[1] if transpose_a else a.shape[0]
    cols = b.shape[0] if transpose_b else b.shape[1]

    def run(acc_ref: Any) -> Any:
        for a, b in products:
            plgpu.wgmma(acc_ref, a.transpose((1, 0)) if transpose_a else a, b.transpose((1, 0)) if transpose_b else b)
        extra = between() if between is not None else None
        return acc_ref[...], extra

    acc, extra = pl.run_scoped(run, plgpu.ACC((rows, cols), jnp.float32))
    return acc if extra is None else (acc, extra)


def _mma_into(shape: Shape, acc: jax.Array, a: Any, b: Any) -> jax.Array:
    """``acc + a @ b``, the wgmma accumulating in ``acc``'s registers (``run_state``)."""
    if shape.interpret:
        return acc + lax.dot_general(_operand(a), b[...], (((1,), (0,)), ((), ())), preferred_element_type=jnp.float32)

    def run(acc_ref: Any) -> None:
        plgpu.wgmma(acc_ref, a, b)

    return pl.run_state(run)(plgpu.ACC.init(acc))


PROFILE_DIR_VARIABLE = "EJLABEL_MOSAIC_PROFILE_DIR"


def _profiled() -> bool:
    """Whether kernels traced now record their named regions (see :func:`_compiler_params`)."""
    return bool(os.environ.get(PROFILE_DIR_VARIABLE))


def _compiler_params() -> Any:
    """Approximate math for ``exp2``; with ``$EJLABEL_MOSAIC_PROFILE_DIR`` set when a kernel is
    traced, each call writes a trace of the kernel's named regions (per warpgroup: ``tile_wait``,
    ``walk`` and the ``masked`` steps inside it, ``k_wait``, ``out_wait``, ``write``, the
    producer's ``slot_wait``) to that directory (read by bench/profile_mosaic.py). The regions
    cost nothing when it is unset. The events sit in shared memory, 512 a warpgroup, and more
    are undefined behaviour: profile short walks only (causal S4096, 32 steps a tile and about
    15 tiles a program, stopped on an illegal address, bench/RESULTS.md run 120).

    No shared memory is set aside for reductions across warps (Pallas reserves 2 KiB by
    default): every reduction here runs along the rows of the wgmma layout, whose elements
    sit in one warp, and a reduction that needed the scratch would fail to lower. The forward
    at head dim 128 needs those bytes for its results' own buffer (:func:`_forward_call`)."""
    directory = os.environ.get(PROFILE_DIR_VARIABLE)
    profile = {"profile_space": 512, "profile_dir": directory} if directory else {}
    return plgpu.CompilerParams(approx_math=True, reduction_scratch_bytes=0, **profile)


def _interpret_params() -> Any:
    """The Mosaic GPU interpreter's parameters (a private class in the JAX releases we use):
    it simulates shared memory, barriers, TMA and wgmma on the CPU, so values are tested there."""
    public = getattr(plgpu, "InterpretParams", None)
    if public is not None:
        return public()
    from jax._src.pallas.mosaic_gpu.interpret.params import InterpretGPUParams

    return InterpretGPUParams()


# 24 x 128 + 2 x 240 x 128 = 64512 of the SM's 65536 registers. The producer only issues copies;
# 240 rather than 232 per consumer cut the dk/dv kernel's spills at head dim 128 by a fifth.
_CONSUMER_REGISTERS = 240
_PRODUCER_REGISTERS = 24


# --------------------------------------------------------------------------------------------
# Forward


def _forward_call(
    q: jax.Array, k: jax.Array, v: jax.Array, plan: jax.Array, segment_ids: jax.Array | None,
    shape: Shape, *, block_k: int, stages: int | None, pingpong: bool = False, persistent: bool = True,
) -> tuple[jax.Array, jax.Array]:
    """``(out [batch, seq_q, heads, dim], lse [batch, heads, seq_q])`` on padded operands.

    Items are query tiles of one head (see :class:`Items`). ``pingpong``: the two consumers
    meet at a two-arrival barrier twice per step (after issuing ``q k^T``, and after the
    softmax), offset by half a step, so one's softmax runs while the other's matrix products
    use the tensor cores. Both walk the same blocks, so their meetings pair up; per item,
    consumer 1 meets once before its loop and consumer 0 once after.
    """
    batch, seq_q, heads, dim = q.shape
    dtype = q.dtype
    segmented = segment_ids is not None
    row_bytes = dim * jnp.dtype(dtype).itemsize
    items, order = _key_value_items(plan, heads, persistent, shape, segmented, k)
    stages = _ring_stages(stages, TILE * row_bytes, 2 * block_k * row_bytes)
    tile_bytes, ring_bytes = TILE * row_bytes, stages * 2 * block_k * row_bytes
    buffers = _tile_buffers(tile_bytes, ring_bytes)
    # The small buffers: the log-sum-exp rows and, with segment ids, the ids of the query tiles
    # and of the ring's key blocks.
    small = (4 * CONSUMERS * WG_ROWS,) + ((4 * buffers * CONSUMERS * WG_ROWS, 4 * stages * block_k) if segmented else ())
    # Results in a buffer of their own (see _consume_items) where they fit, above head dim 64:
    # there the causal D128 forward ran 0.4-1.7% faster with it, in three interleaved runs on
    # the H100, and the packed D64 forward 0.5-3.1% slower (bench/RESULTS.md, runs 79-81).
    # The profiler's buffers take shared memory too: a profiled kernel stages its results in the
    # query buffer.
    staged_apart = dim > 64 and buffers == 2 and not _profiled() and _fits_exactly(3 * tile_bytes, ring_bytes, *small)

    def body(q_ref: Any, k_ref: Any, v_ref: Any, plan_ref: Any, order_ref: Any, *refs: Any) -> None:
        if segmented:
            seg_ref, out_ref, lse_ref, scratch, barriers = refs
        else:
            (out_ref, lse_ref, scratch, barriers), seg_ref = refs, None
        q_smem, k_ring, v_ring, *rest = scratch
        out_smem = rest.pop(0) if staged_apart else None
        lse_smem = rest.pop(0)
        qseg_smem, kseg_ring = rest if segmented else (None, None)
        q_ready, k_ready, v_ready, k_used, v_used, kseg_ready, turn = barriers
        wg = lax.axis_index("wg")

        @pl.when(wg < CONSUMERS)
        def _consumer() -> None:
            plgpu.set_max_registers(_CONSUMER_REGISTERS, action="increase")

            def meet() -> None:
                plgpu.barrier_arrive(turn)
                plgpu.barrier_wait(turn)

            def load(visit: Visit, buf: jax.Array) -> None:
                b, h = visit.b, visit.h
                rows = pl.ds(visit.row0(wg), WG_ROWS)
                ready = _tile_ready(q_ready, buf, wg)
                plgpu.copy_gmem_to_smem(q_ref.at[b, rows, h], q_smem.at[buf, wg], ready)
                if segmented:
                    plgpu.copy_gmem_to_smem(seg_ref.at[b, rows], qseg_smem.at[buf, wg], ready)

            def process(visit: Visit, buf: jax.Array, t0: jax.Array) -> tuple[jax.Array, Any]:
                b, h = visit.b, visit.h
                row0 = visit.row0(wg)
                my_q = q_smem.at[buf, wg]
                q_seg = _load(shape, qseg_smem.at[buf, wg], _row_layout()) if segmented else None

                def step(j: jax.Array, t: jax.Array, carry: Any, kind: Mask) -> Any:
                    acc, m, l = carry
                    slot = lax.rem(t, stages)
                    segments = None
                    if segmented:
                        plgpu.barrier_wait(kseg_ready.at[slot])
                        if kind is Mask.SEGMENTS:
                            segments = (q_seg, _load(shape, kseg_ring.at[slot], _col_layout()))
                    with jax.named_scope("k_wait"):
                        plgpu.barrier_wait(k_ready.at[slot])

                    s = _mma_new(shape, my_q, k_ring.at[slot], transpose_b=True, between=meet if pingpong else None)
                    plgpu.barrier_arrive(k_used.at[slot])
                    s = s * shape.scale
                    masked = kind is not Mask.NONE
                    mask = _visibility(shape, row0, j * block_k, WG_ROWS, block_k, segments, transpose=False) if masked else None
                    if mask is not None:
                        s = jnp.where(mask, s, MASK_VALUE)
                    m_new = jnp.maximum(m, s.max(axis=1))
                    alpha = jnp.exp2(m - m_new)
                    p = jnp.exp2(s - lax.broadcast_in_dim(m_new, s.shape, [0]))
                    if mask is not None:
                        # A row with nothing visible yet has m_new == MASK_VALUE and exp2(0) == 1.
                        p = jnp.where(mask, p, 0.0)
                    l = l * alpha + p.sum(axis=1)
                    acc = acc * lax.broadcast_in_dim(alpha, acc.shape, [0])
                    p16 = p.astype(dtype)
                    if pingpong:
                        plgpu.barrier_arrive(turn)  # softmax done
                    plgpu.barrier_wait(v_ready.at[slot])
                    if pingpong:
                        plgpu.barrier_wait(turn)  # the other consumer's products are issued
                    acc = _mma_into(shape, acc, p16, v_ring.at[slot])
                    plgpu.barrier_arrive(v_used.at[slot])
                    return acc, m_new, l

                init = (
                    _cast(shape, jnp.zeros((WG_ROWS, dim), jnp.float32), plgpu.Layout.WGMMA),
                    _cast(shape, jnp.full((WG_ROWS,), MASK_VALUE, jnp.float32), _row_layout()),
                    _cast(shape, jnp.zeros((WG_ROWS,), jnp.float32), _row_layout()),
                )
                if pingpong:
                    pl.when(wg == 1)(meet)
                acc, m, l = walk(visit, step, init, offset=t0, masks=mask_loops(segmented, dim))
                if pingpong:
                    pl.when(wg == 0)(meet)
                seen = l > 0.0
                safe_l = jnp.where(seen, l, 1.0)
                inv = jnp.where(seen, 1.0 / safe_l, 0.0)

                def write() -> None:
                    staging = out_smem.at[wg] if staged_apart else my_q
                    staging[...] = (acc * lax.broadcast_in_dim(inv, acc.shape, [0])).astype(dtype)
                    # Rows that see nothing get any finite value: every use of it is masked.
                    lse_smem.at[wg][...] = jnp.where(seen, m + jnp.log(safe_l) * (1.0 / _LN2), 0.0)
                    plgpu.commit_smem()
                    plgpu.copy_smem_to_gmem(staging, out_ref.at[b, pl.ds(row0, WG_ROWS), h])
                    plgpu.copy_smem_to_gmem(lse_smem.at[wg], lse_ref.at[b, h, pl.ds(row0, WG_ROWS)])

                return t0 + visit.steps, write

            _consume_items(items, order_ref, plan_ref, buffers, q_ready, load, process, staged_apart=staged_apart)

        @pl.when(wg == CONSUMERS)
        def _producer() -> None:
            plgpu.set_max_registers(_PRODUCER_REGISTERS, action="decrease")

            streams_of = _key_value_streams(
                k_ref, v_ref, seg_ref, (k_ring, v_ring, kseg_ring), (k_ready, v_ready, k_used, v_used, kseg_ready), block_k, shape.group,
            )
            _produce_items(items, order_ref, plan_ref, stages, streams_of, [k_used, v_used])

    # The 128-byte-swizzled buffers first (each a multiple of 1024 bytes), the small ones last.
    scratch = (
        _smem_tile((buffers, CONSUMERS, WG_ROWS, dim), dtype),
        _smem_tile((stages, block_k, dim), dtype),
        _smem_tile((stages, block_k, dim), dtype),
        plgpu.SMEM((CONSUMERS, WG_ROWS), jnp.float32),
    )
    if staged_apart:
        scratch = scratch[:3] + (_smem_tile((CONSUMERS, WG_ROWS, dim), dtype),) + scratch[3:]
    if segmented:
        scratch += (plgpu.SMEM((buffers, CONSUMERS, WG_ROWS), jnp.int32), plgpu.SMEM((stages, block_k), jnp.int32))
    barriers = (
        plgpu.Barrier(num_arrivals=2 if segmented else 1, num_barriers=buffers * CONSUMERS),
        plgpu.Barrier(num_barriers=stages),
        plgpu.Barrier(num_barriers=stages),
        plgpu.Barrier(num_arrivals=CONSUMERS, num_barriers=stages),
        plgpu.Barrier(num_arrivals=CONSUMERS, num_barriers=stages),
        plgpu.Barrier(num_barriers=stages),
        plgpu.Barrier(num_arrivals=CONSUMERS),
    )
    operands = (q, k, v, plan, order) + ((segment_ids,) if segmented else ())
    # The log-sum-exp rows over whole tiles: a TMA row stride must be a multiple of 16 bytes.
    out_type = (jax.ShapeDtypeStruct(q.shape, dtype), jax.ShapeDtypeStruct((batch, heads, plan.shape[2] * TILE), jnp.float32))
    return _launch(body, out_type, (scratch, barriers), items.programs, operands, shape.interpret)


# --------------------------------------------------------------------------------------------
# Backward


# Up to this head dim the dq kernel's softmax runs while the tensor cores compute dP; above it,
# before dP is issued. Beside dP, the probabilities, dP's accumulator and the 64 x 256 float32 dq
# exceed a consumer's registers: at head dim 256 the kernel spilled 1352 bytes per thread with
# the softmax beside dP, 848 with it before, and causal B2 S4096 H8 D256 fwd+bwd ran 2.45 ms
# against 1.83 (H100, bench/RESULTS.md run 142).
SOFTMAX_BESIDE_DP_MAX_DIM = 128


def _dq_tiles(dim: int, dtype: Any, block_k: int, stages: int) -> tuple[int, bool]:
    """``(buffers, computes_delta)`` of the dq kernel's tiles: the kernel reads the forward's
    output tile beside ``q`` and ``dO`` and computes ``delta`` itself only where the three
    still fit twice beside the ring (see :func:`_dq_call`); else ``delta`` comes in."""
    row_bytes = dim * jnp.dtype(dtype).itemsize
    ring_bytes = stages * 2 * block_k * row_bytes
    if _tile_buffers(3 * TILE * row_bytes, ring_bytes) == 2:
        return 2, True
    return _tile_buffers(2 * TILE * row_bytes, ring_bytes), False


def _delta(out: jax.Array, do: jax.Array) -> Float[Array, "batch heads seq_q"]:
    """``delta_i = sum_d out_id * dO_id``, the row term of the softmax backward, in float32."""
    return jnp.einsum("bqhd,bqhd->bhq", out.astype(jnp.float32), do.astype(jnp.float32))


def _dq_call(
    q: jax.Array, k: jax.Array, v: jax.Array, do: jax.Array, lse: jax.Array, out: jax.Array,
    plan: jax.Array, segment_ids: jax.Array | None, shape: Shape, *, block_k: int, stages: int | None, persistent: bool = True,
) -> tuple[jax.Array, jax.Array]:
    """``(dq [batch, seq_q, heads, dim], delta [batch, heads, seq_q])``: items are 128-row query
    tiles of one head, walking the key/value blocks of the plan; ``p`` is rebuilt from the saved
    log-sum-exp; ``delta`` (see :func:`_delta`) goes on to the dk/dv kernel.

    Where :func:`_dq_tiles` says so, each item computes its rows' ``delta`` from its tile of
    ``out`` (loaded beside ``q`` and ``dO``) and writes it out: that replaces a reduction over
    all of ``out`` and ``dO`` before the kernel (18.6 us a layer at the packed model's shape on
    the H100, run 71). Else that reduction runs first and the kernel loads ``delta``.
    """
    batch, seq_q, heads, dim = q.shape
    dtype = q.dtype
    segmented = segment_ids is not None
    items, order = _key_value_items(plan, heads, persistent, shape, segmented, k)
    row_bytes = dim * jnp.dtype(dtype).itemsize
    stages = _ring_stages(stages, 2 * TILE * row_bytes, 2 * block_k * row_bytes)
    buffers, computes_delta = _dq_tiles(dim, dtype, block_k, stages)
    out_or_delta = out if computes_delta else pad_axis(_delta(out, do), 2, lse.shape[2])

    def body(q_ref: Any, k_ref: Any, v_ref: Any, do_ref: Any, lse_ref: Any, in_ref: Any, plan_ref: Any, order_ref: Any, *refs: Any) -> None:
        refs = list(refs)
        seg_ref = refs.pop(0) if segmented else None
        dq_ref = refs.pop(0)
        delta_out_ref = refs.pop(0) if computes_delta else None
        scratch, barriers = refs
        q_smem, do_smem, k_ring, v_ring, lse_smem, delta_smem, qseg_smem, kseg_ring, *rest = scratch
        o_smem = rest[0] if computes_delta else None
        q_ready, k_ready, v_ready, k_used, v_used, kseg_ready = barriers
        wg = lax.axis_index("wg")

        @pl.when(wg < CONSUMERS)
        def _consumer() -> None:
            plgpu.set_max_registers(_CONSUMER_REGISTERS, action="increase")

            def load(visit: Visit, buf: jax.Array) -> None:
                b, h = visit.b, visit.h
                rows = pl.ds(visit.row0(wg), WG_ROWS)
                # One barrier, several copies: it expects one arrival per copy.
                ready = _tile_ready(q_ready, buf, wg)
                plgpu.copy_gmem_to_smem(q_ref.at[b, rows, h], q_smem.at[buf, wg], ready)
                plgpu.copy_gmem_to_smem(do_ref.at[b, rows, h], do_smem.at[buf, wg], ready)
                plgpu.copy_gmem_to_smem(lse_ref.at[b, h, rows], lse_smem.at[buf, wg], ready)
                if computes_delta:
                    plgpu.copy_gmem_to_smem(in_ref.at[b, rows, h], o_smem.at[buf, wg], ready)
                else:
                    plgpu.copy_gmem_to_smem(in_ref.at[b, h, rows], delta_smem.at[buf, wg], ready)
                if segmented:
                    plgpu.copy_gmem_to_smem(seg_ref.at[b, rows], qseg_smem.at[buf, wg], ready)

            def own_delta(visit: Visit, buf: jax.Array) -> jax.Array:
                """This item's rows of ``delta`` from its output and ``dO`` tiles, also sent
                out to the dk/dv kernel."""
                with jax.named_scope("delta"):
                    out = _load(shape, o_smem.at[buf, wg], plgpu.Layout.WGMMA).astype(jnp.float32)
                    do = _load(shape, do_smem.at[buf, wg], plgpu.Layout.WGMMA).astype(jnp.float32)
                    delta = _cast(shape, (out * do).sum(axis=1), _row_layout())
                    delta_smem.at[buf, wg][...] = delta
                    plgpu.commit_smem()
                    plgpu.copy_smem_to_gmem(delta_smem.at[buf, wg], delta_out_ref.at[visit.b, visit.h, pl.ds(visit.row0(wg), WG_ROWS)])
                return delta

            def process(visit: Visit, buf: jax.Array, t0: jax.Array) -> tuple[jax.Array, Any]:
                b, h = visit.b, visit.h
                row0 = visit.row0(wg)
                my_q, my_do = q_smem.at[buf, wg], do_smem.at[buf, wg]
                lse = _load(shape, lse_smem.at[buf, wg], _row_layout())
                delta = own_delta(visit, buf) if computes_delta else _load(shape, delta_smem.at[buf, wg], _row_layout())
                q_seg = _load(shape, qseg_smem.at[buf, wg], _row_layout()) if segmented else None

                def step(j: jax.Array, t: jax.Array, dq: jax.Array, kind: Mask) -> jax.Array:
                    slot = lax.rem(t, stages)
                    segments = None
                    if segmented:
                        plgpu.barrier_wait(kseg_ready.at[slot])
                        if kind is Mask.SEGMENTS:
                            segments = (q_seg, _load(shape, kseg_ring.at[slot], _col_layout()))
                    plgpu.barrier_wait(k_ready.at[slot])
                    s = _mma_new(shape, my_q, k_ring.at[slot], transpose_b=True)

                    def probabilities() -> jax.Array:
                        p = jnp.exp2(s * shape.scale - lax.broadcast_in_dim(lse, s.shape, [0]))
                        if kind is not Mask.NONE:
                            mask = _visibility(shape, row0, j * block_k, WG_ROWS, block_k, segments, transpose=False)
                            if mask is not None:
                                p = jnp.where(mask, p, 0.0)
                        return p

                    if dim <= SOFTMAX_BESIDE_DP_MAX_DIM:
                        plgpu.barrier_wait(v_ready.at[slot])
                        # The softmax runs while the tensor cores compute dP.
                        dp, p = _mma_new(shape, my_do, v_ring.at[slot], transpose_b=True, between=probabilities)
                    else:
                        p = probabilities()
                        plgpu.barrier_wait(v_ready.at[slot])
                        dp = _mma_new(shape, my_do, v_ring.at[slot], transpose_b=True)
                    plgpu.barrier_arrive(v_used.at[slot])
                    ds = (p * (dp - lax.broadcast_in_dim(delta, dp.shape, [0]))).astype(dtype)
                    dq = _mma_into(shape, dq, ds, k_ring.at[slot])
                    plgpu.barrier_arrive(k_used.at[slot])
                    return dq

                zeros = _cast(shape, jnp.zeros((WG_ROWS, dim), jnp.float32), plgpu.Layout.WGMMA)
                dq = walk(visit, step, zeros, offset=t0, masks=mask_loops(segmented, dim))

                def write() -> None:
                    my_q[...] = (dq * (shape.scale / _LOG2E)).astype(dtype)
                    plgpu.commit_smem()
                    plgpu.copy_smem_to_gmem(my_q, dq_ref.at[b, pl.ds(row0, WG_ROWS), h])

                return t0 + visit.steps, write

            _consume_items(items, order_ref, plan_ref, buffers, q_ready, load, process)

        @pl.when(wg == CONSUMERS)
        def _producer() -> None:
            plgpu.set_max_registers(_PRODUCER_REGISTERS, action="decrease")

            streams_of = _key_value_streams(
                k_ref, v_ref, seg_ref, (k_ring, v_ring, kseg_ring), (k_ready, v_ready, k_used, v_used, kseg_ready), block_k, shape.group,
                values_first=stages == 1,  # see _produce
            )
            _produce_items(items, order_ref, plan_ref, stages, streams_of, [k_used, v_used])

    copies = 5 if segmented else 4
    scratch = (
        _smem_tile((buffers, CONSUMERS, WG_ROWS, dim), dtype),
        _smem_tile((buffers, CONSUMERS, WG_ROWS, dim), dtype),
        _smem_tile((stages, block_k, dim), dtype),
        _smem_tile((stages, block_k, dim), dtype),
        plgpu.SMEM((buffers, CONSUMERS, WG_ROWS), jnp.float32),
        plgpu.SMEM((buffers, CONSUMERS, WG_ROWS), jnp.float32),
        plgpu.SMEM((buffers, CONSUMERS, WG_ROWS), jnp.int32),
        plgpu.SMEM((stages, block_k), jnp.int32),
    ) + ((_smem_tile((buffers, CONSUMERS, WG_ROWS, dim), dtype),) if computes_delta else ())
    barriers = (
        plgpu.Barrier(num_arrivals=copies, num_barriers=buffers * CONSUMERS),
        plgpu.Barrier(num_barriers=stages),
        plgpu.Barrier(num_barriers=stages),
        plgpu.Barrier(num_arrivals=CONSUMERS, num_barriers=stages),
        plgpu.Barrier(num_arrivals=CONSUMERS, num_barriers=stages),
        plgpu.Barrier(num_barriers=stages),
    )
    operands = (q, k, v, do, lse, out_or_delta, plan, order) + ((segment_ids,) if segmented else ())
    out_type = (jax.ShapeDtypeStruct(q.shape, dtype),) + ((jax.ShapeDtypeStruct(lse.shape, jnp.float32),) if computes_delta else ())
    results = _launch(body, out_type, (scratch, barriers), items.programs, operands, shape.interpret)
    return results[0], (results[1] if computes_delta else out_or_delta)


def _dkv_call(
    q: jax.Array, k: jax.Array, v: jax.Array, do: jax.Array, lse: jax.Array, delta: jax.Array,
    plan: jax.Array, segment_ids: jax.Array | None, shape: Shape, *, block_q: int, stages: int | None, persistent: bool = True,
    fused: bool = False, grads: tuple[str, ...] = ("dk", "dv"),
) -> tuple[jax.Array | None, jax.Array | None, jax.Array | None]:
    """``(dk, dv [batch, seq_kv, kv_heads, dim], dq)``: items are 128-row key/value tiles of one
    key/value head, walking the planned query blocks once per query head of its group, so the
    group's sum stays in registers (no per-query-head partials, no atomics).

    ``grads``: which of ``dk`` and ``dv`` the walk accumulates (None for the other; see
    :func:`_dkv_passes`). ``dv`` alone needs neither the value tile nor ``delta``.

    ``fused`` (``block_q`` 64): each step also computes the query block's share of ``dq``,
    ``ds^T k`` over the tile's 128 keys, and adds it to a float32 ``dq`` in global memory with a
    TMA reduce-add; ``dq [batch, seq_q, heads, dim]`` float32 is returned unscaled (times the
    softmax scale, it is the gradient), else None. That saves the dq kernel's recomputation of
    ``q k^T``, the softmax and ``dO v^T``, at the price of float32 additions in L2. The two
    consumers take turns (see :func:`_pair_share`): one share per block pair, not one per
    consumer, and each consumer's share buffer has two steps to drain. The interpreter has no
    reduce-add: there each step stores its share in a slot of its own (key/value tile) and the
    shares of the visited blocks are summed outside.
    """
    batch, seq_kv, kv_heads, dim = k.shape
    seq_q, heads = q.shape[1], q.shape[2]
    dtype = k.dtype
    segmented = segment_ids is not None
    group = shape.group
    if not grads or set(grads) - {"dk", "dv"} or (fused and grads != ("dk", "dv")):
        raise ValueError(f"grads: expected dk, dv or both (both when fused), got {grads}")
    with_dk = "dk" in grads  # dk needs dP = dO v^T, so the value tile and delta
    row_bytes = dim * jnp.dtype(dtype).itemsize
    # A batch row's queries, their gradients, log-sum-exps and deltas.
    items, order = deal_items(
        plan, kv_heads, persistent, shape.interpret, segmented=segmented, kv_heads=kv_heads, batch_row_bytes=heads * seq_q * (2 * row_bytes + 8),
    )
    tile_bytes = (2 if with_dk else 1) * TILE * row_bytes  # key (and value) rows of one tile
    fused_bytes = _fused_bytes(dim) if fused else 0
    stages = _ring_stages(stages, tile_bytes + fused_bytes, 2 * block_q * row_bytes)
    ring_bytes = stages * 2 * block_q * row_bytes + fused_bytes
    if fused and tile_bytes + ring_bytes > _SMEM_BYTES:
        raise ValueError(f"num_stages: {stages} stages of the fused backward do not fit shared memory at head dim {dim}")
    buffers = _tile_buffers(tile_bytes, ring_bytes)
    shares = fused and shape.interpret

    def body(q_ref: Any, k_ref: Any, v_ref: Any, do_ref: Any, lse_ref: Any, delta_ref: Any, plan_ref: Any, order_ref: Any, *refs: Any) -> None:
        refs = list(refs)
        seg_ref = refs.pop(0) if segmented else None
        dq_ref = refs.pop(0) if fused and not shares else None
        grad_refs = dict(zip(grads, (refs.pop(0) for _ in grads)))
        if shares:
            dq_ref = refs.pop(0)
        scratch, barriers = refs
        scratch = list(scratch)
        k_smem = scratch.pop(0)
        v_smem = scratch.pop(0) if with_dk else None
        kseg_smem, q_ring, do_ring, lse_ring, delta_ring, qseg_ring = scratch[:6]
        ds_smem, dq_smem = scratch[6:] if fused else (None, None)
        kv_ready, q_ready, do_ready, lse_ready, delta_ready, qseg_ready, q_used, do_used = barriers[:8]
        ds_ready, ds_used = barriers[8:] if fused else (None, None)
        wg = lax.axis_index("wg")

        @pl.when(wg < CONSUMERS)
        def _consumer() -> None:
            plgpu.set_max_registers(_CONSUMER_REGISTERS, action="increase")

            def load(visit: Visit, buf: jax.Array) -> None:
                b, hk = visit.b, visit.h
                rows = pl.ds(visit.row0(wg), WG_ROWS)
                ready = _tile_ready(kv_ready, buf, wg)
                plgpu.copy_gmem_to_smem(k_ref.at[b, rows, hk], k_smem.at[buf, wg], ready)
                if with_dk:
                    plgpu.copy_gmem_to_smem(v_ref.at[b, rows, hk], v_smem.at[buf, wg], ready)
                if segmented:
                    plgpu.copy_gmem_to_smem(seg_ref.at[b, rows], kseg_smem.at[buf, wg], ready)

            def process(visit: Visit, buf: jax.Array, t0: jax.Array) -> tuple[jax.Array, Any]:
                b, hk = visit.b, visit.h
                row0 = visit.row0(wg)
                my_k = k_smem.at[buf, wg]
                my_v = v_smem.at[buf, wg] if with_dk else None
                k_seg = _load(shape, kseg_smem.at[buf, wg], _row_layout()) if segmented else None

                def add_dq(ds_t: jax.Array, t: jax.Array, j: jax.Array, head: jax.Array) -> None:
                    """``dq[block j] += ds^T k`` over both consumers' keys, sent by step ``t``'s turn."""

                    def send(share: jax.Array) -> None:
                        my_dq = dq_smem.at[wg]
                        plgpu.wait_smem_to_gmem(0, wait_read_only=True)  # my last share has left my_dq
                        my_dq[...] = share
                        plgpu.commit_smem()
                        rows = pl.ds(j * block_q, block_q)
                        if shares:
                            plgpu.copy_smem_to_gmem(my_dq, dq_ref.at[b, visit.tile, rows, head])
                        else:
                            plgpu.copy_smem_to_gmem(my_dq, dq_ref.at[b, rows, head], reduction_op="add")

                    _pair_share(shape, wg, t, t0, ds_t, ds_smem, k_smem.at[buf], (ds_ready, ds_used), send)

                def step(r: jax.Array, j: jax.Array, t: jax.Array, acc: dict[str, jax.Array], kind: Mask) -> dict[str, jax.Array]:
                    acc = dict(acc)
                    slot = lax.rem(t, stages)
                    for barrier in (lse_ready,) + ((delta_ready,) if with_dk else ()) + ((qseg_ready,) if segmented else ()):
                        plgpu.barrier_wait(barrier.at[slot])
                    plgpu.barrier_wait(q_ready.at[slot])
                    s_t = _mma_new(shape, my_k, q_ring.at[slot], transpose_b=True)
                    lse = _load(shape, lse_ring.at[slot], _col_layout())
                    p_t = jnp.exp2(s_t * shape.scale - lax.broadcast_in_dim(lse, s_t.shape, [1]))
                    if kind is not Mask.NONE:
                        segments = (_load(shape, qseg_ring.at[slot], _col_layout()), k_seg) if kind is Mask.SEGMENTS else None
                        mask = _visibility(shape, j * block_q, row0, WG_ROWS, block_q, segments, transpose=True)
                        if mask is not None:
                            p_t = jnp.where(mask, p_t, 0.0)
                    # dP before the dV product (delta loaded only now): P and dP in float32 die
                    # into 16-bit P and dS before dV and dK accumulate. Spills at head dim 128:
                    # 108-128 bytes per thread, 120-188 the other way round (RESULTS.md run 48).
                    plgpu.barrier_wait(do_ready.at[slot])
                    if with_dk:
                        dp_t = _mma_new(shape, my_v, do_ring.at[slot], transpose_b=True)
                        delta = _load(shape, delta_ring.at[slot], _col_layout())
                        ds_t = (p_t * (dp_t - lax.broadcast_in_dim(delta, dp_t.shape, [1]))).astype(dtype)
                    if "dv" in acc:
                        acc["dv"] = _mma_into(shape, acc["dv"], p_t.astype(dtype), do_ring.at[slot])
                    plgpu.barrier_arrive(do_used.at[slot])
                    if with_dk:
                        acc["dk"] = _mma_into(shape, acc["dk"], ds_t, q_ring.at[slot])
                    plgpu.barrier_arrive(q_used.at[slot])
                    if fused:
                        add_dq(ds_t, t, j, hk * group + r)
                    return acc

                zeros = _cast(shape, jnp.zeros((WG_ROWS, dim), jnp.float32), plgpu.Layout.WGMMA)
                n = visit.steps
                # A loop, not an unrolled one: every copy of the walk is more code to compile.
                acc = lax.fori_loop(
                    0, group, lambda r, acc: walk(visit, functools.partial(step, r), acc, offset=t0 + r * n, masks=mask_loops(segmented, dim)),
                    {name: zeros for name in grads},
                )
                if fused:
                    _pair_share_done(wg, t0, group * n, ds_used)

                def write() -> None:
                    # The tiles just walked hold the results (dv in the key tile when alone).
                    staging = {"dk": my_k, "dv": my_v if with_dk else my_k}
                    scales = {"dk": shape.scale / _LOG2E, "dv": 1.0}
                    for name in grads:
                        staging[name][...] = (acc[name] * scales[name]).astype(dtype)
                    plgpu.commit_smem()
                    rows = pl.ds(row0, WG_ROWS)
                    for name in grads:
                        plgpu.copy_smem_to_gmem(staging[name], grad_refs[name].at[b, rows, hk])

                return t0 + group * n, write

            _consume_items(items, order_ref, plan_ref, buffers, kv_ready, load, process)

        @pl.when(wg == CONSUMERS)
        def _producer() -> None:
            plgpu.set_max_registers(_PRODUCER_REGISTERS, action="decrease")

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
                return streams[-1:] + streams[:-1] if stages == 1 else streams  # dO first: see _produce

            _produce_items(items, order_ref, plan_ref, stages, streams_of, [q_used, do_used], repeats=group)

    tile = _smem_tile((buffers, CONSUMERS, WG_ROWS, dim), dtype)
    scratch = (tile,) * (2 if with_dk else 1) + (
        plgpu.SMEM((buffers, CONSUMERS, WG_ROWS), jnp.int32),
        _smem_tile((stages, block_q, dim), dtype),
        _smem_tile((stages, block_q, dim), dtype),
        plgpu.SMEM((stages, block_q), jnp.float32),
        plgpu.SMEM((stages, block_q), jnp.float32),
        plgpu.SMEM((stages, block_q), jnp.int32),
    )
    if fused:
        scratch += (_smem_tile((CONSUMERS, WG_ROWS, block_q), dtype), _smem_tile((CONSUMERS, block_q, dim), jnp.float32))
    ring = functools.partial(plgpu.Barrier, num_barriers=stages)
    barriers = (
        plgpu.Barrier(num_arrivals=1 + with_dk + segmented, num_barriers=buffers * CONSUMERS),
        ring(), ring(), ring(), ring(), ring(),
        ring(num_arrivals=CONSUMERS),
        ring(num_arrivals=CONSUMERS),
    )
    if fused:  # the turns of _pair_share: ds ready (both consumers), ds and keys read (the sender)
        barriers += (plgpu.Barrier(num_arrivals=CONSUMERS, num_barriers=CONSUMERS), plgpu.Barrier(num_barriers=CONSUMERS))
    operands = (q, k, v, do, lse, delta, plan, order) + ((segment_ids,) if segmented else ())
    out_type = [jax.ShapeDtypeStruct(k.shape, dtype) for _ in grads]
    dq_acc = None
    if shares:
        out_type.append(jax.ShapeDtypeStruct((batch, plan.shape[2], seq_q, heads, dim), jnp.float32))
    elif fused:
        dq_acc = jax.new_ref(jnp.zeros(q.shape, jnp.float32))
        operands += (dq_acc,)
    outs = _launch(body, tuple(out_type), (scratch, barriers), items.programs, operands, shape.interpret)
    if shares:
        dq = _sum_shares(outs[len(grads)], plan, block_q)
    else:
        dq = dq_acc[...] if fused else None
    got = dict(zip(grads, outs))
    return got.get("dk"), got.get("dv"), dq


def _dkv_passes(dim: int) -> tuple[tuple[str, ...], ...]:
    """The walks of the dk/dv kernel at this (padded) head dim: one accumulating both up to
    dim 128; above, a consumer's two float32 accumulators of ``64 x dim`` (256 registers per
    thread at dim 256) exceed its 240, so ``dv`` and ``dk`` take a walk each, the ``dv`` walk
    without the value tile, ``dP`` and ``delta``."""
    return (("dk", "dv"),) if dim <= 128 else (("dv",), ("dk",))


def _fused_bytes(dim: int) -> int:
    """Shared memory the fused backward adds per program: each consumer's ``ds`` (16-bit,
    ``64 x 64``) and its float32 share of ``dq`` (``64 x dim``)."""
    return CONSUMERS * (WG_ROWS * WG_ROWS * 2 + WG_ROWS * dim * 4)


def _pair_share(
    shape: Shape, wg: jax.Array, t: jax.Array, t0: jax.Array, ds_t: jax.Array, ds_smem: Any, k_tile: Any,
    barriers: tuple[Any, Any], send: Any,
) -> None:
    """One step's share of ``dq``, ``ds^T k`` over the tile's 128 keys, computed and sent by
    one consumer: the consumers take turns, consumer ``t % 2`` at producer step ``t``.

    Each consumer stores its ``ds [64 keys, 64 queries]`` in ``ds_smem [consumers, ...]`` and
    arrives on ``ds_ready[turn]``; the sender waits for both, adds ``ds_w^T k_w`` over the
    consumers ``w`` in one accumulator (two wgmmas), arrives on ``ds_used[turn]`` (its reads of
    both consumers' ``ds`` and keys are done) and hands the share to ``send``. Before a
    consumer overwrites its ``ds`` on its own turn it waits for the other's last turn to have
    read it (on the other turns it was itself the last reader); the item's first step skips
    that wait, :func:`_pair_share_done` having waited at the end of the item before.

    Against a share per consumer this halves the reduce-adds, and each consumer's float32
    buffer has two steps, not one, to leave shared memory before it is rewritten.
    """
    ds_ready, ds_used = barriers
    turn = lax.rem(t, CONSUMERS)
    mine = turn == wg
    other = 1 - wg
    pl.when(mine & (t > t0))(lambda: plgpu.barrier_wait(ds_used.at[other]))
    ds_smem.at[wg][...] = ds_t
    plgpu.commit_smem()
    plgpu.barrier_arrive(ds_ready.at[turn])

    @pl.when(mine)
    def _send() -> None:
        plgpu.barrier_wait(ds_ready.at[wg])
        products = [(ds_smem.at[w], k_tile.at[w]) for w in range(CONSUMERS)]
        share = _mma_sum(shape, products, transpose_a=True, transpose_b=False)
        plgpu.barrier_arrive(ds_used.at[wg])
        send(share)


def _pair_share_done(wg: jax.Array, t0: jax.Array, steps: jax.Array, ds_used: Any) -> None:
    """At the end of an item of ``steps`` steps from ``t0``: the consumer whose turn the last
    step was not waits until that turn has read its ``ds`` and keys, which the item's results
    (and, with one tile buffer, the next item's keys) are about to overwrite."""
    last = t0 + steps - 1
    pl.when((steps > 0) & (lax.rem(last, CONSUMERS) != wg))(lambda: plgpu.barrier_wait(ds_used.at[1 - wg]))


def _sum_shares(shares: jax.Array, plan: jax.Array, block_q: int) -> Float[Array, "batch seq_q heads dim"]:
    """The interpreter's ``dq``: ``shares [batch, kv tiles, seq_q, heads, dim]`` summed over the
    query blocks each key/value tile visited (the others were never written)."""
    blocks = jnp.arange(shares.shape[2], dtype=jnp.int32) // block_q
    visited = (blocks >= plan[0][..., None]) & (blocks < plan[1][..., None])  # [batch, tiles, seq_q]
    return jnp.where(visited[:, :, :, None, None], shares, 0.0).sum(axis=1)


# The source location every op of a kernel carries (see :func:`_launch`): the Mosaic module's
# hash covers its locations, and one hash per distinct kernel lets the backend compile a kernel
# once for all its call sites.
_KERNEL_TRACEBACK = source_info_util.Traceback.get_traceback()


def _launch(body: Any, out_type: Any, scratch: Any, programs: int, operands: tuple[Any, ...], interpret: bool) -> Any:
    """Run ``body`` on ``programs`` programs of ``consumers + 1`` warpgroups (named ``wg``),
    with ``scratch`` allocated in each program. ``operands`` may hold a ``jax.Ref``: the kernel
    reads and writes it in place (the fused backward's ``dq``).

    The kernel is traced under one fixed source location instead of its caller's: a Mosaic
    module embeds its ops' locations and its hash covers them, so with the caller's stack two
    call sites on different source lines (or a forward seen from two backward sites) got two
    modules of one kernel, each compiled on its own (test_call_sites_share_one_module_per_kernel).
    The other per-launch difference, jaxlib 0.11's dump counter, is removed by
    :mod:`._mosaic_modules`. Errors raised while tracing keep their Python traceback."""

    def kernel_body(*refs: Any) -> None:
        pl.run_scoped(functools.partial(body, *refs), *scratch, collective_axes="wg")

    with source_info_util.user_context(_KERNEL_TRACEBACK):
        return pl.kernel(
            kernel_body,
            out_type=out_type,
            mesh=plgpu.Mesh(grid=(programs,), grid_names=("programs",), num_threads=CONSUMERS + 1, thread_name="wg"),
            compiler_params=_compiler_params(),
            interpret=_interpret_params() if interpret else False,
        )(*operands)


# --------------------------------------------------------------------------------------------
# Padding and the public function


# Mosaic GPU copies a tile to or from memory whose tiled row count is a multiple of the 8-row
# swizzle tile ("dimension 1 must have size smaller or a multiple of its tiling 8").
_TMA_ROWS = 8


@dataclasses.dataclass(frozen=True)
class _Padded:
    """The operands of one call, padded (see :func:`_pad`), and the lengths they came with."""

    q: jax.Array
    k: jax.Array
    v: jax.Array
    segment_ids: jax.Array | None
    shape: Shape
    seq_q: int
    seq_kv: int
    dim: int
    rows: int  # query rows in whole tiles
    cols: int  # key rows in whole tiles

    def like_q(self, x: jax.Array) -> jax.Array:
        """A ``[batch, seq_q, heads, dim]`` operand (``dO``, the forward's output) padded as ``q`` is."""
        return pad_axis(pad_axis(x, 3, self.q.shape[3]), 1, self.q.shape[1])


def _pad(
    q: jax.Array, k: jax.Array, v: jax.Array, segment_ids: jax.Array | None,
    *, scale: float, bounds: Window, block_k: int, interpret: bool = False,
) -> _Padded:
    """Pad the head dimension to a multiple of 64, and take the sequences in whole tiles (queries
    of 128 rows, keys of ``block_k`` and of 128). On the GPU a sequence is padded only to a
    multiple of 8 rows (:data:`_TMA_ROWS`): TMA reads a tile's rows past the end as zeros and does
    not write them back, which is what padding with zeros to whole tiles gave. At B8 S1000 H16
    D128 those copies in and out took as long as the forward kernel (H100, bench/RESULTS.md run
    139). The interpreter clamps such slices, so there the sequences are padded to whole tiles.
    The segment ids are padded to whole tiles everywhere: they are small, and the padding's ids
    of 0 are the ids the tiles' tails must see."""
    seq_q, dim = q.shape[1], q.shape[3]
    seq_kv = k.shape[1]
    kv_tile = math.lcm(block_k, TILE)  # the backward tiles keys by 128
    rows, cols = -(-seq_q // TILE) * TILE, -(-seq_kv // kv_tile) * kv_tile
    padded_dim = -(-dim // _DIM_MULTIPLE) * _DIM_MULTIPLE
    q_rows, kv_rows = (rows, cols) if interpret else (-(-n // _TMA_ROWS) * _TMA_ROWS for n in (seq_q, seq_kv))
    q = pad_axis(pad_axis(q, 3, padded_dim), 1, q_rows)
    k, v = (pad_axis(pad_axis(t, 3, padded_dim), 1, kv_rows) for t in (k, v))
    if segment_ids is not None:
        segment_ids = pad_axis(segment_ids.astype(jnp.int32), 1, max(rows, cols))
    kv_len = seq_kv if segment_ids is None and cols != seq_kv else None
    shape = Shape(scale * _LOG2E, bounds, kv_len, q.shape[2] // k.shape[2], segment_ids is not None, interpret)
    return _Padded(q, k, v, segment_ids, shape, seq_q, seq_kv, dim, rows, cols)


def _forward_padded(p: _Padded, *, block_k: int, stages: int | None, pingpong: bool = False, persistent: bool = True) -> tuple[jax.Array, jax.Array]:
    batch, rows, cols = p.q.shape[0], p.rows, p.cols
    plan = visit_plan(rows, cols, TILE, block_k, p.shape, p.segment_ids, batch, transpose=False)
    segments = None if p.segment_ids is None else p.segment_ids
    return _forward_call(p.q, p.k, p.v, plan, segments, p.shape, block_k=block_k, stages=stages, pingpong=pingpong, persistent=persistent)


def _blocks(params: FwdParams | BwdParams, dim: int) -> tuple[int, int, int | None]:
    """``(q block, kv block, stages)`` from launch parameters; unset block sizes get defaults
    that fit shared memory at this head dimension (128-row blocks up to dim 128, 64-key blocks
    above, since a wgmma's contraction takes 64 elements at least) and, in the backward,
    registers: above dim 64 the dq kernel's tiles of 128 keys spilled 412 bytes per thread and 64
    keys spill none (H100, bench/RESULTS.md run 44: fwd+bwd 5% and 9% faster at dim 128, causal
    and 4 documents). Unset stages stay None: each kernel takes :func:`_ring_stages` of what it
    holds."""
    backward = isinstance(params, BwdParams)
    widest = 64 if backward else 128
    block_q = params.q_blocksize or 64
    block_k = params.kv_blocksize or (64 if dim > widest else 128)
    for name, value in (("q_blocksize", block_q), ("kv_blocksize", block_k)):
        if value not in (64, 128):
            raise ValueError(f"{name}: the mosaic kernels take 64 or 128, got {value}")
    return block_q, block_k, params.num_stages


def _ring_stages(stages: int | None, tile_bytes: int, stage_bytes: int) -> int:
    """``stages`` if set, else the ring's default depth for a kernel that holds ``tile_bytes``
    of resident tiles and streams ``stage_bytes`` per stage: two stages where they fit beside
    one buffer of the tiles, else one. So up to head dim 128 every kernel gets two; above, the
    forward (one 128-row tile, 64-key blocks) and the ``dv`` walk (the key tile alone) get two,
    the dq kernel and the ``dk`` walk (two 128-row tiles) one."""
    if stages:
        return stages
    return 2 if tile_bytes + 2 * stage_bytes <= _SMEM_BYTES else 1


_SMEM_LIMIT = 227 * 1024  # Hopper's per-block limit of shared memory
_SMEM_BYTES = _SMEM_LIMIT - 4096  # less room for barriers and id rings, where those are not counted


def mosaic_fits(dim: int, fwd: FwdParams, bwd: BwdParams, *, fused_backward: bool = False) -> bool:
    """Whether the kernels' shared memory fits at this head dim and these tiles (and the
    tiles are ones the kernels take), with the fused backward if ``fused_backward``."""
    padded = -(-dim // _DIM_MULTIPLE) * _DIM_MULTIPLE
    try:
        _, fwd_k, fwd_stages = _blocks(fwd, padded)
        bwd_q, bwd_k, bwd_stages = _blocks(bwd, padded)
    except ValueError:
        return False
    row = padded * 2  # bytes of one 16-bit row
    fused = _fused_bytes(padded) if fused_backward and bwd_q == WG_ROWS else 0
    kernels = (  # (resident bytes, bytes per stage, stages asked for)
        (TILE * row, 2 * fwd_k * row, fwd_stages),  # the forward
        (2 * TILE * row, 2 * bwd_k * row, bwd_stages),  # the dq kernel
        (2 * TILE * row + fused, 2 * bwd_q * row, bwd_stages),  # the widest dk/dv walk
    )
    return all(tile + _ring_stages(stages, tile, stage) * stage <= _SMEM_BYTES for tile, stage, stages in kernels)


def _check(q: jax.Array, k: jax.Array) -> None:
    if plgpu is None:
        raise NotImplementedError("this JAX has no Pallas Mosaic GPU backend")
    if not mosaic_supports(q.dtype, q.shape[3]):
        raise ValueError(f"q: the mosaic kernels take bfloat16 or float16 with head dim <= {_MAX_DIM}, got {q.dtype} dim {q.shape[3]}")


def _traced_once(fn: Any) -> Any:
    """``fn`` (whose keyword-only arguments are all static) under ``jax.jit``, so every call site
    with the same shapes, arguments and label reuses one trace and one lowering: a model's
    layers then lower each kernel once (the packed example model, 12 layers, lowered for CUDA
    with jax 0.11.2 on the CPU: 14.6 s traced and lowered before, 2.2 s after). Calls under
    other XLA metadata (another label; a call's first site, which also carries its description)
    are traced apart, and their Mosaic modules are still equal. Not in the interpreter: its
    simulated warpgroups hung inside the jitted call (CPU, jax 0.10.2)."""
    static = [name for name, p in inspect.signature(fn).parameters.items() if p.kind is p.KEYWORD_ONLY]
    jitted = jax.jit(fn, static_argnames=static)

    @functools.wraps(fn)
    def call(*args: Any, interpret: bool = False, **kwargs: Any) -> Any:
        return (fn if interpret else jitted)(*args, interpret=interpret, **kwargs)

    return call


@_traced_once
def mosaic_forward(
    q: Float[Array, "batch sq heads dim"], k: Float[Array, "batch skv kv_heads dim"], v: Float[Array, "batch skv kv_heads dim"],
    segment_ids: Int[Array, "batch seq"] | None, *, scale: float, bounds: Window, params: FwdParams, interpret: bool = False,
    pingpong: bool = True, persistent: bool = True,
) -> tuple[Float[Array, "batch sq heads dim"], Float[Array, "batch heads sq"]]:
    """``(out, lse)``: the attention output and its base-2 log-sum-exp ``[batch, heads, sq]``.

    ``pingpong`` alternates the two consumer warpgroups between matrix products and softmax
    (see :func:`_forward_call`). On by default: on the H100 (jax 0.11.2, 2026-11-25) it ran the
    causal B4 S4096 H16 D128 forward 1.06x and the packed-documents forward 1.08x faster than
    the plain schedule, in one interleaved run (bench/RESULTS.md). ``persistent``: at most one
    program per SM, each walking several tiles (see :class:`Items`); False: one per tile.
    """
    _check(q, k)
    _, block_k, stages = _blocks(params, q.shape[3])
    p = _pad(q, k, v, segment_ids, scale=scale, bounds=bounds, block_k=block_k, interpret=interpret)
    out, lse = _forward_padded(p, block_k=block_k, stages=stages, pingpong=pingpong, persistent=persistent)
    return out[:, : p.seq_q, :, : p.dim], lse[:, :, : p.seq_q]


@_traced_once
def mosaic_backward(
    q: Float[Array, "batch sq heads dim"], k: Float[Array, "batch skv kv_heads dim"], v: Float[Array, "batch skv kv_heads dim"],
    segment_ids: Int[Array, "batch seq"] | None, out: Float[Array, "batch sq heads dim"], lse: Float[Array, "batch heads sq"],
    g: Float[Array, "batch sq heads dim"], *, scale: float, bounds: Window, params: BwdParams, interpret: bool = False,
    persistent: bool = True, fused: bool = False,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """``(dq, dk, dv)`` from the forward's output and base-2 log-sum-exp and the cotangent ``g``
    (``persistent``: as in :func:`mosaic_forward`).

    ``fused`` (with a ``q_blocksize`` of 64): one kernel computes all three, adding ``dq`` up
    in float32 (see :func:`_dkv_call`); else a dq kernel and a dk/dv kernel. The split is the
    default because it measured faster: on the H100 (jax 0.11.2, 2026-11-25, interleaved runs,
    bench/RESULTS.md) the backward alone at causal B4 S4096 H16 D128 took 1.85 ms split and 2.88
    fused, at the packed model shape 0.331 and 0.354 ms (run 19). The reduce-adds are the cost:
    without them the fused backward took 0.300 ms at the packed shape (bench/probe_fused_backward.py).
    Run 18 sent one share per consumer (1.69x and 1.07x the split's time); since run 19 the
    consumers take turns sending one share per block pair (:func:`_pair_share`): 1.56x and
    1.07x. Half the reduce-adds, but the turns add a wait of their own (without reduce-adds the
    fused backward went from 1.02x to 1.15x the split at D128).
    """
    _check(q, k)
    block_q, block_k, stages = _blocks(params, q.shape[3])
    p = _pad(q, k, v, segment_ids, scale=scale, bounds=bounds, block_k=block_k, interpret=interpret)
    batch, dim, rows, cols = p.q.shape[0], p.q.shape[3], p.rows, p.cols
    do, out = p.like_q(g.astype(p.q.dtype)), p.like_q(out)
    lse = pad_axis(lse.astype(jnp.float32), 2, rows)  # row terms over whole tiles: TMA strides
    fused = fused and block_q == WG_ROWS and len(_dkv_passes(dim)) == 1
    if fused:
        delta = pad_axis(_delta(out, do), 2, rows)
    else:  # the dq kernel first: it may compute delta for the dk/dv kernel
        rows_plan = visit_plan(rows, cols, TILE, block_k, p.shape, p.segment_ids, batch, transpose=False)
        dq, delta = _dq_call(p.q, p.k, p.v, do, lse, out, rows_plan, p.segment_ids, p.shape, block_k=block_k, stages=stages, persistent=persistent)
    cols_plan = visit_plan(cols, rows, TILE, block_q, p.shape, p.segment_ids, batch, transpose=True)
    got: dict[str, jax.Array] = {}
    for grads in _dkv_passes(dim):
        dk, dv, fused_dq = _dkv_call(
            p.q, p.k, p.v, do, lse, delta, cols_plan, p.segment_ids, p.shape,
            block_q=block_q, stages=stages, persistent=persistent, fused=fused, grads=grads,
        )
        got.update((name, x) for name, x in (("dk", dk), ("dv", dv)) if x is not None)
    dk, dv = got["dk"], got["dv"]
    if fused:
        dq = (fused_dq * scale).astype(p.q.dtype)
    seq_kv = p.seq_kv
    return dq[:, : p.seq_q, :, : p.dim], dk[:, :seq_kv, :, : p.dim], dv[:, :seq_kv, :, : p.dim]


@dataclasses.dataclass(frozen=True)
class _Schedule:
    """How the kernels run, apart from tile sizes (see :func:`mosaic_forward`)."""

    interpret: bool
    pingpong: bool
    persistent: bool
    fused_backward: bool


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5, 6, 7, 8))
def _attention(q: jax.Array, k: jax.Array, v: jax.Array, segment_ids: jax.Array | None, scale: float, bounds: Window,
               fwd: FwdParams, bwd: BwdParams, schedule: _Schedule) -> jax.Array:
    return _attention_fwd(q, k, v, segment_ids, scale, bounds, fwd, bwd, schedule)[0]


def _attention_fwd(q: jax.Array, k: jax.Array, v: jax.Array, segment_ids: jax.Array | None, scale: float, bounds: Window,
                   fwd: FwdParams, bwd: BwdParams, schedule: _Schedule) -> tuple[jax.Array, tuple[Any, ...]]:
    out, lse = mosaic_forward(
        q, k, v, segment_ids, scale=scale, bounds=bounds, params=fwd, interpret=schedule.interpret, pingpong=schedule.pingpong,
        persistent=schedule.persistent,
    )
    return out, (q, k, v, segment_ids, out, lse)


def _attention_bwd(scale: float, bounds: Window, fwd: FwdParams, bwd: BwdParams, schedule: _Schedule,
                   residuals: tuple[Any, ...], g: jax.Array) -> tuple[Any, ...]:
    q, k, v, segment_ids, out, lse = residuals
    dq, dk, dv = mosaic_backward(
        q, k, v, segment_ids, out, lse, g, scale=scale, bounds=bounds, params=bwd, interpret=schedule.interpret,
        persistent=schedule.persistent, fused=schedule.fused_backward,
    )
    return dq, dk, dv, None


_attention.defvjp(_attention_fwd, _attention_bwd)


def mosaic_attention(
    q: Float[Array, "batch sq heads dim"], k: Float[Array, "batch skv kv_heads dim"], v: Float[Array, "batch skv kv_heads dim"],
    *, scale: float | None = None, causal: bool = False, window: tuple[int, int] | None = None,
    segment_ids: Int[Array, "batch seq"] | None = None, params: tuple[FwdParams, BwdParams] | None = None,
    interpret: bool = False, pingpong: bool = True, persistent: bool = True, fused_backward: bool = False,
) -> Float[Array, "batch sq heads dim"]:
    """Attention on the Mosaic GPU kernels, differentiable (the forward's output and log-sum-exp
    are kept for the backward).

    Args:
      q: ``[batch, seq_q, heads, dim]`` bfloat16 or float16, dim <= 256.
      k, v: ``[batch, seq_kv, kv_heads, dim]``; ``kv_heads`` divides ``heads``.
      scale: multiplies ``q k^T``; default ``1 / sqrt(dim)``.
      causal: query ``i`` sees keys ``j <= i``.
      window: ``(left, right)``: query ``i`` sees keys ``i - left .. i + right``.
      segment_ids: ``[batch, seq]`` int, ``seq_q == seq_kv``; equal ids see each other, ids <= 0
        are padding (output 0).
      params: forward and backward launch parameters (kv/q block 64 or 128, stages).
      interpret: run in the Mosaic GPU interpreter (CPU tests).
      pingpong: alternate the forward's two consumer warpgroups (see :func:`mosaic_forward`).
      persistent: at most one program per SM, each walking several tiles (see :class:`Items`).
      fused_backward: one backward kernel for dq, dk and dv (see :func:`mosaic_backward`).
    """
    if q.ndim != 4 or k.ndim != 4 or k.shape != v.shape or q.shape[0] != k.shape[0] or q.shape[3] != k.shape[3] or q.shape[2] % k.shape[2]:
        raise ValueError(f"q, k, v: expected [batch, seq, heads, dim] with kv heads dividing heads, got {q.shape}, {k.shape}, {v.shape}")
    if segment_ids is not None and (segment_ids.shape != q.shape[:2] or q.shape[1] != k.shape[1]):
        raise ValueError(f"segment_ids: expected shape {q.shape[:2]} with equal q and kv lengths, got {segment_ids.shape}")
    left, right = window if window is not None else (None, None)
    if causal:
        right = 0 if right is None else min(right, 0)
    fwd, bwd = params if params is not None else (FwdParams(), BwdParams())
    scale = 1.0 / math.sqrt(q.shape[3]) if scale is None else float(scale)
    return _attention(q, k, v, segment_ids, scale, (left, right), fwd, bwd, _Schedule(interpret, pingpong, persistent, fused_backward))
