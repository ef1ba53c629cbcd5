"""Tuning: finding the fastest correct config of every kernel call, alone and in its program.

The story, in the order the modules tell it:

1. **Measure** (:mod:`.measure`). Every time comes from a compiled program run with the device
   synchronised, after untimed warm-up, as the median of repeated runs (:class:`Timing`,
   :func:`benchmark`); every candidate's output is checked against the reference first.
2. **Candidates** (:mod:`.candidates`). A call is tuned over its *floor* (the kernel's
   heuristic config and the config of its declared plain path, which every other candidate
   must beat and which no budget skips) and its config space; each candidate ends with a
   status and a reason.
3. **In isolation** (:mod:`.isolated`, :mod:`.halving`). The :class:`Autotuner` compiles
   every candidate of every call ahead of time in one thread pool, checks each, and ranks the
   correct ones by successive halving. It serves a selector's cache miss, :func:`autotune`,
   :func:`autotune_recorded` and ``ejlabel tune``; the winner is stored with provenance
   ``autotuned``.
4. **In context** (:mod:`.in_context`, with :mod:`.ranking`, :mod:`.paired`, :mod:`.search`,
   :mod:`.memory`, :mod:`.report`). A config that wins alone can lose in the step (fusions
   across call boundaries, layouts), so :func:`tune_in_context` compiles and times the whole
   step, starting from the all-XLA assignment, and keeps a change only when the noise rule on
   paired rounds says the step got faster. It spends its budget by expected gain: calls in
   order of their share of the step, each kernel's prior candidates first; picks are stored
   with provenance ``in-context``, with what lost, so the next run skips what is known.
5. **Remote** (:mod:`.remote`). A worker process, usually on another machine, tunes calls
   rebuilt from the program's own call descriptions, and answers in plain data; the Ray driver
   that sends the calls out and stores the answers is :mod:`ejlabel.analysis.ray_tuning`.
"""

from ejlabel.execution.tuning.candidates import AutotuneError, CallCodeError, CandidateResult, TuneResult, TuningCut
from ejlabel.execution.tuning.in_context import DEFAULT_BUDGET_S, PROVENANCE, RANK_SHARE, tune_in_context
from ejlabel.execution.tuning.isolated import Autotuner, Tuner, autotune, autotune_recorded, store_result, tune_invocation
from ejlabel.execution.tuning.measure import Timing, benchmark
from ejlabel.execution.tuning.paired import LEVEL, MIN_SAMPLE_MS, ROUND_CAP, Comparison
from ejlabel.execution.tuning.remote import TuningWorker, call_request, result_from_data, result_to_data, worker_name
from ejlabel.execution.tuning.report import CallPick, ContextTuneReport, Trial

__all__ = [
    "DEFAULT_BUDGET_S",
    "LEVEL",
    "MIN_SAMPLE_MS",
    "PROVENANCE",
    "RANK_SHARE",
    "ROUND_CAP",
    "AutotuneError",
    "Autotuner",
    "CallCodeError",
    "CallPick",
    "CandidateResult",
    "Comparison",
    "ContextTuneReport",
    "Timing",
    "Trial",
    "TuneResult",
    "Tuner",
    "TuningCut",
    "TuningWorker",
    "autotune",
    "autotune_recorded",
    "benchmark",
    "call_request",
    "result_from_data",
    "result_to_data",
    "store_result",
    "tune_in_context",
    "tune_invocation",
    "worker_name",
]
