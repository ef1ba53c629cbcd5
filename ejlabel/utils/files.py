"""Bounded reading of files and folders that came from elsewhere (program dumps, cache exports).

One reader for every such file (:func:`read_regular_file`): it never blocks on a FIFO, never
reads a device, and never reads past a byte limit, whatever the file does while it is read. The
path is opened non-blocking and checked on the open descriptor (it may have been swapped since its
caller looked), then read in chunks up to ``limit + 1`` bytes, so a file that grows while being
read stops at the cap.

One walker for every folder (:func:`walk_files`): iterative (a stack of folders, no recursion),
bounded in entries and depth, it never follows a symlink to a folder or out of the folder walked,
never enters a kernel pseudo-filesystem (``/proc``, ``/sys``), and passes over what it
cannot read (counting it) instead of failing half-way through a folder such as ``/``.

Callers turn the refusals into their own errors, with their own wording.
"""

from __future__ import annotations

import os
import stat
from dataclasses import dataclass
from pathlib import Path

__all__ = [
    "MAX_DIRECTORY_DEPTH",
    "MAX_DIRECTORY_ENTRIES",
    "MAX_PROGRAM_BYTES",
    "PSEUDO_FILESYSTEMS",
    "DirectoryLimitError",
    "DirectoryWalk",
    "FileTooLargeError",
    "SpecialFileError",
    "file_kind",
    "in_pseudo_filesystem",
    "read_regular_file",
    "walk_files",
]

#: Most bytes read for one program (one file, or all files of a directory together). The HLO of
#: a 10^6-instruction program is ~150 MiB; parsing takes ~2.5x the text in memory.
MAX_PROGRAM_BYTES = 1 << 30

_CHUNK = 1 << 20
_OPEN_FLAGS = os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_NOCTTY", 0) | getattr(os, "O_CLOEXEC", 0)


class SpecialFileError(OSError):
    """The path is not a regular file; ``kind`` says what it is (``"a FIFO"``, ...)."""

    def __init__(self, path: os.PathLike[str] | str, kind: str) -> None:
        super().__init__(f"{path} is {kind}, not a regular file")
        self.kind = kind


class FileTooLargeError(OSError):
    """The file holds more than the caller's limit of bytes."""


def file_kind(mode: int) -> str:
    """``a FIFO``, ``a character device``, ... of an ``st_mode``, for refusal messages."""
    for test, name in ((stat.S_ISDIR, "a directory"), (stat.S_ISCHR, "a character device"),
                       (stat.S_ISBLK, "a block device"), (stat.S_ISFIFO, "a FIFO"), (stat.S_ISSOCK, "a socket")):
        if test(mode):
            return name
    return "a special file"


def read_regular_file(path: os.PathLike[str] | str, limit: int) -> bytes:
    """The bytes of the regular file ``path``, at most ``limit`` of them.

    Raises:
      SpecialFileError: ``path`` is not a regular file (checked on the open descriptor).
      FileTooLargeError: it holds more than ``limit`` bytes.
      OSError: it cannot be opened or read.
    """
    fd = os.open(Path(path), _OPEN_FLAGS)
    try:
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            raise SpecialFileError(path, file_kind(mode))
        chunks: list[bytes] = []
        total = 0
        while chunk := os.read(fd, min(_CHUNK, limit + 1 - total)):
            chunks.append(chunk)
            total += len(chunk)
            if total > limit:
                raise FileTooLargeError(f"{path} holds more than {limit} bytes")
        return b"".join(chunks)
    finally:
        os.close(fd)


#: Most directory entries a walk looks at (an XLA dump holds a few per module).
MAX_DIRECTORY_ENTRIES = 100_000
#: Deepest folder a walk enters, counted from the folder it starts in (a dump is flat).
MAX_DIRECTORY_DEPTH = 64
#: Kernel pseudo-filesystems: their files are views of the running system (some endless, some
#: blocking), never programs (``/dev`` holds special files, which are passed over anyway). A walk does not enter them and refuses to start in them.
PSEUDO_FILESYSTEMS = ("/proc", "/sys")
# Notes kept per walk; past this, skipped entries are only counted.
_MAX_NOTES = 200


