"""Flash attention: the reference against float64 NumPy, Pallas against the reference (values and
gradients) under every mask kind, padding safety, labels, tuning; cuDNN and real sizes on the GPU."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ejlabel import BwdParams, FwdParams, Invocation
from ejlabel.kernels.attention import AttentionConfig, AttentionKernel, cu_seqlens_to_segment_ids, flash_attention
from ejlabel.kernels.attention.arg_specs import REAL_SIZE
from ejlabel.kernels.attention.mosaic import on_hopper
from ejlabel.kernels.attention.triton import Geometry

from kernel_checks import assert_close, assert_labelled, assert_tunes, gpu, needs_gpu, values_and_grads

XLA = AttentionConfig("xla")
# 16-row tiles over 40 tokens: the last block of every sequence is partial.
PALLAS = AttentionConfig("pallas", FwdParams(16, 16, 4, 1), BwdParams(16, 16, 4, 1))
SEGMENTS = jnp.array([[1] * 15 + [2] * 20 + [0] * 5, [3] * 40], jnp.int32)
CU_SEQLENS = jnp.array([0, 7, 25, 36], jnp.int32)  # three sequences, 4 padding tokens of 40
# 67 tokens (five 16-blocks, the last partial): four documents and end padding in one row, two
# documents around padding in the other. Blocks 0-2 of row 1 hold one document: block skipping
# by segment and unmasked same-document blocks both occur, beside mixed blocks.
PACKED = jnp.array([[1] * 5 + [2] * 37 + [3] * 13 + [4] * 9 + [0] * 3, [7] * 50 + [0] * 4 + [8] * 13], jnp.int32)
PACKED_CU_SEQLENS = jnp.array([0, 3, 40, 58], jnp.int32)  # 67 tokens: 3 sequences, 9 padding


def qkv(batch: int, seq: int, heads: int, kv_heads: int, dim: int, dtype: Any = jnp.float32) -> tuple[jax.Array, ...]:
    keys = jax.random.split(jax.random.key(0), 3)
    shapes = [(batch, seq, heads, dim), (batch, seq, kv_heads, dim), (batch, seq, kv_heads, dim)]
    return tuple(jax.random.normal(key, shape).astype(dtype) for key, shape in zip(keys, shapes))


def attention64(q: jax.Array, k: jax.Array, v: jax.Array, *, causal: bool = False, segment_ids: Any = None,
                sliding_window: Any = None) -> np.ndarray:
    """The textbook formula, one query at a time, in float64."""
    q, k, v = (np.asarray(t, np.float64) for t in (q, k, v))
    batch, seq, heads, dim = q.shape
    group = heads // k.shape[2]
    out = np.zeros_like(q)
    for b in range(batch):
        for h in range(heads):
            for i in range(seq):
                visible = np.ones(seq, bool)
                j = np.arange(seq)
                if causal:
                    visible &= j <= i
                if sliding_window is not None:
                    visible &= (j >= i - sliding_window[0]) & (j <= i + sliding_window[1])
                if segment_ids is not None:
                    ids = np.asarray(segment_ids[b])
                    visible &= (ids == ids[i]) & (ids[i] > 0)
                if not visible.any():
                    continue
                scores = k[b, visible, h // group] @ q[b, i, h] / np.sqrt(dim)
                weights = np.exp(scores - scores.max())
                out[b, i, h] = weights @ v[b, visible, h // group] / weights.sum()
    return out


CASES = {
    "plain": {},
    "causal": {"causal": True},
    "segments": {"causal": True, "segment_ids": SEGMENTS},
    "window": {"sliding_window": (6, 3)},
}


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("group", [1, 2])
def test_reference_matches_float64(case: str, group: int) -> None:
    q, k, v = qkv(2, 40, 4, 4 // group, 16)
    assert_close(flash_attention(q, k, v, cfg=XLA, **CASES[case]), attention64(q, k, v, **CASES[case]), jnp.float32)


def test_cu_seqlens_are_segments() -> None:
    ids = cu_seqlens_to_segment_ids(CU_SEQLENS, 40)
    assert ids.tolist() == [[1] * 7 + [2] * 18 + [3] * 11 + [0] * 4]
    q, k, v = qkv(1, 40, 4, 2, 16)
    got = flash_attention(q, k, v, causal=True, cu_seqlens=CU_SEQLENS, cfg=XLA)
    assert_close(got, attention64(q, k, v, causal=True, segment_ids=ids), jnp.float32)


@pytest.mark.parametrize(
    "group, kwargs",
    [
        (2, {}),
        (1, {"causal": True}),
        (2, {"causal": True, "segment_ids": PACKED}),
        (4, {"segment_ids": PACKED}),
        (2, {"causal": True, "cu_seqlens": PACKED_CU_SEQLENS}),
        (2, {"sliding_window": (6, 3)}),
    ],
    ids=["plain-gqa2", "causal-mha", "segments-causal-gqa2", "segments-mqa", "cu_seqlens", "window"],
)
def test_pallas_values_and_gradients(group: int, kwargs: dict[str, Any]) -> None:
    batch = 1 if "cu_seqlens" in kwargs else 2
    seq = 67 if "segment_ids" in kwargs or "cu_seqlens" in kwargs else 40
    q, k, v = qkv(batch, seq, 4, 4 // group, 12)  # head dim 12: padded to 16 inside
    out, grads = values_and_grads(PALLAS, q, k, v, **kwargs)
    ref, ref_grads = values_and_grads(XLA, q, k, v, **kwargs)
    assert_close(out, ref, jnp.float32)
    for got, want in zip(grads, ref_grads):
        assert_close(got, want, jnp.float32, factor=5)  # also asserts both are free of NaN
    if "segment_ids" in kwargs:
        # Padding queries see nothing: output 0 and no gradient, in both paths.
        padding = np.asarray(kwargs["segment_ids"]) <= 0
        for o, dq in ((out, grads[0]), (ref, ref_grads[0])):
            assert np.all(np.asarray(o)[padding] == 0.0) and np.all(np.asarray(dq)[padding] == 0.0)


def test_pallas_bfloat16() -> None:
    q, k, v = qkv(2, 40, 4, 2, 16, jnp.bfloat16)
    out = jax.jit(lambda q, k, v: flash_attention(q, k, v, causal=True, cfg=PALLAS))(q, k, v)
    assert out.dtype == jnp.bfloat16
    assert_close(out, attention64(q, k, v, causal=True), jnp.bfloat16)


def test_rejects_bad_arguments() -> None:
    q, k, v = qkv(2, 40, 4, 3, 16)
    with pytest.raises(ValueError, match="kv heads divide"):
        flash_attention(q, k, v)
    q, k, v = qkv(2, 40, 4, 2, 16)
    with pytest.raises(ValueError, match="not both"):
        flash_attention(q, k, v, segment_ids=SEGMENTS, cu_seqlens=CU_SEQLENS)
    with pytest.raises(ValueError, match=r"\[1, total"):
        flash_attention(q, k, v, cu_seqlens=CU_SEQLENS)


def test_labels_forward_and_backward() -> None:
    q, k, v = qkv(1, 16, 2, 1, 8)
    assert_labelled(lambda q, k, v: jnp.sum(flash_attention(q, k, v, causal=True) ** 2), (q, k, v), "flash_attention")


def test_tunes_on_small_space_with_segments() -> None:
    q, k, v = qkv(1, 40, 2, 1, 16)
    result = assert_tunes(AttentionKernel(), (q, k, v), {"causal": True, "segment_ids": SEGMENTS[:1]})
    got = flash_attention(q, k, v, causal=True, segment_ids=SEGMENTS[:1], cfg=result.best_cfg)
    assert_close(got, attention64(q, k, v, causal=True, segment_ids=SEGMENTS[:1]), jnp.float32)


# --------------------------------------------------------------------------------------------
# GPU


def three_documents() -> jax.Array:
    """``[2, 1000]`` ids of the GPU tests (REAL_SIZE): documents of 300, 300 and 300 tokens, then
    100 of padding."""
    batch, seq = REAL_SIZE.batch, REAL_SIZE.seq
    return jnp.broadcast_to(jnp.where(jnp.arange(seq) < 900, 1 + jnp.arange(seq) // 300, 0), (batch, seq)).astype(jnp.int32)


@gpu
@needs_gpu
@pytest.mark.parametrize("impl", ["pallas", "cudnn"])
@pytest.mark.parametrize("kv_heads", [8, 2])
def test_gpu_real_size(impl: str, kv_heads: int) -> None:
    q, k, v = REAL_SIZE.replace(kv_heads=kv_heads).arrays(jax.random.key(0))
    kernel = AttentionKernel()
    cfg = AttentionConfig(impl) if impl == "cudnn" else kernel.heuristic_cfg(Invocation(kernel, (q, k, v), {"causal": True}))
    probe = jax.random.normal(jax.random.key(7), q.shape)

    def grads(cfg: AttentionConfig) -> tuple[Any, Any]:
        loss = lambda q, k, v: jnp.sum(flash_attention(q, k, v, causal=True, cfg=cfg).astype(jnp.float32) * probe)
        return flash_attention(q, k, v, causal=True, cfg=cfg), jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(q, k, v)

    (out, got), (ref, want) = grads(cfg), grads(XLA)
    assert_close(out, ref, jnp.bfloat16)
    for g, w in zip(got, want):
        assert_close(g, w, jnp.bfloat16)


@gpu
@needs_gpu
@pytest.mark.parametrize("kwargs", [{"segment_ids": "segments"}, {"sliding_window": (128, 0)}, {"cu_seqlens": "packed"}])
def test_gpu_pallas_masks_real_size(kwargs: dict[str, Any]) -> None:
    batch = 1 if "cu_seqlens" in kwargs else 2
    q, k, v = REAL_SIZE.replace(batch=batch, kv_heads=2, dim=64).arrays(jax.random.key(0))
    if "segment_ids" in kwargs:
        kwargs = {"segment_ids": three_documents()}
    if "cu_seqlens" in kwargs:
        kwargs = {"cu_seqlens": jnp.array([0, 100, 450, 451, 980], jnp.int32)}
    cfg = AttentionConfig("pallas", FwdParams(128, 64, 4, 3), BwdParams(64, 64, 4, 2))
    for kw in (kwargs, {**kwargs, "causal": True}):
        out = flash_attention(q, k, v, cfg=cfg, **kw)
        assert_close(out, flash_attention(q, k, v, cfg=XLA, **kw), jnp.bfloat16)
        got = jax.grad(lambda q: jnp.sum(flash_attention(q, k, v, cfg=cfg, **kw).astype(jnp.float32) ** 2))(q)
        want = jax.grad(lambda q: jnp.sum(flash_attention(q, k, v, cfg=XLA, **kw).astype(jnp.float32) ** 2))(q)
        assert_close(got, want, jnp.bfloat16)


@gpu
@needs_gpu
def test_gpu_default_with_segments_is_cudnn_with_a_dense_mask() -> None:
    """Untuned, packed documents run where a JAX user's call would: cuDNN with the dense mask,
    and XLA where cuDNN refuses (odd lengths); values and gradients match, padding gets 0."""
    q, k, v = REAL_SIZE.replace(kv_heads=2, dim=64).arrays(jax.random.key(0))
    ids = three_documents()
    kernel = AttentionKernel()
    kwargs = {"causal": True, "segment_ids": ids}
    assert kernel.heuristic_cfg(Invocation(kernel, (q, k, v), kwargs)) == AttentionConfig("cudnn")
    odd = (q[:, :999], k[:, :999], v[:, :999])
    assert kernel.heuristic_cfg(Invocation(kernel, odd, {"causal": True, "segment_ids": ids[:, :999]})) == XLA
    out, grads = values_and_grads(AttentionConfig("cudnn"), q, k, v, **kwargs)
    ref, ref_grads = values_and_grads(XLA, q, k, v, **kwargs)
    assert_close(out, ref, jnp.bfloat16)
    for got, want in zip(grads, ref_grads):
        assert_close(got, want, jnp.bfloat16)
    assert np.all(np.asarray(out, np.float32)[np.asarray(ids) <= 0] == 0.0)


@gpu
@needs_gpu
@pytest.mark.parametrize(
    ("dtype", "kv_heads", "kwargs"),
    [(jnp.bfloat16, 2, {"causal": True}), (jnp.float16, 8, {"causal": True}), (jnp.bfloat16, 2, {}), (jnp.bfloat16, 2, {"causal": True, "segment_ids": "documents"})],
    ids=["causal-gqa", "causal-fp16", "full", "documents"],
)
def test_gpu_cudnn_head_dim_256(dtype: Any, kv_heads: int, kwargs: dict[str, Any]) -> None:
    """Head dim 256, where cuDNN is offered on Hopper: values and gradients match XLA's."""
    q, k, v = REAL_SIZE.replace(kv_heads=kv_heads, dim=256).arrays(jax.random.key(0), dtype)
    if "segment_ids" in kwargs:
        kwargs = {**kwargs, "segment_ids": three_documents()}
    kernel = AttentionKernel()
    assert kernel.candidate_is_valid(Invocation(kernel, (q, k, v), kwargs), AttentionConfig("cudnn")) == on_hopper()
    out, grads = values_and_grads(AttentionConfig("cudnn"), q, k, v, **kwargs)
    ref, ref_grads = values_and_grads(XLA, q, k, v, **kwargs)
    assert_close(out, ref, dtype)
    for got, want in zip(grads, ref_grads):
        assert_close(got, want, dtype)


