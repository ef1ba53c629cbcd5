"""Tuning a program's unseen calls on Ray workers: scaling with workers, and overhead on one GPU.

python bench/bench_ray_tuning.py [--scaling] [--overhead] [--gpus 1,2,4] [options]
    (--scaling and --overhead when no part is named)

On a host of four GPUs, the GPU figures (c) and (b) in one run (a reduced policy, so that the
whole run takes a few minutes; (b) takes its Ray row from (c)'s one-worker run):

    python bench/bench_ray_tuning.py --gpus 1,2,4 --overhead --calls-per-task auto,1 --max-configs 4 --iters 3

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
    least as many candidates per call, which the full spaces have too: a task's calls share one
    compile pool, as the local tuner's do), each in a fresh process
    (the local tuner and the Ray driver would otherwise share one GPU's memory); the driver of
    the Ray run never touches the GPU (``JAX_PLATFORMS=cpu``), its one worker does. With
    ``--gpus``, the Ray row of ``--calls-per-task auto`` (the default: one worker tunes every
    call in one task) is (c)'s one-worker run (same program, same policy, a fresh worker
    process) instead of another run; ``--calls-per-task auto,1`` adds a run of one call per task.

(c) ``--gpus 1,2,4``: the same program's unseen calls (``--model``: the GPU_125M training step,
    lowered for the GPU) tuned on 1, 2 and 4 GPU workers (one per GPU: ``ray.init(num_gpus=n)``, each run
    from a fresh cache; the driver never touches a GPU), with the reduced policy
    (``--max-configs``, ``--iters``); speed-up and efficiency against 1 worker, and whether the
    picks agree with the 1-worker run's. Rows go to ``bench_ray_tuning.gpus.json``.

Prints a markdown table per part and writes each part's rows, one per tuner run, to
``bench/results/bench_ray_tuning.scaling.json``, ``bench_ray_tuning.gpus.json`` and
``bench_ray_tuning.overhead.json`` (``bench/_results.py``), (a) and (c) after each run, so a run cut short keeps its finished
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
    # Where a call's time goes: its timed part, and each candidate's compile (in a pool of threads).
    measure = {f"{op}:{key}": round(r.measure_s, 2) for (op, key), r in report.results.items()}
    compiles = {f"{op}:{key}": [round(c.compile_s or 0.0, 2) for c in r.candidates] for (op, key), r in report.results.items()}
    return {
        "wall_s": round(report.wall_s, 2),
        "calls": len(report.results),
        "errors": len(report.errors),
        "workers_used": len(set(report.worker_of.values())),
        "picks": {f"{op}:{key}": repr(r.best_cfg) for (op, key), r in report.results.items()},
        "per_call_s": per_call,
        "per_call_measure_s": measure,
        "per_call_compile_s": compiles,
        **extra,
    }


def _save(part: str, runs: dict[str, Any], args: argparse.Namespace, what: str) -> None:
    """One part's runs as rows (``tuner`` names the run) in its results file."""
    policy = f"policy num_warmup=1, num_iters={args.iters}, max_configs={args.max_configs}"
    write_results(f"bench_ray_tuning.{part}", [{"tuner": name, **run} for name, run in runs.items()], notes=f"{what}; {policy}; wall_s: tune_unseen's")


# ---------------------------------------------------------------------------- (a) scaling


def _on_local_cluster(resources: dict[str, int], run: Any) -> tuple[Any, float]:
    """``run()`` on a fresh local Ray cluster of ``resources``; its result and ``ray.init``'s seconds."""
    import ray

    start = time.perf_counter()
    ray.init(**resources, include_dashboard=False, log_to_driver=False, logging_level="WARNING", object_store_memory=256 * 2**20)
    init_s = time.perf_counter() - start
    try:
        return run(), init_s
    finally:
        ray.shutdown()


def scaling(args: argparse.Namespace, root: str) -> None:
    from ejlabel.analysis import read_program, tune_unseen

    programs = Path(root) / "programs"
    programs.mkdir()
    _write_programs("tiny", args.seq_lens, programs)
    program = read_program(programs)
    runs: dict[str, Any] = {}
    what = f"the TINY training step's unseen calls on the CPU, seq_len {', '.join(map(str, args.seq_lens))}, batch 2; ray.init apart"
    for n in args.workers:
        report, init_s = _on_local_cluster(
            {"num_cpus": n}, lambda: tune_unseen(program, _selector(root), _policy(args, 1), backend="ray", platform="cpu", workers=n, progress=args.progress)
        )
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
        command += ["--calls-per-task", "auto"]
    proc = subprocess.run(command, capture_output=True, text=True, env={**os.environ, **(env or {})}, timeout=560, check=False)
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(extra)} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1]) if proc.stdout.strip() else {}


def _lowered_program(args: argparse.Namespace, root: str, model: str) -> Path:
    """The directory of ``model``'s training step lowered for (b)'s platform, lowered once."""
    programs = Path(root) / f"program_{model}"
    if not programs.exists():
        programs.mkdir()
        lower_env = {"JAX_PLATFORMS": "cpu" if args.platform == "cpu" else ""}  # "": JAX picks the GPU
        _child(args, "--phase", "lower", "--model", model, "--programs", str(programs), env=lower_env)
    return programs


