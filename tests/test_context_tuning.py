"""Tuning in context on the CPU, with toy kernels whose implementations differ in cost by design.

``ctxslow``'s alternative to XLA runs a busy loop first; ``ctxfast``'s XLA path runs it (redundant
work) and its alternative does not. The loop is 400 steps of a 128x128 matmul, tens of times
the cost of a whole toy step without it, so which program is faster is fixed by construction;
the tests assert nothing else about time.

The noise rule is tested as a pure function on synthetic paired samples, and the time budget with
a fake clock (the real one plus an offset that a test moves forward at chosen events): no test
depends on how fast this machine is.
"""

from __future__ import annotations

import dataclasses
import fractions
import math
import random
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from jax import lax

import ejlabel
from ejlabel import AutotunePolicy, Invocation, Kernel, labels_to_configs
from ejlabel.execution import tuning
from ejlabel.execution.tuning import PROVENANCE, Autotuner, CallPick, ContextTuneReport, TuningCut, tune_in_context
from ejlabel.execution.tuning.paired import _bound_rank, _decide, _runs_per_sample, compare
from ejlabel.execution.tuning.search import Search
from tuning_clock import FakeClock, clock  # noqa: F401 (a fixture)

FAST = AutotunePolicy(num_warmup=1, num_iters=5, compile_workers=2)
X = jax.ShapeDtypeStruct((128, 128), jnp.float32)


@dataclasses.dataclass(frozen=True)
class ImplConfig:
    impl: str = "xla"


class CostKernel(Kernel[ImplConfig, jax.Array]):
    """``2 * x`` by the implementation the config names; ``slow_impl`` does redundant work first."""

    def __init__(self, name: str, alternative: str, slow_impl: str) -> None:
        super().__init__(name)
        self.alternative, self.slow_impl = alternative, slow_impl

    def run(self, x: jax.Array, *, cfg: ImplConfig) -> jax.Array:
        y = 2.0 * x
        if cfg.impl == self.slow_impl:
            # Depends on the loop index, so XLA cannot hoist or drop it; adds exactly zero.
            busy = lax.fori_loop(0, 400, lambda i, acc: acc + jnp.tanh(x.T @ x + i).sum() * 0.0, jnp.zeros((), x.dtype))
            y = y + busy
        return y

    def reference(self, x: jax.Array) -> jax.Array:
        return 2.0 * x

    def heuristic_cfg(self, inv: Invocation) -> ImplConfig:
        return ImplConfig("xla")

    def config_space(self, inv: Invocation) -> list[ImplConfig]:
        return [ImplConfig("xla"), ImplConfig(self.alternative)]


class TwoAlternatives(CostKernel):
    """Like ``ctxfast``, with a second fast alternative: a ranking can be cut between them."""

    def config_space(self, inv: Invocation) -> list[ImplConfig]:
        return [ImplConfig("xla"), ImplConfig("direct"), ImplConfig("other")]


slow_alternative = CostKernel("ctxslow", "loop", slow_impl="loop")
fast_alternative = CostKernel("ctxfast", "direct", slow_impl="xla")
two_alternatives = TwoAlternatives("ctxtwo", "direct", slow_impl="xla")


def slow_step(x: jax.Array) -> jax.Array:
    return slow_alternative(x).sum()


def fast_step(x: jax.Array) -> jax.Array:
    return fast_alternative(x).sum() + fast_alternative(x * 3.0).sum()  # one call, two sites


def both_step(x: jax.Array) -> jax.Array:
    return slow_alternative(x).sum() + fast_alternative(x).sum()


def fast_first_step(x: jax.Array) -> jax.Array:
    return fast_alternative(x).sum() + slow_alternative(x).sum()


def tune(fn, *args, **kwargs) -> ContextTuneReport:
    options = {"policy": FAST, "samples": 6, "warmup": 1, "progress": False, "verbose": False}
    return tune_in_context(fn, *args, **{**options, **kwargs})


