"""The Mosaic GPU attention kernels as module texts, without source locations, on the CPU.

    python bench/module_texts.py OUT_DIR

Lowers the Mosaic attention's gradient for CUDA (no GPU needed) over a grid of configurations
(head dims 64/128/256; segment ids or not; causal, full, and two windows; pingpong off; other
tiles) and writes each kernel's Mosaic GPU module, as the
backend receives it but without locations, to ``OUT_DIR/<config>_<kernel>.mlir`` (27
configurations, 89 modules). Run it before and after a change and ``diff -r`` the two
directories: equal texts mean the change left the GPU code alone, which no CPU test can
otherwise show. The texts hold no counters, so two runs of the same code are equal. The
kernels are driven through ``ejlabel.kernels.attention.mosaic.experimental.mosaic_attention``,
the one entry point with every knob of their schedule.
"""

from __future__ import annotations

import argparse
import hashlib
import pathlib
from typing import Any

import jax
import jax.numpy as jnp
from jax._src.interpreters import mlir
from jax.experimental.mosaic.gpu import core as mosaic_gpu_core

from ejlabel import BwdParams, FwdParams
from ejlabel.kernels.attention.mosaic.experimental import mosaic_attention


def configurations() -> list[dict[str, Any]]:
    grid = [
        dict(dim=dim, segments=segments, causal=causal, window=window, pingpong=True, params=None)
        for dim in (64, 128, 256)
        for segments in (False, True)
        for causal, window in ((True, None), (False, None), (True, (100, 0)), (False, (200, 50)))
    ]
    other_tiles = (FwdParams(kv_blocksize=64, num_stages=3), BwdParams(q_blocksize=128, kv_blocksize=64))
    narrow_backward = (FwdParams(kv_blocksize=128, num_stages=2), BwdParams(q_blocksize=64, kv_blocksize=128))
    return grid + [
        dict(dim=128, segments=True, causal=True, window=None, pingpong=False, params=None),
        dict(dim=128, segments=True, causal=True, window=None, pingpong=True, params=other_tiles),
        dict(dim=64, segments=False, causal=True, window=None, pingpong=True, params=narrow_backward),
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=pathlib.Path)
    out = parser.parse_args().out
    out.mkdir(parents=True, exist_ok=True)
    texts: list[str] = []
    lowering = mosaic_gpu_core._mosaic_gpu_lowering_rule

    def recording(ctx: Any, *args: Any, module: Any, **kwargs: Any) -> Any:
        texts.append(module.operation.get_asm(enable_debug_info=False))
        return lowering(ctx, *args, module=module, **kwargs)

    mosaic_gpu_core._mosaic_gpu_lowering_rule = recording  # Pallas calls the module attribute
    mlir.register_lowering(mosaic_gpu_core.mosaic_gpu_p, recording, "cuda")
    for n, c in enumerate(configurations()):
        texts.clear()
        q = jax.ShapeDtypeStruct((2, 513, 4, c["dim"]), jnp.bfloat16)
        k = jax.ShapeDtypeStruct((2, 513, 2, c["dim"]), jnp.bfloat16)
        ids = jax.ShapeDtypeStruct((2, 513), jnp.int32) if c["segments"] else None

        def loss(q: jax.Array, k: jax.Array, v: jax.Array, ids: jax.Array | None, c: dict[str, Any] = c) -> jax.Array:
            out = mosaic_attention(
                q, k, v, causal=c["causal"], window=c["window"], segment_ids=ids, pingpong=c["pingpong"], params=c["params"]
            )
            return out.astype(jnp.float32).sum()

        jax.jit(jax.grad(loss, argnums=(0, 1, 2))).trace(q, k, k, ids).lower(lowering_platforms=("cuda",))
        for m, text in enumerate(texts):
            (out / f"{n:02d}_{m}.mlir").write_text(text)
        print(n, {key: value for key, value in c.items() if key != "params"}, [hashlib.sha1(t.encode()).hexdigest()[:8] for t in texts], flush=True)


if __name__ == "__main__":
    main()
