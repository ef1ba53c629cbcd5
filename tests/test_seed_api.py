"""The code examples of ejkernel's ``ops`` documentation, run with ``ejkernel.ops`` -> ``ejlabel``.

Each test is one example of the page (the seed documents under ``shared/seeds``), with only the
import changed; names the page leaves undefined (``my_kernel``, ``a``, ``b``, ``key``,
``config``, the attention implementations...) are filled in, and what the page says a call
returns is asserted. Where ejlabel is deliberately stricter than the page, the test says so.
"""

from __future__ import annotations

import dataclasses
import json
import re
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np
import pytest

# ---------------------------------------------------------------------------------------------
# "Basic Kernel Implementation" (verbatim but for the import)

from ejlabel import Kernel


@dataclass(frozen=True)
class MyConfig:
    block_size: int = 128
    num_warps: int = 4
    algorithm: str = "default"


class MyKernel(Kernel[MyConfig, jnp.ndarray]):
    def __init__(self):
        super().__init__(name="my_kernel")

    def run(self, a, b, *, cfg: MyConfig, **kwargs) -> jnp.ndarray:
        """Default implementation."""
        # Your operation logic here
        return jnp.dot(a, b)

    def heuristic_cfg(self, inv: "Invocation") -> MyConfig:
        """Generate config based on input shapes."""
        # inv.args contains the input arrays
        a = inv.args[0]
        block = 128 if a.shape[0] >= 128 else 64
        return MyConfig(block_size=block)

    # "Defining Config Space"
    def config_space(self, inv: "Invocation") -> list[MyConfig]:
        """Return configs to try during autotuning."""
        return [
            MyConfig(block_size=64, num_warps=2),
            MyConfig(block_size=128, num_warps=4),
            MyConfig(block_size=256, num_warps=8),
        ]


my_kernel = MyKernel()
a = jnp.arange(12.0).reshape(3, 4)
b = jnp.ones((4, 2))
kernel = my_kernel
args = (a, b)


def test_basic_kernel():
    from ejlabel import ConfigCache, ConfigSelectorChain, Executor

    executor = Executor(ConfigSelectorChain(cache=ConfigCache()))
    np.testing.assert_allclose(executor(my_kernel, a, b), jnp.dot(a, b))
    assert my_kernel.op_id == "my_kernel"
    assert executor.choose_config(my_kernel, a, b) == MyConfig(block_size=64)  # a.shape[0] < 128


# ---------------------------------------------------------------------------------------------
# "Platform-Specific Implementations"


@dataclass(frozen=True)
class AttentionConfig:
    triton_params: tuple = ()
    pallas_params: tuple = ()


def xla_attention(q, k, v):
    return jax.nn.softmax(q @ k.T) @ v


triton_flash_attention = pallas_attention = lambda q, k, v, **_: xla_attention(q, k, v)


class AttentionKernel(Kernel[AttentionConfig, jnp.ndarray]):
    def run_triton(self, q, k, v, *, cfg, **kwargs):
        """Triton GPU implementation."""
        return triton_flash_attention(q, k, v, **dict(cfg.triton_params))

    def run_pallas(self, q, k, v, *, cfg, **kwargs):
        """Pallas TPU implementation."""
        return pallas_attention(q, k, v, **dict(cfg.pallas_params))

    def run_xla(self, q, k, v, *, cfg, **kwargs):
        """XLA fallback implementation."""
        return xla_attention(q, k, v)

    def run(self, q, k, v, *, cfg, **kwargs):
        """Default fallback."""
        return self.run_xla(q, k, v, cfg=cfg, **kwargs)

    def heuristic_cfg(self, inv):
        return AttentionConfig()


def test_platform_specific_implementations():
    from ejlabel import Executor, get_device_platform

    attention = AttentionKernel()  # no op id given: ejkernel's default, module and class name
    assert attention.op_id.endswith("AttentionKernel")
    q = k = v = jnp.ones((4, 8))
    np.testing.assert_allclose(Executor()(attention, q, k, v), xla_attention(q, k, v), rtol=1e-6)
    expected = {"gpu": "run_triton", "tpu": "run_pallas"}.get(get_device_platform(), "run_xla")
    assert attention.implementation(get_device_platform()).__name__ == expected