def stored(op: str):
    (entry,) = stored_entries(op)
    return entry


def stored_entries(op: str) -> list:
    persistent = ejlabel.get_default_executor().selector.persistent
    return [e for e in persistent.entries() if e.op_id == f"{op}@v1"]


def assert_never_slower_than_floor(report: ContextTuneReport) -> None:
    # By construction: the tuned program either is the floor or the noise rule accepted it
    # against the floor (its lower bound on the gain is over the threshold).
    if report.tuned is not report.floor:
        final = report.final
        assert final is not None and final.verdict == "accept" and final.lower_ms > final.threshold_ms >= 0
    assert report.tuned.median_ms <= report.floor.median_ms + report.noise_ms


def jump_after(monkeypatch, owner, name: str, clock: FakeClock, seconds: float, after: int = 1) -> None:
    """Move ``clock`` forward by ``seconds`` once ``owner.name`` has returned ``after`` times."""
    original = getattr(owner, name)
    returned = []

    def wrapped(*args, **kwargs):
        try:
            return original(*args, **kwargs)
        finally:
            returned.append(1)
            if len(returned) == after:
                clock.offset += seconds

    monkeypatch.setattr(owner, name, wrapped)


def test_floor_is_kept_when_nothing_wins():
    report = tune(slow_step, X, skip_slower_in_isolation=False)  # confirm the loser anyway
    (call,) = report.calls
    assert call.cfg == ImplConfig("xla") and not call.changed and call.sites == 1
    (trial,) = report.trials
    assert trial.cfg == ImplConfig("loop") and trial.status == "rejected"
    assert report.changed == [] and not report.reverted and report.tuned is report.floor
    assert_never_slower_than_floor(report)
    entry = stored("ctxslow")
    assert entry.config == ImplConfig("xla") and entry.provenance == PROVENANCE
    assert entry.stats["floor_step_ms"] > 0 and entry.stats["candidate_step_ms"] > entry.stats["incumbent_step_ms"]
    assert "[XLA stays]" in report.render() and "rejected" in report.render()


def test_slower_in_isolation_is_not_confirmed_by_default():
    report = tune(slow_step, X)
    assert report.trials == [] and report.calls[0].cfg == ImplConfig("xla")
    assert stored("ctxslow").provenance == PROVENANCE


def test_clearly_faster_candidate_is_picked_and_stored_with_step_times():
    with ejlabel.use_implementation("xla"):  # the caller's forcing must not leak into the search
        report = tune(fast_step, X, baseline_fn=lambda x: (2.0 * x).sum() + (6.0 * x).sum())
    (call,) = report.calls
    assert call.sites == 2 and call.floor_cfg == ImplConfig("xla")
    assert call.cfg == ImplConfig("direct") and call.changed
    assert call.isolated_ms < call.floor_isolated_ms
    (trial,) = report.trials
    assert trial.status == "accepted" and trial.expected_gain_ms > 0
    assert trial.comparison.rounds >= 6 and trial.comparison.lower_ms > trial.comparison.threshold_ms > 0
    assert report.tuned.median_ms < report.floor.median_ms and report.baseline is not None
    assert report.final.verdict == "accept" and report.samples == report.final.rounds >= 12
    assert_never_slower_than_floor(report)

    entry = stored("ctxfast")
    assert entry.config == ImplConfig("direct") and entry.provenance == PROVENANCE
    stats = entry.stats
    assert {"step_ms", "floor_step_ms", "incumbent_step_ms", "samples", "noise_ms"} <= set(stats)
    assert stats["step_ms"] < stats["floor_step_ms"] and stats["samples"] == report.samples
    assert stats["candidate_step_ms"] < stats["incumbent_step_ms"]
    assert stats["comparison"]["verdict"] == "accept" and stats["comparison"]["rounds"] == trial.comparison.rounds
    assert stats["final"]["rounds"] == report.samples and stats["final"]["level"] == 0.95
    assert stats["ranking_cut"] is False

    # A fresh executor serves the pick from the persistent cache.
    ejlabel.set_default_executor(None)
    selector = ejlabel.get_default_executor().selector
    (pair,) = labels_to_configs(jax.jit(lambda x: fast_alternative(x)).lower(X), selector)
    assert pair.cfg == ImplConfig("direct") and pair.provenance == "persistent"
    text = report.render()
    assert "plain JAX (baseline)" in text and "all-XLA (floor)" in text and "accepted" in text
    assert f"{trial.comparison.rounds} rounds" in text and "95% bounds" in text