def _per_task_words(per_task: int | str, calls: int) -> str:
    if per_task == "auto":
        return f"auto ({calls} calls in one task)"
    return f"{per_task} call{'s' if per_task != 1 else ''} per task"


def overhead(args: argparse.Namespace, root: str, one_gpu: dict[str, Any] | None = None) -> None:
    """(b); ``one_gpu``: (c)'s run on one GPU worker, the same calls and policy, which then
    stands for the Ray run of ``calls_per_task="auto"`` instead of running it again."""
    programs = _lowered_program(args, root, args.model)
    cpu_env = {"JAX_PLATFORMS": "cpu"}
    lower_env = {"JAX_PLATFORMS": "cpu" if args.platform == "cpu" else ""}
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
        if per_task == "auto" and one_gpu is not None:
            remote = dict(one_gpu)
        else:
            remote = _child(args, "--phase", "ray", "--programs", str(programs), "--calls-per-task", str(per_task), env=cpu_env)
        if remote["errors"]:
            raise RuntimeError(f"(b) the Ray run could not tune every call: {remote}")
        remote["same_picks"] = sum(remote["picks"].get(k) == v for k, v in local["picks"].items())
        remote["overhead_pct"] = 100 * (remote["wall_s"] / local["wall_s"] - 1)
        runs[f"ray_{per_task}_per_task"] = remote
        lines.append(
            f"| ray, 1 worker, {_per_task_words(per_task, local['calls'])} | {remote['wall_s']:.1f} "
            f"| {remote['overhead_pct']:+.1f}% | {remote['same_picks']}/{len(local['picks'])} | {remote['ray_init_s']} |"
        )
    device = next(iter(runs.values())).get("device", "?") if runs else "?"
    title = (
        f"One program's unseen calls ({args.model} training step, {local['calls']} distinct calls, "
        f"max_configs={args.max_configs}, num_iters={args.iters}) on {device}"
    )
    print("\n".join([title, "", *lines]))
    _save("overhead", {"local": local, **runs}, args, f"the {args.model} training step's unseen calls on {device}, each tuner in a fresh process")


# ---------------------------------------------------------------------------- (c) GPU workers


def gpus(args: argparse.Namespace, root: str) -> dict[str, Any]:
    """(c); its runs by name (``gpu_N``)."""
    from ejlabel.analysis import read_program, tune_unseen

    program = read_program(_lowered_program(args, root, args.model))
    runs: dict[str, Any] = {}
    for n in args.gpus:
        report, init_s = _on_local_cluster(
            {"num_gpus": n},
            lambda: tune_unseen(
                program, _selector(root), _policy(args, 4), backend="ray", modules=["ejlabel.kernels"], platform="gpu",
                workers=n, progress=args.progress,
            ),
        )
        runs[f"gpu_{n}"] = _run_summary(report, workers=n, ray_init_s=round(init_s, 2), device=report.device)
        print(f"ray, {n} GPU workers: {report.summary()}", file=sys.stderr, flush=True)
        _save("gpus", runs, args, f"the {args.model} training step's unseen calls on GPU workers, one per GPU; ray.init apart")
    one = runs.get(f"gpu_{args.gpus[0]}", {})
    lines = [
        f"The {args.model} training step's unseen calls ({one.get('calls', '?')} distinct calls, max_configs={args.max_configs}, "
        f"num_iters={args.iters}) on {one.get('device', '?')}, one Ray worker per GPU",
        "",
        f"| GPU workers | wall s | speed-up vs {args.gpus[0]} | efficiency | same picks | ray.init s |",
        "|---:|---:|---:|---:|---:|---:|",
    ]
    for run in runs.values():
        n = run["workers"]
        speedup = one["wall_s"] / run["wall_s"] * args.gpus[0] if one.get("wall_s") else None
        same = sum(run["picks"].get(k) == v for k, v in one.get("picks", {}).items())
        lines.append(
            f"| {n} | {run['wall_s']:.1f} | {f'{speedup:.2f}x' if speedup else '-'} | {f'{speedup / n:.0%}' if speedup else '-'} "
            f"| {same}/{len(one.get('picks', {}))} | {run['ray_init_s']} |"
        )
    print("\n".join(lines))
    return runs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--scaling", action="store_true", help="run (a) only (with --overhead: both)")
    parser.add_argument("--overhead", action="store_true", help="run (b) only (with --scaling: both)")
    parser.add_argument(
        "--gpus", type=lambda s: [int(x) for x in s.split(",") if x], default=[],
        help="(c) GPU worker counts, e.g. 1,2,4: one Ray worker per GPU (a multi-GPU host)",
    )
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
        "--calls-per-task", type=lambda s: [x if x == "auto" else int(x) for x in s.split(",")], default=["auto"],
        help="(b) one Ray run per value, e.g. auto,1: calls a worker tunes together (auto, one worker: the whole program in one compile pool)",
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
    named = args.scaling or args.overhead or bool(args.gpus)
    # The driver never needs a device: (a) tunes on the CPU, (b) and (c) on workers' GPUs.
    os.environ["JAX_PLATFORMS"] = "cpu"
    with tempfile.TemporaryDirectory() as root:
        if args.scaling or not named:
            scaling(args, root)
        by_gpus = gpus(args, root) if args.gpus else {}
        if args.overhead or not named:
            overhead(args, root, by_gpus.get("gpu_1"))  # (c) tuned the same program with the same policy


if __name__ == "__main__":
    main()
