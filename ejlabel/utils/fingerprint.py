"""Stable fingerprints of kernel-call signatures, devices and shardings.

A tuned kernel config is stored under a key built from the call that asked for
it: the operation, the abstract arguments (shape, dtype, weak type, sharding,
never contents), the static keyword arguments and the device.  The key must be
the same in every process that makes the same call, and different whenever the
call differs in anything that could change the best config.

How a value is fingerprinted
----------------------------
One table, :func:`_reduce`, turns any supported value into a :class:`_Node`:
a *kind*, a *type tag* and either a leaf payload or children.  Two walkers
read that table:

* :func:`_encode` writes a compact, type-tagged, length-prefixed byte string
  (the input of :func:`short_hash`).  It inlines the commonest types so that
  hashing a call signature costs a few microseconds, and it produces exactly
  the bytes the table would (a test checks this).
* :func:`_render` writes canonical JSON for people (:func:`stable_json`), and
  reports the path to anything that cannot be fingerprinted.

Both walk with an explicit stack, so depth is bounded only by memory, and
both treat a container met again on the current path as a back-reference to
its depth on that path, so cycles terminate with a stable result.

Byte encoding (every item is self-delimiting, so the whole is unambiguous)::

    I<8 bytes>                        Python int in int64 range (little-endian)
    J<len>:<hex>                      any other Python int
    L<tag><payload>                   leaf; tag and payload are <len>:<bytes>
    Q<tag><n>; child*n                ordered sequence (list, tuple, ...)
    R<tag><n>; name*n child*n         record with named fields, in field order
    S<tag><n>; digest*n               unordered set; children's digests sorted
    K<tag><n>; key*n value*n          mapping with only str keys, sorted by key
    M<tag><n>; digest*n               other mapping; digests of (key value) sorted
    B<depth>;                         back-reference to an ancestor on the path
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import hashlib
import importlib
import json
import operator
import os
import struct
import sys
import types
from array import array
from collections.abc import Callable, Iterable
from typing import Any, NamedTuple

import jax
import jax.tree_util as jtu
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec, Sharding, SingleDeviceSharding

from ejlabel.utils.version import VERSION

__all__ = [
    "FINGERPRINT_VERSION",
    "SALT_ENV_VAR",
    "abstractify",
    "default_key_builder_with_sharding",
    "device_fingerprint",
    "device_kind",
    "get_device_platform",
    "register_fingerprint",
    "scalar_memo_key",
    "sharding_fingerprint",
    "short_hash",
    "stable_json",
]

#: Version of the key format.  Bump it whenever an encoding below changes so
#: that keys written by an older format can never be read back as current.
FINGERPRINT_VERSION: int = 1

#: Environment variable whose value is mixed into every hash, so that a user
#: can start a fresh cache namespace without deleting files.
SALT_ENV_VAR: str = "EJLABEL_CACHE_SALT"

# Node kinds.  Small ints rather than an Enum: they are compared in hot loops.
INT, LEAF, SEQ, RECORD, SET, MAP = range(6)
_KIND_LETTER = {INT: b"I", LEAF: b"L", SEQ: b"Q", RECORD: b"R", SET: b"S", MAP: b"M"}


class _Node(NamedTuple):
    """One value reduced to what its fingerprint depends on.

    ``payload`` depends on ``kind``: INT an int; LEAF a str or bytes; SEQ and
    SET a sequence of children; RECORD a pair (field names, field values);
    MAP a mapping from keys to values.
    """

    kind: int
    tag: str
    payload: Any


class _Unsupported(Exception):
    """Raised by the table for a value it has no rule for."""

    def __init__(self, obj: Any, reason: str = "") -> None:
        super().__init__(repr(type(obj)))
        self.obj = obj
        self.reason = reason

    def message(self, where: str) -> str:
        text = f"cannot fingerprint {type(self.obj)!r} at {where}"
        return f"{text}: {self.reason}" if self.reason else text


class _EmptyCell:
    """Stands in for a closure cell that has not been assigned yet."""


_EMPTY_CELL = _EmptyCell()
_MISSING = object()


# ---------------------------------------------------------------------------
# Names of classes and functions
# ---------------------------------------------------------------------------

# Objects already proven to be reachable by module + qualname, by id.  The
# object itself is stored so an id reused after garbage collection never
# matches; such objects live in modules anyway, so holding them costs nothing.
_RESOLVED: dict[int, Any] = {}


def _qualified_name(tp: type) -> str:
    """``module.qualname`` of a class, used as the type part of a tag."""
    return f"{tp.__module__}.{tp.__qualname__}"


def _resolves(obj: Any, module: Any, qualname: Any) -> bool:
    """Whether importing ``module`` and walking ``qualname`` yields ``obj`` itself.

    Only then is the name a faithful, process-independent stand-in for the
    object; a lambda, a local function or a rebound name is not.
    """
    if _RESOLVED.get(id(obj)) is obj:
        return True
    if not isinstance(module, str) or not isinstance(qualname, str) or "<" in qualname:
        return False
    target = sys.modules.get(module)
    if target is None:
        try:
            target = importlib.import_module(module)
        except Exception:
            return False
    for part in qualname.split("."):
        target = getattr(target, part, _MISSING)
        if target is _MISSING:
            return False
    if target is not obj:
        return False
    _RESOLVED[id(obj)] = obj
    return True


# ---------------------------------------------------------------------------
# Shardings and devices
# ---------------------------------------------------------------------------

_SHARDING_CACHE: dict[Sharding, str | None] = {}
_CACHE_LIMIT = 4096


def _normalized_spec(spec: PartitionSpec) -> list[Any]:
    """PartitionSpec entries with equivalent spellings made equal.

    ``('x',)`` and ``'x'`` shard a dimension the same way, ``()`` and ``None``
    both replicate it, and trailing ``None`` entries say nothing.
    """
    entries: list[Any] = []
    for entry in spec:
        if entry is PartitionSpec.UNCONSTRAINED:
            entries.append("<unconstrained>")
        elif isinstance(entry, tuple):
            names = [str(e) for e in entry]
            entries.append(None if not names else names[0] if len(names) == 1 else names)
        else:
            entries.append(None if entry is None else str(entry))
    while entries and entries[-1] is None:
        entries.pop()
    for extra in ("unreduced", "reduced"):
        axes = getattr(spec, extra, None)
        if axes:
            entries.append({extra: sorted(str(a) for a in axes)})
    return entries


def _mesh_parts(mesh: Any) -> dict[str, Any]:
    """Axis names, sizes, types and device ids (in mesh order) of a mesh."""
    names = [str(n) for n in mesh.axis_names]
    parts: dict[str, Any] = {"axes": [[n, int(s)] for n, s in zip(names, mesh.axis_sizes)]}
    axis_types = getattr(mesh, "axis_types", None)
    if axis_types:
        parts["axis_types"] = [getattr(t, "name", str(t)) for t in axis_types]
    devices = getattr(mesh, "devices", None)
    # An abstract mesh has no devices; its axes are all there is to say.
    if isinstance(devices, np.ndarray):
        parts["devices"] = [int(d.id) for d in devices.flat]
    return parts


def _compute_sharding_fingerprint(s: Sharding) -> str | None:
    if isinstance(s, SingleDeviceSharding):
        return None
    if isinstance(s, NamedSharding):
        parts = _mesh_parts(s.mesh)
        parts["spec"] = _normalized_spec(s.spec)
        parts["memory_kind"] = s.memory_kind
        return "named" + json.dumps(parts, separators=(",", ":"))
    # Other shardings: only public, address-free attributes, plus the HLO
    # sharding text where the class carries one (it names devices, not memory).
    tp = type(s)
    parts = {
        "devices": sorted(int(d.id) for d in s.device_set),
        "memory_kind": getattr(s, "memory_kind", None),
        "replicated": bool(getattr(s, "is_fully_replicated", False)),
    }
    assignment = getattr(s, "_device_assignment", None)
    if assignment is not None:
        parts["device_order"] = [int(d.id) for d in assignment]
    hlo = getattr(s, "_hlo_sharding", None)
    if hlo is not None:
        parts["hlo"] = str(hlo)
    return _qualified_name(tp) + json.dumps(parts, separators=(",", ":"))


def sharding_fingerprint(x: Any) -> str | None:
    """Stable text describing how ``x`` is laid out over devices, or None.

    ``x`` may be a jax Array, a ShapeDtypeStruct or a Sharding.  A
    NamedSharding gives its mesh axis names and sizes, device ids in mesh
    order, normalised PartitionSpec and memory kind.  Unsharded values (no
    sharding, or a single-device one) give None, so a concrete unsharded array
    and a ShapeDtypeStruct without sharding fingerprint alike.  Tracers carry
    no concrete sharding and also give None.
    """
    if isinstance(x, jax.core.Tracer):
        return None
    s = x if isinstance(x, Sharding) else getattr(x, "sharding", None)
    if s is None or not isinstance(s, Sharding):
        return None
    try:
        return _SHARDING_CACHE[s]
    except KeyError:
        pass
    except TypeError:  # an unhashable sharding class: no caching
        return _compute_sharding_fingerprint(s)
    fp = _compute_sharding_fingerprint(s)
    if len(_SHARDING_CACHE) >= _CACHE_LIMIT:
        _SHARDING_CACHE.clear()
    _SHARDING_CACHE[s] = fp
    return fp


def _clean(text: Any) -> str:
    """Collapse whitespace and drop the field separator from a device field."""
    return " ".join(str(text).split()).replace("|", "/")


@functools.cache
def _default_device() -> Any:
    # The device list is fixed once the backends are up; looking it up again on
    # every kernel call would cost more than the rest of the key.
    return jax.devices()[0]


_DEVICE_CACHE: dict[Any, str] = {}


def _compute_device_fingerprint(dev: Any) -> str:
    platform = _clean(getattr(dev, "platform", "unknown")).lower()
    kind = _clean(getattr(dev, "device_kind", "unknown"))
    client = getattr(dev, "client", None)
    version = _clean(getattr(client, "platform_version", "") or "")
    return f"{platform}|{kind}|{version}"


def device_fingerprint(dev: Any = None) -> str:
    """``"<platform>|<device_kind>|<platform_version>"`` of ``dev``.

    The platform version (CUDA/driver, ROCm or TPU runtime) is part of it so
    that a config tuned on one device model or software stack is never served
    on another.  ``dev`` defaults to the first jax device.  The result is
    cached per device object because it is asked for on every kernel call.
    """
    d = _default_device() if dev is None else dev
    try:
        return _DEVICE_CACHE[d]
    except KeyError:
        pass
    except TypeError:
        return _compute_device_fingerprint(d)
    fp = _compute_device_fingerprint(d)
    _DEVICE_CACHE[d] = fp
    return fp


def get_device_platform(dev: Any = None) -> str:
    """``"gpu"``, ``"tpu"``, ``"cpu"`` or ``"unknown"`` for ``dev``.

    ``cuda`` and ``rocm`` platforms count as ``gpu``.  When the platform name
    is unfamiliar, the device kind is consulted, as kernels pick their
    implementation by this coarse family.
    """
    d = _default_device() if dev is None else dev
    platform = str(getattr(d, "platform", "")).lower()
    if platform in ("gpu", "cuda", "rocm"):
        return "gpu"
    if platform in ("tpu", "cpu"):
        return platform
    kind = str(getattr(d, "device_kind", "")).lower()
    if any(word in kind for word in ("gpu", "cuda", "nvidia", "geforce", "rtx", "radeon", "instinct", "amd")):
        return "gpu"
    if "tpu" in kind:
        return "tpu"
    if "cpu" in kind:
        return "cpu"
    return "unknown"


def device_kind() -> str:
    """Coarse family (``gpu``/``tpu``/``cpu``/``unknown``) of the default device."""
    return get_device_platform()


# ---------------------------------------------------------------------------
# The reduction table
# ---------------------------------------------------------------------------

_REGISTRY: dict[type, Callable[[Any], Any]] = {}
_REDUCER_CACHE: dict[type, Callable[[Any], _Node]] = {}
# Array classes whose encoding the byte walker caches by abstract value.
_CACHED_ARRAY_TYPES: set[type] = {jax.ShapeDtypeStruct}
_DataclassInfo = tuple[str, tuple[str, ...], Callable[[Any], tuple[Any, ...]], bytes]
_DATACLASS_INFO: dict[type, _DataclassInfo] = {}
# Classes whose leaf encodings may be remembered by object: named, immutable
# things such as classes, module-level functions, dtypes and enum members.
_LEAF_CACHE_TYPES: set[type] = set()
_NAMED_IMMUTABLE = (type, types.FunctionType, types.BuiltinFunctionType, types.ModuleType, np.dtype, enum.Enum)
_ARRAY_FIELDS = ("shape", "dtype", "weak_type", "sharding")
_CODE_FIELDS = (
    "name",
    "argcount",
    "posonlyargcount",
    "kwonlyargcount",
    "flags",
    "code",
    "consts",
    "names",
    "varnames",
    "freevars",
    "cellvars",
    "exceptiontable",
)
_CLOSURE_FIELDS = ("module", "qualname", "code", "defaults", "kwdefaults", "closure")
_NATIVE_BYTEORDER = "<" if sys.byteorder == "little" else ">"
# Builtin types that no module attribute names (there is no builtins.NoneType).
_UNNAMED_BUILTIN_TYPES = {type(None): "NoneType", type(...): "ellipsis", type(NotImplemented): "NotImplementedType"}


def scalar_memo_key(value: Any) -> Any:
    """A hashable key for an immutable scalar that is equal exactly when the values' call-key
    encodings are, for memos in front of the fingerprint (``kernel._memoised_call_key``).

    ``(type(value), value)`` is not such a key: ``0.0 == -0.0`` and ``0j == -0j`` although their
    encodings differ, so a memo keyed that way answered whichever sign it met first, making the
    key depend on call order. Floats and complex numbers are keyed by their exact text
    (``float.hex``, as :func:`_reduce_float` encodes them: -0.0 apart from 0.0, every NaN alike),
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
    _LEAF_CACHE_TYPES.clear()
    _LEAF_CACHE.clear()
    _DATACLASS_INFO.clear()


