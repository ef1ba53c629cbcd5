"""Shapes, instruction facts and cost estimates of HLO instructions.

Three things the call graph needs that the parsed module does not hold directly:

* *Shapes* as numbers: ``f32[64,128]{1,0}`` is 32 KiB, 8192 elements, dims ``(64, 128)``; a
  tuple shape is the sum of its arrays. Shapes are parsed once per distinct string (memoised).
* *Instruction facts*: four attributes that the tolerant parser (:mod:`.hlo`) skips, yet the
  graph needs: the element a ``get-tuple-element`` picks (``index=``), the number of a
  ``parameter(N)``, a dot's ``lhs_contracting_dims`` and a convolution's ``dim_labels``.
  :class:`InstructionFacts` reads them from the program text in one scan. A module given without
  its text (an :class:`~.hlo.HloModule` parsed elsewhere) gets them *inferred from shapes*
  (:func:`infer_facts`): exact whenever the shapes leave one choice (a tuple whose elements all
  differ, a dot whose dimension sizes fix the contraction); otherwise data flow takes the widest
  answer (every candidate tuple element, every candidate parameter), so edges are a superset, and
  a dot the split with the most batch dims that still contracts something (an ``[n, n] x [n, n]``
  dot is a matmul, attention's dots are batched); a dot contracting two dims whose sizes equal its
  free dims' is where that choice can be wrong.
  Once :mod:`.hlo` keeps these attributes on its instructions, both paths read them there.
* *Costs*: estimated flops of one instruction (see :func:`instruction_flops`).

Flops by instruction: a ``dot`` (or a library gemm custom-call such as ``__cublas$gemm``,
contracting dims from its backend config) is 2 × result elements × contracted elements; a
``convolution`` is 2 × result elements × kernel elements per output feature; an elementwise op is
one per result element; anything else (data movement, reductions, custom calls of unknown work)
counts nothing.
"""

from __future__ import annotations

import functools
import math
import re
from collections.abc import Callable
from dataclasses import dataclass, field

from .hlo import HloComputation, HloInstruction, HloModule
from .hlo_lexis import tuple_elements

__all__ = [
    "ELEMENTWISE",
    "InstructionFacts",
    "array_dims",
    "dtype_bits",
    "elements",
    "infer_facts",
    "instruction_flops",
    "read_facts",
    "shape_info",
    "tuple_elements",
]

ELEMENTWISE = frozenset(
    {
        "abs", "add", "and", "atan2", "cbrt", "ceil", "clamp", "clz", "compare", "complex", "convert",
        "cosine", "divide", "erf", "exponential", "exponential-minus-one", "floor", "imag",
        "is-finite", "log", "log-plus-one", "logistic", "maximum", "minimum", "multiply", "negate",
        "not", "or", "popcnt", "power", "real", "remainder", "round-nearest-afz", "round-nearest-even",
        "rsqrt", "select", "shift-left", "shift-right-arithmetic", "shift-right-logical", "sign",
        "sine", "sqrt", "subtract", "tan", "tanh", "xor",
    }
)
"""Opcodes that do one operation per result element."""

_ARRAY_SHAPE = re.compile(r"([a-z][a-z0-9]*)\[([^\]]*)\]")
_DIGITS = re.compile(r"\d+")
# Library gemm custom-calls (GPU): a dot the compiler handed to a vendor library, same flops.
GEMM_TARGETS = frozenset({"__cublas$gemm", "__cublas$lt$matmul", "__cublas$lt$matmul$f8", "__rocblas$gemm", "__hipblas$lt$matmul"})
_GEMM_CONTRACTING = re.compile(r'"lhs_contracting_dimensions"\s*:\s*\[([^\]]*)\]')

# The attributes the parser skips, read straight from the text: one scan per attribute, each
# pattern starting with a literal (which the regex engine finds by a fast search; an alternation
# of the four would be tried at every character, slower).
_GTE_INDEX = re.compile(r"get-tuple-element\([^()\n]*\), index=(\d+)")
_PARAMETER = re.compile(r"parameter\((\d+)\)")
_LHS_CONTRACTING = re.compile(r"lhs_contracting_dims=\{([\d,]*)\}")
_DIM_LABELS = re.compile(r"dim_labels=([\w]+_[\w]+->[\w]+)")
_NUMBERED_PARAMETER = re.compile(r"(?:param|Arg|arg|parameter|p)_?(\d+)(?:\.\d+)?")
_LINE_NAME = re.compile(r"[ \t]*(?:ROOT[ \t]+)?%?([^\s=(){}\[\],\"%]+)[ \t]*=")


