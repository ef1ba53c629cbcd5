"""The Mosaic forward with its results in a buffer of their own, against results staged in the
query tile's buffer, side by side in one process, beside cuDNN.

    python bench/probe_forward_staging.py [--samples N]

With the results staged in the query tile's buffer, each item waits for the previous item's
results to leave before it requests the next tile (about 500 SM cycles per item, run 22); with
a buffer of their own the request goes out at once and the wait moves to the next write, a
walk later. Each variant is compiled ahead of time (the kernels' choice is made while tracing,
so the caches are cleared between the two), then timed interleaved (bench/_timing.py).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from typing import Any

import jax
from _timing import time_interleaved
from bench_attention import both_passes, equal_documents, input_sets, kernel_attend, kernel_variant

from ejlabel.kernels import _mosaic_forward
from ejlabel.kernels.attention import AttentionConfig

CASES = {  # name: (batch, seq, heads, kv_heads, dim, documents or None)
    "causal B4 S4096 H16 D128": (4, 4096, 16, 16, 128, None),
    "packed B8 S2048 H12/4 D64 x4": (8, 2048, 12, 4, 64, 4),
}


def compiled(impl: str) -> dict[str, Callable[[], Any]]:
    """Forward and forward+backward of every case, compiled now."""
    out = {}
    for case, (b, s, h, kv, d, docs) in CASES.items():
        if impl == "cudnn" and docs is not None:  # cuDNN has no segment ids: it is timed on the causal case only
            continue
        q, k, v, probe = input_sets(b, s, h, kv, d, count=1)[0]
        kwargs = {"causal": True} if docs is None else {"causal": True, "segment_ids": equal_documents(b, s, docs)}
        forward, both = both_passes(kernel_attend(AttentionConfig("cudnn" if impl == "cudnn" else "mosaic"), **kwargs))
        for name, fn in (("fwd", forward), ("fwd+bwd", both)):
            exe = fn.lower(q, k, v, probe).compile()
            out[f"{case} | {name} | {impl}"] = lambda exe=exe, args=(q, k, v, probe): exe(*args)
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--samples", type=int, default=9)
    args = parser.parse_args()
    print(f"jax {jax.__version__}, {jax.devices()[0].device_kind}", flush=True)
    steps = compiled("cudnn") | compiled("mosaic, results apart")
    with kernel_variant(_mosaic_forward, "_fits_exactly", lambda *buffer_bytes: False):  # every results buffer in the query tile's
        steps |= compiled("mosaic, results in the query buffer")
    times = time_interleaved(steps, args.samples, 4)
    print("| case | pass | variant | ms |\n|---|---|---|---:|")
    for name, ms in times.items():
        print(f"| {name} | {ms:.4f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
