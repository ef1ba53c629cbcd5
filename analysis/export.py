"""The call graph in other forms: node-link JSON (and back), Graphviz DOT, SVG/PNG drawings."""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path
from typing import Any

import networkx as nx

from ejlabel.utils.sanitize import sanitize
from ejlabel.utils.serialize import to_jsonable

__all__ = ["draw", "from_node_link_json", "to_dot", "to_node_link_json"]


def _jsonable(value: Any) -> Any:
    if isinstance(value, (tuple, list)):
        return [_jsonable(v) for v in value]
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    return repr(value)


def _jsonable_config(cfg: Any) -> Any:
    try:
        encoded = to_jsonable(cfg)
        json.dumps(encoded)
        return encoded
    except (TypeError, ValueError):
        return repr(cfg)


_CONFIG_ENCODING = "ejlabel.utils.serialize.to_jsonable, else repr"


def to_node_link_json(graph: nx.DiGraph) -> str:
    """The graph as node-link JSON (edges under ``"edges"``); configs in their tagged JSON form."""
    # A graph read back from JSON holds configs in their JSON form already: encoding them again
    # would wrap them in another layer of tags.
    encoded = graph.graph.get("config_encoding") == _CONFIG_ENCODING
    copy = nx.DiGraph()
    copy.graph.update({k: _jsonable(v) for k, v in graph.graph.items()})
    copy.graph["config_encoding"] = _CONFIG_ENCODING
    for node, data in graph.nodes(data=True):
        attrs = {k: (_jsonable_config(v) if k == "config" and not encoded else _jsonable(v)) for k, v in data.items()}
        copy.add_node(node, **attrs)
    for a, b, data in graph.edges(data=True):
        copy.add_edge(a, b, **{k: _jsonable(v) for k, v in data.items()})
    return json.dumps(nx.node_link_data(copy, edges="edges"), sort_keys=True)


def from_node_link_json(text: str) -> nx.DiGraph:
    """Read :func:`to_node_link_json` output back; ``nesting`` becomes a tuple again.

    Configs stay in their JSON form: decoding them would import the classes the text names, which
    a file from elsewhere should not make this process do.
    """
    data = json.loads(text)
    graph = nx.node_link_graph(data, directed=True, multigraph=False, edges="edges")
    for _, attrs in graph.nodes(data=True):
        if isinstance(attrs.get("nesting"), list):
            attrs["nesting"] = tuple(attrs["nesting"])
    return graph


def _dot_quote(text: object) -> str:
    """A DOT double-quoted string of data: sanitized for DOT (a quote cannot end it, a backslash
    names nothing, an escape code shows as text in the drawing), line breaks as DOT's ``\\n``."""
    return '"' + sanitize(text, "dot") + '"'


def _short(text: str, width: int = 60) -> str:
    return text if len(text) <= width else text[: width - 3] + "..."


def to_dot(graph: nx.DiGraph) -> str:
    """The graph in Graphviz DOT: kernels as boxes, loops/branches as ellipses.

    Backward kernels are filled in a different colour; kernels with no known config are drawn
    dashed and red.
    """
    lines = ["digraph kernels {", "  rankdir=TB;", '  node [fontname="monospace", fontsize=10];']
    for node, data in graph.nodes(data=True):
        kind = data.get("kind", "kernel")
        if kind == "kernel":
            times = data.get("multiplicity")
            text = "\n".join(
                [
                    f"{data.get('op', '?')}@v{data.get('version', '?')}" + (f" x{times}" if times not in (None, 1) else ""),
                    str(data.get("call_key", ""))[:8],
                    _short("unseen" if data.get("config") is None else repr(data["config"])),
                    str(data.get("provenance") or "no config"),
                ]
            )
            style = ["filled"]
            colour = "black"
            fill = "lightsalmon" if data.get("direction") == "backward" else "lightblue"
            if data.get("config") is None:
                style.append("dashed")
                colour = "red"
            attrs = f'shape=box, style="{",".join(style)}", color={colour}, fillcolor={fill}'
        else:
            times = data.get("multiplicity")
            text = f"{kind} {node.rsplit('/', 1)[-1]}" + ("" if times is None else f"\nx{times}")
            attrs = "shape=ellipse, color=gray40"
        lines.append(f"  {_dot_quote(node)} [label={_dot_quote(text)}, {attrs}];")
    for a, b, data in graph.edges(data=True):
        style = "style=dotted, color=gray50" if data.get("kind") == "nesting" else "color=black"
        lines.append(f"  {_dot_quote(a)} -> {_dot_quote(b)} [{style}];")
    lines.append("}")
    return "\n".join(lines) + "\n"


def draw(graph: nx.DiGraph, path: str | Path, format: str | None = None) -> Path:
    """Render the graph to ``path`` (SVG, PNG, ... from the suffix or ``format``) with Graphviz's ``dot``."""
    path = Path(path)
    fmt = (format or path.suffix.lstrip(".") or "svg").lower()
    dot = shutil.which("dot")
    if dot is None:
        raise RuntimeError(
            "drawing needs Graphviz's `dot` program on PATH (apt install graphviz / brew install graphviz); "
            "`to_dot()` gives the DOT text"
        )
    done = subprocess.run([dot, f"-T{fmt}", "-o", str(path)], input=to_dot(graph), capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"dot failed ({done.returncode}): {done.stderr.strip()}")
    return path
