"""Keeping the call graph a DAG: sites that lie on cycles of data edges are split by level.

A kernel differentiated by JAX writes its forward label on its backward ops too, and the backward
reads the forward's intermediates, so the site rules (:mod:`.sites`) put both in one site. That
site then reads what later calls computed from its own output (the cotangent), and the graph has a
cycle: norm → matmul → ... → matmul's backward → norm. Within one instruction graph (a DAG) such a
cycle can only come from grouping instructions: the fix is to group less.

:func:`sites_on_cycles` finds the sites on cycles. A data edge between sites that are single
instructions of their own, in computations called from one place, is a path of the instruction
graph, which has no cycle: so every cycle passes through a *complex* site (several instructions, an
instruction shared with another site, or a computation called from several places), and only the
sites that reach a complex site are searched, for strongly connected components (Tarjan's
algorithm, iterative).

:func:`split_by_level` splits them, in one pass over each computation holding such sites, in
text order (a topological order: XLA prints operands first). The members of those sites are
regrouped into *parts*, each part with a *level*, such that every data path from one part to
another (through unlabelled instructions, or through members of sites off the cycles) climbs in
level: so no path leaves a part and comes back to it, and the parts close no cycle. A member joins
the parts of the members it was linked to by the site rules (the union-find's links, kept by
:class:`~.sites.SiteFinder`) when the part's level can be raised to what the member reads: at least
one above every other part it reads. A part's level can rise as long as no other part has read it
at a level not above the new one (each part keeps the lowest level that read it); once read, a
part is closed to later members that read what came after it, which start a part of their own.
That is the forward/backward split: a call's forward is read by the calls after it, so its
backward, which reads their cotangents, starts a new part. Links across unlabelled ops inside one
site (its own members read through them) stay inside the part. Values carry the parts they came
from, at most ``MAX_LIVE`` of them: past that the lowest are closed for good and only their
highest level is kept, which can only split more, never close a cycle. ``while``,
``conditional`` and ``call`` instructions holding sites are parts of their own. So levels, joins
and splits take one pass over the computation and the union-find of its parts, whatever the
number of sites or the distance between a call's forward and its backward.

Parts can still close a cycle through computations called from several places, which hold one
node for all their callers; when a round of splits leaves a cycle and splits nothing,
:func:`split_apart` makes each member of the sites on it a site of its own. The graph builder
repeats find → split until no cycle is left (one round for the programs we have seen).
"""

from __future__ import annotations

from collections.abc import Iterable
from itertools import chain

from .hlo import HloComputation, HloInstruction
from .sites import NESTING_KIND, Site, SiteFinder

__all__ = ["sites_on_cycles", "split_apart", "split_by_level"]


def sites_on_cycles(finder: SiteFinder, incoming: list[list[frozenset]]) -> list[int]:
    """Uids of the sites on cycles of data edges (``incoming[uid]``: the upstream sets ``uid`` read).

    A cycle needs a *complex* site (module docstring), so only the sites that reach one (found
    walking the edges back from them) are searched, by Tarjan's algorithm on the reversed edges.
    """
    complex_sites = _complex_sites(finder)
    if not complex_sites:
        return []
    reach = set(complex_sites)
    stack = list(complex_sites)
    while stack:
        for upstream in incoming[stack.pop()]:
            for u in upstream:
                if u not in reach:
                    reach.add(u)
                    stack.append(u)
    return _strongly_connected(reach, incoming)


def _complex_sites(finder: SiteFinder) -> list[int]:
    """Sites of several instructions, sharing an instruction with another site, or in a
    computation called from several places (one node for all its callers)."""
    shared = {name for name in finder.site_sets if _is_shared(finder, name)}
    found = [site.uid for site in finder.sites if len(site.members) > 1 or (shared and site.comp.name in shared)]
    single = finder.singles
    for sets in finder.site_sets.values():
        for uids in sets.values():
            if uids is not single.get(next(iter(uids))):  # members of one site share its one-site set
                found.extend(uids)
    return sorted(set(found))


