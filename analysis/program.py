"""One reader for every form a program comes in: :class:`Program`.

Every pass of :mod:`ejlabel.analysis` (the call graph, the audit, offline tuning) reads a program
through ``Program.read(x)`` (:func:`read_program`), once, so that they all see the same text.
What is read, for each input:

==============================  ===========================================================
input                           text read
==============================  ===========================================================
``jax.stages.Lowered``          its HLO: ``lowered.compiler_ir("hlo").as_hlo_text()``
``jax.stages.Compiled``         its optimised HLO: ``compiled.as_text()``
HLO text, an HLO file           the text
StableHLO text, a ``.mlir``     converted to HLO by jaxlib's StableHLO → HLO conversion (the
                                one ``compiler_ir("hlo")`` runs), then read as HLO
an XLA dump directory           one file per module: its ``*after_optimizations.txt`` (the
                                HLO XLA compiled), else its ``*before_optimizations.txt`` (the
                                HLO XLA received); never both kinds in one program
                                (``stage="before"`` picks the unoptimised files)
a directory without dump files  every ``*.txt`` / ``*.hlo`` / ``*.mlir`` file, in name order
an ``HloModule``                the parsed module as it is
a ``Program``                   itself
==============================  ===========================================================

Whether a text is HLO or StableHLO is decided by its first token (:func:`.hlo.program_kind`),
never by what it mentions further on. Which files of a directory are read, which ``str`` is a path
and the bounds on reading (regular files only, :data:`MAX_PROGRAM_BYTES` in all, directories
walked within :data:`MAX_DIRECTORY_ENTRIES` entries) are the core's one program reader's
(:mod:`ejlabel.core.program_source`), which the label readers of the core use too: they see the
same files. What a walk passed over is in ``Program.notes``.

Why HLO everywhere: it is the one form with computations (while bodies, branches, fusions) and
named operands, which the call graph walks; reading every form through it makes them agree:
StableHLO and the HLO of the same ``Lowered`` give the same call sites, flops and bytes, and an
XLA dump's ``before_optimizations`` file is that HLO too. If the local jaxlib cannot read a
StableHLO text (written by a newer JAX, say), its labels and call descriptions are still read from
its ``mhlo.frontend_attributes`` (``Program.unread``), and the graph degrades to one node per label.

A program holds, per module, the parsed :class:`~.hlo.HloModule`, the instruction facts the
parser does not keep (:class:`.costs.InstructionFacts`: read from the text, or inferred from
shapes for a module given without text), and, for the whole program, every label in order of first
appearance and each label's call description (the ``ejcall`` attribute next to it; a backward
label ``<op>.bwd@vN`` maps to its forward call's description, which its backward pass shares:
:func:`ejlabel.core.labels.label_table`, the core's rule). ``invocations_from_program`` is the
core's one function (:func:`ejlabel.core.calls.invocations_from_program`), which takes a
``Program`` or any form the reader reads.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from ejlabel.core.calls import CallDecodeError, decode_call, invocations_from_program, rebuild_kernel
from ejlabel.core.labels import label_table
from ejlabel.core.program_source import ProgramReadError, Stage, read_program_source
from ejlabel.utils import files

from .costs import InstructionFacts, infer_facts, read_facts
from .hlo import HloModule, parse_hlo, program_kind, stablehlo_frontend_attributes

__all__ = [
    "MAX_DIRECTORY_ENTRIES",
    "MAX_NESTING",
    "MAX_PROGRAM_BYTES",
    "Program",
    "ProgramModule",
    "ProgramReadError",
    "UnreadModule",
    "bracket_depth",
    "invocations_from_program",
    "note_described_kernels",
    "read_program",
]

#: Most bytes read for one program (one file, or all files of a directory together): the core's
#: ``ejlabel.utils.files.MAX_PROGRAM_BYTES``, rebound here so that this reader's can be set alone.
MAX_PROGRAM_BYTES = files.MAX_PROGRAM_BYTES
#: Most directory entries walked when reading a directory (an XLA dump holds a few per module).
MAX_DIRECTORY_ENTRIES = files.MAX_DIRECTORY_ENTRIES

#: Deepest nesting of brackets (``[ ( { <`` together) in StableHLO text handed to jaxlib's
#: converter. Its parser recurses per level and ends the whole process with a segfault (on an
#: 8 MiB stack: regions nested 900 deep, about 1,800 brackets; ``tuple<`` 4,000 deep; ``[`` 6,733
#: deep); real programs nest tens deep. Deeper text is refused before the converter sees it.
MAX_NESTING = 500

_MLIR_MODULE_NAME = re.compile(r"module\s+@\"?([\w.$\-]+)")


class ProgramModule:
    """One HLO module of a program: the parsed module, where it came from, its instruction facts."""

    __slots__ = ("_facts", "_text", "module", "name", "source")

    def __init__(self, name: str, module: HloModule, source: str, text: str | None) -> None:
        self.name = name  # unique within its program
        self.module = module
        self.source = source  # "Lowered.compiler_ir('hlo')", a file path, "HLO text", ...
        self._text = text
        self._facts: InstructionFacts | None = None

    @property
    def facts(self) -> InstructionFacts:
        """The attributes the parser skips: read from the text, else inferred from shapes."""
        if self._facts is None:
            self._facts = read_facts(self._text) if self._text is not None else infer_facts(self.module)
        return self._facts

    def __repr__(self) -> str:
        return f"ProgramModule({self.name!r}, source={self.source!r})"


@dataclass(frozen=True)
class UnreadModule:
    """A StableHLO module the local jaxlib could not convert: only its labelled ops' attributes."""

    name: str
    source: str
    attributes: tuple[Mapping[str, str], ...]
    reason: str


