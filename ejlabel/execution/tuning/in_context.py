"""Tuning in context: a config counts only if the whole step gets faster with it.

Tuning one call at a time, outside its program, cannot see what decides the step time: XLA's
fusions across call boundaries, layouts, custom-VJP boundaries that stop them. A kernel that
wins in isolation can lose in the step. ``tune_in_context(fn, *args)`` therefore measures the
compiled step itself, and its defaults are meant to be the product: with no argument but the
step and its inputs it spends a budget of ``DEFAULT_BUDGET_S`` where the gain is.

1. **Discover.** Trace ``fn`` once under :func:`~ejlabel.recording` with a counting overlay:
   the distinct kernel calls ``(op_id, call_key)`` it makes and at how many sites each.
2. **Recall.** What earlier runs picked and learned (:mod:`.memory`): a call picked before is
   taken as it was, whether that run finished with it or its budget cut the ranking (a second
   run of the same step ranks nothing and gives the same picks; the report counts the cut ones
   and points to ``exhaustive=True``), and candidates that lost at a call's shape class are
   skipped; ``exhaustive=True`` ignores both. When one earlier run picked for every call and
   its final check judged exactly these picks against the floor, nothing is compiled or timed
   at all (unless ``baseline_fn`` asks for a measurement): the report gives that run's step
   times and says so.
3. **Floor.** The all-XLA assignment: every call gets the config of the plain path its kernel
   declares (``kernel.plain_config(inv)``, ``Kernel.plain_implementation``: ``"xla"`` for the
   library's kernels), else its heuristic config. It is written out as an explicit assignment,
   so that every candidate differs from the incumbent in exactly one call. The floor, the warm
   start (the floor with the recalled picks) and the plain baseline compile at once, on the
   compile workers (by default one per core); the floor is timed.
4. **Priors, then the rest, by expected gain** (:mod:`.ranking`). First each call's prior
   candidates (those its kernel expects to beat XLA here) go straight to the whole step,
   largest call first, without isolated ranking: they are few and expected to win, and ranking
   them alone first costs each a trace and compile of its own, which in a cold process is
   most of the budget. Then each call's share of the floor step is measured (its floor timed
   alone x sites; the floors compile in parallel on the compile workers) and calls below
   ``min_gain`` are left out; measuring the shares *after* the priors is deliberate: they
   order only the rest round, and a cold process spent its whole budget on them before. The
   rest of the config spaces are then ranked in isolation, largest share first, with the time
   left. A confirmation compiles the incumbent with that one call changed (several at once,
   in threads: XLA compiles outside the GIL) and times its whole step against the
   incumbent's in paired rounds (:class:`~.search.Search`); the change is kept only if the
   noise rule (:mod:`.paired`) accepts it. The isolated round may use ``RANK_SHARE`` (half) of
   the time left, so that its confirmations get the rest.
5. **The budget is the wall time.** ``budget_s`` bounds the whole run, final check included:
   the final check's estimated time is held back, the budget is checked before each batch of
   compiles, each measurement and each extra block of rounds, and a compile still running when
   the time is up is not waited for (its trial is reported as skipped). The report's stage
   times add up to the run's wall time; what the budget cut off is reported as left untried.
6. **Check and store.** The final assignment is timed against the floor (and ``baseline_fn``,
   if given) in the same paired rounds and judged by the same rule; if it is not accepted, the
   floor is kept. Every call's pick, XLA included, goes to the memory and persistent caches with
   provenance ``"in-context"``, the step times that justify it, its share, whether it was
   decided, and the candidates that lost, so the next run uses them. A call whose ranking the
   budget cut is stored too (with ``ranking_cut`` set and ``decided`` False): the final check
   judged its pick as part of the whole assignment, and the next run recalls it rather than
   spending its budget again.

What the run measured and chose, and what it left, comes back as a
:class:`~.report.ContextTuneReport`.
"""

from __future__ import annotations

import math
import time
import uuid
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import numpy as np

from ejlabel.config.cache import AutotunePolicy
from ejlabel.config.persistent import CacheEntry, CacheError
from ejlabel.config.selection import ConfigSelectorChain
from ejlabel.core.kernel import Invocation, random_values
from ejlabel.execution.executor import get_default_executor
from ejlabel.execution.tuning.measure import Timing
from ejlabel.execution.tuning.memory import PROVENANCE, Recall, lost_candidates, recall, shape_class
from ejlabel.execution.tuning.ranking import Ranking, plan, prior_trials
from ejlabel.execution.tuning.report import CallPick, ContextTuneReport, Key, Trial
from ejlabel.execution.tuning.search import Search, discover

