"""Reference rotary embedding (vLLM's ``RotaryEmbedding.forward_native``), computed in fp32 (or in
the input's dtype where wider) and rounded once into ``query`` and ``key``.

Takes already-validated arguments (``ops.py`` validates): ``positions`` ``(T,)``
int32/int64, ``query`` ``(T, Hq*head_size)`` or ``(T, Hq, head_size)`` and the same for ``key`` (or
``None``), last dimension contiguous; ``cos_sin_cache`` ``(max_position, rot_dim)`` holding
``rot_dim/2`` cosines then ``rot_dim/2`` sines per position. A position outside the cache (unchecked
under ``torch.compile``) reads no row and gives NaN in the rotated dims of its token.
"""

from typing import Optional

import torch
from torch import Tensor

from ... import rotary
from .tokens import flat_tokens


def _positions_unchecked(positions: Tensor) -> bool:
    """Whether the op's eager check of the positions did not run for this call: traced (the compiled
    route's functional tensors) or not asked for on this device (``ops.positions_checked``)."""
    if type(positions) is not Tensor:
        return True
    from . import ops as op  # loaded before any call reaches here
    return not op.positions_checked(positions)


def _cos_sin(positions: Tensor, cos_sin_cache: Tensor, dtype: torch.dtype):
    """``rotary.cos_sin``; where the positions were not checked, NaN for one outside the cache (no row
    outside is read: under ``torch.compile`` -1 read the last row and ``max_position`` failed Inductor's
    bounds check); the clamp costs 15 µs a call on the CPU at 32 tokens, so checked calls gather directly."""
    return rotary.cos_sin(positions, cos_sin_cache, dtype, checked=not _positions_unchecked(positions))


def rotary_embedding(positions: Tensor, query: Tensor, key: Optional[Tensor], head_size: int,
                     cos_sin_cache: Tensor, is_neox: bool) -> None:
    positions, query, key = flat_tokens(positions, query, key)
    cos, sin = _cos_sin(positions, cos_sin_cache, rotary.compute_dtype(query.dtype))
    for x in (query, key):
        if x is not None:
            rotary.rotate_(rotary.heads(x, head_size), cos, sin, is_neox)


def _rms_normalize(heads: Tensor, weight: Tensor, eps: float) -> Tensor:
    """``rmsnorm`` of every head, rounded to the heads' dtype: the norm family's reference expression
    (``x * rsqrt(mean(x^2) + eps) * w`` in the compute dtype), so the bits are ``rmsnorm``'s."""
    x = heads.to(torch.promote_types(heads.dtype, torch.float32))
    return (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight.to(x.dtype)).to(heads.dtype)


def qk_rmsnorm_rope(positions: Tensor, query: Tensor, key: Optional[Tensor], q_weight: Tensor,
                    k_weight: Optional[Tensor], eps: float, head_size: int, cos_sin_cache: Tensor,
                    is_neox: bool) -> None:
    # The norm rounded to the dtype, then rotary_embedding's rotation of those values: the unfused pair.
    positions, query, key = flat_tokens(positions, query, key)
    cos, sin = _cos_sin(positions, cos_sin_cache, rotary.compute_dtype(query.dtype))
    for x, w in ((query, q_weight), (key, k_weight)):
        if x is not None:
            heads = rotary.heads(x, head_size)
            heads.copy_(_rms_normalize(heads, w, eps))
            rotary.rotate_(heads, cos, sin, is_neox)
