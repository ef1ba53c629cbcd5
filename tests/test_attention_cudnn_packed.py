"""cuDNN's packed layout (the ``"cudnn_packed"`` attention): the layout derived from segment ids
against a slow reference, where the tuning space offers it, the arguments it refuses; on a
Hopper GPU, its values and gradients against the dense-mask XLA path at the example model's
packed shape, NaN for rows it cannot say, and the plain model on it."""

from __future__ import annotations

import dataclasses
import importlib
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import ejlabel
from ejlabel import Invocation, examples
from ejlabel.kernels.attention import AttentionConfig, AttentionKernel, flash_attention
from ejlabel.kernels.attention.arg_specs import PACKED
from ejlabel.kernels.attention import cudnn_packed
from ejlabel.kernels.attention.cudnn_packed import packed_layout, packed_runs
from ejlabel.kernels.attention.mosaic import on_hopper

from kernel_checks import assert_close, gpu, values_and_grads

attention_module = importlib.import_module("ejlabel.kernels.attention")
CUDNN_PACKED = AttentionConfig("cudnn_packed")
XLA = AttentionConfig("xla")
needs_hopper = pytest.mark.skipif(not on_hopper(), reason="cuDNN's packed layout needs a Hopper GPU")


def layout_reference(ids: np.ndarray, runs: int, causal: bool) -> tuple[list[list[int]], list[list[int]], list[bool]]:
    """``(lengths, starts, fits)`` one token at a time: a run ends where the id changes, every id
    ``<= 0`` being one padding id; causal, padding extends the run before it."""
    lengths, starts, fits = [], [], []
    for row in ids.tolist():
        row = [i if i > 0 else 0 for i in row]
        found: list[tuple[int, int, int]] = []  # (id of its first token, start, length)
        for position, i in enumerate(row):
            if found and (row[position - 1] == i or (causal and i == 0)):
                found[-1] = (found[-1][0], found[-1][1], found[-1][2] + 1)
            else:
                found.append((i, position, 1))
        named = [i for i, _, _ in found if i > 0]
        fits.append(len(found) <= runs and len(named) == len(set(named)))
        kept = found[:runs]
        lengths.append([n for _, _, n in kept] + [-1] * (runs - len(kept)))
        starts.append([s for _, s, _ in kept] + [-1] * (runs + 1 - len(kept)))
    return lengths, starts, fits


@st.composite
def segment_rows(draw: st.DrawFn) -> np.ndarray:
    """Rows of runs of ids: documents in order, repeated ids, padding of ids 0 and -1 anywhere."""
    batch, seq = draw(st.integers(1, 3)), draw(st.integers(1, 40))
    rows = []
    for _ in range(batch):
        row: list[int] = []
        while len(row) < seq:
            row += [draw(st.integers(-1, 5))] * draw(st.integers(1, 12))
        rows.append(row[:seq])
    return np.asarray(rows, np.int32)


@settings(max_examples=50, deadline=None)
@given(ids=segment_rows(), runs=st.integers(1, 9), causal=st.booleans())
def test_packed_layout_matches_the_slow_reference(ids: np.ndarray, runs: int, causal: bool) -> None:
    layout = jax.jit(packed_layout, static_argnums=1, static_argnames="causal")(jnp.asarray(ids), runs, causal=causal)
    lengths, starts, fits = layout_reference(ids, runs, causal)
    assert layout.lengths.dtype == layout.starts.dtype == jnp.int32  # what cuDNN's module takes
    assert layout.lengths.tolist() == lengths
    assert layout.starts.tolist() == starts
    assert layout.fits.tolist() == fits


