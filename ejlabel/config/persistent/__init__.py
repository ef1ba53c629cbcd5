"""Persistent config cache: tuned kernel configs in one SQLite file, shared by every process.

Autotuning is expensive, so its results outlive the process that found them. Each row is keyed
by ``(device, op_id, call_key)`` and holds the config as tagged JSON (never pickled: opening a
cache file must not be able to run code), its type, provenance, timing statistics, kernel
version, jax/jaxlib versions and when it was written. Many processes may read and write the
same file at once; a crash mid-write loses nothing that was committed; a corrupt or foreign
file gives a :class:`CacheError` naming the file and is left unchanged.

The modules, in the order a row travels:

* :mod:`.entry`: the key (:func:`normalize_key`), the entry a read gives back
  (:class:`CacheEntry`) and :class:`CacheError`;
* :mod:`.store`: the SQLite file: where it lives (:func:`default_cache_path`), its schema, and
  opening it safely from many processes at once (identity checks, WAL), or read-only where it
  cannot be written;
* :mod:`.wal`: damage in the write-ahead log, which SQLite would drop without a word, found and
  reported when the file is opened;
* :mod:`.cache`: :class:`PersistentCache`, the API: get, put, entries, stats, export, import;
* :mod:`.exchange`: the export document that moves tuned configs between machines, and its
  validation on import.
"""

from ejlabel.config.persistent.cache import PersistentCache, open_default_persistent
from ejlabel.config.persistent.entry import CacheEntry, CacheError, normalize_key, split_key
from ejlabel.config.persistent.store import default_cache_path

__all__ = ["CacheError", "CacheEntry", "PersistentCache", "normalize_key", "split_key", "default_cache_path", "open_default_persistent"]
