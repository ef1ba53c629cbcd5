"""What each tile of a Mosaic attention kernel visits, and how a warpgroup walks it.

A kernel's rows (queries, or keys in the dk/dv kernel) are cut into tiles of :data:`TILE` rows,
:data:`WG_ROWS` per consumer warpgroup. Outside the kernel each tile gets a plan
(:func:`visit_plan`): the range ``[lo, hi)`` of column blocks it must visit, from causal
bounds, windows, padded keys and segment ids, inside it the run ``[a, c)`` that every row sees
whole, and around that ``[u_lo, u_hi)``, the blocks holding the tile's one document only.
Blocks outside ``[lo, hi)`` are never loaded; the others come in three kinds (:class:`Mask`),
and :func:`walk` gives each kind the loop whose mask it needs (:func:`mask_loops`).

Nothing here touches the GPU: the kernels (:mod:`.forward`, :mod:`.backward`)
read the plans and call :func:`walk` with their step.
"""

from __future__ import annotations

import contextlib
import dataclasses
import enum
import functools
import math
from collections.abc import Callable, Hashable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jaxtyping import Array, Int

from ..blocks import segment_block_ranges, uniform_block_ranges
from ..masks import Window

__all__ = [
    "CONSUMERS", "MAX_CONSTANT", "POSITIONS_APART_MAX_DIM", "TILE", "WG_ROWS", "Mask", "Shape", "Visit", "mask_loops",
    "folded", "plan_from_tables", "positional_plan", "positional_visibility", "visit_plan", "walk",
]

WG_ROWS = 64  # rows of a tile one consumer warpgroup owns: the M of one wgmma
CONSUMERS = 2
TILE = WG_ROWS * CONSUMERS  # rows per program


@dataclasses.dataclass(frozen=True)
class Shape:
    """Static facts of one call, after padding."""

    scale: float  # softmax scale times log2(e)
    bounds: Window
    kv_len: int | None  # the true key length when keys are padded and there are no segment ids
    group: int  # query heads per key/value head
    segmented: bool
    interpret: bool = False  # run in the Mosaic GPU interpreter (CPU tests)


