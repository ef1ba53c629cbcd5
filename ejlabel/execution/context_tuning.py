"""Tuning in context: a config counts only if the whole step gets faster with it.

Tuning one call at a time, outside its program, cannot see what decides the step time: XLA's
fusions across call boundaries, layouts, custom-VJP boundaries that stop them. A kernel that
wins in isolation can lose in the step. ``tune_in_context(fn, *args)`` therefore measures the
compiled step itself:

1. **Discover.** Trace ``fn`` once under :func:`~ejlabel.recording` with a counting overlay:
   the distinct kernel calls ``(op_id, call_key)`` it makes and at how many sites each.
2. **Floor.** The all-XLA assignment: every call gets ``kernel.config_for(inv, "xla")``, what
   :func:`~ejlabel.use_implementation` ``("xla")`` selects (a kernel without an XLA path keeps
   its usual selection). It is written out as an explicit assignment, so that every candidate
   differs from the incumbent in exactly one call. The floor is compiled and timed first.
3. **Rank.** Each call's candidates get isolated timings (:meth:`Autotuner.tune_each`, or the
   per-candidate timings an earlier tuning stored in the persistent cache). A candidate's
   expected gain is (floor's isolated time - its isolated time) x the number of sites. With a
   budget, the ranking may use at most ``RANK_SHARE`` (half) of the time left once the floor is
   timed, so that confirmations get the rest: its deadline stops it starting new compiles and
   timings (:meth:`Autotuner.tune_each`). What a call had timed before the cut still ranks; a
   call with nothing timed but its floor is *cut*: it keeps the floor, is reported as a skipped
   trial, and nothing of it is stored.
4. **Confirm, greedily.** Every call's best candidate first, in order of expected gain, then
   the runners-up (see :func:`_plan`): the incumbent assignment with that one call
   changed is compiled ahead of time (a few at once, in threads: XLA compiles outside the GIL)
   and its whole step is timed against the incumbent's in paired rounds (below). The change is
   kept only if the noise rule accepts it. The budget (seconds, whole run) is checked before
   each batch of compiles, each measurement and each extra block of rounds; what it cut off is
   reported as skipped.
5. **Check and store.** The final assignment is timed against the floor (and ``baseline_fn``,
   if given) in the same paired rounds and judged by the same rule; if it is not accepted, the
   floor is kept. Every call's pick, XLA included, goes to the memory and persistent caches with
   provenance ``"in-context"`` and the step times that justify it, so the next run uses them;
   a cut call is not stored, and a call whose ranking the budget cut short is stored with
   ``ranking_cut`` set, so the next run ranks it again instead of reusing a partial ranking.

Noise rule: a comparison runs in rounds; each round times the incumbent I and the challenger C
back to back (the order alternating by round: I C, C I, I C, ...), which pairs them: drift and
the machine's state at that moment hit both alike, and cancel in the round's difference
``d = I - C``. The gain is estimated by the median of the d's. Its one-sided lower confidence
bound at ``LEVEL`` (95%) is the sign test's order statistic: the k-th smallest d, with k the
largest rank such that ``P(Binomial(n, 1/2) <= k - 1) <= 5%``; the upper bound is the k-th
largest (none below 5 rounds). It assumes nothing about the shape of the noise, only that rounds
are independent. With the threshold ``T = min_gain * median(I)`` (1% by default: a smaller gain
is not worth a change, which is a new compiled program and another kernel), C is *accepted*
when the lower bound exceeds T, *rejected* when the upper bound is below T, and otherwise timed
for another ``samples`` rounds, up to ``ROUND_CAP`` x ``samples`` in all and only while the
budget has room for them; still undecided then, it is rejected. The rule this replaces asked a
difference of two medians to beat the spread of single samples (their IQR); a median of n
samples scatters far less than one sample, so real gains of 2% were rejected, and it never
measured longer when the answer was unclear. Here a clear gain is decided after the first
block, a small real one by measuring longer. Each look is at 95%; several looks make a false
accept a little likelier than 5% for a change whose true gain is exactly T, and far less likely
for a change that gains nothing (its d's sit T below the line); the final check then applies
the rule to the whole assignment against the floor.

A sample lasts at least ``MIN_SAMPLE_MS`` (20 ms), far above the timer and the dispatch jitter:
if the slowest program of a comparison ran shorter than that in its last warm-up run, each
sample runs each program ``ceil(20 ms / that time)`` times in a row (at most
``MAX_RUNS_PER_SAMPLE``; each run waited for) and records the mean per run.

Traces run in a fresh ``contextvars`` context, so the caller's overlays, ``use_implementation``
and policy overrides do not leak into the assignment being measured. JAX caches traces by
function: every trace goes through a new wrapper function, and a trace that did not consult the
assignment for every call (an inner ``jax.jit`` served from JAX's cache) is redone after
``jax.clear_caches()``.
"""

