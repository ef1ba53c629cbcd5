"""Hostile input to the persistent cache: files, rows and export documents are data from elsewhere.

The cases of the hostile-input issues that concern the cache file and its export documents; the
index of every case and its test is the docstring of ``tests/test_hostile_input.py``.
"""
from __future__ import annotations

import json
import os
import pathlib
import re
import sqlite3
import stat
import subprocess
import sys
import tempfile
import textwrap
import threading
import warnings

import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

import ejlabel.config.persistent.exchange as persistent_module
from conftest import subprocess_env
from ejlabel.config.persistent import CacheError, PersistentCache
from ejlabel.core.kernel import Invocation
from ejlabel.utils.serialize import MAX_DEPTH, DecodeError, from_jsonable, to_json
from hostile import (  # noqa: F401  (cache is a fixture)
    DEV,
    KEY,
    GoodConfig,
    cache,
    call_key,
    capture,
    entry,
    export_doc,
    json_value,
    raw_insert,
)

# ---------------------------------------------------------------- 3. a fresh cache opened by many processes


# Runs in a fresh interpreter that has imported the cache but run no JAX computation, with
# OpenBLAS held to the calling thread: a process with no other thread may fork safely, where a
# forked child can inherit a lock some other thread held and hang (a pytest worker that has run
# JAX; numpy's thread pool). The script checks that it is alone before forking. Forked workers
# start in milliseconds on a small machine and really race; before the fix, 16 workers failed in
# ~20% of trials. A worker that neither reports nor exits within the deadline is named (and
# stopped), as is one that exits without a word: the test then fails saying which.
_RACE = textwrap.dedent(
    """
    import json, multiprocessing, os, queue, sys, time
    from ejlabel.config.persistent import PersistentCache

    DEV, KERNEL = sys.argv[1], "race@v1"
    root, n_proc, trials = sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
    threads = os.listdir("/proc/self/task")
    assert len(threads) == 1, f"the racing parent must have no other thread before it forks: {len(threads)}"

    def open_together(path, barrier, results):
        try:
            barrier.wait(60)
            with PersistentCache(path) as c:
                c.put(DEV, KERNEL, f"{os.getpid():016x}", {"pid": os.getpid()})
            results.put(None)
        except BaseException as err:  # reported to the parent, which asserts on it
            results.put(f"{type(err).__name__}: {err}")

    def gather(procs, results, deadline):
        outcomes = []
        while len(outcomes) < len(procs):
            try:
                outcomes.append(results.get(timeout=max(0.1, deadline - time.monotonic())))
            except queue.Empty:
                for p in procs:
                    if p.is_alive():
                        outcomes.append(f"worker {p.pid} neither reported nor exited in time")
                        p.kill()
                    elif p.exitcode != 0:
                        outcomes.append(f"worker {p.pid} exited with {p.exitcode} without reporting")
                break
        return outcomes

    ctx = multiprocessing.get_context("fork")
    report = []
    for trial in range(trials):
        path = os.path.join(root, f"fresh{trial}", "c.sqlite")
        barrier, results = ctx.Barrier(n_proc), ctx.Queue()
        procs = [ctx.Process(target=open_together, args=(path, barrier, results)) for _ in range(n_proc)]
        for p in procs:
            p.start()
        outcomes = gather(procs, results, time.monotonic() + 180)
        for p in procs:
            p.join(30)
        with PersistentCache(path) as c:
            entries = c.stats()["entries"]
        report.append({"errors": [o for o in outcomes if o is not None], "entries": entries})
    print(json.dumps(report))
    """
)


