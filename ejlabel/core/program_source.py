"""The one reader of program text: which text each form of a program gives, read within bounds.

Every reader of programs goes through :func:`read_program_source`: the label readers of the core
(``find_labels_in_lowered``, ``labels_to_configs``) scan the texts it returns for labels, and
``ejlabel.analysis.read_program`` parses them. So both see the same files of a dump, under the
same limits. What is read, for each input:

==============================  ===========================================================
input                           text read
==============================  ===========================================================
``jax.stages.Lowered``          its StableHLO (``lowered.as_text()``), or with
                                ``lowered_form="hlo"`` its HLO
                                (``lowered.compiler_ir("hlo").as_hlo_text()``)
``jax.stages.Compiled``         its optimised HLO: ``compiled.as_text()``
program text (``str``/bytes)    the text
a program file                  its text
an XLA dump directory           one file per module: its ``*after_optimizations.txt`` (the
                                HLO XLA compiled), else its ``*before_optimizations.txt`` (the
                                HLO XLA received); never both kinds in one program
                                (``stage="before"`` picks the unoptimised files)
a directory without dump files  every ``*.txt`` / ``*.hlo`` / ``*.mlir`` file, in name order
==============================  ===========================================================

A path is a ``str`` or ``os.PathLike`` naming an existing file or directory, or one line ending
in ``.txt``, ``.hlo``, ``.mlir`` or ``/`` (a missing one is a ``FileNotFoundError``); a ``str``
holding a line break is always text.

Reading is bounded, because program files and dump directories come from elsewhere: only regular
files are read (a FIFO, a device such as ``/dev/zero`` or a socket is refused before it is opened,
and checked again on the open descriptor); a program reads at most ``max_bytes`` in all (each file
in chunks, so a file that grows stops at the cap); a directory is walked by
:func:`ejlabel.utils.files.walk_files` (no recursion, symlinked folders and symlinks out of it not
followed, kernel pseudo-filesystems not entered, unreadable entries passed over and counted,
refused past ``max_entries`` entries or ``max_depth`` levels). What was passed over is in
``ProgramSource.notes``.
"""

from __future__ import annotations

import os
import re
import stat
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import jax

from ejlabel.utils import files
from ejlabel.utils.files import (
    DirectoryLimitError,
    FileTooLargeError,
    SpecialFileError,
    file_kind,
    read_regular_file,
    walk_files,
)

__all__ = [
    "PROGRAM_SUFFIXES",
    "ProgramReadError",
    "ProgramSource",
    "SourceText",
    "Stage",
    "read_program_source",
]

Stage = Literal["after", "before"]
PROGRAM_SUFFIXES = (".txt", ".hlo", ".mlir")
"""Suffixes of the files read from a directory that is not an XLA dump."""

_DUMP_MODULE = re.compile(r"(module_\d+)")
_STAGE_NAMES = {"after": "after-optimizations", "before": "before-optimizations"}


class ProgramReadError(ValueError):
    """A program path that is not read: a special file, too large, or a directory too big to walk."""


@dataclass(frozen=True)
class SourceText:
    """One text of a program and where it came from (``"Lowered.as_text()"``, a file path, ...)."""

    text: str
    source: str


@dataclass(frozen=True)
class ProgramSource:
    """The texts of one program, the kind of input they came from, and what was passed over.

    ``origin`` is ``"lowered"``, ``"compiled"``, ``"text"``, ``"file"``, ``"dump"`` or
    ``"directory"``.
    """

    texts: tuple[SourceText, ...]
    origin: str
    notes: tuple[str, ...] = ()


def read_program_source(
    x: Any,
    *,
    stage: Stage = "after",
    lowered_form: Literal["stablehlo", "hlo"] = "stablehlo",
    max_bytes: int | None = None,
    max_entries: int | None = None,
    max_depth: int | None = None,
    also_accepted: str = "",
) -> ProgramSource:
    """The texts of ``x`` (see the module docstring for what each form gives).

    ``max_bytes``, ``max_entries`` and ``max_depth`` default to :mod:`ejlabel.utils.files`'s
    limits, read at each call. ``also_accepted`` names the caller's other accepted forms in the
    ``TypeError`` for anything else.

    Raises:
      TypeError: ``x`` is no program form.
      FileNotFoundError: ``x`` names a path that does not exist.
      ProgramReadError: a special file, a program over ``max_bytes``, a directory past its
        limits or holding no program files.
    """
    if stage not in ("after", "before"):
        raise ValueError(f"stage: expected 'after' or 'before', got {stage!r}")
    if isinstance(x, jax.stages.Lowered):
        if lowered_form == "hlo":
            hlo = x.compiler_ir("hlo")
            if hlo is not None:
                return ProgramSource((SourceText(hlo.as_hlo_text(), "Lowered.compiler_ir('hlo')"),), "lowered")
        return ProgramSource((SourceText(_text_of(x), "Lowered.as_text()"),), "lowered")
    if isinstance(x, jax.stages.Compiled):
        return ProgramSource((SourceText(_text_of(x), "Compiled.as_text()"),), "compiled")
    if isinstance(x, (bytes, bytearray, memoryview)):
        x = bytes(x).decode("utf-8", "replace")
    if isinstance(x, os.PathLike) or (isinstance(x, str) and names_a_path(x)):
        reader = _FileReader(
            files.MAX_PROGRAM_BYTES if max_bytes is None else max_bytes,
            files.MAX_DIRECTORY_ENTRIES if max_entries is None else max_entries,
            files.MAX_DIRECTORY_DEPTH if max_depth is None else max_depth,
        )
        return reader.read_path(Path(x), stage)
    if isinstance(x, str):
        return ProgramSource((SourceText(x, "text"),), "text")
    hint = "; lower a function first: jax.jit(f).lower(*args)" if callable(x) else ""
    raise TypeError(
        "x: expected a Lowered, a Compiled, program text, or a path to a program file or XLA dump "
        f"directory{also_accepted}, got {type(x).__name__}{hint}"
    )


