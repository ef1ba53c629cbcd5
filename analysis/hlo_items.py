"""The tokenising reader of HLO text: its position, errors and the items of a module.

:class:`ItemReader` reads text item by item: the ``HloModule`` header, header sections
(``FileNames``, ``StackFrames``, ...), computation headers and their closing braces; instructions
are read by :class:`~.hlo_instructions.InstructionReader`, which builds on it. It keeps the state
of one parse (the open computation, the module's computations, the ``StackFrames`` tables), turns
positions into line numbers incrementally, and checks what XLA checks of a computation's names
(defined once, operands defined before their use). Nothing here recurses: bracket groups are
matched with an explicit stack.
"""

from __future__ import annotations

import re
from collections.abc import Mapping

from .hlo_async import unfold_async
from .hlo_lexis import (
    CLOSER,
    ENTRY_KW,
    FAST_LINE,
    GROUP_RUN,
    HSKIP,
    LINE_END,
    MODULE_KW,
    MODULE_NAME,
    NAME_TOKEN,
    QUOTED_TAIL,
    ROOT_KW,
    ROW_KEY,
    SECTION_TITLE,
    SKIP,
    SKIPPABLE,
    KV,
    comments_closed,
    intern,
    small_int,
    snippet,
    unquote,
)
from .hlo_model import Frames, HloComputation, HloInstruction, HloModule, HloParseError

__all__ = ["ItemReader", "Restart"]


class Restart(Exception):
    """The quick scan met text it leaves to the tokenising reader alone."""


