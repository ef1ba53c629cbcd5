"""Whole programs for tuning in context: tracing a step under an assignment, and the greedy search.

A step is traced with an *assignment* (a config for every distinct kernel call) served through
an overlay cache that also counts what the trace asked for, so the counts are the call sites
per key. :func:`discover` traces the step once, recording, to find its distinct calls and their
invocations. Traces run in a fresh ``contextvars`` context, so the caller's overlays,
``use_implementation`` and policy overrides do not leak into the assignment being measured.
JAX caches traces by function: every trace goes through a new wrapper function, and a trace
that did not consult the assignment for every call (an inner ``jax.jit`` served from JAX's
cache) is redone after ``jax.clear_caches()``.

:class:`Search` compiles assignments of one step ahead of time and runs the greedy
confirmation: each trial is the incumbent with one call changed, compiled (as many at once as
there are compile workers, in threads) and timed against the incumbent in paired rounds
(:mod:`.paired`); an accepted trial becomes the incumbent. Every step is checked against the
time left before it starts. No assignment is compiled twice: the executables that may be
measured again (the floor, the incumbents) are kept by assignment.
"""

from __future__ import annotations

import collections
import concurrent.futures
import contextlib
import contextvars
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax

from ejlabel.config.cache import overlay_cache, policy_override, usable_cores
from ejlabel.core.kernel import Invocation
from ejlabel.core.label_format import is_backward, parse_label
from ejlabel.core.labels import find_labels_in_lowered
from ejlabel.execution.recording import get_invocations, recording
from ejlabel.execution.tuning.measure import Progress, Timing, describe_error
from ejlabel.execution.tuning.paired import ROUND_CAP, Comparison, compare
from ejlabel.execution.tuning.report import Assignment, CallPick, Key, Trial
from ejlabel.utils.fingerprint import device_fingerprint

__all__ = ["Search", "discover"]

# Tracing is Python work that holds the GIL anyway; one at a time keeps jax.clear_caches()
# (which a stale trace needs) from racing another trace. Compiling runs outside the lock.
_TRACE_LOCK = threading.Lock()


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


def discover(fn: Callable[..., Any], args: Sequence[Any]) -> tuple[dict[Key, int], dict[Key, Invocation[Any, Any]]]:
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


