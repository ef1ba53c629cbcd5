"""Flash attention: softmax(q k^T * scale + mask) v over ``[batch, seq, heads, dim]`` arrays.

Features, in every implementation that accepts them:

- grouped-query attention: ``k`` and ``v`` may have fewer heads than ``q``; query head ``h``
  reads key/value head ``h // (heads_q // heads_kv)``;
- ``causal``: query ``i`` sees keys ``j <= i`` (positions counted from 0 in both);
- ``sliding_window=(left, right)``: query ``i`` sees keys ``i - left <= j <= i + right``
  (with ``causal`` the right side is 0);
- ``segment_ids [batch, seq]``: tokens see only tokens with the same id; ids ``<= 0`` are
  padding, which sees nothing and gets output 0;
- ``cu_seqlens [n + 1]``: a packed batch; ``q``, ``k`` and ``v`` are ``[1, total, heads,
  dim]`` and sequence ``s`` is ``tokens cu_seqlens[s]:cu_seqlens[s + 1]``; tokens past
  ``cu_seqlens[-1]`` are padding. It is turned into segment ids ``1..n`` (padding 0), so
  causal masks and windows act within each sequence.

A query that sees no key gets output 0 and gradient 0, never NaN.

Implementations, chosen by :class:`AttentionConfig.impl`:

- ``"xla"``: what a JAX user writes, differentiated by JAX itself (no custom VJP):
  ``jax.nn.dot_product_attention(implementation="xla")`` for causal or full attention, with
  segment ids (or ``cu_seqlens``) as a dense block-diagonal ``mask``; the masked softmax in
  float32 with a window.
- ``"cudnn"``: ``jax.nn.dot_product_attention(implementation="cudnn")``, differentiated by JAX;
  GPU, 16-bit inputs, causal or not, segment ids as the same dense mask (which cuDNN takes as a
  bias), no windows. ``use_implementation("xla")`` and the untuned default pick it on a GPU
  wherever cuDNN takes the call, as ``jax.nn.dot_product_attention`` would, so a labelled
  packed-documents model is never slower than the plain one.
- ``"cudnn_packed"``: packed documents on cuDNN's own packed layout (:mod:`.cudnn_packed`):
  each document's length and start, derived from the segment ids, instead of a dense mask;
  differentiated by JAX. Hopper, 16-bit inputs, segment ids or ``cu_seqlens``, no window. Its
  call is sized by the most documents in a row, which must be known before the values are:
  ``max_documents=`` with segment ids, the shape of ``cu_seqlens`` with those. The tuning space
  offers it on a GPU for the calls that give that count.
- ``"mosaic"``: flash attention on the Pallas Mosaic GPU backend for Hopper (TMA, wgmma, warp
  specialisation; :mod:`.mosaic`), 16-bit inputs, head dim <= 256 (above 128 the dk/dv kernel
  walks once for dv and once for dk). Where it runs, the tuning space offers it and not the
  Triton kernels below, which it beat at every shape measured; its forward's schedule is a
  field of the config (``fwd_schedule``).
- ``"pallas"``: flash attention on Pallas's Triton backend (:mod:`.triton`; tuned on other GPUs
  and for float32 inputs; selectable everywhere, interpreted off the GPU).

The Pallas and Mosaic implementations have their own backward kernels: the forward keeps its
output and base-2 log-sum-exp ``[batch, heads, seq]`` (``fwd_with_residuals``) and ``vjp``
starts from them, as flash attention does. The masks every implementation shares are in
:mod:`.masks`, the block tables of segment ids in :mod:`.blocks`, the Triton kernels' default
tiles (which the config checks read too) in :mod:`.defaults`, named shapes of the tests and
benchmarks in :mod:`.arg_specs`.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import numbers
import operator
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float, Int

from ejlabel import BwdParams, FwdParams, Invocation, Kernel, ShardRule

from ..checks import check_config, check_floating, check_integer, check_nondecreasing, check_number, check_same_dtype
from ..pallas_common import on_gpu
from .cudnn_packed import GROUPED_HEADS, attention_cudnn_packed
from .defaults import default_fwd
from .masks import Window, cu_seqlens_to_segment_ids, window_bounds
from .mosaic import MOSAIC_SCHEDULES, mosaic_backward, mosaic_fits, mosaic_forward, mosaic_supports, on_hopper
from .xla import attention_plain, attention_xla

__all__ = ["AttentionConfig", "AttentionKernel", "cu_seqlens_to_segment_ids", "flash_attention"]

_IMPLS = ("xla", "cudnn", "cudnn_packed", "pallas", "mosaic")


@dataclasses.dataclass(frozen=True)
class AttentionConfig:
    """How to run one attention call.

    Attributes:
      impl: ``"xla"``, ``"cudnn"``, ``"cudnn_packed"`` (Hopper, packed documents), ``"pallas"``
        or ``"mosaic"`` (Hopper).
      fwd: tiles and launch parameters of the Pallas forward (unset fields get defaults).
      bwd: the same for the Pallas backward kernels.
      fwd_schedule: how the Mosaic forward's two consumer warpgroups share the tensor cores
        (:func:`.mosaic.mosaic_forward`): ``"pingpong"`` (the default: they take turns between
        matrix products and softmax), ``"plain"`` (each on its own), ``"pipelined"`` (each
        overlaps its softmax with its own products) or ``"pipelined_pingpong"`` (both). Other
        implementations take only the default.
    """

    impl: str = "xla"
    fwd: FwdParams = FwdParams()
    bwd: BwdParams = BwdParams()
    fwd_schedule: str = "pingpong"

    def __post_init__(self) -> None:
        if self.impl not in _IMPLS:
            raise ValueError(f"impl: expected one of {_IMPLS}, got {self.impl!r}")
        if self.fwd_schedule not in MOSAIC_SCHEDULES:
            raise ValueError(f"fwd_schedule: expected one of {tuple(MOSAIC_SCHEDULES)}, got {self.fwd_schedule!r}")
        if self.impl != "mosaic" and self.fwd_schedule != "pingpong":
            raise ValueError(f"fwd_schedule: only the mosaic implementation has schedules; impl {self.impl!r} takes 'pingpong', got {self.fwd_schedule!r}")


# Triton tiles, the leaders of a sweep of every tile shape on the H100 (causal, B4 S4096 H16
# D128); the tuner tries every pairing, since forward and backward add up.
_FWD_TILES = ((128, 64, 4, 2), (128, 128, 8, 3), (128, 64, 8, 3), (64, 32, 4, 3), (64, 64, 4, 3), (128, 32, 4, 3))
_BWD_TILES = ((64, 64, 4, 2), (64, 64, 4, 1), (128, 64, 8, 2), (64, 32, 4, 2), (128, 32, 4, 2))
# Mosaic GPU tiles: forward (kv block, stages); backward (q block, kv block) with 2 stages.
_MOSAIC_FWD = ((128, 2), (64, 3))
# With segment ids the plain schedule on 64-key blocks ran the Mosaic forward fastest at the
# example model's packed shape (ahead of the default and of ping-pong on those blocks); without
# them ping-pong led at every shape measured (bench_attention.py section f; figures in
# bench/RESULTS.md). (kv block, stages, schedule).
_MOSAIC_FWD_SEGMENTS = ((64, 3, "plain"),)
# Above head dim 64 the pipelined schedule (each consumer's softmax beside its own products) ran
# the causal D128 forward level with ping-pong or a little ahead, and slower at dim 64
# (bench_attention.py section f): a candidate where it can win, for the tuner to time in context.
_MOSAIC_FWD_WIDE = ((128, 2, "pipelined"),)
_MOSAIC_BWD = ((64, 128, None, 2), (128, 64, None, 2), (64, 64, None, 2))
# Above head dim 128 the kernels take their own tiles, under these schedules: the pipelined one
# ran the causal B2 S4096 H8 D256 forward faster than ping-pong once each step picked its query
# tile (.mosaic.kernel.per_step; bench_attention.py section d, figures in bench/RESULTS.md).
_MOSAIC_FWD_SCHEDULES_256 = ("pingpong", "pipelined")


class AttentionKernel(Kernel[AttentionConfig, jax.Array]):
    """Flash attention with masks, segments and grouped heads; see the module docstring."""

    version = "1"
    plain_implementation = "xla"  # jax.nn.dot_product_attention's path (config_for): the tuners' floor

    def __init__(self) -> None:
        super().__init__("flash_attention")

    def run(
        self, q: Float[Array, "batch sq heads dim"], k: Float[Array, "batch skv kv_heads dim"], v: Float[Array, "batch skv kv_heads dim"],
        *, cfg: AttentionConfig, causal: bool = False, softmax_scale: float | None = None, sliding_window: Window | None = None,
        segment_ids: Int[Array, "batch seq"] | None = None, cu_seqlens: Int[Array, "n+1"] | None = None,
        max_documents: int | None = None,
    ) -> Float[Array, "batch sq heads dim"]:
        documents = _documents(segment_ids, cu_seqlens, max_documents)
        segment_ids = _segments(q, k, segment_ids, cu_seqlens)
        scale = _scale(q, softmax_scale)
        bounds = window_bounds(causal, sliding_window)
        if cfg.impl == "cudnn_packed":
            if sliding_window is not None or segment_ids is None or documents is None:
                raise ValueError(
                    "the cudnn_packed implementation takes segment ids with max_documents (or cu_seqlens) and no sliding window"
                )
            return attention_cudnn_packed(q, k, v, segment_ids, scale=scale, causal=causal, max_documents=documents)
        if cfg.impl in ("xla", "cudnn"):
            if sliding_window is None:
                return attention_plain(q, k, v, segment_ids, scale=scale, causal=causal, implementation=cfg.impl)
            if cfg.impl == "cudnn":
                raise ValueError("the cudnn implementation takes no sliding window")
            return attention_xla(q, k, v, segment_ids, scale=scale, bounds=bounds)
        return self.fwd_with_residuals(
            q, k, v, cfg=cfg, causal=causal, softmax_scale=softmax_scale, sliding_window=sliding_window, segment_ids=segment_ids
        )[0]

    def fwd_with_residuals(
        self, q: Float[Array, "batch sq heads dim"], k: Float[Array, "batch skv kv_heads dim"], v: Float[Array, "batch skv kv_heads dim"],
        *, cfg: AttentionConfig, causal: bool = False, softmax_scale: float | None = None, sliding_window: Window | None = None,
        segment_ids: Int[Array, "batch seq"] | None = None, cu_seqlens: Int[Array, "n+1"] | None = None,
        max_documents: int | None = None,
    ) -> tuple[Float[Array, "batch sq heads dim"], Float[Array, "batch heads sq"]]:
        """The output and its base-2 log-sum-exp ``[batch, heads, seq_q]``, which the backward
        keeps (with the output) instead of rerunning the forward.

        Only the Pallas and Mosaic paths get here: XLA's and cuDNN's are differentiated by JAX.
        """
        segment_ids = _segments(q, k, segment_ids, cu_seqlens)
        scale, bounds = _scale(q, softmax_scale), window_bounds(causal, sliding_window)
        if cfg.impl == "mosaic":
            schedule = MOSAIC_SCHEDULES[cfg.fwd_schedule]
            return mosaic_forward(q, k, v, segment_ids, scale=scale, bounds=bounds, params=cfg.fwd, **schedule)
        from .triton import triton_forward

        return triton_forward(q, k, v, segment_ids, scale=scale, bounds=bounds, params=cfg.fwd)

    def vjp(
        self, lse: Float[Array, "batch heads sq"], out: Float[Array, "batch sq heads dim"], g: Float[Array, "batch sq heads dim"],
        q: Float[Array, "batch sq heads dim"], k: Float[Array, "batch skv kv_heads dim"], v: Float[Array, "batch skv kv_heads dim"],
        *, cfg: AttentionConfig, causal: bool = False, softmax_scale: float | None = None, sliding_window: Window | None = None,
        segment_ids: Int[Array, "batch seq"] | None = None, cu_seqlens: Int[Array, "n+1"] | None = None,
        max_documents: int | None = None,
    ) -> tuple[jax.Array, jax.Array, jax.Array]:
        segment_ids = _segments(q, k, segment_ids, cu_seqlens)
        scale, bounds = _scale(q, softmax_scale), window_bounds(causal, sliding_window)
        if cfg.impl == "mosaic":
            return mosaic_backward(q, k, v, segment_ids, out, lse, g, scale=scale, bounds=bounds, params=cfg.bwd)
        from .triton import triton_backward

        return triton_backward(q, k, v, segment_ids, out, lse, g, scale=scale, bounds=bounds, params=cfg.bwd)

    def differentiated_by_jax(self, cfg: AttentionConfig) -> bool:
        return cfg.impl not in ("pallas", "mosaic")

    def partitioned_by_xla(self, cfg: AttentionConfig) -> bool:
        # cuDNN's calls carry JAX's partitioning rule on auto mesh axes but not on explicit ones:
        # split, they run per shard like ours (inside shard_map, as JAX's own cuDNN tests do).
        return cfg.impl == "xla"

    def shard_rule(self, inv: Invocation[AttentionConfig, jax.Array]) -> ShardRule | None:
        """Rows and heads are independent (query and key/value heads split alike, which keeps
        each group of query heads with its key/value head); sequences and head dims stay whole.
        Varlen calls (``cu_seqlens``) pack every sequence into one row: they run whole."""
        if inv.kwargs.get("cu_seqlens") is not None:
            return None
        per_token = "b _ h _"
        return ShardRule(
            args=(per_token,) * len(inv.args), out=per_token,
            kwargs={"q": per_token, "k": per_token, "v": per_token, "segment_ids": "b _"},
        )

    def config_for(self, inv: Invocation[AttentionConfig, jax.Array], implementation: str) -> AttentionConfig | None:
        """``"xla"`` means what ``jax.nn.dot_product_attention`` gives a JAX user: cuDNN on a GPU
        where cuDNN takes the call (bf16/fp16, head dim <= 256 on Hopper and <= 128 elsewhere, no window; segment ids and
        ``cu_seqlens`` as a dense mask), XLA's own expression otherwise (always on the CPU).
        ``"cudnn_packed"`` applies to calls with packed documents and their count only."""
        if implementation == "xla":
            cudnn = AttentionConfig("cudnn")
            return cudnn if self.candidate_is_valid(inv, cudnn) else AttentionConfig("xla")
        if implementation == "cudnn_packed" and _documents_of(inv) is None:
            return None  # a call without packed documents keeps its own selection
        if implementation in _IMPLS:
            return AttentionConfig(implementation)
        return None

    def reference(
        self, q: Float[Array, "batch sq heads dim"], k: Float[Array, "batch skv kv_heads dim"], v: Float[Array, "batch skv kv_heads dim"],
        *, causal: bool = False, softmax_scale: float | None = None, sliding_window: Window | None = None,
        segment_ids: Int[Array, "batch seq"] | None = None, cu_seqlens: Int[Array, "n+1"] | None = None,
        max_documents: int | None = None,
    ) -> Float[Array, "batch sq heads dim"]:
        segment_ids = _segments(q, k, segment_ids, cu_seqlens)
        return attention_xla(q, k, v, segment_ids, scale=_scale(q, softmax_scale), bounds=window_bounds(causal, sliding_window))

    def make_inputs(self, inv: Invocation[AttentionConfig, jax.Array], key: jax.Array) -> tuple[tuple[Any, ...], dict[str, Any]]:
        keys = jax.random.split(key, 3)
        args = tuple(jax.random.normal(kk, a.shape, jnp.float32).astype(a.dtype) for kk, a in zip(keys, inv.args))
        kwargs = dict(inv.kwargs)
        batch, seq = inv.args[0].shape[:2]
        if kwargs.get("segment_ids") is not None:
            # Four contiguous segments per row (fewer if the call promises fewer), the last
            # eighth of each row padding.
            count = min(4, kwargs.get("max_documents") or 4)
            ids = 1 + (jnp.arange(seq) * count) // seq
            ids = jnp.where(jnp.arange(seq) < seq - seq // 8, ids, 0)
            kwargs["segment_ids"] = jnp.broadcast_to(ids, (batch, seq)).astype(kwargs["segment_ids"].dtype)
        if kwargs.get("cu_seqlens") is not None:
            count = kwargs["cu_seqlens"].shape[0] - 1
            used = seq - seq // 8
            kwargs["cu_seqlens"] = ((jnp.arange(count + 1) * used) // max(count, 1)).astype(kwargs["cu_seqlens"].dtype)
        return args, kwargs

    def heuristic_cfg(self, inv: Invocation[AttentionConfig, jax.Array]) -> AttentionConfig:
        # The plain-JAX path until tuning in context shows something faster: an untuned
        # labelled model compiles to the plain model's program, never to a slower one.
        return self.config_for(inv, "xla")

    def config_space(self, inv: Invocation[AttentionConfig, jax.Array]) -> list[AttentionConfig]:
        if not on_gpu():
            small = BwdParams(16, 16, 4, 1)
            return [AttentionConfig("xla"), AttentionConfig("pallas", FwdParams(16, 16, 4, 1), small), AttentionConfig("pallas", FwdParams(32, 16, 4, 1), small)]
        q = inv.args[0]
        forwards = [(bk, st, "pingpong") for bk, st in _MOSAIC_FWD]
        if any(inv.kwargs.get(name) is not None for name in ("segment_ids", "cu_seqlens")):
            forwards += _MOSAIC_FWD_SEGMENTS
        if q.shape[3] > 64:
            forwards += _MOSAIC_FWD_WIDE
        mosaic = [
            AttentionConfig("mosaic", FwdParams(kv_blocksize=bk, num_stages=st), BwdParams(*bwd), fwd_schedule=schedule)
            for bk, st, schedule in forwards for bwd in _MOSAIC_BWD
        ]
        if q.shape[3] > 128:  # none of those fit shared memory: the kernels' own tiles do
            mosaic = [AttentionConfig("mosaic", fwd_schedule=schedule) for schedule in _MOSAIC_FWD_SCHEDULES_256]
        # Where the Mosaic kernels run, the Triton ones beat them nowhere we measured: Mosaic ran
        # faster at every shape, forward and forward+backward (bench_attention.py sections a-e;
        # figures in bench/RESULTS.md). Their 30 tiles would only cost tuning time (one Triton
        # backward compiled for minutes at 16:1 grouped heads). Still selectable by config.
        pairs = () if on_hopper() and mosaic_supports(q.dtype, q.shape[3]) else itertools.product(_FWD_TILES, _BWD_TILES)
        pallas = [AttentionConfig("pallas", FwdParams(*fwd), BwdParams(*bwd)) for fwd, bwd in pairs]
        # cuDNN's packed layout where the call gives the most documents in a row, which sizes it.
        packed = [AttentionConfig("cudnn_packed")] if _documents_of(inv) is not None else []
        return [AttentionConfig("xla"), AttentionConfig("cudnn")] + packed + pallas + mosaic

    def prior_configs(self, inv: Invocation[AttentionConfig, jax.Array]) -> list[AttentionConfig]:
        # On Hopper our Mosaic GPU kernels are the ones that beat the plain path in the whole
        # training step, dense and packed (bench_model.py); elsewhere no implementation is known to.
        # Before them, where a call gives its packed documents' count, cuDNN's packed layout: it
        # skips the block pairs across documents that the dense mask walks. Each is confirmed
        # against the one kept before it: at the example model's packed shape the Mosaic kernels
        # now pass cuDNN's packed layout in the step (bench_model.py --packed; bench/RESULTS.md).
        q = inv.args[0]
        packed = AttentionConfig("cudnn_packed")
        prior = [packed] if self.candidate_is_valid(inv, packed) else []
        if on_hopper() and mosaic_supports(q.dtype, q.shape[3]):
            prior += [cfg for cfg in self.config_space(inv) if cfg.impl == "mosaic"]
        return prior

    def candidate_is_valid(self, inv: Invocation[AttentionConfig, jax.Array], cfg: AttentionConfig) -> bool:
        q = inv.args[0]
        if cfg.impl == "cudnn":
            masked = any(inv.kwargs.get(name) is not None for name in ("segment_ids", "cu_seqlens"))
            # cuDNN trains with a mask (a bias to it) only on even sequence lengths.
            # Head dims up to 256 on Hopper (H100: values and gradients with and without a mask,
            # bf16 and fp16), up to 128 on the GPUs it has not run on.
            widest = 256 if on_hopper() else 128
            shapes = q.shape[3] % 8 == 0 and q.shape[3] <= widest and not (masked and (q.shape[1] % 2 or inv.args[1].shape[1] % 2))
            return on_gpu() and inv.kwargs.get("sliding_window") is None and q.dtype in (jnp.bfloat16, jnp.float16) and shapes
        if cfg.impl == "cudnn_packed":  # cuDNN runs its packed layout from Hopper on
            shapes = q.shape[3] % 8 == 0 and q.shape[3] <= 256 and (GROUPED_HEADS or q.shape[2] == inv.args[1].shape[2])
            packed = _documents_of(inv) is not None and inv.kwargs.get("sliding_window") is None
            return on_hopper() and packed and q.dtype in (jnp.bfloat16, jnp.float16) and shapes
        if cfg.impl == "mosaic":  # Hopper, 16-bit, head dim <= 256, tiles that fit shared memory
            return on_hopper() and mosaic_supports(q.dtype, q.shape[3]) and mosaic_fits(q.shape[3], cfg.fwd, cfg.bwd)
        if cfg.impl == "pallas":
            fwd = default_fwd(q.shape[3]).merge(cfg.fwd)
            return fwd.q_blocksize <= max(16, 2 * q.shape[1]) and fwd.kv_blocksize <= max(16, 2 * inv.args[1].shape[1])
        return True


def _segments(q: jax.Array, k: jax.Array, segment_ids: jax.Array | None, cu_seqlens: jax.Array | None) -> jax.Array | None:
    if segment_ids is not None and cu_seqlens is not None:
        raise ValueError("pass segment_ids or cu_seqlens, not both")
    if cu_seqlens is not None:
        if q.shape[0] != 1:
            raise ValueError(f"with cu_seqlens, q, k and v are [1, total, heads, dim]; got q of shape {q.shape}")
        segment_ids = cu_seqlens_to_segment_ids(cu_seqlens, q.shape[1])
    if segment_ids is not None and (segment_ids.shape != q.shape[:2] or q.shape[1] != k.shape[1]):
        raise ValueError(f"segment_ids: expected shape {q.shape[:2]} with equal q and kv lengths, got {segment_ids.shape} (kv {k.shape[1]})")
    return segment_ids


def _documents(segment_ids: jax.Array | None, cu_seqlens: jax.Array | None, max_documents: int | None) -> int | None:
    """The most documents in a row, known before the values: ``cu_seqlens``' count of sequences,
    or the caller's ``max_documents`` with segment ids; None without either."""
    if cu_seqlens is not None:
        return max(cu_seqlens.shape[0] - 1, 1)
    return max_documents if segment_ids is not None else None


