"""Reading one HLO instruction: its name, shape, opcode, operands and attributes.

:class:`InstructionReader` adds instructions to the item reader (:mod:`.hlo_items`): the head
``[ROOT] name = shape opcode(``, the operand list (plain names, typed operands, or instructions
written in place of an operand, which become instructions of their own named as XLA names them),
and the ``, key=value`` attributes, over as many lines as they take. Of the attributes it keeps
the called computations (written by name or inline, which are read as computations of their
own), the custom-call target, frontend attributes, backend config, trip count and metadata.
Operands written in place and inline computations nest by recursion, at most ``MAX_DEPTH`` deep.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from types import MappingProxyType

from .hlo_items import ItemReader
from .hlo_lexis import (
    ASSIGN,
    ATTR_FAST,
    ATTR_KEY,
    ATTR_PAIR,
    BARE,
    CALL_KEY,
    CALL_KEYS,
    EMPTY_ATTRS,
    HEAD,
    HSPACE,
    INSTRUCTION_START,
    LISTED_NAME,
    LITERAL_OPCODES,
    MAX_DEPTH,
    NAME_LIST,
    NAME_TOKEN,
    NAMES,
    NO_NAMES,
    OPERAND_LIST,
    ROOT_KW,
    TRIP_COUNT,
    TYPED_OPERAND,
    WORD,
    canonical_shape,
    frontend_pairs,
    intern,
    shape_ok,
    small_int,
    strip_comments,
    unquote,
)
from .hlo_model import HloInstruction, HloParseError

__all__ = ["InstructionReader"]


# The reader's state that belongs to the computation being read: saved around an inline
# computation (a body written inside an instruction) and restored after it.
_COMPUTATION_STATE = ("comp_name", "comp_entry", "comp_line", "comp_pos", "instrs", "root", "names", "names_seen", "anon_next")


class InstructionReader(ItemReader):
    """The item reader with instructions: the parts of one instruction and their attributes."""

    def shape_of(self, raw: str, pos: int) -> str:
        """The printed, interned form of the shape text ``raw`` (written at ``pos``)."""
        printed = self.shapes.get(raw)
        if printed is None:
            printed = canonical_shape(raw)
            if not shape_ok(printed):
                raise self.error(f"malformed element type in shape {printed!r}", pos)
            printed = self.shapes[raw] = intern(printed)
        return printed

    def fast_instruction(self, fast: re.Match[str], comp_name: str, pos: int) -> HloInstruction:
        """The instruction of a line ``FAST_LINE`` matches."""
        is_root, name, shape, opcode, args, pre, frontend, metadata, backend, post = fast.groups()
        opcode = intern(opcode)
        if not args or opcode in LITERAL_OPCODES:
            operands = NO_NAMES
        else:
            operands = tuple(map(intern, args.replace("%", "").replace(" ", "").split(",")))
        called = NO_NAMES
        target = None
        if pre or post:
            called, target = self.generic_attributes(pre, post)
        trip = None
        if backend is not None and "known_trip_count" in backend:
            count = TRIP_COUNT.search(backend)
            if count is not None:
                trip = small_int(count.group(1))
        return HloInstruction(
            intern(name),
            opcode,
            self.shape_of(shape, pos),
            operands,
            comp_name,
            called,
            is_root is not None,
            target,
            EMPTY_ATTRS if frontend is None else self.frontend_attributes(frontend),
            backend,
            trip,
            None if metadata is None else intern(metadata),
            self.frames_ref,
        )

    def generic_attributes(self, pre: str | None, post: str | None) -> tuple[tuple[str, ...], str | None]:
        """Called computations and custom-call target among the attributes the fast path leaves as text."""
        called: list[str] = []
        target: str | None = None
        for text in (pre, post):
            if text and CALL_KEY.search(text):
                for key, value in ATTR_PAIR.findall(text):
                    if key in CALL_KEYS:
                        called.extend(map(intern, NAMES.findall(value)))
                    elif key == "custom_call_target":
                        target = intern(unquote(value))
        return (tuple(called) if called else NO_NAMES), target

    def instruction(self, start: int) -> int:
        """Read the instruction at ``start`` into the open computation; return the position after it."""
        text = self.text
        head = HEAD.match(text, start)
        if head is not None:
            is_root = head.group(1) is not None
            name = head.group(2)
            shape = "" if head.group(3) is None else self.shape_of(head.group(3), head.start(3))
            opcode = intern(head.group(4))
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
        root = ROOT_KW.match(text, pos)
        if root is not None:
            after = self.skip(root.end())
            if not text.startswith("=", after):
                is_root = True
                pos = after
        name = NAME_TOKEN.match(text, pos)
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
        word = WORD.match(text, pos)
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
        opcode = WORD.match(text, pos)
        if opcode is None:
            raise self.error("expected an opcode and '('" + (" after the shape" if shape else " after '='"), pos)
        after = self.skip(opcode.end())
        if not text.startswith("(", after):
            raise self.error(f"expected '(' after the opcode {opcode.group()!r}", pos)
        return shape, intern(opcode.group()), after

    def operand_list(self, pos: int, opcode: str, depth: int) -> tuple[tuple[str, ...], int]:
        """Operand names of the list whose "(" is at ``pos``, and the position after its ")"."""
        text = self.text
        if opcode in LITERAL_OPCODES:
            return NO_NAMES, self.group_end(pos)
        plain = NAME_LIST.match(text, pos)
        if plain is not None:
            names = plain.group(1)
            return (tuple(map(intern, NAMES.findall(names))) if names else NO_NAMES), plain.end()
        listed = OPERAND_LIST.match(text, pos)
        if listed is not None:
            return tuple(map(intern, LISTED_NAME.findall(text, pos, listed.end()))), listed.end()
        operands: list[str] = []
        opening = pos
        pos = self.skip(pos + 1)
        if text.startswith(")", pos):
            return NO_NAMES, pos + 1
        typed = TYPED_OPERAND.match
        while True:
            simple = typed(text, pos)
            if simple is not None:
                operands.append(intern(simple.group(2)))
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
        name = NAME_TOKEN.match(text, pos)
        if name is None:
            raise self.error("expected an operand name", pos)
        after = self.skip(name.end())
        if text.startswith("(", after) and name.group()[0] != "%":
            # An instruction written in place of its operand: XLA adds it to the
            # computation under a made-up name.
            if depth >= MAX_DEPTH:
                raise self.error("operands nested too deep", shape_start)
            opcode = intern(name.group(1))
            nested, end = self.operand_list(after, opcode, depth + 1)
            operands.append(self.anonymous(opcode, shape or "", nested))
            return end
        operands.append(intern(name.group(1)))
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
        return intern(name)

    def attributes(self, pos: int, owner: str) -> tuple[list[tuple[str, str]] | None, int]:
        """``, key=value`` pairs from ``pos`` on (over lines, too); the position after the last value.

        ``owner`` names the instruction, for inline computations in its attributes.
        """
        text = self.text
        pairs: list[tuple[str, str]] | None = None
        fast = ATTR_FAST.match
        while True:
            simple = fast(text, pos)
            if simple is not None:
                key, value = simple.group(1), simple.group(2)
                if not (key in CALL_KEYS and value[0] == "{" and "=" in value):
                    if pairs is None:
                        pairs = []
                    pairs.append((key, value))
                    pos = simple.end()
                    continue
            comma = self.skip(pos)
            if not text.startswith(",", comma):
                return pairs, pos
            key_start = self.skip(comma + 1)
            key_match = ATTR_KEY.match(text, key_start)
            if key_match is None:
                raise self.error("expected 'key=value' after ','", comma)
            key = key_match.group()
            equals = self.skip(key_match.end())
            if not text.startswith("=", equals):
                raise self.error(f"expected '=' after the attribute name {key!r}", key_start)
            start = self.skip(equals + 1)
            inline = None
            if key in CALL_KEYS and text.startswith("{", start):
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
                bare = BARE.match(text, pos)
                if bare is None:
                    break
                pos = bare.end()
            after = HSPACE.match(text, pos).end()  # type: ignore[union-attr]  # matches empty
            char = text[after : after + 1]
            if not char or char in ",)]}=\r\n":
                break
            if char not in '([{"':
                bare = BARE.match(text, after)
                if bare is None:
                    break
                # A name and "=" (or ROOT) start the next instruction on the same line.
                if after > pos and (bare.group() == "ROOT" or ASSIGN.match(text, bare.end())):
                    break
            pos = after
        if pos == start:
            raise self.error(f"attribute {key!r} has no value", key_start)
        value = text[start:pos]
        if self.comment_seen:
            value = strip_comments(value)
        return value, pos

    def inline_computations(self, start: int, key: str, owner: str) -> tuple[str, int] | None:
        """Computations written inline as a call attribute's value: their names (as a value) and end.

        ``to_apply={ ... }`` holds one; ``branch_computations={{ ... }, { ... }}`` a list.
        None when the braces hold names (``{%a, %b}``) rather than instructions.
        """
        text = self.text
        inner = self.skip(start + 1)
        if text.startswith("{", inner):
            if not INSTRUCTION_START.match(text, self.skip(inner + 1)):
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
        if not INSTRUCTION_START.match(text, inner):
            return None
        return self.inline_computation(start, f"{owner}.{key}")

    def inline_computation(self, start: int, base: str) -> tuple[str, int]:
        """Read the computation in braces at ``start`` under a made-up name; return it and the end."""
        if self.depth >= MAX_DEPTH:
            raise self.error("inline computations nested too deep", start)
        text = self.text
        name = base
        count = 0
        while name in self.computations:
            count += 1
            name = f"{base}.{count}"
        outer = {field: getattr(self, field) for field in _COMPUTATION_STATE}
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
        for field, value in outer.items():
            setattr(self, field, value)
        return intern(name), pos + 1

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
        attrs = EMPTY_ATTRS
        backend: str | None = None
        trip: int | None = None
        metadata: str | None = None
        if pairs:
            for key, value in pairs:
                if key == "metadata":
                    metadata = value
                elif key == "frontend_attributes":
                    attrs = self.frontend_attributes(value)
                elif key in CALL_KEYS:
                    if called is None:
                        called = []
                    called.extend(map(intern, NAMES.findall(value)))
                elif key == "custom_call_target":
                    custom_target = intern(unquote(value))
                elif key == "backend_config":
                    backend = value
                    if "known_trip_count" in value:
                        count = TRIP_COUNT.search(value)
                        if count is not None:
                            trip = small_int(count.group(1))
        return HloInstruction(
            intern(name),
            opcode,
            shape,
            operands,
            computation,
            NO_NAMES if called is None else tuple(called),
            is_root,
            custom_target,
            attrs,
            backend,
            trip,
            None if metadata is None else intern(metadata),
            self.frames_ref,
        )

    def frontend_attributes(self, value: str) -> Mapping[str, str]:
        cached = self.attrs_cache.get(value)
        if cached is None:
            if len(value) > self.max_attribute_chars:
                raise HloParseError(
                    f"a frontend_attributes value of {len(value)} characters is over the {self.max_attribute_chars}-character limit "
                    "(ejlabel.analysis.hlo.MAX_ATTRIBUTE_CHARS)", 0, value[:60]
                )
            pairs = frontend_pairs(value)
            cached = MappingProxyType(pairs) if pairs else EMPTY_ATTRS
            if len(self.attrs_cache) < 100_000:
                self.attrs_cache[value] = cached
        return cached