class Search:
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
        self.workers = max(1, min(workers, usable_cores()))
        self.deadline = deadline
        self.compile_s = 0.0  # summed over threads: compile work, not wall time
        self.compile_wall_s = 0.0  # estimate: wall time of one batch of compiles
        self.pair_s = 0.0  # estimate: wall time of a comparison's first block of rounds, warm-up included
        self._programs: dict[frozenset[tuple[Key, Any]], Any] = {}  # executables that may be measured again
        self._lock = threading.Lock()

    def compile(self, configs: Assignment) -> Any:
        """The executable of the step under ``configs``; an assignment compiled before and kept
        (:meth:`keep`) is not compiled again."""
        program = frozenset(configs.items())
        with self._lock:
            kept = self._programs.get(program)
        if kept is not None:
            return kept
        began = time.perf_counter()
        try:
            return _lower(self.fn, self.args, configs, self.sites).compile()
        finally:
            with self._lock:
                self.compile_s += time.perf_counter() - began

    def keep(self, configs: Assignment, executable: Any) -> None:
        """Keep ``executable`` as the program of ``configs``, to be measured again."""
        with self._lock:
            self._programs[frozenset(configs.items())] = executable

    def start(self, floor: Assignment, warm: Assignment, baseline_fn: Callable[..., Any] | None) -> tuple[Any, Timing, Any | None, Any]:
        """Compile the floor, the warm start (the floor with the picks earlier runs decided) and
        the plain baseline at once; time the floor, which also sizes a measurement.

        Returns the floor's executable and timing, the warm start's executable (the floor's when
        they are the same assignment; None when it failed to compile, the reason in
        ``warm_error``) and the baseline's (None without ``baseline_fn``).
        """
        began = time.perf_counter()
        self.warm_error: str | None = None
        with concurrent.futures.ThreadPoolExecutor(max_workers=self.workers) as pool:
            floor_future = pool.submit(self.compile, floor)
            warm_future = pool.submit(self.compile, warm) if dict(warm) != dict(floor) else floor_future
            baseline_future = pool.submit(self.compile_plain, baseline_fn) if baseline_fn is not None else None
            floor_exe = floor_future.result()
            try:
                warm_exe = warm_future.result()
            except Exception as err:  # stored picks that no longer compile cost the warm start, not the run
                warm_exe, self.warm_error = None, describe_error(err)[1]
            baseline_exe = baseline_future.result() if baseline_future is not None else None
        self.compile_wall_s = time.perf_counter() - began
        self.keep(floor, floor_exe)
        if warm_exe is not None:
            self.keep(warm, warm_exe)
        began = time.perf_counter()
        (floor_time,), _ = self.compare([floor_exe], first=self.samples, judge=False)  # warms it up, sizes a measurement
        self.pair_s = 2 * (time.perf_counter() - began)
        return floor_exe, floor_time, warm_exe, baseline_exe

    def final_s(self, programs: int) -> float:
        """Estimated wall time of the final check: twice the rounds of a first block, ``programs`` programs each."""
        return self.pair_s * programs

    def compare(self, executables: Sequence[Any], first: int, judge: bool = True) -> tuple[list[Timing], Comparison | None]:
        """:func:`compare` with this search's rounds, cap, rule and budget."""
        return compare(
            executables, self.args, first=first, block=self.samples, cap=max(first, ROUND_CAP * self.samples),
            warmup=self.warmup, min_gain=self.min_gain, fits=self._fits, judge=judge,
        )

    def compile_plain(self, fn: Callable[..., Any]) -> Any:
        began = time.perf_counter()
        try:
            with _TRACE_LOCK:  # no jax.clear_caches() of another trace while this one runs
                lowered = contextvars.Context().run(lambda: jax.jit(lambda *a: fn(*a)).lower(*self.args))
            return lowered.compile()
        finally:
            with self._lock:
                self.compile_s += time.perf_counter() - began

    def _fits(self, seconds: float) -> bool:
        return time.perf_counter() + seconds <= self.deadline

    def confirm(self, start: Assignment, start_exe: Any, trials: list[Trial], calls: Mapping[Key, CallPick], progress: bool | None) -> tuple[dict[Key, Any], Any]:
        """Greedy confirmation from the incumbent ``start``; returns the final assignment and its executable.

        Trials compile in batches against the current incumbent, all before any timing (compiling
        while timing would skew the timing). Compile workers the batch leaves idle compile its
        other trials as if its first (the largest expected gain) were accepted: then they are
        timed against the new incumbent at once. A trial whose program against the incumbent of
        the moment was not compiled goes back to the queue.
        """
        incumbent, incumbent_exe = dict(start), start_exe
        queue = list(trials)
        if not queue:
            return incumbent, incumbent_exe
        bar = Progress(len(trials), "confirming in context", progress)
        # Not a with-block: leaving one waits for every compile, and a compile still running
        # when the time is up is left to finish in the background, never waited for.
        pool = concurrent.futures.ThreadPoolExecutor(max_workers=self.workers)
        try:
            while queue:
                size = min(self.workers, len(queue))
                while size and not self._fits(self.compile_wall_s + size * self.pair_s):
                    size -= 1
                if not size:
                    break
                batch, queue = queue[:size], queue[size:]
                began = time.perf_counter()
                programs = self._compile_batch(pool, incumbent, batch)
                self.compile_wall_s = max(self.compile_wall_s, time.perf_counter() - began)
                waiting: list[Trial] = []
                for n, trial in enumerate(batch):
                    if not self._fits(self.pair_s):
                        waiting += batch[n:]
                        break
                    future = programs.get(frozenset({**incumbent, trial.key: trial.cfg}.items()))
                    if future is None:  # compiled against an incumbent that has since changed
                        waiting.append(trial)
                        continue
                    began = time.perf_counter()
                    incumbent_exe = self._try(trial, future, incumbent, incumbent_exe, calls[trial.key])
                    # Scaled to a first block: extra rounds one trial needed say little about the next.
                    rounds = trial.comparison.rounds if trial.comparison is not None else self.samples
                    self.pair_s = max(self.pair_s, (time.perf_counter() - began) * self.samples / max(rounds, self.samples))
                    bar.advance()
                queue = waiting + queue
        finally:
            pool.shutdown(wait=False, cancel_futures=True)
            bar.close()
        for trial in queue:
            trial.status, trial.reason = "skipped", "time budget spent"
        return incumbent, incumbent_exe

    def _compile_batch(self, pool: concurrent.futures.ThreadPoolExecutor, base: Assignment, batch: Sequence[Trial]) -> dict[frozenset[tuple[Key, Any]], concurrent.futures.Future[Any]]:
        """Compile each trial of ``batch`` against ``base`` and, on the workers left, the other
        trials against ``base`` with the first trial's change; waits for them until the deadline.
        Keyed by assignment; a program not compiled by the deadline is left out."""
        assignments = [{**base, trial.key: trial.cfg} for trial in batch]
        first = batch[0]
        spare = self.workers - len(batch)
        # A runner-up of the first trial's call replaces its change: that program is in the batch already.
        assignments += [{**base, first.key: first.cfg, trial.key: trial.cfg} for trial in batch[1:] if trial.key != first.key][: max(0, spare)]
        programs = {frozenset(configs.items()): pool.submit(self.compile, configs) for configs in assignments}
        left = self.deadline - time.perf_counter()
        concurrent.futures.wait(list(programs.values()), timeout=max(0.0, left) if left != float("inf") else None)
        # What did not finish by the deadline cannot be timed in time: dropped, its trial skipped.
        return {program: future for program, future in programs.items() if future.done()}

    def _try(self, trial: Trial, future: concurrent.futures.Future[Any], incumbent: dict[Key, Any], incumbent_exe: Any, call: CallPick) -> Any:
        """Time one compiled trial against the incumbent; on a win, update both. Returns the
        incumbent's executable."""
        try:
            executable = future.result()
        except Exception as err:  # one assignment failing to compile is recorded, not raised
            trial.status, trial.reason = "compile_error", describe_error(err)[1]
            return incumbent_exe
        try:
            (trial.incumbent, trial.candidate), trial.comparison = self.compare([incumbent_exe, executable], first=self.samples)
        except Exception as err:
            trial.status, trial.reason = describe_error(err)
            return incumbent_exe
        if trial.comparison is not None and trial.comparison.accepted:
            trial.status = "accepted"
            incumbent[trial.key] = trial.cfg
            self.keep(incumbent, executable)
            call.cfg, call.isolated_ms = trial.cfg, trial.isolated_ms
            call.step_ms, call.compared_to_ms = trial.candidate.median_ms, trial.incumbent.median_ms
            return executable
        trial.status, trial.reason = "rejected", trial.comparison.why if trial.comparison is not None else None
        if not call.changed:
            call.step_ms = trial.incumbent.median_ms
        return incumbent_exe
