"""README's promises, run as a new user would: from the repository root of the checkout.

The snippet runs verbatim (in a child process whose current directory is the repository root,
so the checkout's ``ejlabel/`` folder comes first on the import path, as it does for a user who
types ``python`` there), and the entry points work from the root too.
"""

from __future__ import annotations

import re
import subprocess
import sys

import pytest

from conftest import REPO_ROOT, subprocess_env

README = (REPO_ROOT / "README.md").read_text()


def _run_in_root(*args: str, timeout: int = 600) -> subprocess.CompletedProcess[str]:
    env = subprocess_env()
    env.pop("PYTHONPATH", None)  # nothing but what a user in the root has
    return subprocess.run([sys.executable, *args], cwd=REPO_ROOT, capture_output=True, text=True, env=env, timeout=timeout)


def test_readme_python_snippet_runs_verbatim_from_the_root(tmp_path):
    snippet = re.search(r"```python\n(.*?)```", README, re.S).group(1)
    proc = _run_in_root("-c", snippet)
    assert proc.returncode == 0, proc.stderr
    assert "ejkernel_ops#matmul@v1:" in proc.stdout
    assert "MatmulConfig(" in proc.stdout


@pytest.mark.parametrize(
    "args",
    [
        ("-c", "import ejlabel.analysis, ejlabel.kernels, ejlabel.examples; print(ejlabel.analysis.__file__)"),
        ("-m", "ejlabel", "cache", "stats"),
        ("-m", "ejlabel.cli", "cache", "stats"),
    ],
)
def test_imports_and_commands_work_from_the_root(args: tuple[str, ...]):
    proc = _run_in_root(*args)
    assert proc.returncode == 0, proc.stderr


def test_readme_commands_are_marked_for_ci():
    for marker in ("<!-- demo-command -->", "<!-- test-command -->"):
        after = README.split(marker, 1)[1].lstrip().splitlines()
        assert after[0] == "```bash" and after[1].strip(), marker
