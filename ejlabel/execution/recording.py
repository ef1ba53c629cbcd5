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
_devices: dict[tuple[str, str], str] = {}
_recording: contextvars.ContextVar[bool] = contextvars.ContextVar("ejlabel_recording", default=False)


def record_invocation(*args: Any) -> None:
    """Record a call for a later ``autotune_recorded``; duplicates collapse.

    Forms: ``record_invocation(kernel, inv)`` (ejlabel) and ejkernel's
    ``record_invocation(dev, op_id_v, call_key, kernel, args, kwargs)``, whose ``op_id_v`` and
    ``call_key`` must be the ones ejlabel computes for that call (a mismatch is an error: the
    record would tune a key no call looks up) and whose ``dev`` must be this process's device.
    """
    if len(args) == 2:
        kernel, inv = args
    elif len(args) == 6:
        dev, op_id_v, call_key, kernel, call_args, call_kwargs = args
        inv = Invocation(kernel, tuple(call_args), dict(call_kwargs))
        if (dev, op_id_v, call_key) != inv.cache_key:
            raise ValueError(f"record_invocation: key {(dev, op_id_v, call_key)} is not this call's key {inv.cache_key}")
    else:
        raise TypeError(f"record_invocation takes (kernel, inv) or (dev, op_id_v, call_key, kernel, args, kwargs), got {len(args)} arguments")
    if not isinstance(inv, Invocation):
        raise TypeError(f"inv: expected an Invocation, got {type(inv).__name__}")
    if inv.kernel is not kernel:
        raise ValueError(f"inv: it is a call of {inv.kernel!r}, not of kernel {kernel!r}")
    record = abstract_invocation(inv)
    with _lock:
        _records.setdefault((record.op_id, record.call_key), record)
        _devices[(record.op_id, record.call_key)] = record.device_fingerprint


def get_invocations(dev: str | None = None) -> list[Invocation[Any, Any]]:
    """The recorded calls, one per distinct ``(op_id, call_key)``, in recording order; with
    ``dev`` (ejkernel's argument), only those recorded on that device fingerprint."""
    with _lock:
        return [inv for key, inv in _records.items() if dev is None or _devices.get(key) == dev]


def clear_invocations() -> None:
    with _lock:
        _records.clear()
        _devices.clear()


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
