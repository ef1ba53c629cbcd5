"""The ``"pallas"`` implementation of :func:`ejlabel.kernels.norms.rms_norm` and
:func:`~ejlabel.kernels.norms.layer_norm`: one fused kernel each way on Pallas's Triton backend.

The forward gives each program ``block_rows`` rows, reads them once and writes the output once.
The backward recomputes the row statistics from ``x`` (cheaper than storing them) and returns
``dx`` in one pass; each program walks a contiguous range of rows and keeps its partial sums of
``dw`` (and ``db``) in registers, so only ``[programs, width]`` partials, not ``[rows, width]``,
are written and summed afterwards.

The feature axis is zero-padded to a power of two (Triton tiles must have power-of-two sides)
and statistics divide by the true width; rows are padded to whole blocks.
"""

from __future__ import annotations

import functools
import math
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jaxtyping import Array, Float

from ..pallas_common import compiler_params, interpret_mode, next_power_of_2, pad_axis, pad_to

__all__ = ["norm_triton", "norm_triton_backward"]

# Programs of the backward kernel: enough to fill a large GPU several times over, few enough
# that the per-program partial sums of dw stay small.
_BACKWARD_PROGRAMS = 512


def _normalize(x: Float[Array, "rows width"], width: int, eps: float, centered: bool) -> tuple[jax.Array, jax.Array]:
    """``(x_hat, 1/std)`` of float32 rows whose entries past ``width`` are zero padding."""
    if centered:
        mean = jnp.sum(x, axis=1, keepdims=True) / width
        x = x - mean
        if x.shape[1] != width:
            # Padding is zero in x but not in x - mean; keep it out of the variance.
            x = jnp.where(lax.broadcasted_iota(jnp.int32, x.shape, 1) < width, x, 0.0)
    rstd = lax.rsqrt(jnp.sum(x * x, axis=1, keepdims=True) / width + eps)
    return x * rstd, rstd


def _forward_kernel(x_ref: Any, w_ref: Any, *refs: Any, width: int, eps: float, centered: bool) -> None:
    b_ref, o_ref = refs if centered else (None, refs[0])
    x_hat, _ = _normalize(x_ref[...].astype(jnp.float32), width, eps, centered)
    y = x_hat * w_ref[...].astype(jnp.float32)[None, :]
    if b_ref is not None:
        y = y + b_ref[...].astype(jnp.float32)[None, :]
    o_ref[...] = y.astype(o_ref.dtype)


def _backward_kernel(
    x_ref: Any, w_ref: Any, g_ref: Any, dx_ref: Any, dw_ref: Any, *db_ref: Any,
    width: int, eps: float, centered: bool, block_rows: int, steps: int,
) -> None:
    first_block = pl.program_id(0) * steps
    w = w_ref[...].astype(jnp.float32)[None, :]

    def step(i: jax.Array, sums: tuple[jax.Array, jax.Array]) -> tuple[jax.Array, jax.Array]:
        dw, db = sums
        rows = pl.ds(pl.multiple_of((first_block + i) * block_rows, block_rows), block_rows)
        g = g_ref[rows, :].astype(jnp.float32)
        x_hat, rstd = _normalize(x_ref[rows, :].astype(jnp.float32), width, eps, centered)
        g_hat = g * w
        # d/dx of x_hat: remove the components along x_hat (and, centered, along the mean).
        dx = g_hat - x_hat * (jnp.sum(g_hat * x_hat, axis=1, keepdims=True) / width)
        if centered:
            dx = dx - jnp.sum(g_hat, axis=1, keepdims=True) / width
        dx_ref[rows, :] = (dx * rstd).astype(dx_ref.dtype)
        return dw + jnp.sum(g * x_hat, axis=0), db + jnp.sum(g, axis=0)

    zeros = jnp.zeros((w.shape[1],), jnp.float32)
    dw, db = lax.fori_loop(0, steps, step, (zeros, zeros))
    dw_ref[...] = dw
    if db_ref:
        db_ref[0][...] = db


