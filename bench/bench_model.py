"""Whole-model step times against the model as a JAX user writes it, all variants in one run.

Run on the GPU machine:  python bench/bench_model.py [--packed] [--quick] [--tune-budget S] [--skip-defaults]
                         [--devices N [--fsdp]] [--train-only]

Variants of the example transformer (``ejlabel.examples``), training step (value_and_grad +
SGD) and serving step (forward):

- ``plain``: ``examples.PLAIN_OPS``, the baseline: ``a @ b`` in the input dtype, ``jax.numpy``
  RMSNorm, the unembedding matmul then a logsumexp cross-entropy, ``jax.nn.dot_product_attention``
  on cuDNN (with ``--packed``: 4 documents per row, the dense block-diagonal causal mask on cuDNN).
- ``plain, cuDNN packed layout`` (``--packed``, on a GPU): ``examples.PLAIN_CUDNN_PACKED_OPS``,
  the second baseline: the same plain model with the documents given to cuDNN as its packed
  layout (each document's length and start) instead of a dense mask. Every row then also gets
  its ratios to this baseline (``*_vs_packed_layout``): the strongest plain model is the one to
  beat.
- ``ejlabel, all XLA``: every call labelled, under ``ejlabel.use_implementation("xla")``; the
  compiled program should be the plain one (the zero-cost path).
- ``ejlabel, heuristic``: every call labelled, configs from the kernels' heuristics.
- ``ejlabel, Mosaic attention forced`` (on a GPU): attention forced onto our Mosaic GPU kernel
  (``use_implementation("mosaic")``), every other call on its heuristic path.
- ``ejlabel, fused loss``: the same with ``linear_cross_entropy`` forced onto its
  ``"chunked_tokens"`` implementation (``use_implementation``), the loss's effect alone.
- ``ejlabel, tuned in context (defaults)``: the configs ``tune_in_context(step, params, batch)``
  picked with no argument but the step and its inputs (what a user following README runs), in
  a fresh cache directory; the row records its tuning wall time, and that of a second call on
  the same step (which should rank nothing and keep the same picks). ``--skip-defaults`` leaves
  it out.
- ``ejlabel, tuned in context (hand-set)``: the configs ``tune_in_context`` picked with a policy
  set by hand (``--max-configs`` candidates per call, 12 compile threads, ``--tune-budget``
  seconds; 0 leaves it out), in a cache directory of its own. Each pick of either row is
  confirmed by timing the whole step against the all-XLA floor.

One run of either model (dense, or ``--packed``) with both tuned rows fits a 10-minute command
on an H100; ``--tune-budget 0`` keeps only the defaults row.

``--devices N`` runs every variant sharded over the first N devices (a mesh with one explicit
axis, ``data``; ``examples.place_on_mesh``): the batch's rows split, the parameters replicated
(data parallel) or, with ``--fsdp``, sharded and gathered layer by layer. The batch is the
model's whole batch, so each device runs ``batch / N`` rows; our kernels run per shard
(``Kernel.shard_rule``) and tuning in context times the whole sharded step. ``--train-only``
leaves out the serving step.

Every variant is compiled first, then timed interleaved: each round takes one sample of every
variant in turn (``--steps-per-sample`` back-to-back steps, synchronised), so clock and thermal
drift hit all variants alike; the table gives medians over ``--samples`` rounds and the ratio to
the plain model. Inputs are random, never zeros. The first training step's loss of each variant
is compared with the plain model's (same weights and data). The rows go to
``bench/results/bench_model.json`` (``bench_model.packed.json`` with ``--packed``; ``--quick``
and ``--tiny`` runs to files of their own), through ``bench/_results.py``.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import os
import sys
import tempfile
import time
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from _results import write_results
from _timing import time_interleaved


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a small model (2 layers, seq 512)")
    parser.add_argument("--tiny", action="store_true", help="the TINY model (a CPU smoke run)")
    parser.add_argument("--packed", action="store_true", help="packed documents: segment ids, several documents per row")
    parser.add_argument("--samples", type=int, default=10)
    parser.add_argument("--steps-per-sample", type=int, default=3)
    parser.add_argument("--tune-budget", type=float, default=200.0, help="seconds for the hand-set tune_in_context row; 0 skips the row")
    parser.add_argument("--max-configs", type=int, default=6, help="the hand-set row's candidates per call in the isolated ranking")
    parser.add_argument("--skip-defaults", action="store_true", help="leave out the row tuned with tune_in_context's defaults")
    parser.add_argument("--skip-second-call", action="store_true", help="do not time a second defaults call on the same step")
    parser.add_argument("--devices", type=int, default=1, help="shard every variant's batch over this many devices")
    parser.add_argument("--fsdp", action="store_true", help="with --devices: shard the parameters too, gathered layer by layer")
    parser.add_argument("--train-only", action="store_true", help="time the training step only")
    args = parser.parse_args()
    os.environ.setdefault("EJLABEL_CACHE_DIR", tempfile.mkdtemp(prefix="ejlabel-bench-model-"))

    import ejlabel
    from ejlabel import examples

    cfg = examples.GPU_125M_PACKED if args.packed else examples.GPU_125M
    if args.quick:
        cfg = dataclasses.replace(cfg, n_layers=2, seq_len=512, batch=4)
    if args.tiny:
        cfg = examples.TINY_PACKED if args.packed else examples.TINY
    params = examples.init_params(cfg, jax.random.key(0))
    batch = examples.example_batch(cfg, jax.random.key(1))
    auto_inputs = None
    if args.devices > 1:
        devices = jax.devices()[: args.devices]
        # Explicit axes (jax.make_mesh's default): shardings the kernels see while tracing. The
        # plain model also runs on a mesh of auto axes (XLA alone propagates the shardings), the
        # way older sharded JAX code is written; the faster of the two is the baseline.
        auto_mesh = jax.make_mesh((args.devices,), ("data",), devices=devices, axis_types=(jax.sharding.AxisType.Auto,))
        auto_inputs = examples.place_on_mesh(auto_mesh, params, batch, fsdp=args.fsdp)
        mesh = jax.make_mesh((args.devices,), ("data",), devices=devices)
        params, batch = examples.place_on_mesh(mesh, params, batch, fsdp=args.fsdp)
    inputs_of: dict[str, tuple[Any, Any]] = {}  # variant -> (params, batch) when not the explicit ones
    n_params = sum(x.size for x in jax.tree_util.tree_leaves(params))
    print(f"model: {n_params / 1e6:.1f}M parameters, {cfg}", flush=True)

    def serve_args(batch: dict[str, Any]) -> tuple[Any, Any]:
        return batch["tokens"], batch.get("segment_ids")

    def compiled(ops: examples.Ops, selector: Any = None, implementation: str | None = None, inputs: Any = None) -> tuple[Any, Any]:
        """AOT-compiled (train, serve) steps; selection happens while lowering, under the
        executor and implementation given."""
        ejlabel.set_default_executor(ejlabel.Executor(selector) if selector is not None else None)
        forced = ejlabel.use_implementation(implementation) if implementation else contextlib.nullcontext()
        p, b = inputs or (params, batch)
        with forced:
            train = jax.jit(examples.make_train_step(cfg, ops)).lower(p, b).compile()
            serve = None if args.train_only else jax.jit(examples.make_serve_step(cfg, ops)).lower(p, *serve_args(b)).compile()
        return train, serve

    variants: dict[str, tuple[Any, Any]] = {}
    failures: dict[str, str] = {}

    def add(name: str, build: Callable[[], tuple[Any, Any]]) -> None:
        try:
            start = time.perf_counter()
            variants[name] = build()
            print(f"compiled {name} in {time.perf_counter() - start:.1f} s", flush=True)
        except Exception as err:  # one failing variant must not hide the others
            failures[name] = f"{type(err).__name__}: {str(err).splitlines()[0][:160]}"
            print(f"FAILED {name}: {failures[name]}", flush=True)

    add("plain JAX (baseline)", lambda: compiled(examples.PLAIN_OPS))
    packed_layout = "plain JAX, cuDNN packed layout (baseline)"
    if args.packed and jax.default_backend() == "gpu":  # cuDNN's packed layout runs on the GPU only
        add(packed_layout, lambda: compiled(examples.PLAIN_CUDNN_PACKED_OPS))
    if auto_inputs is not None:
        for name, ops in [("plain JAX, auto axes", examples.PLAIN_OPS), ("plain JAX, cuDNN packed layout, auto axes", examples.PLAIN_CUDNN_PACKED_OPS)]:
            if ops is examples.PLAIN_OPS or packed_layout in variants:
                inputs_of[name] = auto_inputs
                add(name, lambda ops=ops: compiled(ops, inputs=auto_inputs))
    add("ejlabel, all XLA (use_implementation)", lambda: compiled(examples.KERNEL_OPS, ejlabel.ConfigSelectorChain(), "xla"))
    add("ejlabel, heuristic configs", lambda: compiled(examples.KERNEL_OPS, ejlabel.ConfigSelectorChain()))
    if jax.default_backend() == "gpu":
        add("ejlabel, Mosaic attention forced, the rest heuristic", lambda: compiled(examples.KERNEL_OPS, ejlabel.ConfigSelectorChain(), "mosaic"))
    # The fused loss set by hand (token chunks of 2048, the memory goal's size), every other call
    # on its heuristic (XLA) path: what the loss alone does to the whole step.
    add("ejlabel, fused loss (chunked_tokens), the rest heuristic", lambda: compiled(examples.KERNEL_OPS, ejlabel.ConfigSelectorChain(), "chunked_tokens"))

    notes: list[str] = []
    extra: dict[str, dict[str, Any]] = {}  # row fields of the tuned variants
    from ejlabel.execution.tuning import tune_in_context

    def tuned_row(name: str, tune: Callable[[], Any], persistent: Any, fields: dict[str, Any]) -> Any:
        """Run ``tune``, then compile the model with the picks ``persistent`` holds; returns the
        tuning report (None if tuning failed)."""
        start = time.perf_counter()
        try:
            report = tune()
        except Exception as err:
            failures[name] = f"{type(err).__name__}: {str(err).splitlines()[0][:160]}"
            print(f"FAILED tuning: {failures[name]}", flush=True)
            return None
        tune_s = time.perf_counter() - start
        print(report, flush=True)
        for where, why in report.errors.items():
            print(f"  tuning error {where}: {why[:400]}", flush=True)
        extra[name] = {
            "tune_s": tune_s, "tuned_vs_floor": report.speedup, "changed": [f"{c.op_id}:{c.call_key}" for c in report.changed],
            "left": [{"call": f"{c.op_id}:{c.call_key}", "share": c.share, "why": c.left} for c in report.left], **fields,
        }
        notes.append(f"{name}: tuning {tune_s:.0f} s")
        add(name, lambda: compiled(examples.KERNEL_OPS, ejlabel.ConfigSelectorChain(persistent=persistent)))
        return report

    train_step = examples.make_train_step(cfg, examples.KERNEL_OPS)
    if not args.skip_defaults:
        # What README tells a user to run: no argument besides the step and its inputs, the default
        # executor, a cache directory of its own (nothing tuned before).
        os.environ["EJLABEL_CACHE_DIR"] = tempfile.mkdtemp(prefix="ejlabel-bench-model-defaults-")
        ejlabel.set_default_executor(None)
        defaults = ejlabel.get_default_executor().selector
        name = "ejlabel, tuned in context (defaults)"
        first = tuned_row(name, lambda: tune_in_context(train_step, params, batch), defaults.persistent, {"tune_budget_s": "default"})
        if first is not None and not args.skip_second_call:
            ejlabel.set_default_executor(ejlabel.Executor(defaults))  # the same caches as the first call
            start = time.perf_counter()
            again = tune_in_context(train_step, params, batch)
            second_s = time.perf_counter() - start
            same = {c.key: c.cfg for c in first.calls} == {c.key: c.cfg for c in again.calls}
            ranked = len(again.ranked)
            extra[name] |= {"second_call_s": second_s, "second_call_same_picks": same, "second_call_ranked": ranked}
            notes.append(f"second defaults call: {second_s:.0f} s, {ranked} calls ranked, same picks: {same}")
    if args.tune_budget > 0:
        # The hand-set policy: at most --max-configs candidates per call (no per-call time budget:
        # with one, a call whose candidates are still compiling when it runs out gets no timing).
        policy = ejlabel.AutotunePolicy(num_warmup=2, num_iters=10, max_configs=args.max_configs, compile_workers=12)
        hand_dir = tempfile.mkdtemp(prefix="ejlabel-bench-model-hand-set-")
        selector = ejlabel.ConfigSelectorChain(persistent=ejlabel.PersistentCache(hand_dir), policy=policy)
        ejlabel.set_default_executor(ejlabel.Executor(selector))
        tuned_row(
            "ejlabel, tuned in context (hand-set)",
            lambda: tune_in_context(train_step, params, batch, budget_s=args.tune_budget, selector=selector, progress=False),
            selector.persistent,
            {"tune_budget_s": args.tune_budget, "max_configs": args.max_configs, "compile_workers": 12},
        )

    given = {n: inputs_of.get(n, (params, batch)) for n in variants}
    train_ms = time_interleaved({n: (lambda s=v[0], a=given[n]: s(*a)) for n, v in variants.items()}, args.samples, args.steps_per_sample)
    serve_ms = (
        dict.fromkeys(variants) if args.train_only
        else time_interleaved({n: (lambda s=v[1], a=given[n]: s(a[0], *serve_args(a[1]))) for n, v in variants.items()}, args.samples, args.steps_per_sample)
    )
    first_loss = {n: float(v[0](*given[n])[1]) for n, v in variants.items()}
    # Sharded, the baselines are the faster of each plain model on explicit and on auto axes.
    for name, auto in [("plain JAX (baseline)", "plain JAX, auto axes"), (packed_layout, "plain JAX, cuDNN packed layout, auto axes")]:
        if auto not in train_ms:
            continue
        if name not in train_ms:  # failed on explicit axes: the auto-axes model is the baseline
            variants[name], train_ms[name], serve_ms[name], first_loss[name] = variants[auto], train_ms[auto], serve_ms[auto], first_loss[auto]
            notes.append(f"{name}: auto axes only (explicit axes failed)")
        elif train_ms[auto] < train_ms[name]:
            notes.append(f"{name}: the auto-axes timing ({train_ms[auto]:.2f} ms against {train_ms[name]:.2f} ms on explicit axes)")
            train_ms[name] = train_ms[auto]
            if serve_ms[name] is not None:
                serve_ms[name] = min(serve_ms[name], serve_ms[auto])
    tune_note = "; ".join(notes) if notes else "tune_in_context skipped"

    plain = "plain JAX (baseline)"
    device = jax.devices()[0]
    placement = "" if args.devices == 1 else f"sharded over {args.devices} devices ({'FSDP' if args.fsdp else 'data parallel'}), "
    model = (
        f"model {n_params / 1e6:.1f}M params, d_model {cfg.d_model}, {cfg.n_layers} layers, {cfg.n_heads} heads ({cfg.n_kv_heads} kv), "
        f"seq {cfg.seq_len}, batch {cfg.batch}, {placement}{cfg.documents} document(s) per row, {jnp.dtype(cfg.dtype).name}; "
        f"medians of {args.samples} interleaved samples of {args.steps_per_sample} steps"
    )
    lines = [
        f"Device: {device.device_kind}; jax {jax.__version__}; {time.strftime('%Y-%m-%d')}; {model}",
        "",
        "| variant | train step ms | vs plain | serve step ms | vs plain | first-step loss (rel. to plain) |",
        "|---|---:|---:|---:|---:|---|",
    ]
    # With both plain baselines, two more columns: the ratios to the packed-layout one.
    has_layout = packed_layout in variants
    if has_layout:
        lines[-2:] = [lines[-2] + " train vs packed layout | serve vs packed layout |", lines[-1] + "---:|---:|"]
    rows: list[dict[str, Any]] = []
    has_plain = plain in variants  # without the baseline (it failed to compile) there are no ratios
    shown = lambda x, spec: "-" if x is None else format(x, spec)
    for name in variants:
        row = {
            "variant": name,
            "train_ms": train_ms[name], "train_vs_plain": train_ms[plain] / train_ms[name] if has_plain else None,
            "serve_ms": serve_ms[name], "serve_vs_plain": serve_ms[plain] / serve_ms[name] if has_plain and serve_ms[name] else None,
            "first_loss": first_loss[name],
            "first_loss_rel_to_plain": abs(first_loss[name] - first_loss[plain]) / abs(first_loss[plain]) if has_plain else None,
        }
        if has_layout:
            row |= {
                "train_vs_packed_layout": train_ms[packed_layout] / train_ms[name],
                "serve_vs_packed_layout": serve_ms[packed_layout] / serve_ms[name] if serve_ms[name] else None,
            }
        row |= extra.get(name, {})
        rows.append(row)
        lines.append(
            f"| {name} | {row['train_ms']:.2f} | {shown(row['train_vs_plain'], '.3f')}x | {shown(row['serve_ms'], '.2f')} | "
            f"{shown(row['serve_vs_plain'], '.3f')}x | {first_loss[name]:.5f} ({shown(row['first_loss_rel_to_plain'], '.1e')}) |"
        )
        if has_layout:
            lines[-1] += f" {row['train_vs_packed_layout']:.3f}x | {shown(row['serve_vs_packed_layout'], '.3f')}x |"
    for name, why in failures.items():
        rows.append({"variant": name, "failed": why})
        lines.append(f"| {name} | FAILED: {why} | | | | |")
    lines += ["", tune_note + "."]
    print("\n" + "\n".join(lines))
    size = ".tiny" if args.tiny else (".quick" if args.quick else "")
    size += "" if args.devices == 1 else f".{args.devices}dev" + (".fsdp" if args.fsdp else "")
    ratios = "vs_plain: plain time / this time" + ("; vs_packed_layout: the packed-layout plain time / this time" if has_layout else "")
    write_results(f"bench_model{'.packed' if args.packed else ''}{size}", rows, notes=f"{model}; {tune_note}; {ratios}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
