"""Bad arguments to the kernels' public functions: a clear error naming the argument."""

from __future__ import annotations

import jax.numpy as jnp
import pytest

from ejlabel.kernels.attention import flash_attention
from ejlabel.kernels.cross_entropy import softmax_cross_entropy
from ejlabel.kernels.matmul import matmul
from ejlabel.kernels.norms import NormConfig, layer_norm, rms_norm

F32 = jnp.ones((4, 4), jnp.float32)
QKV = jnp.ones((1, 8, 2, 16), jnp.float32)


@pytest.mark.parametrize(
    "call, argument",
    [
        (lambda: matmul(F32, F32, cfg="fast"), "cfg"),
        (lambda: matmul(F32, F32, cfg=NormConfig()), "cfg"),
        (lambda: matmul(F32.astype(jnp.int32), F32.astype(jnp.int32)), "a"),
        (lambda: rms_norm(F32.astype(jnp.int32), jnp.ones((4,))), "x"),
        (lambda: layer_norm(F32, jnp.ones((4,)), jnp.ones((4,), jnp.int32)), "b"),
        (lambda: softmax_cross_entropy(F32, jnp.ones((4,), jnp.float32)), "labels"),
        (lambda: softmax_cross_entropy(F32, jnp.ones((4,), jnp.int32), ignore_index=1.5), "ignore_index"),
        (lambda: flash_attention(QKV, QKV.astype(jnp.bfloat16), QKV), "q, k, v"),
        (lambda: flash_attention(QKV, QKV, QKV, segment_ids=jnp.ones((1, 8), jnp.float32)), "segment_ids"),
    ],
)
def test_bad_arguments_name_the_argument(call, argument: str):
    with pytest.raises(TypeError, match=f"^{argument}:"):
        call()
