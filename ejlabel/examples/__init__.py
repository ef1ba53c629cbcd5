"""The example model: a small decoder-only transformer, labelled and plain.

:mod:`.model` builds the same decoder on sets of ops: ``KERNEL_OPS`` (every call through an
``ejlabel.kernels`` kernel, labelled), ``PLAIN_OPS`` (the model as a JAX user writes it, the
baseline every comparison is made against) and ``PLAIN_CUDNN_PACKED_OPS`` (the same with packed
documents on cuDNN's packed layout, the packed model's second baseline), in sizes from ``TINY``
(the CPU) to ``GPU_125M``.
The demo, the tests and the benchmarks all use it: ``from ejlabel import examples``.

It imports ``ejlabel.kernels``, so it sits above the kernels and below the command line, which
runs it in ``ejlabel demo``; nothing in the core imports it.
"""

from .model import (
    GPU_125M,
    GPU_125M_PACKED,
    KERNEL_OPS,
    PLAIN_CUDNN_PACKED_OPS,
    PLAIN_OPS,
    TINY,
    TINY_PACKED,
    ModelConfig,
    Ops,
    Params,
    example_batch,
    fsdp_specs,
    gathered,
    hidden_fn,
    init_params,
    logits_fn,
    loss_fn,
    make_serve_step,
    make_train_step,
    place_on_mesh,
    random_documents,
)

__all__ = [
    "GPU_125M",
    "GPU_125M_PACKED",
    "KERNEL_OPS",
    "PLAIN_CUDNN_PACKED_OPS",
    "PLAIN_OPS",
    "TINY",
    "TINY_PACKED",
    "ModelConfig",
    "Ops",
    "Params",
    "example_batch",
    "fsdp_specs",
    "gathered",
    "hidden_fn",
    "init_params",
    "logits_fn",
    "loss_fn",
    "make_serve_step",
    "make_train_step",
    "place_on_mesh",
    "random_documents",
]
