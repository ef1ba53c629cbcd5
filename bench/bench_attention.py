"""Attention on one GPU: every implementation side by side, plain causal, segments, packed documents.

    python bench/bench_attention.py                    # everything (about 4 minutes on an H100)
    python bench/bench_attention.py --only a,c          # a subset: a, b, c, d, e, f, check
    python bench/bench_attention.py --samples 5 --quick # fewer samples, smaller correctness grid

Sections:

- ``a``: causal B4 S4096 H16 D128 bf16: cuDNN, the XLA path (``jax.nn.dot_product_attention``
  on XLA), ours on Triton (``pallas``) and on Mosaic GPU (``mosaic``, when
  ``flash_attention`` offers it).
- ``b``: the same shape with segment ids (4 equal documents per row) and varlen
  (``cu_seqlens``: one packed row of 4 sequences of unequal lengths, the same tokens): ours
  against its own plain causal rate, and cuDNN with the dense mask. Also the documents as rows
  of their own (B16 S1024, each implementation and cuDNN, plain causal): the rate any kernel
  gets at that length; the segment rows' note gives their rate against it. The Mosaic kernels
  run with both forward tiles of their tuning space (128-key blocks, the default, and
  ``mosaic kv64``: 64-key blocks in 3 stages).
- ``c``: packed documents as the example model calls attention, B8 S2048, 12 query heads, 4
  key/value heads, head dim 64, 4 documents of random lengths per row, the segment ids an
  argument of the timed call (so plans, masks and layouts are computed inside it, as in a
  training step): what plain JAX offers (cuDNN's packed layout, the strongest and the anchor;
  cuDNN and XLA with the dense block-diagonal causal mask; plain causal cuDNN over the whole
  row as a yardstick that ignores the documents) against ``flash_attention`` untuned and ours,
  with the Mosaic tiles of its tuning space (each forward tile's forward, each backward tile's
  forward+backward); and ours with the ids a constant of the program (its plans folded while
  compiling), which shows what computing the plans costs a call.
- ``d``: causal B2 S4096 H8 D256 bf16 (head dim 256, where the Mosaic backward walks the
  key/value tiles twice, the dv walk with two stages and the others with one): cuDNN (where it
  takes the shape), the XLA path, ours on Triton and on Mosaic GPU, and Mosaic with one stage
  in every backward kernel.
- ``e``: our Mosaic GPU kernels against our Triton ones (and cuDNN where it takes the call), default
  tiles, at other shapes: model-sized causal and full attention, a sliding window, short rows,
  MQA, an odd length, packed documents at head dims 64 and 256.
- ``f``: the Mosaic forward's schedules (ping-pong between the consumers, the default; plain;
  pipelined, each consumer's softmax beside its own products; pipelined with ping-pong), forward only, with both forward
  tiles, at section a's shape and the example model's causal and packed shapes, cuDNN beside.
- ``g``: the backward without turns, with either kernel's consumers or both taking turns, and
  the backward's other tiles, forward+backward, at section f's shapes.
- ``h``: the 8-bit forward (``mosaic/fp8.py``) at section a's shape, causal and not: on
  operands already in 8 bits (the kernel alone), and from 16-bit inputs (quantized in the
  call), beside the 16-bit forward's schedules, cuDNN in 16 bits and cuDNN's own 8-bit forward;
  each row notes its error against the float32 reference.
- ``i``: what a query tile costs beside its key blocks: the example model's shape with 16, 8, 4,
  2 and 1 equal documents per row (a 128-row tile visits 1, 1.5, 2.5, 4.5 and 8.5 key blocks
  on average) and with 4 random ones, ids an argument: the Mosaic forward (default, not
  persistent, 64-key blocks on the plain schedule) and forward+backward, cuDNN's packed layout
  beside each; then 4 layers in one call, as a model calls them (XLA computes the plans, and
  the packed layout's offsets, once for all the layers that share the ids).
- ``check``: values and gradients of each implementation against a float32 reference (highest
  matmul precision) over a grid of head dims, odd lengths, 1-4 segments and GQA ratios.

Throughput is TFLOP/s of visible work: ``4 * batch * heads * dim * pairs`` for the forward,
``pairs`` = ``S^2 / 2`` per causal sequence (document), and the backward counted as 2.5 times
the forward. Timing: each section is one interleaved round-robin (``bench/_timing.py``) over
all of its variants, rotating three random input sets; medians of ``--samples`` samples of
``--per-sample`` back-to-back calls each, after warm-up. ``fwd+bwd`` is ``value_and_grad`` of
``sum(out * probe)`` for a random ``probe``. A variant that fails prints its reason and the run
goes on. The markdown tables come last. Each section's rows go to
``bench/results/bench_attention.<section>.json`` as soon as the section ends
(``bench/_results.py``); a section e or i limited by ``--match`` goes to
``bench_attention.<section>.<match>.json``, a ``--quick`` check grid to ``bench_attention.check.quick.json``
and a ``--tiny`` run to ``.tiny`` files, so a partial run never replaces a whole section's figures.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import functools
import itertools
import re
import time
import traceback
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from _results import write_results
from _timing import time_interleaved

from ejlabel import BwdParams, FwdParams, Invocation
from ejlabel.examples import PLAIN_CUDNN_PACKED_OPS, PLAIN_OPS, random_documents
from ejlabel.kernels import attention as attention_module
from ejlabel.kernels.attention import AttentionConfig, AttentionKernel, flash_attention
from ejlabel.kernels.attention.arg_specs import CAUSAL, HEAD_DIM_256, MODEL_SHAPES, PACKED, ArgSpec

BWD_FLOP_FACTOR = 2.5
SECTIONS = ("a", "b", "c", "d", "e", "f", "g", "h", "i", "check")


@dataclasses.dataclass
class Row:
    section: str
    case: str
    impl: str
    pass_: str  # "fwd" or "fwd+bwd"
    ms: float | None = None
    tflops: float | None = None
    ratio: float | None = None  # against the section's anchor (named in `versus`)
    versus: str = ""
    note: str = ""


@dataclasses.dataclass
class Variant:
    """One timed function: ``fn(*inputs)`` over rotating input sets, and its visible FLOPs."""

    case: str
    impl: str
    pass_: str
    fn: Callable[..., Any]
    sets: Sequence[tuple[Any, ...]]
    flops: float


def extra_impls() -> list[str]:
    """Implementations beyond the Triton one that ``flash_attention`` offers here (``mosaic``)."""
    found = []
    for impl in ("mosaic",):
        if impl in getattr(attention_module, "_IMPLS", ()):
            try:
                AttentionConfig(impl)
                found.append(impl)
            except Exception:  # an implementation that cannot even be configured is not offered
                pass
    return found


def normal(key: jax.Array, shape: tuple[int, ...], dtype: Any = jnp.bfloat16) -> jax.Array:
    return jax.random.normal(key, shape, jnp.float32).astype(dtype)


def input_sets(batch: int, seq: int, heads: int, kv_heads: int, dim: int, count: int = 3) -> list[tuple[jax.Array, ...]]:
    """``count`` sets of (q, k, v, probe): rotating them keeps a call's inputs out of L2."""
    sets = []
    for seed in range(count):
        kq, kk, kv, kp = jax.random.split(jax.random.key(seed), 4)
        q_shape, kv_shape = (batch, seq, heads, dim), (batch, seq, kv_heads, dim)
        sets.append((normal(kq, q_shape), normal(kk, kv_shape), normal(kv, kv_shape), normal(kp, q_shape)))
    return sets


