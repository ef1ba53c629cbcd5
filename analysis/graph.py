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
through their roots (values carried from one loop iteration to the next are not followed). Each
called computation is walked once: one called from a single place with its caller's values; one
called from several places (both layers of a model calling one ``silu`` computation) with a
placeholder set per parameter (per tuple element), keeping what its root carries and what its
sites read in terms of those placeholders, and each caller substitutes its own operands' sets. So
a shared computation passes each caller's producers to that caller's consumers only, its own
sites (one node each, whatever the caller) read from every caller, and the pass stays linear:
a caller costs the size of its callee's root value and of the placeholders its sites read, not
the callee's size. A set keeps up to ``MAX_UPSTREAM`` placeholders besides its ``MAX_UPSTREAM``
sites. A fusion holding several labels
also links their sites by the order inside it: site of label A → site of label B when an op of A
feeds an op of B in the fused computation (nearest labels, through unlabelled ops). On GPU one
gemm fusion can hold a producer's elementwise ops, the dot and an epilogue of three kernels, and
that order is the only data order left between them.

*Costs.* ``flops`` counts the site's labelled instructions (inside fusions too): a dot, or a
library gemm custom-call (``__cublas$gemm`` and the like, contracting dims from its backend
config), is 2 × result elements × contracted elements, a convolution 2 × result elements × kernel elements
per output feature, elementwise ops one per result element, others nothing. ``bytes`` is the
size of every value the site's top-level instructions (not the ones inside fusions) write plus
every value they read from outside the site, each counted once: the memory traffic of the call.

