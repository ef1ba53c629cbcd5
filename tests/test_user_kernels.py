"""A kernel a user writes works without ceremony (issue 40): its config types register from the
process, nothing is added to its config space because of a field's name, a script and the
command line name its types alike, and a policy that can never tune says so.

The whole path a new user walks (script kernel, jit, tune, the command line from the script's
folder, the script reading the command line's pick, tuning in context) is README's "Write your
own kernel", run verbatim by ``tests/test_readme.py``.
"""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
import warnings
from pathlib import Path

import jax
import jax.numpy as jnp
import pytest

import ejlabel
import ejlabel.analysis
from ejlabel.core.registry import import_user_modules, kernel_config_types
from ejlabel.execution.tuning.candidates import floor_configs
from ejlabel.utils.serialize import from_json, is_registered, to_json

from conftest import subprocess_env


# -------------------------------------------------------------- kernels as a user writes them


@dataclasses.dataclass(frozen=True)
class RepCfg:
    """A config with a field named ``impl`` whose values are the kernel's own."""

    impl: str = "twice"
    reps: int = 1


class RepKernel(ejlabel.Kernel):  # no Kernel[Cfg, Out]: the annotations name the config type
    def __init__(self) -> None:
        super().__init__("user_rep")

    def run(self, x: jax.Array, *, cfg: RepCfg) -> jax.Array:
        if cfg.impl == "twice":
            return x * 2.0
        if cfg.impl == "sum":
            return sum([x] * 2 * cfg.reps) / cfg.reps
        raise ValueError(f"unknown impl {cfg.impl!r}")

    def reference(self, x: jax.Array) -> jax.Array:
        return x * 2.0

    def heuristic_cfg(self, inv: ejlabel.Invocation) -> RepCfg:
        return RepCfg()

    def config_space(self, inv: ejlabel.Invocation) -> list[RepCfg]:
        return [RepCfg("twice"), RepCfg("sum", 1), RepCfg("sum", 2)]


@dataclasses.dataclass(frozen=True)
class BareCfg:
    steps: int = 1


class BareKernel(ejlabel.Kernel):  # no generic argument, no annotation at all
    def __init__(self):
        super().__init__("user_bare")

    def run(self, x, *, cfg):
        return x + float(cfg.steps) * 0.0 + 1.0

    def heuristic_cfg(self, inv):
        return BareCfg()

    def config_space(self, inv):
        return [BareCfg(1), BareCfg(2)]


class PlainPathKernel(RepKernel):
    """The same kernel, declaring ``"twice"`` as its plain path."""

    plain_implementation = "twice"

    def __init__(self) -> None:
        ejlabel.Kernel.__init__(self, "user_rep_plain")

    def heuristic_cfg(self, inv: ejlabel.Invocation) -> RepCfg:
        return RepCfg("sum", 2)


rep, bare, plain_path = RepKernel(), BareKernel(), PlainPathKernel()
X = jnp.arange(8.0).reshape(2, 4)


def _step(x: jax.Array) -> jax.Array:
    return (rep(x) + bare(x)).sum()


# -------------------------------------------------------------- item 1: types register themselves


def test_a_plain_kernel_class_registers_its_config_type_from_its_annotations():
    assert kernel_config_types(RepKernel) == (RepCfg,) and is_registered(RepCfg)
    assert from_json(to_json(RepCfg("sum", 3))) == RepCfg("sum", 3)


def test_a_kernel_naming_no_type_learns_it_from_the_configs_it_hands_over(tmp_path):
    selector = ejlabel.ConfigSelectorChain(persistent=ejlabel.PersistentCache(tmp_path / "c"))
    # autotune stores its pick: the type of the configs the kernel handed over is registered.
    assert ejlabel.autotune(bare, X, selector=selector, num_iters=2, num_warmup=1) in (BareCfg(1), BareCfg(2))
    assert is_registered(BareCfg) and kernel_config_types(BareKernel) == (BareCfg,)
    (entry,) = selector.persistent.entries(op_id="user_bare@v1")
    assert entry.provenance == "autotuned" and isinstance(entry.config, BareCfg)


