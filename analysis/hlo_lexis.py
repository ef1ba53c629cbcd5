"""The lexical pieces of HLO text: patterns, tokens and the small readers of strings and shapes.

Every pattern here runs in time linear in the text it is applied to: quantifiers are possessive,
and patterns applied with ``search``/``findall`` start with a literal or guard their first run
with a lookbehind, so that a scan does not re-read a long run from each of its characters. The
whole-line patterns (``FAST_LINE``, ``QUICK_SCAN``) read the common instruction line in one match;
the token patterns serve the tokenising reader (:mod:`.hlo_items`, :mod:`.hlo_instructions`).
The helpers read strings (C escapes), shapes (XLA's printed form) and frontend attributes, and
never raise.
"""

from __future__ import annotations

import functools
import re
import sys
from collections.abc import Callable, Mapping
from types import MappingProxyType

intern: Callable[[str], str] = sys.intern

# One shared, read-only mapping for the (vast majority of) instructions that carry
# no frontend attributes: a dict per instruction would cost ~64 bytes each.
EMPTY_ATTRS: Mapping[str, str] = MappingProxyType({})
NO_NAMES: tuple[str, ...] = ()

# Numbers longer than this are not converted: int() refuses very long digit
# strings, and no line number, id or trip count is that long in a real program.
MAX_INT_DIGITS = 18

# Instructions written in place of operands and inline computations nest by
# recursion; deeper text is refused rather than let Python's stack run out.
MAX_DEPTH = 64


# ---------------------------------------------------------------------------
# Lexical pieces.  Possessive quantifiers keep failing matches linear; patterns
# applied with search/findall start with a literal or guard their first run with
# a lookbehind, so that a scan does not re-read a long run from each of its
# characters.

QUOTED = r'"(?:[^"\\]++|\\(?s:.))*+"'
# The rest of a string after its opening quote (which the lookbehind demands: a scan
# then starts no second read of a string inside the first).
QUOTED_TAIL = re.compile(r'(?<=(?<!\\)")(?:[^"\\]++|\\(?s:.))*+"')
# Characters of a name: no white space, no punctuation of the grammar; no "/" either,
# which would start a comment.
NAME_CHARS = r"[^\s=(){}\[\],\"%/]"
# Not within a name: patterns that start with a name begin only where one can.
NAME_START = r"(?<![^\s=(){}\[\],\"%/])"
# An element type: letters, a width of at most three digits, then the rest of a
# float format's name (f8e4m3fn).  Longer widths are no XLA type.
DTYPE = r"[A-Za-z]++(?:[0-9]{1,3}+(?:[A-Za-z][A-Za-z0-9]*+)?)?"
# An array shape in XLA's printed form (no white space, no comment).
ARRAY = DTYPE + r"\[[^\[\]\s/]*+\](?:\{[^{}\s/]*+\})?"
# Shapes as the whole-line patterns take them: loose (the element type, spaces and
# comments are checked once per distinct shape text, see ``Parser.shape_of``),
# no nested tuple.  Other shapes take the tokenising reader.
LOOSE_SHAPE = r"[A-Za-z][A-Za-z0-9]*\[[^\[\]]*\](?:\{[^{}]*\})?|\((?:[^(){}]++|\{[^{}]*\})*+\)"
# Brace groups nested up to four deep (backend configs' JSON, shardings), quote-aware.
# No "/" outside strings: it could start a comment.
BRACES = r"\{(?:[^{}\"/]++|" + QUOTED + r")*+\}"
for _ in range(3):
    BRACES = r"\{(?:[^{}\"/]++|" + QUOTED + "|" + BRACES + r")*+\}"
