"""Where does the token-chunked loss spend its passes over the logits? Variants side by side.

    python bench/probe_lce_passes.py --variant NAME=FILE ... [--samples 9]
        [--token-chunks 2048,4096] [--out FILE] [--hlo-dir DIR]

Each ``--variant`` is another version of ``kernels/linear_cross_entropy.py`` (the current file
with a diff of ``runs/`` applied), timed beside the current one; a variant named ``label
shift`` also gets a row without its redo loop.

``chunked_tokens`` per chunk of tokens: the logits product ``z``, passes over ``z``, the two
gradient products reading the one dense array the passes write. Rows, side by side in one
interleaved run (``bench_linear_cross_entropy.py``'s problem, baseline and table):

- previous (``runs/2026-11-26_lce_previous_kernel.diff``, the kernel of b3d7c92): a max pass,
  then a pass writing ``e = exp(z - max)`` with the label's column zeroed and summing it; the
  label's term a float32 gather of the weight's label rows from a transposed copy of the weight
  (``d_hidden``) and a scatter into ``d_weight``'s;
- current: the same two passes, the second summing ``e`` off the label as well, and the label's
  gradient written into its column, so ``d_hidden`` needs no weight rows and no transposed copy
  (``d_weight``'s label rows still take a float32 correction);
- normalised (``runs/2026-11-26_lce_normalised.diff``): a first pass finding the max and ``sum
  exp(z - z_label)`` in one reduction, so the second writes the probabilities: the label's entry
  ``p_y - 1``, close to -1 in an untrained model as the plain program's, where the current
  kernel's ``-(sum(e) - e_y)`` is rounded;
- label shift (``runs/2026-11-26_lce_label_shift.diff``): each row shifted by its label's logit,
  so one pass writes ``e``, sums it and finds the max: one pass over ``z`` less; rows whose
  label lies more than 40 nats below the max are left out and redone after the scan by a loop
  over the chunks that have any (a count the host reads: the program waits there);
- label shift without that loop (wrong for such rows; none in this problem): what the loop costs
  when it has nothing to do.
"""

from __future__ import annotations

import importlib
import sys
import types
from collections.abc import Callable

import jax
from jax import lax
from _variants import load_variant
from bench_linear_cross_entropy import PLAIN, compare, our_loss, plain_loss, problem, problem_parser, report


def without_redo_loop(module: types.ModuleType, fn: Callable[..., jax.Array]) -> Callable[..., jax.Array]:
    """``fn`` traced with the module's ``lax.fori_loop`` (the left-out rows' redo) left out."""

    def traced(*args: jax.Array) -> jax.Array:
        real = module.lax
        module.lax = types.SimpleNamespace(**{**vars(lax), "fori_loop": lambda lower, upper, body, init: init})
        try:
            return fn(*args)
        finally:
            module.lax = real

    return traced


def main() -> int:
    parser = problem_parser(__doc__.splitlines()[0], samples=9)
    parser.add_argument("--variant", action="append", default=[], metavar="NAME=FILE")
    parser.add_argument("--token-chunks", default="2048,4096")
    parser.add_argument("--out", default=None)
    parser.add_argument("--hlo-dir", default=None, help="write each variant's optimised HLO here")
    args = parser.parse_args()

    current = importlib.import_module("ejlabel.kernels.linear_cross_entropy")
    modules = {"current": current}
    for spec in args.variant:
        name, _, path = spec.partition("=")
        modules[name] = load_variant("_linear_cross_entropy", name.replace(" ", "_"), path)
    hidden, weight, labels = problem(args.tokens, args.d, args.vocab)
    variants = {PLAIN: plain_loss(labels)}
    for chunk in (int(c) for c in args.token_chunks.split(",")):
        for name, module in modules.items():
            variants[f"{name}, {chunk}"] = our_loss(labels, module.LinearCrossEntropyConfig("chunked_tokens", chunk_tokens=chunk), module)
        if "label shift" in modules:
            variants[f"label shift, no redo loop, {chunk}"] = without_redo_loop(modules["label shift"], variants[f"label shift, {chunk}"])
    if args.hlo_dir:
        for i, (name, fn) in enumerate(variants.items()):
            text = jax.jit(jax.value_and_grad(fn, argnums=(0, 1))).lower(hidden, weight).compile().as_text()
            with open(f"{args.hlo_dir}/{i}.hlo.txt", "w") as f:
                f.write(f"// {name}\n{text}")
    return report(compare(variants, hidden, weight, args.samples), args.out)


if __name__ == "__main__":
    sys.exit(main())
