"""Autotuning with real timing on the CPU: ahead-of-time compiles, checks, early stopping."""

from __future__ import annotations

import dataclasses
import gc
import weakref

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import ejlabel
from ejlabel import (
    AutotunePolicy,
    Autotuner,
    ConfigSelectorChain,
    Executor,
    Invocation,
    PersistentCache,
    autotune,
    autotune_recorded,
    benchmark,
    get_invocations,
    labels_to_configs,
    recording,
)
from ejlabel.execution.tuning import AutotuneError

from toy_kernels import CostConfig, LoopConfig, LoopSumKernel, cost, loopsum, scale

X = jax.random.normal(jax.random.key(0), (64, 512))
FAST = AutotunePolicy(num_warmup=1, num_iters=8, compile_workers=2)


def test_benchmark_returns_median_float_with_stats():
    f = jax.jit(lambda x: x @ x.T)
    t = benchmark(f, X, num_warmup=2, num_iters=7)
    assert isinstance(t, float) and t > 0
    assert t.count == 7 and t.min_ms <= t.median_ms and t.iqr_ms >= 0 and len(t.samples_ms) == 7
    assert float(t) == t.median_ms
    with pytest.raises(ValueError, match="num_iters"):
        benchmark(f, X, num_iters=0)


def test_benchmark_seed_form_and_no_compile_time():
    calls = []

    @jax.jit
    def f(x):
        calls.append(1)  # runs at trace time only
        return x + 1

    t = benchmark(lambda: f(X), num_iters=5)
    assert len(calls) == 1 and t.count == 5


def test_autotune_picks_cheapest_and_rejects_wrong():
    result = Autotuner(FAST).tune(Invocation(loopsum, (X,)))
    statuses = {c.cfg: c.status for c in result.candidates}
    assert statuses[LoopConfig(block=512, wrong=True)] == "wrong"
    assert result.best_cfg.block >= 256 and not result.best_cfg.wrong  # 1 or 2 loop steps of 512
    assert statuses[LoopConfig(block=1)] in ("pruned", "ok")
    timed = [c for c in result.candidates if c.timing is not None]
    assert max(c.timing for c in timed) > 3 * result.best.timing  # configs really differ in cost
    assert any(c.status == "pruned" for c in result.candidates)  # early stopping dropped some
    assert all(c.compile_s is not None and c.compile_s > 0 for c in result.candidates)


def test_compile_failure_recorded_others_run():
    class Fragile(LoopSumKernel):
        def config_space(self, inv):
            return [LoopConfig(3), LoopConfig(4), LoopConfig(8)]  # 3 does not divide 512: fails to trace

    result = Autotuner(FAST).tune(Invocation(Fragile(), (X,)))
    bad = next(c for c in result.candidates if c.cfg == LoopConfig(3))
    assert bad.status == "compile_error" and "does not divide" in bad.reason
    assert result.best_cfg in (LoopConfig(4), LoopConfig(8))


def test_reference_that_fails_falls_back_to_first_working_candidate():
    class HugeReference(LoopSumKernel):
        def reference(self, x):
            raise RuntimeError("RESOURCE_EXHAUSTED: out of memory")

    with pytest.warns(UserWarning, match="reference failed.*out of memory"):
        result = Autotuner(FAST).tune(Invocation(HugeReference(), (X,)), configs=[LoopConfig(256), LoopConfig(512, wrong=True)])
    statuses = {c.cfg: c.status for c in result.candidates}
    assert statuses[LoopConfig(512, wrong=True)] == "wrong"  # still checked, against the heuristic's output
    assert not result.best_cfg.wrong


def test_reference_runs_as_one_compiled_program_or_falls_back_when_it_cannot_trace():
    traced = []

    class CountedReference(LoopSumKernel):
        def reference(self, x):
            traced.append(isinstance(x, jax.core.Tracer))  # called once, while jit traces it
            return super().reference(x)

    result = Autotuner(FAST).tune(Invocation(CountedReference(), (X,)), configs=[LoopConfig(256), LoopConfig(512, wrong=True)])
    assert traced == [True]
    assert {c.cfg: c.status for c in result.candidates}[LoopConfig(512, wrong=True)] == "wrong"

    class BranchingReference(LoopSumKernel):
        def reference(self, x):
            if float(x.sum()) > 1e9:  # a Python branch on a value: cannot be traced
                return x
            return super().reference(x)

    with pytest.warns(UserWarning, match="reference failed"):
        result = Autotuner(FAST).tune(Invocation(BranchingReference(), (X,)), configs=[LoopConfig(256), LoopConfig(512, wrong=True)])
    assert {c.cfg: c.status for c in result.candidates}[LoopConfig(512, wrong=True)] == "wrong"
    assert not result.best_cfg.wrong


