"""The Mosaic GPU flash attention (kernels/attention_mosaic.py).

On the CPU: the visiting plans against a dense mask, lowering to the Mosaic GPU module for a
grid of shapes and options (it catches shape, layout and type errors without a GPU), and
values and gradients in the Mosaic GPU interpreter at small sizes. On a Hopper GPU: values and
gradients against a float32 reference over head dims, odd lengths, segments and GQA ratios.
"""

from __future__ import annotations

import functools
import importlib
import re
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from ejlabel.kernels import attention_mosaic as am
from ejlabel.kernels.attention import (
    AttentionConfig,
    AttentionKernel,
    _attention_xla,
    _bounds,
    flash_attention,
)
from kernel_checks import gpu, needs_gpu, rel_error

import ejlabel
from ejlabel import BwdParams, FwdParams, Invocation, analysis, label, label_scope

pytestmark = pytest.mark.skipif(not am.mosaic_available(), reason="this JAX has no Pallas Mosaic GPU backend")


def qkv(batch: int, seq: int, heads: int, kv_heads: int, dim: int, dtype: Any, seed: int = 0) -> tuple[jax.Array, ...]:
    keys = jax.random.split(jax.random.key(seed), 3)
    shapes = ((batch, seq, heads, dim), (batch, seq, kv_heads, dim), (batch, seq, kv_heads, dim))
    return tuple(jax.random.normal(kk, s, jnp.float32).astype(dtype) for kk, s in zip(keys, shapes))


def documents(batch: int, seq: int, count: int, padding: int, seed: int = 0) -> jax.Array:
    """``[batch, seq]`` ids of ``count`` contiguous documents of random lengths, then padding (0)."""
    rng = np.random.default_rng(seed)
    rows = []
    for _ in range(batch):
        cuts = np.sort(rng.choice(np.arange(1, seq - padding), size=count - 1, replace=False)) if count > 1 else np.array([], int)
        ids = np.zeros(seq, np.int32)
        ids[: seq - padding] = 1 + np.searchsorted(cuts, np.arange(seq - padding), side="right")
        rows.append(ids)
    return jnp.asarray(np.stack(rows))


def reference(q: jax.Array, k: jax.Array, v: jax.Array, *, causal: bool, window: Any, segment_ids: Any, scale: float) -> jax.Array:
    f32 = [t.astype(jnp.float32) for t in (q, k, v)]
    return _attention_xla(*f32, segment_ids, scale=scale, bounds=_bounds(causal, window))


# --------------------------------------------------------------------------------------------
# Visiting plans


def dense_visibility(seq_q: int, seq_kv: int, causal: bool, window: Any, segment_ids: jax.Array | None, kv_len: int | None) -> np.ndarray:
    left, right = _bounds(causal, window)
    i, j = np.arange(seq_q)[:, None], np.arange(seq_kv)[None, :]
    visible = np.ones((seq_q, seq_kv), bool)
    if right is not None:
        visible &= j <= i + right
    if left is not None:
        visible &= j >= i - left
    if kv_len is not None:
        visible &= j < kv_len
    visible = np.broadcast_to(visible, (1 if segment_ids is None else segment_ids.shape[0], seq_q, seq_kv)).copy()
    if segment_ids is not None:
        ids = np.asarray(segment_ids)
        visible &= (ids[:, :seq_q, None] == ids[:, None, :seq_kv]) & (ids[:, :seq_q, None] > 0)
    return visible


@pytest.mark.parametrize("transpose", [False, True])
@pytest.mark.parametrize(
    "options",
    [
        {"causal": True},
        {"causal": False, "window": (100, 30)},
        {"causal": True, "segments": 3},
        {"causal": False, "segments": 4},
        {"causal": True, "kv_len": 300},
        {"causal": False, "unsorted": True},
    ],
)
def test_plan_covers_every_visible_pair_and_skips_masks_only_on_whole_blocks(options: dict[str, Any], transpose: bool) -> None:
    seq, block_r, block_c = 384, 128, 64
    ids = None
    if "segments" in options:
        ids = documents(2, seq, options["segments"], padding=40, seed=3)
    if options.get("unsorted"):
        ids = jnp.asarray(np.random.default_rng(0).integers(0, 3, (2, seq)), jnp.int32)
    bounds = _bounds(options["causal"], options.get("window"))
    shape = am._Shape(1.0, bounds, options.get("kv_len"), 1, ids is not None)
    batch = 2
    plan = np.asarray(am._visit_plan(seq, seq, block_r, block_c, shape, ids, batch, transpose=transpose))
    visible = dense_visibility(seq, seq, options["causal"], options.get("window"), ids, options.get("kv_len"))
    by_position = dense_visibility(seq, seq, options["causal"], options.get("window"), None, options.get("kv_len"))
    visible, by_position = (np.broadcast_to(x, (batch, seq, seq)) for x in (visible, by_position))
    if transpose:  # rows are keys
        visible, by_position = visible.transpose(0, 2, 1), by_position.transpose(0, 2, 1)
    lo, hi, a, c, u_lo, u_hi = plan
    assert np.all((lo <= u_lo) & (u_lo <= a) & (a <= c) & (c <= u_hi) & (u_hi <= hi))
    if ids is None:  # no block needs a segment mask
        np.testing.assert_array_equal(u_lo, lo)
        np.testing.assert_array_equal(u_hi, hi)
    for b in range(batch):
        for r in range(seq // block_r):
            rows = visible[b, r * block_r : (r + 1) * block_r]
            per_block = rows.reshape(block_r, seq // block_c, block_c)
            needed = np.flatnonzero(per_block.any(axis=(0, 2)))
            if needed.size:
                assert lo[b, r] <= needed.min() and needed.max() < hi[b, r], (b, r, needed, lo[b, r], hi[b, r])
            assert per_block[:, a[b, r] : c[b, r]].all(), (b, r, a[b, r], c[b, r])
            # Where the plan says no segment mask is needed, the positions' mask is the whole mask.
            columns = slice(u_lo[b, r] * block_c, u_hi[b, r] * block_c)
            np.testing.assert_array_equal(rows[:, columns], by_position[b, r * block_r : (r + 1) * block_r, columns])


def test_plan_skips_blocks_of_other_documents() -> None:
    # Four documents of 256 tokens: a 128-row tile sees only the key blocks of its document.
    ids = jnp.repeat(jnp.arange(1, 5, dtype=jnp.int32), 256)[None]
    shape = am._Shape(1.0, (None, None), None, 1, True)
    lo, hi, a, c, u_lo, u_hi = np.asarray(am._visit_plan(1024, 1024, 128, 128, shape, ids, 1, transpose=False))
    np.testing.assert_array_equal(lo[0], [0, 0, 2, 2, 4, 4, 6, 6])
    np.testing.assert_array_equal(hi[0], [2, 2, 4, 4, 6, 6, 8, 8])
    np.testing.assert_array_equal(a, lo)  # documents align with blocks: no mask at all
    np.testing.assert_array_equal(c, hi)
    np.testing.assert_array_equal(u_lo, lo)
    np.testing.assert_array_equal(u_hi, hi)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(0, 4), min_size=5, max_size=5))
