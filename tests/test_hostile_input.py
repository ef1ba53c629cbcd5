"""Hostile input: program files, dump folders, cache files, export documents and call
descriptions are data, and data never runs code, hangs, breaks the cache, or makes a call key
depend on call order.

Sections here carry the numbers of the "hostile input" issue (14); some items are tested in the
file that owns the behaviour. Every numbered item and the test(s) that reproduce it (``H`` is this
file, ``tests/test_hostile_input.py``):

====  ==================================  ==========================================================
item  defect                              tests
====  ==================================  ==========================================================
1     data imports any module             H::test_decoding_names_from_data_never_imports,
                                          H::test_cache_ls_of_a_hostile_cache_imports_nothing,
                                          H::test_audit_and_tune_of_a_program_naming_modules_import_nothing,
                                          H::test_kernels_register_themselves_with_their_config_types,
                                          H::test_explicit_registration_and_user_modules,
                                          H::test_put_refuses_a_config_that_would_not_read_back,
                                          test_calls.py::test_missing_kernel_module_is_a_clear_error,
                                          test_cli.py::test_audit_tune_audit_and_cache_commands
2     square-time regular expressions     test_labels.py::test_label_regex_runs_in_linear_time_on_adversarial_text,
                                          test_hlo_grammar.py::test_every_pattern_is_linear_on_hostile_input,
                                          test_hlo_grammar.py::test_parse_is_fast_on_hostile_input
3     race on a new cache                 H::test_32_processes_open_a_fresh_cache_at_once
4     unbounded reads                     H::test_import_refuses_special_files,
                                          H::test_import_of_dev_zero_is_refused_at_once,
                                          H::test_import_caps_file_size,
                                          H::test_program_reader_refuses_special_files_at_once,
                                          H::test_program_reader_caps_bytes_per_file_and_per_directory,
                                          H::test_directory_walk_skips_special_files_and_symlinked_directories,
                                          H::test_label_reader_of_paths_is_bounded_too,
                                          H::test_frontend_attributes_are_capped,
                                          test_cli.py::test_special_files_are_refused_at_once
5     one entry breaks the whole cache    H::test_import_refuses_deep_nesting_naming_the_entry,
                                          H::test_a_deep_entry_in_the_file_is_skipped_not_fatal
6     non-finite numbers                  H::test_import_refuses_non_finite_created,
                                          H::test_import_refuses_non_finite_numbers_in_configs_and_stats,
                                          H::test_old_rows_with_non_finite_time_do_not_break_export
7     export replaces the target          H::test_export_through_a_symlink_keeps_the_link,
                                          H::test_export_honours_the_umask_for_new_files,
                                          H::test_export_refuses_special_targets
8     call key depends on call order      H::test_call_keys_do_not_depend_on_call_order
9     label injection                     test_labels.py::test_kernel_names_the_readers_cannot_read_back_are_rejected,
                                          test_labels.py::test_versions_the_readers_cannot_read_back_are_rejected
10    markup injection                    H::test_markup_in_static_arguments_and_configs_renders_as_itself,
                                          H::test_cli_audit_of_a_foreign_program_with_markup,
                                          H::test_markdown_cells_keep_pipes_and_line_breaks_inside
11    graph crashes on parsed text        H::test_names_and_widths_the_graph_cannot_trust_are_parse_errors,
                                          H::test_cli_audit_and_tune_report_a_duplicate_name,
                                          H::test_fuzz_graph_and_audit_of_parsed_text_never_crash
12    cached configs are not checked      H::test_config_of_another_kernel_type_is_not_served,
                                          H::test_import_checks_kernel_version_against_the_op_id
13    CLI                                 test_cli.py::test_tune_of_unparseable_input_fails_like_audit,
                                          test_cli.py::test_bad_values_name_their_flag_and_debug_and_version_work_anywhere
                                          (--iters 0, --debug anywhere, --version, empty cache ls),
                                          test_cli.py::test_cache_show_takes_a_unique_key_prefix_and_a_closed_pipe_is_quiet,
                                          test_cli.py::test_importing_nothing_new_mentions_overwrite,
                                          test_cli.py::test_tune_budget_report_names_what_it_skipped,
                                          test_tuning.py::test_budget_times_the_floor_first_counts_compile_time_and_says_what_it_skipped,
                                          test_tuning.py::test_budget_large_enough_times_everything_and_skips_nothing,
                                          test_tuning.py::test_max_configs_keeps_the_heuristic_and_xla_candidates
14    kernel inputs                       test_kernel_inputs.py::test_bad_arguments_name_the_argument,
                                          test_kernel_inputs.py::test_labels_to_configs_rejects_what_is_not_a_program,
                                          test_kernel_inputs.py::test_labels_to_configs_reads_every_program_form
====  ==================================  ==========================================================

Fuzz tests (hypothesis; each case bounded in time, the three together well under a minute on 2
cores): H::test_fuzz_import_succeeds_or_raises_cache_error_and_keeps_entries (cache import),
H::test_fuzz_graph_and_audit_of_parsed_text_never_crash (HLO reader, graph, audit),
H::test_fuzz_description_decoder_rebuilds_or_raises_call_decode_error (call descriptions; caps in
H::test_description_caps_and_long_numbers_are_decode_errors), and in the reader's own files
test_hlo.py::test_fuzz_parse_returns_module_or_parse_error and
test_hlo_grammar.py::test_truncations_raise_only_parse_errors.
"""
from __future__ import annotations

import dataclasses
import enum
import json
import multiprocessing
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
from conftest import run_python, subprocess_env
from ejlabel.config.persistent import CacheError, PersistentCache
from ejlabel.config.selection import ConfigSelectorChain
from ejlabel.core.kernel import Invocation, Kernel
from ejlabel.core.registry import (
    UnregisteredTypeError,
    config_type_problem,
    import_user_modules,
    kernel_config_types,
    register_config_type,
    registered_kernel,
)
from ejlabel.utils.serialize import MAX_DEPTH, DecodeError, from_json, from_jsonable, is_registered, resolve_path, to_json

