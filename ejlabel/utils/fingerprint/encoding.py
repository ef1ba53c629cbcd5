"""The byte encoding behind :func:`~.keys.short_hash`: an iterative walk over any value.

:func:`encode` writes a compact, type-tagged, length-prefixed byte string, in which every item
is self-delimiting, so the whole is unambiguous::

    I<8 bytes>                        Python int in int64 range (little-endian)
    J<len>:<hex>                      any other Python int
    L<tag><payload>                   leaf; tag and payload are <len>:<bytes>
    Q<tag><n>; child*n                ordered sequence (list, tuple, ...)
    R<tag><n>; name*n child*n         record with named fields, in field order
    S<tag><n>; digest*n               unordered set; children's digests sorted
    K<tag><n>; key*n value*n          mapping with only str keys, sorted by key
    M<tag><n>; digest*n               other mapping; digests of (key value) sorted
    B<depth>;                         back-reference to an ancestor on the path

It walks with an explicit stack, so depth is bounded only by memory, and it treats a container
met again on the current path as a back-reference to its depth on that path, so cycles
terminate with a stable result. Sets and non-str-keyed mappings encode each child apart and
write the children's digests sorted, so neither insertion order nor the hash seed matters.

It runs on every traced kernel call, so the commonest types (str, int, float, tuple, arrays,
bool, None, str-keyed dicts, dataclasses seen before) skip the table (:mod:`.table`) and
short strings, array signatures and named leaves are remembered. The fast path must produce the
very bytes the table gives; ``encode(value, fast=False)`` takes the table's route for every
value, which is how the tests check it.
"""

from __future__ import annotations

import hashlib
import struct
from array import array
from typing import Any

import numpy as np

from ejlabel.utils.fingerprint.arrays import reduce_array
from ejlabel.utils.fingerprint.grammar import CACHE_LIMIT, INT, LEAF, MAP, RECORD, SEQ, SET, Node, header, lp, record_header
from ejlabel.utils.fingerprint.table import (
    CACHED_ARRAY_TYPES,
    DATACLASS_INFO,
    LEAF_CACHE,
    LEAF_CACHE_TYPES,
    ONLY_STR,
    UNTRACKED,
    reduce_value,
    str_keyed,
)

__all__ = ["encode"]


class _Exit:
    """Leave the most recent tracked container on the current path."""


class _SubBegin:
    """Start a private buffer for one child of an unordered container."""


class _SubEnd:
    """Digest the private buffer into ``digests`` and resume the parent buffer."""

    __slots__ = ("digests",)

    def __init__(self, digests: list[bytes]) -> None:
        self.digests = digests


class _Sorted:
    """Write the collected child digests in sorted order."""

    __slots__ = ("digests",)

    def __init__(self, digests: list[bytes]) -> None:
        self.digests = digests


_EXIT = _Exit()
_SUB_BEGIN = _SubBegin()

_STR_HEAD = header(LEAF, "str")
_FLOAT_HEAD = header(LEAF, "float")
_TUPLE_HEAD = header(SEQ, "tuple")
_DICT_STR_HEAD = b"K" + header(MAP, "dict")[1:]
_TRUE = header(LEAF, "bool") + lp(b"1")
_FALSE = header(LEAF, "bool") + lp(b"0")
_NONE = header(LEAF, "none") + lp(b"")
_DIGEST_SIZE = 16

# An int in int64 range is b"I" and 8 little-endian bytes: one C call to make,
# and a long list of them can be packed at once.  Larger ints use hex text.
_INT_TAG = ord("I")
_PACK_INT = struct.Struct("<Bq").pack
_INT_RUN_DTYPE = np.dtype([("tag", "u1"), ("value", "<i8")])
_ONLY_INT = frozenset({int})


def _int_bytes(n: int) -> bytes:
    try:
        return _PACK_INT(_INT_TAG, n)
    except struct.error:
        return b"J" + lp(hex(n).encode("ascii"))


def _int_run(seq: Any) -> bytes | None:
    """Encoding of a long run of Python ints, the same bytes as one
    :func:`_int_bytes` each but built at C speed; None if one is too large."""
    if len(seq) <= 8 or frozenset(map(type, seq)) != _ONLY_INT:
        return None
    try:
        packed = array("q", seq)
    except OverflowError:
        return None
    records = np.empty(len(packed), _INT_RUN_DTYPE)
    records["tag"] = _INT_TAG
    records["value"] = np.frombuffer(packed, dtype=np.int64)
    return records.tobytes()


_STR_CACHE: dict[str, bytes] = {}


def _str_bytes(s: str) -> bytes:
    """Encoding of a str leaf; short ones (argument names, modes) recur on
    every call, so they are remembered."""
    data = _STR_CACHE.get(s)
    if data is None:
        raw = s.encode("utf-8", "surrogatepass")
        data = _STR_HEAD + b"%d:%b" % (len(raw), raw)
        if len(s) <= 64:
            if len(_STR_CACHE) >= CACHE_LIMIT:
                _STR_CACHE.clear()
            _STR_CACHE[s] = data
    return data


_ARRAY_CACHE: dict[tuple[Any, ...], bytes] = {}


def _array_bytes(obj: Any, key: tuple[Any, ...]) -> bytes:
    """Encoding of an array's abstract value, remembered under ``key`` (shape,
    dtype, weak type, sharding) since a kernel sees few distinct signatures."""
    data = encode(reduce_array(obj))
    if len(_ARRAY_CACHE) >= CACHE_LIMIT:
        _ARRAY_CACHE.clear()
    _ARRAY_CACHE[key] = data
    return data