def test_walk_order_visits_each_block_once_by_kind(gaps: list[int]) -> None:
    # lo <= u_lo <= a <= c <= u_hi <= hi from five gaps (any may be 0: empty ranges).
    lo, u_lo, a, c, u_hi, hi = np.cumsum([3, *gaps])
    visit = am._Visit(*(jnp.int32(0),) * 3, *(jnp.int32(x) for x in (lo, hi, a, c, u_lo, u_hi)))
    blocks = [int(visit.block(jnp.int32(s))) for s in range(int(visit.steps))]
    assert sorted(blocks) == list(range(lo, hi))
    kinds = {am._Mask.SEGMENTS: [], am._Mask.POSITIONS: [], am._Mask.NONE: []}
    start = 0
    for kind in kinds:  # the walk's order of kinds
        stop = int(visit.steps_until(kind))
        kinds[kind] = blocks[start:stop]
        start = stop
    assert set(kinds[am._Mask.SEGMENTS]) == set(range(lo, u_lo)) | set(range(u_hi, hi))
    assert set(kinds[am._Mask.POSITIONS]) == set(range(u_lo, a)) | set(range(c, u_hi))
    assert kinds[am._Mask.NONE] == list(range(a, c))


@pytest.mark.parametrize(
    "masks", [(am._Mask.SEGMENTS, am._Mask.POSITIONS), (am._Mask.SEGMENTS,), (am._Mask.POSITIONS,)], ids=["apart", "joined", "positions"]
)
def test_walk_gives_each_block_its_mask(masks: tuple[Any, ...]) -> None:
    lo, u_lo, a, c, u_hi, hi = 1, 3, 4, 6, 8, 9  # segments: 1, 2, 8; positions: 3, 6, 7; none: 4, 5
    visit = am._Visit(*(jnp.int32(0),) * 3, *(jnp.int32(x) for x in (lo, hi, a, c, u_lo, u_hi)))
    codes = {mask: n for n, mask in enumerate(am._Mask)}

    def step(j: jax.Array, t: jax.Array, got: jax.Array, mask: Any) -> jax.Array:
        return got.at[j].set(codes[mask])

    got = np.asarray(am._walk(visit, step, jnp.full(10, -1), masks=masks))
    want = np.full(10, -1)
    want[[4, 5]] = codes[am._Mask.NONE]
    positions = am._Mask.POSITIONS if am._Mask.POSITIONS in masks else am._Mask.SEGMENTS
    want[[3, 6, 7]] = codes[positions]
    want[[1, 2, 8]] = codes[masks[0]]  # an unsegmented walk's plans have none such: u_lo = lo, u_hi = hi
    np.testing.assert_array_equal(got, want)


def test_plan_masks_a_documents_diagonal_by_position_only() -> None:
    # Causal, documents of 256 and 512 tokens, then two that meet inside a block (64 and 192
    # tokens): a tile's diagonal block inside its document needs the causal mask alone; the
    # block holding two documents needs the segment ids' mask, for its own tile and the next.
    ids = jnp.concatenate([jnp.full(256, 1), jnp.full(512, 2), jnp.full(256, 3)]).astype(jnp.int32)
    ids = ids.at[832:].set(4)[None]
    shape = am._Shape(1.0, (None, 0), None, 1, True)
    lo, hi, a, c, u_lo, u_hi = (row[0] for row in np.asarray(am._visit_plan(1024, 1024, 128, 128, shape, ids, 1, transpose=False)))
    np.testing.assert_array_equal(lo, [0, 0, 2, 2, 2, 2, 6, 6])
    np.testing.assert_array_equal(hi, [1, 2, 3, 4, 5, 6, 7, 8])
    np.testing.assert_array_equal(u_hi - u_lo, [1, 2, 1, 2, 3, 4, 0, 1])
    np.testing.assert_array_equal(u_lo[7], 7)
    np.testing.assert_array_equal(c - a, [0, 1, 0, 1, 2, 3, 0, 0])  # the diagonal is masked: by position


# --------------------------------------------------------------------------------------------
# Lowering to the Mosaic GPU module (no GPU needed)


