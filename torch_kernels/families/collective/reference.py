"""The collective family's reference: ``torch.distributed``'s all-reduce, then the registered fused
norm (our kernel on CUDA), as the ops' docstrings define them."""

from typing import Optional

import torch
import torch.distributed as dist
from torch import Tensor


def _group(group_name: str):
    return dist.distributed_c10d._resolve_process_group(group_name)


def all_reduce_fused_add_rmsnorm(input: Tensor, residual: Tensor, weight: Tensor, eps: float, group_name: str) -> None:
    if input.is_contiguous():
        dist.all_reduce(input, group=_group(group_name))
    else:  # NCCL reduces contiguous tensors only ("Tensors must be contiguous"): strided rows go by a copy
        reduced = input.clone(memory_format=torch.contiguous_format)
        dist.all_reduce(reduced, group=_group(group_name))
        input.copy_(reduced)
    torch.ops.deepinfer.fused_add_rmsnorm.default(input, residual, weight, eps)


def all_reduce_fused_add_rmsnorm_fp8_quant(input: Tensor, residual: Tensor, weight: Tensor, eps: float, group_name: str,
                                           scale: Optional[Tensor] = None, group_size: int = -1,
                                           column_major_scales: bool = False, scale_ue8m0: bool = False):
    reduced = input.clone(memory_format=torch.contiguous_format)
    dist.all_reduce(reduced, group=_group(group_name))
    return torch.ops.deepinfer.fused_add_rmsnorm_fp8_quant.default(reduced, residual, weight, eps, scale, group_size,
                                                                   column_major_scales, scale_ue8m0)
