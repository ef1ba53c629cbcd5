"""Benchmark of the analysis stages on synthetic HLO text of 10^4 .. 10^6 instructions.

Each size runs in a fresh subprocess so that its peak memory is its own.  The
child builds the text, times ``parse_hlo`` (and any other stage given), then
parses once more under tracemalloc to measure the parser's peak allocation on
top of the input text (tracemalloc slows allocation, so it is not timed).

    python bench/bench_analysis.py [--sizes 10000 100000 1000000]
                                   [--graph-callable module:function] [--repeat 3] [--write]

``--graph-callable`` names a function taking the parsed ``HloModule``; its time
is reported as one more stage.  ``--write`` stores the table in
``bench/RESULTS_analysis.md``.
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
RESULTS = Path(__file__).with_name("RESULTS_analysis.md")


def synthetic_hlo(n_instructions: int, n_computations: int = 8) -> str:
    """HLO text with ``n_instructions`` instruction lines that look like compiled XLA output.

    The entry and a few while bodies hold the instructions; one small fused
    computation is shared by all fusions.  Operands reference earlier
    instructions of the same computation; every tenth instruction carries one of
    ``DISTINCT_LABELS`` labels.
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
                b = names[-1 - (i * 7919) % min(len(names), 50)]
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


def child(size: int, graph_callable: str | None, repeat: int) -> dict[str, Any]:
    """Measure one size in this process (run via ``--child``)."""
    from ejlabel.analysis.hlo import parse_hlo

    text = synthetic_hlo(size)
    graph = _load_callable(graph_callable) if graph_callable else None
    times: dict[str, float] = {}
    # Best of `repeat` runs: the machine may be shared, and the minimum is the least disturbed.
    for _ in range(repeat):
        module = None
        gc.collect()
        run: dict[str, float] = {}
        module = time_stage("parse", lambda: parse_hlo(text), run)
        if graph is not None:
            time_stage("graph", lambda: graph(module), run)
        times = {key: min(value, times.get(key, value)) for key, value in run.items()}
    count = module.instruction_count()
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
    parser.add_argument("--write", action="store_true", help=f"write the table to {RESULTS.name}")
    parser.add_argument("--date", default=time.strftime("%Y-%m-%d"))
    parser.add_argument("--child", type=int, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)

    if args.child is not None:
        print(json.dumps(child(args.child, args.graph_callable, args.repeat)))
        return

    rows: list[dict[str, Any]] = []
    for size in args.sizes:
        command = [sys.executable, __file__, "--child", str(size), "--repeat", str(args.repeat)]
        if args.graph_callable:
            command += ["--graph-callable", args.graph_callable]
        done = subprocess.run(command, capture_output=True, text=True, check=False)
        if done.returncode != 0:
            sys.exit(f"size {size} failed:\n{done.stderr}")
        rows.append(json.loads(done.stdout.strip().splitlines()[-1]))
        print(f"measured {size}", file=sys.stderr)

    stages = list(rows[0]["times"])
    header = ["instructions", "text MiB"] + [f"{s} s" for s in stages] + ["parse µs/instr", "parse peak MiB", "max RSS MiB"]
    table = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for row in rows:
        cells = [f"{row['instructions']:,}", f"{row['text_mib']:.1f}"]
        cells += [f"{row['times'][s]:.3f}" for s in stages]
        cells += [
            f"{row['times']['parse'] / row['instructions'] * 1e6:.2f}",
            f"{row['peak_parse_mib']:.1f}",
            f"{row['maxrss_mib']:.0f}",
        ]
        table.append("| " + " | ".join(cells) + " |")
    by_size = {row["size"]: row for row in rows}
    ratio_line = ""
    if 1_000_000 in by_size and 100_000 in by_size:
        ratio = by_size[1_000_000]["times"]["parse"] / by_size[100_000]["times"]["parse"]
        cpu_ratio = by_size[1_000_000]["times"]["parse cpu"] / by_size[100_000]["times"]["parse cpu"]
        ratio_line = f"Parse time ratio 10^6 / 10^5 instructions: {ratio:.2f} wall, {cpu_ratio:.2f} CPU (linear is 10)."
    report = "\n".join(table + ([""] + [ratio_line] if ratio_line else []))
    print(report)

    if args.write:
        info = _versions()
        RESULTS.write_text(
            "# Analysis benchmark: HLO parsing\n\n"
            f"Date: {args.date}. Machine: {info['cpu']}. Python {info['python']}, jax {info['jax']}.\n\n"
            "Synthetic compiled-style HLO (8 computations, operands referencing earlier instructions,\n"
            f"metadata on most lines, {100 // LABELLED_EVERY}% of instructions labelled with "
            f"{DISTINCT_LABELS} distinct labels), one fresh process per size, best of {args.repeat} runs.\n"
            "`parse peak MiB` is tracemalloc's peak during a second parse, above the input text;\n"
            "`max RSS MiB` is the process's peak resident size (text generation included).\n"
            "Metadata texts repeat every 48,500 instructions here and the parser parses each distinct\n"
            "text once, so per-instruction cost falls with size; the ratio below is under 10 for that reason.\n\n"
            f"Command: `python bench/bench_analysis.py --write`\n\n{report}\n",
            encoding="utf-8",
        )


if __name__ == "__main__":
    main()
