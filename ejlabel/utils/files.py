"""Bounded reading of files that came from elsewhere (program dumps, cache exports).

One reader for every such file: it never blocks on a FIFO, never reads a device, and never reads
past a byte limit, whatever the file does while it is read. The path is opened non-blocking and
checked on the open descriptor (it may have been swapped since its caller looked), then read in
chunks up to ``limit + 1`` bytes, so a file that grows while being read stops at the cap. Callers
turn the two refusals into their own errors, with their own wording and limit names.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

__all__ = ["MAX_PROGRAM_BYTES", "FileTooLargeError", "SpecialFileError", "file_kind", "read_regular_file"]

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
