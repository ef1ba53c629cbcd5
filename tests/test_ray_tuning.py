"""Tuning a program's unseen calls across a local Ray cluster (``tune_unseen(backend="ray")``).

One small cluster serves the whole module. The kernels below live in this module, which the
workers import because the tests name it in ``modules`` (the driver ships it to them); a kernel
whose cost is set by its config checks the picks against a local run, and kernels that kill their
worker or raise check retries, error reports, resumption and that only the driver writes.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import pytest
from ejlabel.analysis import read_program, tune_unseen
from ejlabel.analysis.ray_schedule import calls_per_task_for
from jax import lax
from jaxtyping import Array, Float

from ejlabel import AutotunePolicy, Invocation, Kernel
from ejlabel.config.persistent import PersistentCache
from ejlabel.config.selection import ConfigSelectorChain
from ejlabel.execution.tuning import CandidateResult, Timing, TuneResult
from ejlabel.execution.tuning.remote import result_from_data, result_to_data
from ejlabel.utils.serialize import DecodeError

# The ``ray`` extra (in the test extra, so CI has it); the GPU machine's image lacks it.
ray = pytest.importorskip("ray")

MODULE = __name__
POLICY = AutotunePolicy(num_warmup=1, num_iters=4, compile_workers=2)


@dataclasses.dataclass(frozen=True)
class WorkConfig:
    """``repeat`` rounds of extra work that leave the result unchanged: the cost is ~ repeat."""

    repeat: int = 1


class WorkKernel(Kernel[WorkConfig, jax.Array]):
    """``2 x`` plus ``repeat`` rounds of work that add zero; repeat=1 is the clear winner (400x
    less: with 50x, a 2-core machine also running the rest of the suite once timed the slow
    config faster, its samples of a few microseconds lost to descheduling)."""

    def __init__(self) -> None:
        super().__init__("raywork")

    def run(self, x: Float[Array, "n 64"], *, cfg: WorkConfig) -> Float[Array, "n 64"]:
        def body(i: Any, acc: jax.Array) -> jax.Array:
            gram = jnp.tanh(x.T @ x + i)  # [64, 64]
            return acc + (gram @ gram).sum() * 0.0

        return 2.0 * x + lax.fori_loop(0, cfg.repeat, body, jnp.zeros((), x.dtype))

    def reference(self, x: Float[Array, "n 64"]) -> Float[Array, "n 64"]:
        return 2.0 * x

    def heuristic_cfg(self, inv: Invocation) -> WorkConfig:
        return WorkConfig(400)

    def config_space(self, inv: Invocation) -> list[WorkConfig]:
        return [WorkConfig(400), WorkConfig(1)]


class FaultyKernel(Kernel[WorkConfig, jax.Array]):
    """``2 x``, but listing its candidates on a worker misbehaves as ``mode`` says.

    ``die_once``: the first attempt kills its worker process (the marker file remembers it);
    ``die``: every attempt does; ``raise``: every attempt raises. Each attempt appends the
    worker's cache directory (``EJLABEL_CACHE_DIR``) to the marker file.
    """

    def __init__(self) -> None:
        super().__init__("rayfaulty")

    def run(self, x: Float[Array, "n 64"], *, cfg: WorkConfig, marker: str, mode: str) -> Float[Array, "n 64"]:
        return 2.0 * x

    def heuristic_cfg(self, inv: Invocation) -> WorkConfig:
        return WorkConfig(1)

    def config_space(self, inv: Invocation) -> list[WorkConfig]:
        marker, mode = Path(inv.static_kwargs["marker"]), inv.static_kwargs["mode"]
        first = not marker.exists()
        with marker.open("a") as f:
            f.write(os.environ.get("EJLABEL_CACHE_DIR", "") + "\n")
        if mode == "die" or (mode == "die_once" and first):
            os._exit(3)
        if mode == "raise":
            raise RuntimeError("broken on purpose")
        return [WorkConfig(1), WorkConfig(2)]


work = WorkKernel()
faulty = FaultyKernel()


def _lowered(sizes: tuple[int, ...], faults: dict[str, Path] | None = None) -> Any:
    def step(x: jax.Array) -> jax.Array:
        total = sum(work(x[:n]).sum() for n in sizes)
        for mode, marker in (faults or {}).items():
            total = total + faulty(x[:8], marker=str(marker), mode=mode).sum()
        return total

    return jax.jit(step).lower(jax.ShapeDtypeStruct((max(sizes), 64), jnp.float32))


def _program(sizes: tuple[int, ...], faults: dict[str, Path] | None = None) -> Any:
    return read_program(_lowered(sizes, faults))


@pytest.fixture(scope="module")
def cluster() -> Any:
    # A driver that starts Ray itself ships the modules its workers import (as tune_unseen does
    # when it connects on its own): this file, which defines the kernels. Ray's memory monitor is
    # off in this cluster (its raylet reads the variable when it starts): on a machine loaded by
    # other test processes it would kill a worker of these tests, whose kernels take a few MB, and
    # a call would fail for a reason that is not its own.
    with pytest.MonkeyPatch.context() as env:
        env.setenv("RAY_memory_monitor_refresh_ms", "0")
        ray.init(
            num_cpus=4, num_gpus=0, include_dashboard=False, log_to_driver=False, logging_level="WARNING",
            object_store_memory=100 * 2**20, runtime_env={"py_modules": [__file__]},
        )
    yield
    ray.shutdown()


@pytest.fixture
def worker_cache(tmp_path: Path) -> Path:
    """A cache location the workers are given and must never write to."""
    path = tmp_path / "worker-cache"
    path.mkdir()
    return path


def _tune_on_ray(program: Any, cache: Path, worker_cache: Path, calls_per_task: int = 1) -> Any:
    return tune_unseen(
        program,
        ConfigSelectorChain(persistent=PersistentCache(cache)),
        POLICY,
        backend="ray",
        modules=[MODULE],
        workers=2,
        progress=False,
        runtime_env={"env_vars": {"EJLABEL_CACHE_DIR": str(worker_cache)}},
        calls_per_task=calls_per_task,
    )


def test_ray_picks_the_same_configs_as_a_local_run(cluster: Any, tmp_path: Path, worker_cache: Path) -> None:
    program = _program((8, 16, 24, 32))
    local = tune_unseen(program, ConfigSelectorChain(persistent=PersistentCache(tmp_path / "local")), POLICY, progress=False)
    remote = _tune_on_ray(program, tmp_path / "ray", worker_cache)
    assert not local.errors and not remote.errors
    assert len(remote.results) == 4
    assert remote.tuned == local.tuned == dict.fromkeys(program.labels, WorkConfig(1))
    assert remote.device == local.device
    # Every call names the worker that tuned it (host:pid, node); none is "local".
    assert set(remote.worker_of) == set(remote.results)
    assert all(":" in name and "node" in name for name in remote.worker_of.values())
    stored = PersistentCache(tmp_path / "ray")
    for op_id, call_key in remote.results:
        entry = stored.get_entry(remote.device, op_id, call_key)
        assert entry is not None and entry.config == WorkConfig(1) and entry.provenance == "autotuned"
        assert [c["status"] for c in entry.stats["candidates"]].count("ok") >= 1
    assert list(worker_cache.iterdir()) == []  # only the driver writes


@pytest.mark.slow
def test_a_dead_worker_is_replaced_its_call_retried_and_a_rerun_resumes(cluster: Any, tmp_path: Path, worker_cache: Path) -> None:
    marker = tmp_path / "died"
    program = _program((8, 16), {"die_once": marker})
    # Two calls per task: the first task (a raywork call and the faulty one) dies with its worker,
    # and both of its calls are retried alone.
    report = _tune_on_ray(program, tmp_path / "cache", worker_cache, calls_per_task=2)
    assert report.errors == {}
    assert sorted(report.tuned) == sorted(program.labels) and len(report.results) == 3
    # The first attempt killed its worker; the retry ran with the workers' cache location.
    assert marker.read_text().splitlines() == [str(worker_cache)] * 2
    assert list(worker_cache.iterdir()) == []
    # Rerun from the command line, a new driver of the same cluster: everything is tuned already.
    hlo = tmp_path / "step.hlo.txt"
    hlo.write_text(_lowered((8, 16), {"die_once": marker}).compiler_ir("hlo").as_hlo_text())
    # Imported here: the workers import this module without the tests folder beside it.
    from conftest import subprocess_env

    again = subprocess.run(
        [sys.executable, "-P", "-m", "ejlabel.cli.main", "--cache-dir", str(tmp_path / "cache"), "--import", MODULE,
         "tune", str(hlo), "--ray", ray.get_runtime_context().gcs_address, "--iters", "3"],
        capture_output=True, text=True, timeout=300, env=subprocess_env(), check=False,
    )
    assert again.returncode == 0, again.stderr
    assert "tuned 0 distinct calls (0 labels)" in again.stdout and "3 already tuned; 0 errors" in again.stdout


@pytest.mark.slow
def test_calls_that_fail_twice_are_reported_and_the_others_stored(cluster: Any, tmp_path: Path, worker_cache: Path) -> None:
    raises, dies = tmp_path / "raises", tmp_path / "dies"
    program = _program((8,), {"raise": raises, "die": dies})
    report = _tune_on_ray(program, tmp_path / "cache", worker_cache)
    failed = {label.split("#")[1].split("@")[0] for label in report.errors}
    assert failed == {"rayfaulty"} and len(report.errors) == 2
    reasons = sorted(report.errors.values())
    assert any("RuntimeError: broken on purpose" in r for r in reasons)
    assert any("died" in r for r in reasons)
    assert all("both attempts" in r for r in reasons)
    # Each lists its candidates three times: once planned (two workers share the calls), then
    # tuned twice; the plan that raises or kills its worker leaves the call to be tuned whole.
    assert len(raises.read_text().splitlines()) == 3 and len(dies.read_text().splitlines()) == 3
    [(key, result)] = report.results.items()
    assert key[0].startswith("raywork@") and result.best_cfg == WorkConfig(1)
    assert PersistentCache(tmp_path / "cache").get(report.device, *key) == WorkConfig(1)
    assert list(worker_cache.iterdir()) == []


def test_gpu_tuning_on_a_cluster_without_gpus_is_refused_at_once(cluster: Any) -> None:
    with pytest.raises(ValueError, match="no GPU of type H100"):
        tune_unseen(_program((8,)), backend="ray", platform="gpu", accelerator_type="H100", modules=[MODULE])
    assert ray.is_initialized()  # the test's own connection is left alone


def test_without_ray_the_error_says_how_to_install_it(monkeypatch: pytest.MonkeyPatch) -> None:
    program = _program((8,))
    monkeypatch.setitem(sys.modules, "ray", None)  # what an environment without Ray imports
    with pytest.raises(ImportError, match=r'pip install "ejlabel\[ray\]"'):
        tune_unseen(program, backend="ray", modules=[MODULE])


def test_bad_backend_arguments_are_named() -> None:
    program = _program((8,))
    with pytest.raises(ValueError, match="backend"):
        tune_unseen(program, backend="dask")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="address"):
        tune_unseen(program, address="auto")
    with pytest.raises(ValueError, match="platform"):
        tune_unseen(program, backend="ray", platform="tpu")  # type: ignore[arg-type]


def test_a_lone_worker_gets_every_call_in_one_task_several_get_one_each() -> None:
    assert calls_per_task_for("auto", 7, 1) == 7
    assert calls_per_task_for("auto", 7, 4) == 1
    assert calls_per_task_for("auto", 0, 1) == 1
    assert calls_per_task_for(3, 7, 4) == 3
    for bad in (0, -1, True, 1.5, "all"):
        with pytest.raises(ValueError, match="calls_per_task"):
            calls_per_task_for(bad, 7, 1)  # type: ignore[arg-type]
    # Named before any worker starts, and refused for the local tuner.
    with pytest.raises(ValueError, match="calls_per_task"):
        tune_unseen(_program((8,)), backend="ray", calls_per_task=0)
    with pytest.raises(ValueError, match="calls_per_task"):
        tune_unseen(_program((8,)), calls_per_task=2)


def test_a_tuning_result_travels_as_plain_data_and_comes_back_the_same() -> None:
    candidates = [
        CandidateResult(WorkConfig(1), "ok", None, 0.5, 0.0, Timing([1.0, 1.25, 1.5]), floor=True),
        CandidateResult(WorkConfig(50), "wrong", "relative error inf", 0.4, math.inf, None),
        CandidateResult(WorkConfig(10), "pruned", "slower", 0.3, 1e-7, Timing([9.0, 8.0])),
    ]
    result = TuneResult("raywork@v1", "0123456789abcdef", WorkConfig(1), candidates[0], candidates, 2.0, 1.0)
    data = result_to_data(result)
    assert json.loads(json.dumps(data)) == data  # plain data: configs are JSON text, timings samples
    back = result_from_data(data)
    assert back.best_cfg == WorkConfig(1) and back.best is back.candidates[0]
    fields = lambda c: (c.cfg, c.status, c.reason, c.compile_s, c.error, c.floor, c.timing and c.timing.samples_ms)
    assert [fields(c) for c in back.candidates] == [fields(c) for c in candidates]
    assert back.stats() == result.stats()
    with pytest.raises(DecodeError, match="best"):
        result_from_data({**data, "best": 1})  # a candidate that was never timed cannot win
    with pytest.raises(DecodeError, match="not registered"):
        result_from_data({**data, "candidates": [{**data["candidates"][0], "cfg": '{"$dataclass":"os:Nope","fields":{}}'}]})


def test_the_platform_comes_from_the_program_when_it_says() -> None:
    from ejlabel.analysis.ray_tuning import program_platform

    assert program_platform(_lowered((8,)), []) == "cpu"  # a Lowered knows its backend
    assert program_platform(None, ["d/module_0001.jit_step.sm_9.0_gpu_after_optimizations.txt"]) == "gpu"
    assert program_platform(None, ["d/module_0001.jit_step.cpu_after_optimizations.txt"]) == "cpu"
    assert program_platform(None, ["d/module_0001.jit_step.before_optimizations.txt", "x.hlo"]) is None


def test_a_call_split_across_workers_picks_what_a_local_run_picks(cluster: Any, tmp_path: Path, worker_cache: Path) -> None:
    # One call, two workers: its two candidates are tuned one on each, and the driver merges them.
    program = _program((8,))
    local = tune_unseen(program, ConfigSelectorChain(persistent=PersistentCache(tmp_path / "local")), POLICY, progress=False)
    remote = _tune_on_ray(program, tmp_path / "ray", worker_cache)
    assert not remote.errors and remote.tuned == local.tuned == dict.fromkeys(program.labels, WorkConfig(1))
    [(key, result)] = remote.results.items()
    assert [c.cfg for c in result.candidates] == [c.cfg for c in local.results[key].candidates]  # the call's order
    assert len(remote.worker_of[key].split(", ")) == 2  # both workers tuned a part
    entry = PersistentCache(tmp_path / "ray").get_entry(remote.device, *key)
    assert entry is not None and entry.config == WorkConfig(1) and len(entry.stats["candidates"]) == 2
    assert list(worker_cache.iterdir()) == []


def _candidate(cfg: int, status: str, median: float | None, floor: bool = False) -> CandidateResult:
    timing = Timing([median, median]) if median is not None else None
    return CandidateResult(WorkConfig(cfg), status, None, 0.1, 0.0 if timing else None, timing, floor=floor)


def test_merged_parts_pick_what_one_worker_picks_from_the_same_measurements() -> None:
    from ejlabel.execution.tuning.remote import merge_parts, pick_best

    # One worker's outcome: ranked candidates (ok), one pruned (timed, then dropped), one wrong.
    whole = [
        _candidate(1, "ok", 3.0, floor=True), _candidate(2, "pruned", 1.0), _candidate(3, "ok", 2.0),
        _candidate(4, "wrong", None), _candidate(5, "ok", 2.5),
    ]
    assert pick_best(whole) == 2  # the fastest ranked median; a pruned candidate never wins
    order = [c.cfg for c in whole]
    for parts in ([[whole[0], whole[3]], [whole[4], whole[1], whole[2]]], [[c] for c in reversed(whole)]):
        merged = merge_parts("raywork@v1", "k", order, parts, 1.0, 0.5)
        assert isinstance(merged, TuneResult) and merged.best_cfg == WorkConfig(3)
        assert merged.candidates == whole  # back in the call's order
    failed = merge_parts("raywork@v1", "k", [order[3], order[1]], [[whole[3]], [_candidate(2, "compile_error", None)]], 1.0, 0.5)
    assert "every candidate of raywork@v1 call k failed" in str(failed)
    with pytest.raises(ValueError, match="expected 1"):
        merge_parts("raywork@v1", "k", order, [whole[:2]], 1.0, 0.5)  # the parts must cover the call


def test_tasks_go_longest_first_and_a_long_call_is_split_to_fit_a_worker() -> None:
    from ejlabel.analysis.ray_schedule import Plan, Schedule

    plans = {
        ("matmul", "a"): Plan(("m0", "m1", "m2"), (1.0, 10.0, 10.0)),
        ("attention", "b"): Plan(("a0", "a1", "a2", "a3"), (10.0, 50.0, 50.0, 40.0)),
        ("norm", "c"): Plan(("n0", "n1"), (5.0, 6.0)),
        ("user", "d"): None,  # its plan failed: at the largest known cost, never split
    }
    keys = list(plans)
    one = Schedule(keys, plans, workers=1)
    assert [(t.key[0], t.part) for t in one.next_tasks(4)] == [("attention", None), ("user", None), ("matmul", None), ("norm", None)]
    # Three workers, a share of 260 / 3 each: the attention call (160) is split into the fewest
    # parts balanced by cost that fit a share (two would not: 70 and 100); the call whose plan
    # failed counts the largest known cost; then the rest, longest first.
    three = Schedule(keys, plans, workers=3)
    first, rest = three.next_tasks(3), three.next_tasks(3)
    assert [t.key[0] for t in first + rest] == ["user", "attention", "attention", "attention", "matmul", "norm"]
    assert sorted(t.part for t in first + rest if t.key[0] == "attention") == [(0, 3), (1,), (2,)]
    assert [t.cost for t in first + rest] == [160.0, 60.0, 60.0, 60.0, 22.0, 16.0]
    assert not three


def test_when_workers_would_idle_the_waiting_calls_are_split_across_them() -> None:
    from ejlabel.analysis.ray_schedule import Plan, Schedule

    plans = {
        ("a", "1"): Plan(("x0", "x1", "x2", "x3"), (1.0, 4.0, 4.0, 4.0)),
        ("b", "2"): Plan(("y0", "y1"), (1.0, 2.0)),
        ("c", "3"): Plan(("z0", "z1", "z2"), (1.0, 1.0, 1.0), splittable=False),  # no reference to check parts against
    }
    schedule = Schedule(list(plans), plans, workers=8)
    tasks = schedule.next_tasks(8)
    by_call: dict[str, list[tuple[int, ...]]] = {}
    for task in tasks:
        by_call.setdefault(task.key[0], []).append(task.part or tuple(range(len(plans[task.key].candidates))))
    # Every candidate once; the costliest call split most; the unsplittable one whole.
    assert {k: sorted(i for part in v for i in part) for k, v in by_call.items()} == {"a": [0, 1, 2, 3], "b": [0, 1], "c": [0, 1, 2]}
    assert len(by_call["a"]) == 4 and len(by_call["b"]) == 2 and len(by_call["c"]) == 1
    assert not schedule


def test_one_worker_per_gpu_each_pinned_to_its_gpu() -> None:
    from ejlabel.analysis.ray_tuning import worker_request

    def node(cpus: int, gpus: int = 0, kind: str | None = None, alive: bool = True) -> dict[str, Any]:
        resources = {"CPU": float(cpus), **({"GPU": float(gpus)} if gpus else {}), **({f"accelerator_type:{kind}": 1.0} if kind else {})}
        return {"Alive": alive, "Resources": resources}

    host = [node(64, 4, "H100")]
    assert worker_request(host, "auto", calls=30) == ("gpu", 4, {"num_cpus": 1, "max_restarts": 0, "max_task_retries": 0, "num_gpus": 1})
    assert worker_request(host, "auto", calls=3)[1] == 3  # by default no more workers than calls
    assert worker_request(host, "auto", workers=6, calls=3)[1] == 6  # as asked: parts of calls keep them busy
    mixed = [*host, node(32, 2, "A100"), node(16, 8, "H100", alive=False)]
    platform, count, options = worker_request(mixed, "gpu", accelerator_type="H100")
    assert (platform, count, options["num_gpus"], options["accelerator_type"]) == ("gpu", 4, 1, "H100")
    assert worker_request(mixed, "auto")[1] == 6
    assert worker_request([node(16)], "auto", cpus_per_worker=2) == ("cpu", 8, {"num_cpus": 2, "max_restarts": 0, "max_task_retries": 0})
    assert worker_request(host, "cpu")[:2] == ("cpu", 64)  # a CPU program on a GPU host: CPU workers, no GPU held
    with pytest.raises(ValueError, match="no GPU of type H200"):
        worker_request(host, "gpu", accelerator_type="H200")


def test_a_worker_plans_a_call_as_its_tuner_lists_the_candidates(tmp_path: Path) -> None:
    from ejlabel.execution.tuning.remote import TuningWorker, call_request
    from ejlabel.utils.serialize import from_json

    program = _program((8,), {"raise": tmp_path / "raises"})
    [work_label] = [lab for lab in program.labels if "raywork" in lab]
    [faulty_label] = [lab for lab in program.labels if "rayfaulty" in lab]
    worker = TuningWorker([MODULE])
    work_plan, faulty_plan = worker.plan([call_request(lab, program.descriptions[lab], POLICY) for lab in (work_label, faulty_label)])
    assert work_plan["status"] == "planned" and [from_json(c) for c in work_plan["candidates"]] == [WorkConfig(400), WorkConfig(1)]
    # The loop's body counts: each candidate's program is more than the few operations around it.
    assert len(work_plan["costs"]) == 2 and all(cost > 10 for cost in work_plan["costs"])
    assert work_plan["checked_by_reference"] is True
    assert faulty_plan["status"] == "error" and "broken on purpose" in faulty_plan["error"]