def test_one_call_changes_the_other_keeps_xla():
    # min_gain 0: ctxslow's share of the step (2 * x beside a busy loop) is far below 1%, and
    # would not be ranked otherwise (test_context_ranking).
    report = tune(both_step, X, skip_slower_in_isolation=False, min_gain=0.0)
    picks = {call.op_id: call.cfg for call in report.calls}
    assert picks == {"ctxslow@v1": ImplConfig("xla"), "ctxfast@v1": ImplConfig("direct")}
    assert {t.op_id: t.status for t in report.trials} == {"ctxfast@v1": "accepted", "ctxslow@v1": "rejected"}
    assert report.trials[0].op_id == "ctxfast@v1"  # the larger expected gain is confirmed first
    assert {stored(op).provenance for op in ("ctxslow", "ctxfast")} == {PROVENANCE}
    assert_never_slower_than_floor(report)


def test_confirmations_out_of_budget_are_skipped_and_the_floor_stored(monkeypatch):
    monkeypatch.setattr(Search, "_fits", lambda self, seconds: False)  # no time for any confirmation
    report = tune(both_step, X, skip_slower_in_isolation=False, min_gain=0.0)
    assert {t.status for t in report.trials} == {"skipped"} and len(report.skipped) == 2
    assert all(t.cfg is not None for t in report.trials)  # planned confirmations, not cut rankings
    assert all(not call.changed for call in report.calls) and report.tuned is report.floor
    assert "2 skipped (time budget)" in report.summary() and "time budget spent" in report.render()
    assert stored("ctxfast").config == ImplConfig("xla")  # unconfirmed: the floor is stored
    assert all(call.isolated_from == "measured" for call in report.calls)
    assert all(call.left == "time budget: 1 planned confirmations not run" for call in report.calls)
    assert all(entry.stats["decided"] is False for op in ("ctxslow", "ctxfast") for entry in stored_entries(op))
    # A second run recalls the stored picks as they are, however far the budget let the first go.
    again = tune(both_step, X, min_gain=0.0)
    assert all(call.isolated_from == "recalled" and not call.changed for call in again.calls) and again.trials == []
    assert again.recalled_cut == 2 and "exhaustive=True" in again.summary()


def test_tiny_budget_cuts_the_ranking_before_it_starts(monkeypatch):
    compiles, measurements = [], []
    compile_step = Search.compile
    monkeypatch.setattr(Search, "compile", lambda self, configs: (compiles.append(configs), compile_step(self, configs))[1])
    monkeypatch.setattr(tuning.search, "compare", lambda *a, **k: (measurements.append(k["first"]), compare(*a, **k))[1])
    report = tune(both_step, X, budget_s=1e-3, skip_slower_in_isolation=False)
    # Only what always runs ran: the floor (compiled, timed once) and the final check.
    assert len(compiles) == 1 and measurements == [6, 12]
    assert all(call.isolated_from == "cut" and not call.changed for call in report.calls)
    assert all(row["status"] == "skipped" for call in report.calls for row in call.candidates)  # nothing compiled
    assert len(report.skipped) == 2 and all(t.cfg is None and "isolated ranking" in t.reason for t in report.skipped)
    assert report.tuned is report.floor and report.final is None
    assert "2 skipped (time budget, ranking cut for 2)" in report.summary() and "(not ranked)" in report.render()
    # Stored undecided, the floor as their pick: the next run recalls it instead of ranking again.
    assert all(stored(op).config == ImplConfig("xla") and stored(op).stats["decided"] is False for op in ("ctxfast", "ctxslow"))
    assert all(stored(op).stats["ranking_cut"] is True for op in ("ctxfast", "ctxslow"))


