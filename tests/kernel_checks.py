"""Checks shared by the kernel tests: relative errors, labels in a lowered program, tuning, documents."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import ejlabel

ON_GPU = jax.default_backend() == "gpu"
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
