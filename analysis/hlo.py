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

The reader runs in time and memory linear in the text (no pattern re-reads a run
of characters from each of its positions: they are possessive, and those that may
be searched start behind a lookbehind).  The common instruction line (plain
operand names, simple attributes, frontend attributes and metadata) is read by one
regular expression applied to whole chunks of the text, one row per line.  Any
other line is handed to the tokenising reader (:meth:`_Parser.slow_from`), which
first tries a wider one-line pattern (``_FAST_LINE``: untyped operands, nested
JSON configs) and otherwise reads token by token the items that start on that
line, however many lines they take; it hands back the position of the next line,
where the chunk scan resumes (with a small chunk after a multi-line item, doubling
again, so that text scanned twice stays within a small factor of the text read).
Lines the chunk pattern reads are complete: it admits no unclosed bracket, string
or comment, and an instruction that goes on with a ``,`` on a later line sends the
whole text to the tokenising reader alone (``run_lines``), which reads the same
module, only slower.
Metadata is kept as its raw text and read on first access of
``op_name``/``source_file``/``source_line``; repeated strings are interned or
shared, and instructions without attributes share one empty mapping.
"""

from __future__ import annotations

import gc
import re
import sys
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Literal

__all__ = [
    "HloComputation",
    "HloInstruction",
    "HloModule",
    "HloParseError",
    "parse_hlo",
    "program_kind",
    "stablehlo_frontend_attributes",
]

_intern: Callable[[str], str] = sys.intern

# One shared, read-only mapping for the (vast majority of) instructions that carry
# no frontend attributes: a dict per instruction would cost ~64 bytes each.
_EMPTY_ATTRS: Mapping[str, str] = MappingProxyType({})
_NO_NAMES: tuple[str, ...] = ()

# Numbers longer than this are not converted: int() refuses very long digit
# strings, and no line number, id or trip count is that long in a real program.
_MAX_INT_DIGITS = 18

# Instructions written in place of operands and inline computations nest by
# recursion; deeper text is refused rather than let Python's stack run out.
_MAX_DEPTH = 64

#: Longest ``frontend_attributes={...}`` text of one instruction. Ours hold a label (~60
#: characters) and at most one call description (at most 1 MiB, ``core.calls``); anything
#: longer is not a program we wrote or read, and is refused before it is split into pairs.
MAX_ATTRIBUTE_CHARS = 4 << 20




class HloParseError(ValueError):
    """Raised for text that cannot be read as HLO.

    ``line`` is the 1-based line number (0 when the problem is not tied to a line)
    and ``snippet`` the offending line, shortened around ``column`` when long.
    """

    def __init__(self, message: str, line: int, snippet: str, column: int | None = None) -> None:
        super().__init__(message, line, snippet, column)
        self.message = message
        self.line = line
        self.snippet = snippet
        self.column = column

    def __str__(self) -> str:
        where = f"line {self.line}" if self.column is None else f"line {self.line}, column {self.column + 1}"
        return f"{self.message} ({where}): {self.snippet!r}"


class _Frames:
    """The module's ``FileNames`` / ``FileLocations`` / ``StackFrames`` tables, shared by its instructions."""

    __slots__ = ("file_names", "file_locations", "stack_frames", "cache")

    def __init__(self) -> None:
        self.file_names: dict[str, str] = {}
        self.file_locations: dict[str, tuple[str, int | None]] = {}
        self.stack_frames: dict[str, str] = {}
        self.cache: dict[str, tuple[str | None, int | None]] = {}

    def copy(self) -> _Frames:
        other = _Frames()
        other.file_names = dict(self.file_names)
        other.file_locations = dict(self.file_locations)
        other.stack_frames = dict(self.stack_frames)
        return other

    def adopt(self, other: _Frames) -> None:
        """Take ``other``'s tables (for instructions read before the tables were)."""
        self.file_names = other.file_names
        self.file_locations = other.file_locations
        self.stack_frames = other.stack_frames
        self.cache = {}

    def resolve(self, frame_id: str) -> tuple[str | None, int | None]:
        """Source file and line of a stack frame's innermost location ((None, None) when unknown)."""
        cached = self.cache.get(frame_id)
        if cached is None:
            location = self.file_locations.get(self.stack_frames.get(frame_id, ""))
            if location is None:
                cached = (None, None)
            else:
                file_name = self.file_names.get(location[0])
                cached = (None if file_name is None else _intern(file_name), location[1])
            self.cache[frame_id] = cached
        return cached


def _read_metadata(value: str) -> tuple[str | None, str | None, int | None, str | None]:
    """``op_name``, ``source_file``, ``source_line`` and ``stack_frame_id`` of a metadata text (never raises)."""
    fields = dict(_KV.findall(value))
    op_name = fields.get("op_name")
    source_file = fields.get("source_file")
    return (
        None if op_name is None else _intern(_unquote(op_name)),
        None if source_file is None else _intern(_unquote(source_file)),
        _small_int(fields.get("source_line", "")),
        fields.get("stack_frame_id"),
    )


_NO_LOCATION = (None, None, None)


@dataclass(slots=True, eq=False)
class HloInstruction:
    """One instruction (its text may run over several lines).

    ``operands`` and ``called_computations`` are names without the ``%`` sigil;
    ``computation`` is the name of the computation the instruction belongs to.
    ``shape`` is the shape as XLA prints it, ``""`` where the text leaves it out.
    ``frontend_attributes`` maps keys to string values (unquoted) or, for brace
    values, their text.
    ``backend_config`` is the raw attribute text (JSON or a quoted string).
    ``metadata`` is the raw text of the ``metadata={...}`` attribute; it is read on
    first access of ``op_name``, ``source_file`` or ``source_line``, which come
    from it either directly or through the module's ``StackFrames`` tables
    (innermost frame).
    """

    name: str
    opcode: str
    shape: str
    operands: tuple[str, ...]
    computation: str
    called_computations: tuple[str, ...] = _NO_NAMES
    is_root: bool = False
    custom_call_target: str | None = None
    frontend_attributes: Mapping[str, str] = field(default_factory=lambda: _EMPTY_ATTRS)
    backend_config: str | None = None
    known_trip_count: int | None = None
    metadata: str | None = None
    _frames: _Frames | None = field(default=None, repr=False)
    _location: tuple[str | None, str | None, int | None] | None = field(default=None, repr=False)

    def _located(self) -> tuple[str | None, str | None, int | None]:
        location = self._location
        if location is None:
            if self.metadata is None:
                location = _NO_LOCATION
            else:
                op_name, source_file, source_line, frame = _read_metadata(self.metadata)
                if frame is not None and self._frames is not None:
                    source_file, source_line = self._frames.resolve(frame)
                location = (op_name, source_file, source_line)
            self._location = location
        return location

    @property
    def op_name(self) -> str | None:
        """``op_name`` of the metadata."""
        return self._located()[0]

    @property
    def source_file(self) -> str | None:
        """Source file of the metadata (through ``StackFrames`` when it names a frame)."""
        return self._located()[1]

    @property
    def source_line(self) -> int | None:
        """Source line of the metadata (through ``StackFrames`` when it names a frame)."""
        return self._located()[2]


@dataclass(slots=True, eq=False)
class HloComputation:
    """A named list of instructions; ``root`` names its result instruction."""

    name: str
    is_entry: bool
    instructions: list[HloInstruction]
    root: str | None
    line: int = 0
    _index: dict[str, HloInstruction] | None = field(default=None, repr=False)

    @property
    def root_instruction(self) -> HloInstruction | None:
        """The instruction named by ``root``, if any."""
        return None if self.root is None else self.instruction(self.root)

    def instruction(self, name: str) -> HloInstruction | None:
        """Look an instruction up by name (``%`` optional); the index is built on first use."""
        if self._index is None:
            # Built lazily: most callers only iterate, and the index costs a dict entry per instruction.
            self._index = {instr.name: instr for instr in self.instructions}
        return self._index.get(name.lstrip("%"))


