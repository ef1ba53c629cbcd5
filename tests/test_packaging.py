"""The package installs with its subpackages: checked on a wheel built from this checkout."""

from __future__ import annotations

import subprocess
import sys
import zipfile
from pathlib import Path

from conftest import REPO_ROOT


def test_wheel_installs_kernels_and_analysis_as_subpackages(tmp_path: Path):
    build = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(tmp_path / "dist"), str(REPO_ROOT)],
        capture_output=True, text=True, timeout=300,
    )
    assert build.returncode == 0, build.stderr
    (wheel,) = (tmp_path / "dist").glob("ejlabel-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    for required in ("ejlabel/__init__.py", "ejlabel/py.typed", "ejlabel/kernels/__init__.py", "ejlabel/analysis/__init__.py", "ejlabel/analysis/hlo.py"):
        assert required in names, required
    # Every module of the kernels' packages (one package per op, pyproject.toml lists them).
    for path in (REPO_ROOT / "kernels").rglob("*.py"):
        assert f"ejlabel/kernels/{path.relative_to(REPO_ROOT / 'kernels').as_posix()}" in names, path
    assert not any(name.startswith(("kernels/", "analysis/", "tests/")) for name in names)

    target = tmp_path / "site"
    install = subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", "-q", "--target", str(target), str(wheel)], capture_output=True, text=True, timeout=300)
    assert install.returncode == 0, install.stderr
    code = (
        "import sys; sys.path.insert(0, sys.argv[1]); "
        "import ejlabel, ejlabel.kernels, ejlabel.analysis; "
        "print(ejlabel.__file__); print(ejlabel.kernels.__file__); print(ejlabel.analysis.__file__)"
    )
    run = subprocess.run([sys.executable, "-P", "-c", code, str(target)], capture_output=True, text=True, cwd=tmp_path, timeout=300)
    assert run.returncode == 0, run.stderr
    assert all(line.startswith(str(target)) for line in run.stdout.split()), run.stdout
