"""The Mosaic attention's visiting plans and walk (kernels/attention/mosaic/plan.py), on the CPU.

Plans are checked against a dense visibility mask (every visible pair is visited, a block is
walked without a mask only if every pair in it is visible), on hand-worked documents, and the
walk's order and masks over every arrangement of the plan's ranges (hypothesis).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from ejlabel.kernels.attention.masks import window_bounds
from ejlabel.kernels.attention.mosaic import plan as mplan
from kernel_checks import dense_visibility, documents


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
    bounds = window_bounds(options["causal"], options.get("window"))
    shape = mplan.Shape(1.0, bounds, options.get("kv_len"), 1, ids is not None)
    batch = 2
    plan = np.asarray(mplan.visit_plan(seq, seq, block_r, block_c, shape, ids, batch, transpose=transpose))
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
    shape = mplan.Shape(1.0, (None, None), None, 1, True)
    lo, hi, a, c, u_lo, u_hi = np.asarray(mplan.visit_plan(1024, 1024, 128, 128, shape, ids, 1, transpose=False))
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
    visit = mplan.Visit(*(jnp.int32(0),) * 3, *(jnp.int32(x) for x in (lo, hi, a, c, u_lo, u_hi)))
    blocks = [int(visit.block(jnp.int32(s))) for s in range(int(visit.steps))]
    assert sorted(blocks) == list(range(lo, hi))
    kinds = {mplan.Mask.SEGMENTS: [], mplan.Mask.POSITIONS: [], mplan.Mask.NONE: []}
    start = 0
    for kind in kinds:  # the walk's order of kinds
        stop = int(visit.steps_until(kind))
        kinds[kind] = blocks[start:stop]
        start = stop
    assert set(kinds[mplan.Mask.SEGMENTS]) == set(range(lo, u_lo)) | set(range(u_hi, hi))
    assert set(kinds[mplan.Mask.POSITIONS]) == set(range(u_lo, a)) | set(range(c, u_hi))
    assert kinds[mplan.Mask.NONE] == list(range(a, c))


@pytest.mark.parametrize(
    "masks", [(mplan.Mask.SEGMENTS, mplan.Mask.POSITIONS), (mplan.Mask.SEGMENTS,), (mplan.Mask.POSITIONS,)], ids=["apart", "joined", "positions"]
)
def test_walk_gives_each_block_its_mask(masks: tuple[Any, ...]) -> None:
    lo, u_lo, a, c, u_hi, hi = 1, 3, 4, 6, 8, 9  # segments: 1, 2, 8; positions: 3, 6, 7; none: 4, 5
    visit = mplan.Visit(*(jnp.int32(0),) * 3, *(jnp.int32(x) for x in (lo, hi, a, c, u_lo, u_hi)))
    codes = {mask: n for n, mask in enumerate(mplan.Mask)}

    def step(j: jax.Array, t: jax.Array, got: jax.Array, mask: Any) -> jax.Array:
        return got.at[j].set(codes[mask])

    got = np.asarray(mplan.walk(visit, step, jnp.full(10, -1), masks=masks))
    want = np.full(10, -1)
    want[[4, 5]] = codes[mplan.Mask.NONE]
    positions = mplan.Mask.POSITIONS if mplan.Mask.POSITIONS in masks else mplan.Mask.SEGMENTS
    want[[3, 6, 7]] = codes[positions]
    want[[1, 2, 8]] = codes[masks[0]]  # an unsegmented walk's plans have none such: u_lo = lo, u_hi = hi
    np.testing.assert_array_equal(got, want)


def test_plan_masks_a_documents_diagonal_by_position_only() -> None:
    # Causal, documents of 256 and 512 tokens, then two that meet inside a block (64 and 192
    # tokens): a tile's diagonal block inside its document needs the causal mask alone; the
    # block holding two documents needs the segment ids' mask, for its own tile and the next.
    ids = jnp.concatenate([jnp.full(256, 1), jnp.full(512, 2), jnp.full(256, 3)]).astype(jnp.int32)
    ids = ids.at[832:].set(4)[None]
    shape = mplan.Shape(1.0, (None, 0), None, 1, True)
    lo, hi, a, c, u_lo, u_hi = (row[0] for row in np.asarray(mplan.visit_plan(1024, 1024, 128, 128, shape, ids, 1, transpose=False)))
    np.testing.assert_array_equal(lo, [0, 0, 2, 2, 2, 2, 6, 6])
    np.testing.assert_array_equal(hi, [1, 2, 3, 4, 5, 6, 7, 8])
    np.testing.assert_array_equal(u_hi - u_lo, [1, 2, 1, 2, 3, 4, 0, 1])
    np.testing.assert_array_equal(u_lo[7], 7)
    np.testing.assert_array_equal(c - a, [0, 1, 0, 1, 2, 3, 0, 0])  # the diagonal is masked: by position


@settings(max_examples=25, deadline=None)
@given(
    st.integers(0, 3), st.integers(0, 3), st.sampled_from([(None, 0), (20, 5), (None, None), (7, None)]), st.booleans(), st.booleans(),
    st.integers(0, 2**31 - 1),
)
def test_block_mask_is_the_dense_mask(
    q_block: int, k_block: int, bounds: tuple[int | None, int | None], padded_keys: bool, transpose: bool, seed: int,
) -> None:
    """One block pair's mask as the kernels compute it (:func:`visibility`, interpreted) equals
    the dense mask's block, over bounds, padded keys and ids with padding (0 and negative)
    and repeated, unsorted ids."""
    from ejlabel.kernels.attention.mosaic import pad_operands
    from ejlabel.kernels.attention.mosaic.kernel import tile_segments, visibility

    rows, cols, seq = 16, 8, 64
    ids = jnp.asarray(np.random.default_rng(seed).integers(-2, 4, (1, seq)), jnp.int32)
    x = jnp.zeros((1, seq, 1, 64), jnp.bfloat16)
    kernel_ids = pad_operands(x, x, x, ids, scale=1.0, bounds=bounds, block_k=128, interpret=True).segment_ids[0]  # as the kernels get them
    kv_len = 41 if padded_keys else None
    shape = mplan.Shape(1.0, bounds, kv_len, 1, True, interpret=True)
    visible = dense_visibility(seq, seq, False, bounds, ids, kv_len)[0]
    if transpose:  # rows are keys, columns queries
        k0, q0 = k_block * rows, q_block * cols
        segments = (kernel_ids[q0 : q0 + cols], tile_segments(shape, kernel_ids[k0 : k0 + rows]))
        expected = visible[q0 : q0 + cols, k0 : k0 + rows].T
    else:
        q0, k0 = q_block * rows, k_block * cols
        segments = (tile_segments(shape, kernel_ids[q0 : q0 + rows]), kernel_ids[k0 : k0 + cols])
        expected = visible[q0 : q0 + rows, k0 : k0 + cols]
    mask = visibility(shape, jnp.int32(q0), jnp.int32(k0), rows, cols, segments, transpose=transpose)
    np.testing.assert_array_equal(np.asarray(mask), expected)


def test_known_plans_are_folded_by_one_program_and_the_rest_traced() -> None:
    # A result known while tracing enters the program as a constant, computed by one compiled
    # program kept for its shapes and static arguments; a traced input, or a result past
    # MAX_CONSTANT elements, is traced into the caller's program.
    traced: list[int] = []

    def double_plus(x: jax.Array, *, offset: int) -> jax.Array:
        traced.append(offset)  # once per trace
        return 2 * jnp.asarray(x) + offset

    x = np.arange(6, dtype=np.int32)
    first = mplan.folded(double_plus, x, elements=6, offset=1)
    again = mplan.folded(double_plus, x + 1, elements=6, offset=1)
    assert isinstance(first, np.ndarray) and first.tolist() == (2 * x + 1).tolist() and again.tolist() == (2 * x + 3).tolist()
    assert traced == [1]  # the same shapes and static arguments: compiled once
    assert mplan.folded(double_plus, x, elements=6, offset=2).tolist() == (2 * x + 2).tolist() and traced == [1, 2]
    seen: dict[str, Any] = {}

    def outer(y: jax.Array) -> jax.Array:
        seen["known"] = mplan.folded(double_plus, x, elements=6, offset=1)
        seen["traced"] = mplan.folded(double_plus, y, elements=6, offset=1)
        seen["large"] = mplan.folded(double_plus, x, elements=mplan.MAX_CONSTANT + 1, offset=1)
        return seen["traced"] + seen["known"] + seen["large"]

    assert jax.jit(outer)(x).tolist() == (3 * (2 * x + 1)).tolist()
    assert isinstance(seen["known"], np.ndarray)
    assert isinstance(seen["traced"], jax.core.Tracer) and isinstance(seen["large"], jax.core.Tracer)