def test_heuristic_with_segments_off_the_gpu_is_xla() -> None:
    q, k, v = qkv(1, 40, 2, 1, 16, jnp.bfloat16)
    kernel = AttentionKernel()
    inv = Invocation(kernel, (q, k, v), {"causal": True, "segment_ids": SEGMENTS[:1]})
    assert kernel.heuristic_cfg(inv) == (AttentionConfig("cudnn") if jax.default_backend() == "gpu" else XLA)
    assert kernel.candidate_is_valid(inv, AttentionConfig("cudnn")) == (jax.default_backend() == "gpu")
    windowed = Invocation(kernel, (q, k, v), {"sliding_window": (4, 0)})
    assert not kernel.candidate_is_valid(windowed, AttentionConfig("cudnn"))


def test_configs_round_trip_through_json() -> None:
    from ejlabel import from_json, to_json
    from ejlabel.kernels.cross_entropy import CrossEntropyConfig
    from ejlabel.kernels.matmul import MatmulConfig
    from ejlabel.kernels.norms import NormConfig

    for cfg in (PALLAS, MatmulConfig("pallas", 64, 128, 32), NormConfig("pallas", 2, 8), CrossEntropyConfig("pallas", 4, 1024, 4)):
        assert from_json(to_json(cfg)) == cfg


