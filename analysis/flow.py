"""Data edges between kernel call sites: which sites' values each site reads.

Site A → site B when an instruction of B reads a value computed by A directly or through
unlabelled instructions. One pass per computation in text order (XLA prints instructions
operands-first) propagates, for every unlabelled value, the set of nearest upstream sites; a
labelled value's set is its own site(s), so the sets stay small. Sets are shared frozensets (an
unlabelled chain reuses its operand's set) and are capped at ``MAX_UPSTREAM`` sites, keeping the
most recent ones, so the pass is linear in the program.

Tuples keep one set per element and get-tuple-element picks its element, and values flow into
``while`` bodies, ``conditional`` branches and ``call`` targets through their parameters and out
through their roots (values carried from one loop iteration to the next are not followed). Each
called computation is walked once: one called from a single place with its caller's values; one
called from several places (both layers of a model calling one ``silu`` computation) with a
placeholder set per parameter (per tuple element), keeping what its root carries and what its
sites read in terms of those placeholders, and each caller substitutes its own operands' sets. So
a shared computation passes each caller's producers to that caller's consumers only, its own
sites (one node each, whatever the caller) read from every caller, and the pass stays linear: a
caller costs the size of its callee's root value and of the placeholders its sites read, not the
callee's size. A set keeps up to ``MAX_UPSTREAM`` placeholders besides its ``MAX_UPSTREAM`` sites.

A fusion holding several labels also links their sites by the order inside it: site of label A →
site of label B when an op of A feeds an op of B in the fused computation (nearest labels, through
unlabelled ops). On GPU one gemm fusion can hold a producer's elementwise ops, the dot and an
epilogue of three kernels, and that order is the only data order left between them.

A combined collective (:mod:`.sites`: XLA's combiners merge the collectives of several calls)
is read lane by lane, as the tuple of its operands' sets, whatever labels it carries: a site
reading one of its elements reads that element's operand only. Shared leaves carry no site.

Which tuple element a get-tuple-element picks and which operand a parameter takes come from the
instruction facts (:class:`.costs.InstructionFacts`); where they were inferred from shapes and
several elements fit, the value is the union of those elements.

Nothing recurses, however deeply computations nest: each walk of a computation is a generator
that hands the walks it needs (a loop body, a branch) to a driver (:meth:`DataFlow.drive`), which
keeps them on a stack of its own and sends each result back.
"""

from __future__ import annotations

import bisect
from collections import defaultdict
from collections.abc import Generator, Iterable
from dataclasses import dataclass
from typing import Any

from .costs import InstructionFacts, tuple_elements
from .hlo import HloInstruction, HloModule
from .hlo_async import ASYNC_FOLLOWERS
from .nesting import post_order
from .site_parts import COMBINABLE, contents_of
from .sites import NESTING_KIND, SiteFinder, own_label

__all__ = ["MAX_UPSTREAM", "DataFlow"]

MAX_UPSTREAM = 16
"""Most upstream sites remembered per unlabelled value (the most recent ones are kept)."""

Value = frozenset | tuple  # upstream sites of a value; tuples hold one Value per element
_EMPTY: frozenset = frozenset()
_NO_SITES: dict[str, frozenset] = {}
# Opcodes the pass treats specially; everything else unions its operands' sets.
_FLOW_SPECIAL = frozenset({"parameter", "tuple", "get-tuple-element", *NESTING_KIND, *COMBINABLE})
_TUPLE_KEEPING = frozenset({"copy", "opt-barrier", "bitcast", *ASYNC_FOLLOWERS})
_NO_NAMES: frozenset[str] = frozenset()
# A walk: a generator that yields the walks it needs and returns its computation's root value.
Walk = Generator[Any, Any, Any]
# A fused computation's ports: labels reading each parameter, (labels, parameters) producing each output.
_Ports = tuple[dict[int, frozenset[str]] | None, list[tuple[frozenset[str], frozenset[int]]]]


