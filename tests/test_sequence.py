"""Tests for the ejkernel compatibility helpers (kernels/ejkernel_compat.py): sequence bookkeeping
and numerics, each also run under jit."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from ejlabel.kernels.ejkernel_compat import (
    chunk_array,
    identity_dtype_convert,
    log_sum_exp,
    mask_to_segment_ids,
    prepare_cu_seqlens_from_mask,
    prepare_lens,
    prepare_lens_from_mask,
    safe_divide,
    segment_ids_to_mask,
    unchunk_array,
)

# Shapes stay small and few so each compiled program is reused across examples.
_FAST = settings(max_examples=20, deadline=None)


def _ids_by_first_appearance(rows: np.ndarray) -> np.ndarray:
    """Plain-Python statement of the segment id contract, for one 2-D mask's rows."""
    seen: dict[bytes, int] = {}
    ids = []
    for row in rows:
        if not row.any():
            ids.append(-1)
            continue
        key = row.tobytes()
        if key not in seen:
            seen[key] = len(seen) + 1
        ids.append(seen[key])
    return np.asarray(ids, dtype=np.int32)


# --------------------------------------------------------------------------------------------
# Lengths


def test_prepare_lens():
    cu = jnp.array([0, 3, 3, 10], dtype=jnp.int32)
    for fn in (prepare_lens, jax.jit(prepare_lens)):
        out = fn(cu)
        np.testing.assert_array_equal(out, [3, 0, 7])
        assert out.dtype == jnp.int32


def test_prepare_lens_rejects_bad_shape():
    with pytest.raises(ValueError, match=r"cu_seqlens must be 1-D, got shape \(2, 2\)"):
        prepare_lens(jnp.zeros((2, 2), jnp.int32))
    with pytest.raises(ValueError, match="cu_seqlens must have at least one entry"):
        prepare_lens(jnp.zeros((0,), jnp.int32))


def test_lens_and_cu_seqlens_from_mask():
    mask = jnp.array([[1, 1, 0, 0], [1, 1, 1, 1], [0, 0, 0, 0]], dtype=bool)
    for lens_fn, cu_fn in (
        (prepare_lens_from_mask, prepare_cu_seqlens_from_mask),
        (jax.jit(prepare_lens_from_mask), jax.jit(prepare_cu_seqlens_from_mask)),
    ):
        lens = lens_fn(mask)
        np.testing.assert_array_equal(lens, [2, 4, 0])
        assert lens.dtype == jnp.int32
        cu = cu_fn(mask)
        np.testing.assert_array_equal(cu, [0, 2, 6, 6])
        assert cu.dtype == jnp.int32
    np.testing.assert_array_equal(prepare_lens(prepare_cu_seqlens_from_mask(mask)), [2, 4, 0])


def test_cu_seqlens_out_dtype_and_int_mask():
    mask = jnp.array([[3, 0, 1]], dtype=jnp.int32)  # nonzero counts as valid
    cu = prepare_cu_seqlens_from_mask(mask, out_dtype=jnp.int16)
    assert cu.dtype == jnp.int16
    np.testing.assert_array_equal(cu, [0, 2])


def test_mask_lens_reject_bad_shape():
    with pytest.raises(ValueError, match=r"mask must be 2-D, got shape \(3,\)"):
        prepare_lens_from_mask(jnp.ones((3,), bool))
    with pytest.raises(ValueError, match="mask must be 2-D"):
        prepare_cu_seqlens_from_mask(jnp.ones((1, 2, 3), bool))


# --------------------------------------------------------------------------------------------
# Segment ids -> mask


def test_segment_ids_to_mask_self_attention():
    ids = jnp.array([[1, 1, 2, 0, -1]])
    expected = np.array(
        [
            [1, 1, 0, 0, 0],
            [1, 1, 0, 0, 0],
            [0, 0, 1, 0, 0],
            [0, 0, 0, 0, 0],  # padding attends to nothing, not even other padding
            [0, 0, 0, 0, 0],
        ],
        dtype=bool,
    )[None]
    for fn in (segment_ids_to_mask, jax.jit(segment_ids_to_mask)):
        out = fn(ids)
        assert out.dtype == jnp.bool_
        np.testing.assert_array_equal(out, expected)


