"""The kernels' stored names outlive their modules' layout.

Caches, exported config files and call descriptions name config and kernel classes as
``module:QualName`` and ops as ``op@vN``. The ops' packages keep their classes in the package
``__init__`` (``ejlabel.kernels.attention:AttentionConfig``, as when the op was one module), so
configs written before the ops became packages still decode. ``data/caches`` holds an export
written then, with one entry per op.

Importing the kernels registers those classes without importing Pallas: its backends load when
a Pallas kernel first runs.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import ejlabel.kernels as K
from ejlabel import BwdParams, FwdParams, PersistentCache, from_json, to_json
from ejlabel.core.registry import registered_kernels
from ejlabel.utils.serialize import qualified_name

from conftest import run_python

BEFORE_PACKAGES = Path(__file__).parent / "data" / "caches" / "kernel_configs_before_packages.json"

CONFIGS = {
    "flash_attention@v1": K.AttentionConfig("mosaic", FwdParams(kv_blocksize=64, num_stages=3), BwdParams(64, 128, None, 2)),
    "matmul@v1": K.MatmulConfig("pallas", 64, 128, 32),
    "rms_norm@v1": K.NormConfig("pallas", 2, 8),
    "layer_norm@v1": K.NormConfig("xla"),
    "cross_entropy@v2": K.CrossEntropyConfig("pallas", 4, 1024, 4),
    "linear_cross_entropy@v6": K.LinearCrossEntropyConfig("chunked_tokens_triton", chunk_tokens=4096),
}


def test_config_and_kernel_classes_keep_their_stored_names() -> None:
    configs = {qualified_name(t) for t in (K.AttentionConfig, K.MatmulConfig, K.NormConfig, K.CrossEntropyConfig, K.LinearCrossEntropyConfig)}
    assert configs == {
        "ejlabel.kernels.attention:AttentionConfig",
        "ejlabel.kernels.matmul:MatmulConfig",
        "ejlabel.kernels.norms:NormConfig",
        "ejlabel.kernels.cross_entropy:CrossEntropyConfig",
        "ejlabel.kernels.linear_cross_entropy:LinearCrossEntropyConfig",
    }
    assert {name for name in registered_kernels() if name.startswith("ejlabel.kernels")} == {
        "ejlabel.kernels.attention:AttentionKernel",
        "ejlabel.kernels.cross_entropy:CrossEntropyKernel",
        "ejlabel.kernels.linear_cross_entropy:LinearCrossEntropyKernel",
        "ejlabel.kernels.matmul:MatmulKernel",
        "ejlabel.kernels.norms:LayerNormKernel",
        "ejlabel.kernels.norms:RMSNormKernel",
        "ejlabel.kernels.norms:_NormKernel",
    }


def test_op_ids_and_versions_are_unchanged() -> None:
    kernels = (K.AttentionKernel, K.MatmulKernel, K.RMSNormKernel, K.LayerNormKernel, K.CrossEntropyKernel, K.LinearCrossEntropyKernel)
    assert sorted(kernel().versioned_id for kernel in kernels) == sorted(CONFIGS)


# Fields added to a config since the export, with the value an entry without them decodes to
# (the behaviour of the code that wrote it).
ADDED_SINCE = {"flash_attention@v1": {"fwd_schedule": "pingpong"}}


@pytest.mark.parametrize("op_id", sorted(CONFIGS))
def test_configs_encode_as_before(op_id: str) -> None:
    """A config written now is the text written before the packages, with the fields added
    since at their defaults, and that text decodes."""
    written = {entry["op_id"]: entry for entry in json.loads(BEFORE_PACKAGES.read_text())["entries"]}[op_id]
    now = json.loads(to_json(CONFIGS[op_id]))
    added = ADDED_SINCE.get(op_id, {})
    assert {name: now["fields"].pop(name) for name in added} == added
    assert now == written["config"]
    assert written["config_type"] == qualified_name(type(CONFIGS[op_id]))
    assert from_json(json.dumps(written["config"])) == CONFIGS[op_id]


def test_a_cache_exported_before_the_packages_imports(tmp_path: Path) -> None:
    cache = PersistentCache(tmp_path / "cache.db")
    assert cache.import_(BEFORE_PACKAGES) == len(CONFIGS)
    entries = cache.entries(include_undecodable=True)
    assert [entry.status for entry in entries] == ["ok"] * len(CONFIGS)
    assert {entry.op_id: entry.config for entry in entries} == CONFIGS


PALLAS = ("jax.experimental.pallas", "jax._src.pallas.mosaic_gpu", "jax._src.pallas.triton")


def test_pallas_loads_when_a_kernel_first_runs_not_at_import() -> None:
    """A fresh process that imports the kernels and the command (as every ``ejlabel`` command
    does) has the config classes registered and no Pallas backend loaded; one Pallas attention
    call, interpreted on the CPU, loads them."""
    code = f"""
import json, sys
import jax.numpy as jnp
import ejlabel.kernels as K, ejlabel.cli.main
from ejlabel import BwdParams, FwdParams
from ejlabel.core.registry import registered_kernels

loaded = lambda: [name for name in {PALLAS!r} if name in sys.modules]
print(json.dumps(["ejlabel.kernels.attention:AttentionKernel" in registered_kernels(), loaded()]))
q = jnp.ones((1, 16, 1, 16), jnp.float32)
cfg = K.AttentionConfig("pallas", FwdParams(16, 16, 4, 1), BwdParams(16, 16, 4, 1))
K.flash_attention(q, q, q, cfg=cfg).block_until_ready()
print(json.dumps(loaded()))
"""
    imported, ran = (json.loads(line) for line in run_python(code).splitlines()[-2:])
    assert imported == [True, []], f"registered, and Pallas modules loaded at import: {imported}"
    assert ran == list(PALLAS)
