"""Tests for the SQLite config cache: round trips, isolation, concurrency, crashes, bad files."""

from __future__ import annotations

import dataclasses
import enum
import hashlib
import json
import os
import pathlib
import signal
import sqlite3
import subprocess
import sys
import textwrap
import threading
import time
import warnings

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ejlabel.config.persistent import CacheEntry, CacheError, PersistentCache, normalize_key
from ejlabel.core.registry import register_config_type

DEV = "cpu:test-device:fp0"
OTHER_DEV = "gpu:other-device:fp1"
KEY = "0123456789abcdef"


class Layout(enum.Enum):
    ROW = "row"
    COL = "col"


@register_config_type  # decoding never imports: a config type is read back only once registered (Layout with it)
@dataclasses.dataclass(frozen=True)
class TileConfig:
    block: tuple[int, int]
    layout: Layout
    stages: int = 2


CFG = TileConfig(block=(64, 128), layout=Layout.COL, stages=3)


def sha256(path: pathlib.Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def call_key(i: int) -> str:
    return f"{i:016x}"


@pytest.fixture
def cache(tmp_path: pathlib.Path):
    with PersistentCache(tmp_path / "cache") as c:
        yield c


# ---------------------------------------------------------------- basics


def test_round_trip_both_key_forms(cache: PersistentCache) -> None:
    cache.put(DEV, "tile@v1", KEY, CFG, stats={"median_ms": 1.5, "count": 10, "candidates": [{"ms": float("inf")}]})
    got = cache.get(DEV, "tile@v1", KEY)
    assert got == CFG and isinstance(got, TileConfig)
    assert got.layout is Layout.COL and got.block == (64, 128) and isinstance(got.block, tuple)
    assert cache.get((DEV, "tile@v1", KEY)) == CFG

    other = TileConfig(block=(32, 32), layout=Layout.ROW)
    cache.put((DEV, "tile@v1", call_key(7)), other, provenance="heuristic")
    entry = cache.get_entry((DEV, "tile@v1", call_key(7)))
    assert isinstance(entry, CacheEntry)
    assert entry.config == other and entry.provenance == "heuristic" and entry.stats is None
    assert entry.kernel_version == "1" and entry.config_type.endswith(":TileConfig")
    assert entry.jax_version and entry.jaxlib_version and abs(entry.created - time.time()) < 60

    first = cache.get_entry(DEV, "tile@v1", KEY)
    assert first is not None and first.stats == {"median_ms": 1.5, "count": 10, "candidates": [{"ms": float("inf")}]}
    assert first.provenance == "autotuned"

    assert (DEV, "tile@v1", KEY) in cache
    assert (DEV, "tile@v1", call_key(8)) not in cache
    assert cache.get(DEV, "tile@v1", call_key(8)) is None


def test_put_replaces_and_kernel_version(cache: PersistentCache) -> None:
    cache.put(DEV, "tile@v1", KEY, CFG)
    new = dataclasses.replace(CFG, stages=5)
    cache.put(DEV, "tile@v1", KEY, new, kernel_version="1.custom", provenance="override")
    entry = cache.get_entry(DEV, "tile@v1", KEY)
    assert entry is not None and entry.config == new
    assert entry.kernel_version == "1.custom" and entry.provenance == "override"
    assert len(cache.entries()) == 1
    cache.put(DEV, "multi.v2@v12", KEY, CFG)
    assert cache.get_entry(DEV, "multi.v2@v12", KEY).kernel_version == "12"  # type: ignore[union-attr]
    with pytest.raises(ValueError, match="op_id"):  # a name a label cannot carry is never stored
        cache.put(DEV, "multi@part@v12", KEY, CFG)


def test_entries_stats_delete_clear(cache: PersistentCache) -> None:
    for i in range(3):
        cache.put(DEV, "a@v1", call_key(i), CFG)
    cache.put(OTHER_DEV, "a@v1", call_key(0), CFG)
    cache.put(DEV, "b@v2", call_key(0), {"plain": [1, 2]})

    assert len(cache.entries()) == 5
    assert [e.call_key for e in cache.entries(device=DEV, op_id="a@v1")] == [call_key(i) for i in range(3)]
    assert {e.device for e in cache.entries(op_id="a@v1")} == {DEV, OTHER_DEV}
    assert [e.op_id for e in cache.entries(device=OTHER_DEV)] == ["a@v1"]

    s = cache.stats()
    assert s["entries"] == 5
    assert s["by_op_id"] == {"a@v1": 4, "b@v2": 1}
    assert s["by_device"] == {DEV: 4, OTHER_DEV: 1}
    assert s["path"] == str(cache.path) and s["schema_version"] == 1 and s["file_size"] > 0

    assert cache.delete(DEV, "a@v1", call_key(0)) is True
    assert cache.delete((DEV, "a@v1", call_key(0))) is False
    assert cache.get(DEV, "a@v1", call_key(0)) is None
    assert cache.get(OTHER_DEV, "a@v1", call_key(0)) == CFG
    assert cache.clear() == 4
    assert cache.entries() == [] and cache.stats()["entries"] == 0


def test_persists_across_instances(tmp_path: pathlib.Path) -> None:
    with PersistentCache(tmp_path) as c:
        c.put(DEV, "tile@v1", KEY, CFG)
    with PersistentCache(tmp_path) as c:
        assert c.get(DEV, "tile@v1", KEY) == CFG
    with pytest.raises(CacheError, match="closed"):
        c.get(DEV, "tile@v1", KEY)


def test_version_and_device_isolation(cache: PersistentCache) -> None:
    cache.put(DEV, "k@v1", KEY, CFG)
    assert cache.get(DEV, "k@v2", KEY) is None
    assert (DEV, "k@v2", KEY) not in cache
    assert cache.get(OTHER_DEV, "k@v1", KEY) is None
    assert cache.entries(op_id="k@v2") == [] and cache.entries(device=OTHER_DEV) == []
    v2 = dataclasses.replace(CFG, stages=9)
    cache.put(DEV, "k@v2", KEY, v2)
    assert cache.get(DEV, "k@v1", KEY) == CFG and cache.get(DEV, "k@v2", KEY) == v2


# ---------------------------------------------------------------- paths


def test_directory_vs_file_path(tmp_path: pathlib.Path) -> None:
    with PersistentCache(tmp_path / "dir") as c:
        assert c.path == (tmp_path / "dir" / "configs.sqlite").absolute()
    for name in ("mine.sqlite", "nested/other.db"):
        with PersistentCache(tmp_path / name) as c:
            assert c.path == (tmp_path / name).absolute()
            c.put(DEV, "tile@v1", KEY, CFG)
        assert (tmp_path / name).is_file()
    with PersistentCache(str(tmp_path / "mine.sqlite")) as c:
        assert c.get(DEV, "tile@v1", KEY) == CFG


def test_env_var_and_default_dir(tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("EJLABEL_CACHE_DIR", str(tmp_path / "from_env"))
    with PersistentCache() as c:
        assert c.path == (tmp_path / "from_env" / "configs.sqlite").absolute()
        c.put(DEV, "tile@v1", KEY, CFG)
    with PersistentCache(tmp_path / "explicit") as c:  # an explicit path wins over the variable
        assert c.path.parent == (tmp_path / "explicit").absolute() and c.get(DEV, "tile@v1", KEY) is None

    monkeypatch.delenv("EJLABEL_CACHE_DIR")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    with PersistentCache() as c:
        assert c.path == (tmp_path / "xdg" / "ejlabel" / "configs.sqlite").absolute()

    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    with PersistentCache() as c:
        assert c.path == (tmp_path / "home" / ".cache" / "ejlabel" / "configs.sqlite").absolute()


# ---------------------------------------------------------------- bad input


def test_normalize_key_forms() -> None:
    assert normalize_key(DEV, "a@v1", KEY) == (DEV, "a@v1", KEY)
    assert normalize_key((DEV, "a@v1", KEY)) == (DEV, "a@v1", KEY)
    with pytest.raises(TypeError, match="dev"):
        normalize_key(DEV)
    with pytest.raises(TypeError, match="dev"):
        normalize_key((DEV, "a@v1"))
    with pytest.raises(TypeError, match="call_key"):
        normalize_key(DEV, "a@v1")
    with pytest.raises(ValueError, match="device"):
        normalize_key(3, "a@v1", KEY)
    with pytest.raises(ValueError, match="op_id"):
        normalize_key(DEV, "", KEY)
    for bad in ("0123456789ABCDEF", "0123", "0123456789abcdefa", "g123456789abcdef", 123):
        with pytest.raises(ValueError, match="call_key"):
            normalize_key(DEV, "a@v1", bad)


def test_put_rejects_bad_input_and_writes_nothing(cache: PersistentCache) -> None:
    with pytest.raises(ValueError, match="device"):
        cache.put(123, "a@v1", KEY, CFG)
    with pytest.raises(ValueError, match="call_key"):
        cache.put(DEV, "a@v1", "XYZ", CFG)
    with pytest.raises(ValueError, match="op_id"):
        cache.put(DEV, "no-version", KEY, CFG)  # no "@v" suffix and no kernel_version
    with pytest.raises(TypeError):
        cache.put(DEV, "a@v1", KEY, object())
    with pytest.raises(TypeError):
        cache.put(DEV, "a@v1", KEY, {"f": lambda: 0})
    with pytest.raises(TypeError, match="stats"):
        cache.put(DEV, "a@v1", KEY, CFG, stats=[1, 2])  # type: ignore[arg-type]
    with pytest.raises(TypeError):
        cache.put(DEV, "a@v1", KEY, CFG, stats={"bad": object()})
    assert cache.entries() == [] and cache.stats()["entries"] == 0
    cache.put(DEV, "no-version", KEY, CFG, kernel_version="7")
    assert cache.get_entry(DEV, "no-version", KEY).kernel_version == "7"  # type: ignore[union-attr]


def test_undecodable_config_is_skipped_not_deleted(cache: PersistentCache) -> None:
    cache.put(DEV, "a@v1", call_key(1), CFG)
    cache.put(DEV, "a@v1", call_key(2), CFG)
    cache.put(DEV, "a@v1", call_key(3), CFG)
    gone = '{"$dataclass":"no_such_module_xyz:Gone","fields":{}}'
    with sqlite3.connect(cache.path) as raw:
        raw.execute("UPDATE configs SET config_json = ?, config_type = 'no_such_module_xyz:Gone' "
                    "WHERE call_key != ?", (gone, call_key(1)))
    raw.close()
    with pytest.warns(RuntimeWarning, match="no_such_module_xyz:Gone"):
        assert cache.get(DEV, "a@v1", call_key(2)) is None
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # warned once already: no second warning
        assert cache.get(DEV, "a@v1", call_key(3)) is None
        assert [e.call_key for e in cache.entries()] == [call_key(1)]
        assert (DEV, "a@v1", call_key(2)) not in cache
    assert cache.stats()["entries"] == 3  # rows kept for a future version that can read them
    with PersistentCache(cache.path) as fresh, pytest.warns(RuntimeWarning, match="cannot decode"):
        assert len(fresh.entries()) == 1


# ---------------------------------------------------------------- bad files


def test_corrupt_file_is_refused_unchanged(tmp_path: pathlib.Path) -> None:
    for name, data in [("random.sqlite", os.urandom(4096)), ("text.db", b"hello, this is not a database\n" * 50)]:
        path = tmp_path / name
        path.write_bytes(data)
        before = sha256(path)
        with pytest.raises(CacheError, match="is not an ejlabel cache: file is not a database") as info:
            PersistentCache(path)
        assert str(path) in str(info.value)
        assert sha256(path) == before
        assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith(name)) == [name]


def test_corrupt_body_with_sqlite_header_is_refused(tmp_path: pathlib.Path) -> None:
    path = tmp_path / "bad.sqlite"
    path.write_bytes(b"SQLite format 3\x00" + os.urandom(8192))
    before = sha256(path)
    with pytest.raises(CacheError, match="bad.sqlite"):
        PersistentCache(path)
    assert sha256(path) == before


def test_foreign_sqlite_file_is_refused_unchanged(tmp_path: pathlib.Path) -> None:
    path = tmp_path / "foreign.sqlite"
    raw = sqlite3.connect(path)
    raw.execute("CREATE TABLE users (id INTEGER PRIMARY KEY, name TEXT)")
    raw.execute("INSERT INTO users (name) VALUES ('x')")
    raw.commit()
    raw.close()
    before = sha256(path)
    with pytest.raises(CacheError, match="is not an ejlabel cache") as info:
        PersistentCache(path)
    assert str(path) in str(info.value) and "application_id" in str(info.value)
    assert sha256(path) == before


def test_our_id_without_marker_is_refused(tmp_path: pathlib.Path) -> None:
    path = tmp_path / "c.sqlite"
    PersistentCache(path).close()
    with sqlite3.connect(path) as raw:
        raw.execute("UPDATE meta SET value = 'something-else' WHERE key = 'application'")
    raw.close()
    before = sha256(path)
    with pytest.raises(CacheError, match="meta application"):
        PersistentCache(path)
    assert sha256(path) == before


def test_newer_schema_is_refused_unchanged(tmp_path: pathlib.Path) -> None:
    path = tmp_path / "c.sqlite"
    with PersistentCache(path) as c:
        c.put(DEV, "a@v1", KEY, CFG)
    with sqlite3.connect(path) as raw:
        raw.execute("UPDATE meta SET value = '99' WHERE key = 'schema_version'")
        raw.execute("PRAGMA user_version = 99")
    raw.close()
    before = sha256(path)
    with pytest.raises(CacheError, match="upgrade") as info:
        PersistentCache(path)
    assert str(path) in str(info.value) and "99" in str(info.value)
    assert sha256(path) == before


def test_empty_existing_file_becomes_a_cache(tmp_path: pathlib.Path) -> None:
    path = tmp_path / "empty.sqlite"
    path.touch()
    with PersistentCache(path) as c:
        c.put(DEV, "a@v1", KEY, CFG)
        assert c.get(DEV, "a@v1", KEY) == CFG


def test_unusable_directory_parent_is_a_file(tmp_path: pathlib.Path) -> None:
    blocker = tmp_path / "regular_file"
    blocker.write_text("x")
    with pytest.raises(CacheError, match="regular_file"):
        PersistentCache(blocker / "sub")
    with pytest.raises(CacheError, match="regular_file"):
        PersistentCache(blocker / "c.sqlite")
    assert blocker.read_text() == "x"


@pytest.mark.skipif(os.geteuid() == 0, reason="root ignores directory permissions")
def test_unwritable_directory(tmp_path: pathlib.Path) -> None:
    locked = tmp_path / "locked"
    locked.mkdir()
    locked.chmod(0o500)
    try:
        with pytest.raises(CacheError, match="locked"):
            PersistentCache(locked)
        with pytest.raises(CacheError, match="locked"):
            PersistentCache(locked / "deeper")
    finally:
        locked.chmod(0o700)


# ---------------------------------------------------------------- export / import


def test_export_import_round_trip(tmp_path: pathlib.Path) -> None:
    src = PersistentCache(tmp_path / "a")
    for i in range(5):
        src.put(DEV, "tile@v1", call_key(i), dataclasses.replace(CFG, stages=i), stats={"median_ms": i / 3})
    src.put(OTHER_DEV, "other@v3", KEY, ("tuple", 1), provenance="heuristic")
    doc_path = tmp_path / "export.json"
    assert src.export(doc_path) == 6
    doc = json.loads(doc_path.read_text())
    assert doc["format"] == "ejlabel-configs" and doc["version"] == 1 and len(doc["entries"]) == 6

    with PersistentCache(tmp_path / "elsewhere" / "b") as dst:
        assert dst.import_(doc_path) == 6
        assert dst.entries() == src.entries()
        assert dst.get(DEV, "tile@v1", call_key(3)) == dataclasses.replace(CFG, stages=3)
        assert dst.import_(doc_path) == 0  # nothing new

        dst.put(DEV, "tile@v1", call_key(0), CFG, provenance="override")
        assert dst.import_(doc_path) == 0
        assert dst.get(DEV, "tile@v1", call_key(0)) == CFG  # not overwritten by default
        assert dst.import_(doc_path, overwrite=True) == 6
        assert dst.get(DEV, "tile@v1", call_key(0)) == dataclasses.replace(CFG, stages=0)

    with PersistentCache(tmp_path / "c") as marked:
        assert marked.import_(doc_path, provenance="imported") == 6
        assert {e.provenance for e in marked.entries()} == {"imported"}
    src.close()


def test_import_bad_documents_leave_target_unchanged(tmp_path: pathlib.Path) -> None:
    src = PersistentCache(tmp_path / "a")
    for i in range(3):
        src.put(DEV, "tile@v1", call_key(i), CFG)
    good = tmp_path / "good.json"
    src.export(good)
    doc = json.loads(good.read_text())

    dst = PersistentCache(tmp_path / "b")
    dst.put(DEV, "keep@v1", KEY, CFG)
    before = dst.entries()

    def variant(name: str, content: str) -> pathlib.Path:
        p = tmp_path / name
        p.write_text(content)
        return p

    last_bad = dict(doc["entries"][-1], call_key="NOT-HEX")
    bad_docs = {
        "notjson.json": "{nope",
        "format.json": json.dumps({**doc, "format": "something-else"}),
        "list.json": json.dumps([1, 2, 3]),
        "newer.json": json.dumps({**doc, "version": 2}),
        "noentries.json": json.dumps({"format": "ejlabel-configs", "version": 1}),
        # A bad last entry: the good ones before it must not be written either.
        "lastbad.json": json.dumps({**doc, "entries": doc["entries"][:-1] + [last_bad]}),
        "missing.json": json.dumps({**doc, "entries": [{"device": DEV}]}),
    }
    for name, content in bad_docs.items():
        path = variant(name, content)
        with pytest.raises(CacheError) as info:
            dst.import_(path)
        assert name in str(info.value), name
        assert dst.entries() == before, name
    with pytest.raises(CacheError, match="upgrade"):
        dst.import_(tmp_path / "newer.json")
    with pytest.raises(CacheError, match="nofile.json"):
        dst.import_(tmp_path / "nofile.json")
    assert dst.import_(good) == 3
    src.close()
    dst.close()


# ---------------------------------------------------------------- property test


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    items=st.dictionaries(
        st.tuples(st.sampled_from([DEV, OTHER_DEV]), st.sampled_from(["a@v1", "a@v2", "b@v1"]),
                  st.integers(0, 2**64 - 1).map(call_key)),
        st.one_of(
            st.builds(TileConfig, st.tuples(st.integers(1, 512), st.integers(1, 512)), st.sampled_from(Layout),
                      st.integers(1, 8)),
            st.dictionaries(st.text(max_size=5).filter(lambda s: not s.startswith("$")),
                            st.one_of(st.integers(), st.text(max_size=5), st.tuples(st.integers())), max_size=3),
        ),
        max_size=8,
    )
)
def test_property_every_put_reads_back(tmp_path: pathlib.Path, items: dict) -> None:
    path = tmp_path / f"prop-{time.monotonic_ns()}.sqlite"
    with PersistentCache(path) as c:
        for key, cfg in items.items():
            c.put(key, cfg)
        for key, cfg in items.items():
            assert c.get(key) == cfg
        assert len(c.entries()) == len(items)
    path.unlink()