@pytest.mark.skipif(sys.platform != "linux", reason="forks workers (fast start); Linux only")
def test_32_processes_open_a_fresh_cache_at_once(tmp_path: pathlib.Path) -> None:
    n_proc, trials = 32, 8
    single_threaded = {"OPENBLAS_NUM_THREADS": "1", "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
    proc = subprocess.run(
        [sys.executable, "-P", "-c", _RACE, DEV, str(tmp_path), str(n_proc), str(trials)],
        capture_output=True, text=True, env=subprocess_env(**single_threaded), timeout=600,
    )
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    assert [r["errors"] for r in report] == [[]] * trials
    assert [r["entries"] for r in report] == [n_proc] * trials


@pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="reads SQLite's descriptors through /proc/self/fd")
def test_files_sqlite_holds_are_never_opened_and_closed_beside_it(tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # Closing a descriptor of a file drops SQLite's locks on it: the log index (the SIGBUS
    # above), and the database when a second cache of this process opens it.
    from ejlabel.config.persistent import wal

    path = tmp_path / "c.sqlite"
    shm = path.with_name(path.name + "-shm")
    opened: list[str] = []
    real_open, real_os_open = open, os.open
    with PersistentCache(path) as first:
        first.put(DEV, "race@v1", "0123456789abcdef", {"pid": 1})
        monkeypatch.setattr("builtins.open", lambda f, *a, **k: opened.append(str(f)) or real_open(f, *a, **k))
        monkeypatch.setattr(os, "open", lambda f, *a, **k: opened.append(str(f)) or real_os_open(f, *a, **k))
        frames = wal._recovered_frames(shm)
        with PersistentCache(path) as second:
            assert second.get(DEV, "race@v1", "0123456789abcdef") == {"pid": 1}
        monkeypatch.undo()
    assert isinstance(frames, int) and frames >= 1  # the index says the log holds the put
    assert str(shm) not in opened and str(path) not in opened


# ---------------------------------------------------------------- 5. deep nesting


def nested(depth: int) -> object:
    value: object = 1
    for _ in range(depth):
        value = [value]
    return value


@pytest.mark.parametrize("depth", [MAX_DEPTH + 1, 500, 995, 100_000])
def test_import_refuses_deep_nesting_naming_the_entry(cache: PersistentCache, tmp_path: pathlib.Path, depth: int) -> None:
    doc = tmp_path / "deep.json"
    text = json.dumps(export_doc([entry(1), entry(2, config={"deep": 0})]))
    # Written by hand: json.dumps itself stops near depth 1000.
    text = text.replace('{"deep": 0}', "[" * depth + "1" + "]" * depth)
    doc.write_text(text)
    before = cache.entries(include_undecodable=True)
    with pytest.raises(CacheError, match="deep.json") as info:
        cache.import_(doc)
    assert "entries[1].config" in str(info.value) or "nested too deeply" in str(info.value)
    assert cache.entries(include_undecodable=True) == before


def test_a_deep_entry_in_the_file_is_skipped_not_fatal(cache: PersistentCache, tmp_path: pathlib.Path) -> None:
    raw_insert(cache.path, (DEV, "good@v1", call_key(1)), json.dumps(nested(500)))
    raw_insert(cache.path, (DEV, "good@v1", call_key(2)), "[" * 100_000 + "]" * 100_000)
    with pytest.warns(RuntimeWarning, match="cannot decode"):
        assert [e.call_key for e in cache.entries()] == [KEY]
    assert cache.get(DEV, "good@v1", call_key(1)) is None and cache.get(DEV, "good@v1", call_key(2)) is None
    listed = {e.call_key: e for e in cache.entries(include_undecodable=True)}
    assert listed[call_key(1)].status == "undecodable" and "deeper than" in listed[call_key(1)].error
    assert listed[call_key(2)].status == "undecodable" and listed[KEY].config == GoodConfig(3)
    with pytest.warns(RuntimeWarning, match="not exporting"):
        assert cache.export(tmp_path / "out.json") == 1  # the good entry still moves
    with pytest.raises(DecodeError, match="deeper than"):
        from_jsonable(nested(MAX_DEPTH + 1))
    assert from_jsonable(nested(MAX_DEPTH - 1)) == nested(MAX_DEPTH - 1)



# ---------------------------------------------------------------- 6. non-finite numbers


@pytest.mark.parametrize("created", ["1e999", "-1e999", "NaN", "Infinity", "1" + "0" * 400])
@pytest.mark.parametrize("overwrite", [False, True])
def test_import_refuses_non_finite_created(cache: PersistentCache, tmp_path: pathlib.Path, created: str, overwrite: bool) -> None:
    doc = tmp_path / "nonfinite.json"
    doc.write_text(json.dumps(export_doc([entry(1), entry(2, created=123.0)])).replace("123.0", created))
    before = cache.entries(include_undecodable=True)
    with pytest.raises(CacheError, match=r"entries\[1\]\.created .*finite"):
        cache.import_(doc, overwrite=overwrite)
    assert cache.entries(include_undecodable=True) == before
    assert cache.export(tmp_path / "out.json") == 1


@pytest.mark.parametrize("number", ["NaN", "-Infinity", "1e400"])
def test_import_refuses_non_finite_numbers_in_configs_and_stats(cache: PersistentCache, tmp_path: pathlib.Path, number: str) -> None:
    for field in ("config", "stats"):
        doc = tmp_path / f"{field}.json"
        doc.write_text(json.dumps(export_doc([entry(1, **{field: {"x": "HERE"}})])).replace('"HERE"', number))
        with pytest.raises(CacheError, match=rf"entries\[0\]\.{field}\.x"):
            cache.import_(doc)
    assert [e.call_key for e in cache.entries(include_undecodable=True)] == [KEY]


def test_old_rows_with_non_finite_time_do_not_break_export(cache: PersistentCache, tmp_path: pathlib.Path) -> None:
    raw_insert(cache.path, (DEV, "good@v1", call_key(9)), to_json(GoodConfig(9)), created=float("inf"))
    with pytest.warns(RuntimeWarning, match="not exporting"):
        assert cache.export(tmp_path / "out.json") == 1
    assert json.loads((tmp_path / "out.json").read_text())["entries"][0]["call_key"] == KEY



# ---------------------------------------------------------------- 4. unbounded reads (cache import)


def test_import_refuses_special_files(cache: PersistentCache, tmp_path: pathlib.Path) -> None:
    fifo = tmp_path / "pipe.json"
    os.mkfifo(fifo)
    outcome: list[BaseException | int] = []
    worker = threading.Thread(target=lambda: capture(outcome, lambda: cache.import_(fifo)), daemon=True)
    worker.start()
    worker.join(20)
    if worker.is_alive():  # blocked opening the FIFO: release it, then fail
        os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
        worker.join(5)
        pytest.fail("import blocked on a FIFO")
    (err,) = outcome
    assert isinstance(err, CacheError) and "not a regular file" in str(err) and "FIFO" in str(err)
    with pytest.raises(CacheError, match="directory, not a regular file"):
        cache.import_(tmp_path)


def test_import_of_dev_zero_is_refused_at_once(tmp_path: pathlib.Path) -> None:
    # In a child with a memory limit: the old reader grew without bound on /dev/zero.
    code = textwrap.dedent(
        f"""
        import resource, sys
        resource.setrlimit(resource.RLIMIT_AS, (6 << 30, 6 << 30))
        from ejlabel.config.persistent import CacheError, PersistentCache
        c = PersistentCache({str(tmp_path / "c")!r})
        try:
            c.import_("/dev/zero")
        except CacheError as err:
            print("REFUSED", err)
        """
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=subprocess_env(), timeout=120)
    assert "REFUSED" in proc.stdout and "character device" in proc.stdout, proc.stderr[-2000:]


def test_import_caps_file_size(cache: PersistentCache, tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch) -> None:
    doc = tmp_path / "big.json"
    doc.write_text(json.dumps(export_doc([entry(i) for i in range(1, 40)])))
    monkeypatch.setattr(persistent_module, "MAX_IMPORT_BYTES", doc.stat().st_size - 1)
    with pytest.raises(CacheError, match="limit"):
        cache.import_(doc)
    assert [e.call_key for e in cache.entries()] == [KEY]
    monkeypatch.setattr(persistent_module, "MAX_IMPORT_BYTES", doc.stat().st_size)
    assert cache.import_(doc) == 39



# ---------------------------------------------------------------- 7. export targets


def test_export_through_a_symlink_keeps_the_link(cache: PersistentCache, tmp_path: pathlib.Path) -> None:
    real = tmp_path / "real" / "configs.json"
    real.parent.mkdir()
    real.write_text("old")
    os.chmod(real, 0o640)
    link = tmp_path / "link.json"
    link.symlink_to(real)
    assert cache.export(link) == 1
    assert link.is_symlink() and os.readlink(link) == str(real)
    assert json.loads(real.read_text())["entries"][0]["call_key"] == KEY
    assert stat.S_IMODE(real.stat().st_mode) == 0o640  # a replaced file keeps its mode
    assert sorted(p.name for p in real.parent.iterdir()) == ["configs.json"]  # no temporary left


@pytest.mark.parametrize("umask, mode", [(0o022, 0o644), (0o077, 0o600), (0o002, 0o664)])
def test_export_honours_the_umask_for_new_files(cache: PersistentCache, tmp_path: pathlib.Path, umask: int, mode: int) -> None:
    old = os.umask(umask)
    try:
        cache.export(tmp_path / "new.json")
    finally:
        os.umask(old)
    assert stat.S_IMODE((tmp_path / "new.json").stat().st_mode) == mode


def test_export_refuses_special_targets(cache: PersistentCache, tmp_path: pathlib.Path) -> None:
    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)
    targets = [fifo, tmp_path]
    device = tmp_path / "null"
    try:
        os.mknod(device, stat.S_IFCHR | 0o666, os.makedev(1, 3))  # /dev/null's numbers
        targets.append(device)
    except (PermissionError, OSError):
        pass  # not root: the FIFO and the directory still show the rule
    link = tmp_path / "to-pipe"
    link.symlink_to(fifo)
    targets.append(link)
    for target in targets:
        with pytest.raises(CacheError, match="not a regular file"):
            cache.export(target)
    assert stat.S_ISFIFO(fifo.stat().st_mode) and link.is_symlink()
    if device.exists():
        assert stat.S_ISCHR(device.stat().st_mode)
    assert not [p for p in tmp_path.iterdir() if p.name.endswith(".tmp")]



