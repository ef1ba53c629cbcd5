"""Where the fused Mosaic backward's extra time goes: the backward alone, with parts removed.

    python bench/probe_fused_backward.py

The fused backward (``mosaic_backward(..., fused=True)``) adds to each step of the dk/dv kernel
its share of ``dq``: both consumers store ``ds`` to shared memory, the consumer whose turn it is
multiplies ``ds^T k`` over the tile's keys, stores the float32 share and sends it to dq with a
TMA reduce-add. This probe times, side by side in one interleaved run, the split backward, the
fused one, and the fused one without its reduce-adds (taken out at trace time: the share is
computed and stored, never sent, so dq is wrong; only the time is read). What the removal saves
is what the reduce-adds cost on the consumers' path. Not a correctness check.

Run 18 (bench/RESULTS.md) also took out the share product; it cost nothing measurable.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator
from typing import Any

import jax
import jax.numpy as jnp
from _timing import time_interleaved
from bench_attention import equal_documents
from ejlabel import BwdParams, FwdParams
from ejlabel.kernels import _mosaic_backward, attention_mosaic as am


@contextlib.contextmanager
def without_reduce_adds(active: bool) -> Iterator[None]:
    """Trace the kernels with their reduce-adds to global memory taken out (if ``active``)."""
    real_plgpu = _mosaic_backward.plgpu

    def copy(src: Any, dst: Any, *args: Any, reduction_op: Any = None, **kwargs: Any) -> None:
        if reduction_op is None:
            real_plgpu.copy_smem_to_gmem(src, dst, *args, **kwargs)

    class Filtered:  # the module, but its copies out to global memory drop reduce-adds
        def __getattr__(self, name: str) -> Any:
            return copy if name == "copy_smem_to_gmem" else getattr(real_plgpu, name)

    if active:
        _mosaic_backward.plgpu = Filtered()
    try:
        yield
    finally:
        _mosaic_backward.plgpu = real_plgpu


def case(batch: int, seq: int, heads: int, kv_heads: int, dim: int, segments: int | None) -> dict[str, Any]:
    keys = jax.random.split(jax.random.key(0), 4)
    q = jax.random.normal(keys[0], (batch, seq, heads, dim), jnp.bfloat16)
    k = jax.random.normal(keys[1], (batch, seq, kv_heads, dim), jnp.bfloat16)
    v = jax.random.normal(keys[2], (batch, seq, kv_heads, dim), jnp.bfloat16)
    g = jax.random.normal(keys[3], q.shape, jnp.bfloat16)
    ids = None if segments is None else equal_documents(batch, seq, segments)
    bounds = (None, 0)
    out, lse = jax.jit(lambda q, k, v: am.mosaic_forward(q, k, v, ids, scale=dim**-0.5, bounds=bounds, params=FwdParams()))(q, k, v)
    steps = {}
    for name, fused, no_reduce in (("split", False, False), ("fused", True, False), ("fused, no reduce-add", True, True)):
        backward = jax.jit(
            lambda q, k, v, out, lse, g, fused=fused: am.mosaic_backward(
                q, k, v, ids, out, lse, g, scale=dim**-0.5, bounds=bounds, params=BwdParams(q_blocksize=64, kv_blocksize=128), fused=fused,
            )
        )
        with without_reduce_adds(no_reduce):
            compiled = backward.lower(q, k, v, out, lse, g).compile()
        steps[name] = lambda compiled=compiled: compiled(q, k, v, out, lse, g)
    return steps


def main() -> None:
    print(f"jax {jax.__version__}, device {jax.devices()[0].device_kind}", flush=True)
    lines = []
    for title, shape in (("causal B4 S4096 H16 D128", (4, 4096, 16, 16, 128, None)), ("packed B8 S2048 H12/4 D64, 4 docs", (8, 2048, 12, 4, 64, 4))):
        times = time_interleaved(case(*shape), samples=9, per_sample=4)
        lines += [f"### {title}: backward only", "| variant | ms | vs split |", "|---|---:|---:|"]
        lines += [f"| {name} | {ms:.3f} | {ms / times['split']:.2f}x |" for name, ms in times.items()]
        print("\n".join(lines[-len(times) - 3 :]), flush=True)
    print("\n" + "\n".join(lines))


if __name__ == "__main__":
    sys.exit(main())
