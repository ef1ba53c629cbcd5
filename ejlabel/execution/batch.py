"""``vmap_with_config`` and ``pmap_with_config``: select a config once, then map the call.

``vmap_with_config(kernel)`` is ``jax.vmap`` of the kernel's call through the executor: the call
is traced once, on one example, and selected once; the executor reads the batch axes off the
traced arguments (:mod:`ejlabel.core.vmapped`), so the call is keyed, described and tuned as the
batched call it is, with the same key as ``jax.vmap`` of the same call, apart from the
unbatched call of the same per-example shape. ``pmap_with_config`` selects once for the
per-device call and puts ``("pmap", axis_name, in_axes, out_axes)`` into the key: each device
runs the per-example call, which is what tuning times.
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
    """``jax.vmap`` of ``kernel`` with one config chosen for the batched call.

    ``vmap_with_config(kernel, in_axes=0, out_axes=0, executor=None)``; ejkernel's order
    ``vmap_with_config(executor, kernel, in_axes=0, out_axes=0)`` is accepted too. Keyword
    arguments of the returned function are passed unmapped to every example.
    """
    kernel, rest, executor = _order(kernel, args[0] if args else _MISSING, tuple(args[1:]), executor, "vmap_with_config")
    return _vmap(kernel, *rest, executor=executor, **kwargs)


def _vmap(kernel: Kernel[Any, Any], in_axes: Any = 0, out_axes: Any = 0, executor: Executor | None = None) -> Callable[..., Any]:
    if not isinstance(kernel, Kernel):
        raise TypeError(f"kernel: expected a Kernel, got {type(kernel).__name__}")

    def call(*args: Any, **kwargs: Any) -> Any:
        _per_example(args, in_axes)  # the in_axes errors, named, before jax.vmap's own
        chosen = executor if executor is not None else get_default_executor()
        return jax.vmap(lambda *example: chosen(kernel, *example, **kwargs), in_axes=in_axes, out_axes=out_axes)(*args)

    return call


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