from __future__ import annotations

import collections
import concurrent.futures
import contextlib
import contextvars
import dataclasses
import fractions
import functools
import math
import os
import statistics
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import jax
import numpy as np

from ejlabel.config.cache import AutotunePolicy, overlay_cache, policy_override
from ejlabel.config.persistent import CacheError
from ejlabel.config.selection import ConfigSelectorChain
from ejlabel.core.kernel import Invocation, random_values
from ejlabel.core.label_format import is_backward, parse_label
from ejlabel.core.labels import find_labels_in_lowered
from ejlabel.execution.executor import get_default_executor
from ejlabel.execution.recording import get_invocations, recording
from ejlabel.execution.tuning import (
    AutotuneError,
    Autotuner,
    Timing,
    TuneResult,
    TuningCut,
    _describe_error,
    _Progress,
)
from ejlabel.utils.fingerprint import device_fingerprint
from ejlabel.utils.serialize import from_jsonable

__all__ = [
    "LEVEL",
    "MIN_SAMPLE_MS",
    "PROVENANCE",
    "RANK_SHARE",
    "ROUND_CAP",
    "CallPick",
    "Comparison",
    "ContextTuneReport",
    "Trial",
    "tune_in_context",
]

PROVENANCE = "in-context"
LEVEL = 0.95  # one-sided confidence of the noise rule's bounds
ROUND_CAP = 4  # a comparison takes at most ROUND_CAP x samples rounds
MIN_SAMPLE_MS = 20.0  # a sample repeats a shorter step until it lasts about this long
MAX_RUNS_PER_SAMPLE = 1000
RANK_SHARE = 0.5  # the isolated ranking's share of the time left once the floor is timed
Key = tuple[str, str, str]
Assignment = Mapping[Key, Any]

# Tracing is Python work that holds the GIL anyway; one at a time keeps jax.clear_caches()
# (which a stale trace needs) from racing another trace. Compiling runs outside the lock.
_TRACE_LOCK = threading.Lock()


# ---------------------------------------------------------------------------- report


