"""The kernel-call graph of a program: which kernel calls it makes, where, and what feeds what.

``call_graph(x)`` reads ``x`` once as a :class:`~.program.Program` (a ``Lowered``, a ``Compiled``,
HLO or StableHLO text, a file, an XLA dump directory, a parsed :class:`~.hlo.HloModule`, or a
``Program``: see :mod:`.program` for what each form reads) and returns a ``networkx.DiGraph``.

Model
-----
*Nodes.* One node per kernel call **site** (``kind="kernel"``): the instructions of one
computation that make up one call, found by the rules of :mod:`.sites` (same label linked by data;
unlabelled broadcasts, reshapes and copies inside a call join it; XLA's common subexpressions
merged; unlabelled custom-calls attributed). Two identical calls at different places are two
nodes with the same ``label``. Each enclosing ``while`` / ``conditional`` that holds a site is a
node too (``kind="loop"`` / ``"branch"``), with ``kind="nesting"`` edges outer → inner → site.
Sites inside loops and branches carry the chain of enclosing instructions in ``nesting``,
outermost first, and a ``multiplicity``: the product of the enclosing loops'
``known_trip_count`` (None when one is unknown, 1 when not nested; a branch counts once, an upper
bound). A computation called from several places takes the nesting of its first caller.

*Data edges.* Site A → site B (``kind="data"``) when B reads a value A computed, directly or
through unlabelled instructions (:mod:`.flow`). The data edges form a DAG: a site that would lie
on a cycle (a kernel differentiated by JAX labels its backward ops like its forward ones, and the
backward reads the forward's intermediates) is split by level into its forward and its backward
(:mod:`.cycles`), in one pass over its computation.

*Shared ops.* An instruction that XLA made compute for several calls, or for a call and the
user's code (a combined collective, a leaf its CSE shared, a fusion holding several labels), is
a member of each call it computes for and listed in its node's ``shared``; it links no calls,
gives no call another's inputs, and a shared collective or leaf costs no call anything.
``graph.graph["shared"]`` lists each once: ``module``, ``computation``, ``instruction``,
``kind`` (``"combined"``, ``"leaf"``, ``"fusion"``), ``labels``, ``nodes`` (none for a fusion
holding only copies of a label's leaves, which is no site of that label) and ``outside``
(whether unlabelled code shares it). :mod:`.sites` has the rules.

*Costs.* ``flops`` counts the site's labelled instructions, inside fusions too
(:func:`.costs.instruction_flops`): dots and library gemms 2 × result × contracted elements,
convolutions 2 × result × kernel elements per output feature, elementwise ops one per element,
the rest nothing; unlabelled instructions that joined the site count no flops. ``bytes`` is the
size of every value the site's top-level instructions (not the ones inside fusions) write plus
every value they read from outside the site, each counted once: the memory traffic of the call.

Which forms count what
----------------------
* StableHLO and the HLO of the same ``Lowered`` are one program (StableHLO is converted to HLO
  before it is read), so their sites, flops and bytes are equal; an XLA dump's
  ``before_optimizations`` file is that HLO too.
* Compiled HLO (``Compiled.as_text()``, a dump's ``after_optimizations`` file) is what XLA made
  of it: the same sites as long as XLA keeps the labels on the ops it rewrites; where it merged
  the ops of several calls into one (the all-reduce combiner, CSE, fusion), the merged op is
  shared (above), so the calls stay as many. XLA's async shorthand
  (``custom-call-start``/``-update``/``-done``) is one op: an ``async-start`` wrapping it. A dot's flops are
  the same (XLA does not change what a dot computes); elementwise flops change where XLA's
  simplifier rewrites ops (``x / c`` into ``x * (1/c)``, broadcasts folded, a select turned into
  a conditional), and bytes change most: fused ops write nothing to memory, layouts add copies.
* Without the text (a parsed ``HloModule``), the facts the parser skips are inferred from
  shapes (:func:`.costs.infer_facts`): the same graph wherever shapes decide them
  (``graph.graph["inferred_facts"]`` names such modules).
* StableHLO the local jaxlib cannot convert gives a degraded graph: one node per distinct label
  with its op count in ``instructions``, no edges and no costs (``graph.graph["degraded"]``).

``graph.graph`` also says what was read: ``"program"`` (the input's kind), ``"modules"`` and
``"notes"`` (dump files left out, and why).

*Configs.* With a selector, each node's ``config`` and ``provenance`` are what the selector
resolves for its call. The kernels the program's call descriptions name are instantiated first
(:func:`.program.note_described_kernels`), so a cached config of another kernel's type is
refused as the running program refuses it; the node then shows it with provenance
:data:`WRONG_TYPE`, and the call counts as unseen.
"""

