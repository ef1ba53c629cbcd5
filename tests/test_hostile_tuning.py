"""Hostile input to the tuners: one bad call in a program (malformed, too big to exist, more than
memory, a kernel that raises on it) stops no other, in isolation, in context and on Ray workers;
and a cached config of the wrong type does not pass for tuned.

The cases of the hostile-input issues on tuning; the index of every case and its test is the
docstring of ``tests/test_hostile_input.py``.
"""
from __future__ import annotations

import dataclasses
import json
import os
import pathlib

import pytest

from conftest import subprocess_env
from ejlabel.config.persistent import PersistentCache
from ejlabel.config.selection import ConfigSelectorChain
from ejlabel.core.kernel import Invocation, Kernel
from hostile import GOOD_CALL, GOOD_LABEL, b64, described_program


# ---------------------------------------------------------------- 1 and 3. one bad call stops nothing, no abort in jaxlib

BAD_CALLS = {
    # matmul's candidate_is_valid unpacked a 1-d shape: "not enough values to unpack" for the whole run
    "a malformed call": ("ejkernel_ops#matmul@v1:00000000000000cc",
                         [1, "ejlabel.kernels.matmul:MatmulKernel", [{"$array": "float32[8]"}, {"$array": "float32[8]"}], {}, None, None],
                         "matmul@v1 call 00000000000000cc: failed while listing its candidates"),
    # numpy's "array is too big" for the whole run
    "an array too big to exist": ("ejkernel_ops#scale@v1:00000000000000bb",
                                  [1, "toy_kernels:ScaleKernel", [{"$array": "float32[10000000000,1000000000]"}], {}, None, None],
                                  "over the 1125899906842624-byte limit of one array"),
    # jaxlib aborted the process (rc 134): "overflow in static extent product"
    "an element count past int64": ("ejkernel_ops#scale@v1:00000000000000aa",
                                    [1, "toy_kernels:ScaleKernel", [{"$array": "float32[4000000000,4000000000]"}], {}, None, None],
                                    "over the 1125899906842624-byte limit of one array"),
    # would be made on the host, or end the process by the kernel's memory killer
    "more than this machine's memory": ("ejkernel_ops#scale@v1:00000000000000ee",
                                        [1, "toy_kernels:ScaleKernel", [{"$array": "float32[100000000000000]"}], {}, None, None],
                                        "its arguments take 400000000000000 bytes, more than the"),
}


def test_one_malformed_call_does_not_stop_the_others(tmp_path: pathlib.Path) -> None:
    from ejlabel.execution.tuning import TuningWorker, call_request
    from ejlabel.config.cache import AutotunePolicy
    from hostile import run_cli

    program = tmp_path / "calls.hlo"
    program.write_text(described_program([(GOOD_LABEL, GOOD_CALL), *((lab, data) for lab, data, _ in BAD_CALLS.values())]))
    proc = run_cli(["--import", "toy_kernels", "--cache-dir", str(tmp_path / "c"), "tune", "--iters", "1", str(program)])
    assert proc.returncode == 1, proc.stdout + proc.stderr  # the exit code says some failed ...
    assert f"tuned  {GOOD_LABEL.split('#')[1]}" in proc.stdout and "Traceback" not in proc.stderr  # ... the good call is tuned
    assert "tuned 1 distinct calls (1 labels)" in proc.stdout and f"{len(BAD_CALLS)} errors" in proc.stdout
    for lab, _, reason in BAD_CALLS.values():
        assert f"error  {lab}  " in proc.stderr and reason in proc.stderr, (lab, proc.stderr)
    # A Ray worker tunes the same way: a call whose kernel code raises is raised again, so that
    # the driver retries it alone elsewhere and then reports it (test_ray_tuning.py); the others tune.
    worker = TuningWorker(["ejlabel.kernels", "toy_kernels"])
    policy = AutotunePolicy(num_warmup=0, num_iters=1)

    def request(name: str) -> dict:
        lab, data, _ = BAD_CALLS[name] if name in BAD_CALLS else (GOOD_LABEL, GOOD_CALL, "")
        return call_request(lab, b64(json.dumps(data).encode()), policy)

    with pytest.raises((IndexError, ValueError)):  # matmul's own error, for the driver to retry
        worker.tune_many([request("good"), request("a malformed call")])
    good, huge = worker.tune_many([request("good"), request("more than this machine's memory")])
    assert good["status"] == "tuned" and huge["status"] == "failed" and "more than the" in huge["error"]


@dataclasses.dataclass(frozen=True)
class PickyConfig:
    mode: str = "mul"


class PickyKernel(Kernel[PickyConfig, object]):
    """``2 x`` two ways; listing the candidates of a call whose ``x`` has 3 columns raises, as a
    kernel with a bug that one call of a model hits."""

    def __init__(self) -> None:
        super().__init__("picky")

    def run(self, x, *, cfg: PickyConfig):
        return x * 2.0 if cfg.mode == "mul" else x + x

    def heuristic_cfg(self, inv: Invocation) -> PickyConfig:
        return PickyConfig()

    def config_space(self, inv: Invocation) -> list[PickyConfig]:
        if inv.args[0].shape[-1] == 3:
            raise ValueError("not enough values to unpack (expected 2, got 1)")
        return [PickyConfig("mul"), PickyConfig("add")]


