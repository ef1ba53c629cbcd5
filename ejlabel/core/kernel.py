"""``Kernel`` (what a kernel is) and ``Invocation`` (one call of it, abstractly).

A kernel is a class with a frozen config type, one or more implementations, a heuristic config
and a config space to tune over. The executor picks the implementation for the backend it runs
on, in this order of preference:

=======  =======================================================
backend  methods tried, first one the subclass defines wins
=======  =======================================================
gpu      ``run_triton``, ``run_pallas``, ``run_xla``, ``run``
tpu      ``run_pallas``, ``run_xla``, ``run``
cpu      ``run_xla``, ``run``
=======  =======================================================

An ``Invocation`` holds a call's arguments and derives everything the caches need from their
abstract values only: the versioned op id (``matmul@v1``), the 16-hex call key, the device
fingerprint. The config is never part of the key; it is what the key looks up.
"""

from __future__ import annotations

import dataclasses
import enum
import os
import warnings
from collections.abc import Callable, Iterable, Sequence
from typing import Any, ClassVar, Generic, Protocol, TypeVar

import jax
import jax.numpy as jnp
import numpy as np

from ejlabel.core.label_format import check_op_name, check_version, versioned_op
from ejlabel.core.registry import note_kernel_instance, register_kernel
from ejlabel.core.shards import ShardRule
from ejlabel.utils.fingerprint import (
    abstractify,
    default_key_builder_with_sharding,
    device_fingerprint,
    get_device_platform,
    scalar_memo_key,
)
from ejlabel.utils.modules import public_module_name

__all__ = ["Kernel", "Invocation", "Cfg", "Out", "PLATFORM_METHODS", "is_array", "split_kwargs", "abstract_invocation", "random_inputs", "random_values"]

Cfg = TypeVar("Cfg")
Out = TypeVar("Out")

PLATFORM_METHODS: dict[str, tuple[str, ...]] = {
    "gpu": ("run_gpu", "run_triton", "run_pallas", "run_xla", "run"),
    "tpu": ("run_tpu", "run_pallas", "run_xla", "run"),
    "cpu": ("run_cpu", "run_xla", "run"),
    "unknown": ("run_xla", "run"),
}
_ALL_RUN_METHODS = ("run", "run_xla", "run_pallas", "run_triton", "run_gpu", "run_tpu", "run_cpu")
_PLATFORMS = ("gpu", "tpu", "cpu")
# ejkernel's per-platform hooks: ``<hook>_<platform>`` wins over ``<hook>`` on that platform.
_PLATFORM_HOOKS = ("heuristic_cfg", "candidate_cfgs", "fwd_with_residuals", "vjp")
_KNOWN_SUFFIXED = {
    *_ALL_RUN_METHODS,
    *(f"{hook}_{platform}" for hook in _PLATFORM_HOOKS for platform in _PLATFORMS),
}
_HOOK_PREFIXES = ("run_", "heuristic_cfg_", "candidate_cfgs_", "fwd_with_residuals_", "vjp_")


def is_array(x: Any) -> bool:
    """Whether ``x`` is an array-like leaf (concrete, traced or abstract)."""
    return isinstance(x, (jax.Array, np.ndarray, jax.ShapeDtypeStruct, jax.core.Tracer))


class KernelRunner(Protocol):
    """What runs a kernel call: ``runner(kernel, *args, cfg=None, **kwargs)`` (an ``Executor``)."""

    def __call__(self, kernel: Kernel[Any, Any], *args: Any, cfg: Any = None, **kwargs: Any) -> Any: ...


_default_runner: Callable[[], KernelRunner] | None = None


def set_default_runner(get_runner: Callable[[], KernelRunner] | None) -> None:
    """Register what ``kernel(*args)`` runs through (:mod:`ejlabel.execution.executor` does, at import).

    The executor lives in a layer above this one; the kernel knows it only by this interface.
    """
    global _default_runner
    _default_runner = get_runner


