"""One entry of the persistent cache: its key, what it holds, and the error every part raises.

A row is keyed by ``(device, op_id, call_key)``:

* ``device``: the device fingerprint, so a config tuned on one accelerator is never used on another;
* ``op_id``: kernel name and version (``"matmul@v2"``), so a new kernel version never sees the
  configs of an old one;
* ``call_key``: 16 lowercase hex digits naming the call (shapes, dtypes, ...).

:func:`normalize_key` checks a key where it is built, so a malformed one fails with an error
naming the field instead of silently missing. :class:`CacheEntry` is what a read gives back:
the config with its provenance, statistics and the versions it was tuned under.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Any

__all__ = [
    "STATUS_OK", "STATUS_UNDECODABLE", "CacheEntry", "CacheError", "kernel_version_of", "normalize_key", "split_key",
]

STATUS_OK = "ok"
STATUS_UNDECODABLE = "undecodable"

_CALL_KEY_RE = re.compile(r"[0-9a-f]{16}")


class CacheError(Exception):
    """The cache file cannot be used: not ours, corrupt, too new, or not reachable."""


@dataclasses.dataclass(frozen=True)
class CacheEntry:
    """One stored config with where it came from and what it was measured at.

    ``status`` is ``"ok"``, or ``"undecodable"`` when the stored config cannot be decoded here
    (then ``config`` is None and ``error`` says why); only
    ``PersistentCache.entries(include_undecodable=True)`` returns undecodable entries.
    """

    device: str
    op_id: str
    call_key: str
    config: Any
    config_type: str
    provenance: str
    stats: dict | None
    kernel_version: str
    jax_version: str
    jaxlib_version: str
    created: float
    status: str = STATUS_OK
    error: str | None = None


def normalize_key(dev: Any, op_id: Any = None, call_key: Any = None) -> tuple[str, str, str]:
    """Accept ``(dev, op_id, call_key)`` or one ``(dev, op_id, call_key)`` tuple; check and return it.

    Raises TypeError when the arguments have neither form and ValueError naming the field when
    a part is malformed, so a bad key fails where it is built instead of silently missing.
    """
    if op_id is None and call_key is None:
        if not isinstance(dev, (tuple, list)) or len(dev) != 3:
            raise TypeError(
                f"dev: expected a (device, op_id, call_key) tuple or three arguments, got {dev!r}"
            )
        dev, op_id, call_key = dev
    elif op_id is None or call_key is None:
        missing = "op_id" if op_id is None else "call_key"
        raise TypeError(f"{missing}: missing; pass (dev, op_id, call_key) or one 3-tuple")
    if not isinstance(dev, str) or not dev:
        raise ValueError(f"device: expected a non-empty string, got {dev!r}")
    if not isinstance(op_id, str) or not op_id:
        raise ValueError(f"op_id: expected a non-empty string such as 'matmul@v1', got {op_id!r}")
    if not isinstance(call_key, str) or not _CALL_KEY_RE.fullmatch(call_key):
        raise ValueError(f"call_key: expected 16 lowercase hex digits, got {call_key!r}")
    return dev, op_id, call_key


split_key = normalize_key


def kernel_version_of(op_id: str) -> str:
    """The version part of ``"name@v<version>"``; ValueError when ``op_id`` has none."""
    name, sep, version = op_id.rpartition("@v")  # not split_op_id: a missing version is an error here
    if not sep or not name or not version:
        raise ValueError(f"op_id: {op_id!r} has no '@v<version>' suffix; pass kernel_version explicitly")
    return version
