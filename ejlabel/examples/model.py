"""An example model: a small decoder-only transformer built from ``ejlabel.kernels``.

Embedding, ``n_layers`` blocks of RMSNorm → grouped-query causal attention → RMSNorm → gated
MLP, a final norm, and the unembedding with the softmax cross-entropy loss. The same model runs
on these sets of ops (``Ops``):

- ``PLAIN_OPS``, the model as a JAX user writes it: ``a @ b`` in the input dtype, ``jax.numpy``
  norms, ``jax.nn.dot_product_attention`` (cuDNN on a GPU, XLA on the CPU; with packed
  documents, a dense block-diagonal causal mask), and the unembedding matmul followed by a
  logsumexp loss. The baseline every benchmark compares against.
- ``PLAIN_CUDNN_PACKED_OPS``, the same model as a JAX user who knows cuDNN's packed layout writes
  it: packed documents go to cuDNN as each document's length and start (through JAX's cuDNN
  module, which ``jax.nn.dot_product_attention`` does not yet expose) instead of a dense mask.
  The second baseline of the packed model, on Hopper GPUs; the rest is ``PLAIN_OPS``.
- ``KERNEL_OPS``, every call through an ``ejlabel`` kernel, labelled, its config chosen by the
  executor; the unembedding and the loss are one ``linear_cross_entropy`` call, which may run
  without ever writing the ``[tokens, vocab]`` logits. Attention gets the count of documents per
  row (``max_documents``), so the tuner may also pick cuDNN's packed layout.

Under ``ejlabel.use_implementation("xla")`` ``KERNEL_OPS`` and ``PLAIN_OPS`` compile to the
same program. Sizes: ``TINY`` for the CPU, ``GPU_125M`` (~125M parameters) for the GPU; the
``*_PACKED`` variants pack ``documents`` documents of random lengths into every row (segment ids
in the batch), so attention stays within each document.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax._src.cudnn.fused_attention_stablehlo import MaskType
from jax._src.cudnn.fused_attention_stablehlo import dot_product_attention as cudnn_dot_product_attention
from jax.sharding import NamedSharding, PartitionSpec
from jaxtyping import Array, Float, Int

from ejlabel.kernels.attention import flash_attention
from ejlabel.kernels.linear_cross_entropy import linear_cross_entropy
from ejlabel.kernels.matmul import matmul
from ejlabel.kernels.norms import rms_norm

__all__ = [
    "ModelConfig", "TINY", "TINY_PACKED", "GPU_125M", "GPU_125M_PACKED", "Ops", "KERNEL_OPS", "PLAIN_OPS", "PLAIN_CUDNN_PACKED_OPS", "Params",
    "init_params", "example_batch", "random_documents", "fsdp_specs", "gathered", "place_on_mesh", "hidden_fn", "logits_fn", "loss_fn", "make_train_step", "make_serve_step",
]

Params = dict[str, Any]


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    vocab: int
    d_model: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    d_ff: int
    seq_len: int
    batch: int
    dtype: Any = jnp.float32
    documents: int = 1  # documents packed into each row; > 1 puts segment ids in the batch

    def __post_init__(self) -> None:
        if not 1 <= self.documents <= self.seq_len:
            raise ValueError(f"documents: expected 1..seq_len ({self.seq_len}), got {self.documents}")

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_heads


TINY = ModelConfig(vocab=128, d_model=64, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=128, seq_len=32, batch=2)
GPU_125M = ModelConfig(vocab=32000, d_model=768, n_layers=12, n_heads=12, n_kv_heads=4, d_ff=2048, seq_len=2048, batch=8, dtype=jnp.bfloat16)
TINY_PACKED = dataclasses.replace(TINY, documents=3)
GPU_125M_PACKED = dataclasses.replace(GPU_125M, documents=4)


class Ops(NamedTuple):
    """The four operations the model is made of."""

    matmul: Callable[[Array, Array], Array]
    rms_norm: Callable[[Array, Array], Array]
    # (q, k, v, segment_ids or None, documents per row) -> causal attention; [batch, seq, heads,
    # dim], ids [batch, seq]; the count is static (ModelConfig.documents)
    attention: Callable[[Array, Array, Array, Array | None, int], Array]
    # (hidden [tokens, d], unembedding [d, vocab], labels [tokens]) -> mean float32 loss
    unembed_loss: Callable[[Array, Array, Array], Array]


# The plain model: what a JAX user writes, with nothing of ejlabel in it.


def _plain_matmul(a: Array, b: Array) -> Array:
    return a @ b


def _plain_rms_norm(x: Array, w: Array, eps: float = 1e-6) -> Array:
    x32 = x.astype(jnp.float32)
    return (x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps) * w.astype(jnp.float32)).astype(x.dtype)


def _plain_attention(q: Array, k: Array, v: Array, segment_ids: Array | None, documents: int) -> Array:
    # cuDNN's fused attention where there is one: what jax.nn.dot_product_attention offers.
    implementation = "cudnn" if jax.default_backend() == "gpu" else "xla"
    if segment_ids is None:
        return jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation=implementation)
    # Packed documents: the dense block-diagonal mask, the way jax.nn.dot_product_attention has to
    # say it (cuDNN's own packed layout is the other: _plain_cudnn_packed_attention). Ids <= 0 are
    # the padding a packing pipeline leaves at row ends: a padding query sees nothing, so its
    # softmax row is meaningless (NaN on some backends) and is zeroed.
    real = segment_ids > 0
    mask = (segment_ids[:, :, None] == segment_ids[:, None, :]) & real[:, :, None]
    out = jax.nn.dot_product_attention(q, k, v, mask=mask[:, None], is_causal=True, implementation=implementation)
    return jnp.where(real[:, :, None, None], out, jnp.zeros((), out.dtype))


def _plain_cudnn_packed_attention(q: Array, k: Array, v: Array, segment_ids: Array | None, documents: int) -> Array:
    if segment_ids is None:
        return _plain_attention(q, k, v, segment_ids, documents)
    # Packed documents as cuDNN's packed layout: per row, each document's length [batch, M] and
    # start [batch, M + 1], -1 where a row has fewer. The pipeline numbers a row's documents 1..M
    # in order from the row's start and pads the row's end with ids <= 0. cuDNN leaves positions
    # outside its sequences unspecified (outputs and gradients alike), so that padding joins the
    # last document: causal, the document's queries never see it, and the padding queries'
    # outputs are zeroed, which makes their gradients exactly 0.
    number = jnp.arange(1, documents + 1, dtype=segment_ids.dtype)
    lengths = jnp.sum(segment_ids[:, None, :] == number[None, :, None], axis=2, dtype=jnp.int32)
    starts = jnp.cumsum(lengths, axis=1, dtype=jnp.int32) - lengths
    present = lengths > 0
    last = documents - 1 - jnp.argmax(present[:, ::-1], axis=1)
    lengths = jnp.where(jnp.arange(documents) == last[:, None], segment_ids.shape[1] - starts, lengths)
    seqlen = jnp.where(present, lengths, -1)
    offsets = jnp.pad(jnp.where(present, starts, -1), ((0, 0), (0, 1)), constant_values=-1)
    out = cudnn_dot_product_attention(
        q, k, v, q_seqlen=seqlen, kv_seqlen=seqlen, q_offsets=offsets, kv_offsets=offsets,
        scale=1.0 / math.sqrt(q.shape[-1]), mask_type=MaskType.PADDING_CAUSAL,
    )
    return jnp.where((segment_ids > 0)[:, :, None, None], out, jnp.zeros((), out.dtype))


def _plain_unembed_loss(hidden: Array, unembedding: Array, labels: Array) -> Array:
    logits32 = (hidden @ unembedding).astype(jnp.float32)
    picked = jnp.take_along_axis(logits32, labels[:, None], axis=-1)[:, 0]
    return jnp.mean(jax.nn.logsumexp(logits32, axis=-1) - picked)


PLAIN_OPS = Ops(_plain_matmul, _plain_rms_norm, _plain_attention, _plain_unembed_loss)
PLAIN_CUDNN_PACKED_OPS = PLAIN_OPS._replace(attention=_plain_cudnn_packed_attention)
KERNEL_OPS = Ops(
    matmul,
    rms_norm,
    lambda q, k, v, segment_ids, documents: flash_attention(
        q, k, v, causal=True, segment_ids=segment_ids, max_documents=None if segment_ids is None else documents
    ),
    lambda hidden, unembedding, labels: linear_cross_entropy(hidden, unembedding, labels, ignore_index=None, reduction="mean"),
)


def init_params(cfg: ModelConfig, key: jax.Array) -> Params:
    """Weights drawn with 1/sqrt(fan-in) scaling, in ``cfg.dtype``."""
    def dense(key: jax.Array, fan_in: int, fan_out: int) -> Array:
        return (jax.random.normal(key, (fan_in, fan_out), jnp.float32) / math.sqrt(fan_in)).astype(cfg.dtype)

    kv_width = cfg.n_kv_heads * cfg.head_dim
    keys = iter(jax.random.split(key, 2 + 7 * cfg.n_layers))
    layers = []
    for _ in range(cfg.n_layers):
        layers.append({
            "attn_norm": jnp.ones((cfg.d_model,), cfg.dtype),
            "wq": dense(next(keys), cfg.d_model, cfg.d_model),
            "wk": dense(next(keys), cfg.d_model, kv_width),
            "wv": dense(next(keys), cfg.d_model, kv_width),
            "wo": dense(next(keys), cfg.d_model, cfg.d_model),
            "mlp_norm": jnp.ones((cfg.d_model,), cfg.dtype),
            "w_gate": dense(next(keys), cfg.d_model, cfg.d_ff),
            "w_up": dense(next(keys), cfg.d_model, cfg.d_ff),
            "w_down": dense(next(keys), cfg.d_ff, cfg.d_model),
        })
    return {
        "embed": (jax.random.normal(next(keys), (cfg.vocab, cfg.d_model), jnp.float32) * 0.02).astype(cfg.dtype),
        "layers": layers,
        "final_norm": jnp.ones((cfg.d_model,), cfg.dtype),
        "unembed": dense(next(keys), cfg.d_model, cfg.vocab),
    }


def example_batch(cfg: ModelConfig, key: jax.Array) -> dict[str, Array]:
    """Random tokens ``[batch, seq]`` and their next-token targets; with ``cfg.documents > 1``
    also ``segment_ids [batch, seq]``: ids ``1..documents`` of documents of random lengths."""
    k_tokens, k_cuts = jax.random.split(key)
    tokens = jax.random.randint(k_tokens, (cfg.batch, cfg.seq_len + 1), 0, cfg.vocab, dtype=jnp.int32)
    batch = {"tokens": tokens[:, :-1], "targets": tokens[:, 1:]}
    if cfg.documents > 1:
        batch["segment_ids"] = random_documents(k_cuts, cfg.batch, cfg.seq_len, cfg.documents)
    return batch


def random_documents(key: jax.Array, rows: int, seq_len: int, documents: int) -> Int[Array, "rows seq"]:
    """Segment ids of ``documents`` non-empty documents per row, cut at random positions."""
    def one_row(key: jax.Array) -> Int[Array, " seq"]:
        cuts = jnp.sort(jax.random.permutation(key, jnp.arange(1, seq_len))[: documents - 1])
        return 1 + jnp.searchsorted(cuts, jnp.arange(seq_len), side="right").astype(jnp.int32)

    return jax.vmap(one_row)(jax.random.split(key, rows))


def _split_sharding(x: Array) -> NamedSharding | None:
    """``x``'s sharding when the trace sees it split over mesh axes (explicit ones), else None."""
    sharding = jax.typeof(x).sharding
    return sharding if any(entry is not None for entry in getattr(sharding, "spec", ())) else None


