"""Time ``short_hash`` on a typical kernel-call signature and on long lists.

The hash runs on every traced kernel call, so its cost on a call signature is
what matters; the lists show that cost grows linearly with the input.  The
older package's ``short_hash`` is timed side by side, in a subprocess running
a separate environment's Python (``--ref-python``), because that package
cannot share an environment with this one.

Usage::

    PYTHONPATH=. python bench/bench_fingerprint.py [--ref-python PATH] [--repeat N]

The rows go to ``bench/results/bench_fingerprint.json`` (``bench/_results.py``).
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import json
import os
import platform
import statistics
import subprocess
import sys
import timeit
from collections.abc import Callable
from typing import Any

from _results import write_results

DEFAULT_REF_PYTHON = "/work/venv-ref/bin/python"
LIST_SIZES = (10**3, 10**5, 10**6)


@dataclasses.dataclass(frozen=True)
class AttentionConfig:
    """A kernel config as tuners store them: a small frozen dataclass."""

    block_q: int = 128
    block_k: int = 128
    num_warps: int = 4
    num_stages: int = 2


def attention_signature() -> Any:
    """Arguments of one attention call: q, k, v (q sharded over a 1-device
    mesh), the static keyword arguments and the config."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import NamedSharding, PartitionSpec

    mesh = jax.make_mesh((1,), ("x",))
    shape = (4, 4096, 16, 128)
    q = jax.ShapeDtypeStruct(shape, jnp.bfloat16, sharding=NamedSharding(mesh, PartitionSpec(None, None, "x")))
    k = jax.ShapeDtypeStruct(shape, jnp.bfloat16)
    v = jax.ShapeDtypeStruct(shape, jnp.bfloat16)
    kwargs = {"causal": True, "softmax_scale": 0.088, "sliding_window": (128, 0), "dtype": jnp.bfloat16}
    return ((q, k, v), kwargs, AttentionConfig())


def load_hash(impl: str) -> Callable[[Any], str]:
    """``short_hash`` of this library or of the reference package."""
    if impl == "ejlabel":
        from ejlabel.utils.fingerprint import short_hash

        return short_hash
    # Load only the fingerprint module: the reference package's __init__
    # pulls in far more than it needs.
    spec = importlib.util.find_spec("ejkernel")
    if spec is None or not spec.submodule_search_locations:
        raise ImportError("reference package not installed")
    path = os.path.join(list(spec.submodule_search_locations)[0], "ops", "utils", "fingerprint.py")
    module_spec = importlib.util.spec_from_file_location("reference_fingerprint", path)
    module = importlib.util.module_from_spec(module_spec)
    module_spec.loader.exec_module(module)
    return module.short_hash


def seconds_per_call(fn: Callable[[], Any], repeat: int) -> float:
    """Median over ``repeat`` runs of the time per call; each run lasts about
    0.1 s so that timer resolution and one-off stalls do not dominate."""
    fn()  # warm caches, as on every call after the first in real use
    once = min(timeit.repeat(fn, number=1, repeat=3))
    number = max(1, int(0.1 / max(once, 1e-7)))
    runs = timeit.repeat(fn, number=number, repeat=repeat)
    return statistics.median(r / number for r in runs)


def measure(impl: str, repeat: int) -> dict[str, float]:
    """Seconds per call for every case, keyed by case name."""
    short_hash = load_hash(impl)
    results: dict[str, float] = {}
    signature = attention_signature()
    results["attention signature"] = seconds_per_call(lambda: short_hash(signature), repeat)
    for n in LIST_SIZES:
        values = list(range(n))
        results[f"list of {n:,} ints"] = seconds_per_call(lambda: short_hash(values), max(3, repeat // 2))
    return results


def reference_results(ref_python: str, repeat: int) -> dict[str, float] | None:
    if not os.path.exists(ref_python):
        return None
    command = [ref_python, os.path.abspath(__file__), "--worker", "reference", "--repeat", str(repeat)]
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    done = subprocess.run(command, capture_output=True, text=True, env=env, check=False)
    if done.returncode != 0:
        print(done.stderr, file=sys.stderr)
        return None
    return json.loads(done.stdout.strip().splitlines()[-1])


def cpu_model() -> str:
    try:
        for line in subprocess.run(["lscpu"], capture_output=True, text=True, check=False).stdout.splitlines():
            if line.startswith("Model name:"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def elements(case: str) -> int:
    """How many elements a case hashes (0 for the call signature)."""
    return int(case.split()[2].replace(",", "")) if case.startswith("list") else 0


def rows(ours: dict[str, float], ref: dict[str, float] | None) -> list[dict[str, Any]]:
    """One row per case: microseconds per call and nanoseconds per element of each side."""
    out = []
    for case, t in ours.items():
        n = elements(case)
        r = ref.get(case) if ref is not None else None
        out.append({
            "case": case,
            "elements": n or None,
            "ejlabel_us_per_call": t * 1e6,
            "ejlabel_ns_per_element": t / n * 1e9 if n else None,
            "reference_us_per_call": r * 1e6 if r is not None else None,
            "reference_ns_per_element": r / n * 1e9 if r is not None and n else None,
            "speedup": r / t if r is not None else None,
        })
    return out


def table(ours: dict[str, float], ref: dict[str, float] | None) -> str:
    rows = [
        "| case | ejlabel µs/call | ejlabel ns/element | reference µs/call | reference ns/element | speed-up |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for case, t in ours.items():
        n = elements(case)
        per_element = f"{t / n * 1e9:.1f}" if n else ""
        if ref is not None and case in ref:
            r = ref[case]
            ref_cells = f"{r * 1e6:,.1f} | {r / n * 1e9:.1f}" if n else f"{r * 1e6:,.1f} | "
            ratio = f"{r / t:.1f}x"
        else:
            ref_cells, ratio = "n/a | ", ""
        rows.append(f"| {case} | {t * 1e6:,.1f} | {per_element} | {ref_cells} | {ratio} |")
    return "\n".join(rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ref-python", default=DEFAULT_REF_PYTHON)
    parser.add_argument("--repeat", type=int, default=9)
    parser.add_argument("--worker", choices=("ejlabel", "reference"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        print(json.dumps(measure(args.worker, args.repeat)))
        return

    import jax

    ours = measure("ejlabel", args.repeat)
    ref = reference_results(args.ref_python, args.repeat)
    print(f"machine: {cpu_model()}, {os.cpu_count()} cores")
    print(f"python {platform.python_version()}, jax {jax.__version__}")
    if ref is None:
        print("reference not available")
    print(table(ours, ref))
    write_results(
        "bench_fingerprint", rows(ours, ref),
        notes=f"short_hash, median of {args.repeat} runs of about 0.1 s (lists: {max(3, args.repeat // 2)}); reference: the older "
        f"package's short_hash in {args.ref_python}; speedup = reference time / ejlabel time; CPU model: {cpu_model()}; "
        f"load average {os.getloadavg()[0]:.2f}",
    )


if __name__ == "__main__":
    main()
