"""ejlabel: labels in the compiled JAX program, and what they make possible.

Every kernel call made through an :class:`Executor` writes a label
``ejkernel_ops#<op>@v<version>:<call key>`` into the lowered program. After lowering, the labels
read back out of any program form tell which kernel calls a program makes, which config each
one got (``labels_to_configs``), and which have no tuned config yet (``ejlabel.analysis``).
"""

__version__ = "0.1.0"

from .batch import pmap_with_config, vmap_with_config
from .calls import call_descriptions, decode_call, encode_call, invocations_from_program
from .config import AutotunePolicy, ConfigCache, from_json, overlay_cache, policy_override, to_json
from .executor import Executor, get_default_executor, set_default_executor
from .fingerprint import (
    abstractify,
    default_key_builder_with_sharding,
    device_fingerprint,
    device_kind,
    get_device_platform,
    register_fingerprint,
    sharding_fingerprint,
    short_hash,
    stable_json,
)
from .kernel import Invocation, Kernel
from .labels import LABEL_RE, extract_labels_from_hlo_text, find_labels_in_lowered, label, label_scope
from .params import BwdParams, FwdParams, select_num_stages, select_num_warps
from .persistent import CacheEntry, CacheError, PersistentCache
from .registry import clear_invocations, get_invocations, record_invocation, recording
from .selection import ConfigSelectorChain, LabelConfig, Selection, labels_to_configs
from .tuning import Autotuner, AutotuneError, Timing, autotune, autotune_recorded, benchmark

__all__ = [
    "__version__",
    "AutotuneError",
    "AutotunePolicy",
    "Autotuner",
    "BwdParams",
    "CacheEntry",
    "CacheError",
    "ConfigCache",
    "ConfigSelectorChain",
    "Executor",
    "FwdParams",
    "Invocation",
    "Kernel",
    "LABEL_RE",
    "LabelConfig",
    "PersistentCache",
    "Selection",
    "Timing",
    "abstractify",
    "autotune",
    "autotune_recorded",
    "benchmark",
    "call_descriptions",
    "clear_invocations",
    "decode_call",
    "default_key_builder_with_sharding",
    "device_fingerprint",
    "device_kind",
    "encode_call",
    "extract_labels_from_hlo_text",
    "find_labels_in_lowered",
    "from_json",
    "get_default_executor",
    "get_device_platform",
    "get_invocations",
    "invocations_from_program",
    "label",
    "label_scope",
    "labels_to_configs",
    "overlay_cache",
    "pmap_with_config",
    "policy_override",
    "record_invocation",
    "recording",
    "register_fingerprint",
    "select_num_stages",
    "select_num_warps",
    "set_default_executor",
    "sharding_fingerprint",
    "short_hash",
    "stable_json",
    "to_json",
    "vmap_with_config",
]
