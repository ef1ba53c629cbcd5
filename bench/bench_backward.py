"""Where the Mosaic attention backward's time goes: each of its kernels alone, beside the whole
backward and cuDNN's backward alone, at the shapes the open goals name and at head dim 256 with
packed documents.

``mosaic_backward`` runs a dq kernel (products ``q k^T``, ``dO v^T``, ``dS k`` per step) and a
dk/dv kernel (``k q^T``, ``v dO^T``, ``P^T dO``, ``dS^T q``), which above head dim 128 walks twice
(``dv``: two products a step; ``dk``: three; :func:`.backward.dkv_passes`). Each kernel is timed
alone, on operands padded and with ``delta`` made outside the timed call and its plan made in it
(as the backward makes it: a constant without segment ids), under its default schedule and with
its consumers' turns flipped (every case's ring gives turns the two slots they need). The whole
backward (``mosaic_backward``) and cuDNN's backward (the ``jax.vjp`` of
``jax.nn.dot_product_attention``, with packed documents of cuDNN's packed layout, on its
forward's residuals) are timed in the same run; above head dim 128 also our backward with a
one-stage ring in every kernel (what the dq kernel and the ``dk`` walk ran before
:func:`.budget.ring_depths`). A kernel's TFLOP/s counts its own products (each ``2 x pairs x
dim`` per head); a backward's, the visible work (2.5x the forward), and their ratio is against
cuDNN's.

    python3 bench/bench_backward.py [--samples 9] [--only d128,d64,packed,d256,d256packed]   # a Hopper GPU
"""

from __future__ import annotations

import argparse
import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import jax

from _results import write_results
from bench_attention import Row, Variant, baseline, dims, document_sets, find, markdown, row_record, run_section, set_ratios
from ejlabel import BwdParams, FwdParams
from ejlabel.kernels.attention.arg_specs import CAUSAL, HEAD_DIM_256, MODEL_SHAPES, PACKED, ArgSpec
from ejlabel.kernels.attention.mosaic import BACKWARD_PINGPONG_MAX_DIM, TILE, mosaic_backward, mosaic_forward, on_hopper, pad_operands
from ejlabel.kernels.attention.mosaic.plan import Shape, visit_plan
from ejlabel.kernels.pallas_common import pad_axis

CASES: dict[str, ArgSpec] = {
    "d128": CAUSAL, "d64": MODEL_SHAPES[0], "packed": PACKED, "d256": HEAD_DIM_256,
    "d256packed": next(spec for spec in MODEL_SHAPES if spec.dim == 256 and spec.documents),
}
BLOCK = 64  # the backward's default blocks: 64 keys in the dq kernel, 64 queries in the dk/dv kernel
CAUSAL_BOUNDS = (None, 0)


@dataclasses.dataclass(frozen=True)
class Static:
    """A call's static facts, the same for every input set of a case."""

    shape: Shape
    rows: int  # query rows in whole tiles
    cols: int  # key rows in whole tiles


def prepared(spec: ArgSpec, q: jax.Array, k: jax.Array, v: jax.Array, probe: jax.Array, ids: jax.Array | None) -> tuple[dict[str, Any], Any, Static]:
    """One input set as our kernels take it (arrays only, so a jitted call takes them as
    arguments): padded operands, the forward's output and log-sum-exp, ``dO`` (the probe) and
    ``delta``; cuDNN's backward (a closure on its forward's residuals); and the call's static
    facts. The plans are made in the timed call, as the backward makes them: constants of the
    program without segment ids, device work with them."""
    from ejlabel.kernels.attention.mosaic.backward import softmax_delta

    scale = spec.dim**-0.5
    out, lse = mosaic_forward(q, k, v, ids, scale=scale, bounds=CAUSAL_BOUNDS, params=FwdParams())
    p = pad_operands(q, k, v, ids, scale=scale, bounds=CAUSAL_BOUNDS, block_k=BLOCK)
    do, padded_out = p.like_q(probe.astype(q.dtype)), p.like_q(out)
    plain = baseline(spec.documents)
    _, cudnn_vjp = jax.vjp(lambda q, k, v: plain(q, k, v, ids), q, k, v)
    arrays = {
        "q": q, "k": k, "v": v, "ids": ids, "out": out, "lse": lse, "probe": probe.astype(q.dtype),
        "padded_q": p.q, "padded_k": p.k, "padded_v": p.v, "padded_ids": p.segment_ids, "padded_out": padded_out, "do": do,
        "lse_rows": pad_axis(lse, 2, p.rows), "delta": softmax_delta(padded_out, do, p.rows),
    }
    return arrays, cudnn_vjp, Static(p.shape, p.rows, p.cols)


def plan_of(x: dict[str, Any], static: Static, *, transpose: bool) -> jax.Array:
    """The dq kernel's plan (query tiles over key blocks), or with ``transpose`` the dk/dv kernel's."""
    rows, cols = (static.cols, static.rows) if transpose else (static.rows, static.cols)
    return visit_plan(rows, cols, TILE, BLOCK, static.shape, x["padded_ids"], x["padded_q"].shape[0], transpose=transpose)


def dq_kernel(static: Static, pingpong: bool) -> Callable[[dict[str, Any]], Any]:
    from ejlabel.kernels.attention.mosaic.backward import dq_call

    def run(x: dict[str, Any]) -> Any:
        return dq_call(
            x["padded_q"], x["padded_k"], x["padded_v"], x["do"], x["lse_rows"], x["padded_out"], plan_of(x, static, transpose=False),
            x["padded_ids"], static.shape, block_k=BLOCK, stages=None, pingpong=pingpong,
        )

    return run


