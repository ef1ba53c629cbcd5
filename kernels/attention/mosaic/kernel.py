"""The pieces every Mosaic GPU attention kernel shares (see :mod:`ejlabel.kernels.attention.mosaic`).

Register layouts and loads, the attention mask of a block, the producer's and the consumers'
walks over a program's items, the wgmma products, the compiler and interpreter parameters, and
the launch. The kernels themselves are in :mod:`.forward` and :mod:`.backward`, the
shared-memory budget they size their buffers with in :mod:`.budget`. Importing this module
imports Pallas's Mosaic GPU backend: the package imports it only when a kernel runs or
:func:`~ejlabel.kernels.attention.mosaic.mosaic_available` is asked.
"""

from __future__ import annotations

import functools
import inspect
import math
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax
from jax._src import source_info_util  # no public API sets the location ops are traced with
from jax.experimental import pallas as pl

from .modules import share_modules_across_call_sites
from .plan import CONSUMERS, WG_ROWS, Mask, Shape, Visit
from .work import Items, deal_items

__all__ = [
    "CONSUMER_REGISTERS", "LN2", "PRODUCER_REGISTERS", "cast", "col_layout", "consume_items",
    "ids_smem", "ids_views", "interpret_params", "key_segments", "key_value_items", "key_value_streams", "launch", "load_smem", "mma_beside", "mma_into", "mma_new", "mma_sum", "per_step", "plgpu",
    "produce_items", "row_layout", "smem_tile", "tile_ready", "tile_segments", "visibility",
]

try:  # The Mosaic GPU backend may be missing from a JAX build; the modules still import.
    from jax.experimental.pallas import mosaic_gpu as plgpu
except ImportError:  # pragma: no cover - depends on the JAX build
    plgpu = None

if plgpu is not None:
    # Every layer's launch of a kernel shares one compiled module (see .modules).
    share_modules_across_call_sites()

LN2 = math.log(2.0)


def smem_tile(shape: tuple[int, ...], dtype: Any) -> Any:
    """A shared-memory buffer laid out for TMA and wgmma: 8-row tiles, 128-byte swizzle."""
    elems = 128 // jnp.dtype(dtype).itemsize
    return plgpu.SMEM(shape, dtype, transforms=(plgpu.TilingTransform((8, elems)), plgpu.SwizzleTransform(128)))


def row_layout() -> Any:
    return plgpu.Layout.WGMMA.reduce(1)


def col_layout() -> Any:
    return plgpu.Layout.WGMMA.reduce(0)


def cast(shape: Shape, x: jax.Array, layout: Any) -> jax.Array:
    """``x`` in a register layout; the interpreter has no layouts, so there it is ``x``."""
    return x if shape.interpret else plgpu.layout_cast(x, layout)


# Newer JAX releases take the index as part of the ref (``ref.at[idx]``) and deprecate passing it
# to ``load``; older ones require it.
_LOAD_INDEX = None if plgpu is None else inspect.signature(plgpu.load).parameters.get("idx")
_LOAD_INDEX_OPTIONAL = _LOAD_INDEX is None or _LOAD_INDEX.default is not inspect.Parameter.empty


def per_step(index: jax.Array) -> jax.Array:
    """``index``, hidden from the compiler's loop-invariant code motion, for a walk's step to
    pick the item's tile with (``tiles.at[per_step(buf), wg]``), or a ring's slot, before
    passing it to a product.

    A wgmma reads its shared-memory operands through descriptors, one per 16-wide slice of the
    contraction (16 at head dim 256, each 64 bits). Picked once per item, a tile's descriptors
    are the same at every step of its walk, and LLVM computes them all before the loop and holds
    them across it: 32 registers per tile at head dim 256, beside accumulators that take most
    of a consumer's 240. A one-slot ring's slot (``rem(t, 1)``) is such a constant too. The
    barrier (Mosaic lowers it to an empty inline assembly statement with side effects) is re-run
    at every step, so the descriptors are a few integer adds there. At head dim 256 this sped up
    the dq kernel and the ``dk`` walk (each holds two such tiles and a one-slot ring; their
    spills all but vanished) and the pipelined forward; at dim 128 no kernel spills, and the
    times barely moved (the pipelined forward's the other way).
    ``bench/bench_backward.py`` times the kernels, ``bench/ptxas_report.py --dims 128,256``
    reports the spills; figures in ``bench/RESULTS.md``."""
    return lax.optimization_barrier(index)


