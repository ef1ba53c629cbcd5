"""The installed `ejlabel` console script, run in subprocesses."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import ejlabel

from conftest import run_python, subprocess_env

EJLABEL = str(Path(sys.executable).with_name("ejlabel"))


def cli(*args: str, cache: Path, check: int | None = 0, register: bool = True) -> subprocess.CompletedProcess:
    """Run the command; ``register``: name the test kernels' module with ``--import``, as a user must."""
    imports = ["--import", "toy_kernels"] if register else []
    proc = subprocess.run([EJLABEL, "--cache-dir", str(cache), *imports, *args], capture_output=True, text=True, env=subprocess_env(), timeout=600)
    if check is not None:
        assert proc.returncode == check, f"exit {proc.returncode}\nSTDOUT:\n{proc.stdout}\nSTDERR:\n{proc.stderr}"
    return proc


@pytest.fixture(scope="module")
def program(tmp_path_factory) -> Path:
    """An HLO file of a model made of the test kernels, written by another process."""
    path = tmp_path_factory.mktemp("program") / "model.hlo.txt"
    run_python(f"""
import jax, jax.numpy as jnp
from toy_kernels import scale, loopsum
def model(x):
    return loopsum(scale(x)).sum() + loopsum(x).sum()
open({str(path)!r}, "w").write(jax.jit(model).lower(jnp.ones((8, 64))).compiler_ir("hlo").as_hlo_text())
""")
    return path


@pytest.mark.parametrize("argv", [["--help"], ["audit", "--help"], ["tune", "--help"], ["cache", "--help"], ["cache", "ls", "--help"], ["demo", "--help"]])
def test_help_everywhere(argv, tmp_path):
    proc = cli(*argv, cache=tmp_path)
    assert "usage: ejlabel" in proc.stdout


def test_usage_errors_exit_2_without_traceback(tmp_path):
    proc = cli("audit", str(tmp_path / "missing"), cache=tmp_path, check=2)
    assert "PATH" in proc.stderr and "Traceback" not in proc.stderr
    assert cli("bogus", cache=tmp_path, check=2).stderr.startswith("usage:")
    assert "--yes" in cli("cache", "clear", cache=tmp_path, check=2).stderr


def test_errors_exit_1_and_debug_shows_traceback(tmp_path):
    bad = tmp_path / "bad.hlo.txt"
    bad.write_text("HloModule m\nENTRY %main {\n  %x = f32[ parameter(0\n}\n")
    proc = cli("audit", str(bad), cache=tmp_path / "c", check=1)
    assert "error" in proc.stderr and "Traceback" not in proc.stderr
    debug = subprocess.run([EJLABEL, "--debug", "--cache-dir", str(tmp_path / "c"), "audit", str(bad)], capture_output=True, text=True, env=subprocess_env())
    assert debug.returncode != 0 and "Traceback" in debug.stderr


@pytest.mark.slow
def test_audit_tune_audit_and_cache_commands(program, tmp_path):
    cache = tmp_path / "cache"
    before = json.loads(cli("audit", str(program), "--json", cache=cache).stdout)
    assert {call["op"] for call in before["calls"]} == {"scale", "loopsum"}
    assert len(before["calls"]) == 3  # loopsum is called at two places with the same signature
    assert len(before["unseen"]) == 2  # ...so it is one distinct call to tune
    # The program names its kernels, but a process imports only what the user names.
    unregistered = cli("tune", str(program), "--iters", "3", cache=cache, check=1, register=False)
    assert "toy_kernels" in unregistered.stderr and "--import" in unregistered.stderr
    tuned = cli("tune", str(program), "--iters", "3", cache=cache)
    assert "tuned 2 distinct calls" in tuned.stdout
    assert "isolated timings" in tuned.stdout and "not confirmed in context" in tuned.stdout
    after = json.loads(cli("audit", str(program), "--json", cache=cache).stdout)
    assert after["unseen"] == [] and {c["provenance"] for c in after["calls"]} == {"persistent"}
    again = cli("tune", str(program), cache=cache)
    assert "tuned 0 distinct calls" in again.stdout

    listing = cli("cache", "ls", cache=cache).stdout
    assert "loopsum@v1" in listing and "autotuned" in listing
    assert "UNDECODABLE" in cli("cache", "ls", cache=cache, register=False).stdout  # listed, not hidden
    key = after["calls"][0]["call_key"]
    shown = json.loads(cli("cache", "show", key, cache=cache).stdout)
    assert shown["call_key"] == key and shown["stats"]["median_ms"] > 0
    stats = json.loads(cli("cache", "stats", cache=cache).stdout)
    assert stats["entries"] >= 2
    exported = tmp_path / "configs.json"
    cli("cache", "export", str(exported), cache=cache)
    other = tmp_path / "other"
    assert "imported" in cli("cache", "import", str(exported), cache=other).stdout
    assert json.loads(cli("audit", str(program), "--json", cache=other).stdout)["unseen"] == []
    dot = tmp_path / "graph.dot"
    cli("audit", str(program), "--dot", str(dot), cache=other)
    assert "loopsum@v1" in dot.read_text()
    assert "removed" in cli("cache", "clear", "--yes", cache=other).stdout
    assert json.loads(cli("cache", "stats", cache=other).stdout)["entries"] == 0