def fast_two_step(x: jax.Array) -> jax.Array:
    return fast_alternative(x).sum() + fast_alternative(x * 3.0).sum() + two_alternatives(x).sum()


def test_ranking_deadline_leaves_the_confirmations_their_share(monkeypatch, clock):
    deadlines = []
    tune_jobs = Autotuner.tune_jobs
    monkeypatch.setattr(Autotuner, "tune_jobs", lambda self, *a, **k: (deadlines.append(k["deadline"]), tune_jobs(self, *a, **k))[1])
    # The shares take two measurements (one per call); ranking ctxfast (two sites: the larger
    # share, ranked first) then takes 60% of the budget on the fake clock: ctxtwo's ranking is
    # cut, ctxfast is confirmed.
    jump_after(monkeypatch, Autotuner, "_measure", clock, 600.0, after=3)
    began = clock.perf_counter()
    report = tune(fast_two_step, X, budget_s=1000.0)
    shares_deadline, rest_deadline = deadlines  # no prior round: neither kernel declares a prior
    assert 480 <= shares_deadline - began <= 530  # half of the time left once the floor was timed
    assert 480 <= rest_deadline - began <= 530
    fast, two = report.calls
    assert report.ranked == [fast.key, two.key] and fast.share > two.share > 0.01
    assert fast.isolated_from == "measured" and fast.cfg == ImplConfig("direct")
    assert two.isolated_from == "cut" and two.cfg == two.floor_cfg == ImplConfig("xla")
    assert [(t.op_id, t.status) for t in report.trials] == [("ctxfast@v1", "accepted"), ("ctxtwo@v1", "skipped")]
    assert "ranking cut for 1" in report.summary() and "[ranking cut: time budget]" in report.render()
    assert report.left == [two] and two.left == "time budget: 2 of 3 candidates not ranked"
    assert "left untried" in report.render()
    assert stored("ctxfast").config == ImplConfig("direct") and stored("ctxtwo").config == ImplConfig("xla")
    assert stored("ctxtwo").stats["ranking_cut"] is True and stored("ctxtwo").stats["decided"] is False
    # The next run recalls both picks as they are, the cut one included, and says so.
    clock.offset = 0.0
    again = tune(fast_two_step, X, budget_s=None)
    assert [call.isolated_from for call in again.calls] == ["recalled", "recalled"] and again.recalled_cut == 1
    assert [call.cfg for call in again.calls] == [ImplConfig("direct"), ImplConfig("xla")]
    # exhaustive=True tunes the cut one further.
    full = tune(fast_two_step, X, budget_s=None, exhaustive=True)
    assert [call.isolated_from for call in full.calls] == ["measured", "measured"]
    assert full.calls[1].cfg in (ImplConfig("direct"), ImplConfig("other"))


def test_report_says_where_the_time_went(monkeypatch, clock):
    # Timing the floor alone (the share) takes 40 s and one confirmation 70 s on the fake
    # clock: the report's stages say so, in order, and add up to the run's wall time.
    jump_after(monkeypatch, Autotuner, "_measure", clock, 40.0)
    jump_after(monkeypatch, Search, "_try", clock, 70.0)
    report = tune(fast_step, X, budget_s=None)
    stages = report.stages_s
    assert list(stages) == ["calls and floor", "priors in the step", "shares of the step", "isolated ranking", "confirmations", "final check", "storing"]
    assert 40.0 <= stages["shares of the step"] < 70.0 <= stages["confirmations"] < 110.0
    assert sum(stages.values()) == pytest.approx(report.wall_s, abs=0.5)
    assert "time: calls and floor" in report.render() and "shares of the step 4" in report.render()


