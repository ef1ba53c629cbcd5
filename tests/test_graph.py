"""The kernel-call graph: sites, nesting, data edges, costs, configs, inputs and exports."""

from __future__ import annotations

import json
import shutil
import textwrap
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import networkx as nx
import pytest
from conftest import run_python
from ejlabel.analysis import export as export_module
from ejlabel.analysis.graph import (
    call_graph,
    draw,
    from_node_link_json,
    to_dot,
    to_node_link_json,
)
from jax import lax
from toy_kernels import scale, toymatmul

import ejlabel


def kernels(graph: nx.DiGraph, op: str | None = None) -> dict[str, dict[str, Any]]:
    return {
        n: d for n, d in graph.nodes(data=True) if d.get("kind") == "kernel" and (op is None or d["op"] == op)
    }


def only(graph: nx.DiGraph, op: str) -> tuple[str, dict[str, Any]]:
    found = kernels(graph, op)
    assert len(found) == 1, found
    return next(iter(found.items()))


def data_edge(graph: nx.DiGraph, a: str, b: str) -> bool:
    return graph.has_edge(a, b) and graph.edges[a, b]["kind"] == "data"


def chain_model(ex: ejlabel.Executor):
    def model(x: jax.Array, w: jax.Array) -> jax.Array:
        h = ex(scale, x)  # [4, 8]
        h = ex(toymatmul, h, w)  # [4, 16]
        h = ex(scale, h)  # [4, 16]: another shape, another label
        return h.sum()

    return jax.jit(jax.value_and_grad(model, argnums=(0, 1)))


X = jnp.ones((4, 8), jnp.float32)
W = jnp.ones((8, 16), jnp.float32)


@pytest.fixture(scope="module")
def chain() -> tuple[Any, ejlabel.ConfigSelectorChain]:
    selector = ejlabel.ConfigSelectorChain()
    lowered = chain_model(ejlabel.Executor(selector)).lower(X, W)
    return lowered, selector


def test_chain_nodes_edges_and_costs(chain: tuple[Any, ejlabel.ConfigSelectorChain]) -> None:
    lowered, selector = chain
    graph = call_graph(lowered, selector)
    assert graph.graph["modules"] == ["jit_model"]
    assert graph.graph["device"] == ejlabel.device_fingerprint()

    mm_node, mm = only(graph, "toymatmul")
    assert mm["op_id"] == "toymatmul@v1" and mm["version"] == "1" and mm["direction"] == "forward"
    assert mm["label"] == f"ejkernel_ops#toymatmul@v1:{mm['call_key']}"
    assert mm_node.startswith("jit_model/") and mm["module"] == "jit_model"
    assert mm["flops"] == 2 * 4 * 16 * 8
    assert mm["opcodes"] == {"dot": 1}
    assert mm["bytes"] == (4 * 8 + 8 * 16 + 4 * 16) * 4  # reads x·w once each, writes the product
    assert mm["shapes"] == ["f32[4,16]{1,0}"]
    assert sorted(mm["input_shapes"]) == ["f32[4,8]{1,0}", "f32[8,16]{1,0}"]
    assert mm["nesting"] == () and mm["multiplicity"] == 1
    assert mm["provenance"] == "heuristic" and mm["config"] == toymatmul.heuristic_cfg(None)

    scales = kernels(graph, "scale")
    assert len({d["label"] for d in scales.values()}) == 2  # two shapes, two labels
    first = next(n for n in graph.predecessors(mm_node) if n in scales)
    second = next(n for n in graph.successors(mm_node) if n in scales)
    assert scales[first]["shapes"][0].startswith("f32[4,8]") and scales[second]["shapes"][0].startswith("f32[4,16]")
    # scale → toymatmul → scale, in program order.
    assert data_edge(graph, first, mm_node)
    assert data_edge(graph, mm_node, second)
    assert not graph.has_edge(second, first)
    # The first scale is differentiated by JAX (its backward ops carry its label) and its backward
    # reads what the matmul's backward computed from the second scale: it is a site of its own,
    # so the graph has no cycle. The second scale's backward reads only its own intermediates.
    first_backward = [n for n, d in scales.items() if d["label"] == scales[first]["label"] and n != first]
    assert len(first_backward) == 1 and len(scales) == 3
    assert any(data_edge(graph, n, first_backward[0]) for n in kernels(graph, "toymatmul.bwd"))
    assert nx.is_directed_acyclic_graph(graph)

    backward = kernels(graph, "toymatmul.bwd")
    assert backward and all(d["direction"] == "backward" for d in backward.values())
    assert all(d["flops"] == 2 * 4 * 8 * 16 for d in backward.values())
    # The backward resolves to its forward's config.
    assert all(d["provenance"] == "heuristic" for d in backward.values())
    for d in kernels(graph).values():
        assert d["bytes"] > 0 and d["instructions"] >= 1 and d["kind"] == "kernel"


def test_without_selector_configs_are_none(chain: tuple[Any, ejlabel.ConfigSelectorChain]) -> None:
    graph = call_graph(chain[0])
    assert all(d["config"] is None and d["provenance"] is None for d in kernels(graph).values())


def test_compiled_program_maps_fusion_contents_to_the_fusion(chain: tuple[Any, ejlabel.ConfigSelectorChain]) -> None:
    lowered, selector = chain
    graph = call_graph(lowered.compile(), selector)
    _, mm = only(graph, "toymatmul")
    assert mm["flops"] == 2 * 4 * 16 * 8
    assert mm["computation"].startswith("main")  # the fusion's computation, not the fused one
    scale_nodes = kernels(graph, "scale")
    assert scale_nodes and all(d["computation"] == mm["computation"] for d in scale_nodes.values())
    # Same data order in the optimised program. On GPU the matmul, the scale before it and the
    # scale after it can sit in one gemm fusion: the order inside the fusion gives the edges.
    mm_node = next(iter(kernels(graph, "toymatmul")))
    assert any(data_edge(graph, n, mm_node) for n in scale_nodes)
    assert any(data_edge(graph, mm_node, n) for n in scale_nodes)