def equal_documents(batch: int, seq: int, documents: int) -> jax.Array:
    return jnp.broadcast_to(1 + jnp.arange(seq) * documents // seq, (batch, seq)).astype(jnp.int32)


def document_sets(batch: int, seq: int, heads: int, kv_heads: int, dim: int, documents: int) -> tuple[list[tuple[Any, ...]], list[float]]:
    """:func:`input_sets` with each set's own segment ids appended, ``documents`` documents of
    random lengths per row (None with 0 documents), and each set's visible (query, key) pairs
    of a causal call, per head."""
    keys = jax.random.split(jax.random.key(2026), 3)
    sets = [(*one, random_documents(key, batch, seq, documents) if documents else None) for one, key in zip(input_sets(batch, seq, heads, kv_heads, dim), keys)]
    if not documents:
        return sets, [batch * seq * seq / 2] * len(sets)
    return sets, [float(jnp.sum(jnp.sum(ids[:, :, None] == jnp.arange(1, documents + 1), axis=1) ** 2 / 2)) for *_, ids in sets]


def dense_mask(segment_ids: jax.Array, causal: bool) -> jax.Array:
    """``[batch, 1, seq, seq]`` bool: the block-diagonal (and causal) mask a JAX user builds."""
    mask = (segment_ids[:, :, None] == segment_ids[:, None, :]) & (segment_ids[:, :, None] > 0)
    if causal:
        seq = segment_ids.shape[1]
        mask = mask & (jnp.arange(seq)[None, :, None] >= jnp.arange(seq)[None, None, :])
    return mask[:, None]


def both_passes(attend: Callable[..., jax.Array]) -> tuple[Callable[..., Any], Callable[..., Any]]:
    """Jitted forward ``(q, k, v, probe, *rest) -> out`` and forward+backward (value and q/k/v
    grads) of ``attend(q, k, v, *rest)``: ``rest`` (segment ids, say) are arguments of the timed
    call, not constants folded into it."""
    forward = jax.jit(lambda q, k, v, probe, *rest: attend(q, k, v, *rest))

    def loss(q: jax.Array, k: jax.Array, v: jax.Array, probe: jax.Array, *rest: Any) -> jax.Array:
        return jnp.sum(attend(q, k, v, *rest).astype(jnp.float32) * probe.astype(jnp.float32))

    return forward, jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2)))


@contextlib.contextmanager
def kernel_variant(module: Any, name: str, value: Any) -> Iterator[None]:
    """Kernels traced inside the block see ``module.name`` set to ``value`` (a probe's variant).
    jax's caches are cleared on the way in and out: the kernels run under ``jax.jit``, whose
    cache would otherwise hand back a trace made without the change (or with it, after). What
    the variant needs is to be compiled inside the block."""
    keep = getattr(module, name)
    setattr(module, name, value)
    jax.clear_caches()
    try:
        yield
    finally:
        setattr(module, name, keep)
        jax.clear_caches()


def kernel_attend(cfg: AttentionConfig | None, **kwargs: Any) -> Callable[..., jax.Array]:
    return lambda q, k, v: flash_attention(q, k, v, cfg=cfg, **kwargs)


def ids_attend(cfg: AttentionConfig | None, documents: int) -> Callable[..., jax.Array]:
    return lambda q, k, v, ids: flash_attention(q, k, v, cfg=cfg, causal=True, segment_ids=ids, max_documents=documents)


def variants_of(case: str, impl: str, attend: Callable[..., jax.Array], sets: Sequence[tuple[Any, ...]], flops: float) -> list[Variant]:
    forward, both = both_passes(attend)
    return [Variant(case, impl, "fwd", forward, sets, flops), Variant(case, impl, "fwd+bwd", both, sets, flops * (1 + BWD_FLOP_FACTOR))]


def run_section(section: str, variants: list[Variant], samples: int, per_sample: int) -> list[Row]:
    """Compile each variant on every input set (dropping those that fail, with their reason; a
    set whose tree differs, a closure say, is a jit cache entry of its own), then time the rest
    interleaved."""
    rows: dict[int, Row] = {}
    steps: dict[str, Callable[[], Any]] = {}
    for index, variant in enumerate(variants):
        row = Row(section, variant.case, variant.impl, variant.pass_)
        rows[index] = row
        try:
            start = time.perf_counter()
            for one in variant.sets:
                jax.block_until_ready(variant.fn(*one))
            print(f"[{section}] compiled {variant.case} | {variant.impl} | {variant.pass_} in {time.perf_counter() - start:.1f} s", flush=True)
        except Exception as err:
            row.note = f"FAILED: {reason(err)}"
            print(f"[{section}] {variant.case} | {variant.impl} | {variant.pass_}: {row.note}", flush=True)
            continue
        cycle = itertools.cycle(variant.sets)
        steps[str(index)] = lambda fn=variant.fn, cycle=cycle: fn(*next(cycle))
    if steps:
        medians = time_interleaved(steps, samples=samples, per_sample=per_sample)
        for key, ms in medians.items():
            row, variant = rows[int(key)], variants[int(key)]
            row.ms, row.tflops = ms, variant.flops / (ms * 1e-3) / 1e12
    return list(rows.values())


