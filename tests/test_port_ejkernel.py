"""Porting kernels written for ``ejkernel.ops`` to ejlabel by changing only the import line.

``KERNELS_SOURCE`` is a module in ejkernel's style: two ``Kernel`` subclasses with config
dataclasses, ``candidate_cfgs`` (and per-platform ``candidate_cfgs_<platform>``),
``fwd_with_residuals``/``vjp``, ``prepare``, ``run_<platform>``, used through
``Executor(ConfigSelectorChain(cache, policy, tuner, persistent))``, ``vmap_with_config``,
``record_invocation``/``autotune_recorded`` and ``policy_override(selector, ...)``. The test
changes its import line, asserts that is the only change, and runs it.
"""

from __future__ import annotations

import difflib
import sys
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import ejlabel

KERNELS_SOURCE = '''
from dataclasses import dataclass

import jax
import jax.numpy as jnp

from ejkernel.ops import (
    AutotunePolicy,
    ConfigCache,
    ConfigSelectorChain,
    Executor,
    Invocation,
    Kernel,
    PersistentCache,
    Tuner,
    autotune_recorded,
    device_fingerprint,
    get_invocations,
    policy_override,
    record_invocation,
    vmap_with_config,
)

CALLS = {"vjp": 0}


@dataclass(frozen=True)
class ScaledMatmulConfig:
    block_k: int = 4
    unroll: bool = False


class ScaledMatmul(Kernel[ScaledMatmulConfig, jax.Array]):
    """y = scale * x @ w, computed in blocks of k; a hand-written backward."""

    version = "1"

    def __init__(self):
        super().__init__(op_id="scaled_matmul")

    def run(self, x, w, *, cfg, scale=1.0):
        return self.fwd_with_residuals(x, w, cfg=cfg, scale=scale)[0]

    def fwd_with_residuals(self, x, w, *, cfg, scale=1.0):
        k = x.shape[-1]
        parts = [x[:, i : i + cfg.block_k] @ w[i : i + cfg.block_k] for i in range(0, k, cfg.block_k)]
        y = scale * sum(parts)
        return y, (x, w)

    def vjp(self, residuals, y, dy, x_in, w_in, *, cfg, scale=1.0):
        CALLS["vjp"] += 1
        x, w = residuals
        return scale * dy @ w.T, scale * x.T @ dy

    def heuristic_cfg(self, inv):
        return ScaledMatmulConfig(block_k=inv.args[0].shape[-1])

    def candidate_cfgs(self, inv):
        k = inv.args[0].shape[-1]
        return [ScaledMatmulConfig(block_k=b) for b in (2, 4, 8) if k % b == 0]

    def candidate_cfgs_gpu(self, inv):
        return self.candidate_cfgs(inv)

    def candidate_cfgs_tpu(self, inv):
        return self.candidate_cfgs(inv)


@dataclass(frozen=True)
class RowNormConfig:
    chunk: int = 8


class RowNorm(Kernel[RowNormConfig, jax.Array]):
    """x / ||x|| per row; arguments go through prepare; differentiated by JAX."""

    op_id = "row_norm"

    def prepare(self, x, **kwargs):
        return (jnp.asarray(x, jnp.float32),), kwargs

    def run_cpu(self, x, *, cfg, eps=1e-6):
        return self.run(x, cfg=cfg, eps=eps)

    def run(self, x, *, cfg, eps=1e-6):
        sq = sum(jnp.sum(x[:, i : i + cfg.chunk] ** 2, axis=-1) for i in range(0, x.shape[-1], cfg.chunk))
        return x / jnp.sqrt(sq + eps)[:, None]

    def heuristic_cfg(self, inv):
        return RowNormConfig(chunk=inv.args[0].shape[-1])

    def candidate_cfgs_cpu(self, inv):
        return [RowNormConfig(chunk=c) for c in (2, 4, 8)]

    def candidate_cfgs_gpu(self, inv):
        return self.candidate_cfgs_cpu(inv)

    def candidate_cfgs_tpu(self, inv):
        return self.candidate_cfgs_cpu(inv)


def make_executor(cache_path, events):
    cache = ConfigCache()
    policy = AutotunePolicy(allow_autotune=True, allow_heuristics=True, cache_miss_fallback="autotune")
    selector = ConfigSelectorChain(
        cache,
        policy,
        Tuner(warmup=1, iters=3),
        PersistentCache("scaled_matmul", path=cache_path),
        on_event=lambda event, **data: events.append((event, data)),
    )
    return Executor(selector)
'''


