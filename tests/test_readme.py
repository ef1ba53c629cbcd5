"""README's promises, run as a new user would: from the repository root of the checkout.

The snippet runs verbatim (in a child process whose current directory is the repository root,
so the checkout's ``ejlabel/`` folder comes first on the import path, as it does for a user who
types ``python`` there), and the entry points work from the root too. "Write your own kernel"
runs verbatim in a new folder, every output README shows is what ``docs/readme_outputs.py``
gets from a fresh run, and every flag of README's command line works where README puts it.
"""

from __future__ import annotations

import importlib.util
import os
import re
import sqlite3
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import REPO_ROOT, subprocess_env

README = (REPO_ROOT / "README.md").read_text()


def _block(marker: str, fence: str) -> str:
    """The body of the first ```fence block after ``marker`` in README."""
    return re.search(rf"```{fence}\n(.*?)```", README.split(marker, 1)[1], re.S).group(1)


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


def _readme_outputs():
    spec = importlib.util.spec_from_file_location("readme_outputs", REPO_ROOT / "docs" / "readme_outputs.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.slow
def test_readme_shows_what_the_code_prints():
    # The synopsis, the example model's site counts, a first demo run and a second one (which
    # must tune nothing), made again and compared with README, timings and temporary folders aside.
    outputs = _readme_outputs()
    assert set(outputs.readme_blocks(README)) == {"usage", "serve-sites", "train-sites", "demo", "demo-again"}
    stale = outputs.check()
    assert not stale, "\n".join(f"{name}:\n{diff}" for name, diff in stale.items())


def test_readme_output_check_finds_drift():
    outputs = _readme_outputs()
    shown = "```text\n== 3. tune ==\ntuned 7 calls in 12.5 s\n…\n7 picks stored\n```"
    assert outputs.matches(shown, "```text\n== 3. tune ==\ntuned 7 calls in 3.1 s\nmore\nlines\n7 picks stored\n```")
    assert not outputs.matches(shown, "```text\n== 3. tune ==\ntuned 6 calls in 3.1 s\n7 picks stored\n```")


def test_every_flag_readme_lists_works_where_readme_says():
    from ejlabel.cli.main import build_parser

    parser = build_parser()
    commands = parser._subparsers._group_actions[0].choices
    usage = _readme_outputs().readme_blocks(README)["usage"]
    for line in usage.splitlines():
        flags = re.findall(r"(?<![\w-])--[a-z-]+", line.split("#")[0])
        if line.startswith("ejlabel "):
            command = commands[line.split()[1]]
            options = {o for a in command._actions for o in a.option_strings}
            for sub in [a for a in command._actions if isinstance(a, type(parser._subparsers._group_actions[0]))]:
                options |= {o for p in sub.choices.values() for a in p._actions for o in a.option_strings}
            assert set(flags) <= options, line
        elif line.startswith("anywhere on the line"):
            for name, command in commands.items():
                assert set(flags) <= {o for a in command._actions for o in a.option_strings}, name


def test_write_your_own_kernel_runs_verbatim_end_to_end(tmp_path):
    # The new user's whole path, on the CPU, in subprocesses in a new folder: a script kernel with
    # an impl field, jit, tuned alone and in context; the command line from the script's folder
    # tunes a dump; the script, run again, reads its pick; the step tuned in context.
    (tmp_path / "user_kernels.py").write_text(_block("<!-- user-kernel-file: user_kernels.py -->", "python"))
    commands = [line.split("  #")[0].strip() for line in _block("<!-- user-kernel-commands -->", "bash").splitlines() if line.strip()]
    env = subprocess_env(EJLABEL_CACHE_DIR=str(tmp_path / "cache"))
    env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", "")])  # python and ejlabel
    outputs = []
    for command in commands:
        proc = subprocess.run(["bash", "-c", command], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
        assert proc.returncode == 0, f"$ {command}\n{proc.stdout}\n{proc.stderr}"
        outputs.append(proc.stdout)
    tune, cli_tune, again, in_context, listing = outputs

    assert "alone: SoftmaxConfig(" in tune and (tmp_path / "step.hlo.txt").is_file()
    assert re.search(r"batch 32: ejkernel_ops#my_softmax@v1:\w{16} memory SoftmaxConfig", tune)
    assert re.search(r"batch 64: ejkernel_ops#my_softmax@v1:\w{16} heuristic SoftmaxConfig", tune)
    # The command line, from the script's folder, tuned the dump's call...
    key, pick = re.search(r"tuned  my_softmax@v1:(\w{16})  \S+ ms  (SoftmaxConfig\(.*\))", cli_tune).groups()
    assert "tuned 1 distinct calls" in cli_tune
    # ... and the script, run again, reads that pick (and its own in-context one) from the cache.
    assert f"batch 64: ejkernel_ops#my_softmax@v1:{key} persistent {pick}" in again
    assert re.search(r"batch 32: ejkernel_ops#my_softmax@v1:\w{16} persistent SoftmaxConfig", again)
    assert "stored 1 picks with provenance 'in-context'" in in_context
    rows = [line for line in listing.splitlines() if line.startswith("my_softmax@v1")]
    assert len(rows) == 2 and all("in-context" in row and "UNDECODABLE" not in row for row in rows)
    # One name for the script's types, whichever way the file ran; no candidate but the kernel's.
    with sqlite3.connect(tmp_path / "cache" / "configs.sqlite") as db:
        stored = db.execute("SELECT config_type, config_json, stats_json FROM configs").fetchall()
    assert {row[0] for row in stored} == {"user_kernels:SoftmaxConfig"}
    assert "__main__" not in str(stored) and '"xla"' not in str(stored)


def test_readme_policy_snippet_tunes_on_a_miss(tmp_path):
    snippet = _block("### Tuning on a cache miss", "python")
    code = "import jax.numpy as jnp, ejlabel\n" + snippet + (
        "from toy_kernels import scale\nscale(jnp.ones(4))\n"
        "(entry,) = ejlabel.PersistentCache().entries()\nprint(entry.provenance)\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, env=subprocess_env(EJLABEL_CACHE_DIR=str(tmp_path)))
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split()[-1] == "autotuned"
