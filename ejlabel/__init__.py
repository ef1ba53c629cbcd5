"""ejlabel: labels in the compiled JAX program, and what they make possible.

Every kernel call made through an :class:`Executor` writes a label
``ejkernel_ops#<op>@v<version>:<call key>`` into the lowered program. After lowering, the labels
read back out of any program form tell which kernel calls a program makes, which config each
one got (``labels_to_configs``), and which have no tuned config yet (``ejlabel.analysis``).
"""

from pathlib import Path as _Path

from ejlabel import _source_tree

_source_tree.install(_Path(__file__).resolve().parent)

# The layers import one way, bottom up: utils, core, config, execution (tests/test_layers.py).
from ejlabel.config.cache import (  # noqa: E402
    AutotunePolicy,
    ConfigCache,
    from_json,
    overlay_cache,
    policy_override,
    to_json,
    use_implementation,
)
from ejlabel.config.persistent import CacheEntry, CacheError, PersistentCache  # noqa: E402
from ejlabel.config.selection import (  # noqa: E402
    ConfigSelectorChain,
    LabelConfig,
    Selection,
    labels_to_configs,
)
from ejlabel.core.calls import (  # noqa: E402
    decode_call,
    encode_call,
    invocations_from_program,
)
from ejlabel.core.kernel import Cfg, Invocation, Kernel, Out  # noqa: E402
from ejlabel.core.registry import import_user_modules, register_config_type  # noqa: E402
from ejlabel.core.label_format import LABEL_RE  # noqa: E402
from ejlabel.core.labels import (  # noqa: E402
    extract_labels_from_hlo_text,
    find_labels_in_lowered,
    label,
    label_scope,
)
from ejlabel.core.shards import ShardRule  # noqa: E402
from ejlabel.execution.batch import pmap_with_config, vmap_with_config  # noqa: E402
from ejlabel.execution.executor import (  # noqa: E402
    Executor,
    get_default_executor,
    set_default_executor,
)
from ejlabel.execution.recording import (  # noqa: E402
    clear_invocations,
    get_invocations,
    record_invocation,
    recording,
)
from ejlabel.execution.tuning import (  # noqa: E402
    AutotuneError,
    Autotuner,
    ContextTuneReport,
    Timing,
    Tuner,
    autotune,
    autotune_recorded,
    benchmark,
    tune_in_context,
)
from ejlabel.utils.fingerprint import (  # noqa: E402
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
from ejlabel.utils.params import (  # noqa: E402
    BwdParams,
    FwdParams,
    select_num_stages,
    select_num_warps,
)
from ejlabel.utils.version import VERSION as __version__  # noqa: E402  (after the source-tree hook)

__all__ = [
    "__version__",
    "AutotuneError",
    "AutotunePolicy",
    "Autotuner",
    "BwdParams",
    "CacheEntry",
    "CacheError",
    "Cfg",
    "ConfigCache",
    "ConfigSelectorChain",
    "ContextTuneReport",
    "Executor",
    "FwdParams",
    "Invocation",
    "Kernel",
    "LABEL_RE",
    "LabelConfig",
    "Out",
    "PersistentCache",
    "Selection",
    "ShardRule",
    "Timing",
    "Tuner",
    "abstractify",
    "autotune",
    "autotune_recorded",
    "benchmark",
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
    "import_user_modules",
    "invocations_from_program",
    "label",
    "label_scope",
    "labels_to_configs",
    "overlay_cache",
    "pmap_with_config",
    "policy_override",
    "record_invocation",
    "recording",
    "register_config_type",
    "register_fingerprint",
    "select_num_stages",
    "select_num_warps",
    "set_default_executor",
    "sharding_fingerprint",
    "short_hash",
    "stable_json",
    "to_json",
    "tune_in_context",
    "use_implementation",
    "vmap_with_config",
]