@dataclasses.dataclass(frozen=True)
class Comparison:
    """One paired comparison of a challenger with an incumbent, judged by the noise rule.

    ``verdict`` is ``accept``, ``reject`` or ``more`` (undecided: more rounds wanted). The
    gains are incumbent minus challenger, per step: ``gain_ms`` the median over ``rounds``
    paired rounds, ``lower_ms`` / ``upper_ms`` its one-sided bounds at ``LEVEL`` (infinite when
    there are too few rounds for one), ``threshold_ms`` what the lower bound must exceed
    (``min_gain`` x the incumbent's median). Each sample ran the step ``runs_per_sample`` times.
    """

    verdict: str
    rounds: int
    gain_ms: float
    lower_ms: float
    upper_ms: float
    threshold_ms: float
    why: str
    runs_per_sample: int = 1

    @property
    def accepted(self) -> bool:
        return self.verdict == "accept"

    @property
    def noise_ms(self) -> float:
        """How far the lower bound sits below the estimate: the measurement's uncertainty."""
        return self.gain_ms - self.lower_ms

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON values (an infinite bound becomes None)."""
        finite = lambda x: x if math.isfinite(x) else None  # noqa: E731
        return {
            "verdict": self.verdict, "rounds": self.rounds, "runs_per_sample": self.runs_per_sample, "level": LEVEL,
            "gain_ms": self.gain_ms, "lower_ms": finite(self.lower_ms), "upper_ms": finite(self.upper_ms),
            "threshold_ms": self.threshold_ms, "noise_ms": finite(self.noise_ms), "why": self.why,
        }

    def describe(self) -> str:
        """The gain, its bounds against the threshold, and the rounds, for one line of a report."""
        runs = f" x {self.runs_per_sample} runs" if self.runs_per_sample > 1 else ""
        return (
            f"gain {self.gain_ms:.3g} ms ({LEVEL:.0%} bounds {self.lower_ms:.3g} to {self.upper_ms:.3g}, "
            f"needs > {self.threshold_ms:.3g}), {self.rounds} rounds{runs}"
        )

    def outcome(self) -> str:
        """``accepted``, or ``rejected`` with the reason."""
        return "accepted" if self.accepted else f"rejected ({self.why})"


@dataclasses.dataclass
class Trial:
    """One confirmation: the incumbent with one call changed, timed as a whole step.

    ``status``: ``accepted``, ``rejected`` (the noise rule did not accept it),
    ``compile_error``, ``runtime_error`` or ``skipped`` (time budget spent). A call whose
    isolated ranking the budget cut before it timed any alternative to the floor appears as one
    ``skipped`` trial with ``cfg`` None: there was nothing to confirm.
    """

    device: str
    op_id: str
    call_key: str
    cfg: Any
    isolated_ms: float | None
    expected_gain_ms: float | None  # (floor's isolated ms - this one's) x sites
    status: str = "pending"
    reason: str | None = None
    incumbent: Timing | None = None
    candidate: Timing | None = None
    comparison: Comparison | None = None

    @property
    def key(self) -> Key:
        return (self.device, self.op_id, self.call_key)

    @property
    def noise_ms(self) -> float | None:
        return self.comparison.noise_ms if self.comparison is not None else None


@dataclasses.dataclass
class CallPick:
    """What one distinct call ended up with.

    ``step_ms`` is the step time measured with this pick in place (for a change: the step that
    beat ``compared_to_ms``; for the floor: the incumbent of this call's last confirmation, or
    the floor). ``isolated_from`` says where the isolated timings came from (``measured``,
    ``cache``) or what became of them: ``partial`` (the budget cut the ranking after some
    candidates were timed; those rank), ``cut`` (it cut it before any alternative to the floor
    was timed: the floor stays, nothing is stored) or ``failed``.
    """

    device: str
    op_id: str
    call_key: str
    sites: int
    floor_cfg: Any
    cfg: Any
    floor_isolated_ms: float | None = None
    isolated_ms: float | None = None
    step_ms: float | None = None
    compared_to_ms: float | None = None
    isolated_from: str = "measured"
    candidates: list[dict[str, Any]] = dataclasses.field(default_factory=list)

    @property
    def key(self) -> Key:
        return (self.device, self.op_id, self.call_key)

    @property
    def changed(self) -> bool:
        return self.cfg != self.floor_cfg

    @property
    def ranking_cut(self) -> bool:
        return self.isolated_from in ("partial", "cut")


@dataclasses.dataclass
class ContextTuneReport:
    """What ``tune_in_context`` measured and chose.

    ``floor``, ``tuned`` and ``baseline`` come from one final measurement in paired rounds
    (``samples`` of them), so they compare directly; ``final`` is the noise rule's judgement of
    the tuned step against the floor (None when nothing changed). When nothing beat the floor,
    ``tuned`` is the floor's timing.
    """

    floor: Timing
    tuned: Timing
    baseline: Timing | None
    final: Comparison | None
    calls: list[CallPick]
    trials: list[Trial]
    errors: dict[str, str]
    samples: int  # rounds of the final measurement
    budget_s: float | None
    wall_s: float
    compile_s: float
    stored: bool
    reverted: bool = False  # the final check found the tuned step no faster than the floor
    stages_s: dict[str, float] = dataclasses.field(default_factory=dict)  # wall seconds per stage, in order

    @property
    def noise_ms(self) -> float:
        """The final comparison's uncertainty (estimate minus lower bound); 0 without one."""
        return self.final.noise_ms if self.final is not None else 0.0

    @property
    def changed(self) -> list[CallPick]:
        return [call for call in self.calls if call.changed]

    @property
    def skipped(self) -> list[Trial]:
        return [trial for trial in self.trials if trial.status == "skipped"]

    @property
    def ranking_cut(self) -> list[CallPick]:
        """Calls whose isolated ranking the budget cut (``partial`` or ``cut``)."""
        return [call for call in self.calls if call.ranking_cut]

    @property
    def speedup(self) -> float:
        """The floor's median step time over the tuned one's."""
        return self.floor.median_ms / self.tuned.median_ms

    def summary(self) -> str:
        sites = sum(call.sites for call in self.calls)
        confirmed = sum(trial.status in ("accepted", "rejected") for trial in self.trials)
        cut = f", ranking cut for {len(self.ranking_cut)}" if self.ranking_cut else ""
        text = (
            f"{len(self.calls)} distinct calls at {sites} sites; {confirmed} confirmed in context, "
            f"{len(self.changed)} changed from XLA, {len(self.skipped)} skipped (time budget{cut}); "
            f"{self.wall_s:.1f} s"
        )
        return text + ("; the final check kept the floor" if self.reverted else "")

    def render(self) -> str:
        """The report as text: step times, then each call's pick, then each confirmation."""
        lines = [f"in-context tuning: {self.summary()}"]
        if self.stages_s:
            spent = ", ".join(f"{stage} {seconds:.1f} s" for stage, seconds in self.stages_s.items())
            lines.append(f"time: {spent} (compile work {self.compile_s:.1f} s, summed over threads)")
        lines.append(f"step time, median of {self.samples} paired rounds:")
        if self.baseline is not None:
            lines.append(f"  plain JAX (baseline)  {self.baseline.median_ms:10.4g} ms")
        lines.append(f"  all-XLA (floor)       {self.floor.median_ms:10.4g} ms")
        lines.append(f"  tuned                 {self.tuned.median_ms:10.4g} ms  ({self.speedup:.2f}x the floor)")
        if self.final is not None:
            kept = "" if self.final.accepted else ": the floor stays"
            lines.append(f"  tuned vs floor: {self.final.describe()}: {self.final.outcome()}{kept}")
        lines.append("")
        width = max([len("call"), *(len(f"{call.op_id}:{call.call_key}") for call in self.calls)])
        lines.append(f"{'call':{width}} {'sites':>5}  {'isolated ms':>11}  {'XLA iso ms':>10}  {'step ms':>9}  pick")
        for call in self.calls:
            note = f" (beat {call.compared_to_ms:.4g} ms)" if call.changed and call.compared_to_ms is not None else ""
            cut = {"partial": "  [ranking cut short: time budget]", "cut": "  [ranking cut: time budget]"}.get(call.isolated_from, "")
            lines.append(
                f"{call.op_id + ':' + call.call_key:{width}} {call.sites:>5}  {_ms(call.isolated_ms):>11}  "
                f"{_ms(call.floor_isolated_ms):>10}  {_ms(call.step_ms):>9}  {call.cfg!r}{note}"
                + ("" if call.changed else "  [XLA stays]") + cut
            )
        if self.trials:
            lines.append("")
            lines.append("confirmations, in order (whole step, paired rounds with the incumbent):")
            for trial in self.trials:
                lines.append(f"  {trial.op_id}:{trial.call_key} {_candidate(trial)}: {_verdict(trial)}")
        for what, error in self.errors.items():
            lines.append(f"error  {what}: {error}")
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.render()


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value:.4g}"