def test_all_candidates_failing_lists_reasons():
    with pytest.raises(AutotuneError, match="compile_error"):
        Autotuner(FAST).tune(Invocation(loopsum, (X,)), configs=[LoopConfig(3), LoopConfig(5)])


def test_autotune_seed_form_stores_winner():
    best = autotune(loopsum, X, num_warmup=1, num_iters=6)
    inv = Invocation(loopsum, (X,))
    selector = ejlabel.get_default_executor().selector
    assert selector.cache.get(*inv.cache_key) == best
    assert selector.persistent.get_entry(*inv.cache_key).provenance == "autotuned"


def test_second_run_hits_persistent_cache_and_tunes_nothing(tmp_path):
    traces = []

    class Counting(LoopSumKernel):
        def run(self, x, *, cfg):
            traces.append(cfg)
            return super().run(x, cfg=cfg)

    kernel = Counting()
    model = lambda ex: jax.jit(lambda x: ex(kernel, x) * 2)

    first = Executor(ConfigSelectorChain(persistent=PersistentCache(tmp_path), policy=dataclasses.replace(FAST, on_miss="autotune")))
    out = model(first)(X)
    tuned = len(traces)
    assert tuned > 5  # every candidate compiled, plus the final trace
    entry = first.selector.persistent.get_entry(*Invocation(kernel, (X,)).cache_key)
    assert entry.provenance == "autotuned" and entry.stats["median_ms"] > 0 and entry.stats["candidates"]

    traces.clear()
    second = Executor(ConfigSelectorChain(persistent=PersistentCache(tmp_path), policy=dataclasses.replace(FAST, on_miss="autotune")))
    out2 = model(second)(X)
    assert len(traces) == 1  # only the model's own trace: nothing compiled for tuning
    assert jnp.allclose(out, out2, rtol=1e-4)
    lowered = jax.jit(lambda x: second(kernel, x)).lower(X)
    assert [p.provenance for p in labels_to_configs(lowered, second.selector)] == ["memory"]


def test_autotune_inside_jit_trace_returns_config_without_leaks(tmp_path):
    ex = Executor(ConfigSelectorChain(persistent=PersistentCache(tmp_path), autotune=True))
    with ejlabel.policy_override(num_iters=4, num_warmup=1):
        with jax.checking_leaks():
            out = jax.jit(lambda x: ex(loopsum, x))(X)
    assert jnp.allclose(out, X.sum(axis=1), rtol=1e-4, atol=1e-3)
    decision = ex.selector.decision(Invocation(loopsum, (X,)).cache_key)
    assert decision.provenance == "autotuned" and not decision.cfg.wrong


def test_policy_override_turns_tuning_off():
    ex = Executor(ConfigSelectorChain(autotune=True))
    with ejlabel.policy_override(autotune=False):
        ex(loopsum, X)
    assert ex.selector.decision(Invocation(loopsum, (X,)).cache_key).provenance == "heuristic"


def test_recording_keeps_abstract_specs_only():
    x = np.ones((8, 16), np.float32)  # numpy arrays can be weakly referenced
    ref = weakref.ref(x)
    with recording():
        scale(x)
        scale(x)  # same signature: recorded once
        scale(jnp.ones((2, 2)))
    recorded = get_invocations()
    assert len(recorded) == 2
    assert all(isinstance(a, jax.ShapeDtypeStruct) for inv in recorded for a in inv.args)
    del x
    gc.collect()
    assert ref() is None


def test_autotune_recorded_tunes_each_distinct_call_once(tmp_path):
    traced = []

    class Counting(LoopSumKernel):
        def run(self, x, *, cfg):
            traced.append((x.shape, cfg))
            return super().run(x, cfg=cfg)

    kernel = Counting()
    a, b = jnp.ones((16, 64)), jnp.ones((8, 128))
    with recording():
        for x in (a, b, a, a, b):
            kernel(x)
    invs = get_invocations()
    assert len(invs) == 2
    traced.clear()
    selector = ConfigSelectorChain(persistent=PersistentCache(tmp_path))
    winners = autotune_recorded(invs + invs, selector=selector, policy=FAST)
    assert set(winners) == {(inv.op_id, inv.call_key) for inv in invs}
    spaces = sum(len(kernel.config_space(inv)) for inv in invs)
    assert len(traced) == spaces  # each candidate of each distinct call compiled exactly once
    for inv in invs:
        assert selector.persistent.get(*inv.cache_key) == winners[(inv.op_id, inv.call_key)]


