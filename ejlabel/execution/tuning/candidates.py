"""What one call is tuned over, and what comes back.

A call's candidates are its *floor* first (the kernel's heuristic config and the config of the
plain path it declares, :func:`floor_configs`: what every other candidate must beat, never
skipped for budget), then its config space. Nothing else is added: a candidate is a config the
kernel declared. :func:`candidate_function` is what one candidate compiles to: the kernel's
implementation on this platform with that config, and, when the backward pass is timed too,
forward and backward together through the labelled call; a call made under ``jax.vmap`` is
compiled and timed batched, on :func:`tuning_arguments`. A capped list keeps the floor and
takes the rest round-robin over implementations (:func:`spread_over_implementations`), so a cap
never leaves a whole implementation out.

:class:`Job` is one call in flight (its candidates, compiled executables, budget and deadlines);
each candidate ends as a :class:`CandidateResult` with a status and the reason, and the call as
a :class:`TuneResult` (its winner, every candidate, the statistics the caches store) or an
:class:`AutotuneError` (every candidate failed) or :class:`TuningCut` (the caller's deadline
passed before anything was timed).
"""

from __future__ import annotations

import dataclasses
import math
import threading
import time
from collections.abc import Callable
from typing import Any

import jax

from ejlabel.core.kernel import Invocation
from ejlabel.core.vmapped import batched_arguments, batched_function
from ejlabel.execution.executor import run_labelled
from ejlabel.execution.tuning.measure import Timing
from ejlabel.utils.fingerprint import get_device_platform
from ejlabel.utils.serialize import to_jsonable

__all__ = [
    "DEADLINE_COMPILE", "DEADLINE_TIMING", "AutotuneError", "CandidateResult", "Job", "TuneResult", "TuningCut",
    "candidate_function", "floor_configs", "output_spec", "spread_over_implementations", "tuning_arguments",
]


@dataclasses.dataclass
class CandidateResult:
    """What happened to one candidate config.

    ``status`` is ``ok``, ``compile_error``, ``runtime_error``, ``out_of_memory``, ``nan``,
    ``wrong`` (relative error over tolerance), ``pruned`` (dropped by successive halving after
    timing) or ``skipped`` (never timed: the time budget was spent first). ``floor`` marks the
    heuristic and plain-path candidates, which the budget never skips; ``prior`` those the kernel
    expects to beat its floor on this device, which come right after them.
    """

    cfg: Any
    status: str = "pending"
    reason: str | None = None
    compile_s: float | None = None
    error: float | None = None
    timing: Timing | None = None
    floor: bool = False
    prior: bool = False  # the kernel expects it can beat XLA here (Kernel.prior_configs)

    def to_dict(self) -> dict[str, Any]:
        return {
            "cfg": to_jsonable(self.cfg),
            "status": self.status,
            "reason": self.reason,
            "compile_s": self.compile_s,
            "relative_error": self.error,
            "timing": self.timing.to_dict() if self.timing is not None else None,
            "floor": self.floor,
            "prior": self.prior,
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


class CallCodeError(AutotuneError):
    """The call's own code raised (the kernel listing its candidates, making its inputs or its
    reference): that call fails, alone. ``error`` is what it raised."""

    def __init__(self, message: str, error: Exception) -> None:
        super().__init__(message)
        self.error = error


class TuningCut(AutotuneError):
    """The caller's deadline passed before any candidate of this call was timed.

    Not a failure of the call: nothing was measured. ``candidates`` says what each got to
    (``skipped``, or a compile error found before the cut).
    """

    def __init__(self, message: str, candidates: list[CandidateResult]) -> None:
        super().__init__(message)
        self.candidates = candidates


DEADLINE_COMPILE = "deadline: the run's time budget was spent before it was compiled"
DEADLINE_TIMING = "deadline: the run's time budget was spent before it was timed"


@dataclasses.dataclass
class Job:
    """One call being tuned: its spec, candidates and compiled executables.

    A job can be tuned in rounds (:meth:`~.isolated.Autotuner.tune_jobs`): ``active`` names the
    candidates a round ranks; what earlier rounds compiled, checked and timed is kept, so no
    candidate is compiled or checked twice and a timing carries over to the next round.
    """

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
    active: list[int] | None = None  # indices of the candidates this round ranks; None: all
    lock: threading.Lock = dataclasses.field(default_factory=threading.Lock, repr=False)

    @property
    def included(self) -> list[int]:
        """The indices of the candidates this round ranks, in candidate order."""
        return list(range(len(self.candidates))) if self.active is None else sorted(set(self.active))

    def over_budget(self, measured_from: float | None = None) -> bool:
        """Whether compiling (and, given when timing began, timing) has spent the budget."""
        if self.budget_s is None:
            return False
        timing = 0.0 if measured_from is None else time.perf_counter() - measured_from
        return self.compile_spent_s + timing >= self.budget_s


def floor_configs(inv: Invocation[Any, Any]) -> list[Any]:
    """The heuristic config of ``inv`` and the config of the plain path its kernel declares
    (``Kernel.plain_implementation``; one config if they are the same or none is declared)."""
    kernel = inv.kernel
    floor = [kernel.heuristic_cfg(inv)]
    try:
        plain = kernel.plain_config(inv)
    except Exception:  # noqa: BLE001 - a kernel's own hook failing only loses the plain candidate
        plain = None
    if plain is not None and plain not in floor:
        floor.append(plain)
    return floor


def candidate_function(inv: Invocation[Any, Any], cfg: Any, backward: bool) -> Callable[..., Any]:
    """What one candidate compiles to: the forward call, or forward and backward together, of
    the arguments :func:`tuning_arguments` gives (a call made under ``jax.vmap`` batched)."""
    impl = inv.kernel.implementation(_platform())
    static = inv.static_kwargs

    def forward(args: tuple[Any, ...], array_kwargs: dict[str, Any]) -> Any:
        return impl(*args, cfg=cfg, **array_kwargs, **static)

    if not backward:
        return batched_function(forward, inv.args, inv.array_kwargs, inv.batch_axes)

    def labelled_call(args: tuple[Any, ...], array_kwargs: dict[str, Any]) -> Any:
        call = Invocation(inv.kernel, args, {**array_kwargs, **static}, known_call_key=inv.call_key)
        return run_labelled(call, cfg)

    labelled = batched_function(labelled_call, inv.args, inv.array_kwargs, inv.batch_axes)

    def forward_and_backward(args: tuple[Any, ...], array_kwargs: dict[str, Any], cotangent: Any) -> Any:
        out, pullback = jax.vjp(lambda *primals: labelled(primals, array_kwargs), *args)
        return out, pullback(cotangent)

    return forward_and_backward


def tuning_arguments(inv: Invocation[Any, Any], args: tuple[Any, ...], array_kwargs: dict[str, Any]) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """``(args, array_kwargs)`` of one example as the call runs them: batched along its
    ``jax.vmap`` axes when it has any (specs grown, values broadcast), else as they are."""
    return batched_arguments(args, array_kwargs, inv.batch_axes)


def output_spec(inv: Invocation[Any, Any], configs: list[Any]) -> Any:
    """The abstract output of ``inv`` (the same for every config), or None if none traces."""
    operands = tuning_arguments(inv, inv.args, inv.array_kwargs)
    for cfg in configs:
        try:
            return jax.eval_shape(candidate_function(inv, cfg, backward=False), *operands)
        except Exception:
            continue
    return None


def _platform() -> str:
    return get_device_platform()


def spread_over_implementations(configs: list[Any], floored: int, limit: int) -> list[Any]:
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
