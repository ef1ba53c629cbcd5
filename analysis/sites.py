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
   region, and the copies and bitcasts XLA inserts. Unlabelled arithmetic between two ops of one
   label stays out: it is more likely the user's code between two calls.
3. *Identical instructions* of one label (same opcode, shape and operands; reshapes, bitcasts,
   copies and converts) are one: XLA's common subexpression elimination merges them in the
   compiled HLO, so the lowered HLO counts them as merged too.
4. *Unlabelled custom-calls* that rewrites create (XLA's cuDNN attention rewrite drops the
   attributes) join the one label found among their neighbours (operands and users, through up
   to three transparent hops); their targets are listed in ``attributed_custom_calls``.
   Bookkeeping targets (sharding annotations, host offloading) are never attributed.
5. *One asynchronous op is one op*: the ``-update`` and ``-done`` of an asynchronous op (XLA's
   ``async-start``/``async-update``/``async-done``, ``all-reduce-start``/``all-reduce-done``...)
   belong to the site(s) of the start they complete.

*Shared ops.* XLA's rewrites make one instruction compute for several calls, or for a call and
code outside any call; such an op is *shared*: it links no two calls, gives no site the inputs of
another, and lets no unlabelled op join a call (rule 2) through it. It is a member of each site
it computes for, listed in that site's ``shared``, and the graph lists it once with its owners
(``graph.graph["shared"]``). The forms:

