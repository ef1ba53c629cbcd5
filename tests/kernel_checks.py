"""Checks shared by the kernel tests: relative errors, labels in a lowered program, tuning, documents,
and the Mosaic attention tests' inputs, reference, lowering and interpreter race detector."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import ejlabel
from ejlabel.kernels.attention import AttentionConfig, flash_attention
from ejlabel.kernels.attention.masks import window_bounds
from ejlabel import BwdParams, FwdParams
from ejlabel.kernels.attention.mosaic import kernel as mosaic_kernel
from ejlabel.kernels.attention.mosaic import on_hopper
from ejlabel.kernels.attention.mosaic import plan as mosaic_plan
from ejlabel.kernels.attention.mosaic.experimental import mosaic_attention
from ejlabel.kernels.attention.xla import attention_xla

ON_GPU = jax.default_backend() == "gpu"
needs_hopper = pytest.mark.skipif(not on_hopper(), reason="needs a Hopper GPU")  # where the Mosaic kernels run
gpu = pytest.mark.gpu
needs_gpu = pytest.mark.skipif(not ON_GPU, reason="needs a CUDA GPU")

# Relative L2 error allowed against the reference, by input dtype.
TOLERANCE = {"float32": 1e-5, "bfloat16": 2e-2, "float16": 5e-3}
# On the GPU float32 dots run in TF32, like XLA's by default.
TOLERANCE_GPU = {"float32": 2e-3, "bfloat16": 2e-2, "float16": 5e-3}


def tolerance(dtype: Any) -> float:
    return (TOLERANCE_GPU if ON_GPU else TOLERANCE)[np.dtype(dtype).name]


def rel_error(x: Any, ref: Any) -> float:
    """``|x - ref| / |ref|`` in float64 (Frobenius norms), 0 when both are zero."""
    x64, r64 = np.asarray(x, np.float64), np.asarray(ref, np.float64)
    assert x64.shape == r64.shape, (x64.shape, r64.shape)
    assert np.all(np.isfinite(x64)), "non-finite values in the output"
    scale = np.linalg.norm(r64)
    return float(np.linalg.norm(x64 - r64) / (scale if scale > 0 else 1.0))


def assert_close(x: Any, ref: Any, dtype: Any, factor: float = 1.0) -> None:
    err = rel_error(x, ref)
    assert err < factor * tolerance(dtype), f"relative error {err:.3g} over {factor * tolerance(dtype):.3g}"


def assert_labelled(loss: Callable[..., Any], args: tuple[Any, ...], op: str, version: str = "1") -> None:
    """``jit(grad(loss))`` carries the forward label of ``op`` at ``version``, and its backward ops
    are labelled.

    A path with a custom VJP labels its backward ``<op>.bwd``; a path JAX differentiates itself
    (the XLA paths) carries the forward label onto the transposed ops, which JAX names
    ``transpose_jvp_...``.
    """
    from ejlabel.analysis import parse_hlo
    from ejlabel.core.label_format import LABEL_ATTRIBUTE

    lowered = jax.jit(jax.grad(loss, argnums=tuple(range(len(args))))).lower(*args)
    labels = ejlabel.find_labels_in_lowered(lowered)
    assert any(lab.startswith(f"ejkernel_ops#{op}@v{version}:") for lab in labels), labels
    if any(f"{op}.bwd@v{version}:" in lab for lab in labels):
        return
    module = parse_hlo(lowered.compiler_ir("hlo").as_hlo_text())
    transposed = [i for i in module.instructions() if i.name.startswith("transpose") and f"#{op}@v{version}:" in i.frontend_attributes.get(LABEL_ATTRIBUTE, "")]
    assert transposed, f"no backward op of {op} is labelled: {labels}"


def assert_tunes(kernel: ejlabel.Kernel, args: tuple[Any, ...], kwargs: dict[str, Any] | None = None) -> Any:
    """Tune on the CPU over the kernel's small space; every candidate is accounted for."""
    inv = ejlabel.Invocation(kernel, args, kwargs or {})
    policy = ejlabel.AutotunePolicy(num_warmup=1, num_iters=3, compile_workers=2)
    result = ejlabel.Autotuner(policy).tune(inv)
    assert len(result.candidates) >= 2
    for candidate in result.candidates:
        assert candidate.status in ("ok", "pruned") or candidate.reason, candidate
    assert result.best.status == "ok"
    return result


