"""Ahead-of-time tuning of every unseen kernel call of a program, from the program alone.

``tune_unseen(x)`` finds the labels in ``x`` that have no tuned config, rebuilds each call's
:class:`~ejlabel.Invocation` from the call description the program carries next to the label,
tunes them all in one batch (every candidate of every call compiles in one pool), and writes the
winners to the persistent cache. ``x`` can be a dump written on another machine: nothing of the
model is imported, only the kernels the descriptions name. Labels and descriptions come from one
reading of ``x`` (:class:`~ejlabel.analysis.Program`), the same the audit and the graph see.

``backend="ray"`` tunes the same calls across a Ray cluster (:mod:`.ray_tuning`): each distinct
call goes to a worker as plain data (its label and description text, the policy's fields), the
workers answer with plain data, and this process, the driver, stores each winner as it arrives,
so the persistent cache has one writer and an interrupted run loses nothing already tuned.
Rerunning skips what is tuned already, on either backend.
"""

from __future__ import annotations

import collections
import dataclasses
import sys
import time
from collections.abc import Sequence
from typing import Any, Literal

from ejlabel.config.cache import AutotunePolicy
from ejlabel.config.persistent import PersistentCache
from ejlabel.config.selection import ConfigSelectorChain
from ejlabel.core.calls import CallDecodeError, invocation_from_description
from ejlabel.core.kernel import Invocation
from ejlabel.core.label_format import parse_label
from ejlabel.core.registry import import_user_modules
from ejlabel.execution.tuning import AutotuneError, Autotuner, TuneResult, store_result
from ejlabel.execution.tuning.remote import call_request, result_from_data
from ejlabel.utils.fingerprint import device_fingerprint
from ejlabel.utils.sanitize import sanitize

from .audit import TUNED_PROVENANCES
from .program import Program, note_described_kernels, read_program

__all__ = ["TuneReport", "tune_unseen"]


@dataclasses.dataclass
class TuneReport:
    """What ``tune_unseen`` did.

    Attributes:
      tuned: label → winning config, for every unseen label whose call was tuned (a backward
        label maps to its forward call's config, which its backward pass uses).
      errors: label → why it could not be tuned (kernel not importable, no description,
        every candidate failed).
      already_seen: labels that had a tuned config already.
      results: the full tuning result per distinct call, keyed by ``(op_id, call_key)``.
      wall_s: wall time of the whole batch.
      device: the device fingerprint the configs were tuned on and stored under.
      worker_of: which worker tuned each distinct call (``host:pid (node id)``; ``"local"`` for
        a local run), keyed like ``results``; calls that failed have their last worker here too.
    """

    tuned: dict[str, Any] = dataclasses.field(default_factory=dict)
    errors: dict[str, str] = dataclasses.field(default_factory=dict)
    already_seen: list[str] = dataclasses.field(default_factory=list)
    results: dict[tuple[str, str], TuneResult] = dataclasses.field(default_factory=dict)
    wall_s: float = 0.0
    device: str = ""
    worker_of: dict[tuple[str, str], str] = dataclasses.field(default_factory=dict)

    def summary(self) -> str:
        text = (
            f"tuned {len(self.results)} distinct calls ({len(self.tuned)} labels) in {self.wall_s:.1f} s; "
            f"{len(self.already_seen)} already tuned; {len(self.errors)} errors"
        )
        workers = collections.Counter(self.worker_of[key] for key in self.results if key in self.worker_of)
        if set(workers) - {"local"}:
            text += "; by worker: " + ", ".join(f"{name} {n}" for name, n in sorted(workers.items()))
        return text


def _unseen_labels(program: Program, selector: ConfigSelectorChain, device: str) -> tuple[list[str], list[str]]:
    # The described kernels first: a cached config of another kernel's type is then refused (and
    # the call tuned), as the running program would refuse it.
    note_described_kernels(program)
    unseen: list[str] = []
    seen: list[str] = []
    for lab in program.labels:
        op_id, call_key = parse_label(lab)
        found = selector.resolve((device, op_id, call_key))
        if found is None and lab in program.descriptions:
            # A kernel class that names no config type learns it when its call is rebuilt;
            # then the config another process stored for the call decodes here.
            try:
                invocation_from_description(lab, program.descriptions[lab])
            except CallDecodeError:
                pass
            else:
                found = selector.resolve((device, op_id, call_key))
        (seen if found is not None and found.provenance in TUNED_PROVENANCES else unseen).append(lab)
    return unseen, seen


