"""Reference gated activations, computed in fp32 (or in the input's dtype where wider) and cast back.

These functions take already-validated arguments (``ops.py`` validates):
``input`` is ``(..., 2d)`` with its last dimension contiguous; the output is ``(..., d)``, contiguous.
"""

from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor

from ... import fp8


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """fp32, or the input's dtype where it is wider (fp64)."""
    return torch.promote_types(dtype, torch.float32)


def _act_and_mul(input: Tensor, act) -> Tensor:
    d = input.shape[-1] // 2
    x = input.to(compute_dtype(input.dtype))
    # One rounding, at the end (as the fused CUDA kernels of vLLM and FlashInfer keep the product in
    # fp32); .contiguous() because elementwise ops keep a permuted input's layout.
    return (act(x[..., :d]) * x[..., d:]).to(input.dtype).contiguous()


def silu_and_mul(input: Tensor) -> Tensor:
    return _act_and_mul(input, F.silu)


def gelu_and_mul(input: Tensor, approximate: str = "none") -> Tensor:
    return _act_and_mul(input, lambda g: F.gelu(g, approximate=approximate))


def gelu_tanh_and_mul(input: Tensor) -> Tensor:
    return _act_and_mul(input, lambda g: F.gelu(g, approximate="tanh"))


def silu_and_mul_fp8_quant(input: Tensor, scale: Optional[Tensor] = None, group_size: int = -1,
                           column_major_scales: bool = False, scale_ue8m0: bool = False):
    # exactly silu_and_mul, then the quant op: the epilogue of torch_kernels/fp8.py
    return fp8.quantize(silu_and_mul(input), scale, group_size, column_major_scales, scale_ue8m0)
