"""Keeping the call graph a DAG: sites that lie on cycles of data edges are split by level.

A kernel differentiated by JAX writes its forward label on its backward ops too, and the backward
reads the forward's intermediates, so the site rules (:mod:`.sites`) put both in one site. That
site then reads what later calls computed from its own output (the cotangent), and the graph has a
cycle: norm → matmul → ... → matmul's backward → norm. Within one instruction graph (a DAG) such a
cycle can only come from grouping instructions: the fix is to group less.

:func:`sites_on_cycles` finds the sites on cycles: cheaply none when every data edge goes forward
in program order (sites ranked by the positions of their enclosing while/conditional/call
instructions, then of their first member), else by strongly connected components.
:func:`split_by_level` splits each of them by *level*: a member's level is the largest number of
times a path from the site's members to it leaves the site through another site's instruction (or
a loop, branch or call holding sites). The forward is level 0; the backward, which reads the
cotangent other calls computed from the forward's output, level 1. Every part is convex (no path
leaves it and comes back), so the parts close no cycle. The graph builder repeats find → split
until no cycle is left (one round for real programs).
"""

from __future__ import annotations

from collections.abc import Iterable

import networkx as nx

from .hlo import HloInstruction
from .sites import NESTING_KIND, Site, SiteFinder

__all__ = ["sites_on_cycles", "split_by_level"]


def sites_on_cycles(finder: SiteFinder, upstream: list[frozenset]) -> list[int]:
    """Uids of the sites on cycles of data edges (``upstream[uid]``: the sites ``uid`` reads)."""
    prefixes: dict[str, tuple[int, ...]] = {}
    keys = []
    for site in finder.sites:
        prefix = prefixes.get(site.comp.name)
        if prefix is None:
            context = finder.context(site.comp.name)
            prefix = prefixes[site.comp.name] = tuple(finder.positions.get(c.name, 0) for c in context)
        keys.append((*prefix, site.first))
    rank = [0] * len(keys)
    for position, uid in enumerate(sorted(range(len(keys)), key=keys.__getitem__)):
        rank[uid] = position
    at = rank.__getitem__
    if all(not up or max(map(at, up)) < rank[uid] for uid, up in enumerate(upstream)):
        return []  # every edge goes forward: no cycle
    graph = nx.DiGraph()
    graph.add_edges_from((u, uid) for uid, up in enumerate(upstream) for u in up)
    return [uid for component in nx.strongly_connected_components(graph) if len(component) > 1 for uid in component]


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
        uid_of: dict[tuple[str, str], int] = {}
        for site in finder.sites:
            if site.comp is comp:
                for member in site.members:
                    uid_of[(member.name, site.label)] = site.uid
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
                part = Site(len(finder.sites), site.label, comp, members, [], first=finder.positions[members[0].name])
                finder.sites.append(part)
                pieces.append(part)
                created += 1
                for member in members:
                    uid_of[(member.name, site.label)] = part.uid
            site.members = ordered[0]
            for piece in pieces:
                piece.joined = frozenset(m.name for m in piece.members if m.name in joined)
                piece.attributed = [m.custom_call_target or "" for m in piece.members if m.name in finder.attributed_names]
        finder.index_memberships(comp, uid_of)
    return created


def member_levels(finder: SiteFinder, site: Site) -> dict[str, int]:
    """Level of each member of ``site``: one pass over the instructions from its first member to its last."""
    members = {m.name for m in site.members}
    memberships = finder.site_sets[site.comp.name]
    mine = site.uid
    start = min(finder.positions[m] for m in members)
    stop = max(finder.positions[m] for m in members)
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
