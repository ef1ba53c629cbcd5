"""Hostile input: program files, dump folders, cache files, export documents and call
descriptions are data, and data never runs code, hangs, kills the process, breaks the cache, puts
an escape code on the terminal, or makes a call key depend on call order.

This module is the index of the two hostile-input issues: every case, and the test(s) that
reproduce it. The tests live by theme in ``tests/test_hostile_*.py``, some in the file that owns
the behaviour. In the tables ``H`` is this file, ``C`` ``test_hostile_cache.py`` (cache files and
export documents), ``P`` ``test_hostile_programs.py`` (program files, the readers, the graph and
the audit), ``T`` ``test_hostile_tuning.py`` (the tuners) and ``K`` ``test_hostile_kernels.py``
(kernel inputs, ``python -m``); their shared helpers are in ``tests/hostile.py``.

First round (issue 14):

====  ==================================  ==========================================================
item  defect                              tests
====  ==================================  ==========================================================
1     data imports any module             H::test_decoding_names_from_data_never_imports,
                                          H::test_cache_ls_of_a_hostile_cache_imports_nothing,
                                          P::test_audit_and_tune_of_a_program_naming_modules_import_nothing,
                                          H::test_kernels_register_themselves_with_their_config_types,
                                          H::test_explicit_registration_and_user_modules,
                                          H::test_put_refuses_a_config_that_would_not_read_back,
                                          test_calls.py::test_missing_kernel_module_is_a_clear_error,
                                          test_cli.py::test_audit_tune_audit_and_cache_commands
2     square-time regular expressions     test_labels.py::test_label_regex_runs_in_linear_time_on_adversarial_text,
                                          test_hlo_grammar.py::test_every_pattern_is_linear_on_hostile_input,
                                          test_hlo_grammar.py::test_parse_is_fast_on_hostile_input
3     race on a new cache                 C::test_32_processes_open_a_fresh_cache_at_once,
                                          C::test_files_sqlite_holds_are_never_opened_and_closed_beside_it
4     unbounded reads                     C::test_import_refuses_special_files,
                                          C::test_import_of_dev_zero_is_refused_at_once,
                                          C::test_import_caps_file_size,
                                          P::test_program_reader_refuses_special_files_at_once,
                                          P::test_program_reader_caps_bytes_per_file_and_per_directory,
                                          P::test_directory_walk_skips_special_files_and_symlinked_directories,
                                          P::test_label_reader_of_paths_is_bounded_too,
                                          P::test_frontend_attributes_are_capped,
                                          test_cli.py::test_special_files_are_refused_at_once
5     one entry breaks the whole cache    C::test_import_refuses_deep_nesting_naming_the_entry,
                                          C::test_a_deep_entry_in_the_file_is_skipped_not_fatal
6     non-finite numbers                  C::test_import_refuses_non_finite_created,
                                          C::test_import_refuses_non_finite_numbers_in_configs_and_stats,
                                          C::test_old_rows_with_non_finite_time_do_not_break_export
7     export replaces the target          C::test_export_through_a_symlink_keeps_the_link,
                                          C::test_export_honours_the_umask_for_new_files,
                                          C::test_export_refuses_special_targets
8     call key depends on call order      H::test_call_keys_do_not_depend_on_call_order
9     label injection                     test_labels.py::test_kernel_names_the_readers_cannot_read_back_are_rejected,
                                          test_labels.py::test_versions_the_readers_cannot_read_back_are_rejected
10    markup injection                    P::test_markup_in_static_arguments_and_configs_renders_as_itself,
                                          P::test_cli_audit_of_a_foreign_program_with_markup,
                                          P::test_markdown_cells_keep_pipes_and_line_breaks_inside
11    graph crashes on parsed text        P::test_names_and_widths_the_graph_cannot_trust_are_parse_errors,
                                          P::test_cli_audit_and_tune_report_a_duplicate_name,
                                          P::test_fuzz_graph_and_audit_of_parsed_text_never_crash
12    cached configs are not checked      H::test_config_of_another_kernel_type_is_not_served,
                                          C::test_import_checks_kernel_version_against_the_op_id
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

Second round (issue 45): no process dies on a file, no escape reaches the terminal, one bad call
stops nothing.

====  ==================================  ==========================================================
item  defect                              tests
====  ==================================  ==========================================================
1     the process dies on a file          P::test_deep_nesting_in_stablehlo_is_refused_before_jaxlib
      (MLIR nesting, XLA's shape          (``[`` 6,733 deep, ``tuple<>`` 3,513 deep: ``audit`` and ``tune``),
      products)                           T::test_huge_dimensions_are_refused_before_jaxlib
                                          (``f32[4000000000,4000000000]`` in a call, ``--example-args``),
                                          P::test_no_command_ends_by_a_signal_on_any_hostile_file
2     escape codes reach the terminal     H::test_sanitize_makes_data_inert_for_each_place_it_goes,
                                          C::test_cache_ls_shows_escape_codes_from_the_file_inert,
                                          C::test_import_and_put_refuse_op_ids_a_label_cannot_carry,
                                          P::test_escape_codes_in_a_program_reach_no_output
                                          (``audit``, ``--markdown``, ``--json``, ``--dot``, ``tune``'s
                                          errors, a dump file's name in an error)
3     one bad call stops a whole tune     T::test_one_malformed_call_does_not_stop_the_others
                                          (``candidate_is_valid`` raising, ``f32[1e10,1e9]``, more than
                                          memory: local and Ray workers),
                                          T::test_in_context_tuning_reports_a_failing_call_and_tunes_the_rest
4     recursion; walks without caps       P::test_nested_computations_300_deep_are_analysed,
                                          P::test_label_readers_walk_deep_and_wide_folders_within_the_caps
5     export that import refuses;         C::test_export_refuses_what_import_would_refuse_and_exports_in_parts,
      a key twice imports as two          C::test_export_of_many_entries_imports_again,
                                          C::test_a_key_twice_in_an_import_is_refused
6     an entry of the wrong type hides    C::test_cache_ls_shows_an_entry_of_the_wrong_type,
      its call                            T::test_audit_and_tune_count_a_wrong_type_entry_as_unseen
7     a read-only cache cannot be read;   C::test_a_cache_that_cannot_be_written_opens_read_only,
      damage in its log is silent         C::test_a_cache_on_a_read_only_mount_is_listed_shown_counted_and_audited,
                                          C::test_damage_in_the_write_ahead_log_is_reported
8     kernel inputs that give a wrong     K::test_kernels_refuse_concrete_inputs_that_give_a_wrong_answer,
      answer without an error             K::test_bad_kernel_arguments_name_the_argument,
                                          K::test_checks_cost_nothing_under_jit_and_traced_labels_agree
9     ``python -m ejlabel`` runs a        K::test_python_m_from_a_folder_with_networkx_py_is_documented
      ``networkx.py`` of the current      (and the console script is not affected)
      folder
====  ==================================  ==========================================================

Fuzz tests (hypothesis; each case bounded in time, the three together well under a minute on 2
cores): C::test_fuzz_import_succeeds_or_raises_cache_error_and_keeps_entries (cache import),
P::test_fuzz_graph_and_audit_of_parsed_text_never_crash (HLO reader, graph, audit),
P::test_fuzz_description_decoder_rebuilds_or_raises_call_decode_error (call descriptions; caps in
P::test_description_caps_and_long_numbers_are_decode_errors), and in the reader's own files
test_hlo.py::test_fuzz_parse_returns_module_or_parse_error and
test_hlo_grammar.py::test_truncations_raise_only_parse_errors.
"""
from __future__ import annotations

