"""The HLO grammar XLA reads: real HLO files from XLA's own test directories and the
module strings of XLA's ``hlo_parser_test.cc`` (``tests/data/xla_hlo/``), plus
targeted texts for each form (multi-line instructions, comments, tuple shapes,
instructions written in place of operands, inline computations, line ends), the
header-based choice between HLO and StableHLO, and linear time on hostile input."""

from __future__ import annotations

import random
import re
import time
from collections import Counter
from pathlib import Path

import pytest

from ejlabel.analysis import hlo, hlo_parser
from ejlabel.analysis.hlo import HloModule, HloParseError, parse_hlo, program_kind

DATA = Path(__file__).parent / "data" / "xla_hlo"
FILES = sorted(DATA.glob("*.hlo"))

# Files whose instructions include ones written in place of operands: XLA (and this
# reader) adds those as instructions of their own, which a count of "name =" misses.
ANONYMOUS = {
    "parser_test_SimpleNesting.hlo": 4,
    "parser_test_MixAnonAndNonAnonOperands.hlo": 3,
    "parser_test_TupleShapeInsideAnonymousInstr.hlo": 3,
    "parser_test_BroadcastOfScalarDoesntNeedDimensionsAttr.hlo": 2,
}
# XLA's async shorthand (``<op>-start``) read as XLA reads it: one computation wrapping ``<op>``,
# with a parameter per operand: (computations, instructions) beyond what the text spells out.
UNFOLDED = {
    "parser_test_AsyncInstructionWithAttributesShouldPropagateToWrappedInstruction.hlo": (1, 3),
    "parser_test_AsyncOpsWithSyntaxSugar.hlo": (1, 2),
    "parser_test_HloComputationWithParallelThreadName.hlo": (1, 2),
}


def _read(name: str) -> str:
    return (DATA / name).read_text(encoding="utf-8")


# ---------------------------------------------------------------------------
# An independent count: strip strings and comments, then count "name =" at brace
# depth 1 (not after a ",", which starts an attribute) and top-level "{" not after "=".

_STRING = re.compile(r'"(?:[^"\\]|\\.)*"', re.DOTALL)
_BLOCK_COMMENT = re.compile(r"/\*.*?\*/", re.DOTALL)
_LINE_COMMENT = re.compile(r"//[^\n\r]*")
_SECTION_ROW = re.compile(r"(?m)^[ \t]*\d+[ \t]+\{[^}\n]*\}[ \t]*$")
_TOKEN = re.compile(r"[{}()\[\]]|(?:ROOT\s+)?%?[\w.\-]+\s*=(?!=)|\S")
_ROOT_NAME = re.compile(r"\bROOT\s+%?([\w.\-]+)\s*=")
_ENTRY_NAME = re.compile(r"\bENTRY\s+%?([\w.\-]+)")


def _strip(text: str) -> str:
    text = _STRING.sub('""', text)
    text = _BLOCK_COMMENT.sub(" ", text)
    text = _LINE_COMMENT.sub(" ", text)
    return _SECTION_ROW.sub(" ", text)


def naive_counts(text: str) -> tuple[int, int]:
    """(computations, instructions) found without the parser."""
    computations = instructions = 0
    braces = brackets = 0
    last = ""
    for token in _TOKEN.findall(_strip(text)):
        if token == "{":
            if braces == 0 and brackets == 0 and last != "=":
                computations += 1
            braces += 1
        elif token == "}":
            braces -= 1
        elif token in "([":
            brackets += 1
        elif token in ")]":
            brackets -= 1
        elif len(token) > 1 and token.endswith("=") and braces == 1 and brackets == 0 and last != ",":
            instructions += 1
        last = token[-1]
    return computations, instructions


