"""Throughput of the kernels against XLA (and cuDNN for attention), on one GPU.

    python bench/bench_kernels.py                  # full sizes
    python bench/bench_kernels.py --quick          # smaller sizes, fewer tuning candidates
    python bench/bench_kernels.py --only matmul,norms

Rows report TFLOP/s for matmul and attention (attention backward counted as 2.5x the forward
FLOPs) and GB/s for norms and cross-entropy (the bytes an ideal kernel must move). "tuned" rows
use the config the autotuner picks among the Pallas candidates; "best of impls, tuned" rows
use its pick among every implementation (XLA, cuDNN, Pallas), which is what tuning a call
normally does. For kernels with their own backward the autotuner times forward and backward
together, so one pick serves both rows.

Timing: each sample is ``--calls`` back-to-back calls between two device syncs, rotating over
three input sets so an input never sits in L2 from the previous call; the row shows the median
over ``--samples`` samples, after warm-up calls. A failing case prints ``FAILED: reason`` in
its row and the script goes on.

Each family's rows go to ``bench/results/bench_kernels.<family>.json`` (``bench/_results.py``;
``--quick`` and ``--tiny`` runs to ``bench_kernels.<family>.quick.json`` / ``.tiny.json``, so a
smoke run never replaces the full-size figures).
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import sys
import time
import traceback
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
from _results import write_results

import ejlabel
from ejlabel.kernels.attention import AttentionConfig, AttentionKernel, flash_attention
from ejlabel.kernels.attention.mosaic import on_hopper
from ejlabel.kernels.cross_entropy import CrossEntropyConfig, CrossEntropyKernel, softmax_cross_entropy
from ejlabel.kernels.matmul import MatmulConfig, MatmulKernel, matmul
from ejlabel.kernels.norms import LayerNormKernel, NormConfig, RMSNormKernel, layer_norm, rms_norm

from bench_attention import equal_documents

FAMILIES = ("matmul", "attention", "norms", "cross_entropy")
BWD_FLOP_FACTOR = 2.5


@dataclasses.dataclass
class Row:
    case: str
    impl: str
    ms: float | None = None
    rate: float | None = None
    unit: str = ""
    note: str = ""

    def cells(self) -> list[str]:
        if self.ms is None:
            return [self.case, self.impl, "-", "-", self.note]
        return [self.case, self.impl, f"{self.ms:.3f}", f"{self.rate:.4g} {self.unit}", self.note]


HEADER = ["case", "impl", "ms", "throughput", "note"]


@dataclasses.dataclass
class Bench:
    calls: int
    samples: int
    quick: bool
    tiny: bool
    tune_iters: int
    rows: list[Row] = dataclasses.field(default_factory=list)

    def time(self, fn: Callable[..., Any], input_sets: Sequence[tuple[Any, ...]]) -> float:
        """Median milliseconds per call; see the module docstring."""
        for inputs in input_sets:  # compile and warm up
            jax.block_until_ready(fn(*inputs))
        per_call = []
        for _ in range(self.samples):
            start = time.perf_counter()
            outs = [fn(*input_sets[i % len(input_sets)]) for i in range(self.calls)]
            jax.block_until_ready(outs)
            per_call.append((time.perf_counter() - start) * 1e3 / self.calls)
            del outs
        return statistics.median(per_call)

    def measure(self, case: str, impl: str, fn: Callable[..., Any], input_sets: Sequence[tuple[Any, ...]], work: float, unit: str, note: str = "") -> Row:
        """Time ``fn`` and add a row; ``work`` is FLOPs (TFLOP/s) or bytes (GB/s)."""
        row = Row(case, impl, unit=unit, note=note)
        try:
            row.ms = self.time(fn, input_sets)
            row.rate = work / (row.ms * 1e-3) / (1e12 if unit == "TFLOP/s" else 1e9)
        except Exception as err:  # one failing case must not end the run
            row.ms, row.note = None, f"FAILED: {_reason(err)}"
        self.rows.append(row)
        print(" | ".join(row.cells()), flush=True)
        return row

    def fail(self, case: str, impl: str, err: BaseException) -> None:
        row = Row(case, impl, note=f"FAILED: {_reason(err)}")
        self.rows.append(row)
        print(" | ".join(row.cells()), flush=True)

    def policy(self, *, early_stop: bool = True) -> ejlabel.AutotunePolicy:
        return ejlabel.AutotunePolicy(num_warmup=2, num_iters=self.tune_iters, early_stop=early_stop, compile_workers=8)

    def tune_impl(
        self, kernel: ejlabel.Kernel, args: tuple[Any, ...], kwargs: dict[str, Any], *, early_stop: bool = True, every_impl: bool = False, impl: str = "pallas",
    ) -> Any:
        """The tuner's pick among the kernel's valid candidates of ``impl`` (or all of them)."""
        inv = ejlabel.Invocation(kernel, args, kwargs)
        candidates = [c for c in kernel.config_space(inv) if every_impl or c.impl == impl]
        if self.quick or self.tiny:
            candidates = candidates[:: max(1, len(candidates) // 8)]
        if every_impl:  # thinning above must not drop the vendor paths
            candidates += [c for c in kernel.config_space(inv) if c.impl in ("xla", "cudnn") and c not in candidates]
        return ejlabel.Autotuner(self.policy(early_stop=early_stop), progress=False).tune(inv, candidates)


def _reason(err: BaseException) -> str:
    text = f"{type(err).__name__}: {err}".strip().splitlines()
    return (text[0] if text else type(err).__name__)[:160]


def _inputs(make: Callable[[jax.Array], tuple[Any, ...]], count: int = 3) -> list[tuple[Any, ...]]:
    return [make(jax.random.key(seed)) for seed in range(count)]


def _normal(key: jax.Array, shape: tuple[int, ...], dtype: Any = jnp.bfloat16) -> jax.Array:
    return jax.random.normal(key, shape, jnp.float32).astype(dtype)


def impl_heuristic(kernel: ejlabel.Kernel, args: tuple[Any, ...], kwargs: dict[str, Any], impl: str = "pallas") -> Any:
    """The kernel's heuristic config, or its first candidate of ``impl``."""
    inv = ejlabel.Invocation(kernel, args, kwargs)
    cfg = kernel.heuristic_cfg(inv)
    if cfg.impl != impl:
        cfg = next(c for c in kernel.config_space(inv) if c.impl == impl)
    return cfg


