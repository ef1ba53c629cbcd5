"""A tolerant reader for HLO module text and for frontend attributes in StableHLO text.

Why our own parser: XLA's parser rejects dumps written by newer XLA versions (new
attributes, new header sections), yet all we need from a program is its call
structure (instructions, operands, called computations) and the attributes that
the library writes into kernel calls (``ejlabel`` and ``ejcall``).  So this reader
understands the line structure of HLO text and keeps only those parts; attributes
it does not know are skipped, not rejected.

Accepted input, liberally:

* an optional ``HloModule name, key=value, ...`` header (at most one);
* optional header sections such as ``FileNames`` / ``FileLocations`` /
  ``StackFrames`` (numbered lines); unknown sections of that form are skipped;
* computations ``[ENTRY] [%]name [(signature) -> shape] {`` ... ``}``;
* instruction lines ``[ROOT] [%]name = shape opcode(operands)[, key=value]...``;
* blank lines and ``//`` or ``#`` comment lines, ``/*...*/`` comments in operand
  lists and tuple shapes.

Text without an ``HloModule`` header is accepted when it holds computations, so
that snippets cut out of dumps can be read; the module is then named ``""``.
Malformed input raises :class:`HloParseError` (a ``ValueError``) with the line
number and a snippet, and never any other exception type.

The reader runs in time and memory linear in the text.  The common instruction
line (plain operand names, simple attributes, frontend attributes and metadata) is
read by one regular expression applied to whole chunks of the text, one row per
line; every other line goes through a line-by-line reader that handles the full
syntax (and reports errors).  Metadata is kept as its raw text and read on first
access of ``op_name``/``source_file``/``source_line``; repeated strings are
interned or shared, and instructions without attributes share one empty mapping.
"""

from __future__ import annotations

import gc
import re
import sys
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType

