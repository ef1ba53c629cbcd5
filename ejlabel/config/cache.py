"""The in-memory config cache, the autotuning policy, and their context-local overrides.

Keys everywhere are ``(device_fingerprint, op_id, call_key)`` with a versioned op id
(``matmul@v1``), so a config is only ever served to the device and kernel version it was
chosen for. ``overlay_cache`` and ``policy_override`` are ``contextvars``-based: they are local to
the thread or task that enters them, nest, and are restored on exceptions.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import os
import threading
from collections.abc import Iterator
from typing import Any, Literal

from ejlabel.config.persistent import normalize_key
from ejlabel.utils.serialize import from_json, to_json

__all__ = [
    "ConfigCache",
    "AutotunePolicy",
    "overlay_cache",
    "policy_override",
    "active_overlays",
    "use_implementation",
    "forced_implementation",
    "effective_policy",
    "never_tunes",
    "NEVER_TUNES_WARNING",
    "to_json",
    "from_json",
    "usable_cores",
]

Key = tuple[str, str, str]


class ConfigCache:
    """Thread-safe in-memory map from ``(device, op_id, call_key)`` to a config.

    Both the three-argument form ``get(dev, op_id, call_key)`` and the tuple form
    ``get((dev, op_id, call_key))`` are accepted, as is ``key in cache``.
    """

    def __init__(self) -> None:
        self._entries: dict[Key, Any] = {}
        self._lock = threading.Lock()

    def get(self, dev: str | Key, op_id: str | None = None, call_key: str | None = None) -> Any | None:
        if type(dev) is str and type(op_id) is str and type(call_key) is str:
            # Every stored key was validated by put(), so a hit needs no validation; a miss is
            # validated below, so a malformed key still raises.
            with self._lock:
                cfg = self._entries.get((dev, op_id, call_key))
            if cfg is not None:
                return cfg
        key = normalize_key(dev, op_id, call_key)
        with self._lock:
            return self._entries.get(key)

    def put(self, dev: str | Key, op_id: Any = None, call_key: str | None = None, cfg: Any = None) -> None:
        if isinstance(dev, tuple):  # put(key, cfg)
            key, cfg = normalize_key(dev), op_id
        else:
            key = normalize_key(dev, op_id, call_key)
        if cfg is None:
            raise ValueError("cfg: expected a config, got None")
        with self._lock:
            self._entries[key] = cfg

    def delete(self, dev: str | Key, op_id: str | None = None, call_key: str | None = None) -> bool:
        key = normalize_key(dev, op_id, call_key)
        with self._lock:
            return self._entries.pop(key, None) is not None

    def clear(self) -> None:
        with self._lock:
            self._entries.clear()

    def entries(self) -> list[tuple[Key, Any]]:
        """A snapshot of ``(key, config)`` pairs."""
        with self._lock:
            return list(self._entries.items())

    def keys(self) -> list[Key]:
        """A snapshot of the stored ``(device, op_id, call_key)`` keys (ejkernel's ``keys()``)."""
        with self._lock:
            return list(self._entries)

    def size(self) -> int:
        """The number of entries (ejkernel's ``size()``; ``len(cache)`` is the same)."""
        return len(self)

    def __contains__(self, key: object) -> bool:
        if not isinstance(key, tuple):
            return False
        with self._lock:
            return normalize_key(key) in self._entries

    def __len__(self) -> int:
        with self._lock:
            return len(self._entries)

    def __repr__(self) -> str:
        return f"ConfigCache({len(self)} entries)"


MissAction = Literal["heuristic", "autotune", "error"]


def usable_cores() -> int:
    """The CPU cores this process may run on (its affinity mask where the system has one)."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):  # no affinity masks on this system
        return max(1, os.cpu_count() or 1)


@dataclasses.dataclass(frozen=True)
class AutotunePolicy:
    """What a cache miss does, and how much tuning it may cost.

    Attributes:
      enabled: whether tuning may run at all; ``False`` forces the heuristic on a miss.
      on_miss: ``"heuristic"`` (use ``heuristic_cfg``), ``"autotune"`` (tune now, on inputs
        built from the abstract signature, outside any trace) or ``"error"`` (raise: for
        production runs that must only use tuned configs).
      max_configs: try at most this many candidates (the heuristic one always among them).
      time_budget_s: stop timing new candidates of one call after this many seconds.
      num_warmup, num_iters: runs per candidate before and during timing.
      calls_per_sample: back-to-back calls in one timed run, rotating over two input sets, so
        short kernels are timed amortised (not as launch plus sync) and not on inputs that sit
        in cache from the previous call; the run's time is divided by it.
      early_stop: drop candidates clearly slower than the best so far (successive halving).
      compile_workers: threads that compile candidates ahead of time; by default one per CPU
        core this process may run on (XLA compiles outside the GIL, one core each).
      tune_backward: for kernels with a custom VJP, time and check forward and backward
        together (what a training step runs); turn off to tune for serving.

    ejkernel's names are accepted as keywords and read back as properties, with ejlabel's
    meaning where it is stronger:

    - ``allow_autotune`` is ``enabled``: tuning is *allowed*, and still happens on a miss only
      with ``cache_miss_fallback="autotune"``, as in ejkernel. A selector whose policy was made
      with ``allow_autotune=True`` alone warns once, at its first miss, that it never tunes.
    - ``cache_miss_fallback="heuristics"`` / ``"autotune"`` is ``on_miss="heuristic"`` /
      ``"autotune"``.
    - ``allow_heuristics=False`` is ``on_miss="error"`` (a miss raises instead of using the
      heuristic; with ``cache_miss_fallback="autotune"`` the miss tunes, and a tuning failure
      raises, as in ejkernel).
    - ``validate_backward`` is ``tune_backward``: ejlabel always checks candidates against the
      reference; with it on, the backward pass is checked *and timed* together with the forward.

    Arguments are keyword-only: ejkernel's positional order differs from ejlabel's fields, so a
    positional call is refused rather than mis-assigned. Unlike ejkernel's, a policy is frozen:
    change it with ``dataclasses.replace`` or ``policy_override``.
    """

    enabled: bool = True
    on_miss: MissAction = "heuristic"
    max_configs: int | None = None
    time_budget_s: float | None = None
    num_warmup: int = 3
    num_iters: int = 10
    calls_per_sample: int = 4
    early_stop: bool = True
    compile_workers: int = dataclasses.field(default_factory=usable_cores)
    tune_backward: bool = True

    def __post_init__(self) -> None:
        if self.on_miss not in ("heuristic", "autotune", "error"):
            raise ValueError(f"on_miss: expected 'heuristic', 'autotune' or 'error', got {self.on_miss!r}")
        for name in ("num_warmup", "num_iters", "calls_per_sample", "compile_workers"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < (1 if name != "num_warmup" else 0):
                raise ValueError(f"{name}: expected a positive int, got {value!r}")
        if self.max_configs is not None and self.max_configs < 1:
            raise ValueError(f"max_configs: expected None or >= 1, got {self.max_configs!r}")
        if self.time_budget_s is not None and self.time_budget_s <= 0:
            raise ValueError(f"time_budget_s: expected None or > 0, got {self.time_budget_s!r}")

    @property
    def tunes_on_miss(self) -> bool:
        return self.enabled and self.on_miss == "autotune"

    # ejkernel's names, read back.
    @property
    def allow_autotune(self) -> bool:
        return self.enabled

    @property
    def allow_heuristics(self) -> bool:
        return self.on_miss != "error"

    @property
    def cache_miss_fallback(self) -> str:
        return "autotune" if self.on_miss == "autotune" else "heuristics"

    @property
    def validate_backward(self) -> bool:
        return self.tune_backward


_FALLBACKS = {"heuristics": "heuristic", "heuristic": "heuristic", "autotune": "autotune", "error": "error"}
_EJKERNEL_POLICY_NAMES = ("allow_autotune", "allow_heuristics", "cache_miss_fallback", "validate_backward")


def translate_policy_fields(fields: dict[str, Any]) -> dict[str, Any]:
    """``AutotunePolicy`` field values with ejkernel's names mapped to ejlabel's (see its docstring)."""
    updates = dict(fields)
    if "allow_autotune" in updates:
        if "enabled" in updates:
            raise TypeError("give either enabled or allow_autotune (the same field), not both")
        updates["enabled"] = updates.pop("allow_autotune")
    if "validate_backward" in updates:
        if "tune_backward" in updates:
            raise TypeError("give either tune_backward or validate_backward (the same field), not both")
        updates["tune_backward"] = updates.pop("validate_backward")
    fallback = updates.pop("cache_miss_fallback", None)
    allow_heuristics = updates.pop("allow_heuristics", None)
    if fallback is not None:
        if "on_miss" in updates:
            raise TypeError("give either on_miss or cache_miss_fallback (the same field), not both")
        if fallback not in _FALLBACKS:
            raise ValueError(f"cache_miss_fallback: expected 'heuristics' or 'autotune', got {fallback!r}")
        updates["on_miss"] = _FALLBACKS[fallback]
    if allow_heuristics is not None:
        if not isinstance(allow_heuristics, bool):
            raise TypeError(f"allow_heuristics: expected a bool, got {allow_heuristics!r}")
        on_miss = updates.get("on_miss", "heuristic")
        if not allow_heuristics and on_miss == "heuristic":
            updates["on_miss"] = "error"
        elif allow_heuristics and on_miss == "error":
            raise ValueError("allow_heuristics=True contradicts on_miss='error'")
    return updates


_dataclass_init = AutotunePolicy.__init__


def _policy_init(self: AutotunePolicy, *args: Any, **fields: Any) -> None:
    if args:
        raise TypeError(
            "AutotunePolicy takes keyword arguments only (ejkernel's positional order "
            "allow_autotune, allow_heuristics, cache_miss_fallback differs from ejlabel's fields); "
            f"got {len(args)} positional argument(s)"
        )
    _dataclass_init(self, **translate_policy_fields(fields))
    # ejkernel's switch alone allows tuning but keeps the heuristic fallback, so nothing is
    # ever tuned on a miss (ejkernel's meaning too); the selector says so once (see never_tunes).
    if fields.get("allow_autotune") is True and not {"cache_miss_fallback", "on_miss"} & set(fields):
        object.__setattr__(self, "_tuning_asked", True)


def never_tunes(policy: AutotunePolicy) -> bool:
    """Whether ``policy`` was made with ``allow_autotune=True`` and no ``cache_miss_fallback``:
    tuning is allowed, but a miss falls back to the heuristic, so nothing is ever tuned."""
    return policy.enabled and policy.on_miss == "heuristic" and getattr(policy, "_tuning_asked", False)


NEVER_TUNES_WARNING = (
    "AutotunePolicy(allow_autotune=True) allows tuning, but its cache_miss_fallback is 'heuristics', so a "
    "cache miss runs the heuristic config and nothing is tuned (ejkernel's meaning); to tune on a miss, pass "
    "AutotunePolicy(allow_autotune=True, cache_miss_fallback='autotune')"
)


_policy_init.__doc__ = _dataclass_init.__doc__
AutotunePolicy.__init__ = _policy_init  # type: ignore[method-assign]


_overlays: contextvars.ContextVar[tuple[Any, ...]] = contextvars.ContextVar("ejlabel_overlays", default=())
_policy_fields: contextvars.ContextVar[dict[str, Any]] = contextvars.ContextVar("ejlabel_policy", default={})


@contextlib.contextmanager
def overlay_cache(cache: Any) -> Iterator[Any]:
    """Consult ``cache`` before every selector's own caches inside the block (innermost first)."""
    if not hasattr(cache, "get"):
        raise TypeError(f"cache: expected an object with get(dev, op_id, call_key), got {type(cache).__name__}")
    token = _overlays.set((cache, *_overlays.get()))
    try:
        yield cache
    finally:
        _overlays.reset(token)


_implementation: contextvars.ContextVar[str | None] = contextvars.ContextVar("ejlabel_implementation", default=None)


@contextlib.contextmanager
def use_implementation(name: str) -> Iterator[None]:
    """Run every kernel call traced inside the block on implementation ``name`` where it has one.

    ``with ejlabel.use_implementation("xla"): ...`` puts every call on its plain-JAX path (for
    attention, ``"xla"`` means what ``jax.nn.dot_product_attention`` runs: cuDNN on a GPU, XLA's
    own expression on the CPU). It wins over caches, tuning and ``cfg=``; a kernel without that
    implementation keeps its usual selection. The choice is reported with provenance ``forced``.
    Selection happens at trace time: a function jitted and traced before the block keeps its
    configs.
    """
    if not isinstance(name, str) or not name:
        raise ValueError(f"name: expected an implementation name such as 'xla', got {name!r}")
    token = _implementation.set(name)
    try:
        yield
    finally:
        _implementation.reset(token)


def forced_implementation() -> str | None:
    """The implementation ``use_implementation`` forces here, or None."""
    return _implementation.get()


def active_overlays() -> tuple[Any, ...]:
    return _overlays.get()


_POLICY_FIELDS = {f.name for f in dataclasses.fields(AutotunePolicy)}


_policy_layers: contextvars.ContextVar[tuple[tuple[Any, dict[str, Any]], ...]] = contextvars.ContextVar(
    "ejlabel_policy_layers", default=()
)


@contextlib.contextmanager
def policy_override(selector: Any = None, /, **fields: Any) -> Iterator[None]:
    """Override fields of ``AutotunePolicy`` inside the block.

    ``policy_override(**fields)`` applies to every selector; ejkernel's form
    ``policy_override(selector, **fields)`` applies to that selector only. Either way the
    override is local to the thread or task that enters the block (ejkernel mutates the
    selector's policy for every thread; ejlabel never does). ``autotune=False`` disables
    tuning; ``autotune=True`` enables it and tunes on a miss. Any other keyword must be an
    ``AutotunePolicy`` field or one of ejkernel's names for one (``allow_autotune``,
    ``allow_heuristics``, ``cache_miss_fallback``, ``validate_backward``).
    """
    if selector is not None and not hasattr(selector, "policy"):
        raise TypeError(f"selector: expected a ConfigSelectorChain, got {type(selector).__name__}")
    updates = dict(fields)
    if "autotune" in updates:
        flag = updates.pop("autotune")
        if not isinstance(flag, bool):
            raise TypeError(f"autotune: expected a bool, got {flag!r}")
        updates["enabled"] = flag
        if flag and "cache_miss_fallback" not in updates:
            updates.setdefault("on_miss", "autotune")
    unknown = set(updates) - _POLICY_FIELDS - set(_EJKERNEL_POLICY_NAMES)
    if unknown:
        raise TypeError(
            f"policy_override: unknown field(s) {sorted(unknown)}; expected {sorted(_POLICY_FIELDS)}, "
            f"autotune or one of ejkernel's {list(_EJKERNEL_POLICY_NAMES)}"
        )
    updates = translate_policy_fields(updates)
    dataclasses.replace(AutotunePolicy(), **updates)  # validates the values now, not at first use
    if selector is None:
        token = _policy_fields.set({**_policy_fields.get(), **updates})
        try:
            yield
        finally:
            _policy_fields.reset(token)
    else:
        token = _policy_layers.set((*_policy_layers.get(), (selector, updates)))
        try:
            yield
        finally:
            _policy_layers.reset(token)


def effective_policy(policy: AutotunePolicy, selector: Any = None) -> AutotunePolicy:
    """``policy`` with the active ``policy_override`` fields applied (those of ``selector`` last)."""
    overrides = _policy_fields.get()
    if selector is not None:
        for owner, updates in _policy_layers.get():
            if owner is selector:
                overrides = {**overrides, **updates}
    return dataclasses.replace(policy, **overrides) if overrides else policy
