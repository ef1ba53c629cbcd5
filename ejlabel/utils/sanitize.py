"""One sanitizer for every string from data before it is shown: terminal, Markdown or DOT.

Device names, op ids, provenances and config types in a cache file, keyword names in a call
description, file names in a dump folder: all of it is data from elsewhere, and all of it ends up
printed (``ejlabel cache ls``, ``audit``, error messages), written into a Markdown report or into
a DOT file that Graphviz renders. A control character in such a string is an instruction to
whatever displays it: ``ESC [2J`` clears the screen, ``ESC ] 0;...BEL`` sets the window title,
``ESC ] 52;...`` writes the clipboard, a carriage return overwrites the line already printed, and
Unicode's bidirectional overrides show text in another order than it is stored in. So every such
string goes through :func:`sanitize` first, which makes it inert for the place it goes:

``"terminal"``
    Every control character (C0, DEL, C1), every bidirectional control and the Unicode line and
    paragraph separators is written as Python writes it in a string literal (``\\x1b``,
    ``\\u202e``), so it shows as what it is. Line breaks and tabs too, unless ``multiline``: one
    line of output (a table cell, an error message) stays one line.
``"markdown"``
    The terminal form of the text, then what Markdown and the HTML it allows would act on:
    backslash, ``|`` (a table column), the backtick (code spans), the ``(`` that would make
    ``[text](url)`` a link or an image (an image is fetched when the report is viewed) and HTML
    (``< > &``) are escaped, and line breaks become spaces, so the text is one table cell that
    reads as itself. Brackets alone (``f32[8,16]``) and emphasis characters are left as they are:
    they cannot reach outside the cell.
``"dot"``
    The terminal form (the escape codes survive into an SVG's ``<text>`` otherwise), then what a
    DOT double-quoted string would act on: backslash (``\\N``, ``\\G`` and the like name the node
    or graph) and the double quote; line breaks become DOT's ``\\n``. The result goes between the
    quotes.

The function never raises on its input: anything that is not a ``str`` is shown through ``str()``.
"""

from __future__ import annotations

import re
from typing import Literal

__all__ = ["Context", "sanitize"]

Context = Literal["terminal", "markdown", "dot"]

# Bidirectional controls (LRM, RLM, ALM, the embeddings and overrides, the isolates) and the
# Unicode line and paragraph separators: not control characters by category, but they change how
# the text around them is shown.
_REORDERING = "\u061c\u200e\u200f\u202a-\u202e\u2066-\u2069\u2028\u2029"
_UNSAFE = re.compile(f"[\x00-\x1f\x7f-\x9f{_REORDERING}]")
_UNSAFE_BUT_LINES = re.compile(f"[\x00-\x08\x0b-\x1f\x7f-\x9f{_REORDERING}]")
_NAMED = {"\n": "\\n", "\r": "\\r", "\t": "\\t"}
_MARKDOWN_SPECIAL = re.compile(r"[\\|`<>&]|(?<=\])\(")
_MARKDOWN_ENTITIES = {"<": "&lt;", ">": "&gt;", "&": "&amp;"}


def _escape(match: re.Match[str]) -> str:
    char = match.group()
    named = _NAMED.get(char)
    if named is not None:
        return named
    code = ord(char)
    return f"\\x{code:02x}" if code < 0x100 else f"\\u{code:04x}"


def sanitize(text: object, context: Context = "terminal", *, multiline: bool = False) -> str:
    """``text`` made inert for ``context`` (see the module docstring); never raises.

    Args:
      text: the string from data (anything else is shown as its ``str()``).
      context: where it goes: ``"terminal"``, ``"markdown"`` (one table cell or inline text) or
        ``"dot"`` (the inside of a DOT double-quoted string).
      multiline: keep line breaks and tabs (terminal only: a block of several lines).
    """
    if not isinstance(text, str):
        try:
            text = str(text)
        except Exception as err:  # noqa: BLE001 - a __str__ from data that fails still shows something
            text = f"<unprintable {type(text).__name__}: {type(err).__name__}>"
    if context == "terminal":
        return (_UNSAFE_BUT_LINES if multiline else _UNSAFE).sub(_escape, text)
    if context == "markdown":
        flat = text.replace("\r\n", " ").replace("\n", " ").replace("\r", " ")
        shown = _UNSAFE.sub(_escape, flat)
        return _MARKDOWN_SPECIAL.sub(lambda m: _MARKDOWN_ENTITIES.get(m.group()) or "\\" + m.group(), shown)
    if context == "dot":
        lines = text.replace("\r\n", "\n").replace("\r", "\n").split("\n")
        quoted = [_UNSAFE.sub(_escape, line).replace("\\", "\\\\").replace('"', '\\"') for line in lines]
        return "\\n".join(quoted)
    raise ValueError(f"context: expected 'terminal', 'markdown' or 'dot', got {context!r}")