def test_backward_is_checked_and_timed_for_custom_vjp_kernels():
    from toy_kernels import BackwardConfig, double

    x = jax.random.normal(jax.random.key(3), (256, 256))
    result = Autotuner(FAST).tune(Invocation(double, (x,)))
    statuses = {c.cfg: c.status for c in result.candidates}
    assert statuses[BackwardConfig(broken=True)] == "wrong"  # its forward is right: only the backward shows it
    assert result.best_cfg == BackwardConfig()  # the slow backward loses

    forward_only = Autotuner(dataclasses.replace(FAST, tune_backward=False)).tune(Invocation(double, (x,)))
    assert {c.cfg: c.status for c in forward_only.candidates}[BackwardConfig(broken=True)] != "wrong"


# ---------------------------------------------------------------- the time budget

COST_X = jnp.ones((8, 128), jnp.float32)
COST_FLOOR = [CostConfig("loop", steps=300), CostConfig("xla", steps=300)]  # heuristic, then XLA


def test_budget_times_the_floor_first_counts_compile_time_and_says_what_it_skipped(tmp_path):
    # Every candidate of the config space sleeps 0.3 s while traced (its compile time), more than
    # the whole 0.2 s budget; the heuristic (a slow loop) and XLA (the fastest) compile at once.
    policy = AutotunePolicy(num_warmup=1, num_iters=4, compile_workers=1, time_budget_s=0.2)
    inv = Invocation(cost, (COST_X,))
    result = Autotuner(policy).tune(inv)
    floor = [c for c in result.candidates if c.floor]
    assert [c.cfg for c in floor] == COST_FLOOR and result.candidates[:2] == floor
    assert all(c.status == "ok" and c.timing.count == 4 for c in floor)  # timed in full, budget or not
    # Compile seconds count: once the floor's compiles are in, at most one other starts, and
    # nothing is timed past the budget.
    assert sum(c.compile_s is not None for c in result.candidates if not c.floor) <= 1
    assert [c.cfg.steps for c in result.skipped] == [1, 2, 4, 8, 16, 32]
    assert all(c.timing is None and c.reason.startswith("time budget spent") for c in result.skipped)
    # The winner is the fastest candidate timed, so never slower than the heuristic or XLA.
    timed = [c for c in result.candidates if c.timing is not None]
    assert result.best.timing == min(c.timing for c in timed) and result.best.floor
    stats = result.stats()
    assert stats["skipped"] == 6 and [c["status"] for c in stats["candidates"]].count("skipped") == 6
    with PersistentCache(tmp_path) as pc:
        ejlabel.execution.tuning.store_result(result, inv, None, pc)
        (entry,) = pc.entries(op_id="cost@v1")
        assert entry.config == result.best_cfg and entry.stats["skipped"] == 6


def test_budget_large_enough_times_everything_and_skips_nothing():
    policy = AutotunePolicy(num_warmup=1, num_iters=2, compile_workers=2, time_budget_s=600)
    result = Autotuner(policy).tune(Invocation(cost, (COST_X,)), configs=[CostConfig("loop", 2), CostConfig("loop", 300)])
    assert result.skipped == [] and all(c.timing is not None for c in result.candidates)
    assert [c.cfg for c in result.candidates] == [CostConfig("loop", 300), CostConfig("loop", 2)]  # floor first


def test_max_configs_keeps_the_heuristic_and_xla_candidates():
    # A median of 7 runs: the pick between the 300-step loop and ``x + 1`` must hold on a loaded
    # 2-core machine (with 2 runs, one CI run picked the loop).
    policy = AutotunePolicy(num_warmup=1, num_iters=7, compile_workers=2, max_configs=1)
    result = Autotuner(policy).tune(Invocation(cost, (COST_X,)))
    assert [c.cfg for c in result.candidates] == COST_FLOOR
    assert result.best_cfg == CostConfig("xla", steps=300)


def test_max_configs_takes_candidates_round_robin_over_implementations() -> None:
    import dataclasses

    from ejlabel.execution.tuning.candidates import spread_over_implementations

    @dataclasses.dataclass(frozen=True)
    class Cfg:
        impl: str
        tile: int = 0

    floor = [Cfg("xla")]
    space = [Cfg("pallas", t) for t in range(5)] + [Cfg("mosaic", t) for t in range(2)]
    picked = spread_over_implementations(floor + space, 1, 5)
    assert picked == [Cfg("xla"), Cfg("pallas", 0), Cfg("mosaic", 0), Cfg("pallas", 1), Cfg("mosaic", 1)]
    assert spread_over_implementations(floor + space, 1, 20) == floor + space  # no cap hit: order kept
