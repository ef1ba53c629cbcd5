"""Tuning one call from plain data: what a remote tuning worker runs, and how its answer returns.

The Ray backend of :func:`~ejlabel.analysis.tune_unseen` (the driver,
:mod:`ejlabel.analysis.ray_tuning`) sends each distinct unseen call to a worker process, usually
on another machine, which tunes it with the isolated tuner (:mod:`.isolated`). Only plain data
crosses between the driver and a worker (str, numbers, lists and dicts):

* the request (:func:`call_request`): the call's label and its description text exactly as the
  program carries them, the tuning policy as its plain fields, and optionally the candidates to
  tune (a *part* of the call: their configs as tagged JSON text);
* the answer (:meth:`TuningWorker.tune`): the device it was tuned on, every candidate with its
  config as the tagged JSON text of :mod:`ejlabel.utils.serialize`, its status, compile time,
  error and timing samples, and the worker that did it;
* the plan (:meth:`TuningWorker.plan`): a call's candidates, as the tuner lists them on this
  worker's device, each with the size of the program it traces to (its estimated cost).

A call can be split: each part is one request with some of the call's candidates, tuned on its
own worker, and :func:`merge_parts` puts the parts' candidates back in the call's order and
picks the winner by the rule one worker's ranking ends with (:func:`pick_best`: the fastest
median of the candidates that stayed in the ranking), so that for the same measurements a split
call picks what one worker picks.

Never a pickled ``Invocation`` or config: the worker rebuilds the call from the description
through the registry, after importing only the modules it was given, and the driver decodes the
configs of the answer through its own registry (:func:`result_from_data`). Nothing found in a
program or an answer is ever imported, on either side.

:class:`TuningWorker` needs no Ray: the Ray backend wraps it in an actor, and it can be driven
in-process too (the tests check the round trip of its answers).
"""

from __future__ import annotations

import dataclasses
import math
import os
import socket
from collections.abc import Sequence
from typing import Any

import jax

from ejlabel.config.cache import AutotunePolicy
from ejlabel.core.calls import invocation_from_description
from ejlabel.core.registry import import_user_modules
from ejlabel.execution.tuning.candidates import (
    AutotuneError,
    CallCodeError,
    CandidateResult,
    Job,
    TuneResult,
    candidate_function,
    tuning_arguments,
)
from ejlabel.execution.tuning.isolated import Autotuner
from ejlabel.execution.tuning.measure import Timing
from ejlabel.utils.fingerprint import device_fingerprint
from ejlabel.utils.serialize import DecodeError, from_json, to_json

__all__ = [
    "TuningWorker", "call_request", "candidates_from_data", "merge_parts", "pick_best", "program_size", "result_from_data",
    "result_to_data", "worker_name",
]

# Every plain field of a candidate travels as it is; the config and the timing are encoded.
_CANDIDATE_FIELDS = tuple(f.name for f in dataclasses.fields(CandidateResult) if f.name not in ("cfg", "timing"))
_PLAIN = (str, int, float, bool, type(None))


def call_request(label: str, description: str, policy: AutotunePolicy, configs: Sequence[str] | None = None) -> dict[str, Any]:
    """The plain-data request to tune the call that ``description`` (next to ``label``) describes.

    ``configs``: the candidates of this part of the call, as the tagged JSON text a plan lists
    them in (None: every candidate, the whole call).
    """
    if not isinstance(label, str) or not isinstance(description, str):
        raise TypeError("label, description: expected the label and call description text of a program")
    if not isinstance(policy, AutotunePolicy):
        raise TypeError(f"policy: expected an AutotunePolicy, got {type(policy).__name__}")
    request: dict[str, Any] = {"label": label, "description": description, "policy": dataclasses.asdict(policy)}
    if configs is not None:
        if isinstance(configs, str) or not configs or not all(isinstance(c, str) for c in configs):
            raise TypeError("configs: expected None or a non-empty list of config JSON texts")
        request["configs"] = list(configs)
    return request


def worker_name(where: dict[str, Any]) -> str:
    """``host:pid`` of a worker's identity, with the first 8 hex digits of its cluster node id."""
    name = f"{where.get('host', '?')}:{where.get('pid', '?')}"
    node = where.get("node")
    return f"{name} (node {str(node)[:8]})" if node else name