StableHLO text has no computations to walk: it yields a degraded graph, one node per distinct
label with its op count in ``instructions``, no edges and no costs (``graph.graph["degraded"]``).
"""

from __future__ import annotations

import bisect
import functools
import gc
import json
import math
import re
import shutil
import subprocess
from collections import Counter, defaultdict
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Union

import networkx as nx

from ejlabel.core.label_format import LABEL_ATTRIBUTE, LABEL_RE
from ejlabel.core.labels import program_texts

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
_SHAPE_COMMENT = re.compile(r"/\*.*?\*/")
# Library gemm custom-calls (GPU): a dot the compiler handed to a vendor library, same flops.
_GEMM_TARGETS = frozenset({"__cublas$gemm", "__cublas$lt$matmul", "__cublas$lt$matmul$f8", "__rocblas$gemm", "__hipblas$lt$matmul"})
_GEMM_CONTRACTING = re.compile(r'"lhs_contracting_dimensions"\s*:\s*\[([^\]]*)\]')
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


@functools.lru_cache(maxsize=65536)
def _elements(shape: str) -> int:
    """Elements of an array shape (an elementwise op's flops); 0 for a tuple."""
    dims = _dims(shape)
    return math.prod(dims) if dims is not None else 0


@functools.lru_cache(maxsize=65536)
def _tuple_elements(shape: str) -> tuple[str, ...] | None:
    """The element shapes of a tuple shape (``"(f32[2]{0}, (s32[], pred[]))"``); None for an array."""
    text = shape.strip()
    if not text.startswith("("):
        return None
    if "/*" in text:
        text = _SHAPE_COMMENT.sub("", text)
    parts: list[str] = []
    depth = 0
    start = 1
    for i, ch in enumerate(text):
        if ch in "([{":
            depth += 1
        elif ch in ")]}":
            depth -= 1
            if depth == 0:
                part = text[start:i].strip()
                if part:
                    parts.append(part)
                break
        elif ch == "," and depth == 1:
            parts.append(text[start:i].strip())
            start = i + 1
    return tuple(parts)


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


def _flops(instr: HloInstruction, comp: HloComputation, extra: _Extra, by_name: Mapping[str, HloInstruction] | None = None) -> int:
    """Estimated floating-point operations of one instruction (see the module docstring).

    ``by_name``: the computation's instructions by name, where the caller has them already
    (else ``comp.instruction`` builds its own index).
    """
    opcode = instr.opcode
    if opcode in _ELEMENTWISE:
        return _elements(instr.shape)
    if opcode == "custom-call":
        if instr.custom_call_target not in _GEMM_TARGETS or len(instr.operands) < 2:
            return 0
    elif opcode not in ("dot", "convolution") or len(instr.operands) < 2:
        return 0
    out = _dims(instr.shape)
    if opcode == "custom-call":
        # A library gemm returns (result, workspace): the result is the first array.
        arrays = _shape_info(instr.shape)[1]
        out = arrays[0] if arrays else None
    lookup = comp.instruction if by_name is None else by_name.get
    lhs_instr = lookup(instr.operands[0])
    rhs_instr = lookup(instr.operands[1])
    if out is None or lhs_instr is None or rhs_instr is None:
        return 0
    lhs, rhs = _dims(lhs_instr.shape), _dims(rhs_instr.shape)
    if lhs is None or rhs is None:
        return 0
    if opcode != "convolution":
        if opcode == "dot":
            contracting = extra.lhs_contracting.get(instr.name)
        else:
            found = _GEMM_CONTRACTING.search(instr.backend_config or "")
            contracting = tuple(int(d) for d in _DIGITS.findall(found.group(1))) if found else None
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
    if value is None or not _is_label(value):
        return None
    return value


@functools.lru_cache(maxsize=65536)
def _is_label(value: str) -> bool:
    """Whether an attribute value is a label (checked once per distinct value)."""
    return LABEL_RE.fullmatch(value) is not None


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


_NO_SITES: dict[str, frozenset] = {}
# Opcodes the data-flow pass treats specially; everything else unions its operands' sets.
_FLOW_SPECIAL = frozenset({"parameter", "tuple", "get-tuple-element", *_NESTING_KIND})
_TUPLE_KEEPING = frozenset({"copy", "opt-barrier", "bitcast"})
_LINKING = _TRANSPARENT | {"custom-call"}


class _Builder:
    """Builds the graph of one module; state shared by its passes.

    The passes run once over every instruction of a large program, so their loops avoid
    per-instruction function calls and allocations on the common path (an unlabelled
    instruction with one or two operands); work per site (costs, attributes) is done once per
    site, and the graph is filled in bulk at the end.
    """

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
        # computation -> instruction -> uids of the sites it is a member of. Members of one site
        # share one frozenset, so the data-flow pass can tell "same site" by identity.
        self.site_sets: dict[str, dict[str, frozenset]] = {}
        self.by_name: dict[str, dict[str, HloInstruction]] = {}
        self.members_of: dict[str, set[str]] = {}  # computation -> names of its site members
        self.flowed: dict[str, Value] = {}
        self.in_flow: set[str] = set()
        # Computations that several while/conditional/call instructions call: walked once in terms
        # of their parameters (placeholder ids ``-1 - n``, ``placeholders[n]`` = (parameter
        # number, tuple index path)), the summary applied to each caller's operands.
        self.shared: set[str] = {
            name for name, callers in self.callers.items() if sum(c.opcode in _NESTING_KIND for c in callers) > 1
        }
        self.shared_flows: dict[str, _SharedFlow] = {}
        self.placeholders: list[tuple[int | None, tuple[int, ...]]] = []
        self.user_maps: dict[str, dict[str, list[str]]] = {}
        # Per site uid: the upstream sets its instructions read (shared objects, merged at the end).
        self.incoming: list[list[frozenset]] = []
        # Where the walk records what sites read: ``incoming``, or while a shared computation is
        # summarised, a uid -> sets map whose placeholders are resolved per caller.
        self.target: Any = self.incoming
        self.merged: dict[tuple[frozenset, frozenset], frozenset] = {}
        self.flat: dict[tuple, frozenset] = {}
        self.split_labels: dict[str, tuple[str, str, str, str, Any]] = {}
        self.label_sites: dict[str, dict[str, dict[str, int]]] = {}  # computation -> member -> label -> uid
        self.singles: dict[int, frozenset] = {}  # uid -> the shared one-site set
        self.pairs: dict[str, frozenset[tuple[str, str]]] = {}

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

    def member_users(self, comp: HloComputation, members: set[str]) -> dict[str, list[str]]:
        """Users of the site members of ``comp`` and of the transparent hops right after them.

        That is all the node attributes need (which outputs leave their site), and far less than
        the users of every instruction of a large computation.
        """
        full = self.user_maps.get(comp.name)
        if full is not None:
            return full
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
                if instr is not None and instr.opcode in _TRANSPARENT and user not in members:
                    hops.add(user)
        if hops:
            for instr in comp.instructions:
                for operand in instr.operands:
                    if operand in hops:
                        found.setdefault(operand, []).append(instr.name)
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
                own = _own_label(instr) if instr.frontend_attributes else None
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
        own = _own_label(instr) if instr.frontend_attributes else None
        if instr.opcode in _NESTING_KIND or not instr.called_computations:
            return () if own is None or own in absorbed else (own,)
        labels = dict.fromkeys(() if own is None else (own,))
        for callee in instr.called_computations:
            labels.update(dict.fromkeys(self.summary(callee)))
        return tuple(lab for lab in labels if lab not in absorbed)

    def inner_of(self, instr: HloInstruction, lab: str) -> _Inner | None:
        """The part of ``lab`` that sits in computations ``instr`` calls (and that it absorbs)."""
        if instr.opcode in _NESTING_KIND and _own_label(instr) != lab:
            return None
        found = [inner for callee in instr.called_computations if (inner := self.summary(callee).get(lab)) is not None]
        if len(found) <= 1:
            return found[0] if found else None
        total = _Inner()
        for inner in found:
            total.add(inner)
        return total

    # -- sites -----------------------------------------------------------------

    def find_sites(self, comp: HloComputation) -> None:
        """Union-find over (instruction, label) memberships linked by same-label operands."""
        absorbed = self.absorbed(comp.name)
        member_labels: dict[str, tuple[str, ...]] = {}
        # The second loop looks only at members, transparent ops and custom-calls.
        linking: list[HloInstruction] = []
        # Labels of an unlabelled fusion depend only on what it calls: look each callee tuple up once.
        by_callees: dict[tuple[str, ...], tuple[str, ...]] = {}
        for instr in comp.instructions:
            # Most instructions carry no attributes and call nothing: skip them without a call.
            if instr.frontend_attributes or instr.opcode in _NESTING_KIND:
                labels = self.labels_of(instr, absorbed)
            elif instr.called_computations:
                labels = by_callees.get(instr.called_computations)  # type: ignore[assignment]
                if labels is None:
                    labels = by_callees[instr.called_computations] = self.labels_of(instr, absorbed)
            else:
                if instr.opcode in _LINKING:
                    linking.append(instr)
                continue
            if labels:
                member_labels[instr.name] = labels
                linking.append(instr)
            elif instr.opcode in _LINKING:
                linking.append(instr)
        if not member_labels:
            return
        index: dict[tuple[str, str], int] = {}
        owners: list[HloInstruction] = []
        parent: list[int] = []
        by_name = {instr.name: instr for instr in comp.instructions}
        self.by_name[comp.name] = by_name
        self.members_of[comp.name] = set(member_labels)

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
        for instr in linking:
            labels = member_labels.get(instr.name)
            if labels is None:
                opcode = instr.opcode
                if opcode in _TRANSPARENT:
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
                attributed[instr.name] = [neighbours[labels[0]]]
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
                        passed = through.get(operand)
                        if passed is not None:
                            for other in passed.get(lab, ()):
                                union(me, other)
        # Attributed custom-calls also join the same-label sites of their users (after them in text).
        for name in attributed:
            lab = member_labels[name][0]
            me = index[(name, lab)]
            for linked in _linked_names(name, by_name, self.users(comp), lab, member_labels):
                other = index.get((linked, lab))
                if other is not None:
                    union(me, other)

        # Most memberships are their own root: call find only for the others.
        roots = [i if p == i else find(i) for i, p in enumerate(parent)]
        groups: dict[int, list[int]] = {}
        for i, root in enumerate(roots):
            found = groups.get(root)
            if found is None:
                groups[root] = [i]
            else:
                found.append(i)
        keys = list(index)
        root_uid: dict[int, int] = {}
        for root in sorted(groups):
            members = [owners[i] for i in groups[root]]
            site = _Site(len(self.sites), keys[root][1], comp, members, [])
            if attributed:
                for instr in members:
                    if instr.name in attributed:
                        site.attributed.append(instr.custom_call_target or "")
            root_uid[root] = site.uid
            self.sites.append(site)
            self.incoming.append([])
        # Map each member instruction to the uids of its sites; one shared set per single site.
        single = {uid: frozenset((uid,)) for uid in root_uid.values()}
        per_name: dict[str, list[int]] = {}
        for (name, _lab), i in index.items():
            per_name.setdefault(name, []).append(root_uid[roots[i]])
        self.site_sets[comp.name] = {
            name: single[uids[0]] if len(uids) == 1 else frozenset(uids) for name, uids in per_name.items()
        }
        # Members of several sites (a fusion holding several labels): which site is which label's.
        multi = self.label_sites.setdefault(comp.name, {})
        if len(per_name) < len(index):  # else every member has one membership
            for (name, lab), i in index.items():
                if len(per_name[name]) > 1:
                    multi.setdefault(name, {})[lab] = root_uid[roots[i]]
        self.singles.update(single)

    # -- data flow ---------------------------------------------------------------

    def flatten(self, value: tuple) -> frozenset:
        """All upstream sites of a tuple value (memoised: a tuple is often read many times)."""
        found = self.flat.get(value)
        if found is None:
            found = self.union(value)
            self.flat[value] = found
        return found

    def union(self, values: Iterable[Value]) -> frozenset:
        """Union of upstream sets (tuples flattened), capped at ``MAX_UPSTREAM``.

        Keeping the most recent sites is associative, so merging pairwise gives the same set as
        merging all at once; an operand's set is shared when it already holds the result.
        """
        result: frozenset = _EMPTY
        for value in values:
            if value.__class__ is tuple:
                value = self.flatten(value)  # type: ignore[arg-type]
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

    def flow(self, comp_name: str, seeds: list[Value]) -> Value:
        """Propagate upstream sites through one computation; returns its root's value.

        A computation called from one place is walked once with its caller's operands. One
        called from several places is walked once in terms of its parameters (its summary) and
        each caller gets the summary with its own operands substituted (see ``flow_shared``).
        """
        if comp_name in self.shared:
            return self.flow_shared(comp_name, seeds)
        if comp_name in self.flowed:
            return self.flowed[comp_name]
        return self.walk(comp_name, seeds)

    def walk(self, comp_name: str, seeds: list[Value] | None) -> Value:
        """One pass over a computation; ``seeds=None`` gives its parameters placeholder sets."""
        comp = self.module.computations.get(comp_name)
        if comp is None or comp_name in self.in_flow:
            return self.union(seeds or [])
        self.in_flow.add(comp_name)
        values: dict[str, Value] = {}
        get = values.get
        incoming = self.target
        comp_sites = self.site_sets.get(comp_name, _NO_SITES)
        gte_index = self.extra.gte_index
        param_index = self.extra.param_index
        merge = self.merge
        flatten = self.flatten
        union = self.union
        value: Value
        for instr in comp.instructions:
            name = instr.name
            operands = instr.operands
            mine = comp_sites.get(name)
            if mine is not None:
                # A site member: what its operands carry flows into its site(s).
                for operand in operands:
                    upstream = get(operand, _EMPTY)
                    if upstream.__class__ is tuple:
                        upstream = flatten(upstream)  # type: ignore[arg-type]
                    if upstream and upstream is not mine:
                        for s in mine:
                            incoming[s].append(upstream)  # type: ignore[arg-type]
                if instr.opcode in _NESTING_KIND:
                    self.flow_nested(instr, values)
                elif len(mine) > 1 and instr.called_computations:
                    self.flow_inside(instr, comp_name)
                values[name] = mine
                continue
            opcode = instr.opcode
            if opcode in _FLOW_SPECIAL:
                if opcode == "parameter":
                    if not seeds:
                        value = _EMPTY if seeds is not None else self.placeholder(param_index.get(name), (), instr.shape)
                    elif len(seeds) == 1:
                        value = seeds[0]
                    else:
                        position = param_index.get(name)
                        if position is not None and position < len(seeds):
                            value = seeds[position]
                        else:
                            value = union(seeds)
                elif opcode == "tuple":
                    if len(operands) == 2:
                        value = (get(operands[0], _EMPTY), get(operands[1], _EMPTY))
                    else:
                        value = tuple([get(o, _EMPTY) for o in operands])
                elif opcode == "get-tuple-element":
                    source = get(operands[0], _EMPTY) if operands else _EMPTY
                    position = gte_index.get(name)
                    if source.__class__ is tuple:
                        if position is not None and position < len(source):
                            value = source[position]  # type: ignore[index]
                        else:
                            value = flatten(source)  # type: ignore[arg-type]
                    else:
                        value = source
                else:
                    value = self.flow_nested(instr, values)
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

    def placeholder(self, position: int | None, path: tuple[int, ...], shape: str) -> Value:
        """The value of a parameter (or of one element of a tuple parameter) of a shared computation."""
        parts = _tuple_elements(shape)
        if parts is None:
            self.placeholders.append((position, path))
            return frozenset((-len(self.placeholders),))
        return tuple([self.placeholder(position, path + (i,), part) for i, part in enumerate(parts)])

    def flow_shared(self, comp_name: str, seeds: list[Value]) -> Value:
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
            summary = self.summarise(comp_name)
        if not summary.symbolic:
            return summary.root
        resolved: dict[int, frozenset] = {}
        placeholders = self.placeholders
        flatten = self.flatten

        def resolve(pid: int) -> frozenset:
            found = resolved.get(pid)
            if found is not None:
                return found
            position, path = placeholders[pid]
            value: Value
            if not seeds:
                value = _EMPTY
            elif len(seeds) == 1:
                value = seeds[0]
            elif position is not None and position < len(seeds):
                value = seeds[position]
            else:
                value = self.union(seeds)
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

        def substitute(value: Value) -> Value:
            found = done.get(value)
            if found is not None:
                return found
            if value.__class__ is tuple:
                result: Value = tuple([substitute(v) for v in value])  # type: ignore[union-attr]
            else:
                concrete, pids = splits[value]
                if not pids:
                    result = concrete
                elif not concrete and len(pids) == 1:
                    result = resolve(pids[0])
                else:
                    result = self.union([concrete, *(resolve(pid) for pid in pids)])
            done[value] = result
            return result

        return substitute(summary.root)

    def summarise(self, comp_name: str) -> _SharedFlow:
        """Walk a shared computation once in terms of its parameters (see ``flow_shared``)."""
        saved = self.target
        pending: dict[int, list[frozenset]] = defaultdict(list)
        self.target = pending
        try:
            root = self.walk(comp_name, None)
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

    def flow_inside(self, instr: HloInstruction, comp_name: str) -> None:
        """Data edges between the sites of one fusion's labels, from the flow inside it.

        On GPU one fusion often holds several kernels' ops (a gemm fusion with the producer's
        elementwise ops, the dot and an epilogue): the order inside is the only data order left.
        """
        by_label = self.label_sites.get(comp_name, {}).get(instr.name)
        if not by_label:
            return
        for callee in instr.called_computations:
            for upstream, lab in self.label_pairs(callee):
                source = by_label.get(upstream)
                target = by_label.get(lab)
                if source is not None and target is not None and source != target:
                    self.incoming[target].append(self.singles[source])

    def label_pairs(self, comp_name: str) -> frozenset[tuple[str, str]]:
        """``(upstream label, label)`` where an op of one feeds an op of the other in a called computation.

        Nearest labels only, through unlabelled ops, and through the computations its ops call;
        an op that calls computations holding labels counts as having those labels.
        """
        found = self.pairs.get(comp_name)
        if found is not None:
            return found
        self.pairs[comp_name] = frozenset()  # breaks call cycles in malformed text
        comp = self.module.computations.get(comp_name)
        pairs: set[tuple[str, str]] = set()
        if comp is not None:
            values: dict[str, frozenset[str]] = {}
            for instr in comp.instructions:
                upstream: frozenset[str] = frozenset().union(*(values.get(o, _EMPTY) for o in instr.operands))
                own = _own_label(instr) if instr.frontend_attributes else None
                labels = set() if own is None else {own}
                for callee in instr.called_computations:
                    labels.update(self.summary(callee))
                    pairs |= self.label_pairs(callee)
                if labels:
                    pairs.update((u, lab) for u in upstream for lab in labels if u != lab)
                    values[instr.name] = frozenset(labels)
                else:
                    values[instr.name] = upstream
        found = frozenset(pairs)
        self.pairs[comp_name] = found
        return found

    def flow_nested(self, instr: HloInstruction, values: dict[str, Value]) -> Value:
        """Flow into a while body / branches / call target; the value the instruction produces."""
        operands = [values.get(o, _EMPTY) for o in instr.operands]
        called = instr.called_computations
        if instr.opcode == "conditional":
            branches = [self.flow(c, [operands[k + 1]] if k + 1 < len(operands) else []) for k, c in enumerate(called)]
            return self.union_elementwise(branches)
        if instr.opcode == "while":
            result: Value = _EMPTY
            for comp_name in called:
                root = self.flow(comp_name, operands[:1])
                # The body's root (a tuple like the loop state) is the loop's result; the condition returns a predicate.
                if isinstance(root, tuple) or result is _EMPTY:
                    result = root if isinstance(root, tuple) else self.union([result, root])
            return result if result is not _EMPTY else self.union(operands)
        roots = [self.flow(c, operands) for c in called]
        return roots[0] if len(roots) == 1 else self.union(roots)

    def union_elementwise(self, values: list[Value]) -> Value:
        if values and all(isinstance(v, tuple) and len(v) == len(values[0]) for v in values):  # type: ignore[arg-type]
            return tuple(self.union(parts) for parts in zip(*values))  # type: ignore[misc]
        return self.union(values)

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

    def label_parts(self, lab: str) -> tuple[str, str, str, str, Any]:
        """``(op, version, op_id, call_key, resolved config)`` of a label; each label is looked at once."""
        found = self.split_labels.get(lab)
        if found is None:
            op_id, call_key = _split_label(lab)
            op, _, version = op_id.rpartition("@v")
            found = self.split_labels[lab] = (op, version, op_id, call_key, self.resolve(op_id, call_key))
        return found

    def site_attributes(
        self, site: _Site, users: Mapping[str, list[str]], nesting: tuple[str, ...], multiplicity: int | None
    ) -> dict[str, Any]:
        """The node attributes of one kernel site (see the module docstring for the costs)."""
        comp = site.comp
        lab = site.label
        by_name = self.by_name[comp.name]
        members = site.members
        member_names = {members[0].name} if len(members) == 1 else {m.name for m in members}
        opcodes: dict[str, int] = {}
        flops = 0
        instructions = 0
        written = 0
        inputs: dict[str, str] = {}
        shapes: list[str] = []
        extra = self.extra
        for instr in members:
            instructions += 1
            opcode = instr.opcode
            opcodes[opcode] = opcodes.get(opcode, 0) + 1
            if opcode in _ELEMENTWISE:
                flops += _elements(instr.shape)
            elif opcode == "dot" or opcode == "convolution" or opcode == "custom-call":
                flops += _flops(instr, comp, extra, by_name)
            if instr.called_computations:
                inner = self.inner_of(instr, lab)
                if inner is not None:
                    instructions += inner.instructions
                    for key, count in inner.opcodes.items():
                        opcodes[key] = opcodes.get(key, 0) + count
                    flops += inner.flops
            written += _shape_info(instr.shape)[0]
            for operand in instr.operands:
                if operand not in member_names and operand not in inputs:
                    source = by_name.get(operand)
                    if source is None:
                        inputs[operand] = ""
                    elif source.opcode not in _TRANSPARENT or not _passes_from(source, member_names):
                        inputs[operand] = source.shape
            following = users.get(instr.name)
            if not following or instr.is_root:
                shapes.append(instr.shape)
            else:
                for user in following:
                    if user not in member_names and not _stays_inside(by_name, user, member_names, users):
                        shapes.append(instr.shape)  # read outside the site: an output of the call
                        break
        read = 0
        for shape in inputs.values():
            read += _shape_info(shape)[0]
        op, version, op_id, call_key, found = self.label_parts(lab)
        return {
            "kind": "kernel",
            "label": lab,
            "op": op,
            "version": version,
            "op_id": op_id,
            "call_key": call_key,
            "config": None if found is None else found.cfg,
            "provenance": None if found is None else found.provenance,
            "instructions": instructions,
            "opcodes": opcodes,
            "flops": flops,
            "bytes": written + read,
            "nesting": nesting,
            "multiplicity": multiplicity,
            "direction": "backward" if op.endswith(_BACKWARD_SUFFIX) else "forward",
            "computation": comp.name,
            "module": self.name,
            "shapes": shapes,
            "input_shapes": [s for s in inputs.values() if s],
            "attributed_custom_calls": list(site.attributed),
            "members": [m.name for m in members],
        }

    def nesting_nodes(self, node: str, context: tuple[HloInstruction, ...], nodes: list, seen: set[str], edges: list) -> None:
        """Loop/branch nodes for the enclosing whiles/conditionals, and nesting edges down to ``node``."""
        parent: str | None = None
        for depth, instr in enumerate(context):
            kind = _NESTING_KIND[instr.opcode]
            if kind == "call":
                continue
            loop = f"{self.name}/{instr.computation}/{instr.name}"
            if loop not in seen and loop not in self.graph:  # a labelled loop can be a kernel node too
                seen.add(loop)
                outer = context[:depth]
                times = _multiplicity(outer + (instr,)) if kind == "loop" else _multiplicity(outer)
                nodes.append(
                    (
                        loop,
                        {
                            "kind": kind,
                            "label": None,
                            "multiplicity": times,
                            "trip_count": instr.known_trip_count,
                            "nesting": tuple(c.name for c in outer),
                            "computation": instr.computation,
                            "module": self.name,
                        },
                    )
                )
            if parent is not None:
                edges.append((parent, loop))
            parent = loop
        if parent is not None:
            edges.append((parent, node))

    # -- driver ----------------------------------------------------------------

    def build(self) -> None:
        for comp in self.module.computations.values():
            if not self.is_inlined(comp.name):
                self.find_sites(comp)
        if not self.sites:
            return
        taken: set[str] = set(self.graph.nodes)
        for site in self.sites:
            self.node_of(site, taken)
        # Node attributes, computation by computation (sites of one computation are consecutive).
        nodes: list[tuple[str, dict[str, Any]]] = []
        nesting_edges: list[tuple[str, str]] = []
        seen: set[str] = set()
        current: HloComputation | None = None
        users: Mapping[str, list[str]] = {}
        context: tuple[HloInstruction, ...] = ()
        nesting: tuple[str, ...] = ()
        multiplicity: int | None = 1
        for site in self.sites:
            if site.comp is not current:
                current = site.comp
                users = self.member_users(current, self.members_of[current.name])
                context = self.context(current.name)
                nesting = tuple(c.name for c in context)
                multiplicity = _multiplicity(context)
            nodes.append((site.node, self.site_attributes(site, users, nesting, multiplicity)))
            seen.add(site.node)
            if context:
                self.nesting_nodes(site.node, context, nodes, seen, nesting_edges)
        _add_nodes(self.graph, nodes)
        self.graph.add_edges_from(nesting_edges, kind="nesting")
        # Data flow from the computations nobody calls (the entry first), then any left unwalked.
        order = [self.module.entry] + [c for c in self.module.computations if c != self.module.entry]
        for comp_name in order:
            if comp_name not in self.callers:
                self.flow(comp_name, [])
        for comp_name in order:
            if not self.is_inlined(comp_name):
                self.flow(comp_name, [])
        self.merged.clear()
        self.flat.clear()
        _add_data_edges(self.graph, [site.node for site in self.sites], self.incoming)


def _plain(graph: nx.DiGraph) -> tuple[dict, dict, dict] | None:
    """The node and adjacency dicts of a plain ``DiGraph`` (filled directly), else None."""
    node = getattr(graph, "_node", None)
    succ = getattr(graph, "_succ", None)
    pred = getattr(graph, "_pred", None)
    if type(graph) is nx.DiGraph and type(node) is dict and type(succ) is dict and type(pred) is dict:
        return node, succ, pred
    return None


def _clear_cache(graph: nx.DiGraph) -> None:
    clear = getattr(nx, "_clear_cache", None)
    if clear is not None:
        clear(graph)  # what add_nodes_from / add_edges_from do after changing the graph


def _add_nodes(graph: nx.DiGraph, nodes: list[tuple[str, dict[str, Any]]]) -> None:
    """``graph.add_nodes_from(nodes)``, for a plain ``DiGraph`` without its per-node copy.

    ``add_nodes_from`` first tries each ``(node, attributes)`` pair as a node (hashing the pair
    raises TypeError), then copies the attribute dict; the dicts here are fresh, so a new node
    takes its dict as it is. A node already there gets its dict updated, as ``add_nodes_from``
    does.
    """
    plain = _plain(graph)
    if plain is None:
        graph.add_nodes_from(nodes)
        return
    node_attrs, succ, pred = plain
    for node, attrs in nodes:
        found = node_attrs.get(node)
        if found is None:
            succ[node] = {}
            pred[node] = {}
            node_attrs[node] = attrs
        else:
            found.update(attrs)
    _clear_cache(graph)


def _add_data_edges(graph: nx.DiGraph, names: list[str], incoming: list[list[frozenset]]) -> None:
    """Add a ``kind="data"`` edge to each site from every site in the upstream sets it read.

    ``incoming[uid]`` holds the (shared, repeated) upstream sets read by the instructions of site
    ``uid``, named ``names[uid]``. A large program has millions of data edges, and this is the
    graph's biggest cost. Edges are added grouped by their head, tails in uid order, so the
    adjacency dicts being filled stay close together in memory (several times faster than
    inserting in hash order); for a plain ``DiGraph`` they are written straight into its
    adjacency dicts, as ``add_edges_from`` itself does, without its per-edge checks (about twice
    as fast), each site's successor dict looked up once rather than once per edge. Each edge
    still gets its own attribute dict.
    """
    plain = _plain(graph)
    if plain is None:
        for uid, reads in enumerate(incoming):
            if reads:
                upstream = reads[0] if len(reads) == 1 else frozenset().union(*reads)
                head = names[uid]
                tails = [names[u] for u in sorted(upstream) if u != uid]
                graph.add_edges_from(((tail, head) for tail in tails), kind="data")
        return
    _, succ, pred = plain
    out_of = [succ[name] for name in names]
    for uid, reads in enumerate(incoming):
        if not reads:
            continue
        upstream = reads[0] if len(reads) == 1 else frozenset().union(*reads)
        head = names[uid]
        into = pred[head]
        for u in sorted(upstream):
            if u != uid:
                data = {"kind": "data"}
                out_of[u][head] = data
                into[names[u]] = data
    _clear_cache(graph)


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


def _stays_inside(
    by_name: Mapping[str, HloInstruction], user: str, members: set[str], users: Mapping[str, list[str]]
) -> bool:
    """Whether a value read by ``user`` stays in the site: a member, or a transparent hop into it."""
    if user in members:
        return True
    instr = by_name.get(user)
    if instr is None or instr.opcode not in _TRANSPARENT or _own_label(instr) is not None or instr.is_root:
        return False
    following = users.get(user, ())
    return bool(following) and all(u in members for u in following)


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

    ``x`` is anything :func:`ejlabel.core.labels.program_texts` accepts, or a parsed ``HloModule``: a
    ``Lowered`` is read as HLO (which has computations, unlike its StableHLO text), a dump
    directory through its ``*after_optimizations.txt`` files (else ``*before_optimizations.txt``),
    one module each. ``config``/``provenance`` come from ``selector.resolve((device, op_id,
    call_key))`` when a selector is given; ``device`` defaults to this process's device.
    """
    if device is None and selector is not None:
        from ejlabel.utils.fingerprint import device_fingerprint

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
    from ejlabel.utils.serialize import to_jsonable

    try:
        encoded = to_jsonable(cfg)
        json.dumps(encoded)
        return encoded
    except (TypeError, ValueError):
        return repr(cfg)


_CONFIG_ENCODING = "ejlabel.utils.serialize.to_jsonable, else repr"


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
