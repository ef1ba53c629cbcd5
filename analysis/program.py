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

from ejlabel.core.calls import invocations_from_program
from ejlabel.core.labels import label_table
from ejlabel.core.program_source import ProgramReadError, Stage, read_program_source
from ejlabel.utils import files

from .costs import InstructionFacts, infer_facts, read_facts
from .hlo import HloModule, parse_hlo, program_kind, stablehlo_frontend_attributes

__all__ = [
    "MAX_DIRECTORY_ENTRIES",
    "MAX_PROGRAM_BYTES",
    "Program",
    "ProgramModule",
    "ProgramReadError",
    "UnreadModule",
    "invocations_from_program",
    "read_program",
]

#: Most bytes read for one program (one file, or all files of a directory together): the core's
#: ``ejlabel.utils.files.MAX_PROGRAM_BYTES``, rebound here so that this reader's can be set alone.
MAX_PROGRAM_BYTES = files.MAX_PROGRAM_BYTES
#: Most directory entries walked when reading a directory (an XLA dump holds a few per module).
MAX_DIRECTORY_ENTRIES = files.MAX_DIRECTORY_ENTRIES

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


def _stablehlo_to_hlo(text: str) -> str:
    """StableHLO text → HLO text, by the conversion ``Lowered.compiler_ir("hlo")`` runs."""
    # jaxlib's converter is not public API; the one stable way in is the module JAX itself uses.
    from jax._src.lib import _jax

    return _jax.mlir.mlir_module_to_xla_computation(text, use_tuple_args=False, return_tuple=False).as_hlo_text()
