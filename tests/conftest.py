"""Test isolation: every test gets its own persistent-cache directory and default executor."""

import os
import sys
from pathlib import Path

import pytest

TESTS_DIR = Path(__file__).resolve().parent
REPO_ROOT = TESTS_DIR.parent


@pytest.fixture(autouse=True)
def isolated_cache_dir(tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch) -> Path:
    path = tmp_path_factory.mktemp("ejlabel-cache")
    monkeypatch.setenv("EJLABEL_CACHE_DIR", str(path))
    import ejlabel

    ejlabel.set_default_executor(None)
    ejlabel.clear_invocations()
    yield path
    ejlabel.set_default_executor(None)


def subprocess_env(**extra: str) -> dict[str, str]:
    """Environment for a child Python that imports the installed ejlabel and the test kernels."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in [str(TESTS_DIR), env.get("PYTHONPATH", "")] if p)
    env.setdefault("JAX_PLATFORMS", "cpu")
    env.update(extra)
    return env


def run_python(code: str, **env: str) -> str:
    import subprocess

    # -P: the child must import the installed package, never the source tree of the current directory.
    proc = subprocess.run([sys.executable, "-P", "-c", code], capture_output=True, text=True, env=subprocess_env(**env), timeout=300)
    assert proc.returncode == 0, f"child failed:\nSTDOUT:\n{proc.stdout}\nSTDERR:\n{proc.stderr}"
    return proc.stdout
