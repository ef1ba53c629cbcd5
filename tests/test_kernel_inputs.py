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


@pytest.mark.parametrize(
    "x, error, message",
    [
        ("not a program", ValueError, r"^x: expected a Lowered, a Compiled, HLO or StableHLO text.*'not a program'"),
        (b"junk bytes", ValueError, r"^x: expected a Lowered.*'junk bytes'"),
        ("", ValueError, r"^x: expected a Lowered"),  # not the current directory
        ("missing_model.hlo", FileNotFoundError, r"^x: no such file or directory: missing_model\.hlo"),
        ("/dev/zero", ValueError, r"^x: /dev/zero is a character device, not a program file or dump directory \(special files are never read\)"),
        (42, TypeError, r"^x: expected a Lowered, a Compiled, program text.*got int$"),
        (None, TypeError, r"^x: expected .*got NoneType$"),
        (matmul, TypeError, r"^x: expected .*lower a function first"),
        (["not a label"], ValueError, r"^x\[0\]: expected a label"),
        ([F32], ValueError, r"^x\[0\]: expected a label"),
    ],
)
def test_labels_to_configs_rejects_what_is_not_a_program(x, error, message):
    from ejlabel import find_labels_in_lowered, labels_to_configs

    with pytest.raises(error, match=message):
        labels_to_configs(x)
    if not isinstance(x, list):  # the reader it uses has the same contract
        with pytest.raises(error, match=message):
            find_labels_in_lowered(x)


def test_labels_to_configs_reads_every_program_form():
    import jax

    from ejlabel import labels_to_configs
    from ejlabel.analysis import read_program

    lowered = jax.jit(lambda a, b: matmul(a, b)).lower(F32, F32)
    forms = [lowered, lowered.compile(), lowered.as_text(), lowered.compiler_ir("hlo").as_hlo_text(), read_program(lowered)]
    answers = [labels_to_configs(x) for x in forms]
    assert len(answers[0]) == 1 and answers[0][0].label.startswith("ejkernel_ops#matmul@v")
    assert all([pair.label for pair in answer] == [answers[0][0].label] for answer in answers)
    assert labels_to_configs([answers[0][0].label]) == answers[0] and labels_to_configs([]) == []
    assert labels_to_configs("HloModule empty\n\nENTRY %main () -> f32[] {\n  ROOT %c = f32[] constant(1)\n}\n") == []