def _candidate(trial: Trial) -> str:
    if trial.cfg is None:
        return "(not ranked)"
    return f"{trial.cfg!r}, isolated {_ms(trial.isolated_ms)} ms"


def _verdict(trial: Trial) -> str:
    if trial.status in ("accepted", "rejected") and trial.candidate is not None and trial.incumbent is not None:
        step = f"step {trial.candidate.median_ms:.4g} ms vs incumbent {trial.incumbent.median_ms:.4g} ms"
        if trial.comparison is None:
            return f"{step}: {trial.status}"
        return f"{step}; {trial.comparison.describe()}: {trial.comparison.outcome()}"
    return f"{trial.status} ({trial.reason})"


# ---------------------------------------------------------------------------- tracing and timing


class _Overlay:
    """An assignment as an overlay cache: serves its configs and counts what the trace asked for.

    The selector consults overlays once per call site (unless the call passed ``cfg=``), so the
    counts are the number of sites per key.
    """

    def __init__(self, configs: Assignment) -> None:
        self.configs = dict(configs)
        self.lookups: collections.Counter[Key] = collections.Counter()

    def get(self, dev: Any, op_id: str | None = None, call_key: str | None = None) -> Any | None:
        key = tuple(dev) if op_id is None else (dev, op_id, call_key)
        self.lookups[key] += 1  # type: ignore[index]
        return self.configs.get(key)  # type: ignore[arg-type]


