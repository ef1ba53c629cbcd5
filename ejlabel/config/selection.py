"""Choosing a config for a call, remembering why, and mapping labels back to configs.

``ConfigSelectorChain.select`` tries, in order: the explicit ``cfg=`` (``override``), overlay
caches and the in-memory cache (``memory``), the persistent cache (``persistent``, promoted to
memory on a hit), tuning when the policy allows it (``autotuned``), and the kernel's heuristic
(``heuristic``). The selector remembers every decision it made, so ``labels_to_configs`` on a
program it lowered reports exactly the config and provenance each call ran with.
"""

from __future__ import annotations

import threading
import warnings
from operator import itemgetter
from collections.abc import Callable
from typing import Any, Literal, NamedTuple, Protocol

from ejlabel.config.cache import (
    NEVER_TUNES_WARNING,
    AutotunePolicy,
    ConfigCache,
    active_overlays,
    forced_implementation,
    effective_policy,
    never_tunes,
)
from ejlabel.config.persistent import CacheError, PersistentCache
from ejlabel.core.kernel import Invocation
from ejlabel.core.label_format import forward_op_id, is_backward, parse_label
from ejlabel.core.registry import config_type_problem, learn_config_types, note_config
from ejlabel.core.labels import find_labels_in_lowered
from ejlabel.utils.fingerprint import device_fingerprint

__all__ = ["ConfigSelectorChain", "Selection", "LabelConfig", "labels_to_configs", "Provenance", "TuneHook"]

Provenance = Literal["forced", "override", "memory", "persistent", "autotuned", "heuristic"]
Key = tuple[str, str, str]


class TuneHook(Protocol):
    """What the selector calls on a cache miss when the policy tunes: tune ``inv``, store the
    winner in ``cache`` (and ``persistent`` when given), return the winning config.

    Tuning lives in a layer above this one (:mod:`ejlabel.execution.tuning`), which registers its
    tuner with :func:`set_default_tuner` when it is imported; a selector may also be given its own
    (``ejlabel.Tuner(warmup, iters)``, ejkernel's name, is one).
    """

    def __call__(self, inv: Invocation[Any, Any], *, policy: AutotunePolicy, cache: ConfigCache, persistent: PersistentCache | None) -> Any: ...


_default_tuner: TuneHook | None = None


def set_default_tuner(tuner: TuneHook | None) -> None:
    """The tuner selectors use when they were given none (set by :mod:`ejlabel.execution.tuning`)."""
    global _default_tuner
    _default_tuner = tuner


class Selection(NamedTuple):
    """A chosen config and where it came from."""

    cfg: Any
    provenance: Provenance


class UntunedCallError(LookupError):
    """A cache miss under a policy whose ``on_miss`` is ``"error"``."""


_EVENT_OF = {"forced": "override", "override": "override", "memory": "cache_hit", "persistent": "cache_hit", "heuristic": "heuristics"}


