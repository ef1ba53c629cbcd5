"""Persistent config cache: tuned kernel configs in one SQLite file, shared by every process.

Autotuning is expensive, so its results outlive the process that found them. Each row is keyed by
``(device, op_id, call_key)``:

* ``device``: the device fingerprint, so a config tuned on one accelerator is never used on another;
* ``op_id``: kernel name and version (``"matmul@v2"``), so a new kernel version never sees the
  configs of an old one;
* ``call_key``: 16 lowercase hex digits naming the call (shapes, dtypes, ...).

Configs are stored as tagged JSON (:mod:`ejlabel.utils.serialize`) together with the name of
their type, never pickled: opening a cache file must not be able to run code. Decoding a config
never imports anything; the names in it resolve through the registry of kernels and config types
(:mod:`ejlabel.core.registry`), and :meth:`PersistentCache.put` refuses a config that would not
read back. The file is checked before anything is written to it, so pointing the cache at the
wrong file fails with a :class:`CacheError` and leaves that file byte-for-byte unchanged.

Many processes may read and write the same file at once (parallel tuning jobs, test workers):
the database runs in WAL mode with a busy timeout, and each :meth:`PersistentCache.put` is one
short transaction. Opening reads the file's identity in one transaction (one snapshot), and a
new file's identity check and schema creation are one ``BEGIN IMMEDIATE`` transaction, so
processes opening a fresh cache together never see each other's half-made schema.

The cache file and export files are data from elsewhere, so one bad entry never breaks the
cache: an entry whose config does not decode (a type not registered here, nesting deeper than
:data:`~ejlabel.utils.serialize.MAX_DEPTH`, malformed JSON) is skipped with one warning by
:meth:`~PersistentCache.get` and :meth:`~PersistentCache.entries`, and listed with status
``"undecodable"`` by ``entries(include_undecodable=True)``. Import reads at most
:data:`MAX_IMPORT_BYTES` from a regular file only and rejects non-finite numbers and deep
nesting, naming the entry; export replaces its (symlink-resolved) target atomically.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import os
import pathlib
import random
import re
import sqlite3
import stat
import tempfile
import threading
import time
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, TypeVar

import jax
import jaxlib

from ejlabel.core.registry import register_config_type
from ejlabel.utils.files import FileTooLargeError, SpecialFileError, file_kind, read_regular_file
from ejlabel.utils.serialize import (
    MAX_DEPTH,
    DecodeError,
    check_json,
    from_json,
    from_jsonable,
    import_path,
    loads_strict,
    to_json,
)

__all__ = ["CacheError", "CacheEntry", "PersistentCache", "normalize_key", "split_key", "default_cache_path", "open_default_persistent"]

logger = logging.getLogger(__name__)
_T = TypeVar("_T")

SCHEMA_VERSION = 1
APPLICATION_MARKER = "ejlabel-config-cache"
# "EJLB" in ASCII: lets `file`-style tools and our own open() tell the file apart from others.
APPLICATION_ID = 0x454A4C42
EXPORT_FORMAT = "ejlabel-configs"
EXPORT_VERSION = 1
DEFAULT_FILENAME = "configs.sqlite"
FILE_SUFFIXES = (".sqlite", ".db")
BUSY_TIMEOUT_S = 30.0
#: Largest export document :meth:`PersistentCache.import_` reads (64 MiB, about 100,000 entries):
#: the file is read in chunks and refused as soon as it grows past this, so a huge or endless
#: file (``/dev/zero``, a file still being written) cannot exhaust memory.
MAX_IMPORT_BYTES = 64 * 1024 * 1024
STATUS_OK = "ok"
STATUS_UNDECODABLE = "undecodable"

_SQLITE_HEADER = b"SQLite format 3\x00"
_CALL_KEY_RE = re.compile(r"[0-9a-f]{16}")
_COLUMNS = (
    "device", "op_id", "call_key", "config_json", "config_type", "provenance", "stats_json",
    "kernel_version", "jax_version", "jaxlib_version", "created",
)
_SELECT = f"SELECT {', '.join(_COLUMNS)} FROM configs"
_UPSERT = f"INSERT OR REPLACE INTO configs ({', '.join(_COLUMNS)}) VALUES ({', '.join('?' * len(_COLUMNS))})"
_INSERT_NEW = _UPSERT.replace("INSERT OR REPLACE", "INSERT OR IGNORE")
_KEY_WHERE = "WHERE device = ? AND op_id = ? AND call_key = ?"
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


class CacheError(Exception):
    """The cache file cannot be used: not ours, corrupt, too new, or not reachable."""


@dataclasses.dataclass(frozen=True)
class CacheEntry:
    """One stored config with where it came from and what it was measured at.

    ``status`` is ``"ok"``, or ``"undecodable"`` when the stored config cannot be decoded here
    (then ``config`` is None and ``error`` says why); only
    ``PersistentCache.entries(include_undecodable=True)`` returns undecodable entries.
    """

    device: str
    op_id: str
    call_key: str
    config: Any
    config_type: str
    provenance: str
    stats: dict | None
    kernel_version: str
    jax_version: str
    jaxlib_version: str
    created: float
    status: str = STATUS_OK
    error: str | None = None


def normalize_key(dev: Any, op_id: Any = None, call_key: Any = None) -> tuple[str, str, str]:
    """Accept ``(dev, op_id, call_key)`` or one ``(dev, op_id, call_key)`` tuple; check and return it.

    Raises TypeError when the arguments have neither form and ValueError naming the field when
    a part is malformed, so a bad key fails where it is built instead of silently missing.
    """
    if op_id is None and call_key is None:
        if not isinstance(dev, (tuple, list)) or len(dev) != 3:
            raise TypeError(
                f"dev: expected a (device, op_id, call_key) tuple or three arguments, got {dev!r}"
            )
        dev, op_id, call_key = dev
    elif op_id is None or call_key is None:
        missing = "op_id" if op_id is None else "call_key"
        raise TypeError(f"{missing}: missing; pass (dev, op_id, call_key) or one 3-tuple")
    if not isinstance(dev, str) or not dev:
        raise ValueError(f"device: expected a non-empty string, got {dev!r}")
    if not isinstance(op_id, str) or not op_id:
        raise ValueError(f"op_id: expected a non-empty string such as 'matmul@v1', got {op_id!r}")
    if not isinstance(call_key, str) or not _CALL_KEY_RE.fullmatch(call_key):
        raise ValueError(f"call_key: expected 16 lowercase hex digits, got {call_key!r}")
    return dev, op_id, call_key


split_key = normalize_key


def kernel_version_of(op_id: str) -> str:
    """The version part of ``"name@v<version>"``; ValueError when ``op_id`` has none."""
    name, sep, version = op_id.rpartition("@v")  # not split_op_id: a missing version is an error here
    if not sep or not name or not version:
        raise ValueError(f"op_id: {op_id!r} has no '@v<version>' suffix; pass kernel_version explicitly")
    return version


def default_cache_path() -> pathlib.Path:
    """``$EJLABEL_CACHE_DIR``, else ``($XDG_CACHE_HOME or ~/.cache)/ejlabel``."""
    env = os.environ.get("EJLABEL_CACHE_DIR")
    if env:
        return pathlib.Path(env).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return pathlib.Path(base) / "ejlabel"


def _resolve_file(path: str | os.PathLike[str] | None) -> pathlib.Path:
    """Map a directory (or None) to the database file inside it; a ``.sqlite``/``.db`` path is the file."""
    p = default_cache_path() if path is None else pathlib.Path(os.fspath(path)).expanduser()
    if p.suffix.lower() in FILE_SUFFIXES and not p.is_dir():
        return p.absolute()
    return (p / DEFAULT_FILENAME).absolute()


def _is_op_name(value: Any) -> bool:
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


def _dumps(data: Any) -> str:
    return json.dumps(data, sort_keys=True, separators=(",", ":"), allow_nan=False)


class PersistentCache:
    """Tuned configs keyed by ``(device, op_id, call_key)`` in one SQLite file.

    Safe to share between threads (one connection guarded by a lock) and between processes
    (SQLite locking; WAL lets readers run while one writer commits).

    ``PersistentCache(path)``: a directory (the file inside it is created) or a ``.sqlite`` /
    ``.db`` file; None is the default cache (``$EJLABEL_CACHE_DIR`` or the user cache dir).
    ejkernel's form ``PersistentCache(opname, path=None, cfg_type=None)`` keeps ejkernel's
    meaning for the op name: a first argument that is a bare name (no path separator, no
    ``~``, no file suffix, not an existing directory) names an op, not a folder, and selects
    the default cache (ejlabel keeps every op in one database, keyed by op id); write
    ``./name`` for a folder in the current directory. ``cfg_type`` registers the config type
    (``register_config_type``), which is how ejlabel decodes entries. ejkernel's ``loader`` and
    ``dumper`` are refused: entries are typed JSON, decoded through the registry, never by
    user code.
    """

    def __init__(
        self,
        location: str | os.PathLike[str] | None = None,
        /,
        path: str | os.PathLike[str] | None = None,
        *,
        loader: Callable[[Any], Any] | None = None,
        dumper: Callable[[Any], Any] | None = None,
        cfg_type: type | None = None,
    ) -> None:
        if loader is not None or dumper is not None:
            raise TypeError(
                "loader/dumper: ejlabel stores configs as typed JSON and decodes them through its registry; "
                "pass cfg_type= (or call ejlabel.register_config_type) instead"
            )
        self.opname: str | None = None
        if location is not None and _is_op_name(location):
            self.opname = str(location)
        elif location is not None:
            if path is not None:
                raise TypeError(
                    f"PersistentCache({location!r}, path={path!r}): two locations; ejkernel's form is "
                    "PersistentCache(opname, path) with a bare op name first"
                )
            path = location
        if cfg_type is not None:
            register_config_type(cfg_type)
        self.path: pathlib.Path = _resolve_file(path)
        self._lock = threading.RLock()
        self._conn: sqlite3.Connection | None = None
        self._pid = os.getpid()
        self._closed = False
        # Connections inherited across fork are never used or closed in the child: closing
        # them there could release the parent's locks.
        self._inherited: list[sqlite3.Connection] = []
        self._warned: set[str] = set()
        with self._lock:
            self._conn = self._open()

    # ------------------------------------------------------------------ opening

    def _fail(self, what: str) -> CacheError:
        return CacheError(f"{self.path} is not an ejlabel cache: {what}")

    def _open(self) -> sqlite3.Connection:
        """Connect, check that the file is ours (or new), and create the schema if new."""
        path = self.path
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
        except OSError as err:
            raise CacheError(f"cannot create cache directory {path.parent}: {err.strerror or err}") from None
        if not path.parent.is_dir():
            raise CacheError(f"cannot use cache directory {path.parent}: not a directory")
        if not os.access(path.parent, os.W_OK | os.X_OK):
            # WAL needs to create side files next to the database, even just to read it.
            raise CacheError(f"cannot use cache directory {path.parent}: permission denied (not writable)")
        self._check_header()
        try:
            conn = sqlite3.connect(path, timeout=BUSY_TIMEOUT_S, isolation_level=None, check_same_thread=False)
        except sqlite3.Error as err:
            raise CacheError(f"cannot open cache file {path}: {err}") from None
        try:
            # Read-only checks first: nothing is written until the file is known to be ours.
            if self._in_snapshot(conn, self._inspect) == "new":
                self._create(conn)
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
            raise self._fail(str(err)) from None
        return conn

    def _check_header(self) -> None:
        """Refuse a non-empty file that does not start with the SQLite header, without touching it."""
        try:
            with open(self.path, "rb") as f:
                head = f.read(len(_SQLITE_HEADER))
        except FileNotFoundError:
            return
        except IsADirectoryError:
            raise CacheError(f"cache file {self.path} is a directory") from None
        except OSError as err:
            raise CacheError(f"cannot read cache file {self.path}: {err.strerror or err}") from None
        if head and head != _SQLITE_HEADER:
            raise self._fail("file is not a database")

    @staticmethod
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

    def _inspect(self, conn: sqlite3.Connection) -> str:
        """``"new"`` for an empty database, ``"ours"`` for a valid cache; CacheError otherwise.

        Call it inside a transaction (its reads must see one state of the file).
        """
        app_id = conn.execute("PRAGMA application_id").fetchone()[0]
        tables = {r[0] for r in conn.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}
        if not tables and app_id in (0, APPLICATION_ID):
            return "new"
        if app_id != APPLICATION_ID:
            listed = ", ".join(sorted(tables)) or "none"
            raise self._fail(f"SQLite application_id is {app_id:#x}, expected {APPLICATION_ID:#x} (tables: {listed})")
        if "meta" not in tables or "configs" not in tables:
            raise self._fail(f"missing tables (found: {', '.join(sorted(tables))})")
        meta = dict(conn.execute("SELECT key, value FROM meta").fetchall())
        if meta.get("application") != APPLICATION_MARKER:
            raise self._fail(f"meta application is {meta.get('application')!r}, expected {APPLICATION_MARKER!r}")
        try:
            version = int(meta["schema_version"])
        except (KeyError, ValueError):
            raise self._fail(f"bad schema_version {meta.get('schema_version')!r}") from None
        if version > SCHEMA_VERSION:
            raise CacheError(
                f"{self.path} has cache schema version {version}, but this ejlabel reads up to "
                f"version {SCHEMA_VERSION}; upgrade ejlabel to use it"
            )
        return "ours"

    def _create(self, conn: sqlite3.Connection) -> None:
        """Check and create the schema in one ``BEGIN IMMEDIATE`` transaction.

        Another process may be creating it too: under the write lock the file is inspected
        again and the schema created only if it is still new, all in the same transaction.
        """
        _ensure_wal(conn)
        conn.execute("BEGIN IMMEDIATE")
        try:
            if self._inspect(conn) == "new":
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

    # ------------------------------------------------------------------ connection plumbing

    @contextmanager
    def _db(self) -> Iterator[sqlite3.Connection]:
        """The connection for this process, under the lock; reopened after a fork."""
        with self._lock:
            if self._closed:
                raise CacheError(f"cache {self.path} is closed")
            if self._pid != os.getpid() or self._conn is None:
                if self._conn is not None:
                    self._inherited.append(self._conn)
                self._conn = self._open()
                self._pid = os.getpid()
            try:
                yield self._conn
            except sqlite3.DatabaseError as err:
                if isinstance(err, sqlite3.IntegrityError):
                    raise
                raise CacheError(f"cache file {self.path}: {err}") from err

    @contextmanager
    def _transaction(self) -> Iterator[sqlite3.Connection]:
        """One write transaction: all statements inside commit together or not at all."""
        with self._db() as conn:
            # IMMEDIATE takes the write lock up front, so a busy writer is waited for
            # (busy timeout) instead of failing later on a read-to-write upgrade.
            conn.execute("BEGIN IMMEDIATE")
            try:
                yield conn
            except BaseException:
                if conn.in_transaction:
                    conn.execute("ROLLBACK")
                raise
            conn.execute("COMMIT")

    def close(self) -> None:
        """Close the connection; further use raises CacheError."""
        with self._lock:
            if self._conn is not None and self._pid == os.getpid():
                self._conn.close()
            self._conn = None
            self._closed = True

    def __enter__(self) -> PersistentCache:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"PersistentCache({str(self.path)!r})"

    # ------------------------------------------------------------------ reading

    def _warn_once(self, tag: str, message: str) -> None:
        if tag in self._warned:
            return
        self._warned.add(tag)
        logger.warning(message)
        warnings.warn(message, RuntimeWarning, stacklevel=3)

    def _row_to_entry(self, row: tuple[Any, ...], *, keep_undecodable: bool = False) -> CacheEntry | None:
        """Decode a row; an undecodable config gives one warning per config type and None, or an
        entry with status ``"undecodable"`` with ``keep_undecodable``.

        The row is data: whatever it holds (a type not registered here, nesting past the depth
        cap, text that is not JSON), decoding it must not raise, or one entry would break every
        listing and lookup.
        """
        fields = dict(zip(_COLUMNS, row))
        error = None
        config: Any = None
        try:
            config = from_json(fields["config_json"])
        except Exception as err:  # noqa: BLE001 - any failure to decode data is "undecodable"
            error = f"{type(err).__name__}: {err}" if not isinstance(err, DecodeError) else str(err)
            self._warn_once(
                str(fields["config_type"]),
                f"{self.path}: skipping cached config of type {fields['config_type']} "
                f"({fields['device']}, {fields['op_id']}, {fields['call_key']}): cannot decode it: {error}",
            )
            if not keep_undecodable:
                return None
        stats: Any = None
        if fields["stats_json"] is not None:
            try:
                data = loads_strict(fields["stats_json"])
            except DecodeError:
                data = None  # statistics are informational: unreadable ones are left out
            try:
                stats = from_jsonable(data)
            except Exception:  # noqa: BLE001
                # Keep them readable (still tagged) rather than drop them, if they are plain JSON.
                try:
                    check_json(data)
                    stats = data
                except DecodeError:
                    stats = None
        return CacheEntry(
            device=fields["device"], op_id=fields["op_id"], call_key=fields["call_key"], config=config,
            config_type=fields["config_type"], provenance=fields["provenance"], stats=stats,
            kernel_version=fields["kernel_version"], jax_version=fields["jax_version"],
            jaxlib_version=fields["jaxlib_version"], created=fields["created"],
            status=STATUS_OK if error is None else STATUS_UNDECODABLE, error=error,
        )

    def get_entry(self, dev: Any, op_id: str | None = None, call_key: str | None = None) -> CacheEntry | None:
        """The stored entry for the key, or None when absent or its config does not decode here."""
        key = normalize_key(dev, op_id, call_key)
        with self._db() as conn:
            row = conn.execute(f"{_SELECT} {_KEY_WHERE}", key).fetchone()
        return None if row is None else self._row_to_entry(row)

    def get(self, dev: Any, op_id: str | None = None, call_key: str | None = None) -> Any | None:
        """The stored config for the key, or None."""
        entry = self.get_entry(dev, op_id, call_key)
        return None if entry is None else entry.config

    def __contains__(self, key: tuple[str, str, str]) -> bool:
        """True when :meth:`get` would return a config for ``key``."""
        return self.get_entry(key) is not None

    def entries(
        self, *, device: str | None = None, op_id: str | None = None, include_undecodable: bool = False
    ) -> list[CacheEntry]:
        """Entries, optionally of one device and/or op_id, in key order.

        Only those whose config decodes here, unless ``include_undecodable``: then every row is
        listed, the undecodable ones with status ``"undecodable"``, ``config`` None and the
        reason in ``error`` (what ``ejlabel cache ls`` shows).
        """
        where, params = [], []
        if device is not None:
            where.append("device = ?")
            params.append(device)
        if op_id is not None:
            where.append("op_id = ?")
            params.append(op_id)
        sql = _SELECT
        if where:
            sql += " WHERE " + " AND ".join(where)
        with self._db() as conn:
            rows = conn.execute(sql + " ORDER BY device, op_id, call_key", params).fetchall()
        decoded = (self._row_to_entry(row, keep_undecodable=include_undecodable) for row in rows)
        return [e for e in decoded if e is not None]

    def stats(self) -> dict[str, Any]:
        """Counts by op_id and device, file size (database plus WAL), path and schema version."""
        with self._db() as conn:
            total = conn.execute("SELECT COUNT(*) FROM configs").fetchone()[0]
            by_op = dict(conn.execute("SELECT op_id, COUNT(*) FROM configs GROUP BY op_id ORDER BY op_id"))
            by_dev = dict(conn.execute("SELECT device, COUNT(*) FROM configs GROUP BY device ORDER BY device"))
            version = int(conn.execute("SELECT value FROM meta WHERE key = 'schema_version'").fetchone()[0])
        size = 0
        for p in (self.path, self.path.with_name(self.path.name + "-wal")):
            try:
                size += p.stat().st_size
            except FileNotFoundError:
                pass
        return {
            "entries": total, "by_op_id": by_op, "by_device": by_dev, "file_size": size,
            "path": str(self.path), "schema_version": version,
        }

    # ------------------------------------------------------------------ writing

    def put(
        self,
        dev: Any,
        op_id_or_cfg: Any,
        call_key: str | None = None,
        cfg: Any = None,
        *,
        provenance: str = "autotuned",
        stats: dict | None = None,
        kernel_version: str | None = None,
    ) -> None:
        """Store ``cfg`` under the key (replacing any previous one) in one transaction.

        Both ``put(dev, op_id, call_key, cfg)`` and ``put((dev, op_id, call_key), cfg)`` work.
        Everything is encoded before the transaction starts, so a config that cannot be encoded
        raises TypeError and writes nothing; one whose type (or a type nested in it) is not
        registered raises :class:`~ejlabel.utils.serialize.UnregisteredTypeError` (a ValueError)
        and writes nothing, since no process could read it back.
        """
        if call_key is None and cfg is None:
            key, cfg = normalize_key(dev), op_id_or_cfg
        else:
            key = normalize_key(dev, op_id_or_cfg, call_key)
        if cfg is None:
            raise TypeError("cfg: missing; a config of None cannot be cached")
        if not isinstance(provenance, str) or not provenance:
            raise ValueError(f"provenance: expected a non-empty string, got {provenance!r}")
        if stats is not None and not isinstance(stats, dict):
            raise TypeError(f"stats: expected a dict or None, got {type(stats).__name__}")
        if kernel_version is None:
            kernel_version = kernel_version_of(key[1])
        elif not isinstance(kernel_version, str) or not kernel_version:
            raise ValueError(f"kernel_version: expected a non-empty string, got {kernel_version!r}")
        config_json = to_json(cfg)
        config_type = import_path(type(cfg))
        # What cannot be read back must not be stored: a type that is not registered (decoding
        # never imports) would come back as an undecodable entry, in this process and others.
        from_json(config_json)
        stats_json = None if stats is None else to_json(stats)
        row = (*key, config_json, config_type, provenance, stats_json, kernel_version,
               jax.__version__, jaxlib.__version__, time.time())
        with self._transaction() as conn:
            conn.execute(_UPSERT, row)

    def delete(self, dev: Any, op_id: str | None = None, call_key: str | None = None) -> bool:
        """Remove the key; True when a row was removed."""
        key = normalize_key(dev, op_id, call_key)
        with self._transaction() as conn:
            cur = conn.execute(f"DELETE FROM configs {_KEY_WHERE}", key)
        return cur.rowcount > 0

    def clear(self) -> int:
        """Remove every config (undecodable ones too); returns how many rows were removed."""
        with self._transaction() as conn:
            cur = conn.execute("DELETE FROM configs")
        return cur.rowcount

    # ------------------------------------------------------------------ export / import

    def export(self, path: str | os.PathLike[str]) -> int:
        """Write every row (decodable here or not) to a JSON document at ``path``; returns the count.

        The target is resolved through symlinks, and the document written to a temporary file
        next to the real target, flushed to disk and renamed over it: readers never see half a
        document, a symlink keeps pointing at the (new) file, and a crash leaves the old file.
        An existing target that is not a regular file (a device, a FIFO, a directory) is refused.
        A new file gets the mode the umask gives; a replaced file keeps its mode. Rows too broken
        to embed (config not JSON, a non-finite time written by an older version) are skipped
        with a warning rather than failing the export.
        """
        with self._db() as conn:
            rows = conn.execute(_SELECT + " ORDER BY device, op_id, call_key").fetchall()
        entries = []
        for row in rows:
            fields = dict(zip(_COLUMNS, row))
            try:
                entries.append(_export_entry(fields))
            except (DecodeError, TypeError, ValueError) as err:
                key = (fields["device"], fields["op_id"], fields["call_key"])
                self._warn_once(f"export:{key}", f"{self.path}: not exporting entry {key}: {err}")
        doc = {"format": EXPORT_FORMAT, "version": EXPORT_VERSION, "entries": entries}
        text = json.dumps(doc, indent=1, sort_keys=True, allow_nan=False) + "\n"
        _write_atomic(pathlib.Path(os.fspath(path)), text.encode("utf-8"))
        return len(entries)

    def import_(self, path: str | os.PathLike[str], *, overwrite: bool = False, provenance: str | None = None) -> int:
        """Load a document written by :meth:`export`, all or nothing; returns the rows written.

        Without ``overwrite`` existing keys are kept and only new rows count. Entries keep the
        provenance they were exported with unless ``provenance`` (e.g. ``"imported"``) is given.
        The whole document is validated before anything is written; a bad document raises
        :class:`CacheError` naming the file and the entry, and leaves the cache unchanged. Only
        regular files of at most :data:`MAX_IMPORT_BYTES` are read. Configs are stored as they
        are (still tagged): one whose type is not registered here is kept, and listed as
        undecodable until a process that knows the type reads it.
        """
        if provenance is not None and (not isinstance(provenance, str) or not provenance):
            raise ValueError(f"provenance: expected a non-empty string or None, got {provenance!r}")
        rows = _read_export(pathlib.Path(os.fspath(path)), provenance)
        sql = _UPSERT if overwrite else _INSERT_NEW
        count = 0
        try:
            with self._transaction() as conn:
                for row in rows:
                    count += conn.execute(sql, row).rowcount
        except sqlite3.IntegrityError as err:  # validated above; never let a raw one through
            raise CacheError(f"cannot import {path} into {self.path}: {err}") from None
        return count


def _export_entry(fields: dict[str, Any]) -> dict[str, Any]:
    """One row as an export entry; DecodeError/ValueError when the row cannot be embedded."""
    entry = {k: fields[k] for k in _COLUMNS if k not in ("config_json", "stats_json")}
    created = entry["created"]
    if not isinstance(created, (int, float)) or isinstance(created, bool) or not math.isfinite(created):
        raise ValueError(f"created is {created!r}, not a finite number")
    # Embedded (still tagged) rather than as a string, so the document stays readable.
    entry["config"] = loads_strict(fields["config_json"])
    check_json(entry["config"], where="config")
    try:
        stats = None if fields["stats_json"] is None else loads_strict(fields["stats_json"])
        check_json(stats, where="stats")
    except DecodeError:
        stats = None  # informational: an unreadable one does not stop the config from moving
    entry["stats"] = stats
    return entry


def _current_umask() -> int:
    """The process umask, read without changing it where the OS allows (Linux /proc)."""
    try:
        with open("/proc/self/status", encoding="ascii", errors="replace") as f:
            for line in f:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    mask = os.umask(0o022)  # elsewhere: read by setting; restored at once
    os.umask(mask)
    return mask


def _write_atomic(path: pathlib.Path, data: bytes) -> None:
    """Replace the file ``path`` resolves to with ``data``, atomically; CacheError if refused."""
    target = pathlib.Path(os.path.realpath(path))
    try:
        st: os.stat_result | None = os.stat(target)
    except FileNotFoundError:
        st = None
    except OSError as err:
        raise CacheError(f"cannot export to {path}: {err.strerror or err}") from None
    if st is not None and not stat.S_ISREG(st.st_mode):
        raise CacheError(f"cannot export to {path}: {file_kind(st.st_mode)} exists there, not a regular file")
    # A new file gets what open() would give it; a replaced one keeps its mode.
    mode = stat.S_IMODE(st.st_mode) if st is not None else 0o666 & ~_current_umask()
    try:
        fd, tmp = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".tmp", dir=target.parent)
    except OSError as err:
        raise CacheError(f"cannot export to {path}: {err.strerror or err}") from None
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fchmod(f.fileno(), mode)
            os.fsync(f.fileno())
        os.replace(tmp, target)
    except BaseException as err:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        if isinstance(err, OSError):
            raise CacheError(f"cannot export to {path}: {err.strerror or err}") from None
        raise
    try:  # make the rename itself durable
        dir_fd = os.open(target.parent, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(dir_fd)
    except OSError:
        pass
    finally:
        os.close(dir_fd)


def _read_limited(path: pathlib.Path) -> bytes:
    """The bytes of the regular file ``path``, at most MAX_IMPORT_BYTES; CacheError otherwise.

    Checked before opening (opening a FIFO blocks, opening some devices acts) and again on the
    open descriptor (the path may have been swapped in between); read in chunks so a file that
    grows while being read stops at the cap.
    """
    try:
        before = os.stat(path)
    except OSError as err:
        raise CacheError(f"cannot read {path}: {err.strerror or err}") from None
    if not stat.S_ISREG(before.st_mode):
        raise CacheError(f"cannot import {path}: it is {file_kind(before.st_mode)}, not a regular file")
    if before.st_size > MAX_IMPORT_BYTES:
        raise CacheError(f"cannot import {path}: {before.st_size} bytes is more than the {MAX_IMPORT_BYTES}-byte limit")
    try:
        return read_regular_file(path, MAX_IMPORT_BYTES)
    except SpecialFileError as err:
        raise CacheError(f"cannot import {path}: it is {err.kind}, not a regular file") from None
    except FileTooLargeError:
        raise CacheError(f"cannot import {path}: larger than the {MAX_IMPORT_BYTES}-byte limit") from None
    except OSError as err:
        raise CacheError(f"cannot read {path}: {err.strerror or err}") from None


def _check_text(value: Any, what: str, bad: Callable[[str], CacheError]) -> str:
    if not isinstance(value, str) or not value:
        raise bad(f"{what} is {value!r:.80}, expected a non-empty string")
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        raise bad(f"{what} is {value!r:.80}, not valid Unicode text") from None
    return value


def _read_export(path: pathlib.Path, provenance: str | None) -> list[tuple[Any, ...]]:
    """Parse and validate an export document into database rows; CacheError naming the file if bad."""
    def bad(what: str) -> CacheError:
        return CacheError(f"{path} is not an ejlabel config export: {what}")

    raw = _read_limited(path)
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as err:
        raise bad(f"not UTF-8 text ({err})") from None
    try:
        # Non-finite numbers are parsed here and rejected below, where the entry can be named.
        doc = json.loads(text)
    except RecursionError:
        raise bad(f"nested too deeply to parse (configs may nest at most {MAX_DEPTH} levels)") from None
    except ValueError as err:  # JSONDecodeError, and ints past Python's digit limit
        raise bad(f"not valid JSON ({err})") from None
    if not isinstance(doc, dict) or doc.get("format") != EXPORT_FORMAT:
        found = doc.get("format") if isinstance(doc, dict) else type(doc).__name__
        raise bad(f"format is {found!r:.80}, expected {EXPORT_FORMAT!r}")
    version = doc.get("version")
    if not isinstance(version, int) or isinstance(version, bool):
        raise bad(f"version is {version!r:.80}, expected an integer")
    if version > EXPORT_VERSION:
        raise CacheError(f"{path} is export version {version}; this ejlabel reads up to {EXPORT_VERSION}, upgrade it")
    entries = doc.get("entries")
    if not isinstance(entries, list):
        raise bad("'entries' is missing or not a list")
    text_fields = ("config_type", "provenance", "kernel_version", "jax_version", "jaxlib_version")
    rows = []
    for i, e in enumerate(entries):
        if not isinstance(e, dict):
            raise bad(f"entries[{i}] is not an object")
        missing = [k for k in ("device", "op_id", "call_key", "config", *text_fields, "created") if k not in e]
        if missing:
            raise bad(f"entries[{i}] lacks {', '.join(missing)}")
        try:
            key = normalize_key(e["device"], e["op_id"], e["call_key"])
        except (TypeError, ValueError) as err:
            raise bad(f"entries[{i}]: {err}") from None
        for k, v in zip(("device", "op_id"), key[:2]):
            _check_text(v, f"entries[{i}].{k}", bad)
        for k in text_fields:
            _check_text(e[k], f"entries[{i}].{k}", bad)
        # The op id's version is the kernel version lookups match on; an entry that says
        # otherwise (moved from another version by hand) would serve a config the kernel never ran.
        _, has_version, op_version = key[1].rpartition("@v")
        if has_version and e["kernel_version"] != op_version and not e["kernel_version"].startswith((op_version + ".", op_version + "+")):
            raise bad(f"entries[{i}].kernel_version is {e['kernel_version']!r:.40}, but op_id {key[1]} is version {op_version}")
        if e["config"] is None:
            raise bad(f"entries[{i}].config is null")
        stats = e.get("stats")
        if stats is not None and not isinstance(stats, dict):
            raise bad(f"entries[{i}].stats is not an object")
        created = e["created"]
        if not isinstance(created, (int, float)) or isinstance(created, bool):
            raise bad(f"entries[{i}].created is {created!r:.80}, expected a number")
        try:
            created = float(created)
        except OverflowError:
            created = math.inf
        if not math.isfinite(created):
            raise bad(f"entries[{i}].created is {e['created']!r:.80}, not a finite number")
        try:
            # The depth cap and finiteness apply to what is stored, so every later read and
            # export of the entry works; types are resolved only when a config is read.
            check_json(e["config"], where=f"entries[{i}].config")
            if stats is not None:
                check_json(stats, where=f"entries[{i}].stats")
            config_json, stats_json = _dumps(e["config"]), None if stats is None else _dumps(stats)
        except (DecodeError, ValueError) as err:
            raise bad(str(err) if isinstance(err, DecodeError) else f"entries[{i}]: {err}") from None
        rows.append((*key, config_json, e["config_type"], provenance or e["provenance"], stats_json,
                     e["kernel_version"], e["jax_version"], e["jaxlib_version"], created))
    return rows


def open_default_persistent() -> PersistentCache | None:
    """The user's persistent cache (:func:`default_cache_path`), or None with a warning if it
    cannot be opened: a broken cache must not stop a model from running."""
    try:
        return PersistentCache()
    except CacheError as err:
        warnings.warn(f"running without a persistent config cache: {err}", stacklevel=3)
        return None
