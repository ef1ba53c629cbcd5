"""Ahead-of-time tuning of every unseen kernel call of a program, from the program alone.

``tune_unseen(x)`` finds the labels in ``x`` that have no tuned config, rebuilds each call's
:class:`~ejlabel.Invocation` from the call description the program carries next to the label,
tunes them all in one batch (every candidate of every call compiles in one pool), and writes the
winners to the persistent cache. ``x`` can be a dump written on another machine: nothing of the
model is imported, only the kernels the descriptions name. Labels and descriptions come from one
reading of ``x`` (:class:`~ejlabel.analysis.Program`), the same the audit and the graph see.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any

from ejlabel.config.cache import AutotunePolicy
from ejlabel.config.persistent import PersistentCache
from ejlabel.config.selection import ConfigSelectorChain
from ejlabel.core.calls import CallDecodeError, invocation_from_description
from ejlabel.core.kernel import Invocation
from ejlabel.core.label_format import parse_label
from ejlabel.execution.tuning import AutotuneError, Autotuner, TuneResult, store_result
from ejlabel.utils.fingerprint import device_fingerprint

from .audit import TUNED_PROVENANCES
from .program import Program, read_program

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
    """

    tuned: dict[str, Any] = dataclasses.field(default_factory=dict)
    errors: dict[str, str] = dataclasses.field(default_factory=dict)
    already_seen: list[str] = dataclasses.field(default_factory=list)
    results: dict[tuple[str, str], TuneResult] = dataclasses.field(default_factory=dict)
    wall_s: float = 0.0

    def summary(self) -> str:
        return (
            f"tuned {len(self.results)} distinct calls ({len(self.tuned)} labels) in {self.wall_s:.1f} s; "
            f"{len(self.already_seen)} already tuned; {len(self.errors)} errors"
        )


def _unseen_labels(program: Program, selector: ConfigSelectorChain, device: str) -> tuple[list[str], list[str]]:
    unseen: list[str] = []
    seen: list[str] = []
    for lab in program.labels:
        op_id, call_key = parse_label(lab)
        found = selector.resolve((device, op_id, call_key))
        (seen if found is not None and found.provenance in TUNED_PROVENANCES else unseen).append(lab)
    return unseen, seen


def tune_unseen(
    x: Any,
    selector: ConfigSelectorChain | None = None,
    policy: AutotunePolicy | None = None,
    *,
    progress: bool | None = None,
) -> TuneReport:
    """Tune every call in ``x`` that has no tuned config; store winners persistently.

    ``x`` is a ``Program`` or anything :func:`~ejlabel.analysis.read_program` reads.
    ``selector`` defaults to one over the user's persistent cache. Calls whose kernel cannot be
    imported or whose candidates all fail are reported in ``errors``; the others are tuned.
    """
    start = time.perf_counter()
    if selector is None:
        selector = ConfigSelectorChain(persistent=PersistentCache())
    program = read_program(x)
    device = device_fingerprint()
    report = TuneReport()
    unseen, report.already_seen = _unseen_labels(program, selector, device)
    descriptions = program.descriptions

    calls: dict[tuple[str, str], Invocation[Any, Any]] = {}
    labels_of: dict[tuple[str, str], list[str]] = {}
    for lab in unseen:
        text = descriptions.get(lab)
        if text is None:
            report.errors[lab] = "the program carries no call description for this label"
            continue
        try:
            inv = invocation_from_description(lab, text)
        except CallDecodeError as err:
            report.errors[lab] = str(err)
            continue
        key = (inv.op_id, inv.call_key)
        calls.setdefault(key, inv)
        labels_of.setdefault(key, []).append(lab)

    tuner = Autotuner(policy if policy is not None else selector.policy, progress=progress)
    outcomes = tuner.tune_each(list(calls.values())) if calls else []
    for (key, inv), outcome in zip(calls.items(), outcomes):
        if isinstance(outcome, AutotuneError):
            report.errors.update({lab: str(outcome) for lab in labels_of[key]})
            continue
        store_result(outcome, inv, selector.cache, selector.persistent)
        report.results[key] = outcome
        report.tuned.update({lab: outcome.best_cfg for lab in labels_of[key]})
    report.wall_s = time.perf_counter() - start
    return report