def check_module(module: HloModule, text: str) -> None:
    """Structure every parse must have: entry, roots, operands and callees that exist."""
    assert module.entry in module.computations
    assert module.entry_computation.is_entry
    assert sum(c.is_entry for c in module.computations.values()) == 1
    entry = _ENTRY_NAME.search(_strip(text))
    assert module.entry == (entry.group(1) if entry else list(module.computations)[-1])
    roots: Counter[str] = Counter()
    for computation in module.computations.values():
        names = {instr.name for instr in computation.instructions}
        marked = [instr for instr in computation.instructions if instr.is_root]
        if computation.instructions:
            assert len(marked) == 1, computation.name
            assert computation.root == marked[0].name
            assert computation.root_instruction is marked[0]
            roots[marked[0].name] += 1
        for instr in computation.instructions:
            assert instr.computation == computation.name
            assert set(instr.operands) <= names, (computation.name, instr.name, instr.operands)
            assert "/*" not in instr.shape and "\n" not in instr.shape
            for callee in instr.called_computations:
                assert callee in module.computations, (instr.name, callee)
    # Every instruction marked ROOT in the text is its computation's root.
    assert not Counter(_ROOT_NAME.findall(_strip(text))) - roots


def _fields(instr: object) -> tuple[object, ...]:
    return tuple(
        getattr(instr, name)
        for name in (
            "name", "opcode", "shape", "operands", "computation", "called_computations", "is_root",
            "custom_call_target", "frontend_attributes", "backend_config", "known_trip_count", "metadata",
            "op_name", "source_file", "source_line",
        )
    )


def assert_same(a: HloModule, b: HloModule) -> None:
    assert (a.name, a.entry) == (b.name, b.entry)
    assert [(c.name, c.is_entry, c.root, c.line) for c in a.computations.values()] == [
        (c.name, c.is_entry, c.root, c.line) for c in b.computations.values()
    ]
    assert [_fields(i) for i in a.instructions()] == [_fields(i) for i in b.instructions()]


# ---------------------------------------------------------------------------
# The collected files


def test_collection() -> None:
    assert len(FILES) >= 40
    assert sum(path.stat().st_size for path in FILES) < 1_000_000
    sources = Counter()
    for path in FILES:
        first = _read(path.name).split("\n", 1)[0]
        assert first.startswith("// source: "), path.name
        sources["hlo_parser_test.cc" in first] += 1
    # Real files from XLA's test directories, and module strings of its parser test.
    assert sources[False] >= 15 and sources[True] >= 30


@pytest.mark.parametrize("path", FILES, ids=[p.name for p in FILES])
def test_xla_file(path: Path) -> None:
    text = _read(path.name)
    module = parse_hlo(text)
    check_module(module, text)
    computations, instructions = naive_counts(text)
    wrapped, unfolded = UNFOLDED.get(path.name, (0, 0))
    assert len(module.computations) == computations + wrapped
    assert module.instruction_count() == instructions + ANONYMOUS.get(path.name, 0) + unfolded
    # The chunk scan and the tokenising reader alone build the same module.
    assert_same(module, hlo_parser.Parser(text, hlo.MAX_ATTRIBUTE_CHARS).run_lines())
    assert program_kind(text) == "hlo"


def test_files_with_other_line_ends() -> None:
    for path in FILES:
        text = _read(path.name)
        lf = parse_hlo(text)
        for ending in ("\r\n", "\r"):
            other = parse_hlo(text.replace("\n", ending))
            assert [_fields(i)[:9] for i in other.instructions()] == [_fields(i)[:9] for i in lf.instructions()]
            assert [(i.source_file, i.source_line) for i in other.instructions()] == [
                (i.source_file, i.source_line) for i in lf.instructions()
            ]


# ---------------------------------------------------------------------------
# Targeted grammar items


def _instr(module: HloModule, name: str) -> tuple[str, str, tuple[str, ...]]:
    for instr in module.instructions():
        if instr.name == name:
            return instr.opcode, instr.shape, instr.operands
    raise AssertionError(f"no instruction {name!r}")


def test_scatter_with_operands_on_the_next_line() -> None:
    module = parse_hlo(_read("emitters_scatter_variadic_scatter_argmax.hlo"))
    scatter = module.computations["fusion"].root_instruction
    assert scatter is not None
    assert (scatter.name, scatter.opcode, scatter.shape) == ("scatter", "scatter", "(f32[50,5], s32[50,5])")
    assert scatter.operands == ("operand_1", "operand_2", "indices", "update_1", "update_2")
    assert scatter.called_computations == ("argmax_combiner",)
    # Typed operands, one per line, and the ")" on a line of its own.
    typed = parse_hlo(_read("emitters_scatter_add.hlo")).computations["scatter"].root_instruction
    assert typed is not None and typed.operands == ("operand", "indices", "update")
    assert (typed.opcode, typed.shape, typed.called_computations) == ("scatter", "f32[10,5]", ("add",))