def _lower_once(fn: Callable[..., Any], args: Sequence[Any], configs: Assignment, record: bool) -> tuple[Any, collections.Counter[Key]]:
    overlay = _Overlay(configs)

    def step(*a: Any) -> Any:  # a new function object per trace: JAX caches traces by function
        return fn(*a)

    def trace() -> Any:
        with contextlib.ExitStack() as stack:
            stack.enter_context(overlay_cache(overlay))
            stack.enter_context(policy_override(autotune=False))  # a miss must not start tuning mid-trace
            if record:
                stack.enter_context(recording())
            return jax.jit(step).lower(*args)

    # A fresh context: the caller's overlays and use_implementation must not leak in.
    return contextvars.Context().run(trace), overlay.lookups


def _lower(fn: Callable[..., Any], args: Sequence[Any], configs: Assignment, sites: Mapping[Key, int]) -> Any:
    """Lower ``fn`` with ``configs``; retrace after clearing JAX's caches if a trace was stale."""
    with _TRACE_LOCK:
        lowered, lookups = _lower_once(fn, args, configs, record=False)
        if lookups != sites:
            jax.clear_caches()  # an inner jax.jit reused a trace made under another assignment
            lowered, lookups = _lower_once(fn, args, configs, record=False)
        if lookups != sites:
            raise RuntimeError(
                f"fn made different kernel calls from one trace to the next (sites {dict(sites)} then "
                f"{dict(lookups)}); tune_in_context needs a step whose calls depend only on argument shapes"
            )
    return lowered


def _discover(fn: Callable[..., Any], args: Sequence[Any]) -> tuple[dict[Key, int], dict[Key, Invocation[Any, Any]]]:
    """The distinct kernel calls of ``fn`` (with their site counts) and their invocations."""
    dev = device_fingerprint()

    def unseen(lowered: Any, lookups: Mapping[Key, int]) -> bool:
        labelled = {(dev, *parse_label(lab)) for lab in find_labels_in_lowered(lowered)}
        return bool({key for key in labelled if not is_backward(key[1])} - set(lookups))

    with _TRACE_LOCK:
        lowered, lookups = _lower_once(fn, args, {}, record=True)
        if unseen(lowered, lookups):
            # A cached inner trace hid its calls from the selector. Labels still unseen after a
            # clean trace are calls made with cfg=, which no assignment can change.
            jax.clear_caches()
            lowered, lookups = _lower_once(fn, args, {}, record=True)
    recorded = {inv.cache_key: inv for inv in get_invocations()}
    missing = [key for key in lookups if key not in recorded]
    if missing:
        raise RuntimeError(f"calls {missing} were selected but not recorded while tracing fn")
    return dict(lookups), {key: recorded[key] for key in lookups}


def _run(executable: Any, args: Sequence[Any]) -> None:
    jax.block_until_ready(executable(*args))


def _runs_per_sample(step_ms: float) -> int:
    """How many runs one sample takes so that it lasts about ``MIN_SAMPLE_MS`` (module docstring)."""
    if step_ms >= MIN_SAMPLE_MS:
        return 1
    return min(MAX_RUNS_PER_SAMPLE, math.ceil(MIN_SAMPLE_MS / max(step_ms, 1e-6)))


