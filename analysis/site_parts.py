"""The pieces the site rules (:mod:`.sites`) are built from: labels on instructions, the records
of a site, the union-find of memberships, and the small walks between neighbours.

Kept apart from the rules so that every module of the call graph (sites, cycles, flow, graph)
reads one definition of what a label on an instruction is, what a site holds and which opcodes
are leaves, combined collectives or asynchronous followers.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

from ejlabel.core.label_format import LABEL_ATTRIBUTE, LABEL_RE

from .hlo import HloComputation, HloInstruction
from .hlo_async import ASYNC_FOLLOWERS

__all__ = [
    "COMBINABLE",
    "NOT_LEAVES",
    "TRANSPARENT",
    "CompGroups",
    "Inner",
    "Memberships",
    "SharedOp",
    "Site",
    "contents_of",
    "linked_names",
    "neighbour_labels",
    "is_label",
    "own_label",
    "pass_through",
]

TRANSPARENT = frozenset({"get-tuple-element", "bitcast", "copy", "reshape", "transpose", "tuple"})
"""Unlabelled ops through which labelled instructions of one label link (rule 1)."""

COMBINABLE = frozenset(
    {
        "all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective-permute",
        "all-reduce-start", "all-gather-start", "collective-permute-start",
    }
)
"""Collectives XLA's combiners merge: with several operands, element ``i`` comes from operand ``i``."""

NOT_LEAVES = frozenset(
    {
        "parameter", "custom-call", "async-start", "while", "conditional", "call", "rng",
        "rng-bit-generator", "rng-get-and-update-state", "infeed", "recv", "recv-done", "send",
        "send-done", "outfeed", "after-all",
    }
)
"""Opcodes that are never leaves: they bring in data, state or effects even without operands."""

_ATTRIBUTION_HOPS = 3
_THROUGH_CAP = 8


def own_label(instr: HloInstruction) -> str | None:
    """The label an instruction carries itself (its ``ejlabel`` frontend attribute), if valid."""
    value = instr.frontend_attributes.get(LABEL_ATTRIBUTE)
    if value is None or not is_label(value):
        return None
    return value


_LABEL_CHECKED: dict[str, bool] = {}


def is_label(value: str) -> bool:
    """Whether an attribute value is a label (checked once per distinct value)."""
    found = _LABEL_CHECKED.get(value)
    if found is None:
        if len(_LABEL_CHECKED) > 65536:
            _LABEL_CHECKED.clear()
        found = _LABEL_CHECKED[value] = LABEL_RE.fullmatch(value) is not None
    return found


def contents_of(instr: HloInstruction) -> tuple[str, ...]:
    """The computations whose ops count in ``instr``: what it calls, except for an async op's
    ``-update``/``-done``, whose wrapped computation counts once, at its start."""
    return () if instr.opcode in ASYNC_FOLLOWERS else instr.called_computations


@dataclass(slots=True)
class Inner:
    """What one label contributes inside a called computation (and its callees).

    ``work``: whether some of those ops read data (a parameter of the computation), rather than
    all being leaves (constants, iotas and ops of only those).
    """

    instructions: int = 0
    opcodes: Counter = field(default_factory=Counter)
    flops: int = 0
    work: bool = False

    def add(self, other: Inner, work: bool = True) -> None:
        """Add ``other``'s counts; its ops count as work only if ``work`` (they read data here)."""
        self.instructions += other.instructions
        self.opcodes.update(other.opcodes)
        self.flops += other.flops
        self.work = self.work or (other.work and work)


@dataclass(slots=True)
class Site:
    """One kernel call site: its label, computation and member instructions (text order).

    ``shared``: names of members that compute for other calls, or the user's code, too.
    """

    uid: int
    label: str
    comp: HloComputation
    members: list[HloInstruction]
    attributed: list[str]
    joined: frozenset[str] = frozenset()  # unlabelled members that joined by rule 2
    node: str = ""
    shared: frozenset[str] = frozenset()


@dataclass(slots=True)
class SharedOp:
    """An instruction that computes for several calls, or for a call and the user's code.

    ``kind``: ``"combined"`` (a combined collective), ``"leaf"`` (a labelled leaf, or a fusion
    holding a label's leaves only) or ``"fusion"`` (a fusion holding several labels); ``labels``
    the labels it computes for; ``outside``: whether it computes for unlabelled code too. The
    sites it is a member of are those whose members it is (``SiteFinder.site_sets``).
    """

    computation: str
    instruction: str
    kind: str
    labels: tuple[str, ...]
    outside: bool