def _is_shared(finder: SiteFinder, comp_name: str) -> bool:
    """Whether several while/conditional/call instructions call the computation."""
    return sum(c.opcode in NESTING_KIND for c in finder.callers.get(comp_name, ())) > 1


def _strongly_connected(nodes: set[int], incoming: list[list[frozenset]]) -> list[int]:
    """Nodes of ``nodes`` in strongly connected components of more than one node, edges followed
    backwards (``uid`` → the sites in ``incoming[uid]``, which gives the same components):
    iterative Tarjan."""
    index: dict[int, int] = {}
    low: dict[int, int] = {}
    on_stack: set[int] = set()
    stack: list[int] = []
    cyclic: list[int] = []
    for root in nodes:
        if root in index:
            continue
        work = [(root, chain.from_iterable(incoming[root]))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            for child in children:
                if child not in nodes:
                    continue
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, chain.from_iterable(incoming[child])))
                    break
                if child in on_stack:
                    low[node] = min(low[node], index[child])
            else:
                work.pop()
                if work:
                    parent = work[-1][0]
                    low[parent] = min(low[parent], low[node])
                if low[node] == index[node]:
                    component = []
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        component.append(member)
                        if member == node:
                            break
                    if len(component) > 1:
                        cyclic.extend(component)
    return cyclic


def split_by_level(finder: SiteFinder, uids: Iterable[int]) -> int:
    """Split the given sites into their parts by level (module docstring); the number of new sites.

    The part holding a site's first member keeps the site's uid; the others are appended to
    ``finder.sites``, and the finder's membership maps are rebuilt for the computations concerned.
    """
    by_comp: dict[str, set[int]] = {}
    for uid in uids:
        by_comp.setdefault(finder.sites[uid].comp.name, set()).add(uid)
    created = 0
    for comp_name, cyclic in by_comp.items():
        if all(len(finder.sites[uid].members) < 2 for uid in cyclic):
            continue
        # Every site on a cycle takes part (one instruction's site is a part that never splits).
        comp = finder.module.computations[comp_name]
        parts = _Levels(finder, comp, cyclic).run()
        created += _apply_parts(finder, comp, cyclic, parts)
    return created


#: Most parts a value remembers (the highest levels); below them only the highest level is kept.
#: A residual stream, which no call's member reads in full, would carry every layer's parts.
MAX_LIVE = 8
# Memoised unions of two values, dropped past this many (each holds a set).
_MAX_PAIRS = 1 << 16
_OPEN = 1 << 62  # the lowest level that read a part: none yet