def test_multi_line_instruction() -> None:
    text = """HloModule m
ENTRY e {
  p = f32[4] parameter(0)
  q = f32[4]
      parameter(1)
  s = f32[4] add(
      p,
      /* a comment inside */ q
  ), metadata={op_name="a"
               source_file="b.py" source_line=7},
     frontend_attributes={ejlabel="x",
        ejcall="y"}
  ROOT t = (f32[4], f32[4]) tuple(s, p)
    , sharding={{replicated},
                {maximal device=0}}
}
"""
    module = parse_hlo(text)
    entry = module.entry_computation
    assert [i.name for i in entry.instructions] == ["p", "q", "s", "t"]
    s = entry.instruction("s")
    assert s is not None and (s.opcode, s.shape, s.operands) == ("add", "f32[4]", ("p", "q"))
    assert (s.op_name, s.source_file, s.source_line) == ("a", "b.py", 7)
    assert dict(s.frontend_attributes) == {"ejlabel": "x", "ejcall": "y"}
    assert _instr(module, "q") == ("parameter", "f32[4]", ())
    assert entry.root == "t" and _instr(module, "t") == ("tuple", "(f32[4], f32[4])", ("s", "p"))
    assert_same(module, hlo_parser.Parser(text, hlo.MAX_ATTRIBUTE_CHARS).run_lines())


def test_attribute_list_going_on_after_a_complete_line() -> None:
    # The first line alone is a complete instruction; the "," on a later line
    # (after a comment) continues its attributes.
    text = (
        "HloModule m\nENTRY e {\n  %a = f32[] parameter(0)\n  %b = f32[] negate(%a)\n"
        "  // the rest of b\n  , metadata={op_name=\"n\"}, custom_call_target=\"t\"\n"
        "  ROOT %c = f32[] fusion(%b), kind=kLoop, calls=%f\n"
        "}\n%f {\n  ROOT %x = f32[] parameter(0)\n}\n"
    )
    module = parse_hlo(text)
    b = module.computations["e"].instruction("b")
    assert b is not None and (b.op_name, b.custom_call_target, b.operands) == ("n", "t", ("a",))
    assert module.entry == "e" and module.computations["e"].instruction("c").called_computations == ("f",)
    assert_same(module, hlo_parser.Parser(text, hlo.MAX_ATTRIBUTE_CHARS).run_lines())


def test_comments_everywhere() -> None:
    module = parse_hlo(_read("parser_test_Comments.hlo"))
    assert module.name == "comments" and module.entry == "c1"
    assert _instr(module, "const1") == ("constant", "f32[1]{0}", ())
    text = (
        "/* a module\n   of two lines */ // and a line comment\n/**/HloModule /* c */ m // c\n"
        "ENTRY /* c */ %e /* c */ ( p: f32[] /* ) */ ) -> /* c */ f32[] /* { */ {\n"
        "  %p = f32[] parameter(0) /* multi\nline */ ROOT %n = f32[] negate(%p) // }\n"
        "} // end\n/* trailing */"
    )
    module = parse_hlo(text)
    assert module.name == "m" and module.entry == "e"
    assert [(i.name, i.opcode, i.operands, i.is_root) for i in module.entry_computation.instructions] == [
        ("p", "parameter", (), False),
        ("n", "negate", ("p",), True),
    ]
    assert module.entry_computation.line == 4


def test_tuple_shapes_with_spaces_and_nesting() -> None:
    text = """HloModule m
ENTRY e {
  p = ( f32[2]{0} ,( s32[ ] , pred[3, 4]{ 1,0 } ),/*index=2*/ token[] ) parameter(0)
  q = (f32[2]{0}, (s32[], pred[3,4]{1,0}), token[]) copy(p)
  ROOT r = (f32[1,2]{0,1:T(2,128)}, ()) tuple(f32[1,2]{0,1:T(2,128)} q, () q)
}
"""
    module = parse_hlo(text)
    printed = "(f32[2]{0}, (s32[], pred[3,4]{1,0}), token[])"
    assert _instr(module, "p") == ("parameter", printed, ())
    assert _instr(module, "q") == ("copy", printed, ("p",))
    assert _instr(module, "r") == ("tuple", "(f32[1,2]{0,1:T(2,128)}, ())", ("q", "q"))
    whitespace = parse_hlo(_read("parser_test_AllowShapeWhitespace.hlo"))
    assert _instr(whitespace, "root") == ("parameter", "f32[1,2,3,4,5]{0,1,2,3,4}", ())