def test_audit_module_function_target(tmp_path):
    proc = cli("audit", "toy_kernels:scale", "--example-args", "f32[4,8]", "--markdown", cache=tmp_path)
    assert "scale@v1" in proc.stdout and "UNSEEN" in proc.stdout
    assert cli("audit", "toy_kernels:scale", cache=tmp_path, check=2).returncode == 2
    assert cli("audit", "toy_kernels:scale", "--example-args", "q32[4]", cache=tmp_path, check=2).returncode == 2


def test_tune_module_function_in_context(program, tmp_path):
    # loopsum has no XLA path: its floor is the heuristic (block=1, a 512-step loop), which
    # every larger block beats many times over in the whole step.
    proc = cli("tune", "toy_kernels:loopsum", "--example-args", "f32[8,512]", "--samples", "4", "--iters", "3", "--candidates", "1", cache=tmp_path)
    assert "in-context tuning" in proc.stdout and "all-XLA (floor)" in proc.stdout and "accepted" in proc.stdout
    import toy_kernels  # registers LoopConfig, so this process can decode the stored config
    from ejlabel import PersistentCache

    (entry,) = PersistentCache(tmp_path).entries(op_id="loopsum@v1")
    assert entry.provenance == "in-context" and entry.config.block > 1 and not entry.config.wrong
    assert entry.config == toy_kernels.LoopConfig(entry.config.block) and entry.stats["step_ms"] < entry.stats["floor_step_ms"]
    assert "--samples" in cli("tune", str(program), "--samples", "3", cache=tmp_path, check=2).stderr
    assert "--example-args" in cli("tune", "toy_kernels:loopsum", cache=tmp_path, check=2).stderr


def test_bad_values_name_their_flag_and_debug_and_version_work_anywhere(tmp_path):
    bad = cli("tune", "model.hlo", "--iters", "0", cache=tmp_path, check=2)
    assert "--iters" in bad.stderr and "num_iters" not in bad.stderr
    assert "--budget" in cli("tune", "model.hlo", "--budget", "-1", cache=tmp_path, check=2).stderr
    late_debug = subprocess.run([EJLABEL, "--cache-dir", str(tmp_path), "audit", str(tmp_path / "missing.hlo"), "--debug"], capture_output=True, text=True, env=subprocess_env())
    assert late_debug.returncode != 0 and "Traceback" in late_debug.stderr
    assert cli("--version", cache=tmp_path).stdout.startswith("ejlabel ")
    assert "no entries" in cli("cache", "ls", cache=tmp_path).stdout


def test_global_options_work_anywhere_and_debug_keeps_the_exit_code(tmp_path):
    import toy_kernels  # registers ScaleConfig here

    ejlabel.PersistentCache(tmp_path / "after").put("cpu|cpu|cpu", "scale@v1", "0123456789abcdef", toy_kernels.ScaleConfig())
    run = lambda *args: subprocess.run([EJLABEL, *args], capture_output=True, text=True, env=subprocess_env(), timeout=600)
    late = run("cache", "ls", "--version")
    assert late.returncode == 0 and late.stdout.startswith("ejlabel ")
    # --cache-dir and --import after the command (and after cache's own sub-command) are used.
    listing = run("cache", "--cache-dir", str(tmp_path / "after"), "ls", "--import", "toy_kernels")
    assert listing.returncode == 0 and "ScaleConfig(factor=1" in listing.stdout and "UNDECODABLE" not in listing.stdout
    # --debug adds the traceback; the exit code stays: 2 for bad usage, 1 for a failure.
    usage = run("audit", str(tmp_path / "missing.hlo"), "--debug")
    assert usage.returncode == 2 and "Traceback" in usage.stderr and "PATH" in usage.stderr.splitlines()[-1]
    bad = tmp_path / "bad.hlo.txt"
    bad.write_text("HloModule m\nENTRY %main {\n  %x = f32[ parameter(0\n}\n")
    failed = run("--debug", "--cache-dir", str(tmp_path / "c"), "audit", str(bad))
    assert failed.returncode == 1 and "Traceback" in failed.stderr


