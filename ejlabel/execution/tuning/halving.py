"""Successive halving: ranking a call's compiled, checked candidates without timing each fully.

Every survivor gets a few timed runs, the slower half is dropped, the rest get twice as many,
until one round at the full ``num_iters`` decides. A large config space then costs far less than
timing every config fully, and the final decision is still made on full-length measurements. The
floor (heuristic and plain-path configs) is timed first and in full: it is what every other
candidate must beat, and it always stays in the ranking, so the winner is never slower than the
floor.
"""

from __future__ import annotations

import functools
import math
import time
from typing import Any

from ejlabel.config.cache import AutotunePolicy
from ejlabel.execution.tuning.candidates import DEADLINE_TIMING, Job
from ejlabel.execution.tuning.measure import Progress, Timing, timed_runs

__all__ = ["race"]

_CLEAR_LOSS = 1.5  # a candidate this many times slower than the best is dropped at once
# A candidate in the slower half stays while its median is within this fraction of the best:
# after a few noisy runs it may still be the fastest, and more runs tell.
_TOO_CLOSE_TO_DROP = 0.03


def race(
    job: Job,
    alive: list[int],
    rotation: tuple[tuple[Any, ...], ...],
    progress: Progress,
    measure_start: float,
    policy: AutotunePolicy,
) -> int | None:
    """Successive halving over the correct candidates; returns the winner's index.

    Round one times every survivor ``num_iters // 8`` times (at least 2); each round drops
    the slower half (except candidates within 3% of the best median) and anything over
    ``_CLEAR_LOSS`` times the best median, and doubles the runs. Samples accumulate across
    rounds, so no measurement is wasted, and the last two candidates are topped up to
    ``num_iters`` samples each before the final ranking; a candidate an earlier round timed
    keeps its samples and is timed only up to the count a round asks. Once compile and timing seconds reach
    the budget, candidates not yet timed are skipped (never the floor, which is
    timed first and in full) and every timing so far ranks. The caller's deadline
    (``job.deadline``) skips them the same way.
    """
    if not alive:
        return None
    # A candidate an earlier round of the same job timed starts from its samples.
    samples: dict[int, list[float]] = {i: list(job.candidates[i].timing.samples_ms) if job.candidates[i].timing is not None else [] for i in alive}
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
        timed_runs(run, max(1, policy.num_warmup) if not samples[i] else 1)  # warm-up / re-warm caches
        samples[i].extend(t / per_sample for t in timed_runs(run, count))
        job.candidates[i].timing = Timing(samples[i])

    def drop(i: int, status: str, reason: str) -> None:
        job.candidates[i].status, job.candidates[i].reason = status, reason
        alive.remove(i)
        progress.advance()

    def skip(i: int) -> None:
        if time.perf_counter() > job.deadline:
            job.cut = True
            drop(i, "skipped", DEADLINE_TIMING)
        else:
            drop(i, "skipped", "time budget spent before it was timed")

    # The floor is timed first and in full: it is what every other candidate must beat.
    for i in alive:
        if job.candidates[i].floor and len(samples[i]) < policy.num_iters:
            measure(i, policy.num_iters - len(samples[i]))
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
