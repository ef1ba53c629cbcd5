"""The SQLite file behind the persistent cache: where it lives, its schema, and opening it safely.

The cache is one file, ``configs.sqlite`` in ``$EJLABEL_CACHE_DIR`` (else the user cache
directory), or a ``.sqlite`` / ``.db`` file named directly. Its identity is checked before
anything is written to it: the SQLite header, the application id (``"EJLB"``), the ``meta``
table's marker and schema version. A file that is not ours fails with a
:class:`~.entry.CacheError` naming it and is left byte-for-byte unchanged; a file written by a
newer schema asks for an upgrade.

Many processes open the same file at once (parallel tuning jobs, test workers). Opening reads
the file's identity in one transaction (one snapshot), and a new file's identity check and
schema creation are one ``BEGIN IMMEDIATE`` transaction, so processes opening a fresh cache
together never see each other's half-made schema. The database runs in WAL mode with a busy
timeout; the switch to WAL is retried, since SQLite refuses it at once while another
connection holds a shared lock.

A cache that cannot be written (a read-only mount, a file or folder without write permission:
:func:`can_write`) still opens, read-only (``open_connection(path, read_only=True)``), so that
it can be listed, shown, counted and audited: through SQLite's ``mode=ro`` where the WAL index
can be used, else as ``immutable`` (which cannot read the write-ahead log: what that leaves out
is reported, see :mod:`.wal`). Nothing is created or changed then, and writes fail.
"""

from __future__ import annotations

import os
import pathlib
import random
import sqlite3
import time
import urllib.parse
from collections.abc import Callable
from typing import Any, TypeVar

from ejlabel.config.persistent.entry import CacheError
from ejlabel.config.persistent.wal import log_damage, read_start

__all__ = [
    "BUSY_TIMEOUT_S", "COLUMNS", "DEFAULT_FILENAME", "FILE_SUFFIXES", "INSERT_NEW", "KEY_WHERE", "SCHEMA_VERSION", "SELECT",
    "UPSERT", "can_write", "default_cache_path", "is_op_name", "open_connection", "resolve_file",
]

_T = TypeVar("_T")

SCHEMA_VERSION = 1
APPLICATION_MARKER = "ejlabel-config-cache"
# "EJLB" in ASCII: lets `file`-style tools and our own open() tell the file apart from others.
APPLICATION_ID = 0x454A4C42
DEFAULT_FILENAME = "configs.sqlite"
FILE_SUFFIXES = (".sqlite", ".db")
BUSY_TIMEOUT_S = 30.0

_SQLITE_HEADER = b"SQLite format 3\x00"
COLUMNS = (
    "device", "op_id", "call_key", "config_json", "config_type", "provenance", "stats_json",
    "kernel_version", "jax_version", "jaxlib_version", "created",
)
SELECT = f"SELECT {', '.join(COLUMNS)} FROM configs"
UPSERT = f"INSERT OR REPLACE INTO configs ({', '.join(COLUMNS)}) VALUES ({', '.join('?' * len(COLUMNS))})"
INSERT_NEW = UPSERT.replace("INSERT OR REPLACE", "INSERT OR IGNORE")
KEY_WHERE = "WHERE device = ? AND op_id = ? AND call_key = ?"
_SCHEMA = """
CREATE TABLE IF NOT EXISTS meta (
    key   TEXT PRIMARY KEY,
    value TEXT NOT NULL
);
CREATE TABLE IF NOT EXISTS configs (
    device         TEXT NOT NULL,
    op_id          TEXT NOT NULL,
    call_key       TEXT NOT NULL,
    config_json    TEXT NOT NULL,
    config_type    TEXT NOT NULL,
    provenance     TEXT NOT NULL,
    stats_json     TEXT,
    kernel_version TEXT NOT NULL,
    jax_version    TEXT NOT NULL,
    jaxlib_version TEXT NOT NULL,
    created        REAL NOT NULL,
    PRIMARY KEY (device, op_id, call_key)
) WITHOUT ROWID;
CREATE INDEX IF NOT EXISTS configs_by_op ON configs (op_id);
"""


def default_cache_path() -> pathlib.Path:
    """``$EJLABEL_CACHE_DIR``, else ``($XDG_CACHE_HOME or ~/.cache)/ejlabel``."""
    env = os.environ.get("EJLABEL_CACHE_DIR")
    if env:
        return pathlib.Path(env).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return pathlib.Path(base) / "ejlabel"


def resolve_file(path: str | os.PathLike[str] | None) -> pathlib.Path:
    """Map a directory (or None) to the database file inside it; a ``.sqlite``/``.db`` path is the file."""
    p = default_cache_path() if path is None else pathlib.Path(os.fspath(path)).expanduser()
    if p.suffix.lower() in FILE_SUFFIXES and not p.is_dir():
        return p.absolute()
    return (p / DEFAULT_FILENAME).absolute()


