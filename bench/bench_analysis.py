"""Benchmark of the analysis stages on synthetic HLO text of 10^4 .. 10^6 instructions.

Each size runs in a fresh subprocess so that its peak memory is its own.  The
child builds the text, times ``parse_hlo`` (and any other stage given), then
parses once more under tracemalloc to measure the parser's peak allocation on
top of the input text (tracemalloc slows allocation, so it is not timed).

    python bench/bench_analysis.py [--sizes 10000 100000 1000000]
                                   [--graph-callable module:function] [--repeat 3]
                                   [--operands recent|uniform] [--write]

``--graph-callable`` names a function taking the parsed ``HloModule``; its time
is reported as one more stage, and ``total`` (parse + that stage, best run) with
it.  ``--write`` replaces the analysis section of ``bench/RESULTS.md`` (between its
``<!-- analysis:begin -->`` and ``<!-- analysis:end -->`` lines) with the new table.

``--operands`` picks where an instruction's second operand comes from (the first
is always the previous instruction).  ``recent`` (the default) follows compiled
programs, which mostly read values computed a few lines earlier: one of the
last 4 values 80% of the time, a parameter of the computation (weights, inputs:
defined at its top, read all along) 15%, and a value up to 50 back (a residual)
5%.  ``uniform`` is the earlier model: any of the last 50 values, equally often.
"""

from __future__ import annotations

import argparse
import gc
import importlib
import json
import platform
import resource
import subprocess
import sys
import time
import tracemalloc
from collections.abc import Callable
from pathlib import Path
from typing import Any

DEFAULT_SIZES = (10_000, 100_000, 1_000_000)
DISTINCT_LABELS = 1_000
LABELLED_EVERY = 10  # 10% of instructions carry a label
RESULTS = Path(__file__).with_name("RESULTS.md")
BEGIN, END = "<!-- analysis:begin -->", "<!-- analysis:end -->"
OPERAND_MODELS = ("recent", "uniform")


def _second_operand(i: int, names: list[str], operands: str) -> str:
    """The second operand of instruction ``i`` (see ``--operands`` in the module docstring)."""
    if operands == "uniform":
        return names[-1 - (i * 7919) % min(len(names), 50)]
    pick = (i * 7919) % 100
    if pick < 80:
        return names[-1 - (i * 104729) % min(len(names), 4)]
    if pick < 95:
        return names[i % 2]  # the computation's parameters come first
    return names[-1 - (i * 104729) % min(len(names), 50)]


