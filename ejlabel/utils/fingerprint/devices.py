"""Which device a config was tuned on: the device fingerprint and the coarse platform family.

A tuned config is looked up by ``(device_fingerprint, op_id@vN, call_key)``: the call key says
what the call is (:mod:`.keys`), the device fingerprint where it runs, down to the software
stack, so a config tuned on one device model or driver is never served on another. Kernels pick
their implementation by the coarser family (:func:`get_device_platform`). Both are asked on
every kernel call, so both are memoised per device object.
"""

from __future__ import annotations

import functools
from typing import Any

import jax

__all__ = ["device_fingerprint", "device_kind", "get_device_platform"]


def _clean(text: Any) -> str:
    """Collapse whitespace and drop the field separator from a device field."""
    return " ".join(str(text).split()).replace("|", "/")


@functools.cache
def _default_device() -> Any:
    # The device list is fixed once the backends are up; looking it up again on
    # every kernel call would cost more than the rest of the key.
    return jax.devices()[0]


_DEVICE_CACHE: dict[Any, str] = {}


def _compute_device_fingerprint(dev: Any) -> str:
    platform = _clean(getattr(dev, "platform", "unknown")).lower()
    kind = _clean(getattr(dev, "device_kind", "unknown"))
    client = getattr(dev, "client", None)
    version = _clean(getattr(client, "platform_version", "") or "")
    return f"{platform}|{kind}|{version}"


def device_fingerprint(dev: Any = None) -> str:
    """``"<platform>|<device_kind>|<platform_version>"`` of ``dev``.

    The platform version (CUDA/driver, ROCm or TPU runtime) is part of it so
    that a config tuned on one device model or software stack is never served
    on another.  ``dev`` defaults to the first jax device.  The result is
    cached per device object because it is asked for on every kernel call.
    """
    d = _default_device() if dev is None else dev
    try:
        return _DEVICE_CACHE[d]
    except KeyError:
        pass
    except TypeError:
        return _compute_device_fingerprint(d)
    fp = _compute_device_fingerprint(d)
    _DEVICE_CACHE[d] = fp
    return fp


def get_device_platform(dev: Any = None) -> str:
    """``"gpu"``, ``"tpu"``, ``"cpu"`` or ``"unknown"`` for ``dev``.

    ``cuda`` and ``rocm`` platforms count as ``gpu``.  When the platform name
    is unfamiliar, the device kind is consulted, as kernels pick their
    implementation by this coarse family.
    """
    d = _default_device() if dev is None else dev
    platform = str(getattr(d, "platform", "")).lower()
    if platform in ("gpu", "cuda", "rocm"):
        return "gpu"
    if platform in ("tpu", "cpu"):
        return platform
    kind = str(getattr(d, "device_kind", "")).lower()
    if any(word in kind for word in ("gpu", "cuda", "nvidia", "geforce", "rtx", "radeon", "instinct", "amd")):
        return "gpu"
    if "tpu" in kind:
        return "tpu"
    if "cpu" in kind:
        return "cpu"
    return "unknown"


def device_kind() -> str:
    """Coarse family (``gpu``/``tpu``/``cpu``/``unknown``) of the default device."""
    return get_device_platform()