class _Levels:
    """The one pass of :func:`split_by_level` over a computation (module docstring)."""

    def __init__(self, finder: SiteFinder, comp: HloComputation, cyclic: set[int]) -> None:
        self.finder = finder
        self.comp = comp
        groups = finder.groups[comp.name]
        self.groups = groups
        # The memberships of the cyclic sites, by instruction, and for each the memberships it
        # was linked to that come before it in the text (those placed when it is).
        site_of = groups.site_of
        owners = groups.owners
        at = groups.at
        memberships: dict[str, list[int]] = {}
        for i, uid in enumerate(site_of):
            if uid in cyclic:
                name = owners[i].name
                found = memberships.get(name)
                if found is None:
                    memberships[name] = [i]
                else:
                    found.append(i)
        links: dict[int, list[int]] = {}
        for a, b in groups.links:
            uid = site_of[a]
            if uid in cyclic and site_of[b] == uid:
                if at[a] < at[b]:
                    a, b = b, a
                found = links.get(a)
                if found is None:
                    links[a] = [b]
                else:
                    found.append(b)
        self.memberships = memberships
        self.links = links
        # Parts: a union-find with, per root, its level, its site (-1 - n for a loop's own part),
        # the lowest level of another site's part that read it, and per same-site part that read
        # it, the lowest level it did so at.
        self.parent: list[int] = []
        self.size: list[int] = []
        self.level: list[int] = []
        self.site: list[int] = []
        self.read_at: list[int] = []
        self.same_site_read: list[dict[int, int]] = []
        self.part_of: dict[int, int] = {}
        self.latest: dict[int, int] = {}  # site uid -> its part last joined or made

    def find(self, p: int) -> int:
        parent = self.parent
        while parent[p] != p:
            parent[p] = parent[parent[p]]
            p = parent[p]
        return p

    def new_part(self, level: int, site: int) -> int:
        part = len(self.parent)
        self.parent.append(part)
        self.size.append(1)
        self.level.append(level)
        self.site.append(site)
        self.read_at.append(_OPEN)
        self.same_site_read.append({})
        return part

    def can_rise(self, part: int, level: int, merging: set[int]) -> bool:
        """Whether ``part`` may rise to ``level``: every part that read it (except those it is
        merged with) read it at a higher level."""
        if level >= self.read_at[part]:
            return False
        return all(level < at for reader, at in self.same_site_read[part].items() if self.find(reader) not in merging)

    def merge(self, parts: list[int], level: int) -> int:
        """One part of the roots ``parts`` (one site's), at ``level``; what read each, kept."""
        # The largest part stays the root (union by size): chains stay short whatever the depth.
        size = self.size
        root = max(parts, key=size.__getitem__)
        for part in parts:
            if part != root:
                self.parent[part] = root
                size[root] += size[part]
                self.read_at[root] = min(self.read_at[root], self.read_at[part])
                for reader, at in self.same_site_read[part].items():
                    known = self.same_site_read[root].get(reader)
                    self.same_site_read[root][reader] = at if known is None else min(known, at)
        self.level[root] = level
        inside = set(parts)
        readers = self.same_site_read[root]
        for reader in [r for r in readers if self.find(r) in inside or r in inside]:
            del readers[reader]
        return root

    def run(self) -> dict[int, int]:
        """Each membership of the cyclic sites -> its part's root."""
        find = self.find
        level = self.level
        part_of = self.part_of
        links = self.links
        memberships = self.memberships
        # Per value: the parts it carries (``floors``: the highest level of parts closed for good,
        # for the few values that dropped some). Unions of two operands' sets are memoised.
        values: dict[str, frozenset[int]] = {}
        get = values.get
        floors: dict[str, int] = {}
        pairs: dict[tuple[frozenset[int], frozenset[int]], frozenset[int]] = {}
        empty: frozenset[int] = frozenset()
        holding: dict[str, bool] = {}
        for instr in self.comp.instructions:
            name = instr.name
            operands = instr.operands
            floor = -1
            if len(operands) == 1:
                live = get(operands[0], empty)
                if floors:
                    floor = floors.get(operands[0], -1)
            elif len(operands) == 2:
                a = get(operands[0], empty)
                b = get(operands[1], empty)
                if a is b or not b:
                    live = a
                elif not a:
                    live = b
                else:
                    live = pairs.get((a, b))  # type: ignore[assignment]
                    if live is None:
                        if len(pairs) > _MAX_PAIRS:
                            pairs.clear()
                        live = pairs[(a, b)] = a | b
                if floors:
                    floor = max(floors.get(operands[0], -1), floors.get(operands[1], -1))
            elif operands:
                # Many operands (a program's result tuple holds every updated weight): one set
                # gathers them, where a union per operand would copy a growing set each time.
                found = [v for v in map(get, operands) if v]
                if not found:
                    live = empty
                elif len(found) == 1 or all(v is found[0] for v in found):
                    live = found[0]
                else:
                    live = frozenset().union(*found)
                if floors:
                    floor = max(floors.get(o, -1) for o in operands)
            else:
                live = empty
            if len(live) > MAX_LIVE:
                live, floor = self.close_lowest(live, floor)
            mine = memberships.get(name)
            if mine is None:
                if instr.opcode in NESTING_KIND and _holds_sites(self.finder, instr, holding):
                    reads = {find(p) for p in live}
                    top = max([floor, *(level[p] for p in reads)])
                    part = self.new_part(top + 1, -1 - len(self.parent))
                    self.read_at[part] = top + 2  # one instruction: it never rises
                    self.record_reads(reads, [part])
                    values[name] = frozenset((part,))
                else:
                    if live:
                        values[name] = live
                    if floor >= 0:
                        floors[name] = floor
                continue
            if len(mine) == 1 and floor < 0:
                # The common member: it reads only parts it is linked to (its own call's), all at
                # one level: it joins them, and nothing it reads is read from outside.
                m = mine[0]
                earlier = links.get(m)
                if earlier:
                    if len(live) == 1:
                        (only,) = live
                        root = find(only)
                        if all(o in part_of and find(part_of[o]) == root for o in earlier):
                            part_of[m] = root
                            self.latest[self.groups.site_of[m]] = root
                            values[name] = live
                            continue
                    else:
                        linked = {find(part_of[o]) for o in earlier if o in part_of}
                        if linked and {find(p) for p in live} <= linked:
                            top = max(level[p] for p in linked)
                            if all(level[p] == top for p in linked):
                                root = self.merge(list(linked), top) if len(linked) > 1 else next(iter(linked))
                                part_of[m] = root
                                self.latest[self.groups.site_of[m]] = root
                                values[name] = frozenset((root,))
                                continue
            reads = {find(p) for p in live}
            placed = [self.place(m, reads, floor) for m in mine]
            self.record_reads(reads, placed)
            values[name] = frozenset(find(p) for p in placed)
        return {m: find(p) for m, p in part_of.items()}

    def place(self, m: int, reads: set[int], floor: int) -> int:
        """Put membership ``m``, which reads the parts ``reads``, into a part; that part."""
        find = self.find
        level = self.level
        linked = {find(self.part_of[o]) for o in self.links.get(m, ()) if o in self.part_of}
        need = max([floor, *(level[p] for p in reads if p not in linked)]) + 1
        top = max([need, *(level[p] for p in linked)])
        at_top = {p for p in linked if level[p] == top}
        joining = [*at_top, *(p for p in linked if level[p] < top and self.can_rise(p, top, at_top))]
        site = self.groups.site_of[m]
        if joining:
            part = self.merge(joining, top)
        else:
            # Its own parts are closed to it: the site's latest part, if that can take it (as the
            # parts of one level of one call: a backward's pieces need not meet).
            part = self.latest.get(site, -1)
            part = -1 if part < 0 else find(part)
            if part >= 0 and part in reads:  # read through unlabelled ops: from inside the call
                need = max([floor, *(level[p] for p in reads if p not in linked and p != part)]) + 1
            if part >= 0 and (level[part] >= need or self.can_rise(part, need, {part})):
                level[part] = max(level[part], need)
            else:
                part = self.new_part(top, site)
        self.latest[site] = part
        self.part_of[m] = part
        return part

    def close_lowest(self, live: frozenset[int], floor: int) -> tuple[frozenset[int], int]:
        """Keep the ``MAX_LIVE`` highest parts of a value live; close the others for good."""
        find = self.find
        ordered = sorted({find(p) for p in live}, key=self.level.__getitem__)
        for part in ordered[:-MAX_LIVE]:
            # Closed for good: it can no longer rise, so its level may be kept as a floor only.
            self.read_at[part] = min(self.read_at[part], self.level[part] + 1)
            floor = max(floor, self.level[part])
        return frozenset(ordered[-MAX_LIVE:]), floor

    def record_reads(self, reads: Iterable[int], readers: list[int]) -> None:
        """Each part read by ``readers`` remembers the lowest level it was read at."""
        find = self.find
        for reader in readers:
            root = find(reader)
            at = self.level[root]
            site = self.site[root]
            for part in reads:
                part = find(part)
                if part == root:
                    continue
                if self.site[part] == site:
                    known = self.same_site_read[part].get(root)
                    self.same_site_read[part][root] = at if known is None else min(known, at)
                elif at < self.read_at[part]:
                    self.read_at[part] = at


