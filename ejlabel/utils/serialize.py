"""Tagged JSON for configs and call descriptions: readable, exact, and never pickle.

Configs go into the persistent cache and call descriptions go into the compiled program, and
both must come back as the same Python values in another process. Plain JSON loses too much
(tuples become lists, enums and dataclasses are not representable), and pickle can run code
when it loads. This module maps values to JSON with a small set of tags:

========================  ===========================================================
value                     JSON
========================  ===========================================================
None, bool, int, str      themselves
float                     itself when finite, ``{"$float": "nan" | "inf" | "-inf"}``
list                      a JSON array
tuple                     ``{"$tuple": [...]}``
dict with plain str keys  a JSON object
other dict                ``{"$dict": [[key, value], ...]}``
set / frozenset           ``{"$set": [...]}`` / ``{"$frozenset": [...]}`` (sorted)
bytes                     ``{"$bytes": "<base64>"}``
dataclass instance        ``{"$dataclass": "module:QualName", "fields": {...}}``
enum member               ``{"$enum": "module:QualName", "name": "MEMBER"}``
dtype                     ``{"$dtype": "bfloat16"}``
ShapeDtypeStruct          ``{"$array": "float32[4,128]"}`` (``...]w`` when weakly typed)
class or function         ``{"$ref": "module:QualName"}``
slice                     ``{"$slice": [start, stop, step]}``
========================  ===========================================================

Data never runs code
--------------------
Decoding never imports a module. A ``module:QualName`` found in data (``$dataclass``,
``$enum``, ``$ref``) is looked up in an explicit registry that only code fills:
:func:`register` (kernels register themselves and their config types through
:mod:`ejlabel.core.registry` when their class is defined). A name nobody registered is an
:class:`UnregisteredTypeError` naming it; a registered name of the wrong kind (a function where
a dataclass is tagged) is a :class:`DecodeError`. Encoding needs no registration: it writes the
name of an object the program already holds, checked against the loaded module (again without
importing anything). A script's own classes are written under the script's module name, not
``__main__`` (:mod:`ejlabel.utils.modules`), so a config a script stored is the entry the command
line finds after importing the same file, and the reverse.

Decoding is also bounded, so one hostile entry cannot exhaust the stack or the decoder:
containers nest at most :data:`MAX_DEPTH` deep (counting every JSON array and object, so a
tagged tuple counts two), numbers must be finite (non-finite floats have their own tag), and
every malformed value raises :class:`DecodeError` (a ``ValueError``), never a stray
``KeyError`` or ``RecursionError``. An ``$array`` is checked before it reaches JAX: a shape whose
element count overflows XLA's 64-bit products aborts the whole process inside jaxlib when it is
lowered, so :func:`check_array_size` refuses any array of more than :data:`MAX_ARRAY_BYTES`.
"""

from __future__ import annotations

import base64
import binascii
import dataclasses
import enum
import json
import math
import re
import sys
import threading
from collections.abc import Callable
from typing import Any, TypeVar

import jax
import numpy as np

from ejlabel.utils.modules import public_module_name

__all__ = [
    "MAX_ARRAY_BYTES",
    "MAX_DEPTH",
    "check_array_size",
    "DecodeError",
    "UnregisteredTypeError",
    "unregistered_error",
    "to_jsonable",
    "from_jsonable",
    "to_json",
    "from_json",
    "loads_strict",
    "check_json",
    "import_path",
    "qualified_name",
    "register",
    "registered",
    "is_registered",
    "registered_names",
    "resolve_path",
]

T = TypeVar("T")
_TAG_PREFIX = "$"

#: Deepest nesting of JSON arrays and objects that decoding accepts. Real configs and call
#: descriptions stay under 20 (AttentionConfig is 4); the cap keeps the recursive decoder far
#: from Python's recursion limit even when it runs inside a deep trace.
MAX_DEPTH = 64

#: Most bytes an array described by data may hold: 1 PiB, beyond any one device's memory, and far
#: enough below 2**63 that XLA's element and byte counts (padded to tiles) cannot overflow.
MAX_ARRAY_BYTES = 1 << 50

_NAME_RE = re.compile(r"[A-Za-z_][\w]*(\.[A-Za-z_][\w]*)*:[A-Za-z_][\w]*(\.[A-Za-z_][\w]*)*")


class DecodeError(ValueError):
    """Data that does not decode: malformed, nested too deep, or naming what it may not."""


class UnregisteredTypeError(DecodeError, ImportError):
    """Data names a class or function that no code registered, so it is not looked up.

    Also an ``ImportError``: callers written for the old import-based resolver catch that.
    """


