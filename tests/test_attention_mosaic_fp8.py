"""The 8-bit Mosaic GPU attention forward (kernels/attention/mosaic/fp8.py).

Its error has two parts, held apart here: quantizing ``q``, ``k`` and ``v`` (the reference on
the dequantized inputs against the one on the inputs), and the kernel's own 8-bit products and
probabilities (the kernel against the reference on the dequantized inputs). On the CPU:
quantization, argument checks, lowering to the Mosaic GPU module and values in the Mosaic GPU
interpreter; on a Hopper GPU, values over causal, GQA, segment ids and odd lengths.
"""

from __future__ import annotations

from typing import Any

import hypothesis.extra.numpy as hnp
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from ejlabel import FwdParams
from ejlabel.kernels.attention import mosaic as am
from ejlabel.kernels.attention.mosaic import fp8
from hypothesis import example, given, settings
from hypothesis import strategies as st
from kernel_checks import attention_reference as reference
from kernel_checks import documents, gpu, lower_for_cuda, needs_gpu, needs_hopper, qkv, rel_error

pytestmark = pytest.mark.skipif(not am.mosaic_available(), reason="this JAX has no Pallas Mosaic GPU backend")

# Relative L2 errors on standard normal inputs (see the module docstring): quantizing the
# inputs costs about 0.04, the kernel's own 8-bit steps about 0.02 more.
QUANTIZED_INPUTS = 0.06
KERNEL_OWN = 0.03


def dequantized(x: jax.Array) -> jax.Array:
    x8, descale = fp8.quantize(x)
    return x8.astype(jnp.float32) * descale


def check_errors(out: jax.Array, q: jax.Array, k: jax.Array, v: jax.Array, *, causal: bool, ids: Any, scale: float) -> None:
    want = reference(q, k, v, causal=causal, window=None, segment_ids=ids, scale=scale)
    from_quantized = reference(*(dequantized(x) for x in (q, k, v)), causal=causal, window=None, segment_ids=ids, scale=scale)
    assert out.dtype == q.dtype and out.shape == q.shape
    assert rel_error(out, from_quantized) < KERNEL_OWN
    assert rel_error(out, want) < QUANTIZED_INPUTS


@settings(max_examples=25, deadline=None)
# Subnormal float32 values are left out: XLA flushes them to zero on the CPU and the GPU
# (max|x| of a tensor of them is 0), so no computation in JAX sees them.
@given(hnp.arrays(np.float32, st.tuples(st.integers(1, 40), st.integers(1, 8)), elements=st.floats(-1e4, 1e4, width=32, allow_subnormal=False)))
@example(np.array([[1.6058228e-36]], np.float32))  # max|x| / 448 is subnormal: it was flushed to 0
def test_quantize_keeps_e4m3_precision(x: np.ndarray) -> None:
    x8, descale = fp8.quantize(jnp.asarray(x))
    assert x8.dtype == fp8.FP8
    back = np.asarray(x8.astype(jnp.float32)) * float(descale)
    assert np.all(np.isfinite(back))
    amax = float(np.max(np.abs(x)))
    # Three mantissa bits: half an ulp is 2**-4 of the value; below e4m3's normal range
    # (2**-6 of 448 / amax's scale) the absolute step is 2**-9 in e4m3's units.
    assert np.all(np.abs(back - x) <= 2**-4 * np.abs(x) + 2**-10 * float(descale) + 1e-30)
    assert amax == 0 or abs(np.max(np.abs(back)) - amax) <= 2**-4 * amax


def test_fp8_attention_rejects_what_it_cannot_run() -> None:
    q, k, v = qkv(1, 128, 2, 1, 128, jnp.bfloat16)
    q8, k8, v_t, factors = fp8.quantize_operands(q, k, v)
    forward = lambda *args, **kw: fp8.mosaic_forward_fp8(*args, **{"scale": 0.1, "bounds": (None, 0), **kw})  # noqa: E731
    with pytest.raises(ValueError, match="q: expected float8_e4m3fn"):
        forward(q, k8, v_t, factors)
    with pytest.raises(ValueError, match="v_t: expected the values transposed"):
        forward(q8, k8, fp8.quantize(v)[0], factors)
    with pytest.raises(ValueError, match="scale: the 8-bit forward takes a positive"):
        forward(q8, k8, v_t, factors, scale=-1.0)
    with pytest.raises(ValueError, match="kv_blocksize"):
        forward(q8, k8, v_t, factors, params=FwdParams(kv_blocksize=64))
    with pytest.raises(ValueError, match="descale"):
        forward(q8, k8, v_t, factors[:2])
    with pytest.raises(ValueError, match="head dims 65 to 128"):
        fp8.fp8_attention(*qkv(1, 128, 2, 1, 64, jnp.bfloat16))
    with pytest.raises(NotImplementedError, match="forward-only"):
        jax.grad(lambda q: fp8.fp8_attention(q, k, v, causal=True).astype(jnp.float32).sum())(q)