DEV = "cpu:hostile:fp0"
KEY = "0123456789abcdef"
EJLABEL = str(pathlib.Path(sys.executable).with_name("ejlabel"))


@register_config_type
@dataclasses.dataclass(frozen=True)
class GoodConfig:
    tile: int = 8


def call_key(i: int) -> str:
    return f"{i:016x}"


def raw_insert(path: pathlib.Path, key: tuple[str, str, str], config_json: str, *, config_type: str = "x:Y",
               created: float = 1.0, stats_json: str | None = None) -> None:
    """Write a row as a hostile (or older) writer could, bypassing every check of put()."""
    with sqlite3.connect(path) as raw:
        raw.execute(
            "INSERT OR REPLACE INTO configs VALUES (?, ?, ?, ?, ?, 'autotuned', ?, '1', 'j', 'jl', ?)",
            (*key, config_json, config_type, stats_json, created),
        )
    raw.close()


def export_doc(entries: list[dict]) -> dict:
    return {"format": "ejlabel-configs", "version": 1, "entries": entries}


def entry(i: int = 0, config: object = None, **overrides: object) -> dict:
    base = {
        "device": DEV, "op_id": "good@v1", "call_key": call_key(i),
        "config": {"$dataclass": f"{__name__}:GoodConfig", "fields": {"tile": i}} if config is None else config,
        "config_type": f"{__name__}:GoodConfig", "provenance": "autotuned", "stats": None,
        "kernel_version": "1", "jax_version": "j", "jaxlib_version": "jl", "created": 1.0,
    }
    base.update(overrides)
    return base


@pytest.fixture
def cache(tmp_path: pathlib.Path):
    with PersistentCache(tmp_path / "cache.sqlite") as c:
        c.put(DEV, "good@v1", KEY, GoodConfig(3))
        yield c


# ---------------------------------------------------------------- 1. data imports no module


EVIL_MODULE = textwrap.dedent(
    """
    import dataclasses, enum, pathlib
    pathlib.Path(__file__).with_name("IMPORTED").write_text("the module ran")

    @dataclasses.dataclass
    class Cfg:
        x: int = 0

    class Mode(enum.Enum):
        A = 1

    def geohash():
        return 0
    """
)


@pytest.fixture
def evil_module(tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch) -> tuple[str, pathlib.Path]:
    """An importable module that leaves a marker file when it is imported."""
    folder = tmp_path / "evil"
    folder.mkdir()
    name = f"evil_{os.getpid()}_{abs(hash(str(tmp_path))) % 10**8}"
    (folder / f"{name}.py").write_text(EVIL_MODULE)
    monkeypatch.syspath_prepend(str(folder))
    return name, folder / "IMPORTED"


def hostile_configs(module: str) -> list[dict]:
    return [
        {"$ref": f"{module}:geohash"},
        {"$dataclass": f"{module}:Cfg", "fields": {"x": 1}},
        {"$enum": f"{module}:Mode", "name": "A"},
        {"$tuple": [{"$ref": "this:s"}]},  # `this` prints the Zen of Python when imported
    ]


def test_decoding_names_from_data_never_imports(cache: PersistentCache, evil_module, tmp_path: pathlib.Path) -> None:
    name, marker = evil_module
    assert "this" not in sys.modules
    configs = hostile_configs(name)
    for i, cfg in enumerate(configs):
        raw_insert(cache.path, (DEV, "good@v1", call_key(100 + i)), json.dumps(cfg), config_type=f"{name}:Cfg")
        with pytest.raises(UnregisteredTypeError, match=f"{name}|this:s") as info:
            from_json(json.dumps(cfg))
        assert isinstance(info.value, ValueError) and "not registered" in str(info.value)
    doc = tmp_path / "hostile.json"
    doc.write_text(json.dumps(export_doc([entry(200 + i, cfg) for i, cfg in enumerate(configs)])))

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        assert [e.call_key for e in cache.entries()] == [KEY]  # the usable entry only
        listed = cache.entries(include_undecodable=True)
        assert cache.get(DEV, "good@v1", call_key(100)) is None
        assert cache.import_(doc) == len(configs)  # kept as data, listed as undecodable
        cache.export(tmp_path / "out.json")
    bad = [e for e in listed if e.status == "undecodable"]
    assert len(bad) == len(configs) and all(e.config is None and "not registered" in e.error for e in bad)
    assert [e.status for e in listed if e.call_key == KEY] == ["ok"]
    for path in (f"{name}:geohash", "antigravity:geohash", "os:system"):
        with pytest.raises(UnregisteredTypeError):
            resolve_path(path)
        with pytest.raises(UnregisteredTypeError, match="--import"):
            registered_kernel(path)
    assert not marker.exists() and name not in sys.modules and "this" not in sys.modules
    assert "antigravity" not in sys.modules


