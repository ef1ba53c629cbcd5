"""Where an attention call's device time goes: every kernel it launches, from a profiler trace.

    python bench/probe_kernel_times.py [--model | --model-only | --loss] [--out FILE.md]

Each case (one jitted call: ours on Mosaic GPU or cuDNN, forward or forward+backward) is traced
alone with ``jax.profiler`` after warm-up: ``--calls`` calls, each followed by a synchronisation
and a pause, so the device events of one call form one burst. For every burst the probe reads
the GPU kernels' names, start times and durations from the trace's Perfetto JSON, and reports
per case: the kernels of one call (median duration over the calls), the sum of their
durations, the span from the first kernel's start to the last one's end, and what lies in
between (launch gaps). That splits a call's time into the attention kernels themselves and the
work around them (visiting plans, the tiles' order, padding, casts), which medians of whole
calls cannot. ``--model`` adds the packed example model's training step with the Mosaic
attention at every site (its loss on the heuristic path), kernels grouped by name: whether the
work around the kernels is paid once per step or once per layer. ``--loss`` traces the
linear cross-entropy instead (bench/bench_linear_cross_entropy.py's problem), plain and ours.
"""

from __future__ import annotations

import argparse
import gzip
import json
import pathlib
import re
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from bench_attention import both_passes, equal_documents, input_sets, kernel_attend

from ejlabel.kernels.attention import AttentionConfig

_PAUSE_S = 0.02  # between calls: a gap far longer than any launch gap inside one call
_MAX_TRACE_BYTES = 512 << 20


def device_kernels(trace_file: pathlib.Path) -> list[tuple[float, float, str]]:
    """``(start us, duration us, name)`` of every complete event on a GPU device's timelines."""
    with gzip.open(trace_file, "rb") as f:
        data = f.read(_MAX_TRACE_BYTES + 1)
    if len(data) > _MAX_TRACE_BYTES:
        raise ValueError(f"trace_file: expected at most {_MAX_TRACE_BYTES} bytes, {trace_file} is larger")
    events = json.loads(data)["traceEvents"]

    def named(kind: str) -> dict[Any, str]:
        return {(e["pid"], e.get("tid")): str(e.get("args", {}).get("name", "")) for e in events if e.get("ph") == "M" and e.get("name") == kind}

    gpu_pids = {pid for (pid, _), name in named("process_name").items() if "GPU" in name}
    # A device's timelines include derived ones ("XLA Ops", "XLA Modules") that repeat the
    # kernels: only the streams' own timelines are read.
    streams = {key for key, name in named("thread_name").items() if key[0] in gpu_pids and name.startswith("Stream")}
    if not streams:
        raise ValueError(f"trace_file: expected a GPU stream's timeline in {trace_file}, found {sorted(set(named('thread_name').values()))[:20]}")
    return sorted(
        (float(e["ts"]), float(e.get("dur", 0.0)), str(e.get("name", "")))
        for e in events
        if e.get("ph") == "X" and (e.get("pid"), e.get("tid")) in streams
    )


def bursts(kernels: list[tuple[float, float, str]], gap_us: float) -> list[list[tuple[float, float, str]]]:
    """The kernels split wherever the device sat idle for more than ``gap_us``."""
    groups: list[list[tuple[float, float, str]]] = []
    end = -float("inf")
    for k in kernels:
        if k[0] - end > gap_us:
            groups.append([])
        groups[-1].append(k)
        end = max(end, k[0] + k[1])
    return groups


def trace_case(fn: Callable[[], Any], calls: int) -> list[list[tuple[float, float, str]]]:
    """The device kernels of ``calls`` calls of ``fn`` (after two untraced ones), one list per call."""
    for _ in range(2):
        jax.block_until_ready(fn())
    with tempfile.TemporaryDirectory() as log_dir:
        with jax.profiler.trace(log_dir, create_perfetto_trace=True):
            for _ in range(calls):
                jax.block_until_ready(fn())
                time.sleep(_PAUSE_S)
        (trace_file,) = pathlib.Path(log_dir).rglob("perfetto_trace.json.gz")
        return bursts(device_kernels(trace_file), gap_us=_PAUSE_S * 1e6 / 2)


def report(name: str, groups: list[list[tuple[float, float, str]]]) -> list[str]:
    """The kernels of one call (the bursts' medians) as markdown lines."""
    sizes = [len(g) for g in groups]
    common = statistics.mode(sizes)
    same = [g for g in groups if len(g) == common]
    lines = [f"### {name}", f"{len(groups)} calls traced, {common} kernels per call (counts seen: {sorted(set(sizes))})", "",
             "| # | kernel | median us |", "|---:|---|---:|"]
    for i in range(common):
        lines.append(f"| {i} | `{same[0][i][2][:90]}` | {statistics.median(g[i][1] for g in same):.1f} |")
    busy = statistics.median(sum(k[1] for k in g) for g in same)
    span = statistics.median(max(k[0] + k[1] for k in g) - g[0][0] for g in same)
    lines += ["", f"kernels {busy:.1f} us, first start to last end {span:.1f} us, idle between them {span - busy:.1f} us", ""]
    return lines


