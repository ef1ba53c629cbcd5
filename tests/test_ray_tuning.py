"""Tuning a program's unseen calls across a local Ray cluster (``tune_unseen(backend="ray")``).

One small cluster serves the whole module. The kernels below live in this module, which the
workers import because the tests name it in ``modules`` (the driver ships it to them); a kernel
whose cost is set by its config checks the picks against a local run, and kernels that kill their
worker or raise check retries, error reports, resumption and that only the driver writes.
"""

from __future__ import annotations

import dataclasses
import os
import sys
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import pytest
import ray
from ejlabel.analysis import read_program, tune_unseen
from jax import lax
from jaxtyping import Array, Float

from ejlabel import AutotunePolicy, Invocation, Kernel
from ejlabel.config.persistent import PersistentCache
from ejlabel.config.selection import ConfigSelectorChain

MODULE = __name__
POLICY = AutotunePolicy(num_warmup=1, num_iters=4, compile_workers=2)


@dataclasses.dataclass(frozen=True)
class WorkConfig:
    """``repeat`` rounds of extra work that leave the result unchanged: the cost is ~ repeat."""

    repeat: int = 1


class WorkKernel(Kernel[WorkConfig, jax.Array]):
    """``2 x`` plus ``repeat`` rounds of work that add zero; repeat=1 is the clear winner (50x less)."""

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
        return WorkConfig(50)

    def config_space(self, inv: Invocation) -> list[WorkConfig]:
        return [WorkConfig(50), WorkConfig(1)]


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


def _program(sizes: tuple[int, ...], faults: dict[str, Path] | None = None) -> Any:
    def step(x: jax.Array) -> jax.Array:
        total = sum(work(x[:n]).sum() for n in sizes)
        for mode, marker in (faults or {}).items():
            total = total + faulty(x[:8], marker=str(marker), mode=mode).sum()
        return total

    return read_program(jax.jit(step).lower(jax.ShapeDtypeStruct((max(sizes), 64), jnp.float32)))


@pytest.fixture(scope="module")
def cluster() -> Any:
    # A driver that starts Ray itself ships the modules its workers import (as tune_unseen does
    # when it connects on its own): this file, which defines the kernels.
    ray.init(
        num_cpus=4, include_dashboard=False, log_to_driver=False, logging_level="WARNING",
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


def _tune_on_ray(program: Any, cache: Path, worker_cache: Path) -> Any:
    return tune_unseen(
        program,
        ConfigSelectorChain(persistent=PersistentCache(cache)),
        POLICY,
        backend="ray",
        modules=[MODULE],
        workers=2,
        progress=False,
        runtime_env={"env_vars": {"EJLABEL_CACHE_DIR": str(worker_cache)}},
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


def test_a_dead_worker_is_replaced_its_call_retried_and_a_rerun_resumes(cluster: Any, tmp_path: Path, worker_cache: Path) -> None:
    marker = tmp_path / "died"
    program = _program((8, 16), {"die_once": marker})
    report = _tune_on_ray(program, tmp_path / "cache", worker_cache)
    assert report.errors == {}
    assert sorted(report.tuned) == sorted(program.labels) and len(report.results) == 3
    # The first attempt killed its worker; the retry ran with the workers' cache location.
    assert marker.read_text().splitlines() == [str(worker_cache)] * 2
    again = _tune_on_ray(program, tmp_path / "cache", worker_cache)
    assert again.results == {} and again.errors == {}
    assert sorted(again.already_seen) == sorted(program.labels)
    assert list(worker_cache.iterdir()) == []


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
    assert len(raises.read_text().splitlines()) == 2 and len(dies.read_text().splitlines()) == 2
    [(key, result)] = report.results.items()
    assert key[0].startswith("raywork@") and result.best_cfg == WorkConfig(1)
    assert PersistentCache(tmp_path / "cache").get(report.device, *key) == WorkConfig(1)
    assert list(worker_cache.iterdir()) == []


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
