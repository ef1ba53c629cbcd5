"""``Executor``: choose a config for a call, label the call's region, run it.

Selection happens in Python at trace time, so under ``jax.jit`` it costs nothing at run time;
the label is written as frontend attributes on every op of the call (and, for kernels with a
custom VJP, on every op of the backward pass, under ``<op>.bwd@v<version>``). A path that JAX
differentiates itself (``Kernel.differentiated_by_jax``) runs without a custom VJP: the program
is then exactly the plain one, and JAX carries the label onto the transposed ops. The encoded
call description goes only onto the first site of each call key in a traced function. A call
traced under ``jax.vmap`` is keyed and described with its batch axes (:mod:`ejlabel.core.vmapped`).
A call whose kernel has a shard rule and whose arguments are split over explicit mesh axes is
keyed as the call each device runs, and runs per shard (:mod:`ejlabel.core.shards`, :meth:`Executor.run_split`).
"""

from __future__ import annotations

import inspect
import threading
import weakref
from typing import Any, Generic

import jax
from jax._src import core as jax_core  # the current trace: no public API names it

from ejlabel.config.persistent import open_default_persistent
from ejlabel.config.selection import ConfigSelectorChain, set_default_selector
from ejlabel.core.calls import encode_call
from ejlabel.core.kernel import Cfg, Invocation, Kernel, Out, is_array, set_default_runner
from ejlabel.core.label_format import backward_op_id
from ejlabel.core.labels import label, label_scope
from ejlabel.core.shards import Split, plan_split
from ejlabel.core.vmapped import traced_batch_axes
from ejlabel.execution.recording import maybe_record
from ejlabel.utils.fingerprint import get_device_platform

__all__ = ["Executor", "get_default_executor", "per_shard_invocation", "set_default_executor", "split_of"]


# ejkernel's executor keywords that ejlabel cannot honour: its shard_map dispatch.
_SHARD_MAP_KEYWORDS = ("method", "mesh", "in_specs", "out_specs", "check_vma")


