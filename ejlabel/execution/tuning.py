"""Autotuning: compile every candidate ahead of time, check it, time only the executable.

For one call (an :class:`~ejlabel.kernel.Invocation`) the tuner

1. lowers and compiles each candidate config on the abstract arguments, several at once in a
   thread pool (XLA compiles outside the GIL); compile time is reported, never timed;
2. builds concrete inputs once (``kernel.make_inputs``), outside any trace;
3. checks each candidate's output against the reference (``kernel.reference`` if defined, else
   the heuristic config's output) by relative error with a dtype-appropriate tolerance;
4. times the compiled executables with successive halving: every survivor gets a few timed
   runs, the slower half is dropped, the rest get twice as many, until one round at the full
   ``num_iters`` decides. A large config space then costs far less than timing every config
   fully, and the final decision is still made on full-length measurements.

Candidates that fail to compile, run out of memory, give NaN or a wrong result are recorded with
the reason and skipped. The winner goes to the memory cache and the persistent cache with
provenance ``autotuned``, its statistics and every candidate's result.

The time budget (``AutotunePolicy.time_budget_s``, per call) is spent in this order and never
buys a worse pick:

* the *floor* candidates, the heuristic config and the kernel's XLA config
  (``kernel.config_for(inv, "xla")``), come first in the candidate list, survive
  ``max_configs``, and are always compiled, checked and fully timed, budget or not;
* every other candidate's compile seconds count against the budget: once they reach it, the
  remaining candidates are not compiled; timing stops starting new candidates once compile and
  timing together reach it;
* a candidate is ``skipped`` only if it was never timed, so every timing taken stays in the
  ranking: the winner is the fastest candidate measured, and the floor is always measured, so
  the stored winner is never slower than the heuristic or XLA. ``TuneResult.skipped`` (and the
  stored statistics) say how many candidates were skipped and which.

A caller with a whole-run budget (tuning in context) passes ``tune_each(..., deadline=t)``, a
``time.perf_counter()`` time. Unlike the per-call budget it is a hard stop, the floor included:
no compile starts after the midpoint between the call to ``tune_each`` and ``t`` (the timing
needs the other half); no call's measurement starts after ``t``, and within a call whose
measurement began, no candidate but the floor starts its timing after ``t``; work already
running finishes. Calls are measured one after the other, in the given order, so a
cut leaves the first calls fully ranked. A call cut after some of its candidates were timed
comes back as a ``TuneResult`` with ``cut`` set (the untimed ones ``skipped``, the timed ones
ranked, perhaps on fewer runs than ``num_iters``): usable, but not a finished ranking. A call cut
before any was timed comes back as a :class:`TuningCut` in place.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import functools
import math
import statistics
import sys
import threading
import time
import warnings
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from ejlabel.config.cache import AutotunePolicy, ConfigCache
from ejlabel.config.selection import ConfigSelectorChain, set_default_tuner
from ejlabel.core.kernel import Invocation, Kernel, abstract_invocation, random_inputs
from ejlabel.execution.executor import get_default_executor, run_labelled
from ejlabel.execution.recording import get_invocations
from ejlabel.utils.fingerprint import device_fingerprint, get_device_platform
from ejlabel.utils.serialize import to_jsonable

__all__ = [
    "Timing",
    "benchmark",
    "CandidateResult",
    "TuneResult",
    "Autotuner",
    "AutotuneError",
    "TuningCut",
    "Tuner",
    "autotune",
    "autotune_recorded",
    "tune_invocation",
    "random_inputs",
]


class Timing(float):
    """A median time in milliseconds that also carries the full statistics."""

    median_ms: float
    mean_ms: float
    min_ms: float
    iqr_ms: float
    count: int
    samples_ms: tuple[float, ...]

    def __new__(cls, samples_ms: Sequence[float]) -> Timing:
        if not samples_ms:
            raise ValueError("samples_ms: expected at least one sample")
        ordered = sorted(samples_ms)
        timing = super().__new__(cls, statistics.median(ordered))
        timing.median_ms = float(timing)
        timing.mean_ms = statistics.fmean(ordered)
        timing.min_ms = ordered[0]
        quartiles = statistics.quantiles(ordered, n=4) if len(ordered) > 1 else [ordered[0]] * 3
        timing.iqr_ms = quartiles[2] - quartiles[0]
        timing.count = len(ordered)
        timing.samples_ms = tuple(samples_ms)
        return timing

    def to_dict(self) -> dict[str, float | int]:
        return {k: getattr(self, k) for k in ("median_ms", "mean_ms", "min_ms", "iqr_ms", "count")}

    def __repr__(self) -> str:
        return f"Timing(median={self.median_ms:.4g} ms, iqr={self.iqr_ms:.3g} ms, n={self.count})"


def _timed_runs(fn: Callable[[], Any], count: int) -> list[float]:
    samples = []
    for _ in range(count):
        start = time.perf_counter()
        jax.block_until_ready(fn())
        samples.append((time.perf_counter() - start) * 1e3)
    return samples


def benchmark(
    fn: Callable[..., Any],
    *args: Any,
    num_warmup: int = 3,
    num_iters: int = 10,
    warmup: int | None = None,
    iters: int | None = None,
    **kwargs: Any,
) -> Timing:
    """Median wall time of ``fn(*args, **kwargs)`` in milliseconds, device synchronised.

    At least one untimed call runs first, so compilation is never timed. Every output leaf is
    waited on (``jax.block_until_ready``) before the clock stops. The result is a ``float``
    carrying ``median_ms``, ``mean_ms``, ``min_ms``, ``iqr_ms``, ``count`` and ``samples_ms``.
    ``warmup=`` and ``iters=`` (ejkernel's names) are ``num_warmup`` and ``num_iters``; they are
    never passed to ``fn`` (bind such arguments of ``fn`` with ``functools.partial``).
    """
    if warmup is not None:
        if num_warmup != 3:
            raise TypeError("give either num_warmup or warmup (the same count), not both")
        num_warmup = warmup
    if iters is not None:
        if num_iters != 10:
            raise TypeError("give either num_iters or iters (the same count), not both")
        num_iters = iters
    if num_iters < 1:
        raise ValueError(f"num_iters: expected >= 1, got {num_iters}")
    if num_warmup < 0:
        raise ValueError(f"num_warmup: expected >= 0, got {num_warmup}")
    call = lambda: fn(*args, **kwargs)
    _timed_runs(call, max(1, num_warmup))
    return Timing(_timed_runs(call, num_iters))


_CLEAR_LOSS = 1.5  # a candidate this many times slower than the best is dropped at once
# A candidate in the slower half stays while its median is within this fraction of the best:
# after a few noisy runs it may still be the fastest, and more runs tell.
_TOO_CLOSE_TO_DROP = 0.03

_TOLERANCE = {"float64": 1e-9, "float32": 2e-3, "bfloat16": 3e-2, "float16": 5e-3}


def _relative_error(out: Any, ref: Any) -> float:
    errors = []
    for o, r in zip(jax.tree_util.tree_leaves(out), jax.tree_util.tree_leaves(ref), strict=True):
        if getattr(o, "dtype", None) == jax.dtypes.float0:  # cotangent of an integer input
            continue
        o64, r64 = np.asarray(o, dtype=np.float64), np.asarray(r, dtype=np.float64)
        if o64.shape != r64.shape:
            return math.inf
        if not np.all(np.isfinite(o64)):
            return math.nan
        scale = np.linalg.norm(r64)
        errors.append(float(np.linalg.norm(o64 - r64) / scale) if scale > 0 else float(np.linalg.norm(o64)))
    return max(errors, default=0.0)


def _tolerance(out: Any) -> float:
    leaves = [leaf for leaf in jax.tree_util.tree_leaves(out) if hasattr(leaf, "dtype")]
    floats = [np.dtype(leaf.dtype).name for leaf in leaves if leaf.dtype != jax.dtypes.float0 and jnp.issubdtype(leaf.dtype, jnp.inexact)]
    return max((_TOLERANCE.get(name, 3e-2) for name in floats), default=0.0)


@dataclasses.dataclass
class CandidateResult:
    """What happened to one candidate config.

    ``status`` is ``ok``, ``compile_error``, ``runtime_error``, ``out_of_memory``, ``nan``,
    ``wrong`` (relative error over tolerance), ``pruned`` (dropped by successive halving after
    timing) or ``skipped`` (never timed: the time budget was spent first). ``floor`` marks the
    heuristic and XLA candidates, which the budget never skips.
    """

    cfg: Any
    status: str = "pending"
    reason: str | None = None
    compile_s: float | None = None
    error: float | None = None
    timing: Timing | None = None
    floor: bool = False

    def to_dict(self) -> dict[str, Any]:
        return {
            "cfg": to_jsonable(self.cfg),
            "status": self.status,
            "reason": self.reason,
            "compile_s": self.compile_s,
            "relative_error": self.error,
            "timing": self.timing.to_dict() if self.timing is not None else None,
            "floor": self.floor,
        }


@dataclasses.dataclass
class TuneResult:
    """The outcome of tuning one call."""

    op_id: str
    call_key: str
    best_cfg: Any
    best: CandidateResult
    candidates: list[CandidateResult]
    wall_s: float
    measure_s: float  # the part of wall_s spent checking and timing compiled candidates
    cut: bool = False  # the caller's deadline stopped the timing before it finished

    @property
    def skipped(self) -> list[CandidateResult]:
        """Candidates never timed because the time budget was spent (in candidate order)."""
        return [c for c in self.candidates if c.status == "skipped"]

    def stats(self) -> dict[str, Any]:
        """The statistics stored with the winner in the persistent cache."""
        assert self.best.timing is not None
        return {
            **self.best.timing.to_dict(),
            "wall_s": self.wall_s,
            "measure_s": self.measure_s,
            "skipped": len(self.skipped),
            "candidates": [c.to_dict() for c in self.candidates],
        }


class AutotuneError(RuntimeError):
    """Every candidate of a call failed; the message lists each one's reason."""


class TuningCut(AutotuneError):
    """The caller's deadline passed before any candidate of this call was timed.

    Not a failure of the call: nothing was measured. ``candidates`` says what each got to
    (``skipped``, or a compile error found before the cut).
    """

    def __init__(self, message: str, candidates: list[CandidateResult]) -> None:
        super().__init__(message)
        self.candidates = candidates


_DEADLINE_COMPILE = "deadline: the run's time budget was spent before it was compiled"
_DEADLINE_TIMING = "deadline: the run's time budget was spent before it was timed"


def _describe_error(err: BaseException) -> tuple[str, str]:
    text = f"{type(err).__name__}: {err}".strip()
    lowered = text.lower()
    status = "out_of_memory" if ("resource_exhausted" in lowered or "out of memory" in lowered) else "runtime_error"
    return status, text.splitlines()[0][:500]


class _Progress:
    """A progress bar on a terminal (rich), silence otherwise."""

    def __init__(self, total: int, description: str, enabled: bool | None) -> None:
        self._bar = None
        if enabled is None:
            enabled = sys.stderr.isatty()
        if enabled and total > 0:
            try:
                from rich.progress import Progress
            except ImportError:
                return
            self._bar = Progress(transient=False)
            self._task = self._bar.add_task(description, total=total)
            self._bar.start()

    def advance(self, amount: int = 1) -> None:
        if self._bar is not None:
            self._bar.advance(self._task, amount)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.stop()


@dataclasses.dataclass
class _Job:
    """One call being tuned: its spec, candidates and compiled executables."""

    inv: Invocation[Any, Any]
    candidates: list[CandidateResult]
    cotangent: Any = None  # output spec when the backward pass is timed too, else None
    executables: dict[int, Any] = dataclasses.field(default_factory=dict)
    start: float = dataclasses.field(default_factory=time.perf_counter)
    budget_s: float | None = None  # per call: compile seconds + timing seconds
    compile_spent_s: float = 0.0  # compile seconds of this call's candidates, summed
    deadline: float = math.inf  # the caller's: no timing starts after it (perf_counter time)
    compile_deadline: float = math.inf  # no compile starts after it
    cut: bool = False  # the deadline made a candidate skip
    lock: threading.Lock = dataclasses.field(default_factory=threading.Lock, repr=False)

    def over_budget(self, measured_from: float | None = None) -> bool:
        """Whether compiling (and, given when timing began, timing) has spent the budget."""
        if self.budget_s is None:
            return False
        timing = 0.0 if measured_from is None else time.perf_counter() - measured_from
        return self.compile_spent_s + timing >= self.budget_s


class Autotuner:
    """The tuning engine; ``tune`` one call, or ``tune_many`` calls with one compile pool.

    Args:
      policy: iteration counts, candidate cap, time budget, early stopping, compile threads.
        ejkernel's form ``Autotuner(warmup, iters)`` (two ints, or ``warmup=``/``iters=``) is
        the default policy with ``num_warmup=warmup`` and ``num_iters=iters``.
      progress: show a progress bar (None: only when stderr is a terminal).
      seed: seed of the random tuning inputs.
    """

    def __init__(
        self,
        policy: AutotunePolicy | int | None = None,
        iters: int | None = None,
        *,
        warmup: int | None = None,
        progress: bool | None = None,
        seed: int = 0,
    ) -> None:
        if isinstance(policy, int) and not isinstance(policy, bool):
            if warmup is not None:
                raise TypeError("give warmup either positionally or by keyword, not both")
            policy, warmup = None, policy
        if policy is not None and not isinstance(policy, AutotunePolicy):
            raise TypeError(f"policy: expected an AutotunePolicy or ejkernel's warmup count, got {type(policy).__name__}")
        policy = policy if policy is not None else AutotunePolicy()
        counts = {k: v for k, v in (("num_warmup", warmup), ("num_iters", iters)) if v is not None}
        self.policy = dataclasses.replace(policy, **counts) if counts else policy
        self.progress = progress
        self.seed = seed

    @property
    def warmup(self) -> int:
        return self.policy.num_warmup

    @property
    def iters(self) -> int:
        return self.policy.num_iters

    def tune(self, inv: Invocation[Any, Any], configs: Iterable[Any] | None = None) -> TuneResult:
        return self.tune_many([inv], configs=None if configs is None else {0: list(configs)})[0]

    def tune_many(
        self, invocations: Sequence[Invocation[Any, Any]], configs: dict[int, list[Any]] | None = None
    ) -> list[TuneResult]:
        """Tune each call; all candidates of all calls compile in one thread pool first.

        Raises the first call's :class:`AutotuneError` if any call has no working candidate;
        :meth:`tune_each` returns per-call errors instead.
        """
        outcomes = self.tune_each(invocations, configs)
        for outcome in outcomes:
            if isinstance(outcome, AutotuneError):
                raise outcome
        return outcomes  # type: ignore[return-value]

    def tune_each(
        self,
        invocations: Sequence[Invocation[Any, Any]],
        configs: dict[int, list[Any]] | None = None,
        *,
        deadline: float | None = None,
    ) -> list[TuneResult | AutotuneError]:
        """Like :meth:`tune_many`, but a call whose candidates all fail gives its error in place.

        ``deadline`` (a ``time.perf_counter()`` time, None: none) stops the whole batch as the
        module docstring says: a call it cut before any timing gives a :class:`TuningCut`, one
        it cut midway a result with ``cut`` set.
        """
        # A separate thread has no active JAX trace, so tuning triggered while tracing a jit'd
        # function compiles and runs concretely instead of being staged into that function.
        with concurrent.futures.ThreadPoolExecutor(max_workers=1) as outside_trace:
            return outside_trace.submit(self._tune_each, list(invocations), configs or {}, deadline).result()

    def _tune_each(
        self, invocations: list[Invocation[Any, Any]], configs: dict[int, list[Any]], deadline: float | None
    ) -> list[TuneResult | AutotuneError]:
        jobs: list[_Job | AutotuneError] = []
        for i, inv in enumerate(invocations):
            try:
                jobs.append(self._job(abstract_invocation(inv), configs.get(i)))
            except AutotuneError as err:
                jobs.append(err)
        if deadline is not None:
            now = time.perf_counter()
            compile_deadline = now + (deadline - now) / 2  # the other half is for timing
            for job in jobs:
                if isinstance(job, _Job):
                    job.deadline, job.compile_deadline = deadline, compile_deadline
        live = [job for job in jobs if isinstance(job, _Job)]
        progress = _Progress(2 * sum(len(job.candidates) for job in live), "autotuning", self.progress)
        try:
            self._compile_all(live, progress)
            return [job if isinstance(job, AutotuneError) else self._measure_or_error(job, progress) for job in jobs]
        finally:
            progress.close()

    def _measure_or_error(self, job: _Job, progress: _Progress) -> TuneResult | AutotuneError:
        try:
            return self._measure(job, progress)
        except AutotuneError as err:
            return err

    def _job(self, inv: Invocation[Any, Any], configs: list[Any] | None) -> _Job:
        """The call's candidates: the floor (heuristic, then XLA) first, then the config space.

        Given ``configs``, only those are tried (in their order, the floor among them first).
        ``max_configs`` caps the list but never drops a floor candidate, and takes the others
        round-robin over their implementations, so a cap never leaves a whole implementation out.
        """
        kernel = inv.kernel
        floor = _floor_configs(inv)
        if configs is None:
            unique = list(dict.fromkeys([*floor, *kernel.config_space(inv)]))
        else:
            given = list(dict.fromkeys(configs))
            unique = [cfg for cfg in floor if cfg in given] + [cfg for cfg in given if cfg not in floor]
        unique = [cfg for cfg in unique if kernel.candidate_is_valid(inv, cfg)]
        floored = sum(cfg in floor for cfg in unique)
        if self.policy.max_configs is not None:
            unique = _spread_over_implementations(unique, floored, max(self.policy.max_configs, floored))
        if not unique:
            raise AutotuneError(f"{inv.op_id} call {inv.call_key}: no valid candidate configs")
        job = _Job(inv, [CandidateResult(cfg, floor=cfg in floor) for cfg in unique], budget_s=self.policy.time_budget_s)
        if self.policy.tune_backward and kernel.has_custom_vjp:
            job.cotangent = _output_spec(inv, unique)
        return job

    def _compile_all(self, jobs: list[_Job], progress: _Progress) -> None:
        # Every call's floor first, so a budget spent on compiling never starves it.
        work = [(job, i) for job in jobs for i, c in enumerate(job.candidates) if c.floor]
        work += [(job, i) for job in jobs for i, c in enumerate(job.candidates) if not c.floor]
        with concurrent.futures.ThreadPoolExecutor(max_workers=self.policy.compile_workers) as pool:
            futures = {pool.submit(self._compile, job, job.candidates[i]): (job, i) for job, i in work}
            for future in concurrent.futures.as_completed(futures):
                job, i = futures[future]
                executable = future.result()
                if executable is not None:
                    job.executables[i] = executable
                progress.advance()

    @staticmethod
    def _compile(job: _Job, candidate: CandidateResult) -> Any:
        inv = job.inv
        if time.perf_counter() > job.compile_deadline:
            candidate.status, candidate.reason = "skipped", _DEADLINE_COMPILE
            job.cut = True
            return None
        if not candidate.floor and job.over_budget():
            candidate.status, candidate.reason = "skipped", "time budget spent compiling other candidates"
            return None
        operands = (inv.args, inv.array_kwargs) + ((job.cotangent,) if job.cotangent is not None else ())
        start = time.perf_counter()
        try:
            executable = jax.jit(_candidate_function(inv, candidate.cfg, job.cotangent is not None)).lower(*operands).compile()
        except Exception as err:  # any failure of one candidate is recorded, not raised
            candidate.status, candidate.reason = "compile_error", _describe_error(err)[1]
            return None
        finally:
            candidate.compile_s = time.perf_counter() - start
            with job.lock:
                job.compile_spent_s += candidate.compile_s
        return executable

    def _measure(self, job: _Job, progress: _Progress) -> TuneResult:
        inv = job.inv
        measure_start = time.perf_counter()
        if measure_start > job.deadline:
            self._cut(job, progress)

        def inputs(seed: int) -> tuple[tuple[Any, ...], dict[str, Any]]:
            args, kwargs = inv.kernel.make_inputs(inv, jax.random.key(seed))
            return (args, {k: v for k, v in kwargs.items() if k in inv.array_kwargs}), kwargs

        operands, kwargs = inputs(self.seed)
        if job.cotangent is not None:
            operands += (random_inputs(Invocation(inv.kernel, (job.cotangent,)), jax.random.key(self.seed + 1))[0][0],)
        reference = self._reference(job, operands, kwargs)
        # A second input set to rotate through while timing (see AutotunePolicy.calls_per_sample).
        rotation = (operands, inputs(self.seed + 2)[0] + operands[2:])
        alive: list[int] = []
        for i, executable in job.executables.items():
            candidate = job.candidates[i]
            try:
                out = jax.block_until_ready(executable(*operands))
            except Exception as err:
                candidate.status, candidate.reason = _describe_error(err)
                continue
            candidate.error = _relative_error(out, reference) if reference is not None else 0.0
            tolerance = _tolerance(out)
            if math.isnan(candidate.error):
                candidate.status, candidate.reason = "nan", "output has NaN or Inf"
            elif candidate.error > tolerance:
                candidate.status = "wrong"
                candidate.reason = f"relative error {candidate.error:.3g} over tolerance {tolerance:.3g}"
            else:
                alive.append(i)
        progress.advance(len(job.candidates) - len(alive))
        winner = self._race(job, alive, rotation, progress, measure_start)
        if winner is None and job.cut:
            self._cut(job, progress)
        if winner is None:
            reasons = "; ".join(f"{c.cfg!r}: {c.status} ({c.reason})" for c in job.candidates)
            raise AutotuneError(f"every candidate of {inv.op_id} call {inv.call_key} failed: {reasons}")
        best = job.candidates[winner]
        now = time.perf_counter()
        return TuneResult(inv.op_id, inv.call_key, best.cfg, best, job.candidates, now - job.start, now - measure_start, job.cut)

    @staticmethod
    def _cut(job: _Job, progress: _Progress) -> None:
        """Mark every candidate not yet decided ``skipped`` and raise :class:`TuningCut`."""
        pending = [c for c in job.candidates if c.status == "pending"]
        for candidate in pending:
            candidate.status, candidate.reason = "skipped", _DEADLINE_TIMING
        progress.advance(len(pending))
        raise TuningCut(
            f"{job.inv.op_id} call {job.inv.call_key}: the run's time budget was spent before any candidate was timed",
            job.candidates,
        )

    def _reference(self, job: _Job, operands: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """The kernel's reference output (and gradients), else the first working candidate's."""
        reference = getattr(job.inv.kernel, "reference", None)
        if callable(reference):
            args = operands[0]
            try:
                if job.cotangent is None:
                    return jax.block_until_ready(reference(*args, **kwargs))
                out, pullback = jax.vjp(lambda *a: reference(*a, **kwargs), *args)
                return jax.block_until_ready((out, pullback(operands[2])))
            except Exception as err:  # a plain reference can need memory a tiled kernel does not
                warnings.warn(
                    f"{job.inv.op_id} call {job.inv.call_key}: the reference failed ({_describe_error(err)[1]}); "
                    "checking candidates against the first one that runs instead",
                    stacklevel=2,
                )
        for i in sorted(job.executables):  # the heuristic config is candidate 0 when valid
            try:
                return jax.block_until_ready(job.executables[i](*operands))
            except Exception:
                continue
        return None

    def _race(
        self, job: _Job, alive: list[int], rotation: tuple[tuple[Any, ...], ...], progress: _Progress, measure_start: float
    ) -> int | None:
        """Successive halving over the correct candidates; returns the winner's index.

        Round one times every survivor ``num_iters // 8`` times (at least 2); each round drops
        the slower half (except candidates within 3% of the best median) and anything over
        ``_CLEAR_LOSS`` times the best median, and doubles the runs. Samples accumulate across rounds, so no measurement is wasted, and the last two
        candidates are topped up to ``num_iters`` samples each before the final ranking. Once
        compile and timing seconds reach the budget, candidates not yet timed are skipped
        (never the floor, which is timed first and in full) and every timing so far ranks. The
        caller's deadline (``job.deadline``) skips them the same way.
        """
        policy = self.policy
        if not alive:
            return None
        samples: dict[int, list[float]] = {i: [] for i in alive}
        halving = policy.early_stop and len(alive) > 2
        runs = max(2, policy.num_iters // 8) if halving else policy.num_iters
        if job.budget_s is None:
            deadline = math.inf
        else:
            deadline = measure_start + max(0.0, job.budget_s - job.compile_spent_s)
        deadline = min(deadline, job.deadline)

        per_sample = policy.calls_per_sample

        def measure(i: int, count: int) -> None:
            calls = [functools.partial(job.executables[i], *operands) for operands in rotation]
            run = lambda: [calls[k % len(calls)]() for k in range(per_sample)]
            _timed_runs(run, max(1, policy.num_warmup) if not samples[i] else 1)  # warm-up / re-warm caches
            samples[i].extend(t / per_sample for t in _timed_runs(run, count))
            job.candidates[i].timing = Timing(samples[i])

        def drop(i: int, status: str, reason: str) -> None:
            job.candidates[i].status, job.candidates[i].reason = status, reason
            alive.remove(i)
            progress.advance()

        def skip(i: int) -> None:
            if time.perf_counter() > job.deadline:
                job.cut = True
                drop(i, "skipped", _DEADLINE_TIMING)
            else:
                drop(i, "skipped", "time budget spent before it was timed")

        # The floor is timed first and in full: it is what every other candidate must beat.
        for i in alive:
            if job.candidates[i].floor:
                measure(i, policy.num_iters)
        while True:
            for i in list(alive):
                in_time = time.perf_counter() <= deadline  # one reading: an untimed candidate is timed or skipped
                if not in_time and not samples[i]:
                    skip(i)
                elif len(samples[i]) < runs and in_time:
                    measure(i, runs - len(samples[i]))
            alive.sort(key=lambda i: job.candidates[i].timing)
            if len(alive) <= 2 or runs >= policy.num_iters or time.perf_counter() > deadline:
                break
            best = job.candidates[alive[0]].timing
            for i in alive[math.ceil(len(alive) / 2):]:
                if job.candidates[i].floor:
                    continue  # timed in full already; it stays in the ranking
                if job.candidates[i].timing > (1 + _TOO_CLOSE_TO_DROP) * best:
                    drop(i, "pruned", f"in the slower half after {len(samples[i])} timed runs")
            for i in [i for i in alive if job.candidates[i].timing > _CLEAR_LOSS * best and not job.candidates[i].floor]:
                drop(i, "pruned", f"over {_CLEAR_LOSS}x the best median after {len(samples[i])} timed runs")
            runs = min(policy.num_iters, runs * 2)
        for i in alive:
            if len(samples[i]) >= policy.num_iters:
                continue
            if time.perf_counter() <= deadline:
                measure(i, policy.num_iters - len(samples[i]))
            elif time.perf_counter() > job.deadline:
                job.cut = True  # ranked on fewer runs than a finished ranking takes
        alive.sort(key=lambda i: job.candidates[i].timing)
        for i in alive:
            job.candidates[i].status = "ok"
        progress.advance(len(alive))
        return alive[0]


def _floor_configs(inv: Invocation[Any, Any]) -> list[Any]:
    """The heuristic config and the kernel's XLA config of ``inv`` (one if they are the same)."""
    kernel = inv.kernel
    floor = [kernel.heuristic_cfg(inv)]
    try:
        xla = kernel.config_for(inv, "xla")
    except Exception:  # noqa: BLE001 - a kernel's own hook failing only loses the XLA candidate
        xla = None
    if xla is not None and xla not in floor:
        floor.append(xla)
    return floor


def _candidate_function(inv: Invocation[Any, Any], cfg: Any, backward: bool) -> Callable[..., Any]:
    """What one candidate compiles to: the forward call, or forward and backward together."""
    impl = inv.kernel.implementation(_platform())
    static = inv.static_kwargs

    def forward(args: tuple[Any, ...], array_kwargs: dict[str, Any]) -> Any:
        return impl(*args, cfg=cfg, **array_kwargs, **static)

    if not backward:
        return forward
    def forward_and_backward(args: tuple[Any, ...], array_kwargs: dict[str, Any], cotangent: Any) -> Any:
        def labelled(*primals: Any) -> Any:
            call = Invocation(inv.kernel, primals, {**array_kwargs, **static}, known_call_key=inv.call_key)
            return run_labelled(call, cfg)

        out, pullback = jax.vjp(labelled, *args)
        return out, pullback(cotangent)

    return forward_and_backward


def _output_spec(inv: Invocation[Any, Any], configs: list[Any]) -> Any:
    """The abstract output of ``inv`` (the same for every config), or None if none traces."""
    for cfg in configs:
        try:
            return jax.eval_shape(_candidate_function(inv, cfg, backward=False), inv.args, inv.array_kwargs)
        except Exception:
            continue
    return None


def _platform() -> str:
    return get_device_platform()


def store_result(result: TuneResult, inv: Invocation[Any, Any], cache: ConfigCache | None, persistent: Any) -> None:
    """Put a tuning winner into the memory cache and, when given, the persistent cache."""
    key = inv.cache_key
    if cache is not None:
        cache.put(*key, result.best_cfg)
    if persistent is not None:
        persistent.put(*key, result.best_cfg, provenance="autotuned", stats=result.stats(), kernel_version=inv.kernel_version)


def tune_invocation(
    inv: Invocation[Any, Any],
    *,
    policy: AutotunePolicy | None = None,
    cache: ConfigCache | None = None,
    persistent: Any = None,
    configs: Iterable[Any] | None = None,
) -> TuneResult:
    """Tune one call and store the winner (used by the selector on a cache miss)."""
    result = Autotuner(policy).tune(inv, configs)
    store_result(result, inv, cache, persistent)
    return result


class Tuner:
    """ejkernel's ``Tuner(warmup, iters)``: what a ``ConfigSelectorChain`` tunes a miss with.

    As a selector's ``tuner`` it runs ejlabel's autotuner (ahead-of-time compiles, checks every
    candidate against the reference, successive halving) with ``num_warmup=warmup`` and
    ``num_iters=iters``; the candidates are the kernel's ``config_space`` (ejkernel's
    ``candidate_cfgs[_<platform>]`` when defined). ``measure`` and ``autotune`` keep ejkernel's
    stand-alone forms; ``measure`` returns the median time in seconds.
    """

    def __init__(self, warmup: int = 1, iters: int = 3) -> None:
        AutotunePolicy(num_warmup=warmup, num_iters=iters)  # validates both counts
        self.warmup, self.iters = warmup, iters

    def __call__(self, inv: Invocation[Any, Any], *, policy: AutotunePolicy, cache: ConfigCache, persistent: Any) -> Any:
        policy = dataclasses.replace(policy, num_warmup=self.warmup, num_iters=self.iters)
        return tune_invocation(inv, policy=policy, cache=cache, persistent=persistent).best_cfg

    def measure(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> float:
        """Median seconds per call of ``jax.jit(fn)(*args, **kwargs)``, compile excluded."""
        compiled = jax.jit(fn).lower(*args, **kwargs).compile()
        return benchmark(compiled, *args, num_warmup=self.warmup, num_iters=self.iters, **kwargs) / 1e3

    def autotune(self, make_fn: Callable[[Any], Callable[..., Any]], args: Sequence[Any], kwargs: dict[str, Any], candidates: Iterable[Any]) -> Any:
        """The candidate ``cfg`` whose ``make_fn(cfg)`` runs fastest on ``(args, kwargs)``."""
        best_cfg, best_t = None, math.inf
        for cfg in candidates:
            t = self.measure(make_fn(cfg), *args, **kwargs)
            if t < best_t:
                best_cfg, best_t = cfg, t
        if best_cfg is None:
            raise AutotuneError("no candidates to tune")
        return best_cfg

    def __repr__(self) -> str:
        return f"Tuner(warmup={self.warmup}, iters={self.iters})"


def _tune_on_miss(inv: Invocation[Any, Any], *, policy: AutotunePolicy, cache: ConfigCache, persistent: Any) -> Any:
    return tune_invocation(inv, policy=policy, cache=cache, persistent=persistent).best_cfg


set_default_tuner(_tune_on_miss)


def _default_selector() -> Any:
    return get_default_executor().selector


def autotune(
    kernel: Kernel[Any, Any],
    *args: Any,
    configs: Iterable[Any] | None = None,
    num_warmup: int = 3,
    num_iters: int = 10,
    selector: Any = None,
    **kwargs: Any,
) -> Any:
    """Tune ``kernel`` on these arguments and return the fastest correct config.

    The winner is stored in ``selector``'s caches (the default executor's when None), so later
    calls with the same signature use it.
    """
    if not isinstance(kernel, Kernel):
        raise TypeError(
            f"autotune(kernel, *args): expected a Kernel, got {type(kernel).__name__}; ejlabel's autotune tunes "
            "one kernel call (ejkernel's function-decorator form is not supported: make the function a Kernel "
            "with candidate_cfgs)"
        )
    selector = selector if selector is not None else _default_selector()
    policy = dataclasses.replace(selector.policy, num_warmup=num_warmup, num_iters=num_iters)
    inv = Invocation(kernel, args, kwargs)
    return tune_invocation(inv, policy=policy, cache=selector.cache, persistent=selector.persistent, configs=configs).best_cfg


def autotune_recorded(
    invocations: Iterable[Invocation[Any, Any]] | ConfigSelectorChain | None = None,
    *,
    selector: Any = None,
    policy: AutotunePolicy | None = None,
    progress: bool | None = None,
    show_progress: bool | None = None,
    repetition_count: int = 1,
) -> dict[tuple[str, str], Any]:
    """Tune many calls in one batch; returns ``{(op_id, call_key): winning config}``.

    Calls are deduplicated by ``(op_id, call_key)``; every candidate of every call compiles in
    one pool; each winner is stored in ``selector``'s memory and persistent caches.

    ejkernel's form ``autotune_recorded(selector, show_progress=..., repetition_count=1)`` tunes
    every call recorded on this device (``get_invocations(device_fingerprint())``) with that
    selector; ``invocations=None`` does the same with ``selector=``. ``repetition_count`` other
    than 1 is refused: set ``policy.num_iters`` instead.
    """
    if isinstance(invocations, ConfigSelectorChain):
        if selector is not None:
            raise TypeError("give the selector either positionally (ejkernel's form) or as selector=, not both")
        invocations, selector = None, invocations
    if invocations is None:
        invocations = get_invocations(device_fingerprint())
    if show_progress is not None:
        if progress is not None:
            raise TypeError("give either progress or show_progress (the same flag), not both")
        progress = show_progress
    if repetition_count != 1:
        raise ValueError("repetition_count: ejlabel times each candidate policy.num_iters times; set that instead")
    selector = selector if selector is not None else _default_selector()
    unique: dict[tuple[str, str], Invocation[Any, Any]] = {}
    for inv in invocations:
        unique.setdefault((inv.op_id, inv.call_key), inv)
    tuner = Autotuner(policy if policy is not None else selector.policy, progress=progress)
    outcomes = tuner.tune_each(list(unique.values()))
    winners, failures = {}, []
    for key, inv, outcome in zip(unique, unique.values(), outcomes):
        if isinstance(outcome, AutotuneError):
            failures.append(str(outcome))
        else:
            store_result(outcome, inv, selector.cache, selector.persistent)
            winners[key] = outcome.best_cfg
    if failures:
        # The calls that did tune are stored already; the error names the others.
        raise AutotuneError(f"{len(failures)} of {len(unique)} calls could not be tuned: " + " | ".join(failures))
    return winners


def _spread_over_implementations(configs: list[Any], floored: int, limit: int) -> list[Any]:
    """The first ``limit`` of ``configs``: the ``floored`` leading ones, then the rest taken
    round-robin over their ``impl`` field (in order within each), so a space that lists one
    implementation's thirty tilings before another's six still gets both ranked under a cap."""
    if len(configs) <= limit:
        return configs
    groups: dict[Any, list[Any]] = {}
    for cfg in configs[floored:]:
        groups.setdefault(getattr(cfg, "impl", None), []).append(cfg)
    picked = list(configs[:floored])
    queues = [iter(group) for group in groups.values()]
    while len(picked) < limit and queues:
        for queue in list(queues):
            cfg = next(queue, None)
            if cfg is None:
                queues.remove(queue)
            elif len(picked) < limit:
                picked.append(cfg)
    return picked