def load_smem(shape: Shape, ref: Any, layout: Any) -> jax.Array:
    """A whole shared-memory ref, loaded into ``layout``."""
    if shape.interpret:
        return ref[...]
    return plgpu.load(ref, layout=layout) if _LOAD_INDEX_OPTIONAL else plgpu.load(ref, (), layout=layout)


def visibility(
    shape: Shape, q_start: jax.Array, k_start: jax.Array, rows: int, cols: int,
    segments: tuple[jax.Array, jax.Array] | None, *, transpose: bool,
) -> jax.Array | None:
    """``[rows, cols]`` mask in the wgmma layout: rows are queries (keys with ``transpose``);
    ``segments`` are the query and key ids, in the row and column layouts of that matrix, the
    rows' from :func:`tile_segments`.

    Each condition is one comparison per element, as the kernels' steps at small head dims
    are bound by their instructions: positions compare the column index with a limit of its
    row (the row index shifted by the blocks' starts), and the ids compare for equality alone
    (padding never matches, see :func:`tile_segments`). At the example model's packed shape
    (4 random documents, H200; ``bench/bench_attention.py`` section c) this ran the forward and
    forward+backward faster than absolute positions and ``(q == k) & (q > 0)`` (figures in
    ``bench/RESULTS.md``). A loop-invariant ``column - row``
    instead sped the forward less and slowed the backward: the dq kernel holds it across its
    walk, in registers it did not have."""
    r = cast(shape, lax.broadcasted_iota(jnp.int32, (rows, cols), 0), plgpu.Layout.WGMMA)
    c = cast(shape, lax.broadcasted_iota(jnp.int32, (rows, cols), 1), plgpu.Layout.WGMMA)
    shift = k_start - q_start  # key - query = (c - r, or r - c with transpose) + shift
    conditions = []
    left, right = shape.bounds
    if right is not None:  # key - query <= right
        conditions.append(c >= r + (shift - right) if transpose else c <= r + (right - shift))
    if left is not None:  # key - query >= -left
        conditions.append(c <= r + (shift + left) if transpose else c >= r - (left + shift))
    if shape.kv_len is not None:
        conditions.append((r if transpose else c) < shape.kv_len - k_start)
    if segments is not None:
        q_seg, k_seg = segments
        q_dim, k_dim = (1, 0) if transpose else (0, 1)
        conditions.append(lax.broadcast_in_dim(q_seg, (rows, cols), [q_dim]) == lax.broadcast_in_dim(k_seg, (rows, cols), [k_dim]))
    return functools.reduce(jnp.logical_and, conditions) if conditions else None


def tile_segments(shape: Shape, ref: Any) -> jax.Array:
    """The segment ids of a tile's own rows (the mask's rows), in the row layout, padding as -1.

    The kernels' ids are clamped at 0 (:func:`ejlabel.kernels.attention.mosaic.pad_operands`),
    so no streamed id is -1: in :func:`visibility` one equality then says both "the same
    segment" and "not padding" (ids <= 0 see nothing)."""
    ids = load_smem(shape, ref, row_layout())
    return jnp.where(ids > 0, ids, -1)


