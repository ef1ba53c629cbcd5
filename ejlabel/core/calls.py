"""Self-describing calls: the abstract signature of each kernel call, carried in the program.

Next to its label, every labelled op carries ``ejcall="<text>"``: the call's kernel (import path
of its class and its op id), version, abstract arguments (shape, dtype, weak type; sharding as
its fingerprint), static keyword arguments and batch axes. The text is tagged JSON
(:mod:`ejlabel.utils.serialize`), base64url-encoded, because HLO printing emits frontend
attribute values unquoted-inside-quotes and would mangle raw JSON. Decoding is for data from
elsewhere: it never imports (kernels and types come from the registry), refuses text over
:data:`MAX_DESCRIPTION_CHARS` and nesting past the serializer's ``MAX_DEPTH``, and turns every
failure into one :class:`CallDecodeError`. With it,
``invocations_from_program`` rebuilds each call's :class:`~ejlabel.kernel.Invocation` with
``jax.ShapeDtypeStruct`` arguments from a program file alone, in a process that never ran the
model, which is what offline tuning needs.
"""

from __future__ import annotations

import base64
import dataclasses
import json
from collections.abc import Mapping
from typing import Any

import jax

from ejlabel.core.kernel import Invocation, Kernel
from ejlabel.core.label_format import forward_op_id, parse_label, split_op_id
from ejlabel.core.labels import program_descriptions
from ejlabel.core.registry import learn_config_types
from ejlabel.core.vmapped import vmap_levels
from ejlabel.utils.fingerprint import sharding_fingerprint
from ejlabel.utils.serialize import (
    from_jsonable,
    import_path,
    resolve_path,
    to_jsonable,
)

__all__ = [
    "MAX_DESCRIPTION_CHARS",
    "CallDecodeError",
    "CallDescription",
    "decode_call",
    "encode_call",
    "invocation_from_description",
    "invocations_from_program",
]

_FORMAT = 1
_cache: dict[tuple[str, str], str] = {}

#: Longest description text decoded. A real one is a few hundred characters (a call with a
#: thousand array arguments stays under 100 KiB); longer text is refused before decoding.
MAX_DESCRIPTION_CHARS = 1 << 20


class CallDecodeError(ValueError):
    """A call description that cannot be decoded or whose kernel cannot be rebuilt."""


@dataclasses.dataclass(frozen=True)
class CallDescription:
    """The decoded ``ejcall`` attribute of one labelled call."""

    kernel: str | None  # "module:QualName" of the Kernel subclass; None if it has no importable name
    op_id: str  # unversioned kernel name
    version: str
    call_key: str
    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    batch_axes: Any
    shardings: tuple[str | None, ...]

    @property
    def label_op(self) -> str:
        return f"{self.op_id}@v{self.version}"


def _encode_tree(tree: Any) -> Any:
    return to_jsonable(jax.tree_util.tree_map(_abstract_leaf, tree, is_leaf=lambda x: x is None))


def _abstract_leaf(x: Any) -> Any:
    if hasattr(x, "shape") and hasattr(x, "dtype") and not isinstance(x, type):
        return jax.ShapeDtypeStruct(tuple(x.shape), x.dtype, weak_type=bool(getattr(getattr(x, "aval", x), "weak_type", False)))
    return x


def encode_call(inv: Invocation[Any, Any]) -> str:
    """The ``ejcall`` text of ``inv``; memoised per (op, call key) since it runs at every trace.

    Only what the label does not say: the kernel class, the abstract arguments, the static
    keyword arguments, the batch axes and (when any is sharded) the shardings, as a positional
    JSON list, base64url-encoded. It is written on every op of the call, so it is kept short.
    """
    memo_key = (inv.op_id, inv.call_key)
    cached = _cache.get(memo_key)
    if cached is not None:
        return cached
    leaves = jax.tree_util.tree_leaves((inv.args, inv.kwargs))
    # A per-shard call (core/shards) says how it was split; a whole one gives its arrays' shardings.
    shardings = list(inv.metadata.get("shardings", ())) or [sharding_fingerprint(x) for x in leaves if hasattr(x, "shape")]
    data = [
        _FORMAT,
        _kernel_path(inv.kernel),
        [_encode_tree(arg) for arg in inv.args],
        _encode_tree(inv.kwargs),
        to_jsonable(inv.batch_axes),
        shardings if any(shardings) else None,
    ]
    raw = json.dumps(data, separators=(",", ":")).encode()
    text = base64.urlsafe_b64encode(raw).decode("ascii").rstrip("=")
    _cache[memo_key] = text
    return text


def _kernel_path(kernel: Kernel[Any, Any]) -> str | None:
    """The kernel class's import path, or None for a class defined inside a function."""
    try:
        return import_path(type(kernel))
    except TypeError:
        return None