def test_cache_ls_of_a_hostile_cache_imports_nothing(tmp_path: pathlib.Path, evil_module) -> None:
    name, marker = evil_module
    with PersistentCache(tmp_path / "c") as c:
        c.put(DEV, "good@v1", KEY, GoodConfig(1))
        for i, cfg in enumerate(hostile_configs(name)):
            raw_insert(c.path, (DEV, "good@v1", call_key(i + 1)), json.dumps(cfg))
    env = subprocess_env(PYTHONPATH=os.pathsep.join([str(marker.parent), subprocess_env()["PYTHONPATH"]]))
    proc = subprocess.run([EJLABEL, "--cache-dir", str(tmp_path / "c"), "cache", "ls"], capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert not marker.exists()
    assert "Zen of Python" not in proc.stdout + proc.stderr


def test_kernels_register_themselves_with_their_config_types() -> None:
    import toy_kernels

    import ejlabel.kernels as builtin
    from ejlabel.utils.params import FwdParams

    assert registered_kernel("toy_kernels:ScaleKernel") is toy_kernels.ScaleKernel
    assert kernel_config_types(toy_kernels.ScaleKernel) == (toy_kernels.ScaleConfig,)
    assert registered_kernel("ejlabel.kernels.norms:RMSNormKernel") is builtin.RMSNormKernel
    assert kernel_config_types(builtin.RMSNormKernel) == (builtin.NormConfig,)  # through _NormKernel
    assert kernel_config_types(builtin.AttentionKernel) == (builtin.AttentionConfig,)
    assert is_registered(builtin.AttentionConfig) and is_registered(FwdParams)  # nested field types too
    cfg = builtin.AttentionConfig()
    assert from_json(to_json(cfg)) == cfg

    class Local(Kernel[GoodConfig, object]):
        def run(self, x, *, cfg):
            return x

    assert kernel_config_types(Local) == (GoodConfig,)  # usable in-process ...
    with pytest.raises(UnregisteredTypeError):  # ... but data cannot name it
        registered_kernel(f"{__name__}:Local")

    @dataclasses.dataclass(frozen=True)
    class LocalConfig:
        n: int = 1

    class LocalToo(Kernel[LocalConfig, object]):  # a config class with no name: still definable
        def run(self, x, *, cfg):
            return x

    assert kernel_config_types(LocalToo) == (LocalConfig,) and not is_registered(LocalConfig)


def test_explicit_registration_and_user_modules() -> None:
    class Layout(enum.Enum):
        ROW = 1

    @dataclasses.dataclass(frozen=True)
    class Unregistered:
        n: int = 1

    with pytest.raises(TypeError, match="importable name"):
        register_config_type(Unregistered)  # a local class: no name data could use
    (toy,) = import_user_modules(["toy_kernels"])
    assert toy.__name__ == "toy_kernels"
    with pytest.raises(ValueError, match="module name"):
        import_user_modules(["some/file.py"])
    with pytest.raises(ImportError, match="no_such_module_for_ejlabel"):
        import_user_modules(["no_such_module_for_ejlabel"])


@dataclasses.dataclass(frozen=True)
class UnregisteredConfig:  # module level, so it has a name, but nothing registered it
    n: int = 1


def test_put_refuses_a_config_that_would_not_read_back(cache: PersistentCache) -> None:
    with pytest.raises(UnregisteredTypeError, match="UnregisteredConfig is not registered"):
        cache.put(DEV, "good@v1", call_key(5), UnregisteredConfig())
    with pytest.raises(UnregisteredTypeError):
        cache.put(DEV, "good@v1", call_key(6), GoodConfig(tile=UnregisteredConfig()))  # nested
    assert [e.call_key for e in cache.entries(include_undecodable=True)] == [KEY]


def test_config_of_another_kernel_type_is_not_served(tmp_path: pathlib.Path) -> None:
    import jax.numpy as jnp

    from ejlabel.kernels.matmul import MatmulKernel
    from ejlabel.kernels.norms import NormConfig

    inv = Invocation(MatmulKernel(), (jnp.ones((4, 8)), jnp.ones((8, 4))))
    assert config_type_problem(inv.op_id, NormConfig("xla")) is not None
    with PersistentCache(tmp_path / "c") as pc:
        pc.put(*inv.cache_key, NormConfig("xla"))  # a NormConfig under a matmul key
        selector = ConfigSelectorChain(persistent=pc)
        with pytest.warns(RuntimeWarning, match="NormConfig"):
            chosen = selector.select(inv)
        assert chosen.provenance == "heuristic" and type(chosen.cfg).__name__ == "MatmulConfig"
        assert selector.cache.get(*inv.cache_key) is None  # not promoted to memory either


# ---------------------------------------------------------------- 3. a fresh cache opened by many processes


def _open_together(path: str, barrier, results) -> None:
    try:
        barrier.wait(60)
        with PersistentCache(path) as c:
            c.put(DEV, "race@v1", f"{os.getpid():016x}", {"pid": os.getpid()})
        results.put(None)
    except BaseException as err:  # reported to the parent, which asserts on it
        results.put(f"{type(err).__name__}: {err}")


@pytest.mark.skipif(sys.platform != "linux", reason="forks workers (fast start); Linux only")
def test_32_processes_open_a_fresh_cache_at_once(tmp_path: pathlib.Path) -> None:
    # Forked after the parent imported everything, so 32 workers start in milliseconds on a
    # small machine and really race; before the fix, 16 workers failed in ~20% of trials.
    ctx = multiprocessing.get_context("fork")
    n_proc, trials = 32, 8
    errors = []
    for trial in range(trials):
        path = str(tmp_path / f"fresh{trial}" / "c.sqlite")
        barrier, results = ctx.Barrier(n_proc), ctx.Queue()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # JAX warns about fork; the workers only use SQLite
            procs = [ctx.Process(target=_open_together, args=(path, barrier, results)) for _ in range(n_proc)]
            for p in procs:
                p.start()
        outcomes = [results.get(timeout=120) for _ in procs]
        for p in procs:
            p.join(30)
        errors += [f"trial {trial}: {o}" for o in outcomes if o is not None]
        with PersistentCache(path) as c:
            assert c.stats()["entries"] == n_proc - sum(o is not None for o in outcomes)
    assert errors == []


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
    worker = threading.Thread(target=lambda: _capture(outcome, lambda: cache.import_(fifo)), daemon=True)
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


def _capture(outcome: list, fn) -> None:
    try:
        outcome.append(fn())
    except BaseException as err:
        outcome.append(err)


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


# ---------------------------------------------------------------- 8. call keys independent of call order


ORDER_PROBE = """
import json, sys
import jax.numpy as jnp
import numpy as np
from ejlabel import Invocation
from toy_kernels import ScaleKernel
k, x = ScaleKernel(), jnp.ones((2,))
nan_a = np.frombuffer(np.uint64(0x7FF8000000000001).tobytes(), np.float64)[0]
nan_b = np.frombuffer(np.uint64(0x7FF8000000000002).tobytes(), np.float64)[0]
values = {{"0.0": 0.0, "-0.0": -0.0, "0j": 0j, "-0j": complex(0.0, -0.0), "np0": np.float64(0.0),
          "np-0": np.float64(-0.0), "nan_a": nan_a, "nan_b": nan_b}}
order = list(values) if {forward} else list(reversed(values))
print(json.dumps({{name: Invocation(k, (x,), {{"offset": values[name]}}).call_key for name in order}}))
"""


def test_call_keys_do_not_depend_on_call_order() -> None:
    forward = json.loads(run_python(ORDER_PROBE.format(forward=True)).strip().splitlines()[-1])
    backward = json.loads(run_python(ORDER_PROBE.format(forward=False)).strip().splitlines()[-1])
    assert forward == backward
    for a, b in [("0.0", "-0.0"), ("0j", "-0j"), ("np0", "np-0"), ("nan_a", "nan_b")]:
        assert forward[a] != forward[b], (a, b)


# ---------------------------------------------------------------- fuzz: import never breaks the cache


TAG_KEYS = ["$ref", "$dataclass", "$enum", "$tuple", "$float", "$dict", "$set", "$bytes", "$dtype", "$array", "$slice", "fields", "name"]
json_leaf = st.one_of(
    st.none(), st.booleans(), st.integers(-(2**70), 2**70), st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=6), st.sampled_from([f"{__name__}:GoodConfig", "os:system", "antigravity:geohash", "\ud800"]),
)