def is_op_name(value: Any) -> bool:
    """Whether a first argument reads as ejkernel's op name rather than a location."""
    if not isinstance(value, str) or not value or value in (".", ".."):
        return False
    if "/" in value or os.sep in value or (os.altsep and os.altsep in value) or value.startswith("~"):
        return False
    return pathlib.Path(value).suffix.lower() not in FILE_SUFFIXES and not os.path.isdir(value)


def _ensure_wal(conn: sqlite3.Connection) -> None:
    """Put the database in WAL mode, waiting out other processes that hold it meanwhile.

    Leaving rollback-journal mode needs an exclusive lock, and SQLite answers "database is
    locked" at once, without its busy handler, when another connection holds a shared lock
    (it could deadlock otherwise): with many processes opening a fresh cache together that
    happens, so the switch is retried, with jitter, for up to the busy timeout.
    """
    deadline = time.monotonic() + BUSY_TIMEOUT_S
    while True:
        try:
            if conn.execute("PRAGMA journal_mode").fetchone()[0].lower() != "wal":
                conn.execute("PRAGMA journal_mode = WAL")
            return
        except sqlite3.OperationalError as err:
            message = str(err).lower()
            if ("locked" not in message and "busy" not in message) or time.monotonic() > deadline:
                raise
            time.sleep(random.uniform(0.001, 0.02))


def _not_ours(path: pathlib.Path, what: str) -> CacheError:
    return CacheError(f"{path} is not an ejlabel cache: {what}")


def can_write(path: pathlib.Path) -> bool:
    """Whether the cache file ``path`` can be opened for writing: the file (when it exists) and its
    folder, where SQLite writes the WAL's side files, are writable. A read-only mount fails this
    even for root, which the permission bits alone do not stop."""
    folder_ok = os.access(path.parent, os.W_OK | os.X_OK)
    return folder_ok and (not path.exists() or os.access(path, os.W_OK))


def open_connection(path: pathlib.Path, *, read_only: bool = False) -> tuple[sqlite3.Connection, str | None]:
    """Connect to the cache file ``path``, check that it is ours (or new), and create the schema if new.

    Returns the connection and what damage in the write-ahead log cost (:func:`.wal.log_damage`,
    checked before anything is written, which would overwrite the damaged log), or None. With
    ``read_only`` the file must exist already and nothing is written to it or next to it.
    :class:`~.entry.CacheError` naming the file for anything that stops it; a file that is not
    ours is left byte-for-byte unchanged.
    """
    if read_only:
        return _open_read_only(path)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise CacheError(f"cannot create cache directory {path.parent}: {err.strerror or err}") from None
    if not path.parent.is_dir():
        raise CacheError(f"cannot use cache directory {path.parent}: not a directory")
    if not os.access(path.parent, os.W_OK | os.X_OK):
        # WAL needs to create side files next to the database, even just to read it.
        raise CacheError(f"cannot use cache directory {path.parent}: permission denied (not writable)")
    _check_header(path)
    try:
        conn = sqlite3.connect(path, timeout=BUSY_TIMEOUT_S, isolation_level=None, check_same_thread=False)
    except sqlite3.Error as err:
        raise CacheError(f"cannot open cache file {path}: {err}") from None
    try:
        # Read-only checks first: nothing is written until the file is known to be ours.
        kind = _in_snapshot(conn, lambda c: _inspect(path, c))
        damage = log_damage(path, conn, reads_log=True, keep_copy=True)
        if kind == "new":
            _create(path, conn)
        conn.execute(f"PRAGMA busy_timeout = {int(BUSY_TIMEOUT_S * 1000)}")
        _ensure_wal(conn)
        # With WAL, NORMAL still makes every committed transaction survive a process crash
        # (the commit is in the WAL file before put() returns); only a power loss or OS crash
        # can lose the last few commits. FULL would fsync per put and make tuning runs
        # with many processes much slower for no gain against crashes.
        conn.execute("PRAGMA synchronous = NORMAL")
    except CacheError:
        conn.close()
        raise
    except sqlite3.OperationalError as err:
        # Locked, unable to open side files, ...: the file may well be ours.
        conn.close()
        raise CacheError(f"cannot open cache file {path}: {err}") from None
    except sqlite3.DatabaseError as err:
        conn.close()
        raise _not_ours(path, str(err)) from None
    return conn, damage