def test_segment_ids_to_mask_cross_attention_separate_masks():
    q = jnp.array([[1, 2]])
    kv = jnp.array([[1, 1, 2, 2, -1]])
    fn = jax.jit(
        lambda q, kv: segment_ids_to_mask((q, kv), dtype=jnp.float32, return_separate_masks=True)
    )
    q_mask, kv_mask, attn = fn(q, kv)
    assert q_mask.shape == (1, 2) and kv_mask.shape == (1, 5) and attn.shape == (1, 2, 5)
    assert attn.dtype == jnp.float32
    np.testing.assert_array_equal(q_mask, [[1, 1]])
    np.testing.assert_array_equal(kv_mask, [[1, 1, 1, 1, 0]])
    np.testing.assert_array_equal(attn[0], [[1, 1, 0, 0, 0], [0, 0, 1, 1, 0]])


def test_segment_ids_to_mask_errors():
    with pytest.raises(ValueError, match=r"segment_ids must be 2-D, got shape \(4,\)"):
        segment_ids_to_mask(jnp.ones((4,), jnp.int32))
    with pytest.raises(ValueError, match="kv_segment_ids must be 2-D"):
        segment_ids_to_mask((jnp.ones((1, 4)), jnp.ones((4,))))
    with pytest.raises(ValueError, match="same batch size"):
        segment_ids_to_mask((jnp.ones((1, 4)), jnp.ones((2, 4))))
    with pytest.raises(ValueError, match="tuple of length 3"):
        segment_ids_to_mask((jnp.ones((1, 4)),) * 3)


# --------------------------------------------------------------------------------------------
# Mask -> segment ids

_jit_mask_to_ids = jax.jit(mask_to_segment_ids, static_argnames="per_head")


def test_mask_to_segment_ids_example():
    mask = jnp.array([[1, 1, 0, 0], [1, 1, 0, 0], [0, 0, 0, 0], [0, 0, 1, 0]], dtype=bool)
    q_ids, kv_ids = _jit_mask_to_ids(mask)
    np.testing.assert_array_equal(q_ids, [1, 1, -1, 2])
    np.testing.assert_array_equal(kv_ids, [1, 1, 2, -1])
    assert q_ids.dtype == jnp.int32 and kv_ids.dtype == jnp.int32


def test_mask_to_segment_ids_causal_gives_distinct_ids():
    causal = jnp.tril(jnp.ones((5, 5), bool))
    q_ids, kv_ids = _jit_mask_to_ids(causal)
    np.testing.assert_array_equal(q_ids, [1, 2, 3, 4, 5])
    np.testing.assert_array_equal(kv_ids, [1, 2, 3, 4, 5])


@_FAST
@given(
    mask=hnp.arrays(np.bool_, st.sampled_from([(2, 6, 5), (3, 4, 4)]), elements=st.booleans()),
    sparsify=st.booleans(),
)
def test_mask_to_segment_ids_matches_python_reference(mask, sparsify):
    if sparsify:
        # Random masks rarely repeat rows; copy rows/columns around so groups and empties occur.
        mask = mask.copy()
        mask[:, 1] = mask[:, 0]
        mask[:, -1] = False
        mask[:, :, 2] = mask[:, :, 0]
    q_ids, kv_ids = _jit_mask_to_ids(jnp.asarray(mask))
    for b in range(mask.shape[0]):
        np.testing.assert_array_equal(q_ids[b], _ids_by_first_appearance(mask[b]))
        np.testing.assert_array_equal(kv_ids[b], _ids_by_first_appearance(mask[b].T))


