"""The export file: tuned configs moved between machines as one JSON document.

:func:`write_export` writes every row as an entry of ``{"format": "ejlabel-configs", "version":
1, "entries": [...]}``, configs embedded as their tagged JSON (still tagged, so the document
stays readable and nothing in it is ever imported), one entry per line. The target is replaced
atomically, through symlinks, keeping its mode: readers never see half a document, and a crash
leaves the old file.

:func:`read_export` is the other side, and treats the document as data from elsewhere: it reads
at most :data:`MAX_IMPORT_BYTES` from a regular file only (never a FIFO or a device), and
validates the whole document (keys, op ids as labels carry them, text fields, versions, finite
numbers, nesting depth, no key twice, no member name twice in an object) into database rows
before anything is written, so a bad document raises a :class:`~.entry.CacheError` naming the
file and the entry and changes nothing.

Export and import agree on size: :func:`write_export` refuses (changing nothing) a document
larger than what :func:`read_export` reads, so every file an export writes imports again; a
cache too large for one document is exported in parts (by device or op id).
"""

from __future__ import annotations

import json
import math
import os
import pathlib
import stat
import tempfile
from collections.abc import Callable
from typing import Any

from ejlabel.config.persistent.entry import CacheError, normalize_key
from ejlabel.config.persistent.store import COLUMNS
from ejlabel.core.label_format import check_op_id
from ejlabel.utils.files import FileTooLargeError, SpecialFileError, file_kind, read_regular_file
from ejlabel.utils.serialize import MAX_DEPTH, DecodeError, check_json, loads_strict

__all__ = ["EXPORT_FORMAT", "EXPORT_VERSION", "MAX_IMPORT_BYTES", "export_entry", "read_export", "write_export"]

EXPORT_FORMAT = "ejlabel-configs"
EXPORT_VERSION = 1
#: Largest export document :meth:`~.cache.PersistentCache.import_` reads, and so the largest one
#: :meth:`~.cache.PersistentCache.export` writes (64 MiB: about 150,000 entries of one line
#: each). The file is read in chunks and refused as soon as it grows past this, so a huge or
#: endless file (``/dev/zero``, a file still being written) cannot exhaust memory.
MAX_IMPORT_BYTES = 64 * 1024 * 1024


def _dumps(data: Any) -> str:
    return json.dumps(data, sort_keys=True, separators=(",", ":"), allow_nan=False)


def export_entry(fields: dict[str, Any]) -> dict[str, Any]:
    """One row as an export entry; DecodeError/ValueError when the row cannot be embedded."""
    entry = {k: fields[k] for k in COLUMNS if k not in ("config_json", "stats_json")}
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


def write_export(path: pathlib.Path, entries: list[dict[str, Any]]) -> None:
    """Write ``entries`` (each from :func:`export_entry`) as an export document at ``path``, atomically.

    One entry per line: readable, diffable, and a third of the bytes of an indented document.
    CacheError, and nothing written, when the document would be larger than
    :data:`MAX_IMPORT_BYTES`, since no import could read it.
    """
    lines = [_dumps(entry) for entry in entries]
    text = '{"entries": [\n' + ",\n".join(lines) + f'\n], "format": {json.dumps(EXPORT_FORMAT)}, "version": {EXPORT_VERSION}}}\n'
    data = text.encode("utf-8")
    if len(data) > MAX_IMPORT_BYTES:
        raise CacheError(
            f"cannot export to {path}: the {len(entries)} entries take {len(data)} bytes, more than the "
            f"{MAX_IMPORT_BYTES} bytes an import reads (MAX_IMPORT_BYTES); export them in parts with "
            "export(path, device=..., op_id=...) (`ejlabel cache export FILE --device D --op-id OP`)"
        )
    _write_atomic(path, data)


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


def _unique_members(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """A JSON object as a dict; ValueError for a member name given twice (``json`` keeps the last)."""
    obj = dict(pairs)
    if len(obj) != len(pairs):
        names = [name for name, _ in pairs]
        twice = next(name for name in names if names.count(name) > 1)
        raise ValueError(f"member name {twice!r:.80} appears twice in one object")
    return obj


def _check_text(value: Any, what: str, bad: Callable[[str], CacheError]) -> str:
    if not isinstance(value, str) or not value:
        raise bad(f"{what} is {value!r:.80}, expected a non-empty string")
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        raise bad(f"{what} is {value!r:.80}, not valid Unicode text") from None
    return value


def read_export(path: pathlib.Path, provenance: str | None) -> list[tuple[Any, ...]]:
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
        doc = json.loads(text, object_pairs_hook=_unique_members)
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
    first_of: dict[tuple[str, str, str], int] = {}
    for i, e in enumerate(entries):
        if not isinstance(e, dict):
            raise bad(f"entries[{i}] is not an object")
        missing = [k for k in ("device", "op_id", "call_key", "config", *text_fields, "created") if k not in e]
        if missing:
            raise bad(f"entries[{i}] lacks {', '.join(missing)}")
        try:
            key = normalize_key(e["device"], e["op_id"], e["call_key"])
            check_op_id(key[1])
        except (TypeError, ValueError) as err:
            raise bad(f"entries[{i}]: {err}") from None
        first = first_of.setdefault(key, i)
        if first != i:
            # Two entries for one key: which config the cache would keep depends on their order.
            raise bad(f"entries[{i}] has the key of entries[{first}] {key!r:.200}; a key may appear once")
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
