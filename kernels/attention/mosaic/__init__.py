"""Flash attention on the Pallas Mosaic GPU backend, for Hopper (sm_90a): the ``"mosaic"``
implementation of :func:`ejlabel.kernels.attention.flash_attention`.

Same function and conventions as :mod:`ejlabel.kernels.attention` (``[batch, seq, heads,
dim]``, grouped-query attention, causal, sliding window, segment ids with ids ``<= 0`` as
padding; a query that sees nothing gets output 0 and gradient 0; the log-sum-exp is kept in
base 2 for the backward), written for what the Triton backend cannot express:

- **Warp specialisation.** Each program (CTA) runs three warpgroups: two consumers that each
  own 64 rows of the program's 128-row tile and do the math with ``wgmma``, and one producer
  that only issues TMA copies. The producer gives most of its registers to the consumers.
- **A ring of shared-memory stages.** The producer streams the blocks the tile must visit into
  ``stages`` slots; a "ready" barrier per slot (completed by the TMA engine) and a "consumed"
  barrier per slot (two arrivals, one per consumer) keep the two sides in step. Keys and values
  have separate barriers so the next key block can land while the current ``P V`` runs. Where
  two full stages do not fit (the backward at head dim 256), the blocks a step holds to its end
  get two slots and those it frees mid-step one (:func:`.budget.ring_depths`). A consumer's
  own tile stays for the whole walk, but each step picks it anew (:func:`.kernel.per_step`):
  else the compiler holds its wgmma descriptors in registers across the walk.
- **A visiting plan instead of a mask over everything.** Outside the kernel, each tile gets the
  range ``[lo, hi)`` of blocks it must visit (from causal bounds, windows, padded keys and
  segment ids), inside it the run ``[a, c)`` of blocks that every row sees whole, and around
  that the run ``[u_lo, u_hi)`` of blocks that hold the tile's one document only. The kernel
  walks the blocks that need the segment ids' mask first, then those masked by positions alone
  (a document's diagonal; up to head dim 64, where the registers allow a third loop), then
  ``[a, c)`` without a mask: one loop per kind of mask, so the step's code is in the kernel
  once per kind, not once per range. Blocks outside ``[lo, hi)`` are never loaded. With packed
  documents that skips every block pair of two different documents. Without segment ids the
  plan is a constant of the program. The plans, the kinds of mask and the walk live in
  :mod:`.plan`.
- **Persistent programs.** At most one program per SM, each walking several tiles (dealt in
  sections whose blocks stay in L2, the costliest first within each, and where a program
  walks few tiles, each round by the programs' load so far, see :mod:`.work`);
  the ring runs on from one tile to the next, and the next tile loads while the last one's
  results are written (:class:`.work.Items`).

Kernels (an item is one tile of one head of one batch row):

- forward: items are query tiles of 128 rows; each walks key/value blocks with an online
  softmax in float32, base 2;
- backward, split in two kernels (the simplest split that needs no atomics and no
  per-query-head partials): ``dq`` over query tiles walking key/value blocks, and ``dk, dv``
  over key/value tiles of 128 rows walking, for each query head of its group, the query blocks
  that see it (above head dim 128, where a consumer cannot hold both accumulators, one walk
  for ``dv`` and one for ``dk``: :func:`.backward.dkv_passes`). Where its tiles fit, the
  ``dq`` kernel also computes the softmax backward's row term ``delta = sum_d out * dO`` from
  the tiles it loads and hands it to ``dk, dv`` (see :func:`.backward.dq_call`). Up to head
  dim 64 each kernel's two consumers take turns with their products, as the forward's do
  (:data:`BACKWARD_PINGPONG_MAX_DIM`).

The head dimension is padded to a multiple of 64 (the width of a 128-byte swizzled row of 16-bit
elements) outside the kernels. Sequences are walked in whole tiles without being copied to them:
TMA reads a tile's rows past the end as zeros and does not write them back (see
:func:`pad_operands`). Keys past the end are masked; queries past the end are never written.

The forward kernel is in :mod:`.forward`, the backward ones in :mod:`.backward`, the pieces
they share (layouts, the mask, the producer's and consumers' walks, the launch) in
:mod:`.kernel`, the shared-memory budget in :mod:`.budget`. This module checks what the kernels
take, pads the operands, and binds the entry points :func:`mosaic_forward` and
:func:`mosaic_backward`, whose gradient the attention kernel wires
(``AttentionKernel.fwd_with_residuals`` and ``vjp``). Importing it imports no Pallas: the
attention op reads its facts (:data:`MOSAIC_SCHEDULES`, :func:`mosaic_supports`,
:func:`mosaic_fits`, :func:`on_hopper`) to check and offer configs, and the kernels (with
Pallas's Mosaic GPU backend) are imported by the entry points when they first run and by
:func:`mosaic_available` (which :func:`on_hopper` asks on a Hopper GPU). Schedules kept for
experiments (a differentiable entry point with every knob) are in
:mod:`.experimental`, which nothing in the product imports. The 8-bit forward for inference
(e4m3 operands, the forward kernel with its ``descale``) is bound in :mod:`.fp8`; the tuner never
picks it, since it changes the values.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import math
from typing import Any

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int

from ejlabel import BwdParams, FwdParams

from ...pallas_common import LOG2E, pad_axis
from ..masks import Window
from .budget import SMEM_BYTES, ring_stages
from .plan import TILE, WG_ROWS, Shape, visit_plan

__all__ = [
    "BACKWARD_PINGPONG_MAX_DIM",
    "MOSAIC_SCHEDULES",
    "TILE",
    "WG_ROWS",
    "Padded",
    "check_operands",
    "mosaic_available",
    "mosaic_backward",
    "mosaic_fits",
    "mosaic_forward",
    "mosaic_supports",
    "on_hopper",
    "pad_operands",
    "padded_head_dim",
    "tile_blocks",
    "traced_once",
]

_DIM_MULTIPLE = 64  # 128-byte swizzle of 16-bit elements

# The forward's schedules by name (AttentionConfig.fwd_schedule): mosaic_forward's arguments.
MOSAIC_SCHEDULES: dict[str, dict[str, bool]] = {
    "pingpong": {"pingpong": True, "pipelined": False},
    "plain": {"pingpong": False, "pipelined": False},
    "pipelined": {"pingpong": False, "pipelined": True},
    "pipelined_pingpong": {"pingpong": True, "pipelined": True},
}
_MAX_DIM = 256


def mosaic_available() -> bool:
    """Whether this JAX has the Mosaic GPU backend of Pallas (asking imports it, with
    :mod:`.kernel`)."""
    from .kernel import plgpu

    return plgpu is not None


def on_hopper() -> bool:
    """Whether the default device is a Hopper GPU (compute capability 9.x), where wgmma runs,
    and this JAX has the backend to run it."""
    if jax.default_backend() != "gpu":
        return False
    capability = str(getattr(jax.devices()[0], "compute_capability", ""))
    return capability.startswith("9.") and mosaic_available()


def padded_head_dim(dim: int) -> int:
    """The head dimension the kernels run at: ``dim`` padded to a multiple of 64."""
    return -(-dim // _DIM_MULTIPLE) * _DIM_MULTIPLE


def mosaic_supports(dtype: Any, dim: int) -> bool:
    """Whether the kernels, forward and backward, take this dtype and head dimension: 16-bit
    inputs, head dims up to 256 (above 128 the dk/dv kernel walks twice, see
    :func:`.backward.dkv_passes`)."""
    padded = padded_head_dim(dim)
    return jnp.dtype(dtype) in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16)) and 0 < padded <= _MAX_DIM


# Mosaic GPU copies a tile to or from memory whose tiled row count is a multiple of the 8-row
# swizzle tile ("dimension 1 must have size smaller or a multiple of its tiling 8").
_TMA_ROWS = 8


@dataclasses.dataclass(frozen=True)
class Padded:
    """The operands of one call, padded (see :func:`pad_operands`), and the lengths they came with."""

    q: jax.Array
    k: jax.Array
    v: jax.Array
    segment_ids: jax.Array | None
    shape: Shape
    seq_q: int
    seq_kv: int
    dim: int
    rows: int  # query rows in whole tiles
    cols: int  # key rows in whole tiles

    def like_q(self, x: jax.Array) -> jax.Array:
        """A ``[batch, seq_q, heads, dim]`` operand (``dO``, the forward's output) padded as ``q`` is."""
        return pad_axis(pad_axis(x, 3, self.q.shape[3]), 1, self.q.shape[1])


def pad_operands(
    q: jax.Array, k: jax.Array, v: jax.Array, segment_ids: jax.Array | None,
    *, scale: float, bounds: Window, block_k: int, interpret: bool = False,
) -> Padded:
    """Pad the head dimension to a multiple of 64, and take the sequences in whole tiles (queries
    of 128 rows, keys of ``block_k`` and of 128). On the GPU a sequence is padded only to a
    multiple of 8 rows (:data:`_TMA_ROWS`): TMA reads a tile's rows past the end as zeros and does
    not write them back, which is what padding with zeros to whole tiles gave. At B8 S1000 H16
    D128 those copies in and out took as long as the forward kernel (``bench/bench_attention.py``
    section e, its odd-length row; ``bench/RESULTS.md``). The interpreter clamps such slices, so
    there the sequences are padded to whole tiles.
    The segment ids are padded to whole tiles everywhere: they are small, and the padding's ids
    of 0 are the ids the tiles' tails must see. They are clamped at 0 (ids <= 0 all see
    nothing), which the kernels' mask relies on (:func:`.kernel.tile_segments`)."""
    seq_q, dim = q.shape[1], q.shape[3]
    seq_kv = k.shape[1]
    kv_tile = math.lcm(block_k, TILE)  # the backward tiles keys by 128
    rows, cols = -(-seq_q // TILE) * TILE, -(-seq_kv // kv_tile) * kv_tile
    padded_dim = padded_head_dim(dim)
    q_rows, kv_rows = (rows, cols) if interpret else (-(-n // _TMA_ROWS) * _TMA_ROWS for n in (seq_q, seq_kv))
    q = pad_axis(pad_axis(q, 3, padded_dim), 1, q_rows)
    k, v = (pad_axis(pad_axis(t, 3, padded_dim), 1, kv_rows) for t in (k, v))
    if segment_ids is not None:
        segment_ids = pad_axis(jnp.maximum(segment_ids.astype(jnp.int32), 0), 1, max(rows, cols))
    kv_len = seq_kv if segment_ids is None and cols != seq_kv else None
    shape = Shape(scale * LOG2E, bounds, kv_len, q.shape[2] // k.shape[2], segment_ids is not None, interpret)
    return Padded(q, k, v, segment_ids, shape, seq_q, seq_kv, dim, rows, cols)


def _forward_padded(
    p: Padded, *, block_k: int, stages: int | None, pingpong: bool = False, persistent: bool = True, pipelined: bool = False,
) -> tuple[jax.Array, jax.Array]:
    from .forward import forward_call

    batch, rows, cols = p.q.shape[0], p.rows, p.cols
    plan = visit_plan(rows, cols, TILE, block_k, p.shape, p.segment_ids, batch, transpose=False)
    return forward_call(
        p.q, p.k, p.v, plan, p.segment_ids, p.shape, block_k=block_k, stages=stages, pingpong=pingpong, persistent=persistent, pipelined=pipelined,
    )


def tile_blocks(params: FwdParams | BwdParams, dim: int) -> tuple[int, int, int | None]:
    """``(q block, kv block, stages)`` from launch parameters; unset block sizes get defaults
    that fit shared memory at this head dimension (128-row blocks up to dim 128, 64-key blocks
    above, since a wgmma's contraction takes 64 elements at least) and, in the backward,
    registers: above dim 64 the dq kernel's tiles of 128 keys spilled and 64 keys did not, and
    fwd+bwd ran faster on 64 at dim 128, causal and with 4 documents (``bench/ptxas_report.py``
    for the spills; ``bench/bench_attention.py`` times the backward tiles in section g). Since
    each step picks its tiles (:func:`.kernel.per_step`) no kernel spills at dim 128, and 128
    keys run level with 64 there and at dim 64 (section g): 64 stays.
    Unset stages stay None: each kernel takes :func:`ring_stages` of what it holds."""
    backward = isinstance(params, BwdParams)
    widest = 64 if backward else 128
    block_q = params.q_blocksize or 64
    block_k = params.kv_blocksize or (64 if dim > widest else 128)
    for name, value in (("q_blocksize", block_q), ("kv_blocksize", block_k)):
        if value not in (64, 128):
            raise ValueError(f"{name}: the mosaic kernels take 64 or 128, got {value}")
    return block_q, block_k, params.num_stages


def mosaic_fits(dim: int, fwd: FwdParams, bwd: BwdParams) -> bool:
    """Whether the kernels' shared memory fits at this head dim and these tiles (and the
    tiles are ones the kernels take)."""
    padded = padded_head_dim(dim)
    try:
        _, fwd_k, fwd_stages = tile_blocks(fwd, padded)
        bwd_q, bwd_k, bwd_stages = tile_blocks(bwd, padded)
    except ValueError:
        return False
    row = padded * 2  # bytes of one 16-bit row
    kernels = (  # (resident bytes, bytes per stage, stages asked for)
        (TILE * row, 2 * fwd_k * row, fwd_stages),  # the forward
        (2 * TILE * row, 2 * bwd_k * row, bwd_stages),  # the dq kernel
        (2 * TILE * row, 2 * bwd_q * row, bwd_stages),  # the widest dk/dv walk
    )
    return all(tile + ring_stages(stages, tile, stage) * stage <= SMEM_BYTES for tile, stage, stages in kernels)


def check_operands(q: jax.Array, k: jax.Array) -> None:
    """Raise unless this JAX has the kernels and they take ``q``'s dtype and head dimension."""
    del k  # its dtype and head dim are q's (the attention op checks them)
    if not mosaic_available():
        raise NotImplementedError("this JAX has no Pallas Mosaic GPU backend")
    if not mosaic_supports(q.dtype, q.shape[3]):
        raise ValueError(f"q: the mosaic kernels take bfloat16 or float16 with head dim <= {_MAX_DIM}, got {q.dtype} dim {q.shape[3]}")


def traced_once(fn: Any) -> Any:
    """``fn`` (whose keyword-only arguments are all static) under ``jax.jit``, so every call site
    with the same shapes, arguments and label reuses one trace and one lowering: a model's
    layers then lower each kernel once (the packed example model, 12 layers, lowered for CUDA
    with jax 0.11.2 on the CPU in a fraction of the time it took before; a one-off measurement,
    its figures in git history). Calls under
    other XLA metadata (another label; a call's first site, which also carries its description)
    are traced apart, and their Mosaic modules are still equal. Not in the interpreter: its
    simulated warpgroups hung inside the jitted call (CPU, jax 0.10.2)."""
    static = [name for name, p in inspect.signature(fn).parameters.items() if p.kind is p.KEYWORD_ONLY]
    jitted = jax.jit(fn, static_argnames=static)

    @functools.wraps(fn)
    def call(*args: Any, interpret: bool = False, **kwargs: Any) -> Any:
        return (fn if interpret else jitted)(*args, interpret=interpret, **kwargs)

    return call


@traced_once
def mosaic_forward(
    q: Float[Array, "batch sq heads dim"], k: Float[Array, "batch skv kv_heads dim"], v: Float[Array, "batch skv kv_heads dim"],
    segment_ids: Int[Array, "batch seq"] | None, *, scale: float, bounds: Window, params: FwdParams, interpret: bool = False,
    pingpong: bool = True, persistent: bool = True, pipelined: bool = False,
) -> tuple[Float[Array, "batch sq heads dim"], Float[Array, "batch heads sq"]]:
    """``(out, lse)``: the attention output and its base-2 log-sum-exp ``[batch, heads, sq]``.

    ``pingpong`` alternates the two consumer warpgroups between matrix products and softmax
    (see :func:`.forward.forward_call`). On by default: on the H100 (jax 0.11.2) it ran the
    causal B4 S4096 H16 D128 forward and the packed-documents forward faster than the plain
    schedule, in one interleaved run (``bench/bench_attention.py`` section f compares the
    schedules; figures in ``bench/RESULTS.md``). ``persistent``: at most one program per SM,
    each walking several tiles (see :class:`.work.Items`); False: one per tile.
    ``pipelined``: each consumer overlaps its softmax with its own products
    (:func:`.forward.pipelined_walk`); with ``pingpong``, the consumers also take turns to
    issue them.
    """
    check_operands(q, k)
    _, block_k, stages = tile_blocks(params, q.shape[3])
    p = pad_operands(q, k, v, segment_ids, scale=scale, bounds=bounds, block_k=block_k, interpret=interpret)
    out, lse = _forward_padded(p, block_k=block_k, stages=stages, pingpong=pingpong, persistent=persistent, pipelined=pipelined)
    return out[:, : p.seq_q, :, : p.dim], lse[:, :, : p.seq_q]


# Up to this head dim the backward kernels' consumers take turns by default: at the example
# model's D64 shapes (causal GQA and 4 packed documents) that ran fwd+bwd faster than the
# kernels without turns, and at D128 level (bench_attention.py section g; bench/RESULTS.md).
BACKWARD_PINGPONG_MAX_DIM = 64


@traced_once
def mosaic_backward(
    q: Float[Array, "batch sq heads dim"], k: Float[Array, "batch skv kv_heads dim"], v: Float[Array, "batch skv kv_heads dim"],
    segment_ids: Int[Array, "batch seq"] | None, out: Float[Array, "batch sq heads dim"], lse: Float[Array, "batch heads sq"],
    g: Float[Array, "batch sq heads dim"], *, scale: float, bounds: Window, params: BwdParams, interpret: bool = False,
    persistent: bool = True, pingpong_dq: bool | None = None, pingpong_dkv: bool | None = None,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """``(dq, dk, dv)`` from the forward's output and base-2 log-sum-exp and the cotangent ``g``
    (``persistent``: as in :func:`mosaic_forward`): a dq kernel, then a dk/dv kernel (two walks
    of it above head dim 128). ``pingpong_dq``: the dq kernel's consumers take turns (see
    :func:`.backward.dq_call`); ``pingpong_dkv``: the dk/dv kernel's do (see
    :func:`.backward.dkv_call`). Unset, both take turns up to head dim
    :data:`BACKWARD_PINGPONG_MAX_DIM` unless ``params`` asks for one stage; set with one stage,
    they raise ValueError."""
    from .backward import dkv_call, dkv_passes, dq_call

    check_operands(q, k)
    block_q, block_k, stages = tile_blocks(params, q.shape[3])
    p = pad_operands(q, k, v, segment_ids, scale=scale, bounds=bounds, block_k=block_k, interpret=interpret)
    batch, dim, rows, cols = p.q.shape[0], p.q.shape[3], p.rows, p.cols
    # Turns need two ring stages (:func:`.backward.check_turns`); every kernel's default ring
    # has two up to dim 128, and above two slots of the blocks a step holds (turns are not the
    # default there).
    turns = dim <= BACKWARD_PINGPONG_MAX_DIM and stages != 1
    pingpong_dq = turns if pingpong_dq is None else pingpong_dq
    pingpong_dkv = turns if pingpong_dkv is None else pingpong_dkv
    do, out = p.like_q(g.astype(p.q.dtype)), p.like_q(out)
    lse = pad_axis(lse.astype(jnp.float32), 2, rows)  # row terms over whole tiles: TMA strides
    # The dq kernel first: it may compute delta for the dk/dv kernel.
    rows_plan = visit_plan(rows, cols, TILE, block_k, p.shape, p.segment_ids, batch, transpose=False)
    dq, delta = dq_call(
        p.q, p.k, p.v, do, lse, out, rows_plan, p.segment_ids, p.shape, block_k=block_k, stages=stages, persistent=persistent, pingpong=pingpong_dq,
    )
    cols_plan = visit_plan(cols, rows, TILE, block_q, p.shape, p.segment_ids, batch, transpose=True)
    got: dict[str, jax.Array] = {}
    for grads in dkv_passes(dim):
        dk, dv = dkv_call(
            p.q, p.k, p.v, do, lse, delta, cols_plan, p.segment_ids, p.shape, block_q=block_q, stages=stages, persistent=persistent, grads=grads,
            pingpong=pingpong_dkv,
        )
        got.update((name, x) for name, x in (("dk", dk), ("dv", dv)) if x is not None)
    seq_kv = p.seq_kv
    return dq[:, : p.seq_q, :, : p.dim], got["dk"][:, :seq_kv, :, : p.dim], got["dv"][:, :seq_kv, :, : p.dim]