# ---------------------------------------------------------------------------
# Shapes.


@functools.lru_cache(maxsize=65536)
def dtype_bits(dtype: str) -> int:
    """Bits per element of an HLO element type: the width in its name (``bf16`` 16, ``f8e4m3fn`` 8)."""
    if dtype == "pred":
        return 8
    found = _DIGITS.search(dtype)
    return int(found.group()) if found else 0  # token, opaque: no data


@functools.lru_cache(maxsize=65536)
def shape_info(shape: str) -> tuple[int, tuple[tuple[int, ...], ...]]:
    """``(bytes, dims of each array)`` of a shape string; a tuple is the sum of its arrays."""
    bits = 0
    arrays: list[tuple[int, ...]] = []
    for dtype, dims_text in _ARRAY_SHAPE.findall(shape):
        dims = tuple(int(d) for d in _DIGITS.findall(dims_text)) if dims_text else ()
        arrays.append(dims)
        bits += dtype_bits(dtype) * math.prod(dims)
    return (bits + 7) // 8, tuple(arrays)


def array_dims(shape: str) -> tuple[int, ...] | None:
    """Dims of an array shape; None for a tuple (or anything that is not one array)."""
    arrays = shape_info(shape)[1]
    return arrays[0] if len(arrays) == 1 else None


@functools.lru_cache(maxsize=65536)
def elements(shape: str) -> int:
    """Elements of an array shape (an elementwise op's flops); 0 for a tuple."""
    dims = array_dims(shape)
    return math.prod(dims) if dims is not None else 0


# ---------------------------------------------------------------------------
# Instruction facts.


@dataclass(slots=True)
class InstructionFacts:
    """The four attributes the parser skips, by instruction name (names are unique in a module).

    Read from the text (:func:`read_facts`), or, for a module without its text
    (:func:`infer_facts`), inferred from shapes where first asked for (``index_of``,
    ``parameter_of``; dot dims by :func:`instruction_flops`): then ``exact`` is False, a
    get-tuple-element may name several candidate elements and a parameter several candidate
    operands (empty: unknown, any).
    """

    tuple_index: dict[str, tuple[int, ...]] = field(default_factory=dict)
    parameter_number: dict[str, tuple[int, ...]] = field(default_factory=dict)
    lhs_contracting: dict[str, tuple[int, ...]] = field(default_factory=dict)
    dim_labels: dict[str, str] = field(default_factory=dict)
    module: HloModule | None = None  # the module to infer from; None when read from the text

    @property
    def exact(self) -> bool:
        return self.module is None

    def index_of(self, instr: HloInstruction, comp: HloComputation) -> tuple[int, ...] | None:
        """The tuple element(s) a get-tuple-element picks."""
        found = self.tuple_index.get(instr.name)
        if found is None and self.module is not None:
            found = self.tuple_index[instr.name] = _infer_tuple_index(instr, comp)
        return found

    def parameter_of(self, instr: HloInstruction, comp: HloComputation) -> tuple[int, ...] | None:
        """The operand position(s) of its caller a parameter takes."""
        found = self.parameter_number.get(instr.name)
        if found is None and self.module is not None:
            self.parameter_number.update(_infer_parameters(comp, self.module))
            found = self.parameter_number.setdefault(instr.name, ())
        return found


def read_facts(text: str) -> InstructionFacts:
    """The facts of every instruction of HLO ``text``, in one scan of the text per attribute."""
    facts = InstructionFacts()
    rfind = text.rfind
    line_name = _LINE_NAME.match
    for pattern, table, convert in (
        (_GTE_INDEX, facts.tuple_index, _one_int),
        (_PARAMETER, facts.parameter_number, _one_int),
        (_LHS_CONTRACTING, facts.lhs_contracting, _int_list),
        (_DIM_LABELS, facts.dim_labels, str),
    ):
        for found in pattern.finditer(text):
            head = line_name(text, rfind("\n", 0, found.start()) + 1)
            if head is not None:
                table[head.group(1)] = convert(found.group(1))  # type: ignore[index]
    return facts


def _one_int(digits: str) -> tuple[int, ...]:
    return (int(digits),)


def _int_list(digits: str) -> tuple[int, ...]:
    return tuple(int(d) for d in _DIGITS.findall(digits))


