"""The package's layers import one way, and no module imports itself back through others.

Every ``import`` statement of every module is read with ``ast`` (function-level imports too,
so a lazy import cannot hide a circle). Layers, bottom up: ``utils`` < ``core`` < ``config``
< ``execution`` < the ``ejlabel`` facade (``ejlabel/__init__.py``) < ``kernels`` and
``analysis`` < ``examples`` (the example model, built from the kernels) < ``cli``. A module may
import from its own layer or below, never above.
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