@_FAST
@given(ids=hnp.arrays(np.int32, (2, 8), elements=st.integers(-1, 3)))
def test_segment_ids_round_trip(ids):
    mask = segment_ids_to_mask(jnp.asarray(ids))
    q_ids, kv_ids = _jit_mask_to_ids(mask)
    np.testing.assert_array_equal(segment_ids_to_mask((q_ids, kv_ids)), mask)
    # Recovered ids are canonical: first appearance order, padding -> -1.
    for b in range(ids.shape[0]):
        np.testing.assert_array_equal(q_ids[b], _ids_by_first_appearance(np.asarray(mask[b])))
        assert np.all((q_ids[b] == -1) == (ids[b] <= 0))


def test_mask_to_segment_ids_cross_attention():
    # Segments appear in the same order along queries and keys, so the independently numbered
    # query and key ids line up and reproduce the mask.
    q_seg = jnp.array([[1, 1, 2, 0, 3]])
    kv_seg = jnp.array([[1, 2, 2, 3, 3, -1, 3]])
    mask = segment_ids_to_mask((q_seg, kv_seg))
    q_ids, kv_ids = _jit_mask_to_ids(mask)
    assert q_ids.shape == (1, 5) and kv_ids.shape == (1, 7)
    np.testing.assert_array_equal(segment_ids_to_mask((q_ids, kv_ids)), mask)


def test_mask_to_segment_ids_numbers_queries_and_keys_independently():
    # Documented limitation: when segments come in a different order along the keys, each
    # side is still numbered by its own first appearance, so the ids group correctly but do
    # not pair up across queries and keys.
    mask = segment_ids_to_mask((jnp.array([[1, 2]]), jnp.array([[2, 1]])))
    q_ids, kv_ids = _jit_mask_to_ids(mask)
    np.testing.assert_array_equal(q_ids, [[1, 2]])
    np.testing.assert_array_equal(kv_ids, [[1, 2]])


def test_mask_to_segment_ids_four_dim():
    a = segment_ids_to_mask(jnp.array([[1, 1, 2, 2]]))[0]
    b = segment_ids_to_mask(jnp.array([[1, 2, 2, 2]]))[0]
    mask = jnp.stack([a, b])[None]  # [batch=1, heads=2, 4, 4]

    q_ids, kv_ids = _jit_mask_to_ids(mask, per_head=True)
    assert q_ids.shape == (1, 2, 4) and kv_ids.shape == (1, 2, 4)
    np.testing.assert_array_equal(q_ids[0, 0], [1, 1, 2, 2])
    np.testing.assert_array_equal(q_ids[0, 1], [1, 2, 2, 2])

    # Without per_head only head 0 is read.
    q_ids, kv_ids = _jit_mask_to_ids(mask)
    assert q_ids.shape == (1, 4) and kv_ids.shape == (1, 4)
    np.testing.assert_array_equal(q_ids[0], [1, 1, 2, 2])


def test_mask_to_segment_ids_exact_integer_path(monkeypatch):
    # Very long rows switch the row comparison to int32; force that path on a small mask.
    from ejlabel.kernels import ejkernel_compat

    monkeypatch.setattr(ejkernel_compat, "_EXACT_F32_COUNT", 1)
    mask = np.array([[2, 2, 0], [0, 0, 0], [1, 1, 0], [0, 0, 5]], dtype=np.int32)
    q_ids, kv_ids = mask_to_segment_ids(jnp.asarray(mask))
    np.testing.assert_array_equal(q_ids, [1, -1, 1, 2])
    np.testing.assert_array_equal(kv_ids, [1, 1, 2])


def test_mask_to_segment_ids_errors():
    with pytest.raises(ValueError, match=r"mask must be 2-D, 3-D or 4-D, got shape \(3,\)"):
        mask_to_segment_ids(jnp.ones((3,), bool))
    with pytest.raises(ValueError, match="mask must be 2-D, 3-D or 4-D"):
        mask_to_segment_ids(jnp.ones((1, 1, 1, 2, 2), bool))


