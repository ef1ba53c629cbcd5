"""``ejlabel demo``: the whole workflow on the tiny example model, on the CPU.

1. Lower the model's training step and list every kernel call with its config
   (``labels_to_configs``).
2. Audit the program: the call sites, their costs, the unseen ones.
3. Write the program to a dump directory and, in a separate process that never imports the
   model, run ``ejlabel tune DIR``: every unseen call is rebuilt from the program text, tuned,
   and stored in the persistent cache.
4. Lower again in this process with a fresh selector: every call is now ``persistent``; run
   the step with the tuned configs.
5. Tune in context (``tune_in_context`` with its defaults, as a user calls it): the picks of
   step 3 are timings of each call alone. Starting from every call on XLA (the floor), calls are
   taken in order of their share of the step (those below 1% are not ranked), and the most
   promising candidates are compiled into the whole training step and timed against it, next
   to the model in plain JAX; a config is kept only where the whole step gets faster. On the
   CPU the Pallas kernels run in interpret mode, slower than XLA alone, so expect XLA to stay
   everywhere: the step is never slower than the all-XLA floor. The isolated timings of step 3
   are reused from the cache. The picks are stored with provenance ``in-context``; when every
   call of the step has one that tuning in context recalls (an earlier run's pick), the step
   says so and tunes nothing.

Run it twice: the second time step 3 finds every call tuned and step 5 finds every call's
in-context pick, so nothing is tuned.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

__all__ = ["run_demo"]


def _heading(text: str) -> None:
    print(f"\n== {text} ==", flush=True)


def run_demo(*, fresh: bool = False, workdir: str | None = None) -> int:
    """Run the five steps, printing as it goes; returns the process exit code."""
    with tempfile.TemporaryDirectory(prefix="ejlabel-demo-") as scratch:
        if fresh:
            os.environ["EJLABEL_CACHE_DIR"] = str(Path(scratch) / "cache")
        dump_dir = Path(workdir) if workdir else Path(scratch) / "dump"
        return _run(dump_dir)


def _run(dump_dir: Path) -> int:
    import jax

    import ejlabel
    from ejlabel.analysis import audit
    from ejlabel import examples
    from ejlabel.execution.tuning import PROVENANCE, tune_in_context

    cfg = examples.TINY
    params = examples.init_params(cfg, jax.random.key(0))
    batch = examples.example_batch(cfg, jax.random.key(1))
    step = examples.make_train_step(cfg)

    _heading("1. lower the training step; every kernel call and its config")
    ejlabel.set_default_executor(None)
    lowered = jax.jit(step).lower(params, batch)
    selector = ejlabel.get_default_executor().selector
    print(f"persistent cache: {selector.persistent.path if selector.persistent else 'none'}")
    for pair in ejlabel.labels_to_configs(lowered, selector):
        print(f"  {pair.label:58} {pair.provenance or 'none':10} {pair.cfg!r}")

    _heading("2. audit: every call site, its config and cost; the unseen calls")
    print(audit(lowered).render())

    _heading(f"3. dump the program to {dump_dir}; tune it in a separate process")
    dump_dir.mkdir(parents=True, exist_ok=True)
    (dump_dir / "module_0001.jit_step.before_optimizations.txt").write_text(lowered.compiler_ir("hlo").as_hlo_text())
    command = [sys.executable, "-m", "ejlabel.cli", "tune", str(dump_dir)]
    print("$ ejlabel tune", dump_dir, flush=True)
    tuned = subprocess.run(command, env=dict(os.environ))
    if tuned.returncode != 0:
        print(f"ejlabel tune failed with exit code {tuned.returncode}", file=sys.stderr)
        return 1

    _heading("4. lower again: every call now comes from the persistent cache")
    ejlabel.set_default_executor(None)
    lowered = jax.jit(step).lower(params, batch)
    report = audit(lowered)
    print(report.render())
    _, loss = jax.jit(step)(params, batch)
    print(f"training step with the tuned configs: loss {float(loss):.4f}")
    if report.unseen:
        print(f"{len(report.unseen)} calls are still unseen", file=sys.stderr)
        return 1

    _heading("5. tune in context: the whole step, from the all-XLA floor, next to plain JAX")
    persistent = ejlabel.get_default_executor().selector.persistent
    picked, calls = _in_context_picks(lowered, persistent)
    if calls and picked == calls:
        print(
            f"every one of the step's {calls} distinct calls has an in-context pick from an earlier run: "
            "nothing to tune (`ejlabel demo --fresh` starts from an empty cache)"
        )
        return 0
    print(
        "step 3 timed each call alone; now, largest share of the step first, the alternatives to XLA "
        "that were faster alone are compiled into the training step and timed against the incumbent "
        "(tune_in_context's defaults)",
        flush=True,
    )
    context = tune_in_context(step, params, batch, baseline_fn=examples.make_train_step(cfg, examples.PLAIN_OPS))
    if persistent is not None:
        stored = [e for e in persistent.entries() if e.provenance == PROVENANCE]
        print(f"{len(stored)} picks stored with provenance 'in-context' ({len(context.changed)} not XLA); the next run of the step uses them")
    return 0


def _in_context_picks(lowered: Any, persistent: Any) -> tuple[int, int]:
    """How many of the distinct forward calls in ``lowered`` have an in-context pick in
    ``persistent`` that tuning in context recalls (stored by a run, whether it finished with the
    call or its budget cut it, and not marked ``recall: False``: see
    :mod:`ejlabel.execution.tuning.memory`), and how many there are."""
    from ejlabel import find_labels_in_lowered
    from ejlabel.core.label_format import is_backward, parse_label
    from ejlabel.execution.tuning import PROVENANCE
    from ejlabel.utils.fingerprint import device_fingerprint

    keys = [parse_label(lab) for lab in find_labels_in_lowered(lowered)]
    keys = [(op_id, call_key) for op_id, call_key in keys if not is_backward(op_id)]
    if persistent is None:
        return 0, len(keys)
    device = device_fingerprint()
    picked = 0
    for op_id, call_key in keys:
        entry = persistent.get_entry(device, op_id, call_key)
        stats = entry.stats if entry is not None and isinstance(entry.stats, dict) else {}
        picked += entry is not None and entry.provenance == PROVENANCE and isinstance(stats.get("decided"), bool) and stats.get("recall") is not False
    return picked, len(keys)