def key_segments(shape: Shape, kseg: tuple[Any, Any] | None, slot: jax.Array, kind: Mask, q_seg: jax.Array | None) -> Any:
    """The query and key segment ids a step's mask compares, or None: waits for the ring's key ids
    (with segment ids, every step, so each barrier phase is observed) and reads them where
    ``kind`` is the segment ids' mask. Their slot is freed with the key slot, so this comes
    before the step arrives on it."""
    if kseg is None:
        return None
    kseg_ready, kseg_ring = kseg
    plgpu.barrier_wait(kseg_ready.at[slot])
    return (q_seg, load_smem(shape, kseg_ring.at[slot], col_layout())) if kind is Mask.SEGMENTS else None


def ids_smem(buffers: int, depth: int, width: int) -> Any:
    """One shared-memory buffer for the segment ids a backward kernel holds: its tile's own ids
    (``buffers x CONSUMERS`` rows of ``WG_ROWS``), then a ring of ``depth`` slots of ``width``
    ids (``width >= WG_ROWS``). One buffer, not two: each is placed at a 1 KiB boundary, and at
    head dim 256 the ring's second slot of held blocks fits beside one only
    (:func:`.budget.ring_depths`). :func:`ids_views` reads it."""
    return plgpu.SMEM((buffers * CONSUMERS + depth, width), jnp.int32)


def ids_views(ref: Any, buffers: int) -> tuple[Any, Any]:
    """``(tile_ids(buf, wg), ring)`` of a buffer from :func:`ids_smem`: the ref of consumer
    ``wg``'s tile ids in tile buffer ``buf``, and the ring (``[depth, width]``)."""
    tiles = buffers * CONSUMERS

    def tile_ids(buf: jax.Array, wg: jax.Array) -> Any:
        return ref.at[buf * CONSUMERS + wg, pl.ds(0, WG_ROWS)]

    return tile_ids, ref.at[pl.ds(tiles, ref.shape[0] - tiles)]


def tile_ready(barriers: Any, buf: jax.Array, wg: jax.Array) -> Any:
    """The barrier of consumer ``wg``'s tile in buffer ``buf`` (``buffers x consumers`` of them)."""
    return barriers.at[buf * CONSUMERS + wg]


def _wait_for_tile(barriers: Any, buf: jax.Array, wg: jax.Array) -> None:
    """Wait until consumer ``wg``'s tile in buffer ``buf`` has arrived (a named region, so that a
    profile of the kernel shows the wait)."""
    with jax.named_scope("tile_wait"):
        plgpu.barrier_wait(tile_ready(barriers, buf, wg))


def key_value_streams(
    k_ref: Any, v_ref: Any, seg_ref: Any, rings: tuple[Any, ...], barriers: tuple[Any, ...], block_k: int, group: int, *, values_first: bool = False,
    values_transposed: bool = False,
) -> Any:
    """``streams_of(b, h)`` for :func:`produce_items` of the kernels that walk key/value blocks
    (forward and dq): the key, value and (with ``seg_ref``) key segment-id blocks of query head
    ``h``'s key/value head. ``rings``: ``(k, v, kseg)``; ``barriers``: ``(k_ready, v_ready,
    k_used, v_used, kseg_ready)``. Slots of the segment ring are freed with the key slots.
    ``values_transposed``: ``v_ref`` is ``[batch, kv_heads, dim, seq_kv]`` and its blocks
    ``[dim, block_k]`` (the 8-bit forward's, see :mod:`.fp8`)."""
    k_ring, v_ring, kseg_ring = rings
    k_ready, v_ready, k_used, v_used, kseg_ready = barriers

    def streams_of(b: jax.Array, h: jax.Array) -> list[Any]:
        kv_head = lax.div(h, jnp.int32(group))

        def values(j: jax.Array, _: Any) -> Any:
            block = pl.ds(j * block_k, block_k)
            return v_ref.at[b, kv_head, :, block] if values_transposed else v_ref.at[b, block, kv_head]

        streams = [
            (lambda j, _: k_ref.at[b, pl.ds(j * block_k, block_k), kv_head], k_ring, k_ready, k_used),
            (values, v_ring, v_ready, v_used),
        ]
        if seg_ref is not None:
            streams.insert(1, (lambda j, _: seg_ref.at[b, pl.ds(j * block_k, block_k)], kseg_ring, kseg_ready, None))
        return streams[-1:] + streams[:-1] if values_first else streams

    return streams_of


