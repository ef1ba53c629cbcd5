"""Benchmark of the analysis: parse + call graph of real training steps, beside XLA's own parser.

The program is the example decoder's training step (``ejlabel.examples``, GPU_125M
dimensions, any number of layers), lowered on the CPU with abstract arguments, as HLO text
(``lowered.compiler_ir("hlo").as_hlo_text()``): 12 to 600 layers, and 3,350 layers, about 10^6
instructions. On the same text, each timed in the same process, one after the other:

- ``parse``: ``ejlabel.analysis.read_program(text)`` (the tolerant parser);
- ``graph``: ``ejlabel.analysis.call_graph(program)`` (instruction facts, sites, data flow,
  splits of the sites on cycles, nodes and edges);
- ``xla``: jaxlib's own HLO parser, ``jax._src.lib.hlo.hlo_module_from_text(text)`` (on the
  training steps: it verifies shapes, which the synthetic text does not keep consistent).

Each depth runs in a fresh process (its own memory, nothing cached from another depth); each
stage is timed ``--repeat`` times and the median is kept (the machine may be shared), wall and
CPU time both. Lowered texts can be kept between runs with ``--cache DIR`` (lowering 3,350 layers
takes minutes; it is not timed). The synthetic program (compiled-style HLO of 10^4 to 10^6
instructions, 10% labelled, see ``synthetic_hlo``) runs the same stages.

    python bench/bench_analysis.py [--layers 12 24 48 96 300 600 3350] [--synthetic 10000 100000 1000000]
                                   [--repeat 5] [--cache DIR] [--no-write]

Rows go to ``bench/results/bench_analysis.json`` (``bench/_results.py``); the table is printed,
with the growth of the graph's time from 24 to 96 layers and from 300 to 600, and parse + graph
over XLA's parser.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import gc
import json
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any


DEFAULT_LAYERS = (12, 24, 48, 96, 300, 600, 3350)
DEFAULT_SYNTHETIC = (10_000, 100_000, 1_000_000)
DISTINCT_LABELS = 1_000
LABELLED_EVERY = 10  # 10% of the synthetic program's instructions carry a label


def synthetic_hlo(n_instructions: int, n_computations: int = 8) -> str:
    """HLO text with ``n_instructions`` instruction lines that look like compiled XLA output.

    The entry and a few while bodies hold the instructions; one small fused computation is
    shared by all fusions. An instruction's first operand is the previous instruction, its second
    one of the last 4 values 80% of the time, a parameter of the computation 15%, and a value up
    to 50 back 5% (compiled programs mostly read values computed a few lines earlier); every
    tenth instruction carries one of ``DISTINCT_LABELS`` labels.
    """
    lines = [
        "HloModule jit_synthetic, is_scheduled=true, "
        "entry_computation_layout={(f32[128,256]{1,0}, f32[256,256]{1,0})->f32[128,256]{1,0}}",
        "",
        "%fused_add (param_0: f32[128,256], param_1: f32[128,256]) -> f32[128,256] {",
        "  %param_0 = f32[128,256]{1,0} parameter(0)",
        "  %param_1 = f32[128,256]{1,0} parameter(1)",
        "  ROOT %add.f = f32[128,256]{1,0} add(%param_0, %param_1)",
        "}",
        "",
    ]
    bodies = n_computations - 1
    per_comp = max(4, (n_instructions - 3) // n_computations)
    counter = 0

    def second(i: int, names: list[str]) -> str:
        pick = (i * 7919) % 100
        if pick < 80:
            return names[-1 - (i * 104729) % min(len(names), 4)]
        if pick < 95:
            return names[i % 2]
        return names[-1 - (i * 104729) % min(len(names), 50)]

    def body_lines(count: int) -> list[str]:
        nonlocal counter
        out: list[str] = []
        names: list[str] = []
        for k in range(count):
            i = counter
            counter += 1
            name = f"%op.{i}"
            shape = "f32[128,256]{1,0}"
            meta = f'metadata={{op_name="jit(f)/layer_{i % 97}/add" source_file="model.py" source_line={i % 500}}}'
            if k < 2:
                text = f"{shape} parameter({k}), {meta}"
            else:
                a, b = names[-1], second(i, names)
                text = (
                    f"{shape} add({a}, {b}), {meta}",
                    f"{shape} multiply({a}, {b}), {meta}",
                    f"{shape} fusion({a}, {b}), kind=kLoop, calls=%fused_add, {meta}",
                    f"{shape} dot({a}, {b}), lhs_contracting_dims={{1}}, rhs_contracting_dims={{0}}, {meta}",
                    f"(f32[128,256]{{1,0}}, s32[]) tuple({a}, {b})",
                )[i % 5]
            if i % LABELLED_EVERY == 0:
                label = i % DISTINCT_LABELS
                attrs = (
                    f'frontend_attributes={{ejcall="eyJvcCI6{label:04d}fQ",'
                    f'ejlabel="ejkernel_ops#op{label}@v1:{label * 2654435761 % 16**16:016x}"}}'
                )
                text = text.replace("metadata=", f"{attrs}, metadata=") if "metadata=" in text else f"{text}, {attrs}"
            root = "ROOT " if k == count - 1 else ""
            out.append(f"  {root}{name} = {text}")
            names.append(name)
        return out

    body_names: list[str] = []
    for comp in range(bodies):
        name = f"%region_{comp}.body"
        body_names.append(name)
        lines.append(f"{name} (arg_tuple.{comp}: (f32[128,256], f32[128,256])) -> f32[128,256] {{")
        lines.extend(body_lines(per_comp))
        lines += ["}", ""]
    entry_count = max(4, n_instructions - 3 - bodies * per_comp - bodies)
    lines.append("ENTRY %main (x: f32[128,256], y: f32[256,256]) -> f32[128,256] {")
    lines.extend(body_lines(entry_count - 1)[:-1])
    last = f"%op.{counter - 2}"
    for comp, body in enumerate(body_names):
        lines.append(
            f"  %while.{comp} = f32[128,256]{{1,0}} while({last}), condition=%fused_add, body={body}, "
            f'backend_config={{"known_trip_count":{{"n":"{comp + 2}"}}}}'
        )
        last = f"%while.{comp}"
    lines += [f"  ROOT %result = f32[128,256]{{1,0}} copy({last})", "}"]
    return "\n".join(lines) + "\n"


def training_step_hlo(layers: int) -> str:
    """The HLO text of the example decoder's training step with ``layers`` layers (not timed)."""
    import jax

    from ejlabel import examples

    cfg = dataclasses.replace(examples.GPU_125M, n_layers=layers)
    params = jax.eval_shape(lambda: examples.init_params(cfg, jax.random.key(0)))
    batch = jax.eval_shape(lambda: examples.example_batch(cfg, jax.random.key(1)))
    # Tracing thousands of layers allocates millions of acyclic objects: the cycle collector
    # walking them again and again makes lowering quadratic in depth.
    gc.disable()
    try:
        return jax.jit(examples.make_train_step(cfg)).lower(params, batch).compiler_ir("hlo").as_hlo_text()
    finally:
        gc.enable()
        gc.collect()


