"""The package must never load pickled data: a cache or program file could then run code."""

from __future__ import annotations

import ast
import pathlib

ROOT = pathlib.Path(__file__).resolve().parent.parent
SOURCE_DIRS = ("ejlabel", "kernels", "analysis")
# Every module here can execute code while loading data; shelve is pickle underneath.
BANNED_MODULES = {"pickle", "_pickle", "cPickle", "cloudpickle", "dill", "marshal", "shelve", "joblib"}


def _banned(name: str | None) -> bool:
    return name is not None and name.split(".")[0] in BANNED_MODULES


def _problems(path: pathlib.Path) -> list[str]:
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    found = []
    for node in ast.walk(tree):
        where = f"{path.relative_to(ROOT)}:{getattr(node, 'lineno', '?')}"
        if isinstance(node, ast.Import):
            found += [f"{where}: import {a.name}" for a in node.names if _banned(a.name)]
        elif isinstance(node, ast.ImportFrom) and _banned(node.module):
            found.append(f"{where}: from {node.module} import ...")
        elif isinstance(node, ast.Call):
            # importlib.import_module("pickle") / __import__("pickle") dodge the import statement.
            func = node.func
            name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", None)
            if name in {"import_module", "__import__"} and node.args:
                arg = node.args[0]
                if isinstance(arg, ast.Constant) and isinstance(arg.value, str) and _banned(arg.value):
                    found.append(f"{where}: {name}({arg.value!r})")
            # numpy's allow_pickle=True unpickles object arrays on load.
            for kw in node.keywords:
                if kw.arg == "allow_pickle" and not (isinstance(kw.value, ast.Constant) and kw.value.value is False):
                    found.append(f"{where}: allow_pickle={ast.unparse(kw.value)}")
    return found


def test_no_pickle_in_package() -> None:
    files = [p for d in SOURCE_DIRS if (ROOT / d).is_dir() for p in sorted((ROOT / d).rglob("*.py"))]
    assert files, f"no sources found under {ROOT}"
    problems = [problem for path in files for problem in _problems(path)]
    assert problems == [], "pickle-style loading found:\n" + "\n".join(problems)


def test_checker_catches_each_form(tmp_path: pathlib.Path) -> None:
    global ROOT
    sample = tmp_path / "sample.py"
    sample.write_text(
        "import os, pickle\nfrom dill import loads\nimport marshal as m\n"
        "import importlib\nimportlib.import_module('cloudpickle')\nimport numpy as np\n"
        "np.load('x.npy', allow_pickle=True)\nnp.load('y.npy', allow_pickle=False)\n"
    )
    saved, ROOT = ROOT, tmp_path
    try:
        problems = _problems(sample)
    finally:
        ROOT = saved
    assert len(problems) == 5, problems