def _warm_up(executables: Sequence[Any], args: Sequence[Any], warmup: int) -> int:
    """Run each program ``warmup`` times (at least once); returns the runs per sample, sized on
    the slowest program's last warm-up run."""
    slowest_ms = 0.0
    for executable in executables:
        for _ in range(max(1, warmup)):
            start = time.perf_counter()
            _run(executable, args)
            last_ms = (time.perf_counter() - start) * 1e3
        slowest_ms = max(slowest_ms, last_ms)
    return _runs_per_sample(slowest_ms)


def _time_rounds(executables: Sequence[Any], args: Sequence[Any], times: list[list[float]], count: int, runs: int) -> None:
    """Append ``count`` rounds to ``times``: each round times every program once, as the mean of
    ``runs`` runs in a row (each waited for), in alternating order (AB, BA, AB, ...: it cancels a
    linear drift and gives each program the other's leftovers equally often). The parity follows
    the rounds already taken, so blocks of rounds continue the alternation."""
    order = list(range(len(executables)))
    taken = len(times[0])
    for round_ in range(taken, taken + count):
        for i in order if round_ % 2 == 0 else order[::-1]:
            start = time.perf_counter()
            for _ in range(runs):
                _run(executables[i], args)
            times[i].append((time.perf_counter() - start) * 1e3 / runs)


@functools.cache
def _bound_rank(n: int) -> int:
    """The sign test's rank for a one-sided ``LEVEL`` bound on the median of ``n`` differences.

    The largest k with ``P(Binomial(n, 1/2) <= k - 1) <= 1 - LEVEL``: the k-th smallest
    difference is then a lower bound and the k-th largest an upper bound, each at ``LEVEL``.
    0 when even k = 1 is too likely (fewer than 5 rounds at 95%): no bound yet.
    """
    alpha = fractions.Fraction(1 - LEVEL).limit_denominator(10_000)
    cumulative, rank = 0, 0
    for j in range(n + 1):
        cumulative += math.comb(n, j)
        if cumulative * alpha.denominator > alpha.numerator * 2**n:
            break
        rank = j + 1
    return rank


def _decide(incumbent_ms: Sequence[float], challenger_ms: Sequence[float], min_gain: float, cap: int) -> Comparison:
    """The noise rule (module docstring) on paired samples: round i timed ``incumbent_ms[i]``
    and ``challenger_ms[i]``. ``more`` while undecided and under ``cap`` rounds, else a verdict.
    """
    if len(incumbent_ms) != len(challenger_ms) or not incumbent_ms:
        raise ValueError(f"expected paired samples, got {len(incumbent_ms)} and {len(challenger_ms)}")
    diffs = sorted(i - c for i, c in zip(incumbent_ms, challenger_ms))
    n, rank = len(diffs), _bound_rank(len(diffs))
    lower, upper = (diffs[rank - 1], diffs[n - rank]) if rank else (-math.inf, math.inf)
    threshold = min_gain * statistics.median(incumbent_ms)
    if lower > threshold:
        verdict, why = "accept", "lower bound over the threshold"
    elif upper < threshold:
        verdict, why = "reject", "upper bound under the threshold: no worthwhile gain"
    elif n >= cap:
        verdict, why = "reject", f"undecided at the cap of {cap} rounds"
    else:
        verdict, why = "more", "undecided"
    return Comparison(verdict, n, statistics.median(diffs), lower, upper, threshold, why)


def _compare(
    executables: Sequence[Any],
    args: Sequence[Any],
    *,
    first: int,
    block: int,
    cap: int,
    warmup: int,
    min_gain: float,
    fits: Callable[[float], bool],
    judge: bool = True,
) -> tuple[list[Timing], Comparison | None]:
    """Time ``executables`` in paired rounds; with ``judge``, judge the second against the first.

    ``first`` rounds, then blocks of ``block`` more while the noise rule is undecided, up to
    ``cap`` rounds and while ``fits(seconds)`` says the next block's estimated time fits the
    budget. Returns every program's per-run timings and the verdict (None without ``judge``).
    """
    runs = _warm_up(executables, args, warmup)
    times: list[list[float]] = [[] for _ in executables]
    count = first
    while True:
        began = time.perf_counter()
        _time_rounds(executables, args, times, count, runs)
        round_s = (time.perf_counter() - began) / count
        if not judge:
            return [Timing(t) for t in times], None
        comparison = _decide(times[0], times[1], min_gain, cap)
        count = min(block, cap - comparison.rounds)
        if comparison.verdict != "more":
            break
        if not fits(count * round_s):
            comparison = dataclasses.replace(comparison, verdict="reject", why="undecided, and no time left for more rounds")
            break
    return [Timing(t) for t in times], dataclasses.replace(comparison, runs_per_sample=runs)


