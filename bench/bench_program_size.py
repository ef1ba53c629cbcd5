"""What labels and call descriptions cost in program size.

python bench/bench_program_size.py

Lowers the example transformer's training step (tiny and ~125M-parameter sizes, on abstract
arguments, so no GPU is needed) and reports, for StableHLO, HLO and compiled HLO text, the
total size and the bytes taken by the ``ejlabel`` and ``ejcall`` frontend attributes. The rows
go to ``bench/results/bench_program_size.json`` (``bench/_results.py``).
"""

from __future__ import annotations

import re
import sys

import jax
from _results import write_results

from ejlabel import examples

_ATTRS = {name: re.compile(name + r'\s*=\s*"[^"]*",?\s*') for name in ("ejlabel", "ejcall")}


def main() -> int:
    print(f"jax {jax.__version__}\n")
    print("| model | form | size KiB | ejlabel KiB (%) | ejcall KiB (%) |")
    print("|---|---|---|---|---|")
    rows = []
    for name, cfg in (("tiny", examples.TINY), ("125M", examples.GPU_125M)):
        params = jax.eval_shape(lambda: examples.init_params(cfg, jax.random.key(0)))
        batch = jax.eval_shape(lambda: examples.example_batch(cfg, jax.random.key(1)))
        lowered = jax.jit(examples.make_train_step(cfg)).lower(params, batch)
        forms = {"stablehlo": lowered.as_text(), "hlo": lowered.compiler_ir("hlo").as_hlo_text()}
        if cfg is examples.TINY:
            forms["compiled"] = lowered.compile().as_text()
        for form, text in forms.items():
            total = len(text.encode())
            sizes = {k: sum(len(m.group(0)) for m in rx.finditer(text)) for k, rx in _ATTRS.items()}
            cells = " | ".join(f"{sizes[k] / 1024:.1f} ({100 * sizes[k] / total:.1f}%)" for k in ("ejlabel", "ejcall"))
            print(f"| {name} | {form} | {total / 1024:.1f} | {cells} |")
            pct = {k: 100 * sizes[k] / total for k in sizes}
            rows.append({
                "model": name, "form": form, "size_kib": total / 1024,
                "ejlabel_kib": sizes["ejlabel"] / 1024, "ejlabel_pct": pct["ejlabel"],
                "ejcall_kib": sizes["ejcall"] / 1024, "ejcall_pct": pct["ejcall"],
                "both_pct": pct["ejlabel"] + pct["ejcall"],
            })
    write_results("bench_program_size", rows, notes="the training step's program text; ejlabel = labels, ejcall = call descriptions (frontend attributes); KiB and % of the text")
    return 0


if __name__ == "__main__":
    sys.exit(main())
