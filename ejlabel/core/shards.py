"""How a kernel call splits over devices: a kernel's :class:`ShardRule` and the :class:`Split` of one call.

A Pallas call is opaque to XLA's partitioner: given sharded inputs, it gathers them and every
device computes the whole call. A kernel that knows which dimensions of its arrays are
independent (attention's batch and heads, a loss's tokens, a matmul's rows and columns) says so
in a :class:`ShardRule`, and the executor runs the call once per shard under ``jax.shard_map``:
each device computes its own shard, with no gather.

The rule names each dimension of each array argument and of the output. ``"_"`` marks a
dimension every device needs whole (a contraction, a sequence the kernel scans); any other name
marks one that may be split, and dimensions with the same name are split alike (attention's
query heads and key/value heads are both ``"h"``: splitting both into ``n`` contiguous blocks
keeps each query head with its key/value head). Which mesh axes split a name is read from the
arguments' shardings while tracing: that needs shardings the trace can see, those of a mesh with
explicit axes (``jax.make_mesh``'s default; ``jax.sharding.AxisType.Explicit``). A name whose
size some split does not divide stays whole.

:func:`plan_split` turns a call and its kernel's rule into a :class:`Split`: the mesh, the
partition spec of every array argument and of the output, and the per-shard call as
``jax.ShapeDtypeStruct``\\ s. The per-shard call is what the label, the call key, the description
and the config belong to, since it is what each device runs and what a tuner must time; the
description states how it was split (``shardings``). Arguments sharded where the rule wants them
whole are resharded first: what XLA would do to a plain expression of the same call.

A per-shard call may differ from the whole one in its static options (``local_kwargs``: a loss
returns per-token values per shard) and then ``finish`` maps the assembled output to the whole
call's (the mean over every token, computed by XLA across devices).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Mapping
from typing import Any

import jax
from jax.sharding import AxisType, PartitionSpec

__all__ = ["ShardRule", "Split", "plan_split", "WHOLE"]

WHOLE = "_"  # a dimension every device needs whole


def _dims(text: str, where: str) -> tuple[str, ...]:
    if not isinstance(text, str):
        raise TypeError(f"{where}: expected a string of dimension names (e.g. 'b _ h _'), got {type(text).__name__}")
    return tuple(text.split())


@dataclasses.dataclass(frozen=True)
class ShardRule:
    """Which dimensions of a kernel call may be split across devices.

    Attributes:
      args: one dimension string per positional argument (``"m _"``: rows may be split, the
        contraction stays whole); ``None``: an array there stays whole on every device.
      kwargs: dimension strings of the array keyword arguments, by name; an array keyword
        argument not named stays whole.
      out: the output's dimension string, or a tuple of them for a tuple of outputs.
      out_summed: the (single) output is each shard's part of a sum over the split dimensions
        (a loss summed over its tokens): the whole call's output is the sum of the shards'.
      local_kwargs: static keyword arguments the per-shard call takes instead of the caller's.
      finish: maps the output assembled from the shards to the whole call's output; None: as is.
    """

    args: tuple[str | None, ...]
    out: str | tuple[str, ...]
    kwargs: Mapping[str, str] = dataclasses.field(default_factory=dict)
    out_summed: bool = False
    local_kwargs: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    finish: Callable[[Any], Any] | None = None

    def __post_init__(self) -> None:
        for i, dims in enumerate(self.args):
            if dims is not None:
                _dims(dims, f"ShardRule.args[{i}]")
        for name, dims in self.kwargs.items():
            _dims(dims, f"ShardRule.kwargs[{name!r}]")
        for i, dims in enumerate(self.out if isinstance(self.out, tuple) else (self.out,)):
            _dims(dims, f"ShardRule.out[{i}]")
        if self.out_summed and isinstance(self.out, tuple):
            raise ValueError("ShardRule.out_summed: a summed output is a single array, got a tuple of outputs")


@dataclasses.dataclass(frozen=True)
class Split:
    """One call's split: a mesh, every array argument's and the output's spec, the per-shard call.

    ``arg_specs`` and ``kwarg_specs`` follow the call's arguments (``None`` for a non-array);
    ``local_args`` / ``local_kwargs`` are the per-shard call's arguments (arrays as
    ``jax.ShapeDtypeStruct``\\ s of each shard's shape); ``shardings`` says, per array leaf, how
    the shards came about (``"data=4: P('data', None)"``), for the call's description.
    """

    mesh: Any
    axes: dict[str, tuple[str, ...]]  # dimension name -> mesh axes that split it
    arg_specs: tuple[PartitionSpec | None, ...]
    kwarg_specs: dict[str, PartitionSpec]
    out_specs: PartitionSpec | tuple[PartitionSpec, ...]  # summed: of the shards' outputs stacked on a new first axis
    summed: bool
    local_args: tuple[Any, ...]
    local_kwargs: dict[str, Any]
    shardings: tuple[str, ...]
    finish: Callable[[Any], Any] | None


def _explicit_sharding(x: Any) -> tuple[Any, tuple[Any, ...]] | None:
    """``(mesh, spec entries)`` of an array split over explicit mesh axes, else None."""
    try:
        sharding = jax.typeof(x).sharding
    except (TypeError, AttributeError):
        return None
    mesh, spec = getattr(sharding, "mesh", None), getattr(sharding, "spec", None)
    if mesh is None or spec is None or not getattr(mesh, "axis_names", ()):
        return None
    entries = tuple(spec) + (None,) * (len(x.shape) - len(spec))
    explicit = [ax for entry in entries for ax in _axes_of(entry)]
    types = dict(zip(mesh.axis_names, mesh.axis_types))
    if not explicit or any(types[ax] != AxisType.Explicit for ax in explicit):
        return None
    return mesh, entries


def _is_array(x: Any) -> bool:
    return hasattr(x, "shape") and hasattr(x, "dtype") and not isinstance(x, type)


def _axes_of(entry: Any) -> tuple[str, ...]:
    return () if entry is None else (entry if isinstance(entry, tuple) else (entry,))


def plan_split(rule: ShardRule, args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> Split | None:
    """The split of a call with these arguments under ``rule``, or None when nothing is split.

    None as well when no argument is split over explicit mesh axes, or when every split dimension
    is one the rule wants whole (then the call runs as it is, and XLA gathers as for any opaque
    call). ValueError naming the argument when the rule does not fit the call.
    """
    if len(rule.args) != len(args):
        raise ValueError(f"ShardRule.args: names {len(rule.args)} positional arguments, the call has {len(args)}")
    leaves: list[tuple[str, Any, tuple[str, ...]]] = []  # (where, array, dims); unnamed arrays whole
    for i, value in enumerate(args):
        if _is_array(value):
            dims = rule.args[i]
            leaves.append((f"args[{i}]", value, (WHOLE,) * len(value.shape) if dims is None else _dims(dims, f"ShardRule.args[{i}]")))
        elif any(map(_is_array, jax.tree_util.tree_leaves(value))):
            return None  # arrays nested in a container: not split
    for name, value in kwargs.items():
        if _is_array(value):
            dims = rule.kwargs.get(name)
            leaves.append((name, value, (WHOLE,) * len(value.shape) if dims is None else _dims(dims, f"ShardRule.kwargs[{name!r}]")))
        elif any(map(_is_array, jax.tree_util.tree_leaves(value))):
            return None
    for where, value, dims in leaves:
        if len(dims) != len(value.shape):
            raise ValueError(f"ShardRule: {where} has shape {tuple(value.shape)}, the rule names {len(dims)} dimensions ({' '.join(dims)})")

    mesh, axes = None, {}
    for _, value, dims in leaves:
        found = _explicit_sharding(value)
        if found is None:
            continue
        if mesh is None:
            mesh = found[0]
        elif found[0] != mesh:
            return None  # arrays of different meshes: leave the call to XLA
        for name, entry in zip(dims, found[1]):
            taken = {a for ax in axes.values() for a in ax}
            # A mesh axis splits one name: the first found keeps it, the other stays whole.
            if name != WHOLE and entry is not None and name not in axes and not taken & set(_axes_of(entry)):
                axes[name] = _axes_of(entry)
    if mesh is None:
        return None
    sizes = dict(zip(mesh.axis_names, mesh.axis_sizes))
    for _, value, dims in leaves:  # a split must divide every dimension it splits
        for name, size in zip(dims, value.shape):
            if name in axes and size % math.prod(sizes[a] for a in axes[name]):
                axes.pop(name)
    used = [a for ax in axes.values() for a in ax]
    if not axes:
        return None

    def spec(dims: tuple[str, ...]) -> PartitionSpec:
        return PartitionSpec(*(None if name not in axes else (axes[name] if len(axes[name]) > 1 else axes[name][0]) for name in dims))

    def local(value: Any, dims: tuple[str, ...]) -> jax.ShapeDtypeStruct:
        shape = tuple(size // math.prod(sizes[a] for a in axes.get(name, ())) for name, size in zip(dims, value.shape))
        return jax.ShapeDtypeStruct(shape, value.dtype, weak_type=bool(getattr(jax.typeof(value), "weak_type", False)))

    by_leaf = {where: (value, dims) for where, value, dims in leaves}
    arg_specs = tuple(spec(by_leaf[f"args[{i}]"][1]) if f"args[{i}]" in by_leaf else None for i in range(len(args)))
    kwarg_specs = {name: spec(by_leaf[name][1]) for name in kwargs if name in by_leaf}
    local_args = tuple(local(*by_leaf[f"args[{i}]"]) if f"args[{i}]" in by_leaf else a for i, a in enumerate(args))
    local_kwargs = {name: local(*by_leaf[name]) if name in by_leaf else v for name, v in kwargs.items()}
    local_kwargs.update(rule.local_kwargs)
    if rule.out_summed:
        out = PartitionSpec(tuple(used), *spec(_dims(rule.out, "ShardRule.out")))
    elif isinstance(rule.out, tuple):
        out = tuple(spec(_dims(d, "ShardRule.out")) for d in rule.out)
    else:
        out = spec(_dims(rule.out, "ShardRule.out"))
    # In the order of the description's array leaves (core/calls.encode_call).
    split_text = ",".join(f"{a}={sizes[a]}" for a in used)
    dims_of = {id(value): dims for _, value, dims in leaves}
    shardings = tuple(
        f"{split_text}: {spec(dims_of[id(x)])}" if id(x) in dims_of else f"{split_text}: whole"
        for x in jax.tree_util.tree_leaves((tuple(args), dict(kwargs))) if hasattr(x, "shape")
    )
    return Split(mesh, axes, arg_specs, kwarg_specs, out, rule.out_summed, local_args, local_kwargs, shardings, rule.finish)
