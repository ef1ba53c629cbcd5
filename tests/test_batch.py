"""Calls under vmap are keyed, described and tuned as the batched call; pmap selects once."""

from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import pytest

import ejlabel
import ejlabel.analysis
from ejlabel import ConfigSelectorChain, Executor, Invocation, find_labels_in_lowered, vmap_with_config
from ejlabel.analysis import invocations_from_program
from ejlabel.execution.tuning import Autotuner
from ejlabel.execution.tuning.candidates import candidate_function, tuning_arguments

from conftest import run_python
from toy_kernels import ScaleConfig, scale, toymatmul


def _labels(fn, *args):
    return find_labels_in_lowered(jax.jit(fn).lower(*args))


def test_vmap_with_config_selects_once_for_the_batched_call():
    selector = ConfigSelectorChain()
    ex = Executor(selector)
    xs = jnp.arange(24.0).reshape(6, 4)
    batched = Invocation(scale, (jax.ShapeDtypeStruct((4,), jnp.float32),), batch_axes=("vmap", ((6, (0,)),)))
    selector.cache.put(*batched.cache_key, ScaleConfig(5, "add"))

    out = vmap_with_config(scale, executor=ex)(xs)
    assert jnp.allclose(out, xs * 2)
    assert selector.decision(batched.cache_key) == (ScaleConfig(5, "add"), "memory")
    assert len(selector._decisions) == 1  # selected once, not per example
    plain = Invocation(scale, (xs[0],))
    assert plain.call_key != batched.call_key
    assert selector.decision(plain.cache_key) is None

    lowered = jax.jit(vmap_with_config(scale, executor=ex)).lower(xs)
    assert find_labels_in_lowered(lowered) == [f"ejkernel_ops#scale@v1:{batched.call_key}"]


def test_jax_vmap_keys_the_batched_call_not_the_example():
    a, b = jnp.ones((16, 32)), jnp.ones((32, 24))
    alone = _labels(toymatmul, a, b)
    over_8 = _labels(jax.vmap(toymatmul), jnp.ones((8, 16, 32)), jnp.ones((8, 32, 24)))
    over_4 = _labels(jax.vmap(toymatmul), jnp.ones((4, 16, 32)), jnp.ones((4, 32, 24)))
    shared_b = _labels(jax.vmap(toymatmul, in_axes=(0, None)), jnp.ones((8, 16, 32)), b)
    nested = _labels(jax.vmap(jax.vmap(toymatmul)), jnp.ones((2, 8, 16, 32)), jnp.ones((2, 8, 32, 24)))
    assert len({*alone, *over_8, *over_4, *shared_b, *nested}) == 5  # five calls the program runs differently
    # vmap_with_config is jax.vmap of the same call: one key.
    assert _labels(vmap_with_config(toymatmul), jnp.ones((8, 16, 32)), jnp.ones((8, 32, 24))) == over_8
    # The backward of a vmapped call has the forward's key (grad inside vmap: JVP over batch tracers).
    loss = lambda x, y: toymatmul(x, y).sum()
    grads = _labels(jax.vmap(jax.grad(loss)), jnp.ones((8, 16, 32)), jnp.ones((8, 32, 24)))
    assert grads == [over_8[0].replace("toymatmul@", "toymatmul.bwd@")]

    lowered = jax.jit(jax.vmap(jax.vmap(toymatmul, in_axes=(1, None)))).lower(jnp.ones((2, 16, 8, 32)), jnp.ones((2, 32, 24)))
    ((label, inv),) = invocations_from_program(lowered).items()
    assert [x.shape for x in inv.args] == [(16, 32), (32, 24)]  # the kernel's hooks see one example
    assert inv.batch_axes == ("vmap", ((8, (1, None)), (2, (0, 0))))  # innermost first
    args, _ = tuning_arguments(inv, inv.args, inv.array_kwargs)
    assert [x.shape for x in args] == [(2, 16, 8, 32), (2, 32, 24)]  # what the program runs


def test_the_audit_shows_a_vmapped_call_as_the_program_runs_it():
    lowered = jax.jit(jax.vmap(jax.vmap(toymatmul, in_axes=(1, None)))).lower(jnp.ones((2, 16, 8, 32)), jnp.ones((2, 32, 24)))
    (call,) = ejlabel.analysis.audit(lowered).summaries
    assert call.arguments == "f32[2,16,8,32] f32[2,32,24] vmap=2x8"


def test_a_vmapped_call_is_tuned_on_its_batched_arguments():
    xs = jnp.arange(8 * 16 * 32, dtype=jnp.float32).reshape(8, 16, 32) / 1000
    lowered = jax.jit(jax.vmap(toymatmul, in_axes=(0, None))).lower(xs, jnp.ones((32, 24)))
    (inv,) = invocations_from_program(lowered).values()
    cfg = toymatmul.heuristic_cfg(inv)
    args, kwargs = tuning_arguments(inv, (xs[0], jnp.ones((32, 24))), {})
    assert args[0].shape == (8, 16, 32) and args[1].shape == (32, 24)
    out = jax.jit(candidate_function(inv, cfg, backward=False))(args, kwargs)
    assert out.shape == (8, 16, 24)
    # With the backward pass: the cotangent is the batched output's.
    cot = jnp.ones((8, 16, 24))
    (y, (da, db)) = jax.jit(candidate_function(inv, cfg, backward=True))(args, kwargs, cot)
    assert y.shape == (8, 16, 24) and da.shape == (8, 16, 32) and db.shape == (32, 24)  # b is shared

    selector = ConfigSelectorChain(persistent=ejlabel.PersistentCache())
    result = Autotuner(ejlabel.AutotunePolicy(num_iters=2, num_warmup=1), progress=False).tune(inv)
    assert result.best.status == "ok" and result.call_key == inv.call_key
    report = ejlabel.analysis.tune_unseen(lowered, selector=selector)
    assert not report.errors and list(report.results) == [(inv.op_id, inv.call_key)]


def test_bad_batch_axes_in_a_description_are_a_clear_error():
    from ejlabel.core.calls import CallDecodeError, encode_call, invocation_from_description
    from ejlabel import label

    bad = Invocation(scale, (jax.ShapeDtypeStruct((4,), jnp.float32),), batch_axes=("vmap", ((0, (0,)),)))
    with pytest.raises(CallDecodeError, match="batch_axes"):
        invocation_from_description(label(bad.op_id, bad.call_key), encode_call(bad))
    short = Invocation(scale, (jax.ShapeDtypeStruct((4,), jnp.float32),), batch_axes=("vmap", ((3, (0, 0)),)))
    with pytest.raises(CallDecodeError, match="batch_axes"):
        invocation_from_description(label(short.op_id, short.call_key), encode_call(short))


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