def test_variadic_tuple_shaped_reduce() -> None:
    module = parse_hlo(_read("emitters_reduce_row_variadic_f32.hlo"))
    # The shape on one line, the opcode on the next.
    assert _instr(module, "reduce") == ("reduce", "(f32[2,3], f32[2,3])", ("param_0", "param_1", "c0", "c0"))
    assert module.computations["fusion"].instruction("reduce").called_computations == ("add",)
    reduce2 = parse_hlo(_read("emitters_reduce_row_mof_scalar_variadic.hlo")).computations["fusion"].instruction("reduce2")
    assert reduce2 is not None and reduce2.shape == "(f32[], f32[])" and reduce2.operands == ("p0", "p0", "c0", "c0")
    root = parse_hlo(_read("parser_test_TupleReduce.hlo")).entry_computation.root_instruction
    assert root is not None and (root.opcode, root.shape) == ("reduce", "(f32[], s32[])")
    assert root.operands == ("values", "indices", "init_value", "init_index")


def test_stablehlo_mentioned_in_hlo_is_still_hlo() -> None:
    text = """// Lowered from: func.func @main(%arg0: tensor<f32>) { stablehlo.add }
HloModule jit_f, entry_computation_layout={(f32[])->f32[]}

ENTRY %main (x: f32[]) -> f32[] {
  %x = f32[] parameter(0), metadata={op_name="stablehlo.add" source_file="module { func.func }"}
  ROOT %y = f32[] custom-call(f32[] %x), custom_call_target="stablehlo.custom", backend_config="func.func @f"
}
"""
    assert program_kind(text) == "hlo"
    module = parse_hlo(text)
    assert [(i.name, i.opcode, i.shape, i.operands) for i in module.instructions()] == [
        ("x", "parameter", "f32[]", ()),
        ("y", "custom-call", "f32[]", ("x",)),
    ]
    assert module.entry_computation.instruction("y").custom_call_target == "stablehlo.custom"
    # A real file whose FileCheck lines name func.func.
    assert program_kind(_read("emitters_scatter_variadic_scatter_argmax.hlo")) == "hlo"


@pytest.mark.parametrize(
    ("text", "kind"),
    [
        ("module @jit_f attributes {mhlo.num_partitions = 1 : i32} {\n  func.func public @main() {}\n}\n", "stablehlo"),
        ("// comment\n/* HloModule x */\nmodule {\n  func.func @main() { return }\n}\n", "stablehlo"),
        ('#loc = loc("x.py":1:0)\nmodule @m {\n}\n', "stablehlo"),
        ("#map = affine_map<(d0) -> (d0)>\nmodule {}\n", "stablehlo"),
        ("func.func @main(%a: tensor<f32>) -> tensor<f32> { return %a : tensor<f32> }", "stablehlo"),
        ('"builtin.module"() ({}) : () -> ()', "stablehlo"),
        ("HloModule m\n// module @x { func.func }\nENTRY e {\n  ROOT a = f32[] parameter(0)\n}\n", "hlo"),
        ("  \n/* module @x */ ENTRY e {\n  ROOT a = f32[] parameter(0)\n}\n", "hlo"),
        ("# a comment line\nHloModule m\n", "hlo"),
        ("module {\n  ROOT a = f32[] parameter(0)\n}\n", "hlo"),
        ("module (p: f32[]) -> f32[] {\n  ROOT p = f32[] parameter(0)\n}\n", "hlo"),
        ("%fused (p: f32[]) -> f32[] {\n  ROOT p = f32[] parameter(0)\n}\n", "hlo"),
        ("", "hlo"),
    ],
)
def test_program_kind(text: str, kind: str) -> None:
    assert program_kind(text) == kind


