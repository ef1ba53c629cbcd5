"""One program reader: every form of a program gives the same calls, flops and data order."""

from __future__ import annotations

import textwrap
from collections import Counter
from pathlib import Path
from typing import Any

import jax
import networkx as nx
import pytest
from conftest import run_python
from ejlabel.analysis import (
    Program,
    audit,
    call_graph,
    invocations_from_program,
    parse_hlo,
    read_program,
)

import ejlabel
import ejlabel.execution.executor as executor_module
from ejlabel import examples
from ejlabel.core.labels import label_scope

# The models of these tests, as source: the test process lowers them, a child process that
# dumps with XLA_FLAGS (which must be set before JAX starts) runs the same code.
MODELS = textwrap.dedent(
    """
    import jax, jax.numpy as jnp
    from ejlabel.kernels.matmul import MatmulConfig, matmul
    from ejlabel.kernels.norms import NormConfig, rms_norm

    # Pallas configs (interpret mode on the CPU) give every call a custom VJP: its backward is a
    # kernel call of its own, under its own label. XLA configs are differentiated by JAX.
    PALLAS = (MatmulConfig("pallas", 8, 8, 8), NormConfig("pallas", 4))
    XLA = (None, None)

    def three_layers(params, x, cfgs):
        mm_cfg, norm_cfg = cfgs
        layers, final = params
        for w, g in layers:
            x = matmul(rms_norm(x, g, cfg=norm_cfg), w, cfg=mm_cfg)
        return jnp.sum(rms_norm(x, final, cfg=norm_cfg))

    def fwd_xla(params, x):
        return three_layers(params, x, XLA)

    def fwd_pallas(params, x):
        return three_layers(params, x, PALLAS)

    def grad_xla(params, x):
        return jax.value_and_grad(fwd_xla)(params, x)

    def grad_pallas(params, x):
        return jax.value_and_grad(fwd_pallas)(params, x)

    def one_matmul(a, b):
        return matmul(a, b)

    PARAMS = ([(jnp.full((16, 16), 0.1), jnp.ones((16,))) for _ in range(3)], jnp.ones((16,)))
    X = jnp.ones((8, 16))
    A, B = jnp.ones((32, 64)), jnp.ones((64, 48))
    FUNCTIONS = {"fwd_xla": (fwd_xla, (PARAMS, X)), "fwd_pallas": (fwd_pallas, (PARAMS, X)),
                 "grad_xla": (grad_xla, (PARAMS, X)), "grad_pallas": (grad_pallas, (PARAMS, X)),
                 "one_matmul": (one_matmul, (A, B))}
    """
)
models: dict[str, Any] = {}
exec(MODELS, models)  # noqa: S102 - the test's own source, shared with the child process

FORMS = ("stablehlo", "hlo", "compiled", "dump")


def kernels(graph: nx.DiGraph, module: str | None = None) -> dict[str, dict[str, Any]]:
    return {
        n: d
        for n, d in graph.nodes(data=True)
        if d.get("kind") == "kernel" and (module is None or d["module"] == module)
    }