from __future__ import annotations

import gc
from collections import Counter
from collections.abc import Iterable, Mapping
from typing import Any, NamedTuple

import networkx as nx

from ejlabel.config.persistent import CacheError
from ejlabel.core.label_format import (
    BACKWARD_SUFFIX,
    LABEL_ATTRIBUTE,
    LABEL_RE,
    forward_op_id,
    is_backward,
    split_op_id,
)
from ejlabel.core.registry import config_type_problem
from ejlabel.utils.fingerprint import device_fingerprint

from .costs import ELEMENTWISE, elements, instruction_flops, shape_info
from .cycles import sites_on_cycles, split_apart, split_by_level
from .export import draw, from_node_link_json, to_dot, to_node_link_json
from .flow import MAX_UPSTREAM, DataFlow
from .hlo import HloComputation, HloInstruction
from .program import ProgramModule, UnreadModule, note_described_kernels, read_program
from .sites import NESTING_KIND, TRANSPARENT, Site, SiteFinder, own_label

__all__ = ["MAX_UPSTREAM", "WRONG_TYPE", "Found", "call_graph", "draw", "from_node_link_json", "to_dot", "to_node_link_json", "wrong_type_entry"]

_MAX_SPLIT_ROUNDS = 8  # each round splits the sites on cycles; real programs need one
_NOTHING: frozenset[str] = frozenset()
_NO_UIDS: frozenset[int] = frozenset()


def call_graph(x: Any, selector: Any = None, device: str | None = None) -> nx.DiGraph:
    """The kernel-call graph of ``x`` (see the module docstring for the model).

    ``x`` is anything :func:`~.program.read_program` accepts, or a ``Program``. ``config`` /
    ``provenance`` come from ``selector.resolve((device, op_id, call_key))`` when a selector is
    given; ``device`` defaults to this process's device.
    """
    program = read_program(x)
    if device is None and selector is not None:
        device = device_fingerprint()
    graph = nx.DiGraph()
    graph.graph["device"] = device
    graph.graph["modules"] = []
    graph.graph["degraded"] = program.degraded
    graph.graph["inferred_facts"] = []
    graph.graph["program"] = program.origin
    graph.graph["notes"] = list(program.notes)
    graph.graph["shared"] = []
    resolved: dict[tuple[str, str], Any] = {}
    if selector is not None:
        note_described_kernels(program)

    def resolve(op_id: str, call_key: str) -> Any:
        key = (op_id, call_key)
        if key not in resolved:
            found = None if selector is None else selector.resolve((device, op_id, call_key))
            resolved[key] = found if found is not None or selector is None else wrong_type_entry(selector, (device, op_id, call_key))
        return resolved[key]

    # The passes allocate many small acyclic objects; the cycle collector walking them again and
    # again as they grow would cost more than the passes themselves.
    collecting = gc.isenabled()
    gc.disable()
    try:
        for pm in program.modules:
            graph.graph["modules"].append(pm.name)
            if not pm.facts.exact:
                graph.graph["inferred_facts"].append(pm.name)
            _Builder(pm, graph, resolve).build()
        for unread in program.unread:
            graph.graph["modules"].append(unread.name)
            _add_degraded(graph, unread, resolve)
    finally:
        if collecting:
            gc.enable()
    return graph


