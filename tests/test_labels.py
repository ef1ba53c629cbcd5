"""Labels come back verbatim from every program form, through every transformation."""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from pathlib import Path

import jax
import jax.numpy as jnp
import pytest
from jax import lax

import ejlabel
from ejlabel import LABEL_RE, extract_labels_from_hlo_text, find_labels_in_lowered, label
from ejlabel.core.label_format import parse_label

from conftest import run_python
from toy_kernels import scale, toymatmul

X = jnp.arange(12.0).reshape(3, 4)


def program_forms(fn: Callable, *args) -> dict[str, str]:
    lowered = jax.jit(fn).lower(*args)
    return {
        "stablehlo": lowered.as_text(),
        "hlo": lowered.compiler_ir("hlo").as_hlo_text(),
        "compiled": lowered.compile().as_text(),
    }


def expected_label(kernel, *args, **kwargs) -> str:
    inv = ejlabel.Invocation(kernel, args, kwargs)
    return label(inv.op_id, inv.call_key)


def test_label_format_and_regex():
    lab = label("matmul@v1", "0123456789abcdef")
    assert lab == "ejkernel_ops#matmul@v1:0123456789abcdef"
    m = LABEL_RE.fullmatch(lab)
    assert m.group("op") == "matmul@v1" and m.group("key") == "0123456789abcdef"
    assert label("matmul", "0123456789abcdef") == "ejkernel_ops#matmul@v1:0123456789abcdef"
    assert parse_label(lab) == ("matmul@v1", "0123456789abcdef")
    assert label("x@v2", "0" * 16, prefix="mine#") == "mine#x@v2:" + "0" * 16


@pytest.mark.parametrize("bad", ["", "0123", "0123456789ABCDEF", "0123456789abcdeg"])
def test_label_rejects_bad_hash(bad):
    with pytest.raises(ValueError, match="call_hash"):
        label("matmul@v1", bad)


def test_extract_labels_distinct_in_order():
    a, b = label("a@v1", "1" * 16), label("b@v3", "2" * 16)
    text = f'x ejlabel="{b}" y ejlabel="{a}" z "{b}" op_name="jit(f)/ejkernel_ops#a"'
    assert extract_labels_from_hlo_text(text) == [b, a]


