"""FlashInfer RMSNorm family: ``out = x * rsqrt(mean(x^2, -1) + eps) * w`` (``* (1 + w)`` for Gemma) over
rows ``(T, N)``, on FlashInfer's CUDA norm kernels (``flashinfer.norm.get_norm_module()``: ``rmsnorm``,
``gemma_rmsnorm``, ``fused_add_rmsnorm``, ``gemma_fused_add_rmsnorm``; ``include/flashinfer/norm.cuh``).

The fused ops have our contract exactly: ``residual += input`` and ``input = norm(residual) * w`` in
place, the sum taken in fp32, written rounded into ``residual`` and normalised unrounded (it stays in
fp32 shared memory), as the reference does. Everything is computed in fp32 and rounded once.

Why the module and not ``flashinfer.norm.rmsnorm``: in 0.6.18 and 0.7.4 the public functions run CuTe-DSL
kernels instead whenever ``nvidia-cutlass-dsl`` is installed (compiled per hidden size at first use,
with other layout assumptions); the module holds the CUDA kernels that every 0.6.x and 0.7.x runs
otherwise, the ones whose limits are refused below and that a saved FlashInfer JIT cache holds.
Its functions take the same arguments in 0.6.0-0.7.4: ``rmsnorm(out, input, weight, eps, enable_pdl)``
and ``fused_add_rmsnorm(input, residual, weight, eps, enable_pdl)``.

Calls the kernels cannot take go to the next backend (``<op>_refuses``, and fp16/bf16 only through
``KernelSpec.dtypes``: the kernels dispatch on those two types):

* a weight of another dtype than the input: the kernels read it as the input's type;
  ``weight=None`` is served with a cached weight of ones in the input's dtype (``unit_weight.py``);
* misaligned rows: each thread loads ``vec = gcd(8, N)`` elements, so every row start and the weight
  must sit on ``2 * vec`` bytes;
* rows that do not form one ``(T, N)`` view, or reach past 2^32 elements (``uint32`` row offsets);
* fused ops whose row, ``4 N`` bytes of fp32 in shared memory, exceeds the device's opt-in shared
  memory per block (N above about 58000 on an H200).
"""

import math
from typing import Optional

import flashinfer.norm as fi_norm
import torch
from flashinfer.utils import device_support_pdl
from torch import Tensor

from ... import outputs
from ...backends.rows import rows_view
from ...backends import flashinfer_jit as _module
from .unit_weight import ones_like_row

_MAX_VEC = 8  # elements per 16-byte load of fp16/bf16: the kernels use gcd(8, N)
_MAX_THREADS = 1024  # threads per block: min(1024, N / vec)
_UINT32 = 2**32  # row offsets are uint32 products row * stride


def _kernels():
    return _module.jit_module("norm", fi_norm.gen_norm_module, fi_norm.get_norm_module)


def _refuses(input: Tensor, weight: Tensor, residual: Optional[Tensor] = None) -> Optional[str]:
    if weight.dtype != input.dtype:
        return f"weight is {weight.dtype}, input {input.dtype}: FlashInfer reads the weight as the input's type"
    n = input.shape[-1]
    vec = math.gcd(_MAX_VEC, n)
    align = vec * input.element_size()
    if weight.data_ptr() % align:
        return f"weight is not {align}-byte aligned (FlashInfer loads {vec} elements at a time)"
    for name, t in (("input", input), ("residual", residual)):
        if t is None:
            continue
        rows = rows_view(t)
        if rows is None:
            return f"the leading dims of {name} do not collapse into one row stride"
        if rows.data_ptr() % align or (rows.shape[0] > 1 and rows.stride(0) % vec):
            return f"{name} rows are not {align}-byte aligned (FlashInfer loads {vec} elements at a time)"
        if max(rows.shape[0] - 1, 0) * rows.stride(0) + n > _UINT32:
            return f"{name} reaches past 2^32 elements (FlashInfer's row offsets are uint32)"
    if residual is not None and input.numel():
        warps = math.ceil(min(_MAX_THREADS, n // vec) / 32)
        smem = (math.ceil(warps / 4) * 4 + n) * 4  # FusedAddRMSNorm keeps the fp32 row in shared memory
        limit = _module.max_shared_bytes(input.device)
        if smem > limit:
            return f"hidden size {n} needs {smem} bytes of shared memory, more than the device's {limit}"
    return None


def _norm(input: Tensor, weight: Tensor, eps: float, gemma: bool, out=None) -> Tensor:
    if out is None:
        y = torch.empty(input.shape, dtype=input.dtype, device=input.device)
    else:
        y = outputs.given(out, 0, input.shape, input.dtype, input.device)
    rows = rows_view(input)
    if rows.shape[0]:  # a grid of 0 blocks is a launch error
        kernels = _kernels()
        (kernels.gemma_rmsnorm if gemma else kernels.rmsnorm)(
            y.view(rows.shape), rows, weight, eps, device_support_pdl(input.device))
    return y


def _fused_add(input: Tensor, residual: Tensor, weight: Tensor, eps: float, gemma: bool) -> None:
    x, res = rows_view(input), rows_view(residual)
    if x.shape[0]:
        kernels = _kernels()
        (kernels.gemma_fused_add_rmsnorm if gemma else kernels.fused_add_rmsnorm)(
            x, res, weight, eps, device_support_pdl(input.device))


def rmsnorm(input: Tensor, weight: Optional[Tensor], eps: float = 1e-6, *, out=None) -> Tensor:
    # no weight: the kernels read one, so a weight of ones in the input's dtype (a product with 1 is exact)
    return _norm(input, ones_like_row(input) if weight is None else weight, eps, gemma=False, out=out)


def gemma_rmsnorm(input: Tensor, weight: Tensor, eps: float = 1e-6, *, out=None) -> Tensor:
    return _norm(input, weight, eps, gemma=True, out=out)


def fused_add_rmsnorm(input: Tensor, residual: Tensor, weight: Optional[Tensor], eps: float = 1e-6) -> None:
    _fused_add(input, residual, ones_like_row(input) if weight is None else weight, eps, gemma=False)


def gemma_fused_add_rmsnorm(input: Tensor, residual: Tensor, weight: Tensor, eps: float = 1e-6) -> None:
    _fused_add(input, residual, weight, eps, gemma=True)


def rmsnorm_refuses(input: Tensor, weight: Optional[Tensor], eps: float = 1e-6) -> Optional[str]:
    return _refuses(input, ones_like_row(input) if weight is None else weight)


def gemma_rmsnorm_refuses(input: Tensor, weight: Tensor, eps: float = 1e-6) -> Optional[str]:
    return _refuses(input, weight)


def fused_add_rmsnorm_refuses(input: Tensor, residual: Tensor, weight: Optional[Tensor], eps: float = 1e-6) -> Optional[str]:
    return _refuses(input, ones_like_row(input) if weight is None else weight, residual)


def gemma_fused_add_rmsnorm_refuses(input: Tensor, residual: Tensor, weight: Tensor, eps: float = 1e-6) -> Optional[str]:
    return _refuses(input, weight, residual)