# --------------------------------------------------------------------------------------------
# Gradient dtype, chunking


@pytest.mark.parametrize(
    ("x_dtype", "grad_dtype"), [(jnp.float32, jnp.bfloat16), (jnp.bfloat16, jnp.float32)]
)
def test_identity_dtype_convert(x_dtype, grad_dtype):
    convert = identity_dtype_convert(grad_dtype)
    x = jnp.arange(4, dtype=x_dtype)
    np.testing.assert_array_equal(convert(x), x)
    assert convert(x).dtype == x_dtype

    def loss(x):
        return jnp.sum(convert(x).astype(jnp.float32) * 2.0)

    for grad in (jax.grad(loss), jax.jit(jax.grad(loss))):
        g = grad(x)
        assert g.dtype == grad_dtype
        np.testing.assert_array_equal(g.astype(jnp.float32), 2.0)


def test_identity_dtype_convert_pytree():
    convert = identity_dtype_convert(jnp.bfloat16)
    tree = {"a": jnp.ones(2), "b": jnp.ones((1, 3))}
    grads = jax.grad(lambda t: sum(jnp.sum(v) for v in jax.tree.leaves(convert(t))))(tree)
    assert all(g.dtype == jnp.bfloat16 for g in jax.tree.leaves(grads))


@pytest.mark.parametrize(
    ("shape", "chunk", "axis", "expected"),
    [
        ((2, 8, 3), 4, 1, (2, 2, 4, 3)),
        ((2, 8, 3), 1, 1, (2, 8, 1, 3)),
        ((6,), 3, 0, (2, 3)),
        ((2, 3, 8), 2, -1, (2, 3, 4, 2)),
        ((4, 5), 4, 0, (1, 4, 5)),
    ],
)
def test_chunk_round_trip(shape, chunk, axis, expected):
    x = jnp.arange(np.prod(shape)).reshape(shape)
    chunk_fn = jax.jit(chunk_array, static_argnums=(1, 2))
    unchunk_fn = jax.jit(unchunk_array, static_argnums=1)
    chunked = chunk_fn(x, chunk, axis)
    assert chunked.shape == expected
    np.testing.assert_array_equal(unchunk_fn(chunked, axis), x)
    # Chunk c along the axis holds elements [c * chunk, (c + 1) * chunk).
    ax = axis % len(shape)
    first = jnp.take(jnp.take(chunked, 0, axis=ax), 0, axis=ax)
    np.testing.assert_array_equal(first, jnp.take(x, 0, axis=ax))


def test_chunk_errors():
    x = jnp.zeros((2, 10))
    with pytest.raises(ValueError, match=r"length 10, which is not divisible by chunk_size=4"):
        chunk_array(x, 4)
    with pytest.raises(ValueError, match="chunk_size must be a positive int"):
        chunk_array(x, 0)
    with pytest.raises(ValueError, match="chunk_size must be a positive int"):
        chunk_array(x, 2.0)
    with pytest.raises(ValueError, match="axis=2 is out of range"):
        chunk_array(x, 2, axis=2)
    with pytest.raises(ValueError, match=r"x must have at least one dimension"):
        chunk_array(jnp.zeros(()), 1, axis=0)
    with pytest.raises(ValueError, match=r"x must have at least two dimensions"):
        unchunk_array(jnp.zeros((4,)), axis=0)
    with pytest.raises(ValueError, match="axis=2 is out of range"):
        unchunk_array(jnp.zeros((2, 3, 4)), axis=2)


# --------------------------------------------------------------------------------------------
# Numerics

_jit_lse = jax.jit(log_sum_exp, static_argnames=("axis", "keepdims"))
_jit_reference_lse = jax.jit(jax.nn.logsumexp, static_argnames=("axis", "keepdims"))


