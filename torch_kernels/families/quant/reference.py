"""Reference FP8 activation quantisation: ``per_token_group_quant_fp8`` and ``scaled_fp8_quant``,
computed in fp32 by the shared numerics of ``torch_kernels/fp8.py`` (its docstring has the formulas),
so that the fused norm and activation ops, which end in the same functions, equal these bit for bit.
The arguments arrive validated (``ops.py``).
"""

from typing import Optional, Tuple

from torch import Tensor

from ... import fp8
from ...fp8 import FP8, FP8_MAX, pow2_ceil  # noqa: F401  (the Triton and TileLang kernels take them from here)


def empty_outputs(input: Tensor, group_size: int, column_major_scales: bool, out=None) -> Tuple[Tensor, Tensor]:
    """``q (..., H)`` float8_e4m3fn contiguous, and the fp32 group scales ``(..., H/group_size)``
    (layouts: :func:`torch_kernels.fp8.group_scales_empty`); ``out``: the out overload's, checked."""
    return fp8.empty_outputs(input, input.shape[-1], None, group_size, column_major_scales, out=out)


def per_token_group_quant_fp8(input: Tensor, group_size: int, eps: float = 1e-10,
                              column_major_scales: bool = False, scale_ue8m0: bool = False) -> Tuple[Tensor, Tensor]:
    return fp8.quantize_groups(input, group_size, eps, column_major_scales, scale_ue8m0)


def scaled_fp8_quant(input: Tensor, scale: Optional[Tensor] = None, per_token: bool = False,
                     scale_ub: Optional[Tensor] = None) -> Tuple[Tensor, Tensor]:
    if scale is not None:
        q, s = fp8.quantize_static(input, scale)
    elif per_token:
        q, s = fp8.quantize_per_token(input, scale_ub)
    else:
        q, s = fp8.quantize_per_tensor(input)
    return q.contiguous(), s.contiguous()
