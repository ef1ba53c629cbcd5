"""Argument checks the kernels' public functions share: each error names the argument and what
was expected, before anything is traced (a wrong dtype would otherwise surface as a lowering
error deep inside a kernel, or not at all).
"""

from __future__ import annotations

from typing import Any

import jax.numpy as jnp

__all__ = ["check_config", "check_floating", "check_integer", "check_same_dtype"]


def check_config(cfg: Any, expected: type, argument: str = "cfg") -> None:
    """``cfg`` is None (the executor chooses) or an instance of ``expected``."""
    if cfg is not None and not isinstance(cfg, expected):
        raise TypeError(f"{argument}: expected a {expected.__name__} or None, got {type(cfg).__name__} {cfg!r}")


def check_floating(x: Any, argument: str) -> None:
    """``x`` is an array of a floating dtype."""
    dtype = getattr(x, "dtype", None)
    if dtype is None or not jnp.issubdtype(dtype, jnp.floating):
        raise TypeError(f"{argument}: expected a floating-point array, got {_describe(x)}")


def check_integer(x: Any, argument: str) -> None:
    """``x`` is an array of an integer dtype."""
    dtype = getattr(x, "dtype", None)
    if dtype is None or not jnp.issubdtype(dtype, jnp.integer):
        raise TypeError(f"{argument}: expected an integer array, got {_describe(x)}")


def check_same_dtype(arrays: dict[str, Any]) -> None:
    """Every array in ``arrays`` (argument name -> array) has one dtype."""
    dtypes = {name: getattr(x, "dtype", None) for name, x in arrays.items()}
    if len(set(dtypes.values())) > 1:
        listed = ", ".join(f"{name} {jnp.dtype(d).name if d is not None else '?'}" for name, d in dtypes.items())
        raise TypeError(f"{', '.join(arrays)}: expected one dtype, got {listed}")


def _describe(x: Any) -> str:
    dtype = getattr(x, "dtype", None)
    return f"{jnp.dtype(dtype).name} array" if dtype is not None else type(x).__name__
