"""Kernel-call labels: their format, writing them into the program, reading them back.

A label ``ejkernel_ops#<op>@v<version>:<16 hex call key>`` names one kernel call signature.
The executor writes it onto every op of the call's region as an XLA *frontend attribute*
(``ejlabel="..."``), next to an encoded description of the call (``ejcall="..."``, see
:mod:`ejlabel.calls`). Frontend attributes are the only carrier that survives every program
form: they appear verbatim in StableHLO (``lowered.as_text()``), HLO
(``lowered.compiler_ir("hlo")``), compiled HLO (``compiled.as_text()``) and XLA dump files, and
they follow ops through jit, grad, vmap, scan, while, cond, checkpoint and shard_map. A name
scope is written too, so profiler traces show the kernel, but it cannot be the carrier: XLA cuts
``op_name`` metadata at the first ``@`` and StableHLO text prints no locations at all.
"""

from __future__ import annotations

import contextlib
import functools
import os
import re
import sys
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any, TypeVar, overload

import jax
from jax.experimental.xla_metadata import set_xla_metadata

from ejlabel.core.label_format import (
    CALL_ATTRIBUTE,
    LABEL_ATTRIBUTE,
    LABEL_PREFIX,
    LABEL_RE,
    format_label,
    forward_op_id,
    is_backward,
    parse_label,
)
from ejlabel.core.program_source import read_program_source
from ejlabel.utils.files import MAX_PROGRAM_BYTES
from ejlabel.utils.fingerprint import abstractify, short_hash

__all__ = [
    "label",
    "label_scope",
    "extract_labels_from_hlo_text",
    "find_labels_in_lowered",
    "frontend_attribute_dicts",
    "label_table",
    "program_descriptions",
    "program_texts",
]

F = TypeVar("F", bound=Callable[..., Any])


@overload
def label(op_id: str, call_hash: str, prefix: str | None = None) -> str: ...
@overload
def label(op_id: str, call_hash: None = None, prefix: str | None = None) -> Callable[[F], F]: ...


def label(op_id: str, call_hash: str | None = None, prefix: str | None = None) -> str | Callable[[F], F]:
    """Format a label, or, given only a name, return a decorator that labels a function.

    ``label("matmul@v1", "0123456789abcdef")`` returns ``"ejkernel_ops#matmul@v1:0123456789abcdef"``.
    ``@label("my_attention")`` labels every op the decorated function emits with
    ``ejkernel_ops#my_attention@v1:<key>``, the key being the fingerprint of the call's abstract
    signature (array shapes, dtypes and shardings, other arguments by value).

    The prefix defaults to ``$EJLABEL_PREFIX`` or ``ejkernel_ops#``; it must end with ``#``.
    """
    env_prefix = os.environ.get("EJLABEL_PREFIX")
    if call_hash is not None:
        memo_key = (op_id, call_hash, prefix, env_prefix)
        try:
            return _LABEL_MEMO[memo_key]
        except (KeyError, TypeError):  # TypeError: an unhashable argument, rejected below
            pass
    if not isinstance(op_id, str) or not op_id:
        raise TypeError(f"op_id: expected a non-empty str, got {op_id!r}")
    chosen = prefix or env_prefix or LABEL_PREFIX
    if call_hash is None:
        format_label(op_id, "0" * 16, chosen)  # validates the name and prefix now, not at the first call
        return _label_decorator(op_id, chosen)
    text = format_label(op_id, call_hash, chosen)
    if type(op_id) is str and type(call_hash) is str and type(prefix) in (str, type(None)):
        if len(_LABEL_MEMO) >= _LABEL_MEMO_LIMIT:
            _LABEL_MEMO.clear()
        _LABEL_MEMO[memo_key] = text
    return text


# Formatted labels by (op_id, call_hash, prefix, $EJLABEL_PREFIX): the executor formats the
# same label at every call of a signature. Only validated arguments are stored.
_LABEL_MEMO: dict[tuple[Any, ...], str] = {}
_LABEL_MEMO_LIMIT = 8192


def _label_decorator(name: str, prefix: str) -> Callable[[F], F]:
    def decorate(fn: F) -> F:
        @functools.wraps(fn)
        def labelled(*args: Any, **kwargs: Any) -> Any:
            key = short_hash((name, abstractify(args), abstractify(kwargs)))
            with label_scope(label(name, key, prefix)):
                return fn(*args, **kwargs)

        return labelled  # type: ignore[return-value]

    return decorate


class label_scope(contextlib.ContextDecorator):
    """Label every op traced inside the block with ``lab`` (and the encoded call, if given).

    ``with label_scope(lab, call): ...`` or ``@label_scope(lab)``. A class rather than a
    generator-based context manager because the executor enters one on every kernel call.
    """

    def __init__(self, lab: str, call: str | None = None) -> None:
        attributes = {LABEL_ATTRIBUTE: lab}
        if call is not None:
            attributes[CALL_ATTRIBUTE] = call
        self._attributes = attributes
        self._name = lab
        self._entered: list[tuple[Any, Any]] = []

    def __enter__(self) -> None:
        metadata = set_xla_metadata(**self._attributes)
        metadata.__enter__()
        try:
            scope = jax.named_scope(self._name)
            scope.__enter__()
        except BaseException:
            metadata.__exit__(*sys.exc_info())
            raise
        self._entered.append((metadata, scope))

    def __exit__(self, *exc: Any) -> None:
        metadata, scope = self._entered.pop()
        try:
            scope.__exit__(*exc)
        finally:
            metadata.__exit__(*exc)


