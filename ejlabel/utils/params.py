"""Launch parameters of the forward and backward kernels, and heuristics to pick them.

A kernel call is tuned by four numbers: the query and key/value tile sizes, the number of
warps per program, and the software-pipelining depth (stages). :class:`FwdParams` and
:class:`BwdParams` hold them; ``None`` means "not chosen here", so partial choices from
different sources (user override, cache, heuristic) compose with :meth:`~FwdParams.merge`.
Both classes are frozen and hashable, so they can key caches and live in static arguments of
jitted functions.

:func:`select_num_warps` and :func:`select_num_stages` give defaults for fields nobody set.
They are deliberately simple rules of thumb; tuning replaces them where it matters.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Self

import numpy as np

__all__ = ["BwdParams", "FwdParams", "select_num_stages", "select_num_warps"]

_VALID_NUM_WARPS = (1, 2, 4, 8, 16)


def _is_int(value: Any) -> bool:
    # bool is an int subclass, but True as a block size is always a mistake.
    return isinstance(value, (int, np.integer)) and not isinstance(value, (bool, np.bool_))


def _is_power_of_two(value: int) -> bool:
    return value > 0 and value & (value - 1) == 0


_EXTRA_TILES = ("blocksize_m", "blocksize_k", "blocksize_n", "blocksize_heads", "blocksize_keys")


@dataclass(frozen=True)
class _LaunchParams:
    """Fields and behaviour shared by :class:`FwdParams` and :class:`BwdParams`."""

    q_blocksize: int | None = None
    kv_blocksize: int | None = None
    num_warps: int | None = None
    num_stages: int | None = None
    # ejkernel's further tile sizes (matmul-style m/k/n tiles, head and key blocks): positive ints.
    blocksize_m: int | None = None
    blocksize_k: int | None = None
    blocksize_n: int | None = None
    blocksize_heads: int | None = None
    blocksize_keys: int | None = None

    def __post_init__(self) -> None:
        for name in _EXTRA_TILES:
            value = getattr(self, name)
            if value is not None and not (_is_int(value) and value >= 1):
                raise ValueError(f"{name} must be a positive int or None, got {value!r}")
        for name in ("q_blocksize", "kv_blocksize"):
            value = getattr(self, name)
            if value is not None and not (_is_int(value) and _is_power_of_two(int(value))):
                raise ValueError(f"{name} must be a positive power of two or None, got {value!r}")
        if self.num_warps is not None and not (
            _is_int(self.num_warps) and int(self.num_warps) in _VALID_NUM_WARPS
        ):
            raise ValueError(
                f"num_warps must be one of {_VALID_NUM_WARPS} or None, got {self.num_warps!r}"
            )
        if self.num_stages is not None and not (_is_int(self.num_stages) and self.num_stages >= 1):
            raise ValueError(f"num_stages must be an int >= 1 or None, got {self.num_stages!r}")
        # Store plain ints so numpy integers do not leak into hashes, reprs and serialized
        # configs.
        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            if value is not None:
                object.__setattr__(self, field.name, int(value))

    def to_dict(self) -> dict[str, int | None]:
        """All fields by name, including those left as None.

        Unset fields are kept so the result has a fixed set of keys and
        ``type(p)(**p.to_dict()) == p`` always holds.
        """
        return {field.name: getattr(self, field.name) for field in dataclasses.fields(self)}

    def merge(self, other: _LaunchParams | Mapping[str, int | None]) -> Self:
        """A new instance of this class where the fields set in ``other`` win.

        A field counts as set when it is not None, so merging never erases a choice. ``other``
        can be any launch-parameter object (forward or backward) or a mapping of field names;
        unknown names raise ValueError rather than being dropped silently.
        """
        if isinstance(other, _LaunchParams):
            updates = other.to_dict()
        elif isinstance(other, Mapping):
            known = {field.name for field in dataclasses.fields(self)}
            unknown = sorted(str(key) for key in other if key not in known)
            if unknown:
                raise ValueError(
                    f"other has unknown fields {unknown}; expected some of {sorted(known)}"
                )
            updates = dict(other)
        else:
            raise ValueError(
                "other must be FwdParams, BwdParams or a mapping of field names, "
                f"got {type(other).__name__}"
            )
        overrides = {name: value for name, value in updates.items() if value is not None}
        return dataclasses.replace(self, **overrides)


@dataclass(frozen=True)
class FwdParams(_LaunchParams):
    """Launch parameters of a forward kernel; every field None means "use the default".

    Attributes:
        q_blocksize: rows of the query tile per program, a power of two.
        kv_blocksize: rows of the key/value tile per loop step, a power of two.
        num_warps: warps per program, one of 1, 2, 4, 8, 16.
        num_stages: software-pipelining depth, >= 1.
        blocksize_m, blocksize_k, blocksize_n, blocksize_heads, blocksize_keys: ejkernel's
            further tile sizes, positive ints (not necessarily powers of two).
    """


@dataclass(frozen=True)
class BwdParams(_LaunchParams):
    """Launch parameters of a backward kernel; same fields and rules as :class:`FwdParams`.

    A separate class so a forward choice cannot be passed where a backward one is expected by
    accident; :meth:`from_fwd_params` makes the conversion explicit.
    """

    @classmethod
    def from_fwd_params(cls, fwd: FwdParams) -> BwdParams:
        """Backward parameters starting from the forward ones (all fields are shared)."""
        if not isinstance(fwd, FwdParams):
            raise ValueError(f"fwd must be FwdParams, got {type(fwd).__name__}")
        return cls(**fwd.to_dict())


# --------------------------------------------------------------------------------------------
# Heuristics

_KIB = 1024
# Shared memory a single program may use, by compute capability. Unknown or absent devices
# get the smallest figure so the answer fits everywhere.
_SHARED_MEMORY_BYTES = {
    (8, 0): 164 * _KIB,
    (8, 7): 164 * _KIB,
    (9, 0): 228 * _KIB,
    (10, 0): 228 * _KIB,
}
_DEFAULT_SHARED_MEMORY_BYTES = 100 * _KIB
_DEFAULT_HEAD_DIM = 64
_DEFAULT_ITEMSIZE = 2  # 16-bit inputs are the common case for these kernels.
_MAX_STAGES = 4


def _check_positive_int(name: str, value: Any) -> int:
    if not _is_int(value) or value <= 0:
        raise ValueError(f"{name} must be a positive int, got {value!r}")
    return int(value)


def _itemsize(dtype: Any) -> int:
    if dtype is None:
        return _DEFAULT_ITEMSIZE
    try:
        return int(np.dtype(dtype).itemsize)
    except TypeError:
        raise ValueError(f"dtype must be a dtype or None, got {dtype!r}") from None


def select_num_warps(
    block_m: int, block_n: int, head_dim: int | None = None, *, dtype: Any = None
) -> int:
    """Warps per program for a ``block_m x block_n`` tile.

    The rule: tiles under 16x16 elements get 1 warp, under 32x32 get 2, under 128x128 get 4.
    Tiles of 128x128 and more get 8 when the accumulators are heavy, i.e. ``head_dim >= 128``,
    ``head_dim`` unknown (None), or 4-byte-or-wider ``dtype``; otherwise 4 keep enough
    registers per thread. The result never decreases as ``block_m``, ``block_n`` or
    ``head_dim`` grow.

    Args:
        block_m: query tile rows.
        block_n: key/value tile rows.
        head_dim: feature dimension of the tile, if known.
        dtype: input dtype; None means a 16-bit type.

    Returns:
        One of 1, 2, 4, 8.
    """
    block_m = _check_positive_int("block_m", block_m)
    block_n = _check_positive_int("block_n", block_n)
    if head_dim is not None:
        head_dim = _check_positive_int("head_dim", head_dim)
    itemsize = _itemsize(dtype)

    tile = block_m * block_n
    if tile < 16 * 16:
        return 1
    if tile < 32 * 32:
        return 2
    if tile < 128 * 128:
        return 4
    heavy = head_dim is None or head_dim >= 128 or itemsize >= 4
    return 8 if heavy else 4


def select_num_stages(
    block_m: int,
    block_n: int,
    head_dim: int | None = None,
    *,
    dtype: Any = None,
    device_capability: tuple[int, int] | None = None,
) -> int:
    """Pipelining depth that fits the tiles of an attention-style loop in shared memory.

    The query tile (``block_m x head_dim``) stays resident while each stage buffers one key
    and one value tile (``2 x block_n x head_dim``). The answer is how many stages fit in the
    device's shared memory after the resident tile, clamped to 1..4: deeper pipelines rarely
    help and a kernel always needs at least one stage. Budgets: 228 KiB on compute capability
    9.0 and 10.0, 164 KiB on 8.0 and 8.7, 100 KiB otherwise and when ``device_capability`` is
    None. The result never increases as ``block_m``, ``block_n``, ``head_dim`` or the dtype
    size grow.

    Args:
        block_m: query tile rows.
        block_n: key/value tile rows.
        head_dim: feature dimension of the tiles; None assumes 64.
        dtype: input dtype; None means a 16-bit type.
        device_capability: ``(major, minor)`` compute capability, if known.

    Returns:
        An int in 1..4.
    """
    block_m = _check_positive_int("block_m", block_m)
    block_n = _check_positive_int("block_n", block_n)
    head_dim = _DEFAULT_HEAD_DIM if head_dim is None else _check_positive_int("head_dim", head_dim)
    itemsize = _itemsize(dtype)
    if device_capability is None:
        budget = _DEFAULT_SHARED_MEMORY_BYTES
    else:
        if not (
            isinstance(device_capability, tuple)
            and len(device_capability) == 2
            and all(_is_int(v) and v >= 0 for v in device_capability)
        ):
            raise ValueError(
                "device_capability must be a (major, minor) tuple of non-negative ints or None, "
                f"got {device_capability!r}"
            )
        key = (int(device_capability[0]), int(device_capability[1]))
        budget = _SHARED_MEMORY_BYTES.get(key, _DEFAULT_SHARED_MEMORY_BYTES)

    resident = block_m * head_dim * itemsize
    per_stage = 2 * block_n * head_dim * itemsize
    fits = (budget - resident) // per_stage
    return int(max(1, min(_MAX_STAGES, fits)))