class _Builder:
    """Builds the nodes and edges of one module: sites, data flow, splits, then the graph."""

    def __init__(self, pm: ProgramModule, graph: nx.DiGraph, resolve: Any) -> None:
        self.module = pm.module
        self.name = pm.name
        self.facts = pm.facts
        self.graph = graph
        self.resolve = resolve
        self.split_labels: dict[str, tuple[str, str, str, str, Any]] = {}
        self.flow: DataFlow | None = None  # the last data flow: its fusion ports, for inputs

    def build(self) -> None:
        finder = SiteFinder(self.module, self.facts)
        finder.find_all()
        if not finder.sites:
            self.add_shared(finder)
            return
        flow = DataFlow(self.module, self.facts, finder)
        incoming = flow.run()
        for _ in range(_MAX_SPLIT_ROUNDS):
            cyclic = sites_on_cycles(finder, incoming)
            if not cyclic or not (split_by_level(finder, cyclic) or split_apart(finder, cyclic)):
                break
            flow = DataFlow(self.module, self.facts, finder)
            incoming = flow.run()
        self.flow = flow
        self.add_nodes(finder)
        _add_data_edges(self.graph, [site.node for site in finder.sites], incoming)
        self.add_shared(finder)

    def add_shared(self, finder: SiteFinder) -> None:
        """``graph.graph["shared"]``: each shared op once, with the nodes it is a member of."""
        listed = self.graph.graph["shared"]
        for op in finder.shared_ops:
            uids = finder.site_sets.get(op.computation, {}).get(op.instruction, frozenset())
            listed.append(
                {
                    "module": self.name,
                    "computation": op.computation,
                    "instruction": op.instruction,
                    "kind": op.kind,
                    "labels": list(op.labels),
                    "nodes": sorted(finder.sites[uid].node for uid in uids),
                    "outside": op.outside,
                }
            )

    # -- nodes ---------------------------------------------------------------

    def add_nodes(self, finder: SiteFinder) -> None:
        taken: set[str] = set(self.graph.nodes)
        for site in finder.sites:
            self.node_of(site, taken)
        # Node attributes, computation by computation.
        nodes: list[tuple[str, dict[str, Any]]] = []
        nesting_edges: list[tuple[str, str]] = []
        seen: set[str] = set()
        by_comp: dict[str, list[Site]] = {}
        for site in finder.sites:
            by_comp.setdefault(site.comp.name, []).append(site)
        for comp_name, sites in by_comp.items():
            leaving = _outputs(finder, sites[0].comp)
            # Shared collectives and leaves compute for other calls too: they give a call no
            # inputs, outputs or costs (a fusion holding several labels counts its own label's part).
            not_costed = finder.lanes.get(comp_name, set()) | finder.passive.get(comp_name, set())
            context = finder.context(comp_name)
            nesting = tuple(c.name for c in context)
            multiplicity = _multiplicity(context)
            for site in sites:
                passive = site.shared & not_costed if site.shared else _NOTHING
                nodes.append((site.node, self.site_attributes(finder, site, leaving, passive, nesting, multiplicity)))
                seen.add(site.node)
                if context:
                    self.nesting_nodes(site.node, context, nodes, seen, nesting_edges)
        _add_nodes(self.graph, nodes)
        self.graph.add_edges_from(nesting_edges, kind="nesting")

    def node_of(self, site: Site, taken: set[str]) -> None:
        node = f"{self.name}/{site.comp.name}/{site.members[0].name}"
        if node in taken:
            # One fusion can start sites of several labels (or several levels of one label).
            op_id, key = _split_label(site.label)
            node = f"{node}#{op_id}:{key[:8]}"
            count = 1
            while node in taken:
                count += 1
                node = f"{node.rsplit('~', 1)[0]}~{count}"
        taken.add(node)
        site.node = node

    def label_parts(self, lab: str) -> tuple[str, str, str, str, Any]:
        """``(op, version, op_id, call_key, resolved config)`` of a label; each label is looked at once."""
        found = self.split_labels.get(lab)
        if found is None:
            op_id, call_key = _split_label(lab)
            op, version = split_op_id(op_id)
            found = self.split_labels[lab] = (op, version, op_id, call_key, self.resolve(op_id, call_key))
        return found

    def site_attributes(
        self,
        finder: SiteFinder,
        site: Site,
        leaving: set[tuple[str, int]],
        passive: frozenset[str],
        nesting: tuple[str, ...],
        multiplicity: int | None,
    ) -> dict[str, Any]:
        """The node attributes of one kernel site (see the module docstring for the costs).

        ``leaving``: (member, site uid) whose value is read outside that site (:func:`_outputs`);
        ``passive``: the site's shared members that count nothing for it.
        """
        comp = site.comp
        lab = site.label
        uid = site.uid
        by_name = finder.by_name[comp.name]
        lookup = by_name.get
        members = site.members
        joined = site.joined
        site_sets = finder.site_sets[comp.name]
        opcodes: dict[str, int] = {}
        flops = 0
        instructions = 0
        written = 0
        inputs: dict[str, str] = {}
        shapes: list[str] = []
        facts = self.facts
        for instr in members:
            instructions += 1
            opcode = instr.opcode
            opcodes[opcode] = opcodes.get(opcode, 0) + 1
            if passive and instr.name in passive:
                continue
            operands = instr.operands
            if site.shared and instr.name in site.shared and instr.called_computations and self.flow is not None:
                # A fusion holding several calls: this call's inputs are the operands its ops read.
                readers = self.flow.fusion_ports(instr.called_computations[0])[0]
                if readers is not None:
                    operands = tuple(o for k, o in enumerate(operands) if lab in readers.get(k, ()))
            if instr.name not in joined:
                if opcode in ELEMENTWISE:
                    flops += elements(instr.shape)
                elif opcode == "dot" or opcode == "convolution" or opcode == "custom-call":
                    flops += instruction_flops(instr, lookup, facts)
                if instr.called_computations:
                    inner = finder.inner_of(instr, lab)
                    if inner is not None:
                        instructions += inner.instructions
                        for key, count in inner.opcodes.items():
                            opcodes[key] = opcodes.get(key, 0) + count
                        flops += inner.flops
            written += shape_info(instr.shape)[0]
            for operand in operands:
                if operand not in inputs and uid not in site_sets.get(operand, _NO_UIDS):
                    source = by_name.get(operand)
                    if source is None:
                        inputs[operand] = ""
                    elif source.opcode not in TRANSPARENT or not _passes_from(source, uid, site_sets):
                        inputs[operand] = source.shape
            if instr.is_root or (instr.name, uid) in leaving:
                shapes.append(instr.shape)  # read outside the site (or by nothing): an output of the call
        read = 0
        for shape in inputs.values():
            read += shape_info(shape)[0]
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
            "direction": "backward" if op.endswith(BACKWARD_SUFFIX) else "forward",
            "computation": comp.name,
            "module": self.name,
            "shapes": shapes,
            "input_shapes": [s for s in inputs.values() if s],
            "attributed_custom_calls": list(site.attributed),
            "members": [m.name for m in members],
            "shared": sorted(site.shared),
        }

    def nesting_nodes(
        self,
        node: str,
        context: tuple[HloInstruction, ...],
        nodes: list[tuple[str, dict[str, Any]]],
        seen: set[str],
        edges: list[tuple[str, str]],
    ) -> None:
        """Loop/branch nodes for the enclosing whiles/conditionals, and nesting edges down to ``node``."""
        parent: str | None = None
        for depth, instr in enumerate(context):
            kind = NESTING_KIND[instr.opcode]
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