@pytest.fixture(scope="module")
def dump(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """An XLA dump of every model above, written by a child process."""
    path = tmp_path_factory.mktemp("dump")
    run_python(
        MODELS + "\nfor fn, args in FUNCTIONS.values():\n    jax.jit(fn).lower(*args).compile()\n",
        XLA_FLAGS=f"--xla_dump_to={path}",
    )
    return path


@pytest.fixture(scope="module")
def lowered() -> dict[str, Any]:
    return {name: jax.jit(fn).lower(*args) for name, (fn, args) in models["FUNCTIONS"].items()}


def form_graphs(name: str, lowered: dict[str, Any], dump: Path) -> dict[str, nx.DiGraph]:
    """The call graph of one model from each form: its sites (the dump's other modules dropped)."""
    low = lowered[name]
    graphs = {
        "stablehlo": call_graph(low.as_text()),
        "hlo": call_graph(low),
        "compiled": call_graph(low.compile()),
    }
    whole = call_graph(dump)
    graphs["dump"] = whole.subgraph(kernels(whole, f"jit_{name}")).copy()
    return graphs


@pytest.fixture()
def count_calls(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Labels of the kernel calls made in Python while tracing: the label scopes entered.

    A forward call enters one; a backward pass run by the kernel's custom VJP enters one more.
    """
    entered: list[str] = []

    class Counting(label_scope):
        def __enter__(self) -> None:
            entered.append(self._name)
            super().__enter__()

    monkeypatch.setattr(executor_module, "label_scope", Counting)
    return entered


# ---------------------------------------------------------------------------
# Reading.


def test_what_each_form_reads(lowered: dict[str, Any], dump: Path, tmp_path: Path) -> None:
    low = lowered["one_matmul"]
    assert read_program(low).origin == "lowered"
    assert read_program(low).modules[0].source == "Lowered.compiler_ir('hlo')"
    assert read_program(low.compile()).origin == "compiled"
    stable = read_program(low.as_text())
    assert stable.origin == "text" and "converted to HLO" in stable.modules[0].source and not stable.degraded
    program = read_program(dump)
    assert program.origin == "dump" and all(pm.source.endswith("after_optimizations.txt") for pm in program.modules)
    before = read_program(dump, stage="before")
    assert all(pm.source.endswith("before_optimizations.txt") for pm in before.modules)
    assert [pm.name for pm in before.modules] == [pm.name for pm in program.modules]
    # A module dumped only before optimizations is left out (and said so), never mixed in.
    only_before = tmp_path / "partial"
    only_before.mkdir()
    for path in sorted(dump.glob("*jit_one_matmul*_optimizations.txt")) + sorted(dump.glob("*jit_fwd_xla.before_optimizations.txt")):
        (only_before / path.name).write_text(path.read_text())
    partial = read_program(only_before)
    assert [pm.name for pm in partial.modules] == ["jit_one_matmul"]
    assert any("jit_fwd_xla.before_optimizations.txt" in note for note in partial.notes)
    file = tmp_path / "program.hlo"
    file.write_text(low.compiler_ir("hlo").as_hlo_text())
    assert read_program(file).origin == "file" and read_program(str(file)).origin == "file"
    assert read_program(program) is program
    module = parse_hlo(file.read_text())
    assert read_program(module).modules[0].module is module
    with pytest.raises(TypeError, match="x: expected a Lowered"):
        read_program(3.5)
    with pytest.raises(FileNotFoundError):
        read_program(tmp_path / "missing.hlo")


def test_kind_is_decided_by_the_header_not_by_what_the_text_mentions(lowered: dict[str, Any]) -> None:
    hlo = lowered["one_matmul"].compiler_ir("hlo").as_hlo_text()
    # HLO that mentions StableHLO ops and func.func (in a comment) is still HLO.
    header, rest = hlo.split("\n", 1)
    mentions = f"{header}\n// from module @jit_one_matmul: stablehlo.dot_general in func.func @main\n{rest}"
    assert mentions.startswith("HloModule")
    program = read_program(mentions)
    assert "converted" not in program.modules[0].source and len(kernels(call_graph(program))) == 1
    stable = lowered["one_matmul"].as_text()
    assert "converted to HLO" in read_program("// a comment first\n" + stable).modules[0].source


def test_labels_and_descriptions_in_one_reading(lowered: dict[str, Any]) -> None:
    program = read_program(lowered["grad_pallas"])
    labels = program.labels
    backward = [lab for lab in labels if ".bwd@" in lab]
    assert backward and len(labels) == 4  # matmul and rms_norm, forward and backward
    for lab in backward:
        forward = lab.replace(".bwd@", "@")
        assert forward in labels and program.descriptions[lab] == program.descriptions[forward]
    invs = invocations_from_program(program)
    assert {inv.op_id for inv in invs.values()} == {"matmul@v1", "rms_norm@v1"}
    assert set(invs) == set(labels)
    assert read_program(lowered["grad_pallas"].as_text()).descriptions == program.descriptions


def test_audit_reads_one_program(lowered: dict[str, Any]) -> None:
    program = read_program(lowered["fwd_xla"])
    report = audit(program, ejlabel.ConfigSelectorChain())
    assert len(report.calls) == 7
    assert all(args != "?" for args in report.arguments.values())
    assert {row.label for row in report.calls} == set(program.labels)


# ---------------------------------------------------------------------------
# One graph, whatever the form.


@pytest.fixture(scope="module")
def tiny_step() -> Any:
    cfg = examples.TINY
    params = examples.init_params(cfg, jax.random.PRNGKey(0))
    batch = examples.example_batch(cfg, jax.random.PRNGKey(1))
    return jax.jit(examples.make_train_step(cfg)).lower(params, batch)


def _summary(graph: nx.DiGraph) -> tuple[set, set, dict]:
    nodes = {n: (d.get("flops"), d.get("bytes"), d.get("instructions"), d.get("label")) for n, d in graph.nodes(data=True)}
    return set(graph.nodes), set(graph.edges), nodes


@pytest.mark.parametrize("form", ["lowered", "compiled"])
def test_graph_from_text_equals_graph_from_parsed_module(tiny_step: Any, form: str) -> None:
    text = tiny_step.compiler_ir("hlo").as_hlo_text() if form == "lowered" else tiny_step.compile().as_text()
    from_text = call_graph(text)
    from_module = call_graph(parse_hlo(text))
    assert from_module.graph["inferred_facts"] == ["jit_step"] and from_text.graph["inferred_facts"] == []
    assert len(kernels(from_text)) > 40 and from_text.number_of_edges() > 40
    assert _summary(from_text) == _summary(from_module)
    assert sum(d["flops"] for d in kernels(from_text).values()) == sum(d["flops"] for d in kernels(from_module).values())


def test_compiled_training_step_is_a_dag(tiny_step: Any) -> None:
    for program in (tiny_step, tiny_step.compile()):
        graph = call_graph(program)
        assert nx.is_directed_acyclic_graph(graph), nx.find_cycle(graph)
        # The forward and backward pieces of one norm call (one label, differentiated by JAX)
        # are two sites, the backward after the forward.
        norms = kernels(graph)
        assert sum(d["op"] == "rms_norm" for d in norms.values()) == 2 * 5  # 5 norm calls


def test_matmul_flops_in_every_form(lowered: dict[str, Any], dump: Path) -> None:
    expected = 2 * 32 * 48 * 64
    graphs = form_graphs("one_matmul", lowered, dump)
    before = call_graph(read_program(dump, stage="before"))
    graphs["dump before optimizations"] = before.subgraph(kernels(before, "jit_one_matmul")).copy()
    flops = {form: [d["flops"] for d in kernels(g).values()] for form, g in graphs.items()}
    # StableHLO is read as the HLO of its lowering, which the dump's unoptimised file is too:
    # exactly equal. The compiled program is XLA's rewrite: the dot is the same dot (the stated
    # tolerance, 1%, is for rewrites of the elementwise ops around it).
    assert flops["stablehlo"] == flops["hlo"] == flops["dump before optimizations"] == [expected]
    for form in ("compiled", "dump"):
        [value] = flops[form]
        assert abs(value - expected) <= 0.01 * expected, (form, value)
    bytes_ = {form: [d["bytes"] for d in kernels(g).values()] for form, g in graphs.items()}
    assert bytes_["stablehlo"] == bytes_["hlo"] == bytes_["dump before optimizations"] == [(32 * 64 + 64 * 48 + 32 * 48) * 4]


# ---------------------------------------------------------------------------
# One call, one site.


@pytest.mark.parametrize("name", ["fwd_xla", "fwd_pallas", "grad_pallas"])
def test_one_site_per_python_call_in_every_form(name: str, lowered: dict[str, Any], dump: Path, count_calls: list[str]) -> None:
    fn, args = models["FUNCTIONS"][name]
    jax.jit(lambda *a: fn(*a)).lower(*args)  # a new function: traced afresh, each call enters its label scope
    expected = Counter(lab.split("#")[1].split("@")[0] for lab in count_calls)
    if name.startswith("grad"):
        assert sum(expected.values()) == 14 and expected["matmul.bwd"] == 3 and expected["rms_norm.bwd"] == 4
    else:
        assert sum(expected.values()) == 7
    for form, graph in form_graphs(name, lowered, dump).items():
        found = Counter(d["op"] for d in kernels(graph).values())
        assert found == expected, (form, found)
        assert nx.is_directed_acyclic_graph(graph)


def test_unlabelled_ops_inside_a_call_join_it(lowered: dict[str, Any]) -> None:
    # JAX writes the broadcasts and reshapes of rms_norm's statistics without attributes.
    graph = call_graph(lowered["fwd_xla"])
    norms = [d for d in kernels(graph).values() if d["op"] == "rms_norm"]
    assert len(norms) == 4
    hlo = lowered["fwd_xla"].compiler_ir("hlo").as_hlo_text()
    module = parse_hlo(hlo)
    unlabelled = {i.name for i in module.instructions() if "ejlabel" not in i.frontend_attributes}
    joined = {m for d in norms for m in d["members"] if m in unlabelled}
    assert joined and {module.entry_computation.instruction(m).opcode for m in joined} <= {"broadcast", "reshape"}


def test_differentiated_by_jax_every_form_agrees(lowered: dict[str, Any], dump: Path) -> None:
    """XLA configs: JAX writes the backward under the forward's labels. Forms agree; it is a DAG."""
    counts = {}
    for form, graph in form_graphs("grad_xla", lowered, dump).items():
        counts[form] = Counter(d["op"] for d in kernels(graph).values())
        assert nx.is_directed_acyclic_graph(graph)
    assert len(set(map(frozenset, (c.items() for c in counts.values())))) == 1, counts
    # A layer norm's forward and backward are two sites: the backward reads the cotangent that the
    # matmuls after it computed from the forward's output, and one site would close a cycle. The
    # final norm's backward reads only its own forward's values and the constant cotangent: one
    # site. A matmul's forward and its two gradient products meet nowhere: three sites.
    assert counts["hlo"] == Counter({"rms_norm": 3 * 2 + 1, "matmul": 3 * 3})


def test_program_is_accepted_by_every_pass(lowered: dict[str, Any]) -> None:
    program = Program.read(lowered["fwd_xla"])
    assert set(kernels(call_graph(program))) == set(kernels(call_graph(lowered["fwd_xla"])))
    assert len(audit(program, ejlabel.ConfigSelectorChain()).calls) == 7
