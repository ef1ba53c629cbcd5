"""The Ray backend of ``tune_unseen``: a pool of tuning workers across a cluster.

The driver (the process that called ``tune_unseen(..., backend="ray")``) reads the program once,
groups its distinct unseen calls and hands each to :class:`RayTuningPool`, which sends it to one
worker as plain data (:mod:`ejlabel.execution.tuning.remote`) and yields each answer as it
arrives, so that the driver can store it at once: only the driver writes the persistent cache.

Design choices:

* Workers are Ray actors, one per accelerator (``num_gpus=1``, and ``accelerator_type`` when
  given) for GPU tuning, one per ``cpus_per_worker`` CPUs otherwise; each call is one actor task.
  An actor keeps its JAX runtime and compilation caches warm across the calls it tunes, and keeps
  the GPU Ray gave it: plain GPU tasks run each call in a fresh process (Ray's default for GPU
  tasks), which costs a JAX start and a GPU init per call, and a reused task process could be
  handed a different GPU than the one its JAX runtime already opened.
* A call compiles and is timed on the same worker. A GPU executable is compiled for the GPU it
  runs on (XLA's GPU compiler autotunes its own GEMMs on the device, Triton targets its compute
  capability), so compiling on CPU workers would mean shipping executables and compiling for a
  device the compiling machine does not have; the tuner already overlaps compiles of a call's
  candidates in a thread pool on the worker's CPUs.
* Retries are counted per call by the driver: a call whose worker dies (the process exits or its
  node is lost) or whose task raises is sent once more, to another worker when one is idle; a
  dead worker is replaced by a fresh one. After the second failure the call is reported with the
  reason. A call whose candidates all fail is a tuning outcome (as in a local run), not retried.
* Granularity: one call per task by default, so answers stream in and a lost worker costs one
  call. A worker compiles one task's candidates at a time, so calls with fewer candidates than
  the policy's compile threads leave threads idle that a local run (one pool for every call)
  keeps busy; ``calls_per_task`` > 1 tunes several calls in one pool (one GPU, few candidates).
* Order: the calls wait in one queue, round-robin over kernels at first, then the kernels whose
  calls took longest so far first (:class:`_Queue`), so that a long call rarely starts last and
  keeps one worker busy while the others idle.
* Which device: ``platform="auto"`` takes the one the program says it was compiled for (an XLA
  dump's ``*gpu_after_optimizations*`` / ``*cpu_after_optimizations*`` files, a ``Lowered``'s
  backend), else GPUs when the cluster has any, else CPUs. The driver's own JAX backend is never
  started for this (on a one-GPU machine it would take the memory the worker needs). CPU
  workers get ``JAX_PLATFORMS=cpu``, so a CPU tuning run never takes a GPU of a GPU node. The configs are stored under the device
  fingerprint the workers report, which on a cluster of one accelerator kind is the driver's
  for a GPU it does not have: pin ``accelerator_type`` on a mixed cluster.
* The user's kernels reach the workers by the module names the user gave (``modules``): each
  worker imports exactly those. When the pool connects to the cluster itself, modules that live
  outside an installed distribution (a project's own files) are shipped in the job's Ray
  runtime environment (``py_modules``); a driver that called ``ray.init`` itself passes them in
  its own ``runtime_env``. Installed packages must be installed on the cluster, as ejlabel
  itself must.

``ray`` is imported only here, when the Ray backend is asked for.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import itertools
import math
import statistics
import sys
import sysconfig
import warnings
from collections.abc import Iterable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any, Self

from ejlabel.execution.tuning.remote import TuningWorker

__all__ = ["RayTuningPool", "import_ray", "program_platform"]

Key = tuple[str, str]
_INSTALL_HINT = 'pip install "ejlabel[ray]"'
_ATTEMPTS = 2  # the first try and one retry


def import_ray() -> Any:
    """The ``ray`` module, or an ImportError that says how to install it."""
    try:
        import ray
    except ImportError as err:
        raise ImportError(f'backend="ray" needs Ray, which is not installed: {_INSTALL_HINT}') from err
    return ray


def program_platform(x: Any, sources: Sequence[str]) -> str | None:
    """``"gpu"`` or ``"cpu"`` when the program says what it was compiled for, else None.

    ``x`` is what the user passed; ``sources`` are the files its modules were read from.
    """
    lowering = getattr(x, "_lowering", None)  # a Lowered keeps the backend it lowered for
    backend = getattr(lowering, "compile_args", {}).get("backend") if lowering is not None else None
    platform = str(getattr(backend, "platform", "")).lower()
    if platform in ("cuda", "rocm", "gpu"):
        return "gpu"
    if platform == "cpu":
        return "cpu"
    names = [Path(s).name for s in sources]
    if any("gpu_after_optimizations" in n for n in names):
        return "gpu"
    if any("cpu_after_optimizations" in n for n in names):
        return "cpu"
    return None


def _installed_roots() -> list[Path]:
    paths = sysconfig.get_paths()
    roots = {paths[k] for k in ("purelib", "platlib", "stdlib", "platstdlib") if k in paths}
    roots |= {p for p in sys.path if p.rstrip("/").endswith(("site-packages", "dist-packages"))}
    return [Path(r).resolve() for r in roots]


def _modules_to_ship(modules: Sequence[str]) -> list[str]:
    """Paths of the top-level packages (or single-file modules) of ``modules`` that are not
    installed, to ship to the workers; installed ones (and ejlabel) must be on the cluster."""
    roots, shipped = _installed_roots(), {}
    for name in modules:
        top = name.split(".")[0]
        module = sys.modules.get(top)
        where = getattr(module, "__file__", None)
        if module is None or top == "ejlabel" or where is None:
            continue
        path = Path(where).resolve()
        if any(path.is_relative_to(root) for root in roots):
            continue
        package_dirs = list(getattr(module, "__path__", []))
        shipped[top] = str(Path(package_dirs[0]).resolve()) if len(package_dirs) == 1 else str(path)
    return list(shipped.values())


def _holds_a_gpu() -> bool:
    """Whether this process's JAX runtime has a GPU backend (importing kernels starts it)."""
    from jax.extend import backend

    return any(name in ("cuda", "rocm", "gpu") for name in backend.backends())


