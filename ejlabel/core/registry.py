"""Which kernels and config types data may name: the registry that replaces imports from data.

Cache entries, exported config files and call descriptions in compiled programs name classes
(``"ejlabel.kernels.matmul:MatmulConfig"``). Importing a module named by data would let a
file run code (``{"$ref": "antigravity:geohash"}`` once opened a browser from
``ejlabel cache ls``), so nothing found in data is ever imported. Names resolve only through
this registry, which the process's own code fills:

* Every :class:`~ejlabel.core.kernel.Kernel` subclass registers itself when its class
  statement runs (``Kernel.__init_subclass__`` calls :func:`register_kernel`), together with
  its config type: the ``Cfg`` of a generic base (``class MatmulKernel(Kernel[MatmulConfig,
  jax.Array])``), else what the class's own annotations say (a ``cfg`` parameter of any method,
  ``heuristic_cfg``'s return type, the item type of ``config_space``'s). Through the type's
  fields' annotations and defaults, every dataclass and enum nested in it is registered too.
  A kernel with neither can name its config type with :func:`register_config_type`
  (``kernel=``), but need not: the first config it hands ejlabel (:func:`note_config`: its
  heuristic config when a call is selected, a tuning candidate, a config stored for its op id)
  registers that config's type.
* Each kernel instance records its op id (``matmul@v2``) with its class
  (:func:`note_kernel_instance`), so a config read from a cache can be checked against the
  types its kernel takes (:func:`config_type_problem`).
* A program's own kernels are therefore registered by running or importing the code that
  defines them. Offline tools (``ejlabel --import MODULE``) call :func:`import_user_modules`
  with the modules the user typed (a module name, or a path to a ``.py`` file): code the user
  chose, never names read from a file.

A script's classes are registered under the script's module name, not ``__main__``
(:mod:`ejlabel.utils.modules`): the names a script writes are the names a process that imports
the same file registers. Kernels defined inside a function have no name that data can use; they
work in-process but cannot be rebuilt from a program file.
"""

from __future__ import annotations

import dataclasses
import enum
import importlib
import inspect
import os
import re
import sys
import threading
import types
import typing
from collections.abc import Iterable
from pathlib import Path
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
    "note_config",
    "learn_config_types",
    "expected_config_types",
    "config_type_problem",
    "import_user_modules",
]

T = TypeVar("T", bound=type)

_LOCK = threading.RLock()
_KERNELS: dict[str, type] = {}
# Kernel class -> its config types; () while they are unknown (no generic argument, no
# annotation, no config handed over yet).
_KERNEL_CONFIGS: dict[type, tuple[type, ...]] = {}
# Versioned op id -> the kernel classes whose instances use it.
_OP_KERNELS: dict[str, set[type]] = {}
# (kernel class, config type) pairs already noted, and kernel classes whose heuristic was
# asked for their config type: each is done once.
_NOTED: set[tuple[type, type]] = set()
_PROBED: set[type] = set()
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
    """The ``Cfg`` of the nearest ``Kernel[Cfg, Out]``-style base in ``cls``'s MRO, else the
    config types the class's methods are annotated with (:func:`_annotated_config_types`)."""
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
    return _annotated_config_types(cls, base)


def _annotated_config_types(cls: type, base: type) -> tuple[type, ...]:
    """Config types named by the annotations of ``cls``'s own methods (``base``'s excluded):
    every parameter called ``cfg``, the return of ``heuristic_cfg*``, the items of the return
    of ``config_space`` / ``candidate_cfgs*`` / ``prior_configs``. Unresolvable annotations are
    passed over."""
    found: list[type] = []
    for klass in cls.__mro__:
        if klass is base or klass is object or klass.__module__ == "typing":
            continue
        for name, attr in vars(klass).items():
            fn = attr.__func__ if isinstance(attr, (staticmethod, classmethod)) else attr
            if not inspect.isfunction(fn):
                continue
            try:
                hints = typing.get_type_hints(fn)
            except Exception:  # a forward reference to a name defined later, a local class
                hints = {k: v for k, v in getattr(fn, "__annotations__", {}).items() if not isinstance(v, str)}
            named = [hints.get("cfg")]
            if name.startswith("heuristic_cfg"):
                named.append(hints.get("return"))
            elif name in ("config_space", "candidate_cfgs", "prior_configs") or name.startswith("candidate_cfgs_"):
                named.extend(typing.get_args(hints.get("return"))[:1])  # list[Cfg] -> Cfg
            found.extend(t for hint in named if hint is not None for t in _concrete_types(hint))
    return tuple(t for t in dict.fromkeys(found) if t is not type(None) and t is not object)


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
    with _LOCK:
        _OP_KERNELS.setdefault(kernel.versioned_id, set()).add(type(kernel))