class Program:
    """A program read once from any form (see the module docstring); passes read it, never the text."""

    def __init__(
        self,
        modules: Iterable[ProgramModule],
        origin: str,
        unread: Iterable[UnreadModule] = (),
        notes: Iterable[str] = (),
    ) -> None:
        self.modules = tuple(modules)
        self.unread = tuple(unread)
        self.origin = origin  # "lowered", "compiled", "text", "file", "dump", "module"
        self.notes = tuple(notes)  # what was skipped, and why

    @classmethod
    def read(cls, x: Any, *, stage: Stage = "after") -> Program:
        """Read ``x`` (see the module docstring); ``stage`` picks a dump's files."""
        return read_program(x, stage=stage)

    @property
    def degraded(self) -> bool:
        """Whether some module could only be read for its labels (see :class:`UnreadModule`)."""
        return bool(self.unread)

    @functools.cached_property
    def _label_table(self) -> tuple[tuple[str, ...], dict[str, str]]:
        return label_table(self._attribute_dicts())

    def _attribute_dicts(self) -> Iterable[Mapping[str, str]]:
        for pm in self.modules:
            for comp in pm.module.computations.values():
                for instr in comp.instructions:
                    if instr.frontend_attributes:
                        yield instr.frontend_attributes
        for unread in self.unread:
            yield from unread.attributes

    @property
    def labels(self) -> tuple[str, ...]:
        """Every distinct label, in order of first appearance (modules in order, text order)."""
        return self._label_table[0]

    @property
    def descriptions(self) -> Mapping[str, str]:
        """Each label's encoded call description (``ejcall``); backward labels share their forward's."""
        return self._label_table[1]

    def __repr__(self) -> str:
        names = [pm.name for pm in self.modules] + [f"{u.name} (unread)" for u in self.unread]
        return f"Program(origin={self.origin!r}, modules={names})"


def read_program(x: Any, *, stage: Stage = "after") -> Program:
    """Read ``x`` once into a :class:`Program` (see the module docstring for what is read)."""
    if stage not in ("after", "before"):
        raise ValueError(f"stage: expected 'after' or 'before', got {stage!r}")
    if isinstance(x, Program):
        return x
    reader = _Reader()
    if isinstance(x, HloModule):
        reader.add_module(x, "parsed HloModule", None)
        return reader.program("module", ())
    source = read_program_source(
        x,
        stage=stage,
        lowered_form="hlo",
        max_bytes=MAX_PROGRAM_BYTES,
        max_entries=MAX_DIRECTORY_ENTRIES,
        also_accepted=", an HloModule or a Program",
    )
    for piece in source.texts:
        reader.add_text(piece.text, piece.source)
    return reader.program(source.origin, source.notes)


