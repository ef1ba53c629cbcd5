"""What the hostile-input tests share: a registered config type, entries and export documents as
a hostile writer makes them, a module that leaves a marker when imported, JSON strategies, small
HLO modules, and a runner for the ``ejlabel`` command.

Not a test module (no ``test_`` prefix): ``tests/test_hostile_*.py`` import from it.
"""

from __future__ import annotations

import base64
import dataclasses
import json
import os
import pathlib
import sqlite3
import subprocess
import sys
import textwrap
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import pytest
from hypothesis import strategies as st

from conftest import subprocess_env
from ejlabel.config.persistent import PersistentCache
from ejlabel.core.registry import register_config_type

DEV = "cpu:hostile:fp0"
KEY = "0123456789abcdef"
EJLABEL = str(pathlib.Path(sys.executable).with_name("ejlabel"))


@register_config_type
@dataclasses.dataclass(frozen=True)
class GoodConfig:
    tile: int = 8


def call_key(i: int) -> str:
    return f"{i:016x}"


def raw_insert(path: pathlib.Path, key: tuple[str, str, str], config_json: str, *, config_type: str = "x:Y",
               created: float = 1.0, stats_json: str | None = None, provenance: str = "autotuned") -> None:
    """Write a row as a hostile (or older) writer could, bypassing every check of put()."""
    with sqlite3.connect(path) as raw:
        raw.execute(
            "INSERT OR REPLACE INTO configs VALUES (?, ?, ?, ?, ?, ?, ?, '1', 'j', 'jl', ?)",
            (*key, config_json, config_type, provenance, stats_json, created),
        )
    raw.close()


def export_doc(entries: list[dict]) -> dict:
    return {"format": "ejlabel-configs", "version": 1, "entries": entries}


def entry(i: int = 0, config: object = None, **overrides: object) -> dict:
    base = {
        "device": DEV, "op_id": "good@v1", "call_key": call_key(i),
        "config": {"$dataclass": f"{__name__}:GoodConfig", "fields": {"tile": i}} if config is None else config,
        "config_type": f"{__name__}:GoodConfig", "provenance": "autotuned", "stats": None,
        "kernel_version": "1", "jax_version": "j", "jaxlib_version": "jl", "created": 1.0,
    }
    base.update(overrides)
    return base


@pytest.fixture
def cache(tmp_path: pathlib.Path) -> Iterator[PersistentCache]:
    with PersistentCache(tmp_path / "cache.sqlite") as c:
        c.put(DEV, "good@v1", KEY, GoodConfig(3))
        yield c


EVIL_MODULE = textwrap.dedent(
    """
    import dataclasses, enum, pathlib
    pathlib.Path(__file__).with_name("IMPORTED").write_text("the module ran")

    @dataclasses.dataclass
    class Cfg:
        x: int = 0

    class Mode(enum.Enum):
        A = 1

    def geohash():
        return 0
    """
)


@pytest.fixture
def evil_module(tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch) -> tuple[str, pathlib.Path]:
    """An importable module that leaves a marker file when it is imported."""
    folder = tmp_path / "evil"
    folder.mkdir()
    name = f"evil_{os.getpid()}_{abs(hash(str(tmp_path))) % 10**8}"
    (folder / f"{name}.py").write_text(EVIL_MODULE)
    monkeypatch.syspath_prepend(str(folder))
    return name, folder / "IMPORTED"


def hostile_configs(module: str) -> list[dict]:
    return [
        {"$ref": f"{module}:geohash"},
        {"$dataclass": f"{module}:Cfg", "fields": {"x": 1}},
        {"$enum": f"{module}:Mode", "name": "A"},
        {"$tuple": [{"$ref": "this:s"}]},  # `this` prints the Zen of Python when imported
    ]


def capture(outcome: list, fn: Callable[[], Any]) -> None:
    """Run ``fn`` and append its result or the exception it raised (for a watched thread)."""
    try:
        outcome.append(fn())
    except BaseException as err:
        outcome.append(err)


def b64(data: bytes) -> str:
    """``data`` as a call description's base64url text."""
    return base64.urlsafe_b64encode(data).decode("ascii").rstrip("=")


TAG_KEYS = ["$ref", "$dataclass", "$enum", "$tuple", "$float", "$dict", "$set", "$bytes", "$dtype", "$array", "$slice", "fields", "name"]
json_leaf = st.one_of(
    st.none(), st.booleans(), st.integers(-(2**70), 2**70), st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=6), st.sampled_from([f"{__name__}:GoodConfig", "os:system", "antigravity:geohash", "\ud800"]),
)


def _json_containers(inner: st.SearchStrategy) -> st.SearchStrategy:
    return st.one_of(
        st.lists(inner, max_size=3),
        st.dictionaries(st.one_of(st.text(max_size=4), st.sampled_from(TAG_KEYS)), inner, max_size=3),
    )


json_value = st.recursive(json_leaf, _json_containers, max_leaves=12)

LABELLED = 'frontend_attributes={ejlabel="ejkernel_ops#scale@v1:0123456789abcdef"}'


def hlo_module(*body: str, params: str = "p: f32[4]") -> str:
    """An HLO module whose entry computation has these instruction lines."""
    lines = "\n".join(f"  {line}" for line in body)
    return f"HloModule m\n\nENTRY %main ({params}) -> f32[4] {{\n{lines}\n}}\n"


#: A call of toy_kernels.ScaleKernel and its description, as a program carries them.
GOOD_LABEL = "ejkernel_ops#scale@v1:c0417bbf50206eff"
GOOD_CALL = [1, "toy_kernels:ScaleKernel", [{"$array": "float32[8,16]"}], {}, None, None]


def described_program(calls: list[tuple[str, list]]) -> str:
    """An HLO module with one labelled instruction per ``(label, description data)``, in a chain."""
    body = ["%p = f32[4]{0} parameter(0)"]
    for i, (lab, data) in enumerate(calls):
        text = b64(json.dumps(data, separators=(",", ":")).encode())
        body.append(f'%a{i} = f32[4]{{0}} add(%{"p" if i == 0 else f"a{i - 1}"}, %p), frontend_attributes={{ejcall="{text}",ejlabel="{lab}"}}')
    body.append(f"ROOT %r = f32[4]{{0}} negate(%a{len(calls) - 1})")
    return hlo_module(*body)



def run_cli(args: Sequence[str], *, cwd: pathlib.Path | None = None, timeout: float = 300, **env: str) -> subprocess.CompletedProcess[str]:
    """``ejlabel ARGS`` in a child process (the console script), its output captured as text."""
    return subprocess.run([EJLABEL, *args], cwd=cwd, check=False, capture_output=True, text=True, env=subprocess_env(**env), timeout=timeout)
