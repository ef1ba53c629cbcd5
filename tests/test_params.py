"""Tests for the kernel launch parameters and the warps/stages heuristics."""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ejlabel.utils.params import BwdParams, FwdParams, select_num_stages, select_num_warps

_FIELDS = ("q_blocksize", "kv_blocksize", "num_warps", "num_stages")
# ejkernel's further tile fields, after ours.
_ALL_FIELDS = _FIELDS + ("blocksize_m", "blocksize_k", "blocksize_n", "blocksize_heads", "blocksize_keys")

powers_of_two = st.sampled_from([1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024])


def maybe(strategy: st.SearchStrategy) -> st.SearchStrategy:
    return st.none() | strategy


params_kwargs = st.fixed_dictionaries(
    {
        "q_blocksize": maybe(powers_of_two),
        "kv_blocksize": maybe(powers_of_two),
        "num_warps": maybe(st.sampled_from([1, 2, 4, 8, 16])),
        "num_stages": maybe(st.integers(1, 8)),
    }
)


# --------------------------------------------------------------------------------------------
# Dataclasses


@pytest.mark.parametrize("cls", [FwdParams, BwdParams])
def test_defaults_are_all_none(cls):
    p = cls()
    assert p.to_dict() == dict.fromkeys(_ALL_FIELDS)
    assert tuple(f.name for f in dataclasses.fields(p)) == _ALL_FIELDS


@pytest.mark.parametrize("cls", [FwdParams, BwdParams])
def test_frozen_and_hashable(cls):
    p = cls(q_blocksize=64, num_warps=4)
    with pytest.raises(dataclasses.FrozenInstanceError):
        p.q_blocksize = 128  # type: ignore[misc]
    assert hash(p) == hash(cls(q_blocksize=64, num_warps=4))
    assert len({p, cls(q_blocksize=64, num_warps=4), cls()}) == 2


def test_forward_and_backward_params_are_not_equal():
    assert FwdParams(q_blocksize=64) != BwdParams(q_blocksize=64)


@settings(max_examples=50, deadline=None)
@given(kwargs=params_kwargs)
def test_to_dict_round_trip(kwargs):
    for cls in (FwdParams, BwdParams):
        p = cls(**kwargs)
        assert p.to_dict() == {**dict.fromkeys(_ALL_FIELDS), **kwargs}
        assert cls(**p.to_dict()) == p


def test_numpy_ints_are_stored_as_python_ints():
    p = FwdParams(q_blocksize=np.int64(64), num_stages=np.int32(3))
    assert type(p.q_blocksize) is int and type(p.num_stages) is int
    assert p == FwdParams(q_blocksize=64, num_stages=3)


def test_merge_set_fields_override():
    base = FwdParams(q_blocksize=64, kv_blocksize=32, num_warps=4)
    merged = base.merge(FwdParams(kv_blocksize=128, num_stages=3))
    assert merged == FwdParams(q_blocksize=64, kv_blocksize=128, num_warps=4, num_stages=3)
    assert base == FwdParams(q_blocksize=64, kv_blocksize=32, num_warps=4)  # unchanged


def test_merge_none_never_erases():
    base = FwdParams(q_blocksize=64, num_warps=4)
    assert base.merge(FwdParams()) == base
    assert base.merge({"q_blocksize": None, "num_stages": 2}) == FwdParams(
        q_blocksize=64, num_warps=4, num_stages=2
    )


def test_merge_keeps_own_class_and_accepts_the_other():
    merged = BwdParams(num_warps=8).merge(FwdParams(q_blocksize=32))
    assert type(merged) is BwdParams
    assert merged == BwdParams(q_blocksize=32, num_warps=8)
    assert type(FwdParams().merge(BwdParams(num_stages=2))) is FwdParams


@settings(max_examples=50, deadline=None)
@given(a=params_kwargs, b=params_kwargs)
def test_merge_property(a, b):
    merged = FwdParams(**a).merge(b)
    assert all(getattr(merged, name) is None for name in _ALL_FIELDS[len(_FIELDS):])
    for name in _FIELDS:
        expected = b[name] if b[name] is not None else a[name]
        assert getattr(merged, name) == expected


def test_merge_errors():
    with pytest.raises(ValueError, match=r"unknown fields \['block_q'\]"):
        FwdParams().merge({"block_q": 64})
    with pytest.raises(ValueError, match="other must be FwdParams, BwdParams or a mapping"):
        FwdParams().merge([("num_warps", 4)])  # type: ignore[arg-type]
    # Values from a dict are validated like constructor arguments.
    with pytest.raises(ValueError, match="num_warps must be one of"):
        FwdParams().merge({"num_warps": 3})


