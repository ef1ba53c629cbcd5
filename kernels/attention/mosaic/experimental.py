"""Experimental schedules of the Mosaic GPU attention kernels: kept for experiments and their
tests, outside the product (nothing in ``ejlabel.kernels`` imports this module; the attention
op's tuning space and config checks never see it).

- :func:`mosaic_attention`: the kernels as one differentiable function with every knob of
  their schedule (``interpret``, ``pingpong``, ``persistent``, ``fused_backward``) and tiles
  as arguments. With the defaults it runs the product's kernels, as
  ``flash_attention(..., cfg=AttentionConfig("mosaic", fwd, bwd))`` does without the
  executor, labels or tuning. The CPU tests drive the kernels in the Mosaic GPU interpreter
  through it, and the module-texts check (``module_texts.py``) lowers it to show that a change
  left the kernels' modules alone.
- The fused backward (:func:`fused_backward`): one kernel for ``dq``, ``dk`` and ``dv``. The
  dk/dv kernel's walk already has each step's ``ds``; the fused backward adds that step's
  share of ``dq``, ``ds^T k`` over the tile's 128 keys, to a float32 ``dq`` in global memory
  with TMA reduce-adds (:class:`FusedDq`, a :class:`.backward.DkvExtension`), which saves the
  dq kernel's recomputation of ``q k^T``, the softmax and ``dO v^T`` at the price of float32
  additions in L2. It measured slower than the split: on the H100 (jax 0.11.2, interleaved
  runs) the backward alone at causal B4 S4096 H16 D128 took 1.85 ms split and 2.88 fused, at
  the packed model's shape 0.331 and 0.354 ms. The reduce-adds are the cost: without them the
  fused backward took 0.300 ms at the packed shape. One share per consumer ran 1.69x and 1.07x
  the split's time; the consumers taking turns to send one share per block pair
  (:func:`pair_share`) 1.56x and 1.07x: half the reduce-adds, but the turns add a wait of their
  own (without reduce-adds the fused backward went from 1.02x to 1.15x the split at D128).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jaxtyping import Array, Float, Int

from ejlabel import BwdParams, FwdParams

from ...pallas_common import pad_axis
from ..masks import Window
from . import (
    check_operands, mosaic_backward, mosaic_fits, mosaic_forward, pad_operands, padded_head_dim, tile_blocks, traced_once,
)
from .backward import DkvSite, dkv_call, dkv_passes, softmax_delta
from .kernel import SMEM_BYTES, mma_sum, plgpu, ring_stages, smem_tile
from .plan import CONSUMERS, TILE, WG_ROWS, Shape, visit_plan

__all__ = [
    "FusedDq",
    "Schedule",
    "fused_backward",
    "fused_bytes",
    "fused_fits",
    "mosaic_attention",
    "pair_share",
    "pair_share_done",
    "sum_shares",
]


# --------------------------------------------------------------------------------------------
# The fused backward


def fused_bytes(dim: int) -> int:
    """Shared memory the fused backward adds per program: each consumer's ``ds`` (16-bit,
    ``64 x 64``) and its float32 share of ``dq`` (``64 x dim``)."""
    return CONSUMERS * (WG_ROWS * WG_ROWS * 2 + WG_ROWS * dim * 4)


def fused_fits(dim: int, fwd: FwdParams, bwd: BwdParams) -> bool:
    """:func:`.mosaic_fits` with the fused backward: its dk/dv kernel also holds
    :func:`fused_bytes` (where it runs, with 64-row query blocks; else the split runs)."""
    if not mosaic_fits(dim, fwd, bwd):
        return False
    padded = padded_head_dim(dim)
    bwd_q, _, stages = tile_blocks(bwd, padded)
    if bwd_q != WG_ROWS:
        return True
    row = padded * 2  # bytes of one 16-bit row
    tile, stage = 2 * TILE * row + fused_bytes(padded), 2 * bwd_q * row
    return tile + ring_stages(stages, tile, stage) * stage <= SMEM_BYTES


def pair_share(
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
    that wait, :func:`pair_share_done` having waited at the end of the item before.

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
        share = mma_sum(shape, products, transpose_a=True, transpose_b=False)
        plgpu.barrier_arrive(ds_used.at[wg])
        send(share)


def pair_share_done(wg: jax.Array, t0: jax.Array, steps: jax.Array, ds_used: Any) -> None:
    """At the end of an item of ``steps`` steps from ``t0``: the consumer whose turn the last
    step was not waits until that turn has read its ``ds`` and keys, which the item's results
    (and, with one tile buffer, the next item's keys) are about to overwrite."""
    last = t0 + steps - 1
    pl.when((steps > 0) & (lax.rem(last, CONSUMERS) != wg))(lambda: plgpu.barrier_wait(ds_used.at[1 - wg]))


def sum_shares(shares: jax.Array, plan: jax.Array, block_q: int) -> Float[Array, "batch seq_q heads dim"]:
    """The interpreter's ``dq``: ``shares [batch, kv tiles, seq_q, heads, dim]`` summed over the
    query blocks each key/value tile visited (the others were never written)."""
    blocks = jnp.arange(shares.shape[2], dtype=jnp.int32) // block_q
    visited = (blocks >= plan[0][..., None]) & (blocks < plan[1][..., None])  # [batch, tiles, seq_q]
    return jnp.where(visited[:, :, :, None, None], shares, 0.0).sum(axis=1)


@dataclasses.dataclass(frozen=True)
class FusedDq:
    """The dk/dv kernel's extension that adds each step's share of ``dq`` up in float32 (see
    :func:`pair_share`); its result is ``dq [batch, seq_q, heads, dim]`` float32, unscaled
    (times the softmax scale, it is the gradient).

    On the GPU the shares go to a float32 ``dq`` in global memory, read and written in place,
    with TMA reduce-adds. The interpreter has no reduce-add: there each step stores its share
    in a slot of its own (key/value tile) and the shares of the visited blocks are summed
    outside (:func:`sum_shares`).
    """

    interpret: bool

    def smem_bytes(self, dim: int) -> int:
        return fused_bytes(dim)

    def operands(self, q: jax.Array) -> tuple[Any, ...]:
        return () if self.interpret else (jax.new_ref(jnp.zeros(q.shape, jnp.float32)),)

    def out_types(self, q: jax.Array, plan: jax.Array) -> tuple[jax.ShapeDtypeStruct, ...]:
        return (jax.ShapeDtypeStruct((q.shape[0], plan.shape[2], *q.shape[1:]), jnp.float32),) if self.interpret else ()

    def scratch(self, dtype: Any, block_q: int, dim: int) -> tuple[Any, ...]:
        return smem_tile((CONSUMERS, WG_ROWS, block_q), dtype), smem_tile((CONSUMERS, block_q, dim), jnp.float32)

    def barriers(self) -> tuple[Any, ...]:
        # The turns of pair_share: ds ready (both consumers), ds and keys read (the sender).
        return plgpu.Barrier(num_arrivals=CONSUMERS, num_barriers=CONSUMERS), plgpu.Barrier(num_barriers=CONSUMERS)

    def step(self, site: DkvSite, ds: jax.Array, t: jax.Array, j: jax.Array, head: jax.Array) -> None:
        """``dq[block j] += ds^T k`` over both consumers' keys, sent by step ``t``'s turn."""
        ds_smem, dq_smem = site.scratch
        dq_ref = (site.outputs if self.interpret else site.inputs)[0]
        wg, block_q = site.wg, site.block_q

        def send(share: jax.Array) -> None:
            my_dq = dq_smem.at[wg]
            plgpu.wait_smem_to_gmem(0, wait_read_only=True)  # my last share has left my_dq
            my_dq[...] = share
            plgpu.commit_smem()
            rows = pl.ds(j * block_q, block_q)
            if self.interpret:
                plgpu.copy_smem_to_gmem(my_dq, dq_ref.at[site.b, site.tile, rows, head])
            else:
                plgpu.copy_smem_to_gmem(my_dq, dq_ref.at[site.b, rows, head], reduction_op="add")

        pair_share(site.shape, wg, t, site.t0, ds, ds_smem, site.k_smem.at[site.buf], site.barriers, send)

    def item_done(self, site: DkvSite, steps: jax.Array) -> None:
        pair_share_done(site.wg, site.t0, steps, site.barriers[1])

    def result(self, operands: tuple[Any, ...], outputs: tuple[jax.Array, ...], plan: jax.Array, block_q: int) -> jax.Array:
        return sum_shares(outputs[0], plan, block_q) if self.interpret else operands[0][...]


@traced_once
def fused_backward(
    q: Float[Array, "batch sq heads dim"], k: Float[Array, "batch skv kv_heads dim"], v: Float[Array, "batch skv kv_heads dim"],
    segment_ids: Int[Array, "batch seq"] | None, out: Float[Array, "batch sq heads dim"], lse: Float[Array, "batch heads sq"],
    g: Float[Array, "batch sq heads dim"], *, scale: float, bounds: Window, params: BwdParams, interpret: bool = False,
    persistent: bool = True,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """:func:`.mosaic_backward` in one kernel that adds ``dq`` up in float32 (see the module
    docstring), where it runs: a ``q_blocksize`` of 64 and one dk/dv walk (head dim <= 128);
    elsewhere the split."""
    check_operands(q, k)
    block_q, block_k, stages = tile_blocks(params, q.shape[3])
    if block_q != WG_ROWS or len(dkv_passes(padded_head_dim(q.shape[3]))) != 1:
        return mosaic_backward(q, k, v, segment_ids, out, lse, g, scale=scale, bounds=bounds, params=params, interpret=interpret, persistent=persistent)
    p = pad_operands(q, k, v, segment_ids, scale=scale, bounds=bounds, block_k=block_k, interpret=interpret)
    batch, rows, cols = p.q.shape[0], p.rows, p.cols
    do, out = p.like_q(g.astype(p.q.dtype)), p.like_q(out)
    lse = pad_axis(lse.astype(jnp.float32), 2, rows)  # row terms over whole tiles: TMA strides
    delta = softmax_delta(out, do, rows)
    cols_plan = visit_plan(cols, rows, TILE, block_q, p.shape, p.segment_ids, batch, transpose=True)
    dk, dv, dq = dkv_call(
        p.q, p.k, p.v, do, lse, delta, cols_plan, p.segment_ids, p.shape,
        block_q=block_q, stages=stages, persistent=persistent, extension=FusedDq(interpret),
    )
    dq = (dq * scale).astype(p.q.dtype)
    seq_kv = p.seq_kv
    return dq[:, : p.seq_q, :, : p.dim], dk[:, :seq_kv, :, : p.dim], dv[:, :seq_kv, :, : p.dim]


# --------------------------------------------------------------------------------------------
# One differentiable function with every knob


@dataclasses.dataclass(frozen=True)
class Schedule:
    """How the kernels run, apart from tile sizes (see :func:`mosaic_attention`)."""

    interpret: bool
    pingpong: bool
    persistent: bool
    fused_backward: bool
    pipelined: bool = False
    pipelined_dq: bool = False
    pingpong_dq: bool | None = None
    pingpong_dkv: bool | None = None


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5, 6, 7, 8))
def _attention(q: jax.Array, k: jax.Array, v: jax.Array, segment_ids: jax.Array | None, scale: float, bounds: Window,
               fwd: FwdParams, bwd: BwdParams, schedule: Schedule) -> jax.Array:
    return _attention_fwd(q, k, v, segment_ids, scale, bounds, fwd, bwd, schedule)[0]


