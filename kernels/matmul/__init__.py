"""Matrix multiplication: ``[..., m, k] @ [..., k, n]`` with float32 accumulation.

Two implementations, chosen by :class:`MatmulConfig.impl`:

- ``"xla"``: ``a @ b``, the expression a JAX user writes, differentiated by JAX itself (XLA's
  GPU dot accumulates half-precision inputs in float32); with it the compiled program is the
  one plain JAX gives;
- ``"pallas"``: a tiled Pallas kernel (Triton backend). Each program computes one
  ``block_m x block_n`` output tile, looping over ``k`` in ``block_k`` steps with a float32
  accumulator. Programs are numbered so that ``group_m`` consecutive ones share a column band
  of ``b``: tiles that run together then read the same ``b`` tiles, which stay in L2.

Operands are zero-padded to whole blocks (zeros add nothing to a dot product) and the result
sliced back, so any shape works. The Pallas backward pass is two more matmuls through the same
implementation and config: ``da = g @ b^T`` and ``db = a^T @ g``.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jaxtyping import Array, Float

from ejlabel import Invocation, Kernel

from ..checks import check_config, check_floating
from ..pallas_common import compiler_params, dot, interpret_mode, on_gpu, pad_to

__all__ = ["MatmulConfig", "MatmulKernel", "matmul"]

_IMPLS = ("xla", "pallas")
# Shared memory one Hopper program may use; a candidate whose pipelined tiles need more
# cannot launch.
_SHARED_MEMORY_BYTES = 228 * 1024


@dataclasses.dataclass(frozen=True)
class MatmulConfig:
    """How to run one matmul.

    Attributes:
      impl: ``"xla"`` or ``"pallas"``; the tile fields only matter for ``"pallas"``.
      block_m, block_n: output tile of one program (powers of two).
      block_k: depth of one step of the reduction loop (a power of two).
      num_warps, num_stages: Triton launch parameters (warps per program, pipelining depth).
      group_m: programs along ``m`` that share a band of ``b`` columns (L2 reuse).
    """

    impl: str = "xla"
    block_m: int = 128
    block_n: int = 128
    block_k: int = 32
    num_warps: int = 4
    num_stages: int = 3
    group_m: int = 8

    def __post_init__(self) -> None:
        if self.impl not in _IMPLS:
            raise ValueError(f"impl: expected one of {_IMPLS}, got {self.impl!r}")


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


def _matmul_pallas(
    a: Float[Array, "batch m k"], b: Float[Array, "batch k n"], cfg: MatmulConfig
) -> Float[Array, "batch m n"]:
    batch, m, _ = a.shape
    n = b.shape[2]
    a = pad_to(pad_to(a, 1, cfg.block_m), 2, cfg.block_k)
    b = pad_to(pad_to(b, 1, cfg.block_k), 2, cfg.block_n)
    padded_k = a.shape[2]
    num_m, num_n = a.shape[1] // cfg.block_m, b.shape[2] // cfg.block_n
    tile = functools.partial(_tile_coordinates, num_m=num_m, num_n=num_n, group_m=cfg.group_m)

    out = pl.pallas_call(
        functools.partial(_matmul_kernel, block_k=cfg.block_k),
        grid=(batch, num_m * num_n),
        in_specs=[
            pl.BlockSpec((None, cfg.block_m, padded_k), lambda z, p: (z, tile(p)[0], 0)),
            pl.BlockSpec((None, padded_k, cfg.block_n), lambda z, p: (z, 0, tile(p)[1])),
        ],
        out_specs=pl.BlockSpec((None, cfg.block_m, cfg.block_n), lambda z, p: (z, *tile(p))),
        out_shape=jax.ShapeDtypeStruct((batch, a.shape[1], b.shape[2]), a.dtype),
        compiler_params=compiler_params(cfg.num_warps, cfg.num_stages),
        interpret=interpret_mode(),
        name="matmul",
    )(a, b)
    return out[:, :m, :n]


def _matmul_xla(a: Float[Array, "*batch m k"], b: Float[Array, "*batch k n"]) -> Float[Array, "*batch m n"]:
    return a @ b


def _matmul(a: Float[Array, "*batch m k"], b: Float[Array, "*batch k n"], cfg: MatmulConfig) -> Float[Array, "*batch m n"]:
    if cfg.impl == "xla":
        return _matmul_xla(a, b)
    batch = a.shape[:-2]
    flat = _matmul_pallas(a.reshape(-1, *a.shape[-2:]), b.reshape(-1, *b.shape[-2:]), cfg)
    return flat.reshape(*batch, *flat.shape[-2:])


def _check_operands(a: Any, b: Any) -> None:
    if a.ndim < 2 or a.ndim != b.ndim:
        raise ValueError(f"a, b: expected [..., m, k] and [..., k, n] of equal rank >= 2, got {a.shape} and {b.shape}")
    if a.shape[:-2] != b.shape[:-2] or a.shape[-1] != b.shape[-2]:
        raise ValueError(f"a, b: shapes {a.shape} and {b.shape} do not multiply (batch dims must be equal)")
    if a.dtype != b.dtype:
        raise ValueError(f"a, b: expected one dtype, got {a.dtype} and {b.dtype}")


class MatmulKernel(Kernel[MatmulConfig, jax.Array]):
    """``a @ b`` over equal leading batch dimensions; see the module docstring."""

    version = "1"

    def __init__(self) -> None:
        super().__init__("matmul")

    def run(self, a: Float[Array, "*batch m k"], b: Float[Array, "*batch k n"], *, cfg: MatmulConfig) -> Float[Array, "*batch m n"]:
        _check_operands(a, b)
        return _matmul(a, b, cfg)

    def custom_vjp(
        self, primals: tuple[Any, ...], cfg: MatmulConfig, kwargs: dict[str, Any], cotangents: tuple[Any, ...]
    ) -> tuple[jax.Array, jax.Array]:
        a, b = primals
        (g,) = cotangents
        g = g.astype(a.dtype)
        return _matmul(g, jnp.swapaxes(b, -1, -2), cfg), _matmul(jnp.swapaxes(a, -1, -2), g, cfg)

    def differentiated_by_jax(self, cfg: MatmulConfig) -> bool:
        return cfg.impl == "xla"

    def reference(self, a: Float[Array, "*batch m k"], b: Float[Array, "*batch k n"]) -> Float[Array, "*batch m n"]:
        return jnp.matmul(a, b, preferred_element_type=jnp.float32).astype(a.dtype)

    def heuristic_cfg(self, inv: Invocation[MatmulConfig, jax.Array]) -> MatmulConfig:
        # The plain-JAX path until tuning in context shows something faster: an untuned
        # labelled model compiles to the plain model's program, never to a slower one.
        return MatmulConfig("xla")

    def config_space(self, inv: Invocation[MatmulConfig, jax.Array]) -> list[MatmulConfig]:
        if not on_gpu():
            # The interpreter is slow: a couple of tilings are enough to exercise tuning.
            return [MatmulConfig("xla"), MatmulConfig("pallas", 16, 16, 16, 4, 3, 2), MatmulConfig("pallas", 32, 16, 32, 4, 3, 1)]
        tiles = itertools.product((64, 128, 256), (64, 128, 256), (32, 64), (4, 8), (3, 4))
        return [MatmulConfig("xla")] + [MatmulConfig("pallas", bm, bn, bk, w, s, 8) for bm, bn, bk, w, s in tiles]

    def candidate_is_valid(self, inv: Invocation[MatmulConfig, jax.Array], cfg: MatmulConfig) -> bool:
        if cfg.impl == "xla":
            return True
        a, b = inv.args
        if a.dtype not in (jnp.float32, jnp.bfloat16, jnp.float16):
            return False
        # A tile much taller or wider than the matrix is padding, not work.
        m, k, n = a.shape[-2], a.shape[-1], b.shape[-1]
        if cfg.block_m > max(16, 2 * m) or cfg.block_n > max(16, 2 * n) or cfg.block_k > max(16, 2 * k):
            return False
        staged = (cfg.block_m + cfg.block_n) * cfg.block_k * a.dtype.itemsize * cfg.num_stages
        return not on_gpu() or staged <= _SHARED_MEMORY_BYTES


_MATMUL = MatmulKernel()


def matmul(
    a: Float[Array, "*batch m k"], b: Float[Array, "*batch k n"], *, cfg: MatmulConfig | None = None
) -> Float[Array, "*batch m n"]:
    """``a @ b`` with float32 accumulation, in the inputs' dtype.

    Args:
      a: ``[..., m, k]``, float32, bfloat16 or float16.
      b: ``[..., k, n]``, same dtype and the same leading (batch) dimensions as ``a``.
      cfg: force a config; by default the executor picks one (cache, else heuristic).

    Returns:
      ``[..., m, n]`` in the dtype of ``a``.
    """
    check_floating(a, "a")
    check_floating(b, "b")
    check_config(cfg, MatmulConfig)
    return _MATMUL(a, b, cfg=cfg)
