"""Fused linear cross-entropy: the loss of ``hidden @ weight`` without materialising the logits.

In a language model the unembedding matmul writes a ``[tokens, vocab]`` logits array (1 GB in
bf16 for 16384 tokens and a 32000-word vocabulary) that the loss reads once and the backward
reads again. The chunked implementations hold at most one chunk of logits at a time.

Per token ``t`` with label ``y``, logits ``z = hidden[t] @ weight`` (optionally soft-capped,
``z = cap * tanh(z / cap)``) and smoothing ``eps``::

    loss[t] = lse(z) - (1 - eps) * z[y] - eps * mean(z)

Implementations, chosen by :class:`LinearCrossEntropyConfig.impl`:

- ``"xla"``: the plain expression a JAX user writes (matmul, then a logsumexp loss),
  differentiated by JAX itself: the floor (:mod:`.xla`).
- ``"chunked"``: a ``lax.scan`` over vocabulary chunks with an online log-sum-exp, the
  backward recomputing each chunk's logits: the least memory, many small matrix products
  (:mod:`.xla_chunked`).
- ``"chunked_tokens"``: a ``lax.scan`` over chunks of tokens, each against the whole
  vocabulary, the gradient computed with the loss while a chunk's logits are at hand and
  factored around the plain program's products (:mod:`.xla_chunked_tokens`).
- ``"chunked_tokens_triton"``: the same chunks, each chunk's logits read once by a kernel on
  Pallas's Triton backend that writes the gradient over them (:mod:`.triton`): faster than the
  plain program at a small fraction of its memory, and faster with larger chunks
  (``bench/bench_linear_cross_entropy.py``; figures in ``bench/RESULTS.md``). Interpreted off
  the GPU (correct, slow).

No Pallas kernel for the products: the backward's two products reduce over different axes
(``d_hidden`` over the vocabulary, ``d_weight`` over the tokens), so a kernel walking (token
tile, vocabulary block) pairs keeps at most one of them on chip. The other must be summed
across programs in global memory (at the benchmark's shape, 16384 tokens x 768 x 32000 in 128
x 128 blocks, 128 float32 partials of ``768 x 128`` per vocabulary block: 12.6 GB of
reduce-adds, the kind of traffic that made the fused attention backward lose) or rebuilt in a
second kernel (a fourth pass of the matmul, a third more than the plain program's three).
``chunked_tokens`` runs the plain program's three passes with one chunk of logits at a time
and, factored, two passes over them besides the products (faster than the plain program at a
fraction of its memory, and faster with larger chunks; same benchmark).

Tokens labelled ``ignore_index`` get loss 0 and no gradient. The reduction (``"mean"`` over the
tokens that count, ``"sum"`` or ``"none"``) is part of the call: its one home is
:meth:`.loss.Loss.reduce`, whose pullback gives the backward its per-token cotangent.

Labels must lie in ``[0, vocab)`` or equal ``ignore_index``. Concrete labels are checked: an
eager call with any other label raises ValueError. Traced labels (under ``jit``, ``grad``,
``vmap``) cannot be checked and cost nothing; there every implementation reads them as the XLA
path's gather (NumPy's indexing) does: a label in ``[-vocab, 0)`` counts as ``label + vocab``,
and any other label outside ``[0, vocab)`` gives its token a NaN loss (so a NaN mean or sum) and
the gradient of its log-sum-exp alone.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int

from ejlabel import Invocation, Kernel, ShardRule

from ..checks import check_config, check_fields_positive, check_floating, check_ignore_index, check_integer, check_labels, check_number
from ..pallas_common import on_gpu
from .loss import Loss, TokenPass
from .xla import loss_xla
from .xla_chunked import backward_chunked, forward_chunked
from .xla_chunked_tokens import tokens_pass

__all__ = ["LinearCrossEntropyConfig", "LinearCrossEntropyKernel", "linear_cross_entropy"]

_IMPLS = ("xla", "chunked", "chunked_tokens", "chunked_tokens_triton")
_REDUCTIONS = ("mean", "sum", "none")


@dataclasses.dataclass(frozen=True)
class LinearCrossEntropyConfig:
    """How to run one fused linear cross-entropy.

    Attributes:
      impl: ``"xla"`` (the plain expression), ``"chunked"`` (online over vocabulary chunks),
        ``"chunked_tokens"`` (over token chunks, the gradient computed with the loss) or
        ``"chunked_tokens_triton"`` (the same, each chunk's logits read once by a kernel).
      chunk_vocab: vocabulary columns per step of ``"chunked"``.
      chunk_tokens: tokens per step of the two token-chunked implementations.
    """

    impl: str = "xla"
    chunk_vocab: int = 4096
    chunk_tokens: int = 2048

    def __post_init__(self) -> None:
        if self.impl not in _IMPLS:
            raise ValueError(f"impl: expected one of {_IMPLS}, got {self.impl!r}")
        check_fields_positive(self, ("chunk_vocab", "chunk_tokens"))


class LinearCrossEntropyKernel(Kernel[LinearCrossEntropyConfig, jax.Array]):
    """Cross-entropy of ``hidden @ weight``, per token or reduced; see the module docstring."""

    # 2: the reduction is part of the call (version 1 returned per-token losses only).
    # 3: chunked_tokens computes its gradient factored; picks timed against version 2 are stale.
    # 4: chunked_tokens writes the label's gradient into its dense array (no transposed weight),
    # so its time and memory changed: picks timed against version 3 are stale.
    # 5: chunked_tokens_triton joins the candidates: picks made without it are stale.
    # 6: chunked_tokens_triton's kernel writes the gradient itself (its products changed).
    version = "6"
    plain_implementation = "xla"  # the floor every tuner starts from

    def __init__(self) -> None:
        super().__init__("linear_cross_entropy")

    def run(
        self, hidden: Float[Array, "tokens d"], weight: Float[Array, "d vocab"], *, labels: Int[Array, "tokens"],
        cfg: LinearCrossEntropyConfig, ignore_index: int | None = -100, label_smoothing: float = 0.0, logit_soft_cap: float | None = None,
        reduction: str = "none",
    ) -> Float[Array, "..."]:
        loss = Loss(ignore_index, label_smoothing, logit_soft_cap, reduction)
        if cfg.impl == "xla":
            return loss.reduce(loss_xla(hidden, weight, labels, loss), labels)
        vocab = weight.shape[1]
        labels = loss.wrapped(labels, vocab)
        if cfg.impl == "chunked":
            per_token = forward_chunked(hidden, weight, labels, loss, cfg.chunk_vocab)[0]
        else:  # a forward alone is the same program for both token-chunked implementations
            per_token = tokens_pass(hidden, weight, labels, loss, cfg.chunk_tokens).per_token
        return loss.reduce(loss.nan_where_out_of_range(per_token, labels, vocab), labels)

    def fwd_with_residuals(
        self, hidden: Float[Array, "tokens d"], weight: Float[Array, "d vocab"], *, labels: Int[Array, "tokens"],
        cfg: LinearCrossEntropyConfig, ignore_index: int | None = -100, label_smoothing: float = 0.0, logit_soft_cap: float | None = None,
        reduction: str = "none",
    ) -> tuple[Float[Array, "..."], Any]:
        # Only the chunked paths get here (the XLA one is differentiated by JAX), and only under
        # differentiation: the executor runs `run` for a forward that is not differentiated.
        loss = Loss(ignore_index, label_smoothing, logit_soft_cap, reduction)
        vocab = weight.shape[1]
        labels = loss.wrapped(labels, vocab)
        if cfg.impl == "chunked":
            # The per-token log-sum-exp, [tokens] floats: the backward recomputes each chunk's
            # logits from it instead of rerunning the whole forward.
            per_token, lse = forward_chunked(hidden, weight, labels, loss, cfg.chunk_vocab)
            return loss.reduce(loss.nan_where_out_of_range(per_token, labels, vocab), labels), lse
        if reduction == "none":  # a cotangent per token, known only in the backward
            return loss.nan_where_out_of_range(tokens_pass(hidden, weight, labels, loss, cfg.chunk_tokens).per_token, labels, vocab), None
        # A scalar output: the gradient for a unit cotangent now, from the logits at hand.
        done = _gradient_pass(cfg)(hidden, weight, labels, loss, cfg.chunk_tokens, loss.token_cotangent(1.0, labels))
        return loss.reduce(loss.nan_where_out_of_range(done.per_token, labels, vocab), labels), (done.d_hidden, done.d_weight)

    def vjp(
        self, residuals: Any, out: Float[Array, "..."], g: Float[Array, "..."],
        hidden: Float[Array, "tokens d"], weight: Float[Array, "d vocab"], *, labels: Int[Array, "tokens"],
        cfg: LinearCrossEntropyConfig, ignore_index: int | None = -100, label_smoothing: float = 0.0, logit_soft_cap: float | None = None,
        reduction: str = "none",
    ) -> tuple[jax.Array, jax.Array]:
        del out
        loss = Loss(ignore_index, label_smoothing, logit_soft_cap, reduction)
        labels = loss.wrapped(labels, weight.shape[1])
        if cfg.impl == "chunked":
            return backward_chunked(hidden, weight, labels, residuals, loss.token_cotangent(g, labels), loss, cfg.chunk_vocab)
        if residuals is None:
            done = _gradient_pass(cfg)(hidden, weight, labels, loss, cfg.chunk_tokens, loss.token_cotangent(g, labels))
            return done.d_hidden, done.d_weight.astype(weight.dtype)
        d_hidden, d_weight = residuals
        g = jnp.asarray(g, jnp.float32)
        return (d_hidden * g).astype(hidden.dtype), (d_weight * g).astype(weight.dtype)

    def differentiated_by_jax(self, cfg: LinearCrossEntropyConfig) -> bool:
        return cfg.impl == "xla"

    def shard_rule(self, inv: Invocation[LinearCrossEntropyConfig, jax.Array]) -> ShardRule | None:
        """Tokens split; the weight stays whole on every device. A summed or mean loss is
        summed per shard (the fused paths then compute the gradient in the same pass), the
        shards' sums added up and, for the mean, divided by the tokens that count."""
        if len(inv.args) != 2:
            return None
        args, kwargs = ("n _", "_ _"), {"labels": "n"}
        reduction = inv.kwargs.get("reduction", "none")
        if reduction == "none":
            return ShardRule(args=args, kwargs=kwargs, out="n")
        loss, labels = Loss(inv.kwargs.get("ignore_index", -100), 0.0, None, "mean"), inv.kwargs["labels"]
        return ShardRule(
            args=args, kwargs=kwargs, out="", out_summed=True, local_kwargs={"reduction": "sum"},
            finish=(lambda total: loss.mean_of_sum(total, labels)) if reduction == "mean" else None,
        )

    def reference(
        self, hidden: Float[Array, "tokens d"], weight: Float[Array, "d vocab"], *, labels: Int[Array, "tokens"],
        ignore_index: int | None = -100, label_smoothing: float = 0.0, logit_soft_cap: float | None = None, reduction: str = "none",
    ) -> Float[Array, "..."]:
        loss = Loss(ignore_index, label_smoothing, logit_soft_cap, reduction)
        return loss.reduce(loss_xla(hidden.astype(jnp.float32), weight.astype(jnp.float32), labels, loss), labels)

    def make_inputs(self, inv: Invocation[LinearCrossEntropyConfig, jax.Array], key: jax.Array) -> tuple[tuple[Any, ...], dict[str, Any]]:
        hidden, weight = inv.args
        k_h, k_w, k_y = jax.random.split(key, 3)
        args = (
            jax.random.normal(k_h, hidden.shape, jnp.float32).astype(hidden.dtype),
            (jax.random.normal(k_w, weight.shape, jnp.float32) / jnp.sqrt(weight.shape[0])).astype(weight.dtype),
        )
        labels = inv.kwargs["labels"]
        return args, {**inv.kwargs, "labels": jax.random.randint(k_y, labels.shape, 0, weight.shape[1], labels.dtype)}

    def heuristic_cfg(self, inv: Invocation[LinearCrossEntropyConfig, jax.Array]) -> LinearCrossEntropyConfig:
        # The plain expression until tuning in context shows the chunked one is faster.
        return LinearCrossEntropyConfig("xla")

    def config_space(self, inv: Invocation[LinearCrossEntropyConfig, jax.Array]) -> list[LinearCrossEntropyConfig]:
        tokens, vocab = inv.args[0].shape[0], inv.args[1].shape[1]
        # Fastest first within each implementation, and the implementations in the order they
        # ranked on the H100 (bench_linear_cross_entropy.py): a tuner that ranks only the first
        # few candidates of each ranks the likely winners. One chunk of every token (16384) ran
        # slower than two. The rows kernel is offered on the GPU only: interpreted, it is correct but slow.
        vocab_sizes, token_sizes = ((8192, 4096, 2048), (8192, 4096, 2048)) if on_gpu() else ((64, 16), (32, 8))
        token_impls = ("chunked_tokens_triton", "chunked_tokens") if on_gpu() else ("chunked_tokens",)
        return (
            [LinearCrossEntropyConfig(impl, chunk_tokens=c) for impl in token_impls for c in _fitting(token_sizes, tokens)]
            + [LinearCrossEntropyConfig("xla")]
            + [LinearCrossEntropyConfig("chunked", chunk_vocab=c) for c in _fitting(vocab_sizes, vocab)]
        )

    def prior_configs(self, inv: Invocation[LinearCrossEntropyConfig, jax.Array]) -> list[LinearCrossEntropyConfig]:
        # On GPUs the token-chunked loss, which never holds the whole logits, is what beat the
        # plain unembedding and cross-entropy in the whole training step (bench_model.py).
        if not on_gpu():
            return []
        return [cfg for cfg in self.config_space(inv) if cfg.impl.startswith("chunked_tokens")]


def _gradient_pass(cfg: LinearCrossEntropyConfig) -> Callable[..., TokenPass]:
    """The token-chunked pass that computes the loss with its gradient, by implementation."""
    if cfg.impl != "chunked_tokens_triton":
        return tokens_pass
    from .triton import triton_tokens_pass

    return triton_tokens_pass


def _fitting(sizes: tuple[int, ...], length: int) -> list[int]:
    """The chunk sizes that split ``length`` into at least two chunks, and the smallest that does
    not (one chunk, the whole length): a larger chunk would only be the same program again."""
    whole = [c for c in sizes if c >= length]
    return [c for c in sizes if c < length or c == min(whole, default=None)]


_LINEAR_CROSS_ENTROPY = LinearCrossEntropyKernel()


def linear_cross_entropy(
    hidden: Float[Array, "tokens d"], weight: Float[Array, "d vocab"], labels: Int[Array, "tokens"], *,
    ignore_index: int | None = -100, label_smoothing: float = 0.0, logit_soft_cap: float | None = None,
    reduction: str = "mean", cfg: LinearCrossEntropyConfig | None = None,
) -> Float[Array, "..."]:
    """Cross-entropy of the logits ``hidden @ weight`` against ``labels``, in float32.

    Args:
      hidden: ``[tokens, d]`` final hidden states.
      weight: ``[d, vocab]`` unembedding, the dtype of ``hidden``.
      labels: ``[tokens]`` integer classes in ``[0, vocab)``, or ``ignore_index``; checked when
        concrete (ValueError), traced ones as the module docstring says.
      ignore_index: tokens with this label count nowhere (loss 0, no gradient); None: all count.
      label_smoothing: ``eps`` in ``[0, 1)``: the target puts ``eps`` uniformly over the vocabulary.
      logit_soft_cap: if given, logits pass through ``cap * tanh(z / cap)`` first.
      reduction: ``"mean"`` over the tokens that count, ``"sum"``, or ``"none"`` (per token).
      cfg: force a config; by default the executor picks one.

    Returns:
      A float32 scalar, or ``[tokens]`` losses with ``reduction="none"``.
    """
    check_floating(hidden, "hidden")
    check_floating(weight, "weight")
    check_integer(labels, "labels")
    check_config(cfg, LinearCrossEntropyConfig)
    if hidden.ndim != 2 or weight.ndim != 2 or hidden.shape[1] != weight.shape[0] or labels.shape != hidden.shape[:1]:
        raise ValueError(f"hidden, weight, labels: expected [tokens, d], [d, vocab], [tokens], got {hidden.shape}, {weight.shape}, {labels.shape}")
    if hidden.dtype != weight.dtype:
        raise TypeError(f"hidden, weight: expected one dtype, got {jnp.dtype(hidden.dtype).name} and {jnp.dtype(weight.dtype).name}")
    if reduction not in _REDUCTIONS:
        raise ValueError(f"reduction: expected one of {_REDUCTIONS}, got {reduction!r}")
    smoothing = check_number(label_smoothing, "label_smoothing", minimum=0.0)
    if not smoothing < 1.0:
        raise ValueError(f"label_smoothing: expected a number in [0, 1), got {label_smoothing!r}")
    cap = None if logit_soft_cap is None else check_number(logit_soft_cap, "logit_soft_cap")
    if cap is not None and not cap > 0:
        raise ValueError(f"logit_soft_cap: expected None or a number > 0, got {logit_soft_cap!r}")
    check_ignore_index(ignore_index)
    check_labels(labels, weight.shape[1], ignore_index)
    return _LINEAR_CROSS_ENTROPY(
        hidden, weight, labels=labels, ignore_index=ignore_index, label_smoothing=smoothing, logit_soft_cap=cap,
        reduction=reduction, cfg=cfg,
    )