def values_and_grads(cfg: AttentionConfig, q: jax.Array, k: jax.Array, v: jax.Array, **kwargs: Any) -> tuple[Any, Any]:
    """``(output, (dq, dk, dv))`` of a random projection of the output, in one jitted call."""
    probe = jax.random.normal(jax.random.key(7), q.shape)

    def loss(q: jax.Array, k: jax.Array, v: jax.Array) -> tuple[jax.Array, jax.Array]:
        out = flash_attention(q, k, v, cfg=cfg, **kwargs)
        return jnp.sum(out.astype(jnp.float32) * probe), out

    (_, out), grads = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True))(q, k, v)
    return out, grads


def documents(batch: int, seq: int, count: int, padding: int, seed: int = 0) -> jax.Array:
    """``[batch, seq]`` ids of ``count`` contiguous documents of random lengths, then padding (0)."""
    rng = np.random.default_rng(seed)
    rows = []
    for _ in range(batch):
        cuts = np.sort(rng.choice(np.arange(1, seq - padding), size=count - 1, replace=False)) if count > 1 else np.array([], int)
        ids = np.zeros(seq, np.int32)
        ids[: seq - padding] = 1 + np.searchsorted(cuts, np.arange(seq - padding), side="right")
        rows.append(ids)
    return jnp.asarray(np.stack(rows))


# --------------------------------------------------------------------------------------------
# The Mosaic attention tests (test_attention_mosaic.py, test_mosaic_experimental.py)


def qkv(batch: int, seq: int, heads: int, kv_heads: int, dim: int, dtype: Any, seed: int = 0) -> tuple[jax.Array, ...]:
    """Standard normal ``q [batch, seq, heads, dim]`` and ``k, v [batch, seq, kv_heads, dim]``."""
    keys = jax.random.split(jax.random.key(seed), 3)
    shapes = ((batch, seq, heads, dim), (batch, seq, kv_heads, dim), (batch, seq, kv_heads, dim))
    return tuple(jax.random.normal(kk, s, jnp.float32).astype(dtype) for kk, s in zip(keys, shapes))


def dense_visibility(seq_q: int, seq_kv: int, causal: bool, window: Any, segment_ids: jax.Array | None, kv_len: int | None) -> np.ndarray:
    """``[batch (1 without ids), seq_q, seq_kv]`` bool: which (query, key) pairs see each other
    under causal bounds or a window, padded keys past ``kv_len`` and segment ids (ids <= 0 see
    nothing)."""
    left, right = window_bounds(causal, window)
    i, j = np.arange(seq_q)[:, None], np.arange(seq_kv)[None, :]
    visible = np.ones((seq_q, seq_kv), bool)
    if right is not None:
        visible &= j <= i + right
    if left is not None:
        visible &= j >= i - left
    if kv_len is not None:
        visible &= j < kv_len
    visible = np.broadcast_to(visible, (1 if segment_ids is None else segment_ids.shape[0], seq_q, seq_kv)).copy()
    if segment_ids is not None:
        ids = np.asarray(segment_ids)
        visible &= (ids[:, :seq_q, None] == ids[:, None, :seq_kv]) & (ids[:, :seq_q, None] > 0)
    return visible


def attention_reference(q: jax.Array, k: jax.Array, v: jax.Array, *, causal: bool, window: Any, segment_ids: Any, scale: float) -> jax.Array:
    """The XLA implementation's masked softmax in float32."""
    f32 = [t.astype(jnp.float32) for t in (q, k, v)]
    return attention_xla(*f32, segment_ids, scale=scale, bounds=window_bounds(causal, window))


def lower_for_cuda(fn: Any, *args: Any) -> str:
    """``fn``'s program lowered for CUDA (no GPU needed), as StableHLO text."""
    return jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",)).as_text()


def kernel_hashes(text: str) -> list[str]:
    """The hash of every Mosaic GPU module in a lowered program's text, in order."""
    return re.findall(r'kernel_hash = "((?:[^"\\]|\\.)*)"', text)