class _Reader:
    """Collects the modules of one program; names them uniquely."""

    def __init__(self) -> None:
        self.modules: list[ProgramModule] = []
        self.unread: list[UnreadModule] = []
        self.notes: list[str] = []
        self.taken: dict[str, int] = {}

    def program(self, origin: str, notes: Iterable[str]) -> Program:
        return Program(self.modules, origin, self.unread, [*notes, *self.notes])

    def unique(self, name: str) -> str:
        count = self.taken.get(name, 0) + 1
        self.taken[name] = count
        return name if count == 1 else f"{name}.{count}"

    def add_module(self, module: HloModule, source: str, text: str | None) -> None:
        self.modules.append(ProgramModule(self.unique(module.name or "module"), module, source, text))

    def add_text(self, text: str, source: str) -> None:
        if program_kind(text) == "stablehlo":
            self.add_stablehlo(text, source)
        else:
            self.add_module(parse_hlo(text), source, text)

    def add_stablehlo(self, text: str, source: str) -> None:
        depth, at = bracket_depth(text)
        if depth > MAX_NESTING:
            line = text.count("\n", 0, at) + 1
            raise ProgramReadError(
                f"x: {source} nests brackets {depth} deep (line {line}), more than the {MAX_NESTING} levels handed to "
                "jaxlib's StableHLO converter (ejlabel.analysis.program.MAX_NESTING), which would end the process"
            )
        try:
            hlo = _stablehlo_to_hlo(text)
        except Exception as err:  # noqa: BLE001 - any failure of the converter: read the attributes only
            found = _MLIR_MODULE_NAME.search(text)
            name = self.unique(found.group(1) if found else "module")
            reason = f"jaxlib could not convert this StableHLO to HLO ({type(err).__name__}: {str(err)[:200]})"
            self.unread.append(UnreadModule(name, source, tuple(stablehlo_frontend_attributes(text)), reason))
            self.notes.append(f"{source}: {reason}; its labels are read, its structure is not")
            return
        self.add_module(parse_hlo(hlo), f"{source} (StableHLO, converted to HLO)", hlo)


def note_described_kernels(program: Program) -> None:
    """Make an instance of each kernel the program's call descriptions name (of those registered
    here), so that the registry knows which config types each op id takes before any config is
    looked up for it (:func:`ejlabel.core.registry.config_type_problem`).

    Without it a kernel defined in a module given by ``--import`` is known as a class but not by
    its op id, and a cached entry of another kernel's type under its key would pass as tuned,
    while the running program refuses it and never tunes the call.
    """
    seen: set[tuple[str | None, str, str]] = set()
    for lab, text in program.descriptions.items():
        try:
            desc = decode_call(text, lab)
            if (desc.kernel, desc.op_id, desc.version) not in seen:
                seen.add((desc.kernel, desc.op_id, desc.version))
                rebuild_kernel(desc)  # Kernel.__init__ records the op id with its config types
        except CallDecodeError:
            continue  # a kernel not registered here: nothing is known of its configs


_BRACKET_STEP = np.zeros(256, np.int8)
_BRACKET_STEP[list(b"[({<")] = 1
_BRACKET_STEP[list(b"])}>")] = -1
_SCAN_CHUNK = 1 << 24


def bracket_depth(text: str) -> tuple[int, int]:
    """The deepest nesting of brackets in ``text`` and the character offset where it is reached.

    ``[ ( { <`` open and ``] ) } >`` close, whatever their kinds (MLIR's parser recurses into
    each); the ``>`` of ``->`` closes nothing. The count never goes below zero, so closing
    brackets (in a string, say) cannot hide the openers after them. Brackets inside strings count
    too: real programs keep them balanced there, so the bound only errs towards refusing hostile
    text. Vectorised over the UTF-8 bytes, in chunks: linear in the text, and quick.
    """
    data = np.frombuffer(text.encode("utf-8", "surrogatepass"), np.uint8)
    deepest = deepest_at = 0
    total = floor = 0  # the running sum of opens and closes, and its lowest value so far (<= 0)
    for start in range(0, len(data), _SCAN_CHUNK):
        chunk = data[start : start + _SCAN_CHUNK]
        steps = np.take(_BRACKET_STEP, chunk)
        where = np.flatnonzero(steps)
        if not where.size:
            continue
        step = steps[where].astype(np.int64)
        before = data[np.maximum(where + start - 1, 0)]
        step[(chunk[where] == ord(">")) & (before == ord("-")) & (where + start > 0)] = 0
        sums = np.cumsum(step) + total
        floors = np.minimum(np.minimum.accumulate(sums), floor)
        depth = sums - floors  # the walk reflected at zero: the depth, never negative
        i = int(np.argmax(depth))
        if depth[i] > deepest:
            deepest, deepest_at = int(depth[i]), start + int(where[i])
        total, floor = int(sums[-1]), int(floors[-1])
    return deepest, deepest_at


def _stablehlo_to_hlo(text: str) -> str:
    """StableHLO text → HLO text, by the conversion ``Lowered.compiler_ir("hlo")`` runs."""
    # jaxlib's converter is not public API; the one stable way in is the module JAX itself uses.
    from jax._src.lib import _jax

    return _jax.mlir.mlir_module_to_xla_computation(text, use_tuple_args=False, return_tuple=False).as_hlo_text()
