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
# ---------------------------------------------------------------- 1. no process dies on a file


def _stablehlo_nested(kind: str, depth: int) -> str:
    """StableHLO nesting ``kind`` (``"["`` in an attribute, ``"tuple"`` in a type) ``depth`` deep."""
    if kind == "[":
        attribute = "[" * depth + "]" * depth
        return ('module @m {\n func.func public @main(%arg0: tensor<4xf32>) -> tensor<4xf32> {\n'
                f' %0 = "stablehlo.custom_call"() {{x = {attribute}}} : () -> tensor<4xf32>\n return %0 : tensor<4xf32>\n }}\n}}\n')
    nested = "tuple<" * depth + "f32" + ">" * depth
    return (f"module @m {{\n func.func public @main(%arg0: {nested}) -> tensor<4xf32> {{\n"
            " %0 = stablehlo.constant dense<1.0> : tensor<4xf32>\n return %0 : tensor<4xf32>\n }\n}\n")


def test_deep_nesting_in_stablehlo_is_refused_before_jaxlib(tmp_path: pathlib.Path) -> None:
    """jaxlib's StableHLO parser recursed until the process died (rc 139, no message) on ``[``
    nested 6,733 deep and ``tuple<>`` 3,513 deep: the nesting is measured first, and refused."""
    from ejlabel.analysis import ProgramReadError, read_program
    from ejlabel.analysis.program import MAX_NESTING, bracket_depth
    from hostile import run_cli

    assert bracket_depth("a[b(c{d<e>})]->f") == (4, 7)  # the arrow closes nothing
    assert bracket_depth("]]]]]" + "[" * 3)[0] == 3  # closers cannot hide the openers after them
    for kind, depth in (("[", 6733), ("tuple", 3513)):
        path = tmp_path / f"deep-{'list' if kind == '[' else kind}.mlir"
        path.write_text(_stablehlo_nested(kind, depth))
        with pytest.raises(ProgramReadError, match=rf"nests brackets {str(depth)[:2]}\d+ deep \(line \d\), more than the {MAX_NESTING} .*MAX_NESTING"):
            read_program(path)
        for command in ("audit", "tune"):
            proc = run_cli(["--cache-dir", str(tmp_path / "c"), command, str(path)])
            assert proc.returncode == 1 and f"ejlabel {command}: error: ProgramReadError" in proc.stderr, (proc.returncode, proc.stderr)
            assert "nests brackets" in proc.stderr
    shallow = _stablehlo_nested("tuple", MAX_NESTING - 10)  # what real programs never reach still converts
    assert read_program(shallow).modules and not read_program(shallow).unread


HOSTILE_FILES: dict[str, str] = {
    "deep-brackets.mlir": _stablehlo_nested("[", 6733),
    "deep-tuple.mlir": _stablehlo_nested("tuple", 3513),
    "deep-braces.mlir": "module @m {\n" + "{" * 20000 + "}" * 20000 + "\n}\n",
    "deep-attribute.hlo": hlo_module("%p = f32[4]{0} parameter(0)", f"ROOT %a = f32[4]{{0}} add(%p, %p), backend_config={'{' * 20000}{'}' * 20000}, {LABELLED}"),
    "deep-constant.hlo": hlo_module(f"ROOT %c = f32[4]{{0}} constant({'{' * 20000}1{'}' * 20000})"),
    "deep-tuple.hlo": hlo_module("%p = " + "(" * 20000 + "f32[4]" + ")" * 20000 + " parameter(0)", "ROOT %c = f32[4]{0} constant({1,2,3,4})",
                                 params="p: " + "(" * 20000 + "f32[4]" + ")" * 20000),
    "huge-shape.hlo": hlo_module("%p = f32[4000000000,4000000000]{1,0} parameter(0)", f"ROOT %a = f32[4000000000,4000000000]{{1,0}} add(%p, %p), {LABELLED}",
                                 params="p: f32[4000000000,4000000000]"),
    "binary.hlo": bytes(range(256)).decode("latin-1") * 8,
    "empty.hlo": "",
}


def _described_files() -> dict[str, str]:
    from hostile import GOOD_CALL, GOOD_LABEL, described_program

    huge = [1, "toy_kernels:ScaleKernel", [{"$array": "float32[4000000000,4000000000]"}], {}, None, None]
    malformed = [1, "ejlabel.kernels.matmul:MatmulKernel", [{"$array": "float32[8]"}, {"$array": "float32[8]"}], {}, None, None]
    nested: object = 0
    for _ in range(200):  # past the decoder's depth cap
        nested = [nested]
    deep = [1, "toy_kernels:ScaleKernel", [{"$array": "float32[8]"}], {"offset": nested}, None, None]
    calls = [(GOOD_LABEL, GOOD_CALL), ("ejkernel_ops#scale@v1:00000000000000aa", huge),
             ("ejkernel_ops#matmul@v1:00000000000000cc", malformed), ("ejkernel_ops#scale@v1:00000000000000dd", deep)]
    return {"described.hlo": described_program(calls)}