def _json_containers(inner: st.SearchStrategy) -> st.SearchStrategy:
    return st.one_of(
        st.lists(inner, max_size=3),
        st.dictionaries(st.one_of(st.text(max_size=4), st.sampled_from(TAG_KEYS)), inner, max_size=3),
    )


json_value = st.recursive(json_leaf, _json_containers, max_leaves=12)
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


# ---------------------------------------------------------------- 10. markup in data renders as itself


@dataclasses.dataclass(frozen=True)
class ModeConfig:
    note: str = ""


class ModeKernel(Kernel[ModeConfig, object]):
    """2 * x; its static keyword ``mode`` is any string and only reaches the call description."""

    def __init__(self) -> None:
        super().__init__("modek")

    def run(self, x, *, cfg: ModeConfig, mode: str = "plain"):
        return x * 2.0

    def heuristic_cfg(self, inv: Invocation) -> ModeConfig:
        return ModeConfig()


# Rich markup that fails ("[/]"), restyles ("[bold]"), links, or becomes an emoji (":smile:").
MARKUP = "[/]x[bold]:smile:[link=a]"
SAME_WIDTH = "y" * len(MARKUP)


def _mode_program(mode: str) -> object:
    import jax
    import jax.numpy as jnp

    return jax.jit(lambda x: ModeKernel()(x, mode=mode)).lower(jnp.ones((4,), jnp.float32))


def test_markup_in_static_arguments_and_configs_renders_as_itself(tmp_path: pathlib.Path) -> None:
    from ejlabel.analysis import audit

    reports = {}
    for mode in (MARKUP, SAME_WIDTH):
        with PersistentCache(tmp_path / mode[:1]) as pc:
            probe = audit(_mode_program(mode), selector=ConfigSelectorChain(persistent=pc))
            (row,) = probe.calls
            pc.put(probe.device, "modek@v1", row.call_key, ModeConfig(mode))  # markup in the config too
            reports[mode] = audit(_mode_program(mode), selector=ConfigSelectorChain(persistent=pc))
    bad, good = reports[MARKUP], reports[SAME_WIDTH]
    assert bad.calls[0].provenance == "persistent" and bad.calls[0].config == ModeConfig(MARKUP)
    text = bad.render(width=200)  # wide enough that no cell wraps
    assert f"mode='{MARKUP}'" in text and f"ModeConfig(note='{MARKUP}')" in text
    # Same layout, cell for cell, as a value of the same width with no markup in it.
    key_bad, key_good = bad.calls[0].call_key[:8], good.calls[0].call_key[:8]
    assert text == good.render(width=200).replace(SAME_WIDTH, MARKUP).replace(key_good, key_bad)
    assert bad.to_markdown() == good.to_markdown().replace(SAME_WIDTH, MARKUP).replace(key_good, key_bad)
    assert json.loads(bad.to_json())["arguments"] == {bad.calls[0].label: f"f32[4] mode='{MARKUP}'"}


def test_markdown_cells_keep_pipes_and_line_breaks_inside(tmp_path: pathlib.Path) -> None:
    from ejlabel.analysis import audit

    with PersistentCache(tmp_path / "c") as pc:
        report = audit(_mode_program("a|b"), selector=ConfigSelectorChain(persistent=pc))
        (row,) = report.calls
        pc.put(report.device, "modek@v1", row.call_key, ModeConfig("x\ny|"))
        report = audit(_mode_program("a|b"), selector=ConfigSelectorChain(persistent=pc))
    table = report.to_markdown().split("\n\n")[1].splitlines()
    assert len(table) == 3  # header, rule, one row: nothing from data ended the row
    assert table[2].replace("\\|", "").count("|") == table[0].count("|")  # nor added a column