# ---------------------------------------------------------------------------- the registry

_REGISTRY: dict[str, Any] = {}
_REGISTRY_LOCK = threading.Lock()


def _own_name(obj: Any) -> tuple[str, str]:
    """``(module, qualname)`` from the object's own attributes; TypeError when data could not name it."""
    module, qualname = getattr(obj, "__module__", None), getattr(obj, "__qualname__", None)
    if not isinstance(module, str) or not isinstance(qualname, str) or not module or not qualname:
        raise TypeError(f"{obj!r} has no name that data could refer to (no __module__/__qualname__)")
    if "<locals>" in qualname or "<lambda>" in qualname:
        raise TypeError(f"{obj!r} has no importable name (module-level classes and functions only)")
    return module, qualname


def qualified_name(obj: Any) -> str:
    """``module:QualName`` of a class or function, from its own attributes (no lookup).

    A script's ``__main__`` is written as the script's module name
    (:func:`~ejlabel.utils.modules.public_module_name`), so the script and a process that imports
    the same file name its classes alike. TypeError when it has no name that data could use:
    objects defined inside a function or lambdas.
    """
    module, qualname = _own_name(obj)
    return f"{public_module_name(module)}:{qualname}"


def register(obj: T, *, name: str | None = None) -> T:
    """Let data name ``obj`` (a class, dataclass, enum or function); returns ``obj``.

    Usable as a decorator. Only code registers: this is the whole list of what ``$dataclass``,
    ``$enum`` and ``$ref`` may decode to. ``name`` defaults to ``module:QualName``; registering
    a name again replaces the object (a reloaded module).
    """
    if not (isinstance(obj, type) or callable(obj)):
        raise TypeError(f"obj: expected a class or function, got {type(obj).__name__}")
    key = qualified_name(obj) if name is None else name
    if not isinstance(key, str) or not _NAME_RE.fullmatch(key):
        raise ValueError(f"name: expected 'module:QualName', got {key!r}")
    with _REGISTRY_LOCK:
        _REGISTRY[key] = obj
    return obj


def registered(name: Any) -> Any:
    """The object registered as ``name``; :class:`UnregisteredTypeError` if none. Never imports."""
    if not isinstance(name, str) or not _NAME_RE.fullmatch(name):
        raise DecodeError(f"expected a name 'module:QualName', got {name!r:.80}")
    found = _REGISTRY.get(name)
    if found is None:
        raise unregistered_error(name)
    return found


def unregistered_error(name: str, kind: str | None = None) -> UnregisteredTypeError:
    """The error for data that names ``name`` (``module:QualName``) which no code registered.

    One wording for every registry (types here, kernels in :mod:`ejlabel.core.registry`): what is
    missing, that decoding never imports, and how the user registers it. ``kind`` (``"kernel"``)
    prefixes the name and picks the hint.
    """
    module = name.partition(":")[0]
    how = (
        "kernel classes register themselves when their module is imported"
        if kind == "kernel"
        else "kernels register themselves and their config types, other types with "
        "ejlabel.core.registry.register_config_type"
    )
    return UnregisteredTypeError(
        f"{kind + ' ' if kind else ''}{name} is not registered, so data may not name it (decoding never "
        f"imports). Import the module that defines it first ({module}; on the command line "
        f"`ejlabel --import {module}`), or register it: {how}"
    )


def is_registered(obj: Any) -> bool:
    """Whether ``obj`` itself is registered under its ``module:QualName``."""
    try:
        return _REGISTRY.get(qualified_name(obj)) is obj
    except TypeError:
        return False


def registered_names() -> list[str]:
    """Every registered name, sorted."""
    with _REGISTRY_LOCK:
        return sorted(_REGISTRY)


def resolve_path(path: str) -> Any:
    """The registered object named ``module:QualName`` (never imports; kept for old callers)."""
    return registered(path)


def import_path(obj: Any) -> str:
    """``module:QualName`` of a class or function, checked to name ``obj`` in its loaded module.

    Looks in ``sys.modules`` only: naming an object the program holds never imports anything.
    """
    module_name, qualname = _own_name(obj)
    path = f"{public_module_name(module_name)}:{qualname}"
    # Checked in the module the object lives in (``__main__`` for a script's), under the name
    # every process uses for it.
    found: Any = sys.modules.get(module_name)
    if found is None:
        raise TypeError(f"{path}: module {module_name} is not loaded, so {obj!r} has no importable name")
    for part in qualname.split("."):
        found = getattr(found, part, None)
    if found is not obj:
        raise TypeError(f"{path} names a different object than {obj!r} in its module")
    return path