# ---------------------------------------------------------------- fuzz: import never breaks the cache


FIELDS = ["device", "op_id", "call_key", "config", "config_type", "provenance", "stats", "kernel_version",
          "jax_version", "jaxlib_version", "created"]
fuzz_entry = st.one_of(
    # Well-formed entries around an arbitrary config (which import stores without decoding) ...
    st.builds(lambda i, cfg: entry(i, config=cfg), st.integers(0, 6), json_value),
    st.builds(lambda i, stats: entry(i, stats=stats), st.integers(0, 6), st.dictionaries(st.text(max_size=3), json_value, max_size=2)),
    # ... and entries with arbitrary fields replaced or missing.
    st.builds(
        lambda i, changes, dropped: {k: v for k, v in {**entry(i), **changes}.items() if k not in dropped},
        st.integers(0, 6),
        st.dictionaries(st.sampled_from(FIELDS), json_value, max_size=2),
        st.sets(st.sampled_from(FIELDS), max_size=1),
    ),
)
fuzz_document = st.one_of(
    st.builds(lambda entries: json.dumps(export_doc(entries)), st.lists(fuzz_entry, max_size=3)),
    st.builds(lambda entries: json.dumps(export_doc(entries)), st.lists(fuzz_entry, max_size=3)),
    st.builds(lambda doc: json.dumps(doc), st.fixed_dictionaries({"format": st.sampled_from(["ejlabel-configs", "x"]),
                                                                  "version": json_value, "entries": json_value})),
    json_value.map(json.dumps),
    st.integers(0, 3000).map(lambda n: json.dumps(export_doc([entry(1, config={"d": 0})])).replace('{"d": 0}', "[" * n + "]" * n)),
    st.binary(max_size=64).map(lambda b: b.decode("latin-1")),
)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(text=fuzz_document, overwrite=st.booleans())
def test_fuzz_import_succeeds_or_raises_cache_error_and_keeps_entries(tmp_path: pathlib.Path, text: str, overwrite: bool) -> None:
    with tempfile.TemporaryDirectory(dir=tmp_path) as work:
        work_dir = pathlib.Path(work)
        doc = work_dir / "doc.json"
        doc.write_bytes(text.encode("utf-8", "surrogatepass"))
        with PersistentCache(work_dir / "c.sqlite") as c, warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)
            for i in range(3):  # previously committed; call keys 0-2 also occur in the documents
                c.put(DEV, "good@v1", call_key(i), GoodConfig(100 + i))
            before = {(e.device, e.op_id, e.call_key): e for e in c.entries(include_undecodable=True)}
            try:
                c.import_(doc, overwrite=overwrite)
            except CacheError:
                event("refused")
                assert {(e.device, e.op_id, e.call_key): e for e in c.entries(include_undecodable=True)} == before
                return
            event("imported")
            after = {(e.device, e.op_id, e.call_key): e for e in c.entries(include_undecodable=True)}
            assert set(before) <= set(after)
            if not overwrite:
                assert all(after[k] == e for k, e in before.items())
            # Whatever was imported lists, looks up and exports, and the export imports again.
            for key in after:
                c.get(key)
            count = c.export(work_dir / "again.json")
            assert count == len(after)
            with PersistentCache(work_dir / "d.sqlite") as d:
                assert d.import_(work_dir / "again.json") == count



