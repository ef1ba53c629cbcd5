"""Cross-entropy: both impls against a float64 formula, ignored labels, gradients, labels, tuning."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ejlabel.kernels.cross_entropy import CrossEntropyConfig, CrossEntropyKernel, softmax_cross_entropy

from kernel_checks import assert_close, assert_labelled, assert_tunes, gpu, needs_gpu

# 13 tokens in blocks of 4, a vocabulary of 70 in chunks of 16: nothing divides evenly.
PALLAS = CrossEntropyConfig("pallas", block_tokens=4, chunk_vocab=16, num_warps=4)
CONFIGS = {"xla": CrossEntropyConfig("xla"), "pallas": PALLAS}


def inputs(tokens: int, vocab: int, dtype: jnp.dtype, ignored: int = 2) -> tuple[jax.Array, jax.Array]:
    kx, kl = jax.random.split(jax.random.key(0))
    logits = (3.0 * jax.random.normal(kx, (tokens, vocab))).astype(dtype)
    labels = jax.random.randint(kl, (tokens,), 0, vocab)
    return logits, labels.at[:ignored].set(-100)


def cross_entropy64(logits: jax.Array, labels: jax.Array) -> np.ndarray:
    x, y = np.asarray(logits, np.float64), np.asarray(labels)
    top = x.max(axis=1)
    lse = top + np.log(np.exp(x - top[:, None]).sum(axis=1))
    picked = x[np.arange(len(y)), np.clip(y, 0, x.shape[1] - 1)]
    return np.where((y >= 0) & (y < x.shape[1]), lse - picked, 0.0)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("impl", ["xla", "pallas"])
def test_matches_float64(impl: str, dtype: jnp.dtype) -> None:
    logits, labels = inputs(13, 70, dtype)
    loss = softmax_cross_entropy(logits, labels, cfg=CONFIGS[impl])
    assert loss.shape == (13,) and loss.dtype == jnp.float32
    # The loss is computed in float32 from the given logits, so even bfloat16 inputs are exact.
    assert_close(loss, cross_entropy64(logits, labels), jnp.float32)
    assert np.all(np.asarray(loss[:2]) == 0.0)


@pytest.mark.parametrize("impl", ["xla", "pallas"])
def test_gradients_match_reference(impl: str) -> None:
    logits, labels = inputs(13, 70, jnp.float32)
    weights = jax.random.uniform(jax.random.key(4), (13,))
    got = jax.jit(jax.grad(lambda x: jnp.sum(softmax_cross_entropy(x, labels, cfg=CONFIGS[impl]) * weights)))(logits)
    want = jax.jit(jax.grad(lambda x: jnp.sum(CrossEntropyKernel().reference(x, labels=labels) * weights)))(logits)
    assert_close(got, want, jnp.float32)
    assert np.all(np.asarray(got[:2]) == 0.0)  # ignored tokens get no gradient


def test_labels_forward_and_backward() -> None:
    logits, labels = inputs(8, 32, jnp.float32)
    assert_labelled(lambda x: jnp.sum(softmax_cross_entropy(x, labels) ** 2), (logits,), "cross_entropy", CrossEntropyKernel.version)


def test_tunes_on_small_space() -> None:
    # A vocabulary of 700: on the GPU the space's chunks of 1024 still fit it (at 70 only the
    # XLA path would), and on the CPU chunks of 16 and 32 leave a partial last chunk.
    logits, labels = inputs(13, 700, jnp.float32, ignored=0)
    result = assert_tunes(CrossEntropyKernel(), (logits,), {"labels": labels})
    assert_close(softmax_cross_entropy(logits, labels, cfg=result.best_cfg), cross_entropy64(logits, labels), jnp.float32)


@gpu
@needs_gpu
@pytest.mark.parametrize("cfg", [None, CrossEntropyConfig("pallas", 4, 2048, 4)], ids=["default", "pallas"])
def test_gpu_pallas_real_size(cfg: CrossEntropyConfig | None) -> None:
    """The executor's pick (the XLA path while untuned) and the Pallas kernel at the config
    tuned on the H100 (bench/results/bench_kernels.cross_entropy.json)."""
    logits, labels = inputs(4096, 32000, jnp.bfloat16, ignored=16)
    assert_close(softmax_cross_entropy(logits, labels, cfg=cfg), cross_entropy64(logits, labels), jnp.float32, factor=10)
    got = jax.grad(lambda x: jnp.sum(softmax_cross_entropy(x, labels, cfg=cfg)))(logits)
    want = jax.grad(lambda x: jnp.sum(CrossEntropyKernel().reference(x, labels=labels)))(logits)
    assert_close(got, want, jnp.bfloat16)
