"""Tests for the HLO text reader: real texts from jax on CPU, hand-written GPU-style
samples, malformed lines, and a fuzz test that mutates real text."""

from __future__ import annotations

import dataclasses
import os
import re
import subprocess
import sys
import textwrap

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ejlabel.analysis import hlo, hlo_items, hlo_parser
from ejlabel.analysis.hlo import HloModule, HloParseError, parse_hlo, stablehlo_frontend_attributes

LABEL = "ejkernel_ops#matmul@v1:0123456789abcdef"
CALL = "eyJhIjoxfQ"

# A program with every structure the reader must follow: a labelled kernel, a
# fori_loop (known trip count), a scan, a cond, a vmap, a while_loop, tuples and
# constants; plus its gradient, a checkpointed gradient and a token-using call.
PROGRAM = textwrap.dedent(
    f"""
    import jax, jax.numpy as jnp
    from jax import lax
    from jax.experimental import io_callback
    from jax.experimental.xla_metadata import set_xla_metadata

    def kernel(x):
        with set_xla_metadata(ejlabel="{LABEL}", ejcall="{CALL}"):
            return jnp.sin(x @ x)

    def f(x, y, with_while=True):
        z = kernel(x)
        z = lax.fori_loop(0, 3, lambda i, c: c * 2.0 + jnp.cos(c), z)
        c, ys = lax.scan(lambda c, xs: (c + xs, c * xs), z[0], z)
        w = lax.cond(c.sum() > 0, lambda a: a + 1, lambda a: a - 1, ys)
        v = jax.vmap(lambda r: r @ y)(w)
        if with_while:
            v = lax.while_loop(lambda t: t[0] < 5, lambda t: (t[0] + 1, t[1] * 1.5), (0, v))[1]
        return v.sum(), (v, jnp.array([1.5, 2.0]))

    x = jnp.ones((4, 4)); y = jnp.ones((4, 4))
    programs = {{
        "f": (jax.jit(f), (x, y)),
        "grad": (jax.jit(jax.grad(lambda x, y: f(x, y, with_while=False)[0])), (x, y)),
        "checkpoint": (jax.jit(jax.grad(jax.checkpoint(lambda x: kernel(x).sum()))), (x,)),
        "token": (jax.jit(lambda x: io_callback(lambda a: None, None, x, ordered=True) or kernel(x)), (x,)),
    }}
    """
)


def _lower_all(namespace: dict) -> dict[str, dict[str, str]]:
    texts: dict[str, dict[str, str]] = {}
    for name, (fn, args) in namespace["programs"].items():
        lowered = fn.lower(*args)
        texts[name] = {
            "stablehlo": lowered.as_text(),
            "hlo": lowered.compiler_ir("hlo").as_hlo_text(),
            "compiled": lowered.compile().as_text(),
        }
    return texts


@pytest.fixture(scope="module")
def texts() -> dict[str, dict[str, str]]:
    """StableHLO, HLO and compiled HLO text of each program, from jax on CPU."""
    namespace: dict = {}
    exec(compile(PROGRAM, "<hlo-test-program>", "exec"), namespace)
    return _lower_all(namespace)


