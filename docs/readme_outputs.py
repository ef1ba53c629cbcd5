"""README's shown outputs, made by running the code: README never shows what the code does not print.

    python docs/readme_outputs.py            # rewrite README's output blocks from fresh runs
    python docs/readme_outputs.py --check    # exit 1, naming each block that differs

Run it from the repository root. Each output sits in README between ``<!-- output:NAME -->`` and
``<!-- /output:NAME -->``:

* ``usage``: the command line's synopsis (``ejlabel.cli.main.usage_text``);
* ``serve-sites``, ``train-sites``: the kernel call sites of the example model's serving and
  training steps, as the audit counts them;
* ``demo``: the output of a first ``ejlabel demo`` on an empty cache; what its timings decide
  (step 3's picks, step 4's table of them, step 5's in-context report) is shown as a line ``…``;
* ``demo-again``: steps 3 and 5 of a second run over the same cache.

Timings and temporary paths change from run to run, so ``--check`` (and
``tests/test_readme.py``, which calls :func:`check`) compares with them masked, and reads a
README line ``…`` as any number of output lines.
"""

from __future__ import annotations

import difflib
import os
import re
import subprocess
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
ELIDED = "…"
_BLOCK_RE = re.compile(r"<!-- output:(?P<name>[\w-]+) -->(?P<body>.*?)<!-- /output:(?P=name) -->", re.S)
# What differs between runs of the same code: times, temporary folders.
_VOLATILE = (
    (re.compile(r"\S*ejlabel-demo-\w+"), "ejlabel-demo-*"),  # a temporary folder, wherever TMPDIR is
    (re.compile(r"\d+(\.\d+)?(e-?\d+)? ms\b"), "N ms"),
    (re.compile(r"\bin \d+(\.\d+)? s\b"), "in N s"),
)


def usage() -> str:
    from ejlabel.cli.main import usage_text

    return f"\n```text\n{usage_text()}\n```\n"


def _sites(step: str) -> str:
    import jax

    from ejlabel import examples
    from ejlabel.analysis import audit

    cfg = examples.TINY
    params = examples.init_params(cfg, jax.random.key(0))
    batch = examples.example_batch(cfg, jax.random.key(1))
    if step == "serve":
        lowered = jax.jit(examples.make_serve_step(cfg)).lower(params, batch["tokens"])
    else:
        lowered = jax.jit(examples.make_train_step(cfg)).lower(params, batch)
    return f"{len(audit(lowered).calls)} call sites"