def _dtype_text(dtype: np.dtype) -> str:
    """Dtype name, which unlike ``dtype.str`` tells bfloat16 from float16, plus
    the byte order when it is not native."""
    if dtype.fields is not None or dtype.subdtype is not None:
        return str(dtype)
    order = dtype.byteorder
    if order in ("=", "|", _NATIVE_BYTEORDER):
        return dtype.name
    return dtype.name + order


def _dtype_value(dtype: Any) -> Any:
    if isinstance(dtype, np.dtype):
        return dtype
    # Extended dtypes (PRNG keys and the like) are not numpy dtypes; their
    # text form is a stable name such as ``key<fry>``.
    return _Node(LEAF, "extended_dtype", str(dtype))


def _shape_value(shape: Iterable[Any]) -> tuple[Any, ...]:
    # Symbolic dimensions keep their text form; concrete ones become ints.
    return tuple(int(d) if isinstance(d, (int, np.integer)) else str(d) for d in shape)


def _array_node(shape: Any, dtype: Any, weak_type: Any, sharding: str | None) -> _Node:
    values = (_shape_value(shape), _dtype_value(dtype), bool(weak_type), sharding)
    return _Node(RECORD, "array", (_ARRAY_FIELDS, values))


def _reduce_array(obj: Any) -> _Node:
    """Arrays of every kind reduce to the same abstract record, so a concrete
    array, its tracer and its ShapeDtypeStruct fingerprint alike."""
    if isinstance(obj, jax.core.Tracer):
        aval = obj.aval
        return _array_node(aval.shape, aval.dtype, getattr(aval, "weak_type", False), None)
    if isinstance(obj, np.ndarray):
        return _array_node(obj.shape, obj.dtype, False, None)
    return _array_node(obj.shape, obj.dtype, getattr(obj, "weak_type", False), sharding_fingerprint(obj))


