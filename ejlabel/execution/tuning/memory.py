"""What tuning in context remembers between runs, kept in the persistent store.

Every call's pick is stored with provenance ``in-context`` and statistics
(:func:`~.in_context.tune_in_context`). Two of those statistics spare the next run work:

* **Recalled picks.** A later run of a step that makes this exact call (device, op, version
  and call key, at as many sites) takes the stored pick as it is, whether the run that wrote it
  finished with the call or the budget cut its ranking: the call is neither ranked nor confirmed
  again; the final check against the all-XLA floor still judges the whole step. A second run of
  the same step therefore ranks nothing and gives the same picks. ``decided`` says whether the
  writing run finished with the call (complete ranking and every planned confirmation measured,
  or a share too small to be worth a change, :mod:`.ranking`); a pick recalled without it is
  counted in the report (:attr:`Recall.cut`), which points to ``exhaustive=True`` (CLI
  ``--exhaustive``) to tune such calls further. Recalling a cut pick rather than ranking the
  call again is what keeps a second call within seconds: a cut ranking resumed would spend the
  same budget the first call ran out of.
  Every entry a run stores carries that run's id (``run``) and the step times of its final
  check; when one run stored the picks of every call of a step, that check judged exactly
  this assignment, and a later run needs to measure nothing (:meth:`Recall.checked_together`).
* **Losers by shape class.** ``lost`` lists the candidates that did not beat the floor: slower
  than it in isolation, failed (compile error, wrong output, out of memory) or rejected in the
  whole step, each with the reason and the call it lost at. A call of the same op and version
  on the same device whose :func:`shape_class` matches skips them, never compiling them: a batch
  size or sequence length that moves within a power of two keeps what was learned, and a kernel
  that never beat XLA at a shape costs nothing the next time.

Both are provenance-carrying data: the entry says which call, run statistics and versions they
come from, and decoding them never imports anything (configs resolve through the registry). An
exhaustive run (``tune_in_context(..., exhaustive=True)``) ignores both and measures everything
again, overwriting what it decides.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable, Mapping
from typing import Any

import jax
import numpy as np

from ejlabel.config.persistent import CacheEntry, CacheError
from ejlabel.core.kernel import Invocation
from ejlabel.execution.tuning.report import CallPick, Key, Trial
from ejlabel.utils.fingerprint import short_hash
from ejlabel.utils.serialize import from_jsonable

__all__ = ["FAILED", "PROVENANCE", "Recall", "decode_config", "lost_candidates", "recall", "shape_class"]

PROVENANCE = "in-context"
FAILED = ("compile_error", "runtime_error", "out_of_memory", "nan", "wrong")  # statuses of a candidate that failed


def shape_class(inv: Invocation[Any, Any]) -> str:
    """The call's shape class: each array argument's dtype and dimensions rounded up to a power
    of two, then a hash of the static options (which decide what the kernel computes).

    ``bf16[8192,1024] bf16[1024,4096] #3f09...``: calls of one op that differ only in sizes
    within a power of two share it.
    """
    parts = []
    for leaf in jax.tree_util.tree_leaves((inv.args, inv.array_kwargs)):
        shape, dtype = getattr(leaf, "shape", None), getattr(leaf, "dtype", None)
        if shape is None or dtype is None:
            continue
        parts.append(f"{np.dtype(dtype).name}[{','.join(str(_ceil_power_of_two(int(d))) for d in shape)}]")
    try:
        static = short_hash((inv.static_kwargs, inv.batch_axes))
    except TypeError:  # an option the fingerprint has no rule for: only this exact call matches
        static = inv.call_key
    return " ".join([*parts, f"#{static}"])


def _ceil_power_of_two(n: int) -> int:
    return 1 if n <= 1 else 1 << (n - 1).bit_length()


def decode_config(value: Any) -> Any | None:
    """A config read back from stored statistics (decoded already, or tagged JSON), or None when
    it does not decode here or cannot serve as a key."""
    try:
        cfg = from_jsonable(value) if isinstance(value, dict) else value
        hash(cfg)
    except (ValueError, TypeError, KeyError, AttributeError, ImportError):
        return None
    return cfg


@dataclasses.dataclass
class Recall:
    """What earlier runs left for this step's calls.

    ``picks``: the stored entry of each call an earlier run picked for (this exact call, as
    many sites); ``losers``: per call, the candidates that lost at its shape class:
    ``{cfg: (why, call key)}``.
    """

    picks: dict[Key, CacheEntry] = dataclasses.field(default_factory=dict)
    losers: dict[Key, dict[Any, tuple[str, str]]] = dataclasses.field(default_factory=dict)

    @property
    def cut(self) -> list[Key]:
        """The recalled calls that the writing run did not finish with (ranking cut by its budget)."""
        return [key for key, entry in self.picks.items() if (entry.stats or {}).get("decided") is not True]

    def checked_together(self, keys: Iterable[Key]) -> tuple[float, float] | None:
        """``(floor step ms, tuned step ms)`` when every one of ``keys`` has a decided pick and all
        of them were stored by one run, whose final check judged exactly this assignment against
        the floor; else None."""
        entries = [self.picks.get(key) for key in keys]
        if not entries or any(entry is None for entry in entries):
            return None
        stats = [entry.stats or {} for entry in entries if entry is not None]
        runs = {s.get("run") for s in stats}
        floor_ms, step_ms = stats[0].get("floor_step_ms"), stats[0].get("step_ms")
        if len(runs) != 1 or not isinstance(next(iter(runs)), str) or not (_finite(floor_ms) and _finite(step_ms)):
            return None
        return float(floor_ms), float(step_ms)


def recall(persistent: Any, invocations: Mapping[Key, Invocation[Any, Any]], sites: Mapping[Key, int], floor: Mapping[Key, Any]) -> Recall:
    """Read the decided picks and the losers of these calls from ``persistent`` (None: nothing).

    A store that cannot be read gives nothing back: remembering is an optimisation, never a
    reason to fail a run.
    """
    memory = Recall()
    if persistent is None:
        return memory
    by_op: dict[tuple[str, str], list[CacheEntry]] = {}
    for key, inv in invocations.items():
        device, op_id, call_key = key
        if (device, op_id) not in by_op:
            try:
                by_op[device, op_id] = [e for e in persistent.entries(device=device, op_id=op_id) if e.provenance == PROVENANCE and isinstance(e.stats, dict)]
            except CacheError:
                by_op[device, op_id] = []
        klass = shape_class(inv)
        losers: dict[Any, tuple[str, str]] = {}
        for entry in by_op[device, op_id]:
            stats = entry.stats or {}
            if entry.call_key == call_key and isinstance(stats.get("decided"), bool) and stats.get("recall") is not False and stats.get("sites") == sites[key] and _usable(inv, entry.config):
                memory.picks[key] = entry
            if stats.get("shape_class") == klass:
                losers.update(_losers(stats.get("lost"), entry.call_key))
        losers.pop(floor[key], None)  # the floor is what every candidate must beat: never skipped
        if losers:
            memory.losers[key] = losers
    return memory


def _usable(inv: Invocation[Any, Any], cfg: Any) -> bool:
    if cfg is None:
        return False
    try:
        return bool(inv.kernel.candidate_is_valid(inv, cfg))
    except Exception:  # noqa: BLE001 - a config the kernel cannot judge is not recalled
        return False


def _losers(rows: Any, call_key: str) -> dict[Any, tuple[str, str]]:
    """``{cfg: (why, call key)}`` from a stored ``lost`` list; malformed rows are passed over."""
    found: dict[Any, tuple[str, str]] = {}
    for row in rows if isinstance(rows, list) else []:
        if not isinstance(row, dict) or not isinstance(row.get("why"), str):
            continue
        cfg = decode_config(row.get("cfg"))
        if cfg is not None:
            where = row.get("call_key") if isinstance(row.get("call_key"), str) else call_key
            found[cfg] = (row["why"], where)
    return found


def lost_candidates(call: CallPick, trials: Iterable[Trial], skip_slower: bool) -> list[dict[str, Any]]:
    """The candidates of ``call`` that did not beat its floor in this run, and those an earlier
    run's losers made it skip, as rows for the stored ``lost`` list.

    Slower than the floor in isolation counts only when such candidates were not confirmed
    anyway (``skip_slower``): otherwise the isolated time was not taken as decisive.
    """
    rows: dict[Any, str] = {}
    floor_ms = call.floor_isolated_ms
    for row in call.candidates:
        cfg, status, ms = row.get("cfg"), row.get("status"), row.get("median_ms")
        if cfg in (call.floor_cfg, call.cfg):
            continue
        if status in FAILED:
            rows[cfg] = f"{status} in isolation"
        elif skip_slower and status in ("ok", "pruned") and _finite(ms) and _finite(floor_ms) and ms >= floor_ms:
            rows[cfg] = f"slower than XLA in isolation ({ms:.4g} ms vs {floor_ms:.4g} ms)"
    for trial in trials:
        if trial.key != call.key or trial.cfg is None or trial.cfg == call.cfg:
            continue
        if trial.status == "rejected":
            rows[trial.cfg] = "rejected in the whole step"
        elif trial.status in FAILED:
            rows[trial.cfg] = f"{trial.status} in the whole step"
    own = [{"cfg": cfg, "why": why, "call_key": call.call_key} for cfg, why in rows.items()]
    carried = [{"cfg": cfg, "why": why, "call_key": where} for cfg, (why, where) in call.skipped_losers.items() if cfg not in rows]
    return own + carried


def _finite(value: Any) -> bool:
    return isinstance(value, (int, float)) and math.isfinite(value)
