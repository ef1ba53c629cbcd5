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


# Modules that decode data (cache rows, export files, call descriptions): they resolve names
# through the registry only, so none of them may import a module by a name computed at run time.
DECODERS = ("ejlabel/utils/serialize.py", *(f"ejlabel/config/persistent/{name}.py" for name in ("cache", "entry", "exchange", "store")), "ejlabel/core/calls.py")


def _dynamic_imports(path: pathlib.Path) -> list[str]:
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    found = []
    for node in ast.walk(tree):
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            names = [a.name for a in node.names] + ([node.module] if isinstance(node, ast.ImportFrom) and node.module else [])
            found += [f"{path.name}:{node.lineno}: imports {n}" for n in names if n.split(".")[0] in {"importlib", "imp", "pkgutil", "runpy"}]
        elif isinstance(node, ast.Call):
            func = node.func
            name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", None)
            if name in {"import_module", "__import__", "find_spec", "run_module"}:
                found.append(f"{path.name}:{node.lineno}: calls {name}")
    return found


def test_decoders_never_import_by_name() -> None:
    problems = [p for rel in DECODERS if (ROOT / rel).is_file() for p in _dynamic_imports(ROOT / rel)]
    assert problems == [], "a decoder can import a module named by data:\n" + "\n".join(problems)


def test_the_only_dynamic_import_in_the_core_takes_user_module_names() -> None:
    # ejlabel --import MODULE: names the user typed, never read from a file.
    found = [p for path in sorted((ROOT / "ejlabel" / "core").glob("*.py")) for p in _dynamic_imports(path)]
    assert all(p.startswith("registry.py:") for p in found), found
