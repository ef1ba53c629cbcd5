"""Can XLA fuse the dense gradient into the two products, so it is never written?

    python bench/probe_lce_prologue.py [--samples 9] [--chunks 4096,8192]

``chunked_tokens`` writes ``e = exp(z - max)`` (bf16) in the pass that sums it and the two
gradient products read it. With the sum taken by a reduction of its own, ``e`` is an elementwise
function of the logits that only the products read: if XLA's GEMM fusion takes it in as their
operand's prologue, ``e`` is never written (one ``[chunk, vocab]`` array per chunk instead of
two). Also: the weight's transposed copy (the products contract it in place; the label's
columns gathered from it). Prints each variant's count of Triton GEMM fusions; one
interleaved run, the table of ``bench_linear_cross_entropy.py``.
"""

from __future__ import annotations

import argparse
import importlib
import sys

import jax

from bench_linear_cross_entropy import PLAIN, compare, plain_loss, problem


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=16384)
    parser.add_argument("--d", type=int, default=768)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--samples", type=int, default=9)
    parser.add_argument("--chunks", default="4096,8192")
    args = parser.parse_args()

    module = importlib.import_module("ejlabel.kernels.linear_cross_entropy")
    hidden, weight, labels = problem(args.tokens, args.d, args.vocab)
    variants = {PLAIN: plain_loss(labels)}
    for chunk in (int(c) for c in args.chunks.split(",")):
        cfg = module.LinearCrossEntropyConfig("chunked_tokens", chunk_tokens=chunk)
        for dense in ("pass", "prologue"):
            for weight_t in (True, False):

                def loss(h, w, cfg=cfg, probe={"dense": dense, "weight_t": weight_t}):
                    module._PROBE.update(probe)  # read while tracing; compare() traces one variant at a time
                    return module.linear_cross_entropy(h, w, labels, ignore_index=None, cfg=cfg)

                name = f"{chunk} tokens, e {dense}, {'transposed weight' if weight_t else 'weight in place'}"
                variants[name] = loss
                text = jax.jit(jax.value_and_grad(loss, argnums=(0, 1))).lower(hidden, weight).compile().as_text()
                print(name, "| triton gemm fusions:", text.count("__triton_gemm"), "| cublas calls:", text.count("custom_call_target=\"__cublas"), flush=True)
    print(compare(variants, hidden, weight, args.samples))
    return 0


if __name__ == "__main__":
    sys.exit(main())
