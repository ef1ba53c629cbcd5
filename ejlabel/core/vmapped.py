"""Calls made under ``jax.vmap``: keyed, described and tuned as the batched call the program runs.

Inside ``jax.vmap`` a kernel sees one example: its arguments are tracers of the per-example
shape. Keyed by those alone, ``matmul(a, b)`` vmapped over 8 would share its label, its cache
entry and its tuning with the unbatched call of the same per-example shape, and a dump would be
tuned for a shape the program never runs. So the executor reads the batch axes off the
arguments (:func:`traced_batch_axes`) and puts them into the call's ``batch_axes``, which the
call key hashes and the call description carries:

    ("vmap", ((size, dims), ...))

one ``(size, dims)`` level per enclosing ``vmap``, innermost first: ``size`` is the mapped axis
size and ``dims`` holds, for each leaf of ``(args, array_kwargs)`` in pytree order, the axis
that level maps (or None). The kernel's own hooks (``heuristic_cfg``, ``config_space``,
``make_inputs``) still see the per-example arguments, as its ``run`` does; tuning compiles and
times the batched call: :func:`batched_function` maps the kernel's call over the levels and
:func:`batched_arguments` gives the batched arguments (specs grown by the mapped axes, values
broadcast along them).

Only the arguments' own tracers tell the axes. A call traced where JAX traces a function once
per example before batching it (the body of a ``lax.scan`` or a ``jax.jit``-ed function called
under ``vmap``) sees no batch tracer, and is keyed per example. ``vmap_with_config`` makes the
same key as ``jax.vmap`` of the same call.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from jax._src import core as jax_core  # the current trace: no public API names it

from ejlabel.core.kernel import split_kwargs

__all__ = ["VMAP", "batched_arguments", "batched_call", "batched_function", "traced_batch_axes", "vmap_levels"]

VMAP = "vmap"
Level = tuple[int, tuple[int | None, ...]]


def _tracer_kinds() -> tuple[type, tuple[type, ...], Any] | None:
    """JAX's batch tracer, the differentiation tracers that wrap a primal, and "not mapped";
    None on a JAX that has none of these (then calls are keyed per example)."""
    try:
        from jax._src.interpreters import ad, batching  # the tracers' types: no public API names them
    except ImportError:
        return None
    wrappers = tuple(t for t in (getattr(ad, "JVPTracer", None), getattr(ad, "LinearizeTracer", None)) if isinstance(t, type))
    return batching.BatchTracer, wrappers, getattr(batching, "not_mapped", None)


_KINDS = _tracer_kinds()


class _NotBatched(Exception):
    """An argument whose batching this module cannot state (a ragged axis, a JAX without sizes)."""


def _chain(leaf: Any) -> list[tuple[Any, int | None, int]]:
    """``(trace, dim, size)`` of every vmap ``leaf`` is mapped by, innermost first."""
    assert _KINDS is not None
    batch_tracer, wrappers, not_mapped = _KINDS
    chain = []
    while True:
        if isinstance(leaf, batch_tracer):
            dim = leaf.batch_dim
            size = getattr(getattr(getattr(leaf, "_trace", None), "axis_data", None), "size", None)
            if dim is not_mapped or dim is None:
                dim = None
            elif not isinstance(dim, int) or not isinstance(size, int):
                raise _NotBatched
            chain.append((leaf._trace, dim, size))
            leaf = leaf.val
        elif wrappers and isinstance(leaf, wrappers):
            leaf = leaf.primal  # grad inside vmap: the batch tracer sits under the JVP one
        else:
            return chain


def traced_batch_axes(args: tuple[Any, ...], array_kwargs: dict[str, Any]) -> tuple[str, tuple[Level, ...]] | None:
    """The ``batch_axes`` of a call whose arguments are traced under ``jax.vmap``, or None."""
    if _KINDS is None:
        return None
    leaves = jax.tree_util.tree_leaves((args, array_kwargs))
    if not any(isinstance(leaf, jax.core.Tracer) for leaf in leaves):
        return None
    try:
        chains = [_chain(leaf) for leaf in leaves]
    except _NotBatched:
        return None
    sizes = {id(trace): (trace, size) for chain in chains for trace, _, size in chain}
    if not sizes:
        return None
    levels = []
    for trace in _innermost_first([trace for trace, _ in sizes.values()]):
        dims = tuple(next((dim for t, dim, _ in chain if t is trace), None) for chain in chains)
        levels.append((sizes[id(trace)][1], dims))
    return (VMAP, tuple(levels))


def _innermost_first(traces: list[Any]) -> list[Any]:
    """``traces`` ordered as the trace stack nests them, from the current trace outwards."""
    depth: dict[int, int] = {}
    current = getattr(getattr(jax_core, "trace_ctx", None), "trace", None)
    while current is not None and len(depth) < 10_000:
        depth.setdefault(id(current), len(depth))
        current = getattr(current, "parent_trace", None)
    return sorted(traces, key=lambda t: depth.get(id(t), len(depth)))


def vmap_levels(batch_axes: Any, leaves: int | None = None) -> tuple[Level, ...]:
    """The levels of a ``("vmap", levels)`` spec, innermost first; () for any other
    ``batch_axes`` (None, ``pmap_with_config``'s). ValueError naming ``batch_axes`` for a vmap
    spec that is malformed, or whose levels do not give one entry per leaf (``leaves``)."""
    if not (isinstance(batch_axes, tuple) and len(batch_axes) == 2 and batch_axes[0] == VMAP):
        return ()
    levels = batch_axes[1]
    if not isinstance(levels, tuple) or not levels:
        raise ValueError(f"batch_axes: expected ('vmap', ((size, dims), ...)), got {batch_axes!r:.200}")
    for level in levels:
        ok = isinstance(level, tuple) and len(level) == 2 and type(level[0]) is int and level[0] > 0 and isinstance(level[1], tuple)
        if not ok or not all(d is None or (type(d) is int and d >= 0) for d in level[1]):
            raise ValueError(f"batch_axes: expected levels (size > 0, (axis or None, ...)), got {level!r:.200}")
        if leaves is not None and len(level[1]) != leaves:
            raise ValueError(f"batch_axes: a level names {len(level[1])} axes for a call of {leaves} argument leaves")
    return levels


def batched_function(fn: Callable[[tuple[Any, ...], dict[str, Any]], Any], args: tuple[Any, ...], array_kwargs: dict[str, Any], batch_axes: Any) -> Callable[[tuple[Any, ...], dict[str, Any]], Any]:
    """``fn(args, array_kwargs)`` of one example mapped over ``batch_axes``'s levels: a function
    of the batched arguments (``args``/``array_kwargs`` give the per-example structure)."""
    leaves, treedef = jax.tree_util.tree_flatten((args, array_kwargs))
    levels = vmap_levels(batch_axes, len(leaves))
    for size, dims in levels:  # innermost first: the first vmap wraps fn itself
        fn = jax.vmap(fn, in_axes=jax.tree_util.tree_unflatten(treedef, list(dims)), axis_size=size)
    return fn


def batched_arguments(args: tuple[Any, ...], array_kwargs: dict[str, Any], batch_axes: Any) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """The batched ``(args, array_kwargs)`` of per-example ones: a ``ShapeDtypeStruct`` grows by
    each level's mapped axis, an array is broadcast along it (every example the same values)."""
    leaves, treedef = jax.tree_util.tree_flatten((args, array_kwargs))
    levels = vmap_levels(batch_axes, len(leaves))
    out = list(leaves)
    for size, dims in levels:
        out = [_grow(leaf, dim, size) for leaf, dim in zip(out, dims)]
    return jax.tree_util.tree_unflatten(treedef, out)


def batched_call(args: tuple[Any, ...], kwargs: dict[str, Any], batch_axes: Any) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """A described call's ``(args, kwargs)`` as the program runs them: the array arguments
    batched by :func:`batched_arguments`, the static keyword arguments as they are (what the
    audit shows for a call made under ``jax.vmap``)."""
    if not vmap_levels(batch_axes):
        return args, kwargs
    batched_args, batched_kwargs = batched_arguments(args, split_kwargs(kwargs)[0], batch_axes)
    return batched_args, {**kwargs, **batched_kwargs}


def _grow(leaf: Any, dim: int | None, size: int) -> Any:
    if dim is None:
        return leaf
    shape = tuple(getattr(leaf, "shape", ()))
    if dim > len(shape):
        raise ValueError(f"batch_axes: axis {dim} is out of range for an argument of shape {shape}")
    grown = shape[:dim] + (size,) + shape[dim:]
    if isinstance(leaf, jax.ShapeDtypeStruct):
        return jax.ShapeDtypeStruct(grown, leaf.dtype, weak_type=leaf.weak_type)
    return jnp.broadcast_to(jnp.expand_dims(leaf, dim), grown)
