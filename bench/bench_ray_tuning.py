"""Tuning a program's unseen calls on Ray workers: scaling with workers, and overhead on one GPU.

python bench/bench_ray_tuning.py [--scaling] [--overhead] [options]   (both when neither is given)

(a) ``--scaling``: the unseen calls of the TINY example model's training step, lowered at
    several sequence lengths (``--seq-lens``, batch 2: one program per length, each with its own
    call shapes, so there are enough distinct calls to keep 8 workers busy), tuned on the CPU
    with 1, 2, 4, 8 Ray workers (``--workers``; a local cluster with that many CPUs, one CPU and
    one compile thread per worker) and by the local tuner (one process, ``compile_workers`` =
    the machine's CPUs, its best setting). Each run starts from a fresh temporary cache. Wall
    time is ``tune_unseen``'s: starting the workers included, starting the cluster (``ray.init``)
    reported apart.
(b) ``--overhead``: one program's unseen calls (``--model 125m``: the GPU_125M training step;
    ``tiny`` for a CPU check) through Ray on this machine's GPU against the local tuner, the same
    calls and the same reduced policy (``--max-configs``, ``--iters``; 4 compile threads, and at
    least as many candidates per call, which the full spaces have too: a worker compiles one call's
    candidates at a time, the local tuner all calls' in one pool), each in a fresh process
    (the local tuner and the Ray driver would otherwise share one GPU's memory); the driver of
    the Ray run never touches the GPU (``JAX_PLATFORMS=cpu``), its one worker does.

Prints a markdown table per part and writes each part's rows, one per tuner run, to
``bench/results/bench_ray_tuning.scaling.json`` and ``bench_ray_tuning.overhead.json``
(``bench/_results.py``), the scaling part after each run, so a run cut short keeps its finished
parts.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from _results import write_results


def _policy(args: argparse.Namespace, compile_workers: int) -> Any:
    import ejlabel

    return ejlabel.AutotunePolicy(
        num_warmup=1, num_iters=args.iters, max_configs=args.max_configs, compile_workers=compile_workers
    )


def _selector(root: str) -> Any:
    from ejlabel.config.persistent import PersistentCache
    from ejlabel.config.selection import ConfigSelectorChain

    return ConfigSelectorChain(persistent=PersistentCache(tempfile.mkdtemp(dir=root)))


def _write_programs(model: str, seq_lens: list[int], where: Path) -> None:
    """Lower the training step (abstract arguments: no weights are made) and write its HLO."""
    import dataclasses

    import jax

    from ejlabel import examples

    base = examples.TINY if model == "tiny" else examples.GPU_125M
    for seq in seq_lens:
        cfg = dataclasses.replace(base, seq_len=seq) if seq else base
        params = jax.eval_shape(lambda cfg=cfg: examples.init_params(cfg, jax.random.key(0)))
        batch = jax.eval_shape(lambda cfg=cfg: examples.example_batch(cfg, jax.random.key(1)))
        lowered = jax.jit(examples.make_train_step(cfg)).lower(params, batch)
        (where / f"train_b{cfg.batch}_s{cfg.seq_len}.txt").write_text(lowered.compiler_ir("hlo").as_hlo_text())


def _run_summary(report: Any, **extra: Any) -> dict[str, Any]:
    per_call = {f"{op}:{key}": round(r.wall_s, 2) for (op, key), r in report.results.items()}
    return {
        "wall_s": round(report.wall_s, 2),
        "calls": len(report.results),
        "errors": len(report.errors),
        "workers_used": len(set(report.worker_of.values())),
        "picks": {f"{op}:{key}": repr(r.best_cfg) for (op, key), r in report.results.items()},
        "per_call_s": per_call,
        **extra,
    }


def _save(part: str, runs: dict[str, Any], args: argparse.Namespace, what: str) -> None:
    """One part's runs as rows (``tuner`` names the run) in its results file."""
    policy = f"policy num_warmup=1, num_iters={args.iters}, max_configs={args.max_configs}"
    write_results(f"bench_ray_tuning.{part}", [{"tuner": name, **run} for name, run in runs.items()], notes=f"{what}; {policy}; wall_s: tune_unseen's")


# ---------------------------------------------------------------------------- (a) scaling


