"""The HLO parser's two drivers: the quick scan of whole chunks, and the line-by-line reader.

The reader runs in time and memory linear in the text. The common instruction line (plain
operand names, simple attributes, frontend attributes and metadata) is read by one regular
expression (``QUICK_SCAN``) applied to whole chunks of the text, one row per line
(:meth:`Parser.run_quick`). Any other line is handed to the tokenising reader
(:meth:`~.hlo_items.ItemReader.slow_from`), which first tries a wider one-line pattern
(``FAST_LINE``: untyped operands, nested JSON configs) and otherwise reads token by token the
items that start on that line, however many lines they take; it hands back the position of the
next line, where the chunk scan resumes (with a small chunk after a multi-line item, doubling
again, so that text scanned twice stays within a small factor of the text read). Lines the chunk
pattern reads are complete: it admits no unclosed bracket, string or comment, and an instruction
that goes on with a ``,`` on a later line sends the whole text to the tokenising reader alone
(:meth:`Parser.run_lines`), which reads the same module, only slower. Metadata is kept as its raw
text; repeated strings are interned or shared, and instructions without attributes share one
empty mapping.
"""

from __future__ import annotations

from .hlo_instructions import InstructionReader
from .hlo_items import Restart
from .hlo_lexis import intern as intern_text
from .hlo_lexis import (
    CALL_KEY,
    EMPTY_ATTRS,
    LITERAL_OPCODES,
    NO_NAMES,
    QUICK_SCAN,
    canonical_shape,
    comments_closed,
    shape_ok,
)
from .hlo_model import HloInstruction, HloModule, HloParseError

__all__ = ["Parser"]

# Characters per chunk of the quick scan: bounds the rows held at once.
CHUNK_CHARS = 1 << 18
# Chunk size after an item that ran over several lines: the rows scanned past it
# are scanned again, so the next chunk starts small (a line or two) and doubles
# while none does; the text scanned twice stays within a small factor of the text read.
RESCAN_CHARS = 1 << 8
# Distinct metadata (and other attribute) texts the quick scan keeps before it starts afresh.
SHARED_TEXTS = 100_000


class Parser(InstructionReader):
    """Reads one text into a module: :meth:`run_quick`, or :meth:`run_lines` where it restarts.

    :meth:`run_quick` reads the common instruction line (``QUICK_LINE``) straight from chunks of
    the text and hands every other line to :meth:`slow_from`, the tokenising reader;
    :meth:`run_lines` hands it every line. Both build the same module, and the quick scan
    restarts as :meth:`run_lines` where only the tokenising reader knows what to report.
    """

    def run_quick(self) -> HloModule:
        self.quick = True
        text = self.text
        n = self.n
        pos = 0
        lineno = 0
        chunk = CHUNK_CHARS
        scan = QUICK_SCAN.findall
        find = text.find
        comp_name = self.comp_name
        append = self.instrs.append
        root = self.root
        frames_ref = self.frames_ref
        slow_from = self.slow_from
        make_tuple = tuple
        literal_opcodes = LITERAL_OPCODES
        call_key = CALL_KEY.search
        generic_attributes = self.generic_attributes
        frontend_attributes = self.frontend_attributes
        intern = intern_text
        empty = EMPTY_ATTRS
        no_names = NO_NAMES
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
                            raise Restart
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
                            if "/" in shape and not comments_closed(shape):
                                raise Restart
                            printed = canonical_shape(shape)
                            if not shape_ok(printed):
                                raise Restart
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
                    chunk = RESCAN_CHARS
                else:
                    pos = stop + 1
                    chunk = min(chunk * 2, CHUNK_CHARS)
                if len(seen) > SHARED_TEXTS:
                    seen.clear()
                if len(attribute_cache) > SHARED_TEXTS:
                    attribute_cache.clear()
        except (HloParseError, Restart):
            raise
        except Exception as exc:
            # The tokenising reader alone reports the line (or finds nothing wrong).
            raise Restart from exc
        if lineno != text.count("\n") + 1:
            raise Restart
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
        raise Restart

    def run_lines(self) -> HloModule:
        self.quick = False
        pos = 0
        n = self.n
        slow_from = self.slow_from
        while pos < n:
            pos = slow_from(pos)
        return self.finish()

