"""Every notebook runs top to bottom on the CPU: a broken one fails CI, except the
ahead-of-time tuning notebook, which tunes a model for a minute and is one of the ``slow`` tests
(README's full-suite command runs it)."""

from __future__ import annotations

from pathlib import Path

import pytest

# Part of the test extra; the GPU machine's image lacks them, and runs only `-m gpu` there.
nbformat = pytest.importorskip("nbformat")
NotebookClient = pytest.importorskip("nbclient").NotebookClient

NOTEBOOKS = sorted((Path(__file__).resolve().parent.parent / "notebooks").glob("*.ipynb"))
SLOW_NOTEBOOKS = {"aot_tuning"}


def test_notebooks_are_present():
    assert {p.stem for p in NOTEBOOKS} >= {"quickstart", "audit", "aot_tuning"}


@pytest.mark.parametrize("path", [pytest.param(p, id=p.stem, marks=[pytest.mark.slow] if p.stem in SLOW_NOTEBOOKS else []) for p in NOTEBOOKS])
def test_notebook_runs_top_to_bottom(path: Path, tmp_path: Path, isolated_cache_dir: Path):
    book = nbformat.read(path, as_version=4)
    assert all(not cell.get("outputs") for cell in book.cells if cell.cell_type == "code"), "outputs must be stripped in git"
    NotebookClient(book, timeout=120, kernel_name="python3", resources={"metadata": {"path": str(tmp_path)}}).execute()
    errors = [o for cell in book.cells for o in cell.get("outputs", []) if o.get("output_type") == "error"]
    assert not errors