# ---------------------------------------------------------------- 12. an imported entry's version must be its op id's


@pytest.mark.parametrize("kernel_version, accepted", [("1", True), ("1.custom", True), ("2", False), ("10", False), ("0.9", False)])
def test_import_checks_kernel_version_against_the_op_id(cache: PersistentCache, tmp_path: pathlib.Path, kernel_version: str, accepted: bool) -> None:
    doc = tmp_path / "versions.json"
    doc.write_text(json.dumps(export_doc([entry(1), entry(2, kernel_version=kernel_version)])))  # op_id good@v1
    before = cache.entries(include_undecodable=True)
    if accepted:
        assert cache.import_(doc) == 2
        return
    with pytest.raises(CacheError, match=rf"entries\[1\]\.kernel_version is '{re.escape(kernel_version)}', but op_id good@v1 is version 1"):
        cache.import_(doc)
    assert cache.entries(include_undecodable=True) == before


# ================================================================ the second round (issue 45)
# ---------------------------------------------------------------- 2. escape codes from a cache file

ESCAPES = "\x1b[2J\x1b]0;title\x07\x1b]52;c;cHduZWQ=\x07\r\u202e"  # clear, title, clipboard, return, reorder


def _no_escape_reaches(text: str) -> None:
    for char in ("\x1b", "\x07", "\r", "\u202e", "\x9b"):
        assert char not in text, f"{char!r} reached the output: {text[:400]!r}"


