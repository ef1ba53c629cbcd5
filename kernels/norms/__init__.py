"""RMS norm and layer norm over the last axis, with statistics in float32.

``rms_norm(x, w) = x / sqrt(mean(x^2) + eps) * w`` and
``layer_norm(x, w, b) = (x - mean(x)) / sqrt(var(x) + eps) * w + b``.

Implementations, chosen by :class:`NormConfig.impl`:

- ``"xla"``: the formula in ``jax.numpy`` as a JAX user writes it, run without a custom VJP:
  JAX differentiates it and XLA fuses it exactly as in a plain model (:mod:`.xla`).
- ``"pallas"``: one fused kernel each way on Pallas's Triton backend (:mod:`.triton`).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
from jaxtyping import Array, Float

from ejlabel import Invocation, Kernel, ShardRule

from ..checks import check_config, check_fields_positive, check_floating, check_number
from ..pallas_common import next_power_of_2, on_gpu
from .xla import norm_xla

__all__ = ["LayerNormKernel", "NormConfig", "RMSNormKernel", "layer_norm", "rms_norm"]

_IMPLS = ("xla", "pallas")
# Elements of one program's row block; beyond this the float32 copies spill out of registers.
_MAX_BLOCK_ELEMENTS = 64 * 1024


@dataclasses.dataclass(frozen=True)
class NormConfig:
    """How to run one normalization.

    Attributes:
      impl: ``"xla"`` or ``"pallas"``.
      block_rows: rows per program (forward) and per loop step (backward), a power of two.
      num_warps: Triton warps per program.
    """

    impl: str = "xla"
    block_rows: int = 4
    num_warps: int = 4

    def __post_init__(self) -> None:
        if self.impl not in _IMPLS:
            raise ValueError(f"impl: expected one of {_IMPLS}, got {self.impl!r}")
        check_fields_positive(self, ("block_rows", "num_warps"))


class _NormKernel(Kernel[NormConfig, jax.Array]):
    """What RMS norm and layer norm share; ``centered`` tells them apart."""

    plain_implementation = "xla"  # the floor every tuner starts from
    centered: bool

    def run(self, x: Float[Array, "*batch width"], *params: Float[Array, "width"], cfg: NormConfig, eps: float) -> Float[Array, "*batch width"]:
        w, b = self._params(x, params)
        if cfg.impl == "xla":
            return norm_xla(x, w, b, eps)
        from .triton import norm_triton

        return norm_triton(x, w, b, eps, block_rows=cfg.block_rows, num_warps=cfg.num_warps)

    def custom_vjp(
        self, primals: tuple[Any, ...], cfg: NormConfig, kwargs: dict[str, Any], cotangents: tuple[Any, ...]
    ) -> tuple[jax.Array, ...]:
        # Only the Pallas path gets here: the XLA one is differentiated by JAX.
        from .triton import norm_triton_backward

        x, *params = primals
        (g,) = cotangents
        w, b = self._params(x, params)
        return norm_triton_backward(x, w, b, g, kwargs["eps"], block_rows=cfg.block_rows, num_warps=cfg.num_warps)

    def _params(self, x: Any, params: tuple[Any, ...]) -> tuple[Any, Any]:
        names = ("w", "b") if self.centered else ("w",)
        if len(params) != len(names):
            raise ValueError(f"{self.op_id}: expected the parameter vector(s) {', '.join(names)}, got {len(params)}")
        _check_widths(x, dict(zip(names, params)))
        return params[0], (params[1] if self.centered else None)

    def differentiated_by_jax(self, cfg: NormConfig) -> bool:
        return cfg.impl == "xla"

    def shard_rule(self, inv: Invocation[NormConfig, jax.Array]) -> ShardRule | None:
        """Every row is normalised alone: the leading dimensions split, the normalised one stays whole."""
        dims = " ".join([*(f"r{i}" for i in range(len(inv.args[0].shape) - 1)), "_"])
        return ShardRule(args=(dims, *(("_",) * (len(inv.args) - 1))), out=dims)

    def reference(self, x: Float[Array, "*batch width"], *params: Float[Array, "width"], eps: float) -> Float[Array, "*batch width"]:
        return norm_xla(x, *self._params(x, params), eps)

    def heuristic_cfg(self, inv: Invocation[NormConfig, jax.Array]) -> NormConfig:
        # The plain-JAX path until tuning in context shows something faster: an untuned
        # labelled model compiles to the plain model's program, never to a slower one.
        return NormConfig("xla")

    def config_space(self, inv: Invocation[NormConfig, jax.Array]) -> list[NormConfig]:
        if not on_gpu():
            return [NormConfig("xla"), NormConfig("pallas", 4, 4), NormConfig("pallas", 8, 4)]
        return [NormConfig("xla")] + [NormConfig("pallas", r, w) for r in (1, 2, 4, 8, 16) for w in (4, 8, 16)]

    def candidate_is_valid(self, inv: Invocation[NormConfig, jax.Array], cfg: NormConfig) -> bool:
        if cfg.impl == "xla":
            return True
        x = inv.args[0]
        return cfg.block_rows * next_power_of_2(x.shape[-1]) <= _MAX_BLOCK_ELEMENTS


class RMSNormKernel(_NormKernel):
    """``x / sqrt(mean(x^2) + eps) * w`` over the last axis; see the module docstring."""

    version = "1"
    centered = False

    def __init__(self) -> None:
        super().__init__("rms_norm")


class LayerNormKernel(_NormKernel):
    """``(x - mean) / sqrt(var + eps) * w + b`` over the last axis; see the module docstring."""

    version = "1"
    centered = True

    def __init__(self) -> None:
        super().__init__("layer_norm")


_RMS_NORM = RMSNormKernel()
_LAYER_NORM = LayerNormKernel()


def rms_norm(
    x: Float[Array, "*batch width"], w: Float[Array, "width"], eps: float = 1e-6, *, cfg: NormConfig | None = None
) -> Float[Array, "*batch width"]:
    """RMS norm of ``x`` over its last axis, scaled by ``w``; statistics in float32.

    Args:
      x: ``[..., width]`` activations.
      w: ``[width]`` scale.
      eps: added to the mean square before the square root; a number >= 0.
      cfg: force a config; by default the executor picks one.

    Returns:
      ``[..., width]`` in the dtype of ``x``.
    """
    check_floating(x, "x")
    check_floating(w, "w")
    check_config(cfg, NormConfig)
    _check_widths(x, {"w": w})
    return _RMS_NORM(x, w, eps=check_number(eps, "eps", minimum=0.0), cfg=cfg)


def layer_norm(
    x: Float[Array, "*batch width"], w: Float[Array, "width"], b: Float[Array, "width"], eps: float = 1e-5,
    *, cfg: NormConfig | None = None,
) -> Float[Array, "*batch width"]:
    """Layer norm of ``x`` over its last axis, then ``* w + b``; statistics in float32.

    Args:
      x: ``[..., width]`` activations.
      w, b: ``[width]`` scale and shift.
      eps: added to the variance before the square root; a number >= 0.
      cfg: force a config; by default the executor picks one.

    Returns:
      ``[..., width]`` in the dtype of ``x``.
    """
    for name, array in (("x", x), ("w", w), ("b", b)):
        check_floating(array, name)
    check_config(cfg, NormConfig)
    _check_widths(x, {"w": w, "b": b})
    return _LAYER_NORM(x, w, b, eps=check_number(eps, "eps", minimum=0.0), cfg=cfg)


def _check_widths(x: Any, params: dict[str, Any]) -> None:
    """Each parameter vector is ``[width]``, ``x``'s last axis; ValueError naming the one that is not."""
    if x.ndim < 1:
        raise ValueError(f"x: expected [..., width] with at least one axis, got shape {x.shape}")
    for name, p in params.items():
        if p.shape != x.shape[-1:]:
            raise ValueError(f"{name}: expected shape {x.shape[-1:]} (the width of x), got {p.shape}")
