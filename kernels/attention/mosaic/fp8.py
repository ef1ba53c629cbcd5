"""The Mosaic GPU attention forward in 8 bits (``float8_e4m3fn``), for inference: FlashAttention-3's
FP8 option on Hopper, where an 8-bit wgmma runs at twice the 16-bit rate.

Both products take 8-bit operands and accumulate in float32: ``q k^T`` on the quantized
queries and keys, then ``P v`` on the probabilities rounded to 8 bits (from the float32 online
softmax of :func:`.forward.online_softmax`) and the quantized values. Two facts of the hardware
shape the kernel (:func:`.forward.forward_call` with ``descale``):

- an 8-bit wgmma reads both operands along their contraction (no transposed operand), so the
  values come transposed, ``[batch, kv_heads, dim, seq_kv]``, and a value block is ``[dim,
  block_k]``: the kernel shares the key ring, so it runs at ``dim == block_k`` (head dims
  65 to 128, padded to 128, on 128-key blocks);
- the accumulator's register layout is not the one an 8-bit operand takes from registers, and
  Mosaic GPU has no relayout between them (jax 0.11.2: its layout inference fails), so each
  step's probabilities go through shared memory (``64 x 128`` bytes per consumer).

Quantization is per tensor (:func:`quantize`): ``x ~ descale * x8`` with ``descale =
max|x| / 448``, e4m3's largest finite value. The kernel takes the factors as a float32 operand:
the scores are scaled by ``softmax scale * descale_q * descale_k`` inside the exponent, and the
output by ``descale_v``; the log-sum-exp it saves is the true scores'. The error is e4m3's three
mantissa bits on ``q``, ``k``, ``v`` and on every probability; ``bench/bench_attention.py``
states it against the float32 reference beside the 16-bit kernel's (section h), and the tests
bound it.

Forward only: :func:`fp8_attention` has no gradient (its backward raises).
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int

from ejlabel import FwdParams

from ...pallas_common import pad_axis
from ..masks import Window, window_bounds
from . import pad_operands, tile_blocks, traced_once
from .forward import forward_call
from .kernel import plgpu
from .plan import TILE, visit_plan

__all__ = ["E4M3_MAX", "FP8", "FP8_DIM", "fp8_attention", "mosaic_forward_fp8", "quantize", "quantize_operands"]

FP8 = jnp.float8_e4m3fn
E4M3_MAX = 448.0  # e4m3's largest finite value
FP8_DIM = 128  # the head dim the 8-bit forward runs at (dims 65..128 are padded to it)


def quantize(x: jax.Array) -> tuple[jax.Array, Float[Array, ""]]:
    """``(x8, descale)`` with ``x8 = x / descale`` in ``float8_e4m3fn`` and ``descale = max|x| /
    448`` (1 for an all-zero ``x``, which includes one of subnormal values: XLA flushes them to
    zero): one factor per tensor. ``descale`` is float32's smallest normal value at least: below
    it (``max|x|`` under about 5e-36) it would be subnormal, flushed to zero, and ``x / 0`` is no
    e4m3 value."""
    amax = jnp.max(jnp.abs(x)).astype(jnp.float32)
    descale = jnp.where(amax > 0, jnp.maximum(amax / E4M3_MAX, jnp.finfo(jnp.float32).tiny), 1.0)
    return (x.astype(jnp.float32) / descale).astype(FP8), descale


def quantize_operands(
    q: Float[Array, "batch sq heads dim"], k: Float[Array, "batch skv kv_heads dim"], v: Float[Array, "batch skv kv_heads dim"],
) -> tuple[jax.Array, jax.Array, jax.Array, Float[Array, "3"]]:
    """``(q8, k8, v_t8, descale)``: :func:`mosaic_forward_fp8`'s operands from an attention
    call's, each quantized per tensor (:func:`quantize`), the values transposed to ``[batch,
    kv_heads, dim, seq_kv]``; ``descale`` holds the three factors."""
    (q8, dq), (k8, dk), (v8, dv) = (quantize(x) for x in (q, k, v))
    return q8, k8, jnp.transpose(v8, (0, 2, 3, 1)), jnp.stack([dq, dk, dv])


def _check(q: jax.Array, k: jax.Array, v_t: jax.Array) -> None:
    if plgpu is None:
        raise NotImplementedError("this JAX has no Pallas Mosaic GPU backend")
    for name, x in (("q", q), ("k", k), ("v_t", v_t)):
        if x.dtype != FP8:
            raise ValueError(f"{name}: expected float8_e4m3fn (see quantize), got {x.dtype}")
    if v_t.shape != (k.shape[0], k.shape[2], k.shape[3], k.shape[1]):
        raise ValueError(f"v_t: expected the values transposed to [batch, kv_heads, dim, seq_kv] = {(k.shape[0], k.shape[2], k.shape[3], k.shape[1])}, got {v_t.shape}")
    if q.shape[3] != FP8_DIM or k.shape[3] != FP8_DIM:
        raise ValueError(f"q, k: the 8-bit forward runs at head dim {FP8_DIM}, got {q.shape[3]}, {k.shape[3]}")


@traced_once
def mosaic_forward_fp8(
    q: Float[Array, "batch sq heads 128"], k: Float[Array, "batch skv kv_heads 128"], v_t: Float[Array, "batch kv_heads 128 skv"],
    descale: Float[Array, "3"], segment_ids: Int[Array, "batch seq"] | None = None, *, scale: float, bounds: Window,
    params: FwdParams = FwdParams(), out_dtype: Any = jnp.bfloat16, pingpong: bool = True, interpret: bool = False,
) -> tuple[Float[Array, "batch sq heads 128"], Float[Array, "batch heads sq"]]:
    """``(out, lse)`` as :func:`.mosaic_forward` gives them, from 8-bit operands: ``q`` and ``k``
    ``[batch, seq, heads, 128]`` and the values transposed, ``v_t [batch, kv_heads, 128,
    seq_kv]``, all ``float8_e4m3fn``; ``descale``: float32 ``[3]``, the factors of ``q``, ``k``
    and ``v`` (see :func:`quantize`). ``scale`` (the softmax's) must be positive; ``out`` is in
    ``out_dtype``. Key blocks of 128 (``params.kv_blocksize`` may only say so)."""
    _check(q, k, v_t)
    if scale <= 0:
        raise ValueError(f"scale: the 8-bit forward takes a positive softmax scale, got {scale}")
    if descale.shape != (3,):
        raise ValueError(f"descale: expected float32 [3] (the factors of q, k, v), got {descale.shape}")
    _, block_k, stages = tile_blocks(params, FP8_DIM)
    if block_k != FP8_DIM:
        raise ValueError(f"params.kv_blocksize: the 8-bit forward walks key blocks of {FP8_DIM}, got {block_k}")
    # Padding as the 16-bit forward's (the values ride along in k's place, then transposed back).
    p = pad_operands(q, k, k, segment_ids, scale=scale, bounds=bounds, block_k=block_k, interpret=interpret)
    # The transposed values' rows are keys, copied in boxes of 128 (one 8-bit swizzled row):
    # Mosaic GPU takes them in whole boxes, so they are padded to whole key tiles.
    v_padded = pad_axis(v_t, 3, p.cols)
    factors = jnp.stack([descale[0] * descale[1], descale[2], 0.0, 0.0]).astype(jnp.float32)  # a TMA-sized row
    plan = visit_plan(p.rows, p.cols, TILE, block_k, p.shape, p.segment_ids, p.q.shape[0], transpose=False)
    out, lse = forward_call(
        p.q, p.k, v_padded, plan, p.segment_ids, p.shape, block_k=block_k, stages=stages, pingpong=pingpong, descale=factors,
        out_dtype=out_dtype,
    )
    return out[:, : p.seq_q], lse[:, :, : p.seq_q]


def fp8_attention(
    q: Float[Array, "batch sq heads dim"], k: Float[Array, "batch skv kv_heads dim"], v: Float[Array, "batch skv kv_heads dim"],
    *, causal: bool = False, segment_ids: Int[Array, "batch seq"] | None = None, softmax_scale: float | None = None,
    sliding_window: tuple[int, int] | None = None, interpret: bool = False,
) -> Float[Array, "batch sq heads dim"]:
    """Attention's output in ``q``'s dtype, computed in 8 bits: ``q``, ``k`` and ``v`` (16 or 32
    bits, head dims 65 to 128) quantized (:func:`quantize_operands`), then
    :func:`mosaic_forward_fp8`. Arguments as :func:`ejlabel.kernels.attention.
    flash_attention`'s. Forward only: its gradient raises."""
    dim = q.shape[3]
    if not 64 < dim <= FP8_DIM:
        raise ValueError(f"q: the 8-bit forward takes head dims 65 to {FP8_DIM}, got {dim}")
    scale = dim**-0.5 if softmax_scale is None else softmax_scale
    bounds = window_bounds(causal, sliding_window)
    return _fp8_attention(q, k, v, segment_ids, scale, bounds, interpret)


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5, 6))
def _fp8_attention(q: jax.Array, k: jax.Array, v: jax.Array, segment_ids: Any, scale: float, bounds: Window, interpret: bool) -> jax.Array:
    dim = q.shape[3]
    q8, k8, v_t, descale = quantize_operands(*(pad_axis(x, 3, FP8_DIM) for x in (q, k, v)))
    out, _ = mosaic_forward_fp8(q8, k8, v_t, descale, segment_ids, scale=scale, bounds=bounds, out_dtype=q.dtype, interpret=interpret)
    return out[..., :dim]


def _no_forward_for_gradients(*args: Any) -> Any:
    raise NotImplementedError("fp8_attention is forward-only: differentiate the 16-bit kernels (flash_attention) instead")


_fp8_attention.defvjp(_no_forward_for_gradients, _no_forward_for_gradients)