def set_ratios(rows: list[Row], anchor: Callable[[Row], Row | None], versus: str) -> None:
    for row in rows:
        base = anchor(row)
        if base is not None and row.tflops and base.tflops:
            row.ratio, row.versus = row.tflops / base.tflops, versus


def find(rows: list[Row], case: str, impl: str, pass_: str) -> Row | None:
    return next((r for r in rows if r.case == case and r.impl == impl and r.pass_ == pass_), None)


def reason(err: BaseException) -> str:
    text = f"{type(err).__name__}: {err}".strip().splitlines()
    return (text[0] if text else type(err).__name__)[:200]


# --------------------------------------------------------------------------------------------
# Sections


def plain_causal(
    section: str, args: argparse.Namespace, b: int, s: int, h: int, d: int, others: dict[str, AttentionConfig] | None = None,
) -> list[Row]:
    """Causal attention at one shape: cuDNN, the XLA path and ours (and ``others``, named
    configs), each against cuDNN."""
    sets = input_sets(b, s, h, h, d)
    flops = 4.0 * b * h * d * s * s / 2
    case = f"causal B{b} S{s} H{h} D{d}"
    configs = {impl: AttentionConfig(impl) for impl in ["cudnn", "xla", "pallas", *extra_impls()]} | (others or {})
    variants = []
    for impl, cfg in configs.items():
        variants += variants_of(case, impl, kernel_attend(cfg, causal=True), sets, flops)
    rows = run_section(section, variants, args.samples, args.per_sample)
    set_ratios(rows, lambda r: find(rows, case, "cudnn", r.pass_), "cuDNN")
    return rows


def dims(spec: ArgSpec) -> tuple[int, int, int, int, int, int]:
    """``(batch, seq, heads, kv heads, dim, documents)`` of a named call (:mod:`.arg_specs`)."""
    return spec.batch, spec.seq, spec.heads, spec.kv_heads, spec.dim, spec.documents


def section_a(args: argparse.Namespace) -> list[Row]:
    b, s, h, _, d, _ = (1, 256, 2, 2, 64, 0) if args.tiny else dims(CAUSAL)
    return plain_causal("a", args, b, s, h, d)