def positional_visibility(rows: int, cols: int, block_r: int, block_c: int, shape: Shape, *, transpose: bool) -> tuple[jax.Array, jax.Array]:
    """``(any, all) [1, rows/block_r, cols/block_c]`` over block pairs under positions alone
    (causal bounds, window, padded keys): whether some, and whether every, (query, key) pair of
    the two blocks is visible. With ``transpose`` the row blocks are key blocks."""
    r = jnp.arange(rows // block_r, dtype=jnp.int32)[:, None]
    c = jnp.arange(cols // block_c, dtype=jnp.int32)[None, :]
    q_first, q_last = (c * block_c, c * block_c + block_c - 1) if transpose else (r * block_r, r * block_r + block_r - 1)
    k_first, k_last = (r * block_r, r * block_r + block_r - 1) if transpose else (c * block_c, c * block_c + block_c - 1)
    some = every = jnp.ones((r.shape[0], c.shape[1]), bool)
    left, right = shape.bounds
    if right is not None:  # key <= query + right
        some, every = some & (k_first <= q_last + right), every & (k_last <= q_first + right)
    if left is not None:  # key >= query - left
        some, every = some & (k_last >= q_first - left), every & (k_first >= q_last - left)
    if shape.kv_len is not None:
        some, every = some & (k_first < shape.kv_len), every & (k_last < shape.kv_len)
    return some[None], every[None]


def plan_from_tables(some: jax.Array, every: jax.Array) -> Int[Array, "6 batch blocks"]:
    """``[6, batch, row blocks]`` int32: ``lo, hi, a, c, u_lo, u_hi`` per row block from
    block-pair tables under positions alone. Columns ``[lo, hi)`` are visited, ``[a, c)`` of
    them without a mask; ``[u_lo, u_hi)`` are those that need no segment mask, here all of them
    (``lo <= u_lo <= a <= c <= u_hi <= hi``)."""
    every = every & some
    n = some.shape[2]
    idx = jnp.arange(n, dtype=jnp.int32)
    lo = jnp.min(jnp.where(some, idx, n), axis=2)
    hi = jnp.max(jnp.where(some, idx + 1, 0), axis=2)
    lo = jnp.minimum(lo, hi)  # nothing visible: lo = hi = 0
    a = jnp.min(jnp.where(every, idx, hi[..., None]), axis=2)
    c = jnp.min(jnp.where(~every & (idx >= a[..., None]), idx, hi[..., None]), axis=2)
    c = jnp.clip(c, a, hi)
    return jnp.stack([lo, hi, a, c, lo, hi]).astype(jnp.int32)


MAX_CONSTANT = 1 << 16  # int32 elements of a plan or an order that may enter a program as a constant


@functools.lru_cache(maxsize=1024)
def _compiled(fn: Callable[..., Any], static: tuple[tuple[str, Any], ...], avals: tuple[jax.ShapeDtypeStruct, ...]) -> Any:
    return jax.jit(fn, static_argnames=tuple(name for name, _ in static)).lower(*avals, **dict(static)).compile()


def folded(fn: Callable[..., jax.Array], *arrays: Any, elements: int, **static: Hashable) -> Any:
    """``fn(*arrays, **static)``, computed while tracing so that it enters the caller's program
    as a constant (a NumPy array), when every array is known then and the result has at most
    :data:`MAX_CONSTANT` elements; larger ones (a batch of hundreds of long rows) and results
    of traced arrays (segment ids) are traced into the caller's program instead.

    Computed as one compiled program, kept for its shapes and ``static`` arguments, outside
    every trace: under ``jax.ensure_compile_time_eval`` each operation was compiled on its own
    (a ``jax.jit`` inside it too, its inputs being known), and a differentiated call's plans
    and work orders took seconds of its tracing."""
    if elements <= MAX_CONSTANT and not any(isinstance(a, jax.core.Tracer) for a in arrays):
        avals = tuple(jax.ShapeDtypeStruct(np.shape(a), a.dtype) for a in arrays)
        return np.asarray(_compiled(fn, tuple(sorted(static.items())), avals)(*arrays))
    return fn(*arrays, **static)


def positional_plan(*, rows: int, cols: int, block_r: int, block_c: int, shape: Shape, transpose: bool) -> Int[Array, "6 1 blocks"]:
    """:func:`plan_from_tables` of :func:`positional_visibility`: one batch row's plan under
    positions alone."""
    return plan_from_tables(*positional_visibility(rows, cols, block_r, block_c, shape, transpose=transpose))


def visit_plan(
    rows: int, cols: int, block_r: int, block_c: int, shape: Shape, segment_ids: jax.Array | None, batch: int, *, transpose: bool
) -> Int[Array, "6 batch blocks"]:
    """The plan (see :func:`plan_from_tables`) of every row block: positions give one plan, segment ids
    (through :func:`segment_block_ranges`, which never builds the block-pair table) another;
    the blocks visited are those both visit, and a block runs unmasked only if both say so.
    ``[u_lo, u_hi)`` are the blocks holding the row block's one segment and no other id
    (:func:`uniform_block_ranges`): there the segment ids mask nothing, so a block that needs a
    mask may take the positions' alone (where the kernels give it a loop, see
    :func:`mask_loops`). On the H100, head dim 128, a document's diagonal block took much
    longer with the segment ids' mask than a causal diagonal without segment ids (profiled).

    The positional plan depends on static sizes only, so it is computed while tracing and
    enters the program as a constant (see :func:`folded`): on the device it cost a call a dozen
    small kernels, before the causal forward and around forward and backward (H100)."""
    # [6, 1, row blocks], small whatever the batch: always a constant.
    positional = folded(positional_plan, elements=0, rows=rows, cols=cols, block_r=block_r, block_c=block_c, shape=shape, transpose=transpose)
    plan_shape = (positional.shape[0], batch, rows // block_r)
    plan = folded(jnp.broadcast_to, positional, elements=math.prod(plan_shape), shape=plan_shape)
    if segment_ids is None:
        return plan
    q_rows, k_rows = (cols, rows) if transpose else (rows, cols)
    block_q, block_k = (block_c, block_r) if transpose else (block_r, block_c)
    ranges = segment_block_ranges(segment_ids[:, :q_rows], segment_ids[:, :k_rows], block_q, block_k)
    runs = uniform_block_ranges(ranges)
    seg_lo, seg_hi, first, last = (
        (ranges.q_lo, ranges.q_hi, runs.q_first, runs.q_last) if transpose else (ranges.kv_lo, ranges.kv_hi, runs.kv_first, runs.kv_last)
    )
    lo = jnp.maximum(plan[0], seg_lo)
    hi = jnp.maximum(jnp.minimum(plan[1], seg_hi), lo)
    u_lo = jnp.clip(first, lo, hi)
    u_hi = jnp.clip(last, u_lo, hi)
    a = jnp.clip(plan[2], u_lo, u_hi)
    c = jnp.clip(plan[3], a, u_hi)
    run = a < c  # an empty unmasked run: every visited block gets a mask
    a, c = jnp.where(run, a, u_lo), jnp.where(run, c, u_lo)
    return jnp.stack([lo, hi, a, c, u_lo, u_hi]).astype(jnp.int32)


class Mask(enum.Enum):
    """The mask a step applies: the planned blocks come in three kinds (see :func:`visit_plan`)."""

    NONE = "none"  # every pair of the block is visible
    POSITIONS = "positions"  # causal bounds, window, padded keys
    SEGMENTS = "segments"  # those and the segment ids


class Visit(NamedTuple):
    """One item as a warpgroup walks it: batch row ``b``, head ``h`` (a key/value head in the
    dk/dv kernel), ``tile``, and its plan ``lo, hi, a, c, u_lo, u_hi`` (see :func:`plan_from_tables`)."""

    b: jax.Array
    h: jax.Array
    tile: jax.Array
    lo: jax.Array
    hi: jax.Array
    a: jax.Array
    c: jax.Array
    u_lo: jax.Array
    u_hi: jax.Array

    @property
    def steps(self) -> jax.Array:
        return self.hi - self.lo

    def _ranges(self) -> tuple[tuple[jax.Array, jax.Array], ...]:
        """The visited blocks as ranges, in the order walked: those needing the segment ids'
        mask (``[lo, u_lo)``, ``[u_hi, hi)``), those masked by positions alone (``[u_lo, a)``,
        ``[c, u_hi)``), then the unmasked run ``[a, c)``."""
        return (self.lo, self.u_lo), (self.u_hi, self.hi), (self.u_lo, self.a), (self.c, self.u_hi), (self.a, self.c)

    def steps_until(self, kind: Mask) -> jax.Array:
        """Steps up to the end of the blocks of ``kind`` (the kinds come in :meth:`_ranges`' order)."""
        ranges = {Mask.SEGMENTS: 2, Mask.POSITIONS: 4, Mask.NONE: 5}[kind]
        return sum(stop - start for start, stop in self._ranges()[:ranges])

    def block(self, s: jax.Array) -> jax.Array:
        """The block of the item's ``s``-th step, in :meth:`_ranges`' order. The producer and
        the consumers walk this one order, so a ring slot holds the block its consumer expects."""
        (start, stop), *later = self._ranges()
        block, first = start + s, stop - start  # ``first``: the item's step where a range begins
        for start, stop in later:  # an empty range is overridden by the next
            block = jnp.where(s >= first, start + s - first, block)
            first = first + (stop - start)
        return block

    def row0(self, wg: jax.Array) -> jax.Array:
        """The first row of the tile that consumer ``wg`` owns."""
        return self.tile * TILE + wg * WG_ROWS


# Up to this head dim, blocks masked by positions alone get a loop of their own beside those that
# need the segment ids' mask (see mask_loops). The third copy of a step costs registers: at head
# dim 128 the kernels spilled more with it (bench/ptxas_report.py --segments) and ran slower
# (4 documents of 1024 tokens); at 64 the packed model's shape ran faster with it (H100; the
# shapes of bench_attention.py sections b and c). Measured before kernel.per_step freed the
# registers each walk held for its tiles' descriptors; not measured again since.
POSITIONS_APART_MAX_DIM = 64


def mask_loops(segmented: bool, dim: int) -> tuple[Mask, ...]:
    """The masks that get a walk loop of their own (see :func:`walk`), the strictest first.
    Without segment ids no block needs theirs. With them, a block masked by positions alone
    (a document's diagonal) skips loading and comparing the ids in a loop of its own, up to
    head dim :data:`POSITIONS_APART_MAX_DIM`; above it such blocks take the segment ids' mask
    too, so the kernel holds two copies of its step rather than three."""
    if not segmented:
        return (Mask.POSITIONS,)
    return (Mask.SEGMENTS, Mask.POSITIONS) if dim <= POSITIONS_APART_MAX_DIM else (Mask.SEGMENTS,)


def walk(visit: Visit, step: Any, carry: Any, offset: Any = 0, *, masks: tuple[Mask, ...]) -> Any:
    """``step(j, t, carry, mask)`` over the planned blocks ``j`` in :meth:`Visit.block`'s
    order, ``mask`` the :class:`Mask` they get; ``t = offset + s`` at the item's ``s``-th step
    counts the producer's steps (it picks the ring slot). One loop per mask in ``masks`` (see
    :func:`mask_loops`; the last takes every masked block left), then the unmasked run: each
    loop is a copy of the step's code in the kernel, so the blocks of one kind on both sides
    of the unmasked run share one."""
    stops = [visit.steps_until(mask) for mask in masks[:-1]] + [visit.steps_until(Mask.POSITIONS), visit.steps]

    def run(start: jax.Array, stop: jax.Array, mask: Mask, carry: Any) -> Any:
        return lax.fori_loop(start, stop, lambda s, cr: step(visit.block(s), offset + s, cr, mask), carry)

    start = jnp.int32(0)
    with jax.named_scope("walk"):
        for mask, stop in zip((*masks, Mask.NONE), stops):
            with jax.named_scope("masked") if mask is not Mask.NONE else contextlib.nullcontext():
                carry = run(start, stop, mask, carry)
            start = stop
    return carry
