"""The package's layers import one way, and no module imports itself back through others.

Every ``import`` statement of every module is read with ``ast`` (function-level imports too,
so a lazy import cannot hide a circle). Layers, bottom up: ``utils`` < ``core`` < ``config``
< ``execution`` < the ``ejlabel`` facade (``ejlabel/__init__.py``) < ``kernels`` and
``analysis`` < ``examples`` (the example model, built from the kernels) < ``cli``. A module may
import from its own layer or below, never above.

Inside ``kernels``: one package per op, its backends in modules named for them (``xla*``,
``triton*``, ``cudnn*``; the ``mosaic`` subpackage is one backend). A backend never imports
another backend, nothing in the product imports an ``experimental`` module, and a module
imports from another only the names that module exports (its ``__all__``), never a
``_private`` one.
"""

from __future__ import annotations

import ast
from pathlib import Path

import networkx as nx
import pytest

from conftest import REPO_ROOT

LAYERS = {"utils": 0, "core": 1, "config": 2, "execution": 3, "": 4, "kernels": 5, "analysis": 5, "examples": 6, "cli": 7}
FOLDERS = {"ejlabel": "ejlabel", "kernels": "ejlabel.kernels", "analysis": "ejlabel.analysis"}


def _modules() -> dict[str, Path]:
    found = {}
    for folder, package in FOLDERS.items():
        for path in (REPO_ROOT / folder).rglob("*.py"):
            parts = list(path.relative_to(REPO_ROOT / folder).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            found[".".join([package, *parts])] = path
    return found


def _layer(module: str) -> int:
    parts = module.split(".")
    if len(parts) == 1 or parts[1] in ("_source_tree", "__main__"):
        return LAYERS[""] if parts[-1] != "__main__" else LAYERS["cli"]
    return LAYERS[parts[1]]


def _imports(module: str, path: Path, known: set[str]) -> set[str]:
    is_package = path.name == "__init__.py"
    package = module if is_package else module.rpartition(".")[0]
    targets = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                base = ".".join(anchor + ([base] if base else []))
            names = [base] + [f"{base}.{alias.name}" for alias in node.names]
        else:
            continue
        for name in names:
            # The longest known module the name starts with (``ejlabel.core.kernel.Kernel``
            # is the module ``ejlabel.core.kernel``).
            while name and name not in known:
                name = name.rpartition(".")[0]
            if name and name != module:
                targets.add(name)
    return targets


def _graph() -> nx.DiGraph:
    modules = _modules()
    graph = nx.DiGraph()
    for module, path in modules.items():
        graph.add_node(module)
        for target in _imports(module, path, set(modules)):
            graph.add_edge(module, target)
    return graph


def test_the_scan_sees_the_layers():
    graph = _graph()
    assert {"ejlabel.core.kernel", "ejlabel.config.selection", "ejlabel.execution.executor", "ejlabel.kernels.matmul", "ejlabel.analysis.graph", "ejlabel.examples.model"} <= set(graph)
    assert graph.has_edge("ejlabel.execution.executor", "ejlabel.config.selection")
    assert graph.has_edge("ejlabel.kernels.attention.mosaic.forward", "ejlabel.kernels.attention.mosaic.kernel")


def test_layers_import_only_downwards():
    graph = _graph()
    upward = [
        f"{src} -> {dst}"
        for src, dst in graph.edges
        if _layer(dst) > _layer(src) and not (src == "ejlabel" and dst == "ejlabel._source_tree")
    ]
    assert not upward, "imports reaching up a layer:\n" + "\n".join(sorted(upward))


def test_no_import_circles():
    # ejlabel.X -> ejlabel (the facade) is a package-parent edge Python resolves first; only
    # kernels, analysis and cli may use the facade, and the facade never imports them.
    cycles = list(nx.simple_cycles(_graph()))
    assert not cycles, "import circles:\n" + "\n".join(" -> ".join(c + [c[0]]) for c in cycles)


@pytest.mark.parametrize("module", ["ejlabel.core", "ejlabel.config", "ejlabel.execution", "ejlabel.utils"])
def test_the_core_never_imports_kernels_or_analysis(module: str):
    graph = _graph()
    reached = {dst for src in graph if src.startswith(module) for dst in nx.descendants(graph, src)}
    assert not {m for m in reached if m.startswith(("ejlabel.kernels", "ejlabel.analysis", "ejlabel.examples", "ejlabel.cli"))}


# --------------------------------------------------------------------------------------------
# Kernels: one package per op, backends in modules named for them

KERNELS = "ejlabel.kernels"
# The modules of kernels/ beside the op packages: what every op shares.
SHARED = {"ejlabel.kernels", "ejlabel.kernels.checks", "ejlabel.kernels.pallas_common", "ejlabel.kernels.ejkernel_compat"}
BACKEND_PREFIXES = ("xla", "triton", "cudnn")


def _kernel_modules() -> dict[str, Path]:
    return {module: path for module, path in _modules().items() if module == KERNELS or module.startswith(KERNELS + ".")}


def _backend(module: str) -> str | None:
    """The backend a kernels module belongs to (``ejlabel.kernels.<op>.<backend>``), or None."""
    parts = module.split(".")
    if len(parts) < 4:
        return None
    name = parts[3]
    return ".".join(parts[:4]) if name == "mosaic" or name.startswith(BACKEND_PREFIXES) else None


def _from_imports(module: str, path: Path, known: set[str]) -> list[tuple[str, str, int]]:
    """``(source module, name, line)`` of every ``from <project module> import name``."""
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                base = ".".join(anchor + ([base] if base else []))
            if base in known:
                found += [(base, alias.name, node.lineno) for alias in node.names]
    return found


def _exported(path: Path) -> set[str] | None:
    """A module's ``__all__``, read from its text; None when it has none."""
    for node in ast.parse(path.read_text(), str(path)).body:
        if isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            if any(isinstance(t, ast.Name) and t.id == "__all__" for t in targets):
                return set(ast.literal_eval(node.value))
    return None


def test_kernels_are_one_package_per_op():
    root = REPO_ROOT / "kernels"
    top = {f"{KERNELS}.{p.stem}" if p.stem != "__init__" else KERNELS for p in root.glob("*.py")}
    assert top == SHARED, "modules of kernels/ that belong in an op's package: " + ", ".join(sorted(top - SHARED))
    folders = [p for p in root.rglob("*") if p.is_dir() and p.name != "__pycache__"]
    assert folders and all((folder / "__init__.py").is_file() for folder in folders)


def test_kernel_modules_import_only_exported_names():
    """No ``_private`` name crosses modules, and what crosses is in the exporter's ``__all__``
    (a submodule of a package may be imported by name)."""
    modules = _modules()
    known = set(modules)
    bad = []
    for module, path in _kernel_modules().items():
        for source, name, line in _from_imports(module, path, known):
            exported = _exported(modules[source])
            if f"{source}.{name}" in known:  # a submodule
                private = name.startswith("_")
            else:
                private = name.startswith("_") or (exported is not None and name not in exported)
            if private:
                bad.append(f"{module}:{line} imports {name} from {source}")
    assert not bad, "imports of names their module does not export:\n" + "\n".join(bad)


def _module_names(module: str, path: Path, known: set[str]) -> set[str]:
    """The names a module binds to project modules (``from . import kernel as mkernel``)."""
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    bound = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            bound |= {alias.asname for alias in node.names if alias.asname and alias.name in known}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                base = ".".join(anchor + ([base] if base else []))
            bound |= {alias.asname or alias.name for alias in node.names if f"{base}.{alias.name}" in known}
    return bound


def test_kernel_modules_use_no_private_attribute_of_another_module():
    """``module._name`` on a project module bound by an import is a private import by another name."""
    known = set(_modules())
    bad = []
    for module, path in _kernel_modules().items():
        bound = _module_names(module, path, known)
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in bound:
                if node.attr.startswith("_") and not node.attr.startswith("__"):
                    bad.append(f"{module}:{node.lineno} uses {node.value.id}.{node.attr}")
    assert not bad, "\n".join(bad)


def test_a_backend_never_imports_another_backend():
    graph = _graph()
    crossing = [
        f"{src} -> {dst}"
        for src, dst in graph.edges
        if _backend(src) and _backend(dst) and _backend(src) != _backend(dst)
    ]
    assert not crossing, "backends importing each other:\n" + "\n".join(sorted(crossing))
    # The scan knows the backends: attention has three, each op at least an XLA one.
    backends = {_backend(m) for m in graph if _backend(m)}
    assert {"ejlabel.kernels.attention.xla", "ejlabel.kernels.attention.triton", "ejlabel.kernels.attention.mosaic"} <= backends
    for op in ("attention", "matmul", "norms", "cross_entropy", "linear_cross_entropy"):
        assert f"{KERNELS}.{op}.xla" in backends, op


def test_op_packages_import_their_backends_entry_points_only():
    """An op package's ``__init__`` (the op, its config and tuning space) takes from each of its
    backends only what the backend exports, and never imports below a backend's top."""
    modules = _modules()
    known = set(modules)
    bad = []
    for module, path in _kernel_modules().items():
        if module.count(".") != 2 or path.name != "__init__.py":
            continue  # not an op package
        for source, name, line in _from_imports(module, path, known):
            backend = _backend(source)
            if backend and (source != backend or name not in (_exported(modules[source]) or set())):
                bad.append(f"{module}:{line} imports {name} from {source}")
    assert not bad, "\n".join(bad)


def test_nothing_in_the_product_imports_the_experiments():
    graph = _graph()
    experiments = {m for m in graph if m.rpartition(".")[2] == "experimental"}
    assert experiments, "the scan finds no experimental module"
    importers = {src for src, dst in graph.edges if dst in experiments and src not in experiments}
    assert not importers, f"product modules importing experiments: {sorted(importers)}"
    assert not experiments & nx.descendants(graph, KERNELS)