def dkv_kernel(static: Static, grads: tuple[str, ...], pingpong: bool) -> Callable[[dict[str, Any]], Any]:
    from ejlabel.kernels.attention.mosaic.backward import dkv_call

    def run(x: dict[str, Any]) -> Any:
        return dkv_call(
            x["padded_q"], x["padded_k"], x["padded_v"], x["do"], x["lse_rows"], x["delta"], plan_of(x, static, transpose=True),
            x["padded_ids"], static.shape, block_q=BLOCK, stages=None, grads=grads, pingpong=pingpong,
        )

    return run


def whole_backward(params: BwdParams) -> Callable[[dict[str, Any]], Any]:
    def run(x: dict[str, Any]) -> Any:
        q = x["q"]
        return mosaic_backward(q, x["k"], x["v"], x["ids"], x["out"], x["lse"], x["probe"], scale=q.shape[3] ** -0.5, bounds=CAUSAL_BOUNDS, params=params)

    return run


def cudnn_backward(vjp: Any, probe: jax.Array) -> Any:
    return vjp(probe)


# Products a step of each walk of the dk/dv kernel (the dq kernel's: 3).
WALK_PRODUCTS = {("dk", "dv"): 4, ("dv",): 2, ("dk",): 3}


def case_rows(name: str, spec: ArgSpec, samples: int, per_sample: int) -> list[Row]:
    """The kernels alone, the whole backward and cuDNN's at one shape, timed side by side."""
    from ejlabel.kernels.attention.mosaic.backward import dkv_passes

    sets, pairs = document_sets(*dims(spec))
    prepared_sets = [prepared(spec, *one) for one in sets]
    inputs, static = [(arrays,) for arrays, _, _ in prepared_sets], prepared_sets[0][2]
    # Each closure is its own jit cache entry (its residuals' jaxpr is part of its tree).
    cudnn_inputs = [(vjp, arrays["probe"]) for arrays, vjp, _ in prepared_sets]
    forward_flops = 4.0 * spec.heads * spec.dim * sum(pairs) / len(pairs)  # one product is half of it
    case = f"{name}: {spec.name} B{spec.batch} S{spec.seq} H{spec.heads}/{spec.kv_heads} D{spec.dim}"
    turns = spec.dim <= BACKWARD_PINGPONG_MAX_DIM
    kernels: list[tuple[str, Callable[..., Any], int]] = []  # (name, fn, products a step)
    for pingpong in (turns, not turns):
        schedule = ("turns" if pingpong else "no turns") + (" (default)" if pingpong == turns else "")
        kernels.append((f"dq kernel, {schedule}", dq_kernel(static, pingpong), 3))
        for grads in dkv_passes(spec.dim):
            walk = "dk/dv kernel" if len(grads) == 2 else f"dk/dv kernel, {grads[0]} walk"
            kernels.append((f"{walk}, {schedule}", dkv_kernel(static, grads, pingpong), WALK_PRODUCTS[grads]))
    variants = [Variant(case, kernel, "bwd kernel", jax.jit(fn), inputs, products * forward_flops / 2) for kernel, fn, products in kernels]
    backwards = {"mosaic backward (default)": BwdParams()}
    if spec.dim > 128:  # where the default ring gives held blocks two slots, freed ones one
        backwards["mosaic backward, one-stage ring"] = BwdParams(num_stages=1)
    variants += [Variant(case, name, "bwd", jax.jit(whole_backward(params)), inputs, 2.5 * forward_flops) for name, params in backwards.items()]
    variants += [
        Variant(case, "cudnn backward" + (" (packed layout)" if spec.documents else ""), "bwd", jax.jit(cudnn_backward), cudnn_inputs, 2.5 * forward_flops),
    ]
    rows = run_section(name, variants, samples, per_sample)
    cudnn = next(r for r in rows if r.impl.startswith("cudnn"))
    set_ratios([r for r in rows if r.pass_ == "bwd"], lambda r: find(rows, case, cudnn.impl, "bwd"), cudnn.impl)
    return rows


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--samples", type=int, default=9)
    parser.add_argument("--per-sample", type=int, default=10)
    parser.add_argument("--only", default=",".join(CASES), help=f"comma-separated subset of {list(CASES)}")
    args = parser.parse_args(argv)
    only = [c.strip() for c in args.only.split(",") if c.strip()]
    if set(only) - set(CASES) or args.samples < 1 or args.per_sample < 1:
        parser.error(f"--only: expected names from {list(CASES)}; --samples, --per-sample: positive counts (got {args.only}, {args.samples}, {args.per_sample})")
    if not on_hopper():
        parser.error(f"the Mosaic GPU kernels need a Hopper GPU; this process has {jax.devices()[0].device_kind}")
    rows: list[Row] = []
    for name in only:  # a run cut short keeps the cases that came first
        rows += case_rows(name, CASES[name], args.samples, args.per_sample)
        print("\n" + markdown([r for r in rows if r.section == name]) + "\n", flush=True)
        notes = (f"medians of {args.samples} interleaved samples of at least {args.per_sample} calls and 10 ms; TFLOP/s: a kernel's own "
                 "products, a backward's visible work (2.5x the forward); ratio: TFLOP/s over cuDNN's backward in the same case")
        write_results("bench_backward", [row_record(r) for r in rows], notes=notes)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