class Executor(Generic[Cfg, Out]):
    """Runs kernels with configs chosen by ``selector``.

    ``executor(kernel, *args, cfg=None, **kwargs)`` works eagerly and inside ``jax.jit``;
    ``cfg=`` forces a config (provenance ``override``). ejkernel's forms are accepted:
    ``Executor(chooser, stamp_prefix=...)``, ``_cfg=`` for ``cfg=``, ``stamp=True``,
    ``choose_config``, ``compile`` and ``Executor[Cfg, Out]``; ``kernel.prepare(*args,
    **kwargs)`` rewrites the arguments first. What cannot hold is refused, never ignored:
    ``stamp=False`` (ejlabel always writes the label: it is what the tools read),
    ``stamp_prefix`` other than the label prefix in use, and ejkernel's shard_map keywords
    ``method``, ``mesh``, ``in_specs``, ``out_specs``, ``check_vma`` (unless the kernel's run
    method itself takes that keyword).
    """

    def __init__(self, selector: ConfigSelectorChain | None = None, stamp_prefix: str | None = None) -> None:
        if selector is not None and not isinstance(selector, ConfigSelectorChain):
            raise TypeError(
                f"selector: expected a ConfigSelectorChain, got {type(selector).__name__} (ejlabel's executor needs "
                "the selector's provenance records for labels_to_configs; other ConfigChooser objects are not supported)"
            )
        if stamp_prefix is not None:
            prefix = stamp_prefix if stamp_prefix.endswith("#") else stamp_prefix + "#"
            if label("x@v1", "0" * 16).split("x@v1")[0] != prefix:
                raise ValueError(
                    f"stamp_prefix={stamp_prefix!r}: ejlabel writes labels with the prefix of ejlabel.label "
                    "(ejkernel_ops#, or $EJLABEL_PREFIX); set EJLABEL_PREFIX to change it for every reader"
                )
        self.selector = selector if selector is not None else ConfigSelectorChain()

    @property
    def chooser(self) -> ConfigSelectorChain:
        """ejkernel's name for ``selector``."""
        return self.selector

    def _invocation(self, kernel: Kernel[Any, Any], args: tuple[Any, ...], cfg: Any, kwargs: dict[str, Any]) -> Invocation[Any, Any]:
        if not isinstance(kernel, Kernel):
            raise TypeError(f"kernel: expected a Kernel instance, got {type(kernel).__name__}")
        if "_cfg" in kwargs:
            override = kwargs.pop("_cfg")
            if cfg is not None and override is not None:
                raise TypeError("give either cfg= or _cfg= (the same override), not both")
            cfg = override if override is not None else cfg
        if "stamp" in kwargs and not _takes_keyword(kernel, "stamp"):
            if kwargs.pop("stamp") is not True:
                raise ValueError("stamp=False: ejlabel always labels kernel calls (the label is what its tools read)")
        refused = [name for name in _SHARD_MAP_KEYWORDS if name in kwargs and not _takes_keyword(kernel, name)]
        if refused:
            raise TypeError(
                f"{refused}: ejkernel's shard_map dispatch (run_shard_map*, create_shard_map_wrapper) is not "
                "implemented by ejlabel; wrap the executor call in jax.shard_map yourself"
            )
        prepared = kernel.prepare(*args, **kwargs)
        try:
            args, kwargs = prepared
            args, kwargs = tuple(args), dict(kwargs)
        except (TypeError, ValueError):
            raise TypeError(f"{type(kernel).__qualname__}.prepare must return (args, kwargs), got {prepared!r}") from None
        inv = Invocation(kernel, args, kwargs, override_cfg=cfg)
        # Under jax.vmap the arguments are one example; the call the program runs is batched,
        # and is keyed, described and tuned as such (core/vmapped).
        inv.batch_axes = traced_batch_axes(inv.args, inv.array_kwargs)
        return inv

    def __call__(self, kernel: Kernel[Any, Any], *args: Any, cfg: Any = None, **kwargs: Any) -> Any:
        inv = self._invocation(kernel, args, cfg, kwargs)
        split = split_of(inv)
        return self.run_invocation(inv) if split is None else self.run_split(inv, split)

    def run_invocation(self, inv: Invocation[Any, Any]) -> Any:
        """Select a config for ``inv``, then run it labelled."""
        selection = self.selector.select(inv)
        maybe_record(inv)
        return run_labelled(inv, selection.cfg)

    def run_split(self, inv: Invocation[Any, Any], split: Split) -> Any:
        """Run ``inv`` as ``split`` says: each device its shard, keyed and labelled as the
        per-shard call; a path XLA partitions itself runs whole (the program stays the plain one)."""
        local = per_shard_invocation(inv, split)
        cfg = self.selector.select(local).cfg
        maybe_record(local)
        if inv.kernel.partitioned_by_xla(cfg):
            return run_labelled(inv, cfg, identity=local)
        arg_at = [i for i, spec in enumerate(split.arg_specs) if spec is not None]
        kwarg_names = list(split.kwarg_specs)
        in_specs = tuple(split.arg_specs[i] for i in arg_at) + tuple(split.kwarg_specs[n] for n in kwarg_names)
        leaves = [inv.args[i] for i in arg_at] + [inv.kwargs[n] for n in kwarg_names]
        # Arguments split otherwise than the shards need (an FSDP weight the kernel needs whole)
        # are resharded first, as XLA would gather them for a plain expression of the call.
        leaves = [jax.sharding.reshard(x, jax.sharding.NamedSharding(split.mesh, spec)) for x, spec in zip(leaves, in_specs)]

        def per_shard(*shards: Any) -> Any:
            args = list(inv.args)
            for i, shard in zip(arg_at, shards):
                args[i] = shard
            kwargs = dict(split.local_kwargs)
            kwargs.update(zip(kwarg_names, shards[len(arg_at):]))
            out = run_labelled(Invocation(inv.kernel, tuple(args), kwargs), cfg, identity=local)
            return out[None] if split.summed else out  # a part of a sum: stacked, then added up

        # check_vma off: a Pallas call states no replication; the rule says what is split.
        out = jax.shard_map(per_shard, mesh=split.mesh, in_specs=in_specs, out_specs=split.out_specs, check_vma=False)(*leaves)
        if split.summed:
            out = jax.numpy.sum(out, axis=0)
        return out if split.finish is None else split.finish(out)

    def choose_config(self, kernel: Kernel[Any, Any], *args: Any, cfg: Any = None, **kwargs: Any) -> Any:
        """The config a call with these arguments gets, without running it (ejkernel's name);
        for a split call, the per-shard call's, as running it would choose."""
        inv = self._invocation(kernel, args, cfg, kwargs)
        split = split_of(inv)
        return self.selector.select(inv if split is None else per_shard_invocation(inv, split)).cfg

    def compile(self, kernel: Kernel[Any, Any], *example_args: Any, cfg: Any = None, **example_kwargs: Any) -> Any:
        """A jitted function running ``kernel`` with the config chosen for the example call.

        Unlike ejkernel's (which runs ``kernel.run`` bare), the call stays labelled, custom
        backward included, and keyed like the example call.
        """
        inv = self._invocation(kernel, example_args, cfg, dict(example_kwargs))
        chosen = self.selector.select(inv).cfg

        def run(*args: Any, **kwargs: Any) -> Any:
            return run_labelled(Invocation(kernel, args, kwargs), chosen)

        return jax.jit(run)


