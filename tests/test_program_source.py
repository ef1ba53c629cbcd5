"""The one program reader and the one folder walker, shared by the core's label readers and analysis."""

from __future__ import annotations

import os
from pathlib import Path

import jax
import jax.numpy as jnp
import pytest
from toy_kernels import scale

import ejlabel
import ejlabel.utils.files as files_module
from ejlabel.analysis import ProgramReadError, read_program
from ejlabel.core.labels import program_texts
from ejlabel.core.program_source import read_program_source
from ejlabel.utils.files import DirectoryLimitError, SpecialFileError, walk_files

PROGRAM = jax.jit(lambda x: scale(x)).lower(jnp.ones((2, 3))).compiler_ir("hlo").as_hlo_text()


def test_core_and_analysis_read_the_same_files_of_a_dump(tmp_path: Path) -> None:
    dump = tmp_path / "dump"
    dump.mkdir()
    (dump / "module_0001.jit_f.before_optimizations.txt").write_text(PROGRAM)
    (dump / "module_0001.jit_f.cpu_after_optimizations.txt").write_text(PROGRAM)
    (dump / "module_0001.jit_f.cpu_after_optimizations-buffer-assignment.txt").write_text("not a program")
    source = read_program_source(dump)
    assert source.origin == "dump" and [Path(t.source).name for t in source.texts] == ["module_0001.jit_f.cpu_after_optimizations.txt"]
    assert [pm.source for pm in read_program(dump).modules] == [t.source for t in source.texts]
    assert program_texts(dump) == [t.text for t in source.texts]
    assert ejlabel.find_labels_in_lowered(dump) == list(read_program(dump).labels)


def test_walk_is_bounded_in_entries_and_depth(tmp_path: Path) -> None:
    deep = tmp_path
    for level in range(70):
        deep = deep / f"d{level}"
    deep.mkdir(parents=True)
    (deep / "m.hlo").write_text(PROGRAM)
    with pytest.raises(DirectoryLimitError, match="more than 64 levels deep"):
        walk_files(tmp_path)
    assert walk_files(tmp_path, max_depth=100).files == (deep / "m.hlo",)  # iterative: no recursion limit
    with pytest.raises(DirectoryLimitError, match="more than 10 entries"):
        walk_files(tmp_path, max_entries=10, max_depth=100)
    with pytest.raises(ProgramReadError, match="more than 64 levels deep"):
        read_program(tmp_path)


def test_walk_never_leaves_the_folder_or_enters_pseudo_filesystems(tmp_path: Path) -> None:
    outside = tmp_path / "outside.hlo"
    outside.write_text(PROGRAM)
    folder = tmp_path / "dump"
    folder.mkdir()
    (folder / "inside.hlo").write_text(PROGRAM)
    (folder / "alias.hlo").symlink_to(folder / "inside.hlo")  # inside the folder: read
    (folder / "escape.hlo").symlink_to(outside)
    (folder / "proc").symlink_to("/proc")
    walk = walk_files(folder)
    assert walk.files == (folder / "alias.hlo", folder / "inside.hlo")
    notes = "\n".join(walk.notes)
    assert "escape.hlo: a symlink out of" in notes and "proc: a symlink to a folder, not followed" in notes
    assert walk.skipped == 2
    with pytest.raises(SpecialFileError, match="pseudo-filesystem"):
        walk_files("/proc/self")
    with pytest.raises(ProgramReadError, match="pseudo-filesystem"):
        ejlabel.find_labels_in_lowered("/proc/self")


def test_unreadable_entries_are_passed_over_and_counted(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "a.hlo").write_text(PROGRAM)
    locked = tmp_path / "locked"
    locked.mkdir()
    (locked / "b.hlo").write_text(PROGRAM)
    real_scandir = os.scandir

    def scandir(path: os.PathLike[str] | str) -> object:
        if Path(path) == locked:  # chmod 000 does not stop root, so the refusal is simulated
            raise PermissionError(13, "Permission denied")
        return real_scandir(path)

    monkeypatch.setattr(files_module.os, "scandir", scandir)
    walk = walk_files(tmp_path)
    assert walk.files == (tmp_path / "a.hlo",) and walk.skipped == 1
    assert f"{locked}: not read (Permission denied)" in walk.notes
    assert ejlabel.find_labels_in_lowered(tmp_path) == ejlabel.find_labels_in_lowered(PROGRAM)
    assert any("Permission denied" in note for note in read_program(tmp_path).notes)


def test_labels_to_configs_of_the_root_folder_refuses_cleanly() -> None:
    # Unreadable entries are passed over (no PermissionError); a limit stops the walk with a clear
    # error naming it (entries, depth), or the folder holds no program files.
    with pytest.raises(ProgramReadError, match=r"^x: (/ holds more than|/ nests folders|the directory / holds no)"):
        ejlabel.labels_to_configs("/")