class ItemReader:
    """Reads one text; ``where`` is the position errors of unexpected kinds are reported at.

    The items of a module are read here; instructions by the subclass that adds them
    (:meth:`instruction`, :meth:`fast_instruction`, :meth:`attributes`).
    """

    def __init__(self, text: str, max_attribute_chars: int) -> None:
        self.text = text
        self.max_attribute_chars = max_attribute_chars
        # Opcode -> its kind of XLA's async shorthand (hlo_async), memoised per parse.
        self.async_kinds: dict[str, str] = {}
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
        self.frames = Frames()
        self.frames_shared = False
        self.late = Frames()
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
        return HloParseError(message, self.text.count("\n", 0, pos) + 1, snippet(line, column), column)

    # -- drivers -----------------------------------------------------------


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
            fast = FAST_LINE.fullmatch(text, pos, eol)
            if fast is not None and "/" in fast.group(3) and not comments_closed(fast.group(3)):
                fast = None
            if fast is not None and not self.continued(eol):
                self.add(self.fast_instruction(fast, comp_name, pos))
                return min(eol + 1, n)
        first = True
        while True:
            pos = self.skip(pos, HSKIP)
            if pos >= n or text[pos] == "\n":
                return min(pos + 1, n)
            if first and text[pos] == "#":
                # "#" comment lines: a leftover of older dumps, not XLA's grammar.
                line_end = text.find("\n", pos)
                return n if line_end < 0 else line_end + 1
            first = False
            self.where = pos
            pos = self.item(pos)

    def skip(self, pos: int, skipper: re.Pattern[str] = SKIP) -> int:
        """Position of the next token at or after ``pos`` (past white space and comments)."""
        if self.text[pos : pos + 1] not in SKIPPABLE:
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
                raise Restart
            raise self.error("unexpected ',' (no attribute list to go on with)", pos)
        return self.instruction(pos)

    def top_item(self, pos: int) -> int:
        text = self.text
        module = MODULE_KW.match(text, pos)
        if module is not None:
            return self.module_header(pos, module.end())
        entry = ENTRY_KW.match(text, pos)
        start = self.skip(entry.end()) if entry is not None else pos
        name = NAME_TOKEN.match(text, start)
        if name is None:
            raise self.error("unexpected text outside of a computation", pos)
        after = self.skip(name.end())
        char = text[after : after + 1]
        if char == "{" or char == "(" or text.startswith("->", after):
            return self.computation_header(pos, entry is not None, name.group(1), after)
        if entry is None and name.group()[0] != "%" and SECTION_TITLE.fullmatch(name.group(1)):
            # A header section: its title alone on its line, or followed by rows.
            end = self.skip(name.end(), HSKIP)
            if end >= self.n or text[end] == "\n" or ROW_KEY.match(text, after):
                return self.section(name.group(1), name.end())
        if char == "=" or ROOT_KW.match(text, pos):
            raise self.error("instruction outside of a computation", pos)
        raise self.error("unexpected text outside of a computation", pos)

    def module_header(self, pos: int, end: int) -> int:
        if self.module_name is not None:
            raise self.error("second HloModule header (one module per text)", pos)
        start = self.skip(end)
        name = MODULE_NAME.match(self.text, start)
        if name is None:
            raise self.error("malformed HloModule header", pos)
        module_name = name.group(1)
        # XLA's own tests write "HloModule name:"; the colon is no part of the name.
        if module_name.endswith(":") and len(module_name) > 1:
            module_name = module_name[:-1]
        self.module_name = intern(module_name)
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
        self.comp_name = intern(name)
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
        unfold_async(self.computations, name, instrs, self.async_kinds)
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
            key = ROW_KEY.match(text, row)
            if key is None:
                return end
            start = self.skip(key.end(), HSKIP)
            char = text[start : start + 1]
            if char == '"':
                end = self.string_end(start)
            elif char == "{":
                end = self.group_end(start)
            elif ours:
                raise self.error(f"malformed row in section {title}", row)
            else:
                # Rows of sections we do not know may have another form: the rest of the line.
                line_end = LINE_END.search(text, start)
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
            frames.file_names[key] = unquote(value)
        elif section == "FileLocations":
            fields = dict(KV.findall(value))
            frames.file_locations[key] = (fields.get("file_name_id", ""), small_int(fields.get("line", "")))
        else:
            fields = dict(KV.findall(value))
            frames.stack_frames[key] = fields.get("file_location_id", "")

    # -- instructions ------------------------------------------------------


    def string_end(self, pos: int) -> int:
        """Index just past the string whose quote is at ``pos``."""
        tail = QUOTED_TAIL.match(self.text, pos + 1)
        if tail is None:
            raise self.error("unterminated string", pos)
        return tail.end()

    def group_end(self, pos: int) -> int:
        """Index just past the bracket group opening at ``text[pos]`` (string- and comment-aware, iterative)."""
        text = self.text
        n = self.n
        opener = text[pos : pos + 1]
        closer = CLOSER.get(opener)
        if closer is None:
            raise self.error("expected '(', '[' or '{'", pos)
        stack = [closer]
        run = GROUP_RUN.match
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
                    line_end = LINE_END.search(text, index)
                    index = n if line_end is None else line_end.start()
                    self.comment_seen = True
                else:
                    index += 1
                continue
            expected = CLOSER.get(char)
            if expected is not None:
                stack.append(expected)
            elif char == stack[-1]:
                stack.pop()
                if not stack:
                    return index + 1
            else:
                raise self.error(f"unexpected {char!r}, expected {stack[-1]!r}", index)
            index += 1


    # -- read by the instruction reader ---------------------------------------

    def instruction(self, start: int) -> int:
        """Read the instruction at ``start``; the position after it (see the subclass)."""
        raise NotImplementedError

    def fast_instruction(self, fast: re.Match[str], comp_name: str, pos: int) -> HloInstruction:
        """The instruction of a line ``FAST_LINE`` matches (see the subclass)."""
        raise NotImplementedError

    def attributes(self, pos: int, owner: str) -> tuple[list[tuple[str, str]] | None, int]:
        """``, key=value`` pairs from ``pos`` on; the position after the last (see the subclass)."""
        raise NotImplementedError