def synthetic_hlo(n_instructions: int, n_computations: int = 8, operands: str = "recent") -> str:
    """HLO text with ``n_instructions`` instruction lines that look like compiled XLA output.

    The entry and a few while bodies hold the instructions; one small fused
    computation is shared by all fusions.  Operands reference earlier
    instructions of the same computation (``operands`` says which: see the
    module docstring); every tenth instruction carries one of
    ``DISTINCT_LABELS`` labels.
    """
    if operands not in OPERAND_MODELS:
        raise ValueError(f"operands must be one of {OPERAND_MODELS}, not {operands!r}")
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
    fixed = 3
    bodies = n_computations - 1
    per_comp = max(4, (n_instructions - fixed) // n_computations)
    counter = 0

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
                a = names[-1]
                b = _second_operand(i, names, operands)
                kind = i % 5
                if kind == 0:
                    text = f"{shape} add({a}, {b}), {meta}"
                elif kind == 1:
                    text = f"{shape} multiply({a}, {b}), {meta}"
                elif kind == 2:
                    text = (f"{shape} fusion({a}, {b}), kind=kLoop, calls=%fused_add, {meta}")
                elif kind == 3:
                    text = (
                        f"{shape} dot({a}, {b}), lhs_contracting_dims={{1}}, rhs_contracting_dims={{0}}, "
                        f"{meta}"
                    )
                else:
                    text = f"(f32[128,256]{{1,0}}, s32[]) tuple({a}, {b})"
            if i % LABELLED_EVERY == 0:
                # XLA prints frontend attributes just before the metadata.
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
        lines.append("}")
        lines.append("")
    entry_count = max(4, n_instructions - fixed - bodies * per_comp - bodies)
    lines.append("ENTRY %main (x: f32[128,256], y: f32[256,256]) -> f32[128,256] {")
    lines.extend(body_lines(entry_count - 1)[:-1])
    last = f"%op.{counter - 2}"
    for comp, body in enumerate(body_names):
        lines.append(
            f"  %while.{comp} = f32[128,256]{{1,0}} while({last}), condition=%fused_add, body={body}, "
            f'backend_config={{"known_trip_count":{{"n":"{comp + 2}"}}}}'
        )
        last = f"%while.{comp}"
    lines.append(f"  ROOT %result = f32[128,256]{{1,0}} copy({last})")
    lines.append("}")
    return "\n".join(lines) + "\n"


def time_stage(name: str, fn: Callable[[], Any], results: dict[str, float]) -> Any:
    """Run ``fn`` once, store its wall and CPU time under ``name`` / ``name cpu``, return its result.

    CPU time is reported too because the machine may be shared: it is less
    affected by other processes than wall time.
    """
    start, start_cpu = time.perf_counter(), time.process_time()
    value = fn()
    results[name] = time.perf_counter() - start
    results[f"{name} cpu"] = time.process_time() - start_cpu
    return value


def _load_callable(spec: str) -> Callable[[Any], Any]:
    module_name, _, attr = spec.partition(":")
    return getattr(importlib.import_module(module_name), attr)


def child(size: int, graph_callable: str | None, repeat: int, operands: str = "recent") -> dict[str, Any]:
    """Measure one size in this process (run via ``--child``)."""
    from ejlabel.analysis.hlo import parse_hlo

    text = synthetic_hlo(size, operands=operands)
    graph = _load_callable(graph_callable) if graph_callable else None
    times: dict[str, float] = {}
    # Best of `repeat` runs: the machine may be shared, and the minimum is the least disturbed.
    for _ in range(repeat):
        module = None
        gc.collect()
        run: dict[str, float] = {}
        module = time_stage("parse", lambda: parse_hlo(text), run)
        if graph is not None:
            built = time_stage("graph", lambda: graph(module), run)
            edges = getattr(built, "number_of_edges", lambda: None)()
            del built
            run["total"] = run["parse"] + run["graph"]
            run["total cpu"] = run["parse cpu"] + run["graph cpu"]
        times = {key: min(value, times.get(key, value)) for key, value in run.items()}
    count = module.instruction_count()
    if graph is None:
        edges = None
    labelled = sum(1 for _ in module.with_attribute("ejlabel"))
    rss_after_parse = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    del module
    gc.collect()
    tracemalloc.start()
    again = parse_hlo(text)
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    del again
    return {
        "size": size,
        "instructions": count,
        "labelled": labelled,
        "text_mib": len(text) / 2**20,
        "times": times,
        "edges": edges,
        "peak_parse_mib": peak / 2**20,
        "maxrss_mib": rss_after_parse,
    }


def _versions() -> dict[str, str]:
    try:
        import jax

        jax_version = jax.__version__
    except Exception:  # noqa: BLE001 - the bench runs without jax too
        jax_version = "not installed"
    cpu = platform.processor() or "unknown"
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, check=False).stdout
        for row in out.splitlines():
            if row.startswith("Model name:"):
                cpu = row.split(":", 1)[1].strip()
        cores = subprocess.run(["nproc"], capture_output=True, text=True, check=False).stdout.strip()
        cpu = f"{cpu}, {cores} cores"
    except OSError:
        pass
    return {"cpu": cpu, "python": platform.python_version(), "jax": jax_version}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", type=int, nargs="+", default=list(DEFAULT_SIZES))
    parser.add_argument("--graph-callable", default=None, help="module:function taking the parsed HloModule")
    parser.add_argument("--repeat", type=int, default=3, help="timed runs per size; the best is kept")
    parser.add_argument("--operands", choices=OPERAND_MODELS, default="recent", help="operand model (see above)")
    parser.add_argument("--write", action="store_true", help=f"write the table into the analysis section of {RESULTS.name}")
    parser.add_argument("--date", default=time.strftime("%Y-%m-%d"))
    parser.add_argument("--child", type=int, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)

    if args.child is not None:
        print(json.dumps(child(args.child, args.graph_callable, args.repeat, args.operands)))
        return

    rows: list[dict[str, Any]] = []
    for size in args.sizes:
        command = [sys.executable, __file__, "--child", str(size), "--repeat", str(args.repeat), "--operands", args.operands]
        if args.graph_callable:
            command += ["--graph-callable", args.graph_callable]
        done = subprocess.run(command, capture_output=True, text=True, check=False)
        if done.returncode != 0:
            sys.exit(f"size {size} failed:\n{done.stderr}")
        rows.append(json.loads(done.stdout.strip().splitlines()[-1]))
        print(f"measured {size}", file=sys.stderr)

    stages = [s for s in rows[0]["times"] if not s.endswith(" cpu")]
    header = ["instructions", "text MiB"] + [f"{s} s" for s in stages] + [f"{stages[-1]} cpu s"]
    if rows[0]["edges"] is not None:
        header.append("graph edges")
    header += ["parse µs/instr", "parse peak MiB", "max RSS MiB"]
    table = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for row in rows:
        cells = [f"{row['instructions']:,}", f"{row['text_mib']:.1f}"]
        cells += [f"{row['times'][s]:.3f}" for s in stages]
        cells.append(f"{row['times'][stages[-1] + ' cpu']:.3f}")
        if row["edges"] is not None:
            cells.append(f"{row['edges']:,}")
        cells += [
            f"{row['times']['parse'] / row['instructions'] * 1e6:.2f}",
            f"{row['peak_parse_mib']:.1f}",
            f"{row['maxrss_mib']:.0f}",
        ]
        table.append("| " + " | ".join(cells) + " |")
    by_size = {row["size"]: row for row in rows}
    ratio_lines: list[str] = []
    if 1_000_000 in by_size and 100_000 in by_size:
        big, small = by_size[1_000_000]["times"], by_size[100_000]["times"]
        for stage in stages:
            ratio_lines.append(
                f"{stage} time ratio 10^6 / 10^5 instructions: {big[stage] / small[stage]:.2f} wall, "
                f"{big[stage + ' cpu'] / small[stage + ' cpu']:.2f} CPU (linear is 10)."
            )
    report = "\n".join(table + ([""] + ratio_lines if ratio_lines else []))
    print(report)

    if args.write:
        info = _versions()
        command = "python bench/bench_analysis.py --write"
        if args.graph_callable:
            command += f" --graph-callable {args.graph_callable}"
        if args.operands != "recent":
            command += f" --operands {args.operands}"
        section = (
            "## Analysis benchmark: HLO parsing and the call graph\n\n"
            f"Date: {args.date}. Machine: {info['cpu']}. Python {info['python']}, jax {info['jax']}.\n\n"
            "Synthetic compiled-style HLO (8 computations, operands referencing earlier instructions\n"
            f"({args.operands!r} operand model, see the bench's docstring), metadata on most lines, "
            f"{100 // LABELLED_EVERY}% of instructions labelled with\n"
            f"{DISTINCT_LABELS} distinct labels), one fresh process per size, best of {args.repeat} runs "
            "(each stage's best; `total` is the best run's parse + graph).\n"
            "`parse peak MiB` is tracemalloc's peak during a second parse, above the input text;\n"
            "`max RSS MiB` is the process's peak resident size (text generation, parse and graph included).\n"
            "Metadata texts repeat every 48,500 instructions here and the parser parses each distinct\n"
            "text once, so per-instruction parse cost falls with size.\n\n"
            f"Command: `{command}`\n\n{report}\n"
        )
        current = RESULTS.read_text(encoding="utf-8")
        start, stop = current.find(BEGIN), current.find(END)
        if start < 0 or stop < start:
            sys.exit(f"{RESULTS}: no {BEGIN} ... {END} section to replace")
        RESULTS.write_text(current[: start + len(BEGIN)] + "\n" + section + current[stop:], encoding="utf-8")


if __name__ == "__main__":
    main()
