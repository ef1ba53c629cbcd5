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
   expected gain is (floor's isolated time - its isolated time) x the number of sites.
4. **Confirm, greedily.** In order of expected gain, the incumbent assignment with that one call
   changed is compiled ahead of time (a few at once, in threads: XLA compiles outside the GIL)
   and its whole step is timed interleaved with the incumbent's (A B B A A B ...: alternating
   order, so drift and cache warmth hit both alike). The change is kept only if it beats the
   incumbent by more than the noise (below). The budget (seconds, whole run) is checked before
   each batch of compiles and each measurement; what it cut off is reported as skipped.
5. **Check and store.** The final assignment is timed against the floor (and ``baseline_fn``,
   if given) the same interleaved way; if it does not beat the floor by more than the noise, the
   floor is kept. Every call's pick, XLA included, goes to the memory and persistent caches with
   provenance ``"in-context"`` and the step times that justify it, so the next run uses them.

Noise rule: a challenger C replaces an incumbent I when
``median(I) - median(C) > max(min_gain * median(I), (IQR(I) + IQR(C)) / 2)``, over ``samples``
interleaved samples each (``min_gain`` is 1% by default). The IQR term is the typical spread of
one sample around its median in this very measurement, so a "win" smaller than the run-to-run
scatter is not taken; the 1% floor keeps a change that gains almost nothing from being taken on
a very quiet machine (each change is also a risk: a new compiled program, another kernel).

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
import math
import os
import threading
import time
from collections.abc import Callable, Mapping, Sequence
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
    _describe_error,
    _Progress,
)
from ejlabel.utils.fingerprint import device_fingerprint
from ejlabel.utils.serialize import from_jsonable

__all__ = ["PROVENANCE", "CallPick", "ContextTuneReport", "Trial", "tune_in_context"]

PROVENANCE = "in-context"
Key = tuple[str, str, str]
Assignment = Mapping[Key, Any]

# Tracing is Python work that holds the GIL anyway; one at a time keeps jax.clear_caches()
# (which a stale trace needs) from racing another trace. Compiling runs outside the lock.
_TRACE_LOCK = threading.Lock()


# ---------------------------------------------------------------------------- report


@dataclasses.dataclass
class Trial:
    """One confirmation: the incumbent with one call changed, timed as a whole step.

    ``status``: ``accepted``, ``rejected`` (not faster by more than the noise),
    ``compile_error``, ``runtime_error`` or ``skipped`` (time budget spent).
    """

    device: str
    op_id: str
    call_key: str
    cfg: Any
    isolated_ms: float
    expected_gain_ms: float  # (floor's isolated ms - this one's) x sites
    status: str = "pending"
    reason: str | None = None
    incumbent: Timing | None = None
    candidate: Timing | None = None
    noise_ms: float | None = None

    @property
    def key(self) -> Key:
        return (self.device, self.op_id, self.call_key)


