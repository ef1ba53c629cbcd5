"""Attention as a JAX user writes it, differentiated by JAX itself (no custom VJP): the
``"xla"`` and ``"cudnn"`` implementations of :func:`ejlabel.kernels.attention.flash_attention`.

:func:`attention_plain` is ``jax.nn.dot_product_attention`` on XLA's or cuDNN's
implementation, with packed documents as a dense block-diagonal mask; :func:`attention_xla`
is the masked softmax in float32 for what that function does not take (a sliding window),
and the reference every other implementation is checked against.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int

from ..pallas_common import MASK_VALUE
from .masks import Window, visibility_mask

__all__ = ["attention_plain", "attention_xla"]


def attention_xla(
    q: Float[Array, "batch sq heads dim"], k: Float[Array, "batch skv kv_heads dim"], v: Float[Array, "batch skv kv_heads dim"],
    segment_ids: Int[Array, "batch seq"] | None, *, scale: float, bounds: Window,
) -> Float[Array, "batch sq heads dim"]:
    """The masked softmax in float32, grouped heads by reshaping (no copy of the keys per query
    head); a query that sees nothing gets 0."""
    batch, sq, heads, dim = q.shape
    kv_heads = k.shape[2]
    qg = q.reshape(batch, sq, kv_heads, heads // kv_heads, dim)
    scores = jnp.einsum("bqhgd,bkhd->bhgqk", qg, k, preferred_element_type=jnp.float32) * scale
    positions_q, positions_k = jnp.arange(sq), jnp.arange(k.shape[1])
    if segment_ids is None:
        mask = visibility_mask(positions_q, positions_k, None, None, bounds=bounds, kv_len=None)
        mask = None if mask is None else mask[None]
    else:
        mask = jax.vmap(lambda s: visibility_mask(positions_q, positions_k, s, s, bounds=bounds, kv_len=None))(segment_ids)
    if mask is not None:
        mask = mask[:, None, None]  # [batch, 1, 1, sq, skv] against [batch, kv_heads, group, sq, skv]
        scores = jnp.where(mask, scores, MASK_VALUE)
    probs = jnp.exp(scores - jnp.max(scores, axis=-1, keepdims=True))
    if mask is not None:
        probs = jnp.where(mask, probs, 0.0)
    total = jnp.sum(probs, axis=-1, keepdims=True)
    probs = probs / jnp.where(total == 0.0, 1.0, total)  # rows that see nothing stay 0
    out = jnp.einsum("bhgqk,bkhd->bqhgd", probs.astype(v.dtype), v, preferred_element_type=jnp.float32)
    return out.reshape(q.shape).astype(q.dtype)


def attention_plain(
    q: Float[Array, "batch sq heads dim"], k: Float[Array, "batch skv kv_heads dim"], v: Float[Array, "batch skv kv_heads dim"],
    segment_ids: Int[Array, "batch seq"] | None, *, scale: float, causal: bool, implementation: str,
) -> Float[Array, "batch sq heads dim"]:
    """What a JAX user writes: ``jax.nn.dot_product_attention`` on ``implementation`` (``"xla"``
    or ``"cudnn"``), with packed documents as a dense ``[batch, 1, seq, seq]`` block-diagonal
    mask beside ``is_causal``.

    A padding query sees no key, so the softmax spreads it over every key; its output is set to
    0 afterwards (which also stops its gradient), to keep the op's contract.
    """
    if segment_ids is None:
        return jax.nn.dot_product_attention(q, k, v, scale=scale, is_causal=causal, implementation=implementation)
    real = segment_ids > 0
    mask = (segment_ids[:, :, None] == segment_ids[:, None, :]) & real[:, :, None]
    out = jax.nn.dot_product_attention(q, k, v, mask=mask[:, None], scale=scale, is_causal=causal, implementation=implementation)
    return jnp.where(real[:, :, None, None], out, jnp.zeros((), out.dtype))