def _passes_from(instr: HloInstruction, uid: int, site_sets: Mapping[str, frozenset]) -> bool:
    """A transparent unlabelled op fed only by the members of site ``uid``: a hop inside it."""
    return (
        instr.opcode in TRANSPARENT
        and own_label(instr) is None
        and bool(instr.operands)
        and all(uid in site_sets.get(o, _NO_UIDS) for o in instr.operands)
    )


def _outputs(finder: SiteFinder, comp: HloComputation) -> set[tuple[str, int]]:
    """(member, site uid) of the members of ``comp`` whose value leaves that site, in one pass.

    A value leaves its site when nothing reads it, or when an instruction outside the site reads
    it, other than an unlabelled transparent op (a bitcast, a get-tuple-element...) all of whose
    readers are in the site: a hop inside the call.
    """
    site_sets = finder.site_sets.get(comp.name, {})
    leaving: set[tuple[str, int]] = set()
    read: set[str] = set()
    hops: dict[str, list[tuple[str, int]]] = {}  # hop -> (member, uid) it passes on
    hop_ok: dict[str, bool] = {}
    hop_read: set[str] = set()
    mark_read = read.update
    for instr in comp.instructions:
        name = instr.name
        mine = site_sets.get(name, _NO_UIDS)
        operands = instr.operands
        mark_read(operands)
        for operand in operands:
            if hops and operand in hops:
                hop_read.add(operand)
                if hop_ok[operand] and not all(uid in mine for _, uid in hops[operand]):
                    hop_ok[operand] = False
            theirs = site_sets.get(operand)
            if theirs is None or theirs is mine:
                continue
            for uid in theirs:
                if uid in mine:
                    continue
                if name not in site_sets and instr.opcode in TRANSPARENT and not instr.is_root and own_label(instr) is None:
                    hops.setdefault(name, []).append((operand, uid))
                    hop_ok.setdefault(name, True)
                else:
                    leaving.add((operand, uid))
    for hop, passing in hops.items():
        if not hop_ok[hop] or hop not in hop_read:
            leaving.update(passing)
    for name in site_sets:
        if name not in read:
            leaving.update((name, uid) for uid in site_sets[name])
    return leaving


