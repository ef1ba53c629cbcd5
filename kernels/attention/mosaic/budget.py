"""The shared-memory budget of a Mosaic GPU attention program (see
:mod:`ejlabel.kernels.attention.mosaic`): how much a program may hold, how deep its ring of
stages runs, and whether its tiles get a second buffer.

The kernels (:mod:`.forward`, :mod:`.backward`) size their buffers with it; the attention op's
config checks ask it whether a config's tiles fit (:func:`ejlabel.kernels.attention.mosaic.mosaic_fits`)
without importing the kernels, so it is arithmetic alone, importing nothing.
"""

from __future__ import annotations

__all__ = ["SMEM_BYTES", "fits_exactly", "ring_stages", "tile_buffers"]

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
    the dq kernel and the ``dk`` walk (two 128-row tiles) one."""
    if stages:
        return stages
    return 2 if tile_bytes + 2 * stage_bytes <= SMEM_BYTES else 1