def _apply_parts(finder: SiteFinder, comp: HloComputation, cyclic: set[int], part_of: dict[int, int]) -> int:
    """Make each cyclic site's parts sites (the lowest level keeps the uid); the number of new sites."""
    groups = finder.groups[comp.name]
    created = 0
    by_site: dict[int, dict[int, list[int]]] = {}
    for m, part in part_of.items():
        by_site.setdefault(groups.site_of[m], {}).setdefault(part, []).append(m)
    for uid in sorted(cyclic):
        site = finder.sites[uid]
        by_part = by_site.get(uid, {})
        if len(by_part) < 2:
            continue
        # Parts in order of their first member, members in text order (the site's order).
        root_of = {groups.owners[m].name: part for part, ms in by_part.items() for m in ms}
        index_of: dict[int, int] = {}
        member_part: dict[str, int] = {}
        for member in site.members:
            part = root_of.get(member.name)
            if part is not None:
                member_part[member.name] = index_of.setdefault(part, len(index_of))
        ordered = sorted(by_part.items(), key=lambda item: index_of[item[0]])
        parts: list[list[HloInstruction]] = [[] for _ in ordered]
        for member in site.members:
            k = member_part.get(member.name)
            if k is None:
                # Attached without a membership (a shared op): with each part it computes for.
                users = finder.users(comp)
                near = {member_part[n] for n in (*member.operands, *users.get(member.name, ())) if n in member_part}
                for j in sorted(near) or [0]:
                    parts[j].append(member)
            else:
                parts[k].append(member)
        pieces = [site]
        for members in parts[1:]:
            piece = Site(len(finder.sites), site.label, comp, members, [])
            finder.sites.append(piece)
            pieces.append(piece)
            created += 1
        site.members = parts[0]
        for k, piece in enumerate(pieces):
            names = {m.name for m in piece.members}
            piece.joined = frozenset(n for n in site.joined if n in names)
            piece.attributed = [m.custom_call_target or "" for m in piece.members if m.name in finder.attributed_names]
            piece.shared = frozenset(n for n in site.shared if n in names)
            for m in ordered[k][1]:
                groups.site_of[m] = piece.uid
    finder.index_memberships(comp, [site for site in finder.sites if site.comp is comp])
    return created