def scaling(args: argparse.Namespace, root: str) -> None:
    import ray
    from ejlabel.analysis import read_program, tune_unseen

    programs = Path(root) / "programs"
    programs.mkdir()
    _write_programs("tiny", args.seq_lens, programs)
    program = read_program(programs)
    runs: dict[str, Any] = {}
    what = f"the TINY training step's unseen calls on the CPU, seq_len {', '.join(map(str, args.seq_lens))}, batch 2; ray.init apart"
    for n in args.workers:
        start = time.perf_counter()
        ray.init(num_cpus=n, include_dashboard=False, log_to_driver=False, logging_level="WARNING", object_store_memory=256 * 2**20)
        init_s = time.perf_counter() - start
        try:
            report = tune_unseen(
                program, _selector(root), _policy(args, 1), backend="ray", platform="cpu", workers=n, progress=args.progress
            )
        finally:
            ray.shutdown()
        runs[f"ray_{n}"] = _run_summary(report, workers=n, ray_init_s=round(init_s, 2))
        print(f"ray, {n} workers: {report.summary()}", file=sys.stderr, flush=True)
        _save("scaling", runs, args, what)
    if not args.no_local:
        cpus = os.cpu_count() or 1
        report = tune_unseen(program, _selector(root), _policy(args, cpus), progress=False)
        runs["local"] = _run_summary(report, compile_workers=cpus)
        print(f"local: {report.summary()}", file=sys.stderr, flush=True)
        _save("scaling", runs, args, what)
    one = runs.get("ray_1", {}).get("wall_s")
    lines = [
        (
            f"Tuning the TINY training step's unseen calls on the CPU ({len(args.seq_lens)} programs, seq_len "
            f"{', '.join(map(str, args.seq_lens))}, batch 2): {max(r['calls'] + r['errors'] for r in runs.values())} distinct calls"
        ),
        "",
        "| tuner | wall s | speed-up vs 1 worker | efficiency | vs local | ray.init s |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    local = runs.get("local", {}).get("wall_s")
    for name, run in runs.items():
        n = run.get("workers")
        speedup = one / run["wall_s"] if one and n else None
        tuner = f"local (compile_workers={run['compile_workers']})" if name == "local" else f"ray, {n} workers"
        vs_local = f"{local / run['wall_s']:.2f}x" if local else "-"
        lines.append(
            f"| {tuner} | {run['wall_s']:.1f} | {f'{speedup:.2f}x' if speedup else '-'} "
            f"| {f'{speedup / n:.0%}' if speedup else '-'} | {vs_local} | {run.get('ray_init_s', '-')} |"
        )
    print("\n".join(lines))


# ---------------------------------------------------------------------------- (b) overhead


def _phase(args: argparse.Namespace) -> None:
    """One side of (b), in its own process; prints its summary as the last line (JSON)."""
    from ejlabel.analysis import read_program, tune_unseen

    program = read_program(args.programs)
    root = tempfile.mkdtemp()
    policy = _policy(args, 4)
    if args.phase == "local":
        report = tune_unseen(program, _selector(root), policy, modules=["ejlabel.kernels"], progress=False)
        print(json.dumps(_run_summary(report)))
        return
    import ray

    start = time.perf_counter()
    ray.init(include_dashboard=False, log_to_driver=False, logging_level="WARNING", object_store_memory=256 * 2**20)
    init_s = time.perf_counter() - start
    try:
        report = tune_unseen(
            program, _selector(root), policy, backend="ray", modules=["ejlabel.kernels"], platform=args.platform, workers=1,
            calls_per_task=args.calls_per_task[0], progress=args.progress,
        )
    finally:
        ray.shutdown()
    print(json.dumps(_run_summary(report, ray_init_s=round(init_s, 2), device=report.device)))


def _child(args: argparse.Namespace, *extra: str, env: dict[str, str] | None = None) -> dict[str, Any]:
    command = [sys.executable, __file__, *extra, "--iters", str(args.iters), "--max-configs", str(args.max_configs), "--platform", args.platform]
    if "--calls-per-task" not in extra:
        command += ["--calls-per-task", "1"]
    proc = subprocess.run(command, capture_output=True, text=True, env={**os.environ, **(env or {})}, timeout=560, check=False)
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(extra)} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1]) if proc.stdout.strip() else {}


