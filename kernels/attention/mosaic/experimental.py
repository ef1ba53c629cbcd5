"""Experimental schedules of the Mosaic GPU attention kernels: kept for experiments and their
tests, outside the product (nothing in ``ejlabel.kernels`` imports this module; the attention
op's tuning space and config checks never see it).

:func:`mosaic_attention`: the kernels as one differentiable function with every knob of their
schedule (``interpret``, ``pingpong``, ``persistent``, ``pipelined``, the backward kernels'
turns) and tiles as arguments. With the defaults it runs the product's kernels, as
``flash_attention(..., cfg=AttentionConfig("mosaic", fwd, bwd))`` does without the executor,
labels or tuning. The CPU tests drive the kernels in the Mosaic GPU interpreter through it, and
the module-texts check (``module_texts.py``) lowers it to show that a change left the kernels'
modules alone. (The fused backward once here, and the pipelined dq kernel, were measured slower
and removed: see :mod:`.backward`.)
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any

import jax
from jaxtyping import Array, Float, Int

from ejlabel import BwdParams, FwdParams

from ..masks import Window
from . import mosaic_backward, mosaic_forward

__all__ = ["Schedule", "mosaic_attention"]


@dataclasses.dataclass(frozen=True)
class Schedule:
    """How the kernels run, apart from tile sizes (see :func:`mosaic_attention`)."""

    interpret: bool
    pingpong: bool
    persistent: bool
    pipelined: bool = False
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
    dq, dk, dv = mosaic_backward(
        q, k, v, segment_ids, out, lse, g, scale=scale, bounds=bounds, params=bwd, interpret=schedule.interpret,
        persistent=schedule.persistent, pingpong_dq=schedule.pingpong_dq, pingpong_dkv=schedule.pingpong_dkv,
    )
    return dq, dk, dv, None


_attention.defvjp(_attention_fwd, _attention_bwd)


def mosaic_attention(
    q: Float[Array, "batch sq heads dim"], k: Float[Array, "batch skv kv_heads dim"], v: Float[Array, "batch skv kv_heads dim"],
    *, scale: float | None = None, causal: bool = False, window: tuple[int, int] | None = None,
    segment_ids: Int[Array, "batch seq"] | None = None, params: tuple[FwdParams, BwdParams] | None = None,
    interpret: bool = False, pingpong: bool = True, persistent: bool = True, pipelined: bool = False,
    pingpong_dq: bool | None = None, pingpong_dkv: bool | None = None,
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
      pipelined: the forward's consumers overlap their softmax with their own products
        (:func:`.forward.pipelined_walk`); with ``pingpong``, taking turns to issue them.
      pingpong_dq: the dq kernel's consumers take turns with their products (see
        :func:`.backward.dq_call`). Unset: as :func:`.mosaic_backward` chooses by head dim.
      pingpong_dkv: the dk/dv kernel's consumers take turns (see :func:`.backward.dkv_call`).
        Unset: as :func:`.mosaic_backward` chooses.
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
    schedule = Schedule(interpret, pingpong, persistent, pipelined, pingpong_dq, pingpong_dkv)
    return _attention(q, k, v, segment_ids, scale, (left, right), fwd, bwd, schedule)
