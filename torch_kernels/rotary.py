"""The rotary embedding's reference numerics (vLLM's ``RotaryEmbedding.forward_native``), for every
family whose op rotates heads: one definition, so that a fused op's reference equals, bit for bit,
``rotary_embedding``'s followed by its other half.

For token ``t`` at ``p = positions[t]`` with ``r = cos_sin_cache.shape[1]``: ``cos = cache[p, :r/2]``,
``sin = cache[p, r/2:]``, and each head ``x`` is rotated pair by pair, ``x1, x2 = x1 * cos - x2 * sin,
x2 * cos + x1 * sin``, pairs ``(x[i], x[i + r/2])`` (neox) or ``(x[2i], x[2i + 1])`` (GPT-J); dims
``r..head_size`` pass through. Computed in fp32 (fp64 for fp64 input) and rounded once. Torch only; no
family imported.
"""

from typing import Tuple

import torch
from torch import Tensor


def heads(x: Tensor, head_size: int) -> Tensor:
    """``(T, H*head_size)`` or ``(T, H, head_size)`` as a ``(T, H, head_size)`` view."""
    return x if x.dim() == 3 else x.unflatten(-1, (-1, head_size))


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.promote_types(dtype, torch.float32)


def cos_sin(positions: Tensor, cos_sin_cache: Tensor, dtype: torch.dtype, checked: bool) -> Tuple[Tensor, Tensor]:
    """``(cos, sin)``, each ``(T, 1, r/2)`` in ``dtype``, of ``cos_sin_cache[positions]``. ``checked``:
    the positions are known to lie in the cache (gathered directly); otherwise a position outside it
    reads no row (the index is clamped) and gets NaN."""
    p = positions.reshape(-1)
    if checked:
        rows = cos_sin_cache.index_select(0, p).to(dtype)
    elif cos_sin_cache.shape[0] == 0:
        rows = cos_sin_cache.new_full((p.shape[0], cos_sin_cache.shape[1]), float("nan"), dtype=dtype)
    else:
        index = p.clamp(0, cos_sin_cache.shape[0] - 1)
        rows = torch.where((index == p)[:, None], cos_sin_cache.index_select(0, index).to(dtype), float("nan"))
    cos, sin = rows.unsqueeze(-2).chunk(2, dim=-1)
    return cos, sin


def rotated_dims(x: Tensor, cos: Tensor, sin: Tensor, is_neox: bool) -> Tensor:
    """The first ``r`` dims of every head of ``x`` ``(T, H, head_size)``, rotated, in ``x``'s dtype."""
    r = x[..., :2 * cos.shape[-1]].to(cos.dtype)
    if is_neox:  # pairs (i, i + r/2)
        x1, x2 = r.chunk(2, dim=-1)
    else:  # GPT-J: pairs (2i, 2i + 1)
        x1, x2 = r[..., 0::2], r[..., 1::2]
    o1 = x1 * cos - x2 * sin
    o2 = x2 * cos + x1 * sin
    out = torch.cat((o1, o2), dim=-1) if is_neox else torch.stack((o1, o2), dim=-1).flatten(-2)
    return out.to(x.dtype)


def rotate_(x: Tensor, cos: Tensor, sin: Tensor, is_neox: bool) -> None:
    """Rotate the heads of ``x`` ``(T, H, head_size)`` in place (dims ``r..head_size`` untouched)."""
    x[..., :2 * cos.shape[-1]].copy_(rotated_dims(x, cos, sin, is_neox))


def rotated(x: Tensor, cos: Tensor, sin: Tensor, is_neox: bool) -> Tensor:
    """The heads of ``x`` ``(T, H, head_size)`` rotated, as a new tensor (``x`` is not written)."""
    rot = rotated_dims(x, cos, sin, is_neox)
    return rot if rot.shape[-1] == x.shape[-1] else torch.cat((rot, x[..., rot.shape[-1]:]), dim=-1)


def make_cos_sin_cache(max_position: int, rot_dim: int, base: float = 10000.0, device=None, dtype=torch.float32) -> Tensor:
    """vLLM's ``RotaryEmbedding._compute_cos_sin_cache``: ``(max_position, rot_dim)``, row ``p`` holding
    ``cos(p * theta_i)`` then ``sin(p * theta_i)``, ``theta_i = base^(-2i/rot_dim)``, computed in fp64."""
    inv_freq = base ** (-torch.arange(0, rot_dim, 2, dtype=torch.float64) / rot_dim)
    angles = torch.arange(max_position, dtype=torch.float64)[:, None] * inv_freq
    return torch.cat((angles.cos(), angles.sin()), dim=-1).to(device=device, dtype=dtype)