def test_cache_ls_shows_escape_codes_from_the_file_inert(tmp_path: pathlib.Path) -> None:
    from hostile import run_cli

    cache_dir = tmp_path / "c"
    with PersistentCache(cache_dir) as c:
        c.put(DEV, "good@v1", KEY, GoodConfig(3))
        # What an import used to accept, and an older writer may have left: escapes in every text column.
        raw_insert(c.path, (f"dev{ESCAPES}", "good@v1", call_key(1)), '{"$dataclass":"x:Y","fields":{}}',
                   config_type=f"x:Y{ESCAPES}", provenance=f"tuned{ESCAPES}")
        raw_insert(c.path, (DEV, f"op{ESCAPES}@v1", call_key(2)), "[1,", config_type=f"x{ESCAPES}")
    for command in (["cache", "ls"], ["cache", "show", call_key(1)], ["cache", "show", call_key(2)], ["cache", "stats"]):
        proc = run_cli(["--import", "hostile", "--cache-dir", str(cache_dir), *command])
        assert proc.returncode == 0, proc.stderr
        _no_escape_reaches(proc.stdout + proc.stderr)
    listed = run_cli(["--import", "hostile", "--cache-dir", str(cache_dir), "cache", "ls"]).stdout
    assert "\\x1b[2J" in listed and "\\x07" in listed and "\\u202e" in listed  # shown, as what they are
    assert listed.count("\n") == 3  # one line per entry: no line break or return from the file