@dataclasses.dataclass
class CallPick:
    """What one distinct call ended up with.

    ``step_ms`` is the step time measured with this pick in place (for a change: the step that
    beat ``compared_to_ms``; for the floor: the incumbent of this call's last confirmation, or
    the floor). ``isolated_from`` says where the isolated timings came from (``measured``,
    ``cache``) or why there are none.
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


@dataclasses.dataclass
class ContextTuneReport:
    """What ``tune_in_context`` measured and chose.

    ``floor``, ``tuned`` and ``baseline`` come from one final interleaved measurement, so they
    compare directly; ``noise_ms`` is the noise of that measurement by the module's rule. When
    nothing beat the floor, ``tuned`` is the floor's timing.
    """

    floor: Timing
    tuned: Timing
    baseline: Timing | None
    noise_ms: float
    calls: list[CallPick]
    trials: list[Trial]
    errors: dict[str, str]
    samples: int
    budget_s: float | None
    wall_s: float
    compile_s: float
    stored: bool
    reverted: bool = False  # the final check found the tuned step no faster than the floor

    @property
    def changed(self) -> list[CallPick]:
        return [call for call in self.calls if call.changed]

    @property
    def skipped(self) -> list[Trial]:
        return [trial for trial in self.trials if trial.status == "skipped"]

    @property
    def speedup(self) -> float:
        """The floor's median step time over the tuned one's."""
        return self.floor.median_ms / self.tuned.median_ms

    def summary(self) -> str:
        sites = sum(call.sites for call in self.calls)
        confirmed = sum(trial.status in ("accepted", "rejected") for trial in self.trials)
        text = (
            f"{len(self.calls)} distinct calls at {sites} sites; {confirmed} confirmed in context, "
            f"{len(self.changed)} changed from XLA, {len(self.skipped)} skipped (time budget); "
            f"{self.wall_s:.1f} s"
        )
        return text + ("; the final check kept the floor" if self.reverted else "")

    def render(self) -> str:
        """The report as text: step times, then each call's pick, then each confirmation."""
        lines = [f"in-context tuning: {self.summary()}"]
        lines.append(f"step time, median of {self.samples} interleaved samples (noise {self.noise_ms:.3g} ms):")
        if self.baseline is not None:
            lines.append(f"  plain JAX (baseline)  {self.baseline.median_ms:10.4g} ms")
        lines.append(f"  all-XLA (floor)       {self.floor.median_ms:10.4g} ms")
        lines.append(f"  tuned                 {self.tuned.median_ms:10.4g} ms  ({self.speedup:.2f}x the floor)")
        lines.append("")
        width = max([len("call"), *(len(f"{call.op_id}:{call.call_key}") for call in self.calls)])
        lines.append(f"{'call':{width}} {'sites':>5}  {'isolated ms':>11}  {'XLA iso ms':>10}  {'step ms':>9}  pick")
        for call in self.calls:
            note = f" (beat {call.compared_to_ms:.4g} ms)" if call.changed and call.compared_to_ms is not None else ""
            lines.append(
                f"{call.op_id + ':' + call.call_key:{width}} {call.sites:>5}  {_ms(call.isolated_ms):>11}  "
                f"{_ms(call.floor_isolated_ms):>10}  {_ms(call.step_ms):>9}  {call.cfg!r}{note}"
                + ("" if call.changed else "  [XLA stays]")
            )
        if self.trials:
            lines.append("")
            lines.append("confirmations, in order (whole step, interleaved with the incumbent):")
            for trial in self.trials:
                lines.append(f"  {trial.op_id}:{trial.call_key} {trial.cfg!r}: isolated {trial.isolated_ms:.4g} ms; {_verdict(trial)}")
        for what, error in self.errors.items():
            lines.append(f"error  {what}: {error}")
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.render()


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value:.4g}"


def _verdict(trial: Trial) -> str:
    if trial.status in ("accepted", "rejected") and trial.candidate is not None and trial.incumbent is not None:
        return (
            f"step {trial.candidate.median_ms:.4g} ms vs incumbent {trial.incumbent.median_ms:.4g} ms "
            f"(noise {trial.noise_ms:.3g} ms): {trial.status}"
        )
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


def _interleaved(executables: Sequence[Any], args: Sequence[Any], samples: int, warmup: int) -> list[Timing]:
    """Time each executable ``samples`` times, in rounds of alternating order (AB, BA, AB, ...).

    Alternating the order cancels a linear drift and gives each program the other's leftovers
    (caches, clocks) equally often. Every run is waited for (``block_until_ready``).
    """
    for executable in executables:
        for _ in range(max(1, warmup)):
            _run(executable, args)
    times: list[list[float]] = [[] for _ in executables]
    order = list(range(len(executables)))
    for round_ in range(samples):
        for i in order if round_ % 2 == 0 else order[::-1]:
            start = time.perf_counter()
            _run(executables[i], args)
            times[i].append((time.perf_counter() - start) * 1e3)
    return [Timing(t) for t in times]


