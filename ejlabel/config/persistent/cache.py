"""The persistent cache's API: :class:`PersistentCache`, tuned configs shared by every process.

Autotuning is expensive, so its results outlive the process that found them. Configs are stored
as tagged JSON (:mod:`ejlabel.utils.serialize`) together with the name of their type, never
pickled: opening a cache file must not be able to run code. Decoding a config never imports
anything; the names in it resolve through the registry of kernels and config types
(:mod:`ejlabel.core.registry`), and :meth:`PersistentCache.put` refuses a config that would not
read back.

One connection per process, guarded by a lock, reopened after a fork (a child never uses or
closes its parent's). Each :meth:`PersistentCache.put` is one short transaction; the file, its
schema and how it is opened safely by many processes at once are :mod:`.store`'s. A cache that
cannot be written (a read-only mount) opens read-only (``read_only`` is then True): every read
works, every write raises :class:`CacheError`. Damage found in the write-ahead log when the file
is opened (:mod:`.wal`) is a warning naming the file and what was lost.

The cache file and export files are data from elsewhere, so one bad entry never breaks the
cache: an entry whose config does not decode (a type not registered here, nesting deeper than
:data:`~ejlabel.utils.serialize.MAX_DEPTH`, malformed JSON) is skipped with one warning by
:meth:`~PersistentCache.get` and :meth:`~PersistentCache.entries`, and listed with status
``"undecodable"`` by ``entries(include_undecodable=True)``. Export and import go through
:mod:`.exchange`.
"""

from __future__ import annotations

import logging
import os
import pathlib
import sqlite3
import threading
import time
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import jax
import jaxlib

from ejlabel.config.persistent.entry import (
    STATUS_OK,
    STATUS_UNDECODABLE,
    CacheEntry,
    CacheError,
    kernel_version_of,
    normalize_key,
)
from ejlabel.config.persistent.exchange import export_entry, read_export, write_export
from ejlabel.config.persistent.store import (
    COLUMNS,
    INSERT_NEW,
    KEY_WHERE,
    SELECT,
    UPSERT,
    can_write,
    is_op_name,
    open_connection,
    resolve_file,
)
from ejlabel.core.label_format import check_op_id
from ejlabel.core.registry import note_config_for_op, register_config_type
from ejlabel.utils.sanitize import sanitize
from ejlabel.utils.serialize import DecodeError, check_json, from_json, from_jsonable, import_path, loads_strict, to_json

__all__ = ["PersistentCache", "open_default_persistent"]