@pytest.mark.parametrize("op_id", ["x\x1b[2J@v1", "a b{c}@v1", "op@v1\n", "op@v1:0123456789abcdef", "op@v", "#op@v1", ""])
def test_import_and_put_refuse_op_ids_a_label_cannot_carry(cache: PersistentCache, tmp_path: pathlib.Path, op_id: str) -> None:
    doc = tmp_path / "ops.json"
    doc.write_text(json.dumps(export_doc([entry(1), entry(2, op_id=op_id)])))
    before = cache.entries(include_undecodable=True)
    with pytest.raises(CacheError, match=r"entries\[1\]: op_id"):
        cache.import_(doc)
    with pytest.raises(ValueError, match="op_id"):
        cache.put(DEV, op_id, call_key(3), GoodConfig(1), kernel_version="1")
    assert cache.entries(include_undecodable=True) == before
    cache.put(DEV, "name.bwd@v1.2-rc_1", call_key(4), GoodConfig(1))  # what labels carry is accepted
    cache.put(DEV, "bare-name", call_key(5), GoodConfig(1), kernel_version="7")  # ejkernel's bare op names too


# ---------------------------------------------------------------- 5. export writes only what import reads


def test_export_refuses_what_import_would_refuse_and_exports_in_parts(tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch) -> None:
    with PersistentCache(tmp_path / "c") as c:
        for i in range(30):
            c.put(DEV if i % 2 else "other-device", "good@v1" if i % 3 else "other@v1", call_key(i), GoodConfig(i))
        whole = tmp_path / "whole.json"
        assert c.export(whole) == 30
        size = whole.stat().st_size
        monkeypatch.setattr(persistent_module, "MAX_IMPORT_BYTES", size - 1)  # the cap of both sides
        whole.write_text("old")
        with pytest.raises(CacheError, match=r"the 30 entries take \d+ bytes, more than the \d+ bytes an import reads.*--device"):
            c.export(whole)
        assert whole.read_text() == "old"  # refused before anything was written
        parts = [(tmp_path / f"{d}-{o}.json", d, o) for d in (DEV, "other-device") for o in ("good@v1", "other@v1")]
        assert sum(c.export(path, device=d, op_id=o) for path, d, o in parts) == 30
    with PersistentCache(tmp_path / "d") as d:
        assert sum(d.import_(path) for path, _, _ in parts) == 30  # every part imports again
        assert {e.call_key for e in d.entries()} == {call_key(i) for i in range(30)}
    with pytest.raises(ValueError, match="device"):
        PersistentCache(tmp_path / "d").export(tmp_path / "x.json", device="")