class ConfigSelectorChain:
    """Override → memory → persistent → autotune (if allowed) → heuristic.

    The positional order is ejkernel's: ``ConfigSelectorChain(cache, policy, tuner, persistent,
    persist_autotune, on_event, forbid_reautotune)``; every slot is type-checked, so an argument
    in the wrong slot (a ``PersistentCache`` where the policy goes) is a ``TypeError``, never a
    silent mis-assignment.

    Args:
      cache: the in-memory cache (a fresh ``ConfigCache`` if None).
      policy: what a miss does; ``policy_override`` adjusts it inside a block.
      tuner: what tunes a miss when the policy says so (the library's autotuner if None;
        ``ejlabel.Tuner(warmup, iters)`` sets the run counts).
      persistent: a ``PersistentCache``, or None for none.
      persist_autotune: store tuning winners in ``persistent`` (ejkernel also stores heuristic
        choices there; ejlabel never caches a heuristic, so a later tuning run can improve it).
      on_event: ``on_event(event, **data)`` after each decision, with ejkernel's event names:
        ``override``, ``cache_hit`` (``level="memory"|"persistent"``; overlay hits count as memory),
        ``autotune_start``, ``autotune_finish``, ``heuristics``, ``error``; data holds
        ``device``, ``op_id``, ``call_key`` and ``cfg`` (ejlabel adds ``provenance``).
      forbid_reautotune: raise if a key this selector tuned is asked to be tuned again (only
        possible after its memory cache was cleared).
      autotune: keyword-only shorthand for ``policy=AutotunePolicy(on_miss="autotune")``.
    """

    def __init__(
        self,
        cache: ConfigCache | None = None,
        policy: AutotunePolicy | None = None,
        tuner: TuneHook | None = None,
        persistent: PersistentCache | None = None,
        persist_autotune: bool = True,
        on_event: Callable[..., Any] | None = None,
        forbid_reautotune: bool = True,
        *,
        autotune: bool = False,
    ) -> None:
        if cache is not None and (
            isinstance(cache, (AutotunePolicy, PersistentCache)) or not (hasattr(cache, "get") and hasattr(cache, "put"))
        ):
            raise TypeError(f"cache: expected a ConfigCache, got {type(cache).__name__}")
        if policy is not None and not isinstance(policy, AutotunePolicy):
            raise TypeError(
                f"policy: expected an AutotunePolicy, got {type(policy).__name__} (the positional order is "
                "cache, policy, tuner, persistent, as in ejkernel; pass persistent= by keyword)"
            )
        if tuner is not None and (isinstance(tuner, (AutotunePolicy, PersistentCache, ConfigCache)) or not callable(tuner)):
            raise TypeError(f"tuner: expected an ejlabel.Tuner or a tuning callable, got {type(tuner).__name__}")
        if persistent is not None and (
            isinstance(persistent, (AutotunePolicy, ConfigCache)) or not (hasattr(persistent, "get") and hasattr(persistent, "put"))
        ):
            raise TypeError(f"persistent: expected a PersistentCache, got {type(persistent).__name__}")
        for name, flag in (("persist_autotune", persist_autotune), ("forbid_reautotune", forbid_reautotune), ("autotune", autotune)):
            if not isinstance(flag, bool):
                raise TypeError(f"{name}: expected a bool, got {flag!r}")
        if on_event is not None and not callable(on_event):
            raise TypeError(f"on_event: expected a callable, got {type(on_event).__name__}")
        if policy is None:
            policy = AutotunePolicy(on_miss="autotune" if autotune else "heuristic")
        elif autotune and not policy.tunes_on_miss:
            raise ValueError("autotune=True contradicts the given policy; set policy.on_miss='autotune' instead")
        self.cache = cache if cache is not None else ConfigCache()
        self.persistent = persistent
        self.policy = policy
        self.tuner = tuner
        self.persist_autotune = persist_autotune
        self.on_event = on_event
        self.forbid_reautotune = forbid_reautotune
        self._tuned: set[Key] = set()
        self._said_never_tunes = False
        self._decisions: dict[Key, Selection] = {}
        self._lock = threading.Lock()

    def select(self, inv: Invocation[Any, Any]) -> Selection:
        """Choose the config for ``inv`` and record the decision."""
        key = inv.cache_key
        try:
            selection = self._choose(inv, key)
        except Exception as err:
            if self.on_event is not None:
                self._emit("error", key, reason=str(err))
            raise
        with self._lock:
            self._decisions[key] = selection
        if self.on_event is not None:
            provenance = selection.provenance
            extra = {"level": provenance} if provenance in ("memory", "persistent") else {}
            if provenance != "autotuned":
                self._emit(_EVENT_OF[provenance], key, cfg=selection.cfg, provenance=provenance, **extra)
        return selection

    def choose(self, inv: Invocation[Any, Any], kernel: Any = None) -> Any:
        """ejkernel's name: the config for ``inv`` (``kernel``, if given, must be ``inv.kernel``)."""
        if kernel is not None and kernel is not inv.kernel:
            raise ValueError(f"kernel: {kernel!r} is not the kernel of this invocation ({inv.kernel!r})")
        return self.select(inv).cfg

    def __call__(self, inv: Invocation[Any, Any]) -> Any:
        return self.select(inv).cfg

    def _emit(self, event: str, key: Key, **data: Any) -> None:
        assert self.on_event is not None
        self.on_event(event, device=key[0], op_id=key[1], call_key=key[2], **data)

    def _choose(self, inv: Invocation[Any, Any], key: Key) -> Selection:
        # A kernel class that names no config type learns it here, before the persistent
        # cache is read, so entries another process stored for it decode in this one.
        learn_config_types(inv.kernel, inv)
        forced = forced_implementation()
        if forced is not None:
            cfg = inv.kernel.config_for(inv, forced)
            if cfg is not None:
                return Selection(cfg, "forced")
        if inv.override_cfg is not None:
            note_config(inv.kernel, inv.override_cfg)
            return Selection(inv.override_cfg, "override")
        cached = self.lookup(key)
        if cached is not None:
            return cached
        policy = effective_policy(self.policy, self)
        if policy.tunes_on_miss:
            tuner = self.tuner if self.tuner is not None else _default_tuner
            if tuner is None:
                raise RuntimeError("the policy tunes on a miss but no tuner is registered; import ejlabel")
            if self.forbid_reautotune and key in self._tuned:
                raise RuntimeError(f"re-autotune requested for {key}, which this selector tuned already (forbid_reautotune=True)")
            if self.on_event is not None:
                self._emit("autotune_start", key)
            cfg = tuner(inv, policy=policy, cache=self.cache, persistent=self.persistent if self.persist_autotune else None)
            self._tuned.add(key)
            if self.on_event is not None:
                self._emit("autotune_finish", key, cfg=cfg, provenance="autotuned")
            return Selection(cfg, "autotuned")
        if never_tunes(policy) and not self._said_never_tunes:
            self._said_never_tunes = True
            warnings.warn(NEVER_TUNES_WARNING, UserWarning, stacklevel=5)
        if policy.on_miss == "error" and policy.enabled:
            raise UntunedCallError(
                f"no tuned config for {inv.op_id} call {inv.call_key} on {key[0]} and the policy's "
                "on_miss is 'error'; tune it first (ejlabel tune) or change the policy"
            )
        return Selection(inv.kernel.heuristic_cfg(inv), "heuristic")

    def lookup(self, key: Key) -> Selection | None:
        """The cached config for ``key`` (overlays, memory, then persistent), without tuning."""
        for overlay in active_overlays():
            cfg = overlay.get(*key)
            if cfg is not None:
                return Selection(cfg, "memory")
        cfg = self.cache.get(*key)
        if cfg is not None:
            return Selection(cfg, "memory")
        if self.persistent is not None:
            try:
                cfg = self.persistent.get(*key)
            except CacheError as err:
                warnings.warn(f"persistent cache unavailable, continuing without it: {err}", stacklevel=3)
                cfg = None
            if cfg is not None:
                # The file is data: an entry of another kernel's config type (a NormConfig under a
                # matmul key) is not served; the next source decides, as on a miss.
                problem = config_type_problem(key[1], cfg)
                if problem is not None:
                    warnings.warn(f"persistent cache entry {key} ignored: {problem}", RuntimeWarning, stacklevel=3)
                    return None
                self.cache.put(*key, cfg)
                return Selection(cfg, "persistent")
        return None

    def decision(self, key: Key) -> Selection | None:
        """What this selector chose for ``key`` in this process, if it chose anything."""
        with self._lock:
            return self._decisions.get(key)

    def resolve(self, key: Key) -> Selection | None:
        """The config a call with ``key`` ran (or would run) with, or None if unknown.

        A backward label ``<op>.bwd@vN`` without its own entry resolves to its forward's config,
        which is what the executor's backward pass uses.
        """
        found = self.decision(key) or self.lookup(key)
        if found is None:
            dev, op_id, call_key = key
            if is_backward(op_id):
                return self.resolve((dev, forward_op_id(op_id), call_key))
        return found


