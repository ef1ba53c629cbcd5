"""Where a Mosaic attention forward spends its time per tile, from the kernel's own trace.

    python bench/profile_mosaic.py [--out DIR]

Sets ``$EJLABEL_MOSAIC_PROFILE_DIR`` so the kernels are built with the Mosaic GPU profiler:
each warpgroup records its named regions (``tile_wait``, ``walk`` and the ``masked`` steps
inside it, ``k_wait``, ``out_wait``, ``write``; the producer's ``slot_wait``) with the SM
clock, and the call writes a trace (one per kernel and process: a later call of the same
kernel finds its file taken). The forward runs at the segment goal's shape (B4 S4096 H16
D128, 4 documents per row), at the same documents as rows of their own without segment ids
(B16 S1024), and at the packed model's shape (B8 S2048 H12/4 D64, 4 documents). Printed per
shape, for the consumer warpgroups: cycles per item inside the walk and between walks (the
fixed cost of a tile), split into the regions found between two walks; cycles per step of
the masked and the unmasked steps; the first ``k_wait`` of a walk against the later ones; and
the producer's waits for free slots. Cycles, not seconds: the clock is the SM's. The events
of a warpgroup must fit the profiler's 512 slots in shared memory: long walks (causal S4096)
overflow them and stop the kernel, so the cases are short (run 120).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
from collections import defaultdict
from pathlib import Path
from typing import Any

_CONSUMERS = 2  # warpgroups 0 and 1 of a program; 2 is the producer


def _regions(events: list[dict[str, Any]]) -> dict[int, list[tuple[str, float, float]]]:
    """``{warpgroup trace id: [(name, begin, end), ...]}`` in time order, from begin/end events."""
    open_at: dict[tuple[int, str], list[float]] = defaultdict(list)
    out: dict[int, list[tuple[str, float, float]]] = defaultdict(list)
    for event in events:
        key = (event["tid"], event["name"])
        if event["ph"] == "B":
            open_at[key].append(event["ts"])
        elif open_at[key]:
            out[event["tid"]].append((event["name"], open_at[key].pop(), event["ts"]))
    for regions in out.values():
        regions.sort(key=lambda r: r[1])
    return out


def _median(values: list[float]) -> float:
    return statistics.median(values) if values else float("nan")


def summarize(trace: dict[str, Any]) -> list[str]:
    """Per-item cycle counts of the consumers and the producer's slot waits (see module doc)."""
    by_wg = _regions(trace["traceEvents"])
    walk, between, first_k, later_k, slot = [], [], [], [], []
    masked_step, unmasked_step, steps = [], [], []
    gap_parts: dict[str, list[float]] = defaultdict(list)
    spans, items = [], 0
    for tid, regions in by_wg.items():
        wg = (tid - 1) % (_CONSUMERS + 1)
        if wg == _CONSUMERS:
            slot += [(e - b) * 1e3 for name, b, e in regions if name == "slot_wait"]
            continue
        walks = [(b, e) for name, b, e in regions if name == "walk"]
        if not walks:
            continue
        items += len(walks)
        spans.append((regions[-1][2] - regions[0][1]) * 1e3)
        walk += [(e - b) * 1e3 for b, e in walks]
        for (_, end), (start, _) in zip(walks, walks[1:]):
            between.append((start - end) * 1e3)
            for name, b, e in regions:
                if end <= b and e <= start:
                    gap_parts[name].append((e - b) * 1e3)
        for b, e in walks:
            waits = [(wb, we) for name, wb, we in regions if name == "k_wait" and b <= wb and we <= e]
            if waits:
                first_k.append((waits[0][1] - waits[0][0]) * 1e3)
                later_k += [(we - wb) * 1e3 for wb, we in waits[1:]]
            # Steps are counted by their k_wait regions: those inside the masked region are its steps.
            masked = [(mb, me) for name, mb, me in regions if name == "masked" and b <= mb and me <= e]
            masked_cycles = sum(me - mb for mb, me in masked) * 1e3
            masked_count = sum(1 for wb, we in waits for mb, me in masked if mb <= wb and we <= me)
            if masked_count:
                masked_step.append(masked_cycles / masked_count)
            if len(waits) > masked_count:
                unmasked_step.append(((e - b) * 1e3 - masked_cycles) / (len(waits) - masked_count))
            steps.append(len(waits))
    gaps = max(len(between), 1)
    lines = [
        f"consumer warpgroups {len(spans)}, items {items}, median span {_median(spans):.0f} cycles",
        f"walk per item: median {_median(walk):.0f}, mean {statistics.fmean(walk) if walk else 0:.0f} cycles",
        f"between two walks: median {_median(between):.0f}, mean {statistics.fmean(between) if between else 0:.0f} cycles",
    ]
    for name, values in sorted(gap_parts.items()):
        lines.append(f"  of which {name}: {sum(values) / gaps:.0f} cycles per gap (median {_median(values):.0f}, {len(values)} regions)")
    lines.append(
        f"steps per item: mean {statistics.fmean(steps) if steps else 0:.2f}; cycles per step: masked median {_median(masked_step):.0f} "
        f"({len(masked_step)} items), unmasked median {_median(unmasked_step):.0f} ({len(unmasked_step)} items)"
    )
    lines.append(f"k_wait: first of a walk median {_median(first_k):.0f}, later ones median {_median(later_k):.0f} cycles ({len(later_k)})")
    lines.append(f"producer slot_wait: median {_median(slot):.0f}, total per program {sum(slot) / max(len(spans) // _CONSUMERS, 1):.0f} cycles")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=None, help="directory for the traces (default: a temporary one)")
    args = parser.parse_args()
    directory = Path(args.out or tempfile.mkdtemp(prefix="mosaic-profile-"))
    directory.mkdir(parents=True, exist_ok=True)

    import jax
    import jax.numpy as jnp
    from bench_attention import equal_documents
    from ejlabel.kernels import _mosaic_kernel, attention_mosaic as am

    print(f"jax {jax.__version__}, device {jax.devices()[0].device_kind}", flush=True)
    cases = {  # (batch, seq, heads, kv heads, dim, documents per row; 1: no segment ids)
        "4 segments B4 S4096 H16 D128": (4, 4096, 16, 16, 128, 4),
        "causal B16 S1024 H16 D128 (the same documents as rows)": (16, 1024, 16, 16, 128, 1),
        "packed B8 S2048 H12/4 D64, 4 documents": (8, 2048, 12, 4, 64, 4),
    }
    for title, (batch, seq, heads, kv_heads, dim, documents) in cases.items():
        keys = jax.random.split(jax.random.key(0), 4)
        q = jax.random.normal(keys[0], (batch, seq, heads, dim), jnp.bfloat16)
        k, v = (jax.random.normal(key, (batch, seq, kv_heads, dim), jnp.bfloat16) for key in keys[2:])
        ids = equal_documents(batch, seq, documents) if documents > 1 else None
        case_dir = directory / "".join(c if c.isalnum() else "_" for c in title)
        case_dir.mkdir(exist_ok=True)
        os.environ[_mosaic_kernel.PROFILE_DIR_VARIABLE] = str(case_dir)  # read when the kernels are traced

        forward = jax.jit(lambda q, k, v, ids: am.mosaic_attention(q, k, v, causal=True, segment_ids=ids))
        jax.block_until_ready(forward(q, k, v, ids))
        jax.effects_barrier()
        traces = sorted(case_dir.glob("*trace.json"), key=lambda p: int(p.name.rsplit("-", 2)[-2]))
        print(f"\n### {title}: {len(traces)} traces, the last one", flush=True)
        if traces:
            print("\n".join(summarize(json.loads(traces[-1].read_text()))), flush=True)


if __name__ == "__main__":
    sys.exit(main())
