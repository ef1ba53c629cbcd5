"""The Ray backend of ``tune_unseen``: a pool of tuning workers across a cluster.

The driver (the process that called ``tune_unseen(..., backend="ray")``) reads the program once,
groups its distinct unseen calls and hands each to :class:`RayTuningPool`, which sends it to one
worker as plain data (:mod:`ejlabel.execution.tuning.remote`) and yields each answer as it
arrives, so that the driver can store it at once: only the driver writes the persistent cache.

Design choices:

* Workers are Ray actors, one per accelerator (``num_gpus=1``, and ``accelerator_type`` when
  given: Ray gives each its own GPU and sets its ``CUDA_VISIBLE_DEVICES``, so on a host of four
  GPUs four workers tune side by side) for GPU tuning, one per ``cpus_per_worker`` CPUs
  otherwise (:func:`worker_request`); each call, or part of a call, is one actor task.
  An actor keeps its JAX runtime and compilation caches warm across the calls it tunes, and keeps
  the GPU Ray gave it: plain GPU tasks run each call in a fresh process (Ray's default for GPU
  tasks), which costs a JAX start and a GPU init per call, and a reused task process could be
  handed a different GPU than the one its JAX runtime already opened.
* A call compiles and is timed on the same worker. A GPU executable is compiled for the GPU it
  runs on (XLA's GPU compiler autotunes its own GEMMs on the device, Triton targets its compute
  capability), so compiling on CPU workers would mean shipping executables and compiling for a
  device the compiling machine does not have; the tuner already overlaps compiles of a call's
  candidates in a thread pool on the worker's CPUs.
* Retries are counted per task by the driver: a call (or part) whose worker dies (the process
  exits or its node is lost) or whose task raises is sent once more, to another worker when one
  is idle; a dead worker is replaced by a fresh one. After the second failure the call is
  reported with the reason. A worker that died before it ever came up (its process could not
  start, as on a loaded machine) costs the task no attempt: the task never ran. A call whose
  candidates all fail is a tuning outcome (as in a local run), not retried.
* Granularity: a worker compiles one task's candidates at a time, so a task of one call with
  fewer candidates than the policy's compile threads leaves threads idle that a local run (one
  pool for every call) keeps busy. ``calls_per_task="auto"`` (the default) sends a lone worker
  every call in one task, one pool as a local run (nothing to balance, and no compile thread
  idles while another call's candidates wait); with several workers, one call per task, so
  answers stream in, the schedule below balances the workers, and a lost worker costs one call.
  An int sets the calls per task whatever the workers.
* Order and splitting (:mod:`.ray_schedule`): with more than one worker, the workers first plan
  the calls between them (each call's candidates as the workers' device lists them, each with
  an estimated cost), then the calls go out longest first; a call that costs more than a
  worker's share, or that waits while workers idle, is split into parts of its candidates, one
  task each, and the driver merges the parts' results (the winner as one worker picks it).
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
import math
import sys
import sysconfig
import warnings
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any, Literal, Self

from ejlabel.execution.tuning.candidates import AutotuneError
from ejlabel.execution.tuning.remote import TuningWorker, candidates_from_data, merge_parts, result_to_data
from ejlabel.utils.serialize import from_json

from .ray_schedule import Plan, Schedule, Task, calls_per_task_for

__all__ = ["RayTuningPool", "import_ray", "program_platform", "worker_request"]

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


def worker_request(
    nodes: Sequence[Mapping[str, Any]],
    platform: str,
    accelerator_type: str | None = None,
    workers: int | None = None,
    calls: int | None = None,
    cpus_per_worker: float = 1,
) -> tuple[str, int, dict[str, Any]]:
    """``(platform, count, actor options)``: the workers to start on a cluster of ``nodes``.

    ``nodes`` as ``ray.nodes()`` gives them. ``platform="auto"`` is GPU when a live node has a
    GPU (or ``accelerator_type`` names one), else CPU. GPU workers reserve one GPU each
    (``num_gpus=1``: Ray gives each its own and sets its ``CUDA_VISIBLE_DEVICES``), one per GPU
    of the cluster (of ``accelerator_type`` when given); CPU workers ``cpus_per_worker`` CPUs
    each, as many as fit. By default no more workers than ``calls``; an explicit ``workers`` is
    started as asked (parts of calls keep more workers than calls busy). ValueError when the
    cluster has no room for one.
    """
    alive = [n for n in nodes if n.get("Alive")]
    if platform == "auto":  # decided by the cluster, never by starting this process's GPU
        has_gpus = any(n["Resources"].get("GPU", 0) > 0 for n in alive)
        platform = "gpu" if has_gpus or accelerator_type is not None else "cpu"
    if platform == "cpu":
        slots = sum(int(n["Resources"].get("CPU", 0) // cpus_per_worker) for n in alive)
        if slots < 1:
            raise ValueError(f"the Ray cluster has no node with {cpus_per_worker} free CPUs for a tuning worker")
    else:
        wanted = None if accelerator_type is None else f"accelerator_type:{accelerator_type}"
        slots = sum(int(n["Resources"].get("GPU", 0)) for n in alive if wanted is None or wanted in n["Resources"])
        if slots < 1:
            kinds = sorted({k.partition(":")[2] for n in alive for k in n["Resources"] if k.startswith("accelerator_type:")})
            where = f" of type {accelerator_type} (the cluster has: {', '.join(kinds) or 'no typed accelerators'})" if wanted else ""
            raise ValueError(f"GPU tuning asked for, but the Ray cluster has no GPU{where}; start GPU workers or tune with platform='cpu'")
    count = workers if workers is not None else (slots if calls is None else min(slots, calls))
    options: dict[str, Any] = {"num_cpus": cpus_per_worker, "max_restarts": 0, "max_task_retries": 0}
    if platform == "gpu":
        options["num_gpus"] = 1
        if accelerator_type is not None:
            options["accelerator_type"] = accelerator_type
    return platform, max(1, count), options


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
    ready: Any = None  # the reference of its identity, answered once it is up
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
      workers: how many workers (default: one per GPU, or per ``cpus_per_worker`` CPUs, and no
        more than ``calls``).
      calls: how many calls there are to tune (by default no more workers are started).
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
        self.platform, count, options = worker_request(self._ray.nodes(), self.platform, accelerator_type, workers, calls, cpus_per_worker)
        options["runtime_env"] = self._runtime_env(runtime_env)
        self._actor = self._ray.remote(_RayWorker).options(**options)
        self._replacements_left = 3 * count  # bounded: workers that keep dying must not be replaced forever
        self._workers = [self._start() for _ in range(count)]
        return self._first_identity()

    def _runtime_env(self, extra: Mapping[str, Any] | None) -> dict[str, Any]:
        env = dict(extra or {})
        # "" lets JAX pick the GPU; a driver running with JAX_PLATFORMS=cpu must not pass that on.
        platform_vars = {"JAX_PLATFORMS": "cpu" if self.platform == "cpu" else ""}
        env["env_vars"] = {**platform_vars, **dict(env.get("env_vars") or {})}
        return env

    def _start(self) -> _Worker:
        handle = self._actor.remote(self.modules)
        return _Worker(handle, handle.identity.remote())

    def _first_identity(self) -> dict[str, Any]:
        """The identity of the first worker up; the others keep starting meanwhile."""
        ray = self._ray
        pending = {w.ready: w for w in self._workers}
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

    def _came_up(self, worker: _Worker) -> bool:
        """Whether ``worker`` ever answered its identity (it was up before it died)."""
        if worker.name is not None:
            return True
        ray = self._ray
        done, _ = ray.wait([worker.ready], num_returns=1, timeout=0)
        if not done:
            return False
        try:
            ray.get(worker.ready)
        except ray.exceptions.RayError:
            return False
        return True

    @property
    def size(self) -> int:
        return len(self._workers)

    def plans(self, requests: Mapping[Key, dict[str, Any]]) -> dict[Key, Plan | None]:
        """Each call's plan (None where none came), the calls shared out between the workers up
        already: one still starting would hold up every other's first call."""
        ray, keys = self._ray, list(requests)
        up = [w for w in self._workers if w.name is not None or ray.wait([w.ready], num_returns=1, timeout=0)[0]]
        up = up or self._workers[:1]
        chunks = [keys[n :: len(up)] for n in range(len(up))]
        asked = {
            worker.handle.plan.remote([requests[key] for key in chunk]): (chunk, worker)
            for worker, chunk in zip(up, chunks) if chunk
        }
        plans: dict[Key, Plan | None] = {}
        for ref, (chunk, worker) in asked.items():
            try:
                answers = ray.get(ref)
            except ray.exceptions.RayTaskError:
                continue  # those calls go whole; their tuning says what is wrong
            except ray.exceptions.RayError:
                self._replace(worker, collections.deque())
                continue
            for key, answer in zip(chunk, answers if isinstance(answers, list) else []):
                plans[key] = _plan_from_answer(answer)
        return plans

    def tune(self, requests: Mapping[Key, dict[str, Any]], calls_per_task: int | Literal["auto"] = "auto") -> Iterator[tuple[Key, dict[str, Any]]]:
        """Send every request; yield ``(key, answer)`` as each call finishes, retried or not.

        ``answer`` is a worker's answer (:meth:`TuningWorker.tune`) with ``"attempts"`` added
        (for a split call, the merge of its parts' answers, ``worker`` naming each worker), or
        ``{"status": "error", "error": ..., "worker": ..., "attempts": ...}`` for a call that
        failed twice (its task raised, or its worker died). With ``calls_per_task`` > 1 a worker
        tunes that many calls together (one compile pool, as a local run), and their answers
        arrive together; the calls of a task that fails are each retried alone, twice at most.
        ``"auto"``: every call in one task for a lone worker, else one. Calls are planned,
        ordered and split (:mod:`.ray_schedule`) only with one call per task and more than one
        worker.
        """
        calls_per_task = calls_per_task_for(calls_per_task, len(requests), self.size)
        ray = self._ray
        plans = self.plans(requests) if calls_per_task == 1 and self.size > 1 else {}
        schedule = Schedule(list(requests), plans, self.size)
        attempts: collections.Counter[Task] = collections.Counter()  # tries of a task on its own
        gathered: dict[Key, list[tuple[Task, dict[str, Any]]]] = collections.defaultdict(list)  # parts answered
        done: set[Key] = set()
        idle = collections.deque(self._workers)
        running: dict[Any, tuple[list[Task], _Worker]] = {}
        warned = False
        while schedule or running:
            while schedule and idle:
                batches = [schedule.pop_batch(calls_per_task)] if calls_per_task > 1 else [[t] for t in schedule.next_tasks(len(idle))]
                for batch in batches:
                    worker = idle.popleft()
                    if len(batch) == 1:
                        attempts[batch[0]] += 1
                    sent = [self._request(requests[task.key], plans.get(task.key), task) for task in batch]
                    running[worker.handle.tune_many.remote(sent)] = (batch, worker)
            if not running:  # calls left, but no worker could be (re)started
                for key in dict.fromkeys(task.key for task in schedule):
                    if key not in done:
                        yield key, {"status": "error", "error": "no tuning worker left: every worker died", "worker": None, "attempts": 0}
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
                if len(batch) == 1 and not self._came_up(worker):
                    attempts[batch[0]] -= 1  # it never ran: its worker could not start
                self._replace(worker, idle)
            except ValueError as err:
                idle.append(worker)
                failure = str(err)
            else:
                idle.append(worker)
                for task, answer in zip(batch, answers):
                    worker.name = answer.get("worker") or worker.name
                    if answer.get("device", self.device) != self.device and not warned:
                        warned = True
                        warnings.warn(
                            f"worker {worker.name} tunes on {answer['device']}, not {self.device}; its configs are "
                            "stored under its own device: pass accelerator_type to tune for one kind",
                            stacklevel=2,
                        )
                    if task.key in done:
                        continue
                    if task.part is not None:
                        gathered[task.key].append((task, answer))
                        answer = self._merged(task.key, plans[task.key], gathered[task.key])  # type: ignore[arg-type]
                        if answer is None:
                            continue  # parts still out
                        answer["attempts"] = max(attempts[t] for t, _ in gathered.pop(task.key))
                    done.add(task.key)
                    yield task.key, {"attempts": max(attempts[task], 1), **answer}
                continue
            for task in reversed(batch):
                if attempts[task] < _ATTEMPTS:
                    # Retried alone and first; by another worker when one is idle (this one went to the back).
                    schedule.retry(task)
                elif task.key not in done:
                    done.add(task.key)
                    schedule.drop(task.key)
                    yield task.key, {"status": "error", "error": failure, "worker": worker.name, "attempts": attempts[task]}

    @staticmethod
    def _request(request: dict[str, Any], plan: Plan | None, task: Task) -> dict[str, Any]:
        if task.part is None or plan is None:
            return request
        return {**request, "configs": [plan.candidates[i] for i in task.part]}

    @staticmethod
    def _merged(key: Key, plan: Plan, parts: list[tuple[Task, dict[str, Any]]]) -> dict[str, Any] | None:
        """The call's answer once every part of it answered (None before): its parts' candidates
        merged, the winner picked as one worker would (:func:`merge_parts`)."""
        if sum(len(task.part or ()) for task, _ in parts) < len(plan.candidates):
            return None
        workers = ", ".join(dict.fromkeys(str(answer.get("worker") or "?") for _, answer in parts))
        try:
            for _, answer in parts:
                if answer.get("status") != "part":
                    raise ValueError(f"expected a part's answer, got status {answer.get('status')!r}")
            order = [from_json(text) for text in plan.candidates]
            merged = merge_parts(
                key[0], key[1], order, [candidates_from_data(answer) for _, answer in parts],
                max(float(answer.get("wall_s") or 0.0) for _, answer in parts),
                max(float(answer.get("measure_s") or 0.0) for _, answer in parts),
            )
        except (ValueError, TypeError) as err:  # DecodeError is a ValueError
            return {"status": "error", "error": f"the parts of this call could not be merged: {err}", "worker": workers}
        if isinstance(merged, AutotuneError):
            return {"status": "failed", "error": str(merged), "worker": workers}
        first = parts[0][1]
        return {
            "status": "tuned", "result": result_to_data(merged), "device": first.get("device"),
            "kernel_version": first.get("kernel_version"), "worker": workers,
        }

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


def _plan_from_answer(answer: Any) -> Plan | None:
    """A worker's plan of one call, or None when it gave none (that call then goes whole)."""
    if not isinstance(answer, dict) or answer.get("status") != "planned":
        return None
    try:
        candidates, costs = answer["candidates"], answer["costs"]
        if not all(isinstance(c, str) for c in candidates) or not all(isinstance(c, (int, float)) and math.isfinite(c) for c in costs):
            return None
        return Plan(tuple(candidates), tuple(float(c) for c in costs), bool(answer.get("checked_by_reference")))
    except (KeyError, TypeError, ValueError):
        return None


def _reason(err: BaseException) -> str:
    """One line: the original exception of a failed task, else the error's last line."""
    cause = getattr(err, "cause", None)
    if isinstance(cause, BaseException) and cause is not err:
        text = f"{type(cause).__name__}: {cause}"
    else:
        lines = [line.strip() for line in str(err).splitlines() if line.strip()]
        text = lines[-1] if lines else type(err).__name__
    return text.splitlines()[0][:500] if text else type(err).__name__
