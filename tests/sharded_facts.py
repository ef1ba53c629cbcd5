"""Facts about kernel calls and the example model split over 4 forced CPU devices, as JSON.

Run as a script in a child process (``tests/test_sharded.py``): the device count must be set
before JAX starts, and the test process has one device. Each fact is measured, never judged
here; the tests assert on them.
"""

from __future__ import annotations

import os

os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=4"

import argparse  # noqa: E402
import dataclasses  # noqa: E402
import json  # noqa: E402
import traceback  # noqa: E402
from typing import Any  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from jax.sharding import NamedSharding, PartitionSpec as P  # noqa: E402

import ejlabel  # noqa: E402
from ejlabel import examples  # noqa: E402
from ejlabel.analysis import audit, parse_hlo  # noqa: E402
from ejlabel.core.calls import decode_call  # noqa: E402
from ejlabel.core.label_format import CALL_ATTRIBUTE, LABEL_ATTRIBUTE  # noqa: E402
from ejlabel.kernels.attention import AttentionConfig, flash_attention  # noqa: E402
from ejlabel.kernels.cross_entropy import CrossEntropyConfig, softmax_cross_entropy  # noqa: E402
from ejlabel.kernels.linear_cross_entropy import LinearCrossEntropyConfig, linear_cross_entropy  # noqa: E402
from ejlabel.kernels.matmul import MatmulConfig, MatmulKernel, matmul  # noqa: E402
from ejlabel.kernels.norms import NormConfig, rms_norm  # noqa: E402

MESH = jax.make_mesh((4,), ("data",))


def put(x: Any, spec: P) -> Any:
    return jax.device_put(x, NamedSharding(MESH, spec))


def normal(seed: int, shape: tuple[int, ...], dtype: Any = jnp.float32) -> jax.Array:
    return jax.random.normal(jax.random.key(seed), shape, jnp.float32).astype(dtype)


def program_facts(lowered: Any) -> dict[str, Any]:
    """The compiled program's all-gathers (result shapes), and every labelled call's arguments
    and shardings as its description states them."""
    gathers = [i.shape for i in parse_hlo(lowered.compile().as_text()).instructions() if i.opcode == "all-gather"]
    described = {}
    for inst in parse_hlo(lowered.compiler_ir("hlo").as_hlo_text()).instructions():
        attrs = inst.frontend_attributes
        if CALL_ATTRIBUTE in attrs:
            desc = decode_call(attrs[CALL_ATTRIBUTE], attrs[LABEL_ATTRIBUTE])
            leaves = jax.tree_util.tree_leaves((desc.args, desc.kwargs))
            described[attrs[LABEL_ATTRIBUTE]] = {
                "shapes": [list(x.shape) for x in leaves if hasattr(x, "shape")],
                "shardings": list(desc.shardings),
            }
    return {"all_gathers": gathers, "labels": sorted(set(ejlabel.find_labels_in_lowered(lowered))), "described": described}


