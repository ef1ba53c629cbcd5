"""Kernels a transformer needs, each with an XLA reference and Pallas GPU implementations.

Which implementation runs is a field of each kernel's config (``impl``), so the tuner picks it
per call site and the audit shows it. One package per op (``attention``, ``matmul``, ``norms``,
``cross_entropy``, ``linear_cross_entropy``): its ``__init__`` holds the op, its config, kernel
class and tuning space, and each implementation sits in a module named for its backend
(``xla.py``, ``triton.py``, the ``attention.mosaic`` package). Config and kernel classes stay in
the ``__init__`` modules: caches name them ``ejlabel.kernels.<op>:<Class>``. Beside the
packages: the argument checks (:mod:`.checks`), the Pallas helpers every op shares
(:mod:`.pallas_common`), and ejkernel's sequence and numerics helpers, re-exported here
(:mod:`.ejkernel_compat`).

Importing this package imports no Pallas. Every process that loads the kernels (the ``ejlabel``
command among them) registers their configs, checks configs and builds tuning spaces without
running a kernel, and Pallas with its Triton and Mosaic GPU backends takes longer to import than
the rest of the package. So an op's ``__init__`` imports its Pallas backend (``triton.py``) in
the method that dispatches to it, and the ``attention.mosaic`` package imports its kernels in
its entry points; the facts the configs are checked with live in modules that import only
``jax`` (:mod:`.pallas_common`, ``attention.defaults``, ``attention.mosaic`` and its
``budget``).
"""

from .attention import AttentionConfig, AttentionKernel, cu_seqlens_to_segment_ids, flash_attention
from .cross_entropy import CrossEntropyConfig, CrossEntropyKernel, softmax_cross_entropy
from .linear_cross_entropy import LinearCrossEntropyConfig, LinearCrossEntropyKernel, linear_cross_entropy
from .matmul import MatmulConfig, MatmulKernel, matmul
from .norms import LayerNormKernel, NormConfig, RMSNormKernel, layer_norm, rms_norm
from .ejkernel_compat import (
    chunk_array,
    identity_dtype_convert,
    log_sum_exp,
    mask_to_segment_ids,
    prepare_cu_seqlens_from_mask,
    prepare_lens,
    prepare_lens_from_mask,
    safe_divide,
    segment_ids_to_mask,
    unchunk_array,
)

__all__ = [
    "AttentionConfig",
    "AttentionKernel",
    "CrossEntropyConfig",
    "CrossEntropyKernel",
    "LayerNormKernel",
    "LinearCrossEntropyConfig",
    "LinearCrossEntropyKernel",
    "MatmulConfig",
    "MatmulKernel",
    "NormConfig",
    "RMSNormKernel",
    "chunk_array",
    "cu_seqlens_to_segment_ids",
    "flash_attention",
    "identity_dtype_convert",
    "layer_norm",
    "linear_cross_entropy",
    "log_sum_exp",
    "mask_to_segment_ids",
    "matmul",
    "prepare_cu_seqlens_from_mask",
    "prepare_lens",
    "prepare_lens_from_mask",
    "rms_norm",
    "safe_divide",
    "segment_ids_to_mask",
    "softmax_cross_entropy",
    "unchunk_array",
]
