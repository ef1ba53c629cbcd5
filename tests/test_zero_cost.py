"""The zero-cost XLA path: with every call on its XLA implementation, the labelled model compiles
to exactly the program of the plain model (labels are metadata, nothing else).

Compared instruction by instruction (opcode and shape, in order, metadata and frontend
attributes aside) on the compiled training and serving steps of the TINY example model, with one
document per row and with packed documents (segment ids; the plain model masks densely).
"""

from __future__ import annotations

import jax
import pytest

import ejlabel
from ejlabel.analysis import parse_hlo
from ejlabel import examples
from ejlabel.core.label_format import LABEL_ATTRIBUTE

CFG = examples.TINY
MODELS = {"one document per row": examples.TINY, "packed documents": examples.TINY_PACKED}


def _instructions(text: str) -> list[tuple[str, str]]:
    return [(i.opcode, i.shape) for i in parse_hlo(text).instructions()]


def _labelled_ops(text: str) -> set[str]:
    return {i.frontend_attributes[LABEL_ATTRIBUTE] for i in parse_hlo(text).instructions() if LABEL_ATTRIBUTE in i.frontend_attributes}


def _abstract_inputs(cfg: examples.ModelConfig = CFG) -> tuple[object, object, object]:
    params = jax.eval_shape(lambda: examples.init_params(cfg, jax.random.key(0)))
    batch = jax.eval_shape(lambda: examples.example_batch(cfg, jax.random.key(1)))
    return params, batch, batch["tokens"]


@pytest.mark.parametrize("model", MODELS)
@pytest.mark.parametrize("step", ["train", "serve"])
def test_labelled_model_on_xla_path_compiles_to_the_plain_program(step: str, model: str):
    cfg = MODELS[model]
    params, batch, tokens = _abstract_inputs(cfg)
    make = examples.make_train_step if step == "train" else examples.make_serve_step
    args = (params, batch) if step == "train" else (params, tokens, batch.get("segment_ids"))

    plain = jax.jit(make(cfg, examples.PLAIN_OPS)).lower(*args).compile().as_text()
    with ejlabel.use_implementation("xla"):
        lowered = jax.jit(make(cfg, examples.KERNEL_OPS)).lower(*args)
    labelled = lowered.compile().as_text()

    assert _instructions(labelled) == _instructions(plain)
    assert not _labelled_ops(plain)
    found = {lab.split("#", 1)[1].split("@", 1)[0] for lab in _labelled_ops(labelled)}
    assert found == {"matmul", "rms_norm", "flash_attention", "linear_cross_entropy"} if step == "train" else {"matmul", "rms_norm", "flash_attention"}


def test_use_implementation_forces_the_path_and_reports_it():
    params, batch, _ = _abstract_inputs()
    selector = ejlabel.ConfigSelectorChain()
    executor = ejlabel.Executor(selector)
    ejlabel.set_default_executor(executor)
    with ejlabel.use_implementation("xla"):
        lowered = jax.jit(examples.make_train_step(CFG, examples.KERNEL_OPS)).lower(params, batch)
    calls = ejlabel.labels_to_configs(lowered, selector)
    assert calls
    assert {c.provenance for c in calls} == {"forced"}
    assert {c[1].impl for c in calls} == {"xla"}


def test_use_implementation_leaves_kernels_without_that_implementation_alone():
    from ejlabel.kernels.matmul import MatmulKernel

    inv = ejlabel.Invocation(MatmulKernel(), (jax.ShapeDtypeStruct((8, 8), "float32"),) * 2, {})
    assert MatmulKernel().config_for(inv, "no-such-implementation") is None
    with pytest.raises(ValueError, match="name"):
        with ejlabel.use_implementation(""):
            pass
