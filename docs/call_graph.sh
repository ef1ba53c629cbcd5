#!/bin/sh
# Draws docs/call_graph.svg and docs/call_graph.dot: the kernel-call graph of the serving
# (forward) step of the TINY example model. Run from the repository root after `ejlabel demo`,
# so that every call has a tuned config; VENV (default .venv) is the environment to use.
set -e
venv=${VENV:-.venv}
dir=$(mktemp -d)
trap 'rm -rf "$dir"' EXIT
hlo="$dir/serve_step.hlo.txt"
"$venv/bin/python" - "$hlo" <<'PY'
import sys

import jax

from ejlabel import examples

cfg = examples.TINY
params = examples.init_params(cfg, jax.random.key(0))
tokens = examples.example_batch(cfg, jax.random.key(1))["tokens"]
lowered = jax.jit(examples.make_serve_step(cfg)).lower(params, tokens)
with open(sys.argv[1], "w") as f:
    f.write(lowered.compiler_ir("hlo").as_hlo_text())
PY
"$venv/bin/ejlabel" audit "$hlo" --svg docs/call_graph.svg --dot docs/call_graph.dot