@_FAST
@given(
    x=hnp.arrays(
        np.float32,
        (3, 5),
        elements=st.floats(-50, 50, width=32),
    ),
    axis=st.sampled_from([-1, 0, None, (0, 1)]),
    keepdims=st.booleans(),
)
def test_log_sum_exp_matches_reference(x, axis, keepdims):
    out = _jit_lse(jnp.asarray(x), axis=axis, keepdims=keepdims)
    ref = _jit_reference_lse(jnp.asarray(x), axis=axis, keepdims=keepdims)
    assert out.shape == ref.shape
    np.testing.assert_allclose(out, ref, rtol=1e-6, atol=1e-6)


def test_log_sum_exp_large_and_masked_rows():
    x = jnp.array(
        [
            [1e30, 1e30, -jnp.inf],
            [-jnp.inf, -jnp.inf, -jnp.inf],
            [1000.0, 0.0, -1000.0],
            [-1e4, -1e4, -jnp.inf],
        ],
        dtype=jnp.float32,
    )
    out = np.asarray(_jit_lse(x))
    assert np.isneginf(out[1])
    np.testing.assert_allclose(out[[0, 2, 3]], [1e30, 1000.0, -1e4 + np.log(2)], rtol=1e-6)
    assert not np.any(np.isnan(out))


def test_log_sum_exp_gradient_of_masked_row_is_zero():
    x = jnp.array([[-jnp.inf, -jnp.inf], [0.0, 0.0]])

    def loss(x):
        lse = log_sum_exp(x)
        return jnp.sum(jnp.where(jnp.isfinite(lse), lse, 0.0))

    g = jax.jit(jax.grad(loss))(x)
    np.testing.assert_array_equal(g, [[0.0, 0.0], [0.5, 0.5]])


def test_log_sum_exp_nan_propagates_and_ints_promote():
    assert np.isnan(log_sum_exp(jnp.array([jnp.nan, 0.0])))
    out = log_sum_exp(jnp.array([0, 0]))
    assert jnp.issubdtype(out.dtype, jnp.floating)
    np.testing.assert_allclose(out, np.log(2.0), rtol=1e-6)


def test_log_sum_exp_keeps_low_precision_dtype():
    assert log_sum_exp(jnp.ones((2, 3), jnp.bfloat16)).dtype == jnp.bfloat16


def test_safe_divide_values():
    a = jnp.array([1.0, 2.0, 3.0, 0.0])
    b = jnp.array([2.0, 0.0, -3.0, 0.0])
    for fn in (safe_divide, jax.jit(safe_divide)):
        np.testing.assert_array_equal(fn(a, b), [0.5, 0.0, -1.0, 0.0])


def test_safe_divide_eps_and_broadcast():
    out = safe_divide(jnp.ones((2, 3)), jnp.array([1e-8, 2.0, 0.0]), eps=1e-6)
    np.testing.assert_array_equal(out, [[0.0, 0.5, 0.0]] * 2)
    with pytest.raises(ValueError, match="eps must be a non-negative number"):
        safe_divide(1.0, 1.0, eps=-1.0)


_safe_divide_grad = jax.jit(jax.grad(lambda a, b: jnp.sum(safe_divide(a, b)), argnums=(0, 1)))


@_FAST
@given(
    a=hnp.arrays(np.float32, (6,), elements=st.floats(-10, 10, width=32)),
    b=hnp.arrays(np.float32, (6,), elements=st.sampled_from([0.0, -0.0, 0.5, -2.0, 1e-3])),
)
def test_safe_divide_gradients_finite(a, b):
    ga, gb = _safe_divide_grad(jnp.asarray(a), jnp.asarray(b))
    assert np.all(np.isfinite(ga)) and np.all(np.isfinite(gb))
    zero = b == 0
    np.testing.assert_array_equal(ga[zero], 0.0)
    np.testing.assert_array_equal(gb[zero], 0.0)
    np.testing.assert_allclose(ga[~zero], 1.0 / b[~zero], rtol=1e-6)