# ---------------------------------------------------------------------------- encoding


def _dtype_name(dtype: Any) -> str:
    return np.dtype(dtype).name


def to_jsonable(obj: Any) -> Any:
    """Map ``obj`` to plain JSON data (dicts, lists, str, numbers, bool, None) with tags."""
    if obj is None or isinstance(obj, (bool, str)):
        return obj
    if isinstance(obj, enum.Enum):  # before int: IntEnum members are ints
        return {"$enum": import_path(type(obj)), "name": obj.name}
    if isinstance(obj, int):
        return int(obj)
    if isinstance(obj, float):
        return float(obj) if math.isfinite(obj) else {"$float": repr(float(obj))}
    if isinstance(obj, list):
        return [to_jsonable(v) for v in obj]
    if isinstance(obj, tuple) and not hasattr(obj, "_fields"):
        return {"$tuple": [to_jsonable(v) for v in obj]}
    if isinstance(obj, dict):
        if all(isinstance(k, str) and not k.startswith(_TAG_PREFIX) for k in obj):
            return {k: to_jsonable(v) for k, v in obj.items()}
        return {"$dict": [[to_jsonable(k), to_jsonable(v)] for k, v in obj.items()]}
    if isinstance(obj, (set, frozenset)):
        items = sorted((to_jsonable(v) for v in obj), key=lambda v: json.dumps(v, sort_keys=True))
        return {"$frozenset" if isinstance(obj, frozenset) else "$set": items}
    if isinstance(obj, bytes):
        return {"$bytes": base64.b64encode(obj).decode("ascii")}
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        fields = {f.name: to_jsonable(getattr(obj, f.name)) for f in dataclasses.fields(obj) if f.init}
        return {"$dataclass": import_path(type(obj)), "fields": fields}
    if isinstance(obj, jax.ShapeDtypeStruct):
        dims = ",".join(str(d) for d in obj.shape)
        return {"$array": f"{_dtype_name(obj.dtype)}[{dims}]" + ("w" if obj.weak_type else "")}
    if isinstance(obj, np.dtype) or (isinstance(obj, type) and issubclass(obj, np.generic)):
        return {"$dtype": _dtype_name(obj)}
    if isinstance(obj, np.generic):
        return to_jsonable(obj.item())
    if isinstance(obj, slice):
        return {"$slice": [to_jsonable(obj.start), to_jsonable(obj.stop), to_jsonable(obj.step)]}
    if isinstance(obj, type) or callable(obj):
        try:
            return {"$ref": import_path(obj)}
        except TypeError:
            pass
        # jnp functions and dtypes such as jnp.bfloat16 are wrappers around numpy scalar types.
        if hasattr(obj, "dtype") and isinstance(getattr(obj, "dtype"), np.dtype):
            return {"$dtype": _dtype_name(obj.dtype)}
        raise TypeError(f"cannot encode {obj!r} as JSON: it has no importable name")
    raise TypeError(f"cannot encode an object of type {type(obj).__module__}.{type(obj).__qualname__} as JSON")


def to_json(obj: Any) -> str:
    """Compact, key-sorted JSON text of ``obj`` (configs, call descriptions)."""
    return json.dumps(to_jsonable(obj), sort_keys=True, separators=(",", ":"), allow_nan=False)


# ---------------------------------------------------------------------------- checking


def _path_text(path: tuple[Any, ...]) -> str:
    return "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in path)


def check_json(data: Any, *, max_depth: int = MAX_DEPTH, where: str = "data", encodable: bool = False) -> None:
    """Check that ``data`` is plain JSON data a decoder may walk; DecodeError naming the spot.

    Plain JSON types only (dict with str keys, list, str, int, finite float, bool, None),
    containers nested at most ``max_depth`` deep. With ``encodable``, strings must also encode
    as UTF-8 (no lone surrogates), which SQLite text columns need. Iterative: a document of any
    depth is rejected without recursing.
    """
    stack: list[tuple[Any, int, tuple[Any, ...]]] = [(data, 0, ())]
    while stack:
        value, depth, path = stack.pop()
        t = type(value)
        if t is dict or t is list:
            if depth >= max_depth:
                raise DecodeError(f"{where}{_path_text(path)}: nested deeper than {max_depth} levels (the limit)")
            if t is dict:
                for k, v in value.items():
                    if type(k) is not str:
                        raise DecodeError(f"{where}{_path_text(path)}: object key {k!r:.40} is not a string")
                    if encodable:
                        _check_text(k, where, path)
                    stack.append((v, depth + 1, (*path, k)))
            else:
                stack.extend((v, depth + 1, (*path, i)) for i, v in enumerate(value))
        elif t is float:
            if not math.isfinite(value):
                raise DecodeError(
                    f"{where}{_path_text(path)}: {value!r} is not a finite number "
                    '(JSON has none; ejlabel writes {"$float": "inf"} for them)'
                )
        elif t is str:
            if encodable:
                _check_text(value, where, path)
        elif value is not None and t is not bool and t is not int:
            raise DecodeError(f"{where}{_path_text(path)}: {t.__name__} is not a JSON value")