def _produce(
    visit: Visit, streams: list[tuple[Any, Any, Any, Any]], *, offset: jax.Array, repeats: int = 1,
) -> jax.Array:
    """The producer warpgroup's part of one item: for every planned block, TMA each stream's
    block into its ring; returns the steps taken.

    ``streams``: ``(source(j, r) -> gmem ref, ring, ready barriers, consumed barriers)``; a slot
    is refilled only after both consumers arrived on its consumed barrier (streams with None
    there are freed with the stream before them, and have as many slots), in the order of
    ``streams``. A ring's depth is its leading dimension: step ``t`` fills slot ``t % depth``
    (rings of one kernel may differ, see :func:`.budget.ring_depths`). With one stage the
    kernels put first the stream their consumers free mid-step (values in the dq kernel, ``dO``
    in the dk walk), so its next block loads during the rest of the step, not after it:
    fwd+bwd faster at causal B2 S4096 H8 D256 on the H100 (``bench/bench_attention.py``
    section d's shape).
    The planned blocks are walked ``repeats`` times, ``r`` counting the walks (the query heads
    of a group in the backward). ``offset`` counts the steps of the program's earlier items:
    the ring runs on across items.
    """
    n = visit.steps

    def body(t: jax.Array, carry: Any) -> Any:
        step = offset + t
        r, j = (jnp.int32(0), visit.block(t)) if repeats == 1 else (lax.div(t, n), visit.block(lax.rem(t, n)))
        for source, ring, ready, consumed in streams:
            depth = ring.shape[0]
            slot = lax.rem(step, depth)
            if consumed is not None:
                with jax.named_scope("slot_wait"):
                    pl.when(step >= depth)(functools.partial(plgpu.barrier_wait, consumed.at[slot]))
            plgpu.copy_gmem_to_smem(source(j, r), ring.at[slot], ready.at[slot])
        return carry

    steps = repeats * n
    lax.fori_loop(0, steps, body, None)
    return steps


def _drain(consumed: list[Any], steps: jax.Array) -> None:
    """Wait for the consumers' last consumptions on each barrier array of ``consumed`` (one
    barrier per slot of its ring, so its length is the ring's depth), so every barrier phase is
    observed before the program's shared memory goes away (the interpreter checks it; on the GPU
    it is free)."""
    for barrier in consumed:
        depth = barrier.shape[0]

        def body(t: jax.Array, carry: Any, barrier: Any = barrier, depth: int = depth) -> Any:
            plgpu.barrier_wait(barrier.at[lax.rem(t, depth)])
            return carry

        lax.fori_loop(jnp.maximum(steps - depth, 0), steps, body, None)


def key_value_items(plan: jax.Array, heads: int, persistent: bool, shape: Shape, segmented: bool, k: jax.Array) -> tuple[Items, jax.Array]:
    """:func:`deal_items` of the kernels that walk key/value blocks (forward and dq): a batch row
    streams its keys and values, ``k`` of ``[batch, seq_kv, kv_heads, dim]`` and as many values."""
    streamed = 2 * math.prod(k.shape[1:]) * jnp.dtype(k.dtype).itemsize
    return deal_items(plan, heads, persistent, shape.interpret, segmented=segmented, kv_heads=k.shape[2], batch_row_bytes=streamed)


