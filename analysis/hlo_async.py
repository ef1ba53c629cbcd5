"""XLA's asynchronous shorthand, read as XLA reads it: one async op, not three plain ones.

XLA prints an asynchronous instruction whose wrapped computation holds one instruction in a short
form: ``%s = (...) custom-call-start(%a, %b), custom_call_target="x"``, then
``custom-call-update(%s)`` and ``custom-call-done(%s)``. Its parser reads ``<op>-start`` as an
``async-start`` that calls a computation wrapping ``<op>`` (with ``<op>``'s attributes), and
``<op>-update`` / ``<op>-done`` as ``async-update`` / ``async-done`` of that start. This module
does the same to a parsed computation (:func:`unfold_async`): the start becomes ``async-start``
calling a new computation ``<start>.wrapped`` whose parameters take the start's operands and whose
root is ``<op>`` with the attributes; the update and done become ``async-update`` / ``async-done``.

The start keeps its frontend attributes and custom-call target too, so passes that look at the top
level (labels, attribution of unlabelled custom calls) see them where the text wrote them. The
update and done call nothing here: they complete the start they read (passes that count what an op
computes count the wrapped computation once, at its start).

XLA's own asynchronous opcodes (``all-reduce-start``, ``all-gather-start``,
``collective-permute-start``, ``copy-start`` and their ``-done``, ``send-done``, ``recv-done``,
``async-start``...) are instructions of their own, read as written.
"""

from __future__ import annotations

from .hlo_lexis import NO_NAMES, intern, tuple_elements
from .hlo_model import HloComputation, HloInstruction

__all__ = ["ASYNC_FOLLOWERS", "ASYNC_OPCODES", "async_sugar_kind", "unfold_async"]

#: Opcodes XLA has of its own for asynchronous work (never shorthand).
ASYNC_OPCODES = frozenset(
    {
        "async-start", "async-update", "async-done",
        "all-gather-start", "all-gather-done",
        "all-reduce-start", "all-reduce-done",
        "collective-permute-start", "collective-permute-done",
        "copy-start", "copy-done",
        "send", "send-done", "recv", "recv-done",
    }
)
#: Instructions that complete (or advance) the asynchronous op they read: one op with it.
ASYNC_FOLLOWERS = frozenset(
    {"async-update", "async-done", "all-gather-done", "all-reduce-done", "collective-permute-done", "copy-done", "send-done", "recv-done"}
)
_SUFFIXES = (("-start", "start"), ("-update", "update"), ("-done", "done"))


def async_sugar_kind(opcode: str) -> str:
    """``"start"``, ``"update"`` or ``"done"`` for XLA's shorthand ``<op>-start`` ...; ``""`` otherwise."""
    if opcode in ASYNC_OPCODES:
        return ""
    for suffix, kind in _SUFFIXES:
        if opcode.endswith(suffix) and len(opcode) > len(suffix):
            return kind
    return ""


def unfold_async(
    computations: dict[str, HloComputation], comp_name: str, instrs: list[HloInstruction], kinds: dict[str, str]
) -> None:
    """Rewrite the shorthand async instructions of one computation as XLA reads them (module docstring).

    ``computations`` receives the wrapped computations (before ``comp_name``, which calls them, as
    XLA prints them); ``kinds`` memoises :func:`async_sugar_kind` per opcode.
    """
    for instr in instrs:
        kind = kinds.get(instr.opcode)
        if kind is None:
            kind = kinds[instr.opcode] = async_sugar_kind(instr.opcode)
        if not kind:
            continue
        if kind == "start":
            wrapped = _wrapped_computation(computations, instr)
            computations[wrapped.name] = wrapped
            instr.opcode = "async-start"
            instr.called_computations = (wrapped.name,)
        else:
            instr.opcode = "async-update" if kind == "update" else "async-done"
            instr.called_computations = NO_NAMES


def _wrapped_computation(computations: dict[str, HloComputation], start: HloInstruction) -> HloComputation:
    """The computation ``<start>.wrapped``: parameters for the start's operands, ``<op>`` as root."""
    name = f"{start.name}.wrapped"
    count = 0
    while name in computations:
        count += 1
        name = f"{start.name}.wrapped.{count}"
    name = intern(name)
    opcode = intern(start.opcode[: -len("-start")])
    # The start's shape is ((operand shapes...), result shape, context...); without one, unknown.
    parts = tuple_elements(start.shape) if start.shape else None
    operand_shapes = tuple_elements(parts[0]) if parts else None
    result_shape = parts[1] if parts and len(parts) > 1 else ""
    params: list[HloInstruction] = []
    for k in range(len(start.operands)):
        shape = operand_shapes[k] if operand_shapes is not None and k < len(operand_shapes) else ""
        params.append(HloInstruction(intern(f"{start.name}.param_{k}"), "parameter", shape, NO_NAMES, name))
    root = HloInstruction(
        intern(f"{start.name}.op"),
        opcode,
        result_shape,
        tuple(p.name for p in params),
        name,
        start.called_computations,
        True,
        start.custom_call_target,
        start.frontend_attributes,
        start.backend_config,
        start.known_trip_count,
        start.metadata,
    )
    return HloComputation(name, False, [*params, root], root.name)