@pytest.mark.parametrize(("segments", "pingpong"), [(False, True), (True, False)])
def test_fp8_forward_lowers_to_mosaic_gpu(segments: bool, pingpong: bool) -> None:
    q = jax.ShapeDtypeStruct((2, 300, 4, 128), fp8.FP8)
    k = jax.ShapeDtypeStruct((2, 300, 2, 128), fp8.FP8)
    v_t = jax.ShapeDtypeStruct((2, 2, 128, 300), fp8.FP8)
    ids = jax.ShapeDtypeStruct((2, 300), jnp.int32) if segments else None

    def forward(q: jax.Array, k: jax.Array, v_t: jax.Array, ids: jax.Array | None) -> tuple[jax.Array, jax.Array]:
        return fp8.mosaic_forward_fp8(q, k, v_t, jnp.ones(3), ids, scale=0.1, bounds=(None, 0), pingpong=pingpong)

    text = lower_for_cuda(forward, q, k, v_t, ids)
    assert "mosaic_gpu" in text
    # The transposed values' rows are keys, copied in boxes of 128: padded to whole tiles.
    assert "x2x128x384xf8E4M3FN" in text


@pytest.mark.slow
def test_interpreted_fp8_forward() -> None:
    # GQA, causal, segment ids with padding, a length of no whole tiles, head dim 96 (padded).
    q, k, v = qkv(1, 150, 2, 1, 96, jnp.bfloat16, seed=3)
    ids = documents(1, 150, 2, padding=20, seed=2)
    out = fp8.fp8_attention(q, k, v, causal=True, segment_ids=ids, interpret=True)
    check_errors(out, q, k, v, causal=True, ids=ids, scale=96**-0.5)


@gpu
@needs_gpu
@needs_hopper
@pytest.mark.parametrize(
    ("causal", "kv_heads", "dim", "segments"), [(True, 2, 128, False), (True, 4, 96, True), (False, 1, 128, False), (False, 4, 128, True)],
)
def test_gpu_fp8_forward(causal: bool, kv_heads: int, dim: int, segments: bool) -> None:
    q, k, v = qkv(2, 1100, 4, kv_heads, dim, jnp.bfloat16, seed=dim + kv_heads)
    ids = documents(2, 1100, 3, padding=60, seed=1) if segments else None
    out = jax.jit(lambda q, k, v: fp8.fp8_attention(q, k, v, causal=causal, segment_ids=ids))(q, k, v)
    check_errors(out, q, k, v, causal=causal, ids=ids, scale=dim**-0.5)


@gpu
@needs_gpu
@needs_hopper
@pytest.mark.parametrize("pingpong", [True, False])
def test_gpu_fp8_forward_log_sum_exp(pingpong: bool) -> None:
    # The saved log-sum-exp is the true scores' (base 2), whatever the walk.
    q, k, v = qkv(1, 640, 4, 2, 128, jnp.bfloat16, seed=4)
    q8, k8, v_t, factors = fp8.quantize_operands(q, k, v)
    run = jax.jit(lambda q8, k8, v_t, f: fp8.mosaic_forward_fp8(q8, k8, v_t, f, scale=0.08, bounds=(None, 0), pingpong=pingpong))
    _, lse = run(q8, k8, v_t, factors)
    qf, kf = (x8.astype(jnp.float32) * factors[i] for i, x8 in enumerate((q8, k8)))
    scores = jnp.einsum("bqhd,bkhd->bhqk", qf, jnp.repeat(kf, 2, axis=2)) * 0.08
    scores = jnp.where(jnp.tril(jnp.ones((640, 640), bool)), scores, -jnp.inf)
    want = jax.nn.logsumexp(scores, axis=-1) / np.log(2.0)
    np.testing.assert_allclose(np.asarray(lse), np.asarray(want), atol=2e-2)