def _documents_of(inv: Invocation[AttentionConfig, jax.Array]) -> int | None:
    return _documents(inv.kwargs.get("segment_ids"), inv.kwargs.get("cu_seqlens"), inv.kwargs.get("max_documents"))


def _scale(q: jax.Array, softmax_scale: float | None) -> float:
    return 1.0 / math.sqrt(q.shape[3]) if softmax_scale is None else float(softmax_scale)


def _check_shapes(q: jax.Array, k: jax.Array, v: jax.Array) -> None:
    if q.ndim != 4 or k.shape != v.shape or k.ndim != 4:
        raise ValueError(f"q, k, v: expected [batch, seq, heads, dim] with k and v alike, got {q.shape}, {k.shape}, {v.shape}")
    if q.shape[0] != k.shape[0] or q.shape[3] != k.shape[3] or q.shape[2] % k.shape[2]:
        raise ValueError(f"q, k: batch and dim must match and kv heads divide q heads, got {q.shape} and {k.shape}")


_ATTENTION = AttentionKernel()


def _window(sliding_window: Any) -> tuple[int, int] | None:
    """``sliding_window`` as ``(left, right)``: two ints >= 0, or None."""
    if sliding_window is None:
        return None
    if not isinstance(sliding_window, (tuple, list)) or len(sliding_window) != 2:
        raise ValueError(f"sliding_window: expected (left, right), two ints >= 0, got {sliding_window!r:.60}")
    for side in sliding_window:
        if isinstance(side, (bool, np.bool_)) or not isinstance(side, numbers.Integral):
            raise TypeError(f"sliding_window: expected (left, right), two ints >= 0, got {sliding_window!r:.60}")
        if side < 0:
            raise ValueError(f"sliding_window: expected (left, right), two ints >= 0, got {sliding_window!r:.60}")
    return int(sliding_window[0]), int(sliding_window[1])