@dataclass(slots=True, eq=False)
class HloModule:
    """A parsed module: computations by name (in text order) and the entry's name."""

    name: str
    computations: dict[str, HloComputation]
    entry: str
    _callers: dict[str, list[HloInstruction]] | None = field(default=None, repr=False)

    @property
    def entry_computation(self) -> HloComputation:
        """The computation the program starts in."""
        return self.computations[self.entry]

    def instructions(self) -> Iterator[HloInstruction]:
        """All instructions, computation by computation, in text order."""
        for computation in self.computations.values():
            yield from computation.instructions

    def instruction_count(self) -> int:
        """Number of instructions in all computations."""
        return sum(len(c.instructions) for c in self.computations.values())

    def computation_of(self, instr: HloInstruction) -> HloComputation:
        """The computation that holds ``instr``."""
        return self.computations[instr.computation]

    def callers(self) -> dict[str, list[HloInstruction]]:
        """Map each called computation's name to the instructions that call it.

        Computations nobody calls (the entry, usually) are absent.  Built once and
        cached; treat the result as read-only.
        """
        if self._callers is None:
            callers: dict[str, list[HloInstruction]] = {}
            for instr in self.instructions():
                for callee in instr.called_computations:
                    callers.setdefault(callee, []).append(instr)
            self._callers = callers
        return self._callers

    def callers_of(self, computation: str) -> list[HloInstruction]:
        """The instructions that call ``computation`` (empty when none)."""
        return self.callers().get(computation.lstrip("%"), [])

    def with_attribute(self, key: str) -> Iterator[HloInstruction]:
        """Instructions whose frontend attributes hold ``key`` (e.g. ``"ejlabel"``)."""
        for instr in self.instructions():
            if key in instr.frontend_attributes:
                yield instr


# ---------------------------------------------------------------------------
# Lexical pieces.  Possessive quantifiers keep failing matches linear; patterns
# applied with search/findall start with a literal or guard their first run with
# a lookbehind, so that a scan does not re-read a long run from each of its
# characters.

_QUOTED = r'"(?:[^"\\]++|\\(?s:.))*+"'
# The rest of a string after its opening quote (which the lookbehind demands: a scan
# then starts no second read of a string inside the first).
_QUOTED_TAIL = re.compile(r'(?<=(?<!\\)")(?:[^"\\]++|\\(?s:.))*+"')
# Characters of a name: no white space, no punctuation of the grammar; no "/" either,
# which would start a comment.
_NAME_CHARS = r"[^\s=(){}\[\],\"%/]"
# Not within a name: patterns that start with a name begin only where one can.
_NAME_START = r"(?<![^\s=(){}\[\],\"%/])"
# An element type: letters, a width of at most three digits, then the rest of a
# float format's name (f8e4m3fn).  Longer widths are no XLA type.
_DTYPE = r"[A-Za-z]++(?:[0-9]{1,3}+(?:[A-Za-z][A-Za-z0-9]*+)?)?"
# An array shape in XLA's printed form (no white space, no comment).
_ARRAY = _DTYPE + r"\[[^\[\]\s/]*+\](?:\{[^{}\s/]*+\})?"
# Shapes as the whole-line patterns take them: loose (the element type, spaces and
# comments are checked once per distinct shape text, see ``_Parser.shape_of``),
# no nested tuple.  Other shapes take the tokenising reader.
_LOOSE_SHAPE = r"[A-Za-z][A-Za-z0-9]*\[[^\[\]]*\](?:\{[^{}]*\})?|\((?:[^(){}]++|\{[^{}]*\})*+\)"
# Brace groups nested up to four deep (backend configs' JSON, shardings), quote-aware.
# No "/" outside strings: it could start a comment.
_BRACES = r"\{(?:[^{}\"/]++|" + _QUOTED + r")*+\}"
for _ in range(3):
    _BRACES = r"\{(?:[^{}\"/]++|" + _QUOTED + "|" + _BRACES + r")*+\}"
# An attribute value: quoted, a brace group, or bare.
_VALUE = _QUOTED + "|" + _BRACES + r"|[^\s,{}()\[\]\"/]++"
_ATTR_PAIR = re.compile(r",[ \t]*+([\w.\-]++)[ \t]*+=[ \t]*+(" + _VALUE + r")")
_GENERIC = r"((?:, (?!frontend_attributes=|metadata=|backend_config=)[\w.\-]+=(?:" + _VALUE + r"))*+)"
# The common instruction line in one match, attributes in the order XLA prints
# them: opcode-specific ones, frontend_attributes, metadata, backend_config, rest.
# Exactly ", " between attributes; any other line takes the tokenising reader.
_FAST_LINE = re.compile(
    r"(?<![^\n])[ \t]*(ROOT[ \t]+)?%?(" + _NAME_CHARS + r"+) = "
    r"(" + _LOOSE_SHAPE + r")"
    r" ([A-Za-z][\w\-]*)\(((?:%?" + _NAME_CHARS + r"++(?:, ?%?" + _NAME_CHARS + r"++)*+)?)\)"
    + _GENERIC
    + r"(?:, frontend_attributes=(\{(?:[^{}\"/]++|" + _QUOTED + r")*+\}))?"
    r"(?:, metadata=(\{(?:[^{}\"/]++|" + _QUOTED + r")*+\}))?"
    r"(?:, backend_config=(" + _QUOTED + "|" + _BRACES + r"))?"
    + _GENERIC
    + r"[ \t\r]*"
)
# The most common line again, narrower, for a scan of the whole text (see
# ``_QUICK_SCAN``): operands are plain names, all with ``%`` or all without;
# strings hold no escapes; no backend_config and nothing after the metadata.
# Every line it matches, ``_FAST_LINE`` matches with the same groups, and no
# character class crosses a line break.
# ``\s`` spelled out (the same characters): a class of plain characters is one
# table lookup per character, where ``\s`` in a class costs a test of its own.
_Q_SPACE = "\\t\\n\\x0b\\x0c\\r\\x1c-\\x20\\x85\\xa0\\u1680\\u2000-\\u200a\\u2028\\u2029\\u202f\\u205f\\u3000"
_Q_NAME = "[^" + _Q_SPACE + r"=(){}\[\],\"%/]+"
_Q_OPERAND = "[^" + _Q_SPACE + r"=(){}\[\],\"%/]+"
_Q_STRING = r'"[^"\\\n]*+"'
_Q_BRACES = r'\{[^{}"\n/]*+(?:' + _Q_STRING + r'[^{}"\n/]*+)*+\}'
_Q_VALUE = _Q_STRING + r'|\{[^{}"\n/]*+\}|[^' + _Q_SPACE + r',{}()\[\]"/]++'
# ``[\w\-]*`` (opcodes) as an ASCII run first: the same strings, fewer tests per character.
_Q_WORD_DASH = r"[A-Za-z0-9_\-]*+(?:[\w\-][A-Za-z0-9_\-]*+)*+"
_QUICK_LINE = (
    r"[ \t]*(ROOT[ \t]+)?%?(" + _Q_NAME + r") = "
    r"([A-Za-z][A-Za-z0-9]*\[[^\[\]\n]*\](?:\{[^{}\n]*\})?|\((?:[^(){}\n]++|\{[^{}\n]*\})*+\))"
    r" ([A-Za-z]" + _Q_WORD_DASH + r")\("
    r"(?:%(" + _Q_OPERAND + r"(?:, %" + _Q_OPERAND + r")*+)|(" + _Q_OPERAND + r"(?:, " + _Q_OPERAND + r")*+))?\)"
    r"((?:, (?!frontend_attributes=|metadata=|backend_config=)[\w.\-]+=(?:" + _Q_VALUE + r"))*+)"
    r"(?:, frontend_attributes=(" + _Q_BRACES + r"))?"
    r"(?:, metadata=(" + _Q_BRACES + r"))?"
    r"[ \t\r]*"
)
# One row per line of the text: the quick line's groups, or the whole line as the last group.
_QUICK_SCAN = re.compile(r"^(?:" + _QUICK_LINE + r"$|(.*))$", re.MULTILINE)
_CALL_KEY = re.compile(
    r"(?:calls|to_apply|body|condition|branch_computations|true_computation|false_computation"
    r"|called_computations|select|scatter|custom_call_target)="
)
_NAMES = re.compile(r"[^\s,{}%]+")
_KV = re.compile(r"(?<![\w.\-])([\w.\-]++)[ \t]*+=[ \t]*+(" + _QUOTED + r"|[^\s,{}\"]*+)")
_TRIP_COUNT = re.compile(r'known_trip_count\\*"\s*:\s*\{\s*\\*"n\\*"\s*:\s*\\*"?(\d+)')
_SECTION_TITLE = re.compile(r"[A-Z][A-Za-z]*")
# The id that starts a row of a header section ("1 {file_name_id=1 ...}").
_ROW_KEY = re.compile(r"(?<![\w.\-])\d++(?=[ \t])")
# A dimension width no element type has (f5000000000000[1]): malformed text.
_ABSURD_WIDTH = re.compile(r"(?<![A-Za-z0-9_])[A-Za-z]++[0-9]{4}")