CASES: dict[str, tuple[Callable, tuple]] = {
    "jit": (lambda x: scale(x) + 1.0, (X,)),
    "grad": (jax.grad(lambda x: scale(x).sum()), (X,)),
    "vmap": (jax.vmap(lambda r: scale(r)), (X,)),
    "scan": (lambda x: lax.scan(lambda c, _: (scale(c), None), x, None, length=3)[0], (X,)),
    "while": (lambda x: lax.while_loop(lambda c: c[0] < 3, lambda c: (c[0] + 1, scale(c[1])), (0, x))[1], (X,)),
    "cond": (lambda x: lax.cond(x.sum() > 0, lambda y: scale(y), lambda y: -y, x), (X,)),
    "checkpoint_grad": (jax.grad(lambda x: jax.checkpoint(lambda y: scale(jnp.sin(y)))(x).sum()), (X,)),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_label_survives_every_form(case):
    fn, args = CASES[case]
    if case == "vmap":  # the batched call: one example and the batch axes
        inv = ejlabel.Invocation(scale, (X[0],), batch_axes=("vmap", ((X.shape[0], (0,)),)))
        want = label(inv.op_id, inv.call_key)
    else:
        want = expected_label(scale, X)
    for form, text in program_forms(fn, *args).items():
        assert want in text, f"{case}: label missing from {form}"
        assert find_labels_in_lowered(text) == [want], form


def test_find_labels_accepts_lowered_and_compiled():
    lowered = jax.jit(lambda x: scale(x)).lower(X)
    want = [expected_label(scale, X)]
    assert find_labels_in_lowered(lowered) == want
    assert find_labels_in_lowered(lowered.compile()) == want


def test_custom_vjp_forward_and_backward_labels():
    a, b = jnp.ones((3, 4)), jnp.ones((4, 5))
    forward = expected_label(toymatmul, a, b)
    backward = forward.replace("toymatmul@v1", "toymatmul.bwd@v1")
    grad_fn = jax.grad(lambda a, b: jnp.sin(toymatmul(a, b)).sum(), argnums=(0, 1))
    for form, text in program_forms(grad_fn, a, b).items():
        labels = find_labels_in_lowered(text)
        assert forward in labels and backward in labels, form
    fwd_only = program_forms(lambda a, b: toymatmul(a, b), a, b)["hlo"]
    assert backward not in fwd_only


def test_custom_vjp_gradients_match_plain_autodiff():
    a = jax.random.normal(jax.random.key(0), (3, 4))
    b = jax.random.normal(jax.random.key(1), (4, 5))
    got = jax.grad(lambda a, b: jnp.sin(toymatmul(a, b)).sum(), argnums=(0, 1))(a, b)
    want = jax.grad(lambda a, b: jnp.sin(a @ b).sum(), argnums=(0, 1))(a, b)
    for g, w in zip(got, want):
        assert jnp.allclose(g, w, atol=1e-5)


def test_labels_in_xla_dump_directory(tmp_path: Path):
    code = """
import jax, jax.numpy as jnp
from toy_kernels import scale, toymatmul
a = jnp.ones((3, 4)); b = jnp.ones((4, 5))
f = jax.jit(jax.grad(lambda a, b: scale(toymatmul(a, b)).sum(), argnums=(0, 1)))
jax.block_until_ready(f(a, b))
"""
    run_python(code, XLA_FLAGS=f"--xla_dump_to={tmp_path}")
    inv_scale = expected_label(scale, jnp.ones((3, 5)))
    inv_mm = expected_label(toymatmul, jnp.ones((3, 4)), jnp.ones((4, 5)))
    found = find_labels_in_lowered(tmp_path)
    assert inv_scale in found and inv_mm in found
    assert inv_mm.replace("toymatmul@v1", "toymatmul.bwd@v1") in found
    after = sorted(tmp_path.glob("*after_optimizations.txt"))
    assert after and any(inv_mm in p.read_text() for p in after)
    assert find_labels_in_lowered(str(after[0])) == find_labels_in_lowered(after[0])


def test_labels_survive_shard_map_on_8_devices():
    code = """
import jax, jax.numpy as jnp, json
from jax.sharding import Mesh, PartitionSpec as P
from ejlabel import find_labels_in_lowered, Invocation, label
from toy_kernels import scale
try:
    from jax import shard_map
except ImportError:
    from jax.experimental.shard_map import shard_map
mesh = Mesh(jax.devices(), ("d",))
f = jax.jit(shard_map(lambda x: scale(x), mesh=mesh, in_specs=P("d"), out_specs=P("d")))
x = jnp.ones((16, 4))
lowered = f.lower(x)
want = label(Invocation(scale, (jnp.ones((2, 4)),)).op_id, Invocation(scale, (jnp.ones((2, 4)),)).call_key)
forms = {"stablehlo": lowered.as_text(), "hlo": lowered.compiler_ir("hlo").as_hlo_text(), "compiled": lowered.compile().as_text()}
print(json.dumps({"devices": len(jax.devices()), "want": want, "found": {k: find_labels_in_lowered(v) for k, v in forms.items()}}))
"""
    out = json.loads(run_python(code, XLA_FLAGS="--xla_force_host_platform_device_count=8").strip().splitlines()[-1])
    assert out["devices"] == 8
    for form, labels in out["found"].items():
        assert labels == [out["want"]], form


def test_label_decorator_labels_all_ops():
    @label("my_attention")
    def attention(q, k):
        return jax.nn.softmax(q @ k.T) @ k

    q = jnp.ones((4, 8))
    text = jax.jit(attention).lower(q, q).compiler_ir("hlo").as_hlo_text()
    labels = find_labels_in_lowered(text)
    assert len(labels) == 1 and labels[0].startswith("ejkernel_ops#my_attention@v1:")
    op_lines = [l for l in text.splitlines() if " = " in l and ("dot(" in l or "exponential(" in l)]
    assert op_lines and all(labels[0] in l for l in op_lines)


def test_name_stack_kept_for_profiles():
    text = jax.jit(lambda x: scale(x)).lower(X).compile().as_text()
    assert 'op_name="jit(<lambda>)/ejkernel_ops#scale' in text


def test_find_labels_rejects_bad_input(tmp_path):
    with pytest.raises(TypeError, match="x: expected"):
        find_labels_in_lowered(42)
    with pytest.raises(ValueError, match="no program files"):
        find_labels_in_lowered(tmp_path)


@pytest.mark.parametrize(
    "text",
    [
        "a" * 1_000_000,  # one run of word characters: the shape of a call description
        "a#" * 500_000,
        "x#" + "a" * 1_000_000,
        "x#" + "a@v" * 333_333,
        "x#a@v" + "1" * 1_000_000,
        "a." * 500_000,
    ],
    ids=["word-run", "hash-pairs", "op-run", "at-v-run", "version-run", "dotted-run"],
)
def test_label_regex_runs_in_linear_time_on_adversarial_text(text: str):
    # 1 MB in well under a second; the regex without its lookbehind took 4 s on 40 kB.
    start = time.perf_counter()
    assert not list(LABEL_RE.finditer(text))
    assert time.perf_counter() - start < 2.0  # quadratic would take minutes


def test_label_regex_still_finds_labels_next_to_punctuation():
    text = 'x={ejlabel="ejkernel_ops#matmul@v1:0123456789abcdef"}, (ejkernel_ops#a.b/c-d@v2.1:fedcba9876543210)'
    assert [m.group("op") for m in LABEL_RE.finditer(text)] == ["matmul@v1", "a.b/c-d@v2.1"]


@pytest.mark.parametrize("name", ['a"b', "a,b", "a{b", "a}b", "a=b", "a b", "a\nb", "ü", "a@b", "a:b", "a#b", "", "foo.bwd"])
def test_kernel_names_the_readers_cannot_read_back_are_rejected(name: str):
    with pytest.raises(ValueError, match="op_id"):
        _Identity(name)


def test_versions_the_readers_cannot_read_back_are_rejected():
    class Injected(_Identity):
        version = "1:0123456789abcdef"

    with pytest.raises(ValueError, match="version"):
        Injected("identity")
    assert _Identity("a.b/c-d_1").versioned_id == "a.b/c-d_1@v1"


class _Identity(ejlabel.Kernel):
    def run(self, x, *, cfg):
        return x


def test_label_format_round_trips_forward_and_backward_ids():
    from ejlabel.core.label_format import backward_op_id, format_label, forward_op_id, is_backward

    lab = format_label("rms_norm@v2", "0123456789abcdef")
    assert parse_label(lab) == ("rms_norm@v2", "0123456789abcdef")
    assert backward_op_id("rms_norm@v2") == "rms_norm.bwd@v2" and is_backward("rms_norm.bwd@v2")
    assert forward_op_id("rms_norm.bwd@v2") == "rms_norm@v2" and not is_backward("rms_norm@v2")
