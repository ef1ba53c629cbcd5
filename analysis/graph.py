"""The kernel-call graph of a program: which kernel calls it makes, where, and what feeds what.

``call_graph(x)`` reads a program (a ``Lowered``, a ``Compiled``, HLO or StableHLO text, an HLO
file, an XLA dump directory, or an already parsed :class:`HloModule`) and returns a
``networkx.DiGraph``.

Model
-----
*Kernel sites.* Every op of a kernel call carries the call's label as a frontend attribute. One
node stands for one call **site**: the labelled instructions of one computation that have the
same label and are connected through operand chains of that label. Two identical calls at
different places of the program (same label, no same-label chain between them) are two nodes with
the same ``label``. A kernel's own backward pass without a custom VJP carries its forward label
and usually joins the forward's site, since it reads the forward's intermediates. Same-label
ops linked only through unlabelled tuples, get-tuple-elements, bitcasts, copies, reshapes or
transposes (which XLA inserts) stay one site. Independent pieces of one call (the two gradient
products of a matmul's backward, or ops XLA duplicated into several fusions) show up as several
sites of the same label.

*Fusions and other inlined computations.* XLA moves labelled ops into fused computations (and
reduce/sort/scatter reducers, async wrappers); on GPU the attributes then sit on the instructions
inside the fusion, not on the fusion. Every computation called by an instruction other than
``while``/``conditional``/``call`` is *inlined*: its labelled instructions are counted in the site
of the calling instruction, and the calling instruction (the fusion) is a member of that site. A
fusion holding several labels is a member of one site per label. A ``while``/``conditional``
that itself carries a label (a loop inside a kernel) absorbs the same-label instructions of its
bodies into its own site.

*Unlabelled custom-calls.* Rewrites such as the cuDNN attention rewrite create custom-calls that
carry no attributes while the ops around them keep their label. A custom-call without a label
whose neighbours (operands and users, looking through up to three get-tuple-element / bitcast /
copy / reshape / transpose / tuple hops) carry exactly one label joins that label's site; its
target is listed in ``attributed_custom_calls``. Bookkeeping targets (sharding annotations, host
offloading) are never attributed.

*Nesting.* Sites inside ``while`` bodies and ``conditional`` branches (and ``call`` targets) get
the chain of enclosing instructions in ``nesting``, outermost first, and a ``multiplicity``: the
product of the enclosing loops' ``known_trip_count`` (None when one is unknown, 1 when not nested;
a branch counts once, an upper bound). Each enclosing ``while`` / ``conditional`` that holds a site
is a node too (``kind="loop"`` / ``"branch"``), with ``kind="nesting"`` edges outer → inner →
site. A computation called from several places takes the nesting of its first caller.

*Data edges.* Site A → site B (``kind="data"``) when an instruction of B reads a value computed
by A directly or through unlabelled instructions. One pass per computation in text order (XLA
prints instructions operands-first) propagates, for every unlabelled value, the set of nearest
upstream sites; a labelled value's set is its own site(s), so the sets stay small. Sets are
shared frozensets (an unlabelled chain reuses its operand's set) and are capped at
``MAX_UPSTREAM`` sites, keeping the most recent ones, so the pass is linear in the program.
Tuples keep one set per element and get-tuple-element picks its element, and values flow into
``while`` bodies, ``conditional`` branches and ``call`` targets through their parameters and out
through their roots (each called computation is walked once, from its first caller; values
carried from one loop iteration to the next are not followed).

*Costs.* ``flops`` counts the site's labelled instructions (inside fusions too): a dot is
2 × result elements × contracted elements, a convolution 2 × result elements × kernel elements
per output feature, elementwise ops one per result element, others nothing. ``bytes`` is the
size of every value the site's top-level instructions (not the ones inside fusions) write plus
every value they read from outside the site, each counted once: the memory traffic of the call.

StableHLO text has no computations to walk: it yields a degraded graph, one node per distinct
label with its op count in ``instructions``, no edges and no costs (``graph.graph["degraded"]``).
"""

from __future__ import annotations

import functools
import gc
import json
import math
import re
import shutil
import subprocess
from collections import Counter
from collections.abc import Iterable, Mapping
from itertools import repeat
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Union

import networkx as nx

from ejlabel.labels import LABEL_ATTRIBUTE, LABEL_RE, program_texts

from .hlo import HloComputation, HloInstruction, HloModule, parse_hlo, stablehlo_frontend_attributes

__all__ = ["MAX_UPSTREAM", "call_graph", "draw", "from_node_link_json", "to_dot", "to_node_link_json"]

MAX_UPSTREAM = 16
"""Most upstream sites remembered per unlabelled value (the most recent ones are kept)."""

