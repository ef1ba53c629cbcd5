"""A tolerant reader for HLO module text and for frontend attributes in StableHLO text.

Why our own parser: XLA's parser rejects dumps written by newer XLA versions (new
attributes, new header sections), yet all we need from a program is its call
structure (instructions, operands, called computations) and the attributes that
the library writes into kernel calls (``ejlabel`` and ``ejcall``).  So this reader
follows the grammar of XLA's ``hlo_parser`` (the module strings of its tests
parse) and keeps only those parts; attributes it does not know are skipped, not
rejected.

Accepted input is the token grammar XLA reads, liberally:

* an optional ``HloModule name, key=value, ...`` header (at most one); values may
  run over several lines (a quoted string may hold line breaks);
* optional header sections such as ``FileNames`` / ``FileLocations`` /
  ``StackFrames`` (rows ``<id> <string or {...}>``); rows of unknown sections
  are skipped to the end of their line;
* computations ``[ENTRY] [%]name [(signature) -> shape] { ... }``, optionally
  followed by ``, key=value`` attributes (``execution_thread=...``);
* instructions ``[ROOT] [%]name = [shape] opcode(operands)[, key=value]...``
  laid out freely over lines: operand lists, tuple shapes and attribute lists may
  continue on the next line, and an attribute list may go on with a ``,`` on a
  later line.  The shape may be left out (XLA infers it; it reads as ``""``
  here).  Operands are names, optionally typed (``f32[2] %x``), or instructions
  written in place (``add(f32[] parameter(0), ...)``), which become instructions
  of their own named ``<opcode>.anon``, ``<opcode>.anon.1``, ... as XLA names
  them.  A called computation may be written inline (``to_apply={ ... }``,
  ``branch_computations={{ ... }, { ... }}``); it is then named
  ``<instruction>.<key>`` (``.<key>.<i>`` in a list).  Both nest by recursion,
  at most 64 deep;
* ``/* ... */`` comments anywhere (also across lines and before the header),
  ``//`` comments to the end of a line, and ``#`` comment lines;
* ``\\n``, ``\\r\\n`` or ``\\r`` line ends.

Text without an ``HloModule`` header is accepted when it holds computations, so
that snippets cut out of dumps can be read; the module is then named ``""``.  A
lone instruction (which XLA's ``ParseAndReturnUnverifiedModule`` wraps in a
module of its own) is not a module here.
Malformed input raises :class:`HloParseError` (a ``ValueError``) with the line
number and a snippet, and never any other exception type.  Element types with
absurd widths (``f5000000000000[1]``) are malformed; unknown but plausible ones
(a newer XLA's float formats) are accepted.  As in XLA, each instruction name is
defined once per computation and every operand names an instruction defined
earlier in the same computation; a duplicate name, a use before definition (or
a cycle) and an operand defined nowhere are parse errors, so the call graph never
has to guess which definition an operand means.  :func:`program_kind` tells HLO text
from StableHLO text by its first token.

Shapes are kept as text in XLA's printed form: comments and white space dropped,
one space after each comma between tuple elements (``(f32[2]{0}, s32[])``).

The reader runs in time and memory linear in the text, and is split by idea:
:mod:`.hlo_lexis` (patterns and the readers of strings and shapes), :mod:`.hlo_model` (the parsed
module and :class:`HloParseError`), :mod:`.hlo_items` (the tokenising reader: position, errors,
headers, computations), :mod:`.hlo_instructions` (one instruction and its attributes) and
:mod:`.hlo_parser` (the quick scan of whole chunks and the line-by-line driver). This module holds
the entry points: :func:`parse_hlo`, :func:`program_kind` and :func:`stablehlo_frontend_attributes`.
"""

from __future__ import annotations

import gc
import re
from typing import Literal

from .hlo_items import Restart
from .hlo_lexis import INSTRUCTION_START, LINE_END, QUOTED, SKIP, intern, snippet
from .hlo_model import HloComputation, HloInstruction, HloModule, HloParseError
from .hlo_parser import Parser

__all__ = [
    "MAX_ATTRIBUTE_CHARS",
    "HloComputation",
    "HloInstruction",
    "HloModule",
    "HloParseError",
    "parse_hlo",
    "program_kind",
    "stablehlo_frontend_attributes",
]

#: Longest ``frontend_attributes={...}`` text of one instruction. Ours hold a label (~60
#: characters) and at most one call description (at most 1 MiB, ``core.calls``); anything
#: longer is not a program we wrote or read, and is refused before it is split into pairs.
MAX_ATTRIBUTE_CHARS = 4 << 20


