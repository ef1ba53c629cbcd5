"""Recording kernel calls for batch tuning.

Inside ``with recording():`` the executor records every call it makes; ``record_invocation``
adds one by hand. Records keep abstract specs only (``jax.ShapeDtypeStruct``), never the arrays
themselves, so recording a training run does not keep its activations alive.
"""

from __future__ import annotations

import contextlib
import contextvars
import threading
from collections.abc import Iterator
from typing import Any

from ejlabel.core.kernel import Invocation, Kernel, abstract_invocation

__all__ = ["record_invocation", "get_invocations", "clear_invocations", "recording", "maybe_record"]

_lock = threading.Lock()
_records: dict[tuple[str, str], Invocation[Any, Any]] = {}
_recording: contextvars.ContextVar[bool] = contextvars.ContextVar("ejlabel_recording", default=False)


def record_invocation(kernel: Kernel[Any, Any], inv: Invocation[Any, Any]) -> None:
    """Record ``inv`` (of ``kernel``) for a later ``autotune_recorded``; duplicates collapse."""
    if inv.kernel is not kernel:
        raise ValueError(f"inv: it is a call of {inv.kernel!r}, not of kernel {kernel!r}")
    record = abstract_invocation(inv)
    with _lock:
        _records.setdefault((record.op_id, record.call_key), record)


def get_invocations() -> list[Invocation[Any, Any]]:
    """The recorded calls, one per distinct ``(op_id, call_key)``, in recording order."""
    with _lock:
        return list(_records.values())


def clear_invocations() -> None:
    with _lock:
        _records.clear()


@contextlib.contextmanager
def recording() -> Iterator[None]:
    """Record every call the executor makes inside the block."""
    token = _recording.set(True)
    try:
        yield
    finally:
        _recording.reset(token)


def maybe_record(inv: Invocation[Any, Any]) -> None:
    if _recording.get():
        record_invocation(inv.kernel, inv)