def test_no_command_ends_by_a_signal_on_any_hostile_file(tmp_path: pathlib.Path) -> None:
    """Every command on every file of the corpus returns an exit code (0, 1 or 2), in one child
    that runs them all: a signal (a segfault, an abort in jaxlib) would end it early, and the
    last command it printed names the file."""
    folder = tmp_path / "corpus"
    folder.mkdir()
    for name, text in {**HOSTILE_FILES, **_described_files()}.items():
        (folder / name).write_text(text, encoding="utf-8", errors="surrogatepass")
    deep_json = json.dumps({"format": "ejlabel-configs", "version": 1, "entries": [{"config": 0}]}).replace("0}", "[" * 100_000 + "]" * 100_000 + "}")
    (folder / "deep-export.json").write_text(deep_json)
    runs = [[command, *(["--iters", "1"] if command == "tune" else []), str(path)] for path in sorted(folder.glob("*.*")) if path.suffix != ".json"
            for command in ("audit", "tune")]
    runs += [["cache", "import", str(folder / "deep-export.json")], ["tune", "toy_kernels:double", "--example-args", "f32[4000000000,4000000000]"]]
    script = (
        "import json, sys\nfrom ejlabel.cli.main import main\n"
        f"for argv in json.loads({json.dumps(json.dumps(runs))}):\n"
        f"    print('RUN', argv, flush=True)\n"
        f"    rc = main(['--import', 'toy_kernels', '--cache-dir', {str(tmp_path / 'c')!r}, *argv])\n"
        "    print('RC', rc, flush=True)\n"
    )
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=False, env=subprocess_env(), timeout=600)
    assert proc.returncode == 0, f"ended by {proc.returncode} after:\n{proc.stdout[-600:]}\n{proc.stderr[-2000:]}"
    codes = [int(line.split()[1]) for line in proc.stdout.splitlines() if line.startswith("RC ")]
    assert len(codes) == len(runs) and set(codes) <= {0, 1, 2}, proc.stdout[-2000:]
    assert "Traceback" not in proc.stderr, proc.stderr[-2000:]


# ---------------------------------------------------------------- 2. no escape code from a program reaches the output

ESCAPES = "\x1b[2J\x1b]0;title\x07\x1b]52;c;cHduZWQ=\x07\r\u202e"


def test_escape_codes_in_a_program_reach_no_output(tmp_path: pathlib.Path) -> None:
    """A call description's keyword names and values carried escape codes into ``audit`` (table
    and Markdown), the DOT file and ``tune``'s errors; a dump file's name into an error message."""
    from hostile import GOOD_CALL, GOOD_LABEL, described_program, run_cli

    hostile = [1, "toy_kernels:ScaleKernel", [{"$array": "float32[8,16]"}], {f"offset{ESCAPES}": 1.0, "mode": f"x{ESCAPES}|<img src=y>"}, None, None]
    program = tmp_path / "p.hlo"
    program.write_text(described_program([(GOOD_LABEL, GOOD_CALL), ("ejkernel_ops#scale@v1:00000000000000dd", hostile)]))
    fifo = tmp_path / f"dump{ESCAPES}.hlo"
    os.mkfifo(fifo)
    cache = ["--import", "toy_kernels", "--cache-dir", str(tmp_path / "c")]
    outputs = []
    for command in (["audit", str(program), "--dot", str(tmp_path / "g.dot")], ["audit", str(program), "--markdown"], ["audit", str(program), "--json"],
                    ["tune", "--iters", "1", str(program)], ["audit", str(fifo)], ["tune", str(fifo)]):
        proc = run_cli([*cache, *command])
        assert proc.returncode in (0, 1), proc.stderr
        outputs.append(proc.stdout + proc.stderr)
    outputs.append((tmp_path / "g.dot").read_text())
    for text in outputs:
        for char in ("\x1b", "\x07", "\r", "\u202e"):
            assert char not in text, f"{char!r} reached: {text[:600]!r}"
    table, markdown, as_json, tune, audit_fifo, tune_fifo, dot = outputs
    assert "offset\\x1b[2J" in table and "offset\\\\x1b[2J" in markdown and "\\u001b" in as_json  # shown, as what they are
    row = next(line for line in markdown.splitlines() if "| 00000000 |" in line)
    assert row.replace("\\|", "").count("|") == 9 and "\\|&lt;img src=y&gt;" in row  # still 8 cells; no tag
    assert "error  ejkernel_ops#scale@v1:00000000000000dd" in tune and "unexpected keyword argument" in tune
    assert "dump\\x1b[2J" in audit_fifo and "is a FIFO" in audit_fifo and "dump\\x1b[2J" in tune_fifo