def test_user_kernels_work_with_the_policy_tune_unseen_and_tune_in_context(tmp_path):
    cache = ejlabel.PersistentCache(tmp_path / "c")
    policy = ejlabel.AutotunePolicy(allow_autotune=True, cache_miss_fallback="autotune", num_iters=2, num_warmup=1)
    ejlabel.set_default_executor(ejlabel.Executor(ejlabel.ConfigSelectorChain(policy=policy, persistent=cache)))
    jax.jit(_step).lower(X)  # each call tuned on its miss, while traced
    assert {e.op_id: e.provenance for e in cache.entries()} == {"user_rep@v1": "autotuned", "user_bare@v1": "autotuned"}
    ejlabel.set_default_executor(None)

    lowered = jax.jit(_step).lower(jnp.ones((3, 5)))
    report = ejlabel.analysis.tune_unseen(lowered, selector=ejlabel.ConfigSelectorChain(persistent=cache), policy=ejlabel.AutotunePolicy(num_iters=2))
    assert not report.errors and len(report.results) == 2

    context = ejlabel.tune_in_context(_step, jnp.ones((4, 6)), budget_s=20, samples=2, verbose=False, progress=False,
                                      selector=ejlabel.ConfigSelectorChain(persistent=cache))
    assert not context.errors and len(context.calls) == 2
    assert {c.floor_cfg for c in context.calls} == {RepCfg(), BareCfg()}  # no plain path declared: the heuristic


def test_a_second_process_that_imports_the_module_reads_the_configs_back(tmp_path):
    cache = tmp_path / "c"
    selector = ejlabel.ConfigSelectorChain(persistent=ejlabel.PersistentCache(cache))
    ejlabel.autotune(rep, X, selector=selector, configs=[RepCfg("sum", 2)], num_iters=2, num_warmup=1)
    ejlabel.autotune(bare, X, selector=selector, configs=[BareCfg(2)], num_iters=2, num_warmup=1)
    code = f"""
import jax, jax.numpy as jnp, ejlabel, json
import test_user_kernels as t
lowered = jax.jit(lambda x: t.rep(x) + t.bare(x)).lower(jnp.arange(8.0).reshape(2, 4))
print(json.dumps({{p.op_id: [p.provenance, repr(p.cfg)] for p in ejlabel.labels_to_configs(lowered)}}))
"""
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=subprocess_env(EJLABEL_CACHE_DIR=str(cache)), timeout=300)
    assert proc.returncode == 0, proc.stderr
    got = json.loads(proc.stdout.splitlines()[-1])
    assert got == {"user_rep@v1": ["persistent", repr(RepCfg("sum", 2))], "user_bare@v1": ["persistent", repr(BareCfg(2))]}