def extract_labels_from_hlo_text(text: str) -> list[str]:
    """Distinct labels in ``text`` (any program form), in order of first appearance."""
    return list(dict.fromkeys(m.group(0) for m in LABEL_RE.finditer(text)))


def program_texts(x: Any) -> list[str]:
    """The program text(s) of ``x``, which may be any form the label readers accept.

    ``x`` is a ``jax.stages.Lowered`` (its StableHLO text), a ``jax.stages.Compiled`` (its
    optimised HLO), HLO or StableHLO text, or a path to a program file or to an XLA dump
    directory, read by the one program reader (:func:`~ejlabel.core.program_source.read_program_source`:
    a dump's after-optimizations files, one per module; a folder without dump files, every
    ``*.txt`` / ``*.mlir`` / ``*.hlo`` file), at most :data:`MAX_PROGRAM_BYTES` in all.
    """
    source = read_program_source(x, lowered_form="stablehlo", max_bytes=MAX_PROGRAM_BYTES)
    if source.origin == "text":
        _check_program_text(source.texts[0].text)
    return [piece.text for piece in source.texts]


# How HLO text (``HloModule``, ``ENTRY``, a computation ``name (...`` / ``name {``) and MLIR text
# (``module``, ``func.func``, ``#loc``/aliases, comments) begin; possessive, so linear.
_PROGRAM_START = re.compile(
    r"\s*+(?:HloModule\b|ENTRY\b|module\b|func\.func\b|builtin\.module\b|\"builtin\.module\"|[#%]|//|/\*"
    r"|[A-Za-z_][\w.\-]*+\s*+[({])"
)


def _check_program_text(text: str) -> None:
    """ValueError unless ``text`` can be program text: it starts as HLO or MLIR text does, or
    holds a label (a snippet cut out of one). Anything else (``"not a program"``) is refused
    instead of read as no labels."""
    if _PROGRAM_START.match(text) is not None or LABEL_RE.search(text) is not None:
        return
    raise ValueError(
        "x: expected a Lowered, a Compiled, HLO or StableHLO text, or a path to an existing program "
        f"file or XLA dump directory; got a str that is none of these: {text[:60]!r}"
    )


# A frontend-attribute dictionary as HLO prints it (``frontend_attributes={k="v",...}``) and as
# StableHLO does (``mhlo.frontend_attributes = {k = "v", ...}``); values may hold one level of
# braces (``composite.attributes={n = 1 : i32}``). Possessive and anchored on a literal: linear.
_FRONTEND_ATTRIBUTES = re.compile(
    r'(?<![\w$\-])(?:mhlo\.)?frontend_attributes[ \t]*+=[ \t]*+\{((?:[^{}"]++|"(?:[^"\\]++|\\.)*+"|\{[^{}]*+\})*+)\}'
)
_ATTRIBUTE_PAIR = re.compile(r'(?<![\w.$\-])([\w.$\-]++)[ \t]*+=[ \t]*+"((?:[^"\\]++|\\.)*+)"')


def frontend_attribute_dicts(text: str) -> Iterator[dict[str, str]]:
    """The frontend-attribute dictionaries of HLO or StableHLO ``text``, in text order.

    A light scan, not a parser: string values only, kept as written (escapes not undone; labels
    and call descriptions hold none). Enough to find the labels and call descriptions of a program
    without parsing it; :mod:`ejlabel.analysis` parses the text for everything else.
    """
    for found in _FRONTEND_ATTRIBUTES.finditer(text):
        yield dict(_ATTRIBUTE_PAIR.findall(found.group(1)))


def label_table(attributes: Iterable[Mapping[str, str]]) -> tuple[tuple[str, ...], dict[str, str]]:
    """Every label among frontend-attribute dicts (first appearance first) and its call description.

    A label's description is the ``ejcall`` next to it; a backward label ``<op>.bwd@vN`` without
    one takes its forward call's, which its backward pass shares.
    """
    labels: dict[str, None] = {}
    found: dict[str, str] = {}
    for attrs in attributes:
        lab = attrs.get(LABEL_ATTRIBUTE)
        if lab is None or not _is_label(lab):
            continue
        labels[lab] = None
        call = attrs.get(CALL_ATTRIBUTE)
        if call and lab not in found:
            found[lab] = call
    for lab in labels:
        if lab not in found:
            op_id, _ = parse_label(lab)
            if is_backward(op_id):
                forward = lab.replace(op_id, forward_op_id(op_id), 1)
                if forward in found:
                    found[lab] = found[forward]
    return tuple(labels), found


@functools.lru_cache(maxsize=65536)
def _is_label(value: str) -> bool:
    return LABEL_RE.fullmatch(value) is not None


def program_descriptions(x: Any) -> dict[str, str]:
    """Each label's encoded call description in ``x``, any form :func:`program_texts` reads."""
    return label_table(attrs for text in program_texts(x) for attrs in frontend_attribute_dicts(text))[1]


def find_labels_in_lowered(x: Any) -> list[str]:
    """Distinct labels in a lowered/compiled program, program text, file or dump directory."""
    labels: dict[str, None] = {}
    for text in program_texts(x):
        labels.update(dict.fromkeys(extract_labels_from_hlo_text(text)))
    return list(labels)
