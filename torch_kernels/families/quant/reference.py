"""Reference DeepSeek block FP8 quantisation (``per_token_group_quant_fp8``), computed in fp32.

Per group of ``group_size`` consecutive elements of the last dimension::

    amax  = max(max|x|, eps)
    scale = amax / 448                       (448: the largest float8_e4m3fn)
    scale = 2 ** ceil(log2(scale))           (scale_ue8m0 only; the exact power-of-two ceiling)
    q     = clamp(x / scale, -448, 448).to(float8_e4m3fn)   (round to nearest even)

Both divisions are IEEE fp32 divisions (correctly rounded), as in vLLM's CUDA kernel. The arguments
arrive validated (``ops.py``).
"""

from typing import Tuple

import torch
from torch import Tensor

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0  # torch.finfo(torch.float8_e4m3fn).max


def empty_outputs(input: Tensor, group_size: int, column_major_scales: bool) -> Tuple[Tensor, Tensor]:
    """``q (..., H)`` float8_e4m3fn contiguous, and the fp32 scales ``(..., H/group_size)``.

    Column-major scales are the layout DeepGEMM reads: the storage is ``(H/group_size, T)`` row-major
    (``T`` the token count, the product of the leading dims), seen as ``(..., H/group_size)``; for 2-D
    input that is vLLM's ``torch.empty((G, T)).permute(1, 0)``, strides ``(1, T)``. No TMA padding of
    ``T``. The fake function (``families/quant/ops.py``) builds the same layout."""
    groups = input.shape[-1] // group_size
    q = torch.empty(input.shape, dtype=FP8, device=input.device)
    if column_major_scales:
        s = torch.empty((groups, *input.shape[:-1]), dtype=torch.float32, device=input.device).movedim(0, -1)
    else:
        s = torch.empty((*input.shape[:-1], groups), dtype=torch.float32, device=input.device)
    return q, s


def pow2_ceil(scale: Tensor) -> Tensor:
    """The smallest power of two ``>= scale`` for fp32 ``scale >= 0``, exactly, from the bits: a
    nonzero mantissa carries into the exponent, then the mantissa is dropped. 0, inf and NaN stay.
    (vLLM's ``exp2(ceil(log2(s)))`` in fp32 rounds down when ``s`` is a few ulp above a power of two,
    because ``log2`` rounds to the integer; this does not.)"""
    bits = scale.view(torch.int32)
    up = ((bits + 0x7FFFFF) & 0x7F800000).view(torch.float32)
    return torch.where(torch.isnan(scale), scale, up)


def per_token_group_quant_fp8(input: Tensor, group_size: int, eps: float = 1e-10,
                              column_major_scales: bool = False, scale_ue8m0: bool = False) -> Tuple[Tensor, Tensor]:
    x = input.to(torch.float32).unflatten(-1, (-1, group_size))  # (..., G, group_size)
    if column_major_scales:
        # scales computed as (G, ...) and returned as a view, so the decomposed graph keeps the layout: a
        # (..., G) result copied into it came back row-major from Inductor with an unbacked token count
        x = x.movedim(-2, 0)  # (G, ..., group_size)
    # amax propagates NaN and clamp keeps it: a group holding a NaN gets a NaN scale and NaN q.
    amax = x.abs().amax(-1).clamp(min=eps)  # (..., G), or (G, ...) for column-major scales
    # Divide by a tensor, not a Python scalar: on CUDA `t / 448` multiplies by fp32(1/448), which is
    # not correctly rounded (one ulp off for about half of all scales).
    scale = (amax / torch.full_like(amax, FP8_MAX)).contiguous()
    if scale_ue8m0:
        scale = pow2_ceil(scale)
    q = (x / scale.unsqueeze(-1)).clamp(-FP8_MAX, FP8_MAX)
    if column_major_scales:
        q, scale = q.movedim(0, -2), scale.movedim(0, -1)
    return q.flatten(-2).to(FP8), scale