def _reduce_float(x: float) -> _Node:
    # float.hex is exact and tells 0.0 from -0.0; every NaN becomes "nan".
    return _Node(LEAF, "float", x.hex())


def _reduce_numpy_scalar(x: np.generic) -> _Node:
    dtype = x.dtype
    if dtype.kind in "biu":
        value = str(int(x))
    else:
        # Raw bits: exact for every float width, including the ml_dtypes ones.
        value = x.tobytes().hex()
    return _Node(LEAF, "np_scalar:" + _dtype_text(dtype), value)


def _reduce_type(tp: type) -> _Node:
    unnamed = _UNNAMED_BUILTIN_TYPES.get(tp)
    if unnamed is not None:
        return _Node(LEAF, "type", "builtins:" + unnamed)
    module, qualname = tp.__module__, tp.__qualname__
    if module == "builtins" or _resolves(tp, module, qualname):
        return _Node(LEAF, "type", f"{module}:{qualname}")
    raise _Unsupported(tp, f"{module}.{qualname} cannot be imported by that name")


def _cell_contents(cell: types.CellType) -> Any:
    try:
        return cell.cell_contents
    except ValueError:
        return _EMPTY_CELL


def _reduce_function(fn: types.FunctionType) -> _Node:
    """A named function by its name; anything else by what it computes.

    Lambdas, closures and local functions are described by their code, their
    defaults and the values they closed over, so two closures over different
    constants differ while recreating the same lambda gives the same key.
    """
    module, qualname = fn.__module__, fn.__qualname__
    if _resolves(fn, module, qualname):
        return _Node(LEAF, "function", f"{module}:{qualname}")
    cells = tuple(_cell_contents(c) for c in fn.__closure__ or ())
    values = (module, qualname, fn.__code__, fn.__defaults__, fn.__kwdefaults__, cells)
    return _Node(RECORD, "closure", (_CLOSURE_FIELDS, values))