@settings(max_examples=60, deadline=None)
@given(
    block_q=st.sampled_from([16, 32, 64]),
    block_k=st.sampled_from([16, 32, 64]),
    blocks=st.integers(1, 6),
    left=st.one_of(st.none(), st.integers(0, 100)),
    right=st.one_of(st.none(), st.integers(-20, 100)),
    kv_short=st.integers(0, 15),
)
def test_unmasked_block_ranges_are_exactly_the_whole_blocks(
    block_q: int, block_k: int, blocks: int, left: int | None, right: int | None, kv_short: int
) -> None:
    """The blocks the Pallas kernels run without a mask are exactly those every pair sees."""
    seq_q, seq_kv = blocks * block_q, blocks * block_k
    kv_len = seq_kv - kv_short if kv_short else None
    geo = Geometry(1.0, (left, right), block_q, block_k, kv_len, 1)
    q_pos, k_pos = np.arange(seq_q)[:, None], np.arange(seq_kv)[None, :]
    visible = np.ones((seq_q, seq_kv), bool) if kv_len is None else np.broadcast_to(k_pos < kv_len, (seq_q, seq_kv))
    if right is not None:
        visible = visible & (k_pos <= q_pos + right)
    if left is not None:
        visible = visible & (k_pos >= q_pos - left)
    whole = visible.reshape(blocks, block_q, blocks, block_k).all(axis=(1, 3))
    for i in range(blocks):
        lo, hi = (int(x) for x in geo.kv_blocks(jnp.int32(i), blocks))
        hi = max(lo, hi)  # a query block past every key gets lo > hi: an empty loop
        first, last = (int(x) for x in geo.unmasked_kv_blocks(jnp.int32(i), jnp.int32(lo), jnp.int32(hi)))
        assert lo <= first <= last <= hi
        assert [j for j in range(lo, hi) if whole[i, j]] == list(range(first, last))
    for j in range(blocks):
        lo, hi = (int(x) for x in geo.q_blocks(jnp.int32(j), blocks))
        hi = max(lo, hi)
        first, last = (int(x) for x in geo.unmasked_q_blocks(jnp.int32(j), jnp.int32(lo), jnp.int32(hi)))
        assert lo <= first <= last <= hi
        assert [i for i in range(lo, hi) if whole[i, j]] == list(range(first, last))
