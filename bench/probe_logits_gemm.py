"""Can a Mosaic GPU matrix product keep up with cuBLAS at the loss's chunk shape?

The token-chunked loss's logits product is ``[2048, 768] x [768, 32000]`` per chunk; a product
of ours that also returned each row's max (sparing the loss a pass over the logits) would first
have to be as fast as the library's. Times ``jnp.dot`` (cuBLAS) beside the Mosaic GPU matmul
that ships with JAX over a sweep of its tilings (bench/RESULTS.md, run 84: 0.934x at best, so
no such product was built).

    python bench/probe_logits_gemm.py [--tokens 2048] [--samples 7]
"""

from __future__ import annotations

import argparse
import functools
import itertools
import sys
from pathlib import Path

import jax
import jax.numpy as jnp

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from _timing import time_interleaved  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--tokens", type=int, default=2048)
    parser.add_argument("--samples", type=int, default=7)
    args = parser.parse_args()
    m, k, n = args.tokens, 768, 32000
    kh, kw = jax.random.split(jax.random.key(0))
    h = jax.random.normal(kh, (m, k), jnp.float32).astype(jnp.bfloat16)
    w = (jax.random.normal(kw, (k, n), jnp.float32) / k**0.5).astype(jnp.bfloat16)
    ref = jnp.dot(h, w)
    steps = {"cublas": jax.jit(lambda: jnp.dot(h, w))}
    from jax.experimental.pallas.ops.gpu import hopper_matmul_mgpu as hm

    for tm, tn, steps_, minor, width, wg in itertools.product(
        (128,), (128, 64), (4, 6), (hm.MatmulDimension.M, hm.MatmulDimension.N), (4, 8), (hm.MatmulDimension.M, hm.MatmulDimension.N)
    ):
        cfg = hm.TuningConfig(tile_m=tm, tile_n=tn, tile_k=64, max_concurrent_steps=steps_, grid_minor_dim=minor, grid_tile_width=width, wg_dimension=wg)
        fn = jax.jit(functools.partial(hm.matmul, config=cfg))
        try:
            out = fn(h, w, None)
            err = float(jnp.max(jnp.abs(out.astype(jnp.float32) - ref.astype(jnp.float32))))
        except Exception as e:  # noqa: BLE001 - a tiling that does not fit is skipped
            print(f"skip {cfg}: {type(e).__name__}: {str(e)[:120]}")
            continue
        steps[f"mosaic tm{tm} tn{tn} s{steps_} {minor} w{width} wg{wg} (err {err:.3g})"] = functools.partial(fn, h, w, None)
    times = time_interleaved(steps, args.samples, per_sample=20)
    flops = 2 * m * n * k
    base = times["cublas"]
    print(f"| product [{m},{k}]x[{k},{n}] | us | TFLOP/s | vs cuBLAS |\n|---|---:|---:|---:|")
    for name, ms in sorted(times.items(), key=lambda kv: kv[1]):
        print(f"| {name} | {ms * 1e3:.1f} | {flops / ms / 1e9:.0f} | {base / ms:.3f} |")


if __name__ == "__main__":
    main()
