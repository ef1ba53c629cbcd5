"""The Mosaic GPU flash attention (kernels/attention/mosaic/).

On the CPU (the plans and the work order have tests of their own, test_mosaic_plan.py and
test_mosaic_work.py; the experimental schedules test_mosaic_experimental.py): lowering to the
Mosaic GPU module for a grid of shapes and options (it catches shape, layout and type errors
without a GPU), and values and gradients in the Mosaic GPU interpreter at small sizes. On a
Hopper GPU: values and gradients against a float32 reference over head dims, odd lengths,
segments and GQA ratios (arg_specs.GPU_GRID).

The kernels are driven through ``experimental.mosaic_attention``, their one differentiable
entry point with every knob; with its defaults it runs the product's kernels, and
``test_gpu_flash_attention_mosaic`` runs them through ``flash_attention`` itself.
"""

from __future__ import annotations

import functools
import importlib
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from ejlabel.kernels import attention as attention_module
from ejlabel.kernels.attention import AttentionConfig, AttentionKernel, flash_attention
from ejlabel.kernels.attention import mosaic as am
from ejlabel.kernels.attention.arg_specs import GPU_GRID, ArgSpec
from ejlabel.kernels.attention.masks import window_bounds
from ejlabel.kernels.attention.mosaic import backward as mbackward
from ejlabel.kernels.attention.mosaic import budget as mbudget
from ejlabel.kernels.attention.mosaic import plan as mplan
from ejlabel.kernels.attention.mosaic.experimental import mosaic_attention
from kernel_checks import attention_reference as reference
from kernel_checks import (
    check_interpreted_backward, dense_visibility, documents, gpu, interpreted_values_and_gradients, kernel_hashes, lower_for_cuda, needs_gpu, needs_hopper, qkv,
    rel_error,
)
from conftest import REPO_ROOT
from kernel_checks import races  # noqa: F401  (a fixture)

import ejlabel
from ejlabel import BwdParams, FwdParams, Invocation, analysis, label, label_scope

pytestmark = pytest.mark.skipif(not am.mosaic_available(), reason="this JAX has no Pallas Mosaic GPU backend")


# --------------------------------------------------------------------------------------------
# Lowering to the Mosaic GPU module (no GPU needed)


@pytest.mark.parametrize(
    ("dim", "kv_heads", "options", "params"),
    [
        (64, 4, {"causal": True}, FwdParams(kv_blocksize=128, num_stages=3)),
        (128, 2, {"causal": True, "pingpong": True}, FwdParams()),
        (128, 2, {"causal": True, "segments": True}, FwdParams()),
        (256, 1, {"causal": False}, FwdParams()),
        (128, 2, {"causal": True, "pipelined": True}, FwdParams()),
        (128, 2, {"causal": True, "pipelined": True, "pingpong": True}, FwdParams()),
        (64, 2, {"causal": True, "segments": True, "pipelined": True}, FwdParams(kv_blocksize=64)),
        (96, 4, {"window": (64, 16)}, FwdParams(kv_blocksize=64)),
    ],
)
def test_forward_lowers_to_mosaic_gpu(dim: int, kv_heads: int, options: dict[str, Any], params: FwdParams) -> None:
    q = jax.ShapeDtypeStruct((2, 300, 4, dim), jnp.bfloat16)
    k = jax.ShapeDtypeStruct((2, 300, kv_heads, dim), jnp.bfloat16)
    seg = jax.ShapeDtypeStruct((2, 300), jnp.int32) if options.get("segments") else None
    bounds = window_bounds(options.get("causal", False), options.get("window"))

    def fwd(q: jax.Array, k: jax.Array, v: jax.Array, seg: jax.Array | None) -> tuple[jax.Array, jax.Array]:
        return am.mosaic_forward(
            q, k, v, seg, scale=0.1, bounds=bounds, params=params, pingpong=options.get("pingpong", False), pipelined=options.get("pipelined", False),
        )

    text = lower_for_cuda(fwd, q, k, k, seg)
    assert "mosaic_gpu" in text