class Kernel(Generic[Cfg, Out]):
    """Base class of every kernel: subclass it and define at least one ``run*`` method.

    Subclasses set ``version`` (a class attribute, ``"1"`` by default) when a change makes old
    tuned configs meaningless: it is part of the op id, so the caches never serve a config tuned
    for another version. Optional hooks:

    - ``custom_vjp(primals, cfg, kwargs, cotangents)``: the backward pass, returning one
      cotangent per positional argument; the executor wires it through ``jax.custom_vjp`` and
      labels it ``<op>.bwd@v<version>``.
    - ``make_inputs(inv, key)``: concrete arguments for tuning, for kernels whose inputs must
      satisfy constraints (integer segment ids, positive lengths).
    - ``reference(*args, **kwargs)``: the output tuning checks candidates against.
    - ``prior_configs(inv)``: the candidates expected to beat XLA on this device, tried first.

    ejkernel's hooks are honoured too: ``prepare(*args, **kwargs) -> (args, kwargs)`` (run by
    the executor before the call is keyed), ``candidate_cfgs[_<platform>](inv)`` (the config
    space when defined; the heuristic config is always a candidate as well),
    ``heuristic_cfg_<platform>`` and ``run_<platform>`` (gpu, tpu, cpu: first on their
    platform), ``fwd_with_residuals[_<platform>]`` with ``vjp[_<platform>]`` (the backward, labelled
    like ``custom_vjp``), a class attribute ``op_id`` and, with no op id at all, ejkernel's
    default ``<module>.<ClassName>``. ``key_builder`` is refused (the call key is part of the
    label), and other ``run_*``-style methods (shard_map variants) warn: ejlabel never calls them.
    """

    version: ClassVar[str] = "1"
    key_builder: ClassVar[Any] = None
    #: The implementation that is the kernel's plain path: the expression a JAX user writes,
    #: differentiated by JAX (``"xla"`` for the library's kernels), which the config's ``impl``
    #: field selects unless ``config_for`` says otherwise. Every tuner starts from it (the
    #: *floor*: :meth:`plain_config`). None, the default: the kernel declares no plain path,
    #: its heuristic config is its floor, and ejlabel never writes into its configs.
    plain_implementation: ClassVar[str | None] = None

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        # Registered by name with its config types (from ``Kernel[Cfg, Out]``): data that names
        # a kernel or config resolves through the registry, never by importing (core/registry).
        register_kernel(cls, Kernel)

    def __init__(self, op_id: str | None = None, *, name: str | None = None) -> None:
        if op_id is None and name is None and isinstance(type(self).__dict__.get("op_id", getattr(type(self), "op_id", None)), str):
            op_id = type(self).op_id  # ejkernel's class attribute ``op_id = "..."``
        elif op_id is None and name is None:
            # ejkernel's default op id: the class's module and name (a script's module by its
            # own name, not __main__, so the script and the command line share its entries).
            op_id = f"{public_module_name(type(self).__module__)}.{type(self).__name__}".lstrip("_.")
        op_id = check_op_name(op_id if op_id is not None else name)
        check_version(type(self).version, f"{type(self).__qualname__}.version")
        cls_name = type(self).__qualname__
        plain = type(self).plain_implementation
        if plain is not None and (not isinstance(plain, str) or not plain):
            raise TypeError(f"{cls_name}.plain_implementation: expected None or an implementation name such as 'xla', got {plain!r}")
        if type(self).key_builder is not None:
            raise TypeError(
                f"{cls_name}.key_builder: ejlabel computes the call key itself (it is written into the "
                "label and rebuilt from the program alone), so a custom key builder cannot hold; remove it"
            )
        pairs = [p for p in ("", *(f"_{q}" for q in _PLATFORMS)) if self._defines(f"fwd_with_residuals{p}") != self._defines(f"vjp{p}")]
        if pairs:
            raise TypeError(f"{cls_name}: fwd_with_residuals{pairs[0]} and vjp{pairs[0]} go together; define both or neither")
        if self._defines("custom_vjp") and self._defines_residual_vjp():
            raise TypeError(f"{cls_name}: define either custom_vjp or fwd_with_residuals/vjp, not both")
        if self._defines("candidate_cfgs") and self._defines("config_space"):
            raise TypeError(f"{cls_name}: define either config_space (ejlabel) or candidate_cfgs (ejkernel), not both")
        if not any(self._defines(method) for method in _ALL_RUN_METHODS) and not self._defines_residual_vjp():
            raise TypeError(
                f"{cls_name} defines no run method: define at least one of "
                f"{', '.join(_ALL_RUN_METHODS)} (or fwd_with_residuals with vjp)"
            )
        _warn_unknown_hooks(type(self))
        self.op_id = op_id
        # ejkernel's ``heuristic_cfg_<platform>`` / ``candidate_cfgs_<platform>`` win on their
        # platform: bound here, once, as instance attributes.
        platform = get_device_platform()
        for hook in ("heuristic_cfg", "candidate_cfgs"):
            if self._defines(f"{hook}_{platform}"):
                setattr(self, hook, getattr(self, f"{hook}_{platform}"))
        note_kernel_instance(self)  # op id -> config types, to check configs read from caches

    def _defines_residual_vjp(self) -> bool:
        return any(self._defines(f"fwd_with_residuals{p}") for p in ("", *(f"_{q}" for q in _PLATFORMS)))

    def residual_vjp(self, platform: str) -> tuple[Callable[..., Any], Callable[..., Any]] | None:
        """ejkernel's ``(fwd_with_residuals, vjp)`` pair for ``platform`` (``_<platform>`` first), or None."""
        for suffix in (f"_{platform}", ""):
            if self._defines(f"fwd_with_residuals{suffix}"):
                return getattr(self, f"fwd_with_residuals{suffix}"), getattr(self, f"vjp{suffix}")
        return None

    def prepare(self, *args: Any, **kwargs: Any) -> tuple[tuple[Any, ...], dict[str, Any]]:
        """ejkernel's hook: rewrite ``(args, kwargs)`` before the call is keyed and run."""
        return args, kwargs

    @property
    def versioned_id(self) -> str:
        """``<op_id>@v<version>``: the op id the caches and labels use."""
        return versioned_op(self.op_id, self.version)

    def _defines(self, method: str) -> bool:
        return getattr(type(self), method, None) is not getattr(Kernel, method, None)

    def implementation(self, platform: str) -> Callable[..., Out]:
        """The bound ``run*`` method the executor calls on ``platform``."""
        for method in PLATFORM_METHODS.get(platform, PLATFORM_METHODS["unknown"]):
            if self._defines(method):
                return getattr(self, method)
        pair = self.residual_vjp(platform)
        if pair is not None:  # an ejkernel kernel with only fwd_with_residuals: its output part
            fwd = pair[0]
            return lambda *args, cfg, **kwargs: fwd(*args, cfg=cfg, **kwargs)[0]
        raise NotImplementedError(f"{type(self).__qualname__} has no implementation for platform {platform!r}")

    @property
    def has_custom_vjp(self) -> bool:
        """Whether the kernel has its own backward: ``custom_vjp``, or ejkernel's
        ``fwd_with_residuals`` with ``vjp``."""
        return self._defines("custom_vjp") or self._defines_residual_vjp()

    # The run methods are declared here so that subclasses can override any subset of them.
    def run(self, *args: Any, cfg: Cfg, **kwargs: Any) -> Out:
        raise NotImplementedError

    def run_xla(self, *args: Any, cfg: Cfg, **kwargs: Any) -> Out:
        raise NotImplementedError

    def run_pallas(self, *args: Any, cfg: Cfg, **kwargs: Any) -> Out:
        raise NotImplementedError

    def run_triton(self, *args: Any, cfg: Cfg, **kwargs: Any) -> Out:
        raise NotImplementedError

    def custom_vjp(self, primals: tuple[Any, ...], cfg: Cfg, kwargs: dict[str, Any], cotangents: tuple[Any, ...]) -> Sequence[Any]:
        raise NotImplementedError

    def heuristic_cfg(self, inv: Invocation[Cfg, Out]) -> Cfg:
        """The config used when nothing is cached and tuning is off."""
        raise NotImplementedError(f"{type(self).__qualname__} defines no heuristic_cfg")

    def config_space(self, inv: Invocation[Cfg, Out]) -> Iterable[Cfg]:
        """Candidate configs for tuning: ejkernel's ``candidate_cfgs[_<platform>]`` when the
        kernel defines it, else only the heuristic one."""
        candidates = getattr(self, "candidate_cfgs", None)
        if candidates is not None and (self._defines("candidate_cfgs") or "candidate_cfgs" in self.__dict__):
            return list(candidates(inv))
        return [self.heuristic_cfg(inv)]

    def prior_configs(self, inv: Invocation[Cfg, Out]) -> Sequence[Cfg]:
        """The candidates this kernel expects can beat its XLA path for ``inv`` on this device.

        The tuners try them first (tuning in context ranks and confirms them before the rest of
        the config space), so a tight budget is spent where a gain was seen before. Empty by
        default: no prior, the config space in its own order.
        """
        return ()

    def make_inputs(self, inv: Invocation[Cfg, Out], key: jax.Array) -> tuple[tuple[Any, ...], dict[str, Any]]:
        """Concrete ``(args, kwargs)`` for tuning: random normal floats, random integers."""
        return random_inputs(inv, key)

    def candidate_is_valid(self, inv: Invocation[Cfg, Out], cfg: Cfg) -> bool:
        """Whether ``cfg`` may be tried on ``inv`` (shape divisibility, backend support)."""
        return True

    def config_for(self, inv: Invocation[Cfg, Out], implementation: str) -> Cfg | None:
        """A config of ``inv`` that runs ``implementation`` (e.g. ``"xla"``), or None if the
        kernel has no such implementation for this call (what ``use_implementation`` forces).

        By default, for a kernel that declares :attr:`plain_implementation`: the heuristic
        config with its ``impl`` field set to ``implementation``, when the config is a dataclass
        with such a field and accepts the value. A kernel that declares none gets None: a field's
        name alone never makes ejlabel write into a user's config.
        """
        if type(self).plain_implementation is None:
            return None
        cfg = self.heuristic_cfg(inv)
        if not dataclasses.is_dataclass(cfg) or "impl" not in {f.name for f in dataclasses.fields(cfg)}:
            return None
        if getattr(cfg, "impl") == implementation:
            return cfg
        try:
            return dataclasses.replace(cfg, impl=implementation)
        except (TypeError, ValueError):
            return None

    def plain_config(self, inv: Invocation[Cfg, Out]) -> Cfg | None:
        """The config of the kernel's declared plain path for ``inv``
        (``config_for(inv, plain_implementation)``), or None when it declares none or has none
        for this call: then the floor is the heuristic config."""
        name = type(self).plain_implementation
        return None if name is None else self.config_for(inv, name)

    def differentiated_by_jax(self, cfg: Cfg) -> bool:
        """Whether ``cfg`` selects an implementation that is plain JAX, differentiated by JAX.

        Then the executor runs it as it is, without wrapping ``custom_vjp`` around it, so the
        compiled program is exactly the one the plain expression gives (labels are metadata).
        False by default: a kernel with a ``custom_vjp`` hook gets its own backward.
        """
        return False

    def partitioned_by_xla(self, cfg: Cfg) -> bool:
        """Whether XLA's partitioner splits ``cfg``'s path by itself (plain JAX ops), so that a
        split call runs whole and the program stays the plain one. By default the paths JAX
        differentiates itself; a vendor call that JAX partitions only in some modes (cuDNN
        attention, on explicit mesh axes) answers False and runs per shard."""
        return self.differentiated_by_jax(cfg)

    def shard_rule(self, inv: Invocation[Cfg, Out]) -> ShardRule | None:
        """Which dimensions of ``inv``'s arrays may be split across devices, or None.

        With a rule, a call whose arguments are split over explicit mesh axes runs once per
        shard under ``jax.shard_map`` whenever its config selects a path that XLA does not
        partition itself (:meth:`partitioned_by_xla`; a Pallas kernel is opaque to XLA's
        partitioner, which would gather its inputs); the label, key and config are the
        per-shard call's (:mod:`ejlabel.core.shards`).
        None by default: the call runs whole, as XLA partitions it.
        """
        return None

    def __call__(self, *args: Any, cfg: Cfg | None = None, **kwargs: Any) -> Out:
        """Run through the default executor (memory cache, persistent cache, heuristic)."""
        if _default_runner is None:
            raise RuntimeError("no executor is registered to run kernels; import ejlabel")
        return _default_runner()(self, *args, cfg=cfg, **kwargs)

    def __repr__(self) -> str:
        return f"{type(self).__qualname__}({self.versioned_id!r})"