def _attention_fwd(q: jax.Array, k: jax.Array, v: jax.Array, segment_ids: jax.Array | None, scale: float, bounds: Window,
                   fwd: FwdParams, bwd: BwdParams, schedule: Schedule) -> tuple[jax.Array, tuple[Any, ...]]:
    out, lse = mosaic_forward(
        q, k, v, segment_ids, scale=scale, bounds=bounds, params=fwd, interpret=schedule.interpret, pingpong=schedule.pingpong,
        persistent=schedule.persistent, pipelined=schedule.pipelined,
    )
    return out, (q, k, v, segment_ids, out, lse)


def _attention_bwd(scale: float, bounds: Window, fwd: FwdParams, bwd: BwdParams, schedule: Schedule,
                   residuals: tuple[Any, ...], g: jax.Array) -> tuple[Any, ...]:
    q, k, v, segment_ids, out, lse = residuals
    common = dict(scale=scale, bounds=bounds, params=bwd, interpret=schedule.interpret, persistent=schedule.persistent)
    if schedule.fused_backward:
        dq, dk, dv = fused_backward(q, k, v, segment_ids, out, lse, g, **common)
    else:
        dq, dk, dv = mosaic_backward(
            q, k, v, segment_ids, out, lse, g, **common,
            pipelined_dq=schedule.pipelined_dq, pingpong_dq=schedule.pingpong_dq, pingpong_dkv=schedule.pingpong_dkv,
        )
    return dq, dk, dv, None