def test_same_call_at_two_places_gives_two_nodes() -> None:
    ex = ejlabel.Executor(ejlabel.ConfigSelectorChain())

    def model(x: jax.Array) -> jax.Array:
        a = ex(scale, x)
        b = jnp.tanh(a) @ jnp.ones((8, 8))  # unlabelled work in between
        return ex(scale, b).sum()

    graph = call_graph(jax.jit(model).lower(jnp.ones((4, 8))))
    sites = kernels(graph, "scale")
    assert len(sites) == 2
    assert len({d["label"] for d in sites.values()}) == 1
    a, b = sorted(sites)
    assert data_edge(graph, a, b) or data_edge(graph, b, a)
    # With the backward pass (JAX's, under the same label): the first call's backward reads what
    # the second call's backward computed, so it is a site of its own; the second call's backward
    # reads only its own forward's values and the constant cotangent, and stays with it.
    graph = call_graph(jax.jit(jax.value_and_grad(model)).lower(jnp.ones((4, 8))))
    assert len(kernels(graph, "scale")) == 3 and nx.is_directed_acyclic_graph(graph)


def scan_cond_model(ex: ejlabel.Executor):
    def model(x: jax.Array, w: jax.Array) -> jax.Array:
        def body(c: jax.Array, _: Any) -> tuple[jax.Array, None]:
            return ex(toymatmul, c, w), None

        c, _ = lax.scan(body, x, None, length=3)
        c = lax.cond(c.sum() > 0, lambda c: ex(scale, c), lambda c: c, c)
        return c.sum()

    return jax.jit(jax.value_and_grad(model)).lower(jnp.ones((8, 8)), jnp.ones((8, 8)))


@pytest.mark.parametrize("compiled", [False, True], ids=["lowered", "compiled"])
def test_loops_and_branches_nest_their_sites(compiled: bool) -> None:
    lowered = scan_cond_model(ejlabel.Executor(ejlabel.ConfigSelectorChain()))
    program = lowered.compile() if compiled else lowered
    graph = call_graph(program)
    text = program.as_text() if compiled else lowered.compiler_ir("hlo").as_hlo_text()

    mm_node, mm = only(graph, "toymatmul")
    assert mm["nesting"] and mm["nesting"][0].startswith("while")
    loop = next(p for p in graph.predecessors(mm_node) if graph.edges[p, mm_node]["kind"] == "nesting")
    assert graph.nodes[loop]["kind"] == "loop" and graph.nodes[loop]["label"] is None
    assert loop.endswith("/" + mm["nesting"][0]) or loop.rsplit("/", 1)[-1] in mm["nesting"]
    # Lowered HLO carries no trip counts; XLA's optimised HLO records known_trip_count.
    expected = 3 if compiled else None
    assert mm["multiplicity"] == expected and graph.nodes[loop]["multiplicity"] == expected

    scale_sites = kernels(graph, "scale")
    assert scale_sites
    branches = [n for n, d in graph.nodes(data=True) if d.get("kind") == "branch"]
    if " conditional(" not in text:
        # The compiler turned the tiny conditional into a select (as on GPU): no branch is
        # left, so the scale's sites are not nested, yet the loop's result still flows into them.
        assert not branches and all(d["nesting"] == () and d["multiplicity"] == 1 for d in scale_sites.values())
        assert any(data_edge(graph, mm_node, n) for n in scale_sites)
        return
    branch_sites = [d for d in scale_sites.values() if d["nesting"]]
    assert branch_sites
    for d in branch_sites:
        assert d["nesting"][0].startswith("cond") and d["multiplicity"] == 1
    assert branches
    # The loop's result flows into the branch's kernel (across the while and conditional bodies).
    assert any(data_edge(graph, mm_node, n) for n, d in scale_sites.items() if d["nesting"])


def test_selector_provenance_through_executor() -> None:
    selector = ejlabel.ConfigSelectorChain()
    ex = ejlabel.Executor(selector)
    lowered = jax.jit(lambda x: ex(scale, x).sum()).lower(jnp.ones((3, 5)))
    graph = call_graph(lowered, selector)
    _, node = only(graph, "scale")
    assert node["provenance"] == "heuristic" and node["config"] == scale.heuristic_cfg(None)
    override = ejlabel.Executor(selector)
    lowered = jax.jit(lambda x: override(scale, x, cfg=type(node["config"])(2, "add")).sum()).lower(jnp.ones((3, 6)))
    _, node = only(call_graph(lowered, selector), "scale")
    assert node["provenance"] == "override"


LABEL_FWD = "ejkernel_ops#flash_attention@v2:0123456789abcdef"
LABEL_MM = "ejkernel_ops#matmul@v1:fedcba9876543210"