def test_instructions_written_in_place_of_operands() -> None:
    module = parse_hlo(_read("parser_test_SimpleNesting.hlo"))
    assert [(i.name, i.opcode, i.shape, i.operands) for i in module.entry_computation.instructions] == [
        ("parameter.anon", "parameter", "f32[10]", ()),
        ("parameter.anon.1", "parameter", "f32[10]", ()),
        ("parameter.anon.2", "parameter", "f32[10]", ()),
        ("multiply.anon", "multiply", "", ("parameter.anon.1", "parameter.anon.2")),
        ("root", "add", "", ("parameter.anon", "multiply.anon")),
    ]
    mixed = parse_hlo(_read("parser_test_MixAnonAndNonAnonOperands.hlo")).entry_computation
    assert mixed.instruction("root").operands == ("add", "add.anon", "add")
    assert mixed.instruction("add.anon").operands == ("add", "add")
    nested_tuple = parse_hlo(_read("parser_test_TupleShapeInsideAnonymousInstr.hlo")).entry_computation
    assert nested_tuple.instruction("tuple.anon").shape == "(f32[10], f16[10])"
    assert nested_tuple.root_instruction.operands == ("tuple.anon",)


def test_inline_computations() -> None:
    text = """HloModule m
ENTRY e {
  p0 = f32[] parameter(0)
  c = s32[] parameter(1)
  r0 = f32[] call(p0), to_apply={
    p1 = f32[] parameter(0)
    ROOT r1 = f32[] call(p1), to_apply={ p2 = f32[] parameter(0)
      ROOT n = f32[] negate(p2) }
  }
  ROOT b = f32[] conditional(c, r0, r0), branch_computations={
{
  t0 = f32[] parameter(0)
  ROOT t1 = f32[] ceil(t0)
},
{
  t0 = f32[] parameter(0)
  ROOT t1 = f32[] floor(t0)
}
}
}
"""
    module = parse_hlo(text)
    assert list(module.computations) == ["r1.to_apply", "r0.to_apply", "b.branch_computations.0", "b.branch_computations.1", "e"]
    entry = module.entry_computation
    assert [i.name for i in entry.instructions] == ["p0", "c", "r0", "b"]
    assert entry.instruction("r0").called_computations == ("r0.to_apply",)
    assert entry.instruction("b").called_computations == ("b.branch_computations.0", "b.branch_computations.1")
    assert module.computations["r0.to_apply"].instruction("r1").called_computations == ("r1.to_apply",)
    assert module.computations["r1.to_apply"].root == "n"
    assert module.callers_of("b.branch_computations.1") == [entry.instruction("b")]
    deep = "HloModule m\nENTRY e {\n" + "p = f32[] parameter(0)\nROOT r = f32[] call(p), to_apply={\n" * 200 + "}\n" * 201
    with pytest.raises(HloParseError, match="too deep"):
        parse_hlo(deep)


def test_computation_attributes_and_closing_brace_comments() -> None:
    module = parse_hlo(_read("parser_test_HloComputationWithParallelThreadName.hlo"))
    assert module.entry == "Entry" and module.entry_computation.root == "async-done"
    assert parse_hlo(_read("parser_test_ParseComputationNameClosingBrace.hlo")).entry == "test"


def test_header_value_over_lines_holding_hlo_text() -> None:
    # origin_recovery_table holds a whole module in a string: it is no part of this one.
    module = parse_hlo(_read("parser_test_OriginalValueRecoveryTable.hlo"))
    assert module.name == "module"
    assert list(module.computations) == ["add.clone", "entry_spmd"]
    assert module.entry_computation.instruction("all-reduce").called_computations == ("add.clone",)