class DirectoryLimitError(OSError):
    """A walk went past :data:`MAX_DIRECTORY_ENTRIES` entries or :data:`MAX_DIRECTORY_DEPTH` levels."""


@dataclass(frozen=True)
class DirectoryWalk:
    """What a walk found: the regular files (sorted), what it passed over and why, and how many."""

    files: tuple[Path, ...]
    notes: tuple[str, ...]
    skipped: int


def in_pseudo_filesystem(path: os.PathLike[str] | str) -> bool:
    """Whether ``path`` (resolved) lies in one of :data:`PSEUDO_FILESYSTEMS`."""
    real = os.path.realpath(path)
    return any(real == root or real.startswith(root + os.sep) for root in PSEUDO_FILESYSTEMS)


def walk_files(
    root: os.PathLike[str] | str,
    *,
    max_entries: int = MAX_DIRECTORY_ENTRIES,
    max_depth: int = MAX_DIRECTORY_DEPTH,
) -> DirectoryWalk:
    """The regular files under the folder ``root``, walked without recursion.

    Never follows a symlink to a folder (no loops, no walking off elsewhere), nor a symlink to a
    file outside ``root``; never enters :data:`PSEUDO_FILESYSTEMS`. Special files, such symlinks
    and entries that cannot be read (a folder without permission) are passed over, noted and
    counted. More than ``max_entries`` entries in all, or a folder ``max_depth`` levels below
    ``root``, is a :class:`DirectoryLimitError`: the walk is refused, not cut short, so a reader
    never works from part of a folder without saying so.

    Raises:
      DirectoryLimitError: past either limit.
      SpecialFileError: ``root`` lies in a pseudo-filesystem.
    """
    start = Path(root)
    if in_pseudo_filesystem(start):
        raise SpecialFileError(start, "a kernel pseudo-filesystem folder")
    base = os.path.realpath(start) + os.sep
    files: list[Path] = []
    notes: list[str] = []
    skipped = 0
    seen = 0

    def skip(note: str) -> None:
        nonlocal skipped
        skipped += 1
        if len(notes) < _MAX_NOTES:
            notes.append(note)

    pending: list[tuple[Path, int]] = [(start, 0)]
    while pending:
        folder, depth = pending.pop()
        try:
            with os.scandir(folder) as listing:
                entries = list(listing)
        except OSError as err:
            skip(f"{folder}: not read ({err.strerror or err})")
            continue
        seen += len(entries)
        if seen > max_entries:
            raise DirectoryLimitError(f"{start} holds more than {max_entries} entries")
        for entry in entries:
            try:
                if entry.is_symlink():
                    if entry.is_dir(follow_symlinks=True):
                        skip(f"{entry.path}: a symlink to a folder, not followed")
                    elif not os.path.realpath(entry.path).startswith(base):
                        skip(f"{entry.path}: a symlink out of {start}, not followed")
                    elif entry.is_file(follow_symlinks=True):
                        files.append(Path(entry.path))
                    else:
                        skip(f"{entry.path}: a symlink to something other than a regular file, not followed")
                elif entry.is_dir(follow_symlinks=False):
                    if depth + 1 > max_depth:
                        raise DirectoryLimitError(f"{start} nests folders more than {max_depth} levels deep ({entry.path})")
                    if in_pseudo_filesystem(entry.path):
                        skip(f"{entry.path}: a kernel pseudo-filesystem folder, not entered")
                    else:
                        pending.append((Path(entry.path), depth + 1))
                elif entry.is_file(follow_symlinks=False):
                    files.append(Path(entry.path))
                else:
                    skip(f"{entry.path}: {file_kind(entry.stat(follow_symlinks=False).st_mode)}, not read")
            except DirectoryLimitError:
                raise
            except OSError as err:
                skip(f"{entry.path}: not read ({err.strerror or err})")
    if skipped > len(notes):
        notes.append(f"{skipped - len(notes)} more entries passed over")
    return DirectoryWalk(tuple(sorted(files)), tuple(notes), skipped)
