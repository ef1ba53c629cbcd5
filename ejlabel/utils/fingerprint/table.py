"""The reduction table: the one place that says what any value's fingerprint depends on.

:func:`reduce_value` turns one value into a :class:`~.grammar.Node`, one level deep: a kind, a
type tag and a payload or children. Both walkers read it, the byte encoder behind
:func:`~.keys.short_hash` (:mod:`.encoding`) and the JSON renderer behind
:func:`~.keys.stable_json` (:mod:`.rendering`), so the hash and its readable form can never
disagree.

The rule for a class is picked once and memoised (:func:`reduce_value`): the builtin scalars and
containers first (their encoding is the key format and cannot be overridden), then the user's
registrations (:func:`register_fingerprint`, nearest class in the MRO first), then the
protocols the library knows: enums, named tuples, dataclasses, pydantic models, arrays
(:mod:`.arrays`), dtypes, shardings, meshes, devices, partials, classes and functions
(:mod:`.names`), subclasses of builtins (tagged with their own class name, so a ``str``
subclass never equals a ``str``). Everything else is named callables and pytree nodes, or an
error.

The memos here that depend on the rules (picked rules, dataclass record headers, the leaf
encodings the encoder remembers by object) are emptied by every registration, so a new rule
applies at once.
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import json
import operator
import sys
import types
from collections.abc import Callable
from typing import Any

import jax
import numpy as np
from jax.sharding import PartitionSpec, Sharding

from ejlabel.utils.fingerprint.arrays import (
    dtype_text,
    mesh_parts,
    normalized_spec,
    reduce_array,
    reduce_numpy_scalar,
    sharding_fingerprint,
)
from ejlabel.utils.fingerprint.devices import device_fingerprint
from ejlabel.utils.fingerprint.grammar import INT, LEAF, MAP, RECORD, SEQ, SET, Node, qualified_name, record_header
from ejlabel.utils.fingerprint.names import (
    EmptyCell,
    reduce_builtin_function,
    reduce_code,
    reduce_descriptor,
    reduce_function,
    reduce_method,
    reduce_other,
    reduce_partial,
    reduce_type,
)

__all__ = [
    "CACHED_ARRAY_TYPES", "DATACLASS_INFO", "LEAF_CACHE", "LEAF_CACHE_TYPES", "ONLY_STR", "UNTRACKED",
    "DataclassInfo", "reduce_value", "register_fingerprint", "scalar_memo_key", "str_keyed",
]

_REGISTRY: dict[type, Callable[[Any], Any]] = {}
_REDUCER_CACHE: dict[type, Callable[[Any], Node]] = {}
# Array classes whose encoding the byte walker caches by abstract value.
CACHED_ARRAY_TYPES: set[type] = {jax.ShapeDtypeStruct}
DataclassInfo = tuple[str, tuple[str, ...], Callable[[Any], tuple[Any, ...]], bytes]
DATACLASS_INFO: dict[type, DataclassInfo] = {}
# Classes whose leaf encodings may be remembered by object: named, immutable
# things such as classes, module-level functions, dtypes and enum members.
LEAF_CACHE_TYPES: set[type] = set()
# The byte encoder's memo of those leaves: id -> (the object, its bytes).
LEAF_CACHE: dict[int, tuple[Any, bytes]] = {}
_NAMED_IMMUTABLE = (type, types.FunctionType, types.BuiltinFunctionType, types.ModuleType, np.dtype, enum.Enum)


def scalar_memo_key(value: Any) -> Any:
    """A hashable key for an immutable scalar that is equal exactly when the values' call-key
    encodings are, for memos in front of the fingerprint (``kernel._memoised_call_key``).

    ``(type(value), value)`` is not such a key: ``0.0 == -0.0`` and ``0j == -0j`` although their
    encodings differ, so a memo keyed that way answered whichever sign it met first, making the
    key depend on call order. Floats and complex numbers are keyed by their exact text
    (``float.hex``, as the table encodes them: -0.0 apart from 0.0, every NaN alike),
    numpy scalars by their raw bytes (NaN payloads apart, as their encoding keeps them).
    """
    t = type(value)
    if isinstance(value, np.generic):
        return (t, value.dtype.str, value.tobytes())
    if isinstance(value, float):
        return (t, value.hex())
    if isinstance(value, complex):
        return (t, value.real.hex(), value.imag.hex())
    return (t, value)


def register_fingerprint(type_: type, fn: Callable[[Any], Any]) -> None:
    """Teach the hasher a user type.

    ``fn(obj)`` must return a value that can already be fingerprinted (its
    *reduction*); the fingerprint is that of the reduction tagged with the
    object's class name.  Subclasses of ``type_`` use ``fn`` too unless a
    registration for a closer class exists.  The builtin scalar and container
    types cannot be overridden: their encoding is part of the key format.
    """
    if type_ in _BUILTIN_REDUCERS:
        raise ValueError(f"cannot override the fingerprint of builtin type {type_!r}")
    _REGISTRY[type_] = fn
    _REDUCER_CACHE.clear()
    LEAF_CACHE_TYPES.clear()
    LEAF_CACHE.clear()
    DATACLASS_INFO.clear()


def _reduce_float(x: float) -> Node:
    # float.hex is exact and tells 0.0 from -0.0; every NaN becomes "nan".
    return Node(LEAF, "float", x.hex())


def _dataclass_info(tp: type) -> DataclassInfo:
    """Tag, field names, field reader and record header of a dataclass, made
    once per class."""
    names = tuple(f.name for f in dataclasses.fields(tp))
    if len(names) >= 2:
        read: Callable[[Any], tuple[Any, ...]] = operator.attrgetter(*names)
    else:
        # attrgetter of one name returns the bare value, not a 1-tuple.
        def read(obj: Any) -> tuple[Any, ...]:
            return tuple(getattr(obj, n) for n in names)

    tag = "dataclass:" + qualified_name(tp)
    info = (tag, names, read, record_header(tag, names))
    DATACLASS_INFO[tp] = info
    return info


def _reduce_dataclass(obj: Any) -> Node:
    # Fields read one by one (in definition order) rather than through
    # dataclasses.asdict, which deep-copies every value.
    tag, names, read, _ = DATACLASS_INFO.get(type(obj)) or _dataclass_info(type(obj))
    return Node(RECORD, tag, (names, read(obj)))


def _reduce_namedtuple(obj: Any) -> Node:
    tp = type(obj)
    return Node(RECORD, "namedtuple:" + qualified_name(tp), (tuple(tp._fields), tuple(obj)))


def _reduce_enum(obj: enum.Enum) -> Node:
    name = obj.name if obj.name is not None else repr(obj.value)
    return Node(LEAF, "enum:" + qualified_name(type(obj)), name)


def _reduce_pydantic(obj: Any) -> Node:
    return Node(SEQ, "pydantic:" + qualified_name(type(obj)), (obj.model_dump(),))


def _registered_reducer(fn: Callable[[Any], Any]) -> Callable[[Any], Node]:
    def reduce(obj: Any) -> Node:
        return Node(SEQ, "registered:" + qualified_name(type(obj)), (fn(obj),))

    return reduce


_BUILTIN_REDUCERS: dict[type, Callable[[Any], Node]] = {
    int: lambda x: Node(INT, "int", x),
    bool: lambda x: Node(LEAF, "bool", "1" if x else "0"),
    type(None): lambda x: Node(LEAF, "none", ""),
    float: _reduce_float,
    complex: lambda x: Node(LEAF, "complex", f"{x.real.hex()},{x.imag.hex()}"),
    str: lambda x: Node(LEAF, "str", x),
    bytes: lambda x: Node(LEAF, "bytes", x),
    bytearray: lambda x: Node(LEAF, "bytearray", bytes(x)),
    list: lambda x: Node(SEQ, "list", x),
    tuple: lambda x: Node(SEQ, "tuple", x),
    dict: lambda x: Node(MAP, "dict", x),
    set: lambda x: Node(SET, "set", x),
    frozenset: lambda x: Node(SET, "frozenset", x),
    slice: lambda x: Node(SEQ, "slice", (x.start, x.stop, x.step)),
    range: lambda x: Node(SEQ, "range", (x.start, x.stop, x.step)),
    type(...): lambda x: Node(LEAF, "ellipsis", ""),
    type(NotImplemented): lambda x: Node(LEAF, "notimplemented", ""),
    EmptyCell: lambda x: Node(LEAF, "empty_cell", ""),
    types.CodeType: reduce_code,
    types.FunctionType: reduce_function,
    types.MethodType: reduce_method,
    types.BuiltinFunctionType: reduce_builtin_function,
    types.ModuleType: lambda m: Node(LEAF, "module", m.__name__),
    PartitionSpec: lambda p: Node(LEAF, "partition_spec", json.dumps(normalized_spec(p), separators=(",", ":"))),
    jax.ShapeDtypeStruct: reduce_array,
    np.ndarray: reduce_array,
}


# Subclasses of builtin containers and scalars keep their builtin encoding
# under their own class name, so a str subclass never equals a str.
_BUILTIN_BASES = (bool, int, float, complex, str, bytes, list, tuple, dict, set, frozenset)


def _subclass_reducer(base: type) -> Callable[[Any], Node]:
    base_reduce = _BUILTIN_REDUCERS[base]

    def reduce(obj: Any) -> Node:
        kind, tag, payload = base_reduce(obj)
        if kind == INT:
            # The bare int form carries no tag; a tagged leaf does.
            kind, payload = LEAF, hex(payload)
        return Node(kind, f"{tag}:{qualified_name(type(obj))}", payload)

    return reduce


def _resolve_reducer(tp: type) -> Callable[[Any], Node]:
    """The rule for a class, noting whether its leaves may be remembered."""
    reducer = _pick_reducer(tp)
    if reducer is reduce_other or issubclass(tp, _NAMED_IMMUTABLE):
        LEAF_CACHE_TYPES.add(tp)
    return reducer


def _pick_reducer(tp: type) -> Callable[[Any], Node]:
    """Pick the rule for a class: builtins, then user registrations (nearest
    class in the MRO first), then the protocols the library knows."""
    exact = _BUILTIN_REDUCERS.get(tp)
    if exact is not None:
        return exact
    for base in tp.__mro__:
        fn = _REGISTRY.get(base)
        if fn is not None:
            return _registered_reducer(fn)
    if issubclass(tp, enum.Enum):
        return _reduce_enum
    if issubclass(tp, tuple) and hasattr(tp, "_fields"):
        return _reduce_namedtuple
    if dataclasses.is_dataclass(tp):
        return _reduce_dataclass
    pydantic = sys.modules.get("pydantic")
    if pydantic is not None and issubclass(tp, pydantic.BaseModel):
        return _reduce_pydantic
    if issubclass(tp, (jax.core.Tracer, np.ndarray)):
        return reduce_array
    if issubclass(tp, (jax.Array, jax.ShapeDtypeStruct)):
        # Concrete jax arrays have shape, dtype, weak_type and sharding like a
        # ShapeDtypeStruct, so they share its cached encoding.
        CACHED_ARRAY_TYPES.add(tp)
        return reduce_array
    if issubclass(tp, np.generic):
        return reduce_numpy_scalar
    if issubclass(tp, np.dtype):
        return lambda d: Node(LEAF, "dtype", dtype_text(d))
    if issubclass(tp, Sharding):
        return lambda s: Node(LEAF, "sharding", sharding_fingerprint(s) or "single_device")
    if issubclass(tp, jax.sharding.Mesh):
        return lambda m: Node(LEAF, "mesh", json.dumps(mesh_parts(m), separators=(",", ":")))
    if issubclass(tp, jax.Device):
        return lambda d: Node(LEAF, "device", f"{device_fingerprint(d)}#{d.id}")
    if issubclass(tp, functools.partial):
        return reduce_partial
    if issubclass(tp, type):
        return reduce_type
    if tp in (types.MethodDescriptorType, types.WrapperDescriptorType, types.ClassMethodDescriptorType):
        return reduce_descriptor
    for base in _BUILTIN_BASES:
        if issubclass(tp, base):
            return _subclass_reducer(base)
    return reduce_other


def reduce_value(obj: Any) -> Node:
    """The table: reduce one value to a :class:`Node` (one level deep)."""
    tp = type(obj)
    reducer = _REDUCER_CACHE.get(tp)
    if reducer is None:
        reducer = _resolve_reducer(tp)
        _REDUCER_CACHE[tp] = reducer
    return reducer(obj)


# Containers whose contents cannot hold a path back to themselves without a
# mutable container in between, which is tracked instead.
UNTRACKED = frozenset({tuple, frozenset, slice, range, Node})
ONLY_STR = frozenset({str})


def str_keyed(mapping: Any) -> bool:
    """Whether every key is a str, so keys alone give a canonical order."""
    return frozenset(map(type, mapping)) <= ONLY_STR
