"""Matrix multiplication: ``[..., m, k] @ [..., k, n]`` with float32 accumulation.

Two implementations, chosen by :class:`MatmulConfig.impl`:

- ``"xla"``: ``a @ b``, the expression a JAX user writes, differentiated by JAX itself
  (:mod:`.xla`); with it the compiled program is the one plain JAX gives;
- ``"pallas"``: a tiled Pallas kernel on the Triton backend (:mod:`.triton`), any shape (the
  operands are padded to whole tiles).

The Pallas backward pass is two more matmuls through the same implementation and config:
``da = g @ b^T`` and ``db = a^T @ g``.
"""

from __future__ import annotations

import dataclasses
import itertools
from typing import Any

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float

from ejlabel import Invocation, Kernel, ShardRule

from ..checks import check_config, check_fields_positive, check_floating
from ..pallas_common import on_gpu
from .xla import matmul_xla

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
        check_fields_positive(self, ("block_m", "block_n", "block_k", "num_warps", "num_stages", "group_m"))


def _matmul(a: Float[Array, "*batch m k"], b: Float[Array, "*batch k n"], cfg: MatmulConfig) -> Float[Array, "*batch m n"]:
    if cfg.impl == "xla":
        return matmul_xla(a, b)
    from .triton import matmul_triton

    batch = a.shape[:-2]
    flat = matmul_triton(
        a.reshape(-1, *a.shape[-2:]), b.reshape(-1, *b.shape[-2:]),
        block_m=cfg.block_m, block_n=cfg.block_n, block_k=cfg.block_k, num_warps=cfg.num_warps, num_stages=cfg.num_stages, group_m=cfg.group_m,
    )
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
    plain_implementation = "xla"  # the floor every tuner starts from

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

    def shard_rule(self, inv: Invocation[MatmulConfig, jax.Array]) -> ShardRule | None:
        """Rows of ``a``, columns of ``b`` and shared batch dimensions split; the contraction
        stays whole (split, it would need a sum across devices after the kernel)."""
        if len(inv.args) != 2:
            return None
        a, b = inv.args
        batch = " ".join(f"b{i}" for i in range(len(a.shape) - 2))
        if len(b.shape) == len(a.shape):
            return ShardRule(args=(f"{batch} m _", f"{batch} _ n"), out=f"{batch} m n")
        if len(b.shape) == 2:
            return ShardRule(args=(f"{batch} m _", "_ n"), out=f"{batch} m n")
        return None

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
