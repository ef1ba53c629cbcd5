"""What tuning in context reports: each call's pick, each confirmation, and the step times.

A run's :class:`ContextTuneReport` holds the floor's, the tuned step's and the plain baseline's
times from one final measurement in paired rounds (so they compare directly), the final
judgement of the tuned step against the floor, one :class:`CallPick` per distinct kernel call
(what it ended up with and the times behind it) and one :class:`Trial` per confirmation (the
incumbent with that one call changed, timed as a whole step). It renders as text, and what it
holds for each call is what the persistent cache stores with the pick.

Calls are keyed like the caches, ``(device, op_id, call_key)`` (:data:`Key`); an assignment
maps each key to the config it runs with (:data:`Assignment`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from ejlabel.execution.tuning.measure import Timing
from ejlabel.execution.tuning.paired import Comparison

__all__ = ["Assignment", "CallPick", "ContextTuneReport", "Key", "Trial"]

Key = tuple[str, str, str]
Assignment = Mapping[Key, Any]


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
    was timed: the floor stays, nothing is stored), ``failed``, ``unranked`` (its share of the
    step was below ``min_gain``: not worth ranking) or ``recalled`` (an earlier run picked for
    this call: its pick was taken as it is, nothing ranked).

    ``share`` is the floor's isolated time x sites over the floor step's time (None: not
    measured); ``left`` says what the run left untried of this call and why (None: nothing);
    ``skipped_losers`` the candidates skipped because they lost at this shape class before,
    ``{cfg: (why, call key where it lost)}``.
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
    share: float | None = None
    left: str | None = None
    skipped_losers: dict[Any, tuple[str, str]] = dataclasses.field(default_factory=dict)

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
    ``tuned`` is the floor's timing. When an earlier run decided every pick and checked them
    together, nothing is measured (``measured`` False): the step times are that run's medians.
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
    ranked: list[Key] = dataclasses.field(default_factory=list)  # the calls ranked (or ranked from stored timings), largest share first
    measured: bool = True  # False: every pick recalled, the step times those of the run that checked them
    recalled_cut: int = 0  # recalled picks whose ranking the budget of the run that stored them cut

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
    def recalled(self) -> list[CallPick]:
        """Calls whose pick an earlier run decided: taken as it was, nothing ranked."""
        return [call for call in self.calls if call.isolated_from == "recalled"]

    @property
    def left(self) -> list[CallPick]:
        """Calls the run left (partly) untried, largest share first: what a bigger budget (or,
        for a share below ``min_gain``, nothing) could still try."""
        return sorted((call for call in self.calls if call.left), key=lambda call: -(call.share or 0.0))

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
        if self.calls and len(self.recalled) == len(self.calls):
            text += "; ranked nothing: every pick recalled from an earlier run"
        elif self.recalled:
            text += f"; {len(self.recalled)} picks recalled from an earlier run"
        if self.recalled_cut:
            text += (
                f"; {self.recalled_cut} of them cut by the earlier run's budget"
                " (exhaustive=True, CLI --exhaustive, tunes them further)"
            )
        return text + ("; the final check kept the floor" if self.reverted else "")

    def render(self) -> str:
        """The report as text: step times, then each call's pick, then each confirmation."""
        lines = [f"in-context tuning: {self.summary()}"]
        if self.stages_s:
            spent = ", ".join(f"{stage} {seconds:.1f} s" for stage, seconds in self.stages_s.items())
            lines.append(f"time: {spent} (compile work {self.compile_s:.1f} s, summed over threads)")
        if self.measured:
            lines.append(f"step time, median of {self.samples} paired rounds:")
        else:
            lines.append("step time, as the run that decided every pick measured it (nothing compiled or timed now; exhaustive=True measures again):")
        if self.baseline is not None:
            lines.append(f"  plain JAX (baseline)  {self.baseline.median_ms:10.4g} ms")
        lines.append(f"  all-XLA (floor)       {self.floor.median_ms:10.4g} ms")
        lines.append(f"  tuned                 {self.tuned.median_ms:10.4g} ms  ({self.speedup:.2f}x the floor)")
        if self.final is not None:
            kept = "" if self.final.accepted else ": the floor stays"
            lines.append(f"  tuned vs floor: {self.final.describe()}: {self.final.outcome()}{kept}")
        lines.append("")
        width = max([len("call"), *(len(f"{call.op_id}:{call.call_key}") for call in self.calls)])
        lines.append(f"{'call':{width}} {'sites':>5}  {'share':>6}  {'isolated ms':>11}  {'XLA iso ms':>10}  {'step ms':>9}  pick")
        for call in self.calls:
            note = f" (beat {call.compared_to_ms:.4g} ms)" if call.changed and call.compared_to_ms is not None else ""
            cut = {
                "partial": "  [ranking cut short: time budget]", "cut": "  [ranking cut: time budget]",
                "recalled": "  [recalled: decided by an earlier run]", "unranked": "  [not ranked: share below min_gain]",
            }.get(call.isolated_from, "")
            lines.append(
                f"{call.op_id + ':' + call.call_key:{width}} {call.sites:>5}  {_share(call.share):>6}  {_ms(call.isolated_ms):>11}  "
                f"{_ms(call.floor_isolated_ms):>10}  {_ms(call.step_ms):>9}  {call.cfg!r}{note}"
                + ("" if call.changed else "  [XLA stays]") + cut
            )
        if self.ranked:
            order = ", ".join(f"{key[1]}:{key[2][:8]}" for key in self.ranked)
            lines.append(f"ranked by share of the step, largest first: {order}")
        elif self.calls and len(self.recalled) == len(self.calls):
            lines.append("ranked nothing: every call's pick was recalled from an earlier run (exhaustive=True measures again)")
        losers = sum(len(call.skipped_losers) for call in self.calls)
        if losers:
            lines.append(f"skipped {losers} candidates that lost at the same shape class before (exhaustive=True tries them)")
        if self.left:
            lines.append("")
            lines.append("left untried (share of the floor step: what each could at most save):")
            for call in self.left:
                lines.append(f"  {call.op_id}:{call.call_key} {_share(call.share):>6}  {call.left}")
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


def _share(value: float | None) -> str:
    return "-" if value is None else f"{100 * value:.1f}%"


def _candidate(trial: Trial) -> str:
    if trial.cfg is None:
        return "(not ranked)"
    if trial.isolated_ms is None:
        return f"{trial.cfg!r}, the kernel's prior (not ranked alone)"
    return f"{trial.cfg!r}, isolated {_ms(trial.isolated_ms)} ms"


def _verdict(trial: Trial) -> str:
    if trial.status in ("accepted", "rejected") and trial.candidate is not None and trial.incumbent is not None:
        step = f"step {trial.candidate.median_ms:.4g} ms vs incumbent {trial.incumbent.median_ms:.4g} ms"
        if trial.comparison is None:
            return f"{step}: {trial.status}"
        return f"{step}; {trial.comparison.describe()}: {trial.comparison.outcome()}"
    return f"{trial.status} ({trial.reason})"