@pytest.mark.parametrize(("seq", "copied"), [(1000, False), (300, True)])
def test_sequences_are_not_copied_to_whole_tiles_on_the_gpu(seq: int, copied: bool) -> None:
    # TMA reads a tile's tail past the end as zeros: a length of whole 8-row swizzle tiles goes
    # to the kernels as it is, forward and backward (only the small row terms are padded); any
    # other length is padded to them.
    q = jax.ShapeDtypeStruct((2, seq, 4, 128), jnp.bfloat16)

    def loss(q: jax.Array, k: jax.Array, v: jax.Array) -> jax.Array:
        return mosaic_attention(q, k, v, causal=True).astype(jnp.float32).sum()

    padded = [line for line in lower_for_cuda(jax.grad(loss, argnums=(0, 1, 2)), q, q, q).splitlines() if "stablehlo.pad" in line]
    assert any(f"x{seq}x4x128x" in line for line in padded) == copied
    whole_tiles = -(-seq // am.TILE) * am.TILE
    assert not any(f"x{whole_tiles}x4x128x" in line for line in padded)  # nor to whole 128-row tiles


@pytest.mark.parametrize(("dim", "kv_heads", "segments"), [(64, 2, True), (128, 4, False), (256, 2, True), (256, 1, False)])
def test_backward_lowers_to_mosaic_gpu(dim: int, kv_heads: int, segments: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    q = jax.ShapeDtypeStruct((1, 200, 4, dim), jnp.float16)
    k = jax.ShapeDtypeStruct((1, 200, kv_heads, dim), jnp.float16)
    seg = jax.ShapeDtypeStruct((1, 200), jnp.int32) if segments else None
    depths: list[tuple[int, int]] = []
    chosen = mbackward.ring_depths
    monkeypatch.setattr(mbackward, "ring_depths", lambda *args: depths.append(chosen(*args)) or depths[-1])
    jax.clear_caches()  # every kernel traced here, so each asks for its ring

    def loss(q: jax.Array, k: jax.Array, v: jax.Array, seg: jax.Array | None) -> jax.Array:
        return mosaic_attention(q, k, v, causal=True, segment_ids=seg).astype(jnp.float32).sum()

    # Lowering checks each kernel's shared memory against the GPU's, byte for byte.
    text = lower_for_cuda(jax.grad(loss, argnums=(0, 1, 2)), q, k, k, seg)
    # Forward, then dq and dk/dv kernels; above head dim 128 dv and dk take a kernel each.
    assert text.count("@mosaic_gpu") == (3 if dim <= 128 else 4)
    # Rings (held blocks, freed blocks) of the dq kernel and each dk/dv walk: at head dim 256 the
    # held blocks' second slot fits exactly, with segment ids or without (budget.ring_depths).
    assert depths == ([(2, 2)] * 2 if dim <= 128 else [(2, 1), (2, 2), (2, 1)])
    assert "cp.reduce.async.bulk" not in text  # no reduce-adds: no kernel shares a gradient
    # delta = sum_d out * dO: in the dq kernel where its tiles fit twice with the output's
    # (head dim 64), else one contraction before the kernels.
    assert mbackward.dq_tiles(dim, jnp.float16, am.tile_blocks(BwdParams(), dim)[1], (2, 2)) == {64: (2, True), 128: (2, False), 256: (1, False)}[dim]
    assert ("stablehlo.dot_general" in text) == (dim > 64)


def _jaxprs_in(eqn: Any) -> Any:
    """The jaxprs among an equation's parameters (a loop's body, a kernel's program)."""
    from jax.extend import core as jcore

    for value in eqn.params.values():
        for sub in value if isinstance(value, (tuple, list)) else (value,):
            if isinstance(sub, (jcore.Jaxpr, jcore.ClosedJaxpr)):
                yield getattr(sub, "jaxpr", sub)


def _eqns(jaxpr: Any) -> Any:
    """Every equation of ``jaxpr`` and of the jaxprs in its equations, all the way down."""
    for eqn in jaxpr.eqns:
        yield eqn
        for sub in _jaxprs_in(eqn):
            yield from _eqns(sub)


@pytest.mark.parametrize(("dim", "schedule"), [(256, {}), (64, {"pipelined": True})])
def test_every_walk_picks_its_tiles_in_each_step(dim: int, schedule: dict[str, bool]) -> None:
    # A loop issuing products must pick its tiles in its own body (kernel.per_step): picked
    # before it, their wgmma descriptors were held in registers across the walk, and the D256
    # backward kernels spilled.
    q = jax.ShapeDtypeStruct((1, 200, 4, dim), jnp.bfloat16)

    def loss(q: jax.Array, k: jax.Array, v: jax.Array) -> jax.Array:
        return mosaic_attention(q, k, v, causal=True, **schedule).astype(jnp.float32).sum()

    program = jax.make_jaxpr(jax.grad(loss, argnums=(0, 1, 2)))(q, q, q).jaxpr
    kernels = [eqn for eqn in _eqns(program) if eqn.primitive.name in ("mpmd_map", "pallas_call")]  # by JAX release
    assert len(kernels) == (3 if dim <= 128 else 4)
    for kernel in kernels:
        loops = [eqn.params["body_jaxpr"].jaxpr for sub in _jaxprs_in(kernel) for eqn in _eqns(sub) if eqn.primitive.name == "while"]
        # The walks: the innermost loops issuing products (an item's loop issues some too,
        # after its walk, on ring slots alone).
        names = [{eqn.primitive.name for eqn in _eqns(body)} for body in loops]
        walks = [body for body, used in zip(loops, names) if "wgmma_ref" in used and "while" not in used]
        assert walks, "a kernel without a walk"
        assert all(any(eqn.primitive.name == "optimization_barrier" for eqn in body.eqns) for body in walks)


@pytest.mark.parametrize(("schedule", "dim", "segments"), [("pingpong_dq", 128, True), ("pingpong_dkv", 128, False)])
def test_backward_schedules_lower_to_mosaic_gpu(dim: int, segments: bool, schedule: str) -> None:
    q = jax.ShapeDtypeStruct((1, 200, 4, dim), jnp.bfloat16)
    seg = jax.ShapeDtypeStruct((1, 200), jnp.int32) if segments else None

    def loss(q: jax.Array, k: jax.Array, v: jax.Array, seg: jax.Array | None) -> jax.Array:
        return mosaic_attention(q, k, v, causal=True, segment_ids=seg, **{schedule: True}).astype(jnp.float32).sum()

    assert lower_for_cuda(jax.grad(loss, argnums=(0, 1, 2)), q, q, q, seg).count("@mosaic_gpu") == 3


@pytest.mark.parametrize("dim", [64, 128])
def test_backward_takes_turns_by_default_up_to_dim_64(dim: int) -> None:
    q = jax.ShapeDtypeStruct((1, 200, 4, dim), jnp.bfloat16)

    def lowered(**schedule: bool) -> str:
        loss = lambda q, k, v: mosaic_attention(q, k, v, causal=True, **schedule).astype(jnp.float32).sum()  # noqa: E731
        return lower_for_cuda(jax.grad(loss, argnums=(0, 1, 2)), q, q, q)

    # Above dim 64 the schedules-lowering test shows that the flags change the kernels.
    turns = dim <= am.BACKWARD_PINGPONG_MAX_DIM
    assert lowered() == lowered(pingpong_dq=turns, pingpong_dkv=turns)
    if turns:
        assert lowered() != lowered(pingpong_dq=False, pingpong_dkv=False)


@pytest.mark.parametrize(("dim", "segments"), [(64, False), (256, True)])
def test_backward_turns_need_two_ring_stages(dim: int, segments: bool) -> None:
    """With a one-stage ring (asked for: every default ring has two slots of the blocks a step
    holds) consumers taking turns would wait on each other forever: asked for, they raise; by
    default there are none."""
    q = jax.ShapeDtypeStruct((1, 200, 2, dim), jnp.bfloat16)
    seg = jax.ShapeDtypeStruct((1, 200), jnp.int32) if segments else None
    params = (FwdParams(), BwdParams(num_stages=1))

    def lowered(**schedule: bool) -> str:
        loss = lambda q, k, v, seg: mosaic_attention(q, k, v, causal=True, segment_ids=seg, params=params, **schedule).astype(jnp.float32).sum()  # noqa: E731
        return lower_for_cuda(jax.grad(loss, argnums=(0, 1, 2)), q, q, q, seg)

    with pytest.raises(ValueError, match="pingpong: .* two ring stages at least, got stages=1"):
        lowered(pingpong_dq=True)
    with pytest.raises(ValueError, match="pingpong: .* got stages=1"):
        lowered(pingpong_dkv=True)
    assert lowered() == lowered(pingpong_dq=False, pingpong_dkv=False)


@pytest.mark.parametrize("window", [None, (64, 16)])
def test_positional_plans_and_orders_are_constants(window: tuple[int, int] | None) -> None:
    """Without segment ids the visiting plans and the items' order depend on sizes only: the
    program carries them as constants, with no device work (no sort, no reduction) before the
    kernels; with segment ids both are computed on the device."""
    q = jax.ShapeDtypeStruct((2, 300, 4, 64), jnp.bfloat16)
    seg = jax.ShapeDtypeStruct((2, 300), jnp.int32)

    def loss(q: jax.Array, k: jax.Array, v: jax.Array, seg: jax.Array | None) -> jax.Array:
        return mosaic_attention(q, k, v, causal=window is None, window=window, segment_ids=seg).astype(jnp.float32).sum()

    grad = jax.grad(loss, argnums=(0, 1, 2))
    positional, segmented = (lower_for_cuda(grad, q, q, q, s) for s in (None, seg))
    assert positional.count("@mosaic_gpu") == segmented.count("@mosaic_gpu") == 3
    assert "stablehlo.sort" not in positional and "stablehlo.reduce" not in positional
    assert "stablehlo.sort" in segmented and "stablehlo.reduce" in segmented
    # Past the cap on constants (3 tiles x 4 heads per batch row: one row more than fits), the
    # order is sorted on the device instead.
    many = jax.ShapeDtypeStruct((mplan.MAX_CONSTANT // 12 + 1, 300, 4, 64), jnp.bfloat16)
    assert "stablehlo.sort" in lower_for_cuda(grad, many, many, many, None)


def test_call_sites_share_one_module_per_kernel() -> None:
    """Two layers' attention, differentiated, from different source lines: six kernel launches
    but three kernels (forward, dq, dk/dv). Calls under one label share one traced and lowered
    function per kernel, so the program holds each module once; calls under two labels are
    traced apart, and their modules must still be equal, so the backend compiles each once. The
    modules' hashes cover their locations (a kernel traced with its caller's stack differs per
    site) and, with jaxlib 0.11, a per-launch counter unless it is removed
    (kernels/_mosaic_modules.py)."""
    q = jax.ShapeDtypeStruct((1, 256, 2, 64), jnp.bfloat16)

    def loss(x: jax.Array, *, second_label: str) -> jax.Array:
        x = mosaic_attention(x, x, x, causal=True)
        x = 2 * x
        with label_scope(second_label):
            x = mosaic_attention(x, x, x, causal=True)
        return x.astype(jnp.float32).sum()

    def hashes_with(second_label: str) -> list[str]:
        return kernel_hashes(lower_for_cuda(jax.grad(functools.partial(loss, second_label=second_label)), q))

    with label_scope(label("attention_a@v1", "0" * 16)):
        shared = hashes_with(label("attention_a@v1", "0" * 16))
        apart = hashes_with(label("attention_b@v1", "1" * 16))
    assert len(shared) == 3 and len(set(shared)) == 3
    assert len(apart) == 6 and set(apart) == set(shared)


def test_audit_finds_every_call_of_a_shared_kernel(monkeypatch: pytest.MonkeyPatch) -> None:
    """Three layers' attention lower to one function per kernel that each layer calls, and the
    audit of that program still finds three forward and three backward call sites."""
    monkeypatch.setattr(importlib.import_module("ejlabel.kernels.attention"), "on_hopper", lambda: True)
    q = jax.ShapeDtypeStruct((1, 256, 2, 64), jnp.bfloat16)

    def loss(x: jax.Array) -> jax.Array:
        for _ in range(3):
            x = 2 * flash_attention(x, x, x, causal=True)
        return x.astype(jnp.float32).sum()

    with ejlabel.use_implementation("mosaic"):
        lowered = jax.jit(jax.grad(loss)).trace(q).lower(lowering_platforms=("cuda",))
    # Nine launches; a kernel is lowered again only under other metadata (the first site of a
    # call also carries its description), and every copy is the same module.
    hashes = kernel_hashes(lowered.as_text())
    assert len(hashes) < 9 and len(set(hashes)) == 3
    assert sorted(call.direction for call in analysis.audit(lowered).calls) == ["backward"] * 3 + ["forward"] * 3


def test_rejects_what_it_cannot_run() -> None:
    q, k, v = qkv(1, 64, 2, 1, 64, jnp.float32)
    with pytest.raises(ValueError, match="bfloat16 or float16"):
        am.mosaic_forward(q, k, v, None, scale=1.0, bounds=(None, None), params=FwdParams())
    q, k, v = qkv(1, 64, 2, 1, 64, jnp.bfloat16)
    with pytest.raises(ValueError, match="kv_blocksize"):
        am.mosaic_forward(q, k, v, None, scale=1.0, bounds=(None, None), params=FwdParams(kv_blocksize=32))
    q, k, v = qkv(1, 64, 2, 1, 320, jnp.bfloat16)
    with pytest.raises(ValueError, match="head dim <= 256"):
        am.mosaic_forward(q, k, v, None, scale=1.0, bounds=(None, None), params=FwdParams())
    assert am.mosaic_supports(jnp.bfloat16, 256) and not am.mosaic_supports(jnp.bfloat16, 320)
    # Above head dim 128 the dq kernel and the dk walk fit one stage of the default tiles, not two.
    assert am.mosaic_fits(256, FwdParams(), BwdParams()) and not am.mosaic_fits(256, FwdParams(), BwdParams(num_stages=2))


def test_ring_depths_give_held_blocks_a_second_slot_where_it_fits() -> None:
    # Head dim 256: the dq kernel and the dk walk hold two 128-row tiles and stream 64-row
    # blocks of 32 KiB, two kinds a step. Their row terms (log-sum-exp, delta) take one buffer
    # of 1 KiB, segment ids another (kernel.ids_smem); one more buffer and the second slot no
    # longer fits, each buffer taking a whole KiB.
    row = 256 * 2
    tiles, block = 2 * am.TILE * row, 64 * row
    assert mbudget.ring_depths(None, tiles, block, block, 1024) == (2, 1)
    assert mbudget.ring_depths(None, tiles, block, block, 1024, 1024) == (2, 1)  # with segment ids
    assert mbudget.ring_depths(None, tiles, block, block, 1024, 512, 512) == (1, 1)
    assert mbudget.ring_depths(None, tiles // 2, block, block, 1024) == (2, 2)  # the dv walk's key tile alone
    assert mbudget.ring_depths(1, tiles // 2, block, block) == (1, 1)  # asked for: every stream
    row = 128 * 2
    assert mbudget.ring_depths(None, 2 * am.TILE * row, 64 * row, 64 * row, 1024) == (2, 2)


@pytest.mark.parametrize("hopper", [True, False])
def test_tuning_space_offers_triton_only_where_mosaic_does_not_run(monkeypatch: pytest.MonkeyPatch, hopper: bool) -> None:
    monkeypatch.setattr(attention_module, "on_gpu", lambda: True)
    monkeypatch.setattr(attention_module, "on_hopper", lambda: hopper)
    kernel = AttentionKernel()
    for dtype, dim in ((jnp.bfloat16, 64), (jnp.float16, 256), (jnp.float32, 64)):
        q, k, v = qkv(1, 64, 2, 1, dim, dtype)
        inv = Invocation(kernel, (q, k, v), {"causal": True})
        impls = {c.impl for c in kernel.config_space(inv)}
        mosaic_runs = hopper and dtype != jnp.float32
        assert ("pallas" in impls) != mosaic_runs and {"xla", "cudnn", "mosaic"} <= impls
        assert kernel.candidate_is_valid(inv, AttentionConfig("pallas"))  # still selectable


@pytest.mark.parametrize("dim", [64, 128])
def test_tuning_space_offers_schedules_where_they_won(monkeypatch: pytest.MonkeyPatch, dim: int) -> None:
    # The plain schedule (64-key blocks) with segments only; the pipelined one above dim 64 only.
    monkeypatch.setattr(attention_module, "on_gpu", lambda: True)
    monkeypatch.setattr(attention_module, "on_hopper", lambda: True)
    kernel = AttentionKernel()
    q, k, v = qkv(1, 64, 2, 1, dim, jnp.bfloat16)
    ids = jnp.ones((1, 64), jnp.int32)
    wide = {"pipelined"} if dim > 64 else set()
    for kwargs, schedules in (({"causal": True}, {"pingpong"} | wide), ({"causal": True, "segment_ids": ids}, {"pingpong", "plain"} | wide)):
        mosaic = [c for c in kernel.config_space(Invocation(kernel, (q, k, v), kwargs)) if c.impl == "mosaic"]
        assert {c.fwd_schedule for c in mosaic} == schedules
        backward_tiles = len({c.bwd for c in mosaic})
        for schedule, blocks in (("plain", 64), ("pipelined", 128)):
            chosen = [c for c in mosaic if c.fwd_schedule == schedule]
            assert all(c.fwd.kv_blocksize == blocks for c in chosen)
            assert len(chosen) == (backward_tiles if schedule in schedules else 0)  # paired with every backward tile


def test_tuning_space_above_dim_128_is_the_kernels_tiles_under_two_schedules(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(attention_module, "on_gpu", lambda: True)
    monkeypatch.setattr(attention_module, "on_hopper", lambda: True)
    kernel = AttentionKernel()
    q, k, v = qkv(1, 64, 2, 1, 256, jnp.bfloat16)
    inv = Invocation(kernel, (q, k, v), {"causal": True})
    mosaic = [c for c in kernel.config_space(inv) if c.impl == "mosaic"]
    assert [c.fwd_schedule for c in mosaic] == ["pingpong", "pipelined"]
    assert all(c.fwd == FwdParams() and c.bwd == BwdParams() and kernel.candidate_is_valid(inv, c) for c in mosaic)


def test_attention_config_checks_its_schedule() -> None:
    assert AttentionConfig("mosaic").fwd_schedule == "pingpong"
    assert set(am.MOSAIC_SCHEDULES) == {"pingpong", "plain", "pipelined", "pipelined_pingpong"}
    with pytest.raises(ValueError, match="fwd_schedule: expected one of"):
        AttentionConfig("mosaic", fwd_schedule="fast")
    with pytest.raises(ValueError, match="fwd_schedule: only the mosaic implementation"):
        AttentionConfig("pallas", fwd_schedule="plain")


def test_a_config_stored_before_schedules_runs_ping_pong() -> None:
    # Entries written before AttentionConfig had a schedule decode to the one they ran.
    from ejlabel.utils.serialize import from_jsonable, to_jsonable

    data = to_jsonable(AttentionConfig("mosaic", FwdParams(kv_blocksize=64, num_stages=3), fwd_schedule="plain"))
    del data["fields"]["fwd_schedule"]
    assert from_jsonable(data) == AttentionConfig("mosaic", FwdParams(kv_blocksize=64, num_stages=3))


@pytest.mark.parametrize("schedule", ["plain", "pipelined_pingpong"])
def test_flash_attention_runs_the_configured_schedule(monkeypatch: pytest.MonkeyPatch, schedule: str) -> None:
    seen: list[dict[str, Any]] = []
    monkeypatch.setattr(attention_module, "mosaic_forward", lambda *args, **kwargs: seen.append(kwargs) or (args[0], None))
    q, k, v = qkv(1, 64, 2, 1, 64, jnp.bfloat16)
    AttentionKernel().fwd_with_residuals(q, k, v, cfg=AttentionConfig("mosaic", fwd_schedule=schedule), causal=True)
    assert {name: seen[0][name] for name in ("pingpong", "pipelined")} == am.MOSAIC_SCHEDULES[schedule]


def test_flash_attention_offers_mosaic_only_where_it_runs() -> None:
    q, k, v = qkv(1, 64, 2, 1, 64, jnp.bfloat16)
    kernel = AttentionKernel()
    inv = Invocation(kernel, (q, k, v), {"causal": True})
    cfg = AttentionConfig("mosaic", FwdParams(kv_blocksize=128, num_stages=2), BwdParams(64, 128, None, 2))
    assert kernel.candidate_is_valid(inv, cfg) == am.on_hopper()
    assert not kernel.differentiated_by_jax(cfg)  # its own backward kernels
    if not am.on_hopper():
        assert all(c.impl != "mosaic" for c in kernel.config_space(inv) if kernel.candidate_is_valid(inv, c))
    # Shared memory: three stages of 128-row key and value blocks at dim 128 do not fit.
    assert not am.mosaic_fits(128, FwdParams(kv_blocksize=128, num_stages=3), BwdParams())
    assert am.mosaic_fits(128, FwdParams(kv_blocksize=64, num_stages=3), BwdParams())


# --------------------------------------------------------------------------------------------
# Values in the Mosaic GPU interpreter (CPU)


@pytest.mark.slow
def test_interpreted_persistent_programs_walk_several_tiles(races: Callable[[], bool]) -> None:
    # Three programs in the interpreter share 4 query tiles (and 4 key/value tiles): one walks
    # two, the ring and the barriers running on across them. At dim 128 the forward and dkv
    # kernels double-buffer their tiles, while the dq kernel's two tiles do not fit twice, so
    # it loads the next tile only after the last one's results are out: both paths run. The
    # forward's results have a buffer of their own here, so its next tile is requested before
    # the last results have left. The race detector must find no access the barriers leave
    # unordered (it runs the copies out at once, so the wait before reusing the results' buffer
    # is not what it checks).
    seq, dim = 256, 128
    q, k, v = qkv(1, seq, 2, 2, dim, jnp.bfloat16, seed=11)
    ids = jnp.where(jnp.arange(seq) < seq - 9, 1 + (jnp.arange(seq) >= 96) + (jnp.arange(seq) >= 200), 0)[None].astype(jnp.int32)
    assert mbudget.tile_buffers(128 * dim * 2, 2 * 2 * 64 * dim * 2) == 2 and mbudget.tile_buffers(2 * 128 * dim * 2, 2 * 2 * 64 * dim * 2) == 2
    assert mbudget.tile_buffers(2 * 128 * dim * 2, 2 * 2 * 128 * dim * 2) == 1  # dq with 128-row key blocks
    probe = jax.random.normal(jax.random.key(12), q.shape, jnp.float32)
    params = (FwdParams(kv_blocksize=64), BwdParams(q_blocksize=64, kv_blocksize=128))
    interpreted_values_and_gradients(q, k, v, ids, params, probe)
    assert not races()


def test_interpreted_backward(races: Callable[[], bool]) -> None:
    # Head dim 64, as the product runs it: the blocks masked by positions alone in a loop of
    # their own, a head group of two, both backward kernels' consumers taking turns (barriers
    # of their own). Above head dim 64, where those blocks share the segment ids' loop, the
    # persistent-programs test above walks several tiles.
    check_interpreted_backward(races, group=2, pingpong=True)


@pytest.mark.slow
def test_interpreted_backward_with_blocks_freed_mid_step(races: Callable[[], bool], monkeypatch: pytest.MonkeyPatch) -> None:
    # The ring the dq kernel and the dk walk get at head dim 256 (two slots of the blocks a step
    # holds to its end, keys or queries; one of those it frees mid-step, values or dO), here at
    # head dim 64 with both kernels' consumers taking turns: the slots freed mid-step are
    # refilled while the other consumer is half a step behind, which the race detector checks.
    monkeypatch.setattr(mbackward, "ring_depths", lambda *_: (2, 1))
    jax.clear_caches()  # no trace of the default ring reused
    check_interpreted_backward(races, group=2, pingpong=True)
    jax.clear_caches()


@pytest.mark.slow
def test_interpreted_backward_above_head_dim_128(races: Callable[[], bool]) -> None:
    # Head dim 256: the dk/dv kernel walks once for dv (without the value tile: two stages fit)
    # and once for dk (one stage, as the dq kernel); one tile (the interpreter takes 15 s a call
    # at this size), three documents and padding.
    seq, dim = 120, 256
    q, k, v = qkv(1, seq, 1, 1, dim, jnp.bfloat16, seed=15)
    position = jnp.arange(seq)
    ids = jnp.where(position < seq - 11, 1 + (position >= 40) + (position >= 80), 0)[None].astype(jnp.int32)
    assert mbackward.dkv_passes(dim) == (("dv",), ("dk",)) and am.tile_blocks(BwdParams(), dim) == (64, 64, None)
    tile, stage = am.TILE * dim * 2, 2 * 64 * dim * 2  # one 128-row tile; a stage of 64-row blocks
    assert mbudget.ring_stages(None, tile, stage) == 2 and mbudget.ring_stages(None, 2 * tile, stage) == 1
    probe = jax.random.normal(jax.random.key(16), q.shape, jnp.float32)
    out, grads = interpreted_values_and_gradients(q, k, v, ids, (FwdParams(), BwdParams()), probe)
    assert not races()
    assert not np.any(np.asarray(grads[1].astype(jnp.float32))[0, seq - 11 :])  # padded keys: dk exactly 0


@pytest.mark.slow  # the forward of test_interpreted_backward runs ping-pong too, on 3 tiles of 2 heads
def test_interpreted_pingpong_forward(races: Callable[[], bool]) -> None:
    # Two query tiles, two documents and padding: the consumers' meetings pair up (a missed
    # one would hang or leave a barrier phase unobserved, which the interpreter reports), and
    # the race detector finds no shared-memory access the barriers leave unordered (the second
    # tile walks four key blocks through two ring slots, so slots are refilled while in use
    # elsewhere; arriving on a slot's "consumed" barrier before reading it is reported).
    seq = 256
    q, k, v = qkv(1, seq, 1, 1, 64, jnp.bfloat16, seed=6)
    ids = jnp.where(jnp.arange(seq) < seq - 7, 1 + (jnp.arange(seq) >= 3 * seq // 4), 0)[None].astype(jnp.int32)
    out, _ = am.mosaic_forward(q, k, v, ids, scale=0.125, bounds=window_bounds(True, None), params=FwdParams(kv_blocksize=64), interpret=True, pingpong=True)
    assert not races()
    assert rel_error(out, reference(q, k, v, causal=True, window=None, segment_ids=ids, scale=0.125)) < 1e-2


@pytest.mark.slow
def test_interpreted_pipelined_forward(races: Callable[[], bool]) -> None:
    # Each consumer's softmax overlapped with its own products, the two consumers taking turns
    # (ping-pong): the scores of the next block are issued before the last values are
    # consumed, each value slot is freed a step late (at the item's end for its last), and the
    # first step's zero product reads a key slot that is freed after it. Two heads of two
    # tiles over three programs (one walks two items, the ring running on across them), two
    # documents and padding, 64-key blocks in two slots: a slot freed too early, or read before
    # it is ready, is what the race detector reports (unpaired turns would hang); every kind of
    # mask runs.
    seq = 256
    q, k, v = qkv(1, seq, 2, 2, 64, jnp.bfloat16, seed=7)
    ids = jnp.where(jnp.arange(seq) < seq - 7, 1 + (jnp.arange(seq) >= 3 * seq // 4), 0)[None].astype(jnp.int32)
    params = FwdParams(kv_blocksize=64, num_stages=2)
    out, lse = am.mosaic_forward(q, k, v, ids, scale=0.125, bounds=window_bounds(True, None), params=params, interpret=True, pingpong=True, pipelined=True)
    assert not races()
    assert rel_error(out, reference(q, k, v, causal=True, window=None, segment_ids=ids, scale=0.125)) < 1e-2
    # The saved log-sum-exp (base 2) of every row that sees a key, against float32 scores.
    scores = jnp.einsum("bqhd,bkhd->bhqk", q.astype(jnp.float32), k.astype(jnp.float32)) * 0.125
    visible = dense_visibility(seq, seq, True, None, ids, None)
    want = jax.nn.logsumexp(jnp.where(visible[:, None], scores, -jnp.inf), axis=-1) / np.log(2.0)
    seen = np.broadcast_to(np.asarray(ids[:, None] > 0), want.shape)
    np.testing.assert_allclose(np.asarray(lse)[seen], np.asarray(want)[seen], atol=2e-3)


# --------------------------------------------------------------------------------------------
# GPU (Hopper)


@pytest.fixture
def ptxas_report(monkeypatch: pytest.MonkeyPatch) -> Any:
    """``bench/ptxas_report.py``, the diagnostic that reads ptxas's reports on the kernels."""
    monkeypatch.syspath_prepend(str(REPO_ROOT / "bench"))
    return importlib.import_module("ptxas_report")


def test_ptxas_reports_are_read(ptxas_report: Any) -> None:
    # ptxas's words on the pipelined forward before its products were issued unconditionally,
    # and on the dq kernel at head dim 128 (H100, jax 0.11.2).
    serialized = (
        "ptxas info    : (C7514) Potential Performance Loss: wgmma.mma_async instructions are serialized due to non wgmma "
        "instructions reading accumulator registers of  a wgmma between start and end of the pipeline stage in the function 'k'\n"
        "ptxas info    : Function properties for k\n    0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads\n"
        "ptxas info    : Used 168 registers, used 16 barriers, 1 bytes smem\n"
    )
    spilled = (
        "ptxas warning : Registers are spilled to local memory in function 'k', 104 bytes spill stores, 136 bytes spill loads\n"
        "ptxas info    : Function properties for k\n    96 bytes stack frame, 104 bytes spill stores, 136 bytes spill loads\n"
    )
    assert ptxas_report.parse_report("forward pipelined", serialized) == ptxas_report.KernelReport("forward pipelined", 0, 0, 0, ("C7514",))
    assert ptxas_report.parse_report("dq", spilled) == ptxas_report.KernelReport("dq", 96, 104, 136, ("spills",))
    with pytest.raises(ValueError, match="text: expected ptxas's line"):
        ptxas_report.parse_report("dq", "ptxas info    : Used 168 registers")
    assert ptxas_report.kernel_names(256)[-3:] == ["dq", "dv walk", "dk walk"]


@gpu
@needs_gpu
@needs_hopper
def test_gpu_no_kernel_has_its_wgmmas_serialized(ptxas_report: Any) -> None:
    # ptxas serializes every wgmma of a kernel where it cannot prove the asynchronous products
    # safe (warning C7514), which cost the pipelined forward 16-25% before its products were
    # issued unconditionally: every forward schedule and the backward kernels, at head dim 128.
    reports = ptxas_report.compile_reports(128)
    assert [report.kernel for report in reports] == ptxas_report.kernel_names(128)
    assert not [report.kernel for report in reports if "C7514" in report.warnings]


@gpu
@needs_gpu
@needs_hopper
@pytest.mark.parametrize("schedule", ["plain", "pingpong", "pipelined", "pipelined pingpong"])
@pytest.mark.parametrize("segments", [False, True])
def test_gpu_forward_schedules(schedule: str, segments: bool) -> None:
    q, k, v = qkv(2, 1100, 4, 2, 128, jnp.bfloat16, seed=8)
    ids = documents(2, 1100, 3, padding=60, seed=1) if segments else None
    options = {"pingpong": "pingpong" in schedule, "pipelined": "pipelined" in schedule}
    forward = jax.jit(lambda q, k, v: am.mosaic_forward(q, k, v, ids, scale=0.09, bounds=(None, 0), params=FwdParams(), **options))
    out, lse = forward(q, k, v)
    assert rel_error(out, reference(q, k, v, causal=True, window=None, segment_ids=ids, scale=0.09)) < 2e-2
    assert np.all(np.isfinite(np.asarray(lse)))


@gpu
@needs_gpu
@needs_hopper
@pytest.mark.parametrize(("causal", "schedule", "segments"), [(True, "pingpong", False), (False, "pingpong", False), (True, "pipelined", True)])
def test_gpu_head_dim_256_forward(causal: bool, schedule: str, segments: bool) -> None:
    q, k, v = qkv(2, 700, 4, 2, 256, jnp.bfloat16, seed=11)
    ids = documents(2, 700, 3, padding=40, seed=3) if segments else None
    options = am.MOSAIC_SCHEDULES[schedule]
    forward = jax.jit(lambda q, k, v: am.mosaic_forward(q, k, v, ids, scale=0.0625, bounds=window_bounds(causal, None), params=FwdParams(), **options))
    out, lse = forward(q, k, v)
    assert rel_error(out, reference(q, k, v, causal=causal, window=None, segment_ids=ids, scale=0.0625)) < 2e-2
    assert np.all(np.isfinite(np.asarray(lse)))


@gpu
@needs_gpu
@needs_hopper
@pytest.mark.parametrize(
    ("dim", "params"),
    [
        (128, (FwdParams(kv_blocksize=64, num_stages=3), BwdParams(q_blocksize=128, kv_blocksize=64))),
        (128, (FwdParams(kv_blocksize=128, num_stages=2), BwdParams(q_blocksize=64, kv_blocksize=128))),
        # One-stage rings where the backward's turns are the default: it takes none.
        (64, (FwdParams(num_stages=1), BwdParams(num_stages=1))),
    ],
)
def test_gpu_other_tiles(dim: int, params: tuple[FwdParams, BwdParams]) -> None:
    q, k, v = qkv(1, 900, 4, 2, dim, jnp.bfloat16, seed=2)
    ids = documents(1, 900, 3, padding=50, seed=4)
    mosaic = lambda q, k, v: mosaic_attention(q, k, v, causal=True, segment_ids=ids, params=params)
    ref = lambda q, k, v: reference(q, k, v, causal=True, window=None, segment_ids=ids, scale=dim**-0.5)
    assert rel_error(jax.jit(mosaic)(q, k, v), ref(q, k, v)) < 2e-2
    got = jax.jit(jax.grad(lambda q, k, v: jnp.sum(mosaic(q, k, v).astype(jnp.float32) ** 2), argnums=(0, 1, 2)))(q, k, v)
    want = jax.grad(lambda q, k, v: jnp.sum(ref(q, k, v) ** 2), argnums=(0, 1, 2))(*(t.astype(jnp.float32) for t in (q, k, v)))
    for g, w in zip(got, want):
        assert rel_error(g, w) < 4e-2


@gpu
@needs_gpu
@needs_hopper
@pytest.mark.parametrize("schedule", ["pingpong_dq", "pingpong_dkv"])
@pytest.mark.parametrize(("dim", "segments"), [(64, True), (128, False), (128, True), (256, False)])
def test_gpu_backward_schedules(dim: int, segments: bool, schedule: str) -> None:
    # Each kernel with its consumers taking turns: gradients against the reference and the default backward's, and the other
    # kernel's gradients exactly as the default backward gives them.
    q, k, v = qkv(2, 1000, 4, 2, dim, jnp.bfloat16, seed=dim)
    ids = documents(2, 1000, 3, padding=70, seed=5) if segments else None
    ref = lambda q, k, v: reference(q, k, v, causal=True, window=None, segment_ids=ids, scale=dim**-0.5)

    def grads(scheduled: bool) -> Any:
        mosaic = lambda q, k, v: mosaic_attention(q, k, v, causal=True, segment_ids=ids, **{schedule: scheduled})
        return jax.jit(jax.grad(lambda q, k, v: jnp.sum(mosaic(q, k, v).astype(jnp.float32) ** 2), argnums=(0, 1, 2)))(q, k, v)

    got, default = grads(True), grads(False)
    want = jax.grad(lambda q, k, v: jnp.sum(ref(q, k, v) ** 2), argnums=(0, 1, 2))(*(t.astype(jnp.float32) for t in (q, k, v)))
    scheduled = (1, 2) if schedule == "pingpong_dkv" else (0,)
    for i, (g, w, d) in enumerate(zip(got, want, default)):
        assert rel_error(g, w) < 4e-2
        if i in scheduled:
            assert rel_error(g, d) < 1e-2
        else:
            np.testing.assert_array_equal(np.asarray(g), np.asarray(d))


@gpu
@needs_gpu
@needs_hopper
@pytest.mark.parametrize("spec", GPU_GRID, ids=lambda spec: spec.name)
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
def test_gpu_values_and_gradients(spec: ArgSpec, dtype: Any) -> None:
    seq, dim = spec.seq, spec.dim
    q, k, v = spec.arrays(jax.random.key(seq + dim), dtype)
    ids = documents(spec.batch, seq, spec.documents, padding=seq // 10, seed=seq) if spec.documents else None
    causal, window = spec.causal, spec.window
    probe = jax.random.normal(jax.random.key(1), q.shape, jnp.float32)
    mosaic = lambda q, k, v: mosaic_attention(q, k, v, causal=causal, window=window, segment_ids=ids)
    ref = lambda q, k, v: reference(q, k, v, causal=causal, window=window, segment_ids=ids, scale=dim**-0.5)
    tol = 2e-2 if dtype == jnp.bfloat16 else 5e-3

    def value_and_grads(f: Any) -> Any:
        def run(q: jax.Array, k: jax.Array, v: jax.Array) -> tuple[jax.Array, Any]:
            out, vjp = jax.vjp(f, q, k, v)
            return out, vjp(probe.astype(out.dtype))

        return jax.jit(run)

    out, got = value_and_grads(mosaic)(q, k, v)
    want_out, want = value_and_grads(ref)(*(t.astype(jnp.float32) for t in (q, k, v)))
    assert rel_error(out, want_out) < tol
    for name, g, w in zip("qkv", got, want):
        assert rel_error(g, w) < 2 * tol, name
    if ids is not None:  # padding sees nothing: exactly 0, never NaN
        pad = np.asarray(ids) <= 0
        assert not np.any(np.asarray(out.astype(jnp.float32))[pad])
        assert not np.any(np.asarray(got[0].astype(jnp.float32))[pad])


@gpu
@needs_gpu
@needs_hopper
@pytest.mark.parametrize(
    "kwargs",
    [{"causal": True}, {"segment_ids": "documents"}, {"segment_ids": "documents", "fwd_schedule": "plain"}, {"cu_seqlens": "packed"}, {"sliding_window": (128, 0)}],
)
def test_gpu_flash_attention_mosaic(kwargs: dict[str, Any]) -> None:
    batch = 1 if "cu_seqlens" in kwargs else 2
    q, k, v = qkv(batch, 1000, 8, 2, 64, jnp.bfloat16, seed=21)
    schedule = kwargs.get("fwd_schedule", "pingpong")  # plain: the tuning space's with segment ids, on 64-key blocks
    fwd = FwdParams(kv_blocksize=64, num_stages=3) if schedule == "plain" else FwdParams(kv_blocksize=128, num_stages=2)
    if "segment_ids" in kwargs:
        kwargs = {"segment_ids": documents(2, 1000, 4, padding=100), "causal": True}
    if "cu_seqlens" in kwargs:
        kwargs = {"cu_seqlens": jnp.array([0, 100, 450, 451, 980], jnp.int32), "causal": True}
    cfg = AttentionConfig("mosaic", fwd, BwdParams(64, 128, None, 2), fwd_schedule=schedule)
    xla = AttentionConfig("xla")
    loss = lambda cfg: jax.jit(jax.value_and_grad(lambda q, k, v: jnp.sum(flash_attention(q, k, v, cfg=cfg, **kwargs).astype(jnp.float32) ** 2), argnums=(0, 1, 2)))
    (value, got), (want_value, want) = loss(cfg)(q, k, v), loss(xla)(q, k, v)
    assert rel_error(flash_attention(q, k, v, cfg=cfg, **kwargs), flash_attention(q, k, v, cfg=xla, **kwargs)) < 2e-2
    assert abs(float(value) - float(want_value)) <= 2e-2 * abs(float(want_value))
    for g, w in zip(got, want):
        assert rel_error(g, w) < 4e-2
