"""Kernel, Invocation, Executor, the selector chain and labels_to_configs."""

from __future__ import annotations

import enum
import threading

import jax
import jax.numpy as jnp
import pytest

import ejlabel
from ejlabel import (
    AutotunePolicy,
    ConfigCache,
    ConfigSelectorChain,
    Executor,
    Invocation,
    Kernel,
    PersistentCache,
    labels_to_configs,
    overlay_cache,
    policy_override,
)
from ejlabel.config.selection import UntunedCallError

from toy_kernels import ScaleConfig, scale, toymatmul

X = jnp.ones((3, 4))


def test_kernel_without_run_method_fails_clearly():
    class Empty(Kernel):
        pass

    with pytest.raises(TypeError, match="defines no run method"):
        Empty("empty")


def test_kernel_rejects_bad_op_id():
    with pytest.raises(ValueError, match="op_id"):
        type(scale)  # keeps the import used
        class K(Kernel):
            def run(self, x, *, cfg):
                return x
        K("bad@name")


def test_platform_dispatch_prefers_specific_methods():
    class K(Kernel):
        def run(self, x, *, cfg):
            return "run"

        def run_xla(self, x, *, cfg):
            return "xla"

        def run_triton(self, x, *, cfg):
            return "triton"

    k = K("k")
    assert k.implementation("cpu")(1, cfg=None) == "xla"
    assert k.implementation("gpu")(1, cfg=None) == "triton"
    assert k.implementation("tpu")(1, cfg=None) == "xla"


def test_call_key_is_abstract_and_excludes_config():
    a = Invocation(scale, (jnp.ones((3, 4)),))
    b = Invocation(scale, (jnp.zeros((3, 4)),), override_cfg=ScaleConfig(2, "add"))
    c = Invocation(scale, (jax.ShapeDtypeStruct((3, 4), jnp.float32),))
    assert a.call_key == b.call_key == c.call_key
    assert a.op_id == "scale@v1"
    assert Invocation(scale, (jnp.ones((3, 5)),)).call_key != a.call_key
    assert Invocation(scale, (jnp.ones((3, 4), jnp.bfloat16),)).call_key != a.call_key
    assert Invocation(scale, (X,), {"offset": 1.0}).call_key != a.call_key
    assert Invocation(scale, (X,), batch_axes=(0,)).call_key != a.call_key


class Color(enum.Enum):
    RED = 1
    BLUE = 2


@pytest.mark.parametrize(
    "static",
    [(1, 2), frozenset({1, 2}), Color.RED, jnp.bfloat16, jnp.dot, {"a": (1, 2)}],
)
def test_static_kwargs_any_fingerprintable_value(static):
    class K(Kernel):
        def run(self, x, *, cfg, option):
            return x

        def heuristic_cfg(self, inv):
            return ScaleConfig()

    k = K("opt")
    key = Invocation(k, (X,), {"option": static}).call_key
    assert key == Invocation(k, (X,), {"option": static}).call_key
    assert key != Invocation(k, (X,), {"option": None}).call_key


def test_invocation_call_key_inside_jit_matches_eager():
    keys = []

    def f(x):
        keys.append(Invocation(scale, (x,)).call_key)
        return x

    jax.jit(f)(X)
    assert keys == [Invocation(scale, (X,)).call_key]


def test_executor_eager_and_jit_agree_and_expose_selector():
    ex = Executor()
    assert isinstance(ex.selector, ConfigSelectorChain)
    eager = ex(scale, X, offset=1.0)
    jitted = jax.jit(lambda x: ex(scale, x, offset=1.0))(X)
    assert jnp.allclose(eager, X * 2 + 1) and jnp.allclose(jitted, eager)


def test_selection_order_and_provenance(tmp_path):
    persistent = PersistentCache(tmp_path)
    selector = ConfigSelectorChain(cache=ConfigCache(), persistent=persistent)
    inv = Invocation(scale, (X,))
    assert selector.select(inv) == (ScaleConfig(), "heuristic")

    persistent.put(*inv.cache_key, ScaleConfig(2, "add"))
    assert selector.select(inv) == (ScaleConfig(2, "add"), "persistent")
    assert selector.cache.get(*inv.cache_key) == ScaleConfig(2, "add")  # promoted
    assert selector.select(inv).provenance == "memory"

    selector.cache.put(*inv.cache_key, ScaleConfig(3, "mul"))
    assert selector.select(inv) == (ScaleConfig(3, "mul"), "memory")
    forced = Invocation(scale, (X,), override_cfg=ScaleConfig(9, "add"))
    assert selector.select(forced) == (ScaleConfig(9, "add"), "override")

    overlay = ConfigCache()
    overlay.put(*inv.cache_key, ScaleConfig(7, "mul"))
    with overlay_cache(overlay):
        assert selector.select(inv).cfg == ScaleConfig(7, "mul")
    assert selector.select(inv).cfg == ScaleConfig(3, "mul")