# -- tokens of the tokenising reader (all applied with match at a position) --
# White space and comments; the horizontal form stops at a line break (but reads a
# /* */ comment to its end, wherever that is).  An unclosed comment runs to the end
# of the text (group 2 is then empty, group 1 its "/*"): a scan never re-reads it.
# The outer loop is greedy, not possessive: Python 3.11 misreports groups inside a
# possessive loop; its branches start differently, so it never backtracks anyway.
_SKIP = re.compile(r"(?:[ \t\r\n\f\v]++|(/\*)(?:[^*]++|\*(?!/))*+(\*/|\Z)|//[^\r\n]*+)*")
_HSKIP = re.compile(r"(?:[ \t\r\f\v]++|(/\*)(?:[^*]++|\*(?!/))*+(\*/|\Z)|//[^\r\n]*+)*")
_HSPACE = re.compile(r"[ \t]*+")
_NAME_TOKEN = re.compile(r"%?(" + _NAME_CHARS + r"++)")
_WORD = re.compile(r"[A-Za-z][\w\-]*+")
_ROOT_KW = re.compile(r"ROOT(?=[\s%/])")
_ENTRY_KW = re.compile(r"ENTRY(?=[\s%/])")
_MODULE_KW = re.compile(r"HloModule(?=[\s%/]|\Z)")
_MODULE_NAME = re.compile(r"%?([^\s,/=(){}\[\]\"]++)")
_ATTR_KEY = re.compile(r"[\w.\-]++")
# Instruction head with a shape in printed form (or none) and a plain opcode.
_HEAD = re.compile(
    _NAME_START + r"(ROOT[ \t]+)?%?(" + _NAME_CHARS + r"++)[ \t]*+=[ \t]*+(?:(" + _ARRAY + r")[ \t]+)?([A-Za-z][\w\-]*+)\("
)
# Operand lists of plain names (over lines, too) and single typed operands.
_NAME_LIST = re.compile(
    r"\(\s*+((?:%?" + _NAME_CHARS + r"++\s*+,\s*+)*+%?" + _NAME_CHARS + r"++)?\s*+\)"
)
# A one-line list of operands, typed or not ("f32[2]{0} %a, %b"); the names in one.
_OPERAND = r"(?:" + _ARRAY + r" )?%?" + _NAME_CHARS + r"++"
_OPERAND_LIST = re.compile(r"\((?:" + _OPERAND + r"(?:, " + _OPERAND + r")*+)?\)")
_LISTED_NAME = re.compile(r"(?<=[(,])[ ]?(?:" + _ARRAY + r" )?%?(" + _NAME_CHARS + r"++)")
_TYPED_OPERAND = re.compile(_NAME_START + r"(?:(" + _ARRAY + r")[ \t]+)?%?(" + _NAME_CHARS + r"++)[ \t]*+(?=[,)])")
# ", key=value" with a simple value that ends its line or is followed by another attribute.
_ATTR_FAST = re.compile(r"(?<![ \t])[ \t]*+,[ \t]*+([\w.\-]++)=(" + _VALUE + r")(?=[ \t\r]*+(?:[,\n]|\Z))")
# A bare piece of an attribute value; "=" only in "<=" (replica groups such as [2,4]<=[8]).
_BARE = re.compile(r"(?:[^\s,(){}\[\]\"/=<]++|<=?|/(?![/*]))++")
_ASSIGN = re.compile(r"(?<![ \t])[ \t]*+=(?!=)")
_INSTRUCTION_START = re.compile(_NAME_START + r"(?:ROOT\s++)?%?" + _NAME_CHARS + r"++\s*+=(?!=)")
_GROUP_SPECIAL = re.compile(r'[(){}\[\]"/]')
# Inside a bracket group: plain text and whole strings up to the next bracket or "/"
# (a string's quote must not follow a backslash, so a scan starts no string inside one).
_GROUP_RUN = re.compile(r'(?:[^(){}\[\]"/]++|(?<!\\)"(?:[^"\\]++|\\(?s:.))*+")*+')
_STRING_OR_SLASH = re.compile(r'["/]')
_LINE_END = re.compile(r"[\r\n]")
_SPACE_RUN = re.compile(r"\s++")
_SHAPE_PUNCT = re.compile(r"[(),\[\]{}]")
_FRONTEND_SEPARATOR = re.compile(r"[\s,]*+")
_FRONTEND_KEY = re.compile(r"(?<![^\s=,{}\"])([^\s=,{}\"]++)[ \t]*+=[ \t]*+")
_FRONTEND_BARE = re.compile(r"[^\s,{}\"]++")

_CLOSER = {"(": ")", "[": "]", "{": "}"}
# First characters of white space or a comment: anything else is a token already.
_SKIPPABLE = frozenset({" ", "\t", "\r", "\n", "\f", "\v", "/"})

# Opcodes whose parentheses hold a literal, not operand names.
_LITERAL_OPCODES = frozenset({"constant", "parameter"})
# Attributes whose value names called computations.
_CALL_KEYS = frozenset(
    {
        "calls",
        "to_apply",
        "body",
        "condition",
        "branch_computations",
        "true_computation",
        "false_computation",
        "called_computations",
        "select",
        "scatter",
    }
)

_C_ESCAPE = re.compile(rb"\\(x[0-9A-Fa-f]{1,2}|[0-7]{1,3}|.)", re.S)
_C_SIMPLE = {
    b"n": b"\n",
    b"t": b"\t",
    b"r": b"\r",
    b"a": b"\a",
    b"b": b"\b",
    b"f": b"\f",
    b"v": b"\v",
    b"\\": b"\\",
    b'"': b'"',
    b"'": b"'",
    b"?": b"?",
}


def _c_escape_byte(match: re.Match[bytes]) -> bytes:
    code = match.group(1)
    if code[:1] == b"x":
        return bytes([int(code[1:], 16)])
    if code[:1] in b"01234567" and code[:1]:
        return bytes([int(code, 8) & 0xFF])
    return _C_SIMPLE.get(code, b"\\" + code)


def _unquote(value: str) -> str:
    """Strip quotes from an HLO string value and undo its C escapes (never raises)."""
    if len(value) >= 2 and value[0] == '"' and value[-1] == '"':
        value = value[1:-1]
    if "\\" not in value:
        return value
    # Escapes denote bytes (octal escapes of UTF-8, say), so decode after unescaping.
    raw = value.encode("utf-8", "surrogatepass")
    return _C_ESCAPE.sub(_c_escape_byte, raw).decode("utf-8", "replace")


def _small_int(digits: str) -> int | None:
    digits = digits.strip()
    if not digits or len(digits) > _MAX_INT_DIGITS or not digits.isdigit() or not digits.isascii():
        return None
    return int(digits)