# --------------------------------------------------------------------------------------------
# Matmul


def bench_matmul(b: Bench) -> None:
    sizes = (64, 128) if b.tiny else ((1024, 2048) if b.quick else (4096, 8192))
    kernel = MatmulKernel()
    for n in sizes:
        case = f"matmul {n}^3 bf16"
        sets = _inputs(lambda key: tuple(_normal(k, (n, n)) for k in jax.random.split(key)))
        flops = 2.0 * n**3
        run = lambda cfg: jax.jit(lambda a, c: matmul(a, c, cfg=cfg))
        b.measure(case, "xla", run(MatmulConfig("xla")), sets, flops, "TFLOP/s")
        heuristic = impl_heuristic(kernel, sets[0], {})
        b.measure(case, "pallas heuristic", run(heuristic), sets, flops, "TFLOP/s", _describe(heuristic))
        try:
            tuned = b.tune_impl(kernel, sets[0], {})
        except Exception as err:
            b.fail(case, "pallas tuned", err)
            continue
        picked = b.measure(case, "pallas tuned", run(tuned.best_cfg), sets, flops, "TFLOP/s", _describe(tuned.best_cfg))
        best_of: list[tuple[str, Any]] = []
        with_best_of_impls(b, case, best_of, kernel, sets[0], {})
        for impl, cfg in best_of:
            b.measure(case, impl, run(cfg), sets, flops, "TFLOP/s", _describe(cfg))
        if n == sizes[0]:
            _check_tuner_pick(b, kernel, sets, tuned.best_cfg, picked, flops, case, run)


