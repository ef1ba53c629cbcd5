"""Matmul: XLA and Pallas (interpreted off the GPU) against a float64 product, gradients, labels, tuning."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ejlabel.kernels.matmul import MatmulConfig, MatmulKernel, matmul

from kernel_checks import ON_GPU, assert_close, assert_labelled, assert_tunes, gpu, needs_gpu

# Small tiles, and shapes that are multiples of none of them.
PALLAS = MatmulConfig("pallas", block_m=16, block_n=16, block_k=16, num_warps=4, num_stages=3, group_m=2)


def operands(shape_a: tuple[int, ...], shape_b: tuple[int, ...], dtype: jnp.dtype) -> tuple[jax.Array, jax.Array]:
    ka, kb = jax.random.split(jax.random.key(0))
    return jax.random.normal(ka, shape_a).astype(dtype), jax.random.normal(kb, shape_b).astype(dtype)


def product64(a: jax.Array, b: jax.Array) -> np.ndarray:
    return np.matmul(np.asarray(a, np.float64), np.asarray(b, np.float64))


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("impl", ["xla", "pallas"])
def test_matches_float64(impl: str, dtype: jnp.dtype) -> None:
    a, b = operands((37, 45), (45, 29), dtype)
    cfg = MatmulConfig("xla") if impl == "xla" else PALLAS
    out = matmul(a, b, cfg=cfg)
    assert out.shape == (37, 29) and out.dtype == dtype
    assert_close(out, product64(a, b), dtype)


def test_batched_pallas_with_swizzle_over_partial_group() -> None:
    # 3 x 2 tiles with group_m=2: the last group has a single row of tiles.
    a, b = operands((2, 3, 40, 20), (2, 3, 20, 30), jnp.float32)
    out = matmul(a, b, cfg=MatmulConfig("pallas", 16, 16, 16, 4, 3, group_m=2))
    assert out.shape == (2, 3, 40, 30)
    assert_close(out, product64(a, b), jnp.float32)


def test_gradients_match_reference() -> None:
    a, b = operands((2, 21, 35), (2, 35, 19), jnp.float32)
    weights = jax.random.normal(jax.random.key(3), (2, 21, 19))
    grads = jax.jit(jax.grad(lambda a, b: jnp.sum(matmul(a, b, cfg=PALLAS) * weights), argnums=(0, 1)))(a, b)
    expected = jax.jit(jax.grad(lambda a, b: jnp.sum(jnp.matmul(a, b) * weights), argnums=(0, 1)))(a, b)
    for got, want in zip(grads, expected):
        assert_close(got, want, jnp.float32)


def test_rejects_mismatched_operands() -> None:
    with pytest.raises(ValueError, match="do not multiply"):
        matmul(jnp.ones((3, 4)), jnp.ones((5, 6)))


def test_labels_forward_and_backward() -> None:
    a, b = operands((8, 8), (8, 8), jnp.float32)
    # Squared, so the gradient needs the forward output and keeps it in the program.
    assert_labelled(lambda a, b: jnp.sum(matmul(a, b) ** 2), (a, b), "matmul")


def test_tunes_on_small_space() -> None:
    a, b = operands((40, 24), (24, 36), jnp.float32)
    result = assert_tunes(MatmulKernel(), (a, b))
    assert_close(matmul(a, b, cfg=result.best_cfg), product64(a, b), jnp.float32)


@gpu
@needs_gpu
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16, jnp.float32])
def test_gpu_pallas_heuristic_real_size(dtype: jnp.dtype) -> None:
    a, b = operands((1000, 1536), (1536, 2056), dtype)
    out = matmul(a, b)  # heuristic: the Pallas kernel on the GPU
    assert_close(out, matmul(a, b, cfg=MatmulConfig("xla")), dtype)
    grads = jax.grad(lambda a, b: matmul(a, b).astype(jnp.float32).sum(), argnums=(0, 1))(a, b)
    expected = jax.grad(lambda a, b: jnp.matmul(a, b).astype(jnp.float32).sum(), argnums=(0, 1))(a, b)
    for got, want in zip(grads, expected):
        assert_close(got, want, dtype)
    assert ON_GPU
