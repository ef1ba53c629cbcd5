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
from typing import Any, Literal, NamedTuple, Protocol

from ejlabel.config.cache import (
    AutotunePolicy,
    ConfigCache,
    active_overlays,
    forced_implementation,
    effective_policy,
)
from ejlabel.config.persistent import CacheError, PersistentCache
from ejlabel.core.kernel import Invocation
from ejlabel.core.label_format import forward_op_id, is_backward, parse_label
from ejlabel.core.registry import config_type_problem
from ejlabel.core.labels import find_labels_in_lowered
from ejlabel.utils.fingerprint import device_fingerprint

__all__ = ["ConfigSelectorChain", "Selection", "LabelConfig", "labels_to_configs", "Provenance", "Tuner"]

Provenance = Literal["forced", "override", "memory", "persistent", "autotuned", "heuristic"]
Key = tuple[str, str, str]


class Tuner(Protocol):
    """What the selector calls on a cache miss when the policy tunes: tune ``inv``, store the
    winner in ``cache`` (and ``persistent`` when given), return the winning config.

    Tuning lives in a layer above this one (:mod:`ejlabel.execution.tuning`), which registers its
    tuner with :func:`set_default_tuner` when it is imported; a selector may also be given its own.
    """

    def __call__(self, inv: Invocation[Any, Any], *, policy: AutotunePolicy, cache: ConfigCache, persistent: PersistentCache | None) -> Any: ...


_default_tuner: Tuner | None = None


def set_default_tuner(tuner: Tuner | None) -> None:
    """The tuner selectors use when they were given none (set by :mod:`ejlabel.execution.tuning`)."""
    global _default_tuner
    _default_tuner = tuner


class Selection(NamedTuple):
    """A chosen config and where it came from."""

    cfg: Any
    provenance: Provenance


class UntunedCallError(LookupError):
    """A cache miss under a policy whose ``on_miss`` is ``"error"``."""


class ConfigSelectorChain:
    """Override → memory → persistent → autotune (if allowed) → heuristic.

    Args:
      cache: the in-memory cache (a fresh ``ConfigCache`` if None).
      persistent: a ``PersistentCache``, or None for none.
      autotune: shorthand for ``policy=AutotunePolicy(on_miss="autotune")``.
      policy: what a miss does; ``policy_override`` adjusts it inside a block.
      tuner: what tunes a miss when the policy says so (the library's autotuner if None).
    """

    def __init__(
        self,
        cache: ConfigCache | None = None,
        persistent: PersistentCache | None = None,
        autotune: bool = False,
        policy: AutotunePolicy | None = None,
        tuner: Tuner | None = None,
    ) -> None:
        if policy is None:
            policy = AutotunePolicy(on_miss="autotune" if autotune else "heuristic")
        elif autotune and not policy.tunes_on_miss:
            raise ValueError("autotune=True contradicts the given policy; set policy.on_miss='autotune' instead")
        self.cache = cache if cache is not None else ConfigCache()
        self.persistent = persistent
        self.policy = policy
        self.tuner = tuner
        self._decisions: dict[Key, Selection] = {}
        self._lock = threading.Lock()

    def select(self, inv: Invocation[Any, Any]) -> Selection:
        """Choose the config for ``inv`` and record the decision."""
        key = inv.cache_key
        selection = self._choose(inv, key)
        with self._lock:
            self._decisions[key] = selection
        return selection

    def __call__(self, inv: Invocation[Any, Any]) -> Any:
        return self.select(inv).cfg

    def _choose(self, inv: Invocation[Any, Any], key: Key) -> Selection:
        forced = forced_implementation()
        if forced is not None:
            cfg = inv.kernel.config_for(inv, forced)
            if cfg is not None:
                return Selection(cfg, "forced")
        if inv.override_cfg is not None:
            return Selection(inv.override_cfg, "override")
        cached = self.lookup(key)
        if cached is not None:
            return cached
        policy = effective_policy(self.policy)
        if policy.tunes_on_miss:
            tuner = self.tuner if self.tuner is not None else _default_tuner
            if tuner is None:
                raise RuntimeError("the policy tunes on a miss but no tuner is registered; import ejlabel")
            return Selection(tuner(inv, policy=policy, cache=self.cache, persistent=self.persistent), "autotuned")
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


def labels_to_configs(x: Any, selector: ConfigSelectorChain, device: str | None = None) -> list[LabelConfig]:
    """For each distinct label in ``x``, the config it maps to (None when nothing is cached).

    ``x`` is anything :func:`find_labels_in_lowered` accepts. ``device`` defaults to the
    fingerprint of this process's default device.
    """
    if not isinstance(selector, ConfigSelectorChain):
        raise TypeError(f"selector: expected a ConfigSelectorChain, got {type(selector).__name__}")
    dev = device if device is not None else device_fingerprint()
    pairs = []
    for lab in find_labels_in_lowered(x):
        op_id, call_key = parse_label(lab)
        found = selector.resolve((dev, op_id, call_key))
        pairs.append(LabelConfig(lab, found.cfg if found else None, found.provenance if found else None))
    return pairs