def _text_of(x: Any) -> str:
    text = x.as_text()
    if text is None:
        raise ValueError(f"x: this {type(x).__name__} has no text form")
    return text


def names_a_path(text: str) -> bool:
    """An existing path, or one line that can only be a path (a name with a program suffix).

    Blank text is not a path (``Path("")`` is the current directory).
    """
    if "\n" in text or len(text) >= 4096 or not text.strip():
        return False
    return Path(text).exists() or text.rstrip().endswith(PROGRAM_SUFFIXES + ("/",))


class _FileReader:
    """Reads the files of one program, counting its bytes against one budget."""

    def __init__(self, max_bytes: int, max_entries: int, max_depth: int) -> None:
        self.max_bytes = max_bytes
        self.bytes_left = max_bytes
        self.max_entries = max_entries
        self.max_depth = max_depth
        self.notes: list[str] = []

    def read_path(self, path: Path, stage: Stage) -> ProgramSource:
        try:
            mode = os.stat(path).st_mode  # follows symlinks; never opens (a FIFO would block)
        except FileNotFoundError:
            raise FileNotFoundError(f"x: no such file or directory: {path}") from None
        except OSError as err:
            raise ProgramReadError(f"x: cannot read {path}: {err.strerror or err}") from None
        if stat.S_ISDIR(mode):
            return self.read_directory(path, stage)
        if not stat.S_ISREG(mode):
            raise ProgramReadError(
                f"x: {path} is {file_kind(mode)}, not a program file or dump directory (special files are never read)"
            )
        return ProgramSource((self.read_file(path),), "file")

    def read_file(self, path: Path) -> SourceText:
        """The text of the regular file ``path``, counted against the byte budget.

        Opened non-blocking and checked again on the descriptor (the path may have changed since
        it was listed), then read in chunks up to the bytes left, so nothing reads without end.
        """
        try:
            data = read_regular_file(path, self.bytes_left)
        except SpecialFileError as err:
            raise ProgramReadError(f"x: {path} is {err.kind}, not a program file (special files are never read)") from None
        except FileTooLargeError:
            raise ProgramReadError(f"x: {path} takes the program past the {self.max_bytes}-byte limit (MAX_PROGRAM_BYTES)") from None
        except OSError as err:
            raise ProgramReadError(f"x: cannot read {path}: {err.strerror or err}") from None
        self.bytes_left -= len(data)
        return SourceText(data.decode("utf-8", "replace"), str(path))

    def read_directory(self, path: Path, stage: Stage) -> ProgramSource:
        try:
            walk = walk_files(path, max_entries=self.max_entries, max_depth=self.max_depth)
        except DirectoryLimitError as err:
            raise ProgramReadError(f"x: {err}; give the dump directory itself") from None
        except SpecialFileError as err:
            raise ProgramReadError(f"x: {path} is {err.kind} (special files are never read)") from None
        self.notes.extend(walk.notes)
        after = [p for p in walk.files if p.name.endswith("after_optimizations.txt")]
        before = [p for p in walk.files if p.name.endswith("before_optimizations.txt")]
        if after or before:
            chosen = self.dump_files(after, before, stage)
            origin = "dump"
        else:
            chosen = [p for p in walk.files if p.suffix in PROGRAM_SUFFIXES]
            origin = "directory"
            if not chosen:
                raise ProgramReadError(f"x: the directory {path} holds no program files ({', '.join(PROGRAM_SUFFIXES)})")
        texts = tuple(self.read_file(p) for p in chosen)
        return ProgramSource(texts, origin, tuple(self.notes))

    def dump_files(self, after: list[Path], before: list[Path], stage: Stage) -> list[Path]:
        """One file per dumped module, all of one stage: ``stage``'s if there are any, else the other's."""
        wanted, other = (after, before) if stage == "after" else (before, after)
        other_stage: Stage = "before" if stage == "after" else "after"
        if not wanted:
            self.notes.append(f"the dump has no {_STAGE_NAMES[stage]} files: read its {_STAGE_NAMES[other_stage]} files")
            wanted, other, stage = other, wanted, other_stage
        chosen: dict[str, Path] = {}
        for p in wanted:
            chosen.setdefault(_module_key(p), p)
        for p in other:
            if _module_key(p) not in chosen:
                self.notes.append(f"{p.name}: no {_STAGE_NAMES[stage]} file for this module, not read")
        return list(chosen.values())


def _module_key(path: Path) -> str:
    """``module_0012`` of ``module_0012.jit_step.cpu_after_optimizations.txt``."""
    found = _DUMP_MODULE.match(path.name)
    if found is not None:
        return found.group(1)
    return path.name.split(".", 1)[0]