def _candidates_to_data(candidates: Sequence[CandidateResult]) -> list[dict[str, Any]]:
    return [
        {
            "cfg": to_json(c.cfg),
            **{name: getattr(c, name) for name in _CANDIDATE_FIELDS},
            "samples_ms": list(c.timing.samples_ms) if c.timing is not None else None,
        }
        for c in candidates
    ]


def result_to_data(result: TuneResult) -> dict[str, Any]:
    """``result`` as plain data; configs as serializer JSON text, timings as their samples."""
    return {
        "op_id": result.op_id,
        "call_key": result.call_key,
        "best": result.candidates.index(result.best),
        "candidates": _candidates_to_data(result.candidates),
        "wall_s": result.wall_s,
        "measure_s": result.measure_s,
    }


def _number(value: Any, what: str, *, optional: bool = True) -> float | None:
    if value is None and optional:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise DecodeError(f"{what}: expected a finite number, got {value!r:.60}")
    return float(value)


def candidates_from_data(data: Any) -> list[CandidateResult]:
    """The candidates of a result or a part's answer (``data["candidates"]``), decoded.

    :class:`~ejlabel.utils.serialize.DecodeError` naming the field for data that is not one.
    """
    if not isinstance(data, dict) or not isinstance(data.get("candidates"), list) or not data["candidates"]:
        raise DecodeError("tuning result: expected a dict with a non-empty 'candidates' list")
    candidates = []
    for i, c in enumerate(data["candidates"]):
        if not isinstance(c, dict) or not isinstance(c.get("cfg"), str) or not isinstance(c.get("status"), str):
            raise DecodeError(f"tuning result: candidate {i} is not a dict with 'cfg' JSON text and a 'status'")
        samples = c.get("samples_ms")
        if samples is not None and (not isinstance(samples, list) or not samples):
            raise DecodeError(f"tuning result: candidate {i}: samples_ms must be a non-empty list or None")
        timing = Timing([_number(s, f"candidate {i} sample") for s in samples]) if samples else None  # type: ignore[misc]
        plain = {name: c[name] for name in _CANDIDATE_FIELDS if name in c}
        for name, value in plain.items():
            if not isinstance(value, _PLAIN):
                raise DecodeError(f"tuning result: candidate {i}: {name} must be a plain value, got {type(value).__name__}")
        candidates.append(CandidateResult(cfg=from_json(c["cfg"]), timing=timing, **plain))
    return candidates


def result_from_data(data: Any) -> TuneResult:
    """Invert :func:`result_to_data`: configs decode through the registry (never an import).

    :class:`~ejlabel.utils.serialize.DecodeError` naming the field for an answer that is not one.
    """
    candidates = candidates_from_data(data)
    best = data.get("best")
    if not isinstance(best, int) or isinstance(best, bool) or not 0 <= best < len(candidates) or candidates[best].timing is None:
        raise DecodeError(f"tuning result: 'best' must index a timed candidate, got {best!r:.40}")
    op_id, call_key = data.get("op_id"), data.get("call_key")
    if not isinstance(op_id, str) or not isinstance(call_key, str):
        raise DecodeError("tuning result: 'op_id' and 'call_key' must be strings")
    winner = candidates[best]
    return TuneResult(
        op_id, call_key, winner.cfg, winner, candidates,
        _number(data.get("wall_s"), "wall_s", optional=False),  # type: ignore[arg-type]
        _number(data.get("measure_s"), "measure_s", optional=False),  # type: ignore[arg-type]
    )


def pick_best(candidates: Sequence[CandidateResult]) -> int | None:
    """The index of the winner among ``candidates``, or None when none was ranked.

    One worker's ranking ends by sorting the candidates that stayed in it (status ``ok``: timed,
    correct, never pruned) by their median time and taking the first; the same rule here, ties
    to the earlier candidate, picks the same winner from the same measurements however the
    candidates were split between workers.
    """
    ranked = [(c.timing, i) for i, c in enumerate(candidates) if c.status == "ok" and c.timing is not None]
    return min(ranked)[1] if ranked else None


