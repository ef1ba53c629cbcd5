"""Where every benchmark writes its rows: one JSON file per benchmark under ``bench/results/``.

A result file is data a reader (``bench/plot_results.py``, bench/RESULTS.md, README) can trust
without rerunning anything: the rows, and with them what produced them, namely the machine (host
CPU, accelerator and its count), the versions (Python, jax, jaxlib, ejlabel), the date and the
exact command line. A benchmark run replaces its file (git history keeps the earlier ones); a
benchmark with several sections names each section's file (``bench_attention.packed.json``).

Only times measured on the machine the file names count as absolute times; ratios are meaningful
only between rows of one file, which were measured side by side in one run.
"""

from __future__ import annotations

import datetime
import json
import os
import platform
import shlex
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

__all__ = ["RESULTS_DIR", "machine", "versions", "write_results", "read_results"]

RESULTS_DIR = Path(__file__).resolve().parent / "results"


def machine() -> dict[str, Any]:
    """The host and its accelerators, as JAX sees them."""
    import jax

    devices = jax.devices()
    return {
        "host": platform.node() or "unknown",
        "cpu": platform.processor() or platform.machine(),
        "cpu_count": os.cpu_count(),
        "platform": devices[0].platform,
        "device": devices[0].device_kind,
        "device_count": len(devices),
    }


def versions() -> dict[str, str]:
    """Python, jax, jaxlib and ejlabel versions of the running process."""
    import jax
    import jaxlib

    from ejlabel.utils.version import VERSION

    return {"python": platform.python_version(), "jax": jax.__version__, "jaxlib": jaxlib.__version__, "ejlabel": VERSION}


def write_results(
    name: str, rows: Sequence[Mapping[str, Any]], *, notes: str = "", directory: Path | None = None,
) -> Path:
    """Write ``rows`` (plain JSON values) as ``<directory>/<name>.json`` with their provenance.

    ``name`` is the benchmark's name (``bench_model``, ``bench_attention.packed``); ``notes``
    says in one line what a reader must know to read the rows (units, what a ratio divides).
    """
    if not name or any(part in name for part in ("/", "\\", "..")):
        raise ValueError(f"name: expected a plain file stem such as 'bench_model', got {name!r}")
    directory = RESULTS_DIR if directory is None else Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    record = {
        "benchmark": name,
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "command": shlex.join([Path(sys.argv[0]).as_posix(), *sys.argv[1:]]) if sys.argv and sys.argv[0] else "",
        "machine": machine(),
        "versions": versions(),
        "notes": notes,
        "rows": [dict(row) for row in rows],
    }
    path = directory / f"{name}.json"
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(record, indent=1, sort_keys=False, allow_nan=False) + "\n")
    tmp.replace(path)
    print(f"rows written to {path}")
    return path


def read_results(name: str, directory: Path | None = None) -> dict[str, Any]:
    """The record :func:`write_results` wrote for ``name``."""
    directory = RESULTS_DIR if directory is None else Path(directory)
    return json.loads((directory / f"{name}.json").read_text())