def _finite(value: float | None) -> float | None:
    return value if value is not None and math.isfinite(value) else None


def _concrete(args: Sequence[Any], seed: int) -> tuple[Any, ...]:
    """``args`` with every ``ShapeDtypeStruct`` leaf replaced by random values (as tuning's inputs)."""
    return tuple(random_values(tuple(args), np.random.default_rng(seed)))


# ---------------------------------------------------------------------------- isolated ranking


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


# ---------------------------------------------------------------------------- the tuner


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

    See the module docstring for the algorithm and the noise rule.

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
    sites, invocations = _discover(fn, args)
    floor: dict[Key, Any] = {key: _floor_cfg(inv, selector) for key, inv in invocations.items()}
    deadline = start + budget_s if budget_s is not None else math.inf
    search = _Search(fn, args, sites, samples, warmup, min_gain, policy.compile_workers, deadline)
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


class _Search:
    """Compiles assignments of one step and runs the greedy confirmation within the budget.

    The budget is checked against estimates: a batch of compiles starts only if one compile
    (they run in parallel) plus the batch's measurements fit in the time left, a measurement
    only if its first block of rounds fits, and each further block only if it fits; the
    estimates start from the floor and follow what batches really cost.
    """

    def __init__(self, fn: Callable[..., Any], args: Sequence[Any], sites: Mapping[Key, int], samples: int, warmup: int, min_gain: float, workers: int, deadline: float) -> None:
        self.fn, self.args, self.sites = fn, args, sites
        self.samples, self.warmup, self.min_gain = samples, warmup, min_gain
        # XLA compiles on CPU threads: more compiles at once than cores only slows each down.
        self.workers = max(1, min(workers, os.cpu_count() or 1))
        self.deadline = deadline
        self.compile_s = 0.0  # summed over threads: compile work, not wall time
        self.compile_wall_s = 0.0  # estimate: wall time of one batch of compiles
        self.pair_s = 0.0  # estimate: wall time of a comparison's first block of rounds, warm-up included
        self._lock = threading.Lock()

    def compile(self, configs: Assignment) -> Any:
        began = time.perf_counter()
        try:
            return _lower(self.fn, self.args, configs, self.sites).compile()
        finally:
            with self._lock:
                self.compile_s += time.perf_counter() - began

    def compile_floor(self, floor: Assignment) -> Any:
        began = time.perf_counter()
        executable = self.compile(floor)
        self.compile_wall_s = time.perf_counter() - began
        began = time.perf_counter()
        self.compare([executable], first=self.samples, judge=False)  # warms it up, sizes a measurement
        self.pair_s = 2 * (time.perf_counter() - began)
        return executable

    def compare(self, executables: Sequence[Any], first: int, judge: bool = True) -> tuple[list[Timing], Comparison | None]:
        """:func:`_compare` with this search's rounds, cap, rule and budget."""
        return _compare(
            executables, self.args, first=first, block=self.samples, cap=max(first, ROUND_CAP * self.samples),
            warmup=self.warmup, min_gain=self.min_gain, fits=self._fits, judge=judge,
        )

    def compile_plain(self, fn: Callable[..., Any]) -> Any:
        began = time.perf_counter()
        executable = contextvars.Context().run(lambda: jax.jit(lambda *a: fn(*a)).lower(*self.args).compile())
        self.compile_s += time.perf_counter() - began
        return executable

    def _fits(self, seconds: float) -> bool:
        return time.perf_counter() + seconds <= self.deadline

    def confirm(self, floor: Assignment, floor_exe: Any, trials: list[Trial], calls: Mapping[Key, CallPick], progress: bool | None) -> tuple[dict[Key, Any], Any]:
        """Greedy confirmation; returns the final assignment and its executable.

        Trials compile in batches against the current incumbent, all before any timing (compiling
        while timing would skew the timing). Once a trial is accepted the incumbent changes, and
        the rest of its batch, compiled against the old one, goes back to the queue.
        """
        incumbent, incumbent_exe = dict(floor), floor_exe
        queue = list(trials)
        bar = _Progress(len(trials), "confirming in context", progress)
        try:
            with concurrent.futures.ThreadPoolExecutor(max_workers=self.workers) as pool:
                while queue:
                    size = min(self.workers, len(queue))
                    while size and not self._fits(self.compile_wall_s + size * self.pair_s):
                        size -= 1
                    if not size:
                        break
                    batch, queue = queue[:size], queue[size:]
                    base = dict(incumbent)
                    began = time.perf_counter()
                    futures = [pool.submit(self.compile, {**base, t.key: t.cfg}) for t in batch]
                    concurrent.futures.wait(futures)
                    self.compile_wall_s = max(self.compile_wall_s, time.perf_counter() - began)
                    for n, (trial, future) in enumerate(zip(batch, futures)):
                        if incumbent != base or not self._fits(self.pair_s):
                            queue = batch[n:] + queue
                            break
                        began = time.perf_counter()
                        incumbent_exe = self._try(trial, future, incumbent, incumbent_exe, calls[trial.key])
                        # Scaled to a first block: extra rounds one trial needed say little about the next.
                        rounds = trial.comparison.rounds if trial.comparison is not None else self.samples
                        self.pair_s = max(self.pair_s, (time.perf_counter() - began) * self.samples / max(rounds, self.samples))
                        bar.advance()
        finally:
            bar.close()
        for trial in queue:
            trial.status, trial.reason = "skipped", "time budget spent"
        return incumbent, incumbent_exe

    def _try(self, trial: Trial, future: concurrent.futures.Future[Any], incumbent: dict[Key, Any], incumbent_exe: Any, call: CallPick) -> Any:
        """Time one compiled trial against the incumbent; on a win, update both. Returns the
        incumbent's executable."""
        try:
            executable = future.result()
        except Exception as err:  # one assignment failing to compile is recorded, not raised
            trial.status, trial.reason = "compile_error", _describe_error(err)[1]
            return incumbent_exe
        try:
            (trial.incumbent, trial.candidate), trial.comparison = self.compare([incumbent_exe, executable], first=self.samples)
        except Exception as err:
            trial.status, trial.reason = _describe_error(err)
            return incumbent_exe
        if trial.comparison is not None and trial.comparison.accepted:
            trial.status = "accepted"
            incumbent[trial.key] = trial.cfg
            call.cfg, call.isolated_ms = trial.cfg, trial.isolated_ms
            call.step_ms, call.compared_to_ms = trial.candidate.median_ms, trial.incumbent.median_ms
            return executable
        trial.status, trial.reason = "rejected", trial.comparison.why if trial.comparison is not None else None
        if not call.changed:
            call.step_ms = trial.incumbent.median_ms
        return incumbent_exe


def _floor_cfg(inv: Invocation[Any, Any], selector: ConfigSelectorChain) -> Any:
    """What ``use_implementation("xla")`` selects for ``inv``: the XLA config, else the usual one."""
    cfg = inv.kernel.config_for(inv, "xla")
    if cfg is not None:
        return cfg
    found = selector.lookup(inv.cache_key)
    return found.cfg if found is not None else inv.kernel.heuristic_cfg(inv)


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


def _plan(calls: Mapping[Key, CallPick], isolated: Mapping[Key, Mapping[Any, float]], per_call: int, skip_slower: bool) -> list[Trial]:
    """The confirmations to try: every call's best candidate first, by expected gain (isolated
    gain x sites), then the calls' second candidates, and so on.

    A runner-up's expected gain is measured from the floor; once its call's best is accepted,
    what it can still add is the difference to that best, usually nothing. Ordered by gain
    alone, runners-up of a call with many sites came before other calls' best candidates and
    spent the budget on them (the packed model, run 12: the fused loss, worth 1.05x, was never
    tried)."""
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