_warned_classes: set[type] = set()


def _warn_unknown_hooks(cls: type) -> None:
    """Warn once per class about ``run_*``-style methods ejlabel will never call."""
    if cls in _warned_classes:
        return
    _warned_classes.add(cls)
    unknown = sorted(
        name
        for klass in cls.__mro__
        if klass is not Kernel and klass is not object
        for name in vars(klass)
        if name.startswith(_HOOK_PREFIXES) and name not in _KNOWN_SUFFIXED and callable(vars(klass)[name])
    )
    if unknown:
        warnings.warn(
            f"{cls.__qualname__} defines {unknown}, which ejlabel never calls (it dispatches run_<platform>, "
            "run_triton/run_pallas/run_xla/run and <hook>_<platform> for gpu/tpu/cpu; shard_map variants and "
            "create_shard_map_wrapper are not supported)",
            RuntimeWarning,
            stacklevel=4,
        )


class _cached_property:
    """``functools.cached_property`` without its per-access lock (Python < 3.12 takes one).

    Every kernel call builds a fresh ``Invocation`` and reads ``call_key`` and
    ``device_fingerprint`` once, so the first access is the common one. The values are pure
    functions of the invocation; two threads computing one at once store equal values.
    """

    def __init__(self, func: Callable[[Any], Any]) -> None:
        self.func = func
        self.attrname = func.__name__
        self.__doc__ = func.__doc__

    def __set_name__(self, owner: type, name: str) -> None:
        self.attrname = name

    def __get__(self, instance: Any, owner: type | None = None) -> Any:
        if instance is None:
            return self
        value = instance.__dict__[self.attrname] = self.func(instance)
        return value