def test_packed_layout_of_documents_and_padding() -> None:
    ids = jnp.array([[1, 1, 1, 2, 2, 0, 0, 3], [0, 0, 7, 7, 7, 7, 7, 0]], jnp.int32)
    # Every position belongs to a run. Not causal, padding runs are runs of their own.
    layout = packed_layout(ids, packed_runs(3, causal=False), causal=False)
    assert layout.lengths.tolist() == [[3, 2, 2, 1, -1, -1, -1], [2, 5, 1, -1, -1, -1, -1]]
    assert layout.starts.tolist() == [[0, 3, 5, 7, -1, -1, -1, -1], [0, 2, 7, -1, -1, -1, -1, -1]]
    assert layout.fits.tolist() == [True, True]
    # Causal, padding closes the run before it (whose queries never see it); leading padding
    # is a run of its own.
    layout = packed_layout(ids, packed_runs(3, causal=True), causal=True)
    assert layout.lengths.tolist() == [[3, 4, 1, -1], [2, 6, -1, -1]]
    assert layout.starts.tolist() == [[0, 3, 7, -1, -1], [0, 2, -1, -1, -1]]
    # An id in two runs, and more runs than the layout holds, are rows it cannot say.
    broken = jnp.array([[1, 1, 2, 1], [1, 2, 3, 4], [1, 1, 0, 1]], jnp.int32)
    assert packed_layout(broken, 3, causal=True).fits.tolist() == [False, False, False]
    assert packed_layout(broken, 3, causal=False).fits.tolist() == [False, False, False]


def test_runs_hold_every_row_of_max_documents() -> None:
    assert packed_runs(4, causal=True) == 5  # padding before the first document
    assert packed_runs(4, causal=False) == 9  # padding before, between and after four documents
    for bad in (0, -1, 2.0, True, None):
        with pytest.raises(ValueError, match="max_documents"):
            packed_runs(bad, causal=True)  # type: ignore[arg-type]


def test_flash_attention_checks_max_documents() -> None:
    q = jnp.zeros((1, 8, 2, 16), jnp.bfloat16)
    ids = jnp.ones((1, 8), jnp.int32)
    for bad in (0, 1.5, "4", True):
        with pytest.raises(ValueError, match="max_documents: expected an int >= 1"):
            flash_attention(q, q, q, segment_ids=ids, max_documents=bad)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="max_documents: counts the documents of segment_ids"):
        flash_attention(q, q, q, max_documents=2)
    with pytest.raises(ValueError, match="cudnn_packed implementation takes segment ids with max_documents"):
        flash_attention(q, q, q, segment_ids=ids, cfg=CUDNN_PACKED)
    # Everywhere else the count changes nothing.
    values = jax.random.normal(jax.random.key(0), q.shape, jnp.float32)
    two = jnp.array([[1] * 5 + [2] * 3], jnp.int32)
    with_count = flash_attention(values, values, values, causal=True, segment_ids=two, max_documents=np.int64(2), cfg=XLA)
    assert np.array_equal(with_count, flash_attention(values, values, values, causal=True, segment_ids=two, cfg=XLA))


def packed_call(**kwargs: Any) -> Invocation[AttentionConfig, jax.Array]:
    batch = 1 if "cu_seqlens" in kwargs else 2
    q = jax.ShapeDtypeStruct((batch, 64, 4, 64), kwargs.pop("dtype", jnp.bfloat16))
    kv = jax.ShapeDtypeStruct((batch, 64, 2, 64), q.dtype)
    return Invocation(AttentionKernel(), (q, kv, kv), {"causal": True, **kwargs})


IDS = jax.ShapeDtypeStruct((2, 64), jnp.int32)
CU = jax.ShapeDtypeStruct((4,), jnp.int32)