def _reduce_code(code: types.CodeType) -> _Node:
    # File name and line numbers are left out: moving a lambda must not
    # change what it means.
    values = (
        code.co_name,
        code.co_argcount,
        code.co_posonlyargcount,
        code.co_kwonlyargcount,
        code.co_flags,
        code.co_code,
        code.co_consts,
        code.co_names,
        code.co_varnames,
        code.co_freevars,
        code.co_cellvars,
        getattr(code, "co_exceptiontable", b""),
    )
    return _Node(RECORD, "code", (_CODE_FIELDS, values))


def _reduce_builtin_function(fn: types.BuiltinFunctionType) -> _Node:
    owner = getattr(fn, "__self__", None)
    if owner is None or isinstance(owner, types.ModuleType):
        if _resolves(fn, fn.__module__, fn.__qualname__):
            return _Node(LEAF, "function", f"{fn.__module__}:{fn.__qualname__}")
        raise _Unsupported(fn, f"{fn!r} cannot be imported by its name")
    # A builtin method bound to an object, such as ``[].append``.
    return _Node(RECORD, "builtin_method", (("self", "name"), (owner, fn.__name__)))


def _reduce_descriptor(d: Any) -> _Node:
    # Unbound builtin methods such as ``str.upper``.
    return _Node(RECORD, "descriptor", (("owner", "name"), (d.__objclass__, d.__name__)))


def _dataclass_info(tp: type) -> _DataclassInfo:
    """Tag, field names, field reader and record header of a dataclass, made
    once per class."""
    names = tuple(f.name for f in dataclasses.fields(tp))
    if len(names) >= 2:
        read: Callable[[Any], tuple[Any, ...]] = operator.attrgetter(*names)
    else:
        # attrgetter of one name returns the bare value, not a 1-tuple.
        def read(obj: Any) -> tuple[Any, ...]:
            return tuple(getattr(obj, n) for n in names)

    tag = "dataclass:" + _qualified_name(tp)
    info = (tag, names, read, _record_header(tag, names))
    _DATACLASS_INFO[tp] = info
    return info


def _reduce_dataclass(obj: Any) -> _Node:
    # Fields read one by one (in definition order) rather than through
    # dataclasses.asdict, which deep-copies every value.
    tag, names, read, _ = _DATACLASS_INFO.get(type(obj)) or _dataclass_info(type(obj))
    return _Node(RECORD, tag, (names, read(obj)))


def _reduce_namedtuple(obj: Any) -> _Node:
    tp = type(obj)
    return _Node(RECORD, "namedtuple:" + _qualified_name(tp), (tuple(tp._fields), tuple(obj)))


def _reduce_enum(obj: enum.Enum) -> _Node:
    name = obj.name if obj.name is not None else repr(obj.value)
    return _Node(LEAF, "enum:" + _qualified_name(type(obj)), name)


def _reduce_pydantic(obj: Any) -> _Node:
    return _Node(SEQ, "pydantic:" + _qualified_name(type(obj)), (obj.model_dump(),))