def _remember_leaf(obj: Any, data: bytes) -> None:
    if len(LEAF_CACHE) >= CACHE_LIMIT:
        LEAF_CACHE.clear()
    # The object is kept with its bytes so a reused id can never match.
    LEAF_CACHE[id(obj)] = (obj, data)


def encode(root: Any, fast: bool = True) -> bytearray:
    """Byte encoding of ``root``; see the module docstring for the grammar.

    With ``fast`` the commonest types skip the table; they must produce the
    very bytes the table gives (``fast=False`` exists to check that).
    Raises :class:`Unsupported` for a value with no rule.
    """
    out = bytearray()
    saved: list[bytearray] = []
    stack: list[Any] = [root]
    path: list[Any] = []  # tracked ancestors, kept alive so their ids stay theirs
    depth_of: dict[int, int] = {}
    pop, push, extend = stack.pop, stack.append, stack.extend
    while stack:
        obj = pop()
        t = type(obj)
        if fast:
            if t is str:
                data = _STR_CACHE.get(obj)
                out += data if data is not None else _str_bytes(obj)
                continue
            if t is int:
                try:
                    out += _PACK_INT(_INT_TAG, obj)
                except struct.error:
                    out += _int_bytes(obj)
                continue
            if t is float:
                data = obj.hex().encode("ascii")
                out += _FLOAT_HEAD
                out += b"%d:%b" % (len(data), data)
                continue
            if t is tuple:
                out += _TUPLE_HEAD
                out += b"%d;" % len(obj)
                run = _int_run(obj) if len(obj) > 8 else None
                if run is None:
                    extend(reversed(obj))
                else:
                    out += run
                continue
            if t in CACHED_ARRAY_TYPES:
                key = (obj.shape, obj.dtype, obj.weak_type, obj.sharding)
                data = _ARRAY_CACHE.get(key)
                out += data if data is not None else _array_bytes(obj, key)
                continue
            if t is bool:
                out += _TRUE if obj else _FALSE
                continue
            if obj is None:
                out += _NONE
                continue
            if t is dict and frozenset(map(type, obj)) <= ONLY_STR:
                i = id(obj)
                d = depth_of.get(i)
                if d is not None:
                    out += b"B%d;" % d
                    continue
                keys = sorted(obj)
                out += _DICT_STR_HEAD
                out += b"%d;" % len(keys)
                for k in keys:
                    data = _STR_CACHE.get(k)
                    out += data if data is not None else _str_bytes(k)
                depth_of[i] = len(path)
                path.append(obj)
                push(_EXIT)
                extend(map(obj.__getitem__, reversed(keys)))
                continue
            info = DATACLASS_INFO.get(t)
            if info is not None:
                # A dataclass seen before: the table's record, with its
                # header made once per class.
                i = id(obj)
                d = depth_of.get(i)
                if d is not None:
                    out += b"B%d;" % d
                    continue
                out += info[3]
                depth_of[i] = len(path)
                path.append(obj)
                push(_EXIT)
                extend(reversed(info[2](obj)))
                continue
            # Lists, other dicts and everything else take the table's route.
        if t is _Exit:
            del depth_of[id(path.pop())]
            continue
        if t is _SubBegin:
            saved.append(out)
            out = bytearray()
            continue
        if t is _SubEnd:
            obj.digests.append(hashlib.blake2b(out, digest_size=_DIGEST_SIZE).digest())
            out = saved.pop()
            continue
        if t is _Sorted:
            obj.digests.sort()
            out += b"".join(obj.digests)
            continue

        # The table's route.
        if t is Node:
            node = obj
        else:
            i = id(obj)
            hit = LEAF_CACHE.get(i)
            if hit is not None and hit[0] is obj:
                out += hit[1]
                continue
            d = depth_of.get(i)
            if d is not None:
                out += b"B%d;" % d
                continue
            node = reduce_value(obj)
        kind, tag, payload = node
        if kind == INT:
            out += _int_bytes(payload)
            continue
        if kind == LEAF:
            data = payload if isinstance(payload, bytes) else payload.encode("utf-8", "surrogatepass")
            data = header(LEAF, tag) + b"%d:%b" % (len(data), data)
            out += data
            if t in LEAF_CACHE_TYPES:
                _remember_leaf(obj, data)
            continue
        if t not in UNTRACKED:
            depth_of[id(obj)] = len(path)
            path.append(obj)
            push(_EXIT)
        if kind == SEQ:
            out += header(SEQ, tag)
            out += b"%d;" % len(payload)
            run = _int_run(payload) if len(payload) > 8 else None
            if run is None:
                extend(reversed(payload))
            else:
                out += run
        elif kind == RECORD:
            names, values = payload
            out += record_header(tag, names)
            extend(reversed(values))
        elif kind == SET or not str_keyed(payload):
            # Unordered children: each is encoded apart, then the digests are
            # written sorted.  A map's child is a key followed by its value.
            out += header(kind, tag)
            out += b"%d;" % len(payload)
            digests: list[bytes] = []
            end = _SubEnd(digests)
            push(_Sorted(digests))
            children = [(item,) for item in payload] if kind == SET else payload.items()
            for child in children:
                push(end)
                extend(reversed(child))
                push(_SUB_BEGIN)
        else:
            # A map with only str keys: the keys, sorted, then their values.
            keys = sorted(payload)
            out += b"K" + header(MAP, tag)[1:]
            out += b"%d;" % len(keys)
            for k in keys:
                out += _str_bytes(k)
            extend(map(payload.__getitem__, reversed(keys)))
    return out