__all__ = [
    "HloComputation",
    "HloInstruction",
    "HloModule",
    "HloParseError",
    "parse_hlo",
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
    """One instruction line.

    ``operands`` and ``called_computations`` are names without the ``%`` sigil;
    ``computation`` is the name of the computation the instruction belongs to.
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
# Lexical pieces.  Possessive quantifiers keep failing matches linear.

_QUOTED = r'"(?:[^"\\]++|\\.)*+"'
# Head of an instruction: ROOT flag, name, then either a non-tuple shape followed
# by the opcode and "(", or (lookahead) the "(" that opens a tuple shape.
_INSTR_HEAD = re.compile(
    r"[ \t]*(ROOT[ \t]+)?%?([^\s=(){}\[\],\"%]+)[ \t]*=[ \t]*"
    r"(?:([A-Za-z][A-Za-z0-9]*(?:\[[^\[\]]*\])?(?:\{[^{}]*\})?)[ \t]+([A-Za-z][\w\-]*)\(|(?=\())"
)
_OPCODE_AFTER_SHAPE = re.compile(r"[ \t]+([A-Za-z][\w\-]*)\(")
# Operand list with no nesting: the common case, taken without a character scan.
_FLAT_ARGS = re.compile(r"([^(){}\[\]\"/]*)\)")
_NAMES = re.compile(r"[^\s,{}%]+")
_OPERAND_NAME = re.compile(r"%?([^\s=(){}\[\],\"%]+)")
_COMMENT = re.compile(r"/\*.*?\*/")
# An attribute value: quoted, a flat (quote-aware) brace group, or bare.
_VALUE = _QUOTED + r"|\{(?:[^{}\"]++|" + _QUOTED + r")*+\}|[^\s,{}()\[\]\"]++"
_ATTR_PAIR = re.compile(r"[ \t]*,[ \t]*([\w.\-]+)[ \t]*=[ \t]*(" + _VALUE + r")")
# JSON objects nested up to three deep (backend configs), quote-aware.
_JSON3 = r"\{(?:[^{}\"]++|Q|\{(?:[^{}\"]++|Q|\{(?:[^{}\"]++|Q)*+\})*+\})*+\}".replace("Q", _QUOTED)
_GENERIC = r"((?:, (?!frontend_attributes=|metadata=|backend_config=)[\w.\-]+=(?:" + _VALUE + r"))*+)"
# The common instruction line in one match, attributes in the order XLA prints
# them: opcode-specific ones, frontend_attributes, metadata, backend_config, rest.
# Exactly ", " between attributes; any other line takes the general path.
_FAST_LINE = re.compile(
    r"[ \t]*(ROOT[ \t]+)?%?([^\s=(){}\[\],\"%]+) = "
    r"([A-Za-z][A-Za-z0-9]*(?:\[[^\[\]]*\])?(?:\{[^{}]*\})?|\((?:[^(){}]++|\{[^{}]*\})*+\))"
    r" ([A-Za-z][\w\-]*)\(([^(){}\[\]\"/\s]*+(?: [^(){}\[\]\"/\s]++)*+)\)"
    + _GENERIC
    + r"(?:, frontend_attributes=(\{(?:[^{}\"]++|" + _QUOTED + r")*+\}))?"
    r"(?:, metadata=(\{(?:[^{}\"]++|" + _QUOTED + r")*+\}))?"
    r"(?:, backend_config=(" + _QUOTED + "|" + _JSON3 + r"))?"
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
_Q_NAME = "[^" + _Q_SPACE + r"=(){}\[\],\"%]+"
_Q_OPERAND = "[^" + _Q_SPACE + r"=(){}\[\],\"%/]+"
_Q_STRING = r'"[^"\\\n]*+"'
_Q_BRACES = r'\{[^{}"\n]*+(?:' + _Q_STRING + r'[^{}"\n]*+)*+\}'
_Q_VALUE = _Q_STRING + r'|\{[^{}"\n]*+\}|[^' + _Q_SPACE + r',{}()\[\]"]++'
# ``[\w\-]*`` (opcodes) as an ASCII run first: the same strings, fewer tests per character.
_Q_WORD_DASH = r"[A-Za-z0-9_\-]*+(?:[\w\-][A-Za-z0-9_\-]*+)*+"
_QUICK_LINE = (
    r"[ \t]*(ROOT[ \t]+)?%?(" + _Q_NAME + r") = "
    r"([A-Za-z][A-Za-z0-9]*(?:\[[^\[\]\n]*\])?(?:\{[^{}\n]*\})?|\((?:[^(){}\n]++|\{[^{}\n]*\})*+\))"
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
# The general path reads one attribute at a time and must see where each value ends.
_ATTR = re.compile(_ATTR_PAIR.pattern + r"(?=[ \t]*(?:,|$))")
_ATTR_KEY = re.compile(r"[ \t]*,[ \t]*([\w.\-]+)[ \t]*=[ \t]*")
_BARE_RUN = re.compile(r"[^,(){}\[\]\"]+")
_SPECIAL = re.compile(r"[(){}\[\]\"]")
_SPECIAL_OR_COMMA = re.compile(r"[(){}\[\]\",]")
_QUOTED_TAIL = re.compile(r'(?:[^"\\]++|\\.)*+"')
_KV = re.compile(r"([\w.\-]+)[ \t]*=[ \t]*(" + _QUOTED + r"|[^\s,{}\"]*)")
_TRIP_COUNT = re.compile(r'known_trip_count\\*"\s*:\s*\{\s*\\*"n\\*"\s*:\s*\\*"?(\d+)')

_MODULE_HEADER = re.compile(r"[ \t]*HloModule[ \t]+%?([^\s,]+)")
_COMPUTATION_HEADER = re.compile(r"[ \t]*(ENTRY[ \t]+)?%?([^\s=(){}\[\],\"%]+)[ \t]*(?:\(|\{|->|,)")
_SECTION_TITLE = re.compile(r"[A-Z][A-Za-z]*")
_SECTION_ROW = re.compile(r"[ \t]*(\d+)[ \t]+(" + _QUOTED + r"|\{[^{}]*\})[ \t]*")

_CLOSER = {"(": ")", "[": "]", "{": "}"}

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


# ---------------------------------------------------------------------------
# The parser.


class _Restart(Exception):
    """The quick scan met a line it leaves to the line-by-line reader."""


# Characters per chunk of the quick scan: bounds the rows held at once.
_CHUNK_CHARS = 1 << 18
# Distinct metadata (and other attribute) texts the quick scan keeps before it starts afresh.
_SHARED_TEXTS = 100_000


class _Parser:
    """Line-by-line state machine; ``lineno``/``line`` always name the current line for errors.

    :meth:`run_quick` reads the common instruction line (``_QUICK_LINE``) straight
    from chunks of the text and hands every other line to :meth:`line_step`, the
    reader of one line; :meth:`run_lines` hands it every line.  Both build the
    same module, and the quick scan restarts as :meth:`run_lines` where only the
    line-by-line reader knows what to report.
    """

    def __init__(self, text: str) -> None:
        self.text = text
        self.lineno = 0
        self.line = ""
        self.module_name: str | None = None
        self.computations: dict[str, HloComputation] = {}
        self.entry: str | None = None
        # State of the line being read: the open computation, header sections.
        self.section: str | None = None
        self.comp_name: str | None = None
        self.comp_line = 0
        self.comp_entry = False
        self.instrs: list[HloInstruction] = []
        self.root: HloInstruction | None = None
        # StackFrames tables.  Instructions read while they are empty resolve their
        # frames through ``late``, which takes the final tables at the end; tables
        # handed to instructions are copied before a later row changes them.
        self.frames = _Frames()
        self.frames_shared = False
        self.late = _Frames()
        self.frames_ref = self.late
        # Identical attribute texts repeat a lot (labels); parse each once.
        self.attrs_cache: dict[str, Mapping[str, str]] = {}

    # -- errors ------------------------------------------------------------

    def error(self, message: str, column: int | None = None) -> HloParseError:
        return HloParseError(message, self.lineno, _snippet(self.line, column), column)

    # -- drivers -----------------------------------------------------------

    def run_quick(self) -> HloModule:
        text = self.text
        n = len(text)
        pos = 0
        lineno = 0
        scan = _QUICK_SCAN.findall
        find = text.find
        comp_name = self.comp_name
        append = self.instrs.append
        root = self.root
        frames_ref = self.frames_ref
        line_step = self.line_step
        make_tuple = tuple
        literal_opcodes = _LITERAL_OPCODES
        call_key = _CALL_KEY.search
        generic_attributes = self.generic_attributes
        frontend_attributes = self.frontend_attributes
        intern = _intern
        empty = _EMPTY_ATTRS
        no_names = _NO_NAMES
        make = HloInstruction
        comment = _COMMENT.sub
        # Repeated metadata texts share one string, within a window of recent ones.
        seen: dict[str, str] = {}
        share = seen.setdefault
        attribute_cache: dict[str, tuple[tuple[str, ...], str | None]] = {}
        try:
            while pos <= n:
                stop = find("\n", pos + _CHUNK_CHARS)
                if stop < 0:
                    stop = n
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
                            known = attribute_cache.get(pre)
                            if known is None:
                                known = generic_attributes(pre, None) if call_key(pre) else (no_names, None)
                                attribute_cache[pre] = known
                            called, target = known
                        else:
                            called = no_names
                            target = None
                        if "/*" in shape:
                            shape = comment("", shape)
                        instr = make(
                            intern(name),
                            opcode,
                            intern(shape),
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
                    self.root = root
                    line_step(other, lineno)
                    comp_name = self.comp_name
                    append = self.instrs.append
                    root = self.root
                    frames_ref = self.frames_ref
                pos = stop + 1
                if len(seen) > _SHARED_TEXTS:
                    seen.clear()
                if len(attribute_cache) > _SHARED_TEXTS:
                    attribute_cache.clear()
        except HloParseError:
            raise
        except Exception as exc:
            # The line-by-line reader reports the line (or finds nothing wrong).
            raise _Restart from exc
        if lineno != text.count("\n") + 1:
            raise _Restart
        self.root = root
        return self.finish()

    def run_lines(self) -> HloModule:
        text = self.text
        n = len(text)
        pos = 0
        lineno = 0
        line_step = self.line_step
        while pos <= n:
            end = text.find("\n", pos)
            if end < 0:
                end = n
            lineno += 1
            line_step(text[pos:end], lineno)
            pos = end + 1
        return self.finish()

    def line_step(self, line: str, lineno: int) -> None:
        """Read one line (any kind) into the parser's state."""
        self.lineno = lineno
        self.line = line
        comp_name = self.comp_name
        if comp_name is not None:
            fast = _FAST_LINE.fullmatch(line)
            if fast is not None:
                self.add(self.fast_instruction(fast, comp_name))
                return
            head = _INSTR_HEAD.match(line)
            if head is not None:
                self.add(self.parse_general(line, head, comp_name))
                return
            stripped = line.strip()
            if stripped == "}":
                self.close_computation(comp_name, self.comp_entry, self.instrs, self.root, self.comp_line)
                self.comp_name = None
                self.instrs = []
                self.root = None
                return
            if not stripped or stripped.startswith(("//", "#")):
                return
            column = len(line) - len(line.lstrip())
            if stripped.endswith("{") and _COMPUTATION_HEADER.match(line):
                raise self.error(f"computation header inside computation {comp_name!r} (missing '}}'?)", column)
            raise self.error("expected an instruction 'name = shape opcode(operands)' or '}'", column)

        # Outside computations.
        stripped = line.strip()
        if not stripped or stripped.startswith(("//", "#")):
            self.section = None
            return
        section = self.section
        if section is not None and stripped[0].isdigit():
            self.section_row(section, line)
            return
        self.section = None
        if stripped.startswith("HloModule"):
            header = _MODULE_HEADER.match(line)
            if header is None:
                raise self.error("malformed HloModule header")
            if self.module_name is not None:
                raise self.error("second HloModule header (one module per text)")
            self.module_name = _intern(header.group(1))
            return
        if _SECTION_TITLE.fullmatch(stripped):
            self.section = stripped
            return
        if stripped.endswith("{"):
            header = _COMPUTATION_HEADER.match(line)
            if header is None:
                raise self.error("malformed computation header")
            self.comp_name = _intern(header.group(2))
            self.comp_entry = header.group(1) is not None
            self.comp_line = lineno
            if self.frames.stack_frames:
                self.frames_ref = self.frames
                self.frames_shared = True
            else:
                self.frames_ref = self.late
            return
        column = len(line) - len(line.lstrip())
        if _INSTR_HEAD.match(line):
            raise self.error("instruction outside of a computation", column)
        raise self.error("unexpected text outside of a computation", column)

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

    def fast_instruction(self, fast: re.Match[str], comp_name: str) -> HloInstruction:
        """The instruction of a line ``_FAST_LINE`` matches."""
        is_root, name, shape, opcode, args, pre, frontend, metadata, backend, post = fast.groups()
        opcode = _intern(opcode)
        if not args or opcode in _LITERAL_OPCODES:
            operands = _NO_NAMES
        else:
            split = args.replace("%", "").replace(" ", "").split(",")
            if "" in split:
                split = [operand for operand in split if operand]
            operands = tuple(map(_intern, split))
        called = _NO_NAMES
        target = None
        if pre or post:
            called, target = self.generic_attributes(pre, post)
        trip = None
        if backend is not None and "known_trip_count" in backend:
            count = _TRIP_COUNT.search(backend)
            if count is not None:
                trip = _small_int(count.group(1))
        if "/*" in shape:
            shape = _COMMENT.sub("", shape)
        return HloInstruction(
            _intern(name),
            opcode,
            _intern(shape),
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

    def close_computation(
        self, name: str, is_entry: bool, instrs: list[HloInstruction], root: HloInstruction | None, line: int
    ) -> None:
        if name in self.computations:
            raise self.error(f"duplicate computation name {name!r}")
        if root is None and instrs:
            # Without a ROOT marker the last instruction is the result, as XLA reads it.
            root = instrs[-1]
            root.is_root = True
        if is_entry:
            if self.entry is not None:
                raise self.error(f"second ENTRY computation {name!r} (first: {self.entry!r})")
            self.entry = name
        self.computations[name] = HloComputation(name, is_entry, instrs, None if root is None else root.name, line)

    # -- header sections ---------------------------------------------------

    def section_row(self, section: str, line: str) -> None:
        row = _SECTION_ROW.fullmatch(line)
        if row is None:
            # Rows of sections we do not know may have another form; only ours must parse.
            if section in ("FileNames", "FunctionNames", "FileLocations", "StackFrames"):
                raise self.error(f"malformed row in section {section}")
            return
        key, value = row.group(1), row.group(2)
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

    def parse_general(self, line: str, head: re.Match[str], computation: str) -> HloInstruction:
        """Instruction lines the whole-line pattern does not cover: nested groups, typed operands, odd spacing."""
        opcode = head.group(4)
        if opcode is not None:
            shape = head.group(3)
            pos = head.end()
        else:
            # Tuple shape: "(f32[2]{0}, /*index=1*/s32[])".
            start = head.end()
            shape_end = self.skip_group(line, start)
            shape = line[start:shape_end]
            if "/*" in shape:
                shape = _COMMENT.sub("", shape)
            after = _OPCODE_AFTER_SHAPE.match(line, shape_end)
            if after is None:
                raise self.error("expected an opcode and '(' after the shape", shape_end)
            opcode = after.group(1)
            pos = after.end()
        opcode = _intern(opcode)

        flat = _FLAT_ARGS.match(line, pos)
        if flat is not None:
            end = flat.end()
            if opcode in _LITERAL_OPCODES:
                operands = _NO_NAMES
            else:
                operands = tuple(map(_intern, _NAMES.findall(flat.group(1))))
        else:
            end = self.skip_group(line, pos - 1)
            operands = _NO_NAMES if opcode in _LITERAL_OPCODES else self.split_operands(line, pos, end - 1)

        pairs: list[tuple[str, str]] = []
        length = len(line)
        while end < length:
            found = _ATTR.match(line, end)
            if found is not None:
                pairs.append((found.group(1), found.group(2)))
                end = found.end()
            else:
                if line[end:].isspace():
                    break
                key, value, end = self.slow_attribute(line, end)
                pairs.append((key, value))
        return self.build(head.group(2), opcode, shape, operands, computation, head.group(1) is not None, pairs)

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
            _intern(shape),
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

    def split_operands(self, line: str, start: int, stop: int) -> tuple[str, ...]:
        """Operand names of ``line[start:stop]`` split at top-level commas (typed or commented forms)."""
        names: list[str] = []
        piece_start = start
        depth = 0
        pos = start
        while True:
            found = _SPECIAL_OR_COMMA.search(line, pos, stop)
            at = stop if found is None else found.start()
            char = "," if found is None else found.group()
            if char == '"':
                tail = _QUOTED_TAIL.match(line, at + 1, stop)
                if tail is None:
                    raise self.error("unterminated string in operands", at)
                pos = tail.end()
                continue
            if char in "({[":
                depth += 1
            elif char in ")}]":
                depth -= 1
            elif depth == 0:
                piece = line[piece_start:at]
                if "/*" in piece:
                    piece = _COMMENT.sub("", piece)
                piece = piece.strip()
                if piece:
                    last = piece.rsplit(None, 1)[-1]
                    operand = _OPERAND_NAME.fullmatch(last)
                    if operand is None:
                        raise self.error(f"malformed operand {piece!r}", piece_start)
                    names.append(_intern(operand.group(1)))
                piece_start = at + 1
            if found is None:
                return tuple(names)
            pos = at + 1

    def skip_group(self, line: str, pos: int) -> int:
        """Index just past the bracket group opening at ``line[pos]`` (quote-aware, iterative)."""
        opener = line[pos] if pos < len(line) else ""
        closer = _CLOSER.get(opener)
        if closer is None:
            raise self.error("expected '(', '[' or '{'", pos)
        stack = [closer]
        search = _SPECIAL.search
        index = pos + 1
        while stack:
            found = search(line, index)
            if found is None:
                raise self.error(f"unbalanced {opener!r}: no matching {stack[-1]!r}", pos)
            char = found.group()
            at = found.start()
            if char == '"':
                tail = _QUOTED_TAIL.match(line, at + 1)
                if tail is None:
                    raise self.error("unterminated string", at)
                index = tail.end()
                continue
            expected = _CLOSER.get(char)
            if expected is not None:
                stack.append(expected)
            elif char == stack[-1]:
                stack.pop()
            else:
                raise self.error(f"unexpected {char!r}, expected {stack[-1]!r}", at)
            index = at + 1
        return index

    def slow_attribute(self, line: str, pos: int) -> tuple[str, str, int]:
        """Read ``, key=value`` whose value mixes bare text and (nested) groups, e.g. ``{{0,1}}``."""
        key_match = _ATTR_KEY.match(line, pos)
        if key_match is None:
            raise self.error("expected ', key=value' after the operands", pos)
        start = index = key_match.end()
        length = len(line)
        while index < length:
            char = line[index]
            if char == ",":
                break
            if char in "({[":
                index = self.skip_group(line, index)
            elif char == '"':
                tail = _QUOTED_TAIL.match(line, index + 1)
                if tail is None:
                    raise self.error("unterminated string", index)
                index = tail.end()
            elif char in ")}]":
                raise self.error(f"unbalanced {char!r}", index)
            else:
                index = _BARE_RUN.match(line, index).end()  # type: ignore[union-attr]  # char is in the class
        value = line[start:index].rstrip()
        if not value:
            raise self.error(f"attribute {key_match.group(1)!r} has no value", start)
        return key_match.group(1), value, index

    def frontend_attributes(self, value: str) -> Mapping[str, str]:
        cached = self.attrs_cache.get(value)
        if cached is None:
            pairs = {_intern(k): _intern(_unquote(v)) for k, v in _KV.findall(value)}
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
        raise HloParseError(f"cannot parse HLO ({detail})", parser.lineno, _snippet(parser.line, None)) from exc
    finally:
        if collecting:
            gc.enable()


# ---------------------------------------------------------------------------
# StableHLO.

_MLIR_FRONTEND_ATTRS = re.compile(
    r"mhlo\.frontend_attributes\s*=\s*\{((?:[^{}\"]++|" + _QUOTED + r")*+)\}"
)
_MLIR_KV = re.compile(r"([\w.$\-]+|" + _QUOTED + r")\s*=\s*(" + _QUOTED + r")")
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