_attention.defvjp(_attention_fwd, _attention_bwd)


def mosaic_attention(
    q: Float[Array, "batch sq heads dim"], k: Float[Array, "batch skv kv_heads dim"], v: Float[Array, "batch skv kv_heads dim"],
    *, scale: float | None = None, causal: bool = False, window: tuple[int, int] | None = None,
    segment_ids: Int[Array, "batch seq"] | None = None, params: tuple[FwdParams, BwdParams] | None = None,
    interpret: bool = False, pingpong: bool = True, persistent: bool = True, fused_backward: bool = False, pipelined: bool = False,
    pipelined_dq: bool = False, pingpong_dq: bool | None = None, pingpong_dkv: bool | None = None,
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
      pingpong: alternate the forward's two consumer warpgroups (see :func:`.mosaic_forward`).
      persistent: at most one program per SM, each walking several tiles (see :class:`.work.Items`).
      fused_backward: one backward kernel for dq, dk and dv (see :func:`fused_backward`).
      pipelined: the forward's consumers overlap their softmax with their own products
        (:func:`.forward.pipelined_walk`); with ``pingpong``, taking turns to issue them.
      pipelined_dq: the dq kernel overlaps each step's ``dq`` product with the next step's
        scores (see :func:`.backward.dq_call`); not with ``fused_backward``.
      pingpong_dq: the dq kernel's consumers take turns with their products (see
        :func:`.backward.dq_call`); not with ``fused_backward`` or ``pipelined_dq``. Unset: as
        :func:`.mosaic_backward` chooses by head dim.
      pingpong_dkv: the dk/dv kernel's consumers take turns (see :func:`.backward.dkv_call`);
        not with ``fused_backward``. Unset: as :func:`.mosaic_backward` chooses.
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
    if fused_backward and (pipelined_dq or pingpong_dq or pingpong_dkv):
        raise ValueError("fused_backward, pipelined_dq, pingpong_dq, pingpong_dkv: the fused backward has its own schedule; expected one of them")
    schedule = Schedule(interpret, pingpong, persistent, fused_backward, pipelined, pipelined_dq, pingpong_dq, pingpong_dkv)
    return _attention(q, k, v, segment_ids, scale, (left, right), fwd, bwd, schedule)
