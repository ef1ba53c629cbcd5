"""Call sites that survive XLA's rewrites, XLA's async forms, and nesting of any depth.

XLA's passes make one instruction compute for several calls (the all-reduce combiner, CSE, fusion
of shared leaves), print async ops in a short form, and programs nest computations deeply. The
call graph must count the same calls in the compiled program as in the lowered one, report what
XLA shared as shared, and never run out of stack.
"""

from __future__ import annotations

import json
import textwrap
from collections import Counter
from typing import Any

import networkx as nx
import pytest
from conftest import run_python

import ejlabel
from ejlabel.analysis import audit, call_graph, parse_hlo, read_program, to_dot, to_node_link_json

MATMUL_A = 'frontend_attributes={ejlabel="ejkernel_ops#matmul@v1:000000000000000a"}'
MATMUL_B = 'frontend_attributes={ejlabel="ejkernel_ops#matmul@v1:000000000000000b"}'
ATTENTION = 'frontend_attributes={ejlabel="ejkernel_ops#flash_attention@v1:00000000000000aa"}'
NORM = 'frontend_attributes={ejlabel="ejkernel_ops#rms_norm@v1:00000000000000dd"}'


def kernels(graph: nx.DiGraph) -> dict[str, dict[str, Any]]:
    return {n: d for n, d in graph.nodes(data=True) if d.get("kind") == "kernel"}


def shared_ops(graph: nx.DiGraph) -> dict[str, dict[str, Any]]:
    return {op["instruction"]: op for op in graph.graph["shared"]}


# ---------------------------------------------------------------------------
# A real sharded training step, lowered and compiled on 4 CPU devices.

SHARDED_STEP = textwrap.dedent(
    """
    import json, sys
    import jax, jax.numpy as jnp
    from jax.sharding import Mesh, PartitionSpec as P
    from ejlabel.kernels.matmul import matmul
    from ejlabel.kernels.attention import flash_attention
    try:
        from jax import shard_map
    except ImportError:
        from jax.experimental.shard_map import shard_map

    B, S, H, D = 2, 16, 2, 8
    W = H * D
    mesh = Mesh(jax.devices(), ("d",))

    def loss(params, x):
        wq, wk, wv, wo = params
        def project(xi):  # the kernels run under vmap
            return tuple(matmul(xi, w).reshape(S, H, D) for w in (wq, wk, wv))
        q, k, v = jax.vmap(project)(x)
        ours = flash_attention(q, k, v, causal=True)
        # An unlabelled reference branch: XLA's CSE shares its causal mask with our call's.
        reference = jax.nn.dot_product_attention(q * 0.5, k, v, is_causal=True)
        out = jax.vmap(lambda a: matmul(a.reshape(S, W), wo))(ours)
        return jnp.mean(out ** 2) + jnp.mean((ours - reference) ** 2)

    def step(params, x):
        value, grads = jax.value_and_grad(loss)(params, x)
        return jax.lax.psum(value, "d"), jax.lax.psum(grads, "d")

    f = jax.jit(shard_map(step, mesh=mesh, in_specs=(P(), P("d")), out_specs=(P(), P())))
    params = tuple(jnp.full((W, W), 0.01, jnp.float32) for _ in range(4))
    lowered = f.lower(params, jnp.ones((4 * B, S, W), jnp.float32))
    print(json.dumps({"devices": len(jax.devices()), "lowered": lowered.compiler_ir("hlo").as_hlo_text(),
                      "compiled": lowered.compile().as_text()}))
    """
)


@pytest.fixture(scope="module")
def sharded_step() -> dict[str, Any]:
    """The step's HLO before and after XLA, from a child process with 4 forced CPU devices."""
    out = run_python(SHARDED_STEP, XLA_FLAGS="--xla_force_host_platform_device_count=4")
    return json.loads(out.strip().splitlines()[-1])


