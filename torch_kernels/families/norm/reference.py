"""Reference RMSNorm family, computed in fp32 (or in the input's dtype where wider) and cast back.

These functions take already-validated arguments (``ops.py`` validates) and return
contiguous outputs; the in-place ops write into ``input`` and ``residual`` and return nothing.
"""

from typing import Optional

import torch
from torch import Tensor

from ... import fp8


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """fp32, or the input's dtype where it is wider (fp64)."""
    return torch.promote_types(dtype, torch.float32)


def _normalize(x: Tensor, weight: Optional[Tensor], eps: float, gemma: bool) -> Tensor:
    """``x * rsqrt(mean(x^2, -1) + eps) * w`` in ``x``'s (compute) dtype; ``w`` is ``1 + weight`` for Gemma;
    no weight: no scale, bit for bit ``w = 1`` (a product with 1 is exact)."""
    if weight is None:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    w = weight.to(x.dtype)
    if gemma:
        w = w + 1.0
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def rmsnorm(input: Tensor, weight: Optional[Tensor], eps: float = 1e-6) -> Tensor:
    x = input.to(compute_dtype(input.dtype))
    return _normalize(x, weight, eps, gemma=False).to(input.dtype).contiguous()


def gemma_rmsnorm(input: Tensor, weight: Tensor, eps: float = 1e-6) -> Tensor:
    x = input.to(compute_dtype(input.dtype))
    return _normalize(x, weight, eps, gemma=True).to(input.dtype).contiguous()


def _fused_add(input: Tensor, residual: Tensor, weight: Tensor, eps: float, gemma: bool) -> None:
    # The sum is normalised before rounding to the residual's dtype (FlashInfer and vLLM's
    # forward_native do the same), so both outputs come from one fp32 value.
    s = input.to(compute_dtype(input.dtype)) + residual.to(compute_dtype(residual.dtype))
    residual.copy_(s)
    input.copy_(_normalize(s, weight, eps, gemma))


def fused_add_rmsnorm(input: Tensor, residual: Tensor, weight: Optional[Tensor], eps: float = 1e-6) -> None:
    _fused_add(input, residual, weight, eps, gemma=False)


def gemma_fused_add_rmsnorm(input: Tensor, residual: Tensor, weight: Tensor, eps: float = 1e-6) -> None:
    _fused_add(input, residual, weight, eps, gemma=True)


# The FP8 ops: the norm rounded to the input's dtype, then torch_kernels.fp8's epilogue, exactly the
# unfused pair (the norm's reference, then the quant family's).


def _norm_quant(input: Tensor, weight: Tensor, eps: float, scale: Optional[Tensor], group_size: int,
                column_major: bool, ue8m0: bool, gemma: bool):
    y = _normalize(input.to(compute_dtype(input.dtype)), weight, eps, gemma).to(input.dtype)
    return fp8.quantize(y, scale, group_size, column_major, ue8m0)


def _fused_quant(input: Tensor, residual: Tensor, weight: Tensor, eps: float, scale: Optional[Tensor],
                 group_size: int, column_major: bool, ue8m0: bool, gemma: bool):
    s = input.to(compute_dtype(input.dtype)) + residual.to(compute_dtype(residual.dtype))
    residual.copy_(s)
    y = _normalize(s, weight, eps, gemma).to(input.dtype)
    return fp8.quantize(y, scale, group_size, column_major, ue8m0)


def rmsnorm_fp8_quant(input: Tensor, weight: Tensor, eps: float = 1e-6, scale: Optional[Tensor] = None,
                      group_size: int = -1, column_major_scales: bool = False, scale_ue8m0: bool = False):
    return _norm_quant(input, weight, eps, scale, group_size, column_major_scales, scale_ue8m0, gemma=False)


def gemma_rmsnorm_fp8_quant(input: Tensor, weight: Tensor, eps: float = 1e-6, scale: Optional[Tensor] = None,
                            group_size: int = -1, column_major_scales: bool = False, scale_ue8m0: bool = False):
    return _norm_quant(input, weight, eps, scale, group_size, column_major_scales, scale_ue8m0, gemma=True)


def fused_add_rmsnorm_fp8_quant(input: Tensor, residual: Tensor, weight: Tensor, eps: float = 1e-6,
                                scale: Optional[Tensor] = None, group_size: int = -1,
                                column_major_scales: bool = False, scale_ue8m0: bool = False):
    return _fused_quant(input, residual, weight, eps, scale, group_size, column_major_scales, scale_ue8m0, gemma=False)


def gemma_fused_add_rmsnorm_fp8_quant(input: Tensor, residual: Tensor, weight: Tensor, eps: float = 1e-6,
                                      scale: Optional[Tensor] = None, group_size: int = -1,
                                      column_major_scales: bool = False, scale_ue8m0: bool = False):
    return _fused_quant(input, residual, weight, eps, scale, group_size, column_major_scales, scale_ue8m0, gemma=True)