# ---------------------------------------------------------------------------------------------
# "Custom Gradients (VJP)"


def custom_forward(a, b, cfg):
    return jnp.dot(a, b)


def custom_grad_a(a, b, ct, cfg):
    return ct @ b.T


def custom_grad_b(a, b, ct, cfg):
    return a.T @ ct


class MyVjpKernel(Kernel[MyConfig, jnp.ndarray]):
    def run(self, a, b, *, cfg, **kwargs):
        return custom_forward(a, b, cfg)

    def custom_vjp(self, primals, cfg, kwargs, cotangents):
        """Custom backward pass."""
        a, b = primals
        ct = cotangents[0]
        grad_a = custom_grad_a(a, b, ct, cfg)
        grad_b = custom_grad_b(a, b, ct, cfg)
        return (grad_a, grad_b)

    def heuristic_cfg(self, inv):
        return MyConfig()


def test_custom_vjp():
    from ejlabel import Executor

    vjp_kernel = MyVjpKernel("my_vjp_kernel")
    executor = Executor()
    loss = lambda a, b: executor(vjp_kernel, a, b).sum()
    ga, gb = jax.grad(loss, argnums=(0, 1))(a, b)
    ra, rb = jax.grad(lambda a, b: jnp.dot(a, b).sum(), argnums=(0, 1))(a, b)
    np.testing.assert_allclose(ga, ra)
    np.testing.assert_allclose(gb, rb)


# ---------------------------------------------------------------------------------------------
# "Invocation: Capturing Call Context"


def test_invocation():
    from ejlabel import Invocation

    # Created automatically by the executor
    inv = Invocation(
        kernel=my_kernel,
        args=(a, b),  # Positional arguments
        kwargs={"scale": 1.0},  # Keyword arguments
        metadata={"note": "shapes, dtypes, device info"},  # the page's {...}
    )
    # Access abstracted shapes (for config lookup)
    assert inv.abstract_args == (jax.ShapeDtypeStruct((3, 4), a.dtype), jax.ShapeDtypeStruct((4, 2), b.dtype))
    assert inv.device_fingerprint == __import__("ejlabel").device_fingerprint()
    assert re.fullmatch(r"[0-9a-f]{16}", inv.make_key())


# ---------------------------------------------------------------------------------------------
# "Executor: Running Kernels"


def test_executor():
    from ejlabel import ConfigCache, ConfigSelectorChain, Executor

    # Create the execution stack
    cache = ConfigCache()
    selector = ConfigSelectorChain(cache=cache)
    executor = Executor(selector)

    # Run a kernel
    result = executor(my_kernel, a, b)
    np.testing.assert_allclose(result, jnp.dot(a, b))

    # Run with explicit config
    my_config = MyConfig(block_size=32)
    result = executor(my_kernel, a, b, cfg=my_config)
    np.testing.assert_allclose(result, jnp.dot(a, b))
    inv = __import__("ejlabel").Invocation(my_kernel, (a, b))
    assert selector.decision(inv.cache_key).provenance == "override"


# ---------------------------------------------------------------------------------------------
# "ConfigCache (In-Memory)"


def test_config_cache():
    from ejlabel import ConfigCache, Invocation

    key = Invocation(my_kernel, (a, b)).cache_key
    config = MyConfig(block_size=256)
    cache = ConfigCache()

    # Store a config
    cache.put(key, config)

    # Retrieve
    config = cache.get(key)  # Returns None if not found
    assert config == MyConfig(block_size=256)
    assert cache.get(("cpu|", "other@v1", "0" * 16)) is None

    # Check existence
    assert key in cache
    assert cache.size() == len(cache) == 1 and cache.keys() == [key]


