"""Kernel call sites: which instructions of a module make up each kernel call.

A *site* is one kernel call as the program shows it: instructions of one computation that carry
the same label and are linked by data. The program says which label an instruction carries but
not which Python call of that label made it (two calls with equal signatures have one label), so
sites are rebuilt from data flow with these rules:

1. *Labelled instructions* of one label are linked when one reads the other, directly or through
   unlabelled tuples, get-tuple-elements, bitcasts, copies, reshapes or transposes (which XLA
   inserts between the ops of one call).
2. *Unlabelled data movement inside a call joins it*: an unlabelled instruction that moves data
   (broadcast, reshape, transpose, copy, convert, slice, concatenate, pad, tuple..., or a fusion
   of only such ops), all of whose operands come from sites of one label (directly or through
   such instructions) and all of whose users are instructions of that label (or such
   instructions), transitively, belongs to that label's site and links the pieces on both of its
   sides. These are the broadcasts and reshapes JAX emits without attributes inside a kernel's
   region, and the copies and bitcasts XLA inserts; without the rule one call falls apart into
   several sites in the lowered HLO while the compiled HLO, where they are fused away, shows one.
   Unlabelled arithmetic between two ops of one label stays out: it is more likely the user's
   code between two calls.
3. *Identical instructions* of one label (same opcode, shape and operands; reshapes, bitcasts,
   copies and converts, whose result those determine) are one: XLA's common subexpression
   elimination merges them in the compiled HLO, so the lowered HLO counts them as merged too (the
   two products of a matmul's backward, which both reshape the cotangent).
4. *Unlabelled custom-calls* that rewrites create (XLA's cuDNN attention rewrite drops the
   attributes) join the one label found among their neighbours (operands and users, through up
   to three transparent hops); their targets are listed in ``attributed_custom_calls``.
   Bookkeeping targets (sharding annotations, host offloading) are never attributed.

*Fusions and other inlined computations.* Every computation called by an instruction other than
``while``/``conditional``/``call`` is *inlined*: its labelled instructions count in the site of
the calling instruction (a fusion), which is a member of that site. A fusion holding several labels
(XLA merged pieces of several calls, a forward's and a backward's say) is a member of one site per
label, so each label's costs stay with its own call; in the data flow each of its operands feeds
only the labels whose ops inside read it and its result comes only from the labels that produce it
(:meth:`.flow.DataFlow.flow_fusion`), so the merged op closes no cycle between its sites. A
``while``/``conditional`` that itself carries a label (a loop inside a kernel) absorbs the
same-label instructions of its bodies into its own site.

*Forward and backward.* A kernel differentiated by JAX writes its forward label on its backward
ops too, and the backward reads the forward's intermediates, so rule 1 links them. Where that site
lies on a cycle of data edges (its backward reads what later calls computed from its forward's
output), the call graph splits it by level into its forward and its backward (:mod:`.cycles`).
The last call before the loss keeps its backward when nothing labelled lies between them.

Limits: calls of one label that read each other's outputs directly (``f(f(x))``), or only
through unlabelled data movement, are one site; a call whose pieces never meet (a
JAX-differentiated matmul's forward and two gradient products) is several.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

from ejlabel.core.label_format import LABEL_ATTRIBUTE, LABEL_RE

from .costs import InstructionFacts, instruction_flops
from .hlo import HloComputation, HloInstruction, HloModule

__all__ = ["NESTING_KIND", "TRANSPARENT", "Site", "SiteFinder", "own_label"]

NESTING_KIND = {"while": "loop", "conditional": "branch", "call": "call"}
TRANSPARENT = frozenset({"get-tuple-element", "bitcast", "copy", "reshape", "transpose", "tuple"})
_LINKING = TRANSPARENT | {"custom-call"}
_ATTRIBUTION_HOPS = 3
_THROUGH_CAP = 8
_BOOKKEEPING_TARGETS = frozenset(
    {
        "Sharding",
        "SPMDFullToShardShape",
        "SPMDShardToFullShape",
        "MoveToHost",
        "MoveToDevice",
        "annotate_device_placement",
        "LayoutConstraint",
    }
)
# Unlabelled instructions that may join a call by rule 2: those that move data, which JAX writes
# without attributes inside a kernel's region and XLA inserts (layout copies, bitcasts). An
# unlabelled computation between two ops of one label is more likely the user's code between two
# calls, and stays out. A fusion may join when all it calls moves data (``_moves_data``).
_MOVES_DATA = frozenset(
    {
        "bitcast",
        "bitcast-convert",
        "broadcast",
        "concatenate",
        "convert",
        "copy",
        "copy-done",
        "copy-start",
        "dynamic-slice",
        "get-tuple-element",
        "opt-barrier",
        "pad",
        "reshape",
        "reverse",
        "slice",
        "transpose",
        "tuple",
    }
)
_FUSED_MOVES_DATA = _MOVES_DATA | {"parameter", "constant", "iota"}
# Opcodes whose result is fixed by (opcode, shape, operands) and that JAX writes once per use of a
# value (a reshape or convert of one argument in each of two products): rule 3 merges them.
_CSE_OPCODES = frozenset({"reshape", "bitcast", "copy", "convert", "bitcast-convert"})


def own_label(instr: HloInstruction) -> str | None:
    """The label an instruction carries itself (its ``ejlabel`` frontend attribute), if valid."""
    value = instr.frontend_attributes.get(LABEL_ATTRIBUTE)
    if value is None or not _is_label(value):
        return None
    return value


_LABEL_CHECKED: dict[str, bool] = {}


def _is_label(value: str) -> bool:
    """Whether an attribute value is a label (checked once per distinct value)."""
    found = _LABEL_CHECKED.get(value)
    if found is None:
        if len(_LABEL_CHECKED) > 65536:
            _LABEL_CHECKED.clear()
        found = _LABEL_CHECKED[value] = LABEL_RE.fullmatch(value) is not None
    return found


@dataclass(slots=True)
class Inner:
    """What one label contributes inside a called computation (and its callees)."""

    instructions: int = 0
    opcodes: Counter = field(default_factory=Counter)
    flops: int = 0

    def add(self, other: Inner) -> None:
        self.instructions += other.instructions
        self.opcodes.update(other.opcodes)
        self.flops += other.flops


@dataclass(slots=True)
class Site:
    """One kernel call site: its label, computation and member instructions (text order)."""

    uid: int
    label: str
    comp: HloComputation
    members: list[HloInstruction]
    attributed: list[str]
    joined: frozenset[str] = frozenset()  # unlabelled members that joined by rule 2
    node: str = ""


class _Memberships:
    """Union-find over (instruction, label) memberships; a group is named by its earliest one."""

    __slots__ = ("index", "owners", "parent")

    def __init__(self) -> None:
        self.index: dict[tuple[str, str], int] = {}  # (instruction name, label) -> membership id
        self.owners: list[HloInstruction] = []
        self.parent: list[int] = []

    def add(self, instr: HloInstruction, lab: str) -> int:
        me = len(self.parent)
        self.index[(instr.name, lab)] = me
        self.owners.append(instr)
        self.parent.append(me)
        return me

    def find(self, i: int) -> int:
        parent = self.parent
        while parent[i] != i:
            parent[i] = parent[parent[i]]
            i = parent[i]
        return i

    def union(self, a: int, b: int) -> None:
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


class SiteFinder:
    """Computation roles and the sites of one module.

    The site pass looks at every instruction of a large program, so its loop avoids
    per-instruction calls and allocations for the common instruction (unlabelled, calling
    nothing); work per label or per site is done once.
    """

    def __init__(self, module: HloModule, facts: InstructionFacts) -> None:
        self.module = module
        self.facts = facts
        self.callers = module.callers()
        self.summaries: dict[str, dict[str, Inner]] = {}
        self.contexts: dict[str, tuple[HloInstruction, ...]] = {}
        self.absorbed_labels: dict[str, frozenset[str]] = {}
        self.sites: list[Site] = []
        # computation -> instruction -> uids of the sites it is a member of. Members of one site
        # share one frozenset, so the data-flow pass can tell "same site" by identity.
        self.site_sets: dict[str, dict[str, frozenset]] = {}
        self.by_name: dict[str, dict[str, HloInstruction]] = {}
        self.members_of: dict[str, set[str]] = {}  # computation -> names of its site members
        self.label_sites: dict[str, dict[str, dict[str, int]]] = {}  # computation -> member -> label -> uid
        self.singles: dict[int, frozenset] = {}  # uid -> the shared one-site set
        self.position_maps: dict[str, dict[str, int]] = {}  # computation -> instruction -> position
        self.user_maps: dict[str, dict[str, list[str]]] = {}
        self.attributed_names: set[str] = set()  # unlabelled custom-calls attributed to a label (rule 4)
        self.moving: dict[str, bool] = {}  # fused computation -> whether all it does is move data

    # -- computation roles ---------------------------------------------------

    def is_inlined(self, comp_name: str) -> bool:
        callers = self.callers.get(comp_name)
        return bool(callers) and all(c.opcode not in NESTING_KIND for c in callers)

    def context(self, comp_name: str) -> tuple[HloInstruction, ...]:
        """Enclosing while/conditional/call instructions of a computation, outermost first."""
        found = self.contexts.get(comp_name)
        if found is not None:
            return found
        self.contexts[comp_name] = ()  # breaks call cycles in malformed text
        callers = self.callers.get(comp_name, [])
        nesting = [c for c in callers if c.opcode in NESTING_KIND]
        if nesting:
            caller = nesting[0]
            found = self.context(caller.computation) + (caller,)
        elif callers:
            found = self.context(callers[0].computation)
        else:
            found = ()
        self.contexts[comp_name] = found
        return found

    def absorbed(self, comp_name: str) -> frozenset[str]:
        """Labels whose instructions here belong to a labelled loop/branch calling this computation."""
        found = self.absorbed_labels.get(comp_name)
        if found is not None:
            return found
        self.absorbed_labels[comp_name] = frozenset()
        labels: set[str] = set()
        for caller in self.callers.get(comp_name, []):
            if caller.opcode in NESTING_KIND:
                own = own_label(caller)
                if own is not None:
                    labels.add(own)
                labels |= self.absorbed(caller.computation)
        found = frozenset(labels)
        self.absorbed_labels[comp_name] = found
        return found

    def summary(self, comp_name: str) -> dict[str, Inner]:
        """Per label: labelled instructions of a called computation and of everything it calls."""
        found = self.summaries.get(comp_name)
        if found is not None:
            return found
        self.summaries[comp_name] = {}
        comp = self.module.computations.get(comp_name)
        result: dict[str, Inner] = {}
        if comp is not None:
            for instr in comp.instructions:
                own = own_label(instr) if instr.frontend_attributes else None
                if own is not None:
                    inner = result.setdefault(own, Inner())
                    inner.instructions += 1
                    inner.opcodes[instr.opcode] += 1
                    inner.flops += instruction_flops(instr, comp.instruction, self.facts)
                for callee in instr.called_computations:
                    for lab, inner in self.summary(callee).items():
                        result.setdefault(lab, Inner()).add(inner)
        self.summaries[comp_name] = result
        return result

    def labels_of(self, instr: HloInstruction, absorbed: frozenset[str]) -> tuple[str, ...]:
        """Labels an instruction of a site computation is a member of."""
        own = own_label(instr) if instr.frontend_attributes else None
        if instr.opcode in NESTING_KIND or not instr.called_computations:
            return () if own is None or own in absorbed else (own,)
        labels = dict.fromkeys(() if own is None else (own,))
        for callee in instr.called_computations:
            labels.update(dict.fromkeys(self.summary(callee)))
        return tuple(lab for lab in labels if lab not in absorbed)

    def inner_of(self, instr: HloInstruction, lab: str) -> Inner | None:
        """The part of ``lab`` that sits in computations ``instr`` calls (and that it absorbs)."""
        if instr.opcode in NESTING_KIND and own_label(instr) != lab:
            return None
        found = [inner for callee in instr.called_computations if (inner := self.summary(callee).get(lab)) is not None]
        if len(found) <= 1:
            return found[0] if found else None
        total = Inner()
        for inner in found:
            total.add(inner)
        return total

    def users(self, comp: HloComputation) -> dict[str, list[str]]:
        """Users of each instruction of ``comp``; built only where an unlabelled custom-call needs it."""
        found = self.user_maps.get(comp.name)
        if found is None:
            found = {}
            for instr in comp.instructions:
                for operand in instr.operands:
                    found.setdefault(operand, []).append(instr.name)
            self.user_maps[comp.name] = found
        return found

    def member_users(self, comp: HloComputation) -> dict[str, list[str]]:
        """Users of the site members of ``comp`` and of the transparent hops right after them.

        That is all the node attributes need (which outputs leave their site), and far less than
        the users of every instruction of a large computation.
        """
        full = self.user_maps.get(comp.name)
        if full is not None:
            return full
        members = self.members_of[comp.name]
        found: dict[str, list[str]] = {}
        for instr in comp.instructions:
            for operand in instr.operands:
                if operand in members:
                    users = found.get(operand)
                    if users is None:
                        found[operand] = [instr.name]
                    else:
                        users.append(instr.name)
        by_name = self.by_name[comp.name]
        hops: set[str] = set()
        for users in found.values():
            for user in users:
                instr = by_name.get(user)
                if instr is not None and instr.opcode in TRANSPARENT and user not in members:
                    hops.add(user)
        if hops:
            for instr in comp.instructions:
                for operand in instr.operands:
                    if operand in hops:
                        found.setdefault(operand, []).append(instr.name)
        return found

    def moves_data(self, instr: HloInstruction) -> bool:
        """Whether an unlabelled instruction that calls computations only moves data (rule 2)."""
        if instr.opcode != "fusion":
            return False
        for callee in instr.called_computations:
            found = self.moving.get(callee)
            if found is None:
                comp = self.module.computations.get(callee)
                found = comp is not None and all(i.opcode in _FUSED_MOVES_DATA for i in comp.instructions)
                self.moving[callee] = found
            if not found:
                return False
        return True

    def positions(self, comp: HloComputation) -> dict[str, int]:
        """Position of each instruction of ``comp``; built where needed (cycles, joined members)."""
        found = self.position_maps.get(comp.name)
        if found is None:
            found = self.position_maps[comp.name] = {instr.name: i for i, instr in enumerate(comp.instructions)}
        return found

    # -- sites -----------------------------------------------------------------

    def find_all(self) -> None:
        """The sites of every computation that is not inlined."""
        for comp in self.module.computations.values():
            if not self.is_inlined(comp.name):
                self.find_sites(comp)

    def find_sites(self, comp: HloComputation) -> None:
        """Union-find over (instruction, label) memberships linked by rules 1-4 (module docstring)."""
        absorbed = self.absorbed(comp.name)
        member_labels: dict[str, tuple[str, ...]] = {}
        # The union-find loop looks only at members, transparent ops and custom-calls.
        linking: list[HloInstruction] = []
        # Labels of an unlabelled fusion depend only on what it calls: look each callee tuple up once.
        by_callees: dict[tuple[str, ...], tuple[str, ...]] = {}
        # Rule 2, first half: unlabelled instructions whose operands all come from one label.
        # ``single`` maps members of one label and such instructions to that label, so that one
        # lookup of the first operand rules most instructions out.
        single: dict[str, str] = {}
        up_label: dict[str, str] = {}
        candidates: list[HloInstruction] = []
        for instr in comp.instructions:
            # Most instructions carry no attributes and call nothing: one lookup of their first
            # operand decides whether they may join a call, and they are done.
            if not instr.frontend_attributes and not instr.called_computations and instr.opcode not in NESTING_KIND:
                operands = instr.operands
                if operands and operands[0] in single and instr.opcode in _MOVES_DATA:
                    lab = single[operands[0]]
                    for operand in operands[1:]:
                        if single.get(operand) != lab:
                            break
                    else:
                        single[instr.name] = up_label[instr.name] = lab
                        candidates.append(instr)
                if instr.opcode in _LINKING:
                    linking.append(instr)
                continue
            if instr.frontend_attributes or instr.opcode in NESTING_KIND:
                labels = self.labels_of(instr, absorbed)
            else:
                labels = by_callees.get(instr.called_computations)  # type: ignore[assignment]
                if labels is None:
                    labels = by_callees[instr.called_computations] = self.labels_of(instr, absorbed)
            if labels:
                member_labels[instr.name] = labels
                if len(labels) == 1:
                    single[instr.name] = labels[0]
                linking.append(instr)
            elif instr.opcode in _LINKING:
                linking.append(instr)
            # An unlabelled fusion (or reduce...) may join a call too.
            elif instr.operands and instr.operands[0] in single and self.moves_data(instr):
                lab = single[instr.operands[0]]
                if all(single.get(operand) == lab for operand in instr.operands[1:]):
                    single[instr.name] = up_label[instr.name] = lab
                    candidates.append(instr)
        if not member_labels:
            return
        by_name = {instr.name: instr for instr in comp.instructions}
        self.by_name[comp.name] = by_name

        groups = _Memberships()
        index = groups.index
        owners = groups.owners
        parent = groups.parent
        union = groups.union

        attributed: set[str] = set()  # rule 4
        # Rule 1 through unlabelled transparent ops: label -> membership ids they pass on.
        through: dict[str, dict[str, list[int]]] = {}
        identical: dict[tuple[str, str, str, tuple[str, ...]], int] = {}  # rule 3
        for instr in linking:
            labels = member_labels.get(instr.name)
            if labels is None:
                opcode = instr.opcode
                if opcode in TRANSPARENT:
                    for operand in instr.operands:
                        if operand in member_labels or operand in through:
                            passed = _pass_through(instr.operands, member_labels, index, through)
                            if passed:
                                through[instr.name] = passed
                            break
                    continue
                if opcode != "custom-call" or instr.custom_call_target in _BOOKKEEPING_TARGETS:
                    continue
                neighbours = _neighbour_labels(instr, by_name, self.users(comp), member_labels)
                if len(neighbours) != 1:
                    continue
                labels = (next(iter(neighbours)),)
                member_labels[instr.name] = labels
                attributed.add(instr.name)
                self.attributed_names.add(instr.name)
            cse = instr.opcode in _CSE_OPCODES and not instr.called_computations
            for lab in labels:
                me = len(parent)  # groups.add, inlined: it runs for every labelled instruction
                index[(instr.name, lab)] = me
                owners.append(instr)
                parent.append(me)
                for operand in instr.operands:
                    other = index.get((operand, lab))
                    if other is not None:
                        union(me, other)
                    else:
                        passed = through.get(operand)
                        if passed is not None:
                            for other in passed.get(lab, ()):
                                union(me, other)
                if cse:
                    key = (lab, instr.opcode, instr.shape, instr.operands)
                    other = identical.setdefault(key, me)
                    if other != me:
                        union(me, other)
        # Attributed custom-calls also join the same-label sites of their users (after them in text).
        for name in attributed:
            lab = member_labels[name][0]
            me = index[(name, lab)]
            for linked in _linked_names(name, by_name, self.users(comp), lab, member_labels):
                other = index.get((linked, lab))
                if other is not None:
                    union(me, other)
        joined = self.join_unlabelled(comp, candidates, up_label, member_labels, groups)

        by_root = groups.groups()
        keys = list(index)
        first_uid = len(self.sites)
        for root in sorted(by_root):
            ids = by_root[root]
            members = [owners[ids[0]]] if len(ids) == 1 else [owners[i] for i in ids]
            if joined:
                at = self.positions(comp)
                members.sort(key=lambda m: at[m.name])  # joined ones were added last
            site = Site(len(self.sites), keys[root][1], comp, members, [])
            if attributed:
                site.attributed.extend(m.custom_call_target or "" for m in members if m.name in attributed)
            if joined:
                site.joined = frozenset(m.name for m in members if m.name in joined)
            self.sites.append(site)
        self.members_of[comp.name] = set(member_labels) | joined
        self.index_memberships(comp, self.sites[first_uid:])

    def join_unlabelled(
        self,
        comp: HloComputation,
        candidates: list[HloInstruction],
        up_label: Mapping[str, str],
        member_labels: Mapping[str, tuple[str, ...]],
        groups: _Memberships,
    ) -> set[str]:
        """Rule 2, second half: candidates whose users all are of their label join it.

        ``candidates`` (text order) have operands from one label only; one pass over the
        instructions after the first of them finds their users. A candidate used by a candidate
        depends on that one, so they are decided from the last back.
        """
        if not candidates:
            return set()
        ok: dict[str, bool] = {c.name: not c.is_root for c in candidates}  # a root's value leaves
        used: set[str] = set()
        after: dict[str, list[str]] = {}  # candidate -> candidates that use it
        downstream: dict[str, list[str]] = {}  # candidate -> members of its label that use it
        first = comp.instructions.index(candidates[0])  # by identity (instructions compare so): a C loop
        for instr in comp.instructions[first + 1 :]:
            for operand in instr.operands:
                if operand not in ok:
                    continue
                used.add(operand)
                lab = up_label[operand]
                user = instr.name
                if user in up_label and up_label[user] == lab:
                    after.setdefault(operand, []).append(user)
                elif lab in member_labels.get(user, ()):
                    downstream.setdefault(operand, []).append(user)
                else:
                    ok[operand] = False
        joined: set[str] = set()
        for cand in reversed(candidates):
            name = cand.name
            if not ok[name] or name not in used or not all(ok.get(u, False) for u in after.get(name, ())):
                ok[name] = False
                continue
            joined.add(name)
        if not joined:
            return joined
        for cand in candidates:  # text order: operands' memberships exist before their users'
            name = cand.name
            if name not in joined:
                continue
            lab = up_label[name]
            me = groups.add(cand, lab)
            for other_name in (*cand.operands, *downstream.get(name, ())):
                other = groups.index.get((other_name, lab))
                if other is not None:
                    groups.union(me, other)
        return joined

    def index_memberships(self, comp: HloComputation, sites: Iterable[Site]) -> None:
        """Record which of ``sites`` (all those of ``comp``) each member of ``comp`` is in."""
        singles = self.singles
        site_sets: dict[str, frozenset] = {}
        multi_names: list[str] = []
        for site in sites:
            mine = singles.get(site.uid)
            if mine is None:
                mine = singles[site.uid] = frozenset((site.uid,))
            for member in site.members:
                found = site_sets.get(member.name)
                if found is None:
                    site_sets[member.name] = mine
                elif site.uid not in found:
                    site_sets[member.name] = found | mine
                    multi_names.append(member.name)
        self.site_sets[comp.name] = site_sets
        # Members of several sites (a fusion holding several labels): which site is which label's.
        multi: dict[str, dict[str, int]] = {}
        if multi_names:
            wanted = set(multi_names)
            for site in sites:
                for member in site.members:
                    if member.name in wanted:
                        multi.setdefault(member.name, {})[site.label] = site.uid
        self.label_sites[comp.name] = multi


def _neighbour_labels(
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
    """Instructions reached from ``start`` up or down through transparent unlabelled ones."""
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
                    if nxt is not None and nxt.opcode in TRANSPARENT and own_label(nxt) is None:
                        following.append(other)
            frontier = following
    return reached


def _linked_names(
    name: str,
    by_name: Mapping[str, HloInstruction],
    users: Mapping[str, list[str]],
    lab: str,
    member_labels: Mapping[str, tuple[str, ...]],
) -> list[str]:
    return [other for other in _nearby(name, by_name, users) if lab in member_labels.get(other, ())]


def _pass_through(
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