@pytest.fixture
def races(monkeypatch: pytest.MonkeyPatch) -> Iterator[Callable[[], bool]]:
    """The Mosaic GPU interpreter with its race detector on; the returned function tells whether
    it found an access the kernels' barriers leave unordered."""
    from jax._src.pallas.mosaic_gpu.interpret import gpu_callbacks

    params_type = type(mosaic_kernel.interpret_params())
    monkeypatch.setattr(mosaic_kernel, "interpret_params", lambda: params_type(detect_races=True))
    yield lambda: gpu_callbacks.get_races().races_found


def interpreted_values_and_gradients(
    q: jax.Array, k: jax.Array, v: jax.Array, ids: jax.Array, params: tuple[FwdParams, BwdParams], probe: jax.Array,
    pingpong_dq: bool = False, pingpong_dkv: bool = False,
) -> tuple[jax.Array, tuple[jax.Array, ...]]:
    """Causal attention with segment ids in the Mosaic GPU interpreter, its output and its
    gradients along ``probe``, checked against the float32 reference; returns both (with
    ``pingpong_dq`` and ``pingpong_dkv``, the gradients of the kernels whose consumers take
    turns)."""
    attend = lambda q, k, v: mosaic_attention(  # noqa: E731
        q, k, v, causal=True, segment_ids=ids, params=params, interpret=True, pingpong_dq=pingpong_dq,
        pingpong_dkv=pingpong_dkv,
    )
    out, vjp = jax.vjp(attend, q, k, v)
    grads = vjp(probe.astype(out.dtype))
    f32 = tuple(t.astype(jnp.float32) for t in (q, k, v))
    scale = q.shape[3] ** -0.5
    want, want_vjp = jax.vjp(lambda q, k, v: attention_reference(q, k, v, causal=True, window=None, segment_ids=ids, scale=scale), *f32)
    assert rel_error(out, want) < 1e-2
    for got, expected in zip(grads, want_vjp(probe)):
        assert rel_error(got, expected) < 2e-2
    return out, grads


def check_interpreted_backward(races: Callable[[], bool], group: int = 2, pingpong: bool = False) -> None:
    """Three tiles of ``group`` query heads (a head group) over three programs (each walks
    several), three documents and padding, in the interpreter: values and gradients against the
    reference, no races, and padding rows exactly 0. Some tiles visit masked blocks on both sides of an
    unmasked run (asserted): the producer and the consumers must agree on the order of the walk.
    The interpreter's race detector must find no access that the kernels' barriers leave
    unordered. ``pingpong``: both backward kernels' consumers take turns."""
    seq, dim = 384, 64
    q, k, v = qkv(1, seq, group, 1, dim, jnp.bfloat16, seed=13)
    position = jnp.arange(seq)
    ids = jnp.where(position < seq - 11, 1 + (position >= 30) + (position >= 340), 0)[None].astype(jnp.int32)
    shape = mosaic_plan.Shape(0.125, window_bounds(True, None), None, group, True, True)
    for transpose in (False, True):  # dq and forward walk key blocks of 64; dk/dv, query blocks of 64
        lo, hi, a, c, u_lo, u_hi = np.asarray(mosaic_plan.visit_plan(seq, seq, 128, 64, shape, ids, 1, transpose=transpose))[:, 0]
        assert np.any((lo < a) & (a < c) & (c < hi))
        # Every kind of step runs: blocks masked by the segment ids, by positions alone, neither.
        assert np.any((lo < u_lo) | (u_hi < hi)) and np.any((u_lo < a) | (c < u_hi)) and np.any(a < c)
    probe = jax.random.normal(jax.random.key(14), q.shape, jnp.float32)
    params = (FwdParams(kv_blocksize=64), BwdParams(q_blocksize=64, kv_blocksize=64))
    out, grads = interpreted_values_and_gradients(q, k, v, ids, params, probe, pingpong_dq=pingpong, pingpong_dkv=pingpong)
    assert not races()
    # Padding rows see nothing: output and dq exactly 0.
    assert not np.any(np.asarray(out.astype(jnp.float32))[0, seq - 11 :])
    assert not np.any(np.asarray(grads[0].astype(jnp.float32))[0, seq - 11 :])