# ---------------------------------------------------------------------------------------------
# "PersistentCache (Disk-Based)"


def test_persistent_cache(tmp_path, monkeypatch):
    from ejlabel import Invocation, PersistentCache

    monkeypatch.setenv("HOME", str(tmp_path))  # the page's path is under ~
    key = Invocation(my_kernel, (a, b)).cache_key
    config = MyConfig(block_size=64)

    # Stored in ~/.cache/ejkernel/ by default
    persistent = PersistentCache(path="~/.cache/ejkernel/configs")

    # Same interface as ConfigCache
    persistent.put(key, config)
    config = persistent.get(key)
    assert config == MyConfig(block_size=64)
    assert persistent.path.is_relative_to(tmp_path / ".cache" / "ejkernel" / "configs")


# ---------------------------------------------------------------------------------------------
# "ConfigSelectorChain"


def test_config_selector_chain(isolated_cache_dir):
    from ejlabel import ConfigCache, ConfigSelectorChain, PersistentCache

    selector = ConfigSelectorChain(
        cache=ConfigCache(),  # Level 1: In-memory
        persistent=PersistentCache(),  # Level 2: Disk
        autotune=True,  # Level 3: Benchmark if not found
    )
    assert selector.policy.tunes_on_miss
    assert selector.persistent.path.parent == isolated_cache_dir


# ---------------------------------------------------------------------------------------------
# "Temporary Overrides"


def test_temporary_overrides():
    from ejlabel import ConfigCache, ConfigSelectorChain, Executor, Invocation, overlay_cache, policy_override

    executor = Executor(ConfigSelectorChain(autotune=True))
    my_custom_cache = ConfigCache()
    my_custom_cache.put(Invocation(my_kernel, (a, b)).cache_key, MyConfig(block_size=16))

    # Temporarily use different cache
    with overlay_cache(my_custom_cache):
        result = executor(kernel, *args)
    assert executor.selector.decision(Invocation(my_kernel, (a, b)).cache_key).cfg == MyConfig(block_size=16)

    # Temporarily change autotuning policy
    with policy_override(autotune=False):
        result = executor(kernel, *args)  # No autotuning
    assert executor.selector.decision(Invocation(my_kernel, (a, b)).cache_key).provenance == "heuristic"
    np.testing.assert_allclose(result, jnp.dot(a, b))


# ---------------------------------------------------------------------------------------------
# "Manual Autotuning"


def test_manual_autotuning():
    from ejlabel import Invocation, autotune, benchmark

    inv = Invocation(kernel, (a, b))
    # Autotune a specific kernel call
    best_config = autotune(
        kernel, a, b,
        configs=kernel.config_space(inv),
        num_warmup=3,
        num_iters=10,
    )
    assert best_config in kernel.config_space(inv)

    # Simple function benchmarking
    time_ms = benchmark(lambda: kernel(a, b), num_iters=100)
    assert isinstance(time_ms, float) and time_ms > 0 and time_ms.count == 100


# ---------------------------------------------------------------------------------------------
# "Batch Autotuning"


def test_batch_autotuning():
    from ejlabel import Invocation, autotune_recorded, get_invocations, record_invocation

    inv = Invocation(kernel, (a, b))
    # Enable recording
    record_invocation(kernel, inv)
    # ... run your model with various inputs ...

    # Get all recorded invocations
    invocations = get_invocations()
    assert [i.call_key for i in invocations] == [inv.call_key]

    # Autotune all at once
    results = autotune_recorded(invocations)
    assert set(results) == {(inv.op_id, inv.call_key)}
    # ejlabel always races the heuristic config too
    assert results[(inv.op_id, inv.call_key)] in [*kernel.config_space(inv), kernel.heuristic_cfg(inv)]


# ---------------------------------------------------------------------------------------------
# "vmap_with_config" / "pmap_with_config"


