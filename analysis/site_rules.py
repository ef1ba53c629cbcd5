"""The site rules of :mod:`.sites`, applied to one computation: one pass to classify, a union-find.

:class:`SiteRules` is the part of :class:`~.sites.SiteFinder` that finds the sites of one
computation: a pass over its instructions classifies each (member of which labels, leaf, combined
collective, candidate for rule 2), a second over the linking ones unions their memberships, and
shared ops (leaves, combined collectives) are then attached to the sites they compute for. The
rules themselves are written down in :mod:`.sites`.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any
from itertools import islice

from .costs import InstructionFacts
from .hlo import HloComputation, HloInstruction
from .hlo_async import ASYNC_FOLLOWERS
from .nesting import NESTING_KIND
from ejlabel.core.label_format import LABEL_ATTRIBUTE

from .site_parts import (
    COMBINABLE,
    NOT_LEAVES,
    TRANSPARENT,
    CompGroups,
    Memberships,
    SharedOp,
    Site,
    is_label,
    linked_names,
    neighbour_labels,
    own_label,
    pass_through,
)

__all__ = ["BOOKKEEPING_TARGETS", "MOVES_DATA", "SiteRules"]

_LINKING = TRANSPARENT | {"custom-call", "async-start"}
BOOKKEEPING_TARGETS = frozenset(
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
"""Custom-call targets that only annotate: never attributed to a label (rule 4)."""
MOVES_DATA = frozenset(
    {
        "bitcast", "bitcast-convert", "broadcast", "concatenate", "convert", "copy", "copy-done",
        "copy-start", "dynamic-slice", "get-tuple-element", "opt-barrier", "pad", "reshape",
        "reverse", "slice", "transpose", "tuple",
    }
)
"""Unlabelled instructions that may join a call by rule 2: those that only move data."""
# Opcodes whose result is fixed by (opcode, shape, operands), merged by rule 3.
_CSE_OPCODES = frozenset({"reshape", "bitcast", "copy", "convert", "bitcast-convert"})
# Opcodes the first pass looks at more closely than "labelled or not".
_SPECIAL = frozenset(NESTING_KIND) | ASYNC_FOLLOWERS | COMBINABLE


class SiteRules:
    """Finds the sites of one computation at a time; mixed into :class:`~.sites.SiteFinder`, whose
    state (declared here) and roles (``labels_of``, ``absorbed``, ``users``, ``moves_data``,
    ``positions``) it uses."""

    facts: InstructionFacts
    sites: list[Site]
    site_sets: dict[str, dict[str, frozenset]]
    by_name: dict[str, dict[str, HloInstruction]]
    members_of: dict[str, set[str]]
    label_sites: dict[str, dict[str, dict[str, int]]]
    singles: dict[int, frozenset]
    attributed_names: set[str]
    groups: dict[str, CompGroups]
    lanes: dict[str, set[str]]
    passive: dict[str, set[str]]
    shared_ops: list[SharedOp]

    def labels_of(self, instr: HloInstruction, absorbed: frozenset[str]) -> tuple[tuple[str, ...], tuple[str, ...]]:
        raise NotImplementedError  # SiteFinder's

    def absorbed(self, comp_name: str) -> frozenset[str]:
        raise NotImplementedError  # SiteFinder's

    def users(self, comp: HloComputation) -> dict[str, list[str]]:
        raise NotImplementedError  # SiteFinder's

    def moves_data(self, instr: HloInstruction) -> bool:
        raise NotImplementedError  # SiteFinder's

    def positions(self, comp: HloComputation) -> dict[str, int]:
        raise NotImplementedError  # SiteFinder's

    def find_sites(self, comp: HloComputation) -> None:
        """Classify, union memberships, attach shared ops, record the sites (module docstring)."""
        absorbed = self.absorbed(comp.name)
        labels_of = self.labels_of
        member_labels: dict[str, tuple[str, ...]] = {}
        linking: list[HloInstruction] = []
        by_callees: dict[tuple[str, ...], tuple[tuple[str, ...], tuple[str, ...]]] = {}
        # Rule 2, first half: ``single`` maps members of one label (not leaves) and unlabelled
        # data movement fed only by them to that label; one lookup rules most instructions out.
        single: dict[str, str] = {}
        up_label: dict[str, str] = {}
        candidates: list[HloInstruction] = []
        leaves: set[str] = set()
        combined: dict[str, HloInstruction] = {}  # a combined collective, or its -done -> the collective
        leaf_only: list[tuple[HloInstruction, tuple[str, ...]]] = []
        # Positions of the linking instructions and candidates, for their memberships.
        linking_at: list[int] = []
        candidates_at: list[int] = []
        for at, instr in enumerate(comp.instructions):
            name = instr.name
            operands = instr.operands
            opcode = instr.opcode
            if operands:
                if operands[0] in leaves and opcode not in NOT_LEAVES and all(o in leaves for o in operands):
                    leaves.add(name)
            elif opcode not in NOT_LEAVES:
                leaves.add(name)
            if not instr.frontend_attributes and not instr.called_computations and opcode not in _SPECIAL:
                # The common instruction: one lookup of its first operand decides rule 2.
                if operands and operands[0] in single and opcode in MOVES_DATA:
                    lab = single[operands[0]]
                    for operand in operands[1:]:
                        if single.get(operand) != lab:
                            break
                    else:
                        single[name] = up_label[name] = lab
                        candidates.append(instr)
                        candidates_at.append(at)
                if opcode in _LINKING:
                    linking.append(instr)
                    linking_at.append(at)
                continue
            if opcode in COMBINABLE and len(operands) > 1 and instr.shape.startswith("("):
                combined[name] = instr
                continue
            if opcode in ASYNC_FOLLOWERS and operands and operands[0] in combined:
                combined[name] = combined[operands[0]]
                continue
            if not instr.called_computations:
                # Labelled, calling nothing: its own label (labels_of, inlined: the common member).
                own = instr.frontend_attributes.get(LABEL_ATTRIBUTE)
                labels = (own,) if own is not None and own not in absorbed and is_label(own) else ()
                leafy = ()
            elif instr.frontend_attributes or opcode in NESTING_KIND:
                labels, leafy = labels_of(instr, absorbed)
            else:
                # An unlabelled fusion's labels depend only on what it calls (and on having operands).
                key = instr.called_computations if operands else (*instr.called_computations, "")
                found = by_callees.get(key)
                if found is None:
                    found = by_callees[key] = labels_of(instr, absorbed)
                labels, leafy = found
            if opcode in ASYNC_FOLLOWERS and operands and operands[0] in member_labels:
                labels = tuple(dict.fromkeys((*member_labels[operands[0]], *labels)))  # rule 5
            if leafy:
                leaf_only.append((instr, leafy))
            if labels:
                member_labels[name] = labels
                if len(labels) == 1 and name not in leaves:
                    single[name] = labels[0]
                linking.append(instr)
                linking_at.append(at)
            elif opcode in _LINKING or opcode in ASYNC_FOLLOWERS:
                linking.append(instr)
                linking_at.append(at)
            elif operands and operands[0] in single and self.moves_data(instr):
                lab = single[operands[0]]
                if all(single.get(operand) == lab for operand in operands[1:]):
                    single[name] = up_label[name] = lab
                    candidates.append(instr)
                    candidates_at.append(at)
        if not member_labels:
            for instr, leafy in leaf_only:
                self.shared_ops.append(SharedOp(comp.name, instr.name, "leaf", leafy, True))
            return
        by_name = {instr.name: instr for instr in comp.instructions}
        self.by_name[comp.name] = by_name
        groups = Memberships()
        self.union_memberships(comp, linking, linking_at, member_labels, leaves, combined, groups)
        joined = self.join_unlabelled(comp, candidates, candidates_at, up_label, member_labels, groups)
        attached, shared, dropped, records = self.attach_shared(comp, member_labels, leaves, combined, groups)
        self.record_sites(comp, groups, member_labels, joined, attached, shared, dropped, records, leaf_only, combined)

    def union_memberships(
        self,
        comp: HloComputation,
        linking: list[HloInstruction],
        linking_at: list[int],
        member_labels: dict[str, tuple[str, ...]],
        leaves: set[str],
        combined: Mapping[str, HloInstruction],
        groups: Memberships,
    ) -> None:
        """Rules 1, 3 and 4, and the lanes of combined collectives: the unions."""
        index = groups.index
        owners = groups.owners
        labels_list = groups.labels
        positions = groups.at
        parent = groups.parent
        links = groups.links
        union = groups.union
        join = groups.join
        by_name = self.by_name[comp.name]
        facts = self.facts
        attributed: set[str] = set()  # rule 4
        # Rule 1 through unlabelled transparent ops: label -> membership ids they pass on.
        through: dict[str, dict[str, list[int]]] = {}
        identical: dict[tuple[str, str, str, tuple[str, ...]], int] = {}  # rule 3
        for k, instr in enumerate(linking):
            name = instr.name
            labels = member_labels.get(name)
            operands = instr.operands
            if operands and operands[0] in combined and instr.opcode == "get-tuple-element":
                # A lane of a combined collective: its get-tuple-element reads the lane's operand.
                collective = combined[operands[0]]
                lane = facts.index_of(instr, comp)
                operands = (collective.operands[lane[0]],) if lane and len(lane) == 1 and lane[0] < len(collective.operands) else ()
            if labels is None and instr.opcode in ASYNC_FOLLOWERS:
                # Rule 5 for a start attributed by rule 4 above (after the first pass).
                labels = member_labels.get(operands[0]) if operands else None
                if labels is None:
                    continue
                member_labels[name] = labels
            if labels is None:
                opcode = instr.opcode
                if opcode in TRANSPARENT:
                    for operand in operands:
                        if operand in member_labels or operand in through:
                            passed = pass_through(operands, member_labels, index, through)
                            if passed:
                                through[name] = passed
                            break
                    continue
                if instr.custom_call_target is None or instr.custom_call_target in BOOKKEEPING_TARGETS:
                    continue
                neighbours = neighbour_labels(instr, by_name, self.users(comp), member_labels)
                if len(neighbours) != 1:
                    continue
                labels = (next(iter(neighbours)),)
                member_labels[name] = labels
                attributed.add(name)
                self.attributed_names.add(name)
            is_leaf = name in leaves
            cse = instr.opcode in _CSE_OPCODES and not instr.called_computations
            for lab in labels:
                me = len(parent)  # groups.add, inlined: it runs for every labelled instruction
                index[(name, lab)] = me
                owners.append(instr)
                labels_list.append(lab)
                positions.append(linking_at[k])
                parent.append(me)
                for operand in operands:
                    if operand in leaves and not is_leaf:
                        continue  # a leaf links nothing: it is attached to its readers later
                    other = index.get((operand, lab))
                    if other is not None:
                        # groups.union, inlined: the new membership is its own root.
                        links.append((me, other))
                        while parent[other] != other:
                            parent[other] = parent[parent[other]]
                            other = parent[other]
                        if parent[me] == me:
                            parent[me] = other
                        elif parent[me] != other:
                            join(me, other)
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
            for linked in linked_names(name, by_name, self.users(comp), lab, member_labels):
                other = index.get((linked, lab))
                if other is not None and linked not in leaves:
                    union(me, other)

    def join_unlabelled(
        self,
        comp: HloComputation,
        candidates: list[HloInstruction],
        candidates_at: list[int],
        up_label: Mapping[str, str],
        member_labels: Mapping[str, tuple[str, ...]],
        groups: Memberships,
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
        reads_none = ok.keys().isdisjoint  # a C loop over an instruction's operands
        for instr in islice(comp.instructions, first + 1, None):
            if reads_none(instr.operands):
                continue
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
        for cand, at in zip(candidates, candidates_at):  # text order: operands' memberships first
            name = cand.name
            if name not in joined:
                continue
            lab = up_label[name]
            me = groups.add(cand, lab, at)
            for other_name in (*cand.operands, *downstream.get(name, ())):
                other = groups.index.get((other_name, lab))
                if other is not None:
                    groups.union(me, other)
        return joined

    def attach_shared(
        self,
        comp: HloComputation,
        member_labels: Mapping[str, tuple[str, ...]],
        leaves: set[str],
        combined: Mapping[str, HloInstruction],
        groups: Memberships,
    ) -> tuple[dict[int, list[HloInstruction]], dict[int, set[str]], set[int], list[SharedOp]]:
        """Leaves and combined collectives, attached to the sites they compute for.

        Returns, per group root, the members attached without a membership and the names among
        them that are shared; the roots of leaf groups that became no site (they were shared);
        and the shared ops found.
        """
        attached: dict[int, list[HloInstruction]] = {}
        shared: dict[int, set[str]] = {}
        dropped: set[int] = set()
        records: list[SharedOp] = []
        index = groups.index
        leaf_memberships = [i for i, owner in enumerate(groups.owners) if owner.name in leaves]
        if not leaf_memberships and not combined:
            return attached, shared, dropped, records
        wanted = {groups.owners[i].name for i in leaf_memberships} | set(combined)
        by_name = self.by_name[comp.name]
        users: dict[str, list[HloInstruction]] = {}
        hops: set[str] = set()  # unlabelled leaves and transparent ops a leaf's value passes through
        for instr in comp.instructions:
            for operand in instr.operands:
                if operand in wanted or operand in hops:
                    users.setdefault(operand, []).append(instr)
                    if instr.name not in member_labels and (instr.name in leaves or instr.opcode in TRANSPARENT):
                        hops.add(instr.name)
        # Leaves: each group of same-label leaves joins the sites of its same-label readers.
        by_group: dict[int, list[int]] = {}
        for i in leaf_memberships:
            by_group.setdefault(groups.find(i), []).append(i)
        for root, ids in by_group.items():
            lab = groups.labels[ids[0]]
            readers: dict[int, int] = {}  # reader's root -> one of its memberships
            outside = False
            seen: set[str] = set()
            pending = [groups.owners[i].name for i in ids]
            while pending:
                for user in users.get(pending.pop(), ()):
                    if user.name in seen:
                        continue
                    seen.add(user.name)
                    member = index.get((user.name, lab))
                    if member is not None:
                        if user.name not in leaves:
                            readers.setdefault(groups.find(member), member)
                    elif user.name in hops:
                        pending.append(user.name)
                    elif user.name not in combined:
                        outside = True
            if not readers:
                continue  # read by no instruction of its label: a site of its own
            if len(readers) == 1 and not outside:
                groups.union(ids[0], next(iter(readers.values())))
                continue
            dropped.add(root)
            members = [groups.owners[i] for i in ids]
            for reader in readers:
                attached.setdefault(reader, []).extend(members)
                shared.setdefault(reader, set()).update(m.name for m in members)
            for member in members:
                records.append(SharedOp(comp.name, member.name, "leaf", (lab,), outside))
        # Combined collectives: each lane belongs to the label of its get-tuple-element.
        for name, collective in combined.items():
            if collective.name != name:
                continue  # a -done: attached with its collective below
            followers = [by_name[f] for f, c in combined.items() if c is collective and f != name]
            gtes = [u for n in (name, *(f.name for f in followers)) for u in users.get(n, ()) if u.opcode == "get-tuple-element"]
            roots: set[int] = set()
            labels: set[str] = set()
            outside = False
            if any(g.name in member_labels for g in gtes):
                for g in gtes:
                    for lab in member_labels.get(g.name, ()):
                        roots.add(groups.find(index[(g.name, lab)]))
                        labels.add(lab)
                    outside = outside or g.name not in member_labels
            else:
                own = own_label(collective)
                for operand in collective.operands:
                    member = None if own is None else index.get((operand, own))
                    if member is None:
                        outside = True
                    else:
                        roots.add(groups.find(member))
                        labels.add(own)  # type: ignore[arg-type]
            if not roots:
                continue  # the user's own collective
            members = [collective, *followers]
            for root in roots:
                attached.setdefault(root, []).extend(members)
            if len(roots) > 1 or outside:
                for root in roots:
                    shared.setdefault(root, set()).update(m.name for m in members)
                records.append(SharedOp(comp.name, name, "combined", tuple(sorted(labels)), outside))
        return attached, shared, dropped, records

    def record_sites(
        self,
        comp: HloComputation,
        groups: Memberships,
        member_labels: Mapping[str, tuple[str, ...]],
        joined: set[str],
        attached: dict[int, list[HloInstruction]],
        shared: dict[int, set[str]],
        dropped: set[int],
        records: list[SharedOp],
        leaf_only: list[tuple[HloInstruction, tuple[str, ...]]],
        combined: Mapping[str, HloInstruction],
    ) -> None:
        """Turn the groups into sites; keep the union-find for splitting (``groups``)."""
        # Shared ops were attached to the roots of their day; a later union may have moved them.
        attached, shared = _by_root(attached, groups), _by_root(shared, groups)
        dropped = {groups.find(root) for root in dropped}
        by_root = groups.groups()
        owners = groups.owners
        at = groups.at
        first_uid = len(self.sites)
        uid_of: dict[int, int] = {}
        site_of = [-1] * len(owners)
        attributed = self.attributed_names
        # Memberships are made in text order, rule 2's joins last: only groups holding those, or
        # attached members, need sorting.
        first_joined = len(owners) - len(joined)
        site_attached: dict[int, list[HloInstruction]] = {}
        for root in sorted(by_root):
            if root in dropped:
                continue
            ids = by_root[root]
            holds_joined = ids[-1] >= first_joined  # ids come in id order: rule 2's joins last
            if holds_joined:
                ids.sort(key=at.__getitem__)  # into text order
            members = [owners[ids[0]]] if len(ids) == 1 else [owners[i] for i in ids]
            extra = attached.get(root)
            if extra:
                present = {m.name for m in members}
                extra = [m for m in dict.fromkeys(extra) if m.name not in present]
                members.extend(extra)
                positions = self.positions(comp)
                members.sort(key=lambda m: positions[m.name])
            uid = len(self.sites)
            for i in ids:
                site_of[i] = uid
            site = Site(uid, groups.labels[root], comp, members, [])
            if attributed:
                site.attributed.extend(m.custom_call_target or "" for m in members if m.name in attributed)
            if holds_joined:
                site.joined = frozenset(owners[i].name for i in ids if i >= first_joined)
            if root in shared:
                site.shared = frozenset(shared[root])
            if extra:
                site_attached[uid] = extra
            uid_of[root] = uid
            self.sites.append(site)
        self.groups[comp.name] = CompGroups(owners, groups.labels, at, groups.links, site_of, site_attached)
        self.members_of[comp.name] = set(member_labels) | joined | {m.name for ms in attached.values() for m in ms}
        self.lanes[comp.name] = set(combined)
        self.passive[comp.name] = {name for names in shared.values() for name in names if name not in combined}
        self.shared_ops.extend(records)
        for instr, leafy in leaf_only:
            # Outside: the fusion's own work belongs to no call (else to the calls it is a member of).
            outside = not any(self.uid_for(instr.name, lab, groups, uid_of) >= 0 for lab in member_labels.get(instr.name, ()))
            self.shared_ops.append(SharedOp(comp.name, instr.name, "leaf", leafy, outside))
        self.index_memberships(comp, self.sites[first_uid:])

    @staticmethod
    def uid_for(name: str, lab: str, groups: Memberships, uid_of: Mapping[int, int]) -> int:
        member = groups.index.get((name, lab))
        return -1 if member is None else uid_of.get(groups.find(member), -1)

    def index_memberships(self, comp: HloComputation, sites: Iterable[Site]) -> None:
        """Record which of ``sites`` (all those of ``comp``) each member of ``comp`` is in.

        A fusion that is a member of several sites (several labels) is shared by them.
        """
        sites = list(sites)
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
        multi: dict[str, dict[str, int]] = {}
        if multi_names:
            wanted = set(multi_names)
            for site in sites:
                inside = [m.name for m in site.members if m.name in wanted and m.name not in site.shared]
                for name in inside:
                    multi.setdefault(name, {})[site.label] = site.uid
                if inside:
                    site.shared = site.shared | frozenset(n for n in inside if len({s for s in site_sets[n]}) > 1)
            recorded = {(op.computation, op.instruction) for op in self.shared_ops}
            for name, by_label in multi.items():
                if len(by_label) > 1 and (comp.name, name) not in recorded:
                    self.shared_ops.append(SharedOp(comp.name, name, "fusion", tuple(by_label), False))
        self.label_sites[comp.name] = multi


def _by_root(by_group: dict[int, Any], groups: Memberships) -> dict[int, Any]:
    """``by_group`` keyed by each key's current root, the values of merged keys gathered."""
    found: dict[int, Any] = {}
    for key, value in by_group.items():
        root = groups.find(key)
        if root not in found:
            found[root] = value
        elif isinstance(value, set):
            found[root] = found[root] | value
        else:
            found[root] = [*found[root], *value]
    return found