@dataclass(slots=True)
class _SharedFlow:
    """A shared computation's data flow in terms of its parameters' placeholders.

    ``root``: its root's value; ``reads``: (site uid, placeholder numbers its instructions read);
    ``splits``: each set of ``root`` as (its sites, its placeholder numbers); ``symbolic``: whether
    anything depends on the parameters (else ``root`` holds plain sets, the same for every caller).
    """

    root: Value
    reads: list[tuple[int, tuple[int, ...]]]
    splits: dict[frozenset, tuple[frozenset, tuple[int, ...]]]
    symbolic: bool


class DataFlow:
    """The data-flow pass over one module; ``run()`` gives, per site uid, the upstream sets it read.

    The loop runs once over every instruction of a large program, so it avoids per-instruction
    function calls and allocations on the common path (an unlabelled instruction with one or
    two operands).
    """

    def __init__(self, module: HloModule, facts: InstructionFacts, sites: SiteFinder) -> None:
        self.module = module
        self.facts = facts
        self.sites = sites
        self.callers = sites.callers
        self.flowed: dict[str, Value] = {}
        self.in_flow: set[str] = set()
        # Computations that several while/conditional/call instructions call: walked once in terms
        # of their parameters (placeholder ids ``-1 - n``, ``placeholders[n]`` = (parameter
        # numbers, tuple index path)), the summary applied to each caller's operands.
        self.shared: set[str] = {
            name for name, callers in self.callers.items() if sum(c.opcode in NESTING_KIND for c in callers) > 1
        }
        self.shared_flows: dict[str, _SharedFlow] = {}
        self.placeholders: list[tuple[tuple[int, ...] | None, tuple[int, ...]]] = []
        # Per site uid: the upstream sets its instructions read (shared objects, merged at the end).
        self.incoming: list[list[frozenset]] = [[] for _ in sites.sites]
        # Where the walk records what sites read: ``incoming``, or while a shared computation is
        # summarised, a uid -> sets map whose placeholders are resolved per caller.
        self.target: Any = self.incoming
        self.merged: dict[tuple[frozenset, frozenset], frozenset] = {}
        self.flat: dict[tuple, frozenset] = {}
        self.pairs: dict[str, frozenset[tuple[str, str]]] = {}
        self.ports: dict[str, _Ports] = {}
        self.fusion_tuple: dict[str, bool] = {}

    def run(self) -> list[list[frozenset]]:
        """Walk from the computations nobody calls (the entry first), then any left unwalked."""
        order = [self.module.entry] + [c for c in self.module.computations if c != self.module.entry]
        for comp_name in order:
            if comp_name not in self.callers:
                self.drive(self.flow(comp_name, []))
        for comp_name in order:
            if not self.sites.is_inlined(comp_name):
                self.drive(self.flow(comp_name, []))
        self.merged.clear()
        self.flat.clear()
        return self.incoming

    @staticmethod
    def drive(walk: Walk) -> Value:
        """Run a walk to its end, and each walk it yields before it resumes (a stack, not recursion)."""
        stack = [walk]
        result: Any = None
        while stack:
            try:
                request = stack[-1].send(result)
            except StopIteration as done:
                stack.pop()
                result = done.value
                continue
            stack.append(request)
            result = None
        return result

    # -- set algebra -------------------------------------------------------------

    def flatten(self, value: tuple) -> frozenset:
        """All upstream sites of a tuple value (memoised: a tuple is often read many times).

        Nested tuples are flattened innermost first, from a stack of their own.
        """
        found = self.flat.get(value)
        if found is not None:
            return found
        flat = self.flat
        pending: list[tuple] = [value]
        while pending:
            top = pending[-1]
            if top in flat:
                pending.pop()
                continue
            inner = [v for v in top if v.__class__ is tuple and v not in flat]
            if inner:
                pending.extend(inner)  # type: ignore[arg-type]
                continue
            pending.pop()
            flat[top] = self.union(top)
        return flat[value]

    def union(self, values: Iterable[Value]) -> frozenset:
        """Union of upstream sets (tuples flattened), capped at ``MAX_UPSTREAM``.

        Keeping the most recent sites is associative, so merging pairwise gives the same set as
        merging all at once; an operand's set is shared when it already holds the result.
        """
        result: frozenset = _EMPTY
        for value in values:
            if value.__class__ is tuple:
                value = self.flat.get(value) or self.flatten(value)  # type: ignore[arg-type]
            if value and value is not result:
                result = value if not result else self.merge(result, value)  # type: ignore[assignment,arg-type]
        return result

    def merge(self, a: frozenset, b: frozenset) -> frozenset:
        """Union of two distinct non-empty upstream sets, capped, sharing an operand's set if equal.

        Memoised: the same pairs meet again and again along chains of unlabelled instructions.
        """
        key = (a, b)
        found = self.merged.get(key)
        if found is not None:
            return found
        if a >= b:
            found = a
        elif b >= a:
            found = b
        else:
            found = a | b
            if len(found) > MAX_UPSTREAM:
                ordered = sorted(found)
                if ordered[0] < 0:
                    # Placeholders of a shared computation's parameters (negative) are capped apart
                    # from its sites: each stands for up to MAX_UPSTREAM sites of a caller.
                    cut = bisect.bisect_left(ordered, 0)
                    found = frozenset(ordered[: min(cut, MAX_UPSTREAM)] + ordered[max(cut, len(ordered) - MAX_UPSTREAM) :])
                else:
                    found = frozenset(ordered[-MAX_UPSTREAM:])
                # Keeping the most recent sites often gives back one of the operands' sets.
                if found == a:
                    found = a
                elif found == b:
                    found = b
        self.merged[key] = found
        return found

    def pick(self, values: list[Value] | tuple, positions: tuple[int, ...] | None) -> Value:
        """The element(s) of ``values`` at ``positions`` (several: their union); all if unknown."""
        if positions is not None:
            if len(positions) == 1:
                if positions[0] < len(values):
                    return values[positions[0]]
            else:
                chosen = [values[p] for p in positions if p < len(values)]
                if chosen:
                    return self.union(chosen)
        return self.union(values)

    # -- the walk ------------------------------------------------------------------

    def flow(self, comp_name: str, seeds: list[Value]) -> Walk:
        """Propagate upstream sites through one computation; returns its root's value.

        A computation called from one place is walked once with its caller's operands. One
        called from several places is walked once in terms of its parameters (its summary) and
        each caller gets the summary with its own operands substituted (see ``flow_shared``).
        """
        if comp_name in self.shared:
            return (yield self.flow_shared(comp_name, seeds))
        if comp_name in self.flowed:
            return self.flowed[comp_name]
        return (yield self.walk(comp_name, seeds))

    def walk(self, comp_name: str, seeds: list[Value] | None) -> Walk:
        """One pass over a computation; ``seeds=None`` gives its parameters placeholder sets."""
        comp = self.module.computations.get(comp_name)
        if comp is None or comp_name in self.in_flow:
            return self.union(seeds or [])
        self.in_flow.add(comp_name)
        values: dict[str, Value] = {}
        get = values.get
        incoming = self.target
        comp_sites = self.sites.site_sets.get(comp_name, _NO_SITES)
        # Shared members carry no site's values: combined collectives are read lane by lane,
        # shared leaves as the nothing they read.
        not_members = self.sites.lanes.get(comp_name, _NO_NAMES) | self.sites.passive.get(comp_name, _NO_NAMES)
        facts = self.facts
        merge = self.merge
        flatten = self.flatten
        union = self.union
        value: Value
        for instr in comp.instructions:
            name = instr.name
            operands = instr.operands
            mine = comp_sites.get(name)
            if mine is not None and not (not_members and name in not_members):
                # A site member: what its operands carry flows into its site(s).
                if len(mine) > 1 and len(instr.called_computations) == 1 and instr.opcode not in NESTING_KIND:
                    # A fusion holding several labels: each operand flows to the labels inside
                    # that read it, the result comes from the labels that produce it.
                    values[name] = self.flow_fusion(instr, comp_name, mine, values)
                    continue
                for operand in operands:
                    upstream = get(operand, _EMPTY)
                    if upstream.__class__ is tuple:
                        if instr.opcode == "get-tuple-element":  # its element only (a lane, say)
                            upstream = self.pick(upstream, facts.index_of(instr, comp))  # type: ignore[arg-type]
                        if upstream.__class__ is tuple:
                            upstream = flatten(upstream)  # type: ignore[arg-type]
                    if upstream and upstream is not mine:
                        for s in mine:
                            incoming[s].append(upstream)  # type: ignore[arg-type]
                if instr.opcode in NESTING_KIND:
                    yield self.flow_nested(instr, values)
                values[name] = mine
                continue
            opcode = instr.opcode
            if opcode in _FLOW_SPECIAL:
                if opcode == "parameter":
                    if seeds is None:
                        value = self.placeholder(facts.parameter_of(instr, comp), (), instr.shape)
                    elif not seeds:
                        value = _EMPTY
                    elif len(seeds) == 1:
                        value = seeds[0]
                    else:
                        value = self.pick(seeds, facts.parameter_of(instr, comp))
                elif opcode == "tuple":
                    if len(operands) == 2:
                        value = (get(operands[0], _EMPTY), get(operands[1], _EMPTY))
                    else:
                        value = tuple([get(o, _EMPTY) for o in operands])
                elif opcode == "get-tuple-element":
                    source = get(operands[0], _EMPTY) if operands else _EMPTY
                    value = self.pick(source, facts.index_of(instr, comp)) if source.__class__ is tuple else source  # type: ignore[arg-type]
                elif opcode in NESTING_KIND:
                    value = yield self.flow_nested(instr, values)
                elif len(operands) > 1 and instr.shape.startswith("("):
                    value = tuple([get(o, _EMPTY) for o in operands])  # a combined collective: its lanes
                else:
                    value = union([get(o, _EMPTY) for o in operands])
            elif len(operands) == 2:
                a = get(operands[0], _EMPTY)
                b = get(operands[1], _EMPTY)
                if a.__class__ is tuple:
                    a = flatten(a)  # type: ignore[arg-type]
                if b.__class__ is tuple:
                    b = flatten(b)  # type: ignore[arg-type]
                if a is b or not b:
                    value = a
                elif not a:
                    value = b
                else:
                    value = merge(a, b)  # type: ignore[arg-type]
            elif len(operands) == 1:
                value = get(operands[0], _EMPTY)
                if value.__class__ is tuple and opcode not in _TUPLE_KEEPING:
                    value = flatten(value)  # type: ignore[arg-type]
            elif operands:
                value = union([get(o, _EMPTY) for o in operands])
            else:
                value = _EMPTY
            values[name] = value
        if not self.in_flow - {comp_name}:
            # Back at a computation nobody calls: the memos' sets belong to walked computations.
            self.merged.clear()
            self.flat.clear()
        root_value: Value = _EMPTY
        if comp.root is not None and comp.root in values:
            root_value = values[comp.root]
        else:
            for instr in comp.instructions:
                if instr.is_root:
                    root_value = values.get(instr.name, _EMPTY)
        self.in_flow.discard(comp_name)
        self.flowed[comp_name] = root_value
        return root_value

    # -- shared computations -------------------------------------------------------

    def placeholder(self, positions: tuple[int, ...] | None, path: tuple[int, ...], shape: str) -> Value:
        """The value of a parameter (or of one element of a tuple parameter) of a shared computation.

        One placeholder set per array element of the shape, nested as its tuples are; the
        nesting is built from a stack, innermost tuples first.
        """
        # (shape, path, parts or None, values built so far)
        pending: list[tuple[str, tuple[int, ...], tuple[str, ...] | None, list[Value]]] = [(shape, path, tuple_elements(shape), [])]
        result: Value = _EMPTY
        while pending:
            shape_now, path_now, parts, built = pending[-1]
            if parts is None:
                self.placeholders.append((positions, path_now))
                result = frozenset((-len(self.placeholders),))
            elif len(built) < len(parts):
                part = parts[len(built)]
                pending.append((part, path_now + (len(built),), tuple_elements(part), []))
                continue
            else:
                result = tuple(built)
            pending.pop()
            if pending:
                pending[-1][3].append(result)
        return result

    def flow_shared(self, comp_name: str, seeds: list[Value]) -> Walk:
        """Flow through a computation called from several places, with this caller's operands.

        The computation is walked once with placeholder sets for its parameters; what its sites
        read and what its root carries are kept in terms of those placeholders, and each call
        substitutes its own operands: the sites inside get data edges from every caller, and each
        caller gets back what its own operands (and the sites inside) feed to the root.
        """
        summary = self.shared_flows.get(comp_name)
        if summary is None:
            if comp_name in self.in_flow or comp_name not in self.module.computations:
                return self.union(seeds)
            summary = yield self.summarise(comp_name)
        if not summary.symbolic:
            return summary.root
        resolved: dict[int, frozenset] = {}
        placeholders = self.placeholders
        flatten = self.flatten

        def resolve(pid: int) -> frozenset:
            found = resolved.get(pid)
            if found is not None:
                return found
            positions, path = placeholders[pid]
            value: Value
            if not seeds:
                value = _EMPTY
            elif len(seeds) == 1:
                value = seeds[0]
            else:
                value = self.pick(seeds, positions)
            for i in path:
                if value.__class__ is not tuple:
                    break
                value = value[i] if i < len(value) else flatten(value)  # type: ignore[index,arg-type]
            if value.__class__ is tuple:
                value = flatten(value)  # type: ignore[arg-type]
            resolved[pid] = value  # type: ignore[assignment]
            return value  # type: ignore[return-value]

        target = self.target
        for uid, pids in summary.reads:
            bucket = target[uid]
            for pid in pids:
                upstream = resolve(pid)
                if upstream:
                    bucket.append(upstream)
        splits = summary.splits
        done: dict[Any, Value] = {}

        def substitute_set(value: frozenset) -> Value:
            concrete, pids = splits[value]
            if not pids:
                return concrete
            if not concrete and len(pids) == 1:
                return resolve(pids[0])
            return self.union([concrete, *(resolve(pid) for pid in pids)])

        # The root's value with each set substituted; nested tuples innermost first, from a stack.
        pending: list[Any] = [summary.root]
        while pending:
            top = pending[-1]
            if top in done:
                pending.pop()
            elif top.__class__ is not tuple:
                done[top] = substitute_set(top)
                pending.pop()
            else:
                inner = [v for v in top if v not in done]
                if inner:
                    pending.extend(inner)
                else:
                    done[top] = tuple([done[v] for v in top])
                    pending.pop()
        return done[summary.root]

    def summarise(self, comp_name: str) -> Walk:
        """Walk a shared computation once in terms of its parameters (see ``flow_shared``)."""
        saved = self.target
        pending: dict[int, list[frozenset]] = defaultdict(list)
        self.target = pending
        try:
            root = yield self.walk(comp_name, None)
        finally:
            self.target = saved
        splits: dict[frozenset, tuple[frozenset, tuple[int, ...]]] = {}

        def split(value: frozenset) -> tuple[frozenset, tuple[int, ...]]:
            found = splits.get(value)
            if found is None:
                if value and min(value) < 0:
                    found = (frozenset(u for u in value if u >= 0), tuple(sorted(-1 - u for u in value if u < 0)))
                else:
                    found = (value, ())
                splits[value] = found
            return found

        # What the sites inside read from the sites inside is the same for every caller: record it
        # now; what they read from the parameters is resolved per caller.
        reads: list[tuple[int, tuple[int, ...]]] = []
        incoming = self.incoming
        for uid, sets in pending.items():
            pids: set[int] = set()
            for upstream in sets:
                concrete, from_params = split(upstream)
                if concrete:
                    incoming[uid].append(concrete)
                pids.update(from_params)
            if pids:
                reads.append((uid, tuple(sorted(pids))))
        symbolic = bool(reads)
        stack: list[Value] = [root]
        while stack:
            value = stack.pop()
            if value.__class__ is tuple:
                stack.extend(value)  # type: ignore[arg-type]
            elif split(value)[1]:  # type: ignore[arg-type]
                symbolic = True
        # Not symbolic: nothing depends on the callers, the root's value is the same for all of them.
        summary = _SharedFlow(root, reads, splits, symbolic)
        self.shared_flows[comp_name] = summary
        return summary

    # -- fusions and nested computations --------------------------------------------

    def flow_fusion(self, instr: HloInstruction, comp_name: str, mine: frozenset, values: dict[str, Value]) -> Value:
        """Data flow through a fusion that holds several labels; returns its value.

        Each operand flows into the sites of the labels whose ops inside read it (nearest, through
        unlabelled ops), the labels inside feed each other in their order there, and the result
        (each element of a multi-output fusion) comes from the labels that produce it, plus any
        operand that reaches it through unlabelled ops only. So the fusion joins the sites of its
        labels without closing a cycle between them: the merged op takes part in each call only
        through its own ops.
        """
        by_label = self.sites.label_sites.get(comp_name, {}).get(instr.name, {})
        readers, outputs = self.fusion_ports(instr.called_computations[0])
        incoming = self.target
        flatten = self.flatten
        operand_values: list[frozenset] = []
        for position, operand in enumerate(instr.operands):
            upstream = values.get(operand, _EMPTY)
            if upstream.__class__ is tuple:
                upstream = flatten(upstream)  # type: ignore[arg-type]
            operand_values.append(upstream)  # type: ignore[arg-type]
            if not upstream or upstream is mine:
                continue
            if readers is None:  # parameter numbers unknown: every label inside may read it
                targets: Iterable[int] = mine
            else:
                targets = [by_label[lab] for lab in readers.get(position, ()) if lab in by_label]
            for uid in targets:
                incoming[uid].append(upstream)
        for upstream_label, lab in self.label_pairs(instr.called_computations[0]):
            source, target = by_label.get(upstream_label), by_label.get(lab)
            if source is not None and target is not None and source != target:
                self.incoming[target].append(self.sites.singles[source])
        results: list[frozenset] = []
        for labels, params in outputs:
            parts: list[Value] = [frozenset(by_label[lab] for lab in labels if lab in by_label)]
            parts += [operand_values[p] for p in params if p < len(operand_values)]
            results.append(self.union(parts))
        if len(results) == 1 and not self.fusion_tuple.get(instr.called_computations[0], False):
            return results[0] or mine
        return tuple(results) if results else mine

    def fusion_ports(self, comp_name: str) -> _Ports:
        """Inside a fused computation: the labels reading each parameter (by number; None when
        the numbers are unknown), and for its result (each element of a tuple root) the labels
        producing it and the parameters reaching it through unlabelled ops only."""
        found = self.ports.get(comp_name)
        if found is not None:
            return found
        comp = self.module.computations.get(comp_name)
        readers: dict[int, set[str]] = {}
        outputs: list[tuple[frozenset[str], frozenset[int]]] = []
        if comp is None:
            found = (None, [])
            self.ports[comp_name] = found
            return found
        # Per value: (nearest labels upstream, parameters reaching it without a label between).
        flows: dict[str, tuple[frozenset[str], frozenset[int]]] = {}
        empty: tuple[frozenset[str], frozenset[int]] = (frozenset(), frozenset())
        unknown = False  # a parameter whose number is not known: any label inside may read any operand
        for instr in comp.instructions:
            if instr.opcode == "parameter":
                positions = self.facts.parameter_of(instr, comp)
                unknown = unknown or not positions
                flows[instr.name] = (frozenset(), frozenset(positions or ()))
                continue
            own = own_label(instr) if instr.frontend_attributes else None
            labels = set() if own is None else {own}
            for callee in instr.called_computations:
                labels.update(self.sites.summary(callee))
            upstream = [flows.get(o, empty) for o in instr.operands]
            if labels:
                for _, params in upstream:
                    for p in params:
                        readers.setdefault(p, set()).update(labels)
                flows[instr.name] = (frozenset(labels), frozenset())
            else:
                flows[instr.name] = (
                    frozenset().union(*(u[0] for u in upstream)),
                    frozenset().union(*(u[1] for u in upstream)),
                )
        root = comp.instruction(comp.root) if comp.root is not None else None
        if root is None:
            root = next((i for i in comp.instructions if i.is_root), None)
        is_tuple = root is not None and root.opcode == "tuple" and not (own_label(root) if root.frontend_attributes else None)
        if root is not None:
            sources = root.operands if is_tuple else (root.name,)
            outputs = [flows.get(name, empty) for name in sources]
        self.fusion_tuple[comp_name] = is_tuple
        found = (None if unknown else {p: frozenset(labels) for p, labels in readers.items()}, outputs)
        self.ports[comp_name] = found
        return found

    def label_pairs(self, comp_name: str) -> frozenset[tuple[str, str]]:
        """``(upstream label, label)`` where an op of one feeds an op of the other in a called computation.

        Nearest labels only, through unlabelled ops, and through the computations its ops call
        (worked out first, in post-order); an op that calls computations holding labels counts as
        having those labels.
        """
        found = self.pairs.get(comp_name)
        if found is not None:
            return found
        computations = self.module.computations

        def callees(name: str) -> list[str]:
            comp = computations.get(name)
            return [] if comp is None else [c for i in comp.instructions for c in contents_of(i)]

        for name in post_order([comp_name], callees, self.pairs.__contains__):
            comp = computations.get(name)
            pairs: set[tuple[str, str]] = set()
            if comp is not None:
                values: dict[str, frozenset[str]] = {}
                for instr in comp.instructions:
                    upstream: frozenset[str] = frozenset().union(*(values.get(o, _EMPTY) for o in instr.operands))
                    own = own_label(instr) if instr.frontend_attributes else None
                    labels = set() if own is None else {own}
                    for callee in contents_of(instr):
                        labels.update(self.sites.summary(callee))
                        pairs |= self.pairs.get(callee, frozenset())
                    if labels:
                        pairs.update((u, lab) for u in upstream for lab in labels if u != lab)
                        values[instr.name] = frozenset(labels)
                    else:
                        values[instr.name] = upstream
            self.pairs[name] = frozenset(pairs)
        return self.pairs[comp_name]

    def flow_nested(self, instr: HloInstruction, values: dict[str, Value]) -> Walk:
        """Flow into a while body / branches / call target; the value the instruction produces."""
        operands = [values.get(o, _EMPTY) for o in instr.operands]
        called = instr.called_computations
        if instr.opcode == "conditional":
            branches = []
            for k, c in enumerate(called):
                branches.append((yield self.flow(c, [operands[k + 1]] if k + 1 < len(operands) else [])))
            return self.union_elementwise(branches)
        if instr.opcode == "while":
            result: Value = _EMPTY
            for comp_name in called:
                root = yield self.flow(comp_name, operands[:1])
                # The body's root (a tuple like the loop state) is the loop's result; the condition returns a predicate.
                if isinstance(root, tuple) or result is _EMPTY:
                    result = root if isinstance(root, tuple) else self.union([result, root])
            return result if result is not _EMPTY else self.union(operands)
        roots = []
        for c in called:
            roots.append((yield self.flow(c, operands)))
        return roots[0] if len(roots) == 1 else self.union(roots)

    def union_elementwise(self, values: list[Value]) -> Value:
        if values and all(isinstance(v, tuple) and len(v) == len(values[0]) for v in values):  # type: ignore[arg-type]
            return tuple(self.union(parts) for parts in zip(*values))  # type: ignore[misc]
        return self.union(values)