def test_vmap_with_config():
    from ejlabel import vmap_with_config

    batched_a, batched_b = jnp.stack([a, 2 * a]), jnp.stack([b, b])
    batched_result = vmap_with_config(
        kernel,
        in_axes=(0, 0),  # Batch over first axis
    )(batched_a, batched_b)
    np.testing.assert_allclose(batched_result, jnp.einsum("bij,bjk->bik", batched_a, batched_b))


def test_pmap_with_config():
    from ejlabel import pmap_with_config

    n = jax.local_device_count()
    sharded_a, sharded_b = jnp.stack([a] * n), jnp.stack([b] * n)
    # Run kernel across multiple devices
    parallel_result = pmap_with_config(
        kernel,
        axis_name="devices",
    )(sharded_a, sharded_b)
    np.testing.assert_allclose(parallel_result, jnp.stack([jnp.dot(a, b)] * n))


# ---------------------------------------------------------------------------------------------
# "FwdParams and BwdParams"


def test_fwd_bwd_params():
    from ejlabel import BwdParams, FwdParams

    fwd = FwdParams(
        q_blocksize=128,  # Query block size
        kv_blocksize=256,  # Key-value block size
        num_warps=4,  # GPU warps
        num_stages=2,  # Pipeline stages
    )
    bwd = BwdParams(
        q_blocksize=64,
        kv_blocksize=128,
    )
    assert (fwd.q_blocksize, fwd.kv_blocksize, fwd.num_warps, fwd.num_stages) == (128, 256, 4, 2)
    assert (bwd.q_blocksize, bwd.kv_blocksize, bwd.num_warps) == (64, 128, None)


# ---------------------------------------------------------------------------------------------
# "Device Detection" (and the examples of ejkernel.ops.utils.fingerprint)


def test_device_detection():
    from ejlabel import device_fingerprint, device_kind, get_device_platform

    # Get device type
    assert device_kind() in ("gpu", "tpu", "cpu")
    # Get platform for dispatch. The overview page says "triton", "pallas" or "xla"; the
    # function's own documentation (and ejlabel) says "gpu", "tpu" or "cpu".
    assert get_device_platform() in ("gpu", "tpu", "cpu")
    assert get_device_platform(jax.devices("cpu")[0]) == "cpu"
    # Unique device identifier (for caching)
    fingerprint = device_fingerprint()
    assert isinstance(fingerprint, str) and fingerprint.startswith(device_kind())
    assert device_fingerprint(jax.devices("cpu")[0]).startswith("cpu")


# ---------------------------------------------------------------------------------------------
# "Sharding Utilities"


def test_sharding_utilities():
    from ejlabel import Invocation, default_key_builder_with_sharding, sharding_fingerprint

    array = jnp.ones((4, 4))
    # Get fingerprint of array sharding
    fingerprint = sharding_fingerprint(array)
    # ejlabel: an array on one device is unsharded, and fingerprints like a plain spec.
    assert fingerprint is None if len(array.sharding.device_set) == 1 else isinstance(fingerprint, str)
    assert sharding_fingerprint("not an array") is None

    # Build cache key including sharding info. The overview page writes
    # default_key_builder_with_sharding(kernel, args, kwargs); the function's own documentation
    # (and ejlabel) takes the invocation.
    key = default_key_builder_with_sharding(Invocation(kernel, (a, b), {}))
    assert re.fullmatch(r"[0-9a-f]{16}", key) and key == Invocation(kernel, (a, b)).call_key


# ---------------------------------------------------------------------------------------------
# "Serialization" (and short_hash / abstractify / stable_json of the fingerprint module)


def test_serialization():
    from ejlabel import from_json, stable_json, to_json

    config = MyConfig(block_size=64)
    # Serialize config to JSON
    json_str = to_json(config)
    # Deserialize
    config = from_json(json_str, MyConfig)
    assert config == MyConfig(block_size=64)
    # Stable JSON (deterministic ordering for cache keys)
    stable_str = stable_json(config)
    assert stable_str == stable_json(MyConfig(block_size=64)) and json.loads(stable_str)


