"""RMS norm and layer norm over the last axis, with statistics in float32.

``rms_norm(x, w) = x / sqrt(mean(x^2) + eps) * w`` and
``layer_norm(x, w, b) = (x - mean(x)) / sqrt(var(x) + eps) * w + b``.

Implementations, chosen by :class:`NormConfig.impl`:

- ``"xla"``: the formula in ``jax.numpy`` as a JAX user writes it, run without a custom VJP:
  JAX differentiates it and XLA fuses it exactly as in a plain model.
- ``"pallas"``: one fused kernel each way. The forward gives each program ``block_rows`` rows,
  reads them once and writes the output once. The backward recomputes the row statistics from
  ``x`` (cheaper than storing them) and returns ``dx`` in one pass; each program walks a
  contiguous range of rows and keeps its partial sums of ``dw`` (and ``db``) in registers, so
  only ``[programs, width]`` partials, not ``[rows, width]``, are written and summed afterwards.

The feature axis is zero-padded to a power of two (Triton tiles must have power-of-two sides)
and statistics divide by the true width; rows are padded to whole blocks.
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
from jaxtyping import Array, Float

from ejlabel import Invocation, Kernel

from ..checks import check_config, check_floating
from ..pallas_common import compiler_params, interpret_mode, next_power_of_2, on_gpu, pad_axis, pad_to

__all__ = ["LayerNormKernel", "NormConfig", "RMSNormKernel", "layer_norm", "rms_norm"]

_IMPLS = ("xla", "pallas")
# Programs of the backward kernel: enough to fill a large GPU several times over, few enough
# that the per-program partial sums of dw stay small.
_BACKWARD_PROGRAMS = 512
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


# --------------------------------------------------------------------------------------------
# Math shared by the kernels and the XLA path


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


def _norm_xla(x: Float[Array, "*batch width"], w: Float[Array, "width"], b: Float[Array, "width"] | None, eps: float) -> Float[Array, "*batch width"]:
    x32 = x.astype(jnp.float32)
    if b is not None:
        x32 = x32 - jnp.mean(x32, axis=-1, keepdims=True)
    x_hat = x32 * lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    y = x_hat * w.astype(jnp.float32)
    if b is not None:
        y = y + b.astype(jnp.float32)
    return y.astype(x.dtype)


# --------------------------------------------------------------------------------------------
# Pallas kernels


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


def _norm_pallas(
    x: Float[Array, "*batch width"], w: Float[Array, "width"], b: Float[Array, "width"] | None, eps: float, cfg: NormConfig
) -> Float[Array, "*batch width"]:
    width = x.shape[-1]
    padded = next_power_of_2(width)
    rows = math.prod(x.shape[:-1])
    x2 = pad_to(_flatten(x, padded), 0, cfg.block_rows)
    params = [pad_axis(p, 0, padded) for p in (w, b) if p is not None]
    vector = pl.BlockSpec((padded,), lambda i: (0,))
    block = pl.BlockSpec((cfg.block_rows, padded), lambda i: (i, 0))
    out = pl.pallas_call(
        functools.partial(_forward_kernel, width=width, eps=eps, centered=b is not None),
        grid=(x2.shape[0] // cfg.block_rows,),
        in_specs=[block] + [vector] * len(params),
        out_specs=block,
        out_shape=jax.ShapeDtypeStruct(x2.shape, x.dtype),
        compiler_params=compiler_params(cfg.num_warps, num_stages=1),
        interpret=interpret_mode(),
        name="layer_norm" if b is not None else "rms_norm",
    )(x2, *params)
    return out[:rows, :width].reshape(x.shape)


def _norm_pallas_backward(
    x: Float[Array, "*batch width"], w: Float[Array, "width"], b: Float[Array, "width"] | None,
    g: Float[Array, "*batch width"], eps: float, cfg: NormConfig,
) -> tuple[jax.Array, ...]:
    width = x.shape[-1]
    padded = next_power_of_2(width)
    rows = math.prod(x.shape[:-1])
    blocks = max(1, math.ceil(rows / cfg.block_rows))
    steps = math.ceil(blocks / min(blocks, _BACKWARD_PROGRAMS))
    programs = math.ceil(blocks / steps)
    total = programs * steps * cfg.block_rows
    # Padded rows have g = 0, so they add nothing to dw and db.
    x2, g2 = (pad_axis(_flatten(t, padded), 0, total) for t in (x, g.astype(x.dtype)))
    whole = pl.BlockSpec((total, padded), lambda p: (0, 0))
    partial = pl.BlockSpec((None, padded), lambda p: (p, 0))
    centered = b is not None
    sums = jax.ShapeDtypeStruct((programs, padded), jnp.float32)
    dx, dw, *db = pl.pallas_call(
        functools.partial(_backward_kernel, width=width, eps=eps, centered=centered, block_rows=cfg.block_rows, steps=steps),
        grid=(programs,),
        in_specs=[whole, pl.BlockSpec((padded,), lambda p: (0,)), whole],
        out_specs=[whole, partial] + [partial] * centered,
        out_shape=[jax.ShapeDtypeStruct(x2.shape, x.dtype), sums] + [sums] * centered,
        compiler_params=compiler_params(cfg.num_warps, num_stages=1),
        interpret=interpret_mode(),
        name="layer_norm_bwd" if centered else "rms_norm_bwd",
    )(x2, pad_axis(w, 0, padded), g2)
    grads = [dx[:rows, :width].reshape(x.shape), dw.sum(0)[:width].astype(w.dtype)]
    if centered:
        grads.append(db[0].sum(0)[:width].astype(b.dtype))
    return tuple(grads)


# --------------------------------------------------------------------------------------------
# Kernels


class _NormKernel(Kernel[NormConfig, jax.Array]):
    """What RMS norm and layer norm share; ``centered`` tells them apart."""

    centered: bool

    def run(self, x: Float[Array, "*batch width"], *params: Float[Array, "width"], cfg: NormConfig, eps: float) -> Float[Array, "*batch width"]:
        w, b = self._params(x, params)
        if cfg.impl == "xla":
            return _norm_xla(x, w, b, eps)
        return _norm_pallas(x, w, b, eps, cfg)

    def custom_vjp(
        self, primals: tuple[Any, ...], cfg: NormConfig, kwargs: dict[str, Any], cotangents: tuple[Any, ...]
    ) -> tuple[jax.Array, ...]:
        # Only the Pallas path gets here: the XLA one is differentiated by JAX.
        x, *params = primals
        (g,) = cotangents
        w, b = self._params(x, params)
        return _norm_pallas_backward(x, w, b, g, kwargs["eps"], cfg)

    def _params(self, x: Any, params: tuple[Any, ...]) -> tuple[Any, Any]:
        expected = 2 if self.centered else 1
        if len(params) != expected or any(p.shape != x.shape[-1:] for p in params):
            raise ValueError(f"{self.op_id}: expected {expected} parameter vector(s) of shape {x.shape[-1:]}, got {[p.shape for p in params]}")
        return params[0], (params[1] if self.centered else None)

    def differentiated_by_jax(self, cfg: NormConfig) -> bool:
        return cfg.impl == "xla"

    def reference(self, x: Float[Array, "*batch width"], *params: Float[Array, "width"], eps: float) -> Float[Array, "*batch width"]:
        return _norm_xla(x, *self._params(x, params), eps)

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
      eps: added to the mean square before the square root.
      cfg: force a config; by default the executor picks one.

    Returns:
      ``[..., width]`` in the dtype of ``x``.
    """
    check_floating(x, "x")
    check_floating(w, "w")
    check_config(cfg, NormConfig)
    return _RMS_NORM(x, w, eps=float(eps), cfg=cfg)


def layer_norm(
    x: Float[Array, "*batch width"], w: Float[Array, "width"], b: Float[Array, "width"], eps: float = 1e-5,
    *, cfg: NormConfig | None = None,
) -> Float[Array, "*batch width"]:
    """Layer norm of ``x`` over its last axis, then ``* w + b``; statistics in float32.

    Args:
      x: ``[..., width]`` activations.
      w, b: ``[width]`` scale and shift.
      eps: added to the variance before the square root.
      cfg: force a config; by default the executor picks one.

    Returns:
      ``[..., width]`` in the dtype of ``x``.
    """
    for name, array in (("x", x), ("w", w), ("b", b)):
        check_floating(array, name)
    check_config(cfg, NormConfig)
    return _LAYER_NORM(x, w, b, eps=float(eps), cfg=cfg)