def test_sharded_step_has_the_same_sites_per_op_in_every_form(sharded_step: dict[str, Any]) -> None:
    assert sharded_step["devices"] == 4
    lowered, compiled = (call_graph(sharded_step[form]) for form in ("lowered", "compiled"))
    counts = {form: Counter(d["op"] for d in kernels(graph).values()) for form, graph in (("lowered", lowered), ("compiled", compiled))}
    # 4 forward matmuls, the output projection's input gradient, 4 weight gradients; attention's
    # forward and backward.
    assert counts["lowered"] == counts["compiled"] == Counter({"matmul": 9, "flash_attention": 2})
    assert nx.is_directed_acyclic_graph(lowered) and nx.is_directed_acyclic_graph(compiled)


def test_sharded_step_reports_what_xla_combined_as_shared(sharded_step: dict[str, Any]) -> None:
    compiled = call_graph(sharded_step["compiled"])
    nodes = kernels(compiled)
    combined = [op for op in compiled.graph["shared"] if op["kind"] == "combined"]
    # XLA's all-reduce combiner merged the gradient reductions of the weight gradients (and the
    # loss's): each combined all-reduce is a shared member of the calls whose lanes it carries.
    assert combined and all(op["nodes"] and op["outside"] for op in combined)
    for op in combined:
        for node in op["nodes"]:
            assert op["instruction"] in nodes[node]["shared"]
    gradients = [d for d in nodes.values() if d["shared"] and d["op"] == "matmul"]
    assert len(gradients) == 4
    # No call takes the loss scalars the combined all-reduce also carries.
    assert all(not any(shape.startswith("f32[]") for shape in d["input_shapes"]) for d in gradients)
    # The reference branch's fusions hold copies of the call's causal mask only: shared, no sites.
    leaves = [op for op in compiled.graph["shared"] if op["kind"] == "leaf" and not op["nodes"]]
    assert leaves and all(op["labels"][0].startswith("ejkernel_ops#flash_attention@") for op in leaves)


# ---------------------------------------------------------------------------
# The rules, one program each.

COMBINED_ALL_REDUCE = f"""HloModule combined

%add (x: f32[], y: f32[]) -> f32[] {{
  %x = f32[] parameter(0)
  %y = f32[] parameter(1)
  ROOT %s = f32[] add(%x, %y)
}}

ENTRY %main (a: f32[8,4], w: f32[4,4], v: f32[4,4]) -> (f32[], f32[8,4], f32[8,4]) {{
  %a = f32[8,4]{{1,0}} parameter(0)
  %w = f32[4,4]{{1,0}} parameter(1)
  %v = f32[4,4]{{1,0}} parameter(2)
  %dot.a = f32[8,4]{{1,0}} dot(%a, %w), lhs_contracting_dims={{1}}, rhs_contracting_dims={{0}}, {MATMUL_A}
  %dot.b = f32[8,4]{{1,0}} dot(%a, %v), lhs_contracting_dims={{1}}, rhs_contracting_dims={{0}}, {MATMUL_B}
  %zero = f32[] constant(0)
  %loss = f32[] reduce(%a, %zero), dimensions={{0,1}}, to_apply=%add
  %ar = (f32[], f32[8,4]{{1,0}}, f32[8,4]{{1,0}}) all-reduce(%loss, %dot.a, %dot.b), replica_groups={{}}, to_apply=%add, {MATMUL_A}
  %g0 = f32[] get-tuple-element(%ar), index=0
  %g1 = f32[8,4]{{1,0}} get-tuple-element(%ar), index=1, {MATMUL_A}
  %g2 = f32[8,4]{{1,0}} get-tuple-element(%ar), index=2, {MATMUL_B}
  %scaled = f32[] multiply(%g0, %g0)
  ROOT %out = (f32[], f32[8,4]{{1,0}}, f32[8,4]{{1,0}}) tuple(%scaled, %g1, %g2)
}}
"""