# An attribute value: quoted, a brace group, or bare.
VALUE = QUOTED + "|" + BRACES + r"|[^\s,{}()\[\]\"/]++"
ATTR_PAIR = re.compile(r",[ \t]*+([\w.\-]++)[ \t]*+=[ \t]*+(" + VALUE + r")")
GENERIC = r"((?:, (?!frontend_attributes=|metadata=|backend_config=)[\w.\-]+=(?:" + VALUE + r"))*+)"
# The common instruction line in one match, attributes in the order XLA prints
# them: opcode-specific ones, frontend_attributes, metadata, backend_config, rest.
# Exactly ", " between attributes; any other line takes the tokenising reader.
FAST_LINE = re.compile(
    r"(?<![^\n])[ \t]*(ROOT[ \t]+)?%?(" + NAME_CHARS + r"+) = "
    r"(" + LOOSE_SHAPE + r")"
    r" ([A-Za-z][\w\-]*)\(((?:%?" + NAME_CHARS + r"++(?:, ?%?" + NAME_CHARS + r"++)*+)?)\)"
    + GENERIC
    + r"(?:, frontend_attributes=(\{(?:[^{}\"/]++|" + QUOTED + r")*+\}))?"
    r"(?:, metadata=(\{(?:[^{}\"/]++|" + QUOTED + r")*+\}))?"
    r"(?:, backend_config=(" + QUOTED + "|" + BRACES + r"))?"
    + GENERIC
    + r"[ \t\r]*"
)
# The most common line again, narrower, for a scan of the whole text (see
# ``QUICK_SCAN``): operands are plain names, all with ``%`` or all without;
# strings hold no escapes; no backend_config and nothing after the metadata.
# Every line it matches, ``FAST_LINE`` matches with the same groups, and no
# character class crosses a line break.
# ``\s`` spelled out (the same characters): a class of plain characters is one
# table lookup per character, where ``\s`` in a class costs a test of its own.
Q_SPACE = "\\t\\n\\x0b\\x0c\\r\\x1c-\\x20\\x85\\xa0\\u1680\\u2000-\\u200a\\u2028\\u2029\\u202f\\u205f\\u3000"
Q_NAME = "[^" + Q_SPACE + r"=(){}\[\],\"%/]+"
Q_OPERAND = "[^" + Q_SPACE + r"=(){}\[\],\"%/]+"
Q_STRING = r'"[^"\\\n]*+"'
Q_BRACES = r'\{[^{}"\n/]*+(?:' + Q_STRING + r'[^{}"\n/]*+)*+\}'
Q_VALUE = Q_STRING + r'|\{[^{}"\n/]*+\}|[^' + Q_SPACE + r',{}()\[\]"/]++'
# ``[\w\-]*`` (opcodes) as an ASCII run first: the same strings, fewer tests per character.
Q_WORD_DASH = r"[A-Za-z0-9_\-]*+(?:[\w\-][A-Za-z0-9_\-]*+)*+"
QUICK_LINE = (
    r"[ \t]*(ROOT[ \t]+)?%?(" + Q_NAME + r") = "
    r"([A-Za-z][A-Za-z0-9]*\[[^\[\]\n]*\](?:\{[^{}\n]*\})?|\((?:[^(){}\n]++|\{[^{}\n]*\})*+\))"
    r" ([A-Za-z]" + Q_WORD_DASH + r")\("
    r"(?:%(" + Q_OPERAND + r"(?:, %" + Q_OPERAND + r")*+)|(" + Q_OPERAND + r"(?:, " + Q_OPERAND + r")*+))?\)"
    r"((?:, (?!frontend_attributes=|metadata=|backend_config=)[\w.\-]+=(?:" + Q_VALUE + r"))*+)"
    r"(?:, frontend_attributes=(" + Q_BRACES + r"))?"
    r"(?:, metadata=(" + Q_BRACES + r"))?"
    r"[ \t\r]*"
)
# One row per line of the text: the quick line's groups, or the whole line as the last group.
QUICK_SCAN = re.compile(r"^(?:" + QUICK_LINE + r"$|(.*))$", re.MULTILINE)
CALL_KEY = re.compile(
    r"(?:calls|to_apply|body|condition|branch_computations|true_computation|false_computation"
    r"|called_computations|select|scatter|custom_call_target)="
)
NAMES = re.compile(r"[^\s,{}%]+")
KV = re.compile(r"(?<![\w.\-])([\w.\-]++)[ \t]*+=[ \t]*+(" + QUOTED + r"|[^\s,{}\"]*+)")
TRIP_COUNT = re.compile(r'known_trip_count\\*"\s*:\s*\{\s*\\*"n\\*"\s*:\s*\\*"?(\d+)')
SECTION_TITLE = re.compile(r"[A-Z][A-Za-z]*")
# The id that starts a row of a header section ("1 {file_name_id=1 ...}").
ROW_KEY = re.compile(r"(?<![\w.\-])\d++(?=[ \t])")
# A dimension width no element type has (f5000000000000[1]): malformed text.
ABSURD_WIDTH = re.compile(r"(?<![A-Za-z0-9_])[A-Za-z]++[0-9]{4}")

