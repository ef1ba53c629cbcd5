"""How functions, classes and other callables are identified in a call key.

A call key must be the same in every process that makes the same call, so nothing in it may
depend on memory addresses or on ``repr``. A function, class or callable object counts by its
module and qualified name, but only after checking that importing the module and walking the
name gives back the very same object (:func:`resolves`); a rebound or local name is not a
faithful stand-in. A script's ``__main__`` counts as the script's module name
(:mod:`ejlabel.utils.modules`), as the command line that imports the script names it. What has no such name (lambdas, closures, local functions) counts by what it
computes: its code (without file name or line numbers, so moving a lambda does not change its
key), defaults and closed-over values. Bound methods, partials and wrappers count by their
parts; an object with none of these rules is an error naming its type.
"""

from __future__ import annotations

import functools
import importlib
import sys
import types
from typing import Any

import jax.tree_util as jtu

from ejlabel.utils.fingerprint.grammar import LEAF, RECORD, SEQ, Node, Unsupported, qualified_name
from ejlabel.utils.modules import public_module_name

__all__ = [
    "EmptyCell", "reduce_builtin_function", "reduce_code", "reduce_descriptor", "reduce_function",
    "reduce_method", "reduce_other", "reduce_partial", "reduce_type", "resolves",
]

_MISSING = object()


# Objects already proven to be reachable by module + qualname, by id.  The
# object itself is stored so an id reused after garbage collection never
# matches; such objects live in modules anyway, so holding them costs nothing.
_RESOLVED: dict[int, Any] = {}


def resolves(obj: Any, module: Any, qualname: Any) -> bool:
    """Whether importing ``module`` and walking ``qualname`` yields ``obj`` itself.

    Only then is the name a faithful, process-independent stand-in for the
    object; a lambda, a local function or a rebound name is not.
    """
    if _RESOLVED.get(id(obj)) is obj:
        return True
    if not isinstance(module, str) or not isinstance(qualname, str) or "<" in qualname:
        return False
    target = sys.modules.get(module)
    if target is None:
        try:
            target = importlib.import_module(module)
        except Exception:
            return False
    for part in qualname.split("."):
        target = getattr(target, part, _MISSING)
        if target is _MISSING:
            return False
    if target is not obj:
        return False
    _RESOLVED[id(obj)] = obj
    return True


# Builtin types that no module attribute names (there is no builtins.NoneType).
_UNNAMED_BUILTIN_TYPES = {type(None): "NoneType", type(...): "ellipsis", type(NotImplemented): "NotImplementedType"}


def reduce_type(tp: type) -> Node:
    unnamed = _UNNAMED_BUILTIN_TYPES.get(tp)
    if unnamed is not None:
        return Node(LEAF, "type", "builtins:" + unnamed)
    module, qualname = tp.__module__, tp.__qualname__
    if module == "builtins" or resolves(tp, module, qualname):
        return Node(LEAF, "type", f"{public_module_name(module)}:{qualname}")
    raise Unsupported(tp, f"{module}.{qualname} cannot be imported by that name")


class EmptyCell:
    """Stands in for a closure cell that has not been assigned yet."""


_EMPTY_CELL = EmptyCell()


def _cell_contents(cell: types.CellType) -> Any:
    try:
        return cell.cell_contents
    except ValueError:
        return _EMPTY_CELL


_CLOSURE_FIELDS = ("module", "qualname", "code", "defaults", "kwdefaults", "closure")


def reduce_function(fn: types.FunctionType) -> Node:
    """A named function by its name; anything else by what it computes.

    Lambdas, closures and local functions are described by their code, their
    defaults and the values they closed over, so two closures over different
    constants differ while recreating the same lambda gives the same key.
    """
    module, qualname = fn.__module__, fn.__qualname__
    if resolves(fn, module, qualname):
        return Node(LEAF, "function", f"{public_module_name(module)}:{qualname}")
    cells = tuple(_cell_contents(c) for c in fn.__closure__ or ())
    values = (module, qualname, fn.__code__, fn.__defaults__, fn.__kwdefaults__, cells)
    return Node(RECORD, "closure", (_CLOSURE_FIELDS, values))


_CODE_FIELDS = (
    "name",
    "argcount",
    "posonlyargcount",
    "kwonlyargcount",
    "flags",
    "code",
    "consts",
    "names",
    "varnames",
    "freevars",
    "cellvars",
    "exceptiontable",
)


def reduce_code(code: types.CodeType) -> Node:
    # File name and line numbers are left out: moving a lambda must not
    # change what it means.
    values = (
        code.co_name,
        code.co_argcount,
        code.co_posonlyargcount,
        code.co_kwonlyargcount,
        code.co_flags,
        code.co_code,
        code.co_consts,
        code.co_names,
        code.co_varnames,
        code.co_freevars,
        code.co_cellvars,
        getattr(code, "co_exceptiontable", b""),
    )
    return Node(RECORD, "code", (_CODE_FIELDS, values))


def reduce_builtin_function(fn: types.BuiltinFunctionType) -> Node:
    owner = getattr(fn, "__self__", None)
    if owner is None or isinstance(owner, types.ModuleType):
        if resolves(fn, fn.__module__, fn.__qualname__):
            return Node(LEAF, "function", f"{fn.__module__}:{fn.__qualname__}")
        raise Unsupported(fn, f"{fn!r} cannot be imported by its name")
    # A builtin method bound to an object, such as ``[].append``.
    return Node(RECORD, "builtin_method", (("self", "name"), (owner, fn.__name__)))


def reduce_descriptor(d: Any) -> Node:
    # Unbound builtin methods such as ``str.upper``.
    return Node(RECORD, "descriptor", (("owner", "name"), (d.__objclass__, d.__name__)))


def reduce_method(m: types.MethodType) -> Node:
    return Node(RECORD, "method", (("self", "func"), (m.__self__, m.__func__)))


def reduce_partial(p: functools.partial) -> Node:
    values = (p.func, tuple(p.args), dict(p.keywords or {}))
    return Node(RECORD, "partial:" + qualified_name(type(p)), (("func", "args", "keywords"), values))


def reduce_other(obj: Any) -> Node:
    """Last resort for values of a class with no rule of its own.

    Accepts a callable object that is its module's attribute (jitted or
    custom-derivative functions defined at module level), a wrapper that
    names what it wraps, and a container jax knows as a pytree node.  Never
    falls back to ``str``/``repr``: their text can hold memory addresses.
    """
    module = getattr(obj, "__module__", None)
    qualname = getattr(obj, "__qualname__", None)
    if module is not None and qualname is not None and resolves(obj, module, qualname):
        return Node(LEAF, "callable", f"{public_module_name(module)}:{qualname}")
    wrapped = getattr(obj, "__wrapped__", _MISSING)
    if wrapped is not _MISSING and wrapped is not obj:
        return Node(SEQ, "wrapped:" + qualified_name(type(obj)), (wrapped,))
    try:
        children, meta = jtu.flatten_one_level(obj)
    except ValueError:
        raise Unsupported(obj) from None
    return Node(SEQ, "pytree:" + qualified_name(type(obj)), (meta, *children))
