"""Test isolation: every test gets its own persistent-cache directory and default executor."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

TESTS_DIR = Path(__file__).resolve().parent
REPO_ROOT = TESTS_DIR.parent
SHARDED_PARTS = ("kernels", "dp", "fsdp")
_background: list[subprocess.Popen] = []  # kept referenced while they run


def run_folder(config: pytest.Config) -> Path:
    """A folder of this test run, the same for all its pytest-xdist workers: the run's own under
    pytest's temporary root (which pytest rotates), the parent of each worker's."""
    base = config._tmp_path_factory.getbasetemp()  # the tmp_path_factory fixture's, before any fixture runs
    return base.parent if hasattr(config, "workerinput") else base


def sharded_facts_path(config: pytest.Config) -> Path:
    return run_folder(config) / "sharded_facts.json"


def pytest_configure(config: pytest.Config) -> None:
    """A CPU run (``-m "not gpu"``, as README's test commands give) has XLA compile without
    its backend optimizations, in this process and in every child it starts: the tests check
    values, labels and programs, never speed, and their time is mostly XLA compiling small
    programs for the CPU (the linear cross-entropy tests took 101 s instead of 168 on 2 cores,
    the whole CPU suite 14 minutes instead of 16.4). Runs that include the GPU tests compile as
    users do."""
    if "not gpu" in (config.option.markexpr or "") and "xla_backend_optimization_level" not in os.environ.get("XLA_FLAGS", ""):
        os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} --xla_backend_optimization_level=0".strip()


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Start the sharded facts (tests/sharded_facts.py, a minute of child process on 2 cores) as
    soon as the run is known to need them, in the background and once per run (by the first
    worker, or the only process): a test that needs them waits for them, so no worker sits idle
    for the whole minute, and two workers never compute them twice. Never stopped from here: a
    worker may finish while another still waits for them."""
    worker = getattr(config, "workerinput", {}).get("workerid", "master")
    if config.option.collectonly or worker not in ("master", "gw0") or not any(item.path.name == "test_sharded.py" for item in items):
        return
    path = sharded_facts_path(config)
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path.with_suffix(".err"), "w") as err:
        command = [sys.executable, "-P", str(TESTS_DIR / "sharded_facts.py"), "--out", str(path), *SHARDED_PARTS]
        _background.append(subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=err, env=subprocess_env()))


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
