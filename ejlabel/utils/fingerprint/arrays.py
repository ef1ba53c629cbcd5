"""What an array contributes to a call key: its abstract value and its layout over devices.

A call key never depends on array contents. Every kind of array (a concrete ``jax.Array``, a
numpy array, a tracer, a ``jax.ShapeDtypeStruct``) reduces to one record of shape, dtype, weak
type and sharding (:func:`reduce_array`), so a call traced with concrete arrays and the same call
rebuilt from a program's abstract description get the same key. Dtypes are named so that
bfloat16 and float16 differ, and numpy scalars count by their exact bits.

The sharding part (:func:`sharding_fingerprint`) is stable text: a ``NamedSharding`` gives its
mesh axes, device ids in mesh order, normalised ``PartitionSpec`` and memory kind; unsharded
values give None, so a single-device array and a spec without a sharding agree.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Iterable
from typing import Any

import jax
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec, Sharding, SingleDeviceSharding

from ejlabel.utils.fingerprint.grammar import CACHE_LIMIT, LEAF, RECORD, Node, qualified_name

__all__ = ["dtype_text", "mesh_parts", "normalized_spec", "reduce_array", "reduce_numpy_scalar", "sharding_fingerprint"]

_SHARDING_CACHE: dict[Sharding, str | None] = {}


def normalized_spec(spec: PartitionSpec) -> list[Any]:
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


def mesh_parts(mesh: Any) -> dict[str, Any]:
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
        parts = mesh_parts(s.mesh)
        parts["spec"] = normalized_spec(s.spec)
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
    return qualified_name(tp) + json.dumps(parts, separators=(",", ":"))


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
    if len(_SHARDING_CACHE) >= CACHE_LIMIT:
        _SHARDING_CACHE.clear()
    _SHARDING_CACHE[s] = fp
    return fp


_ARRAY_FIELDS = ("shape", "dtype", "weak_type", "sharding")
_NATIVE_BYTEORDER = "<" if sys.byteorder == "little" else ">"


def dtype_text(dtype: np.dtype) -> str:
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
    return Node(LEAF, "extended_dtype", str(dtype))


def _shape_value(shape: Iterable[Any]) -> tuple[Any, ...]:
    # Symbolic dimensions keep their text form; concrete ones become ints.
    return tuple(int(d) if isinstance(d, (int, np.integer)) else str(d) for d in shape)


def _array_node(shape: Any, dtype: Any, weak_type: Any, sharding: str | None) -> Node:
    values = (_shape_value(shape), _dtype_value(dtype), bool(weak_type), sharding)
    return Node(RECORD, "array", (_ARRAY_FIELDS, values))


def reduce_array(obj: Any) -> Node:
    """Arrays of every kind reduce to the same abstract record, so a concrete
    array, its tracer and its ShapeDtypeStruct fingerprint alike."""
    if isinstance(obj, jax.core.Tracer):
        aval = obj.aval
        return _array_node(aval.shape, aval.dtype, getattr(aval, "weak_type", False), None)
    if isinstance(obj, np.ndarray):
        return _array_node(obj.shape, obj.dtype, False, None)
    return _array_node(obj.shape, obj.dtype, getattr(obj, "weak_type", False), sharding_fingerprint(obj))


def reduce_numpy_scalar(x: np.generic) -> Node:
    dtype = x.dtype
    if dtype.kind in "biu":
        value = str(int(x))
    else:
        # Raw bits: exact for every float width, including the ml_dtypes ones.
        value = x.tobytes().hex()
    return Node(LEAF, "np_scalar:" + dtype_text(dtype), value)
