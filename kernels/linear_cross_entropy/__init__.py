"""Fused linear cross-entropy: the loss of ``hidden @ weight`` without materialising the logits.

In a language model the unembedding matmul writes a ``[tokens, vocab]`` logits array (1 GB in
bf16 for 16384 tokens and a 32000-word vocabulary) that the loss reads once and the backward
reads again. This kernel computes the per-token loss chunk by chunk over the vocabulary with an
online log-sum-exp, so at most ``[tokens, chunk_vocab]`` logits exist at a time.

Per token ``t`` with label ``y``, logits ``z = hidden[t] @ weight`` (optionally soft-capped,
``z = cap * tanh(z / cap)``) and smoothing ``eps``::

    loss[t] = lse(z) - (1 - eps) * z[y] - eps * mean(z)

Implementations, chosen by :class:`LinearCrossEntropyConfig.impl`:

- ``"xla"``: the plain expression a JAX user writes (matmul, then a logsumexp loss),
  differentiated by JAX itself: the floor.
- ``"chunked"``: a ``lax.scan`` over vocabulary chunks of ``chunk_vocab`` columns keeping the
  running max, the rescaled sum of exponentials, the label's logit and the sum of logits. The
  forward saves the per-token log-sum-exp (``[tokens]`` floats); the backward recomputes each
  chunk's logits from ``hidden`` and that log-sum-exp and
  accumulates ``d_hidden += d_z @ w_c^T`` and ``d_weight[:, c] = hidden^T @ d_z``: the
  logits never exist whole in either direction, the cost being one more pass of the matmul.
  The least memory; many small matrix products.
- ``"chunked_tokens"``: a ``lax.scan`` over chunks of ``chunk_tokens`` tokens, each against the
  whole vocabulary, so every product is as large as the plain program's along the vocabulary.
  When the output is reduced (``"mean"``/``"sum"``) its cotangent is one scalar, so the forward,
  run under differentiation, also computes each chunk's gradient while its logits are at hand,
  and the backward only scales it: three passes of the matmul in all, as in the plain program,
  but the logits of one chunk at a time. The gradient is factored (:func:`_factored_chunk`):
  the one ``[chunk, vocab]`` array written besides the logits is ``exp(z - max)``, in the pass
  that sums it, with the label's gradient in the label's column; the softmax's ``1 / sum`` and
  the smoothing term act on ``[chunk, d]`` rows around the two products, and ``d_weight``'s
  label rows take a float32 correction (:func:`_tokens_pass`). With ``reduction="none"`` the
  backward recomputes the chunks instead.
- ``"chunked_tokens_triton"``: the same chunks, each chunk's logits read from memory once by
  a kernel (:mod:`kernels._softmax_rows`; its second walk over a row hits the L2 cache) that
  writes over them the gradient itself, the cotangent, the smoothing term and the label's
  column inside, rounded once as the plain program's: one ``[chunk, vocab]`` array instead of
  two, half the memory, the two gradient products the plain program's own with nothing around
  them (:func:`_kernel_tokens_pass`), and ``d_hidden`` as precise as the plain program's; in
  fp16, entries under its range flush to zero as the plain program's do. H100: 1.32-1.33x the
  plain program at 0.119 of its memory with chunks of 4096 tokens, 1.37-1.38x at 8192,
  1.23-1.25x at 2048 with 0.078 (bench/RESULTS.md, runs 101-107). Interpreted off the GPU
  (correct, slow).

No Pallas kernel for the products: the backward's two products reduce over different axes
(``d_hidden`` over the vocabulary, ``d_weight`` over the tokens), so a kernel walking (token
tile, vocabulary block) pairs keeps at most one of them on chip. The other must be summed across programs in
global memory (at the benchmark's shape, 16384 tokens x 768 x 32000 in 128 x 128 blocks, 128
float32 partials of ``768 x 128`` per vocabulary block: 12.6 GB of reduce-adds, the kind of
traffic that made the fused attention backward lose, bench/RESULTS.md runs 18-19) or rebuilt
in a second kernel (a fourth pass of the matmul, a third more than the plain program's
three). ``chunked_tokens`` runs the plain program's three passes with one chunk of logits at
a time and, factored, two passes over them besides the products (H100: 1.27-1.30x the
plain program at chunks of 8192 tokens, 1.23-1.31x at 4096, 1.18-1.25x at 2048 with 0.119 of
its memory; bench/RESULTS.md runs 30-39, 57 and 68). Written in XLA, a chunk holds two
``[chunk, vocab]`` arrays, the logits and ``e``: XLA writes ``e`` beside the logits, not over
them, and fuses it into neither product (three variants tried, runs 35, 36 and 40). One XLA
pass over the logits would do, shifting each row by its label's logit instead of its max (7-9%
faster), but that is exact only while the label lies within ~40 nats of the max, and redoing
the other rows costs more than the pass saves in every form XLA offers, a loop whose count the
host reads or a conditional that copies ``e`` (runs 62-68); the rows kernel keeps the max
online instead.

Tokens labelled ``ignore_index`` get loss 0 and no gradient. The reduction (``"mean"`` over the
tokens that count, ``"sum"`` or ``"none"``) is part of the call: its one home is
``_Loss.reduce``, whose pullback gives the backward its per-token cotangent.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax import lax
from jaxtyping import Array, Float, Int

from ejlabel import Invocation, Kernel

from ..checks import check_config, check_floating, check_integer
from ..pallas_common import on_gpu, pad_axis
from .triton import softmax_rows

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
        for name in ("chunk_vocab", "chunk_tokens"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name}: expected a positive int, got {value!r}")


@dataclasses.dataclass(frozen=True)
class _Loss:
    """The static parts of the loss: what every implementation computes."""

    ignore_index: int | None
    label_smoothing: float
    logit_soft_cap: float | None
    reduction: str = "none"

    def cap(self, z: jax.Array) -> jax.Array:
        return z if self.logit_soft_cap is None else self.logit_soft_cap * jnp.tanh(z / self.logit_soft_cap)

    def cap_grad(self, capped: jax.Array) -> jax.Array | float:
        """d capped / d raw, from the capped value: ``1 - tanh^2``."""
        return 1.0 if self.logit_soft_cap is None else 1.0 - jnp.square(capped / self.logit_soft_cap)

    def counts(self, labels: jax.Array) -> jax.Array:
        return jnp.ones(labels.shape, bool) if self.ignore_index is None else labels != self.ignore_index

    def per_token(self, lse: jax.Array, picked: jax.Array, mean_logit: Callable[[], jax.Array]) -> jax.Array:
        """Each token's loss from its log-sum-exp, its label's logit and (only read with
        smoothing) ``mean_logit()``, the mean of its logits, all ``[tokens]`` float32."""
        per_token = lse - picked
        if self.label_smoothing:
            per_token = per_token + self.label_smoothing * (picked - mean_logit())
        return per_token

    def from_logits(self, z: Float[Array, "tokens vocab"], safe_labels: Int[Array, "tokens"]) -> tuple[jax.Array, jax.Array]:
        """``(per-token loss, log-sum-exp)`` from capped float32 logits over the whole vocabulary."""
        picked = jnp.take_along_axis(z, safe_labels[:, None], axis=-1)[:, 0]
        lse = jax.nn.logsumexp(z, axis=-1)
        return self.per_token(lse, picked, lambda: jnp.mean(z, axis=-1)), lse

    def d_logits(
        self, z: Float[Array, "tokens cols"], lse: Float[Array, "tokens"], onehot: jax.Array, token_g: Float[Array, "tokens"],
        vocab: int, dtype: Any, real: jax.Array | None = None,
    ) -> jax.Array:
        """``d loss / d raw logits`` of columns ``z`` (capped float32), each token's row scaled
        by ``token_g``, in ``dtype``; ``real`` masks padded columns (zero gradient)."""
        eps = self.label_smoothing
        probs = jnp.exp(z - lse[:, None])
        smoothing = eps / vocab
        if real is not None:
            probs, smoothing = jnp.where(real, probs, 0.0), jnp.where(real, smoothing, 0.0)
        d_z = probs - (1.0 - eps) * onehot - smoothing
        return (d_z * token_g[:, None] * self.cap_grad(z)).astype(dtype)

    def reduce(self, per_token: jax.Array, labels: jax.Array) -> jax.Array:
        """The call's output from the ``[tokens]`` losses: the one home of the reduction."""
        if self.reduction == "none":
            return per_token
        if self.ignore_index is None:  # every token counts: the expression a JAX user writes
            return jnp.mean(per_token) if self.reduction == "mean" else jnp.sum(per_token)
        total = jnp.sum(per_token)
        return total if self.reduction == "sum" else total / jnp.maximum(jnp.sum(self.counts(labels)), 1)

    def token_cotangent(self, g: jax.Array | float, labels: jax.Array) -> Float[Array, "tokens"]:
        """The cotangent of each token's loss, given the output's cotangent ``g``: the pullback
        of :meth:`reduce` (linear in the losses), zero where a token does not count."""
        _, pullback = jax.vjp(lambda per_token: self.reduce(per_token, labels), jnp.zeros(labels.shape, jnp.float32))
        (per_token_g,) = pullback(jnp.asarray(g, jnp.float32))
        return jnp.where(self.counts(labels), per_token_g, 0.0)