def _flatten(x: Float[Array, "*batch width"], padded_width: int) -> Float[Array, "rows padded_width"]:
    return pad_axis(x.reshape(-1, x.shape[-1]), 1, padded_width)


def norm_triton(
    x: Float[Array, "*batch width"], w: Float[Array, "width"], b: Float[Array, "width"] | None, eps: float, *, block_rows: int, num_warps: int,
) -> Float[Array, "*batch width"]:
    """The forward: ``block_rows`` rows a program, read once, written once (``b`` None: RMS norm)."""
    width = x.shape[-1]
    padded = next_power_of_2(width)
    rows = math.prod(x.shape[:-1])
    x2 = pad_to(_flatten(x, padded), 0, block_rows)
    params = [pad_axis(p, 0, padded) for p in (w, b) if p is not None]
    vector = pl.BlockSpec((padded,), lambda i: (0,))
    block = pl.BlockSpec((block_rows, padded), lambda i: (i, 0))
    out = pl.pallas_call(
        functools.partial(_forward_kernel, width=width, eps=eps, centered=b is not None),
        grid=(x2.shape[0] // block_rows,),
        in_specs=[block] + [vector] * len(params),
        out_specs=block,
        out_shape=jax.ShapeDtypeStruct(x2.shape, x.dtype),
        compiler_params=compiler_params(num_warps, num_stages=1),
        interpret=interpret_mode(),
        name="layer_norm" if b is not None else "rms_norm",
    )(x2, *params)
    return out[:rows, :width].reshape(x.shape)


def norm_triton_backward(
    x: Float[Array, "*batch width"], w: Float[Array, "width"], b: Float[Array, "width"] | None,
    g: Float[Array, "*batch width"], eps: float, *, block_rows: int, num_warps: int,
) -> tuple[jax.Array, ...]:
    """``(dx, dw)`` or, with ``b``, ``(dx, dw, db)``: the statistics recomputed from ``x``, each
    program's partial sums of ``dw`` (and ``db``) summed afterwards."""
    width = x.shape[-1]
    padded = next_power_of_2(width)
    rows = math.prod(x.shape[:-1])
    blocks = max(1, math.ceil(rows / block_rows))
    steps = math.ceil(blocks / min(blocks, _BACKWARD_PROGRAMS))
    programs = math.ceil(blocks / steps)
    total = programs * steps * block_rows
    # Padded rows have g = 0, so they add nothing to dw and db.
    x2, g2 = (pad_axis(_flatten(t, padded), 0, total) for t in (x, g.astype(x.dtype)))
    whole = pl.BlockSpec((total, padded), lambda p: (0, 0))
    partial = pl.BlockSpec((None, padded), lambda p: (p, 0))
    centered = b is not None
    sums = jax.ShapeDtypeStruct((programs, padded), jnp.float32)
    dx, dw, *db = pl.pallas_call(
        functools.partial(_backward_kernel, width=width, eps=eps, centered=centered, block_rows=block_rows, steps=steps),
        grid=(programs,),
        in_specs=[whole, pl.BlockSpec((padded,), lambda p: (0,)), whole],
        out_specs=[whole, partial] + [partial] * centered,
        out_shape=[jax.ShapeDtypeStruct(x2.shape, x.dtype), sums] + [sums] * centered,
        compiler_params=compiler_params(num_warps, num_stages=1),
        interpret=interpret_mode(),
        name="layer_norm_bwd" if centered else "rms_norm_bwd",
    )(x2, pad_axis(w, 0, padded), g2)
    grads = [dx[:rows, :width].reshape(x.shape), dw.sum(0)[:width].astype(w.dtype)]
    if centered:
        grads.append(db[0].sum(0)[:width].astype(b.dtype))
    return tuple(grads)
