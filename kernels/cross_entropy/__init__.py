"""Softmax cross-entropy per token: ``logsumexp(logits) - logits[label]``, in float32.

Implementations, chosen by :class:`CrossEntropyConfig.impl`:

- ``"xla"``: ``logsumexp`` and a gather in ``jax.numpy``, the expression a JAX user writes, run
  without a custom VJP (JAX differentiates it, XLA fuses it as in a plain model).
- ``"pallas"``: each program takes ``block_tokens`` rows and walks the vocabulary in chunks of
  ``chunk_vocab`` columns with an online log-sum-exp (running max and rescaled sum), picking
  the label's logit on the way; a row's logits are read once and the float32 softmax never
  exists in memory. The forward keeps each token's log-sum-exp (``[tokens]`` floats) for the
  backward, a second kernel that writes ``(softmax - onehot) * cotangent`` tile by tile: two
  reads of the logits and one write in all, as XLA's program (H100: 0.87x XLA while the
  backward recomputed the log-sum-exp, a third read; bench/RESULTS.md runs 109-111).

With ``ignore_index`` set (``-100`` by default), tokens labelled with it, and any label outside
``[0, vocab)``, are ignored: their loss is 0 and their logits get no gradient. With
``ignore_index=None`` labels are trusted to lie in ``[0, vocab)`` and the XLA path is exactly
``logsumexp(logits) - logits[label]``. The vocabulary is padded to whole chunks and the
padding masked out of the log-sum-exp.
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
from jaxtyping import Array, Float, Int

from ejlabel import Invocation, Kernel

from ..checks import check_config, check_floating, check_integer
from ..pallas_common import MASK_VALUE, compiler_params, fast_exp, interpret_mode, on_gpu, pad_to

__all__ = ["CrossEntropyConfig", "CrossEntropyKernel", "softmax_cross_entropy"]

_IMPLS = ("xla", "pallas")
# Elements of one program's tile; beyond this the float32 copies spill out of registers.
_MAX_TILE_ELEMENTS = 32 * 1024


@dataclasses.dataclass(frozen=True)
class CrossEntropyConfig:
    """How to run one cross-entropy.

    Attributes:
      impl: ``"xla"`` or ``"pallas"``.
      block_tokens: rows per program (a power of two).
      chunk_vocab: vocabulary columns per loop step, and per backward tile (a power of two).
      num_warps: Triton warps per program.
    """

    impl: str = "xla"
    block_tokens: int = 8
    chunk_vocab: int = 2048
    num_warps: int = 8

    def __post_init__(self) -> None:
        if self.impl not in _IMPLS:
            raise ValueError(f"impl: expected one of {_IMPLS}, got {self.impl!r}")


def _ignored(labels: Int[Array, "tokens"], vocab: int) -> Int[Array, "tokens"]:
    return (labels < 0) | (labels >= vocab)


def _cross_entropy_xla(
    logits: Float[Array, "tokens vocab"], labels: Int[Array, "tokens"], ignore_index: int | None = -100
) -> Float[Array, "tokens"]:
    logits = logits.astype(jnp.float32)
    if ignore_index is None:
        picked = jnp.take_along_axis(logits, labels[:, None], axis=-1)[:, 0]
        return jax.nn.logsumexp(logits, axis=-1) - picked
    vocab = logits.shape[1]
    picked = jnp.take_along_axis(logits, jnp.clip(labels, 0, vocab - 1)[:, None], axis=1)[:, 0]
    return jnp.where(_ignored(labels, vocab), 0.0, jax.nn.logsumexp(logits, axis=1) - picked)


def _pallas_labels(labels: Int[Array, "tokens"], ignore_index: int | None) -> Int[Array, "tokens"]:
    """The Pallas kernels ignore labels outside ``[0, vocab)``: map ``ignore_index`` there."""
    return labels if ignore_index is None or ignore_index < 0 else jnp.where(labels == ignore_index, -1, labels)


def _forward_kernel(logits_ref: Any, labels_ref: Any, loss_ref: Any, lse_ref: Any, *, vocab: int, chunk: int) -> None:
    labels = labels_ref[...]
    rows = labels.shape[0]

    def step(j: jax.Array, carry: tuple[jax.Array, ...]) -> tuple[jax.Array, ...]:
        running_max, running_sum, picked = carry
        start = pl.multiple_of(j * chunk, chunk)
        cols = start + jnp.arange(chunk)[None, :]
        x = jnp.where(cols < vocab, logits_ref[:, pl.ds(start, chunk)].astype(jnp.float32), MASK_VALUE)
        new_max = jnp.maximum(running_max, jnp.max(x, axis=1))
        # Rescale the sum so far to the new maximum, so exp never overflows.
        running_sum = running_sum * fast_exp(running_max - new_max) + jnp.sum(fast_exp(x - new_max[:, None]), axis=1)
        picked = picked + jnp.sum(jnp.where(cols == labels[:, None], x, 0.0), axis=1)
        return new_max, running_sum, picked

    init = (jnp.full((rows,), MASK_VALUE, jnp.float32), jnp.zeros((rows,), jnp.float32), jnp.zeros((rows,), jnp.float32))
    running_max, running_sum, picked = lax.fori_loop(0, logits_ref.shape[1] // chunk, step, init)
    lse = running_max + jnp.log(running_sum)
    lse_ref[...] = lse
    loss_ref[...] = jnp.where(_ignored(labels, vocab), 0.0, lse - picked)


def _backward_kernel(logits_ref: Any, labels_ref: Any, lse_ref: Any, g_ref: Any, dlogits_ref: Any, *, vocab: int, chunk: int) -> None:
    labels = labels_ref[...]
    cols = pl.program_id(1) * chunk + jnp.arange(chunk)[None, :]
    probs = fast_exp(logits_ref[...].astype(jnp.float32) - lse_ref[...][:, None])
    scale = jnp.where(_ignored(labels, vocab), 0.0, g_ref[...])
    dlogits_ref[...] = ((probs - (cols == labels[:, None])) * scale[:, None]).astype(dlogits_ref.dtype)


def _padded(logits: Float[Array, "tokens vocab"], labels: Int[Array, "tokens"], cfg: CrossEntropyConfig) -> tuple[jax.Array, jax.Array]:
    # Padded rows carry an ignored label, so they have no loss and no gradient.
    return pad_to(pad_to(logits, 0, cfg.block_tokens), 1, cfg.chunk_vocab), pad_to(labels, 0, cfg.block_tokens, value=-1)


def _cross_entropy_pallas(
    logits: Float[Array, "tokens vocab"], labels: Int[Array, "tokens"], cfg: CrossEntropyConfig
) -> tuple[Float[Array, "tokens"], Float[Array, "tokens"]]:
    """``(loss, logsumexp)`` per token."""
    tokens, vocab = logits.shape
    logits_p, labels_p = _padded(logits, labels, cfg)
    rows = pl.BlockSpec((cfg.block_tokens,), lambda i: (i,))
    per_token = jax.ShapeDtypeStruct(labels_p.shape, jnp.float32)
    loss, lse = pl.pallas_call(
        functools.partial(_forward_kernel, vocab=vocab, chunk=cfg.chunk_vocab),
        grid=(labels_p.shape[0] // cfg.block_tokens,),
        in_specs=[pl.BlockSpec((cfg.block_tokens, logits_p.shape[1]), lambda i: (i, 0)), rows],
        out_specs=[rows, rows],
        out_shape=[per_token, per_token],
        compiler_params=compiler_params(cfg.num_warps, num_stages=2),
        interpret=interpret_mode(),
        name="cross_entropy",
    )(logits_p, labels_p)
    return loss[:tokens], lse[:tokens]


def _cross_entropy_pallas_backward(
    logits: Float[Array, "tokens vocab"], labels: Int[Array, "tokens"], lse: Float[Array, "tokens"], g: Float[Array, "tokens"],
    cfg: CrossEntropyConfig,
) -> Float[Array, "tokens vocab"]:
    tokens, vocab = logits.shape
    logits_p, labels_p = _padded(logits, labels, cfg)
    lse_p, g_p = (pad_to(t.astype(jnp.float32), 0, cfg.block_tokens) for t in (lse, g))
    rows = pl.BlockSpec((cfg.block_tokens,), lambda i, j: (i,))
    tile = pl.BlockSpec((cfg.block_tokens, cfg.chunk_vocab), lambda i, j: (i, j))
    dlogits = pl.pallas_call(
        functools.partial(_backward_kernel, vocab=vocab, chunk=cfg.chunk_vocab),
        grid=(logits_p.shape[0] // cfg.block_tokens, logits_p.shape[1] // cfg.chunk_vocab),
        in_specs=[tile, rows, rows, rows],
        out_specs=tile,
        out_shape=jax.ShapeDtypeStruct(logits_p.shape, logits.dtype),
        compiler_params=compiler_params(cfg.num_warps, num_stages=2),
        interpret=interpret_mode(),
        name="cross_entropy_bwd",
    )(logits_p, labels_p, lse_p, g_p)
    return dlogits[:tokens, :vocab]


class CrossEntropyKernel(Kernel[CrossEntropyConfig, jax.Array]):
    """Per-token softmax cross-entropy; see the module docstring."""

    # 2: the Pallas backward reads the forward's log-sum-exp instead of recomputing it.
    version = "2"

    def __init__(self) -> None:
        super().__init__("cross_entropy")

    def run(
        self, logits: Float[Array, "tokens vocab"], *, labels: Int[Array, "tokens"], cfg: CrossEntropyConfig,
        ignore_index: int | None = -100,
    ) -> Float[Array, "tokens"]:
        if logits.ndim != 2 or labels.shape != logits.shape[:1]:
            raise ValueError(f"logits, labels: expected [tokens, vocab] and [tokens], got {logits.shape} and {labels.shape}")
        if cfg.impl == "xla":
            return _cross_entropy_xla(logits, labels, ignore_index)
        return _cross_entropy_pallas(logits, _pallas_labels(labels, ignore_index), cfg)[0]

    def fwd_with_residuals(
        self, logits: Float[Array, "tokens vocab"], *, labels: Int[Array, "tokens"], cfg: CrossEntropyConfig,
        ignore_index: int | None = -100,
    ) -> tuple[Float[Array, "tokens"], Float[Array, "tokens"]]:
        # Only the Pallas path gets here, and only under differentiation: the XLA one is
        # differentiated by JAX, and a forward alone runs `run`.
        return _cross_entropy_pallas(logits, _pallas_labels(labels, ignore_index), cfg)

    def vjp(
        self, lse: Float[Array, "tokens"], out: Float[Array, "tokens"], g: Float[Array, "tokens"], logits: Float[Array, "tokens vocab"], *,
        labels: Int[Array, "tokens"], cfg: CrossEntropyConfig, ignore_index: int | None = -100,
    ) -> tuple[jax.Array]:
        del out
        return (_cross_entropy_pallas_backward(logits, _pallas_labels(labels, ignore_index), lse, g, cfg),)

    def differentiated_by_jax(self, cfg: CrossEntropyConfig) -> bool:
        return cfg.impl == "xla"

    def reference(
        self, logits: Float[Array, "tokens vocab"], *, labels: Int[Array, "tokens"], ignore_index: int | None = -100
    ) -> Float[Array, "tokens"]:
        return _cross_entropy_xla(logits, labels, ignore_index)

    def make_inputs(self, inv: Invocation[CrossEntropyConfig, jax.Array], key: jax.Array) -> tuple[tuple[Any, ...], dict[str, Any]]:
        (logits,), labels = inv.args, inv.kwargs["labels"]
        k_logits, k_labels = jax.random.split(key)
        return (
            (jax.random.normal(k_logits, logits.shape, jnp.float32).astype(logits.dtype),),
            {**inv.kwargs, "labels": jax.random.randint(k_labels, labels.shape, 0, logits.shape[1], labels.dtype)},
        )

    def heuristic_cfg(self, inv: Invocation[CrossEntropyConfig, jax.Array]) -> CrossEntropyConfig:
        # The plain-JAX path until tuning in context shows something faster: an untuned
        # labelled model compiles to the plain model's program, never to a slower one.
        return CrossEntropyConfig("xla")

    def config_space(self, inv: Invocation[CrossEntropyConfig, jax.Array]) -> list[CrossEntropyConfig]:
        if not on_gpu():
            return [CrossEntropyConfig("xla"), CrossEntropyConfig("pallas", 4, 16, 4), CrossEntropyConfig("pallas", 8, 32, 4)]
        tiles = itertools.product((4, 8, 16), (1024, 2048, 4096), (4, 8))
        return [CrossEntropyConfig("xla")] + [CrossEntropyConfig("pallas", t, c, w) for t, c, w in tiles]

    def candidate_is_valid(self, inv: Invocation[CrossEntropyConfig, jax.Array], cfg: CrossEntropyConfig) -> bool:
        if cfg.impl == "xla":
            return True
        vocab = inv.args[0].shape[1]
        return cfg.block_tokens * cfg.chunk_vocab <= _MAX_TILE_ELEMENTS and cfg.chunk_vocab <= max(16, 2 * vocab)


_CROSS_ENTROPY = CrossEntropyKernel()


def softmax_cross_entropy(
    logits: Float[Array, "tokens vocab"], labels: Int[Array, "tokens"], *, ignore_index: int | None = -100,
    cfg: CrossEntropyConfig | None = None,
) -> Float[Array, "tokens"]:
    """Per-token ``logsumexp(logits) - logits[label]`` in float32.

    Args:
      logits: ``[tokens, vocab]`` unnormalized scores, any float dtype.
      labels: ``[tokens]`` integer classes.
      ignore_index: tokens with this label, and any label outside ``[0, vocab)``, are ignored
        (loss 0, no gradient). ``None``: every label is in range, and the XLA path is the plain
        expression a JAX user writes (no masking ops).
      cfg: force a config; by default the executor picks one.

    Returns:
      ``[tokens]`` float32 losses.
    """
    check_floating(logits, "logits")
    check_integer(labels, "labels")
    check_config(cfg, CrossEntropyConfig)
    if ignore_index is not None and not isinstance(ignore_index, int):
        raise TypeError(f"ignore_index: expected an int or None, got {type(ignore_index).__name__}")
    return _CROSS_ENTROPY(logits, labels=labels, ignore_index=ignore_index, cfg=cfg)
