"""The items of the Mosaic attention kernels and the order programs take them in
(kernels/attention/mosaic/work.py), on the CPU: the snake deal hands out every item once and evenly,
the ranking's sections and costliest-first rule (hypothesis), the deal by load (hypothesis, and
packed documents at the model's shape), the balance the order keeps, and where sections apply.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from ejlabel.kernels.attention.mosaic import work as mwork


@given(count=st.integers(1, 400), programs=st.integers(1, 140))
@settings(max_examples=60, deadline=None)
def test_persistent_programs_deal_every_item_once(count: int, programs: int) -> None:
    programs = min(programs, count)  # the kernels never launch more programs than items
    dealt = [
        int(mwork.snake_position(i, p, programs)) for p in range(programs) for i in range(int(mwork.snake_count(p, count, programs)))
    ]
    assert sorted(dealt) == list(range(count))
    # Balanced: the programs' item counts differ by at most one.
    counts = [int(mwork.snake_count(p, count, programs)) for p in range(programs)]
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
    order = np.asarray(mwork.rank_items(plan, heads=2, programs=5))
    decoded = [mwork.decode_item(int(item), heads=2, tiles=3) for item in order]
    cost = [int(hi[b, t] - lo[b, t]) for b, _, t in decoded]
    assert cost == sorted(cost, reverse=True)
    assert sorted(decoded) == [(b, h, t) for b in range(2) for h in range(2) for t in range(3)]


def snake_loads(costs: list[int], programs: int) -> list[int]:
    """Each program's planned blocks plus one per item, dealt as the kernels deal them."""
    loads = [0] * programs
    for p in range(programs):
        for i in range(int(mwork.snake_count(p, len(costs), programs))):
            loads[p] += costs[int(mwork.snake_position(i, p, programs))] + 1
    return loads


@given(programs=st.integers(1, 40), rounds=st.integers(1, 8), spread=st.integers(0, 60), seed=st.integers(0, 2**16))
@settings(max_examples=15, deadline=None)
def test_balanced_deal_keeps_rounds_and_programs_within_one_item(programs: int, rounds: int, spread: int, seed: int) -> None:
    # Items already ranked costliest first within each round (as rank_items gives them), the
    # last round possibly short.
    rng = np.random.default_rng(seed)
    count = int(rng.integers((rounds - 1) * programs + 1, rounds * programs + 1))
    cost = np.concatenate([np.sort(rng.integers(1, spread + 2, min(programs, count - r * programs)))[::-1] for r in range(rounds)])
    ranked = rng.permutation(count).astype(np.int32)  # item ids; their costs are cost[position]
    cost_of = np.empty(count, np.int64)
    cost_of[ranked] = cost
    # Under jit, as a kernel's traced call or plan.folded runs it (op by op it takes longer).
    order = np.asarray(jax.jit(mwork.balance_rounds, static_argnums=2)(jnp.asarray(ranked), jnp.asarray(cost), programs))
    assert sorted(order.tolist()) == list(range(count))
    i, p = np.meshgrid(np.arange(rounds), np.arange(programs), indexing="ij")
    position = np.asarray(mwork.snake_position(jnp.asarray(i), jnp.asarray(p), programs))
    dealt = position < count
    assert np.array_equal(dealt.sum(axis=0), np.asarray(mwork.snake_count(jnp.arange(programs), count, programs)))
    # A round's items stay in that round (the blocks in flight together are the same).
    for r in range(rounds):
        assert set(order[position[r][dealt[r]]].tolist()) == set(ranked[r * programs : (r + 1) * programs].tolist())
    # Each round's costliest item goes to the least loaded program: loads stay within one item.
    loads = np.where(dealt, cost_of[np.where(dealt, order[np.minimum(position, count - 1)], 0)], 0).sum(axis=0)
    assert loads.max() - loads.min() <= cost.max()


def test_work_order_balances_packed_documents_at_the_model_shape() -> None:
    # The dk/dv kernel's items at the packed model's shape (B8 S2048, 4 key/value heads, 4
    # random documents a row; 512 items on 132 programs): the snake alone leaves the busiest
    # program far above the mean, the deal by load close to it.
    from ejlabel.examples import random_documents
    from ejlabel.kernels.attention.arg_specs import PACKED
    from ejlabel.kernels.attention.mosaic.plan import TILE, Shape, visit_plan

    batch, seq, heads, kv_heads, programs = PACKED.batch, PACKED.seq, PACKED.heads, PACKED.kv_heads, 132
    shape = Shape(scale=1.0, bounds=(None, 0), kv_len=None, group=heads // kv_heads, segmented=True)
    row_bytes = heads * seq * (2 * PACKED.dim * 2 + 8)  # the dk/dv kernel's streamed bytes of a batch row

    @jax.jit
    def plan_and_orders(ids: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
        plan = visit_plan(seq, seq, TILE, 64, shape, ids, batch, transpose=True)  # 64-row query blocks: the backward's default
        return plan, mwork.rank_items(plan, kv_heads, programs, batch_row_bytes=row_bytes), mwork.work_order(plan, kv_heads, programs, batch_row_bytes=row_bytes)

    plan, ranked, dealt = plan_and_orders(random_documents(jax.random.key(101), batch, seq, PACKED.documents))
    cost = np.asarray(mwork.planned_blocks(plan))
    ratios = []
    for order in (ranked, dealt):
        loads = snake_loads([int(cost[item // kv_heads]) for item in np.asarray(order)], programs)
        ratios.append(max(loads) / (sum(loads) / programs))
    assert ratios[0] > 1.3 and ratios[1] < 1.2, ratios


@given(
    batch=st.integers(1, 4), tiles=st.integers(1, 6), heads=st.integers(1, 4), programs=st.integers(1, 7),
    rows_per_section=st.integers(1, 3), seed=st.integers(0, 2**16),
)
@settings(max_examples=20, deadline=None)
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
        patch.setattr(mwork, "L2_SECTION_BYTES", rows_per_section * row_bytes + row_bytes // 2)
        order = np.asarray(mwork.rank_items(plan, heads, programs, batch_row_bytes=row_bytes))
    decoded = [mwork.decode_item(int(item), heads=heads, tiles=tiles) for item in order]
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
            patch.setattr(mwork, "L2_SECTION_BYTES", (section_rows or 0) * 1000)
            order = np.asarray(mwork.work_order(plan, heads, programs, batch_row_bytes=1000))
        decoded = [mwork.decode_item(int(item), heads=heads, tiles=tiles) for item in order]
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
        items, order = mwork.deal_items(causal_costs(batch, 32), 16, True, False, segmented=segmented, kv_heads=kv_heads, batch_row_bytes=32 << 20)
        assert items.programs == 132
        heads = {mwork.decode_item(int(item), heads=16, tiles=32)[:2] for item in order[:132]}
        return np.asarray(order), len(heads)

    order, heads = first_round_heads(4, segmented=False)
    assert np.array_equal(order, np.asarray(mwork.work_order(causal_costs(4, 32), 16, 132))) and heads == 64
    for batch, segmented in ((4, True), (16, False)):
        order, heads = first_round_heads(batch, segmented)
        assert heads <= 32  # a row, and the next where a section reaches into it
    # 16 rows of 16 query heads, 4 key/value heads: each round already holds 2 tiles of each.
    order, _ = first_round_heads(16, segmented=False, kv_heads=4)
    assert np.array_equal(order, np.asarray(mwork.work_order(causal_costs(16, 32), 16, 132)))