def test_cli_audit_of_a_foreign_program_with_markup(tmp_path: pathlib.Path) -> None:
    # The file comes from another process; the auditing one has never heard of ModeKernel.
    program = tmp_path / "foreign.hlo.txt"
    program.write_text(_mode_program(MARKUP).compiler_ir("hlo").as_hlo_text())
    for form in ([], ["--markdown"]):
        proc = subprocess.run([EJLABEL, "--cache-dir", str(tmp_path / "c"), "audit", str(program), *form],
                              check=False, capture_output=True, text=True, env=subprocess_env(), timeout=300)
        assert proc.returncode == 0, proc.stderr
        assert f"mode='{MARKUP}'" in proc.stdout and "MarkupError" not in proc.stderr


# ---------------------------------------------------------------- 11. names and widths the graph cannot trust

LABELLED = 'frontend_attributes={ejlabel="ejkernel_ops#scale@v1:0123456789abcdef"}'


def _module(*body: str, params: str = "p: f32[4]") -> str:
    lines = "\n".join(f"  {line}" for line in body)
    return f"HloModule m\n\nENTRY %main ({params}) -> f32[4] {{\n{lines}\n}}\n"


NAME_AND_WIDTH_CASES = {
    "duplicate name": (_module("%p = f32[4]{0} parameter(0)", f"%a = f32[4]{{0}} add(%p, %p), {LABELLED}",
                               f"%a = f32[4]{{0}} multiply(%a, %a), {LABELLED}", "ROOT %r = f32[4]{0} negate(%a)"),
                       r"%a is defined twice in computation 'main' \(line 6"),
    "duplicate parameter": (_module("%p = f32[4]{0} parameter(0)", "%p = f32[4]{0} parameter(1)", f"ROOT %a = f32[4]{{0}} add(%p, %p), {LABELLED}"),
                            r"%p is defined twice .*line 5"),
    "use before definition": (_module("%p = f32[4]{0} parameter(0)", f"%a = f32[4]{{0}} add(%b, %p), {LABELLED}",
                                      f"%b = f32[4]{{0}} multiply(%p, %p), {LABELLED}", "ROOT %r = f32[4]{0} negate(%a)"),
                              r"operand %b of %a is used before its definition .*line 5"),
    "self use": (_module("%p = f32[4]{0} parameter(0)", f"ROOT %a = f32[4]{{0}} add(%a, %p), {LABELLED}"), r"%a of %a is used before"),
    "undefined operand": (_module("%p = f32[4]{0} parameter(0)", f"ROOT %a = f32[4]{{0}} add(%zz, %p), {LABELLED}"), r"%zz of %a is not defined"),
    "5000-digit width": (_module("%p = f32[4]{0} parameter(0)", f"ROOT %a = f{'9' * 5000}[4]{{0}} add(%p, %p), {LABELLED}"),
                         r"malformed element type"),
    "5000-digit parameter width": (_module(f"%p = s{'1' * 5000}[4]{{0}} parameter(0)", f"ROOT %a = f32[4]{{0}} convert(%p), {LABELLED}",
                                           params=f"p: s{'1' * 5000}[4]"), r"malformed element type"),
    "5000-digit width in a tuple": (_module(f"%p = (f32[4], u{'7' * 5000}[2]) parameter(0)", "ROOT %a = f32[4]{0} get-tuple-element(%p), index=0"),
                                    r"malformed element type"),
}


@pytest.mark.parametrize("case", sorted(NAME_AND_WIDTH_CASES))
def test_names_and_widths_the_graph_cannot_trust_are_parse_errors(case: str) -> None:
    from ejlabel.analysis import HloParseError, audit, call_graph, read_program

    text, message = NAME_AND_WIDTH_CASES[case]
    for read in (read_program, call_graph, lambda t: audit(t, selector=ConfigSelectorChain())):
        with pytest.raises(HloParseError, match=message):
            read(text)


def test_cli_audit_and_tune_report_a_duplicate_name(tmp_path: pathlib.Path) -> None:
    program = tmp_path / "dup.hlo"
    program.write_text(NAME_AND_WIDTH_CASES["duplicate name"][0])
    for command in (["audit"], ["tune", "--iters", "1"]):
        proc = subprocess.run([EJLABEL, "--cache-dir", str(tmp_path / "c"), *command, str(program)],
                              check=False, capture_output=True, text=True, env=subprocess_env(), timeout=300)
        assert proc.returncode == 1 and "Traceback" not in proc.stderr, proc.stderr
        assert f"ejlabel {command[0]}: error: HloParseError" in proc.stderr and "defined twice" in proc.stderr


_GRAPH_CORPUS: list[str] = []


def _graph_corpus() -> list[str]:
    """HLO of a small labelled model (two kernels, a loop, a shared call), lowered and compiled."""
    if not _GRAPH_CORPUS:
        import jax
        import jax.numpy as jnp
        from toy_kernels import double, loopsum, scale

        def model(x):
            return (loopsum(scale(x)).sum() + loopsum(double(x)).sum()) * 2.0

        lowered = jax.jit(jax.grad(model)).lower(jnp.ones((8, 16), jnp.float32))
        _GRAPH_CORPUS.extend([lowered.compiler_ir("hlo").as_hlo_text(), lowered.compile().as_text()])
    return _GRAPH_CORPUS


_NAME_TOKEN = re.compile(r"%[\w.\-]+")
graph_mutation = st.one_of(
    st.tuples(st.just("swap lines"), st.floats(0, 1)),  # a use before its definition
    st.tuples(st.just("duplicate line"), st.floats(0, 1)),  # a name defined twice
    st.tuples(st.just("rename"), st.floats(0, 1), st.floats(0, 1)),  # one name replaced by another
    st.tuples(st.just("drop line"), st.floats(0, 1)),  # an operand defined nowhere, a missing ROOT
    st.tuples(st.just("width"), st.floats(0, 1), st.sampled_from(["9" * 5000, "0", "7", "128"])),
    st.tuples(st.just("insert"), st.floats(0, 1), st.sampled_from(['"', "}", "{", ")", ",", "\n", "[/]", "%", "="])),
)