# -- tokens of the tokenising reader (all applied with match at a position) --
# White space and comments; the horizontal form stops at a line break (but reads a
# /* */ comment to its end, wherever that is).  An unclosed comment runs to the end
# of the text (group 2 is then empty, group 1 its "/*"): a scan never re-reads it.
# The outer loop is greedy, not possessive: Python 3.11 misreports groups inside a
# possessive loop; its branches start differently, so it never backtracks anyway.
SKIP = re.compile(r"(?:[ \t\r\n\f\v]++|(/\*)(?:[^*]++|\*(?!/))*+(\*/|\Z)|//[^\r\n]*+)*")
HSKIP = re.compile(r"(?:[ \t\r\f\v]++|(/\*)(?:[^*]++|\*(?!/))*+(\*/|\Z)|//[^\r\n]*+)*")
HSPACE = re.compile(r"[ \t]*+")
NAME_TOKEN = re.compile(r"%?(" + NAME_CHARS + r"++)")
WORD = re.compile(r"[A-Za-z][\w\-]*+")
ROOT_KW = re.compile(r"ROOT(?=[\s%/])")
ENTRY_KW = re.compile(r"ENTRY(?=[\s%/])")
MODULE_KW = re.compile(r"HloModule(?=[\s%/]|\Z)")
MODULE_NAME = re.compile(r"%?([^\s,/=(){}\[\]\"]++)")
ATTR_KEY = re.compile(r"[\w.\-]++")
# Instruction head with a shape in printed form (or none) and a plain opcode.
HEAD = re.compile(
    NAME_START + r"(ROOT[ \t]+)?%?(" + NAME_CHARS + r"++)[ \t]*+=[ \t]*+(?:(" + ARRAY + r")[ \t]+)?([A-Za-z][\w\-]*+)\("
)
# Operand lists of plain names (over lines, too) and single typed operands.
NAME_LIST = re.compile(
    r"\(\s*+((?:%?" + NAME_CHARS + r"++\s*+,\s*+)*+%?" + NAME_CHARS + r"++)?\s*+\)"
)
# A one-line list of operands, typed or not ("f32[2]{0} %a, %b"); the names in one.
OPERAND = r"(?:" + ARRAY + r" )?%?" + NAME_CHARS + r"++"
OPERAND_LIST = re.compile(r"\((?:" + OPERAND + r"(?:, " + OPERAND + r")*+)?\)")
LISTED_NAME = re.compile(r"(?<=[(,])[ ]?(?:" + ARRAY + r" )?%?(" + NAME_CHARS + r"++)")
TYPED_OPERAND = re.compile(NAME_START + r"(?:(" + ARRAY + r")[ \t]+)?%?(" + NAME_CHARS + r"++)[ \t]*+(?=[,)])")
# ", key=value" with a simple value that ends its line or is followed by another attribute.
ATTR_FAST = re.compile(r"(?<![ \t])[ \t]*+,[ \t]*+([\w.\-]++)=(" + VALUE + r")(?=[ \t\r]*+(?:[,\n]|\Z))")
# A bare piece of an attribute value; "=" only in "<=" (replica groups such as [2,4]<=[8]).
BARE = re.compile(r"(?:[^\s,(){}\[\]\"/=<]++|<=?|/(?![/*]))++")
ASSIGN = re.compile(r"(?<![ \t])[ \t]*+=(?!=)")
INSTRUCTION_START = re.compile(NAME_START + r"(?:ROOT\s++)?%?" + NAME_CHARS + r"++\s*+=(?!=)")
GROUP_SPECIAL = re.compile(r'[(){}\[\]"/]')
# Inside a bracket group: plain text and whole strings up to the next bracket or "/"
# (a string's quote must not follow a backslash, so a scan starts no string inside one).
GROUP_RUN = re.compile(r'(?:[^(){}\[\]"/]++|(?<!\\)"(?:[^"\\]++|\\(?s:.))*+")*+')
STRING_OR_SLASH = re.compile(r'["/]')
LINE_END = re.compile(r"[\r\n]")
SPACE_RUN = re.compile(r"\s++")
SHAPE_PUNCT = re.compile(r"[(),\[\]{}]")
FRONTEND_SEPARATOR = re.compile(r"[\s,]*+")
FRONTEND_KEY = re.compile(r"(?<![^\s=,{}\"])([^\s=,{}\"]++)[ \t]*+=[ \t]*+")
FRONTEND_BARE = re.compile(r"[^\s,{}\"]++")

