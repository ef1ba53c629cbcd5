"""Stable fingerprints of kernel-call signatures, devices and shardings.

A tuned kernel config is stored under a key built from the call that asked for it: the
operation, the abstract arguments (shape, dtype, weak type, sharding, never contents), the
static keyword arguments and the device. The key must be the same in every process that makes
the same call, and different whenever the call differs in anything that could change the best
config.

How a value is fingerprinted, module by module:

* :mod:`.grammar`: the :class:`~.grammar.Node` every value is reduced to (a kind, a type tag,
  a payload or children) and the headers of the byte grammar;
* :mod:`.table`: the one table of rules, :func:`~.table.reduce_value`, with the user's
  registrations (:func:`register_fingerprint`);
* :mod:`.names`: functions, classes and callables, by a name checked to resolve back to the same
  object, or by their code and closed-over values;
* :mod:`.arrays`: arrays by abstract value and sharding (:func:`sharding_fingerprint`);
* :mod:`.devices`: the device a config was tuned on (:func:`device_fingerprint`);
* :mod:`.encoding` and :mod:`.rendering`: the two walkers over the table, iterative and safe on
  cycles: compact bytes for hashing, canonical JSON for people and for error paths;
* :mod:`.keys`: the salted hash (:func:`short_hash`), its readable form (:func:`stable_json`)
  and the call key (:func:`default_key_builder_with_sharding`).
"""

from ejlabel.utils.fingerprint.arrays import sharding_fingerprint
from ejlabel.utils.fingerprint.devices import device_fingerprint, device_kind, get_device_platform
from ejlabel.utils.fingerprint.keys import (
    FINGERPRINT_VERSION,
    SALT_ENV_VAR,
    abstractify,
    default_key_builder_with_sharding,
    short_hash,
    stable_json,
)
from ejlabel.utils.fingerprint.table import register_fingerprint, scalar_memo_key

__all__ = [
    "FINGERPRINT_VERSION",
    "SALT_ENV_VAR",
    "abstractify",
    "default_key_builder_with_sharding",
    "device_fingerprint",
    "device_kind",
    "get_device_platform",
    "register_fingerprint",
    "scalar_memo_key",
    "sharding_fingerprint",
    "short_hash",
    "stable_json",
]