def split_of(inv: Invocation[Any, Any]) -> Split | None:
    """How ``inv`` splits over devices (its kernel's rule, its arguments' shardings), or None."""
    rule = inv.kernel.shard_rule(inv) if inv.batch_axes is None else None
    return None if rule is None else plan_split(rule, inv.args, inv.kwargs)


def per_shard_invocation(inv: Invocation[Any, Any], split: Split) -> Invocation[Any, Any]:
    """The call one device runs under ``split``: keyed, described and tuned as such."""
    return Invocation(inv.kernel, split.local_args, split.local_kwargs, override_cfg=inv.override_cfg, metadata={"shardings": split.shardings})


_takes_cache: dict[tuple[type, str], bool] = {}


def _takes_keyword(kernel: Kernel[Any, Any], name: str) -> bool:
    """Whether the kernel's implementation names keyword ``name`` (then it is the kernel's own)."""
    key = (type(kernel), name)
    if key not in _takes_cache:
        try:
            params = inspect.signature(kernel.implementation(get_device_platform())).parameters
            _takes_cache[key] = name in params
        except (TypeError, ValueError, NotImplementedError):
            _takes_cache[key] = False
    return _takes_cache[key]


def run_labelled(inv: Invocation[Any, Any], cfg: Any, identity: Invocation[Any, Any] | None = None) -> Any:
    """Run ``inv`` with ``cfg``, its forward (and backward) ops carrying their labels.

    ``identity``: the call the label, key and description name, when it is not ``inv`` itself
    (a per-shard call, run on each shard or whole).
    """
    kernel = inv.kernel
    identity = inv if identity is None else identity
    call_key = identity.call_key
    forward_label = label(identity.op_id, call_key)
    description = encode_call(identity) if _first_in_trace(identity) else None
    impl = kernel.implementation(get_device_platform())
    if not kernel.has_custom_vjp or kernel.differentiated_by_jax(cfg):
        with label_scope(forward_label, description):
            return impl(*inv.args, cfg=cfg, **inv.kwargs)

    backward_label = label(backward_op_id(identity.op_id), call_key)
    static_kwargs = inv.static_kwargs
    pair = kernel.residual_vjp(get_device_platform())
    if pair is not None:
        return _run_residual_vjp(inv, cfg, impl, pair, forward_label, backward_label, description)

    @jax.custom_vjp
    def call(args: tuple[Any, ...], array_kwargs: dict[str, Any]) -> Any:
        with label_scope(forward_label, description):
            return impl(*args, cfg=cfg, **array_kwargs, **static_kwargs)

    def call_fwd(args: tuple[Any, ...], array_kwargs: dict[str, Any]) -> tuple[Any, Any]:
        return call(args, array_kwargs), (args, array_kwargs)

    def call_bwd(saved: tuple[Any, Any], cotangent: Any) -> tuple[Any, Any]:
        args, array_kwargs = saved
        with label_scope(backward_label):  # the forward's description covers it: same call key
            grads = kernel.custom_vjp(args, cfg, {**array_kwargs, **static_kwargs}, tuple(jax.tree_util.tree_leaves(cotangent)))
        grads = tuple(grads)
        if len(grads) != len(args):
            raise ValueError(
                f"{type(kernel).__qualname__}.custom_vjp returned {len(grads)} cotangents for {len(args)} positional arguments"
            )
        return tuple(_cotangent_for(arg, g) for arg, g in zip(args, grads)), jax.tree_util.tree_map(lambda _: None, array_kwargs)

    call.defvjp(call_fwd, call_bwd)
    return call(inv.args, inv.array_kwargs)


