"""Tuning one call from plain data: what a remote tuning worker runs, and how its answer returns.

The Ray backend of :func:`~ejlabel.analysis.tune_unseen` (the driver,
:mod:`ejlabel.analysis.ray_tuning`) sends each distinct unseen call to a worker process, usually
on another machine, which tunes it with the isolated tuner (:mod:`.isolated`). Only plain data
crosses between the driver and a worker (str, numbers, lists and dicts):

* the request (:func:`call_request`): the call's label and its description text exactly as the
  program carries them, and the tuning policy as its plain fields;
* the answer (:meth:`TuningWorker.tune`): the device it was tuned on, every candidate with its
  config as the tagged JSON text of :mod:`ejlabel.utils.serialize`, its status, compile time,
  error and timing samples, and the worker that did it.

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

from ejlabel.config.cache import AutotunePolicy
from ejlabel.core.calls import invocation_from_description
from ejlabel.core.registry import import_user_modules
from ejlabel.execution.tuning.candidates import AutotuneError, CallCodeError, CandidateResult, TuneResult
from ejlabel.execution.tuning.isolated import Autotuner
from ejlabel.execution.tuning.measure import Timing
from ejlabel.utils.fingerprint import device_fingerprint
from ejlabel.utils.serialize import DecodeError, from_json, to_json

__all__ = ["TuningWorker", "call_request", "result_from_data", "result_to_data", "worker_name"]

# Every plain field of a candidate travels as it is; the config and the timing are encoded.
_CANDIDATE_FIELDS = tuple(f.name for f in dataclasses.fields(CandidateResult) if f.name not in ("cfg", "timing"))
_PLAIN = (str, int, float, bool, type(None))


def call_request(label: str, description: str, policy: AutotunePolicy) -> dict[str, Any]:
    """The plain-data request to tune the call that ``description`` (next to ``label``) describes."""
    if not isinstance(label, str) or not isinstance(description, str):
        raise TypeError("label, description: expected the label and call description text of a program")
    if not isinstance(policy, AutotunePolicy):
        raise TypeError(f"policy: expected an AutotunePolicy, got {type(policy).__name__}")
    return {"label": label, "description": description, "policy": dataclasses.asdict(policy)}


def worker_name(where: dict[str, Any]) -> str:
    """``host:pid`` of a worker's identity, with the first 8 hex digits of its cluster node id."""
    name = f"{where.get('host', '?')}:{where.get('pid', '?')}"
    node = where.get("node")
    return f"{name} (node {str(node)[:8]})" if node else name


def result_to_data(result: TuneResult) -> dict[str, Any]:
    """``result`` as plain data; configs as serializer JSON text, timings as their samples."""
    return {
        "op_id": result.op_id,
        "call_key": result.call_key,
        "best": result.candidates.index(result.best),
        "candidates": [
            {
                "cfg": to_json(c.cfg),
                **{name: getattr(c, name) for name in _CANDIDATE_FIELDS},
                "samples_ms": list(c.timing.samples_ms) if c.timing is not None else None,
            }
            for c in result.candidates
        ],
        "wall_s": result.wall_s,
        "measure_s": result.measure_s,
    }


def _number(value: Any, what: str, *, optional: bool = True) -> float | None:
    if value is None and optional:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise DecodeError(f"{what}: expected a finite number, got {value!r:.60}")
    return float(value)


def result_from_data(data: Any) -> TuneResult:
    """Invert :func:`result_to_data`: configs decode through the registry (never an import).

    :class:`~ejlabel.utils.serialize.DecodeError` naming the field for an answer that is not one.
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

    def tune(self, request: dict[str, Any]) -> dict[str, Any]:
        """Tune the requested call; plain data back.

        ``{"status": "tuned", "result": ..., "device", "kernel_version", "worker"}``, or
        ``{"status": "failed", "error": ..., "worker"}`` when every candidate failed (a tuning
        outcome, as in a local run). Anything else (the description does not decode here, the
        kernel's own code raises) propagates, so that the driver can retry the call elsewhere;
        a call that fails on every attempt is reported, the others are tuned.
        """
        return self.tune_many([request])[0]

    def tune_many(self, requests: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """Tune several calls together, as a local run does (one compile pool for all their
        candidates); one answer per request, in order, each as :meth:`tune` gives it."""
        if not isinstance(requests, list) or not requests:
            raise TypeError("requests: expected a non-empty list of call_request(...) dicts")
        for request in requests:
            if not isinstance(request, dict) or not all(isinstance(request.get(k), str) for k in ("label", "description")):
                raise TypeError("request: expected call_request(label, description, policy)")
            if not isinstance(request.get("policy"), dict) or request["policy"] != requests[0]["policy"]:
                raise TypeError("request['policy']: expected the policy's fields as a dict, the same for every request")
        policy = AutotunePolicy(**requests[0]["policy"])
        invocations = [invocation_from_description(r["label"], r["description"]) for r in requests]
        outcomes = Autotuner(policy, progress=False).tune_each(invocations)
        for outcome in outcomes:
            if isinstance(outcome, CallCodeError):
                # Raised, not answered: the driver retries the task's calls alone, elsewhere
                # (it may be this worker's environment), and reports a call that fails each time.
                raise outcome.error
        worker, device = worker_name(self._where), device_fingerprint()
        answers = []
        for inv, outcome in zip(invocations, outcomes, strict=True):
            if isinstance(outcome, AutotuneError):
                answers.append({"status": "failed", "error": str(outcome), "worker": worker})
            else:
                answers.append({
                    "status": "tuned",
                    "result": result_to_data(outcome),
                    "device": device,
                    "kernel_version": inv.kernel_version,
                    "worker": worker,
                })
        return answers