def test_export_of_many_entries_imports_again(tmp_path: pathlib.Path) -> None:
    """One line per entry: the size import reads holds far more entries than the indented form did."""
    n = 20_000
    with PersistentCache(tmp_path / "c") as c:
        rows = [(DEV, "good@v1", call_key(i), to_json(GoodConfig(i)), "hostile:GoodConfig", "autotuned",
                 json.dumps({"median_ms": 0.01 * i, "candidates": [{"cfg": {"tile": i}, "status": "ok"}]}),
                 "1", "j", "jl", 1.0) for i in range(n)]
        with sqlite3.connect(c.path) as raw:  # many rows at once, as years of tuning leave them
            raw.executemany("INSERT INTO configs VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)", rows)
        raw.close()
        assert c.export(tmp_path / "all.json") == n
    per_entry = (tmp_path / "all.json").stat().st_size / n
    assert persistent_module.MAX_IMPORT_BYTES / per_entry > 150_000  # the 130,000-entry cache fits
    with PersistentCache(tmp_path / "d") as d:
        assert d.import_(tmp_path / "all.json") == n


def test_a_key_twice_in_an_import_is_refused(cache: PersistentCache, tmp_path: pathlib.Path) -> None:
    doc = tmp_path / "twice.json"
    doc.write_text(json.dumps(export_doc([entry(1), entry(2), entry(1, config={"$dataclass": "hostile:GoodConfig", "fields": {"tile": 9}})])))
    before = cache.entries(include_undecodable=True)
    with pytest.raises(CacheError, match=r"entries\[2\] has the key of entries\[0\]"):
        cache.import_(doc, overwrite=True)
    doc.write_text(json.dumps(export_doc([entry(1)])).replace('"op_id": "good@v1"', '"op_id": "good@v1", "op_id": "evil@v1"'))
    with pytest.raises(CacheError, match="member name 'op_id' appears twice"):
        cache.import_(doc)
    assert cache.entries(include_undecodable=True) == before


# ---------------------------------------------------------------- 6. an entry of the wrong type is shown as such


def test_cache_ls_shows_an_entry_of_the_wrong_type(tmp_path: pathlib.Path) -> None:
    import jax.numpy as jnp

    from ejlabel.kernels.matmul import MatmulKernel
    from ejlabel.kernels.norms import NormConfig
    from hostile import run_cli

    inv = Invocation(MatmulKernel(), (jnp.ones((4, 8)), jnp.ones((8, 4))))
    with PersistentCache(tmp_path / "c") as pc:
        pc.put(*inv.cache_key, NormConfig("xla"))  # a NormConfig under a matmul key
    proc = run_cli(["--cache-dir", str(tmp_path / "c"), "cache", "ls"])
    assert proc.returncode == 0, proc.stderr
    assert "WRONG TYPE: NormConfig(" in proc.stdout and "matmul@v1 takes a MatmulConfig config" in proc.stdout


# ---------------------------------------------------------------- 7. a read-only cache, a damaged log


def _filled(path: pathlib.Path, n: int = 3) -> pathlib.Path:
    with PersistentCache(path) as c:
        for i in range(n):
            c.put(DEV, "good@v1", call_key(i), GoodConfig(i))
    return path


