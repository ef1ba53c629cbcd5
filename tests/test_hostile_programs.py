"""Hostile input to the program readers, the graph, the audit and the tuners: program files, dump
folders and the call descriptions in them are data from elsewhere.

The cases of the hostile-input issues that concern programs; the index of every case and its test
is the docstring of ``tests/test_hostile_input.py``.
"""
from __future__ import annotations

import dataclasses
import json
import os
import pathlib
import re
import subprocess
import sys
import threading
import warnings

import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from conftest import subprocess_env
from ejlabel.config.persistent import PersistentCache
from ejlabel.config.selection import ConfigSelectorChain
from ejlabel.core.kernel import Invocation, Kernel
from ejlabel.utils.serialize import DecodeError, from_jsonable
from hostile import EJLABEL, EVIL_MODULE, LABELLED, b64, capture, hlo_module, json_value

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

NAME_AND_WIDTH_CASES = {
    "duplicate name": (hlo_module("%p = f32[4]{0} parameter(0)", f"%a = f32[4]{{0}} add(%p, %p), {LABELLED}",
                               f"%a = f32[4]{{0}} multiply(%a, %a), {LABELLED}", "ROOT %r = f32[4]{0} negate(%a)"),
                       r"%a is defined twice in computation 'main' \(line 6"),
    "duplicate parameter": (hlo_module("%p = f32[4]{0} parameter(0)", "%p = f32[4]{0} parameter(1)", f"ROOT %a = f32[4]{{0}} add(%p, %p), {LABELLED}"),
                            r"%p is defined twice .*line 5"),
    "use before definition": (hlo_module("%p = f32[4]{0} parameter(0)", f"%a = f32[4]{{0}} add(%b, %p), {LABELLED}",
                                      f"%b = f32[4]{{0}} multiply(%p, %p), {LABELLED}", "ROOT %r = f32[4]{0} negate(%a)"),
                              r"operand %b of %a is used before its definition .*line 5"),
    "self use": (hlo_module("%p = f32[4]{0} parameter(0)", f"ROOT %a = f32[4]{{0}} add(%a, %p), {LABELLED}"), r"%a of %a is used before"),
    "undefined operand": (hlo_module("%p = f32[4]{0} parameter(0)", f"ROOT %a = f32[4]{{0}} add(%zz, %p), {LABELLED}"), r"%zz of %a is not defined"),
    "5000-digit width": (hlo_module("%p = f32[4]{0} parameter(0)", f"ROOT %a = f{'9' * 5000}[4]{{0}} add(%p, %p), {LABELLED}"),
                         r"malformed element type"),
    "5000-digit parameter width": (hlo_module(f"%p = s{'1' * 5000}[4]{{0}} parameter(0)", f"ROOT %a = f32[4]{{0}} convert(%p), {LABELLED}",
                                           params=f"p: s{'1' * 5000}[4]"), r"malformed element type"),
    "5000-digit width in a tuple": (hlo_module(f"%p = (f32[4], u{'7' * 5000}[2]) parameter(0)", "ROOT %a = f32[4]{0} get-tuple-element(%p), index=0"),
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


SMALL_PROGRAM = hlo_module("%p = f32[4]{0} parameter(0)", f"ROOT %a = f32[4]{{0}} add(%p, %p), {LABELLED}")


def test_program_reader_refuses_special_files_at_once(tmp_path: pathlib.Path) -> None:
    from ejlabel.analysis import ProgramReadError, read_program

    fifo = tmp_path / "pipe.hlo"
    os.mkfifo(fifo)
    outcome: list[BaseException | object] = []
    worker = threading.Thread(target=lambda: capture(outcome, lambda: read_program(fifo)), daemon=True)
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
    import ejlabel.analysis.hlo as hlo_reader
    from ejlabel.analysis import HloParseError, parse_hlo

    long_value = 'frontend_attributes={ejlabel="ejkernel_ops#scale@v1:0123456789abcdef",ejcall="' + "a" * 300 + '"}'
    text = hlo_module("%p = f32[4]{0} parameter(0)", f"ROOT %a = f32[4]{{0}} add(%p, %p), {long_value}")
    assert parse_hlo(text).instructions()  # under the real cap
    monkeypatch.setattr(hlo_reader, "MAX_ATTRIBUTE_CHARS", 200)
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
    well_formed.map(lambda d: b64(json.dumps(d).encode())),
    description_list.map(lambda d: b64(json.dumps(d).encode())),
    st.builds(_corrupt, description_list.map(lambda d: b64(json.dumps(d).encode())), st.floats(0, 1), st.text(max_size=4)),
    json_value.map(lambda d: b64(json.dumps(d).encode())),
    st.binary(max_size=64).map(b64),
    st.text(max_size=40),
    st.integers(0, 3000).map(lambda n: b64(("[1," + "[" * n + "]" * n + "]").encode())),
    st.sampled_from([b64(b'[1,"toy_kernels:ScaleKernel",[{"$array":"float32[3]"}],{"offset":NaN},null,null]'),
                     b64(b'[1,"toy_kernels:ScaleKernel",[{"$array":"float32[3]"}],{"offset":1e999},null,null]'),
                     b64(b'[1,"toy_kernels:ScaleKernel",[' + b"1" * 5000 + b"],{},null,null]")]),
)


description_case = st.one_of(
    # The label of the kernel the description names, as a real program pairs them ...
    well_formed.map(lambda d: (f"ejkernel_ops#{TOY_OPS[d[1]]}@v1:0123456789abcdef", b64(json.dumps(d).encode()))),
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
    text = b64(b'[1,"toy_kernels:ScaleKernel",[{"$array":"float32[3]"}],{},null,null]')
    assert decode_call(text, lab).args[0].shape == (3,)
    monkeypatch.setattr(calls_module, "MAX_DESCRIPTION_CHARS", len(text) - 1)
    with pytest.raises(CallDecodeError, match="over the .* limit"):
        decode_call(text, lab)
    monkeypatch.undo()
    for dims in ("9" * 19, "9" * 5000):
        with pytest.raises(CallDecodeError, match=r"is not 'dtype\[d0,d1,...\]'"):
            decode_call(b64(f'[1,"k:K",[{{"$array":"float32[{dims}]"}}],{{}},null,null]'.encode()), lab)
    with pytest.raises(DecodeError, match="dtype"):
        from_jsonable({"$array": "float32[" + "9" * 5000 + "]"})
    with pytest.raises(CallDecodeError, match="label"):
        decode_call(text, "not a label")



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
    hostile = b64(json.dumps([1, f"{module}:Cfg", [{"$array": "float32[4]"}], {"offset": {"$ref": f"{module}:geohash"}}, None, None]).encode())
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


# ================================================================ the second round (issue 45)
# ---------------------------------------------------------------- 1 and 3. one bad call stops nothing, no abort in jaxlib

GOOD_LABEL = "ejkernel_ops#scale@v1:c0417bbf50206eff"
GOOD_CALL = [1, "toy_kernels:ScaleKernel", [{"$array": "float32[8,16]"}], {}, None, None]


def described_program(calls: list[tuple[str, list]]) -> str:
    """An HLO module with one labelled instruction per ``(label, description data)``, in a chain."""
    body = ["%p = f32[4]{0} parameter(0)"]
    for i, (lab, data) in enumerate(calls):
        text = b64(json.dumps(data, separators=(",", ":")).encode())
        body.append(f'%a{i} = f32[4]{{0}} add(%{"p" if i == 0 else f"a{i - 1}"}, %p), frontend_attributes={{ejcall="{text}",ejlabel="{lab}"}}')
    body.append(f"ROOT %r = f32[4]{{0}} negate(%a{len(calls) - 1})")
    return hlo_module(*body)


BAD_CALLS = {
    # matmul's candidate_is_valid unpacked a 1-d shape: "not enough values to unpack" for the whole run
    "a malformed call": ("ejkernel_ops#matmul@v1:00000000000000cc",
                         [1, "ejlabel.kernels.matmul:MatmulKernel", [{"$array": "float32[8]"}, {"$array": "float32[8]"}], {}, None, None],
                         "matmul@v1 call 00000000000000cc: failed while listing its candidates"),
    # numpy's "array is too big" for the whole run
    "an array too big to exist": ("ejkernel_ops#scale@v1:00000000000000bb",
                                  [1, "toy_kernels:ScaleKernel", [{"$array": "float32[10000000000,1000000000]"}], {}, None, None],
                                  "over the 1125899906842624-byte limit of one array"),
    # jaxlib aborted the process (rc 134): "overflow in static extent product"
    "an element count past int64": ("ejkernel_ops#scale@v1:00000000000000aa",
                                    [1, "toy_kernels:ScaleKernel", [{"$array": "float32[4000000000,4000000000]"}], {}, None, None],
                                    "over the 1125899906842624-byte limit of one array"),
    # would be made on the host, or end the process by the kernel's memory killer
    "more than this machine's memory": ("ejkernel_ops#scale@v1:00000000000000ee",
                                        [1, "toy_kernels:ScaleKernel", [{"$array": "float32[100000000000000]"}], {}, None, None],
                                        "its arguments take 400000000000000 bytes, more than the"),
}


def test_one_malformed_call_does_not_stop_the_others(tmp_path: pathlib.Path) -> None:
    from ejlabel.execution.tuning import TuningWorker, call_request
    from ejlabel.config.cache import AutotunePolicy
    from hostile import run_cli

    program = tmp_path / "calls.hlo"
    program.write_text(described_program([(GOOD_LABEL, GOOD_CALL), *((lab, data) for lab, data, _ in BAD_CALLS.values())]))
    proc = run_cli(["--import", "toy_kernels", "--cache-dir", str(tmp_path / "c"), "tune", "--iters", "1", str(program)])
    assert proc.returncode == 1, proc.stdout + proc.stderr  # the exit code says some failed ...
    assert f"tuned  {GOOD_LABEL.split('#')[1]}" in proc.stdout and "Traceback" not in proc.stderr  # ... the good call is tuned
    assert "tuned 1 distinct calls (1 labels)" in proc.stdout and f"{len(BAD_CALLS)} errors" in proc.stdout
    for lab, _, reason in BAD_CALLS.values():
        assert f"error  {lab}  " in proc.stderr and reason in proc.stderr, (lab, proc.stderr)
    # A Ray worker tunes the same way: a call whose kernel code raises is raised again, so that
    # the driver retries it alone elsewhere and then reports it (test_ray_tuning.py); the others tune.
    worker = TuningWorker(["ejlabel.kernels", "toy_kernels"])
    policy = AutotunePolicy(num_warmup=0, num_iters=1)

    def request(name: str) -> dict:
        lab, data, _ = BAD_CALLS[name] if name in BAD_CALLS else (GOOD_LABEL, GOOD_CALL, "")
        return call_request(lab, b64(json.dumps(data).encode()), policy)

    with pytest.raises((IndexError, ValueError)):  # matmul's own error, for the driver to retry
        worker.tune_many([request("good"), request("a malformed call")])
    good, huge = worker.tune_many([request("good"), request("more than this machine's memory")])
    assert good["status"] == "tuned" and huge["status"] == "failed" and "more than the" in huge["error"]


@dataclasses.dataclass(frozen=True)
class PickyConfig:
    mode: str = "mul"


class PickyKernel(Kernel[PickyConfig, object]):
    """``2 x`` two ways; listing the candidates of a call whose ``x`` has 3 columns raises, as a
    kernel with a bug that one call of a model hits."""

    def __init__(self) -> None:
        super().__init__("picky")

    def run(self, x, *, cfg: PickyConfig):
        return x * 2.0 if cfg.mode == "mul" else x + x

    def heuristic_cfg(self, inv: Invocation) -> PickyConfig:
        return PickyConfig()

    def config_space(self, inv: Invocation) -> list[PickyConfig]:
        if inv.args[0].shape[-1] == 3:
            raise ValueError("not enough values to unpack (expected 2, got 1)")
        return [PickyConfig("mul"), PickyConfig("add")]


def test_in_context_tuning_reports_a_failing_call_and_tunes_the_rest(tmp_path: pathlib.Path) -> None:
    import jax
    import jax.numpy as jnp

    from ejlabel.config.cache import AutotunePolicy
    from ejlabel.execution.tuning import tune_in_context

    picky = PickyKernel()
    step = lambda a, b: picky(a).sum() + picky(b).sum()  # noqa: E731
    args = (jax.ShapeDtypeStruct((16, 16), jnp.float32), jax.ShapeDtypeStruct((16, 3), jnp.float32))
    with PersistentCache(tmp_path / "c") as pc:
        selector = ConfigSelectorChain(persistent=pc)
        report = tune_in_context(step, *args, selector=selector, policy=AutotunePolicy(num_warmup=0, num_iters=2), budget_s=120,
                                 samples=2, warmup=0, progress=False, verbose=False)
        (failed,) = report.errors
        assert failed.startswith("picky@v1:") and "cannot list its candidates" in report.errors[failed]
        assert "not enough values to unpack" in report.errors[failed]
        assert len(report.calls) == 2 and [call.isolated_from == "failed" for call in report.calls].count(True) == 1
        (ranked,) = [call for call in report.calls if call.isolated_from != "failed"]
        assert failed == f"picky@v1:{next(c.call_key for c in report.calls if c is not ranked)}"
        assert len(ranked.candidates) == 2  # the other call was ranked on both candidates ...
        assert pc.get_entry(ranked.key).provenance == "in-context"  # ... and its pick stored


def test_huge_dimensions_are_refused_before_jaxlib(tmp_path: pathlib.Path) -> None:
    """jaxlib ended the process (rc 134, "overflow in static extent product") when a call or
    ``--example-args`` had an element count past int64: now a clear error, and the others go on."""
    from ejlabel.core.calls import CallDecodeError, invocation_from_description
    from hostile import run_cli

    lab, data, _ = BAD_CALLS["an element count past int64"]
    with pytest.raises(CallDecodeError, match=r"\$array: shape \(4000000000, 4000000000\) of float32 spans 64000000000000000000 bytes"):
        invocation_from_description(lab, b64(json.dumps(data).encode()))
    program = tmp_path / "huge.hlo"
    program.write_text(described_program([(GOOD_LABEL, GOOD_CALL), (lab, data)]))
    for command in (["tune", "--iters", "1", str(program)], ["audit", str(program)],
                    ["tune", "toy_kernels:double", "--example-args", "f32[4000000000,4000000000]"]):
        proc = run_cli(["--import", "toy_kernels", "--cache-dir", str(tmp_path / "c"), *command])
        assert proc.returncode in (0, 1, 2) and "Traceback" not in proc.stderr, proc.stderr  # never a signal
        if command[0] == "tune" and "--example-args" in command:
            assert proc.returncode == 2 and "--example-args: shape (4000000000, 4000000000) of float32 spans" in proc.stderr
        elif command[0] == "tune":
            assert proc.returncode == 1 and "tuned 1 distinct calls" in proc.stdout
