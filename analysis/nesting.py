"""How the computations of a module call each other, worked out without recursion.

A module's computations form a call graph: ``while`` bodies and conditions, ``conditional``
branches and ``call`` targets (*nesting*: the call graph draws them as loops and branches around
the sites inside), and fusions, reductions, ``async-start`` wrappers and the like (*inlined*: what
they hold counts in the calling instruction). Programs nest deeply (a scan inside a scan inside a
remat...) and text from elsewhere can nest thousands deep, so every walk here keeps its own stack:
nothing recurses, whatever the depth. Text that calls computations in a cycle (malformed: XLA
refuses it) is read as if the call closing the cycle called nothing.

* :func:`post_order`: computations reachable from some, callees before callers.
* :class:`CallStructure`: per computation, whether it is inlined, its *context* (the enclosing
  ``while``/``conditional``/``call`` instructions, outermost first, through its first caller), and
  which labels it *absorbs* (those of labelled loops and branches around it).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

from .hlo import HloInstruction, HloModule

__all__ = ["NESTING_KIND", "CallStructure", "post_order"]

NESTING_KIND = {"while": "loop", "conditional": "branch", "call": "call"}
"""Opcodes whose called computations the graph draws as loops, branches and calls."""


def post_order(roots: Iterable[str], children: Callable[[str], Iterable[str]], done: Callable[[str], bool]) -> list[str]:
    """Nodes reachable from ``roots`` that are not ``done``, each after all of its children.

    Iterative depth-first search; a child met again while it is still being visited (a cycle)
    is not followed, so the node that closes a cycle comes first among the cycle's nodes.
    """
    order: list[str] = []
    state: dict[str, int] = {}  # 1: being visited, 2: finished
    for root in roots:
        if root in state or done(root):
            continue
        state[root] = 1
        stack: list[tuple[str, Iterable[str]]] = [(root, iter(children(root)))]
        while stack:
            node, pending = stack[-1]
            for child in pending:
                if child not in state and not done(child):
                    state[child] = 1
                    stack.append((child, iter(children(child))))
                    break
            else:
                stack.pop()
                state[node] = 2
                order.append(node)
    return order


class CallStructure:
    """Roles of a module's computations (module docstring), each worked out once, on demand."""

    def __init__(self, module: HloModule, label_of: Callable[[HloInstruction], str | None]) -> None:
        self.module = module
        self.label_of = label_of  # the label an instruction carries itself
        self.callers = module.callers()
        self.contexts: dict[str, tuple[HloInstruction, ...]] = {}
        self.absorbed_labels: dict[str, frozenset[str]] = {}

    def is_inlined(self, comp_name: str) -> bool:
        """Called, and only by instructions that are not ``while``/``conditional``/``call``."""
        callers = self.callers.get(comp_name)
        return bool(callers) and all(c.opcode not in NESTING_KIND for c in callers)

    def is_shared(self, comp_name: str) -> bool:
        """Whether several ``while``/``conditional``/``call`` instructions call the computation."""
        return sum(c.opcode in NESTING_KIND for c in self.callers.get(comp_name, ())) > 1

    def context(self, comp_name: str) -> tuple[HloInstruction, ...]:
        """Enclosing ``while``/``conditional``/``call`` instructions of a computation, outermost first.

        Followed through the first nesting caller (else the first caller) up to a computation
        nobody calls: one chain, walked in a loop.
        """
        found = self.contexts.get(comp_name)
        if found is not None:
            return found
        chain: list[tuple[str, HloInstruction | None]] = []
        on_chain: set[str] = set()
        name: str | None = comp_name
        base: tuple[HloInstruction, ...] = ()
        while name is not None:
            known = self.contexts.get(name)
            if known is not None:
                base = known
                break
            if name in on_chain:  # a call cycle in malformed text: start it from nothing
                break
            on_chain.add(name)
            callers = self.callers.get(name, ())
            nesting = next((c for c in callers if c.opcode in NESTING_KIND), None)
            if nesting is not None:
                chain.append((name, nesting))
                name = nesting.computation
            elif callers:
                chain.append((name, None))
                name = callers[0].computation
            else:
                chain.append((name, None))
                name = None
        for name, caller in reversed(chain):
            if caller is not None:
                base = base + (caller,)
            self.contexts[name] = base
        return self.contexts[comp_name]

    def absorbed(self, comp_name: str) -> frozenset[str]:
        """Labels whose instructions here belong to a labelled loop/branch around this computation.

        The callers' absorbed labels are worked out first, in post-order over their computations.
        """
        found = self.absorbed_labels.get(comp_name)
        if found is not None:
            return found

        def parents(name: str) -> list[str]:
            return [c.computation for c in self.callers.get(name, ()) if c.opcode in NESTING_KIND]

        for name in post_order([comp_name], parents, self.absorbed_labels.__contains__):
            labels: set[str] = set()
            for caller in self.callers.get(name, ()):
                if caller.opcode in NESTING_KIND:
                    own = self.label_of(caller)
                    if own is not None:
                        labels.add(own)
                    labels |= self.absorbed_labels.get(caller.computation, frozenset())
            self.absorbed_labels[name] = frozenset(labels)
        return self.absorbed_labels[comp_name]
