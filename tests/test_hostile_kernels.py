"""Hostile input to the kernels and to how the command starts: inputs that used to give a wrong
answer without an error, arguments whose error did not name them, and ``python -m ejlabel``
from a folder holding a module named like a library it imports.

The cases of the hostile-input issues on kernel inputs; the index of every case and its test is
the docstring of ``tests/test_hostile_input.py``.
"""
from __future__ import annotations

import importlib
import pathlib
import subprocess
import sys
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import REPO_ROOT, subprocess_env
from ejlabel.kernels.attention import flash_attention
from ejlabel.kernels.cross_entropy import CrossEntropyConfig, softmax_cross_entropy
from ejlabel.kernels.linear_cross_entropy import LinearCrossEntropyConfig, linear_cross_entropy
from ejlabel.kernels.matmul import MatmulConfig
from ejlabel.kernels.norms import NormConfig, layer_norm, rms_norm
from hostile import EJLABEL, LABELLED, hlo_module

VOCAB = 50
HIDDEN = jnp.ones((4, 8), jnp.float32)
WEIGHT = jnp.ones((8, VOCAB), jnp.float32)
LOGITS = jnp.ones((4, VOCAB), jnp.float32)
QKV = jnp.ones((1, 8, 2, 16), jnp.float32)


def _labels(bad: int) -> jax.Array:
    return jnp.array([1, 2, bad, 3], jnp.int32)


# ---------------------------------------------------------------- 8. inputs that gave a wrong answer silently

WRONG_ANSWER_CASES: dict[str, tuple[Callable[[], Any], type[Exception], str]] = {
    # label == vocab gave a NaN loss; -5 (not the ignore index) wrapped to class 45
    "linear_cross_entropy label == vocab": (lambda: linear_cross_entropy(HIDDEN, WEIGHT, _labels(VOCAB)), ValueError,
                                            r"^labels: expected classes in \[0, 50\) or the ignore_index -100, got 50 at index 2"),
    "linear_cross_entropy label -5": (lambda: linear_cross_entropy(HIDDEN, WEIGHT, _labels(-5)), ValueError, r"^labels: .* got -5 at index 2"),
    "linear_cross_entropy without ignore_index": (lambda: linear_cross_entropy(HIDDEN, WEIGHT, _labels(-100), ignore_index=None), ValueError,
                                                  r"^labels: expected classes in \[0, 50\), got -100"),
    # both were ignored as if they were the ignore index
    "softmax_cross_entropy label == vocab": (lambda: softmax_cross_entropy(LOGITS, _labels(VOCAB)), ValueError, r"^labels: .* got 50 at index 2"),
    "softmax_cross_entropy label -5": (lambda: softmax_cross_entropy(LOGITS, _labels(-5)), ValueError, r"^labels: .* got -5 at index 2"),
    "numpy labels": (lambda: softmax_cross_entropy(LOGITS, np.array([0, 1, 2, 99])), ValueError, r"^labels: .* got 99 at index 3"),
    # taken as class 1
    "ignore_index=True (softmax)": (lambda: softmax_cross_entropy(LOGITS, _labels(1), ignore_index=True), TypeError, r"^ignore_index: expected an int"),
    "ignore_index=True (linear)": (lambda: linear_cross_entropy(HIDDEN, WEIGHT, _labels(1), ignore_index=True), TypeError, r"^ignore_index: expected an int"),
    # accepted, and made segments that are not the sequences
    "cu_seqlens decreasing": (lambda: flash_attention(QKV, QKV, QKV, cu_seqlens=jnp.array([0, 5, 3, 8])), ValueError,
                              r"^cu_seqlens: expected non-decreasing values, got 5 then 3 at index 2"),
    "cu_seqlens negative": (lambda: flash_attention(QKV, QKV, QKV, cu_seqlens=jnp.array([-2, 5, 8])), ValueError, r"^cu_seqlens: expected non-negative"),
    # every output zero
    "sliding_window (-1, 0)": (lambda: flash_attention(QKV, QKV, QKV, sliding_window=(-1, 0)), ValueError, r"^sliding_window: expected \(left, right\), two ints >= 0"),
    # NaN everywhere
    "rms_norm default eps": (lambda: rms_norm(HIDDEN, jnp.ones((8,))), None, ""),
    "rms_norm eps -1": (lambda: rms_norm(HIDDEN, jnp.ones((8,)), eps=-1), ValueError, r"^eps: expected a number >= 0"),
    "layer_norm eps nan": (lambda: layer_norm(HIDDEN, jnp.ones((8,)), jnp.ones((8,)), eps=float("nan")), ValueError, r"^eps: expected a finite number"),
    # block sizes of 0 were accepted, and failed (or divided by zero) later
    "MatmulConfig(block_m=0)": (lambda: MatmulConfig("pallas", block_m=0), ValueError, r"^block_m: expected a positive int, got 0"),
    "MatmulConfig(group_m=-1)": (lambda: MatmulConfig(group_m=-1), ValueError, r"^group_m: expected a positive int"),
    "CrossEntropyConfig(chunk_vocab=0)": (lambda: CrossEntropyConfig("pallas", chunk_vocab=0), ValueError, r"^chunk_vocab: expected a positive int"),
    "NormConfig(block_rows=True)": (lambda: NormConfig("pallas", block_rows=True), ValueError, r"^block_rows: expected a positive int, got True"),
    "LinearCrossEntropyConfig(chunk_tokens=0)": (lambda: LinearCrossEntropyConfig(chunk_tokens=0), ValueError, r"^chunk_tokens: expected a positive int"),
}


