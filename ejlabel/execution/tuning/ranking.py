"""Tuning in context's ranking: which calls are tried, in what order, and what is confirmed.

A budget spent on calls that cannot gain is a budget the gain never gets. So the work is
ordered by what each call can win, and done in rounds, each followed by its confirmations in
the whole step (:func:`~.in_context.tune_in_context` runs them):

1. **Prior round: straight to the whole step.** The candidates a kernel expects to beat XLA on
   this device (:meth:`~ejlabel.core.kernel.Kernel.prior_configs`: Mosaic attention on Hopper,
   the token-chunked loss on GPUs) are few and expected to win, so they are not ranked in
   isolation first: ranking them would cost each one a trace and compile of its own (in a cold
   process, first-time lowering and autotuning dominate) before the whole-step compile that
   decides anyway. :func:`prior_trials` makes them confirmations at once: each call's first
   prior, then the runners-up, calls ordered by :func:`size_estimate` (bytes of the call's
   arguments x sites). That order needs nothing compiled or timed: the shares are not measured
   yet, and measuring them first is what made a cold first call spend its budget before any
   gain landed.
2. **Shares.** Then each call's floor config (its all-XLA pick) is compiled and timed alone,
   forward and backward as the step runs it (the first round of the call's
   :class:`~.candidates.Job`, compiled on the compile workers); the call's *share* of the step
   is that time x its sites over the floor step's time. A call whose share is below
   ``min_gain`` is not ranked at all: even at no cost it could not make the step ``min_gain``
   faster, which is what the noise rule asks of a change (:mod:`.paired`).
3. **Rest round.** With the time left, the rest of every call's config space is ranked in
   isolation, largest share first (the candidates the prior round already confirmed in the
   step are left out), then confirmed.

Rounds of one call share its job, so nothing is compiled, checked or timed twice; the budget
cuts the lowest shares first. Candidates that lost at the call's shape class in an earlier run
are not in the job at all (:mod:`.memory`). A call whose isolated timings an earlier tuning
stored (``reuse``) is not measured: it is planned from those timings in the first round.

:func:`plan` turns the timings into confirmations: every call's best candidate first, by
expected gain (isolated gain x sites), then the runners-up, at most ``per_call`` per call over
the whole run.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import numpy as np

from ejlabel.config.cache import AutotunePolicy
from ejlabel.config.persistent import CacheError
from ejlabel.config.selection import ConfigSelectorChain
from ejlabel.core.kernel import Invocation
from ejlabel.execution.tuning.candidates import AutotuneError, CandidateResult, Job, TuneResult, TuningCut
from ejlabel.execution.tuning.isolated import Autotuner, prior_configs
from ejlabel.execution.tuning.memory import decode_config
from ejlabel.execution.tuning.report import CallPick, Key, Trial

__all__ = ["Ranking", "isolated_from_stats", "plan", "prior_trials", "size_estimate"]


@dataclasses.dataclass
class Ranking:
    """The isolated ranking of one run's calls, in rounds over the same jobs.

    ``isolated`` holds ``{key: {cfg: isolated ms}}`` over each call's correct candidates (the
    floor's included), as the rounds fill it in; ``ranked`` the calls in the order they were
    ranked. What became of each call is written on its :class:`~.report.CallPick`.
    """

    policy: AutotunePolicy
    selector: ConfigSelectorChain
    reuse: bool
    progress: bool | None
    seed: int
    calls: Mapping[Key, CallPick]
    floor: Mapping[Key, Any]
    errors: dict[str, str]
    isolated: dict[Key, dict[Any, float]] = dataclasses.field(default_factory=dict)
    ranked: list[Key] = dataclasses.field(default_factory=list)
    jobs: dict[Key, Job] = dataclasses.field(default_factory=dict)
    order: list[Key] = dataclasses.field(default_factory=list)  # the calls by share, largest first
    in_context: dict[Key, set[Any]] = dataclasses.field(default_factory=dict)  # candidates the prior round confirmed in the step

    def __post_init__(self) -> None:
        self.tuner = Autotuner(self.policy, progress=self.progress, seed=self.seed)

    def prepare(self, invocations: Mapping[Key, Invocation[Any, Any]], losers: Mapping[Key, Mapping[Any, tuple[str, str]]]) -> None:
        """Take stored isolated timings where allowed; build the jobs of the calls to measure,
        without the candidates in ``losers``."""
        to_tune: list[Key] = []
        for key in invocations:
            stored = self._stored(key)
            call = self.calls[key]
            if self.floor[key] in stored and len(stored) > 1:
                self.isolated[key] = stored
                call.isolated_from = "cache"
                call.floor_isolated_ms = call.isolated_ms = stored[self.floor[key]]
                call.candidates = [{"cfg": cfg, "status": "ok", "median_ms": ms} for cfg, ms in stored.items()]
            else:
                to_tune.append(key)
        lists = {}
        listed: list[Key] = []
        for key in to_tune:
            try:
                candidates = _candidate_list(invocations[key], self.floor[key])
            except Exception as err:  # noqa: BLE001 - the kernel's code failed on this call alone
                self._failed(key, AutotuneError(f"cannot list its candidates: {type(err).__name__}: {err}"))
                continue
            lost = losers.get(key, {})
            self.calls[key].skipped_losers = {cfg: lost[cfg] for cfg in candidates if cfg in lost}
            lists[len(listed)] = [cfg for cfg in candidates if cfg not in lost]
            listed.append(key)
        to_tune = listed
        jobs = self.tuner.jobs([invocations[key] for key in to_tune], lists, floors={i: self.floor[key] for i, key in enumerate(to_tune)})
        for key, job in zip(to_tune, jobs):
            if isinstance(job, AutotuneError):
                self._failed(key, job)
            else:
                self.jobs[key] = job

    def shares(self, floor_step_ms: float, min_gain: float, exhaustive: bool, deadline: float | None) -> None:
        """Time every job's floor; set each call's share; order the calls; leave out those whose
        share is below ``min_gain`` (all are kept when ``exhaustive``)."""
        for job in self.jobs.values():
            job.active = [i for i, candidate in enumerate(job.candidates) if candidate.floor]
        self._round(list(self.jobs), deadline)
        for key in [key for key in self.jobs if self.calls[key].floor_isolated_ms is None]:
            del self.jobs[key]  # the budget cut it before its floor was timed, or it failed: no share, not ranked
        for key, timings in self.isolated.items():
            call = self.calls[key]
            if call.floor_isolated_ms is not None and floor_step_ms > 0:
                call.share = call.floor_isolated_ms * call.sites / floor_step_ms
        known = [key for key in self.isolated if self.calls[key].share is not None]
        self.order = sorted(known, key=lambda key: -(self.calls[key].share or 0.0)) + [key for key in self.isolated if key not in known]
        if exhaustive:
            return
        for key in self.order:
            call = self.calls[key]
            if call.share is not None and call.share < min_gain:
                call.isolated_from = "unranked"
                self.isolated[key] = {call.floor_cfg: call.floor_isolated_ms} if call.floor_isolated_ms is not None else {}
                self.jobs.pop(key, None)
                call.candidates = [row if row["cfg"] == call.floor_cfg else {**row, "status": "unranked"} for row in call.candidates]

    def rank(self, which: str, deadline: float | None) -> list[Key]:
        """One round: ``"prior"`` ranks each call's floor and prior candidates, ``"rest"`` all
        of its candidates; calls in share order. Returns the calls this round ranked."""
        if which not in ("prior", "rest"):
            raise ValueError(f"which: expected 'prior' or 'rest', got {which!r}")
        chosen = []
        for key in [key for key in self.order if key in self.jobs]:
            job = self.jobs[key]
            if which == "prior":
                prior = [i for i, candidate in enumerate(job.candidates) if candidate.prior]
                if not prior:
                    continue
                job.active = [i for i, candidate in enumerate(job.candidates) if candidate.floor] + prior
            else:
                done = self.in_context.get(key, set())
                # The floor stays active: it was timed for the share already, and ranks the rest.
                active = [i for i, c in enumerate(job.candidates) if c.floor or c.cfg not in done]
                if all(job.candidates[i].status not in ("pending", "skipped") for i in active):
                    continue  # every candidate had its turn in an earlier round
                job.active = active
            chosen.append(key)
        self._round(chosen, deadline)
        self.ranked += [key for key in chosen if key not in self.ranked]
        return chosen

    def in_share_order(self) -> list[Key]:
        """The calls ranked this run or from stored timings, largest share first."""
        ranked = set(self.ranked)
        return [key for key in self.order if key in ranked or self.calls[key].isolated_from == "cache"]

    def _round(self, keys: Sequence[Key], deadline: float | None) -> None:
        if not keys:
            return
        outcomes = self.tuner.tune_jobs([self.jobs[key] for key in keys], deadline=deadline)
        for key, outcome in zip(keys, outcomes):
            self._take(key, outcome)

    def _take(self, key: Key, outcome: TuneResult | AutotuneError) -> None:
        """What a round left for one call: its timings so far, and how far its ranking got."""
        call, job = self.calls[key], self.jobs[key]
        if isinstance(outcome, AutotuneError) and not isinstance(outcome, TuningCut):
            self._failed(key, outcome)
            return
        done = self.in_context.get(key, set())
        call.candidates = _rows([c for c in job.candidates if c.cfg not in done])
        timings = {c.cfg: c.timing.median_ms for c in job.candidates if c.timing is not None and c.status in ("ok", "pruned")}
        self.isolated[key] = timings
        if call.floor_cfg in timings:
            call.floor_isolated_ms = timings[call.floor_cfg]
            if not call.changed:
                call.isolated_ms = call.floor_isolated_ms
        untried = any(c.status in ("pending", "skipped") for c in job.candidates if c.cfg not in done)
        if not timings:
            call.isolated_from = "cut"
        elif untried:
            call.isolated_from = "partial" if any(cfg != call.floor_cfg for cfg in timings) else "cut"
        else:
            call.isolated_from = "measured"

    def _failed(self, key: Key, err: AutotuneError) -> None:
        call = self.calls[key]
        self.errors[f"{call.op_id}:{call.call_key}"] = f"isolated tuning failed, XLA stays: {err}"
        call.isolated_from = "failed"
        self.isolated.pop(key, None)
        self.jobs.pop(key, None)

    def _stored(self, key: Key) -> dict[Any, float]:
        """The isolated timings an earlier tuning stored for ``key``, unless its ranking was cut."""
        if not self.reuse or self.selector.persistent is None:
            return {}
        try:
            entry = self.selector.persistent.get_entry(key)
        except CacheError:
            return {}
        if entry is None or (isinstance(entry.stats, dict) and entry.stats.get("ranking_cut")):
            return {}
        return isolated_from_stats(entry.stats)


def _rows(candidates: Sequence[CandidateResult]) -> list[dict[str, Any]]:
    """One row per candidate; one no round reached is ``skipped`` (never timed: the time budget)."""
    return [
        {"cfg": c.cfg, "status": "skipped" if c.status == "pending" else c.status, "median_ms": c.timing.median_ms if c.timing is not None else None}
        for c in candidates
    ]


def isolated_from_stats(stats: Any) -> dict[Any, float]:
    """``{cfg: isolated median ms}`` of the correct candidates an earlier tuning stored, if any.

    Understands the ``candidates`` list of both ``autotuned`` entries (timing dicts, configs as
    tagged JSON) and ``in-context`` entries (``median_ms``, configs decoded).
    """
    timings: dict[Any, float] = {}
    rows = stats.get("candidates") if isinstance(stats, dict) else None
    for item in rows if isinstance(rows, list) else []:
        if not isinstance(item, dict) or item.get("status") not in ("ok", "pruned"):
            continue
        cfg = decode_config(item.get("cfg"))
        if cfg is None:
            continue
        timing = item.get("timing")
        median = timing.get("median_ms") if isinstance(timing, dict) else item.get("median_ms")
        if isinstance(median, (int, float)) and math.isfinite(median):
            timings[cfg] = float(median)
    return timings


def _candidate_list(inv: Invocation[Any, Any], floor_cfg: Any) -> list[Any]:
    """The floor, the heuristic, the kernel's prior, then its config space (the job puts them in
    that order too, and keeps only the valid ones)."""
    kernel = inv.kernel
    return list(dict.fromkeys([floor_cfg, kernel.heuristic_cfg(inv), *prior_configs(inv), *kernel.config_space(inv)]))


def plan(calls: Mapping[Key, CallPick], isolated: Mapping[Key, Mapping[Any, float]], per_call: int, skip_slower: bool, tried: Mapping[Key, set[Any]]) -> list[Trial]:
    """The confirmations to try now: every call's best candidate first, by expected gain
    (isolated gain over the call's current pick x sites), then the calls' second candidates, and
    so on; at most ``per_call`` per call counting those ``tried`` in earlier rounds.

    A runner-up's expected gain is measured from the current pick; once its call's best is
    accepted, what it can still add is the difference to that best, usually nothing. Ordered by
    gain alone, the runners-up of a call with many sites would come before other calls' best
    candidates and could spend the whole budget before those are tried."""
    trials = []
    for key, timings in isolated.items():
        call = calls[key]
        if not timings or call.isolated_from in ("unranked", "recalled", "failed"):
            continue
        done = tried.get(key, set())
        room = per_call - len(done)
        if room <= 0:
            continue
        # A pick the prior round confirmed in the step has no isolated time: the floor's stands in.
        current = call.isolated_ms if call.changed and call.isolated_ms is not None else call.floor_isolated_ms
        reference = current if current is not None else max(timings.values())
        ranked = sorted((ms, i, cfg) for i, (cfg, ms) in enumerate(timings.items()) if cfg not in (call.floor_cfg, call.cfg) and cfg not in done)
        chosen = [(ms, cfg) for ms, _, cfg in ranked if not skip_slower or ms < reference][:room]
        for place, (ms, cfg) in enumerate(chosen):
            trials.append((place, Trial(*key, cfg, ms, (reference - ms) * call.sites)))
    trials.sort(key=lambda pt: (pt[0], -pt[1].expected_gain_ms))
    return [trial for _, trial in trials]


def size_estimate(inv: Invocation[Any, Any], sites: int) -> float:
    """Bytes of the call's array arguments x its sites: how much of the step the call may
    take, known without compiling anything (it orders the prior round, not the rest)."""
    total = 0
    for leaf in jax.tree_util.tree_leaves((inv.args, inv.array_kwargs)):
        shape, dtype = getattr(leaf, "shape", None), getattr(leaf, "dtype", None)
        if shape is not None and dtype is not None:
            total += math.prod(int(d) for d in shape) * np.dtype(dtype).itemsize
    return float(total * sites)


def prior_trials(
    calls: Mapping[Key, CallPick], invocations: Mapping[Key, Invocation[Any, Any]], skip: Mapping[Key, Iterable[Any]], per_call: int,
) -> list[Trial]:
    """The prior round's confirmations: each call's first prior candidate, calls by
    :func:`size_estimate` (largest first), then the second priors, and so on, at most
    ``per_call`` per call; candidates in ``skip`` (lost before at the shape class) left out.
    Their isolated time is None (not ranked in isolation); the expected gain is the size estimate."""
    rounds: list[list[Trial]] = []
    order = sorted(invocations, key=lambda key: -size_estimate(invocations[key], calls[key].sites))
    for key in order:
        call, lost = calls[key], set(skip.get(key, ()))
        prior = [cfg for cfg in prior_configs(invocations[key]) if cfg not in lost and cfg != call.floor_cfg]
        for place, cfg in enumerate(prior[:per_call]):
            while len(rounds) <= place:
                rounds.append([])
            rounds[place].append(Trial(*key, cfg, None, size_estimate(invocations[key], call.sites)))
    return [trial for trials in rounds for trial in trials]
