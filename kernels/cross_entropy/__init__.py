"""Softmax cross-entropy per token: ``logsumexp(logits) - logits[label]``, in float32.

Implementations, chosen by :class:`CrossEntropyConfig.impl`:

- ``"xla"``: ``logsumexp`` and a gather in ``jax.numpy``, the expression a JAX user writes, run
  without a custom VJP (JAX differentiates it, XLA fuses it as in a plain model; :mod:`.xla`).
- ``"pallas"``: an online log-sum-exp over vocabulary chunks on Pallas's Triton backend, its
  own backward kernel reading the forward's log-sum-exp (:mod:`.triton`).

Labels must lie in ``[0, vocab)`` or equal ``ignore_index`` (``-100`` by default; tokens
labelled with it have loss 0 and no gradient). Concrete labels are checked: an eager call with
any other label raises ValueError. Traced labels (under ``jit``, ``grad``, ``vmap``) cannot be
checked and cost nothing; there every implementation gives the same (:mod:`.labels`):

- with ``ignore_index`` set, a label outside ``[0, vocab)`` is ignored like ``ignore_index``;
- with ``ignore_index=None`` (the XLA path is then exactly ``logsumexp(logits) -
  logits[label]``), a label in ``[-vocab, 0)`` counts as ``label + vocab`` (NumPy's indexing) and
  any other label outside ``[0, vocab)`` gives a NaN loss.
"""

from __future__ import annotations

import dataclasses
import itertools
from typing import Any

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int

from ejlabel import Invocation, Kernel, ShardRule

from ..checks import check_config, check_fields_positive, check_floating, check_ignore_index, check_integer, check_labels
from ..pallas_common import on_gpu
from .labels import nan_where_out_of_range, wrapped
from .xla import cross_entropy_xla

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
        check_fields_positive(self, ("block_tokens", "chunk_vocab", "num_warps"))


class CrossEntropyKernel(Kernel[CrossEntropyConfig, jax.Array]):
    """Per-token softmax cross-entropy; see the module docstring."""

    # 2: the Pallas backward reads the forward's log-sum-exp instead of recomputing it.
    version = "2"
    plain_implementation = "xla"  # the floor every tuner starts from

    def __init__(self) -> None:
        super().__init__("cross_entropy")

    def run(
        self, logits: Float[Array, "tokens vocab"], *, labels: Int[Array, "tokens"], cfg: CrossEntropyConfig,
        ignore_index: int | None = -100,
    ) -> Float[Array, "tokens"]:
        if logits.ndim != 2 or labels.shape != logits.shape[:1]:
            raise ValueError(f"logits, labels: expected [tokens, vocab] and [tokens], got {logits.shape} and {labels.shape}")
        if cfg.impl == "xla":
            return cross_entropy_xla(logits, labels, ignore_index)
        return self.fwd_with_residuals(logits, labels=labels, cfg=cfg, ignore_index=ignore_index)[0]

    def fwd_with_residuals(
        self, logits: Float[Array, "tokens vocab"], *, labels: Int[Array, "tokens"], cfg: CrossEntropyConfig,
        ignore_index: int | None = -100,
    ) -> tuple[Float[Array, "tokens"], Float[Array, "tokens"]]:
        # Only the Pallas path gets here (from `run` for a forward alone): the XLA one is
        # differentiated by JAX.
        from .triton import cross_entropy_triton

        vocab = logits.shape[1]
        labels = labels if ignore_index is not None else wrapped(labels, vocab)
        loss, lse = cross_entropy_triton(logits, labels, ignore_index, **_tiles(cfg))
        return (loss if ignore_index is not None else nan_where_out_of_range(loss, labels, vocab)), lse

    def vjp(
        self, lse: Float[Array, "tokens"], out: Float[Array, "tokens"], g: Float[Array, "tokens"], logits: Float[Array, "tokens vocab"], *,
        labels: Int[Array, "tokens"], cfg: CrossEntropyConfig, ignore_index: int | None = -100,
    ) -> tuple[jax.Array]:
        from .triton import cross_entropy_triton_backward

        del out
        labels = labels if ignore_index is not None else wrapped(labels, logits.shape[1])
        return (cross_entropy_triton_backward(logits, labels, ignore_index, lse, g, **_tiles(cfg)),)

    def differentiated_by_jax(self, cfg: CrossEntropyConfig) -> bool:
        return cfg.impl == "xla"

    def shard_rule(self, inv: Invocation[CrossEntropyConfig, jax.Array]) -> ShardRule | None:
        """Each token's loss is its own: tokens split, the vocabulary stays whole."""
        return ShardRule(args=("n _",) * len(inv.args), kwargs={"logits": "n _", "labels": "n"}, out="n")

    def reference(
        self, logits: Float[Array, "tokens vocab"], *, labels: Int[Array, "tokens"], ignore_index: int | None = -100
    ) -> Float[Array, "tokens"]:
        return cross_entropy_xla(logits, labels, ignore_index)

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


def _tiles(cfg: CrossEntropyConfig) -> dict[str, int]:
    return {"block_tokens": cfg.block_tokens, "chunk_vocab": cfg.chunk_vocab, "num_warps": cfg.num_warps}


_CROSS_ENTROPY = CrossEntropyKernel()


def softmax_cross_entropy(
    logits: Float[Array, "tokens vocab"], labels: Int[Array, "tokens"], *, ignore_index: int | None = -100,
    cfg: CrossEntropyConfig | None = None,
) -> Float[Array, "tokens"]:
    """Per-token ``logsumexp(logits) - logits[label]`` in float32.

    Args:
      logits: ``[tokens, vocab]`` unnormalized scores, any float dtype.
      labels: ``[tokens]`` integer classes in ``[0, vocab)``, or ``ignore_index``; checked when
        concrete (ValueError), traced ones as the module docstring says.
      ignore_index: an int: tokens with this label are ignored (loss 0, no gradient). ``None``:
        every label is a class, and the XLA path is the plain expression a JAX user writes (no
        masking ops).
      cfg: force a config; by default the executor picks one.

    Returns:
      ``[tokens]`` float32 losses.
    """
    check_floating(logits, "logits")
    check_integer(labels, "labels")
    check_config(cfg, CrossEntropyConfig)
    check_ignore_index(ignore_index)
    if logits.ndim != 2 or labels.shape != logits.shape[:1]:
        raise ValueError(f"logits, labels: expected [tokens, vocab] and [tokens], got {logits.shape} and {labels.shape}")
    check_labels(labels, logits.shape[1], ignore_index)
    return _CROSS_ENTROPY(logits, labels=labels, ignore_index=ignore_index, cfg=cfg)
