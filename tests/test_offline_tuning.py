"""Offline tuning: a program dumped by one process, audited and tuned by another."""

from __future__ import annotations

import json
from pathlib import Path

from conftest import run_python


def test_tune_unseen_from_an_xla_dump_in_a_fresh_process(tmp_path: Path) -> None:
    dump, cache = tmp_path / "dump", tmp_path / "cache"
    # Process A: the model, one of whose kernels is defined in the script itself, so that no
    # other process can import it from the call's description.
    run_python(
        """
import jax, jax.numpy as jnp
from ejlabel import Kernel
from toy_kernels import ScaleKernel, loopsum, scale

class ScriptScale(ScaleKernel):
    def __init__(self):
        Kernel.__init__(self, "script_scale")

def model(x):
    return loopsum(scale(x)).sum() + ScriptScale()(x * 3.0).sum()

jax.jit(model).lower(jnp.ones((8, 64))).compile()
""",
        XLA_FLAGS=f"--xla_dump_to={dump}",
        EJLABEL_CACHE_DIR=str(cache),
    )
    # Process B never sees the model: only the dump, and the kernels the descriptions name (their
    # module is imported first: decoding a description never imports anything by itself).
    out = run_python(
        f"""
import json, sys
import ejlabel
import toy_kernels
from ejlabel.analysis import audit, read_program, tune_unseen

program = read_program({str(dump)!r})  # read once, used by all three passes

before = audit(program)
report = tune_unseen(program, policy=ejlabel.AutotunePolicy(num_warmup=1, num_iters=3))
after = audit(program)
print(json.dumps({{
    "before": [row.label for row in before.unseen],
    "tuned": sorted(report.tuned),
    "errors": report.errors,
    "after_unseen": [row.label for row in after.unseen],
    "provenance": {{row.label: row.provenance for row in after.calls}},
    "modules": [pm.source.rsplit("/", 1)[-1] for pm in program.modules],
}}))
""",
        EJLABEL_CACHE_DIR=str(cache),
    )
    data = json.loads(out.strip().splitlines()[-1])
    ops = lambda labels: sorted(label.split("#")[1].split("@")[0] for label in labels)
    assert ops(data["before"]) == ["loopsum", "scale", "script_scale"]
    assert ops(data["tuned"]) == ["loopsum", "scale"]  # the other calls are tuned despite the failure
    [(failed, reason)] = data["errors"].items()
    assert "script_scale@v" in failed and "__main__" in reason and "import" in reason.lower()
    assert data["after_unseen"] == [failed]
    assert {data["provenance"][label] for label in data["tuned"]} == {"persistent"}
    # The dump's compiled HLO, one file per module: the model's and the helpers JAX compiled.
    assert data["modules"] and all(name.endswith("after_optimizations.txt") for name in data["modules"])