def overhead(args: argparse.Namespace, root: str) -> None:
    programs = Path(root) / "program"
    programs.mkdir()
    cpu_env = {"JAX_PLATFORMS": "cpu"}
    lower_env = {"JAX_PLATFORMS": "cpu" if args.platform == "cpu" else ""}  # "": JAX picks the GPU
    _child(args, "--phase", "lower", "--model", args.model, "--programs", str(programs), env=lower_env)
    local = _child(args, "--phase", "local", "--programs", str(programs), env=lower_env)
    if local["errors"] or not local["calls"]:
        raise RuntimeError(f"(b) the local tuner could not tune every call: {local}")
    lines = [
        "| tuner | wall s | overhead | same picks | ray.init s |",
        "|---|---:|---:|---:|---:|",
        f"| local | {local['wall_s']:.1f} | - | - | - |",
    ]
    runs: dict[str, Any] = {}
    for per_task in args.calls_per_task:
        # The Ray driver reads the program on the CPU; its worker gets the GPU (platform="gpu").
        remote = _child(args, "--phase", "ray", "--programs", str(programs), "--calls-per-task", str(per_task), env=cpu_env)
        if remote["errors"]:
            raise RuntimeError(f"(b) the Ray run could not tune every call: {remote}")
        remote["same_picks"] = sum(remote["picks"].get(k) == v for k, v in local["picks"].items())
        remote["overhead_pct"] = 100 * (remote["wall_s"] / local["wall_s"] - 1)
        runs[f"ray_{per_task}_per_task"] = remote
        lines.append(
            f"| ray, 1 worker, {per_task} call{'s' if per_task > 1 else ''} per task | {remote['wall_s']:.1f} "
            f"| {remote['overhead_pct']:+.1f}% | {remote['same_picks']}/{len(local['picks'])} | {remote['ray_init_s']} |"
        )
    device = next(iter(runs.values())).get("device", "?") if runs else "?"
    title = (
        f"One program's unseen calls ({args.model} training step, {local['calls']} distinct calls, "
        f"max_configs={args.max_configs}, num_iters={args.iters}) on {device}"
    )
    print("\n".join([title, "", *lines]))
    _save("overhead", {"local": local, **runs}, args, f"the {args.model} training step's unseen calls on {device}, each tuner in a fresh process")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--scaling", action="store_true", help="run (a) only (with --overhead: both)")
    parser.add_argument("--overhead", action="store_true", help="run (b) only (with --scaling: both)")
    parser.add_argument("--workers", type=lambda s: [int(x) for x in s.split(",") if x], default=[1, 2, 4, 8], help="(a) worker counts, e.g. 1,2 (empty: the local tuner only)")
    parser.add_argument("--seq-lens", type=lambda s: [int(x) for x in s.split(",")], default=[16, 32, 48, 64], help="(a) one TINY program per sequence length")
    parser.add_argument("--no-local", action="store_true", help="(a) skip the local tuner")
    parser.add_argument("--model", choices=("125m", "tiny"), default="125m", help="(b) the program")
    parser.add_argument("--platform", choices=("gpu", "cpu"), default="gpu", help="(b) where the Ray worker tunes (cpu: a check without a GPU)")
    parser.add_argument("--iters", type=int, default=5, help="timed runs per candidate")
    parser.add_argument(
        "--max-configs", type=int, default=4,
        help="candidates per call at most (the heuristic and XLA ones always run); (b) keeps it >= the 4 compile threads: "
        "a Ray worker compiles one call's candidates at a time, the local tuner every call's in one pool",
    )
    parser.add_argument(
        "--calls-per-task", type=lambda s: [int(x) for x in s.split(",")], default=[1],
        help="(b) one Ray run per value, e.g. 1,8: calls a worker tunes together (8: the whole program in one compile pool)",
    )
    parser.add_argument("--progress", action="store_true", help="print each call as it finishes")
    parser.add_argument("--phase", choices=("lower", "local", "ray"), help=argparse.SUPPRESS)
    parser.add_argument("--programs", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.phase == "lower":
        _write_programs(args.model, [0], Path(args.programs))
        return
    if args.phase:
        _phase(args)
        return
    if not args.overhead:
        os.environ["JAX_PLATFORMS"] = "cpu"  # (a) tunes on the CPU, even on a GPU machine
    with tempfile.TemporaryDirectory() as root:
        if args.scaling or not args.overhead:
            scaling(args, root)
        if args.overhead or not args.scaling:
            overhead(args, root)


if __name__ == "__main__":
    main()