def test_in_context_tuning_reports_a_failing_call_and_tunes_the_rest(tmp_path: pathlib.Path) -> None:
    import jax
    import jax.numpy as jnp

    from ejlabel.config.cache import AutotunePolicy
    from ejlabel.execution.tuning import tune_in_context

    picky = PickyKernel()
    step = lambda a, b: picky(a).sum() + picky(b).sum()  # noqa: E731
    args = (jax.ShapeDtypeStruct((16, 16), jnp.float32), jax.ShapeDtypeStruct((16, 3), jnp.float32))
    with PersistentCache(tmp_path / "c") as pc:
        selector = ConfigSelectorChain(persistent=pc)
        report = tune_in_context(step, *args, selector=selector, policy=AutotunePolicy(num_warmup=0, num_iters=2), budget_s=120,
                                 samples=2, warmup=0, progress=False, verbose=False)
        (failed,) = report.errors
        assert failed.startswith("picky@v1:") and "cannot list its candidates" in report.errors[failed]
        assert "not enough values to unpack" in report.errors[failed]
        assert len(report.calls) == 2 and [call.isolated_from == "failed" for call in report.calls].count(True) == 1
        (ranked,) = [call for call in report.calls if call.isolated_from != "failed"]
        assert failed == f"picky@v1:{next(c.call_key for c in report.calls if c is not ranked)}"
        assert len(ranked.candidates) == 2  # the other call was ranked on both candidates ...
        assert pc.get_entry(ranked.key).provenance == "in-context"  # ... and its pick stored


def test_huge_dimensions_are_refused_before_jaxlib(tmp_path: pathlib.Path) -> None:
    """jaxlib ended the process (rc 134, "overflow in static extent product") when a call or
    ``--example-args`` had an element count past int64: now a clear error, and the others go on."""
    from ejlabel.core.calls import CallDecodeError, invocation_from_description
    from hostile import run_cli

    lab, data, _ = BAD_CALLS["an element count past int64"]
    with pytest.raises(CallDecodeError, match=r"\$array: shape \(4000000000, 4000000000\) of float32 spans 64000000000000000000 bytes"):
        invocation_from_description(lab, b64(json.dumps(data).encode()))
    program = tmp_path / "huge.hlo"
    program.write_text(described_program([(GOOD_LABEL, GOOD_CALL), (lab, data)]))
    for command in (["tune", "--iters", "1", str(program)], ["audit", str(program)],
                    ["tune", "toy_kernels:double", "--example-args", "f32[4000000000,4000000000]"]):
        proc = run_cli(["--import", "toy_kernels", "--cache-dir", str(tmp_path / "c"), *command])
        assert proc.returncode in (0, 1, 2) and "Traceback" not in proc.stderr, proc.stderr  # never a signal
        if command[0] == "tune" and "--example-args" in command:
            assert proc.returncode == 2 and "--example-args: shape (4000000000, 4000000000) of float32 spans" in proc.stderr
        elif command[0] == "tune":
            assert proc.returncode == 1 and "tuned 1 distinct calls" in proc.stdout


# ---------------------------------------------------------------- 6. an entry of the wrong type is unseen

USER_MODULE = '''
import dataclasses
import jax
from ejlabel import Invocation, Kernel


@dataclasses.dataclass(frozen=True)
class UserConfig:
    factor: int = 1


class UserKernel(Kernel[UserConfig, jax.Array]):
    """2 x; the module makes no instance: the kernel is known as a class until a call is rebuilt."""

    def __init__(self) -> None:
        super().__init__("userk")

    def run(self, x, *, cfg):
        return x * 2.0 if cfg.factor == 1 else x + x

    def heuristic_cfg(self, inv):
        return UserConfig()

    def config_space(self, inv):
        return [UserConfig(1), UserConfig(2)]
'''


def test_audit_and_tune_count_a_wrong_type_entry_as_unseen(tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """An entry of another kernel's config type under a user kernel's key was reported by
    ``audit`` as ``persistent`` and by ``tune`` as "already tuned", while the running program
    ignored it: the call was never tuned."""
    import importlib

    import jax
    import jax.numpy as jnp

    from ejlabel.analysis import read_program
    from ejlabel.kernels.norms import NormConfig
    from ejlabel.utils.fingerprint import device_fingerprint
    from hostile import run_cli

    folder = tmp_path / "mods"
    folder.mkdir()
    name = f"wrong_type_user_{abs(hash(str(tmp_path))) % 10**8}"
    (folder / f"{name}.py").write_text(USER_MODULE)
    monkeypatch.syspath_prepend(str(folder))
    module = importlib.import_module(name)
    lowered = jax.jit(lambda x: module.UserKernel()(x)).lower(jnp.ones((4, 4), jnp.float32))
    program = tmp_path / "p.hlo"
    program.write_text(lowered.compiler_ir("hlo").as_hlo_text())
    (lab,) = read_program(lowered).labels
    op_id, call_key = lab.split("#")[1].split(":")
    with PersistentCache(tmp_path / "c") as pc:
        pc.put(device_fingerprint(), op_id, call_key, NormConfig("xla"))  # a NormConfig under the user kernel's key
    cli = ["--import", name, "--cache-dir", str(tmp_path / "c")]
    env = {"PYTHONPATH": os.pathsep.join([str(folder), subprocess_env()["PYTHONPATH"]])}
    before = run_cli([*cli, "audit", str(program)], **env)
    assert before.returncode == 0, before.stderr
    assert "WRONG TYPE" in before.stdout and "NormConfig(" in before.stdout and "1 unseen" in before.stdout
    tuned = run_cli([*cli, "tune", "--iters", "1", str(program)], **env)
    assert tuned.returncode == 0 and "tuned 1 distinct calls (1 labels)" in tuned.stdout and "0 already tuned" in tuned.stdout, tuned.stdout + tuned.stderr
    after = run_cli([*cli, "audit", str(program)], **env)
    assert "0 unseen" in after.stdout and "UserConfig(factor=" in after.stdout and "WRONG TYPE" not in after.stdout
