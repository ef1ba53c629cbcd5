"""Post-lowering passes: read a program, rebuild its kernel-call graph, audit it, tune it.

Everything here works from program text alone (a ``Lowered``, a ``Compiled``, HLO or
StableHLO text, an HLO file or an XLA dump directory), so a dump written on another machine is
enough to audit and tune a model. A program is read once (:class:`Program`, :mod:`.program`
says which text each form reads); ``call_graph``, ``audit``, ``tune_unseen`` and
``invocations_from_program`` take that ``Program`` or anything it reads.

Modules: ``hlo`` (the tolerant HLO parser's entry points; ``hlo_lexis``, ``hlo_model``,
``hlo_items``, ``hlo_instructions``, ``hlo_parser`` and ``hlo_async`` are its parts), ``program``
(a program read once, through the core's one program reader), ``costs`` (shapes, instruction
facts, flops), ``nesting`` (how computations call each other), ``sites`` (which instructions make
up each call; ``site_rules`` and ``site_parts`` are its parts), ``flow`` (data edges), ``cycles``
(splits that keep the graph a DAG), ``graph`` (the ``networkx`` graph), ``export`` (JSON, DOT,
drawings), ``audit`` and ``tune``.
"""

from .audit import CallRow, Report, audit
from .export import draw, from_node_link_json, to_dot, to_node_link_json
from .graph import call_graph
from .hlo import (
    HloComputation,
    HloInstruction,
    HloModule,
    HloParseError,
    parse_hlo,
    stablehlo_frontend_attributes,
)
from .program import (
    Program,
    ProgramModule,
    ProgramReadError,
    UnreadModule,
    invocations_from_program,
    read_program,
)
from .tune import TuneReport, tune_unseen

__all__ = [
    "CallRow",
    "HloComputation",
    "HloInstruction",
    "HloModule",
    "HloParseError",
    "Program",
    "ProgramModule",
    "ProgramReadError",
    "Report",
    "TuneReport",
    "UnreadModule",
    "audit",
    "call_graph",
    "draw",
    "from_node_link_json",
    "invocations_from_program",
    "parse_hlo",
    "read_program",
    "stablehlo_frontend_attributes",
    "to_dot",
    "to_node_link_json",
    "tune_unseen",
]