def test_measured_candidates_of_a_cut_ranking_still_rank_but_are_not_reused(monkeypatch, clock):
    # timed_runs runs twice per timed candidate (warm-up, timing): jump once the floor and one
    # alternative were timed, past the ranking's deadline but not the run's.
    jump_after(monkeypatch, tuning.halving, "timed_runs", clock, 600.0, after=4)
    report = tune(lambda x: two_alternatives(x).sum(), X, budget_s=1000.0, policy=dataclasses.replace(FAST, compile_workers=1))
    (call,) = report.calls
    statuses = {row["cfg"]: row["status"] for row in call.candidates}
    assert call.isolated_from == "partial" and statuses[ImplConfig("xla")] == "ok"
    assert "ranking cut for 1" in report.summary() and "[ranking cut short: time budget]" in report.render()
    assert sorted(statuses[cfg] for cfg in (ImplConfig("direct"), ImplConfig("other"))) == ["ok", "skipped"]
    (timed,) = [cfg for cfg, status in statuses.items() if status == "ok" and cfg != ImplConfig("xla")]
    (trial,) = report.trials
    assert trial.cfg == timed and trial.status == "accepted" and call.cfg == timed  # what was timed ranks
    entry = stored("ctxtwo")
    assert entry.config == timed and entry.stats["ranking_cut"] is True
    clock.offset = 0.0
    again = tune(lambda x: two_alternatives(x).sum(), X, budget_s=None)
    assert again.calls[0].isolated_from == "recalled" and again.calls[0].cfg == timed  # recalled as it is
    full = tune(lambda x: two_alternatives(x).sum(), X, budget_s=None, exhaustive=True)
    assert full.calls[0].isolated_from == "measured"  # exhaustive=True ranks it fully


def test_tune_each_with_a_passed_deadline_compiles_and_times_nothing():
    inv = Invocation(fast_alternative, (jnp.ones(X.shape, X.dtype),), {})
    (outcome,) = Autotuner(FAST, progress=False).tune_each([inv], deadline=time.perf_counter() - 1.0)
    assert isinstance(outcome, TuningCut)
    assert [c.status for c in outcome.candidates] == ["skipped", "skipped"]
    assert all(c.compile_s is None and c.reason.startswith("deadline") for c in outcome.candidates)


# ---------------------------------------------------------------------------- the noise rule


def paired(incumbent: float, challenger: float, rounds: int, noise: float, drift: float = 0.0, seed: int = 0):
    """Synthetic paired samples: a drift shared by both programs of a round, plus own noise."""
    rng = np.random.default_rng(seed)
    shared = drift * rng.standard_normal(rounds)
    return (list(incumbent + shared + noise * rng.standard_normal(rounds)), list(challenger + shared + noise * rng.standard_normal(rounds)))


def test_rule_accepts_a_gain_the_spread_of_single_samples_hides():
    # The GPU case: a 2.2% faster step (32.84 vs 33.57 ms) with a per-sample IQR of about 1.2 ms,
    # mostly drift both programs share. Pairing cancels the drift.
    incumbent, challenger = paired(33.57, 32.84, rounds=10, noise=0.15, drift=1.0, seed=2)
    iqr = [np.subtract(*np.percentile(x, [75, 25])) for x in (incumbent, challenger)]
    assert iqr[0] > 1.1 and np.mean(iqr) > np.median(incumbent) - np.median(challenger)  # the old rule rejected it
    verdict = _decide(incumbent, challenger, min_gain=0.01, cap=40)
    assert verdict.verdict == "accept" and verdict.rounds == 10
    assert verdict.lower_ms > verdict.threshold_ms == pytest.approx(0.01 * np.median(incumbent))
    assert verdict.gain_ms == pytest.approx(0.73, abs=0.2)


def test_rule_accepts_a_consistent_three_percent_gain_over_noise():
    incumbent, challenger = paired(100.0, 97.0, rounds=20, noise=1.0)
    assert _decide(incumbent, challenger, min_gain=0.01, cap=40).verdict == "accept"