def merge_parts(
    op_id: str, call_key: str, order: Sequence[Any], parts: Sequence[Sequence[CandidateResult]], wall_s: float, measure_s: float
) -> TuneResult | AutotuneError:
    """One call's result from its parts' candidates, as if one worker had tuned them all.

    ``order`` is the call's candidate configs as its plan lists them; the merged candidates
    follow it (a candidate no part answered for is an error: the parts must cover the call).
    The winner is :func:`pick_best`'s; with none ranked, the :class:`AutotuneError` a local
    run gives, naming each candidate's reason. ``wall_s`` and ``measure_s`` are the call's
    (the slowest part's: the parts run side by side).
    """
    found = [c for part in parts for c in part]
    merged: list[CandidateResult] = []
    for cfg in order:
        matches = [c for c in found if c.cfg == cfg]
        if len(matches) != 1:
            raise ValueError(f"{op_id} call {call_key}: {len(matches)} parts answered for candidate {cfg!r}, expected 1")
        merged.append(matches[0])
    if len(found) != len(merged):
        raise ValueError(f"{op_id} call {call_key}: the parts answered for {len(found)} candidates, the call has {len(merged)}")
    best = pick_best(merged)
    if best is None:
        reasons = "; ".join(f"{c.cfg!r}: {c.status} ({c.reason})" for c in merged)
        return AutotuneError(f"every candidate of {op_id} call {call_key} failed: {reasons}")
    return TuneResult(op_id, call_key, merged[best].cfg, merged[best], merged, wall_s, measure_s)


def program_size(job: Job, cfg: Any) -> int | None:
    """How many operations the program of candidate ``cfg`` of ``job`` traces to (nested
    programs included: a Pallas kernel's body, a loop's, a custom VJP's); None if it does not trace.

    The cost of tuning a candidate is mostly compiling it, and compile time grows with the size
    of the program compiled; the shapes of its arguments change it far less (the time of the
    timed runs is small next to it at the shapes calls are tuned at).
    """
    inv = job.inv
    operands = tuning_arguments(inv, inv.args, inv.array_kwargs)
    if job.cotangent is not None:
        operands += (job.cotangent,)
    try:
        jaxpr = jax.make_jaxpr(candidate_function(inv, cfg, job.cotangent is not None))(*operands)
    except Exception:  # noqa: BLE001 - a candidate that does not trace fails fast when tuned: no estimate
        return None
    count, stack = 0, [jaxpr.jaxpr]
    while stack:  # iterative: a deeply nested program must not reach the recursion limit
        eqns = stack.pop().eqns
        count += len(eqns)
        for eqn in eqns:
            for value in eqn.params.values():
                for sub in value if isinstance(value, (list, tuple)) else (value,):
                    inner = getattr(sub, "jaxpr", sub)  # a closed program holds its program
                    if hasattr(inner, "eqns"):
                        stack.append(inner)
    return count


