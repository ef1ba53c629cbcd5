"""Offline audit of a program: every kernel call, the config it maps to, what is unseen.

``audit(x)`` reads ``x`` once (:class:`~ejlabel.analysis.Program`), builds its call graph
(:func:`ejlabel.analysis.call_graph`) and summarises it per call site: op, version, shapes,
config, provenance, how often it runs and its estimated cost. The arguments shown per call come
from the call descriptions the same program carries. Calls with no cached config (or only the
kernel's heuristic) are *unseen*: ``tune_unseen`` tunes exactly those. The report renders as a
terminal table, Markdown or JSON.
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Mapping
from typing import Any

import jax
import networkx as nx

from ejlabel.config.persistent import open_default_persistent
from ejlabel.config.selection import ConfigSelectorChain
from ejlabel.core.calls import CallDecodeError, decode_call
from ejlabel.core.vmapped import batched_call, vmap_levels
from ejlabel.utils.fingerprint import device_fingerprint
from ejlabel.utils.sanitize import sanitize
from ejlabel.utils.serialize import to_jsonable

from .graph import WRONG_TYPE, call_graph
from .program import read_program

__all__ = ["TUNED_PROVENANCES", "CallRow", "CallSummary", "Report", "audit"]

TUNED_PROVENANCES = frozenset({"override", "memory", "persistent", "autotuned"})
"""Provenances that count as seen; ``heuristic`` and None are unseen."""


@dataclasses.dataclass(frozen=True)
class CallRow:
    """One kernel call site of the program."""

    node: str
    label: str
    op: str
    version: str
    call_key: str
    direction: str
    config: Any
    provenance: str | None
    input_shapes: tuple[str, ...]
    shapes: tuple[str, ...]
    instructions: int
    multiplicity: int | None
    flops: int
    bytes: int
    nesting: tuple[str, ...]
    attributed_custom_calls: tuple[str, ...]

    @property
    def seen(self) -> bool:
        return self.provenance in TUNED_PROVENANCES

    def to_dict(self) -> dict[str, Any]:
        data = dataclasses.asdict(self)
        data["config"] = _jsonable_config(self.config)
        data["seen"] = self.seen
        return data


@dataclasses.dataclass(frozen=True)
class CallSummary:
    """All call sites of one label: what a reader of the report wants first."""

    label: str
    op: str
    version: str
    call_key: str
    arguments: str
    sites: int
    config: Any
    provenance: str | None
    flops: int
    bytes: int

    @property
    def seen(self) -> bool:
        return self.provenance in TUNED_PROVENANCES


def _describe_arguments(label: str, descriptions: Mapping[str, str]) -> str:
    """``f32[64,64] f32[64] eps=1e-06`` from the call description next to ``label``; a call made
    under ``jax.vmap`` with the shapes the program runs and its batch sizes (``vmap=2x8``)."""
    text = descriptions.get(label)
    if text is None:
        return "?"
    try:
        desc = decode_call(text, label)
        args, kwargs = batched_call(desc.args, desc.kwargs, desc.batch_axes)
        levels = vmap_levels(desc.batch_axes)
    except (CallDecodeError, ValueError, TypeError):
        return "?"
    parts = []
    for leaf in jax.tree_util.tree_leaves((args, kwargs), is_leaf=lambda x: isinstance(x, jax.ShapeDtypeStruct)):
        if isinstance(leaf, jax.ShapeDtypeStruct):
            parts.append(f"{_DTYPE_SHORT.get(leaf.dtype.name, leaf.dtype.name)}[{','.join(map(str, leaf.shape))}]")
    parts += [f"{k}={v!r}" for k, v in kwargs.items() if not isinstance(v, jax.ShapeDtypeStruct) and v is not None]
    if levels:
        parts.append("vmap=" + "x".join(str(size) for size, _ in reversed(levels)))  # outermost first
    return " ".join(parts)


_DTYPE_SHORT = {"float32": "f32", "bfloat16": "bf16", "float16": "f16", "float64": "f64", "int32": "s32", "int64": "s64", "bool": "pred", "int8": "s8", "uint8": "u8"}


def _jsonable_config(cfg: Any) -> Any:
    try:
        return to_jsonable(cfg)
    except TypeError:
        return repr(cfg)


def _short(cfg: Any, width: int = 48) -> str:
    if cfg is None:
        return "-"
    text = repr(cfg)
    return text if len(text) <= width else text[: width - 1] + "…"


def _human(n: float) -> str:
    for unit in ("", "K", "M", "G", "T", "P"):
        if abs(n) < 1000:
            return f"{n:.3g}{unit}"
        n /= 1000
    return f"{n:.3g}E"


@dataclasses.dataclass(frozen=True)
class Report:
    """The audit of one program: its call rows, totals per op, and unseen calls."""

    calls: tuple[CallRow, ...]
    device: str
    graph: nx.DiGraph = dataclasses.field(repr=False, compare=False)
    arguments: dict[str, str] = dataclasses.field(default_factory=dict, repr=False, compare=False)

    @property
    def summaries(self) -> tuple[CallSummary, ...]:
        """One entry per distinct label (in order of first appearance), its sites summed."""
        grouped: dict[str, list[CallRow]] = {}
        for row in self.calls:
            grouped.setdefault(row.label, []).append(row)
        return tuple(
            CallSummary(
                label=label,
                op=rows[0].op,
                version=rows[0].version,
                call_key=rows[0].call_key,
                arguments=self.arguments.get(label, "?"),
                sites=len(rows),
                config=rows[0].config,
                provenance=rows[0].provenance,
                flops=sum(r.flops * (r.multiplicity or 1) for r in rows),
                bytes=sum(r.bytes * (r.multiplicity or 1) for r in rows),
            )
            for label, rows in grouped.items()
        )

    @property
    def unseen(self) -> tuple[CallRow, ...]:
        """Call sites without a tuned config, one per distinct label."""
        distinct: dict[str, CallRow] = {}
        for row in self.calls:
            if not row.seen:
                distinct.setdefault(row.label, row)
        return tuple(distinct.values())

    @property
    def by_op(self) -> dict[str, dict[str, int]]:
        """Per op: call sites, distinct labels, unseen labels, flops and bytes (times multiplicity)."""
        totals: dict[str, dict[str, Any]] = {}
        for row in self.calls:
            op = totals.setdefault(row.op, {"sites": 0, "labels": set(), "unseen": set(), "flops": 0, "bytes": 0})
            times = row.multiplicity or 1
            op["sites"] += 1
            op["labels"].add(row.label)
            if not row.seen:
                op["unseen"].add(row.label)
            op["flops"] += row.flops * times
            op["bytes"] += row.bytes * times
        return {
            name: {"sites": t["sites"], "labels": len(t["labels"]), "unseen": len(t["unseen"]), "flops": t["flops"], "bytes": t["bytes"]}
            for name, t in sorted(totals.items())
        }

    def summary(self) -> str:
        labels = {row.label for row in self.calls}
        return f"{len(self.calls)} kernel call sites, {len(labels)} distinct calls, {len(self.unseen)} unseen, on {self.device}"

    def to_json(self, indent: int | None = 2) -> str:
        data = {
            "device": self.device,
            "summary": self.summary(),
            "calls": [row.to_dict() for row in self.calls],
            "arguments": self.arguments,
            "by_op": self.by_op,
            "unseen": [row.label for row in self.unseen],
        }
        return json.dumps(data, indent=indent, default=repr)

    def _table_rows(self) -> list[list[str]]:
        return [
            [
                f"{c.op}@v{c.version}",
                c.call_key[:8],
                c.arguments,
                str(c.sites),
                _short(c.config),
                c.provenance or "UNSEEN",
                _human(c.flops),
                _human(c.bytes) + "B",
            ]
            for c in self.summaries
        ]

    _HEADERS = ("op", "key", "arguments", "sites", "config", "provenance", "flops", "bytes")

    def to_markdown(self) -> str:
        """The report as Markdown; every cell from data is sanitized for Markdown (a ``|`` or a
        line break cannot add a column or end the row, a link, an image or HTML shows as text)."""
        lines = [f"**{sanitize(self.summary(), 'markdown')}**", "", "| " + " | ".join(self._HEADERS) + " |", "|" + "---|" * len(self._HEADERS)]
        lines += ["| " + " | ".join(sanitize(cell, "markdown") for cell in row) + " |" for row in self._table_rows()]
        lines += ["", "| op | sites | distinct calls | unseen | flops | bytes |", "|---|---|---|---|---|---|"]
        lines += [
            f"| {sanitize(op, 'markdown')} | {t['sites']} | {t['labels']} | {t['unseen']} | {_human(t['flops'])} | {_human(t['bytes'])}B |"
            for op, t in self.by_op.items()
        ]
        return "\n".join(lines)

    def render(self, width: int = 140) -> str:
        """A terminal table (rich), as text.

        Every cell comes from data (argument values, configs, device names read from a program
        or a cache), so each is sanitized for the terminal (no escape code or line break from
        data reaches it: :func:`~ejlabel.utils.sanitize.sanitize`) and is a ``rich.text.Text``:
        rich never parses it as markup or emoji codes, and a value such as ``"[/]"`` prints as
        itself instead of failing or restyling.
        """
        from rich.console import Console
        from rich.table import Table
        from rich.text import Text

        table = Table(title=Text(sanitize(self.summary())), title_justify="left")
        for header in self._HEADERS:
            table.add_column(header, no_wrap=header in ("op", "key", "provenance"))
        for cells in self._table_rows():
            style = "red" if cells[5] in ("UNSEEN", "heuristic", WRONG_TYPE) else None
            table.add_row(*(Text(sanitize(cell)) for cell in cells), style=style)
        with open(os.devnull, "w") as sink:
            console = Console(width=width, record=True, file=sink, color_system=None, markup=False, emoji=False, highlight=False)
            console.print(table)
            return console.export_text()

    def __str__(self) -> str:
        return self.render()


def audit(x: Any, selector: ConfigSelectorChain | None = None, device: str | None = None) -> Report:
    """Audit ``x`` (a ``Program`` or anything :func:`~ejlabel.analysis.read_program` reads)
    against ``selector``'s caches.

    With no selector, a fresh one over the default persistent cache is used: the audit then
    shows what a new process would find.
    """
    if selector is None:
        selector = ConfigSelectorChain(persistent=open_default_persistent())
    program = read_program(x)
    graph = call_graph(program, selector=selector, device=device)
    rows = []
    for node, data in graph.nodes(data=True):
        if data.get("kind", "kernel") != "kernel":
            continue
        rows.append(
            CallRow(
                node=node,
                label=data["label"],
                op=data["op"],
                version=data["version"],
                call_key=data["call_key"],
                direction=data["direction"],
                config=data["config"],
                provenance=data["provenance"],
                input_shapes=tuple(data.get("input_shapes", ())),
                shapes=tuple(data.get("shapes", ())),
                instructions=data["instructions"],
                multiplicity=data["multiplicity"],
                flops=data["flops"],
                bytes=data["bytes"],
                nesting=tuple(data["nesting"]),
                attributed_custom_calls=tuple(data.get("attributed_custom_calls", ())),
            )
        )
    arguments = {row.label: _describe_arguments(row.label, program.descriptions) for row in rows}
    return Report(tuple(rows), graph.graph.get("device") or device or device_fingerprint(), graph, arguments)
