"""What ptxas says about each Mosaic GPU attention kernel: spills and warnings, on a Hopper GPU.

    python bench/ptxas_report.py [--dims 64,128,256] [--segments]

The Mosaic GPU backend assembles each kernel's PTX with ptxas while XLA compiles the program.
With ``MOSAIC_GPU_DUMP_PTXAS=1`` and ``MOSAIC_GPU_DUMP_TO=DIR`` it keeps ptxas's report of each
kernel as ``DIR/<name>_<n>.ptxas``, ``n`` counting the kernels of the process in the order they
were compiled. For each head dim this script compiles, in a process of its own (the options are
read when a kernel compiles), the forward under every schedule of
:data:`ejlabel.kernels.attention.mosaic.MOSAIC_SCHEDULES` and then the backward (the dq kernel,
then one dk/dv walk per :func:`.backward.dkv_passes`), each once, so the reports' order names
them. It prints one row per kernel: the bytes of stack frame and spill stores and loads per
thread, and ptxas's warnings by code (C7514: every wgmma of the kernel serialized).

The register count ptxas prints is the launch's share, 65536 over the program's 384 threads
(168): the consumers raise theirs with ``setmaxnreg`` (``kernel.CONSUMER_REGISTERS``), so
spills, not that count, say whether a kernel fits its registers. Causal attention at the shapes
of ``bench_attention.py`` (the example model's at head dim 64); ``--segments`` adds segment ids
(4 documents per row), whose kernels hold one more loop. A diagnostic, not a benchmark: it times
nothing and writes no results file (``gpu_session.sh`` step ``ptxas`` keeps its output).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

_SHAPES = {64: (8, 2048, 12, 4), 128: (4, 4096, 16, 16), 256: (2, 4096, 8, 8)}  # batch, seq, heads, kv heads

# Run in a process of its own: compile each forward schedule, then the backward, each once.
_COMPILE = """
import sys, jax, jax.numpy as jnp
from ejlabel import BwdParams, FwdParams
from ejlabel.kernels.attention.mosaic import MOSAIC_SCHEDULES, mosaic_backward, mosaic_forward
dim, batch, seq, heads, kv_heads, segmented = map(int, sys.argv[1:])
keys = jax.random.split(jax.random.PRNGKey(0), 4)
q = jax.random.normal(keys[0], (batch, seq, heads, dim), jnp.bfloat16)
k, v = (jax.random.normal(key, (batch, seq, kv_heads, dim), jnp.bfloat16) for key in keys[1:3])
ids = (1 + jnp.arange(seq) * 4 // seq)[None].repeat(batch, 0).astype(jnp.int32) if segmented else None
kw = dict(scale=dim ** -0.5, bounds=(None, 0))
for schedule in MOSAIC_SCHEDULES.values():
    jax.block_until_ready(mosaic_forward(q, k, v, ids, params=FwdParams(), **schedule, **kw))
lse = jax.random.normal(keys[3], (batch, heads, seq), jnp.float32)  # any values: only compiled
jax.block_until_ready(mosaic_backward(q, k, v, ids, q, lse, q, params=BwdParams(), **kw))
"""

_NUMBERED = re.compile(r"_(\d+)\.ptxas$")
_SPILLS = re.compile(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads")
_WARNING_CODE = re.compile(r"\((C\d+)\)")


@dataclasses.dataclass(frozen=True)
class KernelReport:
    """What ptxas reported on one kernel."""

    kernel: str
    stack_frame: int  # bytes per thread
    spill_stores: int
    spill_loads: int
    warnings: tuple[str, ...]  # ptxas's warning codes (C7514, ...), or its words where it gives none


def parse_report(kernel: str, text: str) -> KernelReport:
    """One kernel's report from ptxas's ``-v`` output ``text``."""
    found = _SPILLS.search(text)
    if found is None:
        raise ValueError(f"text: expected ptxas's line 'N bytes stack frame, N bytes spill stores, N bytes spill loads' for {kernel}")
    warnings = []
    for line in text.splitlines():
        if "warning" in line or "Performance Loss" in line:
            code = _WARNING_CODE.search(line)
            warnings.append(code.group(1) if code else ("spills" if "spilled" in line else line.split(":", 1)[-1].strip()))
    stack, stores, loads = map(int, found.groups())
    return KernelReport(kernel, stack, stores, loads, tuple(warnings))


def kernel_names(dim: int) -> list[str]:
    """The kernels :data:`_COMPILE` compiles, in order."""
    from ejlabel.kernels.attention.mosaic import MOSAIC_SCHEDULES
    from ejlabel.kernels.attention.mosaic.backward import dkv_passes

    walks = ["dk/dv" if set(grads) == {"dk", "dv"} else f"{'/'.join(grads)} walk" for grads in dkv_passes(dim)]
    return [f"forward {name}" for name in MOSAIC_SCHEDULES] + ["dq", *walks]


def compile_reports(dim: int, *, segmented: bool = False, timeout: float = 600.0) -> list[KernelReport]:
    """Compile the kernels at head dim ``dim`` in a process of its own and read ptxas's reports."""
    batch, seq, heads, kv_heads = _SHAPES[dim]
    with tempfile.TemporaryDirectory(prefix="ptxas-") as folder:
        env = dict(os.environ, MOSAIC_GPU_DUMP_PTXAS="1", MOSAIC_GPU_DUMP_TO=folder)
        args = [str(n) for n in (dim, batch, seq, heads, kv_heads, int(segmented))]
        subprocess.run([sys.executable, "-c", _COMPILE, *args], env=env, check=True, timeout=timeout)
        paths = sorted(Path(folder).glob("*.ptxas"), key=lambda path: int(_NUMBERED.search(path.name).group(1)))
        names = kernel_names(dim)
        if len(paths) != len(names):
            raise RuntimeError(f"expected a ptxas report for each of {names}, found {len(paths)}: {[p.name for p in paths]}")
        return [parse_report(name, path.read_text()) for name, path in zip(names, paths)]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dims", default="64,128,256", help="head dims, comma-separated (64, 128, 256)")
    parser.add_argument("--segments", action="store_true", help="also with segment ids")
    args = parser.parse_args(argv)
    dims = [int(d) for d in args.dims.split(",")]
    if not set(dims) <= set(_SHAPES):
        parser.error(f"--dims: expected some of {sorted(_SHAPES)}, got {args.dims}")
    print("| head dim | masks | kernel | stack frame | spill stores | spill loads | warnings |")
    print("|---|---|---|---:|---:|---:|---|")
    for dim in dims:
        for segmented in (False, True) if args.segments else (False,):
            for report in compile_reports(dim, segmented=segmented):
                masks = "causal, segments" if segmented else "causal"
                row = (dim, masks, report.kernel, report.stack_frame, report.spill_stores, report.spill_loads, ", ".join(report.warnings) or "-")
                print("| " + " | ".join(map(str, row)) + " |", flush=True)


if __name__ == "__main__":
    main()