def test_rule_rejects_equal_programs_and_a_gain_below_min_gain():
    incumbent, challenger = paired(100.0, 100.0, rounds=40, noise=0.2)
    same = _decide(incumbent, challenger, min_gain=0.01, cap=40)
    assert same.verdict == "reject" and same.upper_ms < same.threshold_ms
    incumbent, challenger = paired(100.0, 99.7, rounds=40, noise=0.05)  # a real but 0.3% gain
    small = _decide(incumbent, challenger, min_gain=0.01, cap=40)
    assert small.verdict == "reject" and small.lower_ms > 0 and "no worthwhile gain" in small.why


def test_rule_asks_for_more_rounds_when_unclear_and_rejects_at_the_cap():
    incumbent, challenger = paired(100.0, 98.5, rounds=10, noise=2.0, seed=3)
    unclear = _decide(incumbent, challenger, min_gain=0.01, cap=40)
    assert unclear.verdict == "more" and unclear.lower_ms < unclear.threshold_ms < unclear.upper_ms
    at_cap = _decide(incumbent, challenger, min_gain=0.01, cap=10)
    assert at_cap.verdict == "reject" and "cap" in at_cap.why
    # Four rounds bound nothing at 95% (the smallest of four is below the median with p = 1/16).
    few = _decide([10.0] * 4, [1.0] * 4, min_gain=0.01, cap=40)
    assert few.verdict == "more" and few.lower_ms == -np.inf


@given(st.integers(1, 400))
@settings(max_examples=60, deadline=None)
def test_bound_rank_is_the_sign_test_order_statistic(n):
    def below(k: int) -> fractions.Fraction:  # P(Binomial(n, 1/2) <= k - 1), exactly
        return fractions.Fraction(sum(math.comb(n, j) for j in range(k)), 2**n)

    k = _bound_rank(n)
    assert below(k) <= fractions.Fraction(1, 20) < below(k + 1)
    assert {10: 2, 20: 6, 40: 15}.get(n, k) == k


samples_ms = st.lists(st.tuples(st.integers(50, 150), st.integers(50, 150)), min_size=1, max_size=50)
ORDER = {"reject": 0, "more": 1, "accept": 2}


@given(samples_ms, st.integers(0, 30), st.sampled_from([0.0, 0.01, 0.05]))
@settings(max_examples=200, deadline=None)
def test_rule_is_monotone_in_the_gain(pairs, extra, min_gain):
    incumbent = [float(i) for i, _ in pairs]
    challenger = [float(c) for _, c in pairs]
    faster = [c - extra for c in challenger]  # every paired difference grows by `extra`
    before = _decide(incumbent, challenger, min_gain, cap=100).verdict
    after = _decide(incumbent, faster, min_gain, cap=100).verdict
    assert ORDER[after] >= ORDER[before]


@given(samples_ms, st.randoms(use_true_random=False))
@settings(max_examples=100, deadline=None)
def test_rule_depends_on_the_pairs_not_their_order(pairs, rng: random.Random):
    shuffled = list(pairs)
    rng.shuffle(shuffled)
    verdicts = [_decide([float(i) for i, _ in p], [float(c) for _, c in p], 0.01, cap=30) for p in (pairs, shuffled)]
    assert verdicts[0] == verdicts[1]


# ---------------------------------------------------------------------------- paired rounds


def test_runs_per_sample_make_a_sample_last_long_enough():
    assert _runs_per_sample(33.6) == 1 and _runs_per_sample(20.0) == 1
    assert _runs_per_sample(5.0) == 4 and _runs_per_sample(0.3) == 67
    assert _runs_per_sample(0.0) == tuning.paired.MAX_RUNS_PER_SAMPLE