def _run_residual_vjp(
    inv: Invocation[Any, Any], cfg: Any, impl: Any, pair: Any, forward_label: str, backward_label: str, description: Any
) -> Any:
    """ejkernel's ``fwd_with_residuals(*args, cfg, **kw) -> (y, res)`` and
    ``vjp(res, y, dy, *args, cfg, **kw) -> grads`` wired through ``jax.custom_vjp``, labelled.
    A forward that is not differentiated runs ``impl`` (the kernel's run method where it has
    one): it need not compute residuals no backward will read."""
    fwd, vjp = pair
    kernel, static_kwargs = inv.kernel, inv.static_kwargs

    def forward(args: tuple[Any, ...], array_kwargs: dict[str, Any]) -> tuple[Any, Any]:
        with label_scope(forward_label, description):
            return fwd(*args, cfg=cfg, **array_kwargs, **static_kwargs)

    @jax.custom_vjp
    def call(args: tuple[Any, ...], array_kwargs: dict[str, Any]) -> Any:
        with label_scope(forward_label, description):
            return impl(*args, cfg=cfg, **array_kwargs, **static_kwargs)

    def call_fwd(args: tuple[Any, ...], array_kwargs: dict[str, Any]) -> tuple[Any, Any]:
        y, res = forward(args, array_kwargs)
        return y, (res, y, args, array_kwargs)

    def call_bwd(saved: Any, dy: Any) -> tuple[Any, Any]:
        res, y, args, array_kwargs = saved
        with label_scope(backward_label):
            grads = vjp(res, y, dy, *args, cfg=cfg, **array_kwargs, **static_kwargs)
        if isinstance(grads, dict):
            raise TypeError(f"{type(kernel).__qualname__}.vjp must return a tuple of grads for the positional arguments")
        grads = tuple(grads)
        if len(grads) != len(args):
            raise ValueError(f"{type(kernel).__qualname__}.vjp returned {len(grads)} cotangents for {len(args)} positional arguments")
        return tuple(_cotangent_for(a, g) for a, g in zip(args, grads)), jax.tree_util.tree_map(lambda _: None, array_kwargs)

    call.defvjp(call_fwd, call_bwd)
    return call(inv.args, inv.array_kwargs)


# The call descriptions each trace has carried already, by (op id, call key). A description is
# the same at every site of a call key, so one copy per traced function is enough for the
# readers; the others carry only the label. Weak keys: a finished trace takes its set with it.
_described: weakref.WeakKeyDictionary[Any, set[tuple[str, str]]] = weakref.WeakKeyDictionary()
_described_lock = threading.Lock()


def _first_in_trace(inv: Invocation[Any, Any]) -> bool:
    """Whether the trace being recorded has not carried ``inv``'s description yet."""
    trace = getattr(getattr(jax_core, "trace_ctx", None), "trace", None)
    if trace is None:  # a JAX without the trace context: describe every site
        return True
    key = (inv.op_id, inv.call_key)
    with _described_lock:
        try:
            seen = _described.setdefault(trace, set())
        except TypeError:  # a trace that takes no weak reference
            return True
        if key in seen:
            return False
        seen.add(key)
        return True


def _cotangent_for(primal: Any, grad: Any) -> Any:
    """Integer and boolean inputs have no cotangent; everything else gets the kernel's grad."""
    if is_array(primal) and not jax.numpy.issubdtype(primal.dtype, jax.numpy.inexact):
        return None
    return grad


_default_lock = threading.Lock()
_default_executor: Executor | None = None


def get_default_executor() -> Executor:
    """The executor ``kernel(*args)`` uses: memory cache plus the user's persistent cache."""
    global _default_executor
    with _default_lock:
        if _default_executor is None:
            _default_executor = Executor(ConfigSelectorChain(persistent=open_default_persistent()))
        return _default_executor


def set_default_executor(executor: Executor | None) -> None:
    """Replace the default executor (None: rebuild it on next use)."""
    global _default_executor
    if executor is not None and not isinstance(executor, Executor):
        raise TypeError(f"executor: expected an Executor or None, got {type(executor).__name__}")
    with _default_lock:
        _default_executor = executor


set_default_runner(get_default_executor)
set_default_selector(lambda: get_default_executor().selector)