def _demo_runs() -> tuple[str, str]:
    """The stdout of two ``ejlabel demo`` runs over one new cache."""
    with tempfile.TemporaryDirectory(prefix="ejlabel-demo-") as scratch:
        env = {**os.environ, "EJLABEL_CACHE_DIR": str(Path(scratch) / "cache"), "JAX_PLATFORMS": "cpu"}
        outs = []
        for _ in range(2):
            proc = subprocess.run(
                [sys.executable, "-m", "ejlabel", "demo"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=900
            )
            if proc.returncode != 0:
                raise RuntimeError(f"ejlabel demo failed ({proc.returncode}):\n{proc.stdout}\n{proc.stderr}")
            outs.append(proc.stdout)
    return outs[0], outs[1]


def _steps(text: str) -> dict[str, list[str]]:
    """The demo's output by step (``"1"`` ... ``"5"``), each with its heading line."""
    steps: dict[str, list[str]] = {}
    current = None
    for line in text.splitlines():
        match = re.match(r"== (\d)\. ", line)
        if match:
            current = match.group(1)
        if current is not None:
            steps.setdefault(current, []).append(line.rstrip())
    return steps


def _elide(lines: list[str], head: int, tail: int) -> list[str]:
    """The first ``head`` and last ``tail`` lines of a step (trailing blank lines kept), a ``…``
    between them."""
    body = list(lines)
    blank = []
    while body and not body[-1]:
        blank.append(body.pop())
    if len(body) <= head + tail:
        return lines
    return [*body[:head], ELIDED, *body[len(body) - tail :], *blank]


def demo(first: str) -> str:
    """A first run; what its timings decide elided: step 3's picks (each call alone, the fastest
    by a margin the machine's noise can flip), step 4's table of them, step 5's report."""
    steps = _steps(first)
    shown = [
        *steps["1"], *steps["2"], *_elide(steps["3"], 2, 2), *_elide(steps["4"], 2, 1), *_elide(steps["5"], 2, 1),
    ]
    return "\n```text\n" + "\n".join(shown).strip("\n") + "\n```\n"


def demo_again(second: str) -> str:
    steps = _steps(second)
    shown = [line for n in "35" for line in steps[n] if line]
    return "\n```text\n" + "\n".join(shown) + "\n```\n"


def produce(names: set[str] | None = None) -> dict[str, str]:
    """Every block's text from fresh runs (only ``names`` when given; the demo runs take a minute)."""
    makers: dict[str, Callable[[], str]] = {
        "usage": usage,
        "serve-sites": lambda: _sites("serve"),
        "train-sites": lambda: _sites("train"),
    }
    blocks = {name: make() for name, make in makers.items() if names is None or name in names}
    if names is None or names & {"demo", "demo-again"}:
        first, second = _demo_runs()
        blocks["demo"], blocks["demo-again"] = demo(first), demo_again(second)
    return blocks


def readme_blocks(text: str) -> dict[str, str]:
    """README's output blocks by name."""
    return {m.group("name"): m.group("body") for m in _BLOCK_RE.finditer(text)}


def _masked(text: str) -> list[str]:
    lines = []
    for line in text.strip("\n").splitlines():
        for pattern, replacement in _VOLATILE:
            line = pattern.sub(replacement, line)
        lines.append(line.rstrip())
    return lines


def matches(shown: str, produced: str) -> bool:
    """Whether README's ``shown`` block is ``produced`` (volatile parts masked; a ``…`` line of
    ``shown`` stands for any number of lines)."""
    pattern = [re.escape(line) if line != ELIDED else None for line in _masked(shown)]
    regex = "".join("(?:.*\n)*?" if p is None else p + "\n" for p in pattern)
    return re.fullmatch(regex, "\n".join(_masked(produced)) + "\n") is not None


def check(names: set[str] | None = None) -> dict[str, str]:
    """README blocks that differ from a fresh run, by name, each with a diff of the two (volatile
    parts masked); empty when README shows what the code prints."""
    shown = readme_blocks(README.read_text())
    stale = {}
    for name, text in produce(names).items():
        if name not in shown:
            stale[name] = "README.md has no such block"
        elif not matches(shown[name], text):
            diff = difflib.unified_diff(_masked(shown[name]), _masked(text), "README.md", "fresh run", lineterm="", n=1)
            stale[name] = "\n".join(diff)
    return stale


def write() -> None:
    """Put fresh runs' outputs into README's blocks."""
    text = README.read_text()
    produced = produce()
    missing = set(produced) - set(readme_blocks(text))
    if missing:
        raise SystemExit(f"README.md has no block for {sorted(missing)}: add <!-- output:NAME --><!-- /output:NAME -->")
    text = _BLOCK_RE.sub(lambda m: f"<!-- output:{m.group('name')} -->{produced.get(m.group('name'), m.group('body'))}<!-- /output:{m.group('name')} -->", text)
    README.write_text(text)


if __name__ == "__main__":
    if sys.argv[1:] == ["--check"]:
        stale = check()
        for name, diff in stale.items():
            print(f"== {name}\n{diff}")
        if stale:
            print(f"README.md differs from the code's output in: {', '.join(stale)} (python docs/readme_outputs.py rewrites them)")
            raise SystemExit(1)
        print("README.md shows what the code prints")
    elif sys.argv[1:]:
        raise SystemExit("usage: python docs/readme_outputs.py [--check]")
    else:
        write()
