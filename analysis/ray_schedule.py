"""The order in which a Ray run's calls go to its workers, and when a call is split.

Workers stay busy when no long call starts last and no worker idles while another still has a
long call ahead of it. :class:`Schedule` does both, from each call's plan (its candidates and
their estimated costs, :meth:`~ejlabel.execution.tuning.remote.TuningWorker.plan`):

* **Cost of a call.** Tuning a call is mostly compiling its candidates, and compile time grows
  with the size of the program a candidate compiles to, far more than with the sizes of its
  arguments: at the shapes calls are tuned at, the timed runs are short next to the compiles.
  So a candidate's cost is the number of operations its program traces to (nested programs
  included: a Pallas kernel's body, a custom VJP's backward), and a part of a call (some of its
  candidates, one task) costs the sum over its candidates plus the first candidate's once more:
  each task makes its inputs and runs the reference, about the size of the call's first
  candidate, the plain path. Bytes or flops of the arguments order the calls of a small model
  wrongly: its attention calls hold fewer bytes than its matmuls yet take several times longer
  to tune (``bench/bench_ray_tuning.py --scaling`` gives the times per call).
* **Longest first.** Tasks wait sorted by cost, longest first, so the long ones start while
  short ones remain to fill the other workers around them.
* **Splitting.** A call that costs more than a worker's fair share (the total cost over the
  workers) is split from the start into parts that each fit the share, as far as its candidates
  allow; when the waiting tasks run out, so that workers would idle, the remaining ones are
  split further across the idle workers, the costliest first. A part is a set of the call's
  candidates, balanced by cost; the driver merges the parts' candidates and picks the winner
  as one worker would (:func:`~ejlabel.execution.tuning.remote.merge_parts`). Only calls whose
  kernel has a reference are split (a part without the call's first candidate would otherwise
  check its candidates against one of its own), and a call with one candidate cannot be. Under
  a per-call time budget (``AutotunePolicy.time_budget_s``) each part has the whole budget: a
  split call may time candidates that one worker would have skipped, never fewer.

Calls without a plan (one worker; a plan that failed; several calls per task) keep their order
and are never split; a call whose plan failed counts at the largest known cost (its tuning will
say why, and should not wait for the end to). Retries go to the front. Nothing here needs Ray.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterator, Mapping, Sequence

__all__ = ["Plan", "Schedule", "Task", "calls_per_task_for", "split_candidates"]

Key = tuple[str, str]


def calls_per_task_for(setting: int | str, calls: int, workers: int) -> int:
    """How many calls each task holds: ``setting`` when an int, else (``"auto"``) every call
    for a lone worker (one compile pool, as a local run: nothing to balance) and one call per
    task for several (scheduled longest first, split, streamed). ValueError names the setting."""
    if setting == "auto":
        return max(1, calls) if workers == 1 else 1
    if isinstance(setting, bool) or not isinstance(setting, int) or setting < 1:
        raise ValueError(f"calls_per_task: expected 'auto' or an int >= 1, got {setting!r}")
    return setting


@dataclasses.dataclass(frozen=True)
class Plan:
    """One call's candidates (config JSON text, in the tuner's order) and their costs."""

    candidates: tuple[str, ...]
    costs: tuple[float, ...]
    splittable: bool = True  # its kernel has a reference to check a part against

    def __post_init__(self) -> None:
        if not self.candidates or len(self.candidates) != len(self.costs) or any(not c > 0 for c in self.costs):
            raise ValueError("plan: expected as many positive costs as candidates, at least one")

    def cost(self, indices: Sequence[int] | None = None) -> float:
        """What tuning these candidates (all when None) in one task costs: their costs, and the
        first candidate's once more for the task's inputs and reference."""
        chosen = range(len(self.candidates)) if indices is None else indices
        return self.costs[0] + sum(self.costs[i] for i in chosen)


@dataclasses.dataclass(frozen=True)
class Task:
    """What one worker is sent: a call, whole (``part`` None) or a part of its candidates
    (indices into its plan's candidates, ascending)."""

    key: Key
    part: tuple[int, ...] | None
    cost: float


def split_candidates(plan: Plan, indices: Sequence[int], parts: int) -> list[tuple[int, ...]]:
    """``indices`` of ``plan`` split into ``parts`` sets of about equal cost (the costliest
    candidate first, each to the cheapest set so far); each set in candidate order."""
    parts = max(1, min(parts, len(indices)))
    bins: list[list[int]] = [[] for _ in range(parts)]
    loads = [0.0] * parts
    for i in sorted(indices, key=lambda i: (-plan.costs[i], i)):
        target = loads.index(min(loads))
        bins[target].append(i)
        loads[target] += plan.costs[i]
    return sorted(tuple(sorted(b)) for b in bins)


class Schedule:
    """The tasks waiting for a worker; :meth:`next_tasks` says what idle workers get now.

    Args:
      keys: the calls, in the order they were found.
      plans: each call's plan; a call missing from it (or None) is sent whole, in its place.
      workers: how many workers tune.
    """

    def __init__(self, keys: Sequence[Key], plans: Mapping[Key, Plan | None], workers: int) -> None:
        self.plans = {key: plans.get(key) for key in keys}
        known = [plan.cost() for plan in self.plans.values() if plan is not None]
        unknown_cost = max(known, default=1.0)
        share = sum(known) / max(1, workers) if known else math.inf
        waiting: list[Task] = []
        for key in keys:
            plan = self.plans[key]
            if plan is None:
                waiting.append(Task(key, None, unknown_cost))
                continue
            whole = tuple(range(len(plan.candidates)))
            waiting.extend(self._split_to_fit(key, plan, whole, share, workers))
        # Longest first; a stable sort keeps the found order between equal costs.
        self._waiting = sorted(waiting, key=lambda task: -task.cost)
        self._retries: list[Task] = []

    def _split_to_fit(self, key: Key, plan: Plan, whole: tuple[int, ...], share: float, workers: int) -> list[Task]:
        """The call whole when it fits a worker's share, else the fewest parts that each do."""
        if not plan.splittable or plan.cost() <= share or len(whole) < 2:
            return [Task(key, None, plan.cost())]
        best = [whole]
        for parts in range(2, min(len(whole), workers) + 1):
            best = split_candidates(plan, whole, parts)
            if max(plan.cost(p) for p in best) <= share:
                break
        return [self._task(key, plan, p) for p in best]

    @staticmethod
    def _task(key: Key, plan: Plan, part: tuple[int, ...]) -> Task:
        whole = len(part) == len(plan.candidates)
        return Task(key, None if whole else part, plan.cost(part))

    def __bool__(self) -> bool:
        return bool(self._waiting or self._retries)

    def __iter__(self) -> Iterator[Task]:
        return iter([*self._retries, *self._waiting])

    def retry(self, task: Task) -> None:
        """Send ``task`` again, before anything else."""
        self._retries.insert(0, task)

    def next_tasks(self, idle: int) -> list[Task]:
        """Up to ``idle`` tasks to send now: retries first, then the longest waiting ones.

        When fewer tasks wait than workers idle, the waiting ones are split across the idle
        workers first: each idle worker gets a part, the costliest tasks split most.
        """
        tasks = self._retries[:idle]
        del self._retries[: len(tasks)]
        free = idle - len(tasks)
        if free > len(self._waiting) and self._waiting:
            self._waiting = self._spread(self._waiting, free)
        taken = self._waiting[:free]
        del self._waiting[: len(taken)]
        return tasks + taken

    def pop_batch(self, size: int) -> list[Task]:
        """The next retry alone, else the next ``size`` waiting tasks (several calls per task)."""
        if self._retries:
            return [self._retries.pop(0)]
        batch = self._waiting[:size]
        del self._waiting[: len(batch)]
        return batch

    def drop(self, key: Key) -> None:
        """Forget the tasks of call ``key`` still waiting (it failed already)."""
        self._retries = [task for task in self._retries if task.key != key]
        self._waiting = [task for task in self._waiting if task.key != key]

    def _spread(self, waiting: list[Task], workers: int) -> list[Task]:
        """``waiting`` split into up to ``workers`` tasks, one more part at a time to the task
        whose parts would cost most, while it has candidates to split; longest first."""
        groups: list[tuple[Task, int]] = [(task, 1) for task in waiting]

        def candidates_of(task: Task) -> tuple[int, ...]:
            plan = self.plans[task.key]
            if plan is None or not plan.splittable:
                return ()
            return task.part if task.part is not None else tuple(range(len(plan.candidates)))

        while sum(parts for _, parts in groups) < workers:
            splittable = [(task.cost / parts, n) for n, (task, parts) in enumerate(groups) if parts < len(candidates_of(task))]
            if not splittable:
                break
            _, n = max(splittable)
            groups[n] = (groups[n][0], groups[n][1] + 1)
        spread: list[Task] = []
        for task, parts in groups:
            plan = self.plans[task.key]
            if parts == 1 or plan is None:
                spread.append(task)
            else:
                spread.extend(self._task(task.key, plan, p) for p in split_candidates(plan, candidates_of(task), parts))
        return sorted(spread, key=lambda task: -task.cost)