def test_from_fwd_params():
    fwd = FwdParams(q_blocksize=128, kv_blocksize=64, num_warps=8, num_stages=2)
    bwd = BwdParams.from_fwd_params(fwd)
    assert type(bwd) is BwdParams
    assert bwd.to_dict() == fwd.to_dict()
    with pytest.raises(ValueError, match="fwd must be FwdParams, got BwdParams"):
        BwdParams.from_fwd_params(bwd)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"q_blocksize": 48}, r"q_blocksize must be a positive power of two or None, got 48"),
        ({"q_blocksize": 0}, "q_blocksize must be a positive power of two"),
        ({"kv_blocksize": -64}, "kv_blocksize must be a positive power of two"),
        ({"kv_blocksize": 64.0}, "kv_blocksize must be a positive power of two"),
        ({"q_blocksize": True}, "q_blocksize must be a positive power of two"),
        ({"num_warps": 3}, r"num_warps must be one of \(1, 2, 4, 8, 16\) or None, got 3"),
        ({"num_warps": 32}, "num_warps must be one of"),
        ({"num_stages": 0}, r"num_stages must be an int >= 1 or None, got 0"),
        ({"num_stages": "2"}, "num_stages must be an int >= 1"),
    ],
)
@pytest.mark.parametrize("cls", [FwdParams, BwdParams])
def test_validation(cls, kwargs, message):
    with pytest.raises(ValueError, match=message):
        cls(**kwargs)


# --------------------------------------------------------------------------------------------
# Heuristics

block_sizes = st.sampled_from([1, 8, 16, 32, 64, 128, 256])
head_dims = st.none() | st.sampled_from([32, 64, 96, 128, 256])
dtypes = st.sampled_from([None, jnp.bfloat16, jnp.float16, jnp.float32, np.float64])
capabilities = st.sampled_from([None, (7, 5), (8, 0), (8, 6), (8, 9), (9, 0), (12, 0)])


@settings(max_examples=100, deadline=None)
@given(m=block_sizes, n=block_sizes, d=head_dims, dtype=dtypes, cap=capabilities)
def test_heuristics_return_valid_values(m, n, d, dtype, cap):
    warps = select_num_warps(m, n, d, dtype=dtype)
    assert warps in (1, 2, 4, 8)
    stages = select_num_stages(m, n, d, dtype=dtype, device_capability=cap)
    assert type(stages) is int and 1 <= stages <= 5
    # Results are always acceptable launch parameters.
    FwdParams(num_warps=warps, num_stages=stages)


@settings(max_examples=100, deadline=None)
@given(m=block_sizes, n=block_sizes, d=head_dims, dtype=dtypes, cap=capabilities)
def test_heuristics_monotonic_in_tile_size(m, n, d, dtype, cap):
    warps = select_num_warps(m, n, d, dtype=dtype)
    stages = select_num_stages(m, n, d, dtype=dtype, device_capability=cap)
    for bigger in ((2 * m, n), (m, 2 * n), (2 * m, 2 * n)):
        assert select_num_warps(*bigger, d, dtype=dtype) >= warps
        assert select_num_stages(*bigger, d, dtype=dtype, device_capability=cap) <= stages
    if d is not None:
        assert select_num_warps(m, n, 2 * d, dtype=dtype) >= warps
        assert select_num_stages(m, n, 2 * d, dtype=dtype, device_capability=cap) <= stages


@settings(max_examples=50, deadline=None)
@given(m=block_sizes, n=block_sizes, d=head_dims, dtype=dtypes)
def test_stages_never_decrease_with_more_shared_memory(m, n, d, dtype):
    small, mid, big = (
        select_num_stages(m, n, d, dtype=dtype, device_capability=cap)
        for cap in ((8, 6), (8, 0), (9, 0))
    )
    assert small <= mid <= big


def test_warps_examples():
    assert select_num_warps(16, 16) == 2
    assert select_num_warps(64, 64, 64) == 4
    assert select_num_warps(128, 128, 64) == 4
    assert select_num_warps(128, 128, 128) == 8
    assert select_num_warps(128, 128, 64, dtype=jnp.float32) == 8
    assert select_num_warps(128, 128) == 8


def test_stages_examples():
    # 128x128 tiles, head_dim 128, 16-bit: 32 KiB resident, 64 KiB per stage.
    assert select_num_stages(128, 128, 128, device_capability=(9, 0)) == 3
    assert select_num_stages(128, 128, 128, device_capability=(8, 0)) == 2
    assert select_num_stages(128, 128, 128, device_capability=(8, 6)) == 1
    assert select_num_stages(128, 128, 128) == 1  # unknown device: smallest budget
    assert select_num_stages(64, 64, 64, device_capability=(9, 0)) == 4
    # Even tiles too large for one stage still get a valid answer.
    assert select_num_stages(1024, 1024, 256, dtype=jnp.float32) == 1


@pytest.mark.parametrize(
    ("args", "kwargs", "message"),
    [
        ((0, 64), {}, r"block_m must be a positive int, got 0"),
        ((64, -1), {}, r"block_n must be a positive int, got -1"),
        ((64.0, 64), {}, r"block_m must be a positive int, got 64.0"),
        ((64, 64, 0), {}, r"head_dim must be a positive int, got 0"),
        ((64, 64), {"dtype": "not a dtype"}, r"dtype must be a dtype or None"),
    ],
)
@pytest.mark.parametrize("fn", [select_num_warps, select_num_stages])
def test_heuristic_argument_validation(fn, args, kwargs, message):
    with pytest.raises(ValueError, match=message):
        fn(*args, **kwargs)


@pytest.mark.parametrize("cap", [(9,), [9, 0], (9, -1), (9.0, 0), "9.0"])
def test_device_capability_validation(cap):
    with pytest.raises(ValueError, match=r"device_capability must be a \(major, minor\) tuple"):
        select_num_stages(64, 64, device_capability=cap)