def _reduce_partial(p: functools.partial) -> _Node:
    values = (p.func, tuple(p.args), dict(p.keywords or {}))
    return _Node(RECORD, "partial:" + _qualified_name(type(p)), (("func", "args", "keywords"), values))


def _reduce_method(m: types.MethodType) -> _Node:
    return _Node(RECORD, "method", (("self", "func"), (m.__self__, m.__func__)))


def _reduce_other(obj: Any) -> _Node:
    """Last resort for values of a class with no rule of its own.

    Accepts a callable object that is its module's attribute (jitted or
    custom-derivative functions defined at module level), a wrapper that
    names what it wraps, and a container jax knows as a pytree node.  Never
    falls back to ``str``/``repr``: their text can hold memory addresses.
    """
    module = getattr(obj, "__module__", None)
    qualname = getattr(obj, "__qualname__", None)
    if module is not None and qualname is not None and _resolves(obj, module, qualname):
        return _Node(LEAF, "callable", f"{module}:{qualname}")
    wrapped = getattr(obj, "__wrapped__", _MISSING)
    if wrapped is not _MISSING and wrapped is not obj:
        return _Node(SEQ, "wrapped:" + _qualified_name(type(obj)), (wrapped,))
    try:
        children, meta = jtu.flatten_one_level(obj)
    except ValueError:
        raise _Unsupported(obj) from None
    return _Node(SEQ, "pytree:" + _qualified_name(type(obj)), (meta, *children))


def _registered_reducer(fn: Callable[[Any], Any]) -> Callable[[Any], _Node]:
    def reduce(obj: Any) -> _Node:
        return _Node(SEQ, "registered:" + _qualified_name(type(obj)), (fn(obj),))

    return reduce


def _unsupported(obj: Any) -> _Node:
    raise _Unsupported(obj)


_BUILTIN_REDUCERS: dict[type, Callable[[Any], _Node]] = {
    int: lambda x: _Node(INT, "int", x),
    bool: lambda x: _Node(LEAF, "bool", "1" if x else "0"),
    type(None): lambda x: _Node(LEAF, "none", ""),
    float: _reduce_float,
    complex: lambda x: _Node(LEAF, "complex", f"{x.real.hex()},{x.imag.hex()}"),
    str: lambda x: _Node(LEAF, "str", x),
    bytes: lambda x: _Node(LEAF, "bytes", x),
    bytearray: lambda x: _Node(LEAF, "bytearray", bytes(x)),
    list: lambda x: _Node(SEQ, "list", x),
    tuple: lambda x: _Node(SEQ, "tuple", x),
    dict: lambda x: _Node(MAP, "dict", x),
    set: lambda x: _Node(SET, "set", x),
    frozenset: lambda x: _Node(SET, "frozenset", x),
    slice: lambda x: _Node(SEQ, "slice", (x.start, x.stop, x.step)),
    range: lambda x: _Node(SEQ, "range", (x.start, x.stop, x.step)),
    type(...): lambda x: _Node(LEAF, "ellipsis", ""),
    type(NotImplemented): lambda x: _Node(LEAF, "notimplemented", ""),
    _EmptyCell: lambda x: _Node(LEAF, "empty_cell", ""),
    types.CodeType: _reduce_code,
    types.FunctionType: _reduce_function,
    types.MethodType: _reduce_method,
    types.BuiltinFunctionType: _reduce_builtin_function,
    types.ModuleType: lambda m: _Node(LEAF, "module", m.__name__),
    PartitionSpec: lambda p: _Node(LEAF, "partition_spec", json.dumps(_normalized_spec(p), separators=(",", ":"))),
    jax.ShapeDtypeStruct: _reduce_array,
    np.ndarray: _reduce_array,
}

# Subclasses of builtin containers and scalars keep their builtin encoding
# under their own class name, so a str subclass never equals a str.
_BUILTIN_BASES = (bool, int, float, complex, str, bytes, list, tuple, dict, set, frozenset)


def _subclass_reducer(base: type) -> Callable[[Any], _Node]:
    base_reduce = _BUILTIN_REDUCERS[base]

    def reduce(obj: Any) -> _Node:
        kind, tag, payload = base_reduce(obj)
        if kind == INT:
            # The bare int form carries no tag; a tagged leaf does.
            kind, payload = LEAF, hex(payload)
        return _Node(kind, f"{tag}:{_qualified_name(type(obj))}", payload)

    return reduce


def _resolve_reducer(tp: type) -> Callable[[Any], _Node]:
    """The rule for a class, noting whether its leaves may be remembered."""
    reducer = _pick_reducer(tp)
    if reducer is _reduce_other or issubclass(tp, _NAMED_IMMUTABLE):
        _LEAF_CACHE_TYPES.add(tp)
    return reducer


