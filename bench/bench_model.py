"""Whole-model step times: XLA, cuDNN attention, ejlabel heuristic, ejlabel after AOT tuning.

Run on the GPU machine:  python bench/bench_model.py [--quick] [--out results.md]

For each variant of the example transformer (``ejlabel.cli.examples``) it compiles the training
step (value_and_grad + SGD) and the serving step (forward), then times them: warm-up, then
``--samples`` samples of ``--steps-per-sample`` back-to-back steps each, the median per step.
The tuned variant is produced the way users would: lower the training step, ``tune_unseen`` it
(every unseen call rebuilt from the program text and tuned in one batch, winners in the
persistent cache), lower again. Finally 20 training steps of the XLA, cuDNN-attention and
tuned models from the same weights and data, to compare losses.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp


def time_step(step: Callable[..., Any], args: tuple[Any, ...], samples: int, per_sample: int) -> float:
    """Median milliseconds per call of a compiled step, several back-to-back calls per sample."""
    jax.block_until_ready(step(*args))
    jax.block_until_ready(step(*args))
    times = []
    for _ in range(samples):
        start = time.perf_counter()
        out = None
        for _ in range(per_sample):
            out = step(*args)
        jax.block_until_ready(out)
        times.append((time.perf_counter() - start) * 1e3 / per_sample)
    return statistics.median(times)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a small model (2 layers, seq 512)")
    parser.add_argument("--samples", type=int, default=10)
    parser.add_argument("--steps-per-sample", type=int, default=3)
    parser.add_argument("--loss-steps", type=int, default=20)
    parser.add_argument("--tune-iters", type=int, default=10)
    parser.add_argument("--max-configs", type=int, default=24)
    parser.add_argument("--out", default=None, help="write the Markdown table here too")
    args = parser.parse_args()
    os.environ.setdefault("EJLABEL_CACHE_DIR", tempfile.mkdtemp(prefix="ejlabel-bench-model-"))

    import ejlabel
    from ejlabel.cli import examples
    from ejlabel.analysis import audit, tune_unseen

    cfg = examples.GPU_125M
    if args.quick:
        cfg = dataclasses.replace(cfg, n_layers=2, seq_len=512, batch=4)
    params = examples.init_params(cfg, jax.random.key(0))
    batch = examples.example_batch(cfg, jax.random.key(1))
    n_params = sum(x.size for x in jax.tree_util.tree_leaves(params))
    print(f"model: {n_params / 1e6:.1f}M parameters, {cfg}", flush=True)
    rows: list[tuple[str, float | str, float | str]] = []

    def measure(name: str, ops: examples.Ops) -> None:
        try:
            train = jax.jit(examples.make_train_step(cfg, ops))
            serve = jax.jit(examples.make_serve_step(cfg, ops))
            t_train = time_step(train, (params, batch), args.samples, args.steps_per_sample)
            t_serve = time_step(serve, (params, batch["tokens"]), args.samples, args.steps_per_sample)
            rows.append((name, t_train, t_serve))
        except Exception as err:  # one failing variant must not hide the others
            rows.append((name, f"FAILED: {type(err).__name__}: {str(err).splitlines()[0][:120]}", "-"))
        print(rows[-1], flush=True)

    measure("XLA (jax.numpy ops)", examples.XLA_OPS)
    measure("XLA + cuDNN attention", examples.CUDNN_OPS)
    ejlabel.set_default_executor(None)
    measure("ejlabel, heuristic configs", examples.KERNEL_OPS)

    selector = ejlabel.get_default_executor().selector
    lowered = jax.jit(examples.make_train_step(cfg)).lower(params, batch)
    before = audit(lowered, selector=ejlabel.ConfigSelectorChain(persistent=selector.persistent))
    policy = ejlabel.AutotunePolicy(num_warmup=2, num_iters=args.tune_iters, max_configs=args.max_configs, time_budget_s=60.0, compile_workers=12)
    start = time.perf_counter()
    report = tune_unseen(lowered, selector=ejlabel.ConfigSelectorChain(persistent=selector.persistent), policy=policy, progress=False)
    tune_s = time.perf_counter() - start
    print(report.summary(), flush=True)
    for lab, err in report.errors.items():
        print(f"  tuning error {lab}: {err[:300]}", flush=True)
    for key, result in report.results.items():
        print(f"  {key[0]:24} {key[1]}  {result.best_cfg!r}  {result.best.timing.median_ms:.4g} ms", flush=True)

    ejlabel.set_default_executor(None)
    measure("ejlabel, AOT-tuned configs", examples.KERNEL_OPS)
    after = audit(jax.jit(examples.make_train_step(cfg)).lower(params, batch), selector=ejlabel.ConfigSelectorChain(persistent=selector.persistent))

    # Losses from the same weights and data: the first step's compares the kernels' numerics
    # directly; after 20 bf16 SGD steps rounding differences have compounded, and the XLA and
    # cuDNN-attention models' own gap shows how far two correct implementations drift apart.
    first_losses, losses = {}, {}
    for name, ops in (("xla", examples.XLA_OPS), ("cudnn", examples.CUDNN_OPS), ("tuned", examples.KERNEL_OPS)):
        step = jax.jit(examples.make_train_step(cfg, ops))
        p = params
        for i in range(args.loss_steps):
            p, loss = step(p, batch)
            if i == 0:
                first_losses[name] = float(loss)
        losses[name] = float(loss)
    relative = lambda table, name: abs(table[name] - table["xla"]) / abs(table["xla"])

    device = jax.devices()[0]
    lines = [
        f"Device: {device.device_kind}; jax {jax.__version__}; {time.strftime('%Y-%m-%d')}; model {n_params / 1e6:.1f}M params, "
        f"d_model {cfg.d_model}, {cfg.n_layers} layers, {cfg.n_heads} heads ({cfg.n_kv_heads} kv), seq {cfg.seq_len}, batch {cfg.batch}, {jnp.dtype(cfg.dtype).name}",
        "",
        "| variant | train step ms | serve step ms | train vs cuDNN model |",
        "|---|---|---|---|",
    ]
    cudnn_train = rows[1][1] if isinstance(rows[1][1], float) else None
    for name, t_train, t_serve in rows:
        ratio = f"{cudnn_train / t_train:.2f}x" if cudnn_train and isinstance(t_train, float) else "-"
        fmt = lambda t: f"{t:.2f}" if isinstance(t, float) else t
        lines.append(f"| {name} | {fmt(t_train)} | {fmt(t_serve)} | {ratio} |")
    lines += [
        "",
        f"AOT tuning: {len(report.results)} distinct calls ({len(before.unseen)} unseen labels before, {len(after.unseen)} after) "
        f"in {tune_s:.1f} s; {len(report.errors)} errors.",
        f"Loss of the first step: XLA {first_losses['xla']:.5f}, cuDNN model {first_losses['cudnn']:.5f} "
        f"({relative(first_losses, 'cudnn'):.2e} from XLA), tuned {first_losses['tuned']:.5f} ({relative(first_losses, 'tuned'):.2e}).",
        f"Loss after {args.loss_steps} SGD steps on the same batch: XLA {losses['xla']:.5f}, cuDNN model {losses['cudnn']:.5f} "
        f"({relative(losses, 'cudnn'):.2e} from XLA), tuned {losses['tuned']:.5f} ({relative(losses, 'tuned'):.2e}).",
    ]
    table = "\n".join(lines)
    print("\n" + table)
    if args.out:
        with open(args.out, "w") as f:
            f.write(table + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
