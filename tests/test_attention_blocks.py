"""Per-block visit ranges under segment ids and windows, against a brute-force pair table."""

from __future__ import annotations

import jax
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ejlabel.kernels.attention.blocks import intersect_window, segment_block_ranges, uniform_block_ranges, window_block_ranges

# Jitted once per block-size pair: eager calls would compile every small op for every shape.
# The window functions run eagerly: jitted, every window (static) would compile anew.
ranges_of = jax.jit(segment_block_ranges, static_argnums=(2, 3))
uniform_of = jax.jit(uniform_block_ranges)

# Few block-size pairs (each compiles once); unequal sizes both ways, and blocks of one token.
BLOCK_PAIRS = st.sampled_from([(1, 2), (2, 1), (4, 8), (8, 4), (4, 4)])


def visible_pairs(q_ids: np.ndarray, kv_ids: np.ndarray) -> np.ndarray:
    """``[batch, seq_q, seq_kv]``: same positive id."""
    return (q_ids[:, :, None] == kv_ids[:, None, :]) & (q_ids[:, :, None] > 0)


def block_table(visible: np.ndarray, block_q: int, block_k: int, reduce: str) -> np.ndarray:
    batch, sq, sk = visible.shape
    tiles = visible.reshape(batch, sq // block_q, block_q, sk // block_k, block_k)
    return tiles.any(axis=(2, 4)) if reduce == "any" else tiles.all(axis=(2, 4))


def check_covers(lo: np.ndarray, hi: np.ndarray, needed: np.ndarray) -> None:
    """Every needed block lies in ``[lo, hi)``; ranges are ordered and in bounds."""
    assert np.all((0 <= lo) & (lo <= hi) & (hi <= needed.shape[-1]))
    for b, i in np.ndindex(lo.shape):
        wanted = np.flatnonzero(needed[b, i])
        assert np.all((lo[b, i] <= wanted) & (wanted < hi[b, i])), (b, i, lo[b, i], hi[b, i], wanted)


def check_tight(lo: np.ndarray, hi: np.ndarray, needed: np.ndarray) -> None:
    for b, i in np.ndindex(lo.shape):
        wanted = np.flatnonzero(needed[b, i])
        assert (lo[b, i], hi[b, i]) == ((wanted[0], wanted[-1] + 1) if wanted.size else (lo[b, i], lo[b, i])), (b, i, wanted)


def check_whole(first: np.ndarray, last: np.ndarray, lo: np.ndarray, hi: np.ndarray, whole: np.ndarray) -> None:
    """Blocks in ``[first, last)`` are seen whole, within the visit range."""
    assert np.all((lo <= first) & (first <= last) & (last <= hi))
    for b, i in np.ndindex(first.shape):
        assert whole[b, i, first[b, i] : last[b, i]].all(), (b, i, first[b, i], last[b, i])


def ids_strategy(sorted_ids: bool) -> st.SearchStrategy:
    @st.composite
    def draw(data: st.DrawFn) -> tuple[np.ndarray, np.ndarray, int, int]:
        block_q, block_k = data(BLOCK_PAIRS)
        # One length and batch: every new shape costs compilations, and 24 spans 3 to 24 blocks.
        seq, batch = 24, 2
        rows = []
        for _ in range(batch):
            if sorted_ids:  # packed documents: lengths, then padding at the end
                lengths = data(st.lists(st.integers(1, seq), min_size=1, max_size=4))
                row = np.concatenate([np.full(n, s + 1) for s, n in enumerate(lengths)])[:seq]
                row = np.pad(row, (0, seq - row.size))
            else:
                row = np.array(data(st.lists(st.integers(-1, 3), min_size=seq, max_size=seq)))
            rows.append(row)
        q_ids = np.stack(rows).astype(np.int32)
        kv_ids = q_ids if sorted_ids or data(st.booleans()) else np.array(data(st.permutations(q_ids.ravel().tolist()))).reshape(q_ids.shape)
        return q_ids, kv_ids.astype(np.int32), block_q, block_k

    return draw()


@settings(max_examples=40, deadline=10000)
@given(case=ids_strategy(sorted_ids=False))
def test_ranges_never_skip_a_visible_pair(case: tuple[np.ndarray, np.ndarray, int, int]) -> None:
    q_ids, kv_ids, block_q, block_k = case
    ranges = ranges_of(q_ids, kv_ids, block_q, block_k)
    r = {name: np.asarray(x) for name, x in ranges._asdict().items()}
    visible = visible_pairs(q_ids, kv_ids)
    some = block_table(visible, block_q, block_k, "any")
    check_covers(r["kv_lo"], r["kv_hi"], some)
    check_covers(r["q_lo"], r["q_hi"], some.transpose(0, 2, 1))
    whole = block_table(visible, block_q, block_k, "all")
    uniform = uniform_of(ranges)
    check_whole(np.asarray(uniform.kv_first), np.asarray(uniform.kv_last), r["kv_lo"], r["kv_hi"], whole)
    check_whole(np.asarray(uniform.q_first), np.asarray(uniform.q_last), r["q_lo"], r["q_hi"], whole.transpose(0, 2, 1))
    for ids, block, got in ((q_ids, block_q, r["q_uniform"]), (kv_ids, block_k, r["kv_uniform"])):
        tiles = ids.reshape(ids.shape[0], -1, block)
        want = np.where((tiles[:, :, 0] > 0) & (tiles == tiles[:, :, :1]).all(axis=2), tiles[:, :, 0], -1)
        np.testing.assert_array_equal(got, want)


@settings(max_examples=40, deadline=10000)
@given(case=ids_strategy(sorted_ids=True))
def test_ranges_are_tight_for_packed_documents(case: tuple[np.ndarray, np.ndarray, int, int]) -> None:
    q_ids, kv_ids, block_q, block_k = case
    ranges = ranges_of(q_ids, kv_ids, block_q, block_k)
    visible = visible_pairs(q_ids, kv_ids)
    some, whole = block_table(visible, block_q, block_k, "any"), block_table(visible, block_q, block_k, "all")
    check_tight(np.asarray(ranges.kv_lo), np.asarray(ranges.kv_hi), some)
    check_tight(np.asarray(ranges.q_lo), np.asarray(ranges.q_hi), some.transpose(0, 2, 1))
    # Every block seen whole by segments is in the uniform run: nothing is masked needlessly.
    uniform = uniform_of(ranges)
    for first, last, table in ((uniform.kv_first, uniform.kv_last, whole), (uniform.q_first, uniform.q_last, whole.transpose(0, 2, 1))):
        first, last = np.asarray(first), np.asarray(last)
        for b, i in np.ndindex(first.shape):
            assert list(np.flatnonzero(table[b, i])) == list(range(first[b, i], last[b, i])), (b, i)


@settings(max_examples=40, deadline=10000)
@given(
    case=ids_strategy(sorted_ids=True),
    left=st.one_of(st.none(), st.integers(0, 30)),
    right=st.one_of(st.none(), st.integers(-5, 30)),
)
def test_window_intersection_covers_visible_pairs(case: tuple[np.ndarray, np.ndarray, int, int], left: int | None, right: int | None) -> None:
    q_ids, kv_ids, block_q, block_k = case
    seq = q_ids.shape[1]
    if left is not None and right is not None:
        right = max(right, -left)  # a window that shows a query nothing is not a band
    ranges = intersect_window(ranges_of(q_ids, kv_ids, block_q, block_k), block_q, block_k, left, right)
    pos_q, pos_k = np.arange(seq)[:, None], np.arange(seq)[None, :]
    window = np.ones((seq, seq), bool)
    if left is not None:
        window &= pos_k >= pos_q - left
    if right is not None:
        window &= pos_k <= pos_q + right
    some = block_table(visible_pairs(q_ids, kv_ids) & window, block_q, block_k, "any")
    check_covers(np.asarray(ranges.kv_lo), np.asarray(ranges.kv_hi), some)
    check_covers(np.asarray(ranges.q_lo), np.asarray(ranges.q_hi), some.transpose(0, 2, 1))
    # Positions alone: tight (the window is a band, so its blocks are contiguous).
    kv_lo, kv_hi, q_lo, q_hi = (np.asarray(x)[None] for x in window_block_ranges(seq // block_q, seq // block_k, block_q, block_k, left, right))
    band = block_table(window[None], block_q, block_k, "any")
    check_tight(kv_lo, kv_hi, band)
    check_tight(q_lo, q_hi, band.transpose(0, 2, 1))


def test_rejects_unpadded_ids() -> None:
    with pytest.raises(ValueError, match="q_segments: expected a length that is a multiple"):
        segment_block_ranges(np.ones((1, 10), np.int32), np.ones((1, 16), np.int32), 16, 16)
    with pytest.raises(ValueError, match="one batch"):
        segment_block_ranges(np.ones((1, 16), np.int32), np.ones((2, 16), np.int32), 16, 16)