def test_attribute_forms() -> None:
    pred = parse_hlo(_read("parser_test_ConstantPred.hlo")).entry_computation.root_instruction
    assert pred is not None and pred.op_name == "\"it's not a problem\n" and pred.source_line == 68
    assert pred.backend_config == '"foo\\" bar"'
    composite = parse_hlo(_read("parser_test_CompositeCall.hlo")).entry_computation.root_instruction
    assert composite is not None and composite.called_computations == ("add",)
    assert dict(composite.frontend_attributes) == {
        "composite.attributes": "{n = 1 : i32, tensor = dense<1> : tensor<i32>}",
        "composite.name": "foo.bar",
        "composite.version": "1",
    }
    curly = parse_hlo(_read("parser_test_CustomCallWithBackendConfigInCurlyBraces.hlo")).entry_computation.root_instruction
    assert curly is not None and curly.custom_call_target == 'foo"bar' and curly.backend_config == '{key: "value"}'
    for name in ("parser_test_CustomCallWithLiteralR0.hlo", "parser_test_CustomCallWithLiteralTuple.hlo"):
        call = parse_hlo(_read(name)).entry_computation.root_instruction
        assert call is not None and call.operands == ("constant",) and call.custom_call_target == 'foo"bar'
    propagated = parse_hlo(_read("parser_test_AsyncInstructionWithAttributesShouldPropagateToWrappedInstruction.hlo"))
    start = propagated.entry_computation.instruction("add-start")
    assert start is not None and start.operands == ("a", "b") and start.shape == "((s32[], s32[]), s32[], s32[])"
    assert (start.op_name, start.source_file, start.source_line) == ("sample name", "path/to/test.cc", 68)
    assert dict(start.frontend_attributes) == {"attr_a": "test_a", "attr_b": "b"}
    assert start.backend_config == '"foo\\" bar"'
    comma = parse_hlo(_read("parser_test_CommaBetweenSubAttributes.hlo")).entry_computation.root_instruction
    assert comma is not None and comma.source_line == 5
    conditional = parse_hlo(_read("parser_test_IndexedConditional.hlo")).entry_computation.root_instruction
    assert conditional is not None and conditional.called_computations == ("Negate", "Identity", "Floor")
    send = parse_hlo(_read("parser_test_SendRecv.hlo")).entry_computation
    assert send.root == "recv-done" and send.instruction("send").operands == ("constant", "token0")
    window = parse_hlo(_read("parser_test_ReduceWindow.hlo")).entry_computation.root_instruction
    assert window is not None and window.operands == ("operand", "constant") and window.called_computations == ("add_F32.v3",)
    aliasing = parse_hlo(_read("parser_test_AsyncStartWithAliasing.hlo")).entry_computation.instruction("all-to-all-start.1")
    assert aliasing is not None and aliasing.operands == ("tuple",) and aliasing.called_computations == ("async_computation",)
    assert aliasing.shape.startswith("(((f32[8,4,1]{1,2,0:T(1,128)}, (f32[8,4,1]{1,2,0:T(1,128)}, u32[]{:S(2)}")
    pipelined = parse_hlo(_read("parser_test_PipelinedSendRecv.hlo"))
    send_p = pipelined.entry_computation.instruction("send.0.p")
    assert send_p is not None and send_p.operands == ("init", "after-all.1.p")
    assert dict(send_p.frontend_attributes) == {"_xla_send_recv_source_target_pairs": "{{1,0}}", "_xla_send_recv_pipeline": "0"}
    assert pipelined.entry_computation.instruction("while_result").called_computations == ("body", "cond")
    assert pipelined.computations["cond"].instruction("count").shape == ""
    gather = parse_hlo(_read("parser_test_AllGatherWithSubgroupsIotaList.hlo")).entry_computation.root_instruction
    assert gather is not None and gather.operands == ("input",)
    sections = parse_hlo(_read("parser_test_StackFrameIndex.hlo")).entry_computation.root_instruction
    assert sections is not None and (sections.source_file, sections.source_line) == ("<embedded module>", 153)


def test_line_ends() -> None:
    for ending in ("\r\n", "\r"):
        text = ending.join(
            ["HloModule slash_slash_comment:", "// Garbage", "ENTRY c1 {", "// Foo bar",
             "ROOT const1 = f32[1]{0} constant({12345}) // Something else", "}"]
        )
        module = parse_hlo(text)
        assert module.name == "slash_slash_comment" and module.entry == "c1"
        assert _instr(module, "const1") == ("constant", "f32[1]{0}", ())