class _NoSignature(Exception):
    """A value whose abstract signature is not cheap and exact to state; fingerprint it fully."""


_IMMUTABLE_SCALARS = (type(None), bool, int, float, complex, str, bytes, np.dtype, enum.Enum)


def _signature(value: Any) -> Any:
    """A hashable stand-in for ``value`` that is equal exactly when its fingerprint is.

    Arrays by abstract value (the sharding object itself: equal shardings fingerprint alike),
    immutable scalars and frozen dataclasses tagged with their type (so ``1``, ``1.0`` and
    ``True`` stay apart), tuples of those. Anything else (functions, whose closures may change;
    lists; dicts) has no signature, and the call key is computed in full.
    """
    if isinstance(value, jax.core.Tracer):
        aval = value.aval
        return ("tracer", aval.shape, aval.dtype, aval.weak_type)
    if isinstance(value, (jax.Array, jax.ShapeDtypeStruct)):
        return ("array", value.shape, value.dtype, bool(getattr(value, "weak_type", False)), value.sharding)
    if isinstance(value, np.ndarray):
        return ("ndarray", value.shape, value.dtype)
    if isinstance(value, _IMMUTABLE_SCALARS) or (isinstance(value, type) and issubclass(value, np.generic)):
        # Not (type, value): 0.0 == -0.0 would share one memo entry, whichever came first.
        return scalar_memo_key(value)
    if type(value) is tuple:
        return ("tuple", *map(_signature, value))
    if dataclasses.is_dataclass(value) and not isinstance(value, type) and type(value).__dataclass_params__.frozen:
        return (type(value), tuple(_signature(getattr(value, f.name)) for f in dataclasses.fields(value)))
    raise _NoSignature


