"""Named attention calls: the shapes the tests and benchmarks share, as data in one place.

An :class:`ArgSpec` is one call of :func:`ejlabel.kernels.attention.flash_attention` without its
values: batch, sequence length, query and key/value heads, head dim, dtype and mask (causal,
a sliding window, or a count of documents packed in each row). It gives the arrays' shapes, their
abstract values (to lower or tune without data) and random inputs. Which segment ids a test or
benchmark builds for its documents (equal ones, or random lengths with padding) stays its own
choice; the count is the spec's.

The named specs: :data:`CAUSAL` (B4 S4096 H16 D128, the shape most figures are quoted at),
:data:`PACKED` (the example model's packed documents), :data:`HEAD_DIM_256`, the shapes of other
models (:data:`MODEL_SHAPES`), and the grids of the GPU tests (:data:`GPU_GRID`,
:data:`REAL_SIZE`).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp

__all__ = [
    "CAUSAL",
    "GPU_GRID",
    "HEAD_DIM_256",
    "MODEL_SHAPES",
    "PACKED",
    "REAL_SIZE",
    "ArgSpec",
]


@dataclasses.dataclass(frozen=True)
class ArgSpec:
    """One attention call's shapes and mask.

    Attributes:
      name: what the call is, as tables and test ids show it.
      batch, seq, heads, kv_heads, dim: ``q`` is ``[batch, seq, heads, dim]``, ``k`` and ``v``
        ``[batch, seq, kv_heads, dim]``.
      causal: query ``i`` sees keys ``j <= i``.
      window: ``sliding_window=(left, right)``, or None.
      documents: documents packed in each row (segment ids); 0 for none.
      dtype: of ``q``, ``k`` and ``v``.
    """

    name: str
    batch: int
    seq: int
    heads: int
    kv_heads: int
    dim: int
    causal: bool = True
    window: tuple[int, int] | None = None
    documents: int = 0
    dtype: str = "bfloat16"

    def __post_init__(self) -> None:
        for field in ("batch", "seq", "heads", "kv_heads", "dim"):
            value = getattr(self, field)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{field}: expected a positive int, got {value!r}")
        if self.heads % self.kv_heads:
            raise ValueError(f"kv_heads: expected a divisor of heads {self.heads}, got {self.kv_heads}")
        if self.documents < 0:
            raise ValueError(f"documents: expected a count >= 0, got {self.documents!r}")
        jnp.dtype(self.dtype)  # a name numpy does not know raises here, naming it

    @property
    def q_shape(self) -> tuple[int, int, int, int]:
        return (self.batch, self.seq, self.heads, self.dim)

    @property
    def kv_shape(self) -> tuple[int, int, int, int]:
        return (self.batch, self.seq, self.kv_heads, self.dim)

    def abstract(self) -> tuple[jax.ShapeDtypeStruct, jax.ShapeDtypeStruct, jax.ShapeDtypeStruct]:
        """``(q, k, v)`` as abstract values."""
        dtype = jnp.dtype(self.dtype)
        return (jax.ShapeDtypeStruct(self.q_shape, dtype), *(jax.ShapeDtypeStruct(self.kv_shape, dtype),) * 2)

    def arrays(self, key: jax.Array, dtype: Any = None) -> tuple[jax.Array, jax.Array, jax.Array]:
        """Standard normal ``(q, k, v)`` drawn from ``key``, in ``dtype`` (default the spec's)."""
        dtype = jnp.dtype(self.dtype if dtype is None else dtype)
        kq, kk, kv = jax.random.split(key, 3)
        normal = lambda k, shape: jax.random.normal(k, shape, jnp.float32).astype(dtype)
        return normal(kq, self.q_shape), normal(kk, self.kv_shape), normal(kv, self.kv_shape)

    def replace(self, **changes: Any) -> ArgSpec:
        """This spec with ``changes`` (a dtype, a smaller batch, ...)."""
        return dataclasses.replace(self, **changes)


CAUSAL = ArgSpec("causal", 4, 4096, 16, 16, 128)
PACKED = ArgSpec("packed documents", 8, 2048, 12, 4, 64, documents=4)
HEAD_DIM_256 = ArgSpec("causal D256", 2, 4096, 8, 8, 256)

MODEL_SHAPES: tuple[ArgSpec, ...] = (
    ArgSpec("causal", 8, 2048, 12, 4, 64),
    ArgSpec("full", 4, 2048, 16, 16, 128, causal=False),
    ArgSpec("causal, window 1024", 4, 8192, 16, 16, 128, window=(1024, 0)),
    ArgSpec("causal, short rows", 64, 256, 8, 8, 64),
    ArgSpec("causal GQA 4:1", 4, 4096, 16, 4, 128),
    ArgSpec("causal, odd length", 8, 1000, 16, 16, 128),
    ArgSpec("8 segments", 4, 4096, 12, 4, 64, documents=8),
    ArgSpec("4 segments", 2, 4096, 8, 4, 256, documents=4),
)
"""Calls of other models than the named ones: short and long, grouped, windowed, odd, packed."""

GPU_GRID: tuple[ArgSpec, ...] = (
    ArgSpec("D64 GQA 3:1 causal 4 docs", 2, 1000, 12, 4, 64, documents=4),
    ArgSpec("D128 window", 2, 1000, 4, 2, 128, causal=False, window=(200, 50)),
    ArgSpec("D64 odd causal window 3 docs", 2, 333, 6, 3, 64, window=(100, 0), documents=3),
    ArgSpec("D128 odd full 2 docs", 2, 513, 4, 2, 128, causal=False, documents=2),
    ArgSpec("D64 causal 1 doc", 2, 640, 4, 4, 64, documents=1),
    ArgSpec("D64 GQA 4:1 causal", 2, 1000, 8, 2, 64),
    ArgSpec("D128 odd causal", 2, 777, 4, 4, 128),
    ArgSpec("D128 MQA full", 2, 1024, 8, 1, 128, causal=False),
    ArgSpec("D256 odd causal 2 docs", 2, 513, 4, 2, 256, documents=2),
    ArgSpec("D256 window", 2, 1000, 4, 4, 256, causal=False, window=(200, 50)),
)
"""The Mosaic kernels' values and gradients on the GPU: head dims 64-256, odd lengths, windows,
1-4 documents with padding, grouped heads up to MQA."""

REAL_SIZE = ArgSpec("real size", 2, 1000, 8, 8, 128)
"""The Triton and cuDNN paths at a real size on the GPU (the tests vary its head dim and
key/value heads)."""