def test_combined_all_reduce_is_shared_lane_by_lane() -> None:
    graph = call_graph(COMBINED_ALL_REDUCE)
    nodes = kernels(graph)
    by_label = {d["call_key"][-1]: d for d in nodes.values()}
    assert set(by_label) == {"a", "b"}  # two calls, not one joined through the all-reduce
    assert by_label["a"]["members"] == ["dot.a", "ar", "g1"] and by_label["b"]["members"] == ["dot.b", "ar", "g2"]
    assert by_label["a"]["shared"] == by_label["b"]["shared"] == ["ar"]
    # Each call takes its own inputs only, never the loss scalar of the other lane.
    assert by_label["a"]["input_shapes"] == by_label["b"]["input_shapes"] == ["f32[8,4]{1,0}", "f32[4,4]{1,0}"]
    assert graph.number_of_edges() == 0  # the lanes feed nothing across
    (op,) = graph.graph["shared"]
    assert op["instruction"] == "ar" and op["kind"] == "combined" and op["outside"]
    assert sorted(op["nodes"]) == sorted(nodes)
    # The unlabelled lane and what reads it join nothing.
    assert not any({"g0", "scaled"} & set(d["members"]) for d in nodes.values())


CSE_MASK = f"""HloModule cse

%fused_reference (p0: f32[4,4]) -> f32[4,4] {{
  %p0 = f32[4,4]{{1,0}} parameter(0)
  %i0 = s32[4,4]{{1,0}} iota(), iota_dimension=0, {ATTENTION}
  %i1 = s32[4,4]{{1,0}} iota(), iota_dimension=1, {ATTENTION}
  %ge = pred[4,4]{{1,0}} compare(%i0, %i1), direction=GE, {ATTENTION}
  %ninf = f32[] constant(-inf)
  %b = f32[4,4]{{1,0}} broadcast(%ninf), dimensions={{}}
  ROOT %sel = f32[4,4]{{1,0}} select(%ge, %p0, %b)
}}

ENTRY %main (s: f32[4,4], r: f32[4,4]) -> (f32[4,4], f32[4,4], f32[4,4]) {{
  %s = f32[4,4]{{1,0}} parameter(0)
  %r = f32[4,4]{{1,0}} parameter(1)
  %iota.0 = s32[4,4]{{1,0}} iota(), iota_dimension=0, {ATTENTION}
  %iota.1 = s32[4,4]{{1,0}} iota(), iota_dimension=1, {ATTENTION}
  %mask = pred[4,4]{{1,0}} compare(%iota.0, %iota.1), direction=GE, {ATTENTION}
  %neg = f32[4,4]{{1,0}} negate(%s), {ATTENTION}
  %ours = f32[4,4]{{1,0}} select(%mask, %s, %neg), {ATTENTION}
  %exp = f32[4,4]{{1,0}} exponential(%ours), {ATTENTION}
  %theirs = f32[4,4]{{1,0}} select(%mask, %r, %r)
  %fused = f32[4,4]{{1,0}} fusion(%r), kind=kLoop, calls=%fused_reference
  ROOT %out = (f32[4,4]{{1,0}}, f32[4,4]{{1,0}}, f32[4,4]{{1,0}}) tuple(%exp, %theirs, %fused)
}}
"""


def test_cse_shared_mask_joins_no_unlabelled_branch() -> None:
    graph = call_graph(CSE_MASK)
    (node,) = kernels(graph).values()  # the unlabelled branch's fusion is no attention site
    assert node["members"] == ["iota.0", "iota.1", "mask", "neg", "ours", "exp"]
    assert node["shared"] == ["iota.0", "iota.1", "mask"]  # XLA's CSE gave them to the reference too
    assert node["flops"] == 3 * 16  # negate, select, exponential: the shared mask counts for nobody
    shared = shared_ops(graph)
    assert shared["mask"]["kind"] == "leaf" and shared["mask"]["outside"] and shared["mask"]["nodes"] == [next(iter(kernels(graph)))]
    assert shared["fused"] == {**shared["fused"], "kind": "leaf", "nodes": [], "outside": True}
    assert "theirs" not in node["members"]


def test_leaves_of_one_call_stay_in_it() -> None:
    # Constants and masks written by the call itself (one reader site, nobody else): plain members.
    graph = call_graph(CSE_MASK.replace("%theirs = f32[4,4]{1,0} select(%mask, %r, %r)", "%theirs = f32[4,4]{1,0} negate(%r)"))
    (node,) = kernels(graph).values()
    assert node["shared"] == [] and {"iota.0", "iota.1", "mask"} <= set(node["members"])
    assert node["flops"] == 4 * 16