def _check_text(s: str, where: str, path: tuple[Any, ...]) -> None:
    try:
        s.encode("utf-8")
    except UnicodeEncodeError:
        raise DecodeError(f"{where}{_path_text(path)}: string {s!r:.40} is not valid Unicode text") from None


def _reject_constant(name: str) -> Any:
    raise DecodeError(f"{name} is not a JSON number (ejlabel writes {{\"$float\": ...}} for non-finite floats)")


def _finite_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise DecodeError(f"number {text:.40} is out of range (not finite)")
    return value


def loads_strict(text: str | bytes) -> Any:
    """``json.loads`` that refuses NaN, Infinity and numbers that overflow to them, and turns a
    document nested past the parser's recursion limit into a DecodeError."""
    try:
        return json.loads(text, parse_constant=_reject_constant, parse_float=_finite_float)
    except RecursionError:
        raise DecodeError("JSON nested too deeply to parse") from None
    except json.JSONDecodeError as err:
        raise DecodeError(f"not valid JSON ({err})") from None
    except (ValueError, TypeError) as err:  # DecodeError from the hooks, int digit limits, bad bytes
        if isinstance(err, DecodeError):
            raise
        raise DecodeError(f"not valid JSON ({err})") from None


# ---------------------------------------------------------------------------- decoding


def _kind(name: Any, check: Callable[[Any], bool], kind: str) -> Any:
    found = registered(name)
    if not check(found):
        raise DecodeError(f"{name} is registered but is not a {kind}")
    return found


def _expect(value: Any, t: type | tuple[type, ...], what: str) -> Any:
    if not isinstance(value, t):
        raise DecodeError(f"{what}: expected {getattr(t, '__name__', t)}, got {type(value).__name__}")
    return value


_TAG_KEYS = {
    "$float": {"$float"}, "$tuple": {"$tuple"}, "$dict": {"$dict"}, "$set": {"$set"},
    "$frozenset": {"$frozenset"}, "$bytes": {"$bytes"}, "$dataclass": {"$dataclass", "fields"},
    "$enum": {"$enum", "name"}, "$dtype": {"$dtype"}, "$array": {"$array"}, "$slice": {"$slice"},
    "$ref": {"$ref"},
}
# Dimensions of at most 18 digits: every real size, and int() never meets its digit limit.
_ARRAY_RE = re.compile(r"([a-z0-9_]+)\[((?:\d{1,18}(?:,\d{1,18})*)?)\](w?)")


