"""The Mosaic attention kernels' deal of items to their persistent programs: the deal by load
(``kernels/attention/mosaic/work.py``, :func:`balance_rounds`) against the snake alone, at the
example model's packed shape (B8 S2048 H12/4 D64, 4 documents of random lengths a row, the ids an
argument of the timed call as in a training step), beside cuDNN's packed layout: forward and
backward of one call, and of four layers in one call as a model calls them (each layer's output
the next one's queries, the plans shared). One interleaved run per case, medians.

At this shape only the dk/dv kernel's deal changes (512 items on 132 programs: 4 rounds; the
forward and dq kernels deal 1536 items, more rounds than the deal by load takes), and only which
program walks which item, so values and gradients are the same bit for bit. The snake's rows
are compiled with ``BALANCED_MAX_ROUNDS = 0``.

    python3 bench/bench_work_order.py [--samples 9]      # a Hopper GPU (the Mosaic kernels)
"""

from __future__ import annotations

import argparse
import functools
import statistics
from collections.abc import Sequence

import jax

from _results import write_results
from bench_attention import (
    Row, baseline, dims, document_sets, find, ids_attend, kernel_variant, markdown, row_record, run_section, set_ratios,
    stacked, variants_of,
)
from ejlabel.kernels import AttentionConfig
from ejlabel.kernels.attention.arg_specs import PACKED
from ejlabel.kernels.attention.mosaic import on_hopper, work


def deal_rows(layers: int, samples: int, per_sample: int) -> list[Row]:
    """Forward+backward of ``layers`` packed attention calls: the deal by load, the snake, and
    cuDNN's packed layout, timed side by side."""
    b, s, h, kv, d, documents = dims(PACKED)
    sets, pairs = document_sets(b, s, h, kv, d, documents)
    flops = layers * 4.0 * h * d * statistics.fmean(pairs)
    case = f"packed B{b} S{s} H{h}/{kv} D{d} x{documents} random docs, {layers} layer{'s' if layers > 1 else ''} in one call"
    mosaic, cudnn = ids_attend(AttentionConfig("mosaic"), documents), baseline(documents)
    if layers > 1:
        mosaic, cudnn = functools.partial(stacked, mosaic, layers), functools.partial(stacked, cudnn, layers)
    variants = variants_of(case, "mosaic, deal by load", mosaic, sets, flops)[1:]
    with kernel_variant(work, "BALANCED_MAX_ROUNDS", 0):
        snake = variants_of(case, "mosaic, snake deal", mosaic, sets, flops)[1]
        snake.fn = snake.fn.lower(*sets[0]).compile()  # compiled here, under the snake
    variants += [snake, *variants_of(case, "cudnn packed layout", cudnn, sets, flops)[1:]]
    rows = run_section("deal", variants, samples, per_sample)
    set_ratios(rows, lambda r: find(rows, case, "cudnn packed layout", r.pass_), "cuDNN packed layout")
    return rows


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--samples", type=int, default=9)
    parser.add_argument("--per-sample", type=int, default=3)
    args = parser.parse_args(argv)
    if args.samples < 1 or args.per_sample < 1:
        parser.error("--samples, --per-sample: expected positive counts")
    if not on_hopper():
        parser.error(f"the Mosaic GPU kernels need a Hopper GPU; this process has {jax.devices()[0].device_kind}")
    rows = [row for layers in (1, 4) for row in deal_rows(layers, args.samples, args.per_sample)]
    print("\n" + markdown(rows))
    notes = (f"medians of {args.samples} interleaved samples of at least {args.per_sample} calls and 10 ms, one run per case; TFLOP/s of "
             "visible work (backward = 2.5x the forward); ratio: TFLOP/s over cuDNN's packed layout in the same case")
    write_results("bench_work_order", [row_record(r) for r in rows], notes=notes)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
