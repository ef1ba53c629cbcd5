"""The benchmarks' evidence is data that says where it came from.

Every file under ``bench/results/`` names the machine, versions, date and command of its rows
(``bench/_results.py`` writes them so; the figures transcribed from the benchmark journal also
name their source), every benchmark script in ``bench/`` writes its rows through
``write_results`` and has a results file, bench/RESULTS.md names every results file and only
existing ones, and the H100 model table that README and bench/RESULTS.md show is the one its
results files hold.
"""

from __future__ import annotations

import ast
import datetime
import json
import re
from pathlib import Path

import pytest

from conftest import REPO_ROOT

BENCH = REPO_ROOT / "bench"
RESULT_FILES = sorted((BENCH / "results").glob("*.json"))
SCRIPTS = sorted(BENCH.glob("bench_*.py"))
RESULTS_MD = (BENCH / "RESULTS.md").read_text()
README = (REPO_ROOT / "README.md").read_text()


def test_there_are_benchmarks_and_results() -> None:
    assert len(SCRIPTS) >= 5 and len(RESULT_FILES) >= len(SCRIPTS)


@pytest.mark.parametrize("path", RESULT_FILES, ids=lambda path: path.name)
def test_results_file_says_what_produced_it(path: Path) -> None:
    record = json.loads(path.read_text())
    assert record["benchmark"] == path.stem
    datetime.date.fromisoformat(record["date"][:10])
    script = path.stem.split(".")[0]
    assert f"bench/{script}.py" in record["command"], record["command"]
    assert {"host", "cpu", "cpu_count", "platform", "device", "device_count"} <= set(record["machine"])
    assert record["machine"]["platform"] in ("cpu", "gpu")
    assert {"python", "jax", "jaxlib", "ejlabel"} <= set(record["versions"])
    assert re.fullmatch(r"\d+\.\d+\.\d+", record["versions"]["jax"])
    assert isinstance(record["notes"], str)
    assert record["rows"] and all(isinstance(row, dict) and row for row in record["rows"])
    if "transcribed_from" in record:  # figures copied from the journal, not a run of today's script
        source = re.fullmatch(r"(bench/\S+) at [0-9a-f]{7,40}", record["transcribed_from"])
        assert source and (source.group(1) == "bench/RESULTS.md" or source.group(1).startswith("bench/runs/")), record["transcribed_from"]


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda path: path.name)
def test_benchmark_writes_its_rows(script: Path) -> None:
    nodes = list(ast.walk(ast.parse(script.read_text())))
    imports = any(
        (isinstance(node, ast.ImportFrom) and node.module == "_results" and any(alias.name == "write_results" for alias in node.names))
        or (isinstance(node, ast.Import) and any(alias.name == "_results" for alias in node.names))
        for node in nodes
    )
    calls = any(
        isinstance(node, ast.Call) and "write_results" in (getattr(node.func, "id", None), getattr(node.func, "attr", None)) for node in nodes
    )
    assert imports and calls, f"{script.name} does not record its rows with _results.write_results"
    assert any(path.stem == script.stem or path.stem.startswith(script.stem + ".") for path in RESULT_FILES), f"no results file of {script.name}"


def test_results_page_names_every_results_file_and_no_other() -> None:
    named = set(re.findall(r"\bbench_[\w.]+?\.json\b", RESULTS_MD))
    files = {path.name for path in RESULT_FILES}
    assert named <= files, f"bench/RESULTS.md names missing files: {sorted(named - files)}"
    assert files <= named, f"bench/RESULTS.md does not show: {sorted(files - named)}"


def test_model_table_is_the_one_its_results_files_hold(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.syspath_prepend(str(BENCH))
    import plot_results

    table = plot_results.model_table()
    rows = sum(len(plot_results.read_results(name)["rows"]) for _, name in plot_results.MODELS)
    assert table.count("\n") == 1 + rows  # header, rule, every variant of each model
    assert "<!-- h100-table -->\n" + table in README
    assert table in RESULTS_MD


@pytest.mark.parametrize("page, text", [("README.md", README), ("bench/RESULTS.md", RESULTS_MD)])
def test_pictures_shown_exist(page: str, text: str) -> None:
    pictures = re.findall(r"!\[[^\]]*\]\(([^)]+\.svg)\)", text)
    assert pictures
    for picture in pictures:
        assert ((REPO_ROOT / page).parent / picture).is_file(), (page, picture)