_NESTING_KIND = {"while": "loop", "conditional": "branch", "call": "call"}
_BACKWARD_SUFFIX = ".bwd"
_TRANSPARENT = frozenset({"get-tuple-element", "bitcast", "copy", "reshape", "transpose", "tuple"})
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
_ELEMENTWISE = frozenset(
    """abs add and atan2 cbrt ceil clamp clz compare complex convert cosine divide erf exponential
    exponential-minus-one floor imag is-finite log log-plus-one logistic maximum minimum multiply
    negate not or popcnt power real remainder round-nearest-afz round-nearest-even rsqrt select
    shift-left shift-right-arithmetic shift-right-logical sign sine sqrt subtract tan tanh xor""".split()
)

# Attributes the tolerant parser does not keep but the graph needs; read straight from the text.
_EXTRA_ATTRS = re.compile(
    r"get-tuple-element\([^()\n]*\), index=(\d+)"
    r"|parameter\((\d+)\)"
    r"|lhs_contracting_dims=\{([\d,]*)\}"
    r"|dim_labels=([\w]+_[\w]+->[\w]+)"
)
_LINE_NAME = re.compile(r"[ \t]*(?:ROOT[ \t]+)?%?([^\s=(){}\[\],\"%]+)[ \t]*=")
_ARRAY_SHAPE = re.compile(r"([a-z][a-z0-9]*)\[([^\]]*)\]")
_DIGITS = re.compile(r"\d+")
_MLIR_MODULE = re.compile(r"module\s+@\"?([\w.$\-]+)")

Value = Union[frozenset, tuple]  # upstream sites of a value; tuples hold one Value per element
_EMPTY: frozenset = frozenset()


# ---------------------------------------------------------------------------
# Shapes and costs.


@functools.lru_cache(maxsize=65536)
def _dtype_bits(dtype: str) -> int:
    """Bits per element of an HLO element type: the width in its name (``bf16`` 16, ``f8e4m3fn`` 8)."""
    if dtype == "pred":
        return 8
    found = _DIGITS.search(dtype)
    return int(found.group()) if found else 0  # token, opaque: no data


@functools.lru_cache(maxsize=65536)
def _shape_info(shape: str) -> tuple[int, tuple[tuple[int, ...], ...]]:
    """``(bytes, dims of each array)`` of a shape string; tuples are the sum of their arrays."""
    bits = 0
    arrays: list[tuple[int, ...]] = []
    for dtype, dims_text in _ARRAY_SHAPE.findall(shape):
        dims = tuple(int(d) for d in _DIGITS.findall(dims_text)) if dims_text else ()
        arrays.append(dims)
        bits += _dtype_bits(dtype) * math.prod(dims)
    return (bits + 7) // 8, tuple(arrays)


def _shape_bytes(shape: str) -> int:
    return _shape_info(shape)[0]


def _dims(shape: str) -> tuple[int, ...] | None:
    arrays = _shape_info(shape)[1]
    return arrays[0] if len(arrays) == 1 else None


@dataclass(slots=True)
class _Extra:
    """Per-instruction attributes read from the raw text (absent for an ``HloModule`` input)."""

    gte_index: dict[str, int] = field(default_factory=dict)
    param_index: dict[str, int] = field(default_factory=dict)
    lhs_contracting: dict[str, tuple[int, ...]] = field(default_factory=dict)
    dim_labels: dict[str, str] = field(default_factory=dict)


def _read_extra(text: str | None) -> _Extra:
    extra = _Extra()
    if not text:
        return extra
    for found in _EXTRA_ATTRS.finditer(text):
        start = text.rfind("\n", 0, found.start()) + 1
        head = _LINE_NAME.match(text, start)
        if head is None:
            continue
        name = head.group(1)
        gte, param, contracting, labels = found.groups()
        if gte is not None:
            extra.gte_index[name] = int(gte)
        elif param is not None:
            extra.param_index[name] = int(param)
        elif contracting is not None:
            extra.lhs_contracting[name] = tuple(int(d) for d in _DIGITS.findall(contracting))
        else:
            extra.dim_labels[name] = labels
    return extra


