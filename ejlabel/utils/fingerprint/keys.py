"""Call keys: the salted hash of a call's abstract signature, and its readable form.

:func:`default_key_builder_with_sharding` assembles the record a call key hashes: op id, kernel
version, positional arguments, keyword arguments and batch axes, with every array counting by
its abstract value (:mod:`.arrays`). :func:`short_hash` is 16 hex digits of sha256 over a salt
and the byte encoding (:mod:`.encoding`); :func:`stable_json` the same value as canonical JSON
(:mod:`.rendering`). :func:`abstractify` replaces arrays by ``ShapeDtypeStruct`` for callers
that keep a signature.

The salt holds the library version, the key format version (:data:`FINGERPRINT_VERSION`) and
the user's ``EJLABEL_CACHE_SALT``, so a new release, a new key format or a user who wants a
fresh cache namespace never reuses a config cached under other keys.
"""

from __future__ import annotations

import hashlib
import os
from typing import Any

import jax
import jax.tree_util as jtu
import numpy as np
from jax.sharding import NamedSharding

from ejlabel.utils.fingerprint.encoding import encode
from ejlabel.utils.fingerprint.grammar import RECORD, Node, Unsupported, lp, text_bytes
from ejlabel.utils.fingerprint.rendering import render
from ejlabel.utils.version import VERSION

__all__ = ["FINGERPRINT_VERSION", "SALT_ENV_VAR", "abstractify", "default_key_builder_with_sharding", "short_hash", "stable_json"]

#: Version of the key format.  Bump it whenever an encoding changes so that
#: keys written by an older format can never be read back as current.
FINGERPRINT_VERSION: int = 1

#: Environment variable whose value is mixed into every hash, so that a user
#: can start a fresh cache namespace without deleting files.
SALT_ENV_VAR: str = "EJLABEL_CACHE_SALT"


def _library_version() -> str:
    return VERSION


_SALTS: dict[str, bytes] = {}


def _salt() -> bytes:
    """Length-prefixed salt: library version, key format version and the
    user's ``EJLABEL_CACHE_SALT``.  The variable is read on every call (a dict
    lookup) so that changing it takes effect at once."""
    user = os.environ.get(SALT_ENV_VAR, "")
    salt = _SALTS.get(user)
    if salt is None:
        text = f"ejlabel-fingerprint|{_library_version()}|{FINGERPRINT_VERSION}|{user}"
        salt = lp(text_bytes(text))
        _SALTS[user] = salt
    return salt


def _encode_or_explain(obj: Any) -> bytearray:
    try:
        return encode(obj)
    except Unsupported as exc:
        # Walk again with paths to say where the offending value sits.
        render(obj)
        raise TypeError(exc.message("an unknown place")) from None


def short_hash(obj: Any) -> str:
    """16 hex digits of sha256 over the salt and the encoding of ``obj``.

    Equal under any dict insertion or set iteration order and any hash seed;
    different for values that differ in type or content.  Arrays count only
    by abstract value.  Raises ``TypeError`` (with the path) for a value the
    hasher has no rule for.
    """
    h = hashlib.sha256(_salt())
    h.update(_encode_or_explain(obj))
    return h.hexdigest()[:16]


def stable_json(obj: Any) -> str:
    """Canonical, type-tagged, compact JSON text of ``obj``'s fingerprint.

    Meant for reading and debugging keys: it shows exactly what
    :func:`short_hash` depends on, e.g. ``{"__float__":"0x1.0000000000000p+0"}``
    for ``1.0`` and ``{"__array__":{...}}`` for an array.
    """
    return render(obj)


def abstractify(pytree: Any) -> Any:
    """``pytree`` with every array (jax, numpy or tracer) replaced by a
    ShapeDtypeStruct that keeps its shape, dtype, weak type and NamedSharding.
    Other leaves are left as they are."""

    def leaf(x: Any) -> Any:
        if isinstance(x, jax.core.Tracer):
            aval = x.aval
            return jax.ShapeDtypeStruct(aval.shape, aval.dtype, weak_type=getattr(aval, "weak_type", False))
        if isinstance(x, (jax.Array, np.ndarray)):
            sharding = getattr(x, "sharding", None)
            return jax.ShapeDtypeStruct(
                x.shape,
                x.dtype,
                sharding=sharding if isinstance(sharding, NamedSharding) else None,
                weak_type=bool(getattr(x, "weak_type", False)),
            )
        return x

    return jtu.tree_map(leaf, pytree)


_KEY_FIELDS = ("op_id", "kernel_version", "args", "kwargs", "batch_axes")


def default_key_builder_with_sharding(inv: Any) -> str:
    """Cache key of one kernel invocation.

    ``inv`` needs ``op_id``, ``args``, ``kwargs`` and ``batch_axes``, and may
    have ``kernel_version`` (default ``"1"``).  Arrays anywhere in the
    arguments count by shape, dtype, weak type and sharding, which the hasher
    reads straight from them, so no abstract copy of the arguments is built.
    """
    values = (
        inv.op_id,
        getattr(inv, "kernel_version", "1"),
        tuple(inv.args),
        dict(inv.kwargs),
        inv.batch_axes,
    )
    return short_hash(Node(RECORD, "kernel_key", (_KEY_FIELDS, values)))
