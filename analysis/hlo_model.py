"""The parsed HLO program: modules, computations and instructions, and the parse error.

What the tolerant reader keeps of a program (:mod:`.hlo`): per instruction its name, opcode,
shape as XLA prints it, operand names, called computations, custom-call target, frontend
attributes, backend config and trip count, and its metadata as raw text, read (with the module's
``StackFrames`` tables) only when ``op_name``/``source_file``/``source_line`` is first asked for.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field

from .hlo_lexis import EMPTY_ATTRS, KV, NO_NAMES, intern, small_int, unquote

__all__ = ["Frames", "HloComputation", "HloInstruction", "HloModule", "HloParseError"]


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


class Frames:
    """The module's ``FileNames`` / ``FileLocations`` / ``StackFrames`` tables, shared by its instructions."""

    __slots__ = ("file_names", "file_locations", "stack_frames", "cache")

    def __init__(self) -> None:
        self.file_names: dict[str, str] = {}
        self.file_locations: dict[str, tuple[str, int | None]] = {}
        self.stack_frames: dict[str, str] = {}
        self.cache: dict[str, tuple[str | None, int | None]] = {}

    def copy(self) -> Frames:
        other = Frames()
        other.file_names = dict(self.file_names)
        other.file_locations = dict(self.file_locations)
        other.stack_frames = dict(self.stack_frames)
        return other

    def adopt(self, other: Frames) -> None:
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
                cached = (None if file_name is None else intern(file_name), location[1])
            self.cache[frame_id] = cached
        return cached


def read_metadata(value: str) -> tuple[str | None, str | None, int | None, str | None]:
    """``op_name``, ``source_file``, ``source_line`` and ``stack_frame_id`` of a metadata text (never raises)."""
    fields = dict(KV.findall(value))
    op_name = fields.get("op_name")
    source_file = fields.get("source_file")
    return (
        None if op_name is None else intern(unquote(op_name)),
        None if source_file is None else intern(unquote(source_file)),
        small_int(fields.get("source_line", "")),
        fields.get("stack_frame_id"),
    )


NO_LOCATION = (None, None, None)


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
    called_computations: tuple[str, ...] = NO_NAMES
    is_root: bool = False
    custom_call_target: str | None = None
    frontend_attributes: Mapping[str, str] = field(default_factory=lambda: EMPTY_ATTRS)
    backend_config: str | None = None
    known_trip_count: int | None = None
    metadata: str | None = None
    _frames: Frames | None = field(default=None, repr=False)
    _location: tuple[str | None, str | None, int | None] | None = field(default=None, repr=False)

    def _located(self) -> tuple[str | None, str | None, int | None]:
        location = self._location
        if location is None:
            if self.metadata is None:
                location = NO_LOCATION
            else:
                op_name, source_file, source_line, frame = read_metadata(self.metadata)
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
