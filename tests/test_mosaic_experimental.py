"""The experimental schedules of the Mosaic attention kernels (kernels/attention/mosaic/experimental.py).

``mosaic_attention`` with its defaults runs the product's kernels (the same modules as
``flash_attention`` on the ``"mosaic"`` implementation). The fused backward: lowering (one
kernel with TMA reduce-adds where it runs, the split elsewhere), its shared-memory check, the
interpreter's sum of shares, values and gradients in the interpreter, and on a Hopper GPU
(arg_specs.FUSED_GPU_GRID).
"""

from __future__ import annotations

import importlib
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from ejlabel.kernels.attention import AttentionConfig, flash_attention
from ejlabel.kernels.attention import mosaic as am
from ejlabel.kernels.attention.arg_specs import FUSED_GPU_GRID, ArgSpec
from ejlabel.kernels.attention.mosaic import experimental
from ejlabel.kernels.attention.mosaic.experimental import mosaic_attention
from kernel_checks import attention_reference as reference
from kernel_checks import check_interpreted_backward, documents, gpu, kernel_hashes, lower_for_cuda, needs_gpu, rel_error
from kernel_checks import races  # noqa: F401  (a fixture)

from ejlabel import BwdParams, FwdParams

pytestmark = pytest.mark.skipif(not am.mosaic_available(), reason="this JAX has no Pallas Mosaic GPU backend")

needs_hopper = pytest.mark.skipif(not am.on_hopper(), reason="needs a Hopper GPU")


def test_defaults_run_the_products_kernels(monkeypatch: pytest.MonkeyPatch) -> None:
    """The experimental entry point with its defaults and ``flash_attention`` on the Mosaic
    implementation lower to the same three modules (forward, dq, dk/dv)."""
    monkeypatch.setattr(importlib.import_module("ejlabel.kernels.attention"), "on_hopper", lambda: True)
    q = jax.ShapeDtypeStruct((1, 256, 2, 64), jnp.bfloat16)

    def product(x: jax.Array) -> jax.Array:
        return flash_attention(x, x, x, causal=True, cfg=AttentionConfig("mosaic")).astype(jnp.float32).sum()

    def experiment(x: jax.Array) -> jax.Array:
        return mosaic_attention(x, x, x, causal=True).astype(jnp.float32).sum()

    ours, theirs = (set(kernel_hashes(lower_for_cuda(jax.grad(f), q))) for f in (product, experiment))
    assert len(ours) == 3 and ours == theirs


@pytest.mark.parametrize(("dim", "kv_heads", "segments"), [(64, 2, True), (128, 4, False), (256, 2, True)])
def test_fused_backward_lowers_to_one_kernel_with_reduce_adds(dim: int, kv_heads: int, segments: bool) -> None:
    q = jax.ShapeDtypeStruct((1, 200, 4, dim), jnp.float16)
    k = jax.ShapeDtypeStruct((1, 200, kv_heads, dim), jnp.float16)
    seg = jax.ShapeDtypeStruct((1, 200), jnp.int32) if segments else None

    def loss(q: jax.Array, k: jax.Array, v: jax.Array, seg: jax.Array | None) -> jax.Array:
        return mosaic_attention(q, k, v, causal=True, segment_ids=seg, fused_backward=True).astype(jnp.float32).sum()

    text = lower_for_cuda(jax.grad(loss, argnums=(0, 1, 2)), q, k, k, seg)
    # Forward, then one kernel adding dq up with TMA reduce-adds; above head dim 128, where dv
    # and dk take a walk each, the split runs instead (dq, dv and dk kernels).
    fused = dim <= 128
    assert text.count("@mosaic_gpu") == (2 if fused else 4)
    assert ("cp.reduce.async.bulk" in text) == fused
    # The fused kernel takes delta = sum_d out * dO from one contraction before it.
    assert ("stablehlo.dot_general" in text) == (fused or dim > 64)


def test_fused_fits_leaves_room_for_the_shares() -> None:
    # The fused backward's ds and float32 dq shares leave room for two stages at dim 128, not three.
    three = BwdParams(q_blocksize=64, kv_blocksize=64, num_stages=3)
    assert am.mosaic_fits(128, FwdParams(), three) and not experimental.fused_fits(128, FwdParams(), three)
    assert experimental.fused_fits(128, FwdParams(), BwdParams(q_blocksize=64))
    # With 128-row query blocks the split runs: the product's check is the one that counts.
    wide = BwdParams(q_blocksize=128, kv_blocksize=64)
    assert experimental.fused_fits(128, FwdParams(), wide) == am.mosaic_fits(128, FwdParams(), wide)
    assert not experimental.fused_fits(128, FwdParams(kv_blocksize=32), BwdParams())  # tiles the kernels do not take


def test_sum_shares_adds_only_visited_blocks() -> None:
    # Unvisited slots hold whatever the memory held (NaN here): they must not reach dq.
    shares = jnp.full((1, 2, 256, 1, 8), jnp.nan, jnp.float32)
    plan = jnp.array([[[0, 2]], [[2, 4]], [[0, 2]], [[2, 4]]], jnp.int32)  # tile 0 visits q blocks 0-1, tile 1 blocks 2-3
    shares = shares.at[0, 0, :128].set(1.0).at[0, 1, 128:].set(2.0)
    dq = np.asarray(experimental.sum_shares(shares, plan, 64))
    np.testing.assert_array_equal(dq[0, :128], 1.0)
    np.testing.assert_array_equal(dq[0, 128:], 2.0)


@pytest.mark.slow
def test_interpreted_fused_backward(races: Callable[[], bool]) -> None:
    # Each step's dq share lands in its own slot (the interpreter has no reduce-add) and the
    # visited ones are summed, so a share written to the wrong block, head or tile shows in dq;
    # the consumers take turns sending shares and read each other's ds and keys (taking out one
    # of the turns' waits makes the race detector report it).
    check_interpreted_backward(races, fused=True)


@gpu
@needs_gpu
@needs_hopper
@pytest.mark.parametrize("spec", FUSED_GPU_GRID, ids=lambda spec: spec.name)
def test_gpu_fused_backward(spec: ArgSpec) -> None:
    seq, dim = spec.seq, spec.dim
    q, k, v = spec.arrays(jax.random.key(seq))
    ids = documents(spec.batch, seq, spec.documents, padding=seq // 10, seed=seq) if spec.documents else None
    probe = jax.random.normal(jax.random.key(3), q.shape, jnp.float32)

    fused = lambda q, k, v: mosaic_attention(q, k, v, causal=True, segment_ids=ids, fused_backward=True)
    grads = jax.jit(lambda q, k, v: jax.vjp(fused, q, k, v)[1](probe.astype(q.dtype)))(q, k, v)
    ref = lambda q, k, v: reference(q, k, v, causal=True, window=None, segment_ids=ids, scale=dim**-0.5)
    want = jax.vjp(ref, *(t.astype(jnp.float32) for t in (q, k, v)))[1](probe)
    for name, g, w in zip("qkv", grads, want):
        assert rel_error(g, w) < 4e-2, name