__all__ = ["DEFAULT_BUDGET_S", "PROVENANCE", "RANK_SHARE", "tune_in_context"]

RANK_SHARE = 0.5  # an isolated round's share of the time left when it starts
DEFAULT_BUDGET_S = 120.0  # seconds for a whole run with the defaults


def tune_in_context(
    fn: Callable[..., Any],
    *args: Any,
    baseline_fn: Callable[..., Any] | None = None,
    budget_s: float | None = DEFAULT_BUDGET_S,
    samples: int = 10,
    warmup: int = 2,
    candidates_per_call: int = 2,
    skip_slower_in_isolation: bool = True,
    min_gain: float = 0.01,
    exhaustive: bool = False,
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
      budget_s: seconds for the whole run (None: no limit). Each isolated round may use
        ``RANK_SHARE`` of the time left when it starts, its confirmations the rest; what was
        not started in time is reported as left. Discovering the calls, the floor and the
        final check's first block of rounds always run.
      samples: paired rounds in a comparison's first block, and in each further block while
        the noise rule is undecided (at most ``ROUND_CAP`` x samples rounds; the final check
        starts with twice as many); warmup: untimed runs of each program before its rounds.
      candidates_per_call: the fastest candidates in isolation confirmed per call, over the run.
      skip_slower_in_isolation: confirm only candidates faster than the call's pick in
        isolation; False also confirms slower ones (fusion can reorder them in context, at a
        compile each).
      min_gain: the smallest relative gain worth a change: the noise rule accepts a change only
        if its lower bound on the gain exceeds ``min_gain`` x the incumbent's step time; a call
        whose share of the step is below it is not ranked.
      exhaustive: rank every call (whatever its share) over every candidate, ignoring what
        earlier runs decided and learned and the isolated timings they stored.
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

    # 1. Discover the calls; 2. recall what earlier runs decided; 3. compile and time the floor.
    sites, invocations = discover(fn, args)
    floor: dict[Key, Any] = {key: _floor_cfg(inv, errors) for key, inv in invocations.items()}
    calls = {key: CallPick(*key, sites[key], floor[key], floor[key]) for key in invocations}
    memory = Recall() if exhaustive else recall(selector.persistent, invocations, sites, floor)
    warm = dict(floor)
    for key, entry in memory.picks.items():
        warm[key] = _recalled(calls[key], entry)
    together = None if exhaustive or baseline_fn is not None else memory.checked_together(calls)
    if together is not None:
        # One earlier run picked for every call and checked this very assignment against the floor.
        return _report_recalled(calls, warm != floor, together, selector, store, budget_s, errors, start, stages, verbose, len(memory.cut))
    deadline = start + budget_s if budget_s is not None else math.inf
    search = Search(fn, args, sites, samples, warmup, min_gain, policy.compile_workers, deadline)
    floor_exe, floor_time, incumbent_exe, baseline_exe = search.start(floor, warm, baseline_fn)
    if incumbent_exe is None:  # the recalled picks do not compile together: tune those calls again
        errors["recalled picks"] = f"did not compile together, tuned again from the floor: {search.warm_error}"
        for key in memory.picks:
            calls[key] = CallPick(*key, sites[key], floor[key], floor[key])
        memory.picks.clear()
        warm, incumbent_exe = dict(floor), floor_exe
    search.deadline = deadline - search.final_s(2 + (baseline_fn is not None))  # the final check's time held back
    stages.end("calls and floor")

    # 4. The priors straight to the whole step; then the shares, the rest ranked and confirmed.
    to_rank = {key: inv for key, inv in invocations.items() if key not in memory.picks}
    incumbent, tried = warm, {}
    trials = prior_trials(calls, to_rank, memory.losers, candidates_per_call)
    for trial in trials:
        tried.setdefault(trial.key, set()).add(trial.cfg)
    incumbent, incumbent_exe = search.confirm(incumbent, incumbent_exe, trials, calls, progress)
    stages.end("priors in the step")
    ranking = Ranking(policy, selector, reuse_isolated and not exhaustive, progress, seed, calls, floor, errors)
    ranking.in_context = {key: set(cfgs) for key, cfgs in tried.items()}
    ranking.prepare(to_rank, memory.losers)
    rank_deadline = _rank_deadline(search.deadline)
    ranking.shares(floor_time.median_ms, min_gain, exhaustive, rank_deadline)
    stages.end("shares of the step")
    ranking.rank("rest", rank_deadline)
    stages.end("isolated ranking")
    planned = plan(calls, ranking.isolated, candidates_per_call, skip_slower_in_isolation, tried)
    for trial in planned:
        tried.setdefault(trial.key, set()).add(trial.cfg)
    incumbent, incumbent_exe = search.confirm(incumbent, incumbent_exe, planned, calls, progress)
    trials += planned
    stages.end("confirmations")
    trials += _cut_trials(call for call in calls.values() if call.key not in tried)
    _note_left(calls.values(), trials, min_gain)

    # 5. The final check against the floor (and the plain baseline), then store.
    changed = incumbent != floor
    accepted = {trial.key for trial in trials if trial.status == "accepted"} | {key for key in memory.picks if warm[key] != floor[key]}
    programs = [floor_exe] + ([incumbent_exe] if changed else []) + ([baseline_exe] if baseline_exe is not None else [])
    timings, final = search.compare(programs, first=2 * samples, judge=changed)
    stages.end("final check")
    reverted = final is not None and not final.accepted
    tuned_time = timings[1] if changed and not reverted else timings[0]
    _settle(calls.values(), reverted, tuned_time.median_ms)
    report = ContextTuneReport(
        floor=timings[0], tuned=tuned_time, baseline=timings[-1] if baseline_fn is not None else None,
        final=final, calls=list(calls.values()), trials=trials, errors=errors, samples=timings[0].count,
        budget_s=budget_s, wall_s=0.0, compile_s=search.compile_s, stored=store, reverted=reverted, ranked=ranking.in_share_order(),
        recalled_cut=len(memory.cut),
    )
    if store:
        undecided = accepted if reverted else set()  # a change the final check undid is looked at again next time
        _store(report, invocations, trials, selector, errors, skip_slower_in_isolation, undecided, memory.picks)
        stages.end("storing")
    report.wall_s = stages.last - start  # the stages add up to it
    report.stages_s = stages.seconds
    if verbose:
        print(report.render(), flush=True)
    return report


class _Stages:
    """Wall seconds of each stage of a run, in order of first use: where a budget went (a stage
    that runs once per round adds up)."""

    def __init__(self, start: float) -> None:
        self.seconds: dict[str, float] = {}
        self.last = start

    def end(self, stage: str) -> None:
        now = time.perf_counter()
        self.seconds[stage] = self.seconds.get(stage, 0.0) + now - self.last
        self.last = now


def _rank_deadline(deadline: float) -> float | None:
    """When an isolated round must stop: ``RANK_SHARE`` of the time left to ``deadline``."""
    if math.isinf(deadline):
        return None
    now = time.perf_counter()
    return now + RANK_SHARE * max(0.0, deadline - now)


def _recalled(call: CallPick, entry: CacheEntry) -> Any:
    """Take the pick an earlier run decided for ``call``; returns it."""
    stats = entry.stats or {}
    number = lambda name: stats.get(name) if isinstance(stats.get(name), (int, float)) else None  # noqa: E731
    call.cfg, call.isolated_from = entry.config, "recalled"
    call.floor_isolated_ms, call.isolated_ms, call.share = number("floor_isolated_ms"), number("isolated_ms"), number("share")
    return entry.config


def _report_recalled(
    calls: Mapping[Key, CallPick], changed: bool, times: tuple[float, float], selector: ConfigSelectorChain, store: bool,
    budget_s: float | None, errors: dict[str, str], start: float, stages: _Stages, verbose: bool, recalled_cut: int,
) -> ContextTuneReport:
    """The report of a run that found every pick decided and checked together before: the step
    times are that run's, nothing is compiled or timed, nothing stored but the memory cache."""
    floor_ms, step_ms = times
    floor_time = Timing([floor_ms])
    for call in calls.values():
        call.step_ms = step_ms
        if store:
            selector.cache.put(*call.key, call.cfg)
    stages.end("calls and floor")
    report = ContextTuneReport(
        floor=floor_time, tuned=Timing([step_ms]) if changed else floor_time, baseline=None, final=None, calls=list(calls.values()),
        trials=[], errors=errors, samples=0, budget_s=budget_s, wall_s=time.perf_counter() - start, compile_s=0.0, stored=False,
        measured=False, recalled_cut=recalled_cut,
    )
    report.stages_s = stages.seconds
    if verbose:
        print(report.render(), flush=True)
    return report


def _cut_trials(calls: Iterable[CallPick]) -> list[Trial]:
    """One skipped trial per call whose ranking the budget cut before it timed an alternative."""
    reason = "time budget spent before the isolated ranking timed an alternative to the floor"
    return [Trial(*call.key, None, None, None, status="skipped", reason=reason) for call in calls if call.isolated_from == "cut"]


def _note_left(calls: Iterable[CallPick], trials: Sequence[Trial], min_gain: float) -> None:
    """Write on each call what the run left untried of it and why."""
    for call in calls:
        notes = []
        untimed = sum(row.get("status") == "skipped" for row in call.candidates)
        if call.isolated_from == "unranked":
            notes.append(f"not ranked: its share is below min_gain ({min_gain:.1%}), so no change of it could pass the noise rule")
        elif call.isolated_from == "cut" and call.share is None:
            notes.append("time budget: not measured")
        elif call.isolated_from in ("cut", "partial"):
            notes.append(f"time budget: {untimed} of {len(call.candidates)} candidates not ranked")
        skipped = sum(t.key == call.key and t.cfg is not None and t.status == "skipped" for t in trials)
        if skipped:
            notes.append(f"time budget: {skipped} planned confirmations not run")
        call.left = "; ".join(notes) or None


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


def _floor_cfg(inv: Invocation[Any, Any], errors: dict[str, str]) -> Any:
    """The config of the plain path ``inv``'s kernel declares, else its heuristic config.

    A kernel whose ``plain_config`` raises on this call keeps its heuristic config, and the error
    is reported under the call: one call's failure does not stop the others' tuning.
    """
    try:
        cfg = inv.kernel.plain_config(inv)
    except Exception as err:  # noqa: BLE001 - the kernel's code, on this call alone
        errors[f"{inv.op_id}:{inv.call_key}"] = f"no plain-path config ({type(err).__name__}: {err}); its heuristic config stays"
        cfg = None
    return cfg if cfg is not None else inv.kernel.heuristic_cfg(inv)


def _store(
    report: ContextTuneReport, invocations: Mapping[Key, Invocation[Any, Any]], trials: list[Trial], selector: ConfigSelectorChain,
    errors: dict[str, str], skip_slower: bool, undecided: set[Key], recalled: Mapping[Key, CacheEntry],
) -> None:
    """Every call's pick into the memory and persistent caches, with the step times behind it,
    all marked with one ``run`` id: the calls this run's final check judged together.

    A call whose ranking was cut is stored too, undecided: the final check judged its pick with
    the others, and the next run recalls it instead of spending its budget on it again. A
    recalled call keeps its entry with this run's step times, unless the final check undid its
    pick.
    """
    run = uuid.uuid4().hex[:16]
    for call in report.calls:
        key = call.key
        selector.cache.put(*key, call.cfg)
        inv = invocations[key]
        fresh = _stats(report, call, trials)
        fresh["run"] = run
        if call.isolated_from == "recalled" and key not in undecided:
            step = ("run", "step_ms", "floor_step_ms", "samples", "noise_ms", "final", "baseline_step_ms")
            stats = {name: value for name, value in (recalled[key].stats or {}).items() if name not in step}
            stats |= {name: fresh[name] for name in step if name in fresh}
        else:
            stats = fresh
            stats["decided"] = _decided(call, trials) and key not in undecided
            stats["recall"] = key not in undecided  # a change the final check undid is tuned again
            stats["shape_class"] = shape_class(inv)
            stats["lost"] = lost_candidates(call, trials, skip_slower)
        if selector.persistent is not None:
            try:
                selector.persistent.put(*key, call.cfg, provenance=PROVENANCE, stats=stats, kernel_version=inv.kernel_version)
            except (CacheError, TypeError, ValueError) as err:
                errors[f"{call.op_id}:{call.call_key}"] = f"not stored in the persistent cache: {err}"


def _decided(call: CallPick, trials: Sequence[Trial]) -> bool:
    """Whether this run finished with ``call``: complete ranking (or too small a share to rank)
    and every confirmation planned for it measured."""
    if call.isolated_from not in ("measured", "cache", "unranked"):
        return False
    return not any(t.key == call.key and t.status in ("skipped", "pending") for t in trials)


def _stats(report: ContextTuneReport, call: CallPick, trials: list[Trial]) -> dict[str, Any]:
    """The statistics stored with one call's pick: step times, the comparisons behind it, its
    share of the step and what was left of it, the isolated ranking (flagged ``ranking_cut``
    when the budget cut it, so no later run reuses it)."""
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
        "share": _finite(call.share),
        "left": call.left,
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
