"""Tuning in context: a config counts only if the whole step gets faster with it.

Tuning one call at a time, outside its program, cannot see what decides the step time: XLA's
fusions across call boundaries, layouts, custom-VJP boundaries that stop them. A kernel that
wins in isolation can lose in the step. ``tune_in_context(fn, *args)`` therefore measures the
compiled step itself:

1. **Discover.** Trace ``fn`` once under :func:`~ejlabel.recording` with a counting overlay:
   the distinct kernel calls ``(op_id, call_key)`` it makes and at how many sites each.
2. **Floor.** The all-XLA assignment: every call gets the config of the plain path its kernel
   declares (``kernel.plain_config(inv)``, ``Kernel.plain_implementation``: ``"xla"`` for the
   library's kernels), else its heuristic config. It is written out as an explicit assignment,
   so that every candidate differs from the incumbent in exactly one call. The floor is
   compiled and timed first.
3. **Rank.** Each call's candidates get isolated timings (:meth:`~.isolated.Autotuner.tune_each`, or the
   per-candidate timings an earlier tuning stored in the persistent cache). A candidate's
   expected gain is (floor's isolated time - its isolated time) x the number of sites. With a
   budget, the ranking may use at most ``RANK_SHARE`` (half) of the time left once the floor is
   timed, so that confirmations get the rest: its deadline stops it starting new compiles and
   timings (:meth:`~.isolated.Autotuner.tune_each`). What a call had timed before the cut still ranks; a
   call with nothing timed but its floor is *cut*: it keeps the floor, is reported as a skipped
   trial, and nothing of it is stored.
4. **Confirm, greedily.** Every call's best candidate first, in order of expected gain, then
   the runners-up (see :func:`_plan`): the incumbent assignment with that one call changed is
   compiled ahead of time (a few at once, in threads: XLA compiles outside the GIL) and its
   whole step is timed against the incumbent's in paired rounds (:class:`~.search.Search`). The
   change is kept only if the noise rule (:mod:`.paired`) accepts it. The budget (seconds,
   whole run) is checked before each batch of compiles, each measurement and each extra block
   of rounds; what it cut off is reported as skipped.
5. **Check and store.** The final assignment is timed against the floor (and ``baseline_fn``,
   if given) in the same paired rounds and judged by the same rule; if it is not accepted, the
   floor is kept. Every call's pick, XLA included, goes to the memory and persistent caches with
   provenance ``"in-context"`` and the step times that justify it, so the next run uses them;
   a cut call is not stored, and a call whose ranking the budget cut short is stored with
   ``ranking_cut`` set, so the next run ranks it again instead of reusing a partial ranking.

What the run measured and chose comes back as a :class:`~.report.ContextTuneReport`.
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import numpy as np

from ejlabel.config.cache import AutotunePolicy
from ejlabel.config.persistent import CacheError
from ejlabel.config.selection import ConfigSelectorChain
from ejlabel.core.kernel import Invocation, random_values
from ejlabel.execution.executor import get_default_executor
from ejlabel.execution.tuning.candidates import AutotuneError, TuneResult, TuningCut
from ejlabel.execution.tuning.isolated import Autotuner
from ejlabel.execution.tuning.report import CallPick, ContextTuneReport, Key, Trial
from ejlabel.execution.tuning.search import Search, discover
from ejlabel.utils.serialize import from_jsonable

__all__ = ["PROVENANCE", "RANK_SHARE", "tune_in_context"]

PROVENANCE = "in-context"
RANK_SHARE = 0.5  # the isolated ranking's share of the time left once the floor is timed


def tune_in_context(
    fn: Callable[..., Any],
    *args: Any,
    baseline_fn: Callable[..., Any] | None = None,
    budget_s: float | None = 300.0,
    samples: int = 10,
    warmup: int = 2,
    candidates_per_call: int = 2,
    skip_slower_in_isolation: bool = True,
    min_gain: float = 0.01,
    policy: AutotunePolicy | None = None,
    selector: ConfigSelectorChain | None = None,
    reuse_isolated: bool = True,
    store: bool = True,
    progress: bool | None = None,
    verbose: bool = True,
    seed: int = 0,
) -> ContextTuneReport:
    """Tune the kernel calls of the step ``fn(*args)`` by timing the whole compiled step.

    See the module docstring for the algorithm, and :mod:`.paired` for the noise rule.

    Args:
      fn: the step function, as written in Python (kernels called through the executor).
      *args: example arguments: arrays, ``jax.ShapeDtypeStruct``\\ s (random values are made
        for them) or pytrees of those.
      baseline_fn: the same step written in plain JAX, timed in the final measurement.
      budget_s: seconds for the whole run (None: no limit). The isolated ranking may use
        ``RANK_SHARE`` of the time left once the floor is timed, the confirmations the rest;
        what either did not start in time is reported as skipped. Discovering the calls,
        the floor and the final check's first block of rounds always run.
      samples: paired rounds in a comparison's first block, and in each further block while
        the noise rule is undecided (at most ``ROUND_CAP`` x samples rounds; the final check
        starts with twice as many); warmup: untimed runs of each program before its rounds.
      candidates_per_call: the fastest candidates in isolation confirmed per call.
      skip_slower_in_isolation: confirm only candidates faster than XLA in isolation; False also
        confirms slower ones (fusion can reorder them in context, at a compile each).
      min_gain: the smallest relative gain worth a change: the noise rule accepts a change only
        if its lower bound on the gain exceeds ``min_gain`` x the incumbent's step time.
      policy: the isolated ranking's tuning policy (the selector's by default);
        ``compile_workers`` also sets how many whole programs compile at once.
      selector: whose memory and persistent caches receive the picks (default executor's).
      reuse_isolated: take isolated timings an earlier tuning stored in the persistent cache
        instead of measuring them again.
      store: write the picks to the caches.
      progress: show progress bars (None: when stderr is a terminal); verbose: print the report.
      seed: seed of the random arguments made for specs.
    """
    if not callable(fn):
        raise TypeError(f"fn: expected the step function, got {type(fn).__name__}")
    if baseline_fn is not None and not callable(baseline_fn):
        raise TypeError(f"baseline_fn: expected a function or None, got {type(baseline_fn).__name__}")
    if budget_s is not None and not budget_s > 0:
        raise ValueError(f"budget_s: expected None or > 0, got {budget_s!r}")
    for name, value, least in (("samples", samples, 2), ("warmup", warmup, 0), ("candidates_per_call", candidates_per_call, 1)):
        if not isinstance(value, int) or value < least:
            raise ValueError(f"{name}: expected an int >= {least}, got {value!r}")
    if not 0 <= min_gain < 1:
        raise ValueError(f"min_gain: expected a fraction in [0, 1), got {min_gain!r}")

    start = time.perf_counter()
    stages = _Stages(start)
    selector = selector if selector is not None else get_default_executor().selector
    policy = policy if policy is not None else selector.policy
    args = _concrete(args, seed)
    errors: dict[str, str] = {}

    # 1. Discover the calls; 2. compile and time the floor.
    sites, invocations = discover(fn, args)
    floor: dict[Key, Any] = {key: _floor_cfg(inv) for key, inv in invocations.items()}
    deadline = start + budget_s if budget_s is not None else math.inf
    search = Search(fn, args, sites, samples, warmup, min_gain, policy.compile_workers, deadline)
    floor_exe = search.compile_floor(floor)
    stages.end("calls and floor")

    # 3. Rank each call's candidates in isolation; 4. confirm the promising ones in the step.
    calls = {key: CallPick(*key, sites[key], floor[key], floor[key]) for key in invocations}
    ranking = _Ranking(policy, selector, reuse_isolated, progress, seed, _rank_deadline(deadline))
    isolated = ranking.rank(invocations, floor, calls, errors)
    stages.end("isolated ranking")
    trials = _plan(calls, isolated, candidates_per_call, skip_slower_in_isolation)
    incumbent, tuned_exe = search.confirm(floor, floor_exe, trials, calls, progress)
    trials += _cut_trials(calls.values())
    stages.end("confirmations")

    # 5. The final check against the floor (and the plain baseline), then store.
    changed = incumbent != floor
    programs = [floor_exe] + ([tuned_exe] if changed else [])
    if baseline_fn is not None:
        programs.append(search.compile_plain(baseline_fn))
    timings, final = search.compare(programs, first=2 * samples, judge=changed)
    stages.end("final check")
    reverted = final is not None and not final.accepted
    tuned_time = timings[1] if changed and not reverted else timings[0]
    _settle(calls.values(), reverted, tuned_time.median_ms)
    report = ContextTuneReport(
        floor=timings[0], tuned=tuned_time, baseline=timings[-1] if baseline_fn is not None else None,
        final=final, calls=list(calls.values()), trials=trials, errors=errors, samples=timings[0].count,
        budget_s=budget_s, wall_s=0.0, compile_s=search.compile_s, stored=store, reverted=reverted,
    )
    if store:
        _store(report, invocations, trials, selector, errors)
        stages.end("storing")
    report.wall_s = time.perf_counter() - start
    report.stages_s = stages.seconds
    if verbose:
        print(report.render(), flush=True)
    return report


class _Stages:
    """Wall seconds of each stage of a run, in order: where a budget went."""

    def __init__(self, start: float) -> None:
        self.seconds: dict[str, float] = {}
        self._last = start

    def end(self, stage: str) -> None:
        now = time.perf_counter()
        self.seconds[stage] = now - self._last
        self._last = now


def _rank_deadline(deadline: float) -> float | None:
    """When the isolated ranking must stop: ``RANK_SHARE`` of the time left to ``deadline``."""
    if math.isinf(deadline):
        return None
    now = time.perf_counter()
    return now + RANK_SHARE * max(0.0, deadline - now)


def _cut_trials(calls: Iterable[CallPick]) -> list[Trial]:
    """One skipped trial per call whose ranking the budget cut before it timed an alternative."""
    reason = "time budget spent before the isolated ranking timed an alternative to the floor"
    return [Trial(*call.key, None, None, None, status="skipped", reason=reason) for call in calls if call.isolated_from == "cut"]


def _settle(calls: Iterable[CallPick], reverted: bool, step_ms: float) -> None:
    """After the final check: a reverted run puts every call back on its floor; a call that no
    confirmation measured gets the final step time."""
    for call in calls:
        if reverted:
            # Each change won its own comparison, but together they do not beat the floor.
            call.cfg, call.isolated_ms, call.compared_to_ms = call.floor_cfg, call.floor_isolated_ms, None
            call.step_ms = None
        if call.step_ms is None:
            call.step_ms = step_ms


def _floor_cfg(inv: Invocation[Any, Any]) -> Any:
    """The config of the plain path ``inv``'s kernel declares, else its heuristic config."""
    cfg = inv.kernel.plain_config(inv)
    return cfg if cfg is not None else inv.kernel.heuristic_cfg(inv)


@dataclasses.dataclass
class _Ranking:
    """The isolated ranking of each call's candidates, stopped by ``deadline`` (None: never)."""

    policy: AutotunePolicy
    selector: ConfigSelectorChain
    reuse: bool
    progress: bool | None
    seed: int
    deadline: float | None

    def rank(
        self, invocations: Mapping[Key, Invocation[Any, Any]], floor: Mapping[Key, Any], calls: Mapping[Key, CallPick], errors: dict[str, str]
    ) -> dict[Key, dict[Any, float]]:
        """``{key: {cfg: isolated ms}}`` over each call's correct candidates (the floor's included)."""
        isolated: dict[Key, dict[Any, float]] = {}
        to_tune: list[Key] = []
        for key in invocations:
            stored = self._stored(key)
            if floor[key] in stored and len(stored) > 1:
                isolated[key] = stored
                calls[key].isolated_from = "cache"
            else:
                to_tune.append(key)
        if to_tune:
            lists = {i: _candidate_list(invocations[key], floor[key]) for i, key in enumerate(to_tune)}
            tuner = Autotuner(self.policy, progress=self.progress, seed=self.seed)
            outcomes = tuner.tune_each([invocations[key] for key in to_tune], lists, deadline=self.deadline)
            for key, outcome in zip(to_tune, outcomes):
                isolated[key] = _take(calls[key], outcome, errors)
        for key, timings in isolated.items():
            call = calls[key]
            call.floor_isolated_ms = call.isolated_ms = timings.get(floor[key])
            if not call.candidates:
                call.candidates = [{"cfg": cfg, "status": "ok", "median_ms": ms} for cfg, ms in timings.items()]
        return isolated

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
        return _isolated_from_stats(entry.stats)


def _take(call: CallPick, outcome: TuneResult | AutotuneError, errors: dict[str, str]) -> dict[Any, float]:
    """One call's isolated timings from its tuning outcome; notes a cut or a failure on ``call``."""
    if isinstance(outcome, TuningCut):
        call.isolated_from = "cut"
        call.candidates = _candidate_rows(outcome.candidates)
        return {}
    if isinstance(outcome, AutotuneError):
        errors[f"{call.op_id}:{call.call_key}"] = f"isolated tuning failed, XLA stays: {outcome}"
        call.isolated_from = "failed"
        return {}
    call.candidates = _candidate_rows(outcome.candidates)
    timings = {c.cfg: c.timing.median_ms for c in outcome.candidates if c.timing is not None and c.status in ("ok", "pruned")}
    if outcome.cut:
        call.isolated_from = "partial" if any(cfg != call.floor_cfg for cfg in timings) else "cut"
    return timings


def _candidate_rows(candidates: Sequence[Any]) -> list[dict[str, Any]]:
    return [{"cfg": c.cfg, "status": c.status, "median_ms": c.timing.median_ms if c.timing is not None else None} for c in candidates]


def _isolated_from_stats(stats: Any) -> dict[Any, float]:
    """``{cfg: isolated median ms}`` of the correct candidates an earlier tuning stored, if any.

    Understands the ``candidates`` list of both ``autotuned`` entries (timing dicts, configs as
    tagged JSON) and ``in-context`` entries (``median_ms``, configs decoded).
    """
    timings: dict[Any, float] = {}
    for item in (stats or {}).get("candidates") or []:
        if not isinstance(item, dict) or item.get("status") not in ("ok", "pruned"):
            continue
        cfg = item.get("cfg")
        try:
            cfg = from_jsonable(cfg) if isinstance(cfg, dict) else cfg
            hash(cfg)
        except (ValueError, TypeError, KeyError, AttributeError, ImportError):
            continue
        timing = item.get("timing")
        median = timing.get("median_ms") if isinstance(timing, dict) else item.get("median_ms")
        if isinstance(median, (int, float)) and math.isfinite(median):
            timings[cfg] = float(median)
    return timings


def _candidate_list(inv: Invocation[Any, Any], floor_cfg: Any) -> list[Any]:
    kernel = inv.kernel
    return list(dict.fromkeys([floor_cfg, kernel.heuristic_cfg(inv), *kernel.config_space(inv)]))


def _plan(calls: Mapping[Key, CallPick], isolated: Mapping[Key, Mapping[Any, float]], per_call: int, skip_slower: bool) -> list[Trial]:
    """The confirmations to try: every call's best candidate first, by expected gain (isolated
    gain x sites), then the calls' second candidates, and so on.

    A runner-up's expected gain is measured from the floor; once its call's best is accepted,
    what it can still add is the difference to that best, usually nothing. Ordered by gain
    alone, the runners-up of a call with many sites would come before other calls' best
    candidates and could spend the whole budget before those are tried."""
    trials = []
    for key, timings in isolated.items():
        call = calls[key]
        if not timings:
            continue
        reference = call.floor_isolated_ms if call.floor_isolated_ms is not None else max(timings.values())
        ranked = sorted((ms, i, cfg) for i, (cfg, ms) in enumerate(timings.items()) if cfg != call.floor_cfg)
        chosen = [(ms, cfg) for ms, _, cfg in ranked if not skip_slower or ms < reference][:per_call]
        for place, (ms, cfg) in enumerate(chosen):
            trials.append((place, Trial(*key, cfg, ms, (reference - ms) * call.sites)))
    trials.sort(key=lambda pt: (pt[0], -pt[1].expected_gain_ms))
    return [trial for _, trial in trials]


def _store(report: ContextTuneReport, invocations: Mapping[Key, Invocation[Any, Any]], trials: list[Trial], selector: ConfigSelectorChain, errors: dict[str, str]) -> None:
    """Every call's pick into the memory and persistent caches, with the step times behind it.

    A call whose ranking was cut before it timed an alternative is not stored: nothing about it
    was decided, and whatever the caches held for it stays.
    """
    for call in report.calls:
        if call.isolated_from == "cut":
            continue
        key = call.key
        stats = _stats(report, call, trials)
        inv = invocations[key]
        selector.cache.put(*key, call.cfg)
        if selector.persistent is not None:
            try:
                selector.persistent.put(*key, call.cfg, provenance=PROVENANCE, stats=stats, kernel_version=inv.kernel_version)
            except (CacheError, TypeError) as err:
                errors[f"{call.op_id}:{call.call_key}"] = f"not stored in the persistent cache: {err}"


def _stats(report: ContextTuneReport, call: CallPick, trials: list[Trial]) -> dict[str, Any]:
    """The statistics stored with one call's pick: step times, the comparisons behind it, the
    isolated ranking (flagged ``ranking_cut`` when the budget cut it, so no later run reuses it)."""
    own = [t for t in trials if t.key == call.key and t.status in ("accepted", "rejected")]
    deciding = next((t for t in reversed(own) if t.status == "accepted" and t.cfg == call.cfg), None)
    if deciding is None and own and not call.changed:
        deciding = min(own, key=lambda t: t.candidate.median_ms)  # the best alternative, rejected
    stats: dict[str, Any] = {
        "step_ms": report.tuned.median_ms,
        "floor_step_ms": report.floor.median_ms,
        "samples": report.samples,
        "noise_ms": _finite(report.noise_ms),
        "median_ms": call.isolated_ms,  # isolated kernel time, as in autotuned entries
        "isolated_ms": call.isolated_ms,
        "floor_isolated_ms": call.floor_isolated_ms,
        "sites": call.sites,
        "candidates": call.candidates,
        "ranking_cut": call.ranking_cut,
    }
    if report.final is not None:
        stats["final"] = report.final.to_dict()
    if report.baseline is not None:
        stats["baseline_step_ms"] = report.baseline.median_ms
    if deciding is not None:
        stats["incumbent_step_ms"] = deciding.incumbent.median_ms
        stats["candidate_step_ms"] = deciding.candidate.median_ms
        stats["candidate_cfg"] = deciding.cfg
        if deciding.comparison is not None:
            stats["comparison"] = deciding.comparison.to_dict()
    else:
        stats["incumbent_step_ms"] = report.floor.median_ms
    return stats


def _concrete(args: Sequence[Any], seed: int) -> tuple[Any, ...]:
    """``args`` with every ``ShapeDtypeStruct`` leaf replaced by random values (as tuning's inputs)."""
    return tuple(random_values(tuple(args), np.random.default_rng(seed)))


def _finite(value: float | None) -> float | None:
    return value if value is not None and math.isfinite(value) else None