def _reshape_rows(x: Array, shape: tuple[int, ...]) -> Array:
    """``x.reshape(shape)`` between ``[batch * seq, ...]`` and ``[batch, seq, ...]``; a batch
    split over explicit mesh axes stays split over the first dimension (JAX asks to be told)."""
    sharding = _split_sharding(x)
    if sharding is None:
        return x.reshape(shape)
    rows = PartitionSpec(sharding.spec[0], *([None] * (len(shape) - 1)))
    return jax.lax.reshape(x, shape, out_sharding=NamedSharding(sharding.mesh, rows))


def _block(x: Float[Array, "tokens d"], layer: Params, cfg: ModelConfig, ops: Ops, segment_ids: Int[Array, "batch seq"] | None) -> Float[Array, "tokens d"]:
    b, s = cfg.batch, cfg.seq_len
    h = ops.rms_norm(x, layer["attn_norm"])
    q = _reshape_rows(ops.matmul(h, layer["wq"]), (b, s, cfg.n_heads, cfg.head_dim))
    k = _reshape_rows(ops.matmul(h, layer["wk"]), (b, s, cfg.n_kv_heads, cfg.head_dim))
    v = _reshape_rows(ops.matmul(h, layer["wv"]), (b, s, cfg.n_kv_heads, cfg.head_dim))
    attended = _reshape_rows(ops.attention(q, k, v, segment_ids, cfg.documents), (b * s, cfg.d_model))
    x = x + ops.matmul(attended, layer["wo"])
    h = ops.rms_norm(x, layer["mlp_norm"])
    gated = jax.nn.silu(ops.matmul(h, layer["w_gate"])) * ops.matmul(h, layer["w_up"])
    return x + ops.matmul(gated, layer["w_down"])