def report_grouped(name: str, groups: list[list[tuple[float, float, str]]], top: int) -> list[str]:
    """A long program's kernels grouped by name (numbered fusions folded together): count and
    time per call, the costliest ``top`` groups."""
    totals: dict[str, list[float]] = {}
    for g in groups:
        for _, dur, kernel in g:
            totals.setdefault(re.sub(r"(_\d+)+$", "", kernel)[:90], []).append(dur)
    calls = len(groups)
    rows = sorted(totals.items(), key=lambda kv: -sum(kv[1]))
    lines = [f"### {name}", f"{calls} calls traced, {sum(len(g) for g in groups) / calls:.0f} kernels per call", "",
             "| kernel (numbering folded) | per call | us per call |", "|---|---:|---:|"]
    lines += [f"| `{kernel}` | {len(durs) / calls:.1f} | {sum(durs) / calls:.1f} |" for kernel, durs in rows[:top]]
    busy = sum(sum(k[1] for k in g) for g in groups) / calls
    lines += ["", f"kernels {busy:.1f} us per call in all", ""]
    return lines


def packed_model_step() -> Callable[[], Any]:
    """The example model's packed training step, attention on the Mosaic kernels at every site."""
    import ejlabel
    from ejlabel import examples

    cfg = examples.GPU_125M_PACKED
    params = examples.init_params(cfg, jax.random.key(0))
    batch = examples.example_batch(cfg, jax.random.key(1))
    with ejlabel.use_implementation("mosaic"):
        step = jax.jit(examples.make_train_step(cfg, examples.KERNEL_OPS)).lower(params, batch).compile()
    return lambda: step(params, batch)


def loss_cases() -> dict[str, Callable[[], Any]]:
    """value_and_grad of the plain loss and of ours on token chunks (XLA passes over each chunk's
    logits, or the rows kernel), [16384, 768] x [768, 32000]."""
    from bench_linear_cross_entropy import our_loss, plain_loss, problem

    from ejlabel.kernels.linear_cross_entropy import LinearCrossEntropyConfig

    hidden, weight, labels = problem(16384, 768, 32000)
    variants = {"loss, plain JAX (matmul + logsumexp)": plain_loss(labels)}
    for chunk in (2048, 4096):
        variants[f"loss, ours, token chunks {chunk}"] = our_loss(labels, LinearCrossEntropyConfig("chunked_tokens", chunk_tokens=chunk))
        variants[f"loss, ours, token chunks {chunk}, rows kernel"] = our_loss(labels, LinearCrossEntropyConfig("chunked_tokens_triton", chunk_tokens=chunk))
    out = {}
    for name, fn in variants.items():
        step = jax.jit(jax.value_and_grad(fn, argnums=(0, 1)))
        out[name] = lambda step=step: step(hidden, weight)
    return out


def cases() -> dict[str, Callable[[], Any]]:
    out: dict[str, Callable[[], Any]] = {}
    mosaic, cudnn = AttentionConfig("mosaic"), AttentionConfig("cudnn")
    q, k, v, _ = input_sets(4, 4096, 16, 16, 128, count=1)[0]
    segments = equal_documents(4, 4096, 4)
    for label, attend in [
        ("causal B4 S4096 H16 D128, mosaic", kernel_attend(mosaic, causal=True)),
        ("causal B4 S4096 H16 D128, cudnn", kernel_attend(cudnn, causal=True)),
        ("4 segments B4 S4096 H16 D128, mosaic", kernel_attend(mosaic, causal=True, segment_ids=segments)),
    ]:
        forward, both = both_passes(attend)
        out[f"{label}, fwd"] = lambda f=forward: f(q, k, v, _)
        out[f"{label}, fwd+bwd"] = lambda f=both: f(q, k, v, _)
    # The same documents as rows of their own: the segment forward's kernel against this one's
    # says what packing costs inside the kernel, the kernels before it what it costs outside.
    rq, rk, rv, rp = input_sets(16, 1024, 16, 16, 128, count=1)[0]
    forward, both = both_passes(kernel_attend(mosaic, causal=True))
    out["causal B16 S1024 H16 D128 (the documents as rows), mosaic, fwd"] = lambda f=forward: f(rq, rk, rv, rp)
    out["causal B16 S1024 H16 D128 (the documents as rows), mosaic, fwd+bwd"] = lambda f=both: f(rq, rk, rv, rp)
    pq, pk, pv, pp = input_sets(8, 2048, 12, 4, 64, count=1)[0]
    packed = equal_documents(8, 2048, 4)
    forward, both = both_passes(kernel_attend(mosaic, causal=True, segment_ids=packed))
    out["packed B8 S2048 H12/4 D64 x4, mosaic, fwd"] = lambda: forward(pq, pk, pv, pp)
    out["packed B8 S2048 H12/4 D64 x4, mosaic, fwd+bwd"] = lambda: both(pq, pk, pv, pp)
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=5)
    parser.add_argument("--out", type=pathlib.Path)
    parser.add_argument("--model", action="store_true", help="also the packed example model's training step, kernels grouped by name")
    parser.add_argument("--model-only", action="store_true", help="only the model")
    parser.add_argument("--loss", action="store_true", help="only the linear cross-entropy: plain and ours on token chunks, kernels grouped")
    args = parser.parse_args()
    lines = [f"jax {jax.__version__}, {jax.devices()[0].device_kind}", ""]
    for name, fn in ([] if args.model_only or args.loss else cases().items()):
        lines += report(name, trace_case(fn, args.calls))
        print("\n".join(lines[-8:]), flush=True)
    for name, fn in (loss_cases().items() if args.loss else []):
        lines += report_grouped(name, trace_case(fn, args.calls), top=25)
        print("\n".join(lines[-33:]), flush=True)
    if args.model or args.model_only:
        lines += report_grouped("packed model, training step, Mosaic attention", trace_case(packed_model_step(), 3), top=40)
        print("\n".join(lines[-48:]), flush=True)
    if args.out:
        args.out.write_text("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