# What XLA's GPU pipeline leaves: attributes on instructions inside fusions, and a cuDNN
# attention custom-call with no attributes between labelled ops.
GPU_HLO = textwrap.dedent(
    f"""\
    HloModule jit_attn, is_scheduled=true, entry_computation_layout={{(bf16[2,128,64]{{2,1,0}})->bf16[2,128,64]{{2,1,0}}}}

    %fused_transpose (param_0: bf16[2,128,64]) -> bf16[2,64,128] {{
      %param_0 = bf16[2,128,64]{{2,1,0}} parameter(0)
      ROOT %transpose.3 = bf16[2,64,128]{{2,1,0}} transpose(%param_0), dimensions={{0,2,1}}, frontend_attributes={{ejlabel="{LABEL_FWD}"}}
    }}

    %fused_scale (param_0.1: bf16[2,128,64]) -> bf16[2,128,64] {{
      %param_0.1 = bf16[2,128,64]{{2,1,0}} parameter(0)
      %constant.1 = bf16[] constant(0.125)
      %broadcast.1 = bf16[2,128,64]{{2,1,0}} broadcast(%constant.1), dimensions={{}}
      ROOT %multiply.1 = bf16[2,128,64]{{2,1,0}} multiply(%param_0.1, %broadcast.1), frontend_attributes={{ejlabel="{LABEL_FWD}"}}
    }}

    %fused_dot (p0: bf16[2,128,64], p1: bf16[64,32]) -> f32[2,128,32] {{
      %p0 = bf16[2,128,64]{{2,1,0}} parameter(0)
      %p1 = bf16[64,32]{{1,0}} parameter(1)
      ROOT %dot.7 = f32[2,128,32]{{2,1,0}} dot(%p0, %p1), lhs_contracting_dims={{2}}, rhs_contracting_dims={{0}}, frontend_attributes={{ejlabel="{LABEL_MM}"}}
    }}

    ENTRY %main (q: bf16[2,128,64], w: bf16[64,32]) -> f32[2,128,32] {{
      %q = bf16[2,128,64]{{2,1,0}} parameter(0)
      %w = bf16[64,32]{{1,0}} parameter(1)
      %scale_fusion = bf16[2,128,64]{{2,1,0}} fusion(%q), kind=kLoop, calls=%fused_scale
      %transpose_fusion = bf16[2,64,128]{{2,1,0}} fusion(%q), kind=kLoop, calls=%fused_transpose
      %fmha = (bf16[2,128,64]{{2,1,0}}, u8[0]{{0}}) custom-call(%scale_fusion, %transpose_fusion, %q), custom_call_target="__cudnn$fmhaSoftmax", backend_config={{"operation_queue_id":"0"}}
      %gte.0 = bf16[2,128,64]{{2,1,0}} get-tuple-element(%fmha), index=0
      %out = bf16[2,128,64]{{2,1,0}} copy(%gte.0), frontend_attributes={{ejlabel="{LABEL_FWD}"}}
      %unlabelled = bf16[2,128,64]{{2,1,0}} negate(%out)
      ROOT %proj = f32[2,128,32]{{2,1,0}} fusion(%unlabelled, %w), kind=kCustom, calls=%fused_dot
    }}
    """
)


def test_gpu_like_fusions_and_unlabelled_cudnn_custom_call() -> None:
    graph = call_graph(GPU_HLO)
    attn_node, attn = only(graph, "flash_attention")
    assert attn_node == "jit_attn/main/scale_fusion"
    assert attn["attributed_custom_calls"] == ["__cudnn$fmhaSoftmax"]
    assert attn["version"] == "2" and attn["op_id"] == "flash_attention@v2"
    # Two fusions (+ their labelled insides), the custom-call and the copy.
    assert attn["opcodes"] == {"fusion": 2, "multiply": 1, "transpose": 1, "custom-call": 1, "copy": 1}
    assert attn["instructions"] == 6
    assert attn["flops"] == 2 * 128 * 64  # the labelled multiply; the custom-call's work is unknown
    assert attn["shapes"] == ["bf16[2,128,64]{2,1,0}"]
    assert attn["input_shapes"] == ["bf16[2,128,64]{2,1,0}"]
    # q read once (2·128·64 bf16), outputs of the fusions, the (tuple) custom-call and the copy.
    q = 2 * 128 * 64 * 2
    assert attn["bytes"] == q + q + q + q + q

    mm_node, mm = only(graph, "matmul")
    assert mm_node == "jit_attn/main/proj"
    assert mm["flops"] == 2 * (2 * 128 * 32) * 64
    assert mm["opcodes"] == {"fusion": 1, "dot": 1}
    assert data_edge(graph, attn_node, mm_node)  # through the unlabelled negate


LABEL_SCALE_A = "ejkernel_ops#scale@v1:f56b82415ab332af"
LABEL_SCALE_B = "ejkernel_ops#scale@v1:147a5bd491760d9b"
LABEL_TOYMM = "ejkernel_ops#toymatmul@v1:0c2ebf947f62121f"

# scale -> toymatmul -> scale as compiled for a GPU (trimmed from a real dump): one gemm fusion holds the
# first scale's ops, the dot and the second scale's first multiply; the fusion itself carries the
# second scale's label, and a loop fusion finishes that scale.
GPU_GEMM_FUSION_HLO = textwrap.dedent(
    f"""\
    HloModule jit_model, is_scheduled=true

    %gemm_fusion_computation (parameter_0: f32[4,8], parameter_1: f32[8,16]) -> f32[4,16] {{
      %parameter_0 = f32[4,8]{{1,0}} parameter(0)
      %constant_0 = f32[] constant(2)
      %broadcast.0 = f32[4,8]{{1,0}} broadcast(%constant_0), dimensions={{}}
      %scale.0 = f32[4,8]{{1,0}} multiply(%parameter_0, %broadcast.0), frontend_attributes={{ejlabel="{LABEL_SCALE_A}"}}
      %scale.1 = f32[4,8]{{1,0}} sine(%scale.0), frontend_attributes={{ejlabel="{LABEL_SCALE_A}"}}
      %scale.3 = f32[4,8]{{1,0}} add(%scale.1, %scale.0), frontend_attributes={{ejlabel="{LABEL_SCALE_A}"}}
      %parameter_1 = f32[8,16]{{1,0}} parameter(1)
      %mm.0 = f32[4,16]{{1,0}} dot(%scale.3, %parameter_1), lhs_contracting_dims={{1}}, rhs_contracting_dims={{0}}, frontend_attributes={{ejlabel="{LABEL_TOYMM}"}}
      %broadcast.2 = f32[4,16]{{1,0}} broadcast(%constant_0), dimensions={{}}
      ROOT %scale.4 = f32[4,16]{{1,0}} multiply(%mm.0, %broadcast.2), frontend_attributes={{ejlabel="{LABEL_SCALE_B}"}}
    }}

    %fused_sine (param_0: f32[4,16]) -> f32[4,16] {{
      %param_0 = f32[4,16]{{1,0}} parameter(0)
      ROOT %scale.5 = f32[4,16]{{1,0}} sine(%param_0), frontend_attributes={{ejlabel="{LABEL_SCALE_B}"}}
    }}

    ENTRY %main.2 (x.1: f32[4,8], w.1: f32[8,16]) -> f32[4,16] {{
      %w.1 = f32[8,16]{{1,0}} parameter(1)
      %x.1 = f32[4,8]{{1,0}} parameter(0)
      %gemm_fusion = f32[4,16]{{1,0}} fusion(%x.1, %w.1), kind=kCustom, calls=%gemm_fusion_computation, frontend_attributes={{ejlabel="{LABEL_SCALE_B}",xla.pdl_launch="true"}}, backend_config={{"fusion_backend_config":{{"kind":"__triton_gemm"}}}}
      ROOT %loop_sine_fusion = f32[4,16]{{1,0}} fusion(%gemm_fusion), kind=kLoop, calls=%fused_sine
    }}
    """
)