@pytest.mark.parametrize("case", sorted(WRONG_ANSWER_CASES))
def test_kernels_refuse_concrete_inputs_that_give_a_wrong_answer(case: str) -> None:
    call, error, message = WRONG_ANSWER_CASES[case]
    if error is None:  # the default is fine: the checks refuse what is wrong only
        assert bool(jnp.all(jnp.isfinite(call())))
        return
    with pytest.raises(error, match=message):
        call()


BAD_ARGUMENT_CASES: dict[str, tuple[Callable[[], Any], type[Exception], str]] = {
    "sliding_window (1,)": (lambda: flash_attention(QKV, QKV, QKV, sliding_window=(1,)), ValueError, r"^sliding_window: expected \(left, right\)"),  # was IndexError
    "sliding_window 3": (lambda: flash_attention(QKV, QKV, QKV, sliding_window=3), ValueError, r"^sliding_window:"),
    "sliding_window (1.5, 0)": (lambda: flash_attention(QKV, QKV, QKV, sliding_window=(1.5, 0)), TypeError, r"^sliding_window:"),
    "softmax_scale 'x'": (lambda: flash_attention(QKV, QKV, QKV, softmax_scale="x"), TypeError, r"^softmax_scale: expected a real number, got str"),  # was float()'s
    "softmax_scale inf": (lambda: flash_attention(QKV, QKV, QKV, softmax_scale=float("inf")), ValueError, r"^softmax_scale: expected a finite number"),
    "cu_seqlens 2-d": (lambda: flash_attention(QKV, QKV, QKV, cu_seqlens=jnp.zeros((2, 2), jnp.int32)), ValueError, r"^cu_seqlens: expected \[n \+ 1\]"),
    "rms_norm w of another width": (lambda: rms_norm(HIDDEN, jnp.ones((7,))), ValueError, r"^w: expected shape \(8,\) \(the width of x\), got \(7,\)"),  # named the op
    "layer_norm b of another width": (lambda: layer_norm(HIDDEN, jnp.ones((8,)), jnp.ones((4,))), ValueError, r"^b: expected shape \(8,\)"),
    "label_smoothing 'a'": (lambda: linear_cross_entropy(HIDDEN, WEIGHT, _labels(1), label_smoothing="a"), TypeError, r"^label_smoothing: expected a real number"),
    "logit_soft_cap 0": (lambda: linear_cross_entropy(HIDDEN, WEIGHT, _labels(1), logit_soft_cap=0.0), ValueError, r"^logit_soft_cap: expected None or a number > 0"),
}


@pytest.mark.parametrize("case", sorted(BAD_ARGUMENT_CASES))
def test_bad_kernel_arguments_name_the_argument(case: str) -> None:
    call, error, message = BAD_ARGUMENT_CASES[case]
    with pytest.raises(error, match=message):
        call()


def _losses_and_gradients(loss: Callable[..., jax.Array], x: jax.Array, w: jax.Array, y: jax.Array) -> tuple[np.ndarray, ...]:
    """The loss and the gradients (NaN losses left out of the sum) of ``loss(x, w, y)``, ``y`` traced."""
    out = jax.jit(loss)(x, w, y)
    grads = jax.jit(jax.grad(lambda x, w, y: jnp.sum(jnp.where(jnp.isnan(loss(x, w, y)), 0.0, loss(x, w, y))), argnums=(0, 1)))(x, w, y)
    return (np.asarray(out), *(np.asarray(g) for g in grads))


