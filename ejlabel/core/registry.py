"""Which kernels and config types data may name: the registry that replaces imports from data.

Cache entries, exported config files and call descriptions in compiled programs name classes
(``"ejlabel.kernels.matmul:MatmulConfig"``). Importing a module named by data would let a
file run code (``{"$ref": "antigravity:geohash"}`` once opened a browser from
``ejlabel cache ls``), so nothing found in data is ever imported. Names resolve only through
this registry, which code fills:

* Every :class:`~ejlabel.core.kernel.Kernel` subclass registers itself when its class
  statement runs (``Kernel.__init_subclass__`` calls :func:`register_kernel`), together with
  its config type, inferred from the generic base: ``class MatmulKernel(Kernel[MatmulConfig,
  jax.Array])`` registers ``MatmulConfig`` and, through its fields' annotations and defaults,
  every dataclass and enum nested in it. A kernel without the generic argument can name its
  config type with :func:`register_config_type` (``kernel=``).
* Each kernel instance records its op id (``matmul@v2``) with its class's config types
  (:func:`note_kernel_instance`), so a config read from a cache can be checked against the
  type its kernel expects (:func:`config_type_problem`).
* A program's own kernels are therefore registered by importing the module that defines them,
  in the user's code. Offline tools (``ejlabel --import MODULE``) call
  :func:`import_user_modules` with module names the user typed: code the user chose, never
  names read from a file.

Kernels defined inside a function have no name that data can use; they work in-process but
cannot be rebuilt from a program file.
"""

from __future__ import annotations

import dataclasses
import enum
import importlib
import re
import threading
import types
import typing
from collections.abc import Iterable
from typing import Any, TypeVar

from ejlabel.core.label_format import forward_op_id, is_backward
from ejlabel.utils.serialize import (
    UnregisteredTypeError,
    qualified_name,
    register,
    unregistered_error,
)

__all__ = [
    "UnregisteredTypeError",
    "register_kernel",
    "register_config_type",
    "registered_kernel",
    "registered_kernels",
    "kernel_config_types",
    "note_kernel_instance",
    "expected_config_types",
    "config_type_problem",
    "import_user_modules",
]

T = TypeVar("T", bound=type)

_LOCK = threading.RLock()
_KERNELS: dict[str, type] = {}
# Kernel class -> its config types; () when they are unknown (no generic argument).
_KERNEL_CONFIGS: dict[type, tuple[type, ...]] = {}
# Versioned op id -> config types of the kernel classes seen with that op id; None once a
# class with unknown config types used it (then nothing can be checked for that op id).
_OP_CONFIGS: dict[str, frozenset[type] | None] = {}
_MODULE_RE = re.compile(r"[A-Za-z_]\w*(\.[A-Za-z_]\w*)*")


# ---------------------------------------------------------------------------- config types


def _concrete_types(hint: Any) -> tuple[type, ...]:
    """The classes a type hint allows: ``A | B`` -> (A, B); ``list[int]`` -> (list,); a TypeVar,
    ``Any`` or anything unresolved -> ()."""
    origin = typing.get_origin(hint)
    if origin is typing.Union or (hasattr(types, "UnionType") and isinstance(hint, types.UnionType)):
        return tuple(t for arg in typing.get_args(hint) for t in _concrete_types(arg))
    if origin is typing.Annotated:
        return _concrete_types(typing.get_args(hint)[0])
    if isinstance(origin, type):
        return (origin,)
    if isinstance(hint, type):
        return (type(None),) if hint is type(None) else (hint,)
    if hint is None:
        return (type(None),)
    return ()


def _nested_hints(hint: Any) -> Iterable[Any]:
    """Every type named anywhere in a hint (``tuple[Layout, int] | None`` -> Layout, int, ...)."""
    stack = [hint]
    while stack:
        h = stack.pop()
        origin = typing.get_origin(h)
        if origin is None and isinstance(h, type):
            yield h
        elif isinstance(origin, type):  # list[Cfg]: list here, Cfg from the arguments below
            yield origin
        stack.extend(a for a in typing.get_args(h) if not isinstance(a, (str, int, bool, bytes)))


def _field_types(cls: type) -> Iterable[type]:
    """The types a dataclass's fields may hold, from annotations (resolved where they can be)
    and from default values (which catches what an unresolvable annotation hides)."""
    try:
        hints: dict[str, Any] = typing.get_type_hints(cls)
    except Exception:  # forward references to names not defined yet, local classes: use the rest
        hints = {}
    for field in dataclasses.fields(cls):
        hint = hints.get(field.name, field.type)
        if not isinstance(hint, str):
            yield from _nested_hints(hint)
        if field.default is not dataclasses.MISSING:
            yield type(field.default)


def register_config_type(cls: T, *, kernel: type | None = None) -> T:
    """Let data name the config type ``cls`` and every dataclass and enum nested in its fields.

    With ``kernel`` (a Kernel subclass), also record ``cls`` as that kernel's config type, for
    kernels whose class does not say ``Kernel[Cfg, Out]``. Returns ``cls`` (decorator use).
    """
    if not isinstance(cls, type):
        raise TypeError(f"cls: expected a class, got {cls!r}")
    _register_tree(cls, explicit=True)
    if kernel is not None:
        with _LOCK:
            _KERNEL_CONFIGS[kernel] = tuple(dict.fromkeys((*_KERNEL_CONFIGS.get(kernel, ()), cls)))
    return cls


