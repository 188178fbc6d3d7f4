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


def _heads(x: Tensor, head_size: int) -> Tensor:
    """``(T, H*head_size)`` or ``(T, H, head_size)`` as a ``(T, H, head_size)`` view."""
    return x if x.dim() == 3 else x.unflatten(-1, (-1, head_size))


def _rotate(x: Tensor, head_size: int, cos: Tensor, sin: Tensor, is_neox: bool) -> None:
    """Rotate the first ``rot_dim`` dims of every head of ``x`` in place; ``cos``/``sin`` are
    ``(T, 1, rot_dim/2)`` in the compute dtype."""
    heads = _heads(x, head_size)
    rot = heads[..., :2 * cos.shape[-1]]
    r = rot.to(cos.dtype)
    if is_neox:  # pairs (i, i + rot_dim/2)
        x1, x2 = r.chunk(2, dim=-1)
    else:  # GPT-J: pairs (2i, 2i + 1)
        x1, x2 = r[..., 0::2], r[..., 1::2]
    o1 = x1 * cos - x2 * sin
    o2 = x2 * cos + x1 * sin
    out = torch.cat((o1, o2), dim=-1) if is_neox else torch.stack((o1, o2), dim=-1).flatten(-2)
    rot.copy_(out)  # dims rot_dim..head_size are left as they are


def _positions_unchecked(positions: Tensor) -> bool:
    """Whether the op's eager check of the positions did not run for this call: traced (the compiled
    route's functional tensors) or not asked for on this device (``CHECK_POSITIONS``)."""
    if type(positions) is not Tensor:
        return True
    from . import ops as op  # loaded before any call reaches here
    return not op.positions_checked(positions)


def _cos_sin_rows(positions: Tensor, cos_sin_cache: Tensor, dtype: torch.dtype) -> Tensor:
    """``cos_sin_cache[positions]`` in ``dtype``. Where the positions were not checked, NaN for one
    outside the cache: the index is clamped into it, so no row outside is read (under
    ``torch.compile`` -1 read the last row and ``max_position`` failed Inductor's bounds check); this
    costs 15 µs a call on the CPU at 32 tokens, so checked calls gather directly."""
    p = positions.reshape(-1)
    if not _positions_unchecked(positions):
        return cos_sin_cache.index_select(0, p).to(dtype)
    rows = cos_sin_cache.shape[0]
    if rows == 0:
        return cos_sin_cache.new_full((p.shape[0], cos_sin_cache.shape[1]), float("nan"), dtype=dtype)
    index = p.clamp(0, rows - 1)
    return torch.where((index == p)[:, None], cos_sin_cache.index_select(0, index).to(dtype), float("nan"))


def rotary_embedding(positions: Tensor, query: Tensor, key: Optional[Tensor], head_size: int,
                     cos_sin_cache: Tensor, is_neox: bool) -> None:
    cd = torch.promote_types(query.dtype, torch.float32)
    cos, sin = _cos_sin_rows(positions, cos_sin_cache, cd).unsqueeze(-2).chunk(2, dim=-1)
    _rotate(query, head_size, cos, sin, is_neox)
    if key is not None:
        _rotate(key, head_size, cos, sin, is_neox)


def _rms_normalize(heads: Tensor, weight: Tensor, eps: float) -> Tensor:
    """``rmsnorm`` of every head, rounded to the heads' dtype: the norm family's reference expression
    (``x * rsqrt(mean(x^2) + eps) * w`` in the compute dtype), so the bits are ``rmsnorm``'s."""
    x = heads.to(torch.promote_types(heads.dtype, torch.float32))
    return (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight.to(x.dtype)).to(heads.dtype)


def qk_rmsnorm_rope(positions: Tensor, query: Tensor, key: Optional[Tensor], q_weight: Tensor,
                    k_weight: Optional[Tensor], eps: float, head_size: int, cos_sin_cache: Tensor,
                    is_neox: bool) -> None:
    # The norm rounded to the dtype, then rotary_embedding's rotation of those values: the unfused pair.
    cd = torch.promote_types(query.dtype, torch.float32)
    cos, sin = _cos_sin_rows(positions, cos_sin_cache, cd).unsqueeze(-2).chunk(2, dim=-1)
    for x, w in ((query, q_weight), (key, k_weight)):
        if x is not None:
            heads = _heads(x, head_size)
            heads.copy_(_rms_normalize(heads, w, eps))
            _rotate(x, head_size, cos, sin, is_neox)
