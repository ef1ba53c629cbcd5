"""Registers and spills of each Mosaic GPU attention kernel at the benchmark shapes.

    python bench/probe_registers.py [--bwd-tiles 64x128,64x64]   # default: the kernels' own tiles

Compiles the forward and the split backward (``mosaic_attention``, causal) for causal B4 S4096
H16 D128, the same with 4 documents per row, and the packed model's shape (B8 S2048 H12/4 D64,
4 documents), with ``MOSAIC_GPU_DUMP_PTXAS=1`` so the PTX assembler reports each kernel's
spill stores and loads per thread (every kernel is compiled at 168 registers, the consumers
raise theirs to 240 at run time); prints those lines per shape and backward tile. A consumer
warpgroup that spills pays local-memory traffic at every step of its walk.
"""

from __future__ import annotations

import os
import subprocess
import sys

SHAPES = {
    "causal B4 S4096 H16 D128": (4, 4096, 16, 16, 128, 1),
    "4 segments B4 S4096 H16 D128": (4, 4096, 16, 16, 128, 4),
    "packed B8 S2048 H12/4 D64": (8, 2048, 12, 4, 64, 4),
}

_COMPILE = """
import sys
sys.path.insert(0, {bench!r})
import jax, jax.numpy as jnp
from bench_attention import equal_documents
from ejlabel import BwdParams, FwdParams
from ejlabel.kernels import attention_mosaic as am
tile = {tile}
bwd = BwdParams() if tile is None else BwdParams(q_blocksize=tile[0], kv_blocksize=tile[1])
batch, seq, heads, kv_heads, dim, docs = {shape}
q = jnp.zeros((batch, seq, heads, dim), jnp.bfloat16)
k = v = jnp.zeros((batch, seq, kv_heads, dim), jnp.bfloat16)
ids = None if docs == 1 else equal_documents(batch, seq, docs)
loss = lambda q, k, v: jnp.sum(am.mosaic_attention(q, k, v, causal=True, segment_ids=ids, params=(FwdParams(), bwd)).astype(jnp.float32))
jax.jit(jax.grad(loss, argnums=(0, 1, 2))).lower(q, k, v).compile()
"""


def main() -> int:
    env = {**os.environ, "MOSAIC_GPU_DUMP_PTXAS": "1"}
    tiles = sys.argv[sys.argv.index("--bwd-tiles") + 1].split(",") if "--bwd-tiles" in sys.argv else ["default"]
    for (name, shape), tile in ((item, tile) for item in SHAPES.items() for tile in tiles):
        code = _COMPILE.format(bench=os.path.dirname(os.path.abspath(__file__)), shape=shape, tile=None if tile == "default" else tuple(int(x) for x in tile.split("x")))
        done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
        lines = [line.strip() for line in (done.stdout + done.stderr).splitlines() if "spill stores" in line and "stack frame" in line]
        print(f"### {name}, backward tiles {tile} (exit {done.returncode})")
        print("\n".join(lines) if lines else (done.stdout + done.stderr)[-2000:])
    return 0


if __name__ == "__main__":
    sys.exit(main())
