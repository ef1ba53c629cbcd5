"""The items of a Mosaic attention kernel (one tile of one head of one batch row) and the order
in which persistent programs take them.

At most one program runs per SM and walks several items (:class:`Items`), taken round by round
from a list (:func:`work_order`) cut into sections whose blocks stay in L2, the costliest items
first within each; where programs walk few items, each round goes to the programs by the load
they already carry (:func:`balance_rounds`). :func:`deal_items` gives a kernel its items and
their list.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax
from jaxtyping import Array, Int

from .plan import Visit, folded

__all__ = [
    "BALANCED_MAX_ROUNDS", "L2_SECTION_BYTES", "Items", "balance_rounds", "deal_items", "decode_item", "planned_blocks", "program_count",
    "rank_items", "section_length", "snake_count", "snake_position", "work_order",
]


@dataclasses.dataclass(frozen=True)
class Items:
    """A kernel's work as items (one tile of one head of one batch row) dealt to persistent programs.

    With one program per tile, a tile cost a fixed time (start, its tile's load, filling the
    ring, writing out), several blocks' work, which short documents cannot hide (H100;
    ``bench/bench_attention.py`` section i shows what a tile costs beside its blocks). So
    ``programs`` (one per SM) each walk several items: the producer streams the next item's
    blocks while the consumers finish the current one, the next tile loads while the current
    results are written, and each item's place and plan are read one item ahead (the first two
    of these already cut a tile's fixed cost). ``order [count]``
    lists the items (see :func:`work_order`); programs take them from the snake's positions
    (``p``, then ``2P - 1 - p``, ...), where the order puts a similar mix of long and short
    items for every program: the snake's own pairing, or with few rounds a deal by load.
    """

    count: int
    programs: int
    heads: int
    tiles: int

    def at(self, order_ref: Any, i: jax.Array | int) -> jax.Array:
        """The id of this program's ``i``-th item."""
        return order_ref[snake_position(i, lax.axis_index("programs"), self.programs)]

    def mine(self) -> jax.Array:
        """How many items this program walks."""
        return snake_count(lax.axis_index("programs"), self.count, self.programs)

    def visit(self, order_ref: Any, plan_ref: Any, i: jax.Array | int) -> Visit:
        """This program's ``i``-th item and its plan, read from global memory. Past the last
        item it reads the last one again (harmless): the walks below read each item one item
        ahead, so the reads' latency hides behind the current item's work."""
        b, h, tile = decode_item(self.at(order_ref, jnp.minimum(i, self.mine() - 1)), self.heads, self.tiles)
        return Visit(b, h, tile, *(plan_ref[n, b, tile] for n in range(plan_ref.shape[0])))


def decode_item(item: Any, heads: int, tiles: int) -> tuple[Any, Any, Any]:
    """``(batch row, head, tile)`` of an item id ``(b * tiles + tile) * heads + h``."""
    row_tile, h = item // heads, item % heads
    return row_tile // tiles, h, row_tile % tiles


def snake_position(i: Any, program: Any, programs: int) -> Any:
    """Where program ``program``'s ``i``-th item is in the order: rounds of ``programs`` items,
    dealt forwards in even rounds and backwards in odd ones."""
    return i * programs + jnp.where(i % 2 == 0, program, programs - 1 - program)


