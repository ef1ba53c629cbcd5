"""Persistent config cache: tuned kernel configs in one SQLite file, shared by every process.

Autotuning is expensive, so its results outlive the process that found them. Each row is keyed by
``(device, op_id, call_key)``:

* ``device``: the device fingerprint, so a config tuned on one accelerator is never used on another;
* ``op_id``: kernel name and version (``"matmul@v2"``), so a new kernel version never sees the
  configs of an old one;
* ``call_key``: 16 lowercase hex digits naming the call (shapes, dtypes, ...).

Configs are stored as tagged JSON (:mod:`ejlabel.serialize`) together with the import path of
their type, never pickled: opening a cache file must not be able to run code. The file is
checked before anything is written to it, so pointing the cache at the wrong file fails with a
:class:`CacheError` and leaves that file byte-for-byte unchanged.

Many processes may read and write the same file at once (parallel tuning jobs, test workers):
the database runs in WAL mode with a busy timeout, and each :meth:`PersistentCache.put` is one
short transaction.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import pathlib
import re
import sqlite3
import tempfile
import threading
import time
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import jax
import jaxlib

from ejlabel.utils.serialize import from_json, from_jsonable, import_path, to_json

__all__ = ["CacheError", "CacheEntry", "PersistentCache", "normalize_key", "split_key", "default_cache_path", "open_default_persistent"]

logger = logging.getLogger(__name__)

SCHEMA_VERSION = 1
APPLICATION_MARKER = "ejlabel-config-cache"
# "EJLB" in ASCII: lets `file`-style tools and our own open() tell the file apart from others.
APPLICATION_ID = 0x454A4C42
EXPORT_FORMAT = "ejlabel-configs"
EXPORT_VERSION = 1
DEFAULT_FILENAME = "configs.sqlite"
FILE_SUFFIXES = (".sqlite", ".db")
BUSY_TIMEOUT_S = 30.0

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
    """One stored config with where it came from and what it was measured at."""

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


def _dumps(data: Any) -> str:
    return json.dumps(data, sort_keys=True, separators=(",", ":"), allow_nan=False)


class PersistentCache:
    """Tuned configs keyed by ``(device, op_id, call_key)`` in one SQLite file.

    Safe to share between threads (one connection guarded by a lock) and between processes
    (SQLite locking; WAL lets readers run while one writer commits).
    """

    def __init__(self, path: str | os.PathLike[str] | None = None) -> None:
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
            if self._inspect(conn) == "new":
                self._create(conn)
            conn.execute(f"PRAGMA busy_timeout = {int(BUSY_TIMEOUT_S * 1000)}")
            if conn.execute("PRAGMA journal_mode").fetchone()[0].lower() != "wal":
                conn.execute("PRAGMA journal_mode = WAL")
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

    def _inspect(self, conn: sqlite3.Connection) -> str:
        """``"new"`` for an empty database, ``"ours"`` for a valid cache; CacheError otherwise."""
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
        """Create the schema; another process may be doing the same, so re-check under the write lock."""
        conn.execute("PRAGMA journal_mode = WAL")
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

    def _row_to_entry(self, row: tuple[Any, ...]) -> CacheEntry | None:
        """Decode a row; None (with one warning per config type) when the config no longer decodes."""
        fields = dict(zip(_COLUMNS, row))
        try:
            config = from_json(fields["config_json"])
        except (ValueError, TypeError, KeyError, AttributeError, ImportError) as err:
            self._warn_once(
                fields["config_type"],
                f"{self.path}: skipping cached config of type {fields['config_type']} "
                f"({fields['device']}, {fields['op_id']}, {fields['call_key']}): cannot decode it: {err}",
            )
            return None
        stats: Any = None
        if fields["stats_json"] is not None:
            data = json.loads(fields["stats_json"])
            try:
                stats = from_jsonable(data)
            except (ValueError, TypeError, KeyError, AttributeError, ImportError):
                # Statistics are informational: keep them readable (still tagged) rather than drop them.
                stats = data
        return CacheEntry(
            device=fields["device"], op_id=fields["op_id"], call_key=fields["call_key"], config=config,
            config_type=fields["config_type"], provenance=fields["provenance"], stats=stats,
            kernel_version=fields["kernel_version"], jax_version=fields["jax_version"],
            jaxlib_version=fields["jaxlib_version"], created=fields["created"],
        )

    def get_entry(self, dev: Any, op_id: str | None = None, call_key: str | None = None) -> CacheEntry | None:
        """The stored entry for the key, or None when absent or its config no longer decodes."""
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

    def entries(self, *, device: str | None = None, op_id: str | None = None) -> list[CacheEntry]:
        """All decodable entries, optionally of one device and/or op_id, in key order."""
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
        return [e for e in map(self._row_to_entry, rows) if e is not None]

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
        raises TypeError and writes nothing.
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
        """Write every row (decodable or not) to a JSON document at ``path``; returns the count.

        The file is written to a temporary name and renamed, so readers never see half a document.
        """
        with self._db() as conn:
            rows = conn.execute(_SELECT + " ORDER BY device, op_id, call_key").fetchall()
        entries = []
        for row in rows:
            fields = dict(zip(_COLUMNS, row))
            entry = {k: fields[k] for k in _COLUMNS if k not in ("config_json", "stats_json")}
            # Embedded (still tagged) rather than as a string, so the document stays readable.
            entry["config"] = json.loads(fields["config_json"])
            entry["stats"] = None if fields["stats_json"] is None else json.loads(fields["stats_json"])
            entries.append(entry)
        doc = {"format": EXPORT_FORMAT, "version": EXPORT_VERSION, "entries": entries}
        target = pathlib.Path(os.fspath(path))
        fd, tmp = tempfile.mkstemp(prefix=target.name + ".", suffix=".tmp", dir=target.parent)
        try:
            with os.fdopen(fd, "w", encoding="utf-8") as f:
                json.dump(doc, f, indent=1, sort_keys=True, allow_nan=False)
                f.write("\n")
            os.replace(tmp, target)
        except BaseException:
            if os.path.exists(tmp):
                os.unlink(tmp)
            raise
        return len(entries)

    def import_(self, path: str | os.PathLike[str], *, overwrite: bool = False, provenance: str | None = None) -> int:
        """Load a document written by :meth:`export`, all or nothing; returns the rows written.

        Without ``overwrite`` existing keys are kept and only new rows count. Entries keep the
        provenance they were exported with unless ``provenance`` (e.g. ``"imported"``) is given.
        The whole document is validated before anything is written.
        """
        rows = _read_export(pathlib.Path(os.fspath(path)), provenance)
        sql = _UPSERT if overwrite else _INSERT_NEW
        count = 0
        with self._transaction() as conn:
            for row in rows:
                count += conn.execute(sql, row).rowcount
        return count


def _read_export(path: pathlib.Path, provenance: str | None) -> list[tuple[Any, ...]]:
    """Parse and validate an export document into database rows; CacheError naming the file if bad."""
    def bad(what: str) -> CacheError:
        return CacheError(f"{path} is not an ejlabel config export: {what}")

    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as err:
        raise CacheError(f"cannot read {path}: {err}") from None
    try:
        doc = json.loads(text)
    except json.JSONDecodeError as err:
        raise bad(f"not valid JSON ({err})") from None
    if not isinstance(doc, dict) or doc.get("format") != EXPORT_FORMAT:
        found = doc.get("format") if isinstance(doc, dict) else type(doc).__name__
        raise bad(f"format is {found!r}, expected {EXPORT_FORMAT!r}")
    version = doc.get("version")
    if not isinstance(version, int) or isinstance(version, bool):
        raise bad(f"version is {version!r}, expected an integer")
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
        for k in text_fields:
            if not isinstance(e[k], str) or not e[k]:
                raise bad(f"entries[{i}].{k} is {e[k]!r}, expected a non-empty string")
        if e["config"] is None:
            raise bad(f"entries[{i}].config is null")
        stats = e.get("stats")
        if stats is not None and not isinstance(stats, dict):
            raise bad(f"entries[{i}].stats is not an object")
        created = e["created"]
        if not isinstance(created, (int, float)) or isinstance(created, bool):
            raise bad(f"entries[{i}].created is {created!r}, expected a number")
        try:
            config_json, stats_json = _dumps(e["config"]), None if stats is None else _dumps(stats)
        except ValueError as err:
            raise bad(f"entries[{i}]: {err}") from None
        rows.append((*key, config_json, e["config_type"], provenance or e["provenance"], stats_json,
                     e["kernel_version"], e["jax_version"], e["jaxlib_version"], float(created)))
    return rows


def open_default_persistent() -> PersistentCache | None:
    """The user's persistent cache (:func:`default_cache_path`), or None with a warning if it
    cannot be opened: a broken cache must not stop a model from running."""
    try:
        return PersistentCache()
    except CacheError as err:
        warnings.warn(f"running without a persistent config cache: {err}", stacklevel=3)
        return None
