"""The readable form of a fingerprint: canonical, type-tagged JSON (:func:`~.keys.stable_json`).

:func:`render` walks the same table (:mod:`.table`) as the byte encoder, so the text shows
exactly what a call key depends on, e.g. ``{"__float__":"0x1.0000000000000p+0"}`` for ``1.0``.
Ordered containers are streamed; the children of sets and of dicts with non-str keys are
rendered apart and sorted by their text, so the output is canonical too. Like the encoder it
walks with an explicit stack and writes a back-reference (``{"__ref__": depth}``) for a
container met again on the current path.

It also explains failures: it tracks the path to every value (``args[1]['w'].proj``), so when
the encoder meets a value with no rule, rendering the same value names where it sits.
"""

from __future__ import annotations

import json
from typing import Any

from ejlabel.utils.fingerprint.grammar import INT, LEAF, RECORD, SEQ, SET, Node, Unsupported
from ejlabel.utils.fingerprint.table import UNTRACKED, reduce_value, str_keyed

__all__ = ["render"]

# Instructions of the JSON walker: (op, a, b).
_VISIT, _TEXT, _CLOSE, _JSUB_BEGIN, _JSUB_END, _JSORTED = range(6)


def _json_leaf(tag: str, payload: Any) -> str:
    if tag == "str":
        return json.dumps(payload)
    if tag == "bool":
        return "true" if payload == "1" else "false"
    if tag == "none":
        return "null"
    text = payload.hex() if isinstance(payload, bytes) else payload
    return "{%s:%s}" % (json.dumps(f"__{tag}__"), json.dumps(text))


def _json_int(n: int) -> str:
    # Beyond a few thousand digits str(int) refuses to work; hex never does.
    return str(n) if n.bit_length() < 8000 else '{"__int__":"%s"}' % hex(n)


def _path_text(labels: list[str]) -> str:
    text = "".join(labels)
    return text[1:] if text.startswith(".") else text or "<root>"


def render(root: Any) -> str:
    """Canonical JSON of ``root``, from the same table as :func:`encode`.

    Ordered containers are streamed; the children of sets and of dicts with
    non-str keys are rendered apart and sorted by their text.  Raises
    ``TypeError`` naming the type and path of a value with no rule.
    """
    out: list[str] = []
    saved: list[list[str]] = []
    labels: list[str] = []
    path: list[Any] = []
    depth_of: dict[int, int] = {}
    stack: list[tuple[int, Any, Any]] = [(_VISIT, root, "")]
    while stack:
        op, obj, label = stack.pop()
        if op == _TEXT:
            out.append(obj)
            continue
        if op == _CLOSE:
            labels.pop()
            if obj:
                del depth_of[id(path.pop())]
            continue
        if op == _JSUB_BEGIN:
            saved.append(out)
            out = []
            continue
        if op == _JSUB_END:
            obj.append("".join(out))
            out = saved.pop()
            continue
        if op == _JSORTED:
            out.append(",".join(sorted(obj)))
            continue

        t = type(obj)
        if t is Node:
            node = obj
        else:
            d = depth_of.get(id(obj))
            if d is not None:
                out.append('{"__ref__":%d}' % d)
                continue
            try:
                node = reduce_value(obj)
            except Unsupported as exc:
                raise TypeError(exc.message(_path_text([*labels, label]))) from None
        kind, tag, payload = node
        if kind == INT:
            out.append(_json_int(payload))
            continue
        if kind == LEAF:
            out.append(_json_leaf(tag, payload))
            continue
        tracked = t not in UNTRACKED
        if tracked:
            depth_of[id(obj)] = len(path)
            path.append(obj)
        labels.append(label)
        opener = "" if tag in ("list", "dict") else "{%s:" % json.dumps(f"__{tag}__")
        closer = "" if not opener else "}"
        todo: list[tuple[int, Any, Any]] = []  # in output order; reversed onto the stack
        if kind == SEQ:
            out.append(opener + "[")
            for i, child in enumerate(payload):
                if i:
                    todo.append((_TEXT, ",", None))
                todo.append((_VISIT, child, f"[{i}]"))
            todo.append((_TEXT, "]" + closer, None))
        elif kind == RECORD:
            names, values = payload
            out.append(opener + "{")
            for i, (name, child) in enumerate(zip(names, values)):
                todo.append((_TEXT, ("," if i else "") + json.dumps(name) + ":", None))
                todo.append((_VISIT, child, f".{name}"))
            todo.append((_TEXT, "}" + closer, None))
        elif kind == SET:
            texts: list[str] = []
            out.append(opener + "[")
            for child in payload:
                todo += [(_JSUB_BEGIN, None, None), (_VISIT, child, "<set item>"), (_JSUB_END, texts, None)]
            todo += [(_JSORTED, texts, None), (_TEXT, "]" + closer, None)]
        elif str_keyed(payload):
            # A dict whose keys might read as type tags keeps an explicit tag.
            if any(k.startswith("__") for k in payload):
                opener, closer = "{%s:" % json.dumps(f"__{tag}__"), "}"
            out.append(opener + "{")
            for i, k in enumerate(sorted(payload)):
                todo.append((_TEXT, ("," if i else "") + json.dumps(k) + ":", None))
                todo.append((_VISIT, payload[k], f"[{k!r}]"))
            todo.append((_TEXT, "}" + closer, None))
        else:
            opener = "{%s:" % json.dumps(f"__{tag}__")
            texts = []
            out.append(opener + "[")
            for i, (k, v) in enumerate(payload.items()):
                todo += [
                    (_JSUB_BEGIN, None, None),
                    (_TEXT, "[", None),
                    (_VISIT, k, f"<key {i}>"),
                    (_TEXT, ",", None),
                    (_VISIT, v, f"[{k!r}]"),
                    (_TEXT, "]", None),
                    (_JSUB_END, texts, None),
                ]
            todo += [(_JSORTED, texts, None), (_TEXT, "]}", None)]
        stack.append((_CLOSE, tracked, None))
        stack.extend(reversed(todo))
    return "".join(out)
