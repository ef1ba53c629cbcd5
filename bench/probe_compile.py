"""Where the packed model's compile time goes when its attention runs on the Mosaic kernels.

    python bench/probe_compile.py [--diff]

The tuned packed model compiled in 110 s against 11 s for the plain one (H100 run 23), and
that compile is what spends the in-context tuner's budget. This times tracing+lowering and
XLA's compile separately for the packed example model's training step with 1 and with 12
layers, plain (``examples.PLAIN_OPS``) and with every attention call on ``mosaic``
(``ejlabel.use_implementation``), in fresh jit objects, and counts the distinct Mosaic kernels
in the program (``kernel_hash``). Compile time that grows with the layers although the distinct
kernels do not says the kernels are compiled per call site. ``--diff`` only lowers, and for the
Mosaic variant with more distinct kernels than three prints the first lines in which two call
sites' modules differ (their MLIR text with locations).
"""

from __future__ import annotations

import collections
import contextlib
import difflib
import dataclasses
import os
import re
import sys
import tempfile
import time

import jax


def _module_text(serialized: str) -> list[str]:
    """The MLIR text (with locations) of a kernel module as the program prints it (escaped bytecode)."""
    from jax._src.interpreters import mlir
    from jax._src.lib.mlir import ir

    def unescape(m: re.Match[str]) -> str:
        return chr(int(m.group(1), 16)) if len(m.group(1)) == 2 else m.group(1)

    raw = re.sub(r'\\([0-9A-Fa-f]{2}|\\|")', unescape, serialized)
    with mlir.make_ir_context() as context:
        context.allow_unregistered_dialects = True
        module = ir.Module.parse(raw.encode("latin-1"))
        return module.operation.get_asm(enable_debug_info=True).splitlines()


def diff_sites(text: str, limit: int = 24) -> None:
    """Print the first lines in which the program's first Mosaic module and another one differ."""
    modules = re.findall(r'kernel_hash = "(?:[^"\\]|\\.)*", module = "((?:[^"\\]|\\.)*)"', text)
    if len(modules) < 2:
        print(f"diff: {len(modules)} modules found", flush=True)
        return
    first = _module_text(modules[0])
    for other in modules[1:]:
        lines = list(difflib.unified_diff(first, _module_text(other), lineterm="", n=0))
        if lines:
            print("\n".join(line[:300] for line in lines[:limit]), flush=True)
            return
    print("diff: the modules are the same", flush=True)


def main() -> None:
    os.environ.setdefault("EJLABEL_CACHE_DIR", tempfile.mkdtemp(prefix="ejlabel-probe-compile-"))
    import ejlabel
    from ejlabel import examples

    print(f"jax {jax.__version__}, device {jax.devices()[0].device_kind}", flush=True)
    for layers in (1, 12):
        cfg = dataclasses.replace(examples.GPU_125M_PACKED, n_layers=layers)
        params = examples.init_params(cfg, jax.random.key(0))
        batch = examples.example_batch(cfg, jax.random.key(1))
        for name, ops, context in (
            ("plain", examples.PLAIN_OPS, contextlib.nullcontext()),
            ("mosaic attention", examples.KERNEL_OPS, ejlabel.use_implementation("mosaic")),
        ):
            began = time.perf_counter()
            with context:
                lowered = jax.jit(examples.make_train_step(cfg, ops)).lower(params, batch)
            lowered_s = time.perf_counter() - began
            text = lowered.as_text()
            hashes = collections.Counter(re.findall(r'kernel_hash = "((?:[^"\\]|\\.)*)"', text))
            if "--diff" in sys.argv:
                if len(hashes) > 3:
                    diff_sites(text)
                continue
            began = time.perf_counter()
            compiled = lowered.compile()
            compile_s = time.perf_counter() - began
            began = time.perf_counter()
            jax.block_until_ready(compiled(params, batch))
            first_s = time.perf_counter() - began
            print(
                f"{layers:2d} layers, {name:16s}: trace+lower {lowered_s:6.1f} s, compile {compile_s:6.1f} s, first run {first_s:5.1f} s; "
                f"Mosaic kernels {sum(hashes.values())} calls, {len(hashes)} distinct",
                flush=True,
            )


if __name__ == "__main__":
    sys.exit(main())