import dataclasses
import enum
import json
import os
import pathlib
import re
import subprocess
import sys
import warnings

import pytest

from conftest import run_python, subprocess_env
from ejlabel.config.persistent import PersistentCache
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
from ejlabel.utils.sanitize import sanitize
from ejlabel.utils.serialize import from_json, is_registered, resolve_path, to_json
from hostile import (  # noqa: F401  (cache and evil_module are fixtures)
    DEV,
    EJLABEL,
    KEY,
    GoodConfig,
    cache,
    call_key,
    entry,
    evil_module,
    export_doc,
    hostile_configs,
    raw_insert,
)


# ---------------------------------------------------------------- 1. data imports no module


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



# ---------------------------------------------------------------- 2 (second round). one sanitizer for data shown anywhere


def test_sanitize_makes_data_inert_for_each_place_it_goes() -> None:
    hostile = "a\x1b]52;c;cHduZWQ=\x07b\x9b2J\rc\u202ed\u2028e|f\n[x](javascript:y)<img src=z>&\\N\""
    terminal = sanitize(hostile)
    assert terminal == "a\\x1b]52;c;cHduZWQ=\\x07b\\x9b2J\\rc\\u202ed\\u2028e|f\\n[x](javascript:y)<img src=z>&\\N\""
    assert terminal.isprintable()  # no control, format or separator character is left
    assert sanitize("one\ntwo\tthree\rfour", multiline=True) == "one\ntwo\tthree\\rfour"
    markdown = sanitize(hostile, "markdown")
    assert markdown.isprintable() and "\n" not in markdown
    assert markdown.replace("\\|", "").count("|") == 0 and "<" not in markdown and ">" not in markdown
    assert "[x]\\(javascript:y)" in markdown and "&lt;img src=z&gt;&amp;" in markdown  # no link, no image, no tag
    assert sanitize("f32[8,16] mode='[/]'", "markdown") == "f32[8,16] mode='[/]'"  # brackets alone read as they are
    dot = sanitize(hostile, "dot")
    assert dot.isprintable() and re.search(r'(?<!\\)(\\\\)*"', dot) is None  # every quote escaped: the string cannot end early
    assert "f\\n[x]" in dot and "\\\\N" in dot  # a line break is DOT's, a backslash is itself (\N names the node)
    assert sanitize(b"\x1b") == "b'\\x1b'" and sanitize(None) == "None"
    with pytest.raises(ValueError, match="context"):
        sanitize("x", "html")  # type: ignore[arg-type]


# ---------------------------------------------------------------- the tables above stay true


def test_the_item_tables_name_every_item_and_only_tests_that_exist() -> None:
    files = {"H": "test_hostile_input.py", "C": "test_hostile_cache.py", "P": "test_hostile_programs.py", "T": "test_hostile_tuning.py",
             "K": "test_hostile_kernels.py"}
    lines = __doc__.splitlines()
    rules = [i for i, line in enumerate(lines) if line.startswith("====  ")]
    assert len(rules) == 6  # two tables of three rules each
    tests = pathlib.Path(__file__).parent
    for table, item_count in ((0, 14), (1, 9)):
        items: dict[int, list[tuple[str, str]]] = {}
        current = 0
        for line in lines[rules[3 * table + 1] + 1 : rules[3 * table + 2]]:  # the rows of the table
            number = re.match(r"(\d+)\s", line)
            if number:
                current = int(number.group(1))
            items.setdefault(current, []).extend(re.findall(r"\b([HCPTK]|test_\w+\.py)::(test_\w+)", line))
        assert sorted(k for k in items if k) == list(range(1, item_count + 1))
        for item, named in items.items():
            assert named or not item, f"item {item} names no test"
            for file, test in named:
                source = (tests / files.get(file, file)).read_text()
                assert re.search(rf"^def {test}\(", source, re.M), f"item {item}: {file}::{test} does not exist"
