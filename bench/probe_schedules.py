"""Side-by-side H100 timing of the Mosaic attention kernels under schedule and register settings.

    MOSAIC_GPU_DUMP_PTXAS=1 python bench/probe_schedules.py

Each variant sets constants of the Mosaic attention's modules while its program is traced
(the kernels' own trace caches are cleared first, so every variant lowers its own kernels) and
is timed interleaved with the others and cuDNN in one process: causal B4 S4096 H16 D128 bf16,
its 4 documents per row as rows of their own (B16 S1024), the same with 4 documents per row,
and the packed model's shape (B8 S2048 H12/4 D64, 4 documents; cuDNN with the dense mask). With ``MOSAIC_GPU_DUMP_PTXAS=1`` the assembler's spill
lines follow each ``=== variant`` marker.

Runs 47-48 (bench/RESULTS.md) compared the backward's step orders this way, run 52 two forward
softmax variants (``bench/runs/2026-11-25_run52_forward_variants.diff``), each through switches
the kernels no longer have (the chosen orders are the code; the forward variants were not
kept), run 115 whether the blocks masked by positions alone get a walk loop of their own
(``POSITIONS_APART_MAX_DIM``), run 130 which two loops the walk has above head dim 64 with
segment ids (``bench/runs/2026-11-26_run130_unmasked_run_with_positions.diff``). The variants
here: whether the dq kernel's softmax runs beside dP above head dim 128 too
(``SOFTMAX_BESIDE_DP_MAX_DIM``, run 142). ``--dim256`` times the variants at head dim 256
instead of the shapes above; run 141 compared there, through a switch the kernels no longer
have, the order in which the producer refills the streams, run 119 (without ``--dim256``) the
items' order in L2 sections (``L2_SECTION_BYTES``).
"""

from __future__ import annotations

import inspect
import sys
from typing import Any

import jax
import jax.numpy as jnp
from bench_attention import dense_mask, equal_documents
from quick_mosaic import inputs, report
from ejlabel.kernels import _mosaic_backward, _mosaic_forward, _mosaic_kernel, _mosaic_plan, _mosaic_work
from ejlabel.kernels import attention_mosaic as am

VARIANTS: dict[str, dict[str, Any]] = {
    "default": {},
    # The dq kernel's softmax beside dP at every head dim, as before run 142.
    "softmax beside dP": {"SOFTMAX_BESIDE_DP_MAX_DIM": 256},
    "default again": {},  # the spread of one variant timed twice
    "softmax beside dP again": {"SOFTMAX_BESIDE_DP_MAX_DIM": 256},
}


def _clear_kernel_traces() -> None:
    for entry in (am.mosaic_forward, am.mosaic_backward):
        inspect.getclosurevars(entry).nonlocals["jitted"].clear_cache()


_MODULES = (am, _mosaic_kernel, _mosaic_forward, _mosaic_backward, _mosaic_plan, _mosaic_work)


def under(settings: dict[str, Any], label: str, fn: Any) -> Any:
    """``fn`` traced with ``settings`` applied to the modules that define them (a marker names it on stderr)."""

    def traced(*args: Any) -> Any:
        print(f"=== variant {label}", flush=True)
        homes = {name: module for module in _MODULES for name in settings if name in vars(module)}
        missing = sorted(set(settings) - set(homes))
        if missing:
            raise AttributeError(f"settings: the Mosaic attention's modules have no {missing}")
        saved = {name: getattr(homes[name], name) for name in settings}
        _clear_kernel_traces()
        for name, value in settings.items():
            setattr(homes[name], name, value)
        try:
            return fn(*args)
        finally:
            for name, value in saved.items():
                setattr(homes[name], name, value)

    return traced