def decode_call(text: str, label: str) -> CallDescription:
    """Invert :func:`encode_call`, given the label the description sits next to.

    A backward label (``<op>.bwd@vN``) describes its forward call. The kernel is not imported.
    Any text that is not a description (malformed, nested deeper than the serializer's
    ``MAX_DEPTH``, longer than :data:`MAX_DESCRIPTION_CHARS`, naming unregistered types) is a
    :class:`CallDecodeError`, whatever went wrong inside.
    """
    try:
        op_id, call_key = parse_label(label)
        name, version = split_op_id(forward_op_id(op_id))
    except (TypeError, ValueError) as err:
        raise CallDecodeError(f"label: {err}") from None
    if not isinstance(text, str):
        raise CallDecodeError(f"text: expected the description as str, got {type(text).__name__}")
    if len(text) > MAX_DESCRIPTION_CHARS:
        raise CallDecodeError(f"call description of {label} is {len(text)} characters, over the {MAX_DESCRIPTION_CHARS} limit")
    try:
        data = json.loads(base64.urlsafe_b64decode(text + "=" * (-len(text) % 4)))
        if not isinstance(data, list) or not data or data[0] != _FORMAT:
            raise CallDecodeError(f"call description format {data[0] if isinstance(data, list) and data else data!r} is not {_FORMAT}")
        _, kernel, args, kwargs, batch_axes, shardings = data
        return CallDescription(
            kernel=kernel,
            op_id=name,
            version=version,
            call_key=call_key,
            args=tuple(from_jsonable(arg) for arg in args),
            kwargs=from_jsonable(kwargs),
            batch_axes=from_jsonable(batch_axes),
            shardings=tuple(shardings or ()),
        )
    except CallDecodeError:
        raise
    except Exception as err:  # noqa: BLE001 - any malformed text: one clear error type
        raise CallDecodeError(f"cannot decode call description {text[:40]!r}...: {err}") from None


def rebuild_kernel(desc: CallDescription) -> Kernel[Any, Any]:
    """An instance of the described kernel class with the described op id and version."""
    if desc.kernel is None:
        raise CallDecodeError(
            f"kernel {desc.op_id!r} was defined inside a function; define its class at module level "
            "so that offline tools can import it"
        )
    try:
        cls = resolve_path(desc.kernel)
    except (ImportError, ValueError) as err:  # unregistered (never imported) or not a name at all
        raise CallDecodeError(f"cannot rebuild kernel {desc.kernel!r:.80}: {err}") from None
    if not (isinstance(cls, type) and issubclass(cls, Kernel)):
        raise CallDecodeError(f"{desc.kernel} is not a Kernel subclass")
    kernel = None
    for make in (lambda: cls(), lambda: cls(desc.op_id)):
        try:
            candidate = make()
        except Exception:  # noqa: BLE001, S112 - a constructor that does not take this form: try the next
            continue
        if candidate.op_id == desc.op_id:
            kernel = candidate
            break
    if kernel is None:
        raise CallDecodeError(f"cannot construct {desc.kernel} with op id {desc.op_id!r}")
    if kernel.version != desc.version:
        raise CallDecodeError(
            f"{desc.kernel} is version {kernel.version}, the program was built with version {desc.version}"
        )
    return kernel


def invocations_from_program(program: Any) -> dict[str, Invocation[Any, Any]]:
    """Rebuild the ``Invocation`` of every described call, keyed by label.

    ``program`` is an :class:`ejlabel.analysis.Program` (anything with a ``descriptions``
    mapping), a mapping from label to encoded description, or any form the program reader reads
    (a ``Lowered``, a ``Compiled``, program text, a file or an XLA dump directory), whose
    descriptions are read with :func:`ejlabel.core.labels.program_descriptions`.
    Arguments come back as ``jax.ShapeDtypeStruct``; the call key is the one in the label, so
    configs tuned for the rebuilt invocation land exactly where the program will look.
    Raises :class:`CallDecodeError` for the first call that cannot be rebuilt; use
    :func:`invocation_from_description` to handle calls one by one.
    """
    return {lab: invocation_from_description(lab, text) for lab, text in _descriptions_of(program).items()}


def _descriptions_of(program: Any) -> Mapping[str, str]:
    found = getattr(program, "descriptions", program)
    if isinstance(found, Mapping):
        return found
    return program_descriptions(program)


def invocation_from_description(lab: str, text: str) -> Invocation[Any, Any]:
    """The Invocation that the description ``text`` next to label ``lab`` describes.

    :class:`CallDecodeError` for anything that does not rebuild a call (see :func:`decode_call`),
    including arguments that decode but do not make a call (``kwargs`` that are not a mapping,
    unhashable static values, ...). Never imports: kernels come from the registry.
    """
    desc = decode_call(text, lab)
    kernel = rebuild_kernel(desc)
    if not isinstance(desc.kwargs, dict) or not all(isinstance(k, str) for k in desc.kwargs):
        raise CallDecodeError(f"call description of {lab}: keyword arguments are not a str-keyed mapping")
    try:
        inv = Invocation(kernel, desc.args, desc.kwargs, batch_axes=desc.batch_axes, known_call_key=desc.call_key)
        vmap_levels(inv.batch_axes, len(jax.tree_util.tree_leaves((inv.args, inv.array_kwargs))))  # checks a vmap call's axes
    except Exception as err:  # noqa: BLE001 - decoded data that makes no call: one clear error type
        raise CallDecodeError(f"call description of {lab} does not make a call of {desc.kernel}: {type(err).__name__}: {err}") from None
    # A kernel class that names no config type learns it from its heuristic (code this process
    # imported), so the configs stored for the call decode here.
    learn_config_types(kernel, inv)
    return inv