def consume_items(
    items: Items, order_ref: Any, plan_ref: Any, buffers: int, ready: Any, load: Any, process: Any, *, staged_apart: bool = False,
) -> None:
    """A consumer warpgroup's walk over its program's items.

    ``load(visit, buf)`` starts the copies of an item's tile into buffer ``buf``, completing
    ``ready`` (see :func:`tile_ready`); ``process(visit, buf, t0) -> (t1, write)`` walks the
    item's blocks (producer steps ``t0 .. t1``) and returns ``write()``, which puts the item's
    results into the buffer's shared memory and starts their copies out. With two buffers the
    next item's tile is requested as soon as this one has arrived (once the previous item's
    results have left the other buffer), so it loads during this item's walk; with one buffer
    it follows the results. Requesting it early instead of after the walk all but removed the
    wait for a tile (H100, profiled), at the price of a shorter wait for the previous item's
    results to leave.
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


def produce_items(
    items: Items, order_ref: Any, plan_ref: Any, streams_of: Any, consumed: list[Any], repeats: int = 1,
) -> None:
    """The producer warpgroup's walk: ``streams_of(b, h)`` gives an item's streams (see
    :func:`_produce`), ``consumed`` the barriers the consumers free ring slots on."""

    def body(i: jax.Array, carry: tuple[jax.Array, ...]) -> tuple[jax.Array, ...]:
        t0, visit = carry[0], Visit(*carry[1:])
        upcoming = items.visit(order_ref, plan_ref, i + 1)
        t1 = t0 + _produce(visit, streams_of(visit.b, visit.h), offset=t0, repeats=repeats)
        return (t1, *upcoming)

    steps = lax.fori_loop(0, items.mine(), body, (jnp.int32(0), *items.visit(order_ref, plan_ref, 0)))[0]
    _drain(consumed, steps)


def _operand(x: Any) -> jax.Array:
    return x if isinstance(x, jax.Array) else x[...]


def mma_new(shape: Shape, a: Any, b: Any, *, transpose_b: bool, between: Any = None) -> jax.Array | tuple[jax.Array, Any]:
    """``a @ b`` (``b^T`` with ``transpose_b``) into a fresh float32 accumulator: ``a`` in
    shared memory or registers, ``b`` in shared memory, the product with wgmma. ``between()``,
    if given, runs after the wgmma is issued and before its result is awaited (CUDA-core work
    beside the tensor cores'); what it returns, if not None, comes back as ``(product, it)``."""
    return mma_sum(shape, [(a, b)], transpose_b=transpose_b, between=between)


def mma_sum(
    shape: Shape, products: list[tuple[Any, Any]], *, transpose_b: bool, transpose_a: bool = False, between: Any = None,
) -> jax.Array | tuple[jax.Array, Any]:
    """The sum of ``a @ b`` over ``products`` in one fresh float32 accumulator, one wgmma each
    (operands as in :func:`mma_new`; ``a^T`` with ``transpose_a``, then from shared memory).

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


def mma_into(shape: Shape, acc: jax.Array, a: Any, b: Any, *, transpose_b: bool = False) -> jax.Array:
    """``acc + a @ b`` (``b^T`` with ``transpose_b``), the wgmma accumulating in ``acc``'s
    registers (``run_state``)."""
    if shape.interpret:
        dims = (((1,), (1 if transpose_b else 0,)), ((), ()))
        return acc + lax.dot_general(_operand(a), b[...], dims, preferred_element_type=jnp.float32)

    def run(acc_ref: Any) -> None:
        plgpu.wgmma(acc_ref, a, b.transpose((1, 0)) if transpose_b else b)

    return pl.run_state(run)(plgpu.ACC.init(acc))


def mma_beside(
    shape: Shape, q: Any, k: Any, acc: jax.Array, p: jax.Array, v: Any, *, between: Any, issued: Any = None,
) -> tuple[Any, jax.Array]:
    """``(between(q @ k^T), acc + p @ v)``: both products issued back to back, the first awaited
    alone, so ``between`` (CUDA-core work on the scores) runs while the second is on the tensor
    cores; ``issued()``, if given, runs once both are issued, before any wait. Operands as in
    :func:`mma_new` (``p`` in registers, ``k`` and ``v`` in shared memory). Both are issued
    unconditionally: ptxas serializes every wgmma of a kernel where one may be skipped between
    the issue and the wait."""
    if shape.interpret:
        s = mma_new(shape, q, k, transpose_b=True)
        if issued is not None:
            issued()
        return between(s), mma_into(shape, acc, p, v)

    def run(s_acc: Any, o_acc: Any) -> tuple[Any, jax.Array]:
        o_acc[...] = acc
        plgpu.wgmma(s_acc, q, k.transpose((1, 0)))
        plgpu.wgmma(o_acc, p, v)
        if issued is not None:
            issued()
        extra = between(plgpu.wgmma_accumulator_load(s_acc, wait_n=1))
        return extra, plgpu.wgmma_accumulator_load(o_acc, wait_n=0)

    return pl.run_scoped(run, plgpu.ACC((q.shape[0], k.shape[0]), jnp.float32), plgpu.ACC(acc.shape, jnp.float32))


def _compiler_params() -> Any:
    """Approximate math for ``exp2``, and no shared memory set aside for reductions across
    warps (Pallas reserves 2 KiB by default): every reduction here runs along the rows of the
    wgmma layout, whose elements sit in one warp, and a reduction that needed the scratch would
    fail to lower. The forward at head dim 128 needs those bytes for its results' own buffer
    (:func:`.forward.forward_call`)."""
    return plgpu.CompilerParams(approx_math=True, reduction_scratch_bytes=0)


def interpret_params() -> Any:
    """The Mosaic GPU interpreter's parameters (a private class in the JAX releases we use):
    it simulates shared memory, barriers, TMA and wgmma on the CPU, so values are tested there."""
    public = getattr(plgpu, "InterpretParams", None)
    if public is not None:
        return public()
    from jax._src.pallas.mosaic_gpu.interpret.params import InterpretGPUParams

    return InterpretGPUParams()


# 24 x 128 + 2 x 240 x 128 = 64512 of the SM's 65536 registers. The producer only issues copies;
# 240 rather than 232 per consumer cut the dk/dv kernel's spills at head dim 128
# (bench/ptxas_report.py).
CONSUMER_REGISTERS = 240
PRODUCER_REGISTERS = 24


# The source location every op of a kernel carries (see :func:`launch`): the Mosaic module's
# hash covers its locations, and one hash per distinct kernel lets the backend compile a kernel
# once for all its call sites.
_KERNEL_TRACEBACK = source_info_util.Traceback.get_traceback()


def launch(body: Any, out_type: Any, scratch: Any, programs: int, operands: tuple[Any, ...], interpret: bool) -> Any:
    """Run ``body`` on ``programs`` programs of ``consumers + 1`` warpgroups (named ``wg``),
    with ``scratch`` allocated in each program.

    The kernel is traced under one fixed source location instead of its caller's: a Mosaic
    module embeds its ops' locations and its hash covers them, so with the caller's stack two
    call sites on different source lines (or a forward seen from two backward sites) got two
    modules of one kernel, each compiled on its own (test_call_sites_share_one_module_per_kernel).
    The other per-launch difference, jaxlib 0.11's dump counter, is removed by
    :mod:`.modules`. Errors raised while tracing keep their Python traceback."""

    def kernel_body(*refs: Any) -> None:
        pl.run_scoped(functools.partial(body, *refs), *scratch, collective_axes="wg")

    with source_info_util.user_context(_KERNEL_TRACEBACK):
        return pl.kernel(
            kernel_body,
            out_type=out_type,
            mesh=plgpu.Mesh(grid=(programs,), grid_names=("programs",), num_threads=CONSUMERS + 1, thread_name="wg"),
            compiler_params=_compiler_params(),
            interpret=interpret_params() if interpret else False,
        )(*operands)
