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
never by what it mentions further on. A path is a ``str`` or ``os.PathLike`` naming an existing
file or directory, or ending in ``.txt``, ``.hlo``, ``.mlir`` or ``/`` (a missing one is a
``FileNotFoundError``); a ``str`` holding a line break is always text.

Reading is bounded, because program files and dump directories come from elsewhere: only regular
files are read (a FIFO, a device such as ``/dev/zero`` or a socket is refused at once, before it is
opened, and checked again on the open descriptor); a program reads at most
:data:`MAX_PROGRAM_BYTES` in all (each file in chunks, so a file that grows stops at the cap); a
directory is walked without following symlinked directories and refused past
:data:`MAX_DIRECTORY_ENTRIES` entries. Special files inside a directory are skipped with a note.

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
label ``<op>.bwd@vN`` maps to its forward call's description, which its backward pass shares).
"""

from __future__ import annotations

import functools
import os
import re
import stat
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import jax

from ejlabel.utils import files
from ejlabel.utils.files import FileTooLargeError, SpecialFileError, file_kind, read_regular_file
from ejlabel.core import calls
from ejlabel.core.kernel import Invocation
from ejlabel.core.label_format import (
    CALL_ATTRIBUTE,
    LABEL_ATTRIBUTE,
    LABEL_RE,
    forward_op_id,
    is_backward,
    parse_label,
)

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

#: Most bytes read for one program (one file, or all files of a directory together); the one
#: value is ``ejlabel.utils.files.MAX_PROGRAM_BYTES``, rebound here so it can be set per reader.
MAX_PROGRAM_BYTES = files.MAX_PROGRAM_BYTES
#: Most directory entries walked when reading a directory (an XLA dump holds a few per module).
MAX_DIRECTORY_ENTRIES = 100_000

Stage = Literal["after", "before"]
_PROGRAM_SUFFIXES = (".txt", ".hlo", ".mlir")
_DUMP_MODULE = re.compile(r"(module_\d+)")
_MLIR_MODULE_NAME = re.compile(r"module\s+@\"?([\w.$\-]+)")


class ProgramReadError(ValueError):
    """A program path that is not read: a special file, too large, or a directory too big to walk."""


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
        labels: dict[str, None] = {}
        found: dict[str, str] = {}
        for attrs in self._attribute_dicts():
            lab = attrs.get(LABEL_ATTRIBUTE)
            if lab is None or not _is_label(lab):
                continue
            labels[lab] = None
            call = attrs.get(CALL_ATTRIBUTE)
            if call and lab not in found:
                found[lab] = call
        for lab in labels:
            if lab not in found:
                op_id, _ = parse_label(lab)
                if is_backward(op_id):
                    forward = lab.replace(op_id, forward_op_id(op_id), 1)
                    if forward in found:
                        found[lab] = found[forward]
        return tuple(labels), found

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


@functools.lru_cache(maxsize=65536)
def _is_label(value: str) -> bool:
    return LABEL_RE.fullmatch(value) is not None


def read_program(x: Any, *, stage: Stage = "after") -> Program:
    """Read ``x`` once into a :class:`Program` (see the module docstring for what is read)."""
    if stage not in ("after", "before"):
        raise ValueError(f"stage: expected 'after' or 'before', got {stage!r}")
    if isinstance(x, Program):
        return x
    reader = _Reader()
    if isinstance(x, HloModule):
        reader.add_module(x, "parsed HloModule", None)
        return reader.program("module")
    if isinstance(x, jax.stages.Lowered):
        hlo = x.compiler_ir("hlo")
        if hlo is not None:
            reader.add_text(hlo.as_hlo_text(), "Lowered.compiler_ir('hlo')")
        else:  # a backend without an HLO form: its StableHLO, converted
            reader.add_text(_text_of(x), "Lowered.as_text()")
        return reader.program("lowered")
    if isinstance(x, jax.stages.Compiled):
        reader.add_text(_text_of(x), "Compiled.as_text()")
        return reader.program("compiled")
    if isinstance(x, (bytes, bytearray, memoryview)):
        x = bytes(x).decode("utf-8", "replace")
    if isinstance(x, os.PathLike) or (isinstance(x, str) and _names_a_path(x)):
        path = Path(x)
        try:
            mode = os.stat(path).st_mode  # follows symlinks; never opens (a FIFO would block)
        except FileNotFoundError:
            raise FileNotFoundError(f"x: no such file or directory: {path}") from None
        except OSError as err:
            raise ProgramReadError(f"x: cannot read {path}: {err.strerror or err}") from None
        if stat.S_ISDIR(mode):
            reader.add_directory(path, stage)
            return reader.program("dump" if reader.dump else "directory")
        if not stat.S_ISREG(mode):
            raise ProgramReadError(f"x: {path} is {file_kind(mode)}, not a program file or dump directory (special files are never read)")
        reader.add_text(reader.read_file(path), str(path))
        return reader.program("file")
    if isinstance(x, str):
        reader.add_text(x, "text")
        return reader.program("text")
    raise TypeError(
        "x: expected a Lowered, a Compiled, HLO or StableHLO text, a path to a program file or XLA "
        f"dump directory, an HloModule or a Program, got {type(x).__name__}"
    )


def _text_of(x: Any) -> str:
    text = x.as_text()
    if text is None:
        raise ValueError(f"x: this {type(x).__name__} has no text form")
    return text


def _names_a_path(text: str) -> bool:
    """An existing path, or one line that can only be a path (a name with a program suffix)."""
    if "\n" in text or len(text) >= 4096 or not text.strip():
        return False
    return Path(text).exists() or text.rstrip().endswith(_PROGRAM_SUFFIXES + ("/",))


class _Reader:
    """Collects the modules of one program; names them uniquely."""

    def __init__(self) -> None:
        self.modules: list[ProgramModule] = []
        self.unread: list[UnreadModule] = []
        self.notes: list[str] = []
        self.taken: dict[str, int] = {}
        self.dump = False
        self.bytes_left = MAX_PROGRAM_BYTES

    def read_file(self, path: Path) -> str:
        """The text of the regular file ``path``, counted against :data:`MAX_PROGRAM_BYTES`.

        Opened non-blocking and checked again on the descriptor (the path may have changed since
        it was listed), then read in chunks up to the bytes left, so nothing reads without end.
        """
        try:
            data = read_regular_file(path, self.bytes_left)
        except SpecialFileError as err:
            raise ProgramReadError(f"x: {path} is {err.kind}, not a program file (special files are never read)") from None
        except FileTooLargeError:
            raise ProgramReadError(
                f"x: {path} takes the program past the {MAX_PROGRAM_BYTES}-byte limit (ejlabel.analysis.program.MAX_PROGRAM_BYTES)"
            ) from None
        except OSError as err:
            raise ProgramReadError(f"x: cannot read {path}: {err.strerror or err}") from None
        self.bytes_left -= len(data)
        return data.decode("utf-8", "replace")

    def program(self, origin: str) -> Program:
        return Program(self.modules, origin, self.unread, self.notes)

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

    def add_directory(self, path: Path, stage: Stage) -> None:
        files = self.walk(path)
        after = [p for p in files if p.name.endswith("after_optimizations.txt")]
        before = [p for p in files if p.name.endswith("before_optimizations.txt")]
        if after or before:
            self.dump = True
            for chosen in self.dump_files(after, before, stage):
                self.add_text(self.read_file(chosen), str(chosen))
            return
        programs = [p for p in files if p.suffix in _PROGRAM_SUFFIXES]
        if not programs:
            raise ValueError(f"x: the directory {path} holds no program files ({', '.join(_PROGRAM_SUFFIXES)})")
        for chosen in programs:
            self.add_text(self.read_file(chosen), str(chosen))

    def walk(self, root: Path) -> list[Path]:
        """The regular files under ``root`` (symlinks to files included), sorted.

        Symlinked directories are not entered (no loops, no walking off elsewhere); special
        files are noted and skipped; more than :data:`MAX_DIRECTORY_ENTRIES` entries is an error.
        """
        files: list[Path] = []
        pending = [root]
        seen = 0
        while pending:
            folder = pending.pop()
            try:
                entries = list(os.scandir(folder))
            except OSError as err:
                self.notes.append(f"{folder}: not read ({err.strerror or err})")
                continue
            seen += len(entries)
            if seen > MAX_DIRECTORY_ENTRIES:
                raise ProgramReadError(
                    f"x: {root} holds more than {MAX_DIRECTORY_ENTRIES} entries "
                    "(ejlabel.analysis.program.MAX_DIRECTORY_ENTRIES); give the dump directory itself"
                )
            for entry in entries:
                try:
                    if entry.is_dir(follow_symlinks=False):
                        pending.append(Path(entry.path))
                    elif entry.is_file(follow_symlinks=True):
                        files.append(Path(entry.path))
                    elif entry.is_symlink():
                        self.notes.append(f"{entry.path}: a symlink to something other than a regular file, not followed")
                    else:
                        self.notes.append(f"{entry.path}: {file_kind(entry.stat(follow_symlinks=False).st_mode)}, not read")
                except OSError as err:
                    self.notes.append(f"{entry.path}: not read ({err.strerror or err})")
        return sorted(files)

    def dump_files(self, after: list[Path], before: list[Path], stage: Stage) -> list[Path]:
        """One file per dumped module, all of one stage: ``stage``'s if there are any, else the other's."""
        wanted, other = (after, before) if stage == "after" else (before, after)
        names = {"after": "after-optimizations", "before": "before-optimizations"}
        other_stage = "before" if stage == "after" else "after"
        if not wanted:
            self.notes.append(f"the dump has no {names[stage]} files: read its {names[other_stage]} files")
            wanted, other, stage = other, wanted, other_stage
        chosen: dict[str, Path] = {}
        for p in wanted:
            chosen.setdefault(_module_key(p), p)
        for p in other:
            if _module_key(p) not in chosen:
                self.notes.append(f"{p.name}: no {names[stage]} file for this module, not read")
        return list(chosen.values())


def _module_key(path: Path) -> str:
    """``module_0012`` of ``module_0012.jit_step.cpu_after_optimizations.txt``."""
    found = _DUMP_MODULE.match(path.name)
    if found is not None:
        return found.group(1)
    return path.name.split(".", 1)[0]


def _stablehlo_to_hlo(text: str) -> str:
    """StableHLO text → HLO text, by the conversion ``Lowered.compiler_ir("hlo")`` runs."""
    # jaxlib's converter is not public API; the one stable way in is the module JAX itself uses.
    from jax._src.lib import _jax

    return _jax.mlir.mlir_module_to_xla_computation(text, use_tuple_args=False, return_tuple=False).as_hlo_text()


def invocations_from_program(x: Any) -> dict[str, Invocation[Any, Any]]:
    """Rebuild the ``Invocation`` of every described call in ``x`` (any form), keyed by label.

    Arguments come back as ``jax.ShapeDtypeStruct``; the call key is the one in the label.
    Raises :class:`~ejlabel.core.calls.CallDecodeError` for the first call that cannot be rebuilt;
    ``read_program(x).descriptions`` and ``invocation_from_description`` handle calls one by one.
    """
    return calls.invocations_from_program(read_program(x))
