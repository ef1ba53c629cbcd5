"""The tiles and launch parameters of the ``"pallas"`` attention kernels (:mod:`.triton`)
where a config leaves them unset.

The kernels fill a config's unset fields with them, and the attention op's config checks read
them to judge a config's tiles against a call's shapes, before any kernel is imported: this
module imports no Pallas.
"""

from __future__ import annotations

from ejlabel import BwdParams, FwdParams

__all__ = ["default_bwd", "default_fwd"]


# Defaults from a sweep of every tile shape on the H100 (causal, B4 S4096 H16 D128): four warps
# beat eight for head dims up to 128.
def default_fwd(dim: int) -> FwdParams:
    """The forward's tiles and launch parameters where a config leaves them unset."""
    return FwdParams(q_blocksize=128, kv_blocksize=64, num_warps=4 if dim <= 128 else 8, num_stages=2)


def default_bwd(dim: int) -> BwdParams:
    """The backward kernels' tiles and launch parameters where a config leaves them unset."""
    return BwdParams(q_blocksize=64, kv_blocksize=64, num_warps=4 if dim <= 128 else 8, num_stages=2)