@pytest.mark.parametrize("hopper", [True, False])
def test_tuning_space_offers_the_packed_layout_on_a_gpu_for_packed_calls(monkeypatch: pytest.MonkeyPatch, hopper: bool) -> None:
    monkeypatch.setattr(attention_module, "on_gpu", lambda: True)
    monkeypatch.setattr(attention_module, "on_hopper", lambda: hopper)
    monkeypatch.setattr(attention_module, "GROUPED_HEADS", True)  # the JAX the GPU runs
    kernel = AttentionKernel()
    for inv in (packed_call(segment_ids=IDS, max_documents=4), packed_call(cu_seqlens=CU)):
        assert CUDNN_PACKED in kernel.config_space(inv)
        assert kernel.candidate_is_valid(inv, CUDNN_PACKED) == hopper  # cuDNN runs it from Hopper on
        assert kernel.config_for(inv, "cudnn_packed") == CUDNN_PACKED
    # Without packed documents, or without their count (which sizes cuDNN's call), it is not offered.
    for inv in (packed_call(), packed_call(segment_ids=IDS)):
        assert CUDNN_PACKED not in kernel.config_space(inv)
        assert not kernel.candidate_is_valid(inv, CUDNN_PACKED)
        assert kernel.config_for(inv, "cudnn_packed") is None  # use_implementation leaves it alone
    # Nor what cuDNN does not take: float32, a window, a head dim over 256.
    for inv in (
        packed_call(segment_ids=IDS, max_documents=4, dtype=jnp.float32),
        packed_call(segment_ids=IDS, max_documents=4, sliding_window=(8, 0)),
    ):
        assert not kernel.candidate_is_valid(inv, CUDNN_PACKED)
    # The untuned default stays what jax.nn.dot_product_attention gives: cuDNN with a dense mask;
    # on Hopper tuning tries the packed layout first, then the Mosaic kernels.
    inv = packed_call(segment_ids=IDS, max_documents=4)
    assert kernel.heuristic_cfg(inv).impl in ("cudnn", "xla")
    prior = list(kernel.prior_configs(inv))
    assert (prior[:1] == [CUDNN_PACKED] and {cfg.impl for cfg in prior[1:]} == {"mosaic"}) if hopper else prior == []
    assert all(cfg.impl == "mosaic" for cfg in kernel.prior_configs(packed_call(segment_ids=IDS)))