def _noise(incumbent: Timing, challenger: Timing, min_gain: float) -> float:
    """The margin a challenger must beat the incumbent's median by (module docstring)."""
    return max(min_gain * incumbent.median_ms, (incumbent.iqr_ms + challenger.iqr_ms) / 2)


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
      budget_s: seconds for the whole run (None: no limit); confirmations not started in time
        are reported as skipped. The floor and the final check always run.
      samples: timed runs of each program per comparison (interleaved; the final check runs
        twice as many); warmup: untimed runs of each program before its timed ones.
      candidates_per_call: the fastest candidates in isolation confirmed per call.
      skip_slower_in_isolation: confirm only candidates faster than XLA in isolation; False also
        confirms slower ones (fusion can reorder them in context, at a compile each).
      min_gain: the smallest relative gain a change must show (the noise rule's 1%).
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
    selector = selector if selector is not None else get_default_executor().selector
    policy = policy if policy is not None else selector.policy
    args = _concrete(args, seed)
    errors: dict[str, str] = {}

    # 1. Discover the calls; 2. compile and time the floor.
    sites, invocations = _discover(fn, args)
    floor: dict[Key, Any] = {key: _floor_cfg(inv, selector) for key, inv in invocations.items()}
    search = _Search(fn, args, sites, samples, warmup, min_gain, policy.compile_workers, start + budget_s if budget_s is not None else math.inf)
    floor_exe = search.compile_floor(floor)

    # 3. Rank each call's candidates in isolation; 4. confirm the promising ones in the step.
    calls = {key: CallPick(*key, sites[key], floor[key], floor[key]) for key in invocations}
    isolated = _rank_isolated(invocations, floor, calls, policy, selector, reuse_isolated, progress, seed, errors)
    trials = _plan(calls, isolated, candidates_per_call, skip_slower_in_isolation)
    incumbent, tuned_exe = search.confirm(floor, floor_exe, trials, calls, progress)

    # 5. The final check against the floor (and the plain baseline), then store.
    programs = [floor_exe] + ([tuned_exe] if incumbent != floor else [])
    if baseline_fn is not None:
        programs.append(search.compile_plain(baseline_fn))
    final = _interleaved(programs, args, 2 * samples, warmup)
    floor_time = final[0]
    tuned_time = final[1] if incumbent != floor else floor_time
    noise = _noise(floor_time, tuned_time, min_gain)
    reverted = incumbent != floor and not floor_time.median_ms - tuned_time.median_ms > noise
    for call in calls.values():
        if reverted:
            # Each change won its own comparison, but together they do not beat the floor.
            call.cfg, call.isolated_ms, call.compared_to_ms = call.floor_cfg, call.floor_isolated_ms, None
            call.step_ms = None
        if call.step_ms is None:  # no confirmation measured this call's pick: the final step did
            call.step_ms = tuned_time.median_ms if not reverted else floor_time.median_ms
    if reverted:
        tuned_time = floor_time
    report = ContextTuneReport(
        floor=floor_time, tuned=tuned_time, baseline=final[-1] if baseline_fn is not None else None,
        noise_ms=noise, calls=list(calls.values()), trials=trials, errors=errors, samples=2 * samples,
        budget_s=budget_s, wall_s=0.0, compile_s=search.compile_s, stored=store, reverted=reverted,
    )
    if store:
        _store(report, invocations, trials, selector, errors)
    report.wall_s = time.perf_counter() - start
    if verbose:
        print(report.render(), flush=True)
    return report


class _Search:
    """Compiles assignments of one step and runs the greedy confirmation within the budget.

    The budget is checked against estimates: a batch of compiles starts only if one compile
    (they run in parallel) plus the batch's measurements fit in the time left, and a measurement
    only if it fits; the estimates start from the floor and follow what batches really cost.
    """

    def __init__(self, fn: Callable[..., Any], args: Sequence[Any], sites: Mapping[Key, int], samples: int, warmup: int, min_gain: float, workers: int, deadline: float) -> None:
        self.fn, self.args, self.sites = fn, args, sites
        self.samples, self.warmup, self.min_gain = samples, warmup, min_gain
        # XLA compiles on CPU threads: more compiles at once than cores only slows each down.
        self.workers = max(1, min(workers, os.cpu_count() or 1))
        self.deadline = deadline
        self.compile_s = 0.0  # summed over threads: compile work, not wall time
        self.compile_wall_s = 0.0  # estimate: wall time of one batch of compiles
        self.pair_s = 0.0  # estimate: wall time of timing two programs interleaved
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
        _interleaved([executable], self.args, self.samples, self.warmup)  # warms it up, sizes a measurement
        self.pair_s = 2 * (time.perf_counter() - began)
        return executable

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
                        self.pair_s = max(self.pair_s, time.perf_counter() - began)
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
            trial.incumbent, trial.candidate = _interleaved([incumbent_exe, executable], self.args, self.samples, self.warmup)
        except Exception as err:
            trial.status, trial.reason = _describe_error(err)
            return incumbent_exe
        trial.noise_ms = _noise(trial.incumbent, trial.candidate, self.min_gain)
        if trial.incumbent.median_ms - trial.candidate.median_ms > trial.noise_ms:
            trial.status = "accepted"
            incumbent[trial.key] = trial.cfg
            call.cfg, call.isolated_ms = trial.cfg, trial.isolated_ms
            call.step_ms, call.compared_to_ms = trial.candidate.median_ms, trial.incumbent.median_ms
            return executable
        trial.status, trial.reason = "rejected", "not faster than the incumbent by more than the noise"
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


def _rank_isolated(
    invocations: Mapping[Key, Invocation[Any, Any]],
    floor: Mapping[Key, Any],
    calls: Mapping[Key, CallPick],
    policy: AutotunePolicy,
    selector: ConfigSelectorChain,
    reuse: bool,
    progress: bool | None,
    seed: int,
    errors: dict[str, str],
) -> dict[Key, dict[Any, float]]:
    """``{key: {cfg: isolated ms}}`` over each call's correct candidates (the floor's included)."""
    isolated: dict[Key, dict[Any, float]] = {}
    to_tune: list[Key] = []
    for key in invocations:
        stored: dict[Any, float] = {}
        if reuse and selector.persistent is not None:
            try:
                entry = selector.persistent.get_entry(key)
            except CacheError:
                entry = None
            stored = _isolated_from_stats(entry.stats) if entry is not None else {}
        if floor[key] in stored and len(stored) > 1:
            isolated[key] = stored
            calls[key].isolated_from = "cache"
        else:
            to_tune.append(key)
    if to_tune:
        lists = {i: _candidate_list(invocations[key], floor[key]) for i, key in enumerate(to_tune)}
        outcomes = Autotuner(policy, progress=progress, seed=seed).tune_each([invocations[key] for key in to_tune], lists)
        for key, outcome in zip(to_tune, outcomes):
            if isinstance(outcome, AutotuneError):
                errors[f"{key[1]}:{key[2]}"] = f"isolated tuning failed, XLA stays: {outcome}"
                calls[key].isolated_from = "failed"
                isolated[key] = {}
                continue
            isolated[key] = {c.cfg: c.timing.median_ms for c in outcome.candidates if c.timing is not None and c.status in ("ok", "pruned")}
            calls[key].candidates = [{"cfg": c.cfg, "status": c.status, "median_ms": c.timing.median_ms if c.timing is not None else None} for c in outcome.candidates]
    for key, timings in isolated.items():
        call = calls[key]
        call.floor_isolated_ms = call.isolated_ms = timings.get(floor[key])
        if not call.candidates:
            call.candidates = [{"cfg": cfg, "status": "ok", "median_ms": ms} for cfg, ms in timings.items()]
    return isolated


def _plan(calls: Mapping[Key, CallPick], isolated: Mapping[Key, Mapping[Any, float]], per_call: int, skip_slower: bool) -> list[Trial]:
    """The confirmations to try, most promising first (expected gain = isolated gain x sites)."""
    trials = []
    for key, timings in isolated.items():
        call = calls[key]
        if not timings:
            continue
        reference = call.floor_isolated_ms if call.floor_isolated_ms is not None else max(timings.values())
        ranked = sorted((ms, i, cfg) for i, (cfg, ms) in enumerate(timings.items()) if cfg != call.floor_cfg)
        chosen = [(ms, cfg) for ms, _, cfg in ranked if not skip_slower or ms < reference][:per_call]
        for ms, cfg in chosen:
            trials.append(Trial(*key, cfg, ms, (reference - ms) * call.sites))
    trials.sort(key=lambda t: -t.expected_gain_ms)
    return trials


def _store(report: ContextTuneReport, invocations: Mapping[Key, Invocation[Any, Any]], trials: list[Trial], selector: ConfigSelectorChain, errors: dict[str, str]) -> None:
    """Every call's pick into the memory and persistent caches, with the step times behind it."""
    for call in report.calls:
        key = call.key
        own = [t for t in trials if t.key == key and t.status in ("accepted", "rejected")]
        deciding = next((t for t in reversed(own) if t.status == "accepted" and t.cfg == call.cfg), None)
        if deciding is None and own and not call.changed:
            deciding = min(own, key=lambda t: t.candidate.median_ms)  # the best alternative, rejected
        stats: dict[str, Any] = {
            "step_ms": report.tuned.median_ms,
            "floor_step_ms": report.floor.median_ms,
            "samples": report.samples,
            "noise_ms": report.noise_ms,
            "median_ms": call.isolated_ms,  # isolated kernel time, as in autotuned entries
            "isolated_ms": call.isolated_ms,
            "floor_isolated_ms": call.floor_isolated_ms,
            "sites": call.sites,
            "candidates": call.candidates,
        }
        if report.baseline is not None:
            stats["baseline_step_ms"] = report.baseline.median_ms
        if deciding is not None:
            stats["incumbent_step_ms"] = deciding.incumbent.median_ms
            stats["candidate_step_ms"] = deciding.candidate.median_ms
            stats["candidate_cfg"] = deciding.cfg
        else:
            stats["incumbent_step_ms"] = report.floor.median_ms
        inv = invocations[key]
        selector.cache.put(*key, call.cfg)
        if selector.persistent is not None:
            try:
                selector.persistent.put(*key, call.cfg, provenance=PROVENANCE, stats=stats, kernel_version=inv.kernel_version)
            except (CacheError, TypeError) as err:
                errors[f"{call.op_id}:{call.call_key}"] = f"not stored in the persistent cache: {err}"