def gathered(params: Any) -> Any:
    """``params`` whole on every device: a no-op for replicated (or unsharded) parameters, the
    per-layer gather of FSDP for parameters sharded over explicit mesh axes."""

    def whole(p: Array) -> Array:
        sharding = _split_sharding(p)
        return p if sharding is None else jax.sharding.reshard(p, NamedSharding(sharding.mesh, PartitionSpec()))

    return jax.tree_util.tree_map(whole, params)


def fsdp_specs(params: Params, shards: int, axis: str | tuple[str, ...]) -> Any:
    """Partition specs that shard every parameter FSDP-style: its first dimension that
    ``shards`` divides, over mesh ``axis``; parameters with none stay whole. The model gathers
    them layer by layer (:func:`gathered`); their gradients come back sharded alike."""

    def spec(p: Array) -> PartitionSpec:
        for dim, size in enumerate(p.shape):
            if size % shards == 0:
                return PartitionSpec(*([None] * dim), axis)
        return PartitionSpec()

    return jax.tree_util.tree_map(spec, params)


def place_on_mesh(mesh: jax.sharding.Mesh, params: Params, batch: dict[str, Array], *, fsdp: bool = False, axis: str = "data") -> tuple[Params, dict[str, Array]]:
    """``(params, batch)`` on ``mesh``: every batch array's rows split over mesh ``axis``, the
    parameters replicated (data parallel) or, with ``fsdp``, sharded by :func:`fsdp_specs`.

    The mesh needs explicit axes (``jax.make_mesh``'s default), so that the kernels see the
    shardings while tracing and run per shard."""
    put = lambda x, spec: jax.device_put(x, NamedSharding(mesh, spec))
    shards = mesh.shape[axis]
    specs = fsdp_specs(params, shards, axis) if fsdp else jax.tree_util.tree_map(lambda _: PartitionSpec(), params)
    return jax.tree_util.tree_map(put, params, specs), {name: put(x, PartitionSpec(axis)) for name, x in batch.items()}