def flash_attention(
    q: Float[Array, "batch sq heads dim"], k: Float[Array, "batch skv kv_heads dim"], v: Float[Array, "batch skv kv_heads dim"],
    *, causal: bool = False, segment_ids: Int[Array, "batch seq"] | None = None, cu_seqlens: Int[Array, "n+1"] | None = None,
    softmax_scale: float | None = None, sliding_window: tuple[int, int] | None = None, max_documents: int | None = None,
    cfg: AttentionConfig | None = None,
) -> Float[Array, "batch sq heads dim"]:
    """Multi-head attention with optional causal mask, window, segments and grouped heads.

    Args:
      q: ``[batch, seq_q, heads, dim]`` queries.
      k, v: ``[batch, seq_kv, kv_heads, dim]``; ``kv_heads`` divides ``heads``.
      causal: query ``i`` sees keys ``j <= i``.
      segment_ids: ``[batch, seq]`` int; tokens see only equal ids; ids ``<= 0`` are padding
        (output 0). Needs ``seq_q == seq_kv``.
      cu_seqlens: ``[n + 1]`` int cumulative lengths of a packed batch, non-negative and
        non-decreasing (checked when concrete; traced ones are trusted, and a decreasing one
        gives segments that are not its sequences); ``q``, ``k``, ``v`` are then ``[1, total,
        ...]``. Exclusive with ``segment_ids``.
      softmax_scale: a finite number multiplying ``q k^T``; default ``1 / sqrt(dim)``.
      sliding_window: ``(left, right)``, two ints >= 0: query ``i`` sees keys ``i - left .. i + right``.
      max_documents: with ``segment_ids``, the most documents (runs of equal positive ids) any
        row holds, a static int; it lets the call run on cuDNN's packed layout
        (``"cudnn_packed"``), which it sizes. There a row that layout cannot say (more
        documents, or one id in two separate runs) gets NaN; every other implementation is
        exact for any ids and ignores it.
      cfg: force a config; by default the executor picks one.

    Returns:
      ``[batch, seq_q, heads, dim]`` in the dtype of ``q``.
    """
    _check_shapes(q, k, v)
    for name, array in (("q", q), ("k", k), ("v", v)):
        check_floating(array, name)
    check_same_dtype({"q": q, "k": k, "v": v})
    for name, ids in (("segment_ids", segment_ids), ("cu_seqlens", cu_seqlens)):
        if ids is not None:
            check_integer(ids, name)
    check_config(cfg, AttentionConfig)
    if cu_seqlens is not None:
        if cu_seqlens.ndim != 1 or cu_seqlens.shape[0] < 1:
            raise ValueError(f"cu_seqlens: expected [n + 1] cumulative lengths, got shape {cu_seqlens.shape}")
        check_nondecreasing(cu_seqlens, "cu_seqlens")
    window = _window(sliding_window)
    scale = None if softmax_scale is None else check_number(softmax_scale, "softmax_scale")
    # Passed only when given: calls without it keep the call keys (and tuned configs) they had.
    extra = {} if max_documents is None else {"max_documents": _check_max_documents(max_documents, segment_ids)}
    return _ATTENTION(
        q, k, v, causal=bool(causal), softmax_scale=scale, sliding_window=window, segment_ids=segment_ids, cu_seqlens=cu_seqlens,
        cfg=cfg, **extra,
    )


def _check_max_documents(max_documents: Any, segment_ids: jax.Array | None) -> int:
    try:
        count = None if isinstance(max_documents, bool) else operator.index(max_documents)
    except TypeError:
        count = None
    if count is None or count < 1:
        raise ValueError(f"max_documents: expected an int >= 1, got {max_documents!r}")
    if segment_ids is None:
        raise ValueError("max_documents: counts the documents of segment_ids; pass segment_ids with it (cu_seqlens' shape gives its own count)")
    return count
