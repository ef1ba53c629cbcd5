"""The vocabulary of a fingerprint: nodes, their kinds, and the headers of the byte grammar.

Every value is fingerprinted through what :mod:`.table` reduces it to, a :class:`Node`: a
*kind* (one of the six below), a *type tag* and either a leaf payload or children. The byte
encoding (:mod:`.encoding`) writes each node as its kind letter and length-prefixed tag (its
:func:`header`), so the headers are built here, once per tag, and shared by the walkers and the
table. :class:`Unsupported` is how the table says it has no rule for a value; the walkers turn
it into a ``TypeError`` naming the value's type and where it sits.
"""

from __future__ import annotations

import functools
from typing import Any, NamedTuple

from ejlabel.utils.modules import public_module_name

__all__ = [
    "CACHE_LIMIT", "INT", "LEAF", "MAP", "RECORD", "SEQ", "SET", "Node", "Unsupported",
    "header", "lp", "qualified_name", "record_header", "text_bytes",
]

# Node kinds.  Small ints rather than an Enum: they are compared in hot loops.
INT, LEAF, SEQ, RECORD, SET, MAP = range(6)
_KIND_LETTER = {INT: b"I", LEAF: b"L", SEQ: b"Q", RECORD: b"R", SET: b"S", MAP: b"M"}

#: Entries a memo in front of the fingerprint holds before it is emptied and starts again.
CACHE_LIMIT = 4096


class Node(NamedTuple):
    """One value reduced to what its fingerprint depends on.

    ``payload`` depends on ``kind``: INT an int; LEAF a str or bytes; SEQ and
    SET a sequence of children; RECORD a pair (field names, field values);
    MAP a mapping from keys to values.
    """

    kind: int
    tag: str
    payload: Any


class Unsupported(Exception):
    """Raised by the table for a value it has no rule for."""

    def __init__(self, obj: Any, reason: str = "") -> None:
        super().__init__(repr(type(obj)))
        self.obj = obj
        self.reason = reason

    def message(self, where: str) -> str:
        text = f"cannot fingerprint {type(self.obj)!r} at {where}"
        return f"{text}: {self.reason}" if self.reason else text


def qualified_name(tp: type) -> str:
    """``module.qualname`` of a class, used as the type part of a tag (a script's ``__main__``
    under the script's module name, so the script and a process importing it key alike)."""
    return f"{public_module_name(tp.__module__)}.{tp.__qualname__}"


def lp(data: bytes) -> bytes:
    """Length-prefixed bytes."""
    return b"%d:%b" % (len(data), data)


def text_bytes(text: str) -> bytes:
    # surrogatepass: any Python str, even one holding lone surrogates, encodes.
    return text.encode("utf-8", "surrogatepass")


@functools.cache
def header(kind: int, tag: str) -> bytes:
    """Kind letter plus length-prefixed tag, shared by every node of that tag."""
    return _KIND_LETTER[kind] + lp(text_bytes(tag))


_RECORD_HEADERS: dict[tuple[str, tuple[str, ...]], bytes] = {}


def record_header(tag: str, names: tuple[str, ...]) -> bytes:
    """Header of a record node: its tag, field count and field names, made once per record shape."""
    key = (tag, names)
    head = _RECORD_HEADERS.get(key)
    if head is None:
        head = header(RECORD, tag) + b"%d;" % len(names) + b"".join(lp(text_bytes(n)) for n in names)
        _RECORD_HEADERS[key] = head
    return head
