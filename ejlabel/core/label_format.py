"""The label format: the one place that knows how a label is spelled.

A label ``ejkernel_ops#<op>@v<version>:<call key>`` names one kernel call signature:

- ``<op>`` is the kernel's op name; its backward pass is ``<op>.bwd`` (:data:`BACKWARD_SUFFIX`);
- ``<version>`` is the kernel's version, so a config is never served to another version;
- ``<call key>`` is 16 lowercase hex digits, the fingerprint of the call's abstract signature.

``<op>@v<version>`` is the *op id* the caches key on. Op names and versions are validated where
kernels are made, against exactly the characters the readers read back (:data:`LABEL_RE`):
a name the readers cannot find again must not be written. :func:`check_op_id` is the same rule
for a whole op id, applied wherever one is stored: a cache ``put`` and every entry of an imported
export file, so an op id in a cache is always one a label could carry (never ``"a b{c}@v1"`` or
one holding terminal escape codes).
"""

from __future__ import annotations

import re

__all__ = [
    "LABEL_PREFIX",
    "LABEL_ATTRIBUTE",
    "CALL_ATTRIBUTE",
    "BACKWARD_SUFFIX",
    "LABEL_RE",
    "format_label",
    "parse_label",
    "versioned_op",
    "split_op_id",
    "backward_op_id",
    "forward_op_id",
    "is_backward",
    "check_op_name",
    "check_version",
    "check_op_id",
]

LABEL_PREFIX = "ejkernel_ops#"
LABEL_ATTRIBUTE = "ejlabel"
"""Frontend attribute that carries the label on every op of a call's region."""
CALL_ATTRIBUTE = "ejcall"
"""Frontend attribute that carries the encoded call description (see :mod:`ejlabel.core.calls`)."""
BACKWARD_SUFFIX = ".bwd"

_OP_NAME = r"[A-Za-z0-9_][A-Za-z0-9_.\-/]*"
_VERSION = r"[0-9A-Za-z_][0-9A-Za-z_.\-]*"
_OP_NAME_RE = re.compile(_OP_NAME)
_VERSION_RE = re.compile(_VERSION)
_OP_ID_RE = re.compile(f"{_OP_NAME}(?:@v{_VERSION})?")
_KEY_RE = re.compile(r"[0-9a-f]{16}")
_PREFIX_RE = re.compile(r"[A-Za-z_][A-Za-z0-9_.\-]*#")

# The lookbehind lets a match start only where a run of prefix characters starts: without it,
# a scan retries at every character of a long run (real call descriptions are such runs) and
# takes time quadratic in the run's length.
LABEL_RE = re.compile(
    r"(?<![A-Za-z0-9_.\-])(?P<prefix>[A-Za-z_][A-Za-z0-9_.\-]*#)(?P<op>[A-Za-z0-9_.\-/]+@v[0-9A-Za-z_.\-]+):(?P<key>[0-9a-f]{16})(?![0-9a-f])"
)
"""Matches a label; group ``op`` is the op id (``name@vN``) and ``key`` the call key."""


def check_op_name(name: object, argument: str = "op_id") -> str:
    """``name`` if it is a valid op name (letters, digits, ``_ . - /``; not ending in ``.bwd``)."""
    if not isinstance(name, str) or _OP_NAME_RE.fullmatch(name) is None:
        raise ValueError(
            f"{argument}: expected a name of letters, digits and '_', '.', '-', '/' (starting with a "
            f"letter, digit or '_'), got {name!r}"
        )
    if name.endswith(BACKWARD_SUFFIX):
        raise ValueError(f"{argument}: {name!r} ends in {BACKWARD_SUFFIX!r}, which labels backward passes")
    return name


def check_version(version: object, argument: str = "version") -> str:
    """``version`` if it is valid: letters, digits and ``_ . -`` (no ``:`` ``@`` ``#``)."""
    if not isinstance(version, str) or _VERSION_RE.fullmatch(version) is None:
        raise ValueError(f"{argument}: expected letters, digits and '_', '.', '-', got {version!r}")
    return version


def check_op_id(op_id: object, argument: str = "op_id") -> str:
    """``op_id`` if a label could carry it: ``<name>@v<version>`` (a backward pass's ``.bwd`` name
    included) or, as ejkernel's caches allow, a bare ``<name>``; ValueError naming ``argument``."""
    if not isinstance(op_id, str) or _OP_ID_RE.fullmatch(op_id) is None:
        raise ValueError(
            f"{argument}: expected '<name>@v<version>' (the name of letters, digits and '_', '.', '-', '/'; "
            f"the version of letters, digits and '_', '.', '-'), got {op_id!r:.120}"
        )
    return op_id


def versioned_op(name: str, version: str) -> str:
    """``"matmul", "1"`` -> ``"matmul@v1"``."""
    return f"{name}@v{version}"


def split_op_id(op_id: str) -> tuple[str, str]:
    """``"matmul.bwd@v1"`` -> ``("matmul.bwd", "1")``; an op id without a version is version 1."""
    name, sep, version = op_id.rpartition("@v")
    if not sep:
        return op_id, "1"
    return name, version


def is_backward(op_id: str) -> bool:
    """Whether ``op_id`` (versioned or not) names a backward pass."""
    return split_op_id(op_id)[0].endswith(BACKWARD_SUFFIX)


def backward_op_id(op_id: str) -> str:
    """``"matmul@v1"`` -> ``"matmul.bwd@v1"``."""
    name, version = split_op_id(op_id)
    return versioned_op(name + BACKWARD_SUFFIX, version)


def forward_op_id(op_id: str) -> str:
    """``"matmul.bwd@v1"`` -> ``"matmul@v1"``; a forward op id is returned as it is."""
    name, version = split_op_id(op_id)
    return versioned_op(name.removesuffix(BACKWARD_SUFFIX), version)


def format_label(op_id: str, call_key: str, prefix: str = LABEL_PREFIX) -> str:
    """``"matmul@v1", "0123456789abcdef"`` -> ``"ejkernel_ops#matmul@v1:0123456789abcdef"``."""
    if not isinstance(op_id, str) or not op_id:
        raise TypeError(f"op_id: expected a non-empty str, got {op_id!r}")
    name, version = split_op_id(op_id)
    if _OP_NAME_RE.fullmatch(name) is None:
        raise ValueError(f"op_id: {op_id!r} has characters a label cannot carry")
    check_version(version, "op_id's version")
    if not isinstance(call_key, str) or _KEY_RE.fullmatch(call_key) is None:
        raise ValueError(f"call_hash: expected 16 lowercase hex characters, got {call_key!r}")
    if not isinstance(prefix, str) or _PREFIX_RE.fullmatch(prefix) is None:
        raise ValueError(f"prefix: expected a name ending in '#', got {prefix!r}")
    return f"{prefix}{versioned_op(name, version)}:{call_key}"


def parse_label(text: str) -> tuple[str, str]:
    """``"ejkernel_ops#matmul@v1:0123456789abcdef"`` -> ``("matmul@v1", "0123456789abcdef")``."""
    match = LABEL_RE.fullmatch(text) if isinstance(text, str) else None
    if match is None:
        raise ValueError(f"label: expected '<prefix>#<op>@v<version>:<16 hex>', got {text!r}")
    return match.group("op"), match.group("key")