def _loss_xla(hidden: jax.Array, weight: jax.Array, labels: jax.Array, loss: _Loss) -> jax.Array:
    logits = loss.cap((hidden @ weight).astype(jnp.float32))
    safe = labels if loss.ignore_index is None else jnp.where(loss.counts(labels), labels, 0)
    per_token, _ = loss.from_logits(logits, safe)
    return per_token if loss.ignore_index is None else jnp.where(loss.counts(labels), per_token, 0.0)


def _chunks(weight: jax.Array, chunk: int) -> tuple[jax.Array, int]:
    """``weight [d, vocab]`` as ``[n, d, chunk]`` zero-padded chunks, and the true vocab size."""
    d, vocab = weight.shape
    n = -(-vocab // chunk)
    padded = jnp.pad(weight, ((0, 0), (0, n * chunk - vocab)))
    return jnp.moveaxis(padded.reshape(d, n, chunk), 1, 0), vocab


def _chunk_logits(hidden: jax.Array, w_chunk: jax.Array, start: jax.Array, vocab: int, loss: _Loss) -> tuple[jax.Array, jax.Array]:
    """Capped float32 logits of one chunk ``[tokens, chunk]`` and the mask of real columns."""
    z = loss.cap(jnp.dot(hidden, w_chunk, preferred_element_type=jnp.float32))
    real = (start + jnp.arange(w_chunk.shape[1])) < vocab
    return z, real


def _forward_chunked(hidden: jax.Array, weight: jax.Array, labels: jax.Array, loss: _Loss, chunk: int) -> tuple[jax.Array, jax.Array]:
    """Per-token loss and log-sum-exp, one vocabulary chunk at a time."""
    chunks, vocab = _chunks(weight, chunk)
    tokens = hidden.shape[0]

    def step(carry: tuple[jax.Array, ...], xs: tuple[jax.Array, jax.Array]) -> tuple[tuple[jax.Array, ...], None]:
        running_max, running_sum, picked, total = carry
        index, w_chunk = xs
        start = index * chunk
        z, real = _chunk_logits(hidden, w_chunk, start, vocab, loss)
        masked = jnp.where(real, z, -jnp.inf)
        new_max = jnp.maximum(running_max, jnp.max(masked, axis=-1))
        running_sum = running_sum * jnp.exp(running_max - new_max) + jnp.sum(jnp.exp(masked - new_max[:, None]), axis=-1)
        local = labels - start
        inside = (local >= 0) & (local < chunk)
        picked = picked + jnp.where(inside, jnp.take_along_axis(z, jnp.clip(local, 0, chunk - 1)[:, None], axis=-1)[:, 0], 0.0)
        total = total + jnp.sum(jnp.where(real, z, 0.0), axis=-1)
        return (new_max, running_sum, picked, total), None

    init = (jnp.full((tokens,), -jnp.inf, jnp.float32), jnp.zeros((tokens,), jnp.float32), jnp.zeros((tokens,), jnp.float32), jnp.zeros((tokens,), jnp.float32))
    (running_max, running_sum, picked, total), _ = lax.scan(step, init, (jnp.arange(chunks.shape[0]), chunks))
    lse = running_max + jnp.log(running_sum)
    per_token = loss.per_token(lse, picked, lambda: total / vocab)
    counts = loss.counts(labels)
    return jnp.where(counts, per_token, 0.0), lse


def _backward_chunked(
    hidden: jax.Array, weight: jax.Array, labels: jax.Array, lse: jax.Array, g: jax.Array, loss: _Loss, chunk: int
) -> tuple[jax.Array, jax.Array]:
    """``(d_hidden, d_weight)`` of ``sum(g * loss)``, recomputing each chunk's logits."""
    chunks, vocab = _chunks(weight, chunk)
    scale = jnp.where(loss.counts(labels), g.astype(jnp.float32), 0.0)

    def step(d_hidden: jax.Array, xs: tuple[jax.Array, jax.Array]) -> tuple[jax.Array, jax.Array]:
        index, w_chunk = xs
        start = index * chunk
        z, real = _chunk_logits(hidden, w_chunk, start, vocab, loss)
        onehot = (labels - start)[:, None] == jnp.arange(chunk)[None, :]
        d_z = loss.d_logits(z, lse, onehot, scale, vocab, hidden.dtype, real)
        d_hidden = d_hidden + jnp.dot(d_z, w_chunk.T, preferred_element_type=jnp.float32)
        return d_hidden, jnp.dot(hidden.T, d_z, preferred_element_type=jnp.float32).astype(weight.dtype)

    d_hidden, d_chunks = lax.scan(step, jnp.zeros(hidden.shape, jnp.float32), (jnp.arange(chunks.shape[0]), chunks))
    d_weight = jnp.moveaxis(d_chunks, 0, 1).reshape(weight.shape[0], -1)[:, :vocab]
    return d_hidden.astype(hidden.dtype), d_weight


class _TokenPass(NamedTuple):
    per_token: Float[Array, "tokens"]
    d_hidden: Float[Array, "tokens d"] | None
    d_weight: Float[Array, "d vocab"] | None  # float32


def _token_chunks(x: jax.Array, chunk: int) -> jax.Array:
    """``x [tokens, ...]`` as ``[n, chunk, ...]``, zero-padded to whole chunks."""
    n = -(-x.shape[0] // chunk)
    return pad_axis(x, 0, n * chunk).reshape(n, chunk, *x.shape[1:])


class _Factored(NamedTuple):
    """``d loss / d raw logits`` of one chunk as ``r * dense - k``: the one ``[tokens, vocab]``
    array is ``dense``; ``r`` scales its rows and ``k`` (smoothing without a cap) is taken from
    every column. ``label`` is ``dense``'s label column in float32, before its rounding."""

    per_token: Float[Array, "tokens"]
    dense: Float[Array, "tokens vocab"] | None  # in the input dtype; None for the loss alone
    r: Float[Array, "tokens"] | None
    k: Float[Array, "tokens"] | None
    label: Float[Array, "tokens"] | None


def _row_reductions(*pairs: tuple[jax.Array, str]) -> tuple[jax.Array, ...]:
    """Per-row ``max`` or ``sum`` of each ``[tokens, vocab]`` operand, as one reduction: one pass
    over what the operands are computed from, where separate reductions may read it once each."""
    inits = tuple(jnp.float32(-jnp.inf if kind == "max" else 0.0) for _, kind in pairs)
    combine = lambda a, b: tuple(jnp.maximum(x, y) if kind == "max" else x + y for x, y, (_, kind) in zip(a, b, pairs))
    return lax.reduce(tuple(operand for operand, _ in pairs), inits, combine, (1,))


def _factored_chunk(
    z: Float[Array, "tokens vocab"], labels: Int[Array, "tokens"], token_g: Float[Array, "tokens"] | None, loss: _Loss, dtype: Any
) -> _Factored:
    """The loss and (given ``token_g``) the factored gradient of capped float32 logits ``z``,
    each token's row scaled by ``token_g``.

    The gradient is ``g cg (p - (1 - eps) onehot - eps / V)``, ``p`` the softmax and ``cg`` the
    cap's derivative. A first pass over ``z`` finds each row's max ``m``; the second writes the
    one dense array ``cg e`` with ``e = exp(z - m)`` and sums ``e``, all of it (``s``) and off the
    label (``others``), in one reduction; ``g / s`` scales the rows of the products and, without
    a cap, ``g eps / V`` is taken from every column beside them (``k``). A cap with smoothing
    puts ``eps / V`` inside the dense array, ``cg (e / s - eps / V)``, which needs ``s`` first: a
    pass of its own (``e`` is then ``p`` and its sum 1).

    The label's column is written last, ``cg (eps e_y - (1 - eps) others)``: the gradient
    ``p_y - (1 - eps)`` as ``eps p_y - (1 - eps)(1 - p_y)``, for a confident prediction the small
    ``p_y - 1`` with no cancellation before its rounding to ``dtype`` (``g p_y`` rounded with
    ``-g`` added beside it keeps the rounding of ``g p_y``: d_weight 10% off at p = 0.996, 96% at
    p = 0.99998; test_confident_predictions_keep_their_gradient). In an untrained model this
    entry, ``-(s - e_y)``, is the row's largest and its rounding shows in ``d_hidden`` (H100,
    [16384, 768] x [768, 32000]: 2.3e-3 of float32 against 1.7e-3 for the plain program, whose
    ``p_y - 1`` is close to -1, nearly exact in bf16); writing ``p`` instead needs the sum
    before the dense pass, which ran 2-4% slower (bench/RESULTS.md, runs 66-68). The log-sum-exp
    is not ``jax.nn.logsumexp``: on the H100 that form ran the whole loss 1.09x slower (runs
    28-29)."""
    eps, vocab = loss.label_smoothing, z.shape[1]
    capped = loss.logit_soft_cap is not None
    picked = jnp.take_along_axis(z, labels[:, None], axis=-1)[:, 0]
    m, *total = _row_reductions((z, "max"), *(((z, "sum"),) if eps else ()))
    e = jnp.exp(z - m[:, None])
    if token_g is None:  # the loss only
        per_token = loss.per_token(m + jnp.log(jnp.sum(e, axis=-1)), picked, lambda: total[0] / vocab)
        return _Factored(per_token, None, None, None, None)
    normalised = capped and bool(eps)
    e_label = jnp.exp(picked - m)
    if normalised:
        total_e = jnp.sum(e, axis=-1)
        e, e_label = e / total_e[:, None], e_label / total_e
    is_label = jnp.arange(vocab)[None, :] == labels[:, None]
    s, others = _row_reductions((e, "sum"), (jnp.where(is_label, 0.0, e), "sum"))
    per_token = loss.per_token(m + jnp.log(total_e if normalised else s), picked, lambda: total[0] / vocab)
    uniform = eps / vocab if capped else 0.0  # the smoothing term inside the dense array
    dense = loss.cap_grad(z) * (e - uniform)
    label = loss.cap_grad(picked) * (eps * e_label - (1.0 - eps) * others - uniform)
    dense = dense.astype(dtype).at[jnp.arange(z.shape[0]), labels].set(label.astype(dtype))
    r = token_g if normalised else token_g / s
    k = token_g * (eps / vocab) if eps and not capped else None
    return _Factored(per_token, dense, r, k, label)


def _rounded(x: jax.Array, dtype: Any) -> jax.Array:
    """``x`` rounded to ``dtype``'s precision, kept in float32: a rounding XLA may not skip, as
    it may a convert there and back."""
    info = jnp.finfo(dtype)
    return lax.reduce_precision(x, exponent_bits=info.nexp, mantissa_bits=info.nmant)


def _over_token_chunks(
    step: Callable[[Any, tuple[jax.Array, ...]], tuple[Any, tuple[jax.Array, ...]]], init: Any,
    hidden: jax.Array, labels: jax.Array, loss: _Loss, chunk: int, token_g: jax.Array | None,
) -> tuple[Any, jax.Array, jax.Array | None]:
    """``lax.scan`` of ``step(carry, (h_c, y_c, g_c)) -> (carry, (per_token_c[, d_hidden_c]))``
    over chunks of ``chunk`` tokens (the last one zero-padded, its cotangent zero; ignored
    labels mapped to class 0 with a zero cotangent). Returns the carry, the ``[tokens]`` losses
    (zero where a token does not count) and, when ``step`` gives it, ``d_hidden``."""
    tokens, d = hidden.shape
    chunk = min(chunk, tokens)
    safe = jnp.where(loss.counts(labels), labels, 0)
    g = jnp.zeros(labels.shape, jnp.float32) if token_g is None else token_g.astype(jnp.float32)
    carry, outs = lax.scan(step, init, (_token_chunks(hidden, chunk), _token_chunks(safe, chunk), _token_chunks(g, chunk)))
    per_token = jnp.where(loss.counts(labels), outs[0].reshape(-1)[:tokens], 0.0)
    return carry, per_token, outs[1].reshape(-1, d)[:tokens] if len(outs) > 1 else None


def _tokens_pass(
    hidden: jax.Array, weight: jax.Array, labels: jax.Array, loss: _Loss, chunk: int, token_g: jax.Array | None = None,
) -> _TokenPass:
    """Per-token losses, one chunk of tokens against the whole vocabulary at a time, and with
    ``token_g [tokens]`` the gradient of ``sum(token_g * loss)`` from the same logits, its
    terms from :func:`_factored_chunk`.

    The gradient products take :class:`_Factored` terms: ``d_hidden = r (dense @ w^T) - k
    sum_j w_j`` and ``d_weight^T += dense^T @ (r h) - sum_t k_t h_t``, the label's column inside
    ``dense``, so ``d_hidden`` needs no gathered row of the weight (nor a transposed copy of it
    to gather from). ``d_weight`` is kept transposed so that each label's row takes a float32
    correction contiguously: the exact ``label r h`` less what the product added from the two
    rounded operands, so the label's term, the largest in a confident or an untrained model's
    gradient, is not rounded twice."""
    d = hidden.shape[1]
    smoothed = bool(loss.label_smoothing) and loss.logit_soft_cap is None
    weight_sum = jnp.sum(weight.astype(jnp.float32), axis=1) if smoothed and token_g is not None else None

    def step(carry: tuple[jax.Array, jax.Array] | None, xs: tuple[jax.Array, ...]) -> tuple[tuple[jax.Array, jax.Array] | None, tuple[jax.Array, ...]]:
        h_c, y_c, g_c = xs
        product = h_c @ weight  # the plain program's logits, one chunk
        f = _factored_chunk(loss.cap(product.astype(jnp.float32)), y_c, None if carry is None else g_c, loss, hidden.dtype)
        if carry is None:  # the loss only
            return None, (f.per_token,)
        d_weight_t, smoothing = carry  # smoothing: sum_t k_t h_t, taken from every row at the end
        h32 = h_c.astype(jnp.float32)
        rh = h32 * f.r[:, None]
        d_hidden = f.r[:, None] * jnp.dot(f.dense, weight.T, preferred_element_type=jnp.float32)
        d_weight_t = d_weight_t + jnp.dot(f.dense.T, rh.astype(hidden.dtype), preferred_element_type=jnp.float32)
        d_weight_t = d_weight_t.at[y_c].add(f.label[:, None] * rh - _rounded(f.label, hidden.dtype)[:, None] * _rounded(rh, hidden.dtype))
        if f.k is not None:
            d_hidden = d_hidden - f.k[:, None] * weight_sum[None, :]
            smoothing = smoothing + jnp.sum(f.k[:, None] * h32, axis=0)
        return (d_weight_t, smoothing), (f.per_token, d_hidden.astype(hidden.dtype))

    init = None if token_g is None else (jnp.zeros((weight.shape[1], d), jnp.float32), jnp.zeros((d,), jnp.float32))
    carry, per_token, d_hidden = _over_token_chunks(step, init, hidden, labels, loss, chunk, token_g)
    if carry is None:
        return _TokenPass(per_token, None, None)
    d_weight_t, smoothing = carry
    return _TokenPass(per_token, d_hidden, (d_weight_t - smoothing[None, :]).T)


def _kernel_tokens_pass(
    hidden: jax.Array, weight: jax.Array, labels: jax.Array, loss: _Loss, chunk: int, token_g: jax.Array,
) -> _TokenPass:
    """:func:`_tokens_pass` with each chunk's logits read once by :func:`softmax_rows`, which
    writes over them the gradient itself, ``token_g`` and the smoothing inside, rounded once as
    the plain program's: the two products are the plain program's own, ``d_hidden = dense @
    w^T`` and ``d_weight += h^T @ dense`` (float32 across chunks), with nothing around them."""

    def step(d_weight: jax.Array, xs: tuple[jax.Array, ...]) -> tuple[jax.Array, tuple[jax.Array, ...]]:
        h_c, y_c, g_c = xs
        rows = softmax_rows(h_c @ weight, y_c, g_c, loss)
        d_weight = d_weight + jnp.dot(h_c.T, rows.dense, preferred_element_type=jnp.float32)
        return d_weight, (rows.per_token, rows.dense @ weight.T)

    d_weight, per_token, d_hidden = _over_token_chunks(step, jnp.zeros(weight.shape, jnp.float32), hidden, labels, loss, chunk, token_g)
    return _TokenPass(per_token, d_hidden, d_weight)


class LinearCrossEntropyKernel(Kernel[LinearCrossEntropyConfig, jax.Array]):
    """Cross-entropy of ``hidden @ weight``, per token or reduced; see the module docstring."""

    # 2: the reduction is part of the call (version 1 returned per-token losses only).
    # 3: chunked_tokens computes its gradient factored; picks timed against version 2 are stale.
    # 4: chunked_tokens writes the label's gradient into its dense array (no transposed weight),
    # so its time and memory changed: picks timed against version 3 are stale.
    # 5: chunked_tokens_triton joins the candidates: picks made without it are stale.
    # 6: chunked_tokens_triton's kernel writes the gradient itself (its products changed).
    version = "6"

    def __init__(self) -> None:
        super().__init__("linear_cross_entropy")

    def run(
        self, hidden: Float[Array, "tokens d"], weight: Float[Array, "d vocab"], *, labels: Int[Array, "tokens"],
        cfg: LinearCrossEntropyConfig, ignore_index: int | None = -100, label_smoothing: float = 0.0, logit_soft_cap: float | None = None,
        reduction: str = "none",
    ) -> Float[Array, "..."]:
        loss = _Loss(ignore_index, label_smoothing, logit_soft_cap, reduction)
        if cfg.impl == "xla":
            per_token = _loss_xla(hidden, weight, labels, loss)
        elif cfg.impl == "chunked":
            per_token = _forward_chunked(hidden, weight, labels, loss, cfg.chunk_vocab)[0]
        else:  # a forward alone is the same program for both token-chunked implementations
            per_token = _tokens_pass(hidden, weight, labels, loss, cfg.chunk_tokens).per_token
        return loss.reduce(per_token, labels)

    def fwd_with_residuals(
        self, hidden: Float[Array, "tokens d"], weight: Float[Array, "d vocab"], *, labels: Int[Array, "tokens"],
        cfg: LinearCrossEntropyConfig, ignore_index: int | None = -100, label_smoothing: float = 0.0, logit_soft_cap: float | None = None,
        reduction: str = "none",
    ) -> tuple[Float[Array, "..."], Any]:
        # Only the chunked paths get here (the XLA one is differentiated by JAX), and only under
        # differentiation: the executor runs `run` for a forward that is not differentiated.
        loss = _Loss(ignore_index, label_smoothing, logit_soft_cap, reduction)
        if cfg.impl == "chunked":
            # The per-token log-sum-exp, [tokens] floats: the backward recomputes each chunk's
            # logits from it instead of rerunning the whole forward.
            per_token, lse = _forward_chunked(hidden, weight, labels, loss, cfg.chunk_vocab)
            return loss.reduce(per_token, labels), lse
        if reduction == "none":  # a cotangent per token, known only in the backward
            return _tokens_pass(hidden, weight, labels, loss, cfg.chunk_tokens).per_token, None
        # A scalar output: the gradient for a unit cotangent now, from the logits at hand.
        done = _gradient_pass(cfg)(hidden, weight, labels, loss, cfg.chunk_tokens, loss.token_cotangent(1.0, labels))
        return loss.reduce(done.per_token, labels), (done.d_hidden, done.d_weight)

    def vjp(
        self, residuals: Any, out: Float[Array, "..."], g: Float[Array, "..."],
        hidden: Float[Array, "tokens d"], weight: Float[Array, "d vocab"], *, labels: Int[Array, "tokens"],
        cfg: LinearCrossEntropyConfig, ignore_index: int | None = -100, label_smoothing: float = 0.0, logit_soft_cap: float | None = None,
        reduction: str = "none",
    ) -> tuple[jax.Array, jax.Array]:
        del out
        loss = _Loss(ignore_index, label_smoothing, logit_soft_cap, reduction)
        if cfg.impl == "chunked":
            return _backward_chunked(hidden, weight, labels, residuals, loss.token_cotangent(g, labels), loss, cfg.chunk_vocab)
        if residuals is None:
            done = _gradient_pass(cfg)(hidden, weight, labels, loss, cfg.chunk_tokens, loss.token_cotangent(g, labels))
            return done.d_hidden, done.d_weight.astype(weight.dtype)
        d_hidden, d_weight = residuals
        g = jnp.asarray(g, jnp.float32)
        return (d_hidden * g).astype(hidden.dtype), (d_weight * g).astype(weight.dtype)

    def differentiated_by_jax(self, cfg: LinearCrossEntropyConfig) -> bool:
        return cfg.impl == "xla"

    def reference(
        self, hidden: Float[Array, "tokens d"], weight: Float[Array, "d vocab"], *, labels: Int[Array, "tokens"],
        ignore_index: int | None = -100, label_smoothing: float = 0.0, logit_soft_cap: float | None = None, reduction: str = "none",
    ) -> Float[Array, "..."]:
        loss = _Loss(ignore_index, label_smoothing, logit_soft_cap, reduction)
        return loss.reduce(_loss_xla(hidden.astype(jnp.float32), weight.astype(jnp.float32), labels, loss), labels)

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
        # ranked on the H100 (bench/RESULTS.md): a tuner that ranks only the first few candidates
        # of each ranks the likely winners. One chunk of every token (16384) ran slower than two
        # (run 32). The rows kernel is offered on the GPU only: interpreted, it is correct but slow.
        vocab_sizes, token_sizes = ((8192, 4096, 2048), (8192, 4096, 2048)) if on_gpu() else ((64, 16), (32, 8))
        token_impls = ("chunked_tokens_triton", "chunked_tokens") if on_gpu() else ("chunked_tokens",)
        return (
            [LinearCrossEntropyConfig(impl, chunk_tokens=c) for impl in token_impls for c in _fitting(token_sizes, tokens)]
            + [LinearCrossEntropyConfig("xla")]
            + [LinearCrossEntropyConfig("chunked", chunk_vocab=c) for c in _fitting(vocab_sizes, vocab)]
        )


def _gradient_pass(cfg: LinearCrossEntropyConfig) -> Callable[..., _TokenPass]:
    """The token-chunked pass that computes the loss with its gradient, by implementation."""
    return _kernel_tokens_pass if cfg.impl == "chunked_tokens_triton" else _tokens_pass


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
      labels: ``[tokens]`` integer classes in ``[0, vocab)``, or ``ignore_index``.
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
    if not 0.0 <= float(label_smoothing) < 1.0:
        raise ValueError(f"label_smoothing: expected a number in [0, 1), got {label_smoothing!r}")
    if logit_soft_cap is not None and not float(logit_soft_cap) > 0:
        raise ValueError(f"logit_soft_cap: expected None or a number > 0, got {logit_soft_cap!r}")
    if ignore_index is not None and not isinstance(ignore_index, int):
        raise TypeError(f"ignore_index: expected an int or None, got {type(ignore_index).__name__}")
    cap = None if logit_soft_cap is None else float(logit_soft_cap)
    return _LINEAR_CROSS_ENTROPY(
        hidden, weight, labels=labels, ignore_index=ignore_index, label_smoothing=float(label_smoothing), logit_soft_cap=cap,
        reduction=reduction, cfg=cfg,
    )
