"""Kernel calls split over devices run per shard: 4 forced CPU devices, explicit mesh axes.

Each kernel's rule (``Kernel.shard_rule``) and the executor's per-shard dispatch
(``ejlabel.core.shards``, ``Executor.run_split``), checked on the compiled programs and values of
``tests/sharded_facts.py``, which runs in a child process (the device count is fixed when JAX
starts): with a non-XLA config forced, no all-gather feeds a kernel call; values and gradients
equal the unsharded call's; the label, key and description are those of the call each device
runs. The TINY packed model, data parallel and FSDP: the same loss as unsharded; data parallel
gathers nothing, FSDP gathers exactly its parameters (one all-gather each, layer by layer); on
the XLA path the labelled sharded step compiles to the plain sharded program.
"""

from __future__ import annotations

import json
import re
import time
from pathlib import Path
from typing import Any

import pytest

from conftest import sharded_facts_path
from ejlabel.core.shards import ShardRule, plan_split


@pytest.fixture(scope="module")
def facts(pytestconfig: pytest.Config) -> dict[str, dict[str, Any]]:
    """All three parts from one child process, started in the background by conftest.py as soon
    as the run was collected (once per run, whichever workers get these tests): wait for it."""
    path = sharded_facts_path(pytestconfig)
    failed = Path(f"{path}.failed")
    deadline = time.monotonic() + 600
    while not path.exists():
        if failed.exists():
            pytest.fail(f"tests/sharded_facts.py failed:\n{failed.read_text()[-4000:]}")
        if time.monotonic() > deadline:
            err = path.with_suffix(".err")  # the child's standard error (conftest.py)
            pytest.fail(f"the sharded facts did not come within 10 minutes:\n{err.read_text()[-4000:] if err.exists() else ''}")
        time.sleep(0.5)
    return json.loads(path.read_text())


@pytest.fixture(scope="module")
def kernel_facts(facts: dict[str, dict[str, Any]]) -> dict[str, Any]:
    return facts["kernels"]


@pytest.fixture(scope="module")
def dp_facts(facts: dict[str, dict[str, Any]]) -> dict[str, Any]:
    return facts["dp"]


@pytest.fixture(scope="module")
def fsdp_facts(facts: dict[str, dict[str, Any]]) -> dict[str, Any]:
    return facts["fsdp"]


KERNELS = ["matmul", "rms_norm", "flash_attention", "cross_entropy", "linear_cross_entropy"]


@pytest.mark.parametrize("op", KERNELS)
def test_a_split_kernel_call_gathers_nothing_and_matches_the_whole_call(kernel_facts: dict[str, Any], op: str) -> None:
    facts = kernel_facts[op]
    assert facts["all_gathers"] == []
    assert facts["value_error"] < 1e-5
    assert facts["grad_error"] < 1e-5


@pytest.mark.parametrize("op", KERNELS)
def test_a_split_call_is_labelled_keyed_and_described_as_one_shard(kernel_facts: dict[str, Any], op: str) -> None:
    facts = kernel_facts[op]
    assert facts["labels"] == facts["local_labels"]
    assert {label.split("#")[1].split("@")[0] for label in facts["labels"]} == {op, f"{op}.bwd"}
    (described,) = facts["described"].values()
    assert described["shapes"][0][0] == (2 if op == "flash_attention" else 8)  # a quarter of the rows
    assert described["shardings"][0] == "data=4: " + ("P('data', None, None, None)" if op == "flash_attention" else "P('data', None)")


def test_split_calls_in_scanned_rematerialised_layers(kernel_facts: dict[str, Any]) -> None:
    facts = kernel_facts["scan"]  # lax.scan over layers, jax.checkpoint, differentiated
    assert facts["all_gathers"] == []
    assert facts["value_error"] < 1e-5 and facts["grad_error"] < 1e-5
    assert facts["labels"] == facts["local_labels"]
    assert {label.split("#")[1].split("@")[0] for label in facts["labels"]} == {"matmul", "matmul.bwd", "rms_norm", "rms_norm.bwd"}


def test_autotune_on_split_arguments_tunes_the_call_one_device_runs(kernel_facts: dict[str, Any]) -> None:
    facts = kernel_facts["autotune"]
    assert facts["stored"] == [facts["per_shard_key"]]
    assert facts["chosen_is_best"]