@pytest.mark.parametrize(
    ("text", "line"),
    [
        ("HloModule m\nENTRY e {\n  ROOT a = f5000000000000[1] parameter(0)\n}\n", 3),
        ("HloModule m\nENTRY e {\n  ROOT %a = f5000000000000[1]{0} parameter(0), metadata={op_name=\"x\"}\n}\n", 3),
        ("HloModule m\nENTRY e {\n  a = f32[] parameter(0)\n  ROOT b = (f32[], u99999[2]) tuple(a, a)\n}\n", 4),
        ("HloModule m\nENTRY e {\n  a = f32[] parameter(0)\n  ROOT b = f32[] negate(f12345678901234567890[] a)\n}\n", 4),
        ("HloModule m\nENTRY e (p: f32[]) -> f32[] {\n  a = f32[] parameter(0)\n  /* open\n  ROOT b = f32[] negate(a)\n}\n", 4),
        ("HloModule m\nENTRY e {\n  a = f32[] parameter(0), metadata={op_name=\"x}\n}\n", 3),
        ("HloModule m\nENTRY e {\n  a = f32[] parameter(0)\n  ROOT b = f32[] add(a,\n    a\n}\n", 4),
        ("HloModule m\nENTRY e {\n  , index=0\n  a = f32[] parameter(0)\n}\n", 3),
        ("HloModule m\nENTRY e {\n  a = f32[] parameter(0)\n}\n, x=\n", 5),
        ("HloModule m\nENTRY e {\n  a = f32[] parameter(0)\n  ROOT b = f32[] call(a), to_apply={\n    c = f32[] parameter(0)\n}\n", 2),
    ],
)
def test_malformed(text: str, line: int) -> None:
    with pytest.raises(HloParseError) as info:
        parse_hlo(text)
    assert info.value.line == line, str(info.value)


def test_truncations_raise_only_parse_errors() -> None:
    chooser = random.Random(20240611)
    texts = [path.read_bytes() for path in FILES]
    for _ in range(200):
        data = chooser.choice(texts)
        cut = data[: chooser.randrange(len(data) + 1)]
        try:
            module = parse_hlo(cut)
        except HloParseError as error:
            assert isinstance(error.line, int) and isinstance(error.snippet, str)
            str(error)
        else:
            assert isinstance(module, HloModule) and module.entry in module.computations


# ---------------------------------------------------------------------------
# Linear time

HOSTILE = [
    "a" * 100_000,
    '"' * 100_000,
    "{" * 100_000,
    "%a=" * 33_334,
    "(" * 100_000,
    "[" * 100_000,
    "/*" * 50_000,
    "/*a" * 33_334,
    '"\\' * 50_000,
    "a=" * 50_000,
    ", a=" * 25_000,
    " " * 100_000,
    "f5" * 50_000 + "[",
    "<=" * 50_000,
    "%a, " * 25_000,
    "//" * 50_000,
]


def _patterns() -> list[tuple[str, re.Pattern[str]]]:
    return [
        (name, value)
        for name, value in vars(hlo).items()
        if isinstance(value, re.Pattern) and isinstance(value.pattern, str)
    ]


def test_every_pattern_is_linear_on_hostile_input() -> None:
    slow = []
    for name, pattern in _patterns():
        for text in HOSTILE:
            start = time.perf_counter()
            pattern.match(text)
            pattern.fullmatch(text)
            # Scans (search, findall, sub) try every start position.
            pattern.findall(text)
            spent = time.perf_counter() - start
            if spent > 0.5:
                slow.append((name, text[:8], round(spent, 2)))
    assert not slow


@pytest.mark.parametrize("filler", HOSTILE, ids=range(len(HOSTILE)))
def test_parse_is_fast_on_hostile_input(filler: str) -> None:
    texts = [
        filler,
        "HloModule m\n" + filler,
        f"HloModule m\nENTRY e {{\n  a = f32[] parameter(0)\n  {filler}\n}}\n",
        f"HloModule m\nENTRY e {{\n  a = f32[] add({filler})\n}}\n",
        f"HloModule m\nENTRY e {{\n  a = f32[] parameter(0), metadata={{{filler}}}\n}}\n",
        f"HloModule m\nENTRY e {{\n  a = f32[] parameter(0), backend_config={filler}\n}}\n",
        f"HloModule m, a={filler}\nENTRY e {{\n  a = f32[] parameter(0)\n}}\n",
    ]
    for text in texts:
        start = time.perf_counter()
        try:
            parse_hlo(text)
        except HloParseError:
            pass
        program_kind(text)
        assert time.perf_counter() - start < 1.0, text[:60]
