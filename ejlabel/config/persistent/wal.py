"""Damage in the cache's write-ahead log: found and reported, never silent.

The cache runs SQLite in WAL mode: a committed transaction is first appended to the ``-wal``
file, as frames (one per page), and copied into the database file later (a checkpoint). When
SQLite opens a database whose log is not empty it *recovers* the log: it reads the frames in
order, checking each frame's salt (which log generation it belongs to) and its running checksum,
and stops at the first frame that fails. Everything from there on is dropped without a word: a
few bytes of damage in the middle of the log silently lose every transaction committed after it.

:func:`log_damage` compares two counts, changing neither the log nor the database:

* what the log holds: from its header (magic, format version, page size, salts, header
  checksum), the frames that belong to the current generation (their salts match the header's),
  up to the last one that ends a transaction (a *commit frame*: its "database size" field is set);
* what SQLite recovered: ``mxFrame``, the number of valid frames, from the header of the
  ``-shm`` index that recovery writes, read through SQLite's own descriptor of it (where the
  system lists a process's descriptors: ``/proc/self/fd``).

More commit frames than SQLite accepted means committed transactions were dropped; a header
that fails its own check while frames follow it means the whole log was. The file formats are
SQLite's documented on-disk formats (the WAL file and the wal-index header). A damaged tail that
ends no transaction (a process killed mid-commit) is not damage: nothing committed was lost.
The first writer after a damaged log starts the log over it, so a writable cache keeps a copy
of the damaged log next to it before that happens.
"""

from __future__ import annotations

import os
import pathlib
import shutil
import sqlite3
import struct
import sys
import time

__all__ = ["log_damage", "read_start"]

_WAL_MAGIC = (0x377F0682, 0x377F0683)  # checksums of little- / big-endian words
_WAL_VERSION = 3007000
_WAL_HEADER = 32
_FRAME_HEADER = 24
_SHM_HEADER = 48
_MASK = 0xFFFFFFFF


def _checksum(data: bytes, big_endian: bool, s0: int = 0, s1: int = 0) -> tuple[int, int]:
    """SQLite's WAL checksum of ``data`` (a multiple of 8 bytes), continued from ``(s0, s1)``."""
    words = struct.unpack(f"{'>' if big_endian else '<'}{len(data) // 4}I", data)
    for i in range(0, len(words), 2):
        s0 = (s0 + words[i] + s1) & _MASK
        s1 = (s1 + words[i + 1] + s0) & _MASK
    return s0, s1


def _commit_frames(fd: int, size: int) -> list[int] | str:
    """The numbers (from 1) of the commit frames of the log's current generation, one per
    transaction; or why the header is not a valid one. Reads the headers only."""
    header = os.pread(fd, _WAL_HEADER, 0)
    magic, version, page_size, _, salt1, salt2, ck1, ck2 = struct.unpack(">8I", header)
    if magic not in _WAL_MAGIC or version != _WAL_VERSION:
        return f"its header is not a write-ahead log header (magic {magic:#x}, version {version})"
    if _checksum(header[:24], magic & 1 == 1) != (ck1, ck2):
        return "its header fails its checksum"
    page_size = 65536 if page_size == 1 else page_size
    if page_size < 512 or page_size > 65536 or page_size & (page_size - 1):
        return f"its header gives a page size of {page_size}"
    commits: list[int] = []
    frame = 0
    offset = _WAL_HEADER
    while offset + _FRAME_HEADER + page_size <= size:
        _, db_size, frame_salt1, frame_salt2 = struct.unpack(">4I", os.pread(fd, 16, offset))
        if (frame_salt1, frame_salt2) != (salt1, salt2):
            break  # frames of an earlier generation: the log was restarted over them
        frame += 1
        if db_size:
            commits.append(frame)
        offset += _FRAME_HEADER + page_size
    return commits


def _recovered_frames(shm_path: pathlib.Path) -> int | None:
    """``mxFrame`` of the wal-index header (native byte order), or None when it cannot be read.

    Read through the descriptor SQLite itself holds on the index, never one of our own: closing
    any descriptor of a file drops every POSIX lock this process holds on it, SQLite's included,
    and another process that then finds the index unclaimed truncates it under this process's
    mapping of it (SIGBUS; seen with 32 processes opening a fresh cache at once). None where
    that descriptor cannot be found (no ``/proc/self/fd``): the check is then left out.
    """
    try:
        header = read_start(shm_path, _SHM_HEADER, held_only=True)
    except OSError:
        return None
    if len(header) < _SHM_HEADER:
        return None
    order = "<" if sys.byteorder == "little" else ">"
    _, _, _, is_init, _, _, max_frame = struct.unpack(f"{order}3IBBHI", header[:20])
    return max_frame if is_init else None