def _graph_mutate(text: str, mutation: tuple) -> str:
    kind, where = mutation[0], mutation[1]
    lines = text.split("\n")
    i = int(where * (len(lines) - 2))
    if kind == "swap lines":
        lines[i], lines[i + 1] = lines[i + 1], lines[i]
    elif kind == "duplicate line":
        lines.insert(i, lines[i])
    elif kind == "drop line":
        del lines[i]
    elif kind == "rename":
        names = _NAME_TOKEN.findall(lines[i])
        if names:
            other = _NAME_TOKEN.findall(text)
            lines[i] = lines[i].replace(names[0], other[int(mutation[2] * (len(other) - 1))], 1)
    elif kind == "width":
        lines[i] = re.sub(r"\b([fsu])\d+\[", lambda m: f"{m.group(1)}{mutation[2]}[", lines[i], count=1)
    else:
        at = int(where * len(text))
        return text[:at] + mutation[2] + text[at:]
    return "\n".join(lines)


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(base=st.integers(0, 1), mutations=st.lists(graph_mutation, min_size=1, max_size=4))
def test_fuzz_graph_and_audit_of_parsed_text_never_crash(base: int, mutations: list[tuple]) -> None:
    """Whatever text parses, the graph and the audit read it: HloParseError or a report, nothing else."""
    from ejlabel.analysis import HloParseError, audit, read_program

    text = _graph_corpus()[base]
    for mutation in mutations:
        text = _graph_mutate(text, mutation)
    try:
        program = read_program(text)
    except HloParseError:
        event("refused")
        return
    event("read")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        report = audit(program, selector=ConfigSelectorChain())
    assert isinstance(report.render(), str) and isinstance(report.to_markdown(), str)
    json.loads(report.to_json())


# ---------------------------------------------------------------- 4. unbounded reads of programs


SMALL_PROGRAM = _module("%p = f32[4]{0} parameter(0)", f"ROOT %a = f32[4]{{0}} add(%p, %p), {LABELLED}")


def test_program_reader_refuses_special_files_at_once(tmp_path: pathlib.Path) -> None:
    from ejlabel.analysis import ProgramReadError, read_program

    fifo = tmp_path / "pipe.hlo"
    os.mkfifo(fifo)
    outcome: list[BaseException | object] = []
    worker = threading.Thread(target=lambda: _capture(outcome, lambda: read_program(fifo)), daemon=True)
    worker.start()
    worker.join(20)
    if worker.is_alive():
        os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
        worker.join(5)
        pytest.fail("read_program blocked on a FIFO")
    (err,) = outcome
    assert isinstance(err, ProgramReadError) and "is a FIFO, not a program file" in str(err)
    with pytest.raises(ProgramReadError, match="/dev/zero is a character device"):
        read_program("/dev/zero")
    with pytest.raises(FileNotFoundError, match="no such file"):
        read_program(tmp_path / "missing.hlo")


