"""Other versions of a kernel module, loaded beside the current one for probes that time them
side by side (a variant is the current file with a diff of ``runs/`` applied)."""

from __future__ import annotations

import importlib.util
import sys
import types


def load_variant(module: str, name: str, path: str) -> types.ModuleType:
    """The file ``path``, another version of ``ejlabel.kernels.<module>``, loaded inside
    ``ejlabel.kernels`` under a name of its own, so its relative imports resolve."""
    spec = importlib.util.spec_from_file_location(f"ejlabel.kernels._{name}{module}", path)
    if spec is None or spec.loader is None:
        raise ValueError(f"path: expected a Python file, got {path!r}")
    loaded = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = loaded
    spec.loader.exec_module(loaded)
    return loaded