def kernel_case(fn: Any, args: tuple[Any, ...], specs: tuple[P, ...], n_float: int, local_fn: Any = None) -> dict[str, Any]:
    """One kernel call with a forced non-XLA config, differentiated in its first ``n_float``
    arguments: split over the 4 devices as ``specs`` say against whole on one, and its labels
    against those of the call each device runs (``local_fn``, default ``fn``) made unsharded on
    one shard's shapes."""
    loss = lambda *a: jnp.sum(jnp.square(fn(*a).astype(jnp.float32)))
    grad = jax.jit(jax.value_and_grad(loss, argnums=tuple(range(n_float))))
    sharded = tuple(put(a, s) for a, s in zip(args, specs))
    facts = program_facts(grad.lower(*sharded))
    value, grads = grad(*sharded)
    whole_value, whole_grads = grad(*args)
    facts["value_error"] = float(abs(value - whole_value) / max(abs(float(whole_value)), 1.0))
    facts["grad_error"] = max(float(jnp.max(jnp.abs(g - w)) / max(float(jnp.max(jnp.abs(w))), 1e-6)) for g, w in zip(grads, whole_grads))
    shard = [a[: a.shape[0] // 4] if spec and spec[0] == "data" else a for a, spec in zip(args, specs)]
    local_loss = lambda *a: jnp.sum(jnp.square((local_fn or fn)(*a).astype(jnp.float32)))
    local = jax.jit(jax.grad(local_loss, argnums=tuple(range(n_float)))).lower(*shard)
    facts["local_labels"] = sorted(set(ejlabel.find_labels_in_lowered(local)))
    return facts


def kernels() -> dict[str, Any]:
    """Each kernel on a forced non-XLA path, its rows (tokens, batch) split over the devices."""
    mm, norm = MatmulConfig("pallas", 8, 8, 8), NormConfig("pallas", 4, 4)
    attn, ce = AttentionConfig("pallas"), CrossEntropyConfig("pallas")
    lce = LinearCrossEntropyConfig("chunked_tokens", chunk_tokens=8)
    segments = jnp.repeat(jnp.array([[1, 1, 2, 2, 2, 3, 3, 3] * 2]), 8, axis=0)
    labels = jax.random.randint(jax.random.key(9), (32,), 0, 24)
    rows = P("data")
    cases = {  # (fn, args with the differentiated floats first, specs, how many floats)
        "matmul": (lambda a, b: matmul(a, b, cfg=mm), (normal(0, (32, 16)), normal(1, (16, 24))), (rows, P()), 2),
        "rms_norm": (lambda x, w: rms_norm(x, w, cfg=norm), (normal(2, (32, 16)), normal(3, (16,))), (rows, P()), 2),
        "flash_attention": (
            lambda q, k, v, s: flash_attention(q, k, v, causal=True, segment_ids=s, cfg=attn),
            (normal(4, (8, 16, 4, 16)), normal(5, (8, 16, 2, 16)), normal(6, (8, 16, 2, 16)), segments), (rows,) * 4, 3,
        ),
        "cross_entropy": (lambda z, y: softmax_cross_entropy(z, y, cfg=ce), (normal(7, (32, 24)), labels), (rows, rows), 1),
        "linear_cross_entropy": (
            lambda h, w, y: linear_cross_entropy(h, w, y, reduction="mean", cfg=lce),
            (normal(8, (32, 16)), normal(10, (16, 24)), labels), (rows, P(), rows), 2,
            lambda h, w, y: linear_cross_entropy(h, w, y, reduction="sum", cfg=lce),  # each shard sums its tokens
        ),
    }

    def layers(x: jax.Array, ws: jax.Array) -> jax.Array:  # scanned, rematerialised layers
        def layer(h: jax.Array, w: jax.Array) -> tuple[jax.Array, None]:
            return jnp.tanh(matmul(rms_norm(h, jnp.ones(h.shape[-1]), cfg=norm), w, cfg=mm)), None
        return jax.lax.scan(jax.checkpoint(layer), x, ws)[0]

    cases["scan"] = (layers, (normal(11, (32, 16)), 0.3 * normal(12, (3, 16, 16))), (rows, P()), 2)
    facts = {name: kernel_case(*case) for name, case in cases.items()}
    facts["autotune"] = autotune_facts()
    return facts


def autotune_facts() -> dict[str, Any]:
    """``ejlabel.autotune`` and ``choose_config`` on split arguments: the keys they use."""
    selector = ejlabel.ConfigSelectorChain()
    kernel, a, b = MatmulKernel(), put(normal(13, (32, 16)), P("data")), normal(14, (16, 24))
    best = ejlabel.autotune(kernel, a, b, configs=[MatmulConfig("pallas", 8, 8, 8), MatmulConfig("xla")], selector=selector)
    shard = ejlabel.Invocation(kernel, (jax.ShapeDtypeStruct((8, 16), jnp.float32), jax.ShapeDtypeStruct((16, 24), jnp.float32)))
    return {
        "stored": sorted(key[2] for key in selector.cache.keys()),
        "per_shard_key": shard.call_key,
        "chosen_is_best": ejlabel.Executor(selector).choose_config(kernel, a, b) == best,
    }


def model(mode: str) -> dict[str, Any]:
    """The TINY packed model, batch 4, data parallel (``dp``) or FSDP (``fsdp``) over 4 devices:
    its kernels forced off XLA; data parallel also on the XLA path, plain, and unsharded."""
    cfg = dataclasses.replace(examples.TINY_PACKED, batch=4)
    params = examples.init_params(cfg, jax.random.key(0))
    batch = examples.example_batch(cfg, jax.random.key(1))
    sharded_params, sharded_batch = examples.place_on_mesh(MESH, params, batch, fsdp=mode == "fsdp")
    facts: dict[str, Any] = {"param_shapes": sorted({f"f32{list(p.shape)}".replace(" ", "") for p in jax.tree_util.tree_leaves(params)})}
    losses = {}
    for forced in ("pallas", "xla") if mode == "dp" else ("pallas",):
        with ejlabel.use_implementation(forced):
            step = jax.jit(examples.make_train_step(cfg, examples.KERNEL_OPS))
            lowered = step.lower(sharded_params, sharded_batch)
            facts[forced] = program_facts(lowered)
            losses[forced] = float(step(sharded_params, sharded_batch)[1])
        if forced == "pallas":
            report = audit(lowered.compile(), selector=ejlabel.ConfigSelectorChain())
            facts["audit"] = sorted({(s.label, s.arguments) for s in report.summaries})
        else:
            facts["xla_instructions"] = [(i.opcode, i.shape) for i in parse_hlo(lowered.compile().as_text()).instructions()]
    facts["losses"] = losses
    if mode == "fsdp":  # the plain model and the unsharded one are the data-parallel facts'
        return facts
    plain = jax.jit(examples.make_train_step(cfg, examples.PLAIN_OPS))
    facts["plain_instructions"] = [(i.opcode, i.shape) for i in parse_hlo(plain.lower(sharded_params, sharded_batch).compile().as_text()).instructions()]
    losses["plain"] = float(plain(sharded_params, sharded_batch)[1])
    losses["unsharded"] = float(jax.jit(examples.make_train_step(cfg, examples.PLAIN_OPS))(params, batch)[1])
    # The calls as one device runs them: the same model at batch 1, unsharded.
    one = dataclasses.replace(cfg, batch=1)
    with ejlabel.use_implementation("pallas"):
        local = jax.jit(examples.make_train_step(one, examples.KERNEL_OPS)).lower(
            jax.eval_shape(lambda: params), jax.eval_shape(lambda: examples.example_batch(one, jax.random.key(1)))
        )
    facts["local_labels"] = sorted(set(ejlabel.find_labels_in_lowered(local)))
    return facts


if __name__ == "__main__":
    # Several parts in one process (one JAX start): {part: facts}, each from a fresh executor,
    # to --out (written whole, then renamed: a reader never sees half of it) or standard output.
    parser = argparse.ArgumentParser()
    parser.add_argument("parts", nargs="+", choices=("kernels", "dp", "fsdp"))
    parser.add_argument("--out")
    args = parser.parse_args()
    out = args.out
    facts = {}
    try:
        for part in args.parts:
            ejlabel.set_default_executor(None)
            ejlabel.clear_invocations()
            facts[part] = kernels() if part == "kernels" else model(part)
    except BaseException:
        if out is not None:  # what a reader waiting for --out reports
            with open(out + ".failed", "w") as f:
                f.write(traceback.format_exc())
        raise
    if out is None:
        print(json.dumps(facts))
    else:
        with open(out + ".part", "w") as f:
            json.dump(facts, f)
        os.replace(out + ".part", out)