def _flops(instr: HloInstruction, comp: HloComputation, extra: _Extra) -> int:
    """Estimated floating-point operations of one instruction (see the module docstring)."""
    opcode = instr.opcode
    if opcode in _ELEMENTWISE:
        dims = _dims(instr.shape)
        return math.prod(dims) if dims is not None else 0
    if opcode not in ("dot", "convolution") or len(instr.operands) < 2:
        return 0
    out = _dims(instr.shape)
    lhs_instr = comp.instruction(instr.operands[0])
    rhs_instr = comp.instruction(instr.operands[1])
    if out is None or lhs_instr is None or rhs_instr is None:
        return 0
    lhs, rhs = _dims(lhs_instr.shape), _dims(rhs_instr.shape)
    if lhs is None or rhs is None:
        return 0
    if opcode == "dot":
        contracting = extra.lhs_contracting.get(instr.name)
        if contracting is not None and all(d < len(lhs) for d in contracting):
            contracted = math.prod(lhs[d] for d in contracting)
        else:
            # Without the attribute: assume no batch dims, so lhs·rhs = result·contracted².
            contracted = math.isqrt(math.prod(lhs) * math.prod(rhs) // max(1, math.prod(out)))
        return 2 * math.prod(out) * contracted
    labels = extra.dim_labels.get(instr.name)
    if labels is None:
        return 0
    kernel_labels = labels.split("_", 1)[1].split("->", 1)[0]
    position = kernel_labels.find("o")
    if position < 0 or position >= len(rhs) or rhs[position] == 0:
        return 0
    return 2 * math.prod(out) * (math.prod(rhs) // rhs[position])


# ---------------------------------------------------------------------------
# Labels inside computations.


def _own_label(instr: HloInstruction) -> str | None:
    value = instr.frontend_attributes.get(LABEL_ATTRIBUTE)
    if value is None or LABEL_RE.fullmatch(value) is None:
        return None
    return value


@dataclass(slots=True)
class _Inner:
    """What one label contributes inside a called computation (and its callees)."""

    instructions: int = 0
    opcodes: Counter = field(default_factory=Counter)
    flops: int = 0

    def add(self, other: _Inner) -> None:
        self.instructions += other.instructions
        self.opcodes.update(other.opcodes)
        self.flops += other.flops


@dataclass(slots=True)
class _Site:
    uid: int
    label: str
    comp: HloComputation
    members: list[HloInstruction]
    attributed: list[str]
    node: str = ""


class _Builder:
    """Builds the graph of one module; state shared by its passes."""

    def __init__(self, module: HloModule, module_name: str, extra: _Extra, graph: nx.DiGraph, resolve: Any) -> None:
        self.module = module
        self.name = module_name
        self.extra = extra
        self.graph = graph
        self.resolve = resolve
        self.callers = module.callers()
        self.summaries: dict[str, dict[str, _Inner]] = {}
        self.contexts: dict[str, tuple[HloInstruction, ...]] = {}
        self.absorbed_labels: dict[str, frozenset[str]] = {}
        self.sites: list[_Site] = []
        self.site_sets: dict[tuple[str, str], frozenset] = {}  # (computation, instruction) -> site uids
        self.flowed: dict[str, Value] = {}
        self.in_flow: set[str] = set()
        self.user_maps: dict[str, dict[str, list[str]]] = {}
        self.data_edges: set[tuple[int, int]] = set()  # (upstream site uid, site uid)

    def users(self, comp: HloComputation) -> dict[str, list[str]]:
        """Users of each instruction of ``comp``; built only for computations that hold sites."""
        found = self.user_maps.get(comp.name)
        if found is None:
            found = {}
            for instr in comp.instructions:
                for operand in instr.operands:
                    found.setdefault(operand, []).append(instr.name)
            self.user_maps[comp.name] = found
        return found

    # -- computation roles ---------------------------------------------------

    def is_inlined(self, comp_name: str) -> bool:
        callers = self.callers.get(comp_name)
        return bool(callers) and all(c.opcode not in _NESTING_KIND for c in callers)

    def context(self, comp_name: str) -> tuple[HloInstruction, ...]:
        """Enclosing while/conditional/call instructions of a computation, outermost first."""
        found = self.contexts.get(comp_name)
        if found is not None:
            return found
        self.contexts[comp_name] = ()  # breaks call cycles in malformed text
        callers = self.callers.get(comp_name, [])
        nesting = [c for c in callers if c.opcode in _NESTING_KIND]
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
            if caller.opcode in _NESTING_KIND:
                own = _own_label(caller)
                if own is not None:
                    labels.add(own)
                labels |= self.absorbed(caller.computation)
        found = frozenset(labels)
        self.absorbed_labels[comp_name] = found
        return found

    def summary(self, comp_name: str) -> dict[str, _Inner]:
        """Per label: labelled instructions of a called computation and of everything it calls."""
        found = self.summaries.get(comp_name)
        if found is not None:
            return found
        self.summaries[comp_name] = {}
        comp = self.module.computations.get(comp_name)
        result: dict[str, _Inner] = {}
        if comp is not None:
            for instr in comp.instructions:
                own = _own_label(instr)
                if own is not None:
                    inner = result.setdefault(own, _Inner())
                    inner.instructions += 1
                    inner.opcodes[instr.opcode] += 1
                    inner.flops += _flops(instr, comp, self.extra)
                for callee in instr.called_computations:
                    for lab, inner in self.summary(callee).items():
                        result.setdefault(lab, _Inner()).add(inner)
        self.summaries[comp_name] = result
        return result

    def labels_of(self, instr: HloInstruction, absorbed: frozenset[str]) -> tuple[str, ...]:
        """Labels an instruction of a site computation is a member of."""
        if not instr.called_computations:
            if not instr.frontend_attributes:
                return ()  # the common case: nothing to look at
            own = _own_label(instr)
            return () if own is None or own in absorbed else (own,)
        own = _own_label(instr)
        if instr.opcode in _NESTING_KIND:
            return () if own is None or own in absorbed else (own,)
        labels = dict.fromkeys(() if own is None else (own,))
        for callee in instr.called_computations:
            labels.update(dict.fromkeys(self.summary(callee)))
        return tuple(lab for lab in labels if lab not in absorbed)

    def inner_of(self, instr: HloInstruction, lab: str) -> _Inner:
        """The part of ``lab`` that sits in computations ``instr`` calls (and that it absorbs)."""
        total = _Inner()
        if instr.opcode in _NESTING_KIND and _own_label(instr) != lab:
            return total
        for callee in instr.called_computations:
            inner = self.summary(callee).get(lab)
            if inner is not None:
                total.add(inner)
        return total

    # -- sites -----------------------------------------------------------------

    def find_sites(self, comp: HloComputation) -> None:
        """Union-find over (instruction, label) memberships linked by same-label operands."""
        absorbed = self.absorbed(comp.name)
        member_labels: dict[str, tuple[str, ...]] = {}
        for instr in comp.instructions:
            labels = self.labels_of(instr, absorbed)
            if labels:
                member_labels[instr.name] = labels
        if not member_labels:
            return
        users = self.users(comp)
        index: dict[tuple[str, str], int] = {}
        owners: list[HloInstruction] = []
        parent: list[int] = []
        by_name = {instr.name: instr for instr in comp.instructions}

        def find(i: int) -> int:
            while parent[i] != i:
                parent[i] = parent[parent[i]]
                i = parent[i]
            return i

        def union(a: int, b: int) -> None:
            ra, rb = find(a), find(b)
            if ra != rb:
                parent[max(ra, rb)] = min(ra, rb)  # the earlier instruction names the site

        attributed: dict[str, list[str]] = {}
        # XLA puts unlabelled tuples, bitcasts and copies between the ops of one call: same-label
        # memberships reached through them (label -> membership ids) still link.
        through: dict[str, dict[str, list[int]]] = {}
        for instr in comp.instructions:
            labels = member_labels.get(instr.name)
            if labels is None and instr.opcode == "custom-call" and instr.custom_call_target not in _BOOKKEEPING_TARGETS:
                neighbours = _neighbour_labels(instr, by_name, users, member_labels)
                if len(neighbours) == 1:
                    labels = (next(iter(neighbours)),)
                    member_labels[instr.name] = labels
                    attributed[instr.name] = [neighbours[labels[0]]]
            if labels is None:
                if instr.opcode in _TRANSPARENT:
                    passed = _pass_through(instr.operands, member_labels, index, through)
                    if passed:
                        through[instr.name] = passed
                continue
            for lab in labels:
                me = len(parent)
                index[(instr.name, lab)] = me
                owners.append(instr)
                parent.append(me)
                for operand in instr.operands:
                    other = index.get((operand, lab))
                    if other is not None:
                        union(me, other)
                    else:
                        for other in through.get(operand, {}).get(lab, ()):
                            union(me, other)
        # Attributed custom-calls also join the same-label sites of their users (after them in text).
        for name, _ in attributed.items():
            lab = member_labels[name][0]
            me = index[(name, lab)]
            for linked in _linked_names(name, by_name, users, lab, member_labels):
                other = index.get((linked, lab))
                if other is not None:
                    union(me, other)

        groups: dict[int, list[int]] = {}
        for i in range(len(parent)):
            groups.setdefault(find(i), []).append(i)
        keys = list(index)
        for root in sorted(groups):
            members = [owners[i] for i in groups[root]]
            lab = keys[root][1]
            site = _Site(len(self.sites), lab, comp, members, [])
            for instr in members:
                if instr.name in attributed:
                    site.attributed.append(instr.custom_call_target or "")
            self.sites.append(site)
        # Map each member instruction to the uids of its sites.
        first_uid = len(self.sites) - len(groups)
        root_uid = {root: first_uid + k for k, root in enumerate(sorted(groups))}
        per_name: dict[str, list[int]] = {}
        for (name, _lab), i in index.items():
            per_name.setdefault(name, []).append(root_uid[find(i)])
        for name, uids in per_name.items():
            self.site_sets[(comp.name, name)] = frozenset(uids)

    # -- data flow ---------------------------------------------------------------

    def flow(self, comp_name: str, seeds: list[Value]) -> Value:
        """Propagate upstream sites through one computation; returns its root's value."""
        if comp_name in self.flowed:
            return self.flowed[comp_name]
        comp = self.module.computations.get(comp_name)
        if comp is None or comp_name in self.in_flow:
            return _union(seeds)
        self.in_flow.add(comp_name)
        values: dict[str, Value] = {}
        add_edges = self.data_edges.update
        site_sets = self.site_sets
        gte_index = self.extra.gte_index
        param_index = self.extra.param_index
        cname = comp.name
        root_value: Value = _EMPTY
        for instr in comp.instructions:
            name = instr.name
            opcode = instr.opcode
            mine = site_sets.get((cname, name))
            if mine is not None:
                for operand in instr.operands:
                    upstream = values.get(operand, _EMPTY)
                    if isinstance(upstream, tuple):
                        upstream = _flatten(upstream)
                    if upstream and upstream is not mine:
                        for s in mine:
                            add_edges(zip(upstream, repeat(s)))
                if opcode in _NESTING_KIND:
                    self.flow_nested(instr, values)
                value: Value = mine
            elif opcode == "parameter":
                if not seeds:
                    value = _EMPTY
                elif len(seeds) == 1:
                    value = seeds[0]
                else:
                    position = param_index.get(name)
                    value = seeds[position] if position is not None and position < len(seeds) else _union(seeds)
            elif opcode == "tuple":
                value = tuple(values.get(o, _EMPTY) for o in instr.operands)
            elif opcode == "get-tuple-element":
                source = values.get(instr.operands[0], _EMPTY) if instr.operands else _EMPTY
                position = gte_index.get(name)
                if isinstance(source, tuple) and position is not None and position < len(source):
                    value = source[position]
                else:
                    value = _flatten(source)
            elif opcode in _NESTING_KIND:
                value = self.flow_nested(instr, values)
            elif len(instr.operands) == 1:
                value = values.get(instr.operands[0], _EMPTY)
                if opcode not in ("copy", "opt-barrier", "bitcast") and isinstance(value, tuple):
                    value = _flatten(value)
            elif len(instr.operands) == 2:
                a = values.get(instr.operands[0], _EMPTY)
                b = values.get(instr.operands[1], _EMPTY)
                # Inline fast path of _union for the common binary op.
                if a is b or not b:
                    value = a if isinstance(a, frozenset) else _flatten(a)
                elif not a:
                    value = b if isinstance(b, frozenset) else _flatten(b)
                else:
                    value = _union((a, b))
            else:
                value = _union([values.get(o, _EMPTY) for o in instr.operands])
            values[name] = value
            if instr.is_root:
                root_value = value
        if comp.root is not None and comp.root in values:
            root_value = values[comp.root]
        self.in_flow.discard(comp_name)
        self.flowed[comp_name] = root_value
        return root_value

    def flow_nested(self, instr: HloInstruction, values: dict[str, Value]) -> Value:
        """Flow into a while body / branches / call target; the value the instruction produces."""
        operands = [values.get(o, _EMPTY) for o in instr.operands]
        called = instr.called_computations
        if instr.opcode == "conditional":
            branches = [self.flow(c, [operands[k + 1]] if k + 1 < len(operands) else []) for k, c in enumerate(called)]
            return _union_elementwise(branches)
        if instr.opcode == "while":
            result: Value = _EMPTY
            for comp_name in called:
                root = self.flow(comp_name, operands[:1])
                # The body's root (a tuple like the loop state) is the loop's result; the condition returns a predicate.
                if isinstance(root, tuple) or result is _EMPTY:
                    result = root if isinstance(root, tuple) else _union([result, root])
            return result if result is not _EMPTY else _union(operands)
        roots = [self.flow(c, operands) for c in called]
        return roots[0] if len(roots) == 1 else _union(roots)

    # -- nodes ---------------------------------------------------------------

    def node_of(self, site: _Site, taken: set[str]) -> None:
        first = site.members[0]
        node = f"{self.name}/{site.comp.name}/{first.name}"
        if node in taken:
            # One fusion can start sites of several labels.
            op_id, key = _split_label(site.label)
            node = f"{node}#{op_id}:{key[:8]}"
        taken.add(node)
        site.node = node

    def add_site_node(self, site: _Site) -> None:
        comp = site.comp
        lab = site.label
        member_names = {m.name for m in site.members}
        users = self.users(comp)
        opcodes: Counter = Counter()
        flops = 0
        instructions = 0
        written = 0
        inputs: dict[str, str] = {}
        shapes: list[str] = []
        for instr in site.members:
            instructions += 1
            opcodes[instr.opcode] += 1
            flops += _flops(instr, comp, self.extra)
            inner = self.inner_of(instr, lab)
            instructions += inner.instructions
            opcodes.update(inner.opcodes)
            flops += inner.flops
            written += _shape_bytes(instr.shape)
            for operand in instr.operands:
                if operand not in member_names and operand not in inputs:
                    source = comp.instruction(operand)
                    if source is not None and _passes_from(source, member_names):
                        continue
                    inputs[operand] = source.shape if source is not None else ""
            outside = [u for u in users.get(instr.name, ()) if not self.stays_inside(comp, u, member_names, users)]
            if outside or instr.is_root or not users.get(instr.name):
                shapes.append(instr.shape)
        read = sum(_shape_bytes(s) for s in inputs.values())
        context = self.context(comp.name)
        op_id, call_key = _split_label(lab)
        op, _, version = op_id.rpartition("@v")
        found = self.resolve(op_id, call_key)
        self.graph.add_node(
            site.node,
            kind="kernel",
            label=lab,
            op=op,
            version=version,
            op_id=op_id,
            call_key=call_key,
            config=None if found is None else found.cfg,
            provenance=None if found is None else found.provenance,
            instructions=instructions,
            opcodes=dict(opcodes),
            flops=flops,
            bytes=written + read,
            nesting=tuple(c.name for c in context),
            multiplicity=_multiplicity(context),
            direction="backward" if op.endswith(_BACKWARD_SUFFIX) else "forward",
            computation=comp.name,
            module=self.name,
            shapes=shapes,
            input_shapes=[s for s in inputs.values() if s],
            attributed_custom_calls=list(site.attributed),
            members=[m.name for m in site.members],
        )
        self.add_nesting(site.node, context)

    def stays_inside(self, comp: HloComputation, user: str, members: set[str], users: Mapping[str, list[str]]) -> bool:
        """Whether a value read by ``user`` stays in the site: a member, or a transparent hop into it."""
        if user in members:
            return True
        instr = comp.instruction(user)
        if instr is None or instr.opcode not in _TRANSPARENT or _own_label(instr) is not None or instr.is_root:
            return False
        following = users.get(user, ())
        return bool(following) and all(u in members for u in following)

    def add_nesting(self, node: str, context: tuple[HloInstruction, ...]) -> None:
        """Loop/branch nodes for the enclosing whiles/conditionals, and nesting edges down to ``node``."""
        parent: str | None = None
        for depth, instr in enumerate(context):
            kind = _NESTING_KIND[instr.opcode]
            if kind == "call":
                continue
            loop = f"{self.name}/{instr.computation}/{instr.name}"
            if loop not in self.graph:
                outer = context[:depth]
                times = _multiplicity(outer + (instr,)) if kind == "loop" else _multiplicity(outer)
                self.graph.add_node(
                    loop,
                    kind=kind,
                    label=None,
                    multiplicity=times,
                    trip_count=instr.known_trip_count,
                    nesting=tuple(c.name for c in outer),
                    computation=instr.computation,
                    module=self.name,
                )
            if parent is not None:
                self.graph.add_edge(parent, loop, kind="nesting")
            parent = loop
        if parent is not None:
            self.graph.add_edge(parent, node, kind="nesting")

    # -- driver ----------------------------------------------------------------

    def build(self) -> None:
        for comp in self.module.computations.values():
            if not self.is_inlined(comp.name):
                self.find_sites(comp)
        taken: set[str] = set(self.graph.nodes)
        for site in self.sites:
            self.node_of(site, taken)
        for site in self.sites:
            self.add_site_node(site)
        if not self.sites:
            return
        # Data flow from the computations nobody calls (the entry first), then any left unwalked.
        order = [self.module.entry] + [c for c in self.module.computations if c != self.module.entry]
        for comp_name in order:
            if comp_name not in self.callers:
                self.flow(comp_name, [])
        for comp_name in order:
            if not self.is_inlined(comp_name):
                self.flow(comp_name, [])
        nodes = [site.node for site in self.sites]
        self.graph.add_edges_from(((nodes[u], nodes[s]) for u, s in self.data_edges if u != s), kind="data")


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
                    if nxt is not None and nxt.opcode in _TRANSPARENT and _own_label(nxt) is None:
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


def _passes_from(instr: HloInstruction, members: set[str]) -> bool:
    """A transparent unlabelled op fed only by the site's members: a hop inside the site."""
    return (
        instr.opcode in _TRANSPARENT
        and _own_label(instr) is None
        and bool(instr.operands)
        and all(o in members for o in instr.operands)
    )


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


def _flatten(value: Value) -> frozenset:
    if isinstance(value, frozenset):
        return value
    return _union([_flatten(v) for v in value])


def _union(values: Iterable[Value]) -> frozenset:
    """Union of upstream sets, sharing the operand's set when only one is non-empty."""
    distinct: list[frozenset] = []
    for value in values:
        flat = _flatten(value) if isinstance(value, tuple) else value
        if flat and not any(flat is d for d in distinct):
            distinct.append(flat)
    if not distinct:
        return _EMPTY
    if len(distinct) == 1:
        return distinct[0]
    if len(distinct) == 2:
        # Accumulating chains mostly re-merge what they already hold: share the larger set.
        a, b = distinct
        if a >= b:
            return a
        if b >= a:
            return b
    merged = frozenset().union(*distinct)
    if len(merged) > MAX_UPSTREAM:
        merged = frozenset(sorted(merged)[-MAX_UPSTREAM:])
    return merged


def _union_elementwise(values: list[Value]) -> Value:
    if values and all(isinstance(v, tuple) and len(v) == len(values[0]) for v in values):  # type: ignore[arg-type]
        return tuple(_union(parts) for parts in zip(*values))  # type: ignore[misc]
    return _union(values)


def _multiplicity(context: Iterable[HloInstruction]) -> int | None:
    times = 1
    for instr in context:
        if instr.opcode == "while":
            if instr.known_trip_count is None:
                return None
            times *= instr.known_trip_count
    return times


def _split_label(lab: str) -> tuple[str, str]:
    match = LABEL_RE.fullmatch(lab)
    if match is None:
        return lab, ""
    return match.group("op"), match.group("key")


# ---------------------------------------------------------------------------
# Inputs.


def _is_stablehlo(text: str) -> bool:
    if text.lstrip().startswith("HloModule"):
        return False
    return "stablehlo." in text or "func.func" in text


def _sources(x: Any) -> list[tuple[str | None, HloModule | str]]:
    """``(name hint, parsed module or StableHLO text)`` for each module of ``x``."""
    import jax

    if isinstance(x, HloModule):
        return [(None, x)]
    if isinstance(x, jax.stages.Lowered):
        return [(None, x.compiler_ir("hlo").as_hlo_text())]
    if isinstance(x, (str, Path)) and not (isinstance(x, str) and "\n" in x) and Path(x).is_dir():
        files = sorted(p for p in Path(x).rglob("*after_optimizations.txt") if p.is_file())
        if not files:
            files = sorted(p for p in Path(x).rglob("*before_optimizations.txt") if p.is_file())
        if files:
            return [(None, p.read_text(errors="replace")) for p in files]
    return [(None, text) for text in program_texts(x)]


def call_graph(x: Any, selector: Any = None, device: str | None = None) -> nx.DiGraph:
    """The kernel-call graph of ``x`` (see the module docstring for the model).

    ``x`` is anything :func:`ejlabel.labels.program_texts` accepts, or a parsed ``HloModule``: a
    ``Lowered`` is read as HLO (which has computations, unlike its StableHLO text), a dump
    directory through its ``*after_optimizations.txt`` files (else ``*before_optimizations.txt``),
    one module each. ``config``/``provenance`` come from ``selector.resolve((device, op_id,
    call_key))`` when a selector is given; ``device`` defaults to this process's device.
    """
    if device is None and selector is not None:
        from ejlabel.fingerprint import device_fingerprint

        device = device_fingerprint()
    graph = nx.DiGraph()
    graph.graph["device"] = device
    graph.graph["modules"] = []
    graph.graph["degraded"] = False
    resolved: dict[tuple[str, str], Any] = {}

    def resolve(op_id: str, call_key: str) -> Any:
        key = (op_id, call_key)
        if key not in resolved:
            resolved[key] = None if selector is None else selector.resolve((device, op_id, call_key))
        return resolved[key]

    names: Counter = Counter()
    # The passes allocate many small acyclic objects; the cycle collector walking them again and
    # again as they grow would cost more than the passes themselves.
    collecting = gc.isenabled()
    gc.disable()
    try:
        _add_modules(graph, _sources(x), names, resolve)
    finally:
        if collecting:
            gc.enable()
    return graph


def _add_modules(graph: nx.DiGraph, sources: list[tuple[str | None, HloModule | str]], names: Counter, resolve: Any) -> None:
    for _, source in sources:
        if isinstance(source, str) and _is_stablehlo(source):
            found = _MLIR_MODULE.search(source)
            name = _unique(found.group(1) if found else "module", names)
            graph.graph["modules"].append(name)
            graph.graph["degraded"] = True
            _add_stablehlo(graph, source, name, resolve)
            continue
        module = source if isinstance(source, HloModule) else parse_hlo(source)
        name = _unique(module.name or "module", names)
        graph.graph["modules"].append(name)
        extra = _read_extra(source if isinstance(source, str) else None)
        _Builder(module, name, extra, graph, resolve).build()


def _unique(name: str, taken: Counter) -> str:
    taken[name] += 1
    return name if taken[name] == 1 else f"{name}.{taken[name]}"


def _add_stablehlo(graph: nx.DiGraph, text: str, module: str, resolve: Any) -> None:
    """Degraded mode: one node per distinct label, its op count, nothing else known."""
    counts: Counter = Counter()
    for attrs in stablehlo_frontend_attributes(text):
        lab = attrs.get(LABEL_ATTRIBUTE)
        if lab is not None and LABEL_RE.fullmatch(lab):
            counts[lab] += 1
    for lab, count in counts.items():
        op_id, call_key = _split_label(lab)
        op, _, version = op_id.rpartition("@v")
        found = resolve(op_id, call_key)
        graph.add_node(
            f"{module}/{lab}",
            kind="kernel",
            label=lab,
            op=op,
            version=version,
            op_id=op_id,
            call_key=call_key,
            config=None if found is None else found.cfg,
            provenance=None if found is None else found.provenance,
            instructions=count,
            opcodes={},
            flops=0,
            bytes=0,
            nesting=(),
            multiplicity=None,
            direction="backward" if op.endswith(_BACKWARD_SUFFIX) else "forward",
            computation="",
            module=module,
            shapes=[],
            input_shapes=[],
            attributed_custom_calls=[],
            members=[],
        )


# ---------------------------------------------------------------------------
# Export.


def _jsonable(value: Any) -> Any:
    if isinstance(value, (tuple, list)):
        return [_jsonable(v) for v in value]
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    return repr(value)


def _jsonable_config(cfg: Any) -> Any:
    from ejlabel.serialize import to_jsonable

    try:
        encoded = to_jsonable(cfg)
        json.dumps(encoded)
        return encoded
    except (TypeError, ValueError):
        return repr(cfg)


_CONFIG_ENCODING = "ejlabel.serialize.to_jsonable, else repr"


def to_node_link_json(graph: nx.DiGraph) -> str:
    """The graph as node-link JSON (edges under ``"edges"``); configs in their tagged JSON form."""
    # A graph read back from JSON holds configs in their JSON form already: encoding them again
    # would wrap them in another layer of tags.
    encoded = graph.graph.get("config_encoding") == _CONFIG_ENCODING
    copy = nx.DiGraph()
    copy.graph.update({k: _jsonable(v) for k, v in graph.graph.items()})
    copy.graph["config_encoding"] = _CONFIG_ENCODING
    for node, data in graph.nodes(data=True):
        attrs = {k: (_jsonable_config(v) if k == "config" and not encoded else _jsonable(v)) for k, v in data.items()}
        copy.add_node(node, **attrs)
    for a, b, data in graph.edges(data=True):
        copy.add_edge(a, b, **{k: _jsonable(v) for k, v in data.items()})
    return json.dumps(nx.node_link_data(copy, edges="edges"), sort_keys=True)


def from_node_link_json(text: str) -> nx.DiGraph:
    """Read :func:`to_node_link_json` output back; ``nesting`` becomes a tuple again.

    Configs stay in their JSON form: decoding them would import the classes the text names, which
    a file from elsewhere should not make this process do.
    """
    data = json.loads(text)
    graph = nx.node_link_graph(data, directed=True, multigraph=False, edges="edges")
    for _, attrs in graph.nodes(data=True):
        if isinstance(attrs.get("nesting"), list):
            attrs["nesting"] = tuple(attrs["nesting"])
    return graph


def _dot_quote(text: str) -> str:
    """A DOT double-quoted string; newlines become DOT's ``\\n`` line breaks."""
    escaped = text.replace("\\", "\\\\").replace('"', '\\"')
    return '"' + escaped.replace("\r", "").replace("\n", "\\n") + '"'


def _short(text: str, width: int = 60) -> str:
    return text if len(text) <= width else text[: width - 3] + "..."


def to_dot(graph: nx.DiGraph) -> str:
    """The graph in Graphviz DOT: kernels as boxes, loops/branches as ellipses.

    Backward kernels are filled in a different colour; kernels with no known config are drawn
    dashed and red.
    """
    lines = ["digraph kernels {", "  rankdir=TB;", '  node [fontname="monospace", fontsize=10];']
    for node, data in graph.nodes(data=True):
        kind = data.get("kind", "kernel")
        if kind == "kernel":
            times = data.get("multiplicity")
            text = "\n".join(
                [
                    f"{data.get('op', '?')}@v{data.get('version', '?')}" + (f" x{times}" if times not in (None, 1) else ""),
                    str(data.get("call_key", ""))[:8],
                    _short("unseen" if data.get("config") is None else repr(data["config"])),
                    str(data.get("provenance") or "no config"),
                ]
            )
            style = ["filled"]
            colour = "black"
            fill = "lightsalmon" if data.get("direction") == "backward" else "lightblue"
            if data.get("config") is None:
                style.append("dashed")
                colour = "red"
            attrs = f'shape=box, style="{",".join(style)}", color={colour}, fillcolor={fill}'
        else:
            times = data.get("multiplicity")
            text = f"{kind} {node.rsplit('/', 1)[-1]}" + ("" if times is None else f"\nx{times}")
            attrs = "shape=ellipse, color=gray40"
        lines.append(f"  {_dot_quote(node)} [label={_dot_quote(text)}, {attrs}];")
    for a, b, data in graph.edges(data=True):
        style = "style=dotted, color=gray50" if data.get("kind") == "nesting" else "color=black"
        lines.append(f"  {_dot_quote(a)} -> {_dot_quote(b)} [{style}];")
    lines.append("}")
    return "\n".join(lines) + "\n"


def draw(graph: nx.DiGraph, path: str | Path, format: str | None = None) -> Path:
    """Render the graph to ``path`` (SVG, PNG, ... from the suffix or ``format``) with Graphviz's ``dot``."""
    path = Path(path)
    fmt = (format or path.suffix.lstrip(".") or "svg").lower()
    dot = shutil.which("dot")
    if dot is None:
        raise RuntimeError(
            "drawing needs Graphviz's `dot` program on PATH (apt install graphviz / brew install graphviz); "
            "`to_dot()` gives the DOT text"
        )
    done = subprocess.run([dot, f"-T{fmt}", "-o", str(path)], input=to_dot(graph), capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"dot failed ({done.returncode}): {done.stderr.strip()}")
    return path