def _snippet(line: str, column: int | None, width: int = 160) -> str:
    if len(line) <= width:
        return line
    start = 0 if column is None else max(0, min(column - width // 2, len(line) - width))
    return ("..." if start else "") + line[start : start + width] + ("..." if start + width < len(line) else "")



def _strip_comments(value: str) -> str:
    """``value`` without its ``/* */`` and ``//`` comments (quote-aware; never raises)."""
    if "/" not in value:
        return value
    pieces: list[str] = []
    last = index = 0
    length = len(value)
    find = _STRING_OR_SLASH.search
    while True:
        found = find(value, index)
        if found is None:
            break
        at = found.start()
        if value[at] == '"':
            tail = _QUOTED_TAIL.match(value, at + 1)
            if tail is None:
                break
            index = tail.end()
            continue
        follower = value[at + 1 : at + 2]
        if follower == "*":
            close = value.find("*/", at + 2)
            stop = length if close < 0 else close + 2
        elif follower == "/":
            line_end = _LINE_END.search(value, at)
            stop = length if line_end is None else line_end.start()
        else:
            index = at + 1
            continue
        pieces.append(value[last:at])
        last = index = stop
    pieces.append(value[last:])
    return "".join(pieces)


def _canonical_shape(raw: str) -> str:
    """A shape's text as XLA prints it: no comments or white space, ", " between tuple elements."""
    if "/" in raw:
        raw = _strip_comments(raw)
    compact = _SPACE_RUN.sub("", raw) if _SPACE_RUN.search(raw) else raw
    if "," not in compact or "(" not in compact:
        return compact
    # Only commas directly inside a tuple's parentheses get a space: not those of
    # dimensions, layouts or tiles (T(8,128)), whose "(" follows a letter or ")".
    pieces: list[str] = []
    tuple_depth: list[bool] = []
    last = 0
    for found in _SHAPE_PUNCT.finditer(compact):
        char = found.group()
        at = found.start()
        if char == "(":
            before = compact[at - 1] if at else ","
            inside_tuple = not tuple_depth or tuple_depth[-1]
            tuple_depth.append(inside_tuple and before in "(,")
        elif char in "[{":
            tuple_depth.append(False)
        elif char in ")]}":
            if tuple_depth:
                tuple_depth.pop()
        elif tuple_depth and tuple_depth[-1]:
            pieces.append(compact[last : at + 1])
            pieces.append(" ")
            last = at + 1
    if not pieces:
        return compact
    pieces.append(compact[last:])
    return "".join(pieces)


def _shape_ok(shape: str) -> bool:
    """False for a shape whose element type has an absurd width (``f5000000000000[1]``)."""
    return _ABSURD_WIDTH.search(shape) is None


def _comments_closed(raw: str) -> bool:
    """Whether every "/" of a shape text belongs to a ``/* */`` comment closed within it.

    The whole-line patterns take shapes loosely; a "//" or an open "/*" in one means
    the line goes on beyond what they read.
    """
    index = raw.find("/")
    while index >= 0:
        if not raw.startswith("/*", index):
            return False
        close = raw.find("*/", index + 2)
        if close < 0:
            return False
        index = raw.find("/", close + 2)
    return True


def _balanced_end(text: str, pos: int, stop: int) -> int:
    """Index just past the bracket group opening at ``text[pos]`` (quote-aware), or -1."""
    closers = [_CLOSER[text[pos]]]
    index = pos + 1
    search = _GROUP_SPECIAL.search
    while closers:
        found = search(text, index, stop)
        if found is None:
            return -1
        char = found.group()
        at = found.start()
        if char == '"':
            tail = _QUOTED_TAIL.match(text, at + 1, stop)
            if tail is None:
                return -1
            index = tail.end()
            continue
        if char in "([{":
            closers.append(_CLOSER[char])
        elif char == closers[-1]:
            closers.pop()
        elif char != "/":
            return -1
        index = at + 1
    return index


def _frontend_pairs(value: str) -> dict[str, str]:
    """The top-level ``key=value`` pairs of a ``frontend_attributes={...}`` text (never raises).

    String values are unquoted; brace values (``composite.attributes={n = 1 : i32}``)
    are kept as their text.
    """
    pairs: dict[str, str] = {}
    stop = len(value) - 1 if value.endswith("}") else len(value)
    index = 1 if value.startswith("{") else 0
    while index < stop:
        index = _FRONTEND_SEPARATOR.match(value, index, stop).end()  # type: ignore[union-attr]  # matches empty
        key = _FRONTEND_KEY.match(value, index, stop)
        if key is None:
            break
        start = key.end()
        char = value[start : start + 1] if start < stop else ""
        if char == '"':
            tail = _QUOTED_TAIL.match(value, start + 1, stop)
            if tail is None:
                break
            pairs[_intern(key.group(1))] = _intern(_unquote(value[start : tail.end()]))
            index = tail.end()
        elif char and char in "{[(":
            end = _balanced_end(value, start, stop)
            if end < 0:
                break
            pairs[_intern(key.group(1))] = _intern(value[start:end])
            index = end
        else:
            bare = _FRONTEND_BARE.match(value, start, stop)
            pairs[_intern(key.group(1))] = "" if bare is None else _intern(bare.group())
            index = start if bare is None else bare.end()
    return pairs



# ---------------------------------------------------------------------------
# The parser.


class _Restart(Exception):
    """The quick scan met text it leaves to the tokenising reader alone."""


# Characters per chunk of the quick scan: bounds the rows held at once.
_CHUNK_CHARS = 1 << 18
# Chunk size after an item that ran over several lines: the rows scanned past it
# are scanned again, so the next chunk starts small (a line or two) and doubles
# while none does; the text scanned twice stays within a small factor of the text read.
_RESCAN_CHARS = 1 << 8
# Distinct metadata (and other attribute) texts the quick scan keeps before it starts afresh.
_SHARED_TEXTS = 100_000


class _Parser:
    """Reads one text; ``where`` is the position errors of unexpected kinds are reported at.

    :meth:`run_quick` reads the common instruction line (``_QUICK_LINE``) straight
    from chunks of the text and hands every other line to :meth:`slow_from`, the
    tokenising reader; :meth:`run_lines` hands it every line.  Both build the
    same module, and the quick scan restarts as :meth:`run_lines` where only the
    tokenising reader knows what to report.
    """

    def __init__(self, text: str) -> None:
        self.text = text
        self.n = len(text)
        self.where = 0
        self.quick = False
        self.module_name: str | None = None
        self.computations: dict[str, HloComputation] = {}
        self.entry: str | None = None
        # The open computation and header section.
        self.comp_name: str | None = None
        self.comp_line = 0
        self.comp_pos = 0
        self.comp_entry = False
        self.instrs: list[HloInstruction] = []
        self.root: HloInstruction | None = None
        # Names of the open computation, collected only when an anonymous one is made.
        self.names: set[str] | None = None
        self.names_seen = 0
        self.anon_next: dict[str, int] = {}
        self.depth = 0
        # Line numbers are counted incrementally from the last position asked about.
        self.line_pos = 0
        self.line_no = 1
        self.comment_seen = False
        # StackFrames tables.  Instructions read while they are empty resolve their
        # frames through ``late``, which takes the final tables at the end; tables
        # handed to instructions are copied before a later row changes them.
        self.frames = _Frames()
        self.frames_shared = False
        self.late = _Frames()
        self.frames_ref = self.late
        # Identical attribute texts repeat a lot (labels); parse each once.
        self.attrs_cache: dict[str, Mapping[str, str]] = {}
        # Shape text as written -> its printed, interned form (checked once per distinct text).
        self.shapes: dict[str, str] = {}

    # -- positions and errors ----------------------------------------------

    def line_at(self, pos: int) -> int:
        """1-based line number of ``pos`` (incremental: linear over ascending positions)."""
        if pos >= self.line_pos:
            self.line_no += self.text.count("\n", self.line_pos, pos)
        else:
            self.line_no -= self.text.count("\n", pos, self.line_pos)
        self.line_pos = pos
        return self.line_no

    def line_bounds(self, pos: int) -> tuple[int, int]:
        start = self.text.rfind("\n", 0, pos) + 1
        end = self.text.find("\n", pos)
        return start, (self.n if end < 0 else end)

    @property
    def lineno(self) -> int:
        """Line of ``where`` (for errors of unexpected kinds)."""
        return self.text.count("\n", 0, self.where) + 1

    @property
    def line(self) -> str:
        start, end = self.line_bounds(self.where)
        return self.text[start:end]

    def error(self, message: str, pos: int | None = None) -> HloParseError:
        if pos is None:
            pos = self.where
        pos = max(0, min(pos, self.n))
        start, end = self.line_bounds(pos)
        column = pos - start
        line = self.text[start:end]
        return HloParseError(message, self.text.count("\n", 0, pos) + 1, _snippet(line, column), column)

    # -- drivers -----------------------------------------------------------

    def run_quick(self) -> HloModule:
        self.quick = True
        text = self.text
        n = self.n
        pos = 0
        lineno = 0
        chunk = _CHUNK_CHARS
        scan = _QUICK_SCAN.findall
        find = text.find
        comp_name = self.comp_name
        append = self.instrs.append
        root = self.root
        frames_ref = self.frames_ref
        slow_from = self.slow_from
        make_tuple = tuple
        literal_opcodes = _LITERAL_OPCODES
        call_key = _CALL_KEY.search
        generic_attributes = self.generic_attributes
        frontend_attributes = self.frontend_attributes
        intern = _intern
        empty = _EMPTY_ATTRS
        no_names = _NO_NAMES
        make = HloInstruction
        shapes = self.shapes
        shape_get = shapes.get
        # Repeated metadata texts share one string, within a window of recent ones.
        seen: dict[str, str] = {}
        share = seen.setdefault
        attribute_cache: dict[str, tuple[tuple[str, ...], str | None]] = {}
        try:
            while pos <= n:
                stop = find("\n", pos + chunk)
                if stop < 0:
                    stop = n
                # Start of the first line not yet accounted for: other rows are found from here.
                known = pos
                resume = -1
                for is_root, name, shape, opcode, marked, bare, pre, frontend, metadata, other in scan(text, pos, stop):
                    lineno += 1
                    if name:
                        if comp_name is None:
                            raise _Restart
                        # The common line: this body runs once per instruction.
                        opcode = intern(opcode)
                        # Names and operands are not interned: they are looked up in large
                        # tables, which costs more than the memory they would share.
                        if marked:
                            operands = no_names if opcode in literal_opcodes else make_tuple(map(intern, marked.split(", %")))
                        elif bare:
                            operands = no_names if opcode in literal_opcodes else make_tuple(map(intern, bare.split(", ")))
                        else:
                            operands = no_names
                        if pre:
                            # Attribute texts such as "kind=kLoop, calls=%fused" repeat: read each once.
                            known_attrs = attribute_cache.get(pre)
                            if known_attrs is None:
                                known_attrs = generic_attributes(pre, None) if call_key(pre) else (no_names, None)
                                attribute_cache[pre] = known_attrs
                            called, target = known_attrs
                        else:
                            called = no_names
                            target = None
                        printed = shape_get(shape)
                        if printed is None:
                            if "/" in shape and not _comments_closed(shape):
                                raise _Restart
                            printed = _canonical_shape(shape)
                            if not _shape_ok(printed):
                                raise _Restart
                            printed = shapes[shape] = intern(printed)
                        instr = make(
                            intern(name),
                            opcode,
                            printed,
                            operands,
                            comp_name,
                            called,
                            True if is_root else False,
                            target,
                            frontend_attributes(frontend) if frontend else empty,
                            None,
                            None,
                            share(metadata, metadata) if metadata else None,
                            frames_ref,
                        )
                        append(instr)
                        if is_root:
                            root = instr
                        continue
                    head = other.lstrip()
                    if not head or head[0] == "#" or (head.startswith("//") and "\r" not in head.rstrip()):
                        # Blank and comment lines (complete: a "/*" comment is not on them, and
                        # a "\r" inside would end the comment, with text after it).
                        continue
                    at = self.locate(other, known)
                    self.root = root
                    end = slow_from(at, lineno)
                    comp_name = self.comp_name
                    append = self.instrs.append
                    root = self.root
                    frames_ref = self.frames_ref
                    known = at + len(other) + 1
                    if end > known:
                        # The item ran on past its line: the rows scanned beyond it are stale.
                        resume = end
                        break
                if resume >= 0:
                    if resume >= n:
                        lineno = text.count("\n") + 1
                        break
                    lineno = self.line_at(resume) - 1
                    pos = resume
                    chunk = _RESCAN_CHARS
                else:
                    pos = stop + 1
                    chunk = min(chunk * 2, _CHUNK_CHARS)
                if len(seen) > _SHARED_TEXTS:
                    seen.clear()
                if len(attribute_cache) > _SHARED_TEXTS:
                    attribute_cache.clear()
        except (HloParseError, _Restart):
            raise
        except Exception as exc:
            # The tokenising reader alone reports the line (or finds nothing wrong).
            raise _Restart from exc
        if lineno != text.count("\n") + 1:
            raise _Restart
        self.root = root
        return self.finish()

    def locate(self, line: str, known: int) -> int:
        """Offset of the first line equal to ``line`` at or after the line start ``known``.

        The rows between are quick lines, which no other row equals, or blank and
        comment lines, which are not looked up: so the first equal line is the row's own.
        """
        text = self.text
        end = known + len(line)
        if text.startswith(line, known) and (end == self.n or text[end] == "\n"):
            return known
        found = text.find("\n" + line + "\n", known)
        if found >= 0:
            return found + 1
        if text.endswith("\n" + line) and self.n - len(line) > known:
            return self.n - len(line)
        raise _Restart

    def run_lines(self) -> HloModule:
        self.quick = False
        pos = 0
        n = self.n
        slow_from = self.slow_from
        while pos < n:
            pos = slow_from(pos)
        return self.finish()

    def slow_from(self, pos: int, lineno: int | None = None) -> int:
        """Read the items that start on the line at ``pos`` (and the lines they run on to).

        Returns the start of the next line not read (``n`` at the end).  ``lineno``,
        when given, is the line number of ``pos``.
        """
        if lineno is not None:
            self.line_pos = pos
            self.line_no = lineno
        text = self.text
        n = self.n
        self.where = pos
        eol = text.find("\n", pos)
        if eol < 0:
            eol = n
        comp_name = self.comp_name
        if comp_name is not None:
            fast = _FAST_LINE.fullmatch(text, pos, eol)
            if fast is not None and "/" in fast.group(3) and not _comments_closed(fast.group(3)):
                fast = None
            if fast is not None and not self.continued(eol):
                self.add(self.fast_instruction(fast, comp_name, pos))
                return min(eol + 1, n)
        first = True
        while True:
            pos = self.skip(pos, _HSKIP)
            if pos >= n or text[pos] == "\n":
                return min(pos + 1, n)
            if first and text[pos] == "#":
                # "#" comment lines: a leftover of older dumps, not XLA's grammar.
                line_end = text.find("\n", pos)
                return n if line_end < 0 else line_end + 1
            first = False
            self.where = pos
            pos = self.item(pos)

    def skip(self, pos: int, skipper: re.Pattern[str] = _SKIP) -> int:
        """Position of the next token at or after ``pos`` (past white space and comments)."""
        if self.text[pos : pos + 1] not in _SKIPPABLE:
            return pos
        skipped = skipper.match(self.text, pos)
        assert skipped is not None  # the pattern matches the empty string
        if skipped.group(2) == "":
            raise self.error("unterminated comment", skipped.start(1))
        return skipped.end()

    def continued(self, pos: int) -> bool:
        """Whether the next token after ``pos`` is a "," that goes on with an attribute list."""
        pos = self.skip(pos)
        return self.text.startswith(",", pos)

    # -- items -------------------------------------------------------------

    def item(self, pos: int) -> int:
        """Read one item (instruction, "}", header, computation header, section title) at ``pos``."""
        if self.comp_name is None:
            return self.top_item(pos)
        char = self.text[pos]
        if char == "}":
            return self.close(pos)
        if char == ",":
            if self.quick:
                # An attribute list going on after a line the quick scan took as complete.
                raise _Restart
            raise self.error("unexpected ',' (no attribute list to go on with)", pos)
        return self.instruction(pos)

    def top_item(self, pos: int) -> int:
        text = self.text
        module = _MODULE_KW.match(text, pos)
        if module is not None:
            return self.module_header(pos, module.end())
        entry = _ENTRY_KW.match(text, pos)
        start = self.skip(entry.end()) if entry is not None else pos
        name = _NAME_TOKEN.match(text, start)
        if name is None:
            raise self.error("unexpected text outside of a computation", pos)
        after = self.skip(name.end())
        char = text[after : after + 1]
        if char == "{" or char == "(" or text.startswith("->", after):
            return self.computation_header(pos, entry is not None, name.group(1), after)
        if entry is None and name.group()[0] != "%" and _SECTION_TITLE.fullmatch(name.group(1)):
            # A header section: its title alone on its line, or followed by rows.
            end = self.skip(name.end(), _HSKIP)
            if end >= self.n or text[end] == "\n" or _ROW_KEY.match(text, after):
                return self.section(name.group(1), name.end())
        if char == "=" or _ROOT_KW.match(text, pos):
            raise self.error("instruction outside of a computation", pos)
        raise self.error("unexpected text outside of a computation", pos)

    def module_header(self, pos: int, end: int) -> int:
        if self.module_name is not None:
            raise self.error("second HloModule header (one module per text)", pos)
        start = self.skip(end)
        name = _MODULE_NAME.match(self.text, start)
        if name is None:
            raise self.error("malformed HloModule header", pos)
        module_name = name.group(1)
        # XLA's own tests write "HloModule name:"; the colon is no part of the name.
        if module_name.endswith(":") and len(module_name) > 1:
            module_name = module_name[:-1]
        self.module_name = _intern(module_name)
        _, end = self.attributes(name.end(), "")
        return end

    def computation_header(self, pos: int, is_entry: bool, name: str, after: int) -> int:
        text = self.text
        if text.startswith("(", after):
            after = self.skip(self.group_end(after))
        if text.startswith("->", after):
            after = self.skip(after + 2)
            end = self.shape_end(after)
            if end is None:
                raise self.error("malformed computation header (no result shape after '->')", pos)
            after = self.skip(end)
        if not text.startswith("{", after):
            raise self.error("malformed computation header", pos)
        self.open_computation(name, is_entry, pos)
        return after + 1

    def open_computation(self, name: str, is_entry: bool, pos: int) -> None:
        self.comp_name = _intern(name)
        self.comp_entry = is_entry
        self.comp_pos = pos
        self.comp_line = self.line_at(pos)
        self.instrs = []
        self.root = None
        self.names = None
        self.names_seen = 0
        self.anon_next = {}
        if self.frames.stack_frames:
            self.frames_ref = self.frames
            self.frames_shared = True
        else:
            self.frames_ref = self.late

    def close(self, pos: int) -> int:
        """The "}" that ends the open computation, and the computation's own attributes."""
        assert self.comp_name is not None
        self.close_computation(self.comp_name, self.comp_entry, self.instrs, self.root, self.comp_line)
        self.comp_name = None
        self.instrs = []
        self.root = None
        self.names = None
        # "}, execution_thread=..." attributes of the computation itself.
        _, end = self.attributes(pos + 1, "")
        return end

    def add(self, instr: HloInstruction) -> None:
        self.instrs.append(instr)
        if instr.is_root:
            self.root = instr

    def finish(self) -> HloModule:
        if self.comp_name is not None:
            raise HloParseError(f"computation {self.comp_name!r} is not closed (missing '}}')", self.comp_line, self.comp_name)
        if not self.computations:
            raise HloParseError("no computations found", 0, "")
        # Frames named before the StackFrames tables were read resolve through the final tables.
        self.late.adopt(self.frames)
        entry = self.entry
        if entry is None:
            # Same default as XLA: without an ENTRY marker the last computation is the entry.
            entry = next(reversed(self.computations))
            self.computations[entry].is_entry = True
        return HloModule(self.module_name or "", self.computations, entry)

    def close_computation(
        self, name: str, is_entry: bool, instrs: list[HloInstruction], root: HloInstruction | None, line: int
    ) -> None:
        if name in self.computations:
            raise self.error(f"duplicate computation name {name!r}", self.comp_pos)
        self.check_names(name, instrs)
        if root is None and instrs:
            # Without a ROOT marker the last instruction is the result, as XLA reads it.
            root = instrs[-1]
            root.is_root = True
        if is_entry:
            if self.entry is not None:
                raise self.error(f"second ENTRY computation {name!r} (first: {self.entry!r})", self.comp_pos)
            self.entry = name
        self.computations[name] = HloComputation(name, is_entry, instrs, None if root is None else root.name, line)

    def check_names(self, computation: str, instrs: list[HloInstruction]) -> None:
        """Refuse what XLA refuses and the graph could only guess at: an instruction name
        defined twice in one computation, or an operand that names no instruction defined
        before it there (a use before definition, a cycle, or a name defined nowhere)."""
        defined: set[str] = set()
        add = defined.add
        for instr in instrs:
            for operand in instr.operands:
                if operand not in defined:
                    later = any(i.name == operand for i in instrs)
                    what = "is used before its definition" if later else "is not defined"
                    raise self.error(
                        f"operand %{operand} of %{instr.name} {what} in computation {computation!r} "
                        "(operands name instructions defined earlier in the same computation)",
                        self.definition_pos(instr.name, 1),
                    )
            if instr.name in defined:
                raise self.error(
                    f"instruction name %{instr.name} is defined twice in computation {computation!r}",
                    self.definition_pos(instr.name, 2),
                )
            add(instr.name)

    def definition_pos(self, name: str, nth: int) -> int:
        """Where the ``nth`` definition of ``name`` starts in the open computation, for errors
        (the computation's own position when it cannot be found)."""
        pattern = re.compile(r"(?<![\w.\-%])%?" + re.escape(name) + r"[ \t]*=[ \t]*(?![ \t])")
        pos = self.comp_pos
        found = None
        for _ in range(nth):
            found = pattern.search(self.text, pos)
            if found is None:
                return self.comp_pos
            pos = found.end()
        return found.start() if found is not None else self.comp_pos

    # -- header sections ---------------------------------------------------

    def section(self, title: str, pos: int) -> int:
        """Read the rows ``<id> <value>`` of header section ``title`` after ``pos``; return their end."""
        text = self.text
        ours = title in ("FileNames", "FunctionNames", "FileLocations", "StackFrames")
        end = pos
        while True:
            row = self.skip(end)
            key = _ROW_KEY.match(text, row)
            if key is None:
                return end
            start = self.skip(key.end(), _HSKIP)
            char = text[start : start + 1]
            if char == '"':
                end = self.string_end(start)
            elif char == "{":
                end = self.group_end(start)
            elif ours:
                raise self.error(f"malformed row in section {title}", row)
            else:
                # Rows of sections we do not know may have another form: the rest of the line.
                line_end = _LINE_END.search(text, start)
                end = self.n if line_end is None else line_end.start()
            self.section_row(title, key.group(), text[start:end])

    def section_row(self, section: str, key: str, value: str) -> None:
        if section not in ("FileNames", "FileLocations", "StackFrames"):
            return
        if self.frames_shared:
            self.frames = self.frames.copy()
            self.frames_shared = False
        frames = self.frames
        if section == "FileNames":
            frames.file_names[key] = _unquote(value)
        elif section == "FileLocations":
            fields = dict(_KV.findall(value))
            frames.file_locations[key] = (fields.get("file_name_id", ""), _small_int(fields.get("line", "")))
        else:
            fields = dict(_KV.findall(value))
            frames.stack_frames[key] = fields.get("file_location_id", "")

    # -- instructions ------------------------------------------------------

    def shape_of(self, raw: str, pos: int) -> str:
        """The printed, interned form of the shape text ``raw`` (written at ``pos``)."""
        printed = self.shapes.get(raw)
        if printed is None:
            printed = _canonical_shape(raw)
            if not _shape_ok(printed):
                raise self.error(f"malformed element type in shape {printed!r}", pos)
            printed = self.shapes[raw] = _intern(printed)
        return printed

    def fast_instruction(self, fast: re.Match[str], comp_name: str, pos: int) -> HloInstruction:
        """The instruction of a line ``_FAST_LINE`` matches."""
        is_root, name, shape, opcode, args, pre, frontend, metadata, backend, post = fast.groups()
        opcode = _intern(opcode)
        if not args or opcode in _LITERAL_OPCODES:
            operands = _NO_NAMES
        else:
            operands = tuple(map(_intern, args.replace("%", "").replace(" ", "").split(",")))
        called = _NO_NAMES
        target = None
        if pre or post:
            called, target = self.generic_attributes(pre, post)
        trip = None
        if backend is not None and "known_trip_count" in backend:
            count = _TRIP_COUNT.search(backend)
            if count is not None:
                trip = _small_int(count.group(1))
        return HloInstruction(
            _intern(name),
            opcode,
            self.shape_of(shape, pos),
            operands,
            comp_name,
            called,
            is_root is not None,
            target,
            _EMPTY_ATTRS if frontend is None else self.frontend_attributes(frontend),
            backend,
            trip,
            None if metadata is None else _intern(metadata),
            self.frames_ref,
        )

    def generic_attributes(self, pre: str | None, post: str | None) -> tuple[tuple[str, ...], str | None]:
        """Called computations and custom-call target among the attributes the fast path leaves as text."""
        called: list[str] = []
        target: str | None = None
        for text in (pre, post):
            if text and _CALL_KEY.search(text):
                for key, value in _ATTR_PAIR.findall(text):
                    if key in _CALL_KEYS:
                        called.extend(map(_intern, _NAMES.findall(value)))
                    elif key == "custom_call_target":
                        target = _intern(_unquote(value))
        return (tuple(called) if called else _NO_NAMES), target

    def instruction(self, start: int) -> int:
        """Read the instruction at ``start`` into the open computation; return the position after it."""
        text = self.text
        head = _HEAD.match(text, start)
        if head is not None:
            is_root = head.group(1) is not None
            name = head.group(2)
            shape = "" if head.group(3) is None else self.shape_of(head.group(3), head.start(3))
            opcode = _intern(head.group(4))
            pos = head.end() - 1
        else:
            is_root, name, pos = self.instruction_name(start)
            shape, opcode, pos = self.shape_and_opcode(pos)
        operands, pos = self.operand_list(pos, opcode, 0)
        pairs, pos = self.attributes(pos, name)
        self.add(self.build(name, opcode, shape, operands, self.comp_name or "", is_root, pairs))
        return pos

    def instruction_name(self, start: int) -> tuple[bool, str, int]:
        """``ROOT`` flag, name and the position after "=" of the instruction at ``start``."""
        text = self.text
        pos = start
        is_root = False
        root = _ROOT_KW.match(text, pos)
        if root is not None:
            after = self.skip(root.end())
            if not text.startswith("=", after):
                is_root = True
                pos = after
        name = _NAME_TOKEN.match(text, pos)
        if name is None:
            raise self.error("expected an instruction 'name = shape opcode(operands)' or '}'", start)
        after = self.skip(name.end())
        if not text.startswith("=", after):
            char = text[after : after + 1]
            if name.group(1) == "ENTRY" or (char and char in "{("):
                raise self.error(f"computation header inside computation {self.comp_name!r} (missing '}}'?)", start)
            raise self.error("expected an instruction 'name = shape opcode(operands)' or '}'", start)
        return is_root, name.group(1), self.skip(after + 1)

    def shape_end(self, pos: int) -> int | None:
        """End of the shape written at ``pos``, or None when no shape starts there."""
        text = self.text
        if text.startswith("(", pos):
            return self.group_end(pos)
        word = _WORD.match(text, pos)
        if word is None:
            return None
        end = word.end()
        if text.startswith("[", end):
            end = self.group_end(end)
        elif word.group() == "b" and text.startswith("(", end):
            # A buffer shape, b(f32[8]{0}).
            end = self.group_end(end)
        else:
            return None
        # The layout follows without a space: "-> f32[2] {" opens a computation's body.
        if text.startswith("{", end):
            end = self.group_end(end)
        return end

    def shape_and_opcode(self, pos: int) -> tuple[str, str, int]:
        """Shape (``""`` when left out) and opcode at ``pos``, and the position of the operand list's "("."""
        text = self.text
        end = self.shape_end(pos)
        if end is None:
            shape = ""
        else:
            shape = self.shape_of(text[pos:end], pos)
            pos = self.skip(end)
        opcode = _WORD.match(text, pos)
        if opcode is None:
            raise self.error("expected an opcode and '('" + (" after the shape" if shape else " after '='"), pos)
        after = self.skip(opcode.end())
        if not text.startswith("(", after):
            raise self.error(f"expected '(' after the opcode {opcode.group()!r}", pos)
        return shape, _intern(opcode.group()), after

    def operand_list(self, pos: int, opcode: str, depth: int) -> tuple[tuple[str, ...], int]:
        """Operand names of the list whose "(" is at ``pos``, and the position after its ")"."""
        text = self.text
        if opcode in _LITERAL_OPCODES:
            return _NO_NAMES, self.group_end(pos)
        plain = _NAME_LIST.match(text, pos)
        if plain is not None:
            names = plain.group(1)
            return (tuple(map(_intern, _NAMES.findall(names))) if names else _NO_NAMES), plain.end()
        listed = _OPERAND_LIST.match(text, pos)
        if listed is not None:
            return tuple(map(_intern, _LISTED_NAME.findall(text, pos, listed.end()))), listed.end()
        operands: list[str] = []
        opening = pos
        pos = self.skip(pos + 1)
        if text.startswith(")", pos):
            return _NO_NAMES, pos + 1
        typed = _TYPED_OPERAND.match
        while True:
            simple = typed(text, pos)
            if simple is not None:
                operands.append(_intern(simple.group(2)))
                pos = simple.end()
            else:
                pos = self.operand(pos, operands, depth)
            pos = self.skip(pos)
            char = text[pos : pos + 1]
            if char == ",":
                pos = self.skip(pos + 1)
            elif char == ")":
                return tuple(operands), pos + 1
            else:
                raise self.error("expected ',' or ')' in the operand list", opening)

    def operand(self, pos: int, operands: list[str], depth: int) -> int:
        """Read one operand at ``pos`` into ``operands``: ``[shape] name`` or ``[shape] opcode(...)``."""
        text = self.text
        shape_start = pos
        end = self.shape_end(pos)
        shape: str | None = None
        if end is not None:
            shape = self.shape_of(text[pos:end], pos)
            pos = self.skip(end)
        name = _NAME_TOKEN.match(text, pos)
        if name is None:
            raise self.error("expected an operand name", pos)
        after = self.skip(name.end())
        if text.startswith("(", after) and name.group()[0] != "%":
            # An instruction written in place of its operand: XLA adds it to the
            # computation under a made-up name.
            if depth >= _MAX_DEPTH:
                raise self.error("operands nested too deep", shape_start)
            opcode = _intern(name.group(1))
            nested, end = self.operand_list(after, opcode, depth + 1)
            operands.append(self.anonymous(opcode, shape or "", nested))
            return end
        operands.append(_intern(name.group(1)))
        return name.end()

    def anonymous(self, opcode: str, shape: str, operands: tuple[str, ...]) -> str:
        """Add an instruction written in place of an operand; its name as XLA makes it up."""
        names = self.names
        if names is None:
            names = self.names = set()
        instrs = self.instrs
        if self.names_seen < len(instrs):
            names.update(instr.name for instr in instrs[self.names_seen :])
            self.names_seen = len(instrs)
        base = opcode + ".anon"
        count = self.anon_next.get(base, 0)
        name = base if count == 0 else f"{base}.{count}"
        while name in names:
            count += 1
            name = f"{base}.{count}"
        self.anon_next[base] = count + 1
        names.add(name)
        self.add(self.build(name, opcode, shape, operands, self.comp_name or "", False, None))
        return _intern(name)

    def attributes(self, pos: int, owner: str) -> tuple[list[tuple[str, str]] | None, int]:
        """``, key=value`` pairs from ``pos`` on (over lines, too); the position after the last value.

        ``owner`` names the instruction, for inline computations in its attributes.
        """
        text = self.text
        pairs: list[tuple[str, str]] | None = None
        fast = _ATTR_FAST.match
        while True:
            simple = fast(text, pos)
            if simple is not None:
                key, value = simple.group(1), simple.group(2)
                if not (key in _CALL_KEYS and value[0] == "{" and "=" in value):
                    if pairs is None:
                        pairs = []
                    pairs.append((key, value))
                    pos = simple.end()
                    continue
            comma = self.skip(pos)
            if not text.startswith(",", comma):
                return pairs, pos
            key_start = self.skip(comma + 1)
            key_match = _ATTR_KEY.match(text, key_start)
            if key_match is None:
                raise self.error("expected 'key=value' after ','", comma)
            key = key_match.group()
            equals = self.skip(key_match.end())
            if not text.startswith("=", equals):
                raise self.error(f"expected '=' after the attribute name {key!r}", key_start)
            start = self.skip(equals + 1)
            inline = None
            if key in _CALL_KEYS and text.startswith("{", start):
                inline = self.inline_computations(start, key, owner)
            if inline is None:
                value, pos = self.value(start, key, key_start)
            else:
                value, pos = inline
            if pairs is None:
                pairs = []
            pairs.append((key, value))

    def value(self, start: int, key: str, key_start: int) -> tuple[str, int]:
        """The text of the attribute value at ``start`` (comments dropped) and its end.

        A value is a run of strings, bracket groups and bare pieces; pieces may be
        apart by spaces on one line (``literal=f32[] 0.1``).
        """
        text = self.text
        pos = start
        self.comment_seen = False
        while True:
            char = text[pos : pos + 1]
            if char and char in "([{":
                pos = self.group_end(pos)
            elif char == '"':
                pos = self.string_end(pos)
            else:
                bare = _BARE.match(text, pos)
                if bare is None:
                    break
                pos = bare.end()
            after = _HSPACE.match(text, pos).end()  # type: ignore[union-attr]  # matches empty
            char = text[after : after + 1]
            if not char or char in ",)]}=\r\n":
                break
            if char not in '([{"':
                bare = _BARE.match(text, after)
                if bare is None:
                    break
                # A name and "=" (or ROOT) start the next instruction on the same line.
                if after > pos and (bare.group() == "ROOT" or _ASSIGN.match(text, bare.end())):
                    break
            pos = after
        if pos == start:
            raise self.error(f"attribute {key!r} has no value", key_start)
        value = text[start:pos]
        if self.comment_seen:
            value = _strip_comments(value)
        return value, pos

    def inline_computations(self, start: int, key: str, owner: str) -> tuple[str, int] | None:
        """Computations written inline as a call attribute's value: their names (as a value) and end.

        ``to_apply={ ... }`` holds one; ``branch_computations={{ ... }, { ... }}`` a list.
        None when the braces hold names (``{%a, %b}``) rather than instructions.
        """
        text = self.text
        inner = self.skip(start + 1)
        if text.startswith("{", inner):
            if not _INSTRUCTION_START.match(text, self.skip(inner + 1)):
                return None
            names: list[str] = []
            pos = inner
            while True:
                if not text.startswith("{", pos):
                    raise self.error("expected '{' to open an inline computation", pos)
                name, pos = self.inline_computation(pos, f"{owner}.{key}.{len(names)}")
                names.append(name)
                pos = self.skip(pos)
                if text.startswith(",", pos):
                    pos = self.skip(pos + 1)
                elif text.startswith("}", pos):
                    return "{" + ", ".join(names) + "}", pos + 1
                else:
                    raise self.error("expected ',' or '}' after an inline computation", pos)
        if not _INSTRUCTION_START.match(text, inner):
            return None
        return self.inline_computation(start, f"{owner}.{key}")

    def inline_computation(self, start: int, base: str) -> tuple[str, int]:
        """Read the computation in braces at ``start`` under a made-up name; return it and the end."""
        if self.depth >= _MAX_DEPTH:
            raise self.error("inline computations nested too deep", start)
        text = self.text
        name = base
        count = 0
        while name in self.computations:
            count += 1
            name = f"{base}.{count}"
        outer = (
            self.comp_name,
            self.comp_entry,
            self.comp_line,
            self.comp_pos,
            self.instrs,
            self.root,
            self.names,
            self.names_seen,
            self.anon_next,
        )
        self.depth += 1
        self.open_computation(name, False, start)
        pos = start + 1
        while True:
            pos = self.skip(pos)
            if pos >= self.n:
                raise self.error(f"inline computation {name!r} is not closed (missing '}}')", start)
            if text[pos] == "}":
                break
            pos = self.instruction(pos)
        self.close_computation(name, False, self.instrs, self.root, self.comp_line)
        self.depth -= 1
        (
            self.comp_name,
            self.comp_entry,
            self.comp_line,
            self.comp_pos,
            self.instrs,
            self.root,
            self.names,
            self.names_seen,
            self.anon_next,
        ) = outer
        return _intern(name), pos + 1

    def string_end(self, pos: int) -> int:
        """Index just past the string whose quote is at ``pos``."""
        tail = _QUOTED_TAIL.match(self.text, pos + 1)
        if tail is None:
            raise self.error("unterminated string", pos)
        return tail.end()

    def group_end(self, pos: int) -> int:
        """Index just past the bracket group opening at ``text[pos]`` (string- and comment-aware, iterative)."""
        text = self.text
        n = self.n
        opener = text[pos : pos + 1]
        closer = _CLOSER.get(opener)
        if closer is None:
            raise self.error("expected '(', '[' or '{'", pos)
        stack = [closer]
        run = _GROUP_RUN.match
        index = pos + 1
        while True:
            # One match takes the plain text and strings up to the next bracket or "/".
            index = run(text, index).end()  # type: ignore[union-attr]  # matches empty
            if index >= n:
                raise self.error(f"unbalanced {opener!r}: no matching {stack[-1]!r}", pos)
            char = text[index]
            if char == '"':
                raise self.error("unterminated string", index)
            if char == "/":
                follower = text[index + 1 : index + 2]
                if follower == "*":
                    close = text.find("*/", index + 2)
                    if close < 0:
                        raise self.error("unterminated comment", index)
                    index = close + 2
                    self.comment_seen = True
                elif follower == "/":
                    line_end = _LINE_END.search(text, index)
                    index = n if line_end is None else line_end.start()
                    self.comment_seen = True
                else:
                    index += 1
                continue
            expected = _CLOSER.get(char)
            if expected is not None:
                stack.append(expected)
            elif char == stack[-1]:
                stack.pop()
                if not stack:
                    return index + 1
            else:
                raise self.error(f"unexpected {char!r}, expected {stack[-1]!r}", index)
            index += 1

    def build(
        self,
        name: str,
        opcode: str,
        shape: str,
        operands: tuple[str, ...],
        computation: str,
        is_root: bool,
        pairs: list[tuple[str, str]] | None,
    ) -> HloInstruction:
        """Make the instruction from its parts and its ``(key, value)`` attribute texts."""
        called: list[str] | None = None
        custom_target: str | None = None
        attrs = _EMPTY_ATTRS
        backend: str | None = None
        trip: int | None = None
        metadata: str | None = None
        if pairs:
            for key, value in pairs:
                if key == "metadata":
                    metadata = value
                elif key == "frontend_attributes":
                    attrs = self.frontend_attributes(value)
                elif key in _CALL_KEYS:
                    if called is None:
                        called = []
                    called.extend(map(_intern, _NAMES.findall(value)))
                elif key == "custom_call_target":
                    custom_target = _intern(_unquote(value))
                elif key == "backend_config":
                    backend = value
                    if "known_trip_count" in value:
                        count = _TRIP_COUNT.search(value)
                        if count is not None:
                            trip = _small_int(count.group(1))
        return HloInstruction(
            _intern(name),
            opcode,
            shape,
            operands,
            computation,
            _NO_NAMES if called is None else tuple(called),
            is_root,
            custom_target,
            attrs,
            backend,
            trip,
            None if metadata is None else _intern(metadata),
            self.frames_ref,
        )

    def frontend_attributes(self, value: str) -> Mapping[str, str]:
        cached = self.attrs_cache.get(value)
        if cached is None:
            if len(value) > MAX_ATTRIBUTE_CHARS:
                raise HloParseError(
                    f"a frontend_attributes value of {len(value)} characters is over the {MAX_ATTRIBUTE_CHARS}-character limit "
                    "(ejlabel.analysis.hlo.MAX_ATTRIBUTE_CHARS)", 0, value[:60]
                )
            pairs = _frontend_pairs(value)
            cached = MappingProxyType(pairs) if pairs else _EMPTY_ATTRS
            if len(self.attrs_cache) < 100_000:
                self.attrs_cache[value] = cached
        return cached


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
    parser = _Parser(text)
    # The parse allocates one object graph without reference cycles; letting the
    # cycle collector walk it again and again while it grows costs ~20% of the time.
    collecting = gc.isenabled()
    gc.disable()
    try:
        try:
            return parser.run_quick()
        except _Restart:
            parser = _Parser(text)
            return parser.run_lines()
    except HloParseError:
        raise
    except Exception as exc:  # noqa: BLE001 - the contract is "HloParseError or a module"
        try:
            detail = f"{type(exc).__name__}: {exc}"
        except Exception:  # noqa: BLE001 - an exception whose str() fails must not escape either
            detail = type(exc).__name__
        try:
            where, line = parser.lineno, _snippet(parser.line, None)
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
        pos = _SKIP.match(text, pos).end()  # type: ignore[union-attr]  # matches empty
        if not text.startswith("#", pos):
            break
        if _MLIR_ALIAS.match(text, pos):
            return "stablehlo"
        # A "#" comment line (this reader takes them in HLO text).
        line_end = _LINE_END.search(text, pos)
        pos = n if line_end is None else line_end.start()
    if text.startswith(("func.func", '"func.func"', '"builtin.module"', "builtin.module"), pos):
        return "stablehlo"
    module = _MLIR_MODULE.match(text, pos)
    if module is None:
        return "hlo"
    after = _SKIP.match(text, module.end()).end()  # type: ignore[union-attr]
    if text.startswith("{", after):
        inside = _SKIP.match(text, after + 1).end()  # type: ignore[union-attr]
        if _INSTRUCTION_START.match(text, inside):
            return "hlo"
        return "stablehlo"
    # "module @name", "module attributes {...}": MLIR; "module (p: f32[]) -> ..." an HLO computation.
    return "hlo" if text.startswith(("(", "->"), after) else "stablehlo"


# ---------------------------------------------------------------------------
# StableHLO.

_MLIR_FRONTEND_ATTRS = re.compile(
    r"mhlo\.frontend_attributes\s*=\s*\{((?:[^{}\"]++|" + _QUOTED + r")*+)\}"
)
# The lookbehind keeps findall from re-reading a key (or an escaped quote's string) from each of its characters.
_MLIR_KV = re.compile(r"(?<![\w.$\-\\])([\w.$\-]++|" + _QUOTED + r")\s*+=\s*+(" + _QUOTED + r")")
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
            attrs[_intern(_mlir_unquote(key))] = _intern(_mlir_unquote(value))
        result.append(attrs)
    return result