def split_apart(finder: SiteFinder, uids: Iterable[int]) -> int:
    """The last resort: each member of the given sites becomes a site of its own (one per
    instruction, the label kept); the number of new sites."""
    by_comp: dict[str, HloComputation] = {}
    created = 0
    for uid in uids:
        site = finder.sites[uid]
        if len(site.members) < 2:
            continue
        by_comp[site.comp.name] = site.comp
        members = site.members
        site.members = members[:1]
        for member in members[1:]:
            finder.sites.append(Site(len(finder.sites), site.label, site.comp, [member], []))
            created += 1
        for piece in [site, *finder.sites[len(finder.sites) - len(members) + 1 :]]:
            piece.joined = frozenset(m.name for m in piece.members if m.name in site.joined)
            piece.attributed = [m.custom_call_target or "" for m in piece.members if m.name in finder.attributed_names]
            piece.shared = frozenset(m.name for m in piece.members if m.name in site.shared)
    for comp in by_comp.values():
        sites = [site for site in finder.sites if site.comp is comp]
        groups = finder.groups.get(comp.name)
        if groups is not None:
            membership = {(owner.name, lab): i for i, (owner, lab) in enumerate(zip(groups.owners, groups.labels))}
            for site in sites:
                for member in site.members:
                    i = membership.get((member.name, site.label))
                    if i is not None:
                        groups.site_of[i] = site.uid
        finder.index_memberships(comp, sites)
    return created


def _holds_sites(finder: SiteFinder, instr: HloInstruction, memo: dict[str, bool]) -> bool:
    """Whether a while/conditional/call holds sites in what it calls, at any depth."""
    found = memo.get(instr.name)
    if found is not None:
        return found
    stack = list(instr.called_computations)
    seen: set[str] = set()
    found = False
    while stack and not found:
        name = stack.pop()
        if name in seen:
            continue
        seen.add(name)
        if finder.site_sets.get(name):
            found = True
            break
        comp = finder.module.computations.get(name)
        if comp is not None:
            stack.extend(c for i in comp.instructions if i.opcode in NESTING_KIND for c in i.called_computations)
    memo[instr.name] = found
    return found