def test_checks_cost_nothing_under_jit_and_traced_labels_agree() -> None:
    """Under jit the labels are traced: nothing is checked (the XLA path lowers to the program it
    lowered to before the checks), and a label outside the vocabulary gives the same in every
    implementation, as each kernel's docstring says."""
    for name in ("ejlabel.kernels.cross_entropy", "ejlabel.kernels.linear_cross_entropy"):
        doc = importlib.import_module(name).__doc__  # the package: its function of the same name shadows it as an attribute
        assert "Traced labels" in doc and "[-vocab, 0)" in doc
    hidden = jax.random.normal(jax.random.key(0), (8, 16), jnp.float32)
    weight = jax.random.normal(jax.random.key(1), (16, VOCAB), jnp.float32)
    labels = jnp.array([1, 2, VOCAB, -5, -100, 3, VOCAB + 10, -VOCAB - 1], jnp.int32)  # in range, out, wrapped, ignored

    impls = ["xla", "chunked", "chunked_tokens", "chunked_tokens_triton"]
    for ignore_index in (-100, None, -5):
        runs = {}
        for impl in impls:
            cfg = LinearCrossEntropyConfig(impl, chunk_vocab=16, chunk_tokens=4)
            runs[impl] = _losses_and_gradients(
                lambda x, w, y, cfg=cfg: linear_cross_entropy(x, w, y, reduction="none", ignore_index=ignore_index, label_smoothing=0.1, cfg=cfg),
                hidden, weight, labels,
            )
        loss = runs["xla"][0]
        assert np.isnan(loss[[2, 6, 7]]).all() and np.isfinite(loss[[0, 1, 5]]).all()
        for impl in impls[1:]:
            for got, want in zip(runs[impl], runs["xla"]):
                np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4, err_msg=f"{impl}, ignore_index={ignore_index}")
    logits = hidden @ weight
    for ignore_index in (-100, None):
        runs = {}
        for impl in ("xla", "pallas"):
            cfg = CrossEntropyConfig(impl, 4, 16, 4)
            runs[impl] = _losses_and_gradients(
                lambda z, _, y, cfg=cfg: softmax_cross_entropy(z, y, ignore_index=ignore_index, cfg=cfg), logits, logits, labels
            )
        for got, want in zip(runs["pallas"], runs["xla"]):
            np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5, err_msg=f"ignore_index={ignore_index}")
        if ignore_index is None:
            assert np.isnan(runs["xla"][0][[2, 6, 7]]).all()
        else:
            assert (runs["xla"][0][[2, 3, 4, 6, 7]] == 0).all()
    # Concrete labels are read once per eager call; traced ones never: the XLA path's program is
    # the plain expression's, whatever the labels (test_zero_cost.py compares it to plain JAX).
    lowered = jax.jit(lambda x, w, y: linear_cross_entropy(x, w, y, cfg=LinearCrossEntropyConfig("xla"))).lower(hidden, weight, labels)
    assert "custom_call" not in lowered.as_text() and "callback" not in lowered.as_text()


# ---------------------------------------------------------------- 9. python -m and a shadowing module


def test_python_m_from_a_folder_with_networkx_py_is_documented(tmp_path: pathlib.Path) -> None:
    """``python -m`` puts the current folder first on the path, so a ``networkx.py`` there is
    imported instead of networkx; the console script's path starts at its own folder (until
    ``--import`` asks for the current folder), and ``-P`` / ``PYTHONSAFEPATH`` leave the current
    folder out. README says so next to ``python -m ejlabel``."""
    folder = tmp_path / "work"
    folder.mkdir()
    (folder / "networkx.py").write_text('import pathlib\npathlib.Path(__file__).with_name("SHADOW_RAN").write_text("ran")\n')
    (folder / "p.hlo").write_text(hlo_module("%p = f32[4]{0} parameter(0)", f"ROOT %a = f32[4]{{0}} add(%p, %p), {LABELLED}"))
    cache = ["--cache-dir", str(tmp_path / "c")]
    marker = folder / "SHADOW_RAN"
    safe = [
        ([EJLABEL, *cache, "audit", "p.hlo"], {}),
        ([sys.executable, "-P", "-m", "ejlabel", *cache, "--import", "toy_kernels", "audit", "p.hlo"], {}),
        ([EJLABEL, *cache, "--import", "toy_kernels", "audit", "p.hlo"], {"PYTHONSAFEPATH": "1"}),
    ]
    for argv, env in safe:
        proc = subprocess.run(argv, cwd=folder, capture_output=True, text=True, check=False, env=subprocess_env(**env), timeout=300)
        assert proc.returncode == 0 and "1 kernel call sites" in proc.stdout, proc.stderr
        assert not marker.exists(), argv
    subprocess.run([sys.executable, "-m", "ejlabel", *cache, "audit", "p.hlo"], cwd=folder, capture_output=True, check=False, env=subprocess_env(), timeout=300)
    assert marker.exists()  # what the README warns of: Python's own rule, not ejlabel's
    readme = (REPO_ROOT / "README.md").read_text()
    note = readme[readme.index("`python -m ejlabel ...` runs the same command") :][:800]
    assert "current folder" in note and "python -P -m ejlabel" in note and "PYTHONSAFEPATH=1" in note and "console script" in note