def test_version_and_device_isolation():
    class V1(Kernel):
        version = "1"

        def run(self, x, *, cfg):
            return x

        def heuristic_cfg(self, inv):
            return "heuristic"

    class V2(V1):
        version = "2"

    cache = ConfigCache()
    selector = ConfigSelectorChain(cache=cache)
    inv1, inv2 = Invocation(V1("k"), (X,)), Invocation(V2("k"), (X,))
    assert inv1.op_id == "k@v1" and inv2.op_id == "k@v2"
    cache.put(*inv1.cache_key, "tuned-for-v1")
    assert selector.select(inv1).cfg == "tuned-for-v1"
    assert selector.select(inv2).cfg == "heuristic"
    dev, op, key = inv1.cache_key
    cache.put("gpu|Other Device|cuda 1", op, key, "tuned-elsewhere")
    cache.delete(dev, op, key)
    assert selector.select(inv1).cfg == "heuristic"


def test_policy_error_on_miss_and_override_context():
    selector = ConfigSelectorChain(policy=AutotunePolicy(on_miss="error"))
    ex = Executor(selector)
    with pytest.raises(UntunedCallError, match="no tuned config"):
        ex(scale, X)
    with policy_override(on_miss="heuristic"):
        assert jnp.allclose(ex(scale, X), X * 2)
    with pytest.raises(UntunedCallError):
        ex(scale, X)


def test_policy_override_nests_and_restores_on_exception():
    from ejlabel.config.cache import effective_policy

    base = AutotunePolicy()
    with policy_override(num_iters=5):
        with pytest.raises(RuntimeError):
            with policy_override(autotune=False, num_iters=7):
                assert effective_policy(base).num_iters == 7 and not effective_policy(base).enabled
                raise RuntimeError
        assert effective_policy(base).num_iters == 5 and effective_policy(base).enabled
    assert effective_policy(base) == base
    with pytest.raises(TypeError, match="unknown field"):
        with policy_override(bogus=1):
            pass
    with pytest.raises(ValueError, match="on_miss"):
        with policy_override(on_miss="sometimes"):
            pass


def test_policy_override_is_context_local():
    seen = {}

    def other_thread():
        from ejlabel.config.cache import effective_policy

        seen["iters"] = effective_policy(AutotunePolicy()).num_iters

    with policy_override(num_iters=99):
        t = threading.Thread(target=other_thread)
        t.start()
        t.join()
    assert seen["iters"] == AutotunePolicy().num_iters


def test_config_cache_forms_and_thread_safety():
    cache = ConfigCache()
    key = ("cpu|cpu|x", "k@v1", "0123456789abcdef")
    cache.put(key, "a")
    assert cache.get(key) == "a" and cache.get(*key) == "a" and key in cache
    with pytest.raises(ValueError, match="cfg"):
        cache.put(*key, None)

    def writer(t):
        for i in range(500):
            cache.put("dev", f"op{t}@v1", f"{i:016x}", i)

    threads = [threading.Thread(target=writer, args=(t,)) for t in range(8)]
    [t.start() for t in threads]
    [t.join() for t in threads]
    assert len(cache) == 1 + 8 * 500
    assert all(cache.get("dev", f"op{t}@v1", f"{i:016x}") == i for t in range(8) for i in range(500))


def test_labels_to_configs_finds_exactly_what_the_executor_used(tmp_path):
    persistent = PersistentCache(tmp_path)
    selector = ConfigSelectorChain(persistent=persistent)
    ex = Executor(selector)
    y = jnp.ones((4, 5))
    tuned_inv = Invocation(scale, (y,))
    persistent.put(*tuned_inv.cache_key, ScaleConfig(2, "add"))

    def model(x, y):
        a = ex(scale, x)
        b = ex(scale, y)
        c = ex(toymatmul, a, jnp.ones((4, 2)), cfg=toymatmul.heuristic_cfg(None))
        return a.sum() + b.sum() + c.sum()

    lowered = jax.jit(jax.value_and_grad(model)).lower(X, y)
    pairs = labels_to_configs(lowered, selector)
    by_op = {(p.op_id, p.provenance) for p in pairs}
    assert ("scale@v1", "heuristic") in by_op and ("scale@v1", "persistent") in by_op
    assert ("toymatmul@v1", "override") in by_op and ("toymatmul.bwd@v1", "override") in by_op
    for pair in pairs:
        lab, cfg = pair  # unpacks as a 2-tuple
        assert cfg is not None and pair.label == lab and len(pair.call_key) == 16
    persistent_pair = next(p for p in pairs if p.provenance == "persistent")
    assert persistent_pair.cfg == ScaleConfig(2, "add") and persistent_pair.call_key == tuned_inv.call_key

    # A fresh selector with only the persistent cache sees the tuned call and nothing else.
    fresh = labels_to_configs(lowered, ConfigSelectorChain(persistent=persistent))
    assert sorted((p.provenance or "none") for p in fresh) == ["none", "none", "none", "persistent"]


def test_kernel_call_uses_default_executor():
    assert jnp.allclose(scale(X), X * 2)
    selector = ejlabel.get_default_executor().selector
    assert selector.decision(Invocation(scale, (X,)).cache_key).provenance == "heuristic"


