"""Reference RMSNorm family, computed in fp32 (or in the input's dtype where wider) and cast back.

These functions take already-validated arguments (``ops.py`` validates) and return
contiguous outputs; the in-place ops write into ``input`` and ``residual`` and return nothing.
"""

import torch
from torch import Tensor


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """fp32, or the input's dtype where it is wider (fp64)."""
    return torch.promote_types(dtype, torch.float32)


def _normalize(x: Tensor, weight: Tensor, eps: float, gemma: bool) -> Tensor:
    """``x * rsqrt(mean(x^2, -1) + eps) * w`` in ``x``'s (compute) dtype; ``w`` is ``1 + weight`` for Gemma."""
    w = weight.to(x.dtype)
    if gemma:
        w = w + 1.0
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def rmsnorm(input: Tensor, weight: Tensor, eps: float = 1e-6) -> Tensor:
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


def fused_add_rmsnorm(input: Tensor, residual: Tensor, weight: Tensor, eps: float = 1e-6) -> None:
    _fused_add(input, residual, weight, eps, gemma=False)


def gemma_fused_add_rmsnorm(input: Tensor, residual: Tensor, weight: Tensor, eps: float = 1e-6) -> None:
    _fused_add(input, residual, weight, eps, gemma=True)
