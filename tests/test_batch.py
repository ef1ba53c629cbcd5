"""vmap_with_config / pmap_with_config select once on the per-example signature."""

from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import pytest

from ejlabel import ConfigSelectorChain, Executor, Invocation, find_labels_in_lowered, vmap_with_config

from conftest import run_python
from toy_kernels import ScaleConfig, scale


def test_vmap_with_config_selects_once_with_batch_axes_in_key():
    selector = ConfigSelectorChain()
    ex = Executor(selector)
    xs = jnp.arange(24.0).reshape(6, 4)
    per_example = Invocation(scale, (jax.ShapeDtypeStruct((4,), jnp.float32),), batch_axes=("vmap", 0, 0))
    selector.cache.put(*per_example.cache_key, ScaleConfig(5, "add"))

    out = vmap_with_config(scale, executor=ex)(xs)
    assert jnp.allclose(out, xs * 2)
    assert selector.decision(per_example.cache_key) == (ScaleConfig(5, "add"), "memory")
    plain = Invocation(scale, (xs[0],))
    assert plain.call_key != per_example.call_key
    assert selector.decision(plain.cache_key) is None

    lowered = jax.jit(vmap_with_config(scale, executor=ex)).lower(xs)
    assert find_labels_in_lowered(lowered) == [f"ejkernel_ops#scale@v1:{per_example.call_key}"]


def test_vmap_with_config_axes_and_errors():
    ex = Executor()
    xs = jnp.ones((4, 3))
    out = vmap_with_config(scale, in_axes=1, out_axes=1, executor=ex)(xs)
    assert out.shape == (4, 3) and jnp.allclose(out, 2.0)
    with pytest.raises(ValueError, match="in_axes"):
        vmap_with_config(scale, in_axes=(0, 0), executor=ex)(xs)
    with pytest.raises(ValueError, match="out of range"):
        vmap_with_config(scale, in_axes=3, executor=ex)(xs)


def test_pmap_with_config_on_8_host_devices():
    code = """
import json, jax, jax.numpy as jnp
from ejlabel import ConfigSelectorChain, Executor, Invocation, pmap_with_config
from toy_kernels import ScaleConfig, scale
selector = ConfigSelectorChain()
ex = Executor(selector)
xs = jnp.arange(8 * 3.0).reshape(8, 3)
out = pmap_with_config(scale, axis_name="d", executor=ex)(xs)
decisions = list(selector._decisions.values())
print(json.dumps({"n": len(jax.devices()), "ok": bool(jnp.allclose(out, xs * 2)), "decisions": len(decisions),
                  "provenance": decisions[0].provenance}))
"""
    result = json.loads(run_python(code, XLA_FLAGS="--xla_force_host_platform_device_count=8").strip().splitlines()[-1])
    assert result == {"n": 8, "ok": True, "decisions": 1, "provenance": "heuristic"}