class LabelConfig(tuple):
    """``(label, cfg)``, unpacking as a pair, with ``provenance``, ``op_id`` and ``call_key``."""

    label = property(itemgetter(0))
    cfg = property(itemgetter(1))

    def __new__(cls, label: str, cfg: Any, provenance: Provenance | None) -> LabelConfig:
        pair = super().__new__(cls, (label, cfg))
        pair.provenance = provenance
        pair.op_id, pair.call_key = parse_label(label)
        return pair

    def __repr__(self) -> str:
        return f"LabelConfig(label={self[0]!r}, cfg={self[1]!r}, provenance={self.provenance!r})"


_default_selector: Callable[[], ConfigSelectorChain] | None = None


def set_default_selector(get_selector: Callable[[], ConfigSelectorChain] | None) -> None:
    """What ``labels_to_configs(x)`` without a selector consults (the default executor's;
    registered by :mod:`ejlabel.execution.executor`, a layer above this one)."""
    global _default_selector
    _default_selector = get_selector


def labels_to_configs(x: Any, selector: ConfigSelectorChain | None = None, device: str | None = None) -> list[LabelConfig]:
    """For each distinct label in ``x``, the config it maps to (None when nothing is cached).

    ``x`` is anything :func:`find_labels_in_lowered` accepts, a list of labels (its
    result, as ejkernel's docs pass it), or an ``ejlabel.analysis.Program`` (its ``labels``).
    Anything else (``"not a program"``, a number, a list of non-labels) is a TypeError or
    ValueError naming ``x``, never an empty answer. ``selector`` defaults to the
    default executor's (the one ``kernel(*args)`` runs through). ``device`` defaults to the
    fingerprint of this process's default device.
    """
    if selector is None:
        if _default_selector is None:
            raise RuntimeError("labels_to_configs: no selector given and none registered; import ejlabel")
        selector = _default_selector()
    if not isinstance(selector, ConfigSelectorChain):
        raise TypeError(f"selector: expected a ConfigSelectorChain, got {type(selector).__name__}")
    dev = device if device is not None else device_fingerprint()
    pairs = []
    found_labels = _labels_of(x)
    for lab in found_labels:
        op_id, call_key = parse_label(lab)
        found = selector.resolve((dev, op_id, call_key))
        pairs.append(LabelConfig(lab, found.cfg if found else None, found.provenance if found else None))
    return pairs


def _labels_of(x: Any) -> list[str]:
    """The distinct labels ``x`` names: a list of labels as it is, a Program's (duck-typed, so
    this layer never imports the analysis package), else what :func:`find_labels_in_lowered` finds."""
    program_labels = getattr(x, "labels", None)
    if isinstance(program_labels, tuple) and hasattr(x, "descriptions"):
        x = list(program_labels)
    if not isinstance(x, (list, tuple)):
        return find_labels_in_lowered(x)
    for i, item in enumerate(x):
        try:
            parse_label(item)
        except (TypeError, ValueError):
            raise ValueError(
                f"x[{i}]: expected a label '<prefix>#<op>@v<version>:<16 hex>' (x is a list, so it must "
                f"hold labels, as find_labels_in_lowered returns them), got {item!r:.80}"
            ) from None
    return list(dict.fromkeys(x))