def timed(fn: Callable[[], Any]) -> tuple[Any, float, float]:
    """``fn()``, its wall time and its CPU time (less disturbed by other processes)."""
    gc.collect()
    start, start_cpu = time.perf_counter(), time.process_time()
    value = fn()
    return value, time.perf_counter() - start, time.process_time() - start_cpu


def measure(text: str, repeat: int, with_xla: bool) -> dict[str, Any]:
    """Median times of parse, graph and (``with_xla``) XLA's parser on ``text``, and what the
    graph holds."""
    from jax._src.lib import hlo as xla_hlo

    from ejlabel.analysis import call_graph, read_program

    samples: dict[str, list[float]] = {}
    graph = None
    for _ in range(repeat):
        program, wall, cpu = timed(lambda: read_program(text))
        samples.setdefault("parse_s", []).append(wall)
        samples.setdefault("parse_cpu_s", []).append(cpu)
        graph, wall, cpu = timed(functools.partial(call_graph, program))
        samples.setdefault("graph_s", []).append(wall)
        samples.setdefault("graph_cpu_s", []).append(cpu)
        if with_xla:
            _, wall, cpu = timed(lambda: xla_hlo.hlo_module_from_text(text))
            samples.setdefault("xla_s", []).append(wall)
            samples.setdefault("xla_cpu_s", []).append(cpu)
    row: dict[str, Any] = {key: round(statistics.median(values), 4) for key, values in samples.items()}
    for key, values in samples.items():
        row[key.replace("_s", "_runs_s")] = [round(v, 4) for v in values]
    row["total_s"] = round(row["parse_s"] + row["graph_s"], 4)
    row["total_cpu_s"] = round(row["parse_cpu_s"] + row["graph_cpu_s"], 4)
    if with_xla:
        row["total_over_xla"] = round(row["total_s"] / row["xla_s"], 2)
        row["total_over_xla_cpu"] = round(row["total_cpu_s"] / row["xla_cpu_s"], 2)
    assert graph is not None
    kernels = [d for _, d in graph.nodes(data=True) if d.get("kind") == "kernel"]
    row["nodes"] = len(kernels)
    row["edges"] = graph.number_of_edges()
    row["sites_per_op"] = dict(sorted(Counter(d["op"] for d in kernels).items()))
    row["text_mib"] = round(len(text) / 2**20, 2)
    return row