def _embed(table: Float[Array, "vocab d"], ids: Int[Array, " tokens"]) -> Float[Array, "tokens d"]:
    # With explicit shardings the rows of the result follow the ids' (JAX asks to be told).
    sharding = _split_sharding(ids)
    if sharding is None:
        return table[ids]
    return table.at[ids].get(out_sharding=NamedSharding(sharding.mesh, PartitionSpec(sharding.spec[0], None)))


def hidden_fn(params: Params, tokens: Int[Array, "batch seq"], cfg: ModelConfig, ops: Ops, segment_ids: Int[Array, "batch seq"] | None = None) -> Float[Array, "tokens d"]:
    """Final normalised hidden states for every position, flattened to ``[batch * seq, d]``.

    Sharded (a batch split over explicit mesh axes), every device runs its rows; parameters
    sharded FSDP-style are gathered layer by layer, where they are used (:func:`gathered`)."""
    x = _embed(gathered(params["embed"]), _reshape_rows(tokens, (tokens.size,)))
    for layer in params["layers"]:
        x = _block(x, gathered(layer), cfg, ops, segment_ids)
    return ops.rms_norm(x, gathered(params["final_norm"]))


def logits_fn(params: Params, tokens: Int[Array, "batch seq"], cfg: ModelConfig, ops: Ops, segment_ids: Int[Array, "batch seq"] | None = None) -> Float[Array, "tokens vocab"]:
    """Next-token logits for every position, flattened to ``[batch * seq, vocab]``."""
    return ops.matmul(hidden_fn(params, tokens, cfg, ops, segment_ids), gathered(params["unembed"]))


def loss_fn(params: Params, batch: dict[str, Array], cfg: ModelConfig, ops: Ops) -> Float[Array, ""]:
    """Mean next-token cross-entropy."""
    hidden = hidden_fn(params, batch["tokens"], cfg, ops, batch.get("segment_ids"))
    return ops.unembed_loss(hidden, gathered(params["unembed"]), _reshape_rows(batch["targets"], (batch["targets"].size,)))


def make_train_step(cfg: ModelConfig, ops: Ops = KERNEL_OPS, learning_rate: float = 0.05) -> Callable[[Params, dict[str, Array]], tuple[Params, Array]]:
    """``step(params, batch) -> (params, loss)``: value_and_grad and a plain SGD update."""

    def step(params: Params, batch: dict[str, Array]) -> tuple[Params, Array]:
        loss, grads = jax.value_and_grad(loss_fn)(params, batch, cfg, ops)
        new_params = jax.tree_util.tree_map(lambda p, g: (p - learning_rate * g.astype(jnp.float32)).astype(p.dtype), params, grads)
        return new_params, loss

    return step


def make_serve_step(cfg: ModelConfig, ops: Ops = KERNEL_OPS) -> Callable[..., Array]:
    """``step(params, tokens, segment_ids=None) -> logits [batch * seq, vocab]``: the forward pass."""
    return lambda params, tokens, segment_ids=None: logits_fn(params, tokens, cfg, ops, segment_ids)