logger = logging.getLogger(__name__)


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
        if location is not None and is_op_name(location):
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
        self.path: pathlib.Path = resolve_file(path)
        # A cache that exists but cannot be written (a read-only mount) is still read: listed,
        # shown, audited; only writing to it fails.
        self.read_only: bool = self.path.is_file() and not can_write(self.path)
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

    # ------------------------------------------------------------------ connection plumbing

    def _open(self) -> sqlite3.Connection:
        conn, damage = open_connection(self.path, read_only=self.read_only)
        if damage is not None:
            self._warn_once("wal", f"cache file {self.path}: {damage}")
        return conn

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
        if self.read_only:
            raise CacheError(f"cache file {self.path} is read-only (it or its folder cannot be written): nothing can be stored in it")
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
        message = sanitize(message)  # it quotes rows of the file: data, shown on a terminal
        logger.warning(message)
        warnings.warn(message, RuntimeWarning, stacklevel=3)

    def _row_to_entry(self, row: tuple[Any, ...], *, keep_undecodable: bool = False) -> CacheEntry | None:
        """Decode a row; an undecodable config gives one warning per config type and None, or an
        entry with status ``"undecodable"`` with ``keep_undecodable``.

        The row is data: whatever it holds (a type not registered here, nesting past the depth
        cap, text that is not JSON), decoding it must not raise, or one entry would break every
        listing and lookup.
        """
        fields = dict(zip(COLUMNS, row))
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
            row = conn.execute(f"{SELECT} {KEY_WHERE}", key).fetchone()
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
        sql = SELECT
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
        and writes nothing, since no process could read it back. A config for the op id of a
        kernel this process runs registers its type first (``note_config_for_op``).
        """
        if call_key is None and cfg is None:
            key, cfg = normalize_key(dev), op_id_or_cfg
        else:
            key = normalize_key(dev, op_id_or_cfg, call_key)
        if cfg is None:
            raise TypeError("cfg: missing; a config of None cannot be cached")
        check_op_id(key[1])
        if not isinstance(provenance, str) or not provenance:
            raise ValueError(f"provenance: expected a non-empty string, got {provenance!r}")
        if stats is not None and not isinstance(stats, dict):
            raise TypeError(f"stats: expected a dict or None, got {type(stats).__name__}")
        if kernel_version is None:
            kernel_version = kernel_version_of(key[1])
        elif not isinstance(kernel_version, str) or not kernel_version:
            raise ValueError(f"kernel_version: expected a non-empty string, got {kernel_version!r}")
        # A config of a kernel this process runs is code's, not data's: its type is registered
        # (a kernel whose class names no config type learns it here), so it reads back.
        note_config_for_op(key[1], cfg)
        config_json = to_json(cfg)
        config_type = import_path(type(cfg))
        # What cannot be read back must not be stored: a type that is not registered (decoding
        # never imports) would come back as an undecodable entry, in this process and others.
        from_json(config_json)
        stats_json = None if stats is None else to_json(stats)
        row = (*key, config_json, config_type, provenance, stats_json, kernel_version,
               jax.__version__, jaxlib.__version__, time.time())
        with self._transaction() as conn:
            conn.execute(UPSERT, row)

    def delete(self, dev: Any, op_id: str | None = None, call_key: str | None = None) -> bool:
        """Remove the key; True when a row was removed."""
        key = normalize_key(dev, op_id, call_key)
        with self._transaction() as conn:
            cur = conn.execute(f"DELETE FROM configs {KEY_WHERE}", key)
        return cur.rowcount > 0

    def clear(self) -> int:
        """Remove every config (undecodable ones too); returns how many rows were removed."""
        with self._transaction() as conn:
            cur = conn.execute("DELETE FROM configs")
        return cur.rowcount

    # ------------------------------------------------------------------ export / import

    def export(self, path: str | os.PathLike[str], *, device: str | None = None, op_id: str | None = None) -> int:
        """Write every row (decodable here or not) to a JSON document at ``path``; returns the count.

        ``device`` and/or ``op_id`` export only the rows of that device / op id: a cache too large
        for one document (more than :data:`~.exchange.MAX_IMPORT_BYTES`, which is refused, since
        no import could read it) moves in parts.

        The target is resolved through symlinks, and the document written to a temporary file
        next to the real target, flushed to disk and renamed over it: readers never see half a
        document, a symlink keeps pointing at the (new) file, and a crash leaves the old file.
        An existing target that is not a regular file (a device, a FIFO, a directory) is refused.
        A new file gets the mode the umask gives; a replaced file keeps its mode. Rows too broken
        to embed (config not JSON, a non-finite time written by an older version) are skipped
        with a warning rather than failing the export.
        """
        where, params = [], []
        for column, value in (("device", device), ("op_id", op_id)):
            if value is not None:
                if not isinstance(value, str) or not value:
                    raise ValueError(f"{column}: expected a non-empty string or None, got {value!r}")
                where.append(f"{column} = ?")
                params.append(value)
        sql = SELECT + (" WHERE " + " AND ".join(where) if where else "") + " ORDER BY device, op_id, call_key"
        with self._db() as conn:
            rows = conn.execute(sql, params).fetchall()
        entries = []
        for row in rows:
            fields = dict(zip(COLUMNS, row))
            try:
                entries.append(export_entry(fields))
            except (DecodeError, TypeError, ValueError) as err:
                key = (fields["device"], fields["op_id"], fields["call_key"])
                self._warn_once(f"export:{key}", f"{self.path}: not exporting entry {key}: {err}")
        write_export(pathlib.Path(os.fspath(path)), entries)
        return len(entries)

    def import_(self, path: str | os.PathLike[str], *, overwrite: bool = False, provenance: str | None = None) -> int:
        """Load a document written by :meth:`export`, all or nothing; returns the rows written.

        Without ``overwrite`` existing keys are kept and only new rows count. Entries keep the
        provenance they were exported with unless ``provenance`` (e.g. ``"imported"``) is given.
        The whole document is validated before anything is written; a bad document raises
        :class:`CacheError` naming the file and the entry, and leaves the cache unchanged. Only
        regular files of at most :data:`~.exchange.MAX_IMPORT_BYTES` are read. Configs are stored as they
        are (still tagged): one whose type is not registered here is kept, and listed as
        undecodable until a process that knows the type reads it.
        """
        if provenance is not None and (not isinstance(provenance, str) or not provenance):
            raise ValueError(f"provenance: expected a non-empty string or None, got {provenance!r}")
        rows = read_export(pathlib.Path(os.fspath(path)), provenance)
        sql = UPSERT if overwrite else INSERT_NEW
        count = 0
        try:
            with self._transaction() as conn:
                for row in rows:
                    count += conn.execute(sql, row).rowcount
        except sqlite3.IntegrityError as err:  # validated above; never let a raw one through
            raise CacheError(f"cannot import {path} into {self.path}: {err}") from None
        return count


def open_default_persistent() -> PersistentCache | None:
    """The user's persistent cache (:func:`default_cache_path`), or None with a warning if it
    cannot be opened: a broken cache must not stop a model from running."""
    try:
        return PersistentCache()
    except CacheError as err:
        warnings.warn(f"running without a persistent config cache: {err}", stacklevel=3)
        return None
