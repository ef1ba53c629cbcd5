"""Every Pallas attention tile shape on one causal problem: forward tiles, then backward tiles.

    python bench/sweep_attention.py                       # B4 S4096 H16 D128, causal, bf16
    python bench/sweep_attention.py --batch 2 --seq 2048

The forward sweep times the forward alone; the backward sweep times forward + backward with
the default forward tiles, so its differences are the backward's. cuDNN is timed beside them as
the anchor. This is how the kernel's defaults and tuning space were chosen; timing follows
``bench_kernels.py`` (back-to-back calls, rotated inputs, medians).
"""

from __future__ import annotations

import argparse
import itertools
from collections.abc import Sequence

import jax
import jax.numpy as jnp

from ejlabel import BwdParams, FwdParams
from ejlabel.kernels.attention import AttentionConfig, flash_attention

from bench_kernels import BWD_FLOP_FACTOR, Bench, _inputs, _normal


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=4096)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--dim", type=int, default=128)
    parser.add_argument("--samples", type=int, default=5)
    parser.add_argument("--skip-fwd", action="store_true")
    args = parser.parse_args(argv)
    b, s, h, d = args.batch, args.seq, args.heads, args.dim
    bench = Bench(calls=10, samples=args.samples, quick=False, tiny=False, tune_iters=0)
    sets = _inputs(lambda key: tuple(_normal(k, (b, s, h, d)) for k in jax.random.split(key, 3)))
    flops = 4.0 * b * h * s * s * d / 2
    case = f"causal B{b} S{s} H{h} D{d}"

    def forward(cfg: AttentionConfig):
        return jax.jit(lambda q, k, v: flash_attention(q, k, v, causal=True, cfg=cfg))

    def both(cfg: AttentionConfig):
        loss = lambda q, k, v: jnp.sum(flash_attention(q, k, v, causal=True, cfg=cfg).astype(jnp.float32))
        return jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2)))

    bench.measure(case + " fwd", "cudnn", forward(AttentionConfig("cudnn")), sets, flops, "TFLOP/s")
    bench.measure(case + " fwd+bwd", "cudnn", both(AttentionConfig("cudnn")), sets, flops * (1 + BWD_FLOP_FACTOR), "TFLOP/s")
    if not args.skip_fwd:
        for bq, bk, w, st in itertools.product((64, 128), (32, 64, 128), (4, 8), (2, 3, 4)):
            bench.measure(case + " fwd", "pallas", forward(AttentionConfig("pallas", FwdParams(bq, bk, w, st))), sets, flops, "TFLOP/s", f"fwd {bq}x{bk} w{w} s{st}")
    for bq, bk, w, st in itertools.product((32, 64, 128), (32, 64, 128), (4, 8), (1, 2, 3)):
        cfg = AttentionConfig("pallas", bwd=BwdParams(bq, bk, w, st))
        bench.measure(case + " fwd+bwd", "pallas", both(cfg), sets, flops * (1 + BWD_FLOP_FACTOR), "TFLOP/s", f"bwd {bq}x{bk} w{w} s{st}")
    best = {}
    for row in bench.rows:
        if row.rate is not None and row.rate > best.get(row.case, (0.0, ""))[0]:
            best[row.case] = (row.rate, f"{row.impl} {row.note}")
    for name, (rate, what) in best.items():
        print(f"best {name}: {rate:.4g} TFLOP/s ({what})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
