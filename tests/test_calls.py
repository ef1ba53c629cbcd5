"""Self-describing calls: a program file alone rebuilds each call's Invocation."""

from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import pytest
from conftest import run_python
from ejlabel.analysis import read_program
from toy_kernels import scale, toymatmul

import ejlabel
from ejlabel import Invocation, decode_call, encode_call
from ejlabel.core.calls import CallDecodeError, invocations_from_program


def test_encode_decode_round_trip():
    x = jnp.ones((3, 4), jnp.bfloat16)
    inv = Invocation(scale, (x,), {"offset": 0.5})
    lab = ejlabel.label(inv.op_id, inv.call_key)
    desc = decode_call(encode_call(inv), lab)
    assert desc.kernel == "toy_kernels:ScaleKernel" and desc.op_id == "scale" and desc.version == "1"
    assert desc.args == (jax.ShapeDtypeStruct((3, 4), jnp.bfloat16),)
    assert desc.kwargs == {"offset": 0.5} and desc.call_key == inv.call_key
    assert set(encode_call(inv)) <= set("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789-_")


def test_decode_rejects_garbage():
    with pytest.raises(CallDecodeError):
        decode_call("not-a-description", ejlabel.label("x@v1", "0" * 16))


def test_descriptions_in_every_program_form():
    a, b = jnp.ones((3, 4)), jnp.ones((4, 5))
    lowered = jax.jit(jax.grad(lambda a, b: scale(toymatmul(a, b)).sum())).lower(a, b)
    texts = (lowered.as_text(), lowered.compiler_ir("hlo").as_hlo_text(), lowered.compile().as_text())
    found = [read_program(text).descriptions for text in texts]
    labels = set(ejlabel.find_labels_in_lowered(texts[1]))
    assert any(".bwd@" in lab for lab in labels)  # toymatmul's backward: its forward's description
    for descriptions, text in zip(found, texts):
        assert set(descriptions) == labels == set(ejlabel.find_labels_in_lowered(text))
        assert descriptions == found[0]


def test_core_rebuilds_from_what_the_reader_found():
    """One function: it takes a Program, a mapping, or any form the program reader reads."""
    import ejlabel.analysis

    lowered = jax.jit(lambda x: scale(x, offset=1.5).sum()).lower(jnp.ones((2, 3)))
    program = read_program(lowered)
    [(lab, inv)] = invocations_from_program(program).items()
    assert inv.op_id == "scale@v1" and inv.kwargs == {"offset": 1.5} and lab.endswith(inv.call_key)
    assert invocations_from_program(dict(program.descriptions)).keys() == {lab}
    assert ejlabel.analysis.invocations_from_program is invocations_from_program
    for form in (lowered, lowered.as_text(), lowered.compiler_ir("hlo").as_hlo_text(), lowered.compile()):
        assert invocations_from_program(form).keys() == {lab}
    with pytest.raises(TypeError, match=r"^x: expected a Lowered"):
        invocations_from_program(42)


def test_rebuild_in_fresh_process(tmp_path):
    """Process A writes the HLO of a model; process B rebuilds its calls without the model."""
    path = tmp_path / "model.hlo.txt"
    run_python(
        f"""
import jax, jax.numpy as jnp
from toy_kernels import scale, toymatmul
def model(a, b):
    return scale(toymatmul(a, b), offset=2.0).sum()
text = jax.jit(jax.grad(model)).lower(jnp.ones((3, 4)), jnp.ones((4, 5), jnp.float32)).compiler_ir("hlo").as_hlo_text()
open({str(path)!r}, "w").write(text)
"""
    )
    out = run_python(
        f"""
import json
import ejlabel
import toy_kernels  # the kernels the descriptions name (decoding never imports them itself)
from ejlabel.analysis import invocations_from_program
invs = invocations_from_program({str(path)!r})
rows = []
for lab, inv in invs.items():
    fresh = ejlabel.Invocation(inv.kernel, inv.args, inv.kwargs)
    rows.append([lab, inv.op_id, inv.call_key, fresh.call_key, [list(a.shape) for a in inv.args], inv.kwargs])
print(json.dumps(rows))
"""
    )
    rows = json.loads(out.strip().splitlines()[-1])
    ops = {row[1] for row in rows}
    assert ops == {"scale@v1", "toymatmul@v1"}
    for lab, op_id, key, recomputed, shapes, kwargs in rows:
        assert lab.endswith(key) and key == recomputed  # rebuilt specs give back the same call key
    scale_row = next(r for r in rows if r[1] == "scale@v1")
    assert scale_row[4] == [[3, 5]] and scale_row[5] == {"offset": 2.0}


def test_missing_kernel_module_is_a_clear_error():
    from ejlabel.core.calls import CallDescription, rebuild_kernel

    desc = CallDescription("no_such_module_xyz:K", "k", "1", "0" * 16, (), {}, None, ())
    with pytest.raises(CallDecodeError, match="cannot rebuild kernel 'no_such_module_xyz:K': .*is not registered"):
        rebuild_kernel(desc)