def test_grouped_heads_wait_for_a_jax_that_places_them(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(attention_module, "on_gpu", lambda: True)
    monkeypatch.setattr(attention_module, "on_hopper", lambda: True)
    monkeypatch.setattr(attention_module, "GROUPED_HEADS", False)
    kernel = AttentionKernel()
    assert not kernel.candidate_is_valid(packed_call(segment_ids=IDS, max_documents=4), CUDNN_PACKED)  # 4 query, 2 kv heads
    q = jax.ShapeDtypeStruct((2, 64, 4, 64), jnp.bfloat16)
    assert kernel.candidate_is_valid(Invocation(kernel, (q, q, q), {"causal": True, "segment_ids": IDS, "max_documents": 4}), CUDNN_PACKED)
    monkeypatch.setattr(cudnn_packed, "GROUPED_HEADS", False)
    q, kv = jnp.zeros((1, 8, 4, 16), jnp.bfloat16), jnp.zeros((1, 8, 2, 16), jnp.bfloat16)
    with pytest.raises(ValueError, match="grouped heads"):
        cudnn_packed.attention_cudnn_packed(q, kv, kv, jnp.ones((1, 8), jnp.int32), scale=1.0, causal=True, max_documents=1)


def test_tuning_space_off_the_gpu_has_no_packed_layout(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(attention_module, "on_gpu", lambda: False)
    monkeypatch.setattr(attention_module, "on_hopper", lambda: False)
    kernel = AttentionKernel()
    inv = packed_call(segment_ids=IDS, max_documents=4)
    assert all(cfg.impl != "cudnn_packed" for cfg in kernel.config_space(inv))
    assert not kernel.candidate_is_valid(inv, CUDNN_PACKED)


def test_tuning_inputs_keep_the_promised_count() -> None:
    kernel = AttentionKernel()
    for promised, expected in ((1, 1), (2, 2), (8, 4)):
        inv = Invocation(kernel, (jax.ShapeDtypeStruct((2, 64, 2, 16), jnp.float32),) * 3, {"segment_ids": IDS, "max_documents": promised})
        _, kwargs = kernel.make_inputs(inv, jax.random.key(0))
        ids = np.asarray(kwargs["segment_ids"])
        assert {len(set(row[row > 0].tolist())) for row in ids} == {expected}


def test_calls_without_the_count_keep_their_call_keys() -> None:
    """``max_documents`` reaches the kernel only when given, so call keys (and tuned configs) of
    the calls that do not give it are those they had."""
    q = jnp.zeros((1, 8, 2, 16), jnp.float32)
    ids = jnp.ones((1, 8), jnp.int32)
    ejlabel.clear_invocations()
    with ejlabel.recording():
        flash_attention(q, q, q, segment_ids=ids)
        flash_attention(q, q, q, segment_ids=ids, max_documents=1)
    without, with_count = ejlabel.get_invocations()
    assert "max_documents" not in without.kwargs and with_count.kwargs["max_documents"] == 1
    assert without.call_key != with_count.call_key


def test_the_count_travels_in_the_program() -> None:
    """An HLO program alone rebuilds the call with its count, so offline tuning can offer the
    packed layout too."""
    from ejlabel.analysis import invocations_from_program

    q = jax.ShapeDtypeStruct((2, 16, 2, 8), jnp.bfloat16)
    lowered = jax.jit(lambda q, ids: flash_attention(q, q, q, causal=True, segment_ids=ids, max_documents=3)).lower(q, IDS.update(shape=(2, 16)))
    ((label, inv),) = invocations_from_program(lowered).items()
    assert inv.kwargs["max_documents"] == 3 and label.endswith(inv.call_key)


# --------------------------------------------------------------------------------------------
# GPU (Hopper)


def random_documents(key: jax.Array, batch: int, seq: int, documents: int, padding: int = 0) -> jax.Array:
    """``[batch, seq]`` ids of ``documents`` documents of random lengths per row, as the example
    model packs them, the last ``padding`` tokens of each row padding (id 0)."""
    used = seq - padding
    cuts = jax.vmap(lambda k: jnp.sort(jax.random.permutation(k, jnp.arange(1, used))[: documents - 1]))(jax.random.split(key, batch))
    ids = 1 + jax.vmap(lambda c: jnp.searchsorted(c, jnp.arange(seq), side="right"))(cuts).astype(jnp.int32)
    return jnp.where(jnp.arange(seq) < used, ids, 0)


@gpu
@needs_hopper
@pytest.mark.parametrize(
    ("causal", "padding", "dtype"),
    [(True, 0, jnp.bfloat16), (True, 200, jnp.bfloat16), (False, 200, jnp.bfloat16), (True, 0, jnp.float16)],
    ids=["model", "causal-padding", "full-padding", "fp16"],
)
def test_gpu_values_and_gradients_match_the_dense_mask(causal: bool, padding: int, dtype: Any) -> None:
    """The example model's packed shape (B8 S2048 H12/4 D64, 4 documents of random lengths per
    row): values and gradients of cuDNN's packed layout against the dense-mask XLA path; padding
    gets output and gradient 0."""
    q, k, v = PACKED.arrays(jax.random.key(0), dtype)
    ids = random_documents(jax.random.key(1), PACKED.batch, PACKED.seq, PACKED.documents, padding)
    kwargs = {"causal": causal, "segment_ids": ids, "max_documents": PACKED.documents}
    out, grads = values_and_grads(CUDNN_PACKED, q, k, v, **kwargs)
    ref, ref_grads = values_and_grads(XLA, q, k, v, **kwargs)
    assert_close(out, ref, dtype)
    for got, want in zip(grads, ref_grads):
        assert_close(got, want, dtype)
    pad = np.asarray(ids) <= 0
    for array in (out, *grads):
        assert np.all(np.asarray(array, np.float32)[pad] == 0.0)


@gpu
@needs_hopper
def test_gpu_padding_anywhere_cu_seqlens_and_rows_it_cannot_say() -> None:
    q, k, v = PACKED.replace(batch=2, seq=1024).arrays(jax.random.key(0))
    # Padding before, between and after documents (ids 0 and -1), causal and not.
    ids = jnp.array([[0] * 30 + [1] * 200 + [-1] * 50 + [2] * 600 + [0] * 144, [5] * 300 + [6] * 300 + [0] * 24 + [7] * 400], jnp.int32)
    for causal in (True, False):
        out, grads = values_and_grads(CUDNN_PACKED, q, k, v, causal=causal, segment_ids=ids, max_documents=3)
        ref, ref_grads = values_and_grads(XLA, q, k, v, causal=causal, segment_ids=ids)
        assert_close(out, ref, jnp.bfloat16)
        for got, want in zip(grads, ref_grads):
            assert_close(got, want, jnp.bfloat16)
        for array in (out, *grads):
            assert np.all(np.asarray(array, np.float32)[np.asarray(ids) <= 0] == 0.0)
    q, k, v = (x[:1] for x in (q, k, v))
    cu = jnp.array([0, 100, 450, 451, 980], jnp.int32)
    out, grads = values_and_grads(CUDNN_PACKED, q, k, v, causal=True, cu_seqlens=cu)
    ref, ref_grads = values_and_grads(XLA, q, k, v, causal=True, cu_seqlens=cu)
    assert_close(out, ref, jnp.bfloat16)
    for got, want in zip(grads, ref_grads):
        assert_close(got, want, jnp.bfloat16)
    # Rows the layout cannot say get NaN, never quiet values: one document promised to a causal
    # call holds two runs (leading padding, one document), so the second row's three runs and
    # the third row's id in two runs do not fit; the first row's two runs do.
    q, k, v = PACKED.replace(batch=3, seq=256).arrays(jax.random.key(0))
    ids = jnp.array([[1] * 128 + [2] * 128, [1] * 64 + [2] * 64 + [0] * 64 + [3] * 64, [1] * 64 + [2] * 128 + [1] * 64], jnp.int32)
    out = np.asarray(flash_attention(q, k, v, causal=True, segment_ids=ids, max_documents=1, cfg=CUDNN_PACKED), np.float32)
    assert np.all(np.isfinite(out[0])) and np.all(np.isnan(out[1])) and np.all(np.isnan(out[2]))


@gpu
@needs_hopper
def test_gpu_labelled_and_picked_by_the_tuner() -> None:
    q, k, v = PACKED.replace(batch=2).arrays(jax.random.key(0))
    ids = random_documents(jax.random.key(1), 2, PACKED.seq, PACKED.documents)
    loss = lambda q, k, v: jnp.sum(flash_attention(q, k, v, causal=True, segment_ids=ids, max_documents=4, cfg=CUDNN_PACKED).astype(jnp.float32))
    labels = ejlabel.find_labels_in_lowered(jax.jit(jax.grad(loss, argnums=(0, 1, 2))).lower(q, k, v))
    assert any(label.startswith("ejkernel_ops#flash_attention@v") for label in labels), labels
    kernel = AttentionKernel()
    inv = Invocation(kernel, (q, k, v), {"causal": True, "segment_ids": ids, "max_documents": 4})
    assert CUDNN_PACKED in [cfg for cfg in kernel.config_space(inv) if kernel.candidate_is_valid(inv, cfg)]


@gpu
@needs_hopper
def test_gpu_plain_model_on_the_packed_layout_matches_the_dense_mask() -> None:
    """The packed model's two plain baselines compute one loss and one gradient; the labelled
    model forced onto the packed layout does too."""
    cfg = dataclasses.replace(examples.GPU_125M_PACKED, n_layers=2)
    params = examples.init_params(cfg, jax.random.key(0))
    batch = examples.example_batch(cfg, jax.random.key(1))
    grads = lambda ops: jax.jit(jax.value_and_grad(examples.loss_fn), static_argnums=(2, 3))(params, batch, cfg, ops)
    (dense, dense_grads), (layout, layout_grads) = grads(examples.PLAIN_OPS), grads(examples.PLAIN_CUDNN_PACKED_OPS)
    with ejlabel.use_implementation("cudnn_packed"):
        labelled, labelled_grads = grads(examples.KERNEL_OPS)
    for loss, tree in ((layout, layout_grads), (labelled, labelled_grads)):
        assert abs(float(loss) - float(dense)) < 1e-2 * abs(float(dense))
        for got, want in zip(jax.tree_util.tree_leaves(tree), jax.tree_util.tree_leaves(dense_grads)):
            assert_close(got, want, jnp.bfloat16, factor=2)