def test_undecided_comparison_takes_more_blocks_up_to_the_cap_while_the_budget_allows(monkeypatch):
    monkeypatch.setattr(tuning.paired, "MIN_SAMPLE_MS", 0.0)  # one run per sample
    order: list[str] = []
    programs = [lambda: order.append("I"), lambda: order.append("C")]
    looks: list[int] = []

    def undecided(incumbent, challenger, min_gain, cap):
        looks.append(len(incumbent))
        return dataclasses.replace(_decide([1.0] * len(incumbent), [1.0] * len(incumbent), 0.0, cap), verdict="more" if len(incumbent) < cap else "reject")

    monkeypatch.setattr(tuning.paired, "_decide", undecided)
    options = {"first": 4, "block": 3, "cap": 12, "warmup": 1, "min_gain": 0.01}
    timings, verdict = compare(programs, (), fits=lambda seconds: True, **options)
    assert looks == [4, 7, 10, 12] and verdict.rounds == 12 and verdict.verdict == "reject"
    assert [t.count for t in timings] == [12, 12]
    rounds = ["".join(order[2 + 2 * r: 4 + 2 * r]) for r in range(12)]  # after one warm-up run each
    assert rounds == ["IC", "CI"] * 6  # the order keeps alternating across blocks
    looks.clear()
    _, verdict = compare(programs, (), fits=lambda seconds: False, **options)
    assert looks == [4] and verdict.verdict == "reject" and "no time left" in verdict.why


def test_inner_jit_traced_before_is_retraced(monkeypatch):
    clears = []
    clear_caches = jax.clear_caches
    monkeypatch.setattr(jax, "clear_caches", lambda: (clears.append(1), clear_caches()))
    inner = jax.jit(lambda x: fast_alternative(x))
    inner(jnp.ones(X.shape, X.dtype))  # traced now, under the default selection: JAX caches it
    report = tune(lambda x: inner(x).sum(), X)
    assert clears  # the stale trace was noticed and redone
    assert report.calls[0].cfg == ImplConfig("direct") and report.trials[0].status == "accepted"


def test_step_without_kernel_calls():
    report = tune(lambda x: (x * 2).sum(), X)
    assert report.calls == [] and report.trials == [] and report.tuned is report.floor


@pytest.mark.parametrize(
    ("kwargs", "error"),
    [({"samples": 1}, "samples"), ({"budget_s": 0}, "budget_s"), ({"min_gain": 1.5}, "min_gain"), ({"candidates_per_call": 0}, "candidates_per_call")],
)
def test_bad_arguments_are_named(kwargs, error):
    with pytest.raises(ValueError, match=error):
        tune_in_context(fast_step, X, **kwargs)


def test_fn_must_be_callable():
    with pytest.raises(TypeError, match="fn"):
        tune_in_context("fast_step", X)


def test_plan_tries_every_calls_best_candidate_before_any_runner_up():
    """A call with many sites has runners-up whose expected gain (from the floor) beats other
    calls' best candidates; they still come after every call's best."""
    many = ("cpu", "attention@v1", "a")
    one = ("cpu", "loss@v1", "b")
    calls = {
        many: CallPick(*many, sites=12, floor_cfg="xla", cfg="xla", floor_isolated_ms=1.0),
        one: CallPick(*one, sites=1, floor_cfg="xla", cfg="xla", floor_isolated_ms=6.0),
    }
    isolated = {many: {"xla": 1.0, "fast": 0.3, "second": 0.4, "third": 0.5}, one: {"xla": 6.0, "fused": 5.3, "other": 5.9}}
    trials = tuning.ranking.plan(calls, isolated, per_call=3, skip_slower=True, tried={})
    assert [t.cfg for t in trials] == ["fast", "fused", "second", "other", "third"]
    assert trials[1].expected_gain_ms < trials[2].expected_gain_ms  # the order is not by gain alone
    # A later round plans only what earlier rounds did not, up to per_call over the run.
    later = tuning.ranking.plan(calls, isolated, per_call=3, skip_slower=True, tried={many: {"fast", "second"}, one: {"fused", "other"}})
    assert [t.cfg for t in later] == ["third"]