def tune_unseen(
    x: Any,
    selector: ConfigSelectorChain | None = None,
    policy: AutotunePolicy | None = None,
    *,
    progress: bool | None = None,
    backend: Literal["local", "ray"] = "local",
    address: str | None = None,
    modules: Sequence[str] = (),
    platform: Literal["auto", "cpu", "gpu"] = "auto",
    accelerator_type: str | None = None,
    workers: int | None = None,
    cpus_per_worker: float = 1,
    runtime_env: dict[str, Any] | None = None,
    calls_per_task: int | Literal["auto"] = "auto",
) -> TuneReport:
    """Tune every call in ``x`` that has no tuned config; store winners persistently.

    ``x`` is a ``Program`` or anything :func:`~ejlabel.analysis.read_program` reads.
    ``selector`` defaults to one over the user's persistent cache. Calls whose kernel cannot be
    imported or whose candidates all fail are reported in ``errors``; the others are tuned.
    ``modules`` are imported first (the user's kernels; never names read from ``x``).

    ``backend="ray"`` tunes on a Ray cluster (``pip install "ejlabel[ray]"``): ``address`` is
    the cluster (None: ``ray.init()``'s default; an already connected driver keeps its
    connection); ``platform`` where to tune (``"auto"``: what the program was compiled for,
    else GPUs when the cluster has any, else CPUs); ``accelerator_type`` pins a Ray accelerator type
    (``"H100"``); ``workers`` is how many workers start (default: one per GPU, or per
    ``cpus_per_worker`` CPUs, at most one per call; more than the calls lets a call's candidates
    split across idle workers, :mod:`ejlabel.analysis.ray_schedule`); ``runtime_env`` adds to the workers' Ray runtime environment.
    ``calls_per_task`` is how many calls a worker tunes together, in one compile pool as a local
    run does (fewer idle compile threads when calls have fewer candidates than the policy has
    compile threads; answers then arrive, and are stored, a task at a time); ``"auto"``: every
    call at once for a lone worker, one at a time (scheduled and split) for several.
    ``progress`` prints one line per finished call (None: when stderr is a terminal). Only this
    process writes the cache, each winner as it arrives; a call whose worker dies or whose task
    raises is retried once, on another worker when one is free, then reported in ``errors``;
    ``worker_of`` says which worker tuned each call.
    """
    if backend not in ("local", "ray"):
        raise ValueError(f"backend: expected 'local' or 'ray', got {backend!r}")
    if platform not in ("auto", "cpu", "gpu"):
        raise ValueError(f"platform: expected 'auto', 'cpu' or 'gpu', got {platform!r}")
    if isinstance(modules, str):
        modules = [modules]
    ray_only = (address, platform != "auto", accelerator_type, workers, runtime_env, calls_per_task != "auto")
    if backend == "local" and any(option not in (None, False) for option in ray_only):
        raise ValueError('address, platform, accelerator_type, workers, runtime_env, calls_per_task: only apply to backend="ray"')
    start = time.perf_counter()
    import_user_modules(modules)
    if selector is None:
        selector = ConfigSelectorChain(persistent=PersistentCache())
    policy = policy if policy is not None else selector.policy
    program = read_program(x)
    if backend == "ray":
        report = _tune_on_ray(
            x, program, selector, policy, progress=progress, address=address, modules=list(modules),
            platform=platform, accelerator_type=accelerator_type, workers=workers,
            cpus_per_worker=cpus_per_worker, runtime_env=runtime_env, calls_per_task=calls_per_task,
        )
        report.wall_s = time.perf_counter() - start
        return report
    report = TuneReport(device=device_fingerprint())
    unseen, report.already_seen = _unseen_labels(program, selector, report.device)
    calls, labels_of, _ = _distinct_calls(program, unseen, report.errors)
    tuner = Autotuner(policy, progress=progress)
    outcomes = tuner.tune_each(list(calls.values())) if calls else []
    for (key, inv), outcome in zip(calls.items(), outcomes):
        report.worker_of[key] = "local"
        if isinstance(outcome, AutotuneError):
            report.errors.update({lab: str(outcome) for lab in labels_of[key]})
            continue
        store_result(outcome, inv, selector.cache, selector.persistent)
        report.results[key] = outcome
        report.tuned.update({lab: outcome.best_cfg for lab in labels_of[key]})
    report.wall_s = time.perf_counter() - start
    return report


Key = tuple[str, str]