* *Combined ops*: a collective with several operands and a tuple result (XLA's all-reduce,
  all-gather and reduce-scatter combiners merge the collectives of several calls, and of the
  user's code, into one) computes its element ``i`` from its operand ``i`` alone. Each element is
  a *lane*, owned by the label of its get-tuple-element (XLA copies the original op's attributes
  there; when no element has one, by the op's own label on the lanes whose operand carries it),
  and links only its operand to its get-tuple-element. The op belongs to its lanes' sites: shared
  when they are several, or when a lane has no label.
* *Leaves*: an instruction that reads no data of the program (constants, ``iota``,
  ``partition-id``, and ops of only those, such as a causal mask's comparison) links nothing. A
  labelled leaf joins the site(s) of the same-label instructions that read it: one site, and no
  other reader, makes it a plain member; several, or a reader outside them (XLA's CSE shared the
  mask of a call with the user's code), make it shared. Read by no same-label instruction, it is
  a site of its own. A fusion whose ops of some label are all leaves (XLA copies such ops into
  every fusion that reads them) is no member of that label's site, and is listed as sharing it.
* *Fusions holding several labels*: a member of one site per label (see below), shared by them.

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
lies on a cycle of data edges, the call graph splits it (:mod:`.cycles`); the links made here are
kept (``SiteFinder.groups``) for that.

The rules are applied by :class:`~.site_rules.SiteRules`; the records they fill and the
union-find are in :mod:`.site_parts`.

Limits: calls of one label that read each other's outputs directly (``f(f(x))``), or only
through unlabelled data movement, are one site; a call whose pieces never meet (a
JAX-differentiated matmul's forward and two gradient products) is several.
"""

from __future__ import annotations

from .costs import InstructionFacts, instruction_flops
from .hlo import HloComputation, HloInstruction, HloModule
from .nesting import NESTING_KIND, CallStructure, post_order
from .site_parts import NOT_LEAVES, TRANSPARENT, CompGroups, Inner, SharedOp, Site, contents_of, own_label
from .site_rules import MOVES_DATA, SiteRules

__all__ = ["NESTING_KIND", "TRANSPARENT", "CompGroups", "Inner", "SharedOp", "Site", "SiteFinder", "own_label"]

# A fusion may join a call by rule 2 when all it calls moves data.
_FUSED_MOVES_DATA = MOVES_DATA | {"parameter", "constant", "iota"}


class SiteFinder(SiteRules):
    """Computation roles and the sites of one module.

    The site pass looks at every instruction of a large program, so its loop avoids
    per-instruction calls and allocations for the common instruction (unlabelled, calling
    nothing); work per label or per site is done once.
    """

    def __init__(self, module: HloModule, facts: InstructionFacts) -> None:
        self.module = module
        self.facts = facts
        self.calls = CallStructure(module, own_label)
        self.callers = self.calls.callers
        self.summaries: dict[str, dict[str, Inner]] = {}
        self.sites: list[Site] = []
        # computation -> instruction -> uids of the sites it is a member of. Members of one site
        # share one frozenset, so the data-flow pass can tell "same site" by identity.
        self.site_sets: dict[str, dict[str, frozenset]] = {}
        self.by_name: dict[str, dict[str, HloInstruction]] = {}
        self.members_of: dict[str, set[str]] = {}  # computation -> names of its site members
        self.label_sites: dict[str, dict[str, dict[str, int]]] = {}  # computation -> member -> label -> uid
        self.singles: dict[int, frozenset] = {}  # uid -> the shared one-site set
        self.position_maps: dict[str, dict[str, int]] = {}
        self.user_maps: dict[str, dict[str, list[str]]] = {}
        self.attributed_names: set[str] = set()  # unlabelled custom-calls attributed to a label (rule 4)
        self.moving: dict[str, bool] = {}  # fused computation -> whether all it does is move data
        self.groups: dict[str, CompGroups] = {}  # computation -> its union-find, for splitting
        # computation -> members the data flow reads lane by lane (combined collectives and their
        # -done), and shared leaves, which carry no site's values.
        self.lanes: dict[str, set[str]] = {}
        self.passive: dict[str, set[str]] = {}
        self.shared_ops: list[SharedOp] = []

    # -- computation roles ---------------------------------------------------

    def is_inlined(self, comp_name: str) -> bool:
        return self.calls.is_inlined(comp_name)

    def context(self, comp_name: str) -> tuple[HloInstruction, ...]:
        """Enclosing while/conditional/call instructions of a computation, outermost first."""
        return self.calls.context(comp_name)

    def absorbed(self, comp_name: str) -> frozenset[str]:
        """Labels whose instructions here belong to a labelled loop/branch calling this computation."""
        return self.calls.absorbed(comp_name)

    def summary(self, comp_name: str) -> dict[str, Inner]:
        """Per label: labelled instructions of a called computation and of everything it calls.

        Worked out for callees first (post-order), without recursion.
        """
        found = self.summaries.get(comp_name)
        if found is not None:
            return found
        computations = self.module.computations

        def callees(name: str) -> list[str]:
            comp = computations.get(name)
            return [] if comp is None else [c for i in comp.instructions for c in contents_of(i)]

        for name in post_order([comp_name], callees, self.summaries.__contains__):
            self.summaries[name] = self.summarise(name)
        return self.summaries[comp_name]

    def summarise(self, comp_name: str) -> dict[str, Inner]:
        """One computation's summary; those of what it calls are there already (post-order)."""
        comp = self.module.computations.get(comp_name)
        result: dict[str, Inner] = {}
        if comp is None:
            return result
        leaves: set[str] = set()
        for instr in comp.instructions:
            leaf = instr.opcode not in NOT_LEAVES and all(o in leaves for o in instr.operands)
            if leaf:
                leaves.add(instr.name)
            own = own_label(instr) if instr.frontend_attributes else None
            if own is not None:
                inner = result.get(own)
                if inner is None:
                    inner = result[own] = Inner()
                inner.instructions += 1
                inner.opcodes[instr.opcode] += 1
                inner.flops += instruction_flops(instr, comp.instruction, self.facts)
                inner.work = inner.work or not leaf
            for callee in contents_of(instr):
                for lab, inner in self.summaries.get(callee, {}).items():
                    mine = result.get(lab)
                    if mine is None:
                        mine = result[lab] = Inner()
                    mine.add(inner, not leaf)
        return result

    def labels_of(self, instr: HloInstruction, absorbed: frozenset[str]) -> tuple[tuple[str, ...], tuple[str, ...]]:
        """Labels an instruction of a site computation is a member of, and the labels it holds
        only as leaves in what it calls (which make it no member: module docstring)."""
        own = own_label(instr) if instr.frontend_attributes else None
        called = contents_of(instr)
        if instr.opcode in NESTING_KIND or not called:
            return (() if own is None or own in absorbed else (own,)), ()
        labels = dict.fromkeys(() if own is None else (own,))
        leaf_only: dict[str, None] = {}
        for callee in called:
            for lab, inner in self.summary(callee).items():
                if inner.work or not instr.operands:
                    labels[lab] = None
                else:
                    leaf_only[lab] = None
        kept = tuple(lab for lab in labels if lab not in absorbed)
        return kept, tuple(lab for lab in leaf_only if lab not in labels and lab not in absorbed)

    def inner_of(self, instr: HloInstruction, lab: str) -> Inner | None:
        """The part of ``lab`` that sits in computations ``instr`` calls (and that it absorbs)."""
        if instr.opcode in NESTING_KIND and own_label(instr) != lab:
            return None
        found = [inner for callee in contents_of(instr) if (inner := self.summary(callee).get(lab)) is not None]
        if len(found) <= 1:
            return found[0] if found else None
        total = Inner()
        for inner in found:
            total.add(inner)
        return total

    def users(self, comp: HloComputation) -> dict[str, list[str]]:
        """Users of each instruction of ``comp``; built only where it is needed."""
        found = self.user_maps.get(comp.name)
        if found is None:
            found = {}
            for instr in comp.instructions:
                for operand in instr.operands:
                    found.setdefault(operand, []).append(instr.name)
            self.user_maps[comp.name] = found
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
        """Position of each instruction of ``comp``; built where needed."""
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
