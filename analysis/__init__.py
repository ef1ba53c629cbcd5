"""Post-lowering passes: read a program, rebuild its kernel-call graph, audit it, tune it.

Everything here works from program text alone (a ``Lowered``, a ``Compiled``, HLO or
StableHLO text, an HLO file or an XLA dump directory), so a dump written on another machine is
enough to audit and tune a model.
"""

from .audit import CallRow, Report, audit
from .graph import call_graph, draw, from_node_link_json, to_dot, to_node_link_json
from .hlo import HloComputation, HloInstruction, HloModule, HloParseError, parse_hlo, stablehlo_frontend_attributes
from .tune import TuneReport, tune_unseen

__all__ = [
    "CallRow",
    "HloComputation",
    "HloInstruction",
    "HloModule",
    "HloParseError",
    "Report",
    "TuneReport",
    "audit",
    "call_graph",
    "draw",
    "from_node_link_json",
    "parse_hlo",
    "stablehlo_frontend_attributes",
    "to_dot",
    "to_node_link_json",
    "tune_unseen",
]