def steps(title: str, cudnn: Any, mosaic: Any, q: jax.Array, k: jax.Array, v: jax.Array, probe: jax.Array) -> dict[str, Any]:
    def loss(fn: Any) -> Any:
        return lambda q, k, v: jnp.sum(fn(q, k, v).astype(jnp.float32) * probe)

    out: dict[str, Any] = {}
    if cudnn is not None:
        out["cudnn fwd"] = jax.jit(cudnn)
        out["cudnn fwd+bwd"] = jax.jit(jax.value_and_grad(loss(cudnn), argnums=(0, 1, 2)))
    for name, settings in VARIANTS.items():
        label = f"{title}: {name}"
        out[f"{name} fwd"] = jax.jit(under(settings, label + " fwd", mosaic))
        out[f"{name} fwd+bwd"] = jax.jit(under(settings, label + " fwd+bwd", jax.value_and_grad(loss(mosaic), argnums=(0, 1, 2))))
    return {name: (lambda f=f: f(q, k, v)) for name, f in out.items()}


def head_dim_256() -> list[str]:
    """Causal B2 S4096 H8 D256, and 4 documents per row with 2 query heads per key/value head."""
    batch, seq, heads, dim = 2, 4096, 8, 256
    q, k, v, probe = inputs(batch, seq, heads, heads, dim)
    flops = 4 * batch * heads * dim * seq * seq / 2
    cudnn = lambda q, k, v: jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation="cudnn")
    causal = lambda q, k, v: am.mosaic_attention(q, k, v, causal=True)
    tables = report("causal B2 S4096 H8 D256 bf16", steps("causal", cudnn, causal, q, k, v, probe), flops, samples=15, per_sample=6)
    docs = 4
    q, k, v, probe = inputs(batch, seq, heads, heads // 2, dim)
    ids = equal_documents(batch, seq, docs)
    segments = lambda q, k, v: am.mosaic_attention(q, k, v, causal=True, segment_ids=ids)
    tables += report("4 segments B2 S4096 H8/4 D256 bf16 (visible work)", steps("segments", None, segments, q, k, v, probe), flops / docs, samples=15, per_sample=6)
    return tables


def main() -> None:
    print(f"jax {jax.__version__}, device {jax.devices()[0].device_kind}", flush=True)
    if "--dim256" in sys.argv[1:]:
        print("\n" + "\n".join(head_dim_256()))
        return
    tables = []
    batch, seq, heads, dim = 4, 4096, 16, 128
    q, k, v, probe = inputs(batch, seq, heads, heads, dim)
    flops = 4 * batch * heads * dim * seq * seq / 2
    cudnn = lambda q, k, v: jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation="cudnn")
    causal = lambda q, k, v: am.mosaic_attention(q, k, v, causal=True)
    tables += report("causal B4 S4096 H16 D128 bf16", steps("causal", cudnn, causal, q, k, v, probe), flops, samples=15, per_sample=6)

    docs = 4
    rows = inputs(batch * docs, seq // docs, heads, heads, dim)
    tables += report(
        "causal B16 S1024 H16 D128 bf16 (the documents as rows)", steps("rows", cudnn, causal, *rows), flops / docs, samples=15, per_sample=6,
    )

    ids = equal_documents(batch, seq, docs)
    segments = lambda q, k, v: am.mosaic_attention(q, k, v, causal=True, segment_ids=ids)
    tables += report("4 segments B4 S4096 H16 D128 bf16 (visible work)", steps("segments", None, segments, q, k, v, probe), flops / docs, samples=15, per_sample=6)

    batch, seq, heads, kv_heads, dim = 8, 2048, 12, 4, 64
    q, k, v, probe = inputs(batch, seq, heads, kv_heads, dim)
    ids = equal_documents(batch, seq, docs)
    dense = dense_mask(ids, causal=True)
    cudnn = lambda q, k, v: jax.nn.dot_product_attention(q, k, v, mask=dense, implementation="cudnn")
    packed = lambda q, k, v: am.mosaic_attention(q, k, v, causal=True, segment_ids=ids)
    flops = 4 * batch * heads * dim * seq * seq / 2 / docs
    tables += report("packed B8 S2048 H12/4 D64, 4 documents", steps("packed", cudnn, packed, q, k, v, probe), flops, samples=15, per_sample=12)
    print("\n" + "\n".join(tables))


if __name__ == "__main__":
    sys.exit(main())