CLOSER = {"(": ")", "[": "]", "{": "}"}
# First characters of white space or a comment: anything else is a token already.
SKIPPABLE = frozenset({" ", "\t", "\r", "\n", "\f", "\v", "/"})

# Opcodes whose parentheses hold a literal, not operand names.
LITERAL_OPCODES = frozenset({"constant", "parameter"})
# Attributes whose value names called computations.
CALL_KEYS = frozenset(
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

C_ESCAPE = re.compile(rb"\\(x[0-9A-Fa-f]{1,2}|[0-7]{1,3}|.)", re.S)
C_SIMPLE = {
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


def c_escape_byte(match: re.Match[bytes]) -> bytes:
    code = match.group(1)
    if code[:1] == b"x":
        return bytes([int(code[1:], 16)])
    if code[:1] in b"01234567" and code[:1]:
        return bytes([int(code, 8) & 0xFF])
    return C_SIMPLE.get(code, b"\\" + code)


def unquote(value: str) -> str:
    """Strip quotes from an HLO string value and undo its C escapes (never raises)."""
    if len(value) >= 2 and value[0] == '"' and value[-1] == '"':
        value = value[1:-1]
    if "\\" not in value:
        return value
    # Escapes denote bytes (octal escapes of UTF-8, say), so decode after unescaping.
    raw = value.encode("utf-8", "surrogatepass")
    return C_ESCAPE.sub(c_escape_byte, raw).decode("utf-8", "replace")


def small_int(digits: str) -> int | None:
    digits = digits.strip()
    if not digits or len(digits) > MAX_INT_DIGITS or not digits.isdigit() or not digits.isascii():
        return None
    return int(digits)


def snippet(line: str, column: int | None, width: int = 160) -> str:
    if len(line) <= width:
        return line
    start = 0 if column is None else max(0, min(column - width // 2, len(line) - width))
    return ("..." if start else "") + line[start : start + width] + ("..." if start + width < len(line) else "")



def strip_comments(value: str) -> str:
    """``value`` without its ``/* */`` and ``//`` comments (quote-aware; never raises)."""
    if "/" not in value:
        return value
    pieces: list[str] = []
    last = index = 0
    length = len(value)
    find = STRING_OR_SLASH.search
    while True:
        found = find(value, index)
        if found is None:
            break
        at = found.start()
        if value[at] == '"':
            tail = QUOTED_TAIL.match(value, at + 1)
            if tail is None:
                break
            index = tail.end()
            continue
        follower = value[at + 1 : at + 2]
        if follower == "*":
            close = value.find("*/", at + 2)
            stop = length if close < 0 else close + 2
        elif follower == "/":
            line_end = LINE_END.search(value, at)
            stop = length if line_end is None else line_end.start()
        else:
            index = at + 1
            continue
        pieces.append(value[last:at])
        last = index = stop
    pieces.append(value[last:])
    return "".join(pieces)


def canonical_shape(raw: str) -> str:
    """A shape's text as XLA prints it: no comments or white space, ", " between tuple elements."""
    if "/" in raw:
        raw = strip_comments(raw)
    compact = SPACE_RUN.sub("", raw) if SPACE_RUN.search(raw) else raw
    if "," not in compact or "(" not in compact:
        return compact
    # Only commas directly inside a tuple's parentheses get a space: not those of
    # dimensions, layouts or tiles (T(8,128)), whose "(" follows a letter or ")".
    pieces: list[str] = []
    tuple_depth: list[bool] = []
    last = 0
    for found in SHAPE_PUNCT.finditer(compact):
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


def shape_ok(shape: str) -> bool:
    """False for a shape whose element type has an absurd width (``f5000000000000[1]``)."""
    return ABSURD_WIDTH.search(shape) is None


def comments_closed(raw: str) -> bool:
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


def balanced_end(text: str, pos: int, stop: int) -> int:
    """Index just past the bracket group opening at ``text[pos]`` (quote-aware), or -1."""
    closers = [CLOSER[text[pos]]]
    index = pos + 1
    search = GROUP_SPECIAL.search
    while closers:
        found = search(text, index, stop)
        if found is None:
            return -1
        char = found.group()
        at = found.start()
        if char == '"':
            tail = QUOTED_TAIL.match(text, at + 1, stop)
            if tail is None:
                return -1
            index = tail.end()
            continue
        if char in "([{":
            closers.append(CLOSER[char])
        elif char == closers[-1]:
            closers.pop()
        elif char != "/":
            return -1
        index = at + 1
    return index


def frontend_pairs(value: str) -> dict[str, str]:
    """The top-level ``key=value`` pairs of a ``frontend_attributes={...}`` text (never raises).

    String values are unquoted; brace values (``composite.attributes={n = 1 : i32}``)
    are kept as their text.
    """
    pairs: dict[str, str] = {}
    stop = len(value) - 1 if value.endswith("}") else len(value)
    index = 1 if value.startswith("{") else 0
    while index < stop:
        index = FRONTEND_SEPARATOR.match(value, index, stop).end()  # type: ignore[union-attr]  # matches empty
        key = FRONTEND_KEY.match(value, index, stop)
        if key is None:
            break
        start = key.end()
        char = value[start : start + 1] if start < stop else ""
        if char == '"':
            tail = QUOTED_TAIL.match(value, start + 1, stop)
            if tail is None:
                break
            pairs[intern(key.group(1))] = intern(unquote(value[start : tail.end()]))
            index = tail.end()
        elif char and char in "{[(":
            end = balanced_end(value, start, stop)
            if end < 0:
                break
            pairs[intern(key.group(1))] = intern(value[start:end])
            index = end
        else:
            bare = FRONTEND_BARE.match(value, start, stop)
            pairs[intern(key.group(1))] = "" if bare is None else intern(bare.group())
            index = start if bare is None else bare.end()
    return pairs


SHAPE_COMMENT = re.compile(r"/\*.*?\*/")


@functools.lru_cache(maxsize=65536)
def tuple_elements(shape: str) -> tuple[str, ...] | None:
    """The element shapes of a tuple shape (``"(f32[2]{0}, (s32[], pred[]))"``); None for an array."""
    text = shape.strip()
    if not text.startswith("("):
        return None
    if "/*" in text:
        text = SHAPE_COMMENT.sub("", text)
    parts: list[str] = []
    depth = 0
    start = 1
    for i, ch in enumerate(text):
        if ch in "([{":
            depth += 1
        elif ch in ")]}":
            depth -= 1
            if depth == 0:
                part = text[start:i].strip()
                if part:
                    parts.append(part)
                break
        elif ch == "," and depth == 1:
            parts.append(text[start:i].strip())
            start = i + 1
    return tuple(parts)