ASYNC = f"""HloModule asyncs

ENTRY %main (a: f32[8,16], b: f32[16,4]) -> f32[8,4] {{
  %a = f32[8,16]{{1,0}} parameter(0)
  %b = f32[16,4]{{1,0}} parameter(1)
  %n = f32[8,16]{{1,0}} multiply(%a, %a), {NORM}
  %s = ((f32[8,16]{{1,0}}, f32[16,4]{{1,0}}), f32[8,4]{{1,0}}, s32[]) custom-call-start(%n, %b), custom_call_target="__cublas$gemm", backend_config={{"lhs_contracting_dimensions":["1"]}}, {MATMUL_A}
  %u = ((f32[8,16]{{1,0}}, f32[16,4]{{1,0}}), f32[8,4]{{1,0}}, s32[]) custom-call-update(%s)
  ROOT %d = f32[8,4]{{1,0}} custom-call-done(%u)
}}
"""


def test_async_shorthand_reads_as_one_async_op() -> None:
    module = parse_hlo(ASYNC)
    main = module.entry_computation
    start, update, done = (main.instruction(n) for n in ("s", "u", "d"))
    assert (start.opcode, update.opcode, done.opcode) == ("async-start", "async-update", "async-done")
    (wrapped,) = start.called_computations
    inner = module.computations[wrapped].root_instruction
    assert inner.opcode == "custom-call" and inner.custom_call_target == "__cublas$gemm"
    assert [p.shape for p in module.computations[wrapped].instructions[:-1]] == ["f32[8,16]{1,0}", "f32[16,4]{1,0}"]
    graph = call_graph(ASYNC)
    gemm = next(d for d in kernels(graph).values() if d["op"] == "matmul")
    # One op: the start, update and done in one site, the wrapped gemm's flops counted once.
    assert gemm["members"] == ["s", "u", "d"] and gemm["flops"] == 2 * 8 * 4 * 16
    assert gemm["opcodes"] == {"async-start": 1, "custom-call": 1, "async-update": 1, "async-done": 1}
    assert gemm["shapes"] == ["f32[8,4]{1,0}"]  # its output is the done's
    assert list(graph.edges) == [(next(n for n, d in kernels(graph).items() if d["op"] == "rms_norm"), next(n for n, d in kernels(graph).items() if d["op"] == "matmul"))]


def test_unlabelled_async_custom_call_is_attributed_with_its_done() -> None:
    # A rewrite dropped the start's label (as XLA's cuDNN rewrite does): rule 4 finds the one
    # label next to it, past its update and done, and the whole async op joins that call.
    text = (
        ASYNC.replace(f", {MATMUL_A}", "")
        .replace("custom-call-start(%n, %b)", "custom-call-start(%a, %b)")
        .replace("ROOT %d = ", "%d = ")
        .replace("}\n", f"  ROOT %e = f32[8,4]{{1,0}} exponential(%d), {MATMUL_A}\n}}\n")
    )
    graph = call_graph(text)
    gemm = next(d for d in kernels(graph).values() if d["op"] == "matmul")
    assert gemm["members"] == ["s", "u", "d", "e"] and gemm["attributed_custom_calls"] == ["__cublas$gemm"]


# ---------------------------------------------------------------------------
# Depth.