def parse_hlo(text: str) -> HloModule:
    """Parse HLO module text (``as_hlo_text()``, compiled ``as_text()``, or XLA dump files).

    Raises :class:`HloParseError` for malformed text, and no other exception type:
    unexpected internal failures are reported as ``HloParseError`` on the current line.
    """
    if isinstance(text, (bytes, bytearray, memoryview)):
        text = bytes(text).decode("utf-8", "replace")
    if not isinstance(text, str):
        raise HloParseError(f"expected HLO text as str, got {type(text).__name__}", 0, "")
    if not text.strip():
        raise HloParseError("empty HLO text", 0, "")
    parser = Parser(text, MAX_ATTRIBUTE_CHARS)
    # The parse allocates one object graph without reference cycles; letting the
    # cycle collector walk it again and again while it grows costs a good share of the time
    # (bench/bench_analysis.py times the parse).
    collecting = gc.isenabled()
    gc.disable()
    try:
        try:
            return parser.run_quick()
        except Restart:
            parser = Parser(text, MAX_ATTRIBUTE_CHARS)
            return parser.run_lines()
    except HloParseError:
        raise
    except Exception as exc:  # noqa: BLE001 - the contract is "HloParseError or a module"
        try:
            detail = f"{type(exc).__name__}: {exc}"
        except Exception:  # noqa: BLE001 - an exception whose str() fails must not escape either
            detail = type(exc).__name__
        try:
            where, line = parser.lineno, snippet(parser.line, None)
        except Exception:  # noqa: BLE001 - the position itself must not fail the report
            where, line = 0, ""
        raise HloParseError(f"cannot parse HLO ({detail})", where, line) from exc
    finally:
        if collecting:
            gc.enable()


# ---------------------------------------------------------------------------
# Telling HLO from StableHLO.

_MLIR_ALIAS = re.compile(r"#(?:loc|[A-Za-z_][\w.$\-]*+[ \t]*+=)")
_MLIR_MODULE = re.compile(r"module(?=[\s@{/])")


def program_kind(text: str) -> Literal["hlo", "stablehlo"]:
    """Whether ``text`` is HLO or StableHLO (MLIR) text, decided by its first meaningful token.

    After white space and comments: ``module``, ``func.func`` or an MLIR alias
    (``#loc...``, ``#name = ...``) start StableHLO; anything else (``HloModule``,
    ``ENTRY``, a computation) is HLO.  What the text mentions further on (a
    ``stablehlo.`` op name in a comment or a string, say) does not matter.
    ``module {`` is StableHLO unless an HLO instruction follows the brace (a
    computation that happens to be named ``module``).
    """
    if isinstance(text, (bytes, bytearray, memoryview)):
        text = bytes(text).decode("utf-8", "replace")
    if not isinstance(text, str):
        return "hlo"
    pos = 0
    n = len(text)
    while True:
        pos = SKIP.match(text, pos).end()  # type: ignore[union-attr]  # matches empty
        if not text.startswith("#", pos):
            break
        if _MLIR_ALIAS.match(text, pos):
            return "stablehlo"
        # A "#" comment line (this reader takes them in HLO text).
        line_end = LINE_END.search(text, pos)
        pos = n if line_end is None else line_end.start()
    if text.startswith(("func.func", '"func.func"', '"builtin.module"', "builtin.module"), pos):
        return "stablehlo"
    module = _MLIR_MODULE.match(text, pos)
    if module is None:
        return "hlo"
    after = SKIP.match(text, module.end()).end()  # type: ignore[union-attr]
    if text.startswith("{", after):
        inside = SKIP.match(text, after + 1).end()  # type: ignore[union-attr]
        if INSTRUCTION_START.match(text, inside):
            return "hlo"
        return "stablehlo"
    # "module @name", "module attributes {...}": MLIR; "module (p: f32[]) -> ..." an HLO computation.
    return "hlo" if text.startswith(("(", "->"), after) else "stablehlo"


# ---------------------------------------------------------------------------
# StableHLO.

_MLIR_FRONTEND_ATTRS = re.compile(
    r"mhlo\.frontend_attributes\s*=\s*\{((?:[^{}\"]++|" + QUOTED + r")*+)\}"
)
# The lookbehind keeps findall from re-reading a key (or an escaped quote's string) from each of its characters.
_MLIR_KV = re.compile(r"(?<![\w.$\-\\])([\w.$\-]++|" + QUOTED + r")\s*+=\s*+(" + QUOTED + r")")
_MLIR_ESCAPE = re.compile(rb"\\([0-9A-Fa-f]{2}|.)", re.S)
_MLIR_SIMPLE = {b"n": b"\n", b"t": b"\t", b"\\": b"\\", b'"': b'"'}


def _mlir_escape_byte(match: re.Match[bytes]) -> bytes:
    code = match.group(1)
    if len(code) == 2:
        return bytes([int(code, 16)])
    return _MLIR_SIMPLE.get(code, b"\\" + code)


def _mlir_unquote(value: str) -> str:
    """Strip quotes from an MLIR string and undo its escapes (``\\XX`` is a hex byte)."""
    value = value[1:-1] if len(value) >= 2 and value[0] == '"' and value[-1] == '"' else value
    if "\\" not in value:
        return value
    raw = value.encode("utf-8", "surrogatepass")
    return _MLIR_ESCAPE.sub(_mlir_escape_byte, raw).decode("utf-8", "replace")


def stablehlo_frontend_attributes(text: str) -> list[dict[str, str]]:
    """The ``mhlo.frontend_attributes`` dictionaries of StableHLO text, in text order.

    One dict per attribute occurrence (one per op that carries it, including ops
    with regions and function attributes); string values only.  This is a light
    scan, not an MLIR parser: text that is not StableHLO yields ``[]``, never an error.
    """
    if not isinstance(text, str):
        return []
    result: list[dict[str, str]] = []
    for found in _MLIR_FRONTEND_ATTRS.finditer(text):
        attrs: dict[str, str] = {}
        for key, value in _MLIR_KV.findall(found.group(1)):
            attrs[intern(_mlir_unquote(key))] = intern(_mlir_unquote(value))
        result.append(attrs)
    return result
