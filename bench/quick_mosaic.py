"""Quick H100 check of the Mosaic GPU attention against cuDNN, one process.

    python bench/quick_mosaic.py [--split-only] [--bwd-tiles 64x64,128x64]

Causal B4 S4096 H16 D128 bf16 forward and forward+backward, then packed documents at the
example model's shape (B8 S2048, 12 heads, 4 kv heads, dim 64, 4 documents per row) against
cuDNN with the dense block-diagonal causal mask. TFLOP/s of visible work (the backward counted
as 2.5 forwards); medians of interleaved samples (bench/_timing.py). The full benchmark is
bench/bench_attention.py; this one only tells where the Mosaic kernels stand.

Measured 2026-11-23 on an H100 80GB HBM3, jax 0.11.2 (first version of the kernels; the
fwd+bwd rows are ``mosaic_attention``, which keeps the forward's output and log-sum-exp;
``flash_attention(cfg=mosaic)`` reruns the forward in its backward):

| shape | variant | cuDNN ms | mosaic ms | mosaic / cuDNN speed |
|---|---|---|---|---|
| causal B4 S4096 H16 D128 | fwd | 0.614 (448 TFLOP/s) | 0.651 (422) | 0.94x |
| causal B4 S4096 H16 D128 | fwd+bwd | 2.324 (414) | 2.367 (406) | 0.98x |
| packed B8 S2048 H12/4 D64, 4 docs (cuDNN: dense mask) | fwd | 0.535 | 0.210 | 2.5x |
| packed B8 S2048 H12/4 D64, 4 docs (cuDNN: dense mask) | fwd+bwd | 1.657 | 0.463 | 3.6x |

Measured 2026-11-25, same H100 and jax, with the ``pingpong`` schedule (the forward's consumers
alternating between products and softmax; the default since), one interleaved run:

| shape | variant | cuDNN ms | mosaic ms (no pingpong) | mosaic ms (pingpong) | pingpong / cuDNN speed |
|---|---|---|---|---|---|
| causal B4 S4096 H16 D128 | fwd | 0.691 (398 TFLOP/s) | 0.676 (406) | 0.639 (430) | 1.08x |
| causal B4 S4096 H16 D128 | fwd+bwd | 2.409 (399) | 2.435 (395) | 2.373 (405) | 1.02x |
| packed B8 S2048 H12/4 D64, 4 docs (cuDNN: dense mask) | fwd | 0.594 | 0.355 | 0.330 | 1.80x |
| packed B8 S2048 H12/4 D64, 4 docs (cuDNN: dense mask) | fwd+bwd | 1.714 | 0.568 | 0.529 | 3.24x |
"""

from __future__ import annotations

import sys
import time
import traceback
from typing import Any

import jax
import jax.numpy as jnp
from _timing import time_interleaved
from bench_attention import dense_mask, equal_documents
from ejlabel import BwdParams, FwdParams
from ejlabel.kernels import attention_mosaic as am


def inputs(batch: int, seq: int, heads: int, kv_heads: int, dim: int) -> tuple[jax.Array, ...]:
    keys = jax.random.split(jax.random.key(0), 4)
    q = jax.random.normal(keys[0], (batch, seq, heads, dim), jnp.bfloat16)
    k = jax.random.normal(keys[1], (batch, seq, kv_heads, dim), jnp.bfloat16)
    v = jax.random.normal(keys[2], (batch, seq, kv_heads, dim), jnp.bfloat16)
    probe = jax.random.normal(keys[3], q.shape, jnp.bfloat16)
    return q, k, v, probe


def steps(attend: dict[str, Any], q: jax.Array, k: jax.Array, v: jax.Array, probe: jax.Array) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for name, fn in attend.items():
        fwd = jax.jit(fn)
        both = jax.jit(jax.value_and_grad(lambda q, k, v, fn=fn: jnp.sum(fn(q, k, v).astype(jnp.float32) * probe), argnums=(0, 1, 2)))
        out[f"{name} fwd"] = lambda fwd=fwd: fwd(q, k, v)
        out[f"{name} fwd+bwd"] = lambda both=both: both(q, k, v)
    return out