def test_program_reader_caps_bytes_per_file_and_per_directory(tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import ejlabel.analysis.program as program_module
    from ejlabel.analysis import ProgramReadError, read_program

    folder = tmp_path / "two"
    folder.mkdir()
    for name in ("a.hlo", "b.hlo"):
        (folder / name).write_text(SMALL_PROGRAM)
    size = len(SMALL_PROGRAM.encode())
    monkeypatch.setattr(program_module, "MAX_PROGRAM_BYTES", size - 1)
    with pytest.raises(ProgramReadError, match="limit"):
        read_program(folder / "a.hlo")
    monkeypatch.setattr(program_module, "MAX_PROGRAM_BYTES", size)
    assert read_program(folder / "a.hlo").labels
    with pytest.raises(ProgramReadError, match="b.hlo takes the program past"):  # the cap is for all files together
        read_program(folder)
    monkeypatch.setattr(program_module, "MAX_PROGRAM_BYTES", 2 * size)
    assert len(read_program(folder).modules) == 2


def test_frontend_attributes_are_capped(monkeypatch: pytest.MonkeyPatch) -> None:
    import ejlabel.analysis.hlo as hlo_module
    from ejlabel.analysis import HloParseError, parse_hlo

    long_value = 'frontend_attributes={ejlabel="ejkernel_ops#scale@v1:0123456789abcdef",ejcall="' + "a" * 300 + '"}'
    text = _module("%p = f32[4]{0} parameter(0)", f"ROOT %a = f32[4]{{0}} add(%p, %p), {long_value}")
    assert parse_hlo(text).instructions()  # under the real cap
    monkeypatch.setattr(hlo_module, "MAX_ATTRIBUTE_CHARS", 200)
    with pytest.raises(HloParseError, match="MAX_ATTRIBUTE_CHARS"):
        parse_hlo(text)


def test_label_reader_of_paths_is_bounded_too(tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # labels_to_configs and find_labels read paths through core.labels, not the analysis reader:
    # the same cap over all files of a folder, and special files refused on the descriptor.
    import ejlabel.core.labels as labels_module

    folder = tmp_path / "dump"
    folder.mkdir()
    for name in ("a.txt", "b.txt"):
        (folder / name).write_text(SMALL_PROGRAM)
    size = len(SMALL_PROGRAM.encode())
    monkeypatch.setattr(labels_module, "MAX_PROGRAM_BYTES", size)
    assert labels_module.program_texts(folder / "a.txt") == [SMALL_PROGRAM]
    with pytest.raises(ValueError, match="b.txt takes the program past"):
        labels_module.program_texts(folder)
    monkeypatch.setattr(labels_module, "MAX_PROGRAM_BYTES", 2 * size)
    assert len(labels_module.program_texts(folder)) == 2
    os.mkfifo(folder / "c.txt")
    assert len(labels_module.program_texts(folder)) == 2  # a FIFO in a folder is passed over, never opened
    with pytest.raises(ValueError, match="special files are never read"):
        labels_module.program_texts(folder / "c.txt")


def test_directory_walk_skips_special_files_and_symlinked_directories(tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import ejlabel.analysis.program as program_module
    from ejlabel.analysis import ProgramReadError, read_program

    folder = tmp_path / "dump"
    (folder / "sub").mkdir(parents=True)
    (folder / "sub" / "m.hlo").write_text(SMALL_PROGRAM)
    os.mkfifo(folder / "sub" / "pipe.hlo")
    (folder / "sub" / "loop").symlink_to(folder)  # a cycle, if it were followed
    (folder / "zero.hlo").symlink_to("/dev/zero")
    program = read_program(folder)
    assert [pm.source for pm in program.modules] == [str(folder / "sub" / "m.hlo")]
    notes = "\n".join(program.notes)
    assert "pipe.hlo: a FIFO, not read" in notes and "zero.hlo: a symlink" in notes and "loop: a symlink" in notes
    monkeypatch.setattr(program_module, "MAX_DIRECTORY_ENTRIES", 3)
    with pytest.raises(ProgramReadError, match="more than 3 entries"):
        read_program(folder)


# ---------------------------------------------------------------- fuzz: the call-description decoder


def _b64(data: bytes) -> str:
    import base64

    return base64.urlsafe_b64encode(data).decode("ascii").rstrip("=")


DESCRIBED_LABELS = [
    "ejkernel_ops#scale@v1:0123456789abcdef",
    "ejkernel_ops#scale.bwd@v1:0123456789abcdef",
    "ejkernel_ops#matmul@v2:fedcba9876543210",
    "ejkernel_ops#nosuch@v9:0000000000000000",
]
KERNEL_NAMES = st.sampled_from([
    "toy_kernels:ScaleKernel", "toy_kernels:MatmulKernel", "ejlabel.kernels.matmul:MatmulKernel",
    "toy_kernels:ScaleConfig", "os:system", "antigravity:geohash", "this:s", "toy_kernels", ":", "a:b:c", "",
])
ARRAYS = st.builds(lambda dtype, dims, weak: {"$array": f"{dtype}[{','.join(dims)}]" + ("w" if weak else "")},
                   st.sampled_from(["float32", "bfloat16", "int32", "float0", "nosuchtype", "f32"]),
                   st.lists(st.sampled_from(["0", "1", "4", "-1", "9" * 30, "9" * 5000, ""]), max_size=3), st.booleans())
description_value = st.one_of(json_value, ARRAYS, st.lists(ARRAYS, max_size=3), st.dictionaries(st.text(max_size=4), ARRAYS, max_size=2))
description_list = st.builds(
    lambda fmt, kernel, args, kwargs, axes, shardings, extra: [fmt, kernel, args, kwargs, axes, shardings][: 6 + extra] + [0] * max(0, extra),
    st.sampled_from([1, 1, 1, 0, 2, "1", None]), st.one_of(KERNEL_NAMES, json_value), st.one_of(st.lists(description_value, max_size=3), json_value),
    st.one_of(st.dictionaries(st.sampled_from(["offset", "mode", "$ref", "cfg", "x"]), description_value, max_size=3), json_value),
    json_value, st.one_of(st.none(), st.lists(st.one_of(st.none(), st.text(max_size=8)), max_size=3), json_value),
    st.integers(-2, 1),
)


def _corrupt(text: str, cut: float, junk: str) -> str:
    at = int(cut * len(text))
    return text[:at] + junk + text[at:]


VALID_ARRAY = st.builds(lambda dtype, dims: {"$array": f"{dtype}[{','.join(map(str, dims))}]"},
                       st.sampled_from(["float32", "bfloat16", "int32"]), st.lists(st.integers(0, 64), max_size=3))
TOY_OPS = {"toy_kernels:ScaleKernel": "scale", "toy_kernels:MatmulKernel": "toymatmul", "toy_kernels:LoopSumKernel": "loopsum"}
well_formed = st.builds(  # shaped like a real description, with arbitrary values inside
    lambda kernel, args, kwargs, axes: [1, kernel, args, kwargs, axes, None],
    st.sampled_from(sorted(TOY_OPS)),
    st.lists(st.one_of(VALID_ARRAY, VALID_ARRAY, json_value), max_size=3),
    st.dictionaries(st.sampled_from(["offset", "mode", "x"]), st.one_of(st.floats(-1e3, 1e3), st.integers(), st.text(max_size=4),
                                                                       st.none(), json_value, VALID_ARRAY), max_size=2),
    st.one_of(st.none(), json_value),
)
description_text = st.one_of(
    well_formed.map(lambda d: _b64(json.dumps(d).encode())),
    description_list.map(lambda d: _b64(json.dumps(d).encode())),
    st.builds(_corrupt, description_list.map(lambda d: _b64(json.dumps(d).encode())), st.floats(0, 1), st.text(max_size=4)),
    json_value.map(lambda d: _b64(json.dumps(d).encode())),
    st.binary(max_size=64).map(_b64),
    st.text(max_size=40),
    st.integers(0, 3000).map(lambda n: _b64(("[1," + "[" * n + "]" * n + "]").encode())),
    st.sampled_from([_b64(b'[1,"toy_kernels:ScaleKernel",[{"$array":"float32[3]"}],{"offset":NaN},null,null]'),
                     _b64(b'[1,"toy_kernels:ScaleKernel",[{"$array":"float32[3]"}],{"offset":1e999},null,null]'),
                     _b64(b'[1,"toy_kernels:ScaleKernel",[' + b"1" * 5000 + b"],{},null,null]")]),
)


description_case = st.one_of(
    # The label of the kernel the description names, as a real program pairs them ...
    well_formed.map(lambda d: (f"ejkernel_ops#{TOY_OPS[d[1]]}@v1:0123456789abcdef", _b64(json.dumps(d).encode()))),
    # ... and any label next to any text.
    st.tuples(st.sampled_from(DESCRIBED_LABELS), description_text),
)


@settings(max_examples=500, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(case=description_case)
def test_fuzz_description_decoder_rebuilds_or_raises_call_decode_error(case: tuple[str, str]) -> None:
    import time

    import toy_kernels  # noqa: F401  (registers the kernels that valid descriptions name)

    from ejlabel.core.calls import CallDecodeError, invocation_from_description

    lab, text = case
    start = time.perf_counter()
    try:
        inv = invocation_from_description(lab, text)
    except CallDecodeError as err:
        event("refused")
        assert str(err)
    else:
        event("rebuilt")
        assert isinstance(inv, Invocation) and lab.endswith(inv.call_key)
    assert time.perf_counter() - start < 5.0  # per case; typical cases take well under 10 ms
    assert "this" not in sys.modules and "antigravity" not in sys.modules


def test_description_caps_and_long_numbers_are_decode_errors(monkeypatch: pytest.MonkeyPatch) -> None:
    import ejlabel.core.calls as calls_module
    from ejlabel.core.calls import CallDecodeError, decode_call

    lab = DESCRIBED_LABELS[0]
    text = _b64(b'[1,"toy_kernels:ScaleKernel",[{"$array":"float32[3]"}],{},null,null]')
    assert decode_call(text, lab).args[0].shape == (3,)
    monkeypatch.setattr(calls_module, "MAX_DESCRIPTION_CHARS", len(text) - 1)
    with pytest.raises(CallDecodeError, match="over the .* limit"):
        decode_call(text, lab)
    monkeypatch.undo()
    for dims in ("9" * 19, "9" * 5000):
        with pytest.raises(CallDecodeError, match=r"is not 'dtype\[d0,d1,...\]'"):
            decode_call(_b64(f'[1,"k:K",[{{"$array":"float32[{dims}]"}}],{{}},null,null]'.encode()), lab)
    with pytest.raises(DecodeError, match="dtype"):
        from_jsonable({"$array": "float32[" + "9" * 5000 + "]"})
    with pytest.raises(CallDecodeError, match="label"):
        decode_call(text, "not a label")


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


# ---------------------------------------------------------------- 1. (programs) a program naming a module runs nothing


def test_audit_and_tune_of_a_program_naming_modules_import_nothing(tmp_path: pathlib.Path) -> None:
    """A dump folder holding a module and a program whose call description names it (as the
    kernel and as a `$ref` argument): audit and tune run from inside the folder, where the
    module is importable (`python -m` puts the working directory on the path), import nothing."""
    import jax
    import jax.numpy as jnp
    from toy_kernels import scale

    from ejlabel.core.calls import encode_call

    folder = tmp_path / "dump"
    folder.mkdir()
    module = "dump_kernels"
    (folder / f"{module}.py").write_text(EVIL_MODULE)
    lowered = jax.jit(lambda x: scale(x)).lower(jnp.ones((4,), jnp.float32))
    real = encode_call(Invocation(scale, (jnp.ones((4,), jnp.float32),)))
    hostile = _b64(json.dumps([1, f"{module}:Cfg", [{"$array": "float32[4]"}], {"offset": {"$ref": f"{module}:geohash"}}, None, None]).encode())
    text = lowered.compiler_ir("hlo").as_hlo_text()
    assert real in text
    (folder / "module_0001.jit_f.cpu_after_optimizations.txt").write_text(text.replace(real, hostile))
    runs = [
        [EJLABEL, "--cache-dir", str(tmp_path / "c"), "audit", "."],
        [EJLABEL, "--cache-dir", str(tmp_path / "c"), "tune", ".", "--iters", "1"],
        [sys.executable, "-m", "ejlabel", "--cache-dir", str(tmp_path / "c"), "tune", ".", "--iters", "1"],
    ]
    outcomes = [subprocess.run(argv, cwd=folder, check=False, capture_output=True, text=True, env=subprocess_env(), timeout=300) for argv in runs]
    assert not (folder / "IMPORTED").exists()
    audit, *tunes = outcomes
    assert audit.returncode == 0, audit.stderr
    for tune in tunes:
        assert tune.returncode == 1 and "Traceback" not in tune.stderr
        assert f"{module}:" in tune.stderr and "is not registered" in tune.stderr and "decoding never imports" in tune.stderr


# ---------------------------------------------------------------- the table above stays true


def test_the_item_table_names_every_item_and_only_tests_that_exist() -> None:
    lines = __doc__.splitlines()
    rules = [i for i, line in enumerate(lines) if line.startswith("====  ")]
    items: dict[int, list[tuple[str, str]]] = {}
    current = 0
    for line in lines[rules[1] + 1 : rules[2]]:  # the rows, between the header rule and the closing one
        number = re.match(r"(\d+)\s", line)
        if number:
            current = int(number.group(1))
        items.setdefault(current, []).extend(re.findall(r"(H|test_\w+\.py)::(test_\w+)", line))
    assert sorted(k for k in items if k) == list(range(1, 15))
    tests = pathlib.Path(__file__).parent
    for item, named in items.items():
        assert named or not item, f"item {item} names no test"
        for file, test in named:
            source = (tests / ("test_hostile_input.py" if file == "H" else file)).read_text()
            assert re.search(rf"^def {test}\(", source, re.M), f"item {item}: {file}::{test} does not exist"
