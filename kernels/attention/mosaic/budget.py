"""The shared-memory budget of a Mosaic GPU attention program (see
:mod:`ejlabel.kernels.attention.mosaic`): how much a program may hold, how deep its ring of
stages runs, and whether its tiles get a second buffer.

The kernels (:mod:`.forward`, :mod:`.backward`) size their buffers with it; the attention op's
config checks ask it whether a config's tiles fit (:func:`ejlabel.kernels.attention.mosaic.mosaic_fits`)
without importing the kernels, so it is arithmetic alone, importing nothing.
"""

from __future__ import annotations

__all__ = ["SMEM_BYTES", "fits_exactly", "ring_depths", "ring_stages", "tile_buffers"]

_SMEM_LIMIT = 227 * 1024  # Hopper's per-block limit of shared memory
SMEM_BYTES = _SMEM_LIMIT - 4096  # less room for barriers and id rings, where those are not counted


def fits_exactly(*buffer_bytes: int) -> bool:
    """Whether a kernel's buffers of these sizes (every one of them) fit in shared memory, each
    aligned to 1 KiB as Pallas places them, with 1 KiB to spare for the barriers."""
    return sum(-(-n // 1024) * 1024 for n in buffer_bytes) + 1024 <= _SMEM_LIMIT


def tile_buffers(tile_bytes: int, ring_bytes: int) -> int:
    """Buffers for a program's tile: two (the next item's tile loads during this one) when they
    fit in shared memory beside the ring, else one."""
    return 2 if 2 * tile_bytes + ring_bytes <= SMEM_BYTES else 1


def ring_stages(stages: int | None, tile_bytes: int, stage_bytes: int) -> int:
    """``stages`` if set, else the ring's default depth for a kernel that holds ``tile_bytes``
    of resident tiles and streams ``stage_bytes`` per stage: two stages where they fit beside
    one buffer of the tiles, else one. So up to head dim 128 every kernel gets two; above, the
    forward (one 128-row tile, 64-key blocks) and the ``dv`` walk (the key tile alone) get two,
    the dq kernel and the ``dk`` walk (two 128-row tiles) one, where :func:`ring_depths` gives
    the half of the stage they hold through a step a second slot."""
    if stages:
        return stages
    return 2 if tile_bytes + 2 * stage_bytes <= SMEM_BYTES else 1


def ring_depths(stages: int | None, tile_bytes: int, held_bytes: int, freed_bytes: int, *small_bytes: int) -> tuple[int, int]:
    """``(held, freed)``: the depths of a ring whose blocks come in two kinds, those a step holds
    to its end (the keys of the dq kernel, the queries of the ``dk`` walk) and those it frees
    mid-step (the values, ``dO``), beside ``tile_bytes`` of resident tiles and the
    ``small_bytes`` buffers (row terms, ids).

    ``stages`` if set, for both; else :func:`ring_stages` of the whole stage; where that gives
    one, two of the held blocks and one of the freed where they fit exactly (see
    :func:`fits_exactly`): the freed block loads during the rest of its step and the held one a
    whole step ahead, where with one slot each the next held block could load only once the
    step had ended. At head dim 256 (two 128-row tiles, 64-row blocks of 32 KiB) that fits with
    the row terms and the segment ids in one buffer each, exactly."""
    if stages:
        return stages, stages
    if ring_stages(None, tile_bytes, held_bytes + freed_bytes) == 2:
        return 2, 2
    if fits_exactly(tile_bytes, 2 * held_bytes, freed_bytes, *small_bytes):
        return 2, 1
    return 1, 1