# ---------------------------------------------------------------- threads and processes


def test_threads_share_one_cache(cache: PersistentCache) -> None:
    errors: list[BaseException] = []

    def work(t: int) -> None:
        try:
            for i in range(100):
                cache.put(f"dev{t}", "th@v1", call_key(i), {"t": t, "i": i})
                assert cache.get(f"dev{t}", "th@v1", call_key(i)) == {"t": t, "i": i}
        except BaseException as err:  # surfaced below: a thread's exception is otherwise lost
            errors.append(err)

    threads = [threading.Thread(target=work, args=(t,)) for t in range(6)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert errors == []
    assert cache.stats()["entries"] == 600


_WRITER = textwrap.dedent(
    """
    import os, sys, time
    from ejlabel.config.persistent import PersistentCache
    path, worker, count, go = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
    cache = PersistentCache(path)
    open(f"{go}.ready{worker}", "w").close()
    while not os.path.exists(go):  # start together, so the writes really contend
        time.sleep(0.005)
    for i in range(count):
        cache.put(f"dev{worker}", "conc@v1", f"{worker:04x}{i:012x}", {"w": worker, "i": i, "pair": (worker, i)})
    cache.close()
    """
)


def test_eight_processes_thousand_writes_each(tmp_path: pathlib.Path) -> None:
    path = tmp_path / "shared.sqlite"
    PersistentCache(path).close()
    go = tmp_path / "go"
    n_proc, n_puts = 8, 1000
    procs = [
        subprocess.Popen([sys.executable, "-c", _WRITER, str(path), str(w), str(n_puts), str(go)],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=tmp_path)
        for w in range(n_proc)
    ]
    # Time only the writes, not interpreter start-up: wait until every worker has opened the cache.
    deadline = time.monotonic() + 60
    while not all((tmp_path / f"go.ready{w}").exists() for w in range(n_proc)):
        assert time.monotonic() < deadline and all(p.poll() is None for p in procs), "workers did not start"
        time.sleep(0.01)
    start = time.perf_counter()
    go.touch()
    outputs = [p.communicate(timeout=120) for p in procs]
    elapsed = time.perf_counter() - start
    for p, (_, err) in zip(procs, outputs):
        assert p.returncode == 0, err.decode()
    print(f"\n{n_proc} processes x {n_puts} puts: {elapsed:.2f} s after start signal")

    with PersistentCache(path) as c:
        assert c.stats()["entries"] == n_proc * n_puts
        for w in range(n_proc):
            got = {e.call_key: e.config for e in c.entries(device=f"dev{w}")}
            assert got == {f"{w:04x}{i:012x}": {"w": w, "i": i, "pair": (w, i)} for i in range(n_puts)}
    assert elapsed < 45


_CRASH_WRITER = textwrap.dedent(
    """
    import sys
    from ejlabel.config.persistent import PersistentCache
    cache = PersistentCache(sys.argv[1])
    i = 0
    while True:
        key = f"{i:016x}"
        cache.put("crashdev", "crash@v1", key, {"i": i, "payload": "x" * (i % 500)}, stats={"median_ms": i / 7})
        print(key, flush=True)
        i += 1
    """
)


def test_sigkill_mid_writes_keeps_committed_entries(tmp_path: pathlib.Path) -> None:
    path = tmp_path / "crash.sqlite"
    proc = subprocess.Popen([sys.executable, "-c", _CRASH_WRITER, str(path)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=tmp_path)
    committed: list[str] = []
    try:
        assert proc.stdout is not None
        while len(committed) < 300:
            line = proc.stdout.readline()
            assert line, proc.stderr.read() if proc.stderr else "writer exited"
            committed.append(line.strip())
        proc.send_signal(signal.SIGKILL)
        rest, _ = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
    # Only whole lines were printed after their put returned; a cut-off last line is not a claim.
    committed += [k for k in rest.splitlines() if len(k) == 16]
    assert proc.returncode == -signal.SIGKILL

    raw = sqlite3.connect(path)
    assert raw.execute("PRAGMA integrity_check").fetchone()[0] == "ok"
    raw.close()
    with PersistentCache(path) as c:
        for key in committed:
            i = int(key, 16)
            entry = c.get_entry("crashdev", "crash@v1", key)
            assert entry is not None, key
            assert entry.config == {"i": i, "payload": "x" * (i % 500)} and entry.stats == {"median_ms": i / 7}
        assert c.stats()["entries"] >= len(committed)
