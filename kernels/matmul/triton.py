"""The ``"pallas"`` implementation of :func:`ejlabel.kernels.matmul.matmul`: a tiled Pallas
kernel on the Triton backend.

Each program computes one ``block_m x block_n`` output tile, looping over ``k`` in
``block_k`` steps with a float32 accumulator. Programs are numbered so that ``group_m``
consecutive ones share a column band of ``b``: tiles that run together then read the same
``b`` tiles, which stay in L2. Operands are zero-padded to whole blocks (zeros add nothing to a
dot product) and the result sliced back, so any shape works.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jaxtyping import Array, Float

from ..pallas_common import compiler_params, dot, interpret_mode, pad_to

__all__ = ["matmul_triton"]


def _tile_coordinates(pid: jax.Array, num_m: int, num_n: int, group_m: int) -> tuple[jax.Array, jax.Array]:
    """Grouped ("swizzled") order: program ``pid`` -> output tile ``(i, j)``.

    Programs walk down ``group_m`` rows of tiles before moving one column right, instead of
    along a whole row: the ``group_m`` programs in flight together reuse one ``b`` column band
    and ``group_m`` ``a`` row bands, instead of one ``a`` band and ``num_n`` ``b`` bands.
    """
    per_group = group_m * num_n
    group = lax.div(pid, per_group)
    first_m = group * group_m
    rows_in_group = jnp.minimum(num_m - first_m, group_m)
    within = lax.rem(pid, per_group)
    return first_m + lax.rem(within, rows_in_group), lax.div(within, rows_in_group)


def _matmul_kernel(a_ref: Any, b_ref: Any, o_ref: Any, *, block_k: int) -> None:
    # a_ref is a [block_m, k] band, b_ref a [k, block_n] band; k is a multiple of block_k.
    steps = a_ref.shape[1] // block_k

    def step(i: jax.Array, acc: jax.Array) -> jax.Array:
        cols = pl.ds(pl.multiple_of(i * block_k, block_k), block_k)
        return acc + dot(a_ref[:, cols], b_ref[cols, :])

    acc = jnp.zeros(o_ref.shape, jnp.float32)
    o_ref[...] = lax.fori_loop(0, steps, step, acc).astype(o_ref.dtype)


def matmul_triton(
    a: Float[Array, "batch m k"], b: Float[Array, "batch k n"], *,
    block_m: int, block_n: int, block_k: int, num_warps: int, num_stages: int, group_m: int,
) -> Float[Array, "batch m n"]:
    """``a @ b`` over one leading batch axis, in ``block_m x block_n`` output tiles (see the
    module docstring)."""
    batch, m, _ = a.shape
    n = b.shape[2]
    a = pad_to(pad_to(a, 1, block_m), 2, block_k)
    b = pad_to(pad_to(b, 1, block_k), 2, block_n)
    padded_k = a.shape[2]
    num_m, num_n = a.shape[1] // block_m, b.shape[2] // block_n
    tile = functools.partial(_tile_coordinates, num_m=num_m, num_n=num_n, group_m=group_m)

    out = pl.pallas_call(
        functools.partial(_matmul_kernel, block_k=block_k),
        grid=(batch, num_m * num_n),
        in_specs=[
            pl.BlockSpec((None, block_m, padded_k), lambda z, p: (z, tile(p)[0], 0)),
            pl.BlockSpec((None, padded_k, block_n), lambda z, p: (z, 0, tile(p)[1])),
        ],
        out_specs=pl.BlockSpec((None, block_m, block_n), lambda z, p: (z, *tile(p))),
        out_shape=jax.ShapeDtypeStruct((batch, a.shape[1], b.shape[2]), a.dtype),
        compiler_params=compiler_params(num_warps, num_stages),
        interpret=interpret_mode(),
        name="matmul",
    )(a, b)
    return out[:, :m, :n]