# The same program where the compiler handed the dot to the vendor library: a gemm custom-call
# carrying the matmul's label, between fusions whose labels sit on the ops inside them.
GPU_CUBLAS_HLO = textwrap.dedent(
    f"""\
    HloModule jit_cublas, is_scheduled=true

    %fused_scale (param_0: f32[4,8]) -> f32[4,8] {{
      %param_0 = f32[4,8]{{1,0}} parameter(0)
      %constant.2 = f32[] constant(2)
      %broadcast.2 = f32[4,8]{{1,0}} broadcast(%constant.2), dimensions={{}}
      ROOT %multiply.2 = f32[4,8]{{1,0}} multiply(%param_0, %broadcast.2), frontend_attributes={{ejlabel="{LABEL_SCALE_A}"}}
    }}

    %fused_scale.1 (param_0.1: f32[4,16]) -> f32[4,16] {{
      %param_0.1 = f32[4,16]{{1,0}} parameter(0)
      %constant.3 = f32[] constant(2)
      %broadcast.3 = f32[4,16]{{1,0}} broadcast(%constant.3), dimensions={{}}
      ROOT %multiply.3 = f32[4,16]{{1,0}} multiply(%param_0.1, %broadcast.3), frontend_attributes={{ejlabel="{LABEL_SCALE_B}"}}
    }}

    ENTRY %main (x: f32[4,8], w: f32[8,16]) -> f32[4,16] {{
      %x = f32[4,8]{{1,0}} parameter(0)
      %w = f32[8,16]{{1,0}} parameter(1)
      %loop_multiply_fusion = f32[4,8]{{1,0}} fusion(%x), kind=kLoop, calls=%fused_scale
      %custom-call.1 = (f32[4,16]{{1,0}}, s8[4194304]{{0}}) custom-call(%loop_multiply_fusion, %w), custom_call_target="__cublas$gemm", frontend_attributes={{ejlabel="{LABEL_TOYMM}"}}, backend_config={{"operation_queue_id":"0","wait_on_operation_queues":[],"gemm_backend_config":{{"alpha_real":1,"beta":0,"dot_dimension_numbers":{{"lhs_contracting_dimensions":["1"],"rhs_contracting_dimensions":["0"],"lhs_batch_dimensions":[],"rhs_batch_dimensions":[]}},"alpha_imag":0,"epilogue":"DEFAULT"}},"force_earliest_schedule":false}}
      %get-tuple-element.1 = f32[4,16]{{1,0}} get-tuple-element(%custom-call.1), index=0
      ROOT %loop_multiply_fusion.1 = f32[4,16]{{1,0}} fusion(%get-tuple-element.1), kind=kLoop, calls=%fused_scale.1
    }}
    """
)


def by_label(graph: nx.DiGraph, label: str) -> tuple[str, dict[str, Any]]:
    found = {n: d for n, d in kernels(graph).items() if d["label"] == label}
    assert len(found) == 1, found
    return next(iter(found.items()))


def test_gpu_gemm_fusion_holding_three_kernels_keeps_their_order() -> None:
    graph = call_graph(GPU_GEMM_FUSION_HLO)
    a_node, a = by_label(graph, LABEL_SCALE_A)
    mm_node, mm = by_label(graph, LABEL_TOYMM)
    b_node, b = by_label(graph, LABEL_SCALE_B)
    # One fusion starts all three sites; the second scale's site also holds the loop fusion.
    assert {a["members"][0], mm["members"][0], b["members"][0]} == {"gemm_fusion"}
    assert len({a_node, mm_node, b_node}) == 3
    assert b["members"] == ["gemm_fusion", "loop_sine_fusion"]
    assert mm["opcodes"] == {"fusion": 1, "dot": 1} and mm["flops"] == 2 * 4 * 16 * 8
    assert a["opcodes"] == {"fusion": 1, "multiply": 1, "sine": 1, "add": 1} and a["flops"] == 3 * 4 * 8
    assert b["opcodes"] == {"fusion": 2, "multiply": 1, "sine": 1}
    # scale -> toymatmul -> scale, from the order of the ops inside the gemm fusion.
    assert data_edge(graph, a_node, mm_node) and data_edge(graph, mm_node, b_node)
    assert not graph.has_edge(mm_node, a_node) and not graph.has_edge(b_node, mm_node)