def test_cache_show_takes_a_unique_key_prefix_and_a_closed_pipe_is_quiet(tmp_path):
    import toy_kernels  # registers ScaleConfig here

    cache = ejlabel.PersistentCache(tmp_path)
    cache.put("cpu|cpu|cpu", "scale@v1", "0123456789abcdef", toy_kernels.ScaleConfig(), provenance="autotuned")
    cache.put("cpu|cpu|cpu", "scale@v1", "0123fedcba987654", toy_kernels.ScaleConfig(2, "add"), provenance="autotuned")
    shown = json.loads(cli("cache", "show", "01234567", cache=tmp_path).stdout)
    assert shown["call_key"] == "0123456789abcdef"
    assert "several" in cli("cache", "show", "0123", cache=tmp_path, check=2).stderr
    head = subprocess.run(f"{EJLABEL} --cache-dir {tmp_path} --import toy_kernels cache ls | head -c 10", shell=True, capture_output=True, text=True, env=subprocess_env())
    assert head.returncode == 0 and "BrokenPipe" not in head.stderr and "Traceback" not in head.stderr


def test_tune_of_unparseable_input_fails_like_audit(tmp_path):
    garbage = tmp_path / "garbage.txt"
    garbage.write_text("hello world\nthis is not a program\n")
    audit, tune = (cli(command, str(garbage), cache=tmp_path / "c", check=1) for command in ("audit", "tune"))
    assert audit.stderr.startswith("ejlabel audit: error: HloParseError: ") and "Traceback" not in audit.stderr
    assert tune.stderr == audit.stderr.replace("ejlabel audit:", "ejlabel tune:", 1) and tune.stdout == ""


@pytest.mark.parametrize("special", ["/dev/zero", "fifo"])
def test_special_files_are_refused_at_once(tmp_path, special):
    if special == "fifo":
        special = str(tmp_path / "program.hlo")
        os.mkfifo(special)  # opening it would block until a writer came
    kind = "a FIFO" if special.endswith(".hlo") else "a character device"
    for command in ("audit", "tune"):
        proc = cli(command, special, cache=tmp_path / "c", check=1)  # the timeout is the hang check
        assert f"ejlabel {command}: error: ProgramReadError: x: {special} is {kind}, not a program file" in proc.stderr


def test_tune_budget_report_names_what_it_skipped(tmp_path):
    path = tmp_path / "cost.hlo.txt"
    run_python(f"""
import jax, jax.numpy as jnp
from toy_kernels import cost
open({str(path)!r}, "w").write(jax.jit(cost).lower(jnp.ones((8, 128))).compiler_ir("hlo").as_hlo_text())
""")
    proc = cli("tune", str(path), "--budget", "0.2", "--iters", "2", cache=tmp_path / "c")
    tuned, skipped = proc.stdout.splitlines()[:2]
    assert tuned.startswith("tuned  cost@v1:") and "impl='xla'" in tuned  # the floor's best, timed in full
    assert skipped.strip().startswith("skipped 6 of 8 candidates (time budget; the heuristic and plain-path candidates were timed)")
    assert skipped.count("CostConfig(impl='loop'") == 6 and "trace_s=0.3" in skipped


def test_importing_nothing_new_mentions_overwrite(tmp_path):
    import toy_kernels  # registers ScaleConfig here

    source = ejlabel.PersistentCache(tmp_path / "a")
    source.put("cpu|cpu|cpu", "scale@v1", "0123456789abcdef", toy_kernels.ScaleConfig(), provenance="autotuned")
    exported = tmp_path / "configs.json"
    cli("cache", "export", str(exported), cache=tmp_path / "a")
    first = cli("cache", "import", str(exported), cache=tmp_path / "b").stdout
    again = cli("cache", "import", str(exported), cache=tmp_path / "b").stdout
    assert first.startswith("imported 1 entries") and "--overwrite" not in first
    assert again.startswith("imported 0 entries") and "--overwrite replaces them" in again
    assert cli("cache", "import", str(exported), "--overwrite", cache=tmp_path / "b").stdout.startswith("imported 1 entries")