def _pick_reducer(tp: type) -> Callable[[Any], _Node]:
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
        return _reduce_array
    if issubclass(tp, (jax.Array, jax.ShapeDtypeStruct)):
        # Concrete jax arrays have shape, dtype, weak_type and sharding like a
        # ShapeDtypeStruct, so they share its cached encoding.
        _CACHED_ARRAY_TYPES.add(tp)
        return _reduce_array
    if issubclass(tp, np.generic):
        return _reduce_numpy_scalar
    if issubclass(tp, np.dtype):
        return lambda d: _Node(LEAF, "dtype", _dtype_text(d))
    if issubclass(tp, Sharding):
        return lambda s: _Node(LEAF, "sharding", sharding_fingerprint(s) or "single_device")
    if issubclass(tp, jax.sharding.Mesh):
        return lambda m: _Node(LEAF, "mesh", json.dumps(_mesh_parts(m), separators=(",", ":")))
    if issubclass(tp, jax.Device):
        return lambda d: _Node(LEAF, "device", f"{device_fingerprint(d)}#{d.id}")
    if issubclass(tp, functools.partial):
        return _reduce_partial
    if issubclass(tp, type):
        return _reduce_type
    if tp in (types.MethodDescriptorType, types.WrapperDescriptorType, types.ClassMethodDescriptorType):
        return _reduce_descriptor
    for base in _BUILTIN_BASES:
        if issubclass(tp, base):
            return _subclass_reducer(base)
    return _reduce_other


def _reduce(obj: Any) -> _Node:
    """The table: reduce one value to a :class:`_Node` (one level deep)."""
    tp = type(obj)
    reducer = _REDUCER_CACHE.get(tp)
    if reducer is None:
        reducer = _resolve_reducer(tp)
        _REDUCER_CACHE[tp] = reducer
    return reducer(obj)


# Containers whose contents cannot hold a path back to themselves without a
# mutable container in between, which is tracked instead.
_UNTRACKED = frozenset({tuple, frozenset, slice, range, _Node})
_ONLY_STR = frozenset({str})
_ONLY_INT = frozenset({int})


def _str_keyed(mapping: Any) -> bool:
    """Whether every key is a str, so keys alone give a canonical order."""
    return frozenset(map(type, mapping)) <= _ONLY_STR


# ---------------------------------------------------------------------------
# Byte encoding (input of short_hash)
# ---------------------------------------------------------------------------


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


def _lp(data: bytes) -> bytes:
    """Length-prefixed bytes."""
    return b"%d:%b" % (len(data), data)


def _text_bytes(text: str) -> bytes:
    # surrogatepass: any Python str, even one holding lone surrogates, encodes.
    return text.encode("utf-8", "surrogatepass")


@functools.cache
def _header(kind: int, tag: str) -> bytes:
    """Kind letter plus length-prefixed tag, shared by every node of that tag."""
    return _KIND_LETTER[kind] + _lp(_text_bytes(tag))


_RECORD_HEADERS: dict[tuple[str, tuple[str, ...]], bytes] = {}


def _record_header(tag: str, names: tuple[str, ...]) -> bytes:
    key = (tag, names)
    head = _RECORD_HEADERS.get(key)
    if head is None:
        head = _header(RECORD, tag) + b"%d;" % len(names) + b"".join(_lp(_text_bytes(n)) for n in names)
        _RECORD_HEADERS[key] = head
    return head


_STR_HEAD = _header(LEAF, "str")
_FLOAT_HEAD = _header(LEAF, "float")
_TUPLE_HEAD = _header(SEQ, "tuple")
_LIST_HEAD = _header(SEQ, "list")
_DICT_STR_HEAD = b"K" + _header(MAP, "dict")[1:]
_TRUE = _header(LEAF, "bool") + _lp(b"1")
_FALSE = _header(LEAF, "bool") + _lp(b"0")
_NONE = _header(LEAF, "none") + _lp(b"")
_DIGEST_SIZE = 16

# An int in int64 range is b"I" and 8 little-endian bytes: one C call to make,
# and a long list of them can be packed at once.  Larger ints use hex text.
_INT_TAG = ord("I")
_PACK_INT = struct.Struct("<Bq").pack
_INT_RUN_DTYPE = np.dtype([("tag", "u1"), ("value", "<i8")])


def _int_bytes(n: int) -> bytes:
    try:
        return _PACK_INT(_INT_TAG, n)
    except struct.error:
        return b"J" + _lp(hex(n).encode("ascii"))


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
            if len(_STR_CACHE) >= _CACHE_LIMIT:
                _STR_CACHE.clear()
            _STR_CACHE[s] = data
    return data


_ARRAY_CACHE: dict[tuple[Any, ...], bytes] = {}
_LEAF_CACHE: dict[int, tuple[Any, bytes]] = {}


def _array_bytes(obj: Any, key: tuple[Any, ...]) -> bytes:
    """Encoding of an array's abstract value, remembered under ``key`` (shape,
    dtype, weak type, sharding) since a kernel sees few distinct signatures."""
    data = _encode(_reduce_array(obj))
    if len(_ARRAY_CACHE) >= _CACHE_LIMIT:
        _ARRAY_CACHE.clear()
    _ARRAY_CACHE[key] = data
    return data


def _remember_leaf(obj: Any, data: bytes) -> None:
    if len(_LEAF_CACHE) >= _CACHE_LIMIT:
        _LEAF_CACHE.clear()
    # The object is kept with its bytes so a reused id can never match.
    _LEAF_CACHE[id(obj)] = (obj, data)