def read_start(path: pathlib.Path, size: int, *, held_only: bool) -> bytes:
    """The first ``size`` bytes of ``path``, a file SQLite may hold: read (``os.pread``) through a
    descriptor this process already holds on it, never one opened and closed beside it, whose
    close would drop this process's POSIX locks on the file. With none found, the file is opened
    and closed anew, or with ``held_only`` nothing is read (``b""``). OSError as ``open`` raises."""
    held = _held_descriptor(path)
    if held is not None:
        return os.pread(held, size, 0)
    if held_only:
        return b""
    with open(path, "rb") as f:
        return f.read(size)


def _held_descriptor(path: pathlib.Path) -> int | None:
    """A descriptor this process already holds on ``path`` (Linux: ``/proc/self/fd``), else None."""
    try:
        target = os.stat(path)
        names = os.listdir("/proc/self/fd")
    except OSError:
        return None
    for name in names:
        try:
            held = os.fstat(int(name))
        except (OSError, ValueError):
            continue
        if (held.st_dev, held.st_ino) == (target.st_dev, target.st_ino):
            return int(name)
    return None


def _keep(log_path: pathlib.Path) -> str:
    """Copy the damaged log aside; the words that say where (or why not)."""
    copy = log_path.with_name(f"{log_path.name}.damaged-{int(time.time())}")
    try:
        shutil.copyfile(log_path, copy)
    except OSError as err:
        return f" (a copy could not be kept: {err.strerror or err})"
    return f"; a copy of the log is kept at {copy}"


def log_damage(path: pathlib.Path, conn: sqlite3.Connection, *, reads_log: bool, keep_copy: bool) -> str | None:
    """What damage in ``path``'s write-ahead log cost, in words, or None when there is none.

    Call it on a freshly opened connection, before anything is written through it (the next
    write starts the log over the damaged frames): it takes the write lock (``BEGIN IMMEDIATE``)
    while it compares the log with the index, so that no other process appends to them
    meanwhile. ``reads_log`` False is a read-only open that cannot read the log at all
    (``immutable``): then any committed frame in it is reported as unread. With ``keep_copy`` a
    damaged log is copied aside first (``<log>.damaged-<time>``), so what it still holds is not
    destroyed by the writes that follow.
    """
    log_path = path.with_name(path.name + "-wal")
    try:
        size = os.stat(log_path).st_size
    except OSError:
        return None
    if size == 0:
        return None
    locked = False
    if reads_log:
        try:
            conn.execute("BEGIN IMMEDIATE")  # runs recovery if nobody has, and keeps writers out
            locked = True
        except sqlite3.OperationalError:
            pass  # a read-only open: no writer to keep out
    try:
        try:
            fd = os.open(log_path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0))
        except OSError as err:
            return f"its write-ahead log {log_path} cannot be read ({err.strerror or err})"
        try:
            size = os.fstat(fd).st_size
            if size < _WAL_HEADER:
                return None  # a log cut short while its header was written holds no transaction
            found = _commit_frames(fd, size)
        except OSError as err:
            return f"its write-ahead log {log_path} cannot be read ({err.strerror or err})"
        finally:
            os.close(fd)
        if isinstance(found, str):
            if size > _WAL_HEADER:
                kept = _keep(log_path) if keep_copy else ""
                return f"its write-ahead log {log_path} is damaged: {found}, so none of its {size} bytes is read{kept}"
            return None
        if not found:
            return None
        if not reads_log:
            return (
                f"its write-ahead log {log_path} holds {len(found)} committed transactions that a read-only open "
                "cannot read; open the cache once where it is writable to bring them into the database"
            )
        if not locked:
            conn.execute("SELECT COUNT(*) FROM sqlite_master").fetchone()  # make sure recovery ran
        recovered = _recovered_frames(path.with_name(path.name + "-shm"))
        lost = [frame for frame in found if recovered is not None and frame > recovered]
        if not lost:
            return None
        kept = _keep(log_path) if keep_copy else ""
        return (
            f"its write-ahead log {log_path} fails its check after frame {recovered}: the {len(lost)} transactions "
            f"committed after it (up to frame {lost[-1]}) are not read, and the entries they wrote are lost{kept}"
        )
    finally:
        if locked and conn.in_transaction:
            conn.execute("ROLLBACK")