@dataclass(slots=True)
class CompGroups:
    """The union-find of one computation, kept for splitting its sites (:mod:`.cycles`).

    ``owners[i]``/``labels[i]``/``at[i]``: membership ``i``'s instruction, label and position in
    the computation; ``links``: the unions made, as membership pairs; ``site_of``: each
    membership's site uid; ``attached``: per site uid, its members without a membership of their
    own (shared ops).
    """

    owners: list[HloInstruction]
    labels: list[str]
    at: list[int]
    links: list[tuple[int, int]]
    site_of: list[int]
    attached: dict[int, list[HloInstruction]]


class Memberships:
    """Union-find over (instruction, label) memberships; a group is named by its earliest one.

    Every union is recorded in ``links`` (the splitting of cyclic sites walks them).
    """

    __slots__ = ("at", "index", "labels", "links", "owners", "parent")

    def __init__(self) -> None:
        self.index: dict[tuple[str, str], int] = {}  # (instruction name, label) -> membership id
        self.owners: list[HloInstruction] = []
        self.labels: list[str] = []
        self.at: list[int] = []  # position of each membership's instruction in its computation
        self.parent: list[int] = []
        self.links: list[tuple[int, int]] = []

    def add(self, instr: HloInstruction, lab: str, at: int) -> int:
        me = len(self.parent)
        self.index[(instr.name, lab)] = me
        self.owners.append(instr)
        self.labels.append(lab)
        self.at.append(at)
        self.parent.append(me)
        return me

    def find(self, i: int) -> int:
        parent = self.parent
        while parent[i] != i:
            parent[i] = parent[parent[i]]
            i = parent[i]
        return i

    def union(self, a: int, b: int) -> None:
        self.links.append((a, b))
        self.join(a, b)

    def join(self, a: int, b: int) -> None:
        """Union without recording the link (its caller did)."""
        ra, rb = self.find(a), self.find(b)
        if ra != rb:
            self.parent[max(ra, rb)] = min(ra, rb)

    def groups(self) -> dict[int, list[int]]:
        """Each root's memberships, in id order."""
        # Most memberships are their own root: call find only for the others.
        roots = [i if p == i else self.find(i) for i, p in enumerate(self.parent)]
        by_root: dict[int, list[int]] = {}
        for i, root in enumerate(roots):
            found = by_root.get(root)
            if found is None:
                by_root[root] = [i]
            else:
                found.append(i)
        return by_root


def neighbour_labels(
    instr: HloInstruction,
    by_name: Mapping[str, HloInstruction],
    users: Mapping[str, list[str]],
    member_labels: Mapping[str, tuple[str, ...]],
) -> dict[str, str]:
    """Labels next to an unlabelled custom-call (through a few transparent hops) → its target."""
    found: dict[str, str] = {}
    target = instr.custom_call_target or ""
    for name in _nearby(instr.name, by_name, users):
        for lab in member_labels.get(name, ()):
            found.setdefault(lab, target)
    return found


def _nearby(start: str, by_name: Mapping[str, HloInstruction], users: Mapping[str, list[str]]) -> list[str]:
    """Instructions reached from ``start`` up or down through transparent unlabelled ones (and
    through the update and done of an async op, which are that op)."""
    reached: list[str] = []
    seen = {start}
    for direction in ("up", "down"):
        frontier = [start]
        for _ in range(_ATTRIBUTION_HOPS):
            following: list[str] = []
            for name in frontier:
                instr = by_name.get(name)
                if instr is None:
                    continue
                step = instr.operands if direction == "up" else users.get(name, ())
                for other in step:
                    if other in seen:
                        continue
                    seen.add(other)
                    reached.append(other)
                    nxt = by_name.get(other)
                    if nxt is not None and (nxt.opcode in TRANSPARENT or nxt.opcode in ASYNC_FOLLOWERS) and own_label(nxt) is None:
                        following.append(other)  # a hop, or the rest of one async op
            frontier = following
    return reached


def linked_names(
    name: str,
    by_name: Mapping[str, HloInstruction],
    users: Mapping[str, list[str]],
    lab: str,
    member_labels: Mapping[str, tuple[str, ...]],
) -> list[str]:
    """Members of ``lab`` near the instruction ``name`` (through transparent hops)."""
    return [other for other in _nearby(name, by_name, users) if lab in member_labels.get(other, ())]


def pass_through(
    operands: Iterable[str],
    member_labels: Mapping[str, tuple[str, ...]],
    index: Mapping[tuple[str, str], int],
    through: Mapping[str, dict[str, list[int]]],
) -> dict[str, list[int]]:
    """Memberships (per label, at most ``_THROUGH_CAP``) a transparent unlabelled op passes on."""
    passed: dict[str, list[int]] = {}
    for operand in operands:
        for lab in member_labels.get(operand, ()):
            ids = passed.setdefault(lab, [])
            if len(ids) < _THROUGH_CAP:
                ids.append(index[(operand, lab)])
        for lab, more in through.get(operand, {}).items():
            ids = passed.setdefault(lab, [])
            ids.extend(more[: _THROUGH_CAP - len(ids)])
    return passed