def infer_facts(module: HloModule) -> InstructionFacts:
    """Facts of a module given without its text, inferred from shapes where first needed:

    * ``get-tuple-element``: the elements of its operand's tuple shape equal to its own shape.
    * ``parameter``: the operand positions of its computation's callers (calls, fusions) whose
      shape equals the parameter's, and among several the one its name gives (XLA names them
      ``param_1.196``, ``Arg_0.2``); a while body or condition, a branch, has one parameter
      (number 0); callers that disagree on their operands' shapes leave it unknown.
    * ``dot``: where its flops are needed (:func:`instruction_flops`): the split of its shapes
      into batch, contracting and free dimensions that fits, the one with the most batch dims
      that still contracts something where several do.
    * ``convolution``: not inferred (its flops count 0 without the text).
    """
    return InstructionFacts(module=module)


def _infer_tuple_index(instr: HloInstruction, comp: HloComputation) -> tuple[int, ...]:
    source = comp.instruction(instr.operands[0]) if instr.operands else None
    parts = tuple_elements(source.shape) if source is not None else None
    if parts is None:
        return ()
    return tuple(k for k, part in enumerate(parts) if _same_shape(part, instr.shape)) or tuple(range(len(parts)))


def _infer_parameters(comp: HloComputation, module: HloModule) -> dict[str, tuple[int, ...]]:
    operand_shapes = _caller_operand_shapes(module.callers().get(comp.name, ()), module)
    found: dict[str, tuple[int, ...]] = {}
    if not operand_shapes:
        return found
    for instr in comp.instructions:
        if instr.opcode != "parameter":
            continue
        candidates = tuple(k for k, shape in enumerate(operand_shapes) if _same_shape(shape, instr.shape))
        if len(candidates) > 1:
            # XLA names parameters after their number (``param_1.196``, ``Arg_0.2``): the
            # tie-breaker between operands of one shape.
            named = _NUMBERED_PARAMETER.fullmatch(instr.name)
            if named is not None and int(named.group(1)) in candidates:
                candidates = (int(named.group(1)),)
        found[instr.name] = candidates or tuple(range(len(operand_shapes)))
    return found


def _caller_operand_shapes(callers: list[HloInstruction] | tuple[()], module: HloModule) -> tuple[str, ...] | None:
    """Shapes of the operands a computation's parameters take, if its callers agree on them."""
    found: tuple[str, ...] | None = None
    for caller in callers:
        if caller.opcode in ("while", "conditional"):
            return ("",)  # one parameter (the loop state, the branch operand): number 0
        home = module.computations.get(caller.computation)
        if home is None:
            return None
        operands = [home.instruction(o) for o in caller.operands]
        shapes = tuple("" if o is None else o.shape for o in operands)
        if found is None:
            found = shapes
        elif found != shapes:
            return None
    return found


def _same_shape(a: str, b: str) -> bool:
    if a == b:
        return True
    if not a or not b:
        return True  # unknown: a candidate
    return shape_info(a) == shape_info(b) and _layoutless(a) == _layoutless(b)


@functools.lru_cache(maxsize=65536)
def _layoutless(shape: str) -> str:
    """A shape without layouts and spaces: ``f32[2,3]{1,0}`` -> ``f32[2,3]``."""
    out: list[str] = []
    depth = 0
    for ch in shape:
        if ch == "{":
            depth += 1
        elif ch == "}":
            depth -= 1
        elif depth == 0 and not ch.isspace():
            out.append(ch)
    return "".join(out)


@functools.lru_cache(maxsize=4096)
def _contracting_from_dims(lhs: tuple[int, ...], rhs: tuple[int, ...], out: tuple[int, ...]) -> tuple[int, ...] | None:
    """Lhs contracting dims that the shapes fix, as far as the contracted size goes.

    A dot's result is (batch dims, lhs free dims, rhs free dims); each operand holds the batch
    dims (anywhere), the contracting dims (anywhere) and its free dims in their order. Every
    split that fits is tried, the most batch dims first among those that contract something
    (attention's ``[b, h, s, d] x [b, h, t, d]`` is batched; a dot that contracts nothing is an
    elementwise or outer product, which XLA writes as a multiply, so an ``[n, n] x [n, n]`` dot is
    a matmul). None when nothing fits.
    """
    rank_sum = len(lhs) + len(rhs) - len(out)
    batch_counts = list(range(rank_sum % 2, min(len(lhs), len(rhs), len(out)) + 1, 2))
    # The most batch dims first, those that contract nothing last.
    batch_counts.sort(key=lambda n: (n == rank_sum, -n))
    for n_batch in batch_counts:
        n_contract = (rank_sum - n_batch) // 2
        n_lhs_free = len(lhs) - n_batch - n_contract
        n_rhs_free = len(rhs) - n_batch - n_contract
        if n_contract < 0 or n_lhs_free < 0 or n_rhs_free < 0:
            continue
        batch = out[:n_batch]
        lhs_free = out[n_batch : n_batch + n_lhs_free]
        rhs_free = out[n_batch + n_lhs_free :]
        for contracting in _operand_splits(lhs, batch, lhs_free, n_contract):
            contracted = sorted(lhs[d] for d in contracting)
            if any(sorted(rhs[d] for d in c) == contracted for c in _operand_splits(rhs, batch, rhs_free, n_contract)):
                return contracting
    return None