def test_gpu_cublas_gemm_custom_call_between_fusions() -> None:
    graph = call_graph(GPU_CUBLAS_HLO)
    a_node, _ = by_label(graph, LABEL_SCALE_A)
    mm_node, mm = by_label(graph, LABEL_TOYMM)
    b_node, b = by_label(graph, LABEL_SCALE_B)
    assert a_node == "jit_cublas/main/loop_multiply_fusion" and mm_node == "jit_cublas/main/custom-call.1"
    assert mm["opcodes"] == {"custom-call": 1} and mm["attributed_custom_calls"] == []
    # The library gemm counts as the dot it replaces (contracting dims from its backend config).
    assert mm["flops"] == 2 * 4 * 16 * 8
    assert sorted(mm["input_shapes"]) == ["f32[4,8]{1,0}", "f32[8,16]{1,0}"]
    assert b["opcodes"] == {"fusion": 1, "multiply": 1} and b["input_shapes"] == ["f32[4,16]{1,0}"]
    # Through the custom-call and its unlabelled get-tuple-element.
    assert data_edge(graph, a_node, mm_node) and data_edge(graph, mm_node, b_node)
    assert not graph.has_edge(b_node, mm_node) and not graph.has_edge(a_node, b_node)


def test_multi_label_fusion_belongs_to_both_sites() -> None:
    text = textwrap.dedent(
        f"""\
        HloModule m
        %fused (p: f32[8]) -> f32[8] {{
          %p = f32[8]{{0}} parameter(0)
          %a = f32[8]{{0}} exponential(%p), frontend_attributes={{ejlabel="{LABEL_FWD}"}}
          ROOT %b = f32[8]{{0}} negate(%a), frontend_attributes={{ejlabel="{LABEL_MM}"}}
        }}
        ENTRY %main (x: f32[8]) -> f32[8] {{
          %x = f32[8]{{0}} parameter(0)
          ROOT %f = f32[8]{{0}} fusion(%x), kind=kLoop, calls=%fused
        }}
        """
    )
    graph = call_graph(text)
    nodes = kernels(graph)
    assert len(nodes) == 2 and {d["op"] for d in nodes.values()} == {"flash_attention", "matmul"}
    assert all(d["flops"] == 8 and d["instructions"] == 2 for d in nodes.values())


def test_dump_directory(tmp_path: Path) -> None:
    dump = tmp_path / "dump"
    run_python(
        textwrap.dedent(
            """
            import jax, jax.numpy as jnp, ejlabel
            from toy_kernels import scale, toymatmul
            ex = ejlabel.Executor(ejlabel.ConfigSelectorChain())
            f = jax.jit(jax.grad(lambda x, w: ex(scale, ex(toymatmul, x, w)).sum()))
            f(jnp.ones((4, 8)), jnp.ones((8, 16)))
            """
        ),
        XLA_FLAGS=f"--xla_dump_to={dump}",
    )
    assert list(dump.glob("*after_optimizations.txt"))
    graph = call_graph(str(dump))
    mm_nodes = kernels(graph, "toymatmul")
    assert len(mm_nodes) == 1
    node, data = next(iter(mm_nodes.items()))
    assert data["module"] in graph.graph["modules"] and node.startswith(data["module"] + "/")
    assert data["flops"] == 2 * 4 * 16 * 8
    assert kernels(graph, "toymatmul.bwd") and kernels(graph, "scale")
    assert len(graph.graph["modules"]) == len(list(dump.glob("*after_optimizations.txt")))


def test_stablehlo_reads_as_the_hlo_of_the_same_lowering(chain: tuple[Any, ejlabel.ConfigSelectorChain]) -> None:
    lowered, selector = chain
    text = lowered.as_text()
    assert text.lstrip().startswith("module")
    graph = call_graph(text, selector)
    full = call_graph(lowered, selector)
    assert graph.graph["degraded"] is False
    assert len(kernels(graph)) == len(kernels(full))
    summary = lambda g: sorted((d["label"], d["flops"], d["bytes"], d["instructions"]) for d in kernels(g).values())
    assert summary(graph) == summary(full)
    assert graph.number_of_edges() == full.number_of_edges()


def test_stablehlo_jaxlib_cannot_read_degrades_to_labels(chain: tuple[Any, ejlabel.ConfigSelectorChain]) -> None:
    lowered, selector = chain
    # An op this jaxlib does not know, as in StableHLO written by a newer JAX.
    text = lowered.as_text().replace("stablehlo.sine", "stablehlo.sine_from_the_future", 1)
    assert "sine_from_the_future" in text
    graph = call_graph(text, selector)
    assert graph.graph["degraded"] is True and graph.number_of_edges() == 0
    assert any("could not convert" in note for note in graph.graph["notes"])
    full = call_graph(lowered)
    assert {d["label"] for d in kernels(graph).values()} == {d["label"] for d in kernels(full).values()}
    assert len(kernels(graph)) == len({d["label"] for d in kernels(graph).values()})
    for d in kernels(graph).values():
        assert d["instructions"] > 0 and d["provenance"] == "heuristic"


def test_json_round_trip(chain: tuple[Any, ejlabel.ConfigSelectorChain]) -> None:
    lowered, selector = chain
    graph = call_graph(lowered, selector)

    class Opaque:  # no importable name: falls back to repr
        def __repr__(self) -> str:
            return "Opaque()"

    first = next(iter(kernels(graph)))
    graph.nodes[first]["config"] = Opaque()
    text = to_node_link_json(graph)
    data = json.loads(text)
    assert "edges" in data
    back = from_node_link_json(text)
    assert set(back.nodes) == set(graph.nodes)
    assert set(back.edges) == set(graph.edges)
    assert back.graph["modules"] == graph.graph["modules"]
    assert back.nodes[first]["config"] == "Opaque()"
    for node, attrs in graph.nodes(data=True):
        restored = back.nodes[node]
        assert restored["nesting"] == attrs["nesting"] and isinstance(restored["nesting"], tuple)
        for key in ("label", "op", "flops", "bytes", "multiplicity", "provenance", "opcodes"):
            assert restored[key] == attrs[key]
    other = next(n for n in kernels(graph) if n != first)
    assert back.nodes[other]["config"]["$dataclass"].endswith("Config")
    assert back.graph["config_encoding"]
    assert to_node_link_json(back) == to_node_link_json(from_node_link_json(to_node_link_json(back)))