def lower_for_cuda(fn: Any, *args: Any) -> str:
    return jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",)).as_text()


def kernel_hashes(text: str) -> list[str]:
    """The hash of every Mosaic GPU module in a lowered program's text, in order."""
    return re.findall(r'kernel_hash = "((?:[^"\\]|\\.)*)"', text)


@pytest.mark.parametrize(
    ("dim", "kv_heads", "options", "params"),
    [
        (64, 4, {"causal": True}, FwdParams(kv_blocksize=128, num_stages=3)),
        (128, 2, {"causal": True, "pingpong": True}, FwdParams()),
        (128, 2, {"causal": True, "segments": True}, FwdParams()),
        (256, 1, {"causal": False}, FwdParams()),
        (96, 4, {"window": (64, 16)}, FwdParams(kv_blocksize=64)),
    ],
)
def test_forward_lowers_to_mosaic_gpu(dim: int, kv_heads: int, options: dict[str, Any], params: FwdParams) -> None:
    q = jax.ShapeDtypeStruct((2, 300, 4, dim), jnp.bfloat16)
    k = jax.ShapeDtypeStruct((2, 300, kv_heads, dim), jnp.bfloat16)
    seg = jax.ShapeDtypeStruct((2, 300), jnp.int32) if options.get("segments") else None
    bounds = _bounds(options.get("causal", False), options.get("window"))

    def fwd(q: jax.Array, k: jax.Array, v: jax.Array, seg: jax.Array | None) -> tuple[jax.Array, jax.Array]:
        return am.mosaic_forward(q, k, v, seg, scale=0.1, bounds=bounds, params=params, pingpong=options.get("pingpong", False))

    text = lower_for_cuda(fwd, q, k, k, seg)
    assert "mosaic_gpu" in text


@pytest.mark.parametrize("fused", [False, True])
@pytest.mark.parametrize(("dim", "kv_heads", "segments"), [(64, 2, True), (128, 4, False)])
def test_backward_lowers_to_mosaic_gpu(dim: int, kv_heads: int, segments: bool, fused: bool) -> None:
    q = jax.ShapeDtypeStruct((1, 200, 4, dim), jnp.float16)
    k = jax.ShapeDtypeStruct((1, 200, kv_heads, dim), jnp.float16)
    seg = jax.ShapeDtypeStruct((1, 200), jnp.int32) if segments else None

    def loss(q: jax.Array, k: jax.Array, v: jax.Array, seg: jax.Array | None) -> jax.Array:
        return am.mosaic_attention(q, k, v, causal=True, segment_ids=seg, fused_backward=fused).astype(jnp.float32).sum()

    text = lower_for_cuda(jax.grad(loss, argnums=(0, 1, 2)), q, k, k, seg)
    # Forward, then dq and dk/dv kernels, or one fused kernel adding dq up with TMA reduce-adds.
    assert text.count("@mosaic_gpu") == (2 if fused else 3)
    assert ("cp.reduce.async.bulk" in text) == fused
    # delta = sum_d out * dO: in the dq kernel where its tiles fit twice with the output's
    # (head dim 64), else one contraction before the kernels.
    assert am._dq_tiles(dim, jnp.float16, 128 if dim <= 64 else 64, 2) == ((2, True) if dim <= 64 else (2, False))
    assert ("stablehlo.dot_general" in text) == (fused or dim > 64)