def _open_read_only(path: pathlib.Path) -> tuple[sqlite3.Connection, str | None]:
    """Open an existing cache without writing anything: ``mode=ro``, else ``immutable``.

    ``mode=ro`` reads the write-ahead log too, but needs its index (``-shm``) to exist or be
    creatable; on a read-only folder without one only ``immutable`` opens, and it reads the
    database file alone.
    """
    if not path.is_file():
        raise CacheError(f"cannot open cache file {path} read-only: no such file (a new cache needs a writable folder)")
    _check_header(path)
    quoted = urllib.parse.quote(str(path))
    last: sqlite3.Error | None = None
    for query, reads_log in (("mode=ro", True), ("immutable=1", False)):
        try:
            conn = sqlite3.connect(f"file:{quoted}?{query}", uri=True, timeout=BUSY_TIMEOUT_S, isolation_level=None, check_same_thread=False)
        except sqlite3.Error as err:
            last = err
            continue
        try:
            conn.execute(f"PRAGMA busy_timeout = {int(BUSY_TIMEOUT_S * 1000)}")
            if _in_snapshot(conn, lambda c: _inspect(path, c)) == "new":
                unread = "" if reads_log else (
                    ", or everything is still in its write-ahead log, which a read-only open without the "
                    "log's index (-shm) cannot read: open it once where it is writable"
                )
                raise CacheError(f"cannot open cache file {path} read-only: it holds no cache yet{unread}")
            return conn, log_damage(path, conn, reads_log=reads_log, keep_copy=False)
        except CacheError:
            conn.close()
            raise
        except sqlite3.OperationalError as err:  # no WAL index to be had: try the next way
            conn.close()
            last = err
        except sqlite3.DatabaseError as err:
            conn.close()
            raise _not_ours(path, str(err)) from None
    raise CacheError(f"cannot open cache file {path} read-only: {last}")


def _check_header(path: pathlib.Path) -> None:
    """Refuse a non-empty file that does not start with the SQLite header, without touching it.

    Where another connection of this process has the file open, its header is read through that
    connection's descriptor (:func:`.wal.read_start`): closing one of our own would drop that
    connection's locks."""
    try:
        head = read_start(path, len(_SQLITE_HEADER), held_only=False)
    except FileNotFoundError:
        return
    except IsADirectoryError:
        raise CacheError(f"cache file {path} is a directory") from None
    except OSError as err:
        raise CacheError(f"cannot read cache file {path}: {err.strerror or err}") from None
    if head and head != _SQLITE_HEADER:
        raise _not_ours(path, "file is not a database")


def _in_snapshot(conn: sqlite3.Connection, read: Callable[[sqlite3.Connection], _T]) -> _T:
    """Run ``read`` in one read transaction, so all its statements see one state of the file.

    In autocommit mode each statement is its own transaction: the application id and the
    table list were read from two states, and a process reading while another created the
    schema saw the tables of one and the id (0) of the other.
    """
    conn.execute("BEGIN")  # deferred: takes no write lock, writes nothing
    try:
        return read(conn)
    finally:
        if conn.in_transaction:
            conn.execute("ROLLBACK")


def _inspect(path: pathlib.Path, conn: sqlite3.Connection) -> str:
    """``"new"`` for an empty database, ``"ours"`` for a valid cache; CacheError otherwise.

    Call it inside a transaction (its reads must see one state of the file).
    """
    app_id = conn.execute("PRAGMA application_id").fetchone()[0]
    tables = {r[0] for r in conn.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}
    if not tables and app_id in (0, APPLICATION_ID):
        return "new"
    if app_id != APPLICATION_ID:
        listed = ", ".join(sorted(tables)) or "none"
        raise _not_ours(path, f"SQLite application_id is {app_id:#x}, expected {APPLICATION_ID:#x} (tables: {listed})")
    if "meta" not in tables or "configs" not in tables:
        raise _not_ours(path, f"missing tables (found: {', '.join(sorted(tables))})")
    meta = dict(conn.execute("SELECT key, value FROM meta").fetchall())
    if meta.get("application") != APPLICATION_MARKER:
        raise _not_ours(path, f"meta application is {meta.get('application')!r}, expected {APPLICATION_MARKER!r}")
    try:
        version = int(meta["schema_version"])
    except (KeyError, ValueError):
        raise _not_ours(path, f"bad schema_version {meta.get('schema_version')!r}") from None
    if version > SCHEMA_VERSION:
        raise CacheError(
            f"{path} has cache schema version {version}, but this ejlabel reads up to "
            f"version {SCHEMA_VERSION}; upgrade ejlabel to use it"
        )
    return "ours"


def _create(path: pathlib.Path, conn: sqlite3.Connection) -> None:
    """Check and create the schema in one ``BEGIN IMMEDIATE`` transaction.

    Another process may be creating it too: under the write lock the file is inspected
    again and the schema created only if it is still new, all in the same transaction.
    """
    _ensure_wal(conn)
    conn.execute("BEGIN IMMEDIATE")
    try:
        if _inspect(path, conn) == "new":
            # One statement at a time: executescript() would commit the open transaction.
            for statement in filter(str.strip, _SCHEMA.split(";")):
                conn.execute(statement)
            conn.execute("INSERT OR REPLACE INTO meta VALUES ('application', ?)", (APPLICATION_MARKER,))
            conn.execute("INSERT OR REPLACE INTO meta VALUES ('schema_version', ?)", (str(SCHEMA_VERSION),))
            conn.execute(f"PRAGMA application_id = {APPLICATION_ID}")
            conn.execute(f"PRAGMA user_version = {SCHEMA_VERSION}")
        conn.execute("COMMIT")
    except BaseException:
        if conn.in_transaction:
            conn.execute("ROLLBACK")
        raise
