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
class or function         ``{"$ref": "module:QualName"}`` (must import back to itself)
slice                     ``{"$slice": [start, stop, step]}``
========================  ===========================================================

Decoding imports the named module to find a dataclass, enum, class or function; it refuses
anything that does not resolve to an object of the tagged kind, so a tampered file cannot make
the decoder call arbitrary objects.
"""

from __future__ import annotations

import base64
import dataclasses
import enum
import importlib
import json
import math
from typing import Any, TypeVar

import jax
import numpy as np

__all__ = ["to_jsonable", "from_jsonable", "to_json", "from_json", "import_path", "resolve_path"]

T = TypeVar("T")
_TAG_PREFIX = "$"


def import_path(obj: Any) -> str:
    """``module:QualName`` of a class or function, checked to import back to ``obj``."""
    module, qualname = getattr(obj, "__module__", None), getattr(obj, "__qualname__", None)
    if not module or not qualname or "<locals>" in qualname or "<lambda>" in qualname:
        raise TypeError(f"{obj!r} has no importable name (module-level classes and functions only)")
    path = f"{module}:{qualname}"
    try:
        found = resolve_path(path)
    except (ImportError, AttributeError) as err:
        raise TypeError(f"{path} does not import back to {obj!r}: {err}") from None
    if found is not obj:
        raise TypeError(f"{path} imports to a different object than {obj!r}")
    return path


def resolve_path(path: str) -> Any:
    """Import ``module:QualName`` and return the object it names."""
    module_name, sep, qualname = path.partition(":")
    if not sep or not module_name or not qualname:
        raise ImportError(f"expected 'module:QualName', got {path!r}")
    obj: Any = importlib.import_module(module_name)
    for part in qualname.split("."):
        obj = getattr(obj, part)
    return obj


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


def _resolve_kind(path: str, check: Any, kind: str) -> Any:
    try:
        found = resolve_path(path)
    except (ImportError, AttributeError) as err:
        raise ValueError(f"cannot import {kind} {path!r}: {err}") from None
    if not check(found):
        raise ValueError(f"{path!r} is not a {kind}")
    return found


def from_jsonable(data: Any) -> Any:
    """Invert :func:`to_jsonable`."""
    if data is None or isinstance(data, (bool, int, float, str)):
        return data
    if isinstance(data, list):
        return [from_jsonable(v) for v in data]
    if not isinstance(data, dict):
        raise ValueError(f"unexpected JSON value of type {type(data).__name__}")
    tags = [k for k in data if k.startswith(_TAG_PREFIX)]
    if not tags:
        return {k: from_jsonable(v) for k, v in data.items()}
    tag = tags[0]
    value = data[tag]
    if tag == "$float":
        return float(value)
    if tag == "$tuple":
        return tuple(from_jsonable(v) for v in value)
    if tag == "$dict":
        return {from_jsonable(k): from_jsonable(v) for k, v in value}
    if tag == "$set":
        return {from_jsonable(v) for v in value}
    if tag == "$frozenset":
        return frozenset(from_jsonable(v) for v in value)
    if tag == "$bytes":
        return base64.b64decode(value)
    if tag == "$dataclass":
        cls = _resolve_kind(value, lambda c: isinstance(c, type) and dataclasses.is_dataclass(c), "dataclass")
        return cls(**{k: from_jsonable(v) for k, v in data.get("fields", {}).items()})
    if tag == "$enum":
        cls = _resolve_kind(value, lambda c: isinstance(c, type) and issubclass(c, enum.Enum), "enum")
        return cls[data["name"]]
    if tag == "$dtype":
        return jax.numpy.dtype(value)
    if tag == "$array":
        dtype, _, rest = value.partition("[")
        dims, _, weak = rest.partition("]")
        shape = tuple(int(d) for d in dims.split(",") if d)
        return jax.ShapeDtypeStruct(shape, jax.numpy.dtype(dtype), weak_type=weak == "w")
    if tag == "$slice":
        return slice(*(from_jsonable(v) for v in value))
    if tag == "$ref":
        return _resolve_kind(value, lambda c: isinstance(c, type) or callable(c), "class or function")
    raise ValueError(f"unknown tag {tag!r} in JSON data")


def to_json(obj: Any) -> str:
    """Compact, key-sorted JSON text of ``obj`` (configs, call descriptions)."""
    return json.dumps(to_jsonable(obj), sort_keys=True, separators=(",", ":"), allow_nan=False)


def from_json(text: str | bytes, cls: type[T] | None = None) -> T | Any:
    """Decode :func:`to_json` text; with ``cls``, check (or build) an instance of that type.

    ``cls`` also accepts untagged JSON objects (``{"block_m": 64}``) for dataclass configs written
    by hand, building ``cls(**fields)``.
    """
    try:
        data = json.loads(text)
    except json.JSONDecodeError as err:
        raise ValueError(f"text: not valid JSON ({err})") from None
    value = from_jsonable(data)
    if cls is None or isinstance(value, cls):
        return value
    if isinstance(value, dict) and dataclasses.is_dataclass(cls):
        return cls(**value)
    raise TypeError(f"cls: expected the JSON to hold a {cls.__qualname__}, got {type(value).__qualname__}")