def report(title: str, variants: dict[str, Any], flops_fwd: float, samples: int = 9, per_sample: int = 4) -> list[str]:
    working, first_s = {}, {}
    for name, step in variants.items():
        try:
            began = time.perf_counter()
            jax.block_until_ready(step())  # the first call traces, lowers and compiles
            first_s[name] = time.perf_counter() - began
            working[name] = step
        except Exception as exc:  # noqa: BLE001 - a failing variant is reported, the rest still run
            print(f"{title} / {name}: FAILED {type(exc).__name__}: {str(exc)[:400]}", flush=True)
            traceback.print_exc(limit=3)
    times = time_interleaved(working, samples, per_sample)
    lines = [f"### {title}", "| variant | ms | TFLOP/s | first call s |", "|---|---|---|---|"]
    for name, ms in times.items():
        flops = flops_fwd * (1.0 if name.endswith(" fwd") else 3.5)
        lines.append(f"| {name} | {ms:.3f} | {flops / ms / 1e9:.0f} | {first_s[name]:.1f} |")
    print("\n".join(lines), flush=True)
    return lines


def main() -> None:
    split_only = "--split-only" in sys.argv[1:]  # the default backward alone: half the compiles
    # --bwd-tiles 64x64,128x64: the split backward at these (q block, kv block) tiles as well
    tiles = sys.argv[sys.argv.index("--bwd-tiles") + 1].split(",") if "--bwd-tiles" in sys.argv else []
    print(f"jax {jax.__version__}, device {jax.devices()[0].device_kind}, hopper={am.on_hopper()}", flush=True)
    tables = []

    def mosaic(label: str = "", **options: Any) -> dict[str, Any]:
        """Our kernels with the backward split in two (dq; dk, dv: the default) and fused."""
        split = {f"mosaic split bwd{label}": lambda q, k, v: am.mosaic_attention(q, k, v, causal=True, fused_backward=False, **options)}
        for tile in tiles:
            bq, bk = (int(x) for x in tile.split("x"))
            params = (FwdParams(), BwdParams(q_blocksize=bq, kv_blocksize=bk))
            split[f"mosaic split bwd {tile}{label}"] = lambda q, k, v, params=params: am.mosaic_attention(q, k, v, causal=True, params=params, **options)
        if split_only:
            return split
        return {**split, f"mosaic fused bwd{label}": lambda q, k, v: am.mosaic_attention(q, k, v, causal=True, fused_backward=True, **options)}

    batch, seq, heads, dim = 4, 4096, 16, 128
    q, k, v, probe = inputs(batch, seq, heads, heads, dim)
    attend = {"cudnn": lambda q, k, v: jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation="cudnn"), **mosaic()}
    tables += report("causal B4 S4096 H16 D128 bf16", steps(attend, q, k, v, probe), 4 * batch * heads * dim * seq * seq / 2)

    # The segment goal's shape: 4 documents of 1024 tokens per row, rate in visible work.
    docs = 4
    ids = equal_documents(batch, seq, docs)
    doc = seq // docs
    tables += report(
        "4 segments B4 S4096 H16 D128 bf16 (visible work)", steps(mosaic(", 4 segments", segment_ids=ids), q, k, v, probe),
        4 * batch * heads * dim * docs * doc * doc / 2,
    )

    batch, seq, heads, kv_heads, dim, docs = 8, 2048, 12, 4, 64, 4
    q, k, v, probe = inputs(batch, seq, heads, kv_heads, dim)
    ids = equal_documents(batch, seq, docs)
    dense = dense_mask(ids, causal=True)
    attend = {
        "cudnn dense mask": lambda q, k, v: jax.nn.dot_product_attention(q, k, v, mask=dense, implementation="cudnn"),
        **mosaic(" segments", segment_ids=ids),
    }
    doc = seq // docs
    tables += report("packed B8 S2048 H12/4 D64, 4 documents", steps(attend, q, k, v, probe), 4 * batch * heads * dim * docs * doc * doc / 2)
    print("\n" + "\n".join(tables))


if __name__ == "__main__":
    sys.exit(main())