@pytest.mark.parametrize(
    "kwargs",
    [{"option": 1}, {"option": 1.0}, {"option": True}, {"option": "1"}, {"option": (1, 2.0)}, {"option": Color.RED},
     {"option": ScaleConfig(2, "add")}, {"option": jnp.bfloat16}, {"option": [1, 2]}, {"option": {"a": 1}}, {"option": jnp.dot}],
)
def test_memoised_call_key_equals_full_fingerprint(kwargs):
    from ejlabel.utils.fingerprint import default_key_builder_with_sharding

    class K(Kernel):
        def run(self, x, *, cfg, option):
            return x

    k = K("memo")
    for _ in range(2):  # the second round is answered by the memo
        inv = Invocation(k, (X, jnp.ones((2,), jnp.int32), None, 3), kwargs)
        assert inv.call_key == default_key_builder_with_sharding(inv)
    keys = {Invocation(k, (X,), {"option": v}).call_key for v in (1, 1.0, True, "1", (1,), None)}
    assert len(keys) == 6


def test_memoised_call_key_follows_the_salt(monkeypatch):
    before = Invocation(scale, (X,)).call_key
    monkeypatch.setenv("EJLABEL_CACHE_SALT", "another")
    assert Invocation(scale, (X,)).call_key != before


def test_config_cache_get_still_validates_keys_that_miss():
    cache = ConfigCache()
    cache.put("dev", "k@v1", "0123456789abcdef", "a")
    assert cache.get("dev", "k@v1", "0123456789abcdef") == "a"
    assert cache.get("dev", "k@v1", "fedcba9876543210") is None
    for bad in (("dev", "k@v1", "XYZ"), ("", "k@v1", "0123456789abcdef"), ("dev", "", "0123456789abcdef")):
        with pytest.raises(ValueError):
            cache.get(*bad)
    with pytest.raises(TypeError):
        cache.get("dev", "k@v1")
    cache.delete("dev", "k@v1", "0123456789abcdef")
    assert cache.get("dev", "k@v1", "0123456789abcdef") is None


def test_memoised_label_follows_the_prefix_and_still_validates(monkeypatch):
    from ejlabel.core.labels import label

    key = "0123456789abcdef"
    assert label("memo@v1", key) == label("memo@v1", key) == f"ejkernel_ops#memo@v1:{key}"
    assert label("memo", key, "mine#") == f"mine#memo@v1:{key}"
    monkeypatch.setenv("EJLABEL_PREFIX", "other#")
    assert label("memo@v1", key) == f"other#memo@v1:{key}"
    monkeypatch.setenv("EJLABEL_PREFIX", "nohash")
    with pytest.raises(ValueError, match="prefix"):
        label("memo@v1", key)
    monkeypatch.delenv("EJLABEL_PREFIX")
    assert label("memo@v1", key) == f"ejkernel_ops#memo@v1:{key}"
    with pytest.raises(ValueError, match="call_hash"):
        label("memo@v1", "XYZ")
    with pytest.raises(TypeError, match="op_id"):
        label(["memo"], key)


def test_labelled_calls_see_cache_changes_between_traces():
    """Nothing on the fast path caches a selection: each trace asks the caches again."""
    selector = ConfigSelectorChain()
    ex = Executor(selector)
    inv = Invocation(scale, (X,))

    def traced():
        jax.make_jaxpr(lambda x: ex(scale, x))(X)  # a new function: every trace runs the executor
        return selector.decision(inv.cache_key)

    assert traced() == (ScaleConfig(), "heuristic")
    selector.cache.put(*inv.cache_key, ScaleConfig(3, "add"))
    assert traced() == (ScaleConfig(3, "add"), "memory")
    overlay = ConfigCache()
    overlay.put(*inv.cache_key, ScaleConfig(5, "mul"))
    with overlay_cache(overlay):
        assert traced() == (ScaleConfig(5, "mul"), "memory")
    assert traced() == (ScaleConfig(3, "add"), "memory")
    selector.cache.delete(*inv.cache_key)
    assert traced() == (ScaleConfig(), "heuristic")
    with policy_override(on_miss="error"):
        with pytest.raises(UntunedCallError):
            traced()


def test_label_scope_nests_reuses_and_decorates():
    from ejlabel.core.labels import find_labels_in_lowered, label, label_scope

    outer, inner = label("outer@v1", "0" * 16), label("inner@v1", "1" * 16)
    scope = label_scope(outer, "desc")

    @label_scope(inner)
    def g(x):
        return x * 3

    def f(x):
        with scope:
            y = x + 1
        with scope:  # the same scope object entered twice
            y = g(y) * 2
        return y

    text = jax.jit(f).lower(X).as_text()
    assert set(find_labels_in_lowered(text)) == {outer, inner}
    with pytest.raises(RuntimeError):
        with label_scope(outer):
            raise RuntimeError("propagates")
    from jax._src.xla_metadata_lib import current_xla_metadata

    assert current_xla_metadata() is None  # restored after the exception
