"""``vmap_with_config`` and ``pmap_with_config``: select a config once, then map the call.

A plain ``jax.vmap(kernel)`` would select per traced call, which is the same per-example
signature anyway; these helpers make the choice explicit and put the mapped axes into the call
key (``batch_axes``), so a config tuned for the batched use of a kernel is kept apart from one
tuned for the unbatched call of the same per-example shape.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax

from ejlabel.core.kernel import Invocation, Kernel
from ejlabel.execution.executor import Executor, get_default_executor, run_labelled
from ejlabel.execution.recording import maybe_record

__all__ = ["vmap_with_config", "pmap_with_config"]


def _per_example(args: tuple[Any, ...], in_axes: Any) -> tuple[Any, ...]:
    """Abstract per-example arguments: each mapped array loses its mapped axis."""
    axes = in_axes if isinstance(in_axes, (tuple, list)) else (in_axes,) * len(args)
    if len(axes) != len(args):
        raise ValueError(f"in_axes: expected {len(args)} entries (one per positional argument), got {len(axes)}")

    def drop(axis: int | None, x: Any) -> Any:
        if axis is None or not hasattr(x, "shape"):
            return x
        shape = tuple(x.shape)
        if not -len(shape) <= axis < len(shape):
            raise ValueError(f"in_axes: axis {axis} is out of range for an argument of shape {shape}")
        axis %= len(shape)
        return jax.ShapeDtypeStruct(shape[:axis] + shape[axis + 1 :], x.dtype)

    return tuple(jax.tree_util.tree_map(lambda x, a=axis: drop(a, x), arg) for axis, arg in zip(axes, args))


def _mapped(
    mapper: Callable[..., Callable[..., Any]],
    kernel: Kernel[Any, Any],
    in_axes: Any,
    executor: Executor | None,
    batch_axes: Any,
    mapper_kwargs: dict[str, Any],
) -> Callable[..., Any]:
    if not isinstance(kernel, Kernel):
        raise TypeError(f"kernel: expected a Kernel, got {type(kernel).__name__}")

    def call(*args: Any, **kwargs: Any) -> Any:
        chosen = executor if executor is not None else get_default_executor()
        inv = Invocation(kernel, _per_example(args, in_axes), kwargs, batch_axes=batch_axes)
        cfg = chosen.selector.select(inv).cfg
        maybe_record(inv)

        def per_example(*example_args: Any) -> Any:
            return run_labelled(
                Invocation(kernel, example_args, kwargs, batch_axes=batch_axes, known_call_key=inv.call_key), cfg
            )

        return mapper(per_example, in_axes=in_axes, **mapper_kwargs)(*args)

    return call


def _order(first: Any, second: Any, rest: tuple[Any, ...], executor: Executor | None, name: str) -> tuple[Any, tuple[Any, ...], Executor | None]:
    """Accept ejkernel's ``(executor, kernel, ...)`` order as well as ejlabel's ``(kernel, ...)``."""
    if isinstance(first, Executor):
        if executor is not None:
            raise TypeError(f"{name}: give the executor either first (ejkernel's order) or as executor=, not both")
        if second is _MISSING:
            raise TypeError(f"{name}(executor, kernel, ...): the kernel is missing")
        return second, rest, first
    return first, ((second,) if second is not _MISSING else ()) + rest, executor


_MISSING = object()


def vmap_with_config(
    kernel: Any, *args: Any, executor: Executor | None = None, **kwargs: Any
) -> Callable[..., Any]:
    """``jax.vmap`` of ``kernel`` with one config chosen for the per-example signature.

    ``vmap_with_config(kernel, in_axes=0, out_axes=0, executor=None)``; ejkernel's order
    ``vmap_with_config(executor, kernel, in_axes=0, out_axes=0)`` is accepted too. Keyword
    arguments of the returned function are passed unmapped to every example.
    """
    kernel, rest, executor = _order(kernel, args[0] if args else _MISSING, tuple(args[1:]), executor, "vmap_with_config")
    return _vmap(kernel, *rest, executor=executor, **kwargs)


def _vmap(kernel: Kernel[Any, Any], in_axes: Any = 0, out_axes: Any = 0, executor: Executor | None = None) -> Callable[..., Any]:
    return _mapped(jax.vmap, kernel, in_axes, executor, ("vmap", in_axes, out_axes), {"out_axes": out_axes})


def pmap_with_config(
    kernel: Any, *args: Any, executor: Executor | None = None, **kwargs: Any
) -> Callable[..., Any]:
    """``jax.pmap`` of ``kernel`` with one config chosen for all devices.

    ``pmap_with_config(kernel, axis_name="devices", in_axes=0, out_axes=0, executor=None,
    **pmap_kwargs)``; ejkernel's order ``pmap_with_config(executor, kernel, ...)`` is accepted too.
    """
    kernel, rest, executor = _order(kernel, args[0] if args else _MISSING, tuple(args[1:]), executor, "pmap_with_config")
    return _pmap(kernel, *rest, executor=executor, **kwargs)


def _pmap(
    kernel: Kernel[Any, Any],
    axis_name: str = "devices",
    in_axes: Any = 0,
    out_axes: Any = 0,
    executor: Executor | None = None,
    **pmap_kwargs: Any,
) -> Callable[..., Any]:
    return _mapped(
        jax.pmap,
        kernel,
        in_axes,
        executor,
        ("pmap", axis_name, in_axes, out_axes),
        {"axis_name": axis_name, "out_axes": out_axes, **pmap_kwargs},
    )