def _register_tree(cls: type, *, explicit: bool) -> None:
    """Register ``cls`` and the dataclasses and enums reachable through its fields."""
    seen: set[type] = set()
    stack = [cls]
    while stack:
        t = stack.pop()
        if t in seen or not isinstance(t, type):
            continue
        seen.add(t)
        if issubclass(t, enum.Enum) or dataclasses.is_dataclass(t):
            try:
                register(t)
            except (TypeError, ValueError):
                # A class defined in a function has no name data could use. Asked for
                # explicitly, that is an error; otherwise it only cannot round-trip.
                if explicit and t is cls:
                    raise
            if dataclasses.is_dataclass(t):
                stack.extend(_field_types(t))


# ---------------------------------------------------------------------------- kernels


def _inferred_config_types(cls: type, base: type) -> tuple[type, ...]:
    """The ``Cfg`` of the nearest ``Kernel[Cfg, Out]``-style base in ``cls``'s MRO."""
    for klass in cls.__mro__:
        # Own __dict__ only: the attribute lookup would find a parent's __orig_bases__.
        for orig in klass.__dict__.get("__orig_bases__", ()):
            origin = typing.get_origin(orig)
            if isinstance(origin, type) and issubclass(origin, base):
                args = typing.get_args(orig)
                if args:
                    found = _concrete_types(args[0])
                    if found:
                        return found
    return ()


def register_kernel(cls: type, base: type) -> None:
    """Register the Kernel subclass ``cls`` (``base`` is ``Kernel``) and its config types.

    Called by ``Kernel.__init_subclass__`` when the class statement runs; users do not call it.
    """
    if not (isinstance(cls, type) and issubclass(cls, base)):
        raise TypeError(f"cls: expected a subclass of {base.__qualname__}, got {cls!r}")
    configs = _inferred_config_types(cls, base)
    with _LOCK:
        _KERNEL_CONFIGS[cls] = configs
    for cfg_type in configs:
        # Not explicit: a kernel with a config class defined in a function still works in-process.
        _register_tree(cfg_type, explicit=False)
    try:
        name = qualified_name(cls)
    except TypeError:
        return  # defined in a function: usable in-process, not nameable by data
    with _LOCK:
        _KERNELS[name] = cls
    register(cls)


def registered_kernel(path: str) -> type:
    """The Kernel subclass registered as ``module:QualName``. Never imports.

    :class:`UnregisteredTypeError` (a ValueError) naming the module to import when no such
    kernel class has been defined in this process.
    """
    if not isinstance(path, str):
        raise TypeError(f"path: expected 'module:QualName', got {type(path).__name__}")
    found = _KERNELS.get(path)
    if found is None:
        raise unregistered_error(path, "kernel")
    return found


def registered_kernels() -> dict[str, type]:
    """Name -> class of every registered kernel."""
    with _LOCK:
        return dict(sorted(_KERNELS.items()))


def kernel_config_types(cls: type) -> tuple[type, ...]:
    """The config types registered for the kernel class ``cls``; () when unknown."""
    for klass in getattr(cls, "__mro__", ()):
        found = _KERNEL_CONFIGS.get(klass)
        if found:
            return found
    return ()


def note_kernel_instance(kernel: Any) -> None:
    """Record that ``kernel.versioned_id`` runs with its class's config types (from ``Kernel.__init__``)."""
    op_id = kernel.versioned_id
    configs = kernel_config_types(type(kernel))
    with _LOCK:
        known = _OP_CONFIGS.get(op_id, frozenset())
        if known is None:
            return
        _OP_CONFIGS[op_id] = None if not configs else known | frozenset(configs)


def expected_config_types(op_id: str) -> frozenset[type] | None:
    """Config types the kernels with ``op_id`` take (a backward op id asks its forward's);
    None when unknown (no kernel instance seen, or one whose config type is not known)."""
    if is_backward(op_id):
        op_id = forward_op_id(op_id)
    return _OP_CONFIGS.get(op_id) or None


def config_type_problem(op_id: str, cfg: Any) -> str | None:
    """Why ``cfg`` cannot be a config of ``op_id`` (its type is not one the kernel takes), or
    None when it can be or nothing is known about ``op_id``."""
    expected = expected_config_types(op_id)
    if expected is None or isinstance(cfg, tuple(expected)):
        return None
    names = " or ".join(sorted(t.__qualname__ for t in expected))
    return f"{op_id} takes a {names} config, but the entry holds a {type(cfg).__module__}.{type(cfg).__qualname__}"


# ---------------------------------------------------------------------------- user modules


def import_user_modules(names: Iterable[str]) -> list[types.ModuleType]:
    """Import the modules the user named (``ejlabel --import MODULE``), registering their kernels.

    These names come from the user's command line or code, never from a cache or program file.
    ValueError for a name that is not a dotted module name (a file path, say); the ImportError
    of a module that fails to import names it.
    """
    if isinstance(names, str):
        names = [names]
    modules = []
    for name in names:
        if not isinstance(name, str) or not _MODULE_RE.fullmatch(name):
            raise ValueError(f"--import: expected a module name such as 'my_pkg.kernels', got {name!r}")
        try:
            modules.append(importlib.import_module(name))
        except ImportError as err:
            raise ImportError(f"--import {name}: {err}", name=name) from err
    return modules
