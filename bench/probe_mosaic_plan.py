"""What the Mosaic attention's work outside its kernels costs with segment ids: plans and order.

    python bench/probe_mosaic_plan.py

With segment ids each call computes, on the device and before its kernels, the visiting plans
(which key blocks each query tile walks, and the reverse for the dk/dv kernel) and the order in
which the persistent programs take their tiles (an argsort of the tiles' costs). This probe
times those computations alone, and the kernels with the order left as it comes (no sort),
against the default, at the example model's packed shape and at the segment goal's shape.
Medians of interleaved samples (bench/_timing.py).
"""

from __future__ import annotations

import sys
from typing import Any

import jax
import jax.numpy as jnp
from _timing import time_interleaved
from bench_attention import equal_documents, kernel_variant
from ejlabel.kernels import attention_mosaic as am
from ejlabel.kernels import _mosaic_plan as mplan
from ejlabel.kernels import _mosaic_work as mwork


def natural_order(plan: jax.Array, heads: int, programs: int, **_: object) -> jax.Array:
    """The items in id order: what the programs take without the sort."""
    return jnp.arange(plan.shape[1] * plan.shape[2] * heads, dtype=jnp.int32)


def case(title: str, batch: int, seq: int, heads: int, kv_heads: int, dim: int, docs: int) -> list[str]:
    keys = jax.random.split(jax.random.key(0), 4)
    q = jax.random.normal(keys[0], (batch, seq, heads, dim), jnp.bfloat16)
    k = jax.random.normal(keys[1], (batch, seq, kv_heads, dim), jnp.bfloat16)
    v = jax.random.normal(keys[2], (batch, seq, kv_heads, dim), jnp.bfloat16)
    probe = jax.random.normal(keys[3], q.shape, jnp.bfloat16)
    ids = equal_documents(batch, seq, docs)
    shape = mplan.Shape(dim**-0.5 * am._LOG2E, (None, 0), None, heads // kv_heads, True)

    def plans(ids: jax.Array) -> Any:
        rows = mplan.visit_plan(seq, seq, mplan.TILE, 128, shape, ids, batch, transpose=False)
        cols = mplan.visit_plan(seq, seq, mplan.TILE, 64, shape, ids, batch, transpose=True)
        return rows, cols

    def orders(ids: jax.Array) -> Any:
        rows, cols = plans(ids)
        programs = mwork.program_count(batch * rows.shape[2] * heads, persistent=True)
        return mwork.work_order(rows, heads, programs), mwork.work_order(cols, kv_heads, programs)

    def attend(q: jax.Array, k: jax.Array, v: jax.Array) -> jax.Array:
        return am.mosaic_attention(q, k, v, causal=True, segment_ids=ids)

    def loss(q: jax.Array, k: jax.Array, v: jax.Array) -> jax.Array:
        return jnp.sum(attend(q, k, v).astype(jnp.float32) * probe)

    steps: dict[str, Any] = {}
    plan_fn, order_fn = jax.jit(plans), jax.jit(orders)
    steps["plans only (rows + cols)"] = lambda: plan_fn(ids)
    steps["plans + orders only"] = lambda: order_fn(ids)

    def compiled() -> tuple[Any, Any]:
        """Forward and forward+backward compiled ahead of time, with the order as it is now."""
        fwd, both = jax.jit(attend), jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2)))
        return fwd.lower(q, k, v).compile(), both.lower(q, k, v).compile()

    fwd, both = compiled()
    steps["fwd, sorted order"] = lambda: fwd(q, k, v)
    steps["fwd+bwd, sorted order"] = lambda: both(q, k, v)
    with kernel_variant(am, "_work_order", natural_order):
        fwd_n, both_n = compiled()
    steps["fwd, natural order"] = lambda: fwd_n(q, k, v)
    steps["fwd+bwd, natural order"] = lambda: both_n(q, k, v)
    times = time_interleaved(steps, 9, 4)
    lines = [f"### {title}", "| variant | ms |", "|---|---:|"] + [f"| {name} | {ms:.4f} |" for name, ms in times.items()]
    print("\n".join(lines), flush=True)
    return lines


def main() -> int:
    print(f"jax {jax.__version__}, {jax.devices()[0].device_kind}", flush=True)
    case("packed B8 S2048 H12/4 D64, 4 documents", 8, 2048, 12, 4, 64, 4)
    case("4 segments B4 S4096 H16 D128", 4, 4096, 16, 16, 128, 4)
    return 0


if __name__ == "__main__":
    sys.exit(main())