_KEY_MEMO: dict[Any, str] = {}
_KEY_MEMO_LIMIT = 8192


def _memoised_call_key(inv: Invocation[Any, Any]) -> str:
    """``default_key_builder_with_sharding(inv)``, memoised on the call's cheap signature."""
    try:
        kernel, kwargs, batch_axes = inv.kernel, inv.kwargs, inv.batch_axes
        memo_key = (
            type(kernel),
            kernel.versioned_id,
            os.environ.get("EJLABEL_CACHE_SALT"),
            tuple(map(_signature, inv.args)),
            tuple((name, _signature(value)) for name, value in kwargs.items()) if kwargs else (),
            None if batch_axes is None else _signature(batch_axes),  # _signature never returns None
        )
        key = _KEY_MEMO.get(memo_key)  # TypeError: an unhashable part
    except (_NoSignature, TypeError):
        return default_key_builder_with_sharding(inv)
    if key is None:
        if len(_KEY_MEMO) >= _KEY_MEMO_LIMIT:
            _KEY_MEMO.clear()
        key = _KEY_MEMO[memo_key] = default_key_builder_with_sharding(inv)
    return key


def split_kwargs(kwargs: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """Split keyword arguments into (array-valued, static)."""
    arrays, static = {}, {}
    for name, value in kwargs.items():
        leaves = jax.tree_util.tree_leaves(value)
        (arrays if leaves and all(is_array(leaf) for leaf in leaves) else static)[name] = value
    return arrays, static


@dataclasses.dataclass(eq=False)
class Invocation(Generic[Cfg, Out]):
    """One call of a kernel: its arguments, described by abstract values for the caches.

    Attributes:
      kernel: the kernel being called.
      args: positional arguments (arrays, tracers, ``ShapeDtypeStruct``\\ s or pytrees of them).
      kwargs: keyword arguments; array-valued ones are inputs, the rest are static options.
      batch_axes: how the call is mapped, part of the key: ``("vmap", levels)`` for a call traced
        under ``jax.vmap`` (:mod:`ejlabel.core.vmapped`; ``args`` are then one example),
        ``pmap_with_config``'s ``("pmap", ...)``, or None.
      override_cfg: an explicit config (``cfg=`` at the call), which skips every cache.
    """

    kernel: Kernel[Cfg, Out]
    args: tuple[Any, ...]
    kwargs: dict[str, Any] = dataclasses.field(default_factory=dict)
    batch_axes: Any = None
    override_cfg: Cfg | None = None
    known_call_key: str | None = dataclasses.field(default=None, repr=False)
    metadata: dict[str, Any] = dataclasses.field(default_factory=dict, repr=False)

    def __post_init__(self) -> None:
        if not isinstance(self.kernel, Kernel):
            raise TypeError(f"kernel: expected a Kernel instance, got {type(self.kernel).__name__}")
        self.args = tuple(self.args)
        self.kwargs = dict(self.kwargs)

    @property
    def op_id(self) -> str:
        """The versioned op id, ``<name>@v<version>``."""
        return self.kernel.versioned_id

    @property
    def kernel_version(self) -> str:
        return self.kernel.version

    @_cached_property
    def abstract_args(self) -> tuple[Any, ...]:
        return abstractify(self.args)

    @_cached_property
    def abstract_kwargs(self) -> dict[str, Any]:
        return abstractify(self.kwargs)

    @_cached_property
    def array_kwargs(self) -> dict[str, Any]:
        return split_kwargs(self.kwargs)[0]

    @_cached_property
    def static_kwargs(self) -> dict[str, Any]:
        return split_kwargs(self.kwargs)[1]

    @_cached_property
    def call_key(self) -> str:
        """16-hex fingerprint of op id, version, abstract args, sharding, static kwargs, batch axes."""
        if self.known_call_key is not None:
            return self.known_call_key
        return _memoised_call_key(self)

    @_cached_property
    def device_fingerprint(self) -> str:
        return device_fingerprint()

    def make_key(self, key_builder: Callable[[Invocation[Cfg, Out]], str] | None = None) -> str:
        """ejkernel's name: the call key (``key_builder``, if given, must give ejlabel's key)."""
        if key_builder is None or key_builder is default_key_builder_with_sharding:
            return self.call_key
        raise TypeError("make_key: ejlabel's call key is fixed (it is part of the label); custom key builders are not supported")

    @property
    def cache_key(self) -> tuple[str, str, str]:
        """``(device_fingerprint, op_id, call_key)``, the key of every config cache."""
        return (self.device_fingerprint, self.op_id, self.call_key)


# Recording and offline tuning keep calls as ShapeDtypeStruct specs (never the arrays, so a
# recorded training run keeps no activations alive); tuning makes random inputs of those specs.


def abstract_invocation(inv: Invocation[Any, Any]) -> Invocation[Any, Any]:
    """A copy of ``inv`` whose array arguments are ``ShapeDtypeStruct``\\ s, same call key."""
    to_spec = lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, weak_type=getattr(getattr(x, "aval", x), "weak_type", False)) if hasattr(x, "shape") and hasattr(x, "dtype") else x
    return Invocation(
        inv.kernel,
        jax.tree_util.tree_map(to_spec, inv.args),
        jax.tree_util.tree_map(to_spec, inv.kwargs),
        batch_axes=inv.batch_axes,
        known_call_key=inv.call_key,
    )