# ---------------------------------------------------------------- 4. no recursion, walks within the caps


def _nested_calls(depth: int, opcode: str) -> str:
    """HLO whose entry reaches a labelled add through ``depth`` nested ``call`` or ``while``."""
    def wrap(inner: str) -> str:
        if opcode == "call":
            return f"ROOT %y = f32[4] call(%x), to_apply=%{inner}"
        return f"ROOT %y = f32[4] while(%x), condition=%cond, body=%{inner}, backend_config={{\"known_trip_count\":{{\"n\":\"2\"}}}}"
    comps = [f"%c0 (x: f32[4]) -> f32[4] {{\n  %x = f32[4] parameter(0)\n  ROOT %y = f32[4] add(%x, %x), {LABELLED}\n}}\n",
             "%cond (x: f32[4]) -> pred[] {\n  %x = f32[4] parameter(0)\n  ROOT %t = pred[] constant(false)\n}\n"]
    comps += [f"%c{i} (x: f32[4]) -> f32[4] {{\n  %x = f32[4] parameter(0)\n  {wrap(f'c{i - 1}')}\n}}\n" for i in range(1, depth)]
    comps.append(f"ENTRY %main (p: f32[4]) -> f32[4] {{\n  %x = f32[4] parameter(0)\n  {wrap(f'c{depth - 1}')}\n}}\n")
    return "HloModule m\n\n" + "\n".join(comps)


@pytest.mark.parametrize("opcode", ["call", "while"])
def test_nested_computations_300_deep_are_analysed(tmp_path: pathlib.Path, opcode: str) -> None:
    """``call``/``while`` computations 300 deep ended the audit in a RecursionError (flow.py,
    sites.py); the analysis walks them without recursion, 3,000 deep too."""
    from ejlabel.analysis import audit
    from hostile import run_cli

    for depth in (300, 3000):
        report = audit(_nested_calls(depth, opcode), selector=ConfigSelectorChain())
        (row,) = report.calls
        assert row.op == "scale" and len(row.nesting) == depth  # every enclosing call or loop, outermost first
    path = tmp_path / "nested.hlo"
    path.write_text(_nested_calls(300, opcode))
    proc = run_cli(["--cache-dir", str(tmp_path / "c"), "audit", str(path)])
    assert proc.returncode == 0 and "1 kernel call sites" in proc.stdout, proc.stderr


def test_label_readers_walk_deep_and_wide_folders_within_the_caps(tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``labels_to_configs`` and ``find_labels_in_lowered`` on a folder 1,500 deep ended in a
    RecursionError; on ``/`` in a PermissionError (``/proc/1/cwd``), after 137,739 entries of
    ``/usr``: one walker, iterative, within the README's caps, for every reader."""
    import ejlabel.utils.files as files
    from ejlabel import find_labels_in_lowered, labels_to_configs
    from ejlabel.analysis import ProgramReadError

    fds = [os.open(tmp_path, os.O_RDONLY)]
    try:
        for _ in range(1500):  # os.makedirs, and shutil.rmtree below, recurse per level
            os.mkdir("d", dir_fd=fds[-1])
            fds.append(os.open("d", os.O_RDONLY, dir_fd=fds[-1]))
        for read in (labels_to_configs, find_labels_in_lowered):
            with pytest.raises(ProgramReadError, match=f"nests folders more than {files.MAX_DIRECTORY_DEPTH} levels deep"):
                read(tmp_path / "d")
    finally:
        while len(fds) > 1:  # removed from the bottom up, so that no later clean-up recurses
            os.close(fds.pop())
            os.rmdir("d", dir_fd=fds[-1])
        os.close(fds.pop())
    wide = tmp_path / "wide"
    wide.mkdir()
    for i in range(30):
        (wide / f"{i}.txt").write_text("x")
    (wide / "proc").symlink_to("/proc")  # never followed
    monkeypatch.setattr(files, "MAX_DIRECTORY_ENTRIES", 20)
    with pytest.raises(ProgramReadError, match="holds more than 20 entries"):
        labels_to_configs(wide)
    monkeypatch.setattr(files, "MAX_DIRECTORY_ENTRIES", 500)
    with pytest.raises(ProgramReadError, match="more than 500 entries|levels deep"):  # not a PermissionError in /proc
        labels_to_configs("/")