def _ported_module(name: str = "ported_ejkernel_kernels") -> types.ModuleType:
    ported = KERNELS_SOURCE.replace("from ejkernel.ops import", "from ejlabel import")
    changed = [
        line for line in difflib.unified_diff(KERNELS_SOURCE.splitlines(), ported.splitlines(), lineterm="", n=0)
        if line[:1] in "+-" and not line.startswith(("+++", "---"))
    ]
    assert changed == ["-from ejkernel.ops import (", "+from ejlabel import ("]  # only the import line
    if name in sys.modules:
        return sys.modules[name]
    module = types.ModuleType(name)
    sys.modules[name] = module
    exec(compile(ported, f"<{name}>", "exec"), module.__dict__)
    return module


@pytest.fixture(scope="module")
def m():
    return _ported_module()


def _inputs():
    x = jax.random.normal(jax.random.key(0), (6, 8), jnp.float32)
    w = jax.random.normal(jax.random.key(1), (8, 5), jnp.float32)
    return x, w


def test_values_gradients_labels_tuning(m, tmp_path):
    events = []
    executor = m.make_executor(str(tmp_path / "cache"), events)
    kernel = m.ScaledMatmul()
    x, w = _inputs()

    y = executor(kernel, x, w, scale=0.5)
    np.testing.assert_allclose(y, 0.5 * x @ w, rtol=1e-5, atol=1e-5)

    # Tuning ran once, over the three candidate_cfgs, and stored the winner with its statistics.
    names = [event for event, _ in events]
    assert names.count("autotune_start") == 1 and names.count("autotune_finish") == 1
    inv = m.Invocation(kernel, (x, w), {"scale": 0.5})
    entry = executor.selector.persistent.get_entry(inv.cache_key)
    assert entry is not None and entry.provenance == "autotuned"
    tried = [c["cfg"] for c in entry.stats["candidates"]]
    assert len(tried) == 3, tried
    assert entry.config in kernel.candidate_cfgs(inv)

    # Gradients go through fwd_with_residuals / vjp.
    before = m.CALLS["vjp"]
    loss = lambda x, w: executor(kernel, x, w, scale=0.5).sum()
    gx, gw = jax.grad(loss, argnums=(0, 1))(x, w)
    rx, rw = jax.grad(lambda x, w: (0.5 * x @ w).sum(), argnums=(0, 1))(x, w)
    np.testing.assert_allclose(gx, rx, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(gw, rw, rtol=1e-5, atol=1e-5)
    assert m.CALLS["vjp"] > before

    # Labels of the forward and of the backward are in the compiled program.
    compiled = jax.jit(jax.value_and_grad(loss, argnums=(0, 1))).lower(x, w).compile()
    labels = ejlabel.find_labels_in_lowered(compiled)
    assert f"ejkernel_ops#scaled_matmul@v1:{inv.call_key}" in labels
    assert f"ejkernel_ops#scaled_matmul.bwd@v1:{inv.call_key}" in labels
    configs = dict(ejlabel.labels_to_configs(compiled, executor.selector))
    assert configs[f"ejkernel_ops#scaled_matmul@v1:{inv.call_key}"] == entry.config

    # _cfg= overrides, as in ejkernel.
    forced = m.ScaledMatmulConfig(block_k=2)
    assert executor.choose_config(kernel, x, w, scale=0.5, _cfg=forced) == forced
    np.testing.assert_allclose(executor(kernel, x, w, scale=0.5, _cfg=forced), 0.5 * x @ w, rtol=1e-5, atol=1e-5)


def test_persistence_across_selectors(m, tmp_path):
    kernel = m.ScaledMatmul()
    x, w = _inputs()
    first_events, second_events = [], []
    first = m.make_executor(str(tmp_path / "cache"), first_events)
    first(kernel, x, w)
    tuned = first.selector.persistent.get_entry(m.Invocation(kernel, (x, w)).cache_key).config

    # A fresh process's selector (new memory cache) reads the winner back, without tuning.
    second = m.make_executor(str(tmp_path / "cache"), second_events)
    np.testing.assert_allclose(second(kernel, x, w), x @ w, rtol=1e-5, atol=1e-5)
    assert [e for e, _ in second_events] == ["cache_hit"]
    assert second_events[0][1]["level"] == "persistent" and second_events[0][1]["cfg"] == tuned


def test_prepare_run_platform_vmap_and_policy_override(m, tmp_path):
    events = []
    executor = m.make_executor(str(tmp_path / "cache"), events)
    norm = m.RowNorm()
    assert norm.op_id == "row_norm"
    rows = np.arange(1.0, 17.0).reshape(2, 8)  # numpy input: prepare turns it into float32 jax

    # With tuning turned off for this selector only, the heuristic is used.
    with m.policy_override(executor.selector, allow_autotune=False):
        out = executor(norm, rows)
    assert [e for e, _ in events] == ["heuristics"]
    np.testing.assert_allclose(out, rows / np.linalg.norm(rows, axis=-1, keepdims=True), rtol=1e-5)

    # vmap_with_config in ejkernel's argument order; tuned over candidate_cfgs_<platform>.
    batch = jnp.stack([jnp.asarray(rows, jnp.float32)] * 3)
    out = m.vmap_with_config(executor, norm, 0)(batch)
    np.testing.assert_allclose(out, batch / jnp.linalg.norm(batch, axis=-1, keepdims=True), rtol=1e-5)
    assert "autotune_finish" in [e for e, _ in events]


def test_record_and_autotune_recorded(m, tmp_path):
    events = []
    executor = m.make_executor(str(tmp_path / "cache"), events)
    selector = executor.selector
    kernel = m.ScaledMatmul()
    x, w = _inputs()

    # ejkernel's registry form: record_invocation(dev, op_id_v, call_key, kernel, args, kwargs).
    inv = m.Invocation(kernel, (x, w), {})
    record_args = (m.device_fingerprint(), inv.op_id, inv.make_key(), kernel, (x, w), {})
    m.record_invocation(*record_args)
    assert [i.call_key for i in m.get_invocations(m.device_fingerprint())] == [inv.call_key]

    results = m.autotune_recorded(selector, show_progress=False)
    assert list(results) == [(inv.op_id, inv.call_key)]
    assert selector.cache.get(inv.cache_key) == results[(inv.op_id, inv.call_key)]
    # Later calls use the tuned config without tuning again.
    executor(kernel, x, w)
    assert "autotune_start" not in [e for e, _ in events]


# ---------------------------------------------------------------------------------------------
# What cannot hold in ejlabel is refused with a clear error (never silently dropped).


def test_positional_selector_misuse_is_an_error(tmp_path):
    cache = ejlabel.PersistentCache(path=tmp_path)
    with pytest.raises(TypeError, match="policy: expected an AutotunePolicy"):
        ejlabel.ConfigSelectorChain(ejlabel.ConfigCache(), cache)
    selector = ejlabel.ConfigSelectorChain(ejlabel.ConfigCache(), ejlabel.AutotunePolicy())  # ejkernel's order
    assert selector.persistent is None and isinstance(selector.policy, ejlabel.AutotunePolicy)
    with pytest.raises(TypeError, match="keyword arguments only"):
        ejlabel.AutotunePolicy(True, True, "heuristics")


def test_refused_executor_keywords(m):
    executor = ejlabel.Executor()
    kernel = m.ScaledMatmul()
    x, w = _inputs()
    with pytest.raises(ValueError, match="stamp=False"):
        executor(kernel, x, w, stamp=False)
    np.testing.assert_allclose(executor(kernel, x, w, stamp=True), x @ w, rtol=1e-5, atol=1e-5)
    for name in ("method", "mesh", "in_specs", "out_specs", "check_vma"):
        with pytest.raises(TypeError, match="shard_map"):
            executor(kernel, x, w, **{name: None})
    with pytest.raises(TypeError, match="not both"):
        executor(kernel, x, w, cfg=m.ScaledMatmulConfig(2), _cfg=m.ScaledMatmulConfig(4))
    with pytest.raises(ValueError, match="stamp_prefix"):
        ejlabel.Executor(stamp_prefix="eformer_ops")
    assert ejlabel.Executor(stamp_prefix="ejkernel_ops").selector is not None


def test_refused_kernel_hooks():
    class WithKeyBuilder(ejlabel.Kernel):
        key_builder = staticmethod(lambda inv: "0" * 16)

        def run(self, x, *, cfg):
            return x

    with pytest.raises(TypeError, match="key_builder"):
        WithKeyBuilder("kb")

    class WithShardMap(ejlabel.Kernel):
        def run(self, x, *, cfg):
            return x

        def run_shard_map_gpu(self, x, *, cfg):
            return x

    with pytest.warns(RuntimeWarning, match="run_shard_map_gpu"):
        WithShardMap("sm")

    class HalfVjp(ejlabel.Kernel):
        def fwd_with_residuals(self, x, *, cfg):
            return x, None

    with pytest.raises(TypeError, match="go together"):
        HalfVjp("half")


def test_persistent_cache_op_name_and_loaders(tmp_path, monkeypatch, isolated_cache_dir):
    monkeypatch.chdir(tmp_path)
    cache = ejlabel.PersistentCache("pooling")  # ejkernel's op name: the default cache, no ./pooling
    assert not (tmp_path / "pooling").exists() and cache.opname == "pooling"
    assert cache.path.parent == isolated_cache_dir
    assert ejlabel.PersistentCache("pooling", path=tmp_path / "p").path.parent == tmp_path / "p"
    assert ejlabel.PersistentCache("./here").path.parent == tmp_path / "here"
    with pytest.raises(TypeError, match="loader/dumper"):
        ejlabel.PersistentCache("pooling", loader=lambda raw: raw)


def test_small_compat_forms():
    t = ejlabel.benchmark(lambda: jnp.ones(3) + 1, warmup=1, iters=4)
    assert t.count == 4
    tuner = ejlabel.Autotuner(2, 5)
    assert (tuner.warmup, tuner.iters) == (2, 5)
    policy = ejlabel.AutotunePolicy(allow_autotune=False, allow_heuristics=False, validate_backward=False)
    assert (policy.enabled, policy.on_miss, policy.tune_backward) == (False, "error", False)
    assert (policy.allow_autotune, policy.allow_heuristics, policy.cache_miss_fallback) == (False, False, "heuristics")
    with pytest.raises(TypeError, match="decorator"):
        ejlabel.autotune(lambda x: x)
    fwd = ejlabel.FwdParams(blocksize_m=64, blocksize_k=32, blocksize_n=48, blocksize_heads=2, blocksize_keys=128)
    assert fwd.blocksize_n == 48
    with pytest.raises(ValueError, match="blocksize_heads"):
        ejlabel.BwdParams(blocksize_heads=0)


def test_compile_choose_and_standalone_tuner(m):
    executor = ejlabel.Executor()
    kernel = m.ScaledMatmul()
    x, w = _inputs()
    compiled = executor.compile(kernel, x, w, _cfg=m.ScaledMatmulConfig(block_k=2))
    np.testing.assert_allclose(compiled(x, w), x @ w, rtol=1e-5, atol=1e-5)
    assert ejlabel.find_labels_in_lowered(compiled.lower(x, w)) == [ejlabel.label("scaled_matmul@v1", m.Invocation(kernel, (x, w)).call_key)]
    inv = m.Invocation(kernel, (x, w))
    assert executor.selector.choose(inv, kernel) == kernel.heuristic_cfg(inv)
    with pytest.raises(ValueError, match="not the kernel"):
        executor.selector.choose(inv, m.RowNorm())

    tuner = ejlabel.Tuner(warmup=1, iters=2)
    seconds = tuner.measure(lambda a, b: a @ b, x, w)
    assert 0 < seconds < 10
    mk = lambda cfg: (lambda a, b: kernel.run(a, b, cfg=cfg))
    assert tuner.autotune(mk, (x, w), {}, kernel.candidate_cfgs(inv)) in kernel.candidate_cfgs(inv)