def random_inputs(inv: Invocation[Any, Any], key: jax.Array) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """Concrete arguments for ``inv``: standard normal floats, small non-negative integers."""
    seed = int(jax.random.randint(key, (), 0, 2**31 - 1)) if isinstance(key, jax.Array) else int(key)
    rng = np.random.default_rng(seed)
    spec = abstract_invocation(inv)
    return random_values(spec.args, rng), random_values(spec.kwargs, rng)


def random_values(tree: Any, rng: np.random.Generator) -> Any:
    """``tree`` with every ``ShapeDtypeStruct`` leaf replaced by random values of its spec:
    standard normal floats, integers in [0, 8), random booleans; other leaves stay."""

    def make(leaf: Any) -> Any:
        if not isinstance(leaf, jax.ShapeDtypeStruct):
            return leaf
        dtype = np.dtype(leaf.dtype)
        if jnp.issubdtype(dtype, jnp.inexact):  # jnp's issubdtype: it knows bfloat16
            value = rng.standard_normal(leaf.shape, dtype=np.float32)
        elif dtype == np.bool_:
            value = rng.integers(0, 2, leaf.shape).astype(bool)
        else:
            value = rng.integers(0, 8, leaf.shape)
        return jnp.asarray(value, dtype=dtype)

    return jax.tree_util.tree_map(make, tree)
