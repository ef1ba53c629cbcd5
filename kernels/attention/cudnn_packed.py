"""Packed documents on cuDNN's own packed layout: the ``"cudnn_packed"`` implementation of
:func:`ejlabel.kernels.attention.flash_attention`.

cuDNN's fused attention takes the documents packed in a row as a ragged layout: per row, the
length and the first position of each document. It then runs each document as a sequence of its
own and visits only the blocks inside it, where the dense block-diagonal mask of the ``"cudnn"``
implementation makes it read a ``[seq, seq]`` mask and walk every block under the causal bound.
JAX reaches the layout through its cuDNN module
(``jax._src.cudnn.fused_attention_stablehlo.dot_product_attention`` with ``q_seqlen`` and
``kv_seqlen`` ``[batch, R]``, ``q_offsets`` and ``kv_offsets`` ``[batch, R + 1]``), not through
``jax.nn.dot_product_attention``. JAX differentiates the call with that module's own rule
(cuDNN's backward), as it does for the ``"cudnn"`` path: no custom VJP of ours. cuDNN runs the
layout on Hopper and later GPUs, 16-bit inputs, head dims that are multiples of 8 up to 256,
without a window.

From segment ids to the layout (:func:`packed_layout`, pure ``jnp``, no loop): a row is cut into
runs, each of which becomes one of cuDNN's sequences; every id ``<= 0`` counts as one padding
id. cuDNN computes the positions inside its sequences only; what the output and the gradients
of ``q``, ``k`` and ``v`` hold elsewhere is not specified, so every position must belong to a
run, padding included:

- causal: padding joins the run before it, and a run starts at the row's first position or at
  a non-padding token whose id differs from the token before it. A document's queries come
  before the padding that closes its run, so under the causal bound they never see it; padding
  before the row's first document is a run of its own.
- not causal: a run starts wherever the id changes, padding runs being runs of their own.

A padding query sees keys of its own run only; its output is set to 0 afterwards, which gives
it a cotangent of 0 and so a gradient of exactly 0 to every padding query and key (a padding
key is seen by padding queries only). Entries past a row's runs are -1, and the last start
always is: cuDNN's module drops the -1 entries when it joins the rows into one list of
sequences.

How many runs, ``R``: it is static, since it sizes cuDNN's call (its softmax statistics are
``[batch * R, heads, seq]``, and each entry costs time even when empty, so ``R`` is kept to
what a row can need). A row of ``M`` documents holds at most ``M + 1`` runs when causal (leading padding)
and ``2 M + 1`` otherwise (padding before, between and after the documents):
:func:`packed_runs`. ``M`` is ``flash_attention``'s ``max_documents``, or with ``cu_seqlens``
the count of sequences its shape gives.

Grouped heads: JAX's module turns each start into a memory offset by the heads of the tensor
it indexes from jax 0.11.2 on (the version this was checked on); 0.10.2's scaled the key/value
offsets by the query heads, wrong when keys and values have fewer. With grouped heads on an
older JAX the implementation is not offered, and refused when forced (:data:`GROUPED_HEADS`).

What the layout cannot say: one segment id in two separate runs of a row (under the mask its
tokens see each other wherever they are), or a row of more than ``R`` runs (more documents than
``max_documents`` promised). Neither can be checked before the values exist, inside ``jit``;
such a row's output is NaN, so that a broken promise shows in the loss instead of giving wrong
values quietly.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax._src.cudnn.fused_attention_stablehlo import MaskType
from jax._src.cudnn.fused_attention_stablehlo import dot_product_attention as cudnn_dot_product_attention
from jaxtyping import Array, Bool, Float, Int

__all__ = ["GROUPED_HEADS", "PackedLayout", "attention_cudnn_packed", "packed_layout", "packed_runs"]

GROUPED_HEADS: bool = tuple(jax.__version_info__[:3]) >= (0, 11, 2)
"""Whether this JAX's cuDNN module places the packed layout's keys and values right when they
have fewer heads than the queries."""


class PackedLayout(NamedTuple):
    """cuDNN's packed layout of one batch of segment ids; queries and keys share it.

    Attributes:
      lengths: ``[batch, R]`` int32, the length of each run of the row, then -1
        (``q_seqlen`` and ``kv_seqlen``).
      starts: ``[batch, R + 1]`` int32, the first position of each run, then -1 (``q_offsets``
        and ``kv_offsets``).
      fits: ``[batch]`` bool, whether the layout says what the row's ids say (at most ``R`` runs,
        no id in two runs).
    """

    lengths: Int[Array, "batch runs"]
    starts: Int[Array, "batch runs_plus_1"]
    fits: Bool[Array, " batch"]


def packed_runs(max_documents: int, causal: bool) -> int:
    """``R``: the most runs a row of ``max_documents`` documents and padding holds."""
    if isinstance(max_documents, bool) or not isinstance(max_documents, int) or max_documents < 1:
        raise ValueError(f"max_documents: expected an int >= 1, got {max_documents!r}")
    return max_documents + 1 if causal else 2 * max_documents + 1


def packed_layout(segment_ids: Int[Array, "batch seq"], runs: int, *, causal: bool) -> PackedLayout:
    """The packed layout of ``segment_ids`` in ``runs`` entries per row, for a causal call or not
    (see the module docstring).

    Every count is a comparison of each token's run index with the ``runs`` indices, reduced
    over the row: ``O(runs * seq)`` work per row in a few fused kernels, no device loop.
    """
    if isinstance(runs, bool) or not isinstance(runs, int) or runs < 1:
        raise ValueError(f"runs: expected an int >= 1, got {runs!r}")
    if segment_ids.ndim != 2:
        raise ValueError(f"segment_ids: expected [batch, seq], got shape {segment_ids.shape}")
    ids = jnp.where(segment_ids > 0, segment_ids, 0).astype(jnp.int32)
    batch, seq = ids.shape
    changed = ids[:, 1:] != ids[:, :-1]
    if causal:  # padding closes the run before it
        changed = changed & (ids[:, 1:] > 0)
    new_run = jnp.concatenate([jnp.ones((batch, 1), bool), changed], axis=1)
    run = jnp.cumsum(new_run, axis=1, dtype=jnp.int32) - 1  # each token's run, from 0
    count = run[:, -1] + 1
    index = jnp.arange(runs, dtype=jnp.int32)
    lengths = jnp.sum(run[:, None, :] == index[None, :, None], axis=2, dtype=jnp.int32)
    # Runs tile the row from position 0, so each run starts where the ones before it end.
    starts = jnp.cumsum(lengths, axis=1, dtype=jnp.int32) - lengths
    used = index[None, :] < count[:, None]
    # The id of each run, read at its first token; two runs of one positive id break the layout.
    run_ids = jnp.take_along_axis(ids, jnp.minimum(starts, seq - 1), axis=1)
    named = used & (run_ids > 0)
    same = (run_ids[:, :, None] == run_ids[:, None, :]) & named[:, :, None] & named[:, None, :]
    repeated = jnp.any(same & ~jnp.eye(runs, dtype=bool)[None], axis=(1, 2))
    lengths = jnp.where(used, lengths, -1)
    starts = jnp.concatenate([jnp.where(used, starts, -1), jnp.full((batch, 1), -1, jnp.int32)], axis=1)
    return PackedLayout(lengths, starts, (count <= runs) & ~repeated)


def attention_cudnn_packed(
    q: Float[Array, "batch seq heads dim"], k: Float[Array, "batch seq kv_heads dim"], v: Float[Array, "batch seq kv_heads dim"],
    segment_ids: Int[Array, "batch seq"], *, scale: float, causal: bool, max_documents: int,
) -> Float[Array, "batch seq heads dim"]:
    """Attention within the documents of ``segment_ids`` on cuDNN's packed layout; padding (ids
    ``<= 0``) gets output 0, a row the layout cannot say (see the module docstring) NaN."""
    if k.shape[2] != q.shape[2] and not GROUPED_HEADS:
        raise ValueError(
            f"k, v: cuDNN's packed layout takes grouped heads ({q.shape[2]} query, {k.shape[2]} key/value) "
            f"from jax 0.11.2 on, this is jax {jax.__version__}"
        )
    layout = packed_layout(segment_ids, packed_runs(max_documents, causal), causal=causal)
    # cuDNN's masks for sequences of given lengths, as jax.nn.dot_product_attention picks them.
    mask_type = MaskType.PADDING_CAUSAL if causal else MaskType.PADDING
    out = cudnn_dot_product_attention(
        q, k, v, q_seqlen=layout.lengths, kv_seqlen=layout.lengths, q_offsets=layout.starts, kv_offsets=layout.starts,
        scale=scale, mask_type=mask_type, qkv_layout="BTNH",
    )
    out = jnp.where((segment_ids > 0)[:, :, None, None], out, jnp.zeros((), out.dtype))
    return jnp.where(layout.fits[:, None, None, None], out, jnp.full((), jnp.nan, out.dtype))