def _encode(root: Any, fast: bool = True) -> bytearray:
    """Byte encoding of ``root``; see the module docstring for the grammar.

    With ``fast`` the commonest types skip the table; they must produce the
    very bytes the table gives (``fast=False`` exists to check that).
    Raises :class:`_Unsupported` for a value with no rule.
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
            if t in _CACHED_ARRAY_TYPES:
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
            if t is dict and frozenset(map(type, obj)) <= _ONLY_STR:
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
            info = _DATACLASS_INFO.get(t)
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
        if t is _Node:
            node = obj
        else:
            i = id(obj)
            hit = _LEAF_CACHE.get(i)
            if hit is not None and hit[0] is obj:
                out += hit[1]
                continue
            d = depth_of.get(i)
            if d is not None:
                out += b"B%d;" % d
                continue
            node = _reduce(obj)
        kind, tag, payload = node
        if kind == INT:
            out += _int_bytes(payload)
            continue
        if kind == LEAF:
            data = payload if isinstance(payload, bytes) else payload.encode("utf-8", "surrogatepass")
            data = _header(LEAF, tag) + b"%d:%b" % (len(data), data)
            out += data
            if t in _LEAF_CACHE_TYPES:
                _remember_leaf(obj, data)
            continue
        if t not in _UNTRACKED:
            depth_of[id(obj)] = len(path)
            path.append(obj)
            push(_EXIT)
        if kind == SEQ:
            out += _header(SEQ, tag)
            out += b"%d;" % len(payload)
            run = _int_run(payload) if len(payload) > 8 else None
            if run is None:
                extend(reversed(payload))
            else:
                out += run
        elif kind == RECORD:
            names, values = payload
            out += _record_header(tag, names)
            extend(reversed(values))
        elif kind == SET or not _str_keyed(payload):
            # Unordered children: each is encoded apart, then the digests are
            # written sorted.  A map's child is a key followed by its value.
            out += _header(kind, tag)
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
            out += b"K" + _header(MAP, tag)[1:]
            out += b"%d;" % len(keys)
            for k in keys:
                out += _str_bytes(k)
            extend(map(payload.__getitem__, reversed(keys)))
    return out


# ---------------------------------------------------------------------------
# Canonical JSON (stable_json) and error paths
# ---------------------------------------------------------------------------

# Instructions of the JSON walker: (op, a, b).
_VISIT, _TEXT, _CLOSE, _JSUB_BEGIN, _JSUB_END, _JSORTED = range(6)


def _json_leaf(tag: str, payload: Any) -> str:
    if tag == "str":
        return json.dumps(payload)
    if tag == "bool":
        return "true" if payload == "1" else "false"
    if tag == "none":
        return "null"
    text = payload.hex() if isinstance(payload, bytes) else payload
    return "{%s:%s}" % (json.dumps(f"__{tag}__"), json.dumps(text))


def _json_int(n: int) -> str:
    # Beyond a few thousand digits str(int) refuses to work; hex never does.
    return str(n) if n.bit_length() < 8000 else '{"__int__":"%s"}' % hex(n)


def _path_text(labels: list[str]) -> str:
    text = "".join(labels)
    return text[1:] if text.startswith(".") else text or "<root>"


def _render(root: Any) -> str:
    """Canonical JSON of ``root``, from the same table as :func:`_encode`.

    Ordered containers are streamed; the children of sets and of dicts with
    non-str keys are rendered apart and sorted by their text.  Raises
    ``TypeError`` naming the type and path of a value with no rule.
    """
    out: list[str] = []
    saved: list[list[str]] = []
    labels: list[str] = []
    path: list[Any] = []
    depth_of: dict[int, int] = {}
    stack: list[tuple[int, Any, Any]] = [(_VISIT, root, "")]
    while stack:
        op, obj, label = stack.pop()
        if op == _TEXT:
            out.append(obj)
            continue
        if op == _CLOSE:
            labels.pop()
            if obj:
                del depth_of[id(path.pop())]
            continue
        if op == _JSUB_BEGIN:
            saved.append(out)
            out = []
            continue
        if op == _JSUB_END:
            obj.append("".join(out))
            out = saved.pop()
            continue
        if op == _JSORTED:
            out.append(",".join(sorted(obj)))
            continue

        t = type(obj)
        if t is _Node:
            node = obj
        else:
            d = depth_of.get(id(obj))
            if d is not None:
                out.append('{"__ref__":%d}' % d)
                continue
            try:
                node = _reduce(obj)
            except _Unsupported as exc:
                raise TypeError(exc.message(_path_text([*labels, label]))) from None
        kind, tag, payload = node
        if kind == INT:
            out.append(_json_int(payload))
            continue
        if kind == LEAF:
            out.append(_json_leaf(tag, payload))
            continue
        tracked = t not in _UNTRACKED
        if tracked:
            depth_of[id(obj)] = len(path)
            path.append(obj)
        labels.append(label)
        opener = "" if tag in ("list", "dict") else "{%s:" % json.dumps(f"__{tag}__")
        closer = "" if not opener else "}"
        todo: list[tuple[int, Any, Any]] = []  # in output order; reversed onto the stack
        if kind == SEQ:
            out.append(opener + "[")
            for i, child in enumerate(payload):
                if i:
                    todo.append((_TEXT, ",", None))
                todo.append((_VISIT, child, f"[{i}]"))
            todo.append((_TEXT, "]" + closer, None))
        elif kind == RECORD:
            names, values = payload
            out.append(opener + "{")
            for i, (name, child) in enumerate(zip(names, values)):
                todo.append((_TEXT, ("," if i else "") + json.dumps(name) + ":", None))
                todo.append((_VISIT, child, f".{name}"))
            todo.append((_TEXT, "}" + closer, None))
        elif kind == SET:
            texts: list[str] = []
            out.append(opener + "[")
            for child in payload:
                todo += [(_JSUB_BEGIN, None, None), (_VISIT, child, "<set item>"), (_JSUB_END, texts, None)]
            todo += [(_JSORTED, texts, None), (_TEXT, "]" + closer, None)]
        elif _str_keyed(payload):
            # A dict whose keys might read as type tags keeps an explicit tag.
            if any(k.startswith("__") for k in payload):
                opener, closer = "{%s:" % json.dumps(f"__{tag}__"), "}"
            out.append(opener + "{")
            for i, k in enumerate(sorted(payload)):
                todo.append((_TEXT, ("," if i else "") + json.dumps(k) + ":", None))
                todo.append((_VISIT, payload[k], f"[{k!r}]"))
            todo.append((_TEXT, "}" + closer, None))
        else:
            opener = "{%s:" % json.dumps(f"__{tag}__")
            texts = []
            out.append(opener + "[")
            for i, (k, v) in enumerate(payload.items()):
                todo += [
                    (_JSUB_BEGIN, None, None),
                    (_TEXT, "[", None),
                    (_VISIT, k, f"<key {i}>"),
                    (_TEXT, ",", None),
                    (_VISIT, v, f"[{k!r}]"),
                    (_TEXT, "]", None),
                    (_JSUB_END, texts, None),
                ]
            todo += [(_JSORTED, texts, None), (_TEXT, "]}", None)]
        stack.append((_CLOSE, tracked, None))
        stack.extend(reversed(todo))
    return "".join(out)


# ---------------------------------------------------------------------------
# Public hashing API
# ---------------------------------------------------------------------------


def _library_version() -> str:
    return VERSION


_SALTS: dict[str, bytes] = {}


def _salt() -> bytes:
    """Length-prefixed salt: library version, key format version and the
    user's ``EJLABEL_CACHE_SALT``.  The variable is read on every call (a dict
    lookup) so that changing it takes effect at once."""
    user = os.environ.get(SALT_ENV_VAR, "")
    salt = _SALTS.get(user)
    if salt is None:
        text = f"ejlabel-fingerprint|{_library_version()}|{FINGERPRINT_VERSION}|{user}"
        salt = _lp(_text_bytes(text))
        _SALTS[user] = salt
    return salt


def _encode_or_explain(obj: Any) -> bytearray:
    try:
        return _encode(obj)
    except _Unsupported as exc:
        # Walk again with paths to say where the offending value sits.
        _render(obj)
        raise TypeError(exc.message("an unknown place")) from None


def short_hash(obj: Any) -> str:
    """16 hex digits of sha256 over the salt and the encoding of ``obj``.

    Equal under any dict insertion or set iteration order and any hash seed;
    different for values that differ in type or content.  Arrays count only
    by abstract value.  Raises ``TypeError`` (with the path) for a value the
    hasher has no rule for.
    """
    h = hashlib.sha256(_salt())
    h.update(_encode_or_explain(obj))
    return h.hexdigest()[:16]


def stable_json(obj: Any) -> str:
    """Canonical, type-tagged, compact JSON text of ``obj``'s fingerprint.

    Meant for reading and debugging keys: it shows exactly what
    :func:`short_hash` depends on, e.g. ``{"__float__":"0x1.0000000000000p+0"}``
    for ``1.0`` and ``{"__array__":{...}}`` for an array.
    """
    return _render(obj)


def abstractify(pytree: Any) -> Any:
    """``pytree`` with every array (jax, numpy or tracer) replaced by a
    ShapeDtypeStruct that keeps its shape, dtype, weak type and NamedSharding.
    Other leaves are left as they are."""

    def leaf(x: Any) -> Any:
        if isinstance(x, jax.core.Tracer):
            aval = x.aval
            return jax.ShapeDtypeStruct(aval.shape, aval.dtype, weak_type=getattr(aval, "weak_type", False))
        if isinstance(x, (jax.Array, np.ndarray)):
            sharding = getattr(x, "sharding", None)
            return jax.ShapeDtypeStruct(
                x.shape,
                x.dtype,
                sharding=sharding if isinstance(sharding, NamedSharding) else None,
                weak_type=bool(getattr(x, "weak_type", False)),
            )
        return x

    return jtu.tree_map(leaf, pytree)


_KEY_FIELDS = ("op_id", "kernel_version", "args", "kwargs", "batch_axes")


def default_key_builder_with_sharding(inv: Any) -> str:
    """Cache key of one kernel invocation.

    ``inv`` needs ``op_id``, ``args``, ``kwargs`` and ``batch_axes``, and may
    have ``kernel_version`` (default ``"1"``).  Arrays anywhere in the
    arguments count by shape, dtype, weak type and sharding, which the hasher
    reads straight from them, so no abstract copy of the arguments is built.
    """
    values = (
        inv.op_id,
        getattr(inv, "kernel_version", "1"),
        tuple(inv.args),
        dict(inv.kwargs),
        inv.batch_axes,
    )
    return short_hash(_Node(RECORD, "kernel_key", (_KEY_FIELDS, values)))