def _operand_splits(
    dims: tuple[int, ...], batch: tuple[int, ...], free: tuple[int, ...], n_contract: int
) -> list[tuple[int, ...]]:
    """Contracting positions of an operand such that the other positions hold the batch sizes
    (any positions) and, in order, the free sizes."""
    from itertools import combinations

    rank = len(dims)
    if rank > 8:
        return []  # a rank no real dot has: do not enumerate
    found: list[tuple[int, ...]] = []
    wanted_batch = sorted(batch)
    for contracting in combinations(range(rank), n_contract):
        rest = [p for p in range(rank) if p not in contracting]
        for batch_positions in combinations(rest, len(batch)):
            if sorted(dims[p] for p in batch_positions) != wanted_batch:
                continue
            if tuple(dims[p] for p in rest if p not in batch_positions) == free:
                found.append(contracting)
                break
    return found


# ---------------------------------------------------------------------------
# Costs.


def instruction_flops(
    instr: HloInstruction, lookup: Callable[[str], HloInstruction | None], facts: InstructionFacts
) -> int:
    """Estimated floating-point operations of one instruction (see the module docstring).

    ``lookup`` finds an instruction of the same computation by name (its operands).
    """
    opcode = instr.opcode
    if opcode in ELEMENTWISE:
        return elements(instr.shape)
    if opcode == "custom-call":
        if instr.custom_call_target not in GEMM_TARGETS or len(instr.operands) < 2:
            return 0
        arrays = shape_info(instr.shape)[1]
        out = arrays[0] if arrays else None  # a library gemm returns (result, workspace)
    elif opcode in ("dot", "convolution") and len(instr.operands) >= 2:
        out = array_dims(instr.shape)
    else:
        return 0
    lhs_instr = lookup(instr.operands[0])
    rhs_instr = lookup(instr.operands[1])
    if out is None or lhs_instr is None or rhs_instr is None:
        return 0
    lhs, rhs = array_dims(lhs_instr.shape), array_dims(rhs_instr.shape)
    if lhs is None or rhs is None:
        return 0
    if opcode == "convolution":
        labels = facts.dim_labels.get(instr.name)
        if labels is None:
            return 0
        kernel_labels = labels.split("_", 1)[1].split("->", 1)[0]
        position = kernel_labels.find("o")
        if position < 0 or position >= len(rhs) or rhs[position] == 0:
            return 0
        return 2 * math.prod(out) * (math.prod(rhs) // rhs[position])
    if opcode == "dot":
        contracting = facts.lhs_contracting.get(instr.name)
        if contracting is None and not facts.exact:
            contracting = _contracting_from_dims(lhs, rhs, out)
    else:
        found = _GEMM_CONTRACTING.search(instr.backend_config or "")
        contracting = tuple(int(d) for d in _DIGITS.findall(found.group(1))) if found else None
    return _matmul_flops(tuple(out), lhs, rhs, contracting)


@functools.lru_cache(maxsize=4096)
def _matmul_flops(
    out: tuple[int, ...], lhs: tuple[int, ...], rhs: tuple[int, ...], contracting: tuple[int, ...] | None
) -> int:
    """2 × result × contracted elements (the dims of one model's dots repeat layer after layer)."""
    if contracting is not None and all(d < len(lhs) for d in contracting):
        return 2 * math.prod(out) * math.prod(lhs[d] for d in contracting)
    # No attribute and shapes that leave a choice: assume no batch dims (lhs·rhs = result·contracted²).
    return 2 * math.prod(out) * math.isqrt(math.prod(lhs) * math.prod(rhs) // max(1, math.prod(out)))
