"""The name a script's module has everywhere: ``__main__`` is the script's own module name.

A kernel written in a script runs, while the script runs, in the module ``__main__``; the same
file imported by ``ejlabel --import user_kernels`` (or ``ejlabel tune user_kernels:step``) is the
module ``user_kernels``. Every name ejlabel writes for a class or function (a config type in the
persistent cache, a kernel class in a call description, a function in a call key, a kernel's
default op id) must be the same in both processes, or the script and the command line would
tune, store and look up different entries for one kernel.

So ``__main__`` is written as the name the script has as a module: the one ``python -m NAME``
was given (its ``__spec__``), else the file name of ``python path/NAME.py`` without ``.py``,
which is what ``import NAME`` finds from the script's folder (Python puts that folder first on
the path). A ``__main__`` without a file (``python -c``, an interactive session, a notebook)
keeps the name ``__main__``: no other process can import it anyway.

Only the written name changes: an object is still checked against its own loaded module, and a
name read back resolves through the registry (:mod:`ejlabel.utils.serialize`), never by import.
"""

from __future__ import annotations

import keyword
import sys
from pathlib import Path

__all__ = ["MAIN", "public_module_name", "script_module_name"]

MAIN = "__main__"


def script_module_name() -> str | None:
    """The module name the running ``__main__`` has when imported, or None (no file, no name)."""
    main = sys.modules.get(MAIN)
    if main is None:
        return None
    spec = getattr(main, "__spec__", None)
    name = getattr(spec, "name", None)
    if isinstance(name, str) and name and name != MAIN:
        return name  # python -m pkg.mod
    file = getattr(main, "__file__", None)
    if not isinstance(file, str) or not file.endswith(".py"):
        return None
    stem = Path(file).stem
    if not stem.isidentifier() or keyword.iskeyword(stem):
        return None  # my-script.py: no import statement could name it
    return stem


def public_module_name(module: str) -> str:
    """``module`` as every process names it: ``__main__`` becomes the script's module name."""
    if module != MAIN:
        return module
    return script_module_name() or MAIN