class _RayWorker(TuningWorker):
    """A :class:`TuningWorker` that knows its cluster node (the Ray actor's class).

    It imports the library's kernels, then the user's ``modules``, as the command line does.
    """

    def __init__(self, modules: Sequence[str]) -> None:
        import ray

        super().__init__(["ejlabel.kernels", *modules], node=ray.get_runtime_context().get_node_id())


@dataclasses.dataclass
class _Worker:
    handle: Any
    name: str | None = None  # host:pid (node), once it has answered


class RayTuningPool:
    """Tuning workers on a Ray cluster; ``tune`` yields each call's answer as it arrives.

    Args:
      address: the cluster (``ray.init``'s address: None starts or finds one as ``ray.init()``
        does, ``"auto"`` an existing local one, ``"ray://host:10001"`` a remote one). A driver
        already connected (``ray.is_initialized()``) keeps its connection.
      modules: module names every worker imports (the user's kernels).
      platform: ``"gpu"``, ``"cpu"``, or ``"auto"``: GPUs when the cluster has any.
      accelerator_type: Ray's accelerator type to tune on (``"H100"``), GPU only.
      workers: how many workers at most (default: one per free GPU or ``cpus_per_worker`` CPUs).
      calls: how many calls there are to tune (no more workers are started).
      cpus_per_worker: CPUs each worker reserves.
      runtime_env: extra Ray runtime environment for the workers (``pip``, ``env_vars``...).
    """

    def __init__(
        self,
        *,
        address: str | None = None,
        modules: Sequence[str] = (),
        platform: str = "auto",
        accelerator_type: str | None = None,
        workers: int | None = None,
        calls: int | None = None,
        cpus_per_worker: float = 1,
        runtime_env: Mapping[str, Any] | None = None,
    ) -> None:
        if platform not in ("auto", "cpu", "gpu"):
            raise ValueError(f"platform: expected 'auto', 'cpu' or 'gpu', got {platform!r}")
        if accelerator_type is not None and platform == "cpu":
            raise ValueError("accelerator_type: only applies to GPU tuning, not platform='cpu'")
        if workers is not None and (not isinstance(workers, int) or workers < 1):
            raise ValueError(f"workers: expected None or an int >= 1, got {workers!r}")
        if not cpus_per_worker > 0:
            raise ValueError(f"cpus_per_worker: expected a number > 0, got {cpus_per_worker!r}")
        self._ray = ray = import_ray()
        self.modules = list(modules)
        self.platform = platform
        self._workers: list[_Worker] = []
        self._owns_ray = not ray.is_initialized()
        if self._owns_ray:
            # Local files reach the workers only through the job's runtime environment.
            shipped = _modules_to_ship(self.modules)
            job_env = {"py_modules": shipped} if shipped else None
            ray.init(address=address, runtime_env=job_env, log_to_driver=False, logging_level="WARNING")
        try:
            identity = self._start_workers(accelerator_type, workers, calls, cpus_per_worker, runtime_env)
        except BaseException:
            self.close()  # and Ray, when this pool started it
            raise
        #: The device fingerprint the workers tune for (the first to start says): the key of
        #: their configs in the cache. Each answer names its own device, which it is stored under.
        self.device: str = identity["device"]
        if self.platform == "gpu" and identity.get("node") == ray.get_runtime_context().get_node_id() and _holds_a_gpu():
            warnings.warn(
                "this process holds a GPU of the node its GPU workers run on (JAX reserves most of a GPU's memory "
                "when it starts); run the driver with JAX_PLATFORMS=cpu: it needs no accelerator",
                stacklevel=3,
            )

    # ------------------------------------------------------------------ the pool

    def _start_workers(
        self, accelerator_type: str | None, workers: int | None, calls: int | None, cpus_per_worker: float,
        runtime_env: Mapping[str, Any] | None,
    ) -> dict[str, Any]:
        """Start the workers; the identity of the first one up."""
        ray = self._ray
        if self.platform == "auto":  # decided by the cluster, never by starting this process's GPU
            has_gpus = any(n["Resources"].get("GPU", 0) > 0 for n in ray.nodes() if n.get("Alive"))
            self.platform = "gpu" if has_gpus or accelerator_type is not None else "cpu"
        slots = self._slots(accelerator_type, cpus_per_worker)
        count = slots if workers is None else workers
        count = max(1, count if calls is None else min(count, calls))
        options: dict[str, Any] = {"num_cpus": cpus_per_worker, "max_restarts": 0, "max_task_retries": 0}
        if self.platform == "gpu":
            options["num_gpus"] = 1
            if accelerator_type is not None:
                options["accelerator_type"] = accelerator_type
        options["runtime_env"] = self._runtime_env(runtime_env)
        self._actor = ray.remote(_RayWorker).options(**options)
        self._replacements_left = 2 * count
        self._workers = [self._start() for _ in range(count)]
        return self._first_identity()

    def _slots(self, accelerator_type: str | None, cpus_per_worker: float) -> int:
        nodes = [n for n in self._ray.nodes() if n.get("Alive")]
        if self.platform == "cpu":
            slots = sum(int(n["Resources"].get("CPU", 0) // cpus_per_worker) for n in nodes)
            if slots < 1:
                raise ValueError(f"the Ray cluster has no node with {cpus_per_worker} free CPUs for a tuning worker")
            return slots
        wanted = None if accelerator_type is None else f"accelerator_type:{accelerator_type}"
        slots = sum(int(n["Resources"].get("GPU", 0)) for n in nodes if wanted is None or wanted in n["Resources"])
        if slots < 1:
            kinds = sorted({k.partition(":")[2] for n in nodes for k in n["Resources"] if k.startswith("accelerator_type:")})
            where = f" of type {accelerator_type} (the cluster has: {', '.join(kinds) or 'no typed accelerators'})" if wanted else ""
            raise ValueError(f"GPU tuning asked for, but the Ray cluster has no GPU{where}; start GPU workers or tune with platform='cpu'")
        return slots

    def _runtime_env(self, extra: Mapping[str, Any] | None) -> dict[str, Any]:
        env = dict(extra or {})
        # "" lets JAX pick the GPU; a driver running with JAX_PLATFORMS=cpu must not pass that on.
        platform_vars = {"JAX_PLATFORMS": "cpu" if self.platform == "cpu" else ""}
        env["env_vars"] = {**platform_vars, **dict(env.get("env_vars") or {})}
        return env

    def _start(self) -> _Worker:
        return _Worker(self._actor.remote(self.modules))

    def _first_identity(self) -> dict[str, Any]:
        """The identity of the first worker up; the others keep starting meanwhile."""
        ray = self._ray
        pending = {w.handle.identity.remote(): w for w in self._workers}
        [ref], _ = ray.wait(list(pending), num_returns=1)
        try:
            identity = ray.get(ref)
        except ray.exceptions.RayError as err:
            raise RuntimeError(
                f"a tuning worker could not start ({_reason(err)}); every worker must be able to import "
                f"ejlabel and {self.modules or 'no user modules'}"
            ) from None
        pending[ref].name = identity["name"]
        return identity

    @property
    def size(self) -> int:
        return len(self._workers)

    def tune(self, requests: Mapping[Key, dict[str, Any]], calls_per_task: int = 1) -> Iterator[tuple[Key, dict[str, Any]]]:
        """Send every request; yield ``(key, answer)`` as each call finishes, retried or not.

        ``answer`` is a worker's answer (:meth:`TuningWorker.tune`) with ``"attempts"`` added, or
        ``{"status": "error", "error": ..., "worker": ..., "attempts": ...}`` for a call that
        failed twice (its task raised, or its worker died). With ``calls_per_task`` > 1 a worker
        tunes that many calls together (one compile pool, as a local run), and their answers
        arrive together; the calls of a task that fails are each retried alone, twice at most.
        """
        if not isinstance(calls_per_task, int) or calls_per_task < 1:
            raise ValueError(f"calls_per_task: expected an int >= 1, got {calls_per_task!r}")
        ray = self._ray
        queue = _Queue(requests)
        attempts: collections.Counter[Key] = collections.Counter()  # tries of a call on its own
        idle = collections.deque(self._workers)
        running: dict[Any, tuple[list[Key], _Worker]] = {}
        warned = False
        while queue or running:
            while queue and idle:
                batch, worker = queue.pop_batch(calls_per_task), idle.popleft()
                if len(batch) == 1:
                    attempts[batch[0]] += 1
                running[worker.handle.tune_many.remote([requests[key] for key in batch])] = (batch, worker)
            if not running:  # calls left, but no worker could be (re)started
                for key in queue:
                    yield key, {"status": "error", "error": "no tuning worker left: every worker died", "worker": None, "attempts": attempts[key]}
                return
            [ref], _ = ray.wait(list(running), num_returns=1)
            batch, worker = running.pop(ref)
            try:
                answers = ray.get(ref)
                if not isinstance(answers, list) or len(answers) != len(batch):
                    raise ValueError(f"the worker gave {len(answers) if isinstance(answers, list) else 'no'} answers for {len(batch)} calls")
            except ray.exceptions.RayTaskError as err:  # the task raised; the worker lives on
                idle.append(worker)
                failure = _reason(err)
            except ray.exceptions.RayError as err:  # the worker died (or its node): replace it
                failure = f"the tuning worker {worker.name or ''} died: {_reason(err)}".replace("  ", " ")
                self._replace(worker, idle)
            except ValueError as err:
                idle.append(worker)
                failure = str(err)
            else:
                idle.append(worker)
                for key, answer in zip(batch, answers):
                    worker.name = answer.get("worker") or worker.name
                    queue.took(key[0], answer)
                    if answer.get("device", self.device) != self.device and not warned:
                        warned = True
                        warnings.warn(
                            f"worker {worker.name} tunes on {answer['device']}, not {self.device}; its configs are "
                            "stored under its own device: pass accelerator_type to tune for one kind",
                            stacklevel=2,
                        )
                    yield key, {**answer, "attempts": max(attempts[key], 1)}
                continue
            for key in reversed(batch):
                if attempts[key] < _ATTEMPTS:
                    # Retried alone and first; by another worker when one is idle (this one went to the back).
                    queue.retry(key)
                else:
                    yield key, {"status": "error", "error": failure, "worker": worker.name, "attempts": attempts[key]}

    def _replace(self, dead: _Worker, idle: collections.deque[_Worker]) -> None:
        self._workers.remove(dead)
        with contextlib.suppress(Exception):  # already gone
            self._ray.kill(dead.handle)
        if self._replacements_left > 0:
            self._replacements_left -= 1
            fresh = self._start()
            self._workers.append(fresh)
            idle.append(fresh)

    def close(self) -> None:
        """Stop the workers, and Ray itself when this pool started it."""
        for worker in self._workers:
            with contextlib.suppress(Exception):  # already gone
                self._ray.kill(worker.handle)
        self._workers = []
        if self._owns_ray and self._ray.is_initialized():
            self._ray.shutdown()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class _Queue:
    """The calls waiting for a worker, longest expected first, so that no long call starts last.

    Nothing says in advance how long a call takes to tune (mostly compiling: it depends on the
    kernel far more than on the shapes), so the queue starts round-robin over the kernels (op
    ids), which samples every kernel in the first wave, and then orders the rest by the mean time
    the calls of their kernel took so far, kernels not seen yet first. Retries go to the front.
    """

    def __init__(self, keys: Iterable[Key]) -> None:
        by_op: dict[str, list[Key]] = collections.defaultdict(list)
        for key in keys:
            by_op[key[0]].append(key)
        waves = itertools.zip_longest(*by_op.values())
        self._waiting = [key for wave in waves for key in wave if key is not None]
        self._retries: collections.deque[Key] = collections.deque()
        self._took: dict[str, list[float]] = collections.defaultdict(list)

    def __bool__(self) -> bool:
        return bool(self._waiting or self._retries)

    def __iter__(self) -> Iterator[Key]:
        return iter([*self._retries, *self._waiting])

    def pop_batch(self, size: int) -> list[Key]:
        """The next retry alone, else the next ``size`` waiting calls."""
        if self._retries:
            return [self._retries.popleft()]
        batch, self._waiting = self._waiting[:size], self._waiting[size:]
        return batch

    def retry(self, key: Key) -> None:
        self._retries.appendleft(key)

    def took(self, op_id: str, answer: dict[str, Any]) -> None:
        """Learn from a finished call how long its kernel's calls take; reorder the rest."""
        wall = (answer.get("result") or {}).get("wall_s")
        if not isinstance(wall, (int, float)):
            return
        self._took[op_id].append(float(wall))
        expected = {op: statistics.fmean(times) for op, times in self._took.items()}
        self._waiting.sort(key=lambda key: -expected.get(key[0], math.inf))  # stable: ties keep their order


def _reason(err: BaseException) -> str:
    """One line: the original exception of a failed task, else the error's last line."""
    cause = getattr(err, "cause", None)
    if isinstance(cause, BaseException) and cause is not err:
        text = f"{type(cause).__name__}: {cause}"
    else:
        lines = [line.strip() for line in str(err).splitlines() if line.strip()]
        text = lines[-1] if lines else type(err).__name__
    return text.splitlines()[0][:500] if text else type(err).__name__
