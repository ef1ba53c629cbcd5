"""Tuning in context on the CPU, with toy kernels whose implementations differ in cost by design.

``ctxslow``'s alternative to XLA runs a busy loop first; ``ctxfast``'s XLA path runs it (redundant
work) and its alternative does not. The loop is 400 steps of a 128x128 matmul, tens of times
the cost of a whole toy step without it, so which program is faster is fixed by construction;
the tests assert nothing else about time.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import pytest
from jax import lax

import ejlabel
from ejlabel import AutotunePolicy, Invocation, Kernel, labels_to_configs
from ejlabel.execution.context_tuning import (
    PROVENANCE,
    ContextTuneReport,
    tune_in_context,
)

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


slow_alternative = CostKernel("ctxslow", "loop", slow_impl="loop")
fast_alternative = CostKernel("ctxfast", "direct", slow_impl="xla")


def slow_step(x: jax.Array) -> jax.Array:
    return slow_alternative(x).sum()


def fast_step(x: jax.Array) -> jax.Array:
    return fast_alternative(x).sum() + fast_alternative(x * 3.0).sum()  # one call, two sites


def both_step(x: jax.Array) -> jax.Array:
    return slow_alternative(x).sum() + fast_alternative(x).sum()


def tune(fn, *args, **kwargs) -> ContextTuneReport:
    options = {"policy": FAST, "samples": 6, "warmup": 1, "progress": False, "verbose": False}
    return tune_in_context(fn, *args, **{**options, **kwargs})


def stored(op: str):
    persistent = ejlabel.get_default_executor().selector.persistent
    (entry,) = [e for e in persistent.entries() if e.op_id == f"{op}@v1"]
    return entry


def assert_never_slower_than_floor(report: ContextTuneReport) -> None:
    # By construction: the tuned program either is the floor or beat it by more than the noise.
    assert report.tuned.median_ms <= report.floor.median_ms + report.noise_ms


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
    assert report.tuned.median_ms < report.floor.median_ms and report.baseline is not None
    assert_never_slower_than_floor(report)

    entry = stored("ctxfast")
    assert entry.config == ImplConfig("direct") and entry.provenance == PROVENANCE
    stats = entry.stats
    assert {"step_ms", "floor_step_ms", "incumbent_step_ms", "samples", "noise_ms"} <= set(stats)
    assert stats["step_ms"] < stats["floor_step_ms"] and stats["samples"] == report.samples
    assert stats["candidate_step_ms"] < stats["incumbent_step_ms"]

    # A fresh executor serves the pick from the persistent cache.
    ejlabel.set_default_executor(None)
    selector = ejlabel.get_default_executor().selector
    (pair,) = labels_to_configs(jax.jit(lambda x: fast_alternative(x)).lower(X), selector)
    assert pair.cfg == ImplConfig("direct") and pair.provenance == "persistent"
    text = report.render()
    assert "plain JAX (baseline)" in text and "all-XLA (floor)" in text and "accepted" in text


def test_one_call_changes_the_other_keeps_xla():
    report = tune(both_step, X, skip_slower_in_isolation=False)
    picks = {call.op_id: call.cfg for call in report.calls}
    assert picks == {"ctxslow@v1": ImplConfig("xla"), "ctxfast@v1": ImplConfig("direct")}
    assert {t.op_id: t.status for t in report.trials} == {"ctxfast@v1": "accepted", "ctxslow@v1": "rejected"}
    assert report.trials[0].op_id == "ctxfast@v1"  # the larger expected gain is confirmed first
    assert {stored(op).provenance for op in ("ctxslow", "ctxfast")} == {PROVENANCE}
    assert_never_slower_than_floor(report)


def test_budget_stops_the_search_and_says_what_was_skipped():
    report = tune(both_step, X, budget_s=1e-3, skip_slower_in_isolation=False)
    assert {t.status for t in report.trials} == {"skipped"} and len(report.skipped) == 2
    assert all(not call.changed for call in report.calls) and report.tuned is report.floor
    assert "2 skipped (time budget)" in report.summary() and "time budget spent" in report.render()
    assert stored("ctxfast").config == ImplConfig("xla")  # unconfirmed: the floor is stored
    assert all(call.isolated_from == "measured" for call in report.calls)
    # A second run reuses the isolated timings the first one stored.
    again = tune(both_step, X, budget_s=1e-3)
    assert all(call.isolated_from == "cache" for call in again.calls)
    assert [t.cfg for t in again.trials] == [ImplConfig("direct")]  # the slower one is not planned


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