def snake_count(program: Any, count: int, programs: int) -> Any:
    """How many of ``count`` items program ``program`` gets (only the last round can be short)."""
    rounds = -(-count // programs)
    return jnp.int32(rounds - 1) + (snake_position(rounds - 1, program, programs) < count).astype(jnp.int32)


def program_count(items: int, persistent: bool) -> int:
    """Programs to launch: one per item, or with ``persistent`` at most one per SM."""
    if not persistent:
        return items
    device = jax.devices()[0]
    sms = getattr(device, "core_count", None) if device.platform == "gpu" else None
    return min(items, int(sms) if sms else 132)  # 132: the H100 SXM, when lowering elsewhere


# Bytes of streamed operands (keys and values; or queries, their gradients and row terms) that
# the items of one section of the order may share through the H100's 50 MiB of L2 (see
# work_order). 0: one section.
L2_SECTION_BYTES = 32 << 20


def section_length(programs: int, row_items: int, batch_row_bytes: int, count: int, section_bytes: int | None = None) -> int:
    """Items per section of the work order: the items of the batch rows whose streamed bytes
    fit in :data:`L2_SECTION_BYTES` (one row at least), rounded to whole pairs of rounds
    (``2 * programs`` items). ``section_bytes``: :data:`L2_SECTION_BYTES` unless given."""
    section_bytes = L2_SECTION_BYTES if section_bytes is None else section_bytes
    if not batch_row_bytes or not section_bytes:
        return count
    rows = max(section_bytes // batch_row_bytes, 1)
    return 2 * programs * max(round(rows * row_items / (2 * programs)), 1)


# Up to this many rounds of items per program, each round is dealt by the programs' loads so far
# (:func:`balance_rounds`); with more, the snake alone keeps programs within a few percent.
BALANCED_MAX_ROUNDS = 8


def planned_blocks(plan: jax.Array) -> Int[Array, "row_tiles"]:
    """``[batch * tiles]``: the blocks each row tile's plan visits (``hi - lo``), an item's cost
    (the same for every head of the tile)."""
    return (plan[1] - plan[0]).reshape(-1)


def rank_items(plan: jax.Array, heads: int, programs: int, *, batch_row_bytes: int = 0, section_bytes: int | None = None) -> Int[Array, "items"]:
    """Item ids (see :class:`Items`) in sections that keep the blocks in flight in L2, each
    section's items with the most planned blocks first.

    ``batch_row_bytes``: what the items of one batch row stream (its keys and values, say).
    Costliest first over every row, a round of 132 items held one tile of each of 132 heads at
    1024-token documents, so no two programs read the same blocks and the forward waited on HBM
    (slower than in sections at B16 S1024 H16 D128, section b's documents as rows in
    ``bench/bench_attention.py``).
    Sections cut the items in id order (batch row, tile, head) into runs of whole pairs of
    rounds (at row tiles' starts), about the rows that fit in :data:`L2_SECTION_BYTES`
    (:func:`section_length`); costliest first within a run of two rounds dealt in snake
    order, every program gets one long and one short item (sections of whole heads instead
    left programs well apart, causal S4096). Ties keep id order, as before
    sections: the heads of one tile together. ``batch_row_bytes=0``: one section."""
    batch, tiles = plan.shape[1:]
    count = batch * tiles * heads
    length = section_length(programs, tiles * heads, batch_row_bytes, count, section_bytes)
    cost = planned_blocks(plan)
    # The sort runs over row tiles (every head of one tile of one row; on the device each
    # sorted element costs time before the kernel starts), each in the section of its first
    # item: sections of whole row tiles would drift from whole pairs of rounds, and the
    # balance with them (B16 S1024 H16 D128 forward and backward ran slower than with sections
    # cut at items; the dk/dv kernel's items moved).
    section = jnp.arange(batch * tiles, dtype=jnp.int32) * heads // length
    # One key: section first, then the most blocks (costs lie in [0, most)).
    most = jnp.max(cost, initial=0) + 1
    row_tiles = jnp.argsort(section * most - cost, stable=True).astype(jnp.int32)
    return (row_tiles[:, None] * heads + jnp.arange(heads, dtype=jnp.int32)[None, :]).reshape(-1)


def balance_rounds(ranked: Int[Array, "items"], cost: Int[Array, "items"], programs: int) -> Int[Array, "items"]:
    """``ranked`` (each round of ``programs`` items costliest first, as :func:`rank_items`
    gives) re-laid so that program ``p``'s ``i``-th item sits at ``snake_position(i, p)``,
    each round's ``k``-th costliest item going to the program with the ``k``-th least ``cost``
    dealt so far (ties: the lower program).

    With few items per program, the snake's fixed pairing left them far apart where item costs
    are spread wide: packed documents of random lengths (B8 S2048, 4 key/value heads, the
    dk/dv kernel's 512 items on 132 programs) put the busiest program far above the mean
    planned blocks, by load close to it (``bench/bench_work_order.py``, figures in
    ``bench/RESULTS.md``; ``tests/test_mosaic_work.py`` checks one set of ids). After each
    round the programs' loads lie within the costliest item of the rounds so far of each other
    (the costliest item goes to the least loaded program, a cheaper one to a busier program).
    The rounds' items stay the same, so do the blocks in flight together (the sections' L2
    reuse). Programs are virtual while dealing: those left without an item in a short last
    round become the programs the snake gives none (:func:`snake_count`)."""
    count = ranked.shape[0]
    rounds = -(-count // programs)
    slots = rounds * programs
    # The empty slots of a short last round cost -1: the least, so they go to the busiest programs.
    cost = jnp.pad(cost.astype(jnp.int32), (0, slots - count), constant_values=-1)
    program = jnp.arange(programs, dtype=jnp.int32)
    picks = [program]  # the first round: every load is 0, program v takes the round's v-th item
    load = jnp.maximum(cost[:programs], 0)
    for r in range(1, rounds):
        ahead = (load[None, :] < load[:, None]) | ((load[None, :] == load[:, None]) & (program[None, :] < program[:, None]))
        pick = r * programs + ahead.sum(axis=1, dtype=jnp.int32)  # the least loaded program takes the round's first item
        load = load + jnp.maximum(cost[pick], 0)
        picks.append(pick)
    # Virtual programs dealt a last item take, in order, the programs the snake deals one, the
    # others the rest: cumulative sums place them (the snake's side is a constant), no sort.
    dealt_last = cost[picks[-1]] >= 0
    slot = jnp.where(dealt_last, jnp.cumsum(dealt_last) - 1, jnp.sum(dealt_last) + jnp.cumsum(~dealt_last) - 1)
    with jax.ensure_compile_time_eval():
        real_in_slot = jnp.argsort(snake_position(rounds - 1, program, programs) >= count, stable=True).astype(jnp.int32)
    real = real_in_slot[slot]
    positions = jnp.stack([snake_position(r, real, programs) for r in range(rounds)])
    items = jnp.pad(ranked, (0, slots - count))[jnp.stack(picks)]
    return jnp.zeros(count, jnp.int32).at[positions.reshape(-1)].set(items.reshape(-1), mode="drop")


def work_order(plan: jax.Array, heads: int, programs: int, *, batch_row_bytes: int = 0) -> Int[Array, "items"]:
    """Item ids (see :class:`Items`) at the positions the programs take them from
    (:func:`snake_position`): ranked in sections (:func:`rank_items`), then, up to
    :data:`BALANCED_MAX_ROUNDS` rounds, dealt by load (:func:`balance_rounds`); a constant of
    the program when the plan is one (positions only, see :func:`visit_plan`) and the items
    few enough (:func:`.plan.folded`)."""
    batch, tiles = plan.shape[1:]
    # The module's settings are read here, so that a folded order is kept for the ones it used.
    return folded(
        _ranked_and_dealt, plan, elements=batch * tiles * heads, heads=heads, programs=programs, batch_row_bytes=batch_row_bytes,
        section_bytes=L2_SECTION_BYTES, balanced_max_rounds=BALANCED_MAX_ROUNDS,
    )


def _ranked_and_dealt(
    plan: jax.Array, *, heads: int, programs: int, batch_row_bytes: int, section_bytes: int, balanced_max_rounds: int,
) -> Int[Array, "items"]:
    ranked = rank_items(plan, heads, programs, batch_row_bytes=batch_row_bytes, section_bytes=section_bytes)
    if -(-ranked.shape[0] // programs) > balanced_max_rounds:
        return ranked
    # Each item's planned blocks, plus one for what every item costs (its tile, its results).
    cost = planned_blocks(plan)[ranked // heads] + 1
    return balance_rounds(ranked, cost, programs)


def deal_items(
    plan: jax.Array, heads: int, persistent: bool, interpret: bool, *, segmented: bool, kv_heads: int, batch_row_bytes: int = 0,
) -> tuple[Items, jax.Array]:
    """The items of a kernel with ``plan`` over ``heads`` heads, which read the blocks of
    ``kv_heads`` key/value heads (see :func:`work_order` for the rest)."""
    batch, tiles = plan.shape[1:]
    count = batch * tiles * heads
    # The interpreter runs programs one after another: three show the walk across items.
    programs = min(count, 3) if interpret and persistent else program_count(count, persistent)
    if not segmented and batch * kv_heads <= programs // 2:
        # Every head plans the same blocks: costliest first, each round already holds two tiles
        # of every key/value head, and sections only cost balance (causal S4096: the forward
        # slower in sections).
        batch_row_bytes = 0
    return Items(count, programs, heads, tiles), work_order(plan, heads, programs, batch_row_bytes=batch_row_bytes)