def test_a_cache_that_cannot_be_written_opens_read_only(tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import ejlabel.config.persistent.cache as cache_module

    _filled(tmp_path / "c")
    # As root, permission bits do not stop writes: the check is replaced, and what it decides is tested.
    monkeypatch.setattr(cache_module, "can_write", lambda path: False)
    database = tmp_path / "c" / "configs.sqlite"
    before = (database.read_bytes(), database.stat().st_mtime_ns)
    with PersistentCache(tmp_path / "c") as c:
        assert c.read_only
        assert [e.config for e in c.entries()] == [GoodConfig(i) for i in range(3)]
        assert c.get(DEV, "good@v1", call_key(1)) == GoodConfig(1) and c.stats()["entries"] == 3
        for write in (lambda: c.put(DEV, "good@v1", call_key(9), GoodConfig(9)), lambda: c.delete(DEV, "good@v1", call_key(1)), c.clear):
            with pytest.raises(CacheError, match="read-only"):
                write()
    assert (database.read_bytes(), database.stat().st_mtime_ns) == before
    log = database.with_name("configs.sqlite-wal")  # SQLite may make an empty one where it can
    assert not log.exists() or log.stat().st_size == 0
    monkeypatch.setattr(cache_module, "can_write", lambda path: True)
    assert not PersistentCache(tmp_path / "c").read_only


def test_a_cache_on_a_read_only_mount_is_listed_shown_counted_and_audited(tmp_path: pathlib.Path) -> None:
    """A real read-only mount (a bind mount remounted read-only, in a mount namespace of its own):
    permission bits do not stop root, a read-only file system does."""
    from hostile import EJLABEL, LABELLED, hlo_module

    if subprocess.run(["unshare", "--mount", "true"], capture_output=True, check=False).returncode != 0:
        pytest.skip("no mount namespace here (unshare --mount); test_a_cache_that_cannot_be_written_opens_read_only covers the rule")
    folder = _filled(tmp_path / "ro")
    program = tmp_path / "p.hlo"
    program.write_text(hlo_module("%p = f32[4]{0} parameter(0)", f"ROOT %a = f32[4]{{0}} add(%p, %p), {LABELLED}"))
    commands = [["cache", "ls"], ["cache", "show", call_key(1)], ["cache", "stats"], ["audit", str(program)], ["cache", "clear", "--yes"]]
    script = f"mount --bind {folder} {folder} && mount -o remount,bind,ro {folder} || exit 90\n" + "\n".join(
        f"{EJLABEL} --import hostile --cache-dir {folder} {' '.join(command)}; echo \"rc=$?\"" for command in commands
    )
    proc = subprocess.run(["unshare", "--mount", "sh", "-c", script], capture_output=True, text=True, check=False, env=subprocess_env(), timeout=600)
    if proc.returncode == 90:
        pytest.skip(f"cannot mount here: {proc.stderr.strip()[:200]}")
    codes = re.findall(r"rc=(\d+)", proc.stdout)
    assert codes == ["0", "0", "0", "0", "1"], proc.stdout + proc.stderr
    assert "GoodConfig(tile=2)" in proc.stdout and '"entries": 3' in proc.stdout and "1 kernel call sites" in proc.stdout
    assert "read-only" in proc.stderr  # clear is refused, saying why
    assert PersistentCache(folder).stats()["entries"] == 3


def test_damage_in_the_write_ahead_log_is_reported(tmp_path: pathlib.Path) -> None:
    import shutil

    live = tmp_path / "live"
    writer = PersistentCache(live)
    for i in range(20):  # far fewer pages than a checkpoint waits for: every put stays in the log
        writer.put(DEV, "good@v1", call_key(i), GoodConfig(i))
    copies = {}
    for name in ("intact", "damaged", "header"):  # the files as a crash leaves them: log not checkpointed
        copies[name] = tmp_path / name
        copies[name].mkdir()
        for suffix in ("", "-wal"):
            shutil.copy(writer.path.with_name(writer.path.name + suffix), copies[name] / (writer.path.name + suffix))
    writer.close()
    log = bytearray((copies["damaged"] / "configs.sqlite-wal").read_bytes())
    log[len(log) // 2 : len(log) // 2 + 8] = b"\xa5" * 8  # random-looking bytes mid-log
    (copies["damaged"] / "configs.sqlite-wal").write_bytes(bytes(log))
    log[:4] = b"\x00\x00\x00\x00"  # and a log whose header is broken
    (copies["header"] / "configs.sqlite-wal").write_bytes(bytes(log))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert len(PersistentCache(copies["intact"]).entries()) == 20
    assert not [w for w in caught if "write-ahead log" in str(w.message)]
    for name, expected in (("damaged", r"fails its check after frame \d+: the \d+ transactions committed after it"),
                           ("header", "is damaged: its header is not a write-ahead log header")):
        with pytest.warns(RuntimeWarning, match=expected):
            survivors = len(PersistentCache(copies[name]).entries())
        assert survivors < 20  # what SQLite dropped, and the warning said so
