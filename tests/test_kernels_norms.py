"""RMS norm and layer norm: both impls against float64 formulas, fused backward, labels, tuning."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ejlabel.kernels.norms import LayerNormKernel, NormConfig, RMSNormKernel, layer_norm, rms_norm

from kernel_checks import assert_close, assert_labelled, assert_tunes, gpu, needs_gpu

# 4-row blocks over 2 x 9 rows and a width of 40 (padded to 64 inside): nothing divides evenly.
PALLAS = NormConfig("pallas", block_rows=4, num_warps=4)
CONFIGS = {"xla": NormConfig("xla"), "pallas": PALLAS}


def inputs(shape: tuple[int, ...], dtype: jnp.dtype) -> tuple[jax.Array, jax.Array, jax.Array]:
    kx, kw, kb = jax.random.split(jax.random.key(0), 3)
    width = shape[-1]
    x = (2.0 * jax.random.normal(kx, shape) + 0.5).astype(dtype)
    return x, (1.0 + 0.1 * jax.random.normal(kw, (width,))).astype(dtype), (0.1 * jax.random.normal(kb, (width,))).astype(dtype)


def rms64(x: jax.Array, w: jax.Array, eps: float) -> np.ndarray:
    x, w = np.asarray(x, np.float64), np.asarray(w, np.float64)
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * w


def layer64(x: jax.Array, w: jax.Array, b: jax.Array, eps: float) -> np.ndarray:
    x, w, b = (np.asarray(t, np.float64) for t in (x, w, b))
    centered = x - x.mean(-1, keepdims=True)
    return centered / np.sqrt(np.mean(centered**2, axis=-1, keepdims=True) + eps) * w + b


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("impl", ["xla", "pallas"])
def test_forward_matches_float64(impl: str, dtype: jnp.dtype) -> None:
    x, w, b = inputs((2, 9, 40), dtype)
    cfg = CONFIGS[impl]
    out = rms_norm(x, w, 1e-6, cfg=cfg)
    assert out.dtype == dtype
    assert_close(out, rms64(x, w, 1e-6), dtype)
    assert_close(layer_norm(x, w, b, 1e-5, cfg=cfg), layer64(x, w, b, 1e-5), dtype)


@pytest.mark.parametrize("impl", ["xla", "pallas"])
def test_gradients_match_reference(impl: str) -> None:
    x, w, b = inputs((2, 9, 40), jnp.float32)
    probe = jax.random.normal(jax.random.key(5), x.shape)
    cfg = CONFIGS[impl]

    def rms_loss(norm):
        return lambda x, w: jnp.sum(norm(x, w) * probe)

    def layer_loss(norm):
        return lambda x, w, b: jnp.sum(norm(x, w, b) * probe)

    kernel_rms = rms_loss(lambda x, w: rms_norm(x, w, 1e-6, cfg=cfg))
    reference_rms = rms_loss(lambda x, w: RMSNormKernel().reference(x, w, eps=1e-6))
    for got, want in zip(jax.jit(jax.grad(kernel_rms, (0, 1)))(x, w), jax.jit(jax.grad(reference_rms, (0, 1)))(x, w)):
        assert_close(got, want, jnp.float32, factor=10)

    kernel_layer = layer_loss(lambda x, w, b: layer_norm(x, w, b, 1e-5, cfg=cfg))
    reference_layer = layer_loss(lambda x, w, b: LayerNormKernel().reference(x, w, b, eps=1e-5))
    for got, want in zip(jax.jit(jax.grad(kernel_layer, (0, 1, 2)))(x, w, b), jax.jit(jax.grad(reference_layer, (0, 1, 2)))(x, w, b)):
        assert_close(got, want, jnp.float32, factor=10)


def test_labels_forward_and_backward() -> None:
    x, w, b = inputs((6, 16), jnp.float32)
    assert_labelled(lambda x, w: jnp.sum(rms_norm(x, w) ** 3), (x, w), "rms_norm")
    assert_labelled(lambda x, w, b: jnp.sum(layer_norm(x, w, b) ** 3), (x, w, b), "layer_norm")


def test_rejects_wrong_parameter_shape() -> None:
    x, w, _ = inputs((3, 8), jnp.float32)
    with pytest.raises(ValueError, match=r"^w: expected shape \(8,\)"):  # the argument, not the op
        rms_norm(x, w[:4])


def test_tunes_on_small_space() -> None:
    x, w, b = inputs((21, 40), jnp.float32)
    result = assert_tunes(LayerNormKernel(), (x, w, b), {"eps": 1e-5})
    assert_close(layer_norm(x, w, b, cfg=result.best_cfg), layer64(x, w, b, 1e-5), jnp.float32)


@gpu
@needs_gpu
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
def test_gpu_pallas_real_size(dtype: jnp.dtype) -> None:
    x, w, b = inputs((4, 1000, 4096), dtype)
    assert_close(rms_norm(x, w), rms64(x, w, 1e-6), dtype)
    assert_close(layer_norm(x, w, b), layer64(x, w, b, 1e-5), dtype)
    probe = jax.random.normal(jax.random.key(5), x.shape)
    got = jax.grad(lambda x, w, b: jnp.sum(layer_norm(x, w, b).astype(jnp.float32) * probe), (0, 1, 2))(x, w, b)
    want = jax.grad(
        lambda x, w, b: jnp.sum(LayerNormKernel().reference(x, w, b, eps=1e-5).astype(jnp.float32) * probe), (0, 1, 2)
    )(x, w, b)
    for g, r in zip(got, want):
        assert_close(g, r, dtype, factor=2)