def _decode(data: Any) -> Any:
    # Recursion is bounded: check_json ran first, so depth <= MAX_DEPTH.
    if data is None or isinstance(data, (bool, int, float, str)):
        return data
    if isinstance(data, list):
        return [_decode(v) for v in data]
    tags = [k for k in data if k.startswith(_TAG_PREFIX)]
    if not tags:
        return {k: _decode(v) for k, v in data.items()}
    tag = tags[0]
    allowed = _TAG_KEYS.get(tag)
    if allowed is None:
        raise DecodeError(f"unknown tag {tag!r:.40} in JSON data")
    if not set(data) <= allowed or tag not in data:
        raise DecodeError(f"{tag} object has unexpected keys {sorted(set(data) - allowed)!r:.80}")
    value = data[tag]
    if tag == "$float":
        try:
            return float(_expect(value, str, "$float"))
        except ValueError:
            raise DecodeError(f"$float: {value!r:.40} is not a number") from None
    if tag == "$tuple":
        return tuple(_decode(v) for v in _expect(value, list, "$tuple"))
    if tag == "$dict":
        out = {}
        for pair in _expect(value, list, "$dict"):
            if not isinstance(pair, list) or len(pair) != 2:
                raise DecodeError("$dict: expected [key, value] pairs")
            out[_hashable(_decode(pair[0]), "$dict key")] = _decode(pair[1])
        return out
    if tag in ("$set", "$frozenset"):
        items = [_hashable(_decode(v), tag + " item") for v in _expect(value, list, tag)]
        return set(items) if tag == "$set" else frozenset(items)
    if tag == "$bytes":
        try:
            return base64.b64decode(_expect(value, str, "$bytes"), validate=True)
        except binascii.Error as err:
            raise DecodeError(f"$bytes: not base64 ({err})") from None
    if tag == "$dataclass":
        cls = _kind(value, lambda c: isinstance(c, type) and dataclasses.is_dataclass(c), "dataclass")
        fields = {k: _decode(v) for k, v in _expect(data.get("fields", {}), dict, "$dataclass fields").items()}
        try:
            return cls(**fields)
        except Exception as err:  # the constructor's own checks: any error means bad data here
            raise DecodeError(f"cannot build {value} from the stored fields: {type(err).__name__}: {err}") from None
    if tag == "$enum":
        cls = _kind(value, lambda c: isinstance(c, type) and issubclass(c, enum.Enum), "enum")
        name = _expect(data.get("name"), str, "$enum name")
        try:
            return cls[name]
        except KeyError:
            raise DecodeError(f"{value} has no member {name!r:.40}") from None
    if tag == "$dtype":
        try:
            return jax.numpy.dtype(_expect(value, str, "$dtype"))
        except (TypeError, ValueError):
            raise DecodeError(f"$dtype: {value!r:.40} is not a dtype") from None
    if tag == "$array":
        match = _ARRAY_RE.fullmatch(_expect(value, str, "$array"))
        if match is None:
            raise DecodeError(f"$array: {value!r:.60} is not 'dtype[d0,d1,...]'")
        try:
            dtype = jax.numpy.dtype(match.group(1))
        except (TypeError, ValueError):
            raise DecodeError(f"$array: {match.group(1)!r} is not a dtype") from None
        shape = tuple(int(d) for d in match.group(2).split(",") if d)
        check_array_size(shape, dtype, "$array")
        return jax.ShapeDtypeStruct(shape, dtype, weak_type=match.group(3) == "w")
    if tag == "$slice":
        parts = _expect(value, list, "$slice")
        if len(parts) != 3 or not all(p is None or type(p) is int for p in parts):
            raise DecodeError("$slice: expected [start, stop, step] of ints or nulls")
        return slice(*parts)
    # $ref
    return _kind(value, lambda c: isinstance(c, type) or callable(c), "class or function")


def check_array_size(shape: tuple[int, ...], dtype: Any, what: str) -> None:
    """DecodeError (a ValueError) naming ``what`` unless ``shape`` of ``dtype`` is a real array:
    non-negative dimensions, at most :data:`MAX_ARRAY_BYTES` in all.

    A zero dimension does not excuse the others: XLA multiplies the dimensions in order, so
    ``[2**40, 2**40, 0]`` overflows before the zero is reached.
    """
    if any(not isinstance(d, int) or isinstance(d, bool) or d < 0 for d in shape):
        raise DecodeError(f"{what}: dimensions must be non-negative integers, got {shape!r:.120}")
    count = math.prod(max(d, 1) for d in shape)
    size = count * np.dtype(dtype).itemsize
    if size > MAX_ARRAY_BYTES:
        raise DecodeError(
            f"{what}: shape {shape!r:.120} of {np.dtype(dtype).name} spans {size} bytes, over the "
            f"{MAX_ARRAY_BYTES}-byte limit of one array (ejlabel.utils.serialize.MAX_ARRAY_BYTES)"
        )


def _hashable(value: Any, what: str) -> Any:
    try:
        hash(value)
    except TypeError:
        raise DecodeError(f"{what}: {type(value).__name__} is not hashable") from None
    return value


def from_jsonable(data: Any, *, max_depth: int = MAX_DEPTH) -> Any:
    """Invert :func:`to_jsonable`; :class:`DecodeError` (a ValueError) for anything malformed.

    Never imports: tagged names resolve through the registry only (:func:`registered`).
    """
    check_json(data, max_depth=max_depth)
    return _decode(data)


def from_json(text: str | bytes, cls: type[T] | None = None) -> T | Any:
    """Decode :func:`to_json` text; with ``cls``, check (or build) an instance of that type.

    ``cls`` also accepts untagged JSON objects (``{"block_m": 64}``) for dataclass configs written
    by hand, building ``cls(**fields)``.
    """
    value = from_jsonable(loads_strict(text))
    if cls is None or isinstance(value, cls):
        return value
    if isinstance(value, dict) and dataclasses.is_dataclass(cls):
        return cls(**value)
    raise TypeError(f"cls: expected the JSON to hold a {cls.__qualname__}, got {type(value).__qualname__}")