def _check_tuner_pick(b: Bench, kernel: MatmulKernel, sets: list[tuple[Any, ...]], pick: Any, picked: Row, flops: float, case: str, run: Callable[[Any], Any]) -> None:
    """Time every candidate fully (no early stopping) and compare its best with the pick."""
    try:
        exhaustive = b.tune_impl(kernel, sets[0], {}, early_stop=False)
    except Exception as err:
        b.fail(case, "pallas exhaustive best", err)
        return
    best = b.measure(case, "pallas exhaustive best", run(exhaustive.best_cfg), sets, flops, "TFLOP/s", _describe(exhaustive.best_cfg))
    if exhaustive.best_cfg == pick:
        print(f"tuner pick {_describe(pick)} is the exhaustive best")
        picked.note += "; same config as the exhaustive best"
    elif picked.ms is not None and best.ms is not None:
        gap = picked.ms / best.ms - 1.0
        verdict = "within 3%" if gap <= 0.03 else "MORE than 3% slower"
        print(f"tuner pick {_describe(pick)}: {gap * 100:+.1f}% vs exhaustive best {_describe(exhaustive.best_cfg)} ({verdict})")
        picked.note += f"; {gap * 100:+.1f}% vs exhaustive ({verdict})"


def with_best_of_impls(b: Bench, case: str, configs: list[tuple[str, Any]], kernel: ejlabel.Kernel, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
    """Append the tuner's pick over every implementation the kernel offers (the normal tuning)."""
    try:
        configs.append(("best of impls, tuned", b.tune_impl(kernel, args, kwargs, every_impl=True).best_cfg))
    except Exception as err:
        b.fail(case, "best of impls, tuned", err)


def _describe(cfg: Any) -> str:
    """A config's tuning fields on one short line (launch params as ``q x kv w<warps> s<stages>``)."""
    if cfg.impl != "pallas":
        return f"impl={cfg.impl}"
    parts = []
    for field in dataclasses.fields(cfg):
        value = getattr(cfg, field.name)
        if field.name == "impl" or value is None:
            continue
        if isinstance(value, (ejlabel.FwdParams, ejlabel.BwdParams)):
            value = f"{value.q_blocksize}x{value.kv_blocksize} w{value.num_warps} s{value.num_stages}"
        parts.append(f"{field.name}={value}")
    return ", ".join(parts)


# --------------------------------------------------------------------------------------------
# Attention


def bench_attention(b: Bench) -> None:
    if b.tiny:
        batch, seq, heads, dim = 1, 128, 2, 32
    elif b.quick:
        batch, seq, heads, dim = 2, 2048, 16, 128
    else:
        batch, seq, heads, dim = 4, 4096, 16, 128
    kernel = AttentionKernel()
    ours = "mosaic" if on_hopper() else "pallas"  # on Hopper the tuning space has no Triton tiles
    causal_flops = 4.0 * batch * heads * seq * seq * dim / 2
    segments = equal_documents(batch, seq, 4)
    # Varlen: the same tokens as one packed row of `batch` sequences of unequal lengths.
    lengths = [seq // 2, seq + seq // 2, seq // 4, seq + seq // 4][:batch] if batch == 4 else [seq * batch // 2] * 2
    cu_seqlens = jnp.cumsum(jnp.array([0, *lengths], jnp.int32))
    varlen_flops = sum(4.0 * heads * n * n * dim / 2 for n in lengths)
    cases = [
        ("causal", heads, batch, {"causal": True}, causal_flops),
        (f"causal gqa kv={max(1, heads // 4)}", max(1, heads // 4), batch, {"causal": True}, causal_flops),
        # Four equal segments: a quarter of the causal work is visible.
        ("causal segments x4", heads, batch, {"causal": True, "segment_ids": segments}, causal_flops / 4),
        ("causal varlen", heads, 1, {"causal": True, "cu_seqlens": cu_seqlens}, varlen_flops),
    ]
    for name, kv_heads, rows, kwargs, flops in cases:
        total = seq * batch // rows
        case = f"attention {name} B{rows} S{total} H{heads} D{dim} bf16"

        def make(key: jax.Array) -> tuple[jax.Array, ...]:
            kq, kk, kv = jax.random.split(key, 3)
            return _normal(kq, (rows, total, heads, dim)), _normal(kk, (rows, total, kv_heads, dim)), _normal(kv, (rows, total, kv_heads, dim))

        sets = _inputs(make)
        impls: list[tuple[str, Any]] = [("xla", AttentionConfig("xla"))]
        if set(kwargs) == {"causal"}:
            impls.append(("cudnn", AttentionConfig("cudnn")))
        try:
            impls.append((f"{ours} heuristic", impl_heuristic(kernel, sets[0], kwargs, ours)))
            tuned = b.tune_impl(kernel, sets[0], kwargs, impl=ours)
            impls.append((f"{ours} tuned", tuned.best_cfg))
        except Exception as err:
            b.fail(case, f"{ours} tuned", err)
        with_best_of_impls(b, case, impls, kernel, sets[0], kwargs)
        for impl, cfg in impls:
            note = "" if impl in ("xla", "cudnn") else _describe(cfg)
            forward = jax.jit(lambda q, k, v, cfg=cfg: flash_attention(q, k, v, cfg=cfg, **kwargs))
            # value_and_grad keeps the forward output live, so XLA cannot prune it.
            both = jax.jit(jax.value_and_grad(lambda q, k, v, cfg=cfg: jnp.sum(flash_attention(q, k, v, cfg=cfg, **kwargs).astype(jnp.float32)), argnums=(0, 1, 2)))
            b.measure(case + " fwd", impl, forward, sets, flops, "TFLOP/s", note)
            b.measure(case + " fwd+bwd", impl, both, sets, flops * (1 + BWD_FLOP_FACTOR), "TFLOP/s", note)


# --------------------------------------------------------------------------------------------
# Norms and cross-entropy


def bench_norms(b: Bench) -> None:
    rows, width = (64, 256) if b.tiny else ((4096, 4096) if b.quick else (16384, 4096))
    element_bytes = rows * width * 2
    # The bandwidth ceiling the norms are held to: one read and one write of the same bytes.
    sets = _inputs(lambda key: (_normal(key, (rows, width)),))
    b.measure(f"elementwise x*2 [{rows}, {width}] bf16", "xla", jax.jit(lambda x: x * 2), sets, 2 * element_bytes, "GB/s")
    for name, kernel, fn, params in (
        ("rms_norm", RMSNormKernel(), lambda x, w, bias, cfg: rms_norm(x, w, cfg=cfg), 1),
        ("layer_norm", LayerNormKernel(), lambda x, w, bias, cfg: layer_norm(x, w, bias, cfg=cfg), 2),
    ):
        case = f"{name} [{rows}, {width}] bf16"

        def make(key: jax.Array) -> tuple[jax.Array, ...]:
            kx, kw, kb = jax.random.split(key, 3)
            return _normal(kx, (rows, width)), 1 + 0.1 * _normal(kw, (width,)), 0.1 * _normal(kb, (width,))

        sets = _inputs(make)
        probe = _normal(jax.random.key(99), (rows, width))
        args = sets[0][: 1 + params]
        configs: list[tuple[str, Any]] = [("xla", NormConfig("xla")), ("pallas heuristic", impl_heuristic(kernel, args, {"eps": 1e-6}))]
        try:
            configs.append(("pallas tuned", b.tune_impl(kernel, args, {"eps": 1e-6 if params == 1 else 1e-5}).best_cfg))
        except Exception as err:
            b.fail(case, "pallas tuned", err)
        with_best_of_impls(b, case, configs, kernel, args, {"eps": 1e-6 if params == 1 else 1e-5})
        for impl, cfg in configs:
            note = "" if impl == "xla" else _describe(cfg)
            forward = jax.jit(lambda x, w, bias, cfg=cfg: fn(x, w, bias, cfg))
            # A random cotangent, as in a model: the gradient of a plain sum is a constant that
            # XLA can fold into the backward, which no training step allows.
            loss = lambda x, w, bias, cfg=cfg: jnp.sum(fn(x, w, bias, cfg).astype(jnp.float32) * probe)
            both = jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))
            # Forward: read x, write y. Backward: read x and dy, write dx.
            b.measure(case + " fwd", impl, forward, sets, 2 * element_bytes, "GB/s", note)
            b.measure(case + " fwd+bwd", impl, both, sets, 5 * element_bytes, "GB/s", note)


def bench_cross_entropy(b: Bench) -> None:
    tokens, vocab = (64, 1000) if b.tiny else ((2048, 32000) if b.quick else (8192, 32000))
    case = f"cross_entropy [{tokens}, {vocab}] bf16 fwd+bwd"
    kernel = CrossEntropyKernel()

    def make(key: jax.Array) -> tuple[jax.Array, ...]:
        kx, kl = jax.random.split(key)
        return _normal(kx, (tokens, vocab)), jax.random.randint(kl, (tokens,), 0, vocab)

    sets = _inputs(make)
    configs: list[tuple[str, Any]] = [
        ("xla", CrossEntropyConfig("xla")),
        ("pallas heuristic", impl_heuristic(kernel, sets[0][:1], {"labels": sets[0][1]})),
    ]
    try:
        configs.append(("pallas tuned", b.tune_impl(kernel, sets[0][:1], {"labels": sets[0][1]}).best_cfg))
    except Exception as err:
        b.fail(case, "pallas tuned", err)
    with_best_of_impls(b, case, configs, kernel, sets[0][:1], {"labels": sets[0][1]})
    for impl, cfg in configs:
        note = "" if impl == "xla" else _describe(cfg)
        both = jax.jit(jax.value_and_grad(lambda x, y, cfg=cfg: jnp.sum(softmax_cross_entropy(x, y, cfg=cfg))))
        # Read the logits forward, read them again and write their gradient backward.
        b.measure(case, impl, both, sets, 3 * tokens * vocab * 2, "GB/s", note)


BENCHES = {"matmul": bench_matmul, "attention": bench_attention, "norms": bench_norms, "cross_entropy": bench_cross_entropy}


def plain_table(rows: list[Row]) -> str:
    cells = [HEADER] + [row.cells() for row in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(HEADER))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in cells)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="smaller sizes and fewer tuning candidates")
    parser.add_argument("--tiny", action="store_true", help="toy sizes, to check the script itself off the GPU")
    parser.add_argument("--only", default=",".join(FAMILIES), help=f"comma-separated subset of {','.join(FAMILIES)}")
    parser.add_argument("--calls", type=int, default=10, help="back-to-back calls per sample")
    parser.add_argument("--samples", type=int, default=10, help="samples per row (the median is shown)")
    parser.add_argument("--tune-iters", type=int, default=10, help="timed runs per candidate when tuning")
    args = parser.parse_args(argv)

    families = [f.strip() for f in args.only.split(",") if f.strip()]
    unknown = sorted(set(families) - set(FAMILIES))
    if unknown:
        parser.error(f"--only: unknown families {unknown}; choose from {list(FAMILIES)}")
    device = f"{jax.devices()[0].device_kind} ({jax.default_backend()}), jax {jax.__version__}"
    print(f"# {device}", flush=True)
    if jax.default_backend() != "gpu" and not args.tiny:
        print("warning: no GPU; Pallas runs in the interpreter, which is very slow (use --tiny)", file=sys.stderr)

    bench = Bench(calls=args.calls, samples=args.samples, quick=args.quick, tiny=args.tiny, tune_iters=args.tune_iters)
    size = ".tiny" if args.tiny else (".quick" if args.quick else "")
    for family in families:
        print(f"\n## {family}", flush=True)
        first = len(bench.rows)
        try:
            BENCHES[family](bench)
        except Exception as err:  # a setup failure outside any single row
            traceback.print_exc()
            bench.fail(family, "-", err)
        write_results(
            f"bench_kernels.{family}{size}", [dataclasses.asdict(row) for row in bench.rows[first:]],
            notes=f"medians of {args.samples} samples of {args.calls} back-to-back calls over 3 input sets; rate in unit "
            "(TFLOP/s: attention backward counted as 2.5x the forward; GB/s: the bytes an ideal kernel moves); note: the config",
        )

    print("\n" + plain_table(bench.rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