def child(kind: str, size: int, repeat: int, cache: str) -> dict[str, Any]:
    """One program in this process (run with ``--child``)."""
    if kind == "train_step":
        path = Path(cache) / f"train_step_{size}.hlo"
        if not path.exists():
            path.write_text(training_step_hlo(size))
        text = path.read_text()
    else:
        text = synthetic_hlo(size)
    from ejlabel.analysis import parse_hlo

    instructions = parse_hlo(text).instruction_count()
    row = {"program": kind, "layers" if kind == "train_step" else "size": size, "instructions": instructions}
    # The synthetic text is not shape-consistent (its ops read any earlier value), which XLA's
    # parser verifies: it is timed on the real steps only.
    row.update(measure(text, repeat, with_xla=kind == "train_step"))
    return row


def table(rows: list[dict[str, Any]]) -> str:
    header = ["program", "layers", "instructions", "parse s", "graph s", "parse + graph s", "XLA parser s", "(parse + graph) / XLA", "CPU ratio", "sites", "edges"]
    out = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for row in rows:
        out.append(
            "| "
            + " | ".join(
                [
                    row["program"],
                    str(row.get("layers", "-")),
                    f"{row['instructions']:,}",
                    f"{row['parse_s']:.3f}",
                    f"{row['graph_s']:.3f}",
                    f"{row['total_s']:.3f}",
                    f"{row['xla_s']:.3f}" if "xla_s" in row else "-",
                    f"{row['total_over_xla']:.2f}" if "xla_s" in row else "-",
                    f"{row['total_over_xla_cpu']:.2f}" if "xla_s" in row else "-",
                    f"{row['nodes']:,}",
                    f"{row['edges']:,}",
                ]
            )
            + " |"
        )
    return "\n".join(out)


def growth(rows: list[dict[str, Any]]) -> list[str]:
    """The graph's growth between depths the goals name (median wall and CPU time)."""
    by_layers = {row["layers"]: row for row in rows if row["program"] == "train_step"}
    lines = []
    for small, big, goal in ((24, 96, 4.5), (300, 600, 2.2)):
        if small in by_layers and big in by_layers:
            a, b = by_layers[small], by_layers[big]
            lines.append(
                f"graph {small} -> {big} layers: {b['graph_s'] / a['graph_s']:.2f}x wall, "
                f"{b['graph_cpu_s'] / a['graph_cpu_s']:.2f}x CPU (instructions {b['instructions'] / a['instructions']:.2f}x; goal <= {goal}x)"
            )
    return lines


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, nargs="*", default=list(DEFAULT_LAYERS))
    parser.add_argument("--synthetic", type=int, nargs="*", default=list(DEFAULT_SYNTHETIC))
    parser.add_argument("--repeat", type=int, default=5, help="timed runs per program; the median is kept")
    parser.add_argument("--cache", default=None, help="folder keeping the lowered steps' HLO text between runs")
    parser.add_argument("--no-write", action="store_true", help="print only; bench/results/ untouched")
    parser.add_argument("--child", nargs=2, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)

    if args.child is not None:
        print(json.dumps(child(args.child[0], int(args.child[1]), args.repeat, args.cache)))
        return

    cache = args.cache or tempfile.mkdtemp(prefix="bench_analysis_")
    Path(cache).mkdir(parents=True, exist_ok=True)
    rows: list[dict[str, Any]] = []
    jobs = [("train_step", n) for n in args.layers] + [("synthetic", n) for n in args.synthetic]
    for kind, size in jobs:
        # Fewer repeats where one run takes many seconds: the median of 3 still drops one outlier.
        repeat = args.repeat if size < (1000 if kind == "train_step" else 500_000) else min(args.repeat, 3)
        command = [sys.executable, __file__, "--child", kind, str(size), "--repeat", str(repeat), "--cache", cache]
        done = subprocess.run(command, capture_output=True, text=True, check=False)
        if done.returncode != 0:
            sys.exit(f"{kind} {size} failed:\n{done.stderr}")
        rows.append(json.loads(done.stdout.strip().splitlines()[-1]))
        print(f"measured {kind} {size}", file=sys.stderr)
    print(table(rows))
    for line in growth(rows):
        print(line)
    if not args.no_write:
        from _results import write_results

        write_results(
            "bench_analysis",
            rows,
            notes=(
                "medians of repeated runs, seconds; parse = ejlabel.analysis.read_program, graph = "
                "ejlabel.analysis.call_graph, xla = jaxlib's hlo_module_from_text on the same text; "
                "train_step = the example decoder's training step (GPU_125M dims) lowered on the CPU"
            ),
        )


if __name__ == "__main__":
    main()