def test_the_command_line_reads_a_config_a_script_stored_for_a_kernel_naming_no_type(tmp_path):
    # BareKernel names its config type nowhere: the offline process learns it from the kernel's
    # heuristic when it rebuilds the call from the program, and finds the stored config.
    program = tmp_path / "bare.hlo.txt"
    program.write_text(jax.jit(lambda x: bare(x)).lower(X).compiler_ir("hlo").as_hlo_text())
    selector = ejlabel.ConfigSelectorChain(persistent=ejlabel.PersistentCache(tmp_path / "c"))
    ejlabel.autotune(bare, X, selector=selector, configs=[BareCfg(2)], num_iters=2, num_warmup=1)
    proc = subprocess.run(
        [str(Path(sys.executable).with_name("ejlabel")), "--import", "test_user_kernels", "--cache-dir", str(tmp_path / "c"), "tune", str(program)],
        capture_output=True, text=True, env=subprocess_env(), timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    assert "tuned 0 distinct calls (0 labels)" in proc.stdout and "1 already tuned" in proc.stdout


# -------------------------------------------------------------- item 2: no hidden rules


def test_nothing_is_added_to_a_config_space_because_of_a_field_name(tmp_path):
    inv = ejlabel.Invocation(rep, (X,))
    assert floor_configs(inv) == [RepCfg()]  # the heuristic: no impl='xla' candidate
    assert rep.config_for(inv, "xla") is None and rep.plain_config(inv) is None
    result = ejlabel.Autotuner(ejlabel.AutotunePolicy(num_iters=2, num_warmup=1), progress=False).tune(inv)
    assert [c.cfg for c in result.candidates] == [RepCfg(), RepCfg("sum", 1), RepCfg("sum", 2)]
    assert all(c.status in ("ok", "pruned") for c in result.candidates)  # none failed: none was made up
    with ejlabel.use_implementation("xla"):  # forcing an implementation the kernel lacks leaves it alone
        assert ejlabel.Executor().selector.select(inv).provenance == "heuristic"
    step = lambda x: rep(x).sum()
    report = ejlabel.tune_in_context(step, X, budget_s=20, samples=2, verbose=False, progress=False,
                                     selector=ejlabel.ConfigSelectorChain(persistent=ejlabel.PersistentCache(tmp_path / "c")))
    assert not report.errors and report.calls[0].floor_cfg == RepCfg()


def test_a_declared_plain_path_is_the_floor():
    inv = ejlabel.Invocation(plain_path, (X,))
    assert plain_path.plain_config(inv) == RepCfg("twice", 2)  # the heuristic config on the plain path
    assert floor_configs(inv) == [RepCfg("sum", 2), RepCfg("twice", 2)]  # the heuristic, then the plain path
    with ejlabel.use_implementation("twice"):
        assert ejlabel.Executor().selector.select(inv) == (RepCfg("twice", 2), "forced")
    with pytest.raises(TypeError, match="plain_implementation"):
        type("Bad", (RepKernel,), {"plain_implementation": 3})()


# -------------------------------------------------------------- item 3: one name for script and importer


_SCRIPT = """
import dataclasses, json, sys
import jax.numpy as jnp
import ejlabel
import ejlabel.analysis
from ejlabel.utils.serialize import to_json

@dataclasses.dataclass(frozen=True)
class UCfg:
    impl: str = "a"

def shift(x):
    return x

class K(ejlabel.Kernel):
    def run(self, x, *, cfg: UCfg, fn=None):
        return x

    def heuristic_cfg(self, inv) -> UCfg:
        return UCfg()

k = K()

if __name__ == "__main__":
    inv = ejlabel.Invocation(k, (jnp.ones(3),), {"fn": shift})
    print(json.dumps({"cfg": to_json(UCfg()), "op": k.op_id, "key": inv.call_key}))
"""


def test_a_script_and_a_process_importing_it_name_its_types_alike(tmp_path):
    (tmp_path / "umod.py").write_text(_SCRIPT)
    env = subprocess_env()
    as_script = subprocess.run([sys.executable, "umod.py"], cwd=tmp_path, capture_output=True, text=True, env=env, timeout=300)
    as_module = subprocess.run([sys.executable, "-m", "umod"], cwd=tmp_path, capture_output=True, text=True, env=env, timeout=300)
    importer = subprocess.run(
        [sys.executable, "-c", "import json, jax.numpy as jnp, ejlabel, umod\nfrom ejlabel.utils.serialize import to_json\n"
         "inv = ejlabel.Invocation(umod.k, (jnp.ones(3),), {'fn': umod.shift})\n"
         "print(json.dumps({'cfg': to_json(umod.UCfg()), 'op': umod.k.op_id, 'key': inv.call_key}))"],
        cwd=tmp_path, capture_output=True, text=True, env=env, timeout=300,
    )
    outs = []
    for proc in (as_script, as_module, importer):
        assert proc.returncode == 0, proc.stderr
        outs.append(json.loads(proc.stdout.splitlines()[-1]))
    assert outs[0] == outs[1] == outs[2]  # config type, op id, and a call key naming a function
    assert '"umod:UCfg"' in outs[0]["cfg"] and outs[0]["op"] == "umod.K"  # never __main__


def test_import_user_modules_takes_a_path_to_a_py_file(tmp_path):
    folder = tmp_path / "pkg_dir"
    folder.mkdir()
    (folder / "umod_by_path.py").write_text(_SCRIPT.replace("K(", "KByPath("))
    (module,) = import_user_modules([str(folder / "umod_by_path.py")])
    assert module.__name__ == "umod_by_path" and is_registered(module.UCfg)
    assert import_user_modules([str(folder / "umod_by_path.py")]) == [module]  # once
    with pytest.raises(ValueError, match="no such .py file"):
        import_user_modules([str(folder / "missing.py")])


# -------------------------------------------------------------- item 4: the policy says what it does


def test_allow_autotune_alone_keeps_its_meaning_and_the_selector_says_so_once():
    policy = ejlabel.AutotunePolicy(allow_autotune=True)
    assert policy.allow_autotune and policy.cache_miss_fallback == "heuristics" and not policy.tunes_on_miss
    executor = ejlabel.Executor(ejlabel.ConfigSelectorChain(policy=policy))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        executor(rep, X)
        executor(rep, jnp.ones(5))  # a second miss: no second warning
    said = [str(w.message) for w in caught if "never" in str(w.message) or "nothing is tuned" in str(w.message)]
    assert len(said) == 1 and "cache_miss_fallback='autotune'" in said[0]
    assert executor.selector.decision(ejlabel.Invocation(rep, (X,)).cache_key).provenance == "heuristic"
    for quiet in (ejlabel.AutotunePolicy(), ejlabel.AutotunePolicy(allow_autotune=True, cache_miss_fallback="heuristics")):
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            ejlabel.Executor(ejlabel.ConfigSelectorChain(policy=quiet))(rep, X)
