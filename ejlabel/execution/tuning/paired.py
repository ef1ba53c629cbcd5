"""The noise rule: two compiled programs timed in paired rounds, and when a gain counts.

Tuning in context keeps a change only if the whole step gets faster, which is a judgement under
noise. A comparison runs in rounds; each round times the incumbent I and the challenger C back
to back (the order alternating by round: I C, C I, I C, ...), which pairs them: drift and the
machine's state at that moment hit both alike, and cancel in the round's difference
``d = I - C``. The gain is estimated by the median of the d's. Its one-sided lower confidence
bound at ``LEVEL`` (95%) is the sign test's order statistic: the k-th smallest d, with k the
largest rank such that ``P(Binomial(n, 1/2) <= k - 1) <= 5%``; the upper bound is the k-th
largest (none below 5 rounds). It assumes nothing about the shape of the noise, only that rounds
are independent. With the threshold ``T = min_gain * median(I)`` (1% by default: a smaller gain
is not worth a change, which is a new compiled program and another kernel), C is *accepted*
when the lower bound exceeds T, *rejected* when the upper bound is below T, and otherwise timed
for another block of rounds, up to ``ROUND_CAP`` blocks in all and only while the budget has
room for them; still undecided then, it is rejected. A rule asking a difference of two medians
to beat the spread of single samples (their IQR) would reject real gains of 2%, since a median
of n samples scatters far less than one sample, and would never measure longer when the answer
is unclear. Here a clear gain is decided after the first block, a small real one by measuring
longer. Each look is at 95%; several looks make a false accept a little likelier than 5% for a
change whose true gain is exactly T, and far less likely for a change that gains nothing (its
d's sit T below the line); the final check then applies the rule to the whole assignment
against the floor.

A sample lasts at least ``MIN_SAMPLE_MS`` (20 ms), far above the timer and the dispatch jitter:
if the slowest program of a comparison ran shorter than that in its last warm-up run, each
sample runs each program ``ceil(20 ms / that time)`` times in a row (at most
``MAX_RUNS_PER_SAMPLE``; each run waited for) and records the mean per run.
"""

from __future__ import annotations

import dataclasses
import fractions
import functools
import math
import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any

import jax

from ejlabel.execution.tuning.measure import Timing

__all__ = ["LEVEL", "MAX_RUNS_PER_SAMPLE", "MIN_SAMPLE_MS", "ROUND_CAP", "Comparison", "compare"]

LEVEL = 0.95  # one-sided confidence of the noise rule's bounds
ROUND_CAP = 4  # a comparison takes at most ROUND_CAP x samples rounds
MIN_SAMPLE_MS = 20.0  # a sample repeats a shorter step until it lasts about this long
MAX_RUNS_PER_SAMPLE = 1000


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


def compare(
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