def test_dot_text(chain: tuple[Any, ejlabel.ConfigSelectorChain]) -> None:
    lowered, selector = chain
    graph = call_graph(lowered, selector)
    real = kernels(graph)
    graph.add_node('odd"name\\x', kind="kernel", op='we"ird', version="1", call_key="0" * 16, config=None, direction="forward")
    dot = to_dot(graph)
    assert dot.startswith("digraph ") and dot.rstrip().endswith("}")
    assert dot.count("{") == dot.count("}")
    for d in real.values():
        assert f"{d['op']}@v{d['version']}" in dot
    assert '"odd\\"name\\\\x"' in dot and 'we\\"ird@v1' in dot
    assert "lightsalmon" in dot  # backward kernels are coloured
    assert "dashed" in dot and "color=red" in dot  # the config-less node
    assert "->" in dot


def test_dot_loop_nodes_are_ellipses() -> None:
    graph = call_graph(scan_cond_model(ejlabel.Executor(ejlabel.ConfigSelectorChain())).compile())
    dot = to_dot(graph)
    assert "shape=ellipse" in dot and "shape=box" in dot and "style=dotted" in dot


def test_draw_writes_svg_or_says_what_is_missing(tmp_path: Path, chain: tuple[Any, ejlabel.ConfigSelectorChain]) -> None:
    graph = call_graph(chain[0], chain[1])
    target = tmp_path / "graph.svg"
    if shutil.which("dot") is None:
        with pytest.raises(RuntimeError, match="Graphviz's `dot` program"):
            draw(graph, target)
    else:
        assert draw(graph, target) == target
        assert "<svg" in target.read_text()
        png = draw(graph, tmp_path / "graph.png")
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_draw_without_graphviz_raises(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(export_module.shutil, "which", lambda name: None)
    with pytest.raises(RuntimeError, match=r"apt install graphviz.*to_dot\(\)"):
        draw(nx.DiGraph(), tmp_path / "g.svg")
    assert not (tmp_path / "g.svg").exists()


def test_parsed_module_input_and_scale() -> None:
    """A large synthetic program: linear passes, one site per labelled chain."""
    from ejlabel.analysis.hlo import parse_hlo

    lines = ["HloModule big", "ENTRY %main (p: f32[16]) -> f32[16] {", "  %v.0 = f32[16]{0} parameter(0)"]
    n = 20_000
    for i in range(1, n):
        attrs = ""
        if i % 10 in (3, 4):  # pairs of labelled ops: one site each
            attrs = f', frontend_attributes={{ejlabel="ejkernel_ops#k{(i // 10) % 50}@v1:{(i // 10) % 50:016x}"}}'
        lines.append(f"  %v.{i} = f32[16]{{0}} add(%v.{i - 1}, %v.{max(0, i - 7)}){attrs}")
    lines += [f"  ROOT %r = f32[16]{{0}} copy(%v.{n - 1})", "}"]
    module = parse_hlo("\n".join(lines))
    graph = call_graph(module)
    sites = kernels(graph)
    assert len(sites) == n // 10
    assert all(d["instructions"] == 2 and d["flops"] == 32 for d in sites.values())
    assert graph.number_of_edges() >= len(sites) - 1


LABEL_GATE = "ejkernel_ops#matmul@v1:d72331d8a0b1c2d3"
LABEL_DOWN = "ejkernel_ops#matmul@v1:a3355011e4f5a6b7"
LABEL_UP = "ejkernel_ops#matmul@v1:12976a18c8d9e0f1"
LABEL_INNER = "ejkernel_ops#scale@v1:328e1597f2a3b4c5"


def _attrs(label: str) -> str:
    return f'frontend_attributes={{ejlabel="{label}"}}'


# Two layers call one unlabelled `silu` computation (as `jax.nn.silu` lowers): each layer's gate
# matmul feeds its own down projection through it.
SHARED_SILU_HLO = textwrap.dedent(
    f"""\
    HloModule jit_layers, entry_computation_layout={{(f32[4,4]{{1,0}}, f32[4,4]{{1,0}})->(f32[4,4]{{1,0}}, f32[4,4]{{1,0}})}}

    silu.7 {{
      Arg_0.8 = f32[4,4]{{1,0}} parameter(0)
      logistic.9 = f32[4,4]{{1,0}} logistic(Arg_0.8)
      ROOT multiply.10 = f32[4,4]{{1,0}} multiply(Arg_0.8, logistic.9)
    }}

    ENTRY main.20 {{
      x.1 = f32[4,4]{{1,0}} parameter(0)
      w.2 = f32[4,4]{{1,0}} parameter(1)
      gate.3 = f32[4,4]{{1,0}} dot(x.1, w.2), lhs_contracting_dims={{1}}, rhs_contracting_dims={{0}}, {_attrs(LABEL_GATE)}
      act.4 = f32[4,4]{{1,0}} call(gate.3), to_apply=silu.7
      down.5 = f32[4,4]{{1,0}} dot(act.4, w.2), lhs_contracting_dims={{1}}, rhs_contracting_dims={{0}}, {_attrs(LABEL_DOWN)}
      gate.6 = f32[4,4]{{1,0}} dot(down.5, w.2), lhs_contracting_dims={{1}}, rhs_contracting_dims={{0}}, {_attrs(LABEL_GATE)}
      act.7 = f32[4,4]{{1,0}} call(gate.6), to_apply=silu.7
      down.8 = f32[4,4]{{1,0}} dot(act.7, w.2), lhs_contracting_dims={{1}}, rhs_contracting_dims={{0}}, {_attrs(LABEL_DOWN)}
      ROOT tuple.9 = (f32[4,4]{{1,0}}, f32[4,4]{{1,0}}) tuple(down.5, down.8)
    }}
    """
)

# One computation called from two places with a tuple operand: element 0 passes through
# unlabelled ops, element 1 feeds a labelled site inside; the root is a tuple of both.
SHARED_TUPLE_HLO = textwrap.dedent(
    f"""\
    HloModule jit_mix

    mix.1 {{
      p.2 = (f32[4,4]{{1,0}}, /*index=1*/f32[4,4]{{1,0}}) parameter(0)
      a.3 = f32[4,4]{{1,0}} get-tuple-element(p.2), index=0
      b.4 = f32[4,4]{{1,0}} get-tuple-element(p.2), index=1
      inner.5 = f32[4,4]{{1,0}} multiply(b.4, b.4), {_attrs(LABEL_INNER)}
      neg.6 = f32[4,4]{{1,0}} negate(a.3)
      ROOT r.7 = (f32[4,4]{{1,0}}, f32[4,4]{{1,0}}) tuple(neg.6, inner.5)
    }}

    ENTRY main.10 {{
      x.1 = f32[4,4]{{1,0}} parameter(0)
      w.2 = f32[4,4]{{1,0}} parameter(1)
      gate.3 = f32[4,4]{{1,0}} dot(x.1, w.2), lhs_contracting_dims={{1}}, rhs_contracting_dims={{0}}, {_attrs(LABEL_GATE)}
      up.4 = f32[4,4]{{1,0}} dot(x.1, w.2), lhs_contracting_dims={{1}}, rhs_contracting_dims={{0}}, {_attrs(LABEL_UP)}
      t.5 = (f32[4,4]{{1,0}}, f32[4,4]{{1,0}}) tuple(gate.3, up.4)
      c.6 = (f32[4,4]{{1,0}}, f32[4,4]{{1,0}}) call(t.5), to_apply=mix.1
      e.7 = f32[4,4]{{1,0}} get-tuple-element(c.6), index=0
      f.8 = f32[4,4]{{1,0}} get-tuple-element(c.6), index=1
      down.9 = f32[4,4]{{1,0}} dot(e.7, w.2), lhs_contracting_dims={{1}}, rhs_contracting_dims={{0}}, {_attrs(LABEL_DOWN)}
      gate.10 = f32[4,4]{{1,0}} dot(down.9, w.2), lhs_contracting_dims={{1}}, rhs_contracting_dims={{0}}, {_attrs(LABEL_GATE)}
      up.11 = f32[4,4]{{1,0}} dot(f.8, w.2), lhs_contracting_dims={{1}}, rhs_contracting_dims={{0}}, {_attrs(LABEL_UP)}
      t.12 = (f32[4,4]{{1,0}}, f32[4,4]{{1,0}}) tuple(gate.10, up.11)
      c.13 = (f32[4,4]{{1,0}}, f32[4,4]{{1,0}}) call(t.12), to_apply=mix.1
      e.14 = f32[4,4]{{1,0}} get-tuple-element(c.13), index=0
      f.15 = f32[4,4]{{1,0}} get-tuple-element(c.13), index=1
      down.16 = f32[4,4]{{1,0}} dot(e.14, w.2), lhs_contracting_dims={{1}}, rhs_contracting_dims={{0}}, {_attrs(LABEL_DOWN)}
      ROOT sum.17 = f32[4,4]{{1,0}} add(down.16, f.15)
    }}
    """
)


def _data_edges(graph: nx.DiGraph) -> set[tuple[str, str]]:
    return {(a, b) for a, b, d in graph.edges(data=True) if d["kind"] == "data"}


@pytest.mark.parametrize("parsed", [False, True], ids=["text", "parsed-module"])
def test_shared_call_target_edges_follow_each_callers_operands(parsed: bool) -> None:
    """Each caller of a shared computation gets edges from its own operands, not the first caller's."""
    from ejlabel.analysis.hlo import parse_hlo

    graph = call_graph(parse_hlo(SHARED_SILU_HLO) if parsed else SHARED_SILU_HLO)
    node = "jit_layers/main.20/{}".format
    assert {n for n in kernels(graph)} == {node(n) for n in ("gate.3", "down.5", "gate.6", "down.8")}
    assert graph.nodes[node("gate.6")]["label"] == LABEL_GATE and graph.nodes[node("down.8")]["label"] == LABEL_DOWN
    assert _data_edges(graph) == {
        (node("gate.3"), node("down.5")),  # layer 1's gate -> silu -> layer 1's down projection
        (node("down.5"), node("gate.6")),
        (node("gate.6"), node("down.8")),  # layer 2's gate -> silu -> layer 2's down projection
    }


def test_shared_computation_with_tuple_operand_and_inner_site() -> None:
    """The site inside a shared computation reads from every caller; each caller's outputs follow its operands.

    HLO text, not a parsed module: tuple indices are read from the text.
    """
    graph = call_graph(SHARED_TUPLE_HLO)
    node = "jit_mix/main.10/{}".format
    inner = "jit_mix/mix.1/inner.5"
    assert set(kernels(graph)) == {node(n) for n in ("gate.3", "up.4", "down.9", "gate.10", "up.11", "down.16")} | {inner}
    assert _data_edges(graph) == {
        (node("up.4"), inner),  # element 1 of the first call
        (node("up.11"), inner),  # element 1 of the second call
        (node("gate.3"), node("down.9")),  # element 0 of the first call, through negate
        (node("down.9"), node("gate.10")),
        (inner, node("up.11")),
        (node("gate.10"), node("down.16")),  # element 0 of the second call
    }


# A shared block calling a computation that is shared too (also called from the entry) and one
# called only from the block, with a site inside the block reading its second parameter.
SHARED_NESTED_HLO = textwrap.dedent(
    f"""\
    HloModule jit_nested

    silu.1 {{
      a.1 = f32[4]{{0}} parameter(0)
      ROOT n.2 = f32[4]{{0}} negate(a.1)
    }}

    once.3 {{
      b.1 = f32[4]{{0}} parameter(0)
      c.2 = f32[4]{{0}} parameter(1)
      ROOT m.3 = f32[4]{{0}} multiply(b.1, c.2)
    }}

    blk.4 {{
      p.1 = f32[4]{{0}} parameter(0)
      q.2 = f32[4]{{0}} parameter(1)
      s.3 = f32[4]{{0}} call(p.1), to_apply=silu.1
      site.4 = f32[4]{{0}} sine(q.2), {_attrs(LABEL_INNER)}
      o.5 = f32[4]{{0}} call(s.3, site.4), to_apply=once.3
      ROOT r.6 = f32[4]{{0}} add(o.5, q.2)
    }}

    ENTRY main.9 {{
      x.1 = f32[4]{{0}} parameter(0)
      g.2 = f32[4]{{0}} cosine(x.1), {_attrs(LABEL_GATE)}
      u.3 = f32[4]{{0}} cosine(x.1), {_attrs(LABEL_UP)}
      b1.4 = f32[4]{{0}} call(g.2, u.3), to_apply=blk.4
      h.5 = f32[4]{{0}} cosine(b1.4), {_attrs(LABEL_DOWN)}
      b2.6 = f32[4]{{0}} call(h.5, x.1), to_apply=blk.4
      k.7 = f32[4]{{0}} cosine(b2.6), {_attrs(LABEL_GATE)}
      z.8 = f32[4]{{0}} call(k.7), to_apply=silu.1
      ROOT y.9 = f32[4]{{0}} cosine(z.8), {_attrs(LABEL_UP)}
    }}
    """
)


def test_shared_computation_nested_in_shared_computation() -> None:
    graph = call_graph(SHARED_NESTED_HLO)
    node = "jit_nested/main.9/{}".format
    inner = "jit_nested/blk.4/site.4"
    assert _data_edges(graph) == {
        (node("u.3"), inner),  # the second caller passes the unlabelled x.1: nothing more
        (node("g.2"), node("h.5")),  # through silu (shared), once and the block (shared)
        (node("u.3"), node("h.5")),  # q.2 -> r.6
        (inner, node("h.5")),
        (node("h.5"), node("k.7")),  # the second call: its own first operand
        (inner, node("k.7")),
        (node("k.7"), node("y.9")),  # silu called from the entry too
    }


LABEL_KV = "ejkernel_ops#matmul@v1:12976a181e727540"
LABEL_Q = "ejkernel_ops#matmul@v1:f903ed8484ac6631"

# Trimmed from the compiled TINY training step (CPU): XLA fused the cotangent sums of the k and v
# projections (one label) and of the q projection (another) into one fusion, which holds both
# labels and so is a member of both sites. Each of its operands feeds one label's add inside.
MERGED_ACCUMULATION_HLO = textwrap.dedent(
    f"""\
    HloModule jit_step

    %fused_add (param_0.1: f32[8], param_1.2: f32[8], param_2.3: f32[8]) -> f32[8] {{
      %param_1.2 = f32[8]{{0}} parameter(1)
      %param_2.3 = f32[8]{{0}} parameter(2)
      %kv_sum = f32[8]{{0}} add(%param_1.2, %param_2.3), {_attrs(LABEL_KV)}
      %param_0.1 = f32[8]{{0}} parameter(0)
      ROOT %q_sum = f32[8]{{0}} add(%kv_sum, %param_0.1), {_attrs(LABEL_Q)}
    }}

    ENTRY %main (x: f32[8]) -> f32[8] {{
      %x = f32[8]{{0}} parameter(0)
      %q_grad = f32[8]{{0}} negate(%x), {_attrs(LABEL_Q)}
      %k_grad = f32[8]{{0}} sine(%x), {_attrs(LABEL_KV)}
      %v_grad = f32[8]{{0}} cosine(%x), {_attrs(LABEL_KV)}
      %sums = f32[8]{{0}} fusion(%q_grad, %k_grad, %v_grad), kind=kLoop, calls=%fused_add
      ROOT %out = f32[8]{{0}} exponential(%sums)
    }}
    """
)


@pytest.mark.parametrize("parsed", [False, True], ids=["text", "parsed-module"])
def test_fusion_merging_two_calls_closes_no_cycle(parsed: bool) -> None:
    from ejlabel.analysis.hlo import parse_hlo

    graph = call_graph(parse_hlo(MERGED_ACCUMULATION_HLO) if parsed else MERGED_ACCUMULATION_HLO)
    q_node, q = by_label(graph, LABEL_Q)
    kv_node, kv = by_label(graph, LABEL_KV)
    assert q["members"] == ["q_grad", "sums"] and kv["members"] == ["k_grad", "v_grad", "sums"]
    assert q["flops"] == 8 + 8 and kv["flops"] == 8 + 8 + 8  # each label's ops, inside the fusion too
    # The fusion's first operand feeds the q sum, the others the k/v sum, which feeds the q sum:
    # k/v -> q only (reading every operand into both sites would give q -> k/v as well).
    assert _data_edges(graph) == {(kv_node, q_node)}
    assert nx.is_directed_acyclic_graph(graph)