@pytest.fixture(scope="module")
def dumps(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """XLA dump files (before/after optimizations) of the programs, from a subprocess."""
    out = tmp_path_factory.mktemp("xla_dump")
    script = PROGRAM + "\nfor fn, args in programs.values():\n    fn.lower(*args).compile()\n"
    env = dict(os.environ, XLA_FLAGS=f"--xla_dump_to={out}", JAX_PLATFORMS="cpu")
    subprocess.run([sys.executable, "-c", script], env=env, check=True, capture_output=True, timeout=300)
    files = sorted(out.glob("*before_optimizations.txt")) + sorted(out.glob("*after_optimizations.txt"))
    assert files, "XLA wrote no dumps"
    return {path.name: path.read_text() for path in files}


def _hlo_samples(texts: dict[str, dict[str, str]]) -> dict[str, str]:
    return {f"{name}.{form}": forms[form] for name, forms in texts.items() for form in ("hlo", "compiled")}


def _naive_instruction_count(text: str) -> int:
    """Indented lines with " = ": every printed form indents instructions and nothing else."""
    return sum(1 for line in text.splitlines() if line[:1].isspace() and " = " in line)


# ---------------------------------------------------------------------------
# Real texts


def test_real_texts_parse_completely(texts: dict[str, dict[str, str]], dumps: dict[str, str]) -> None:
    samples = {**_hlo_samples(texts), **dumps}
    for name, text in samples.items():
        module = parse_hlo(text)
        assert isinstance(module, HloModule)
        assert module.instruction_count() == _naive_instruction_count(text), name
        assert module.entry_computation.is_entry
        assert module.entry.startswith("main"), name
        assert sum(c.is_entry for c in module.computations.values()) == 1
        for computation in module.computations.values():
            roots = [i for i in computation.instructions if i.is_root]
            assert len(roots) == 1, (name, computation.name)
            assert computation.root == roots[0].name
            assert computation.root_instruction is roots[0]
        for instr in module.instructions():
            assert module.computation_of(instr).instruction(instr.name) is instr
            for callee in instr.called_computations:
                assert callee in module.computations, (name, instr.name, callee)


def test_labels_and_control_flow_in_compiled_hlo(texts: dict[str, dict[str, str]]) -> None:
    module = parse_hlo(texts["f"]["compiled"])
    labelled = list(module.with_attribute("ejlabel"))
    assert labelled
    for instr in labelled:
        assert instr.frontend_attributes == {"ejlabel": LABEL, "ejcall": CALL}
    # Identical attribute texts share one mapping; unlabelled ones share the empty mapping.
    assert len({id(i.frontend_attributes) for i in labelled}) == 1
    plain = [i for i in module.instructions() if not i.frontend_attributes]
    assert len({id(i.frontend_attributes) for i in plain}) == 1
    dot = next(i for i in labelled if i.opcode == "dot")
    assert dot.op_name is not None and dot.op_name.endswith("dot_general")
    kernel_line = PROGRAM.splitlines().index("        return jnp.sin(x @ x)") + 1
    assert dot.source_file == "<hlo-test-program>" and dot.source_line == kernel_line

    whiles = [i for i in module.instructions() if i.opcode == "while"]
    assert len(whiles) == 3
    for loop in whiles:
        condition, body = loop.called_computations
        assert module.computations[condition].root_instruction is not None
        assert module.computations[body].instructions
        assert len(loop.operands) == 1
        assert module.callers_of(body) == [loop]
    # fori_loop(0, 3), scan over 4 rows, while_loop to 5: XLA records each trip count.
    assert sorted(i.known_trip_count for i in whiles) == [3, 4, 5]

    conditional = next(i for i in module.instructions() if i.opcode == "conditional")
    assert len(conditional.called_computations) == 2
    assert len(conditional.operands) == 3
    for fusion in (i for i in module.instructions() if i.opcode == "fusion"):
        assert len(fusion.called_computations) == 1
        assert module.computations[fusion.called_computations[0]].root is not None
    callers = module.callers()
    assert module.entry not in callers
    assert all(comp in callers for comp in module.computations if comp != module.entry)


def test_unoptimized_hlo(texts: dict[str, dict[str, str]]) -> None:
    module = parse_hlo(texts["f"]["hlo"])
    assert module.name == "jit_f"
    labelled = list(module.with_attribute("ejlabel"))
    assert {i.opcode for i in labelled} == {"dot", "sine"}
    entry = module.entry_computation
    parameters = [i for i in entry.instructions if i.opcode == "parameter"]
    assert [p.name for p in parameters] == ["x.1", "y.1"] and all(p.operands == () for p in parameters)
    constant = next(i for i in module.instructions() if i.opcode == "constant" and i.shape.startswith("f32[2]"))
    assert constant.operands == ()
    tuple_root = entry.root_instruction
    assert tuple_root is not None and tuple_root.opcode == "tuple" and tuple_root.shape.startswith("(")
    assert len(tuple_root.operands) == 3
    gte = next(i for i in module.instructions() if i.opcode == "get-tuple-element")
    assert len(gte.operands) == 1
    # Every operand names an instruction of the same computation.
    for computation in module.computations.values():
        names = {i.name for i in computation.instructions}
        for instr in computation.instructions:
            assert set(instr.operands) <= names, instr


def test_token_and_grad_programs(texts: dict[str, dict[str, str]]) -> None:
    for form in ("hlo", "compiled"):
        module = parse_hlo(texts["token"][form])
        token_param = module.entry_computation.instructions[0]
        assert (token_param.opcode, token_param.shape) == ("parameter", "token[]")
        callback = next(i for i in module.instructions() if i.opcode == "custom-call")
        assert callback.shape == "token[]" and callback.custom_call_target == "xla_ffi_python_cpu_callback"
        assert callback.operands[0] == token_param.name
        assert callback.backend_config == "{index = 0 : ui64}"
        assert module.entry_computation.root_instruction.shape.startswith("(token[], ")
    grad = parse_hlo(texts["grad"]["compiled"])
    assert sum(1 for _ in grad.with_attribute("ejlabel")) >= 2


def test_dumps_keep_source_locations(dumps: dict[str, str]) -> None:
    after = next(text for name, text in dumps.items() if "jit_f" in name and "after_optimizations" in name)
    module = parse_hlo(after)
    # The dumping subprocess runs the program from "-c", so its file name is "<string>".
    located = [i for i in module.instructions() if i.source_file == "<string>"]
    assert located and all(isinstance(i.source_line, int) and i.source_line > 0 for i in located)
    assert {i.known_trip_count for i in module.instructions() if i.opcode == "while"} == {3, 4, 5}


def test_stablehlo_frontend_attributes(texts: dict[str, dict[str, str]]) -> None:
    found = stablehlo_frontend_attributes(texts["f"]["stablehlo"])
    assert found and all(d == {"ejlabel": LABEL, "ejcall": CALL} for d in found)
    # One per labelled op line, in order.
    op_lines = [line for line in texts["f"]["stablehlo"].splitlines() if "mhlo.frontend_attributes" in line]
    assert len(found) == len(op_lines)
    assert stablehlo_frontend_attributes('%0 = "x"() {mhlo.frontend_attributes = {a = "q\\22b\\\\", b = "2"}} : () -> ()') == [
        {"a": 'q"b\\', "b": "2"}
    ]
    assert stablehlo_frontend_attributes("not mlir {") == []


def _fields(instr: object) -> list[object]:
    """Every public field, and the source location read from the metadata."""
    names = [f.name for f in dataclasses.fields(instr) if not f.name.startswith("_")]  # type: ignore[arg-type]
    return [getattr(instr, name) for name in [*names, "op_name", "source_file", "source_line"]]


def test_fast_path_agrees_with_general_path(
    texts: dict[str, dict[str, str]], dumps: dict[str, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    samples = [*_hlo_samples(texts).values(), *dumps.values(), GPU_FUSION, GPU_ASYNC]
    fast = [parse_hlo(text) for text in samples]
    monkeypatch.setattr(hlo_items, "FAST_LINE", re.compile(r"(?!)"))
    general = [parse_hlo(text) for text in samples]
    for a, b in zip(fast, general):
        assert a.entry == b.entry and list(a.computations) == list(b.computations)
        for x, y in zip(a.instructions(), b.instructions(), strict=True):
            assert _fields(x) == _fields(y)


def test_quick_scan_agrees_with_line_by_line_reader(texts: dict[str, dict[str, str]], dumps: dict[str, str]) -> None:
    samples = [*_hlo_samples(texts).values(), *dumps.values(), GPU_FUSION, GPU_ASYNC, COMPILED_STYLE]
    for text in samples:
        quick = parse_hlo(text)
        lines = hlo_parser.Parser(text, hlo.MAX_ATTRIBUTE_CHARS).run_lines()
        assert quick.name == lines.name and quick.entry == lines.entry
        assert [(c.name, c.is_entry, c.root, c.line) for c in quick.computations.values()] == [
            (c.name, c.is_entry, c.root, c.line) for c in lines.computations.values()
        ]
        for x, y in zip(quick.instructions(), lines.instructions(), strict=True):
            assert _fields(x) == _fields(y)


# Lines of the form the quick scan reads, mixed with lines it leaves to the line reader.
COMPILED_STYLE = """HloModule m, is_scheduled=true

%fused (p0: f32[4], p1: f32[4]) -> f32[4] {
  %p0 = f32[4]{0} parameter(0)
  %p1 = f32[4]{0} parameter(1)
  ROOT %add.f = f32[4]{0} add(%p0, %p1)
}

ENTRY %main (x: f32[4]) -> f32[4] {
  %x = f32[4]{0} parameter(0), metadata={op_name="x" source_file="m.py" source_line=3}
  %f = f32[4]{0} fusion(%x, %x), kind=kLoop, calls=%fused, frontend_attributes={ejlabel="l#a@v1:00"}, metadata={op_name="jit(f)/add" source_file="m.py" source_line=4}
  %d = f32[4]{0} dot(%f, %x), lhs_contracting_dims={0}, rhs_contracting_dims={0}, metadata={op_name="jit(f)/dot" source_file="m.py" source_line=5}
  %t = (f32[4]{0}, /*index=1*/s32[]) tuple(%d, %f)
  %g = f32[4]{0} get-tuple-element(%t), index=0, metadata={op_name="esc\\\"aped"}
  c = f32[4]{0} multiply(g, x)
  ROOT %r = f32[4]{0} copy(%c), metadata={op_name="r" source_file="m.py" source_line=9}
}
"""


def test_metadata_is_read_on_first_access() -> None:
    module = parse_hlo(COMPILED_STYLE)
    entry = module.entry_computation
    fusion = entry.instruction("f")
    assert fusion is not None
    assert fusion.metadata == '{op_name="jit(f)/add" source_file="m.py" source_line=4}'
    assert (fusion.op_name, fusion.source_file, fusion.source_line) == ("jit(f)/add", "m.py", 4)
    assert fusion.called_computations == ("fused",) and fusion.frontend_attributes == {"ejlabel": "l#a@v1:00"}
    assert entry.instruction("t").shape == "(f32[4]{0}, s32[])"
    assert entry.instruction("t").op_name is None and entry.instruction("t").metadata is None
    assert entry.instruction("g").op_name == 'esc"aped'
    assert entry.instruction("c").operands == ("g", "x")


# ---------------------------------------------------------------------------
# Hand-written GPU-style samples

GPU_FUSION = r"""HloModule jit_attention, is_scheduled=true, entry_computation_layout={(bf16[2,8,128,64]{3,2,1,0}, bf16[2,8,128,64]{3,2,1,0})->bf16[2,8,128,64]{3,2,1,0}}, frontend_attributes={fingerprint_before_lhs="abc"}

%fused_multiply (param_0.1: bf16[2,8,128,64]) -> bf16[2,8,128,64] {
  %param_0.1 = bf16[2,8,128,64]{3,2,1,0} parameter(0)
  %constant_1 = bf16[] constant(0.125)
  %broadcast.1 = bf16[2,8,128,64]{3,2,1,0} broadcast(bf16[] %constant_1), dimensions={}
  ROOT %multiply.1 = bf16[2,8,128,64]{3,2,1,0} multiply(bf16[2,8,128,64]{3,2,1,0} %param_0.1, bf16[2,8,128,64]{3,2,1,0} %broadcast.1), frontend_attributes={ejcall="eyJiIjoyfQ",ejlabel="ejkernel_ops#flash_attention@v2:fedcba9876543210"}, metadata={op_name="jit(attention)/mul" source_file="/src/model.py" source_line=41}
}

// Comments and blank lines are allowed between computations.

ENTRY %main.7 (q.1: bf16[2,8,128,64], k.1: bf16[2,8,128,64]) -> bf16[2,8,128,64] {
  %q.1 = bf16[2,8,128,64]{3,2,1,0:T(8,128)(2,1)} parameter(0), sharding={replicated}
  %k.1 = bf16[2,8,128,64]{3,2,1,0} parameter(1)
  %loop_multiply_fusion = bf16[2,8,128,64]{3,2,1,0} fusion(%q.1), kind=kLoop, calls=%fused_multiply, metadata={op_name="jit(attention)/mul" source_file="/src/model.py" source_line=41}, backend_config={"operation_queue_id":"0","wait_on_operation_queues":[],"fusion_backend_config":{"kind":"__loop_fusion","block_level_fusion_config":{"output_tiles":[{"sizes":["1","1"]}],"num_warps":"4"}}}
  %custom-call.3 = (bf16[2,8,128,64]{3,1,2,0}, f32[2,8,128]{2,1,0}, /*index=2*/u8[0]{0}) custom-call(%loop_multiply_fusion, %k.1, %k.1), custom_call_target="__cudnn$fmhaSoftmax", operand_layout_constraints={bf16[2,8,128,64]{3,2,1,0}, bf16[2,8,128,64]{3,2,1,0}, bf16[2,8,128,64]{3,2,1,0}}, api_version=API_VERSION_STATUS_RETURNING, frontend_attributes={ejcall="eyJiIjoyfQ",ejlabel="ejkernel_ops#flash_attention@v2:fedcba9876543210"}, metadata={op_name="jit(attention)/custom_call" source_file="/src/model.py" source_line=44}, backend_config={"operation_queue_id":"0","wait_on_operation_queues":[],"cudnn_fmha_backend_config":{"algorithm":{"algo_id":"0","math_type":"TENSOR_OP_MATH","tuning_knobs":{"17":"1","24":"0"},"is_cudnn_frontend":true,"workspace_size":"0"},"fmha_scale":0.125,"intermediate_tensor_shape":{"element_type":"F32","dimensions":["2","8","128","128"],"tuple_shapes":[],"layout":{"dim_level_types":[],"dim_unique":[],"dim_ordered":[],"minor_to_major":["3","2","1","0"],"tiles":[],"element_size_in_bits":"0","memory_space":"0","index_primitive_type":"PRIMITIVE_TYPE_INVALID","pointer_primitive_type":"PRIMITIVE_TYPE_INVALID","dynamic_shape_metadata_prefix_bytes":"0"},"is_dynamic_dimension":[false,false,false,false]},"seed":42,"is_flash_attention":true,"mask_type":"NO_MASK","bmm1_dot_dimension_numbers":{"lhs_contracting_dimensions":["3"],"rhs_contracting_dimensions":["3"],"lhs_batch_dimensions":["0","1"],"rhs_batch_dimensions":["0","1"]},"sliding_window_length":0}}
  ROOT %get-tuple-element.2 = bf16[2,8,128,64]{3,1,2,0} get-tuple-element((bf16[2,8,128,64]{3,1,2,0}, f32[2,8,128]{2,1,0}, /*index=2*/u8[0]{0}) %custom-call.3), index=0, metadata={op_name="weird \"quoted, {braced}\" name"}
}
"""

GPU_ASYNC = r"""HloModule jit_step, entry_computation_layout={(f32[8]{0})->f32[8]{0}}

%add.clone (x.1: f32[], y.1: f32[]) -> f32[] {
  %x.1 = f32[] parameter(0)
  %y.1 = f32[] parameter(1)
  ROOT %add.2 = f32[] add(%x.1, %y.1)
}

%region_cond (p: (s32[], f32[8])) -> pred[] {
  %p = (s32[], f32[8]{0}) parameter(0)
  %i = s32[] get-tuple-element(%p), index=0
  %n = s32[] constant(10)
  ROOT %lt = pred[] compare(%i, %n), direction=LT
}

%region_body (p.1: (s32[], f32[8])) -> (s32[], f32[8]) {
  %p.1 = (s32[], f32[8]{0}) parameter(0)
  %i.1 = s32[] get-tuple-element(%p.1), index=0
  %v = f32[8]{0} get-tuple-element(%p.1), index=1
  %all-reduce-start = f32[8]{0} all-reduce-start(%v), channel_id=1, replica_groups=[1,2]<=[2], use_global_device_ids=true, to_apply=%add.clone, frontend_attributes={ejlabel="ejkernel_ops#all_reduce@v1:00000000000000aa"}, backend_config={"operation_queue_id":"0","collective_backend_config":{"is_sync":false}}
  %all-reduce-done = f32[8]{0} all-reduce-done(%all-reduce-start)
  ROOT %t = (s32[], f32[8]{0}) tuple(%i.1, %all-reduce-done), control-predecessors={%all-reduce-start}
}

ENTRY %main.3 (a: f32[8]) -> f32[8] {
  %a = f32[8]{0} parameter(0)
  %zero = s32[] constant(0)
  %init = (s32[], f32[8]{0}) tuple(%zero, %a)
  %while.1 = (s32[], f32[8]{0}) while(%init), condition=%region_cond, body=%region_body, backend_config="{\"known_trip_count\":{\"n\":\"10\"}}"
  %big = f32[2,2]{1,0} constant({ {1, 2}, {3, 4} })
  ROOT %r = f32[8]{0} get-tuple-element(%while.1), index=1
}
"""


def test_gpu_style_fusion_and_custom_call() -> None:
    module = parse_hlo(GPU_FUSION)
    assert module.name == "jit_attention" and module.entry == "main.7"
    fused = module.computations["fused_multiply"]
    inner = fused.root_instruction
    assert inner is not None and inner.opcode == "multiply"
    # Typed operands ("bf16[...] %x") reduce to names.
    assert inner.operands == ("param_0.1", "broadcast.1")
    assert inner.frontend_attributes["ejlabel"] == "ejkernel_ops#flash_attention@v2:fedcba9876543210"
    assert (inner.source_file, inner.source_line) == ("/src/model.py", 41)
    fusion = module.entry_computation.instruction("%loop_multiply_fusion")
    assert fusion is not None and fusion.called_computations == ("fused_multiply",)
    assert fusion.frontend_attributes == {}
    assert fusion.backend_config is not None and '"__loop_fusion"' in fusion.backend_config
    assert module.callers_of("fused_multiply") == [fusion]
    call = module.entry_computation.instruction("custom-call.3")
    assert call is not None
    assert call.custom_call_target == "__cudnn$fmhaSoftmax"
    assert call.operands == ("loop_multiply_fusion", "k.1", "k.1")
    assert call.shape == "(bf16[2,8,128,64]{3,1,2,0}, f32[2,8,128]{2,1,0}, u8[0]{0})"
    assert call.backend_config is not None and call.backend_config.endswith('"sliding_window_length":0}}')
    root = module.entry_computation.root_instruction
    assert root is not None and root.operands == ("custom-call.3",)
    assert root.op_name == 'weird "quoted, {braced}" name'
    assert module.entry_computation.instruction("q.1").shape == "bf16[2,8,128,64]{3,2,1,0:T(8,128)(2,1)}"


def test_gpu_style_async_collectives_and_quoted_backend_config() -> None:
    module = parse_hlo(GPU_ASYNC)
    body = module.computations["region_body"]
    start = body.instruction("all-reduce-start")
    assert start is not None and start.called_computations == ("add.clone",)
    assert start.frontend_attributes["ejlabel"].startswith("ejkernel_ops#all_reduce@v1:")
    assert body.root_instruction is not None and body.root_instruction.operands == ("i.1", "all-reduce-done")
    loop = module.entry_computation.instruction("while.1")
    assert loop is not None
    assert loop.called_computations == ("region_cond", "region_body")
    assert loop.known_trip_count == 10
    assert module.entry_computation.instruction("big").operands == ()


def test_snippet_without_module_header() -> None:
    module = parse_hlo("%c (p: f32[]) -> f32[] {\n  %p = f32[] parameter(0)\n  %n = f32[] negate(%p)\n}\n")
    assert module.name == "" and module.entry == "c"
    root = module.entry_computation.root_instruction
    assert root is not None and root.name == "n" and root.is_root  # last instruction, as XLA reads it


def test_stack_frame_tables_after_computations() -> None:
    text = textwrap.dedent(
        """\
        HloModule m
        ENTRY %main {
          ROOT %x = f32[] constant(1), metadata={op_name="x" stack_frame_id=2}
        }

        FileNames
        1 "a.py"

        FileLocations
        1 {file_name_id=1 function_name_id=1 line=12 end_line=12 column=1 end_column=2}

        StackFrames
        1 {file_location_id=1 parent_frame_id=1}
        2 {file_location_id=1 parent_frame_id=1}
        """
    )
    instr = parse_hlo(text).entry_computation.instructions[0]
    assert (instr.op_name, instr.source_file, instr.source_line) == ("x", "a.py", 12)


# ---------------------------------------------------------------------------
# Malformed input


@pytest.mark.parametrize(
    ("text", "line", "fragment"),
    [
        ("HloModule m\n\nENTRY %main {\n  %a = f32[] parameter(0)\n  %b = f32[] add(%a, %a\n}\n", 5, "%b = f32[] add(%a, %a"),
        ("HloModule m\nENTRY %main {\n  %a = f32[] parameter(0), metadata={op_name=\"x}\n}\n", 3, "metadata="),
        ("HloModule m\nENTRY %main {\n  %a = f32[] parameter(0)\n  this is not hlo\n}\n", 4, "this is not hlo"),
        ("HloModule m\nENTRY %main {\n  %a = f32[] parameter(0)\n", 2, "main"),
        ("HloModule m\n  %a = f32[] parameter(0)\n", 2, "%a = f32[]"),
        ("HloModule m\nHloModule n\n", 2, "HloModule n"),
        ("HloModule m\n", 0, ""),
    ],
)
def test_malformed_line_reports_line_and_snippet(text: str, line: int, fragment: str) -> None:
    with pytest.raises(HloParseError) as info:
        parse_hlo(text)
    error = info.value
    assert isinstance(error, ValueError)
    assert error.line == line
    assert fragment in error.snippet
    assert f"line {line}" in str(error) and repr(fragment)[1:-1] in str(error)


@pytest.mark.parametrize("text", ["", "   \n\n", b"\xff\xfe", 17, None])
def test_empty_or_wrong_input(text: object) -> None:
    with pytest.raises(HloParseError):
        parse_hlo(text)  # type: ignore[arg-type]


def test_long_line_snippet_is_shortened() -> None:
    line = "  %a = f32[] add(" + "%x, " * 5000 + "%y"
    with pytest.raises(HloParseError) as info:
        parse_hlo(f"HloModule m\nENTRY %e {{\n{line}\n}}\n")
    assert info.value.line == 3 and len(info.value.snippet) < 400


def test_deep_nesting_is_no_recursion_error() -> None:
    deep = "(" * 100_000
    with pytest.raises(HloParseError):
        parse_hlo(f"HloModule m\nENTRY %e {{\n  %a = {deep}f32[] tuple()\n}}\n")
    shape = "(" * 5000 + "f32[]" + ")" * 5000
    module = parse_hlo(f"HloModule m\nENTRY %e {{\n  ROOT %a = {shape} tuple()\n}}\n")
    assert module.entry_computation.instructions[0].shape == shape


# ---------------------------------------------------------------------------
# Fuzzing


def _fuzz_corpus() -> list[str]:
    namespace: dict = {}
    exec(compile(PROGRAM, "<hlo-test-program>", "exec"), namespace)
    texts = _lower_all({"programs": {"f": namespace["programs"]["f"]}})
    return [texts["f"]["hlo"], texts["f"]["compiled"], GPU_FUSION, GPU_ASYNC]


_CORPUS: list[str] = []


def _corpus() -> list[str]:
    if not _CORPUS:
        _CORPUS.extend(_fuzz_corpus())
    return _CORPUS


_mutation = st.one_of(
    st.tuples(st.just("truncate"), st.floats(0, 1)),
    st.tuples(st.just("delete"), st.floats(0, 1), st.sampled_from(list('{}()[]"=,%\n'))),
    st.tuples(st.just("insert"), st.floats(0, 1), st.text(min_size=1, max_size=8)),
    st.tuples(st.just("insert"), st.floats(0, 1), st.sampled_from(["\x00", "\ufeff", "\u2028", "\\", '"', "{", ")", "\udcff"])),
    st.tuples(st.just("bignum"), st.floats(0, 1), st.sampled_from([str(10**400), "9" * 5000, "-1", "1e999"])),
    st.tuples(st.just("dupline"), st.floats(0, 1)),
)


def _mutate(text: str, mutation: tuple) -> str:
    kind, where = mutation[0], mutation[1]
    at = int(where * len(text))
    if kind == "truncate":
        return text[:at]
    if kind == "delete":
        char = mutation[2]
        found = text.find(char, at)
        return text if found < 0 else text[:found] + text[found + 1 :]
    if kind == "insert":
        return text[:at] + mutation[2] + text[at:]
    if kind == "bignum":
        found = re.compile(r"\d+").search(text, at)
        return text if found is None else text[: found.start()] + mutation[2] + text[found.end() :]
    lines = text.split("\n")
    index = int(where * (len(lines) - 1))
    return "\n".join(lines[: index + 1] + lines[index:])


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(base=st.integers(0, 3), mutations=st.lists(_mutation, min_size=1, max_size=6))
def test_fuzz_parse_returns_module_or_parse_error(base: int, mutations: list[tuple]) -> None:
    text = _corpus()[base]
    for mutation in mutations:
        text = _mutate(text, mutation)
    try:
        result = parse_hlo(text)
    except HloParseError as error:
        assert isinstance(error.line, int) and isinstance(error.snippet, str)
        str(error)
    else:
        assert isinstance(result, HloModule)
        assert result.entry in result.computations
    stablehlo_frontend_attributes(text)