class TuningWorker:
    """Tunes calls described by plain-data requests, one at a time, in one process.

    Args:
      modules: the modules to import once here so that their kernels and config types are
        registered: the Ray pool names the library's kernels, then the modules the user named
        (``--import``), as the command line imports them; never a name read from a request.
      node: the cluster node this process runs on, for the worker's name (None outside a cluster).
    """

    def __init__(self, modules: Sequence[str] = (), node: str | None = None) -> None:
        import_user_modules(list(modules))
        self._where = {"host": socket.gethostname(), "pid": os.getpid(), "node": node}

    def identity(self) -> dict[str, Any]:
        """Where this worker runs and the device fingerprint its tuned configs are stored under."""
        return {**self._where, "name": worker_name(self._where), "device": device_fingerprint()}

    def plan(self, requests: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """Each call's candidates as this worker's device lists them, with their estimated costs.

        ``{"status": "planned", "candidates": [config JSON text...], "costs": [...],
        "checked_by_reference": bool}`` per request, in order (``costs``: :func:`program_size`
        of each candidate, the largest known for one that does not trace;
        ``checked_by_reference``: whether the kernel has a reference to check a part of the
        candidates against, without which a part would check against its own first candidate),
        or ``{"status": "error", "error": ...}`` for a call that cannot be planned here (its
        tuning then says why).
        """
        policy, invocations = self._decode(requests)
        answers: list[dict[str, Any]] = [{}] * len(requests)
        indices = [i for i, inv in enumerate(invocations) if not isinstance(inv, Exception)]
        for i, inv in enumerate(invocations):
            if isinstance(inv, Exception):
                answers[i] = {"status": "error", "error": f"{type(inv).__name__}: {inv}"}
        jobs = Autotuner(policy, progress=False).jobs([invocations[i] for i in indices])  # type: ignore[misc]
        for i, job in zip(indices, jobs, strict=True):
            if not isinstance(job, Job):
                answers[i] = {"status": "error", "error": str(job)}
                continue
            sizes = [program_size(job, c.cfg) for c in job.candidates]
            known = [size for size in sizes if size is not None]
            fallback = max(known, default=1)
            answers[i] = {
                "status": "planned",
                "candidates": [to_json(c.cfg) for c in job.candidates],
                "costs": [float(max(1, size if size is not None else fallback)) for size in sizes],
                "checked_by_reference": callable(getattr(job.inv.kernel, "reference", None)),
            }
        return answers

    def tune(self, request: dict[str, Any]) -> dict[str, Any]:
        """Tune the requested call; plain data back.

        ``{"status": "tuned", "result": ..., "device", "kernel_version", "worker"}``, or
        ``{"status": "failed", "error": ..., "worker"}`` when every candidate failed (a tuning
        outcome, as in a local run). A request for a part of a call (``configs``) is answered
        ``{"status": "part", "candidates": [...], "wall_s", "measure_s", "device",
        "kernel_version", "worker"}`` with every candidate of the part, ranked or not: the
        driver merges the parts (:func:`merge_parts`). Anything else (the description does not
        decode here, the kernel's own code raises) propagates, so that the driver can retry the
        call elsewhere; a call that fails on every attempt is reported, the others are tuned.
        """
        return self.tune_many([request])[0]

    def tune_many(self, requests: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """Tune several calls together, as a local run does (one compile pool for all their
        candidates); one answer per request, in order, each as :meth:`tune` gives it."""
        policy, invocations = self._decode(requests)
        for inv in invocations:
            if isinstance(inv, Exception):
                raise inv
        configs = {i: [from_json(text) for text in r["configs"]] for i, r in enumerate(requests) if "configs" in r}
        tuner = Autotuner(policy, progress=False)
        jobs = tuner.jobs(invocations, configs)  # type: ignore[arg-type]
        outcomes = tuner.tune_jobs(jobs)
        for outcome in outcomes:
            if isinstance(outcome, CallCodeError):
                # Raised, not answered: the driver retries the task's calls alone, elsewhere
                # (it may be this worker's environment), and reports a call that fails each time.
                raise outcome.error
        worker, device = worker_name(self._where), device_fingerprint()
        answers = []
        for i, (inv, job, outcome) in enumerate(zip(invocations, jobs, outcomes, strict=True)):
            where = {"device": device, "kernel_version": inv.kernel_version, "worker": worker}  # type: ignore[union-attr]
            if i in configs and isinstance(job, Job):
                ranked = outcome if isinstance(outcome, TuneResult) else None
                answers.append({
                    "status": "part",
                    "candidates": _candidates_to_data(ranked.candidates if ranked else job.candidates),
                    "wall_s": ranked.wall_s if ranked else 0.0,
                    "measure_s": ranked.measure_s if ranked else 0.0,
                    **where,
                })
            elif isinstance(outcome, AutotuneError):
                answers.append({"status": "failed", "error": str(outcome), "worker": worker})
            else:
                answers.append({"status": "tuned", "result": result_to_data(outcome), **where})
        return answers

    @staticmethod
    def _decode(requests: list[dict[str, Any]]) -> tuple[AutotunePolicy, list[Any]]:
        """The requests' shared policy, and each call rebuilt (its decoding error in place)."""
        if not isinstance(requests, list) or not requests:
            raise TypeError("requests: expected a non-empty list of call_request(...) dicts")
        for request in requests:
            if not isinstance(request, dict) or not all(isinstance(request.get(k), str) for k in ("label", "description")):
                raise TypeError("request: expected call_request(label, description, policy)")
            if not isinstance(request.get("policy"), dict) or request["policy"] != requests[0]["policy"]:
                raise TypeError("request['policy']: expected the policy's fields as a dict, the same for every request")
            if "configs" in request and (not isinstance(request["configs"], list) or not all(isinstance(c, str) for c in request["configs"])):
                raise TypeError("request['configs']: expected a list of config JSON texts")
        policy = AutotunePolicy(**requests[0]["policy"])
        invocations: list[Any] = []
        for r in requests:
            try:
                invocations.append(invocation_from_description(r["label"], r["description"]))
            except Exception as err:  # noqa: BLE001 - this call alone; tune_many raises it, plan reports it
                invocations.append(err)
        return policy, invocations
