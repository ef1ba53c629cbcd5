"""Can the token-chunked linear cross-entropy hold one ``[tokens, vocab]`` array per chunk?

    python bench/probe_lce_inplace.py [--samples 9] [--chunks 2048,4096,8192]

Per chunk the kernel holds the logits ``z`` (bf16, the matmul's output) and the dense gradient
``e`` (bf16) at once: 250 MiB each at 4096 tokens. If every read of ``z`` but the one that
writes ``e`` comes first, and that one is elementwise, XLA may write ``e`` over ``z``. Two
first passes, each with the label's logit read by a masked row sum beside it instead of a
gather after it: ``"max"`` (the row max; then ``e`` and its sum in one multi-output pass, not
elementwise) and ``"online"`` (the max and the sum of ``exp(z - max)`` in one reduction over
``(max, sum)`` pairs; then ``e`` in an elementwise pass). Same problem, baseline and table as
``bench_linear_cross_entropy.py``; one interleaved run.
"""

from __future__ import annotations

import argparse
import importlib
import sys

from bench_linear_cross_entropy import PLAIN, compare, plain_loss, problem


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=16384)
    parser.add_argument("--d", type=int, default=768)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--samples", type=int, default=9)
    parser.add_argument("--chunks", default="2048,4096,8192")
    args = parser.parse_args()

    module = importlib.import_module("ejlabel.kernels.linear_cross_entropy")  # the module, not the function it exports

    hidden, weight, labels = problem(args.tokens, args.d, args.vocab)
    variants = {PLAIN: plain_loss(labels)}
    for chunk in (int(c) for c in args.chunks.split(",")):
        cfg = module.LinearCrossEntropyConfig("chunked_tokens", chunk_tokens=chunk)
        for first in ("max", "online"):

            def loss(h, w, cfg=cfg, first=first):
                module._FIRST_PASS = first  # read while tracing, and compare() traces one variant at a time
                return module.linear_cross_entropy(h, w, labels, ignore_index=None, cfg=cfg)

            variants[f"{first} first, token chunks {chunk}"] = loss
    print(compare(variants, hidden, weight, args.samples))
    return 0


if __name__ == "__main__":
    sys.exit(main())