def note_config(kernel: Any, cfg: Any) -> None:
    """Register the type of ``cfg``, a config ``kernel`` handed ejlabel, as one its class takes.

    The config is an object this process made, so its type is code, not data: registering it
    (with the dataclasses and enums nested in its fields) lets the caches store and read back
    the configs of a kernel whose class names no config type. Cheap after the first time for
    each (kernel class, config type) pair; a config class defined inside a function stays
    usable in-process, with no name data could use.
    """
    if cfg is None:
        return
    pair = (type(kernel), type(cfg))
    if pair in _NOTED:
        return
    _register_tree(pair[1], explicit=False)
    with _LOCK:
        known = kernel_config_types(pair[0])
        if not isinstance(cfg, known):
            _KERNEL_CONFIGS[pair[0]] = (*known, pair[1])
        _NOTED.add(pair)


def learn_config_types(kernel: Any, inv: Any) -> None:
    """Learn the config type of ``kernel``'s class from its heuristic config for ``inv``, once
    per class and only while the type is unknown; what the heuristic raises is left to the
    call's own selection to report."""
    cls = type(kernel)
    if cls in _PROBED or kernel_config_types(cls):
        return
    _PROBED.add(cls)
    try:
        cfg = kernel.heuristic_cfg(inv)
    except Exception:  # noqa: BLE001 - the selection that follows calls it again and says why
        return
    note_config(kernel, cfg)


def note_config_for_op(op_id: str, cfg: Any) -> None:
    """:func:`note_config` for every kernel class of this process that uses ``op_id`` and may
    take ``cfg`` (its config types unknown, or ``cfg`` one of them). Nothing for an op id no
    kernel instance of this process uses: then nothing vouches for the type."""
    if is_backward(op_id):
        op_id = forward_op_id(op_id)
    with _LOCK:
        classes = list(_OP_KERNELS.get(op_id, ()))
    for cls in classes:
        known = kernel_config_types(cls)
        if not known or isinstance(cfg, known):
            _register_tree(type(cfg), explicit=False)
            with _LOCK:
                if not known:
                    _KERNEL_CONFIGS[cls] = (type(cfg),)


def expected_config_types(op_id: str) -> frozenset[type] | None:
    """Config types the kernels with ``op_id`` take (a backward op id asks its forward's);
    None when unknown (no kernel instance seen, or one whose config type is not known)."""
    if is_backward(op_id):
        op_id = forward_op_id(op_id)
    with _LOCK:
        classes = list(_OP_KERNELS.get(op_id, ()))
    found: set[type] = set()
    for cls in classes:
        types_ = kernel_config_types(cls)
        if not types_:
            return None
        found.update(types_)
    return frozenset(found) or None


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

    Each name is a dotted module name, imported from the import path as ``import`` would, or a
    path to a ``.py`` file, imported as the module its file name names with its folder first on
    the import path: as ``python path/to/user_kernels.py`` runs it, so its classes get the names
    the script gives them (``user_kernels:UCfg``). These names come from the user's command line
    or code, never from a cache or program file. ValueError for a name that is neither (no such
    file); the ImportError of a module that fails to import names it.
    """
    if isinstance(names, str):
        names = [names]
    modules = []
    for name in names:
        if isinstance(name, (str, os.PathLike)) and _is_file_name(os.fspath(name)):
            modules.append(_import_file(os.fspath(name)))
            continue
        if not isinstance(name, str) or not _MODULE_RE.fullmatch(name):
            raise ValueError(f"--import: expected a module name such as 'my_pkg.kernels' or a path to a .py file, got {name!r}")
        try:
            modules.append(importlib.import_module(name))
        except ImportError as err:
            raise ImportError(f"--import {name}: {err}", name=name) from err
    return modules


def _is_file_name(text: str) -> bool:
    return text.endswith(".py") or os.sep in text or (os.altsep is not None and os.altsep in text)


def _import_file(text: str) -> types.ModuleType:
    """The module of the ``.py`` file ``text``, imported under its file name from its folder."""
    path = Path(text)
    if path.suffix != ".py" or not path.is_file():
        raise ValueError(
            f"--import {text!r}: no such .py file; expected a module name such as 'my_pkg.kernels' or a path to a .py file"
        )
    path = path.resolve()
    name = path.stem
    if not _MODULE_RE.fullmatch(name) or "." in name:
        raise ValueError(f"--import {text!r}: the file name {name!r} is not a module name, so nothing could import it by name")
    main = sys.modules.get("__main__")
    if _same_file(getattr(main, "__file__", None), path):
        return main  # type: ignore[return-value]  # the running script itself: already run
    folder = str(path.parent)
    if folder not in sys.path:
        sys.path.insert(0, folder)
    try:
        module = importlib.import_module(name)
    except ImportError as err:
        raise ImportError(f"--import {text}: {err}", name=name) from err
    if not _same_file(getattr(module, "__file__", None), path):
        raise ImportError(f"--import {text}: the module {name} is {getattr(module, '__file__', None) or 'built in'}, not this file", name=name)
    return module


def _same_file(file: Any, path: Path) -> bool:
    return isinstance(file, str) and Path(file).resolve() == path
