"""One Mosaic GPU module per kernel, however many call sites launch it.

The backend compiles a Mosaic GPU kernel once per distinct module: the custom call carries a
hash of the module's bytecode, and the compiled kernels are cached by that hash. jaxlib 0.11
stamps every module it lowers with ``mosaic_gpu.dump_basename = "<name>_<n>"``, ``n`` a
process-wide counter kept for naming dump files, before the hash is taken. Every launch of a
kernel then gets its own module: the packed example model's 12 attention layers lowered to 36
modules for 3 kernels on the H100 (jax 0.11.2), compiled one by one, many times the plain
step's compile time (a one-off measurement, its figures in git history). Later JAX releases
delete the attribute before hashing; :func:`share_modules_across_call_sites` does the same for
the releases that do not, by wrapping the lowering rule of the Mosaic GPU custom call. The
attribute only names dump files (``MOSAIC_GPU_DUMP_*`` options), so removing it changes no kernel.
"""

from __future__ import annotations

from typing import Any

__all__ = ["share_modules_across_call_sites"]

_ATTRIBUTE = "mosaic_gpu.dump_basename"


def share_modules_across_call_sites() -> bool:
    """Make the Mosaic GPU lowering hash a module without its per-launch counter; idempotent.

    Returns whether the lowering rule is wrapped (False where this JAX has no Mosaic GPU
    backend or keeps no such counter).
    """
    try:
        from jax._src.interpreters import mlir
        from jax.experimental.mosaic.gpu import core as mgpu_core
        from jax.experimental.mosaic.gpu import dialect
    except ImportError:  # pragma: no cover - depends on the JAX build
        return False
    if not hasattr(dialect, "get_or_set_dump_options"):
        return False  # this jaxlib stamps no counter
    rule = mgpu_core._mosaic_gpu_lowering_rule
    if getattr(rule, "_ejlabel_shares_modules", False):
        return True

    def without_counter(ctx: Any, *args: Any, module: Any, **kwargs: Any) -> Any:
        attributes = module.operation.attributes
        if _ATTRIBUTE in attributes:
            del attributes[_ATTRIBUTE]
        return rule(ctx, *args, module=module, **kwargs)

    without_counter._ejlabel_shares_modules = True  # type: ignore[attr-defined]
    # Pallas calls the module attribute directly; other Mosaic GPU calls go through the registry.
    mgpu_core._mosaic_gpu_lowering_rule = without_counter
    mlir.register_lowering(mgpu_core.mosaic_gpu_p, without_counter, "cuda")
    return True