@pytest.mark.parametrize("window", [None, (64, 16)])
def test_positional_plans_and_orders_are_constants(window: tuple[int, int] | None) -> None:
    """Without segment ids the visiting plans and the items' order depend on sizes only: the
    program carries them as constants, with no device work (no sort, no reduction) before the
    kernels; with segment ids both are computed on the device."""
    q = jax.ShapeDtypeStruct((2, 300, 4, 64), jnp.bfloat16)
    seg = jax.ShapeDtypeStruct((2, 300), jnp.int32)

    def loss(q: jax.Array, k: jax.Array, v: jax.Array, seg: jax.Array | None) -> jax.Array:
        return am.mosaic_attention(q, k, v, causal=window is None, window=window, segment_ids=seg).astype(jnp.float32).sum()

    grad = jax.grad(loss, argnums=(0, 1, 2))
    positional, segmented = (lower_for_cuda(grad, q, q, q, s) for s in (None, seg))
    assert positional.count("@mosaic_gpu") == segmented.count("@mosaic_gpu") == 3
    assert "stablehlo.sort" not in positional and "stablehlo.reduce" not in positional
    assert "stablehlo.sort" in segmented and "stablehlo.reduce" in segmented
    # Past the cap on constants (3 tiles x 4 heads per batch row: one row more than fits), the
    # order is sorted on the device instead.
    many = jax.ShapeDtypeStruct((am._MAX_CONSTANT // 12 + 1, 300, 4, 64), jnp.bfloat16)
    assert "stablehlo.sort" in lower_for_cuda(grad, many, many, many, None)


def test_call_sites_share_one_module_per_kernel() -> None:
    """Two layers' attention, differentiated, from different source lines: six kernel launches
    but three kernels (forward, dq, dk/dv). Calls under one label share one traced and lowered
    function per kernel, so the program holds each module once; calls under two labels are
    traced apart, and their modules must still be equal, so the backend compiles each once. The
    modules' hashes cover their locations (a kernel traced with its caller's stack differs per
    site) and, with jaxlib 0.11, a per-launch counter unless it is removed
    (kernels/_mosaic_modules.py)."""
    q = jax.ShapeDtypeStruct((1, 256, 2, 64), jnp.bfloat16)

    def loss(x: jax.Array, *, second_label: str) -> jax.Array:
        x = am.mosaic_attention(x, x, x, causal=True)
        x = 2 * x
        with label_scope(second_label):
            x = am.mosaic_attention(x, x, x, causal=True)
        return x.astype(jnp.float32).sum()

    def hashes_with(second_label: str) -> list[str]:
        return kernel_hashes(lower_for_cuda(jax.grad(functools.partial(loss, second_label=second_label)), q))

    with label_scope(label("attention_a@v1", "0" * 16)):
        shared = hashes_with(label("attention_a@v1", "0" * 16))
        apart = hashes_with(label("attention_b@v1", "1" * 16))
    assert len(shared) == 3 and len(set(shared)) == 3
    assert len(apart) == 6 and set(apart) == set(shared)


def test_audit_finds_every_call_of_a_shared_kernel(monkeypatch: pytest.MonkeyPatch) -> None:
    """Three layers' attention lower to one function per kernel that each layer calls, and the
    audit of that program still finds three forward and three backward call sites."""
    monkeypatch.setattr(importlib.import_module("ejlabel.kernels.attention"), "on_hopper", lambda: True)
    q = jax.ShapeDtypeStruct((1, 256, 2, 64), jnp.bfloat16)

    def loss(x: jax.Array) -> jax.Array:
        for _ in range(3):
            x = 2 * flash_attention(x, x, x, causal=True)
        return x.astype(jnp.float32).sum()

    with ejlabel.use_implementation("mosaic"):
        lowered = jax.jit(jax.grad(loss)).trace(q).lower(lowering_platforms=("cuda",))
    # Nine launches; a kernel is lowered again only under other metadata (the first site of a
    # call also carries its description), and every copy is the same module.
    hashes = kernel_hashes(lowered.as_text())
    assert len(hashes) < 9 and len(set(hashes)) == 3
    assert sorted(call.direction for call in analysis.audit(lowered).calls) == ["backward"] * 3 + ["forward"] * 3


def test_rejects_what_it_cannot_run() -> None:
    q, k, v = qkv(1, 64, 2, 1, 64, jnp.float32)
    with pytest.raises(ValueError, match="bfloat16 or float16"):
        am.mosaic_forward(q, k, v, None, scale=1.0, bounds=(None, None), params=FwdParams())
    q, k, v = qkv(1, 64, 2, 1, 64, jnp.bfloat16)
    with pytest.raises(ValueError, match="kv_blocksize"):
        am.mosaic_forward(q, k, v, None, scale=1.0, bounds=(None, None), params=FwdParams(kv_blocksize=32))
    q, k, v = qkv(1, 64, 2, 1, 256, jnp.bfloat16)
    with pytest.raises(ValueError, match="backward"):
        am.mosaic_backward(q, k, v, None, q, jnp.zeros((1, 2, 64)), q, scale=1.0, bounds=(None, None), params=BwdParams())
    assert not am.mosaic_supports(jnp.bfloat16, 256) and am.mosaic_supports(jnp.bfloat16, 256, backward=False)


def test_flash_attention_offers_mosaic_only_where_it_runs() -> None:
    q, k, v = qkv(1, 64, 2, 1, 64, jnp.bfloat16)
    kernel = AttentionKernel()
    inv = Invocation(kernel, (q, k, v), {"causal": True})
    cfg = AttentionConfig("mosaic", FwdParams(kv_blocksize=128, num_stages=2), BwdParams(64, 128, None, 2))
    assert kernel.candidate_is_valid(inv, cfg) == am.on_hopper()
    assert not kernel.differentiated_by_jax(cfg)  # its own backward kernels
    if not am.on_hopper():
        assert all(c.impl != "mosaic" for c in kernel.config_space(inv) if kernel.candidate_is_valid(inv, c))
    # Shared memory: three stages of 128-row key and value blocks at dim 128 do not fit.
    assert not am.mosaic_fits(128, FwdParams(kv_blocksize=128, num_stages=3), BwdParams())
    assert am.mosaic_fits(128, FwdParams(kv_blocksize=64, num_stages=3), BwdParams())
    # The fused backward's ds and float32 dq shares leave room for two stages at dim 128, not three.
    three = BwdParams(q_blocksize=64, kv_blocksize=64, num_stages=3)
    assert am.mosaic_fits(128, FwdParams(), three) and not am.mosaic_fits(128, FwdParams(), three, fused_backward=True)
    assert am.mosaic_fits(128, FwdParams(), BwdParams(q_blocksize=64), fused_backward=True)


# --------------------------------------------------------------------------------------------
# Values in the Mosaic GPU interpreter (CPU)


def interpreted_values_and_gradients(
    q: jax.Array, k: jax.Array, v: jax.Array, ids: jax.Array, params: tuple[FwdParams, BwdParams], probe: jax.Array,
    fused_backward: bool = False,
) -> tuple[jax.Array, tuple[jax.Array, ...]]:
    """Causal attention with segment ids in the Mosaic GPU interpreter, its output and its
    gradients along ``probe``, checked against the float32 reference; returns both."""
    attend = lambda q, k, v: am.mosaic_attention(q, k, v, causal=True, segment_ids=ids, params=params, interpret=True, fused_backward=fused_backward)
    out, vjp = jax.vjp(attend, q, k, v)
    grads = vjp(probe.astype(out.dtype))
    f32 = tuple(t.astype(jnp.float32) for t in (q, k, v))
    scale = q.shape[3] ** -0.5
    want, want_vjp = jax.vjp(lambda q, k, v: reference(q, k, v, causal=True, window=None, segment_ids=ids, scale=scale), *f32)
    assert rel_error(out, want) < 1e-2
    for got, expected in zip(grads, want_vjp(probe)):
        assert rel_error(got, expected) < 2e-2
    return out, grads


@given(count=st.integers(1, 400), programs=st.integers(1, 140))
@settings(max_examples=60, deadline=None)
def test_persistent_programs_deal_every_item_once(count: int, programs: int) -> None:
    programs = min(programs, count)  # the kernels never launch more programs than items
    dealt = [
        int(am._snake_position(i, p, programs)) for p in range(programs) for i in range(int(am._snake_count(p, count, programs)))
    ]
    assert sorted(dealt) == list(range(count))
    # Balanced: the programs' item counts differ by at most one.
    counts = [int(am._snake_count(p, count, programs)) for p in range(programs)]
    assert max(counts) - min(counts) <= 1


def costed_plan(lo: Any, hi: Any) -> jax.Array:
    """A ``[6, batch, tiles]`` plan whose items visit ``hi - lo`` blocks, every one masked (the
    work order reads only ``lo`` and ``hi``)."""
    lo, hi = jnp.asarray(lo, jnp.int32), jnp.asarray(hi, jnp.int32)
    return jnp.stack([lo, hi, lo, lo, lo, hi])


def causal_costs(batch: int, tiles: int) -> jax.Array:
    """The plan of causal tiles: tile ``t`` visits ``t + 1`` blocks."""
    hi = jnp.broadcast_to(jnp.arange(1, tiles + 1, dtype=jnp.int32), (batch, tiles))
    return costed_plan(jnp.zeros_like(hi), hi)


def test_work_order_puts_the_longest_tiles_first() -> None:
    # A plan [6, batch 2, tiles 3]: lo and hi give 1, 4, 2 / 3, 0, 2 blocks; one section.
    lo = jnp.array([[0, 0, 1], [0, 0, 0]], jnp.int32)
    hi = jnp.array([[1, 4, 3], [3, 0, 2]], jnp.int32)
    plan = costed_plan(lo, hi)
    order = np.asarray(am._work_order(plan, heads=2, programs=5))
    decoded = [am._decode_item(int(item), heads=2, tiles=3) for item in order]
    cost = [int(hi[b, t] - lo[b, t]) for b, _, t in decoded]
    assert cost == sorted(cost, reverse=True)
    assert sorted(decoded) == [(b, h, t) for b in range(2) for h in range(2) for t in range(3)]


def snake_loads(costs: list[int], programs: int) -> list[int]:
    """Each program's planned blocks plus one per item, dealt as the kernels deal them."""
    loads = [0] * programs
    for p in range(programs):
        for i in range(int(am._snake_count(p, len(costs), programs))):
            loads[p] += costs[int(am._snake_position(i, p, programs))] + 1
    return loads


@given(
    batch=st.integers(1, 4), tiles=st.integers(1, 6), heads=st.integers(1, 4), programs=st.integers(1, 7),
    rows_per_section=st.integers(1, 3), seed=st.integers(0, 2**16),
)
@settings(max_examples=40, deadline=None)
def test_work_order_deals_sections_of_rows(batch: int, tiles: int, heads: int, programs: int, rows_per_section: int, seed: int) -> None:
    # Items in id order (batch row, tile, head), cut into sections of about rows_per_section
    # rows in whole pairs of rounds (at row tiles' starts); inside a section the most planned
    # blocks first, ties in id order.
    rng = np.random.default_rng(seed)
    lo = rng.integers(0, 3, (batch, tiles)).astype(np.int32)
    hi = lo + rng.integers(0, 4, (batch, tiles)).astype(np.int32)
    plan = costed_plan(lo, hi)
    row_bytes = 1000
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(am, "_L2_SECTION_BYTES", rows_per_section * row_bytes + row_bytes // 2)
        order = np.asarray(am._work_order(plan, heads, programs, batch_row_bytes=row_bytes))
    decoded = [am._decode_item(int(item), heads=heads, tiles=tiles) for item in order]
    assert sorted(decoded) == [(b, h, t) for b in range(batch) for h in range(heads) for t in range(tiles)]
    length = 2 * programs * max(round(rows_per_section * tiles * heads / (2 * programs)), 1)
    # A row tile (every head of one tile of one row) goes to the section of its first item.
    keys = [((b * tiles + t) * heads // length, -int(hi[b, t] - lo[b, t]), int(item)) for item, (b, h, t) in zip(order, decoded)]
    assert keys == sorted(keys)


def test_work_order_keeps_programs_balanced_and_heads_few() -> None:
    # Causal tiles (tile t plans t + 1 blocks), 16 heads in each of 8 rows: one section,
    # costliest first, balances the 132 programs but runs every head at once; sections of two
    # rows stay balanced too, with two rows' heads in a round.
    batch, tiles, heads, programs = 8, 32, 16, 132
    plan = causal_costs(batch, tiles)
    for section_rows in (None, 2):
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(am, "_L2_SECTION_BYTES", (section_rows or 0) * 1000)
            order = np.asarray(am._work_order(plan, heads, programs, batch_row_bytes=1000))
        decoded = [am._decode_item(int(item), heads=heads, tiles=tiles) for item in order]
        loads = snake_loads([t + 1 for _, _, t in decoded], programs)
        assert max(loads) <= 1.03 * (sum(loads) / programs)
        heads_per_round = max(len({(b, h) for b, h, _ in decoded[i : i + programs]}) for i in range(0, len(decoded), programs))
        if section_rows is None:
            assert heads_per_round == batch * heads
        else:  # a section's length is rounded to whole rounds: it may reach into a row more
            assert heads_per_round <= (section_rows + 1) * heads


def test_items_in_sections_only_where_heads_outnumber_half_the_programs() -> None:
    # Without segment ids, 64 key/value heads on 132 programs already run two tiles of each per
    # round costliest first: one section. With segment ids, or 256 heads, sections of one row
    # (16 heads of 2 MiB).
    def first_round_heads(batch: int, segmented: bool, kv_heads: int = 16) -> tuple[np.ndarray, int]:
        items, order = am._items(causal_costs(batch, 32), 16, True, False, segmented=segmented, kv_heads=kv_heads, batch_row_bytes=32 << 20)
        assert items.programs == 132
        heads = {am._decode_item(int(item), heads=16, tiles=32)[:2] for item in order[:132]}
        return np.asarray(order), len(heads)

    order, heads = first_round_heads(4, segmented=False)
    assert np.array_equal(order, np.asarray(am._work_order(causal_costs(4, 32), 16, 132))) and heads == 64
    for batch, segmented in ((4, True), (16, False)):
        order, heads = first_round_heads(batch, segmented)
        assert heads <= 32  # a row, and the next where a section reaches into it
    # 16 rows of 16 query heads, 4 key/value heads: each round already holds 2 tiles of each.
    order, _ = first_round_heads(16, segmented=False, kv_heads=4)
    assert np.array_equal(order, np.asarray(am._work_order(causal_costs(16, 32), 16, 132)))


@pytest.mark.slow
def test_interpreted_persistent_programs_walk_several_tiles(races: Callable[[], bool]) -> None:
    # Three programs in the interpreter share 4 query tiles (and 4 key/value tiles): one walks
    # two, the ring and the barriers running on across them. At dim 128 the forward and dkv
    # kernels double-buffer their tiles, while the dq kernel's two tiles do not fit twice, so
    # it loads the next tile only after the last one's results are out: both paths run. The
    # forward's results have a buffer of their own here, so its next tile is requested before
    # the last results have left. The race detector must find no access the barriers leave
    # unordered (it runs the copies out at once, so the wait before reusing the results' buffer
    # is not what it checks).
    seq, dim = 256, 128
    q, k, v = qkv(1, seq, 2, 2, dim, jnp.bfloat16, seed=11)
    ids = jnp.where(jnp.arange(seq) < seq - 9, 1 + (jnp.arange(seq) >= 96) + (jnp.arange(seq) >= 200), 0)[None].astype(jnp.int32)
    assert am._tile_buffers(128 * dim * 2, 2 * 2 * 64 * dim * 2) == 2 and am._tile_buffers(2 * 128 * dim * 2, 2 * 2 * 64 * dim * 2) == 2
    assert am._tile_buffers(2 * 128 * dim * 2, 2 * 2 * 128 * dim * 2) == 1  # dq with 128-row key blocks
    probe = jax.random.normal(jax.random.key(12), q.shape, jnp.float32)
    params = (FwdParams(kv_blocksize=64), BwdParams(q_blocksize=64, kv_blocksize=128))
    interpreted_values_and_gradients(q, k, v, ids, params, probe)
    assert not races()


@pytest.fixture
def races(monkeypatch: pytest.MonkeyPatch) -> Callable[[], bool]:
    """The interpreter with its race detector on; the returned function tells whether it found
    an access the kernels' barriers leave unordered."""
    from jax._src.pallas.mosaic_gpu.interpret import gpu_callbacks

    params_type = type(am._interpret_params())
    monkeypatch.setattr(am, "_interpret_params", lambda: params_type(detect_races=True))
    return lambda: gpu_callbacks.get_races().races_found


@pytest.mark.slow
@pytest.mark.parametrize(("fused", "diagonal_apart"), [(False, True), (True, True), (False, False)])
def test_interpreted_backward(races: Callable[[], bool], fused: bool, diagonal_apart: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    # Four tiles over three programs (one walks two), a query head group of 2, three documents
    # and padding. Some tiles visit masked blocks on both sides of an unmasked run (asserted
    # below): the producer and the consumers must agree on the order of the walk. Fused: each
    # step's dq share lands in its own slot (the interpreter has no reduce-add) and the visited
    # ones are summed, so a share written to the wrong block, head or tile shows in dq; the
    # consumers take turns sending shares and read each other's ds and keys. The interpreter's
    # race detector must find no access that the kernels' barriers leave unordered (taking out
    # one of the turns' waits makes it report the race). Not ``diagonal_apart``: the blocks
    # masked by positions alone share the segment ids' loop, as they do above head dim 64.
    if not diagonal_apart:
        monkeypatch.setattr(am, "_POSITIONS_APART_MAX_DIM", 0)
    seq, dim = 512, 64
    q, k, v = qkv(1, seq, 2, 1, dim, jnp.bfloat16, seed=13)
    position = jnp.arange(seq)
    ids = jnp.where(position < seq - 11, 1 + (position >= 60) + (position >= 90), 0)[None].astype(jnp.int32)
    shape = am._Shape(0.125, _bounds(True, None), None, 2, True, True)
    for transpose in (False, True):  # dq and forward walk key blocks of 64; dk/dv, query blocks of 64
        lo, hi, a, c, u_lo, u_hi = np.asarray(am._visit_plan(seq, seq, 128, 64, shape, ids, 1, transpose=transpose))[:, 0]
        assert np.any((lo < a) & (a < c) & (c < hi))
        # Every kind of step runs: blocks masked by the segment ids, by positions alone, neither.
        assert np.any((lo < u_lo) | (u_hi < hi)) and np.any((u_lo < a) | (c < u_hi)) and np.any(a < c)
    probe = jax.random.normal(jax.random.key(14), q.shape, jnp.float32)
    params = (FwdParams(kv_blocksize=64), BwdParams(q_blocksize=64, kv_blocksize=64))
    out, grads = interpreted_values_and_gradients(q, k, v, ids, params, probe, fused_backward=fused)
    assert not races()
    # Padding rows see nothing: output and dq exactly 0.
    assert not np.any(np.asarray(out.astype(jnp.float32))[0, seq - 11 :])
    assert not np.any(np.asarray(grads[0].astype(jnp.float32))[0, seq - 11 :])


def test_sum_shares_adds_only_visited_blocks() -> None:
    # Unvisited slots hold whatever the memory held (NaN here): they must not reach dq.
    shares = jnp.full((1, 2, 256, 1, 8), jnp.nan, jnp.float32)
    plan = jnp.array([[[0, 2]], [[2, 4]], [[0, 2]], [[2, 4]]], jnp.int32)  # tile 0 visits q blocks 0-1, tile 1 blocks 2-3
    shares = shares.at[0, 0, :128].set(1.0).at[0, 1, 128:].set(2.0)
    dq = np.asarray(am._sum_shares(shares, plan, 64))
    np.testing.assert_array_equal(dq[0, :128], 1.0)
    np.testing.assert_array_equal(dq[0, 128:], 2.0)


# --------------------------------------------------------------------------------------------
# GPU (Hopper)


def _hopper() -> bool:
    return am.on_hopper()


needs_hopper = pytest.mark.skipif(not _hopper(), reason="needs a Hopper GPU")


@pytest.mark.slow
def test_interpreted_pingpong_forward(races: Callable[[], bool]) -> None:
    # Two query tiles, two documents and padding: the consumers' meetings pair up (a missed
    # one would hang or leave a barrier phase unobserved, which the interpreter reports), and
    # the race detector finds no shared-memory access the barriers leave unordered (the second
    # tile walks four key blocks through two ring slots, so slots are refilled while in use
    # elsewhere; arriving on a slot's "consumed" barrier before reading it is reported).
    seq = 256
    q, k, v = qkv(1, seq, 1, 1, 64, jnp.bfloat16, seed=6)
    ids = jnp.where(jnp.arange(seq) < seq - 7, 1 + (jnp.arange(seq) >= 3 * seq // 4), 0)[None].astype(jnp.int32)
    out, _ = am.mosaic_forward(q, k, v, ids, scale=0.125, bounds=_bounds(True, None), params=FwdParams(kv_blocksize=64), interpret=True, pingpong=True)
    assert not races()
    assert rel_error(out, reference(q, k, v, causal=True, window=None, segment_ids=ids, scale=0.125)) < 1e-2


@gpu
@needs_gpu
@needs_hopper
@pytest.mark.parametrize("pingpong", [False, True])
@pytest.mark.parametrize("segments", [False, True])
def test_gpu_forward_pingpong(pingpong: bool, segments: bool) -> None:
    q, k, v = qkv(2, 1100, 4, 2, 128, jnp.bfloat16, seed=8)
    ids = documents(2, 1100, 3, padding=60, seed=1) if segments else None
    forward = jax.jit(lambda q, k, v: am.mosaic_forward(q, k, v, ids, scale=0.09, bounds=(None, 0), params=FwdParams(), pingpong=pingpong))
    out, lse = forward(q, k, v)
    assert rel_error(out, reference(q, k, v, causal=True, window=None, segment_ids=ids, scale=0.09)) < 2e-2
    assert np.all(np.isfinite(np.asarray(lse)))


@gpu
@needs_gpu
@needs_hopper
@pytest.mark.parametrize("causal", [True, False])
def test_gpu_head_dim_256_forward(causal: bool) -> None:
    q, k, v = qkv(2, 700, 4, 2, 256, jnp.bfloat16, seed=11)
    out, lse = jax.jit(lambda q, k, v: am.mosaic_forward(q, k, v, None, scale=0.0625, bounds=_bounds(causal, None), params=FwdParams()))(q, k, v)
    assert rel_error(out, reference(q, k, v, causal=causal, window=None, segment_ids=None, scale=0.0625)) < 2e-2
    assert np.all(np.isfinite(np.asarray(lse)))


@gpu
@needs_gpu
@needs_hopper
@pytest.mark.parametrize("params", [(FwdParams(kv_blocksize=64, num_stages=3), BwdParams(q_blocksize=128, kv_blocksize=64)), (FwdParams(kv_blocksize=128, num_stages=2), BwdParams(q_blocksize=64, kv_blocksize=128))])
def test_gpu_other_tiles(params: tuple[FwdParams, BwdParams]) -> None:
    q, k, v = qkv(1, 900, 4, 2, 128, jnp.bfloat16, seed=2)
    ids = documents(1, 900, 3, padding=50, seed=4)
    mosaic = lambda q, k, v: am.mosaic_attention(q, k, v, causal=True, segment_ids=ids, params=params)
    ref = lambda q, k, v: reference(q, k, v, causal=True, window=None, segment_ids=ids, scale=128**-0.5)
    assert rel_error(jax.jit(mosaic)(q, k, v), ref(q, k, v)) < 2e-2
    got = jax.jit(jax.grad(lambda q, k, v: jnp.sum(mosaic(q, k, v).astype(jnp.float32) ** 2), argnums=(0, 1, 2)))(q, k, v)
    want = jax.grad(lambda q, k, v: jnp.sum(ref(q, k, v) ** 2), argnums=(0, 1, 2))(*(t.astype(jnp.float32) for t in (q, k, v)))
    for g, w in zip(got, want):
        assert rel_error(g, w) < 4e-2


@gpu
@needs_gpu
@needs_hopper
@pytest.mark.parametrize(
    ("dim", "seq", "heads", "kv_heads", "options"),
    [
        (64, 1000, 12, 4, {"causal": True, "segments": 4}),
        (128, 1000, 4, 2, {"causal": False, "window": (200, 50)}),
        (64, 333, 6, 3, {"causal": True, "segments": 3, "window": (100, 0)}),
        (128, 513, 4, 2, {"causal": False, "segments": 2}),
        (64, 640, 4, 4, {"causal": True, "segments": 1}),
        (64, 1000, 8, 2, {"causal": True}),
        (128, 777, 4, 4, {"causal": True}),
        (128, 1024, 8, 1, {"causal": False}),
    ],
)
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
def test_gpu_values_and_gradients(dim: int, seq: int, heads: int, kv_heads: int, options: dict[str, Any], dtype: Any) -> None:
    q, k, v = qkv(2, seq, heads, kv_heads, dim, dtype, seed=seq + dim)
    ids = documents(2, seq, options["segments"], padding=seq // 10, seed=seq) if "segments" in options else None
    causal, window = options["causal"], options.get("window")
    probe = jax.random.normal(jax.random.key(1), q.shape, jnp.float32)
    mosaic = lambda q, k, v: am.mosaic_attention(q, k, v, causal=causal, window=window, segment_ids=ids)
    ref = lambda q, k, v: reference(q, k, v, causal=causal, window=window, segment_ids=ids, scale=dim**-0.5)
    tol = 2e-2 if dtype == jnp.bfloat16 else 5e-3

    def value_and_grads(f: Any) -> Any:
        def run(q: jax.Array, k: jax.Array, v: jax.Array) -> tuple[jax.Array, Any]:
            out, vjp = jax.vjp(f, q, k, v)
            return out, vjp(probe.astype(out.dtype))

        return jax.jit(run)

    out, got = value_and_grads(mosaic)(q, k, v)
    want_out, want = value_and_grads(ref)(*(t.astype(jnp.float32) for t in (q, k, v)))
    assert rel_error(out, want_out) < tol
    for name, g, w in zip("qkv", got, want):
        assert rel_error(g, w) < 2 * tol, name
    if ids is not None:  # padding sees nothing: exactly 0, never NaN
        pad = np.asarray(ids) <= 0
        assert not np.any(np.asarray(out.astype(jnp.float32))[pad])
        assert not np.any(np.asarray(got[0].astype(jnp.float32))[pad])


@gpu
@needs_gpu
@needs_hopper
@pytest.mark.parametrize(
    ("dim", "seq", "heads", "kv_heads", "segments"),
    [(64, 1000, 12, 4, 4), (128, 777, 4, 4, None), (128, 1024, 8, 2, 3), (64, 333, 6, 3, None)],
)
def test_gpu_fused_backward(dim: int, seq: int, heads: int, kv_heads: int, segments: int | None) -> None:
    q, k, v = qkv(2, seq, heads, kv_heads, dim, jnp.bfloat16, seed=seq)
    ids = documents(2, seq, segments, padding=seq // 10, seed=seq) if segments else None
    probe = jax.random.normal(jax.random.key(3), q.shape, jnp.float32)

    fused = lambda q, k, v: am.mosaic_attention(q, k, v, causal=True, segment_ids=ids, fused_backward=True)
    grads = jax.jit(lambda q, k, v: jax.vjp(fused, q, k, v)[1](probe.astype(q.dtype)))(q, k, v)
    ref = lambda q, k, v: reference(q, k, v, causal=True, window=None, segment_ids=ids, scale=dim**-0.5)
    want = jax.vjp(ref, *(t.astype(jnp.float32) for t in (q, k, v)))[1](probe)
    for name, g, w in zip("qkv", grads, want):
        assert rel_error(g, w) < 4e-2, name


@gpu
@needs_gpu
@needs_hopper
@pytest.mark.parametrize("kwargs", [{"causal": True}, {"segment_ids": "documents"}, {"cu_seqlens": "packed"}, {"sliding_window": (128, 0)}])
def test_gpu_flash_attention_mosaic(kwargs: dict[str, Any]) -> None:
    batch = 1 if "cu_seqlens" in kwargs else 2
    q, k, v = qkv(batch, 1000, 8, 2, 64, jnp.bfloat16, seed=21)
    if "segment_ids" in kwargs:
        kwargs = {"segment_ids": documents(2, 1000, 4, padding=100), "causal": True}
    if "cu_seqlens" in kwargs:
        kwargs = {"cu_seqlens": jnp.array([0, 100, 450, 451, 980], jnp.int32), "causal": True}
    cfg = AttentionConfig("mosaic", FwdParams(kv_blocksize=128, num_stages=2), BwdParams(64, 128, None, 2))
    xla = AttentionConfig("xla")
    loss = lambda cfg: jax.jit(jax.value_and_grad(lambda q, k, v: jnp.sum(flash_attention(q, k, v, cfg=cfg, **kwargs).astype(jnp.float32) ** 2), argnums=(0, 1, 2)))
    (value, got), (want_value, want) = loss(cfg)(q, k, v), loss(xla)(q, k, v)
    assert rel_error(flash_attention(q, k, v, cfg=cfg, **kwargs), flash_attention(q, k, v, cfg=xla, **kwargs)) < 2e-2
    assert abs(float(value) - float(want_value)) <= 2e-2 * abs(float(want_value))
    for g, w in zip(got, want):
        assert rel_error(g, w) < 4e-2