def test_dp_model_matches_unsharded_and_gathers_nothing(dp_facts: dict[str, Any]) -> None:
    losses = dp_facts["losses"]
    assert losses["pallas"] == pytest.approx(losses["unsharded"], rel=1e-5)
    assert losses["xla"] == pytest.approx(losses["unsharded"], rel=1e-5)
    assert losses["plain"] == pytest.approx(losses["unsharded"], rel=1e-5)
    assert dp_facts["pallas"]["all_gathers"] == []
    assert dp_facts["xla"]["all_gathers"] == []


def test_dp_model_on_the_xla_path_compiles_to_the_plain_sharded_program(dp_facts: dict[str, Any]) -> None:
    assert dp_facts["xla_instructions"] == dp_facts["plain_instructions"]


def test_dp_model_labels_are_those_of_one_device_batch(dp_facts: dict[str, Any]) -> None:
    sharded, local = set(dp_facts["pallas"]["labels"]), set(dp_facts["local_labels"])
    # The loss is the one call that differs: each device sums its tokens (the mean is taken
    # across devices), while the batch-1 model takes its own mean.
    differ = {label.split("#")[1].split("@")[0] for label in sharded ^ local}
    assert differ == {"linear_cross_entropy"}
    assert {"flash_attention", "flash_attention.bwd", "matmul", "rms_norm"} <= {label.split("#")[1].split("@")[0] for label in sharded & local}


def test_audit_of_the_compiled_sharded_step_reports_per_shard_calls(dp_facts: dict[str, Any]) -> None:
    arguments = dict(map(tuple, dp_facts["audit"]))
    attention = [args for label, args in arguments.items() if "#flash_attention@" in label]
    assert attention and all(args.startswith("f32[1,32,4,16] f32[1,32,2,16] f32[1,32,2,16] s32[1,32]") for args in attention)
    (loss,) = [args for label, args in arguments.items() if "#linear_cross_entropy@" in label]
    assert loss.startswith("f32[32,64] f32[64,128] s32[32]") and "reduction='sum'" in loss


def test_fsdp_model_gathers_only_its_parameters(fsdp_facts: dict[str, Any], dp_facts: dict[str, Any]) -> None:
    # The same parameters and batch as the data-parallel facts: the same unsharded loss.
    assert fsdp_facts["losses"]["pallas"] == pytest.approx(dp_facts["losses"]["unsharded"], rel=1e-5)
    gathered = {re.sub(r"\{.*\}$", "", shape) for shape in fsdp_facts["pallas"]["all_gathers"]}
    assert gathered and gathered <= set(fsdp_facts["param_shapes"])


# ---------------------------------------------------------------- the planner alone (one device)


def test_a_rule_that_does_not_fit_the_call_is_an_error_naming_the_argument() -> None:
    import jax

    x = jax.ShapeDtypeStruct((8, 4), "float32")
    with pytest.raises(ValueError, match=r"args\[0\] has shape \(8, 4\)"):
        plan_split(ShardRule(args=("b _ _",), out="b _ _"), (x,), {})
    with pytest.raises(ValueError, match="names 2 positional arguments"):
        plan_split(ShardRule(args=("b _", "b _"), out="b _"), (x,), {})
    with pytest.raises(TypeError, match="ShardRule.out"):
        ShardRule(args=("b _",), out=3)  # type: ignore[arg-type]


def test_unsharded_arguments_plan_no_split() -> None:
    import jax.numpy as jnp

    assert plan_split(ShardRule(args=("b _",), out="b _"), (jnp.ones((8, 4)),), {}) is None


def test_a_mesh_axis_splits_one_name_and_the_others_stay_whole() -> None:
    import jax
    import jax.numpy as jnp
    from jax.sharding import NamedSharding, PartitionSpec

    mesh = jax.make_mesh((1,), ("data",))  # one device: the plan alone is under test
    a = jax.device_put(jnp.ones((4, 8)), NamedSharding(mesh, PartitionSpec("data")))
    b = jax.device_put(jnp.ones((8, 6)), NamedSharding(mesh, PartitionSpec(None, "data")))
    split = plan_split(ShardRule(args=("m _", "_ n"), out="m n"), (a, b), {})
    assert split is not None and split.axes == {"m": ("data",)}
    assert split.arg_specs == (PartitionSpec("data", None), PartitionSpec(None, None))
    assert split.out_specs == PartitionSpec("data", None)
    assert [s.shape for s in split.local_args] == [(4, 8), (8, 6)]
    assert split.shardings == ("data=1: P('data', None)", "data=1: P(None, None)")
