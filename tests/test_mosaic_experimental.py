"""The experimental entry point of the Mosaic attention kernels (kernels/attention/mosaic/experimental.py).

``mosaic_attention`` with its defaults runs the product's kernels: the same modules as
``flash_attention`` on the ``"mosaic"`` implementation.
"""

from __future__ import annotations

import importlib

import jax
import jax.numpy as jnp
import pytest
from ejlabel.kernels.attention import AttentionConfig, flash_attention
from ejlabel.kernels.attention import mosaic as am
from ejlabel.kernels.attention.mosaic.experimental import mosaic_attention
from kernel_checks import kernel_hashes, lower_for_cuda

pytestmark = pytest.mark.skipif(not am.mosaic_available(), reason="this JAX has no Pallas Mosaic GPU backend")


@pytest.mark.slow  # the probes' entry point, not the product's: lowering both for CUDA takes 10-40 s
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
