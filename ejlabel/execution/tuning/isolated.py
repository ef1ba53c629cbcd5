"""Tuning one call in isolation: compile every candidate ahead of time, check it, time only the executable.

For one call (an :class:`~ejlabel.core.kernel.Invocation`) the :class:`Autotuner`

1. lowers and compiles each candidate config (:mod:`.candidates`) on the abstract arguments,
   several at once in a thread pool (XLA compiles outside the GIL); compile time is reported,
   never timed;
2. builds concrete inputs once (``kernel.make_inputs``), outside any trace;
3. checks each candidate's output against the reference (``kernel.reference`` if defined, else
   the heuristic config's output) by relative error with a dtype-appropriate tolerance; the
   reference (with its gradients for a differentiated call) runs as one compiled program, not
   op by op: eager dispatch compiles every operation on its own, seconds per call on a GPU;
4. times the compiled executables with successive halving (:mod:`.halving`).

Candidates that fail to compile, run out of memory, give NaN or a wrong result are recorded with
the reason and skipped. A call whose own kernel code raises (listing its candidates, making its
inputs or its reference: a malformed call rebuilt from a program, an array too big to make) fails
alone: :meth:`Autotuner.tune_each` gives a :class:`~.candidates.CallCodeError` in its place, and
every other call of the batch is tuned. The winner goes to the memory cache and the persistent cache with
provenance ``autotuned``, its statistics and every candidate's result (:func:`store_result`).
The same engine serves a selector's cache miss (:func:`tune_invocation`, registered as the
default tuner), ``autotune``, ``autotune_recorded`` and ejkernel's :class:`Tuner`.

The time budget (``AutotunePolicy.time_budget_s``, per call) is spent in this order and never
buys a worse pick:

* the *floor* candidates, the heuristic config and the config of the kernel's declared plain
  path (``kernel.plain_config(inv)``), come first in the candidate list, survive
  ``max_configs``, and are always compiled, checked and fully timed, budget or not;
* every other candidate's compile seconds count against the budget: once they reach it, the
  remaining candidates are not compiled; timing stops starting new candidates once compile and
  timing together reach it;
* a candidate is ``skipped`` only if it was never timed, so every timing taken stays in the
  ranking: the winner is the fastest candidate measured, and the floor is always measured, so
  the stored winner is never slower than the heuristic or the plain path. ``TuneResult.skipped`` (and the
  stored statistics) say how many candidates were skipped and which.

Candidates come in this order: the floor, then the kernel's prior (the configs it expects to
beat XLA on this device, :meth:`~ejlabel.core.kernel.Kernel.prior_configs`), then the rest of
its config space; a ``max_configs`` cap keeps the floor and then the prior.

A caller can also tune in rounds: :meth:`Autotuner.jobs` builds each call's job once, and each
:meth:`Autotuner.tune_jobs` ranks the candidates a job's ``active`` names (tuning in context
times the floors alone first, then the priors, then the rest). A job keeps what earlier rounds
compiled, checked and timed, so no candidate is compiled or checked twice.

A caller with a whole-run budget (tuning in context) passes ``tune_each(..., deadline=t)``, a
``time.perf_counter()`` time. Unlike the per-call budget it is a hard stop, the floor included:
no compile starts after the midpoint between the call to ``tune_each`` and ``t`` (the timing
needs the other half); no call's measurement starts after ``t``, and within a call whose
measurement began, no candidate but the floor starts its timing after ``t``; work already
running finishes. Calls are measured one after the other, in the given order, so a
cut leaves the first calls fully ranked. A call cut after some of its candidates were timed
comes back as a ``TuneResult`` with ``cut`` set (the untimed ones ``skipped``, the timed ones
ranked, perhaps on fewer runs than ``num_iters``): usable, but not a finished ranking. A call cut
before any was timed comes back as a :class:`~.candidates.TuningCut` in place.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import math
import os
import time
import warnings
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import jax
import numpy as np

from ejlabel.config.cache import AutotunePolicy, ConfigCache
from ejlabel.config.selection import ConfigSelectorChain, set_default_tuner
from ejlabel.core.kernel import Invocation, Kernel, abstract_invocation, random_inputs
from ejlabel.core.vmapped import batched_function
from ejlabel.execution.executor import get_default_executor, per_shard_invocation, split_of
from ejlabel.execution.recording import get_invocations
from ejlabel.execution.tuning.candidates import (
    DEADLINE_COMPILE,
    DEADLINE_TIMING,
    AutotuneError,
    CallCodeError,
    CandidateResult,
    Job,
    TuneResult,
    TuningCut,
    candidate_function,
    floor_configs,
    output_spec,
    spread_over_implementations,
    tuning_arguments,
)
from ejlabel.execution.tuning.halving import race
from ejlabel.execution.tuning.measure import Progress, benchmark, describe_error, output_tolerance, relative_error
from ejlabel.utils.fingerprint import device_fingerprint

__all__ = ["Autotuner", "Tuner", "autotune", "autotune_recorded", "prior_configs", "store_result", "tune_invocation"]


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
        return self.tune_jobs(self.jobs(invocations, configs), deadline=deadline)

    def jobs(
        self, invocations: Sequence[Invocation[Any, Any]], configs: dict[int, list[Any]] | None = None, *, floors: dict[int, Any] | None = None
    ) -> list[Job | AutotuneError]:
        """One :class:`~.candidates.Job` per call (its error in place when it has no valid
        candidate), to tune with :meth:`tune_jobs`, in one round or several.

        ``configs`` ({index: configs}) limits a call to those; ``floors`` ({index: config})
        marks one more config of a call as floor, never skipped (tuning in context's all-XLA
        pick, for a kernel whose own floor lacks it).
        """
        return _outside_trace(self._jobs, list(invocations), configs or {}, floors or {})

    def tune_jobs(self, jobs: Sequence[Job | AutotuneError], *, deadline: float | None = None) -> list[TuneResult | AutotuneError]:
        """Compile, check and rank the active candidates of each job (``job.active``; all when
        None), the calls measured in the given order; errors pass through in place.

        A job tuned before keeps what it compiled, checked and timed: this round compiles and
        checks only candidates new to it, and a candidate timed before starts from its samples.
        ``deadline`` as in :meth:`tune_each`, for this round.
        """
        return _outside_trace(self._tune_jobs, list(jobs), deadline)

    def _jobs(self, invocations: list[Invocation[Any, Any]], configs: dict[int, list[Any]], floors: dict[int, Any]) -> list[Job | AutotuneError]:
        jobs: list[Job | AutotuneError] = []
        for i, inv in enumerate(invocations):
            try:
                jobs.append(self._job(abstract_invocation(inv), configs.get(i), floors.get(i)))
            except AutotuneError as err:
                jobs.append(err)
            except Exception as err:  # noqa: BLE001 - the kernel's code failed on this call alone
                jobs.append(_call_failed(inv, "listing its candidates", err))
        return jobs

    def _tune_jobs(self, jobs: list[Job | AutotuneError], deadline: float | None) -> list[TuneResult | AutotuneError]:
        now = time.perf_counter()
        live = [job for job in jobs if isinstance(job, Job)]
        for job in live:
            job.deadline = math.inf if deadline is None else deadline
            job.compile_deadline = math.inf if deadline is None else now + (deadline - now) / 2  # the other half is for timing
            job.cut = False
            for i in job.included:
                candidate = job.candidates[i]
                if candidate.status == "skipped":  # an earlier round's budget skipped it; this round may reach it
                    candidate.status, candidate.reason = "pending", None
        progress = Progress(2 * sum(len(job.included) for job in live), "autotuning", self.progress)
        try:
            self._compile_all(live, progress)
            return [job if isinstance(job, AutotuneError) else self._measure_or_error(job, progress) for job in jobs]
        finally:
            progress.close()

    def _measure_or_error(self, job: Job, progress: Progress) -> TuneResult | AutotuneError:
        try:
            return self._measure(job, progress)
        except AutotuneError as err:
            return err
        except Exception as err:  # noqa: BLE001 - making its inputs or its reference failed: this call alone
            return _call_failed(job.inv, "measuring it", err)

    def _job(self, inv: Invocation[Any, Any], configs: list[Any] | None, extra_floor: Any = None) -> Job:
        """The call's candidates: the floor (heuristic, then plain path) first, then the kernel's prior
        (:meth:`~ejlabel.core.kernel.Kernel.prior_configs`), then the rest of the config space.

        Given ``configs``, only those are tried (in their order, the floor and prior among them
        first). ``max_configs`` caps the list but never drops a floor candidate, keeps the prior
        next, and takes the others round-robin over their implementations, so a cap never leaves
        a whole implementation out.
        """
        kernel = inv.kernel
        _check_fits(inv)
        floor = floor_configs(inv)
        if extra_floor is not None and extra_floor not in floor:
            floor.append(extra_floor)
        prior = [cfg for cfg in prior_configs(inv) if cfg not in floor]
        if configs is None:
            unique = list(dict.fromkeys([*floor, *prior, *kernel.config_space(inv)]))
        else:
            given = list(dict.fromkeys(configs))
            unique = [cfg for cfg in [*floor, *prior] if cfg in given] + [cfg for cfg in given if cfg not in floor and cfg not in prior]
        unique = [cfg for cfg in unique if kernel.candidate_is_valid(inv, cfg)]
        floored = sum(cfg in floor for cfg in unique)
        if self.policy.max_configs is not None:
            limit = max(self.policy.max_configs, floored)
            leading = min(limit, floored + sum(cfg in prior for cfg in unique))
            unique = spread_over_implementations(unique, leading, limit)
        if not unique:
            raise AutotuneError(f"{inv.op_id} call {inv.call_key}: no valid candidate configs")
        candidates = [CandidateResult(cfg, floor=cfg in floor, prior=cfg in prior) for cfg in unique]
        job = Job(inv, candidates, budget_s=self.policy.time_budget_s)
        if self.policy.tune_backward and kernel.has_custom_vjp:
            job.cotangent = output_spec(inv, unique)
        return job

    def _compile_all(self, jobs: list[Job], progress: Progress) -> None:
        # Only candidates no round has tried to compile; every call's floor first, so a budget
        # spent on compiling never starves it.
        new = [(job, i) for job in jobs for i in job.included if job.candidates[i].status == "pending" and i not in job.executables]
        work = [(job, i) for job, i in new if job.candidates[i].floor] + [(job, i) for job, i in new if not job.candidates[i].floor]
        with concurrent.futures.ThreadPoolExecutor(max_workers=self.policy.compile_workers) as pool:
            futures = {pool.submit(self._compile, job, job.candidates[i]): (job, i) for job, i in work}
            for future in concurrent.futures.as_completed(futures):
                job, i = futures[future]
                executable = future.result()
                if executable is not None:
                    job.executables[i] = executable
                progress.advance()

    @staticmethod
    def _compile(job: Job, candidate: CandidateResult) -> Any:
        inv = job.inv
        if time.perf_counter() > job.compile_deadline:
            candidate.status, candidate.reason = "skipped", DEADLINE_COMPILE
            job.cut = True
            return None
        if not candidate.floor and job.over_budget():
            candidate.status, candidate.reason = "skipped", "time budget spent compiling other candidates"
            return None
        operands = tuning_arguments(inv, inv.args, inv.array_kwargs) + ((job.cotangent,) if job.cotangent is not None else ())
        start = time.perf_counter()
        try:
            executable = jax.jit(candidate_function(inv, candidate.cfg, job.cotangent is not None)).lower(*operands).compile()
        except Exception as err:  # any failure of one candidate is recorded, not raised
            candidate.status, candidate.reason = "compile_error", describe_error(err)[1]
            return None
        finally:
            candidate.compile_s = time.perf_counter() - start
            with job.lock:
                job.compile_spent_s += candidate.compile_s
        return executable

    def _measure(self, job: Job, progress: Progress) -> TuneResult:
        inv = job.inv
        measure_start = time.perf_counter()
        if measure_start > job.deadline:
            self._cut(job, progress)

        def inputs(seed: int) -> tuple[tuple[Any, ...], dict[str, Any]]:
            args, kwargs = inv.kernel.make_inputs(inv, jax.random.key(seed))
            return tuning_arguments(inv, args, {k: v for k, v in kwargs.items() if k in inv.array_kwargs}), kwargs

        operands, kwargs = inputs(self.seed)
        if job.cotangent is not None:
            operands += (random_inputs(Invocation(inv.kernel, (job.cotangent,)), jax.random.key(self.seed + 1))[0][0],)
        included = job.included
        # Candidates an earlier round checked and ranked compete again; the others are checked once.
        alive = [i for i in included if job.candidates[i].status == "ok"]
        unchecked = [i for i in included if i in job.executables and job.candidates[i].status == "pending"]
        reference = self._reference(job, operands, kwargs) if unchecked else None
        # A second input set to rotate through while timing (see AutotunePolicy.calls_per_sample).
        rotation = (operands, inputs(self.seed + 2)[0] + operands[2:])
        for i in unchecked:
            candidate, executable = job.candidates[i], job.executables[i]
            try:
                out = jax.block_until_ready(executable(*operands))
            except Exception as err:
                candidate.status, candidate.reason = describe_error(err)
                continue
            candidate.error = relative_error(out, reference) if reference is not None else 0.0
            tolerance = output_tolerance(out)
            if math.isnan(candidate.error):
                candidate.status, candidate.reason = "nan", "output has NaN or Inf"
            elif candidate.error > tolerance:
                candidate.status = "wrong"
                candidate.reason = f"relative error {candidate.error:.3g} over tolerance {tolerance:.3g}"
            else:
                alive.append(i)
        alive.sort()
        progress.advance(len(included) - len(alive))
        winner = race(job, alive, rotation, progress, measure_start, self.policy)
        if winner is None and job.cut:
            self._cut(job, progress)
        candidates = [job.candidates[i] for i in included]
        if winner is None:
            reasons = "; ".join(f"{c.cfg!r}: {c.status} ({c.reason})" for c in candidates)
            raise AutotuneError(f"every candidate of {inv.op_id} call {inv.call_key} failed: {reasons}")
        best = job.candidates[winner]
        now = time.perf_counter()
        return TuneResult(inv.op_id, inv.call_key, best.cfg, best, candidates, now - job.start, now - measure_start, job.cut)

    @staticmethod
    def _cut(job: Job, progress: Progress) -> None:
        """Mark every candidate of this round not yet decided ``skipped`` and raise :class:`TuningCut`."""
        candidates = [job.candidates[i] for i in job.included]
        pending = [c for c in candidates if c.status == "pending"]
        for candidate in pending:
            candidate.status, candidate.reason = "skipped", DEADLINE_TIMING
        progress.advance(len(pending))
        raise TuningCut(
            f"{job.inv.op_id} call {job.inv.call_key}: the run's time budget was spent before any candidate was timed",
            candidates,
        )

    def _reference(self, job: Job, operands: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """The kernel's reference output (and gradients), else the first working candidate's
        (also when the reference cannot be traced and compiled)."""
        reference = getattr(job.inv.kernel, "reference", None)
        if callable(reference):
            inv = job.inv
            static = {k: v for k, v in kwargs.items() if k not in inv.array_kwargs}
            # Batched like the candidates when the call runs under jax.vmap.
            call = batched_function(lambda a, k: reference(*a, **k, **static), inv.args, inv.array_kwargs, inv.batch_axes)
            args, array_kwargs = operands[0], operands[1]

            def value_and_pullback(args: Any, array_kwargs: Any, cotangent: Any) -> Any:
                if cotangent is None:
                    return call(args, array_kwargs)
                out, pullback = jax.vjp(lambda *a: call(a, array_kwargs), *args)
                return out, pullback(cotangent)

            try:
                cotangent = None if job.cotangent is None else operands[2]
                return jax.block_until_ready(jax.jit(value_and_pullback)(args, array_kwargs, cotangent))
            except Exception as err:  # a plain reference can need memory a tiled kernel does not, or not trace
                warnings.warn(
                    f"{job.inv.op_id} call {job.inv.call_key}: the reference failed ({describe_error(err)[1]}); "
                    "checking candidates against the first one that runs instead",
                    stacklevel=2,
                )
        for i in sorted(job.executables):  # the heuristic config is candidate 0 when valid
            try:
                return jax.block_until_ready(job.executables[i](*operands))
            except Exception:
                continue
        return None


def _memory_bytes() -> int | None:
    """The memory tuning inputs are made in: the host's (they are drawn with numpy), and the
    default device's when it reports a limit; None when neither can be read."""
    limits = []
    try:
        limits.append(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
    except (AttributeError, OSError, ValueError):
        pass
    try:
        stats = jax.devices()[0].memory_stats() or {}
        if isinstance(stats.get("bytes_limit"), int):
            limits.append(stats["bytes_limit"])
    except Exception:  # noqa: BLE001, S110 - a backend without memory statistics: the host's limit stands
        pass
    return min(limits) if limits else None


def _check_fits(inv: Invocation[Any, Any]) -> None:
    """AutotuneError for a call whose arguments alone do not fit in memory.

    A call rebuilt from a program can describe any shape; making its inputs would fail late,
    or, where the system lets a process take more memory than it has, end it with a signal.
    """
    leaves = jax.tree_util.tree_leaves((inv.args, inv.kwargs))
    need = sum(math.prod(x.shape) * np.dtype(x.dtype).itemsize for x in leaves if hasattr(x, "shape") and hasattr(x, "dtype"))
    limit = _memory_bytes()
    if limit is not None and need > limit:
        raise AutotuneError(f"{inv.op_id} call {inv.call_key}: its arguments take {need} bytes, more than the {limit} bytes of memory here")


def _call_failed(inv: Invocation[Any, Any], stage: str, err: Exception) -> CallCodeError:
    """The error of one call whose own code (the kernel's candidate list, inputs, reference)
    raised: that call fails, the batch goes on."""
    return CallCodeError(f"{inv.op_id} call {inv.call_key}: failed while {stage}: {describe_error(err)[1]}", err)


def _outside_trace(fn: Callable[..., Any], *args: Any) -> Any:
    """``fn(*args)`` in a separate thread, which has no active JAX trace: tuning triggered while
    tracing a jit'd function compiles and runs concretely instead of being staged into it."""
    with concurrent.futures.ThreadPoolExecutor(max_workers=1) as pool:
        return pool.submit(fn, *args).result()


def prior_configs(inv: Invocation[Any, Any]) -> list[Any]:
    """The kernel's prior for ``inv`` (:meth:`~ejlabel.core.kernel.Kernel.prior_configs`), valid ones only."""
    try:
        prior = list(dict.fromkeys(inv.kernel.prior_configs(inv)))
    except Exception as err:  # noqa: BLE001 - a kernel's own hook failing only loses the prior
        warnings.warn(f"{inv.op_id}: prior_configs failed ({describe_error(err)[1]}); no prior", RuntimeWarning, stacklevel=2)
        return []
    return [cfg for cfg in prior if inv.kernel.candidate_is_valid(inv, cfg)]


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
    calls with the same signature use it. Arguments split over explicit mesh axes tune the call
    one device runs (``Kernel.shard_rule``), the one a split call looks up.
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
    split = split_of(inv)  # arguments split over devices: tune the call each device runs
    inv = inv if split is None else per_shard_invocation(inv, split)
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
