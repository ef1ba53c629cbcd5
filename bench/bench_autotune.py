"""Successive halving against exhaustive timing, on a kernel with 24 configs (CPU).

python bench/bench_autotune.py [--iters 40] [--repeats 3]

The kernel sums the rows of ``x [256, 4096]`` with a loop whose block size and unroll factor
the config sets (6 block sizes x 4 unroll factors = 24 configs). Every config does the same
arithmetic and gives the same answer; loop overhead and vectorisation make their costs differ,
several of them by only a few percent. Both tuners compile all 24 candidates ahead of time (the
same work for both, reported apart); early stopping saves checking and timing runs, shown
as its own wall-time column. The two picks are then re-timed side by side, interleaved,
to compare them fairly. The rows go to ``bench/results/bench_autotune.json``
(``bench/_results.py``).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import platform
import statistics
import sys
import time

import jax
import jax.numpy as jnp
from _results import write_results
from jax import lax

import ejlabel


@dataclasses.dataclass(frozen=True)
class LoopConfig:
    block: int
    unroll: int


class BlockedRowSum(ejlabel.Kernel):
    def __init__(self) -> None:
        super().__init__("blocked_row_sum")

    def run(self, x, *, cfg: LoopConfig):
        n, m = x.shape
        chunks = x.reshape(n, m // cfg.block, cfg.block)

        def body(i, acc):
            chunk = lax.dynamic_index_in_dim(chunks, i, axis=1, keepdims=False)
            return acc + jnp.tanh(chunk).sum(axis=1)

        return lax.fori_loop(0, m // cfg.block, body, jnp.zeros((n,), x.dtype), unroll=cfg.unroll)

    def heuristic_cfg(self, inv):
        return LoopConfig(64, 1)

    def config_space(self, inv):
        return [LoopConfig(b, u) for b in (16, 32, 64, 128, 256, 512) for u in (1, 2, 4, 8)]


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--iters", type=int, default=40)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    kernel = BlockedRowSum()
    x = jax.random.normal(jax.random.key(0), (256, 4096))
    inv = ejlabel.Invocation(kernel, (x,))
    rows = []
    for repeat in range(args.repeats):
        out = {}
        for name, early in (("successive halving", True), ("exhaustive", False)):
            policy = ejlabel.AutotunePolicy(num_warmup=2, num_iters=args.iters, early_stop=early, compile_workers=2)
            start = time.perf_counter()
            result = ejlabel.Autotuner(policy, progress=False).tune(inv)
            out[name] = (result, time.perf_counter() - start)
        fast, exhaustive = out["successive halving"][0].best_cfg, out["exhaustive"][0].best_cfg
        fns = {cfg: jax.jit(lambda x, cfg=cfg: kernel.run(x, cfg=cfg)) for cfg in {fast, exhaustive}}
        samples = {cfg: [] for cfg in fns}
        for _ in range(30):  # interleaved, so drift hits both equally
            for cfg, fn in fns.items():
                samples[cfg].append(ejlabel.benchmark(fn, x, num_warmup=1, num_iters=5).median_ms)
        t_fast, t_exh = statistics.median(samples[fast]), statistics.median(samples[exhaustive])
        timed_runs = {name: sum(c.timing.count for c in r.candidates if c.timing) for name, (r, _) in out.items()}
        compile_s = sum(c.compile_s for c in out["exhaustive"][0].candidates)
        measure = {name: r.measure_s for name, (r, _) in out.items()}
        rows.append((repeat, fast, exhaustive, t_fast / t_exh, out["successive halving"][1], out["exhaustive"][1], timed_runs, compile_s, measure, os.getloadavg()[0]))
    print(f"machine: {platform.machine()}, 2 cores; python {sys.version.split()[0]}; jax {jax.__version__}; {time.strftime('%Y-%m-%d')}; 24 configs, {args.iters} timed runs per candidate")
    print("| run | halving pick | exhaustive pick | pick time / best time | halving wall s | exhaustive wall s | wall ratio | check+timing s (halving / exhaustive) | check+timing ratio | timed runs (halving / exhaustive) | compile s (24 candidates, summed over threads) |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    records = []
    for repeat, fast, exh, ratio, w_fast, w_exh, runs, compile_s, measure, load in rows:
        m_fast, m_exh = measure["successive halving"], measure["exhaustive"]
        print(
            f"| {repeat} | {fast.block}x{fast.unroll} | {exh.block}x{exh.unroll} | {ratio:.3f} | {w_fast:.2f} | {w_exh:.2f} | {w_fast / w_exh:.2f} "
            f"| {m_fast:.2f} / {m_exh:.2f} | {m_fast / m_exh:.2f} | {runs['successive halving']} / {runs['exhaustive']} | {compile_s:.2f} |"
        )
        records.append({
            "run": repeat, "halving_pick": f"{fast.block}x{fast.unroll}", "exhaustive_pick": f"{exh.block}x{exh.unroll}",
            "pick_over_best": ratio, "halving_wall_s": w_fast, "exhaustive_wall_s": w_exh, "wall_ratio": w_fast / w_exh,
            "halving_measure_s": m_fast, "exhaustive_measure_s": m_exh, "measure_ratio": m_fast / m_exh,
            "halving_timed_runs": runs["successive halving"], "exhaustive_timed_runs": runs["exhaustive"],
            "compile_s": compile_s, "load_average_1min": round(load, 2),
        })
    write_results(
        "bench_autotune", records,
        notes=f"24 configs, {args.iters} timed runs per candidate; pick_over_best: the halving pick's re-timed median over the exhaustive pick's "
        "(30 interleaved rounds); measure_s: check and timing after compilation; compile_s summed over 2 threads",
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
