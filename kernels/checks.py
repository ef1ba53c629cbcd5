"""Argument checks the kernels' public functions share: each error names the argument and what
was expected, before anything is traced (a wrong dtype would otherwise surface as a lowering
error deep inside a kernel, or not at all).

Two kinds of check:

* on what is known while tracing (dtypes, shapes, Python numbers, config fields): always;
* on the *values* of arrays (labels in range, ``cu_seqlens`` non-decreasing): only on concrete
  arrays (:func:`is_concrete`: a NumPy array, or a JAX array that is not a tracer), that is
  when the kernel runs eagerly. Under ``jit``, ``grad`` or ``vmap`` the values are not known
  and nothing is checked, so a traced call costs nothing; each kernel's docstring says what
  traced values out of range give.
"""

from __future__ import annotations

import math
import numbers
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

__all__ = [
    "check_config",
    "check_fields_positive",
    "check_floating",
    "check_ignore_index",
    "check_integer",
    "check_labels",
    "check_nondecreasing",
    "check_number",
    "check_same_dtype",
    "is_concrete",
]


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


def check_fields_positive(cfg: Any, names: tuple[str, ...]) -> None:
    """Each of ``cfg``'s fields ``names`` is a positive int (a config's block sizes and counts);
    ValueError naming the field."""
    for name in names:
        value = getattr(cfg, name)
        if not isinstance(value, numbers.Integral) or isinstance(value, bool) or value < 1:
            raise ValueError(f"{name}: expected a positive int, got {value!r}")


def check_number(value: Any, argument: str, *, minimum: float | None = None) -> float:
    """``value`` as a float: a real Python or NumPy number (not a bool, an array or a string),
    finite, and at least ``minimum`` when given."""
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, numbers.Real):
        raise TypeError(f"{argument}: expected a real number, got {type(value).__name__} {value!r:.60}")
    number = float(value)
    if not math.isfinite(number):
        raise ValueError(f"{argument}: expected a finite number, got {value!r}")
    if minimum is not None and number < minimum:
        raise ValueError(f"{argument}: expected a number >= {minimum}, got {value!r}")
    return number


def check_ignore_index(value: Any) -> None:
    """``value`` is None or an int (not a bool: ``True`` is not the class 1)."""
    if value is not None and (not isinstance(value, numbers.Integral) or isinstance(value, (bool, np.bool_))):
        raise TypeError(f"ignore_index: expected an int or None, got {type(value).__name__} {value!r:.60}")


def is_concrete(x: Any) -> bool:
    """Whether the values of the array ``x`` are known now (eager), not traced."""
    return isinstance(x, np.ndarray) or (isinstance(x, jax.Array) and not isinstance(x, jax.core.Tracer))


def check_labels(labels: Any, vocab: int, ignore_index: int | None, argument: str = "labels") -> None:
    """Concrete ``labels`` lie in ``[0, vocab)`` or equal ``ignore_index``; ValueError naming the
    first that does not. Traced labels are not checked."""
    if not is_concrete(labels):
        return
    values = np.asarray(labels)
    bad = (values < 0) | (values >= vocab)
    if ignore_index is not None:
        bad &= values != ignore_index
    if bad.any():
        where = int(np.flatnonzero(bad.ravel())[0])
        allowed = f"[0, {vocab})" + ("" if ignore_index is None else f" or the ignore_index {ignore_index}")
        raise ValueError(
            f"{argument}: expected classes in {allowed}, got {values.ravel()[where]} at index {where} "
            f"({int(bad.sum())} of {values.size} out of range)"
        )


def check_nondecreasing(x: Any, argument: str) -> None:
    """Concrete ``x`` is non-negative and non-decreasing (cumulative lengths); traced: not checked."""
    if not is_concrete(x):
        return
    values = np.asarray(x).ravel()
    if values.size and values[0] < 0:
        raise ValueError(f"{argument}: expected non-negative cumulative lengths, got {values[0]} first")
    drops = np.flatnonzero(np.diff(values) < 0)
    if drops.size:
        i = int(drops[0])
        raise ValueError(f"{argument}: expected non-decreasing values, got {values[i]} then {values[i + 1]} at index {i + 1}")


def _describe(x: Any) -> str:
    dtype = getattr(x, "dtype", None)
    return f"{jnp.dtype(dtype).name} array" if dtype is not None else type(x).__name__
