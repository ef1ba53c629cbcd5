"""How ``ejlabel.kernels`` and ``ejlabel.analysis`` import from a source checkout.

The repository's top level is the project's design card: ``ejlabel/`` (the core), ``kernels/``
and ``analysis/`` side by side. Installed, the two siblings become the subpackages
``ejlabel.kernels`` and ``ejlabel.analysis`` (``package-dir`` in ``pyproject.toml``), so an
installed ``ejlabel/`` folder holds them as real folders. In a checkout it does not, and Python
imports the checkout's ``ejlabel/`` whenever the repository root is first on ``sys.path``
(``python -m ...``, ``python -c ...`` and ``pytest`` run from the root all put it there), which
used to hide the installed subpackages.

So when ``ejlabel`` is imported from a checkout (its parent folder holds ``pyproject.toml`` and
the sibling packages, and ``ejlabel/`` has no ``kernels/`` of its own), :func:`install` puts a
meta-path finder in front that maps exactly those two names to the sibling folders. Their own
submodules are then found the ordinary way, through the package's ``__path__``. Installed
copies never install the finder. This is the only place that knows about the source layout.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import importlib.util
import sys
from pathlib import Path

__all__ = ["SIBLING_PACKAGES", "install"]

SIBLING_PACKAGES: dict[str, str] = {"ejlabel.kernels": "kernels", "ejlabel.analysis": "analysis"}
"""Subpackage import name -> folder beside ``ejlabel/`` in the repository."""


class _SiblingFinder(importlib.abc.MetaPathFinder):
    def __init__(self, root: Path) -> None:
        self.root = root

    def find_spec(self, fullname: str, path: object = None, target: object = None) -> importlib.machinery.ModuleSpec | None:
        folder = SIBLING_PACKAGES.get(fullname)
        if folder is None:
            return None
        init = self.root / folder / "__init__.py"
        return importlib.util.spec_from_file_location(fullname, init, submodule_search_locations=[str(init.parent)])


def install(package_dir: Path) -> None:
    """Make the sibling folders importable as subpackages if ``package_dir`` is a checkout's."""
    root = package_dir.parent
    if any((package_dir / name.rpartition(".")[2]).is_dir() for name in SIBLING_PACKAGES):
        return  # an installed copy: the subpackages are real folders
    if not (root / "pyproject.toml").is_file():
        return
    if not all((root / folder / "__init__.py").is_file() for folder in SIBLING_PACKAGES.values()):
        return
    if any(isinstance(finder, _SiblingFinder) for finder in sys.meta_path):
        return
    sys.meta_path.insert(0, _SiblingFinder(root))
