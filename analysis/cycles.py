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
sites that reach a complex site are searched, for strongly connected components.
:func:`split_by_level` splits each of them by *level*: a member's level is the largest number of
times a path from the site's members to it leaves the site through another site's instruction (or
a loop, branch or call holding sites). The forward is level 0; the backward, which reads the
cotangent other calls computed from the forward's output, level 1: no path leaves a part and
comes back to it. Parts can still close a cycle without such a path (two sites each holding
members that are not connected to each other); when a round of level splits leaves a cycle and
splits nothing, :func:`split_apart` makes each member of the sites on it a site of its own, which
closes none. The graph builder repeats find → split until no cycle is left (one round of level
splits for the programs we have seen).
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
    """Split each given site into its parts by level (module docstring); the number of new sites.

    The first part keeps the site's uid; the others are appended to ``finder.sites``, and the
    finder's membership maps are rebuilt for the computations concerned.
    """
    by_comp: dict[str, list[Site]] = {}
    for uid in uids:
        site = finder.sites[uid]
        if len(site.members) > 1:
            by_comp.setdefault(site.comp.name, []).append(site)
    created = 0
    for sites in by_comp.values():
        comp = sites[0].comp
        for site in sites:
            levels = member_levels(finder, site)
            parts: dict[int, list[HloInstruction]] = {}
            for member in site.members:
                parts.setdefault(levels[member.name], []).append(member)
            if len(parts) < 2:
                continue
            ordered = [parts[level] for level in sorted(parts)]
            joined = site.joined
            pieces = [site]
            for members in ordered[1:]:
                part = Site(len(finder.sites), site.label, comp, members, [])
                finder.sites.append(part)
                pieces.append(part)
                created += 1
            site.members = ordered[0]
            for piece in pieces:
                piece.joined = frozenset(m.name for m in piece.members if m.name in joined)
                piece.attributed = [m.custom_call_target or "" for m in piece.members if m.name in finder.attributed_names]
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
    for comp in by_comp.values():
        finder.index_memberships(comp, [site for site in finder.sites if site.comp is comp])
    return created


def member_levels(finder: SiteFinder, site: Site) -> dict[str, int]:
    """Level of each member of ``site``: one pass over the instructions from its first member to its last."""
    members = {m.name for m in site.members}
    memberships = finder.site_sets[site.comp.name]
    mine = site.uid
    at = finder.positions(site.comp)
    start = min(at[m] for m in members)
    stop = max(at[m] for m in members)
    clean: dict[str, int] = {}  # highest level reaching a value without leaving the site since
    crossed: dict[str, int] = {}  # highest level that left the site through another site's instruction
    levels: dict[str, int] = {}
    holding: dict[str, bool] = {}
    for instr in site.comp.instructions[start : stop + 1]:
        name = instr.name
        best_clean = best_crossed = -1
        for operand in instr.operands:
            best_clean = max(best_clean, clean.get(operand, -1))
            best_crossed = max(best_crossed, crossed.get(operand, -1))
        if name in members:
            levels[name] = clean[name] = max(0, best_clean, best_crossed + 1)
            continue
        other_site = name in memberships and mine not in memberships[name]
        if other_site or (instr.opcode in NESTING_KIND and _holds_sites(finder, instr, holding)):
            top = max(best_clean, best_crossed)
            if top >= 0:
                crossed[name] = top
            continue
        if best_clean >= 0:
            clean[name] = best_clean
        if best_crossed >= 0:
            crossed[name] = best_crossed
    return levels


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
