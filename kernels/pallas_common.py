"""Small helpers the Pallas kernels of every op share: backend detection, Triton launch
parameters, padding, the mask value, log2(e), a float32-accumulating dot.

The ``triton`` modules of the op packages target Pallas's Triton GPU backend. Off the GPU the
same ``pallas_call`` runs with ``interpret=True``, so the kernels' logic (tiling, masking,
online softmax) is tested on the CPU, just slowly. Kernels pad their operands to whole blocks
instead of masking loads: it keeps every kernel body free of bounds checks and behaves the same
on both backends. The exception is an operand whose padding would be a copy as large as the
kernel's own traffic (the linear cross-entropy's rows kernel, over a chunk of logits): that
kernel masks its loads and stores. The Mosaic GPU attention kernels use the padding helpers,
the mask value and :data:`LOG2E` only.

The op packages and their XLA paths use some of these outside any kernel (:func:`on_gpu` and
:func:`next_power_of_2` in config checks, :data:`MASK_VALUE`, :func:`pad_axis`), so this module
imports no Pallas: :func:`compiler_params` imports Pallas's Triton backend when a kernel asks
for its launch parameters.
"""

from __future__ import annotations

import math
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax
from jaxtyping import Array, Shaped

__all__ = [
    "LOG2E",
    "MASK_VALUE",
    "compiler_params",
    "dot",
    "fast_exp",
    "interpret_mode",
    "next_power_of_2",
    "on_gpu",
    "pad_axis",
    "pad_to",
]

# A very negative finite number instead of -inf: masked logits stay finite, so ``m - m`` and
# ``exp(MASK - m)`` never produce NaN, even for rows where every entry is masked.
MASK_VALUE = -0.7 * float(jnp.finfo(jnp.float32).max)

# Kernels that work in base 2 scale by it (``exp(x) = exp2(x * LOG2E)``).
LOG2E = math.log2(math.e)


def fast_exp(x: jax.Array) -> jax.Array:
    """``exp(x)`` as ``exp2(x log2 e)``. In a Triton kernel ``exp2`` is the hardware's approximate
    ``ex2`` while ``exp`` lowers to libdevice's accurate ``expf``, a dozen instructions (the rows
    kernel ran faster for it). For values rounded to 16 bits or summed in float32: the two
    differ by about 1e-6 relatively (for |x| up to ~20)."""
    return jnp.exp2(x * LOG2E)


def on_gpu() -> bool:
    """Whether the default backend is a GPU, where the Triton lowering is available."""
    return jax.default_backend() == "gpu"


def interpret_mode() -> bool:
    """Run Pallas calls in the interpreter everywhere but on the GPU."""
    return not on_gpu()


def compiler_params(num_warps: int, num_stages: int) -> Any:
    """Triton launch parameters, whichever name this JAX release gives their class (it was
    renamed across releases)."""
    from jax.experimental.pallas import triton as pltriton

    params = getattr(pltriton, "CompilerParams", None) or getattr(pltriton, "TritonCompilerParams")
    return params(num_warps=num_warps, num_stages=num_stages)


def next_power_of_2(n: int) -> int:
    """The smallest power of two >= ``n`` (Triton tiles must have power-of-two sides)."""
    return 1 if n <= 1 else 1 << (int(n) - 1).bit_length()


def pad_axis(x: Shaped[Array, "..."], axis: int, size: int, value: Any = 0) -> Shaped[Array, "..."]:
    """``x`` padded with ``value`` at the end of ``axis`` to length ``size`` (no copy if equal)."""
    extra = size - x.shape[axis]
    if extra < 0:
        raise ValueError(f"cannot pad axis {axis} of length {x.shape[axis]} down to {size}")
    if extra == 0:
        return x
    widths = [(0, 0)] * x.ndim
    widths[axis] = (0, extra)
    return jnp.pad(x, widths, constant_values=value)


def pad_to(x: Shaped[Array, "..."], axis: int, multiple: int, value: Any = 0) -> Shaped[Array, "..."]:
    """``x`` padded at the end of ``axis`` to a multiple of ``multiple``."""
    return pad_axis(x, axis, math.ceil(x.shape[axis] / multiple) * multiple, value)


def dot(
    a: Shaped[Array, "m k"] | Shaped[Array, "k m"],
    b: Shaped[Array, "k n"] | Shaped[Array, "n k"],
    *,
    trans_a: bool = False,
    trans_b: bool = False,
) -> Shaped[Array, "m n"]:
    """``a @ b`` with optional transposes, accumulated in float32.

    Written as one ``dot_general`` with the contracting dimensions chosen, so neither operand
    is transposed in registers; the Triton lowering maps it onto a single tensor-core dot.
    """
    contract = ((0 if trans_a else 1,), (1 if trans_b else 0,))
    return lax.dot_general(a, b, (contract, ((), ())), preferred_element_type=jnp.float32)