def section_b(args: argparse.Namespace) -> list[Row]:
    b, s, h, _, d, _ = (4, 256, 2, 2, 64, 0) if args.tiny else dims(CAUSAL)
    sets = input_sets(b, s, h, h, d)
    causal_flops = 4.0 * b * h * d * s * s / 2
    segments = equal_documents(b, s, 4)
    lengths = [s // 2, s + s // 2, s // 4, s + s // 4]  # one row of the same 4 * S tokens
    cu_seqlens = jnp.cumsum(jnp.array([0, *lengths], jnp.int32))
    packed_sets = [tuple(t.reshape(1, b * s, *t.shape[2:]) for t in one) for one in sets]
    varlen_flops = sum(4.0 * h * d * n * n / 2 for n in lengths)
    # The 4 documents of each row as rows of their own: the plain causal rate at the documents' length.
    doc_sets = [tuple(t.reshape(b * 4, s // 4, *t.shape[2:]) for t in one) for one in sets]
    plain, seg, var = f"causal B{b} S{s} H{h} D{d}", "causal segments x4", f"causal varlen B1 S{b * s}"
    short = f"causal B{b * 4} S{s // 4} H{h} D{d} (the documents as rows)"
    variants = []
    impls = {impl: AttentionConfig(impl) for impl in ["pallas", *extra_impls()]}
    if "mosaic" in impls:  # the other forward tiles of its tuning space: 64-key blocks, 3 stages
        impls["mosaic kv64"] = AttentionConfig("mosaic", FwdParams(kv_blocksize=64, num_stages=3))
    for impl, cfg in impls.items():
        variants += variants_of(plain, impl, kernel_attend(cfg, causal=True), sets, causal_flops)
        variants += variants_of(seg, impl, kernel_attend(cfg, causal=True, segment_ids=segments), sets, causal_flops / 4)
        variants += variants_of(short, impl, kernel_attend(cfg, causal=True), doc_sets, causal_flops / 4)
        variants += variants_of(var, impl, kernel_attend(cfg, causal=True, cu_seqlens=cu_seqlens), packed_sets, varlen_flops)
    # What the untuned flash_attention runs with segment ids on a GPU: cuDNN with the dense mask.
    variants += variants_of(seg, "cudnn (dense mask)", kernel_attend(AttentionConfig("cudnn"), causal=True, segment_ids=segments), sets, causal_flops / 4)
    variants += variants_of(plain, "cudnn", kernel_attend(AttentionConfig("cudnn"), causal=True), sets, causal_flops)
    variants += variants_of(short, "cudnn", kernel_attend(AttentionConfig("cudnn"), causal=True), doc_sets, causal_flops / 4)
    rows = run_section("b", variants, args.samples, args.per_sample)
    own = lambda impl: "cudnn" if impl.startswith("cudnn") else impl  # cuDNN's mask against cuDNN causal
    # Each implementation against its own plain causal rate.
    set_ratios(rows, lambda r: find(rows, plain, own(r.impl), r.pass_), "own plain causal")
    # Beside it, the segments against the same implementation's causal rate at the documents'
    # length: what packing costs over running each document alone.
    for row in rows:
        alone = find(rows, short, own(row.impl), row.pass_)
        if row.case == seg and alone is not None and row.tflops and alone.tflops:
            row.note = f"{row.tflops / alone.tflops:.2f}x own causal at the documents' length"
    return rows


def section_c(args: argparse.Namespace) -> list[Row]:
    """Packed documents as the example model calls attention: the ids are an argument of the
    timed call (each input set its own 4 documents of random lengths per row), so every plan,
    mask and layout is computed inside it, as in a training step."""
    b, s, h, kv, d, documents = (1, 256, 3, 1, 64, 4) if args.tiny else dims(PACKED)
    sets, pairs = document_sets(b, s, h, kv, d, documents)
    flops = 4.0 * h * d * sum(pairs) / len(pairs)  # visible work, averaged over the input sets
    case = f"packed B{b} S{s} H{h}/{kv} D{d} x{documents} random docs"
    plain = lambda ops: lambda q, k, v, ids: ops.attention(q, k, v, ids, documents)  # noqa: E731
    variants = variants_of(case, "cudnn, dense causal mask", plain(PLAIN_OPS), sets, flops)
    variants += variants_of(case, "cudnn packed layout", plain(PLAIN_CUDNN_PACKED_OPS), sets, flops)
    dense = lambda q, k, v, ids: jax.nn.dot_product_attention(q, k, v, mask=dense_mask(ids, causal=True), implementation="xla")  # noqa: E731
    variants += variants_of(case, "xla, dense causal mask", dense, sets, flops)
    row_attend = lambda q, k, v, ids: jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation="cudnn")  # noqa: E731
    variants += variants_of(case, "cudnn causal over the row (ignores documents)", row_attend, sets, flops)
    variants += variants_of(case, "flash_attention untuned", ids_attend(None, documents), sets, flops)
    for impl in ["pallas", *extra_impls()]:
        variants += variants_of(case, impl, ids_attend(AttentionConfig(impl), documents), sets, flops)
    # The Mosaic configs tuning may pick here: their forward tiles (the forward of each distinct
    # one) and backward tiles (forward+backward with the default forward), beside the defaults.
    kwargs = {"causal": True, "segment_ids": sets[0][4], "max_documents": documents}
    space = [cfg for cfg in AttentionKernel().config_space(Invocation(AttentionKernel(), sets[0][:3], kwargs)) if cfg.impl == "mosaic"]
    for fwd, schedule in dict.fromkeys((cfg.fwd, cfg.fwd_schedule) for cfg in space):
        cfg = AttentionConfig("mosaic", fwd, fwd_schedule=schedule)
        name = f"mosaic fwd kv{fwd.kv_blocksize} stages {fwd.num_stages} {schedule}"
        variants += variants_of(case, name, ids_attend(cfg, documents), sets, flops)[:1]
    for bwd in dict.fromkeys(cfg.bwd for cfg in space):
        cfg = AttentionConfig("mosaic", bwd=bwd)
        name = f"mosaic bwd q{bwd.q_blocksize} kv{bwd.kv_blocksize} stages {bwd.num_stages}"
        variants += variants_of(case, name, ids_attend(cfg, documents), sets, flops)[1:]
    for impl in extra_impls():  # the plans' share: the first set's ids as a constant, its plans folded
        folded = kernel_attend(AttentionConfig(impl), causal=True, segment_ids=sets[0][4], max_documents=documents)
        variants += variants_of(case, f"{impl}, plans folded (constant ids)", folded, [sets[0][:4]], 4.0 * h * d * pairs[0])
    rows = run_section("c", variants, args.samples, args.per_sample)
    set_ratios(rows, lambda r: find(rows, case, "cudnn packed layout", r.pass_), "cuDNN packed layout")
    for row in rows:
        dense_row = find(rows, case, "cudnn, dense causal mask", row.pass_)
        if row.tflops and dense_row is not None and dense_row.tflops:
            row.note = f"{row.tflops / dense_row.tflops:.2f}x cuDNN dense mask. {row.note}".strip()
    return rows


def section_d(args: argparse.Namespace) -> list[Row]:
    # Beside the defaults, the pipelined forward (the tuning space's other schedule at this head
    # dim) and the backward's ring at one stage in all its kernels, as before the dv walk took two.
    pipelined, one_stage = AttentionConfig("mosaic", fwd_schedule="pipelined"), AttentionConfig("mosaic", bwd=BwdParams(num_stages=1))
    others = {"mosaic pipelined fwd": pipelined, "mosaic 1-stage bwd": one_stage} if "mosaic" in extra_impls() else {}
    b, s, h, _, d, _ = (1, 256, 2, 2, 256, 0) if args.tiny else dims(HEAD_DIM_256)
    return plain_causal("d", args, b, s, h, d, others)


def section_e(args: argparse.Namespace) -> list[Row]:
    """Mosaic against Triton (and cuDNN where it takes the call) at the calls of other models
    (:data:`.arg_specs.MODEL_SHAPES`), default tiles: where the Triton implementation still wins
    on Hopper, if anywhere. (At GQA 16:1 the Triton backward compiled for 267 s on the H100: the
    grouped call is 4:1.)"""
    variants = []
    for spec in MODEL_SHAPES:
        name = spec.name
        if args.match not in name:
            continue
        b, s, h, kv, d, documents = (1, 128, 2, 1, min(spec.dim, 64), spec.documents) if args.tiny else dims(spec)
        mask: dict[str, Any] = {"causal": spec.causal}
        if spec.window is not None:
            mask["sliding_window"] = spec.window
        if documents:
            mask["segment_ids"] = equal_documents(b, s, documents)
        left = (mask.get("sliding_window") or (None,))[0]
        pairs = (s if documents == 0 else s // documents) ** 2 / (2 if mask["causal"] else 1) * max(documents, 1)
        if left is not None:  # each query sees at most left + 1 keys
            pairs = sum(min(i, left) + 1 for i in range(s))
        case = f"{name} B{b} S{s} H{h}/{kv} D{d}"
        sets = input_sets(b, s, h, kv, d)
        for impl in ["pallas", *extra_impls(), "cudnn"]:
            variants += variants_of(case, impl, kernel_attend(AttentionConfig(impl), **mask), sets, 4.0 * b * h * d * pairs)
    rows = run_section("e", variants, args.samples, args.per_sample)
    set_ratios(rows, lambda r: find(rows, r.case, "pallas", r.pass_), "Triton")
    return rows


def schedule_shapes(tiny: bool) -> dict[str, tuple[int, int, int, int, int, int]]:
    """Sections f and g's shapes, ``(batch, seq, heads, kv heads, dim, documents)``: section a's,
    the example model's causal one and its packed one (4 random documents per row)."""
    model = MODEL_SHAPES[0]
    shapes = {
        f"causal B{CAUSAL.batch} S{CAUSAL.seq} H{CAUSAL.heads} D{CAUSAL.dim}": dims(CAUSAL),
        f"causal B{model.batch} S{model.seq} H{model.heads}/{model.kv_heads} D{model.dim}": dims(model),
        f"packed B{PACKED.batch} S{PACKED.seq} H{PACKED.heads}/{PACKED.kv_heads} D{PACKED.dim} x{PACKED.documents} random docs": dims(PACKED),
    }
    return {name: (1, 256, 2, 1, 64, docs) for name, (*_, docs) in shapes.items()} if tiny else shapes


def baseline(documents: int) -> Callable[..., jax.Array]:
    """Sections f and g's baseline, ``(q, k, v, ids) -> out``: cuDNN causal, or with documents
    cuDNN's packed layout (``documents`` per row) as the plain packed model calls it."""
    if documents:
        return lambda q, k, v, ids: PLAIN_CUDNN_PACKED_OPS.attention(q, k, v, ids, documents)
    return lambda q, k, v, ids: jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation="cudnn")


def section_f(args: argparse.Namespace) -> list[Row]:
    """The Mosaic forward's schedules side by side (forward only, 128- and 64-key blocks):
    ping-pong between the consumers (the default), the plain one, the pipelined one (each
    consumer's softmax beside its own products), and both together, at section a's shape, the example model's
    causal shape and its packed one (ids an argument, as in section c); cuDNN beside each."""
    if "mosaic" not in extra_impls():
        return [Row("f", "-", "mosaic", "fwd", note="FAILED: no Mosaic GPU kernels here")]
    from ejlabel.kernels.attention import mosaic as mosaic_module

    schedules = {
        "ping-pong": {"pingpong": True},
        "plain": {"pingpong": False},
        "pipelined": {"pingpong": False, "pipelined": True},
        "pipelined ping-pong": {"pingpong": True, "pipelined": True},
    }
    rows = []
    # One interleaved run per shape: beside a heavier shape's calls, the packed calls ran up to
    # 1.2x slower (cuDNN's up to 2x) than in a run of their own.
    for case, (b, s, h, kv, d, documents) in schedule_shapes(args.tiny).items():
        variants = []
        sets, pairs = document_sets(b, s, h, kv, d, documents)
        flops = 4.0 * h * d * sum(pairs) / len(pairs)
        for tiles, params in (("", FwdParams()), (", kv64", FwdParams(kv_blocksize=64, num_stages=3))):
            for name, schedule in schedules.items():
                attend = functools.partial(mosaic_module.mosaic_forward, scale=d**-0.5, bounds=(None, 0), params=params, **schedule)
                variants += variants_of(case, f"mosaic {name}{tiles}", lambda q, k, v, ids, attend=attend: attend(q, k, v, ids)[0], sets, flops)[:1]
        variants += variants_of(case, "cudnn" + (" packed layout" if documents else ""), baseline(documents), sets, flops)[:1]
        rows += run_section("f", variants, args.samples, args.per_sample)
    set_ratios(rows, lambda r: find(rows, r.case, "mosaic ping-pong", r.pass_), "Mosaic ping-pong")
    return rows


# Section g's backward variants: (name, backward tiles, the kernels' schedule options). All but
# the ping-pong ones without turns, whatever the head dim's default.
_NO_TURNS = {"pingpong_dq": False, "pingpong_dkv": False}
BACKWARD_VARIANTS = (
    ("dq as is", BwdParams(), _NO_TURNS),
    ("dq ping-pong", BwdParams(), {**_NO_TURNS, "pingpong_dq": True}),
    ("dk/dv ping-pong", BwdParams(), {**_NO_TURNS, "pingpong_dkv": True}),
    ("both ping-pong", BwdParams(), {"pingpong_dq": True, "pingpong_dkv": True}),
    ("bwd q64 k128", BwdParams(q_blocksize=64, kv_blocksize=128), _NO_TURNS),
    ("bwd q128 k64", BwdParams(q_blocksize=128, kv_blocksize=64), _NO_TURNS),
)


def section_g(args: argparse.Namespace) -> list[Row]:
    """The backward's variants, forward+backward through the experimental entry point (ping-pong
    forward): default tiles without turns, with the consumers of either kernel or both taking turns
    (``pingpong_dq``, ``pingpong_dkv``), and the other backward tiles of the tuning space (128-key blocks in
    the dq kernel, 128-query blocks in the dk/dv kernel), at section f's shapes, each one
    interleaved run of its own with cuDNN (its packed layout for documents) beside it."""
    if "mosaic" not in extra_impls():
        return [Row("g", "-", "mosaic", "fwd+bwd", note="FAILED: no Mosaic GPU kernels here")]
    from ejlabel.kernels.attention.mosaic.experimental import mosaic_attention

    rows = []
    for case, (b, s, h, kv, d, documents) in schedule_shapes(args.tiny).items():
        sets, pairs = document_sets(b, s, h, kv, d, documents)
        flops = 4.0 * h * d * sum(pairs) / len(pairs)
        variants = []
        for name, bwd, dq_schedule in BACKWARD_VARIANTS:
            attend = functools.partial(mosaic_attention, causal=True, params=(FwdParams(), bwd), **dq_schedule)
            both = lambda q, k, v, ids, attend=attend: attend(q, k, v, segment_ids=ids)  # noqa: E731
            variants += variants_of(case, f"mosaic {name}", both, sets, flops)[1:]
        variants += variants_of(case, "cudnn" + (" packed layout" if documents else ""), baseline(documents), sets, flops)[1:]
        rows += run_section("g", variants, args.samples, args.per_sample)
    set_ratios(rows, lambda r: find(rows, r.case, "mosaic dq as is", r.pass_), "Mosaic dq as is")
    return rows


def cudnn_fp8(causal: bool) -> Callable[..., jax.Array]:
    """cuDNN's 8-bit forward, ``(q8, k8, v8, factors) -> out`` (its output in 8 bits too), the
    factors those of :func:`fp8.quantize`: reached through JAX's cuDNN module, as its packed
    layout is."""
    from jax._src.cudnn import fused_attention_stablehlo as cudnn

    def attend(q8: jax.Array, k8: jax.Array, v8: jax.Array, factors: jax.Array) -> jax.Array:
        one = jnp.ones((1, 1, 1, 1), jnp.float32)
        descale_q, descale_k, descale_v = (factors[i].reshape(1, 1, 1, 1) for i in range(3))
        params = {key: one for key in cudnn.fp8_params_keys} | {"descale_q": descale_q, "descale_k": descale_k, "descale_v": descale_v}
        # The output in e4m3 at v's scale: out / descale_v is within v8's range.
        params |= {"scale_o": 1.0 / descale_v, "descale_o": descale_v}
        mask = cudnn.MaskType.CAUSAL if causal else cudnn.MaskType.NO_MASK
        out, _, _ = cudnn.dot_product_attention(
            q8, k8, v8, fp8_params=params, scale=q8.shape[-1] ** -0.5, mask_type=mask, use_fp8=True,
        )
        return out.astype(jnp.float32) * descale_v.reshape(())

    return attend


def section_h(args: argparse.Namespace) -> list[Row]:
    """The 8-bit forward against the 16-bit one and cuDNN's, forward only, each shape one
    interleaved run; every row notes its relative L2 error against the float32 reference on
    the first input set."""
    if "mosaic" not in extra_impls():
        return [Row("h", "-", "mosaic", "fwd", note="FAILED: no Mosaic GPU kernels here")]
    from ejlabel.kernels.attention import mosaic as mosaic_module
    from ejlabel.kernels.attention.mosaic import fp8

    b, s, h, _, d, _ = (1, 256, 2, 2, 128, 0) if args.tiny else dims(CAUSAL)
    rows = []
    for causal in (True, False):
        case = f"{'causal' if causal else 'full'} B{b} S{s} H{h} D{d}"
        sets = input_sets(b, s, h, h, d)
        flops = 4.0 * b * h * d * s * s / (2 if causal else 1)
        bounds = (None, 0) if causal else (None, None)

        sets8_t = [jax.jit(fp8.quantize_operands)(*one[:3]) for one in sets]
        sets8 = [(q8, k8, jnp.transpose(v_t, (0, 3, 1, 2)), f) for q8, k8, v_t, f in sets8_t]  # cuDNN's values untransposed
        sixteen = {
            "mosaic ping-pong": {"pingpong": True},
            "mosaic pipelined": {"pingpong": False, "pipelined": True},
        }
        variants = []
        for name, schedule in sixteen.items():
            attend = functools.partial(mosaic_module.mosaic_forward, scale=d**-0.5, bounds=bounds, params=FwdParams(), **schedule)
            variants.append(Variant(case, name, "fwd", jax.jit(lambda q, k, v, probe, attend=attend: attend(q, k, v, None)[0]), sets, flops))
        for name, pingpong in (("fp8 ping-pong, 8-bit operands", True), ("fp8 plain, 8-bit operands", False)):
            attend8 = functools.partial(fp8.mosaic_forward_fp8, scale=d**-0.5, bounds=bounds, pingpong=pingpong)
            variants.append(Variant(case, name, "fwd", jax.jit(lambda q8, k8, v_t, f, attend8=attend8: attend8(q8, k8, v_t, f)[0]), sets8_t, flops))
        from_16 = jax.jit(lambda q, k, v, probe: fp8.fp8_attention(q, k, v, causal=causal))
        variants.append(Variant(case, "fp8 from 16 bits (quantized in the call)", "fwd", from_16, sets, flops))
        variants.append(Variant(case, "cudnn", "fwd", jax.jit(lambda q, k, v, probe: jax.nn.dot_product_attention(q, k, v, is_causal=causal, implementation="cudnn")), sets, flops))
        variants.append(Variant(case, "cudnn fp8, 8-bit operands", "fwd", jax.jit(cudnn_fp8(causal)), sets8, flops))
        section_rows = run_section("h", variants, args.samples, args.per_sample)
        q, k, v, _ = sets[0]
        with jax.default_matmul_precision("highest"):
            want = AttentionKernel().reference(*(x.astype(jnp.float32) for x in (q, k, v)), causal=causal)
        for row, variant in zip(section_rows, variants):
            if row.ms is not None:
                got = variant.fn(*variant.sets[0])
                row.note = f"rel. error {rel(got, want):.2e}"
        set_ratios(section_rows, lambda r: find(section_rows, r.case, "cudnn", r.pass_), "cuDNN")
        rows += section_rows
    return rows


# --------------------------------------------------------------------------------------------
# Correctness


@dataclasses.dataclass
class Check:
    case: str
    impl: str
    out_rel: float | None = None
    out_max: float | None = None
    grad_rel: float | None = None  # the worst of dq, dk, dv
    grad_max: float | None = None
    note: str = ""

    @property
    def ok(self) -> bool:
        # bf16 inputs: relative L2 error well under 2e-2 is the kernel tests' bar.
        return self.out_rel is not None and self.grad_rel is not None and self.out_rel < 2e-2 and self.grad_rel < 2e-2


def section_i(args: argparse.Namespace) -> list[Row]:
    """The fixed cost of a query tile: time against key blocks per tile (see the module
    docstring); each case one interleaved run of its own, as in section f."""
    if "mosaic" not in extra_impls():
        return [Row("i", "-", "mosaic", "fwd", note="FAILED: no Mosaic GPU kernels here")]
    from ejlabel.kernels.attention import mosaic as mosaic_module

    b, s, h, kv, d, _ = (1, 256, 2, 1, 64, 0) if args.tiny else dims(PACKED)
    forwards = {"mosaic": {"params": FwdParams()}, "mosaic not persistent": {"params": FwdParams(), "persistent": False},
                "mosaic kv64 plain": {"params": FwdParams(kv_blocksize=64, num_stages=3), "pingpong": False}}
    rows = []
    # Equal documents of 128 to 2048 tokens (a whole number of 128-row tiles each), then None: 4 random ones.
    for equal in [s // length for length in (128, 256, 512, 1024, 2048) if length <= s] + [None]:
        case = f"{equal} equal documents, {(s // equal // 128 + 1) / 2:g} blocks per tile" if equal else "4 random documents"
        if args.match not in case:
            continue
        if equal:
            documents, sets = equal, [(*one, equal_documents(b, s, equal)) for one in input_sets(b, s, h, kv, d)]
            pairs = b * equal * (s // equal) ** 2 / 2
        else:
            documents, (sets, counts) = 4, document_sets(b, s, h, kv, d, 4)
            pairs = sum(counts) / len(counts)
        flops, variants = 4.0 * h * d * pairs, []
        for name, options in forwards.items():
            attend = functools.partial(mosaic_module.mosaic_forward, scale=d**-0.5, bounds=(None, 0), **options)
            variants += variants_of(case, name, lambda q, k, v, ids, attend=attend: attend(q, k, v, ids)[0], sets, flops)[:1]
        variants += variants_of(case, "mosaic", ids_attend(AttentionConfig("mosaic"), documents), sets, flops)[1:]
        variants += variants_of(case, "cudnn packed layout", baseline(documents), sets, flops)
        rows += run_section("i", variants, args.samples, args.per_sample)
    case = "4 random documents, 4 layers in one call"
    if args.match in case:
        sets, counts = document_sets(b, s, h, kv, d, 4)
        flops, stack = 4 * 4.0 * h * d * sum(counts) / len(counts), lambda attend: functools.partial(stacked, attend, 4)
        variants = variants_of(case, "mosaic", stack(ids_attend(AttentionConfig("mosaic"), 4)), sets, flops)
        variants += variants_of(case, "cudnn packed layout", stack(baseline(4)), sets, flops)
        rows += run_section("i", variants, args.samples, args.per_sample)
    set_ratios(rows, lambda r: find(rows, r.case, "cudnn packed layout", r.pass_), "cuDNN packed layout")
    return rows


def stacked(attend: Callable[..., jax.Array], layers: int, q: jax.Array, k: jax.Array, v: jax.Array, ids: jax.Array) -> jax.Array:
    """``layers`` attention calls in a row, each one's output the next one's queries."""
    return functools.reduce(lambda x, _: attend(x, k, v, ids), range(layers), q)


def grid(quick: bool, tiny: bool = False) -> list[tuple[str, dict[str, Any]]]:
    """(name, shape and mask) cases: head dims 64/128/256, odd lengths, 1-4 segments, GQA 1-8."""
    # Together: every head dim, odd lengths, 1-4 segments and varlen, GQA 1/2/4/8, causal or not;
    # one even length with segments, where cuDNN takes the mask.
    cases = [
        dict(batch=2, seq=777, heads=8, kv_heads=8, dim=64, causal=True, documents=1),
        dict(batch=2, seq=513, heads=8, kv_heads=2, dim=256, causal=False, documents=3),
        dict(batch=1, seq=1031, heads=8, kv_heads=1, dim=128, causal=True, varlen=(100, 451, 452, 980)),
        dict(batch=2, seq=1000, heads=8, kv_heads=4, dim=128, causal=True, documents=2),
        dict(batch=2, seq=2047, heads=8, kv_heads=2, dim=64, causal=True, documents=4),
        dict(batch=2, seq=333, heads=8, kv_heads=4, dim=256, causal=True),
    ]
    if quick:
        cases = cases[:3]
    if tiny:
        cases = [dict(c, batch=1, seq=min(c["seq"], 67), heads=4, kv_heads=max(1, c["kv_heads"] // 4), dim=min(c["dim"], 64)) for c in cases]
    named = []
    for c in cases:
        masks = f"{c['documents']} seg" if "documents" in c else ("varlen" if "varlen" in c else "no seg")
        named.append((f"B{c['batch']} S{c['seq']} H{c['heads']}/{c['kv_heads']} D{c['dim']} {'causal' if c['causal'] else 'full'} {masks}", c))
    return named


def check_case(name: str, c: dict[str, Any], impls: list[str]) -> list[Check]:
    batch, seq, heads, kv_heads, dim = c["batch"], c["seq"], c["heads"], c["kv_heads"], c["dim"]
    kq, kk, kv, kp = jax.random.split(jax.random.key(seq * 1000 + dim), 4)
    q, k, v = normal(kq, (batch, seq, heads, dim)), normal(kk, (batch, seq, kv_heads, dim)), normal(kv, (batch, seq, kv_heads, dim))
    probe = normal(kp, (batch, seq, heads, dim), jnp.float32)
    kwargs: dict[str, Any] = {"causal": c["causal"]}
    if "documents" in c:
        # Unequal documents, the last 5% of each row padding.
        ids = 1 + (jnp.arange(seq) ** 2 * c["documents"]) // (seq * seq)
        kwargs["segment_ids"] = jnp.broadcast_to(jnp.where(jnp.arange(seq) < seq - seq // 20, ids, 0), (batch, seq)).astype(jnp.int32)
    if "varlen" in c:
        kwargs["cu_seqlens"] = jnp.array((0, *c["varlen"]), jnp.int32)
    kernel = AttentionKernel()

    def grads(attend: Callable[..., jax.Array], q: jax.Array, k: jax.Array, v: jax.Array) -> tuple[Any, Any]:
        """``(out, (dq, dk, dv))`` from one compiled program (compiling is most of a case's time)."""

        def loss(q: jax.Array, k: jax.Array, v: jax.Array) -> tuple[jax.Array, jax.Array]:
            out = attend(q, k, v)
            return jnp.sum(out.astype(jnp.float32) * probe), out

        (_, out), grads = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True))(q, k, v)
        return out, grads

    with jax.default_matmul_precision("highest"):
        upcast = tuple(t.astype(jnp.float32) for t in (q, k, v))
        ref_out, ref_grads = grads(lambda q, k, v: kernel.reference(q, k, v, **kwargs), *upcast)
    checks = []
    for impl in impls:
        check = Check(name, impl)
        checks.append(check)
        if not kernel.candidate_is_valid(Invocation(kernel, (q, k, v), kwargs), AttentionConfig(impl)):
            check.note = "refused by candidate_is_valid"
            if impl != "cudnn" or "segment_ids" not in kwargs or seq % 2 == 0:
                continue
            check.note += "; forced:"  # confirm cuDNN's own refusal of an odd length with a mask
        try:
            out, got = grads(kernel_attend(AttentionConfig(impl), **kwargs), q, k, v)
            check.out_rel, check.out_max = rel(out, ref_out), max_abs(out, ref_out)
            check.grad_rel = max(rel(g, w) for g, w in zip(got, ref_grads))
            check.grad_max = max(max_abs(g, w) for g, w in zip(got, ref_grads))
        except Exception as err:
            check.note = f"{check.note} FAILED: {reason(err)}".strip()
        print(f"[check] {name} | {impl} | {fmt(check.out_rel)} {fmt(check.grad_rel)} {check.note}", flush=True)
    return checks


def rel(x: Any, ref: Any) -> float:
    x64, r64 = np.asarray(x, np.float64), np.asarray(ref, np.float64)
    if not np.all(np.isfinite(x64)):
        return float("nan")
    scale = np.linalg.norm(r64)
    return float(np.linalg.norm(x64 - r64) / (scale if scale > 0 else 1.0))


def max_abs(x: Any, ref: Any) -> float:
    return float(np.max(np.abs(np.asarray(x, np.float64) - np.asarray(ref, np.float64))))


# --------------------------------------------------------------------------------------------
# Output


def fmt(x: float | None, spec: str = ".3g") -> str:
    return "-" if x is None else format(x, spec)


def markdown(rows: list[Row]) -> str:
    lines = ["| section | case | impl | pass | ms | TFLOP/s (visible) | ratio | vs | note |", "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r.section} | {r.case} | {r.impl} | {r.pass_} | {fmt(r.ms, '.3f')} | {fmt(r.tflops, '.4g')} | {fmt(r.ratio, '.2f')} | {r.versus} | {r.note} |")
    return "\n".join(lines)


def markdown_checks(checks: list[Check]) -> str:
    lines = ["| case | impl | out rel | out max abs | grad rel (worst) | grad max abs | ok | note |", "|---|---|---|---|---|---|---|---|"]
    for c in checks:
        ok = "yes" if c.ok else ("-" if c.out_rel is None else "NO")
        lines.append(f"| {c.case} | {c.impl} | {fmt(c.out_rel)} | {fmt(c.out_max)} | {fmt(c.grad_rel)} | {fmt(c.grad_max)} | {ok} | {c.note} |")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--only", default=",".join(SECTIONS), help=f"comma-separated subset of {SECTIONS}")
    parser.add_argument("--samples", type=int, default=10)
    parser.add_argument("--per-sample", type=int, default=3)
    parser.add_argument("--quick", action="store_true", help="the first three correctness cases only")
    parser.add_argument("--tiny", action="store_true", help="small shapes: a smoke run of the script itself (CPU)")
    parser.add_argument("--match", default="", help="sections e and i: only the cases whose name holds this text")
    args = parser.parse_args(argv)
    only = [s.strip() for s in args.only.split(",") if s.strip()]
    unknown = set(only) - set(SECTIONS)
    if unknown or args.samples < 1 or args.per_sample < 1:
        parser.error(f"--only: expected names from {SECTIONS}, got {sorted(unknown)}" if unknown else "--samples, --per-sample: expected positive counts")
    print(f"jax {jax.__version__}, {jax.devices()[0].device_kind}, implementations beyond pallas: {extra_impls() or 'none'}", flush=True)
    rows: list[Row] = []
    checks: list[Check] = []
    start = time.perf_counter()
    sections = {"a": section_a, "b": section_b, "c": section_c, "d": section_d, "e": section_e, "f": section_f, "g": section_g, "h": section_h, "i": section_i}
    for name in only:  # in the order given: a run cut short keeps the sections that came first
        if name == "check":
            impls = ["pallas", *extra_impls(), "cudnn", "xla"]
            for case_name, case in grid(args.quick or args.tiny, args.tiny):
                try:
                    checks += check_case(case_name, case, impls)
                except Exception as err:
                    checks.append(Check(case_name, "-", note=f"FAILED: {reason(err)}"))
                save(args, name, [dataclasses.asdict(c) | {"ok": c.ok} for c in checks])  # a run cut short keeps its cases
        else:
            try:
                rows += sections[name](args)
            except Exception:
                traceback.print_exc()
                rows.append(Row(name, "-", "-", "-", note="FAILED: section raised, see the log"))
            print("\n" + markdown([r for r in rows if r.section == name]) + "\n", flush=True)
            save(args, name, [row_record(r) for r in rows if r.section == name])
        print(f"section {name} done at {time.perf_counter() - start:.0f} s", flush=True)
    if rows:
        print("\n" + markdown(rows))
    if checks:
        print("\n" + markdown_checks(checks))
    return 0


def row_record(row: Row) -> dict[str, Any]:
    """A timed row as data: the dataclass's fields, ``pass_`` spelt ``pass``."""
    return {("pass" if key == "pass_" else key): value for key, value in dataclasses.asdict(row).items()}


def save(args: argparse.Namespace, section: str, rows: list[dict[str, Any]]) -> None:
    """One section's rows to ``bench/results/`` (file names in the module docstring)."""
    name = f"bench_attention.{section}"
    if section in ("e", "i") and args.match:
        name += "." + re.sub(r"[^a-z0-9]+", "_", args.match.lower()).strip("_")
    if args.tiny or (section == "check" and args.quick):
        name += ".tiny" if args.tiny else ".quick"
    if section == "check":
        notes = "relative L2 error (and max abs) of the output and of the worst gradient against a float32 reference; ok: both under 2e-2"
    else:
        notes = (f"medians of {args.samples} interleaved samples of at least {args.per_sample} calls and 10 ms; TFLOP/s of visible work (backward = 2.5x "
                 "the forward); ratio: TFLOP/s over the row named in versus")
    write_results(name, rows, notes=notes)


if __name__ == "__main__":
    raise SystemExit(main())