def _distinct_calls(
    program: Program, labels: Sequence[str], errors: dict[str, str]
) -> tuple[dict[Key, Invocation[Any, Any]], dict[Key, list[str]], dict[Key, tuple[str, str]]]:
    """The calls of ``labels``, deduplicated by ``(op_id, call_key)``.

    Returns each call's invocation, its labels, and the label and description text it was
    decoded from; labels that cannot be decoded go to ``errors``.
    """
    descriptions = program.descriptions
    calls: dict[Key, Invocation[Any, Any]] = {}
    labels_of: dict[Key, list[str]] = {}
    source_of: dict[Key, tuple[str, str]] = {}
    for lab in labels:
        text = descriptions.get(lab)
        if text is None:
            errors[lab] = "the program carries no call description for this label"
            continue
        try:
            inv = invocation_from_description(lab, text)
        except CallDecodeError as err:
            errors[lab] = str(err)
            continue
        key = (inv.op_id, inv.call_key)
        calls.setdefault(key, inv)
        source_of.setdefault(key, (lab, text))
        labels_of.setdefault(key, []).append(lab)
    return calls, labels_of, source_of


def _tune_on_ray(
    x: Any,
    program: Program,
    selector: ConfigSelectorChain,
    policy: AutotunePolicy,
    *,
    progress: bool | None,
    address: str | None,
    modules: list[str],
    platform: str,
    accelerator_type: str | None,
    workers: int | None,
    cpus_per_worker: float,
    runtime_env: dict[str, Any] | None,
    calls_per_task: int | Literal["auto"],
) -> TuneReport:
    """The driver of a Ray run: the workers tune, this process checks, stores and reports."""
    from .ray_schedule import calls_per_task_for
    from .ray_tuning import RayTuningPool, import_ray, program_platform

    calls_per_task_for(calls_per_task, 1, 1)  # a bad setting is named before any worker starts
    import_ray()  # before anything else: a clear error when Ray is not installed
    if platform == "auto":  # what the program was compiled for, else the cluster decides
        platform = program_platform(x, [pm.source for pm in program.modules]) or "auto"
    # Every distinct call first, whether tuned or not (which are tuned depends on the workers'
    # device), so that no more workers start than there are calls, and none when there are none.
    report = TuneReport()
    everything, _, _ = _distinct_calls(program, program.labels, report.errors)
    if not everything:
        return report
    report.errors.clear()
    pool = RayTuningPool(
        address=address, modules=modules, platform=platform, accelerator_type=accelerator_type,
        workers=workers, calls=len(everything), cpus_per_worker=cpus_per_worker, runtime_env=runtime_env,
    )
    with pool:
        report.device = pool.device
        unseen, report.already_seen = _unseen_labels(program, selector, report.device)
        calls, labels_of, source_of = _distinct_calls(program, unseen, report.errors)
        requests = {key: call_request(*source_of[key], policy) for key in calls}
        show = progress if progress is not None else sys.stderr.isatty()
        if show:
            print(sanitize(f"tuning {len(requests)} calls on {pool.size} Ray workers ({report.device})"), file=sys.stderr, flush=True)
        done = collections.Counter()
        for key, answer in pool.tune(requests, calls_per_task):
            report.worker_of[key] = answer.get("worker") or "?"
            outcome = _store_answer(key, answer, calls[key], selector, report, labels_of[key])
            done[report.worker_of[key]] += 1
            if show:  # a worker's name and errors are its data: shown inert
                print(
                    sanitize(f"[{sum(done.values())}/{len(requests)}] {key[0]}:{key[1]} {outcome} on {report.worker_of[key]} "
                             f"({done[report.worker_of[key]]} by it)"),
                    file=sys.stderr, flush=True,
                )
    return report


def _store_answer(
    key: Key, answer: dict[str, Any], inv: Invocation[Any, Any], selector: ConfigSelectorChain,
    report: TuneReport, labels: list[str],
) -> str:
    """Store one worker's answer at once (the driver is the cache's only writer); its status."""
    status = answer.get("status")
    if status != "tuned":
        reason = str(answer.get("error") or f"unexpected answer status {status!r}")
        if status == "error" and answer.get("attempts", 1) > 1:
            reason = f"failed on both attempts; last: {reason}"
        report.errors.update({lab: reason for lab in labels})
        return f"failed ({reason[:160]})"
    try:
        result = result_from_data(answer.get("result"))
        if (result.op_id, result.call_key) != key:
            raise ValueError(f"the worker answered for {result.op_id}:{result.call_key}")
        device = answer.get("device")
        if not isinstance(device, str) or not device:
            raise ValueError("the answer names no device")
        if selector.cache is not None:
            selector.cache.put(device, *key, result.best_cfg)
        if selector.persistent is not None:
            selector.persistent.put(
                device, *key, result.best_cfg, provenance="autotuned", stats=result.stats(), kernel_version=inv.kernel_version
            )
    except (ValueError, TypeError) as err:  # DecodeError is a ValueError
        report.errors.update({lab: f"the worker's answer could not be stored: {err}" for lab in labels})
        return "failed"
    report.results[key] = result
    report.tuned.update({lab: result.best_cfg for lab in labels})
    return f"{result.best.timing.median_ms:.4g} ms" if result.best.timing is not None else "tuned"
