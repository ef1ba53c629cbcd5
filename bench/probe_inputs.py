"""Does the input set move the causal timings? cuDNN and the Mosaic kernels on B4 S4096 H16 D128.

    python bench/probe_inputs.py

Two input regimes, timed interleaved in one process: ``one set`` (quick_mosaic.py's: one set of
``jax.random.normal`` drawn in bf16, every call on the same arrays) and ``three sets``
(bench_attention.py's: three sets drawn in float32 and rounded to bf16, rotated call by call).
Across runs 49-52 cuDNN's causal forward read 0.542-0.562 ms in the second and 0.622 ms in the
first; this probe puts both side by side.
"""

from __future__ import annotations

import itertools
import sys
from typing import Any

import jax
import jax.numpy as jnp
from _timing import time_interleaved
from bench_attention import input_sets
from quick_mosaic import inputs
from ejlabel.kernels import attention_mosaic as am


def main() -> None:
    print(f"jax {jax.__version__}, device {jax.devices()[0].device_kind}", flush=True)
    batch, seq, heads, dim = 4, 4096, 16, 128
    regimes = {"one set": [inputs(batch, seq, heads, heads, dim)], "three sets": input_sets(batch, seq, heads, heads, dim)}
    attend = {
        "cudnn": lambda q, k, v: jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation="cudnn"),
        "mosaic": lambda q, k, v: am.mosaic_attention(q, k, v, causal=True),
    }
    steps: dict[str, Any] = {}
    for (name, fn), (regime, sets) in itertools.product(attend.items(), regimes.items()):
        fwd = jax.jit(fn)
        both = jax.jit(jax.value_and_grad(lambda q, k, v, p, fn=fn: jnp.sum(fn(q, k, v).astype(jnp.float32) * p), argnums=(0, 1, 2)))
        cycle_f, cycle_b = itertools.cycle(sets), itertools.cycle(sets)
        steps[f"{name} fwd, {regime}"] = lambda fwd=fwd, c=cycle_f: fwd(*next(c)[:3])
        steps[f"{name} fwd+bwd, {regime}"] = lambda both=both, c=cycle_b: both(*next(c))
    times = time_interleaved(steps, samples=15, per_sample=4)
    flops = 4 * batch * heads * dim * seq * seq / 2
    print("| variant | ms | TFLOP/s |\n|---|---|---|")
    for name, ms in times.items():
        print(f"| {name} | {ms:.3f} | {flops * (1.0 if ' fwd,' in name else 3.5) / ms / 1e9:.0f} |")


if __name__ == "__main__":
    sys.exit(main())