def _nested(depth: int, kind: str) -> str:
    """A labelled op at the bottom of ``depth`` computations, each calling the next."""
    lines = ["HloModule deep", ""]
    for k in reversed(range(depth)):
        lines.append(f"%c{k} (p{k}: f32[4]) -> f32[4] {{")
        lines.append(f"  %p{k} = f32[4]{{0}} parameter(0)")
        if k == depth - 1:
            lines.append(f"  ROOT %m{k} = f32[4]{{0}} multiply(%p{k}, %p{k}), {NORM}")
        elif kind == "call":
            lines.append(f"  ROOT %x{k} = f32[4]{{0}} call(%p{k}), to_apply=%c{k + 1}")
        elif kind == "fusion":
            lines.append(f"  ROOT %x{k} = f32[4]{{0}} fusion(%p{k}), kind=kLoop, calls=%c{k + 1}")
        else:  # a loop whose body loops
            lines.append(f"  ROOT %x{k} = f32[4]{{0}} while(%p{k}), condition=%cond, body=%c{k + 1}")
        lines.append("}")
        lines.append("")
    if kind == "while":
        lines[2:2] = ["%cond (c: f32[4]) -> pred[] {", "  %c = f32[4]{0} parameter(0)", "  ROOT %t = pred[] constant(true)", "}", ""]
    call = {"call": "call(%a), to_apply=%c0", "fusion": "fusion(%a), kind=kLoop, calls=%c0", "while": "while(%a), condition=%cond, body=%c0"}[kind]
    lines += [
        "ENTRY %main (a: f32[4]) -> f32[4] {",
        "  %a = f32[4]{0} parameter(0)",
        f"  %x = f32[4]{{0}} {call}",
        f"  ROOT %y = f32[4]{{0}} add(%x, %x), {MATMUL_A}",
        "}",
    ]
    return "\n".join(lines) + "\n"


@pytest.mark.parametrize("kind", ["call", "while", "fusion"])
def test_a_thousand_nested_computations(kind: str) -> None:
    text = _nested(1000, kind)
    program = read_program(text)
    assert len(program.modules[0].module.computations) >= 1001
    graph = call_graph(program)
    nodes = kernels(graph)
    assert Counter(d["op"] for d in nodes.values()) == Counter({"rms_norm": 1, "matmul": 1})
    norm = next(d for d in nodes.values() if d["op"] == "rms_norm")
    if kind == "fusion":
        assert norm["computation"] == "main" and norm["nesting"] == ()  # inlined into the fusion %x
    else:
        assert len(norm["nesting"]) == 1000 and norm["computation"] == "c999"
    assert graph.has_edge(next(n for n, d in nodes.items() if d["op"] == "rms_norm"), next(n for n, d in nodes.items() if d["op"] == "matmul"))
    report = audit(program, selector=ejlabel.ConfigSelectorChain())
    assert len(report.calls) == 2 and report.render() and report.to_json()
    assert to_dot(graph) and to_node_link_json(graph)


MERGED_FUSION = f"""HloModule merged

%fused (p0: f32[8], p1: f32[4]) -> (f32[8], f32[4]) {{
  %p0 = f32[8]{{0}} parameter(0)
  %p1 = f32[4]{{0}} parameter(1)
  %a = f32[8]{{0}} exponential(%p0), {MATMUL_A}
  %b = f32[4]{{0}} negate(%p1), {NORM}
  ROOT %t = (f32[8]{{0}}, f32[4]{{0}}) tuple(%a, %b)
}}

ENTRY %main (x: f32[8], y: f32[4]) -> (f32[8], f32[4]) {{
  %x = f32[8]{{0}} parameter(0)
  %y = f32[4]{{0}} parameter(1)
  ROOT %f = (f32[8]{{0}}, f32[4]{{0}}) fusion(%x, %y), kind=kLoop, calls=%fused
}}
"""


def test_fusion_of_two_calls_gives_each_its_own_inputs() -> None:
    # XLA fused ops of two calls into one multi-output fusion: a member of both, shared by them,
    # each call taking the operands its own ops read.
    graph = call_graph(MERGED_FUSION)
    nodes = {d["op"]: d for d in kernels(graph).values()}
    assert nodes["matmul"]["shared"] == nodes["rms_norm"]["shared"] == ["f"]
    assert nodes["matmul"]["input_shapes"] == ["f32[8]{0}"] and nodes["rms_norm"]["input_shapes"] == ["f32[4]{0}"]
    assert nodes["matmul"]["flops"] == 8 and nodes["rms_norm"]["flops"] == 4
    (op,) = graph.graph["shared"]
    assert op["kind"] == "fusion" and sorted(op["nodes"]) == sorted(kernels(graph)) and not op["outside"]