def test_fingerprint_examples():
    from ejlabel import abstractify, short_hash

    config = {"block_size": 128, "num_warps": 4}
    assert re.fullmatch(r"[0-9a-f]{16}", short_hash(config))
    assert short_hash({"a": 1, "b": [2, 3]}) == short_hash({"b": [2, 3], "a": 1})
    data = {"x": jnp.array([1, 2, 3]), "y": "scalar"}
    abstract = abstractify(data)
    assert abstract == {"x": jax.ShapeDtypeStruct((3,), data["x"].dtype), "y": "scalar"}
    arr = jnp.ones((2, 3))
    assert abstractify(arr) == jax.ShapeDtypeStruct((2, 3), jnp.float32)


# ---------------------------------------------------------------------------------------------
# "HLO Analysis" / "Labeling Operations" (and ejkernel.ops.utils.meta's examples)


def test_hlo_analysis():
    from ejlabel import extract_labels_from_hlo_text, find_labels_in_lowered, labels_to_configs

    fn = lambda a, b: kernel(a, b)
    # Find labeled operations in lowered JAX code
    lowered = jax.jit(fn).lower(*args)
    labels = find_labels_in_lowered(lowered)
    assert len(labels) == 1 and labels[0].startswith("ejkernel_ops#my_kernel@v1:")

    # Extract from HLO text
    hlo_text = lowered.compiler_ir("hlo").as_hlo_text()
    labels = extract_labels_from_hlo_text(hlo_text)
    assert labels == find_labels_in_lowered(lowered)

    # Convert labels to configs (the default executor's selector, which ran the call)
    configs = labels_to_configs(labels)
    assert [(lab, cfg) for lab, cfg in configs] == [(labels[0], MyConfig(block_size=64))]


def test_label_examples():
    from ejlabel import label

    op_label = label("matmul@v1", "0123456789abcdef")
    assert op_label == "ejkernel_ops#matmul@v1:0123456789abcdef"
    # The page's example hash '1a2b3c4d5e6f7g8h' is not hex; ejkernel's own LABEL_RE would not
    # read that label back, and ejlabel refuses to write it.
    with pytest.raises(ValueError, match="16 lowercase hex"):
        label("matmul@v1", "1a2b3c4d5e6f7g8h")


def test_label_decorator():
    from ejlabel import find_labels_in_lowered, label

    def attention_impl(q, k, v):
        return xla_attention(q, k, v)

    # Add label for HLO analysis
    @label("my_attention")
    def my_attention(q, k, v):
        return attention_impl(q, k, v)

    q = jnp.ones((4, 8))
    np.testing.assert_allclose(my_attention(q, q, q), xla_attention(q, q, q))
    labels = find_labels_in_lowered(jax.jit(my_attention).lower(q, q, q))
    assert len(labels) == 1 and "my_attention" in labels[0]


# ---------------------------------------------------------------------------------------------
# "Define Good Heuristics"


def test_good_heuristics():
    from ejlabel import Invocation

    def heuristic_cfg(self, inv):
        # Consider input shapes
        q = inv.args[0]
        batch, seq_len, heads, dim = q.shape

        # Larger sequences benefit from larger blocks
        if seq_len >= 2048:
            block = 256
        elif seq_len >= 512:
            block = 128
        else:
            block = 64

        return MyConfig(block_size=block)

    for seq_len, block in ((4096, 256), (1024, 128), (16, 64)):
        inv = Invocation(kernel, (jax.ShapeDtypeStruct((1, seq_len, 2, 8), jnp.float32),))
        assert heuristic_cfg(kernel, inv) == MyConfig(block_size=block)


# ---------------------------------------------------------------------------------------------
# "Type Variables"


def test_type_variables():
    import typing

    from ejlabel import Cfg, Executor, Out

    assert isinstance(Cfg, typing.TypeVar) and isinstance(Out, typing.TypeVar)
    assert Executor[Cfg, Out] is not None and Kernel[MyConfig, jnp.ndarray] is not None
    assert dataclasses.is_dataclass(MyConfig)