# ---------------------------------------------------------------------------
# Filling the graph.


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
    adjacency dicts, as ``add_edges_from`` itself does, without its per-edge checks (faster
    still; ``bench/bench_analysis.py`` times the graph), each site's successor dict looked up
    once rather than once per edge. Each edge still gets its own attribute dict.
    """
    plain = _plain(graph)
    if plain is None:
        for uid, reads in enumerate(incoming):
            if reads:
                upstream = reads[0] if len(reads) == 1 else frozenset().union(*reads)
                head = names[uid]
                graph.add_edges_from(((names[u], head) for u in sorted(upstream) if u != uid), kind="data")
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


class Found(NamedTuple):
    """A config found for a call and where from (a selector's ``Selection`` has these fields too)."""

    cfg: Any
    provenance: str


WRONG_TYPE = "WRONG TYPE"
"""Provenance of a cached config the call's kernel does not take: shown, never served, unseen."""


def wrong_type_entry(selector: Any, key: tuple[str, str, str]) -> Found | None:
    """The persistent entry for ``key`` (or, for a backward label, its forward's) that the
    selector refused because the kernel takes another config type, as :data:`WRONG_TYPE`."""
    persistent = getattr(selector, "persistent", None)
    if persistent is None:
        return None
    device, op_id, call_key = key
    for candidate in ((device, op_id, call_key), (device, forward_op_id(op_id), call_key))[: 2 if is_backward(op_id) else 1]:
        try:
            entry = persistent.get_entry(candidate)
        except CacheError:
            return None
        if entry is not None:
            return Found(entry.config, WRONG_TYPE) if config_type_problem(candidate[1], entry.config) is not None else None
    return None


def _add_degraded(graph: nx.DiGraph, unread: UnreadModule, resolve: Any) -> None:
    """Degraded mode: one node per distinct label, its op count, nothing else known."""
    counts: Counter = Counter()
    for attrs in unread.attributes:
        lab = attrs.get(LABEL_ATTRIBUTE)
        if lab is not None and LABEL_RE.fullmatch(lab):
            counts[lab] += 1
    for lab, count in counts.items():
        op_id, call_key = _split_label(lab)
        op, version = split_op_id(op_id)
        found = resolve(op_id, call_key)
        graph.add_node(
            f"{unread.name}/{lab}",
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
            direction="backward" if op.endswith(BACKWARD_SUFFIX) else "forward",
            computation="",
            module=unread.name,
            shapes=[],
            input_shapes=[],
            attributed_custom_calls=[],
            members=[],
            shared=[],
        )
