"""The weight of ones every backend's kernel is given for ``weight=None``: the product with 1 is exact, so
the result is bit for bit the unscaled norm. Triton too: the weight's load is one of the accesses that set
the row's layout (a kernel without it failed the bit-for-bit test for fp32 on the H200)."""

import torch
from torch import Tensor

_ones: dict = {}  # (device, dtype, N) -> (N,) ones: N * 2 bytes each, kept for the process


def ones_like_row(input: Tensor) -> Tensor:
    """``(N,)`` ones in ``input``'s dtype on its device, cached; one made during a CUDA graph capture is
    not kept (its fill runs only when the graph replays), so a capture after an eager call takes the cached one."""
    key = (input.device, input.dtype, input.shape[-1])
    w = _ones.get(key)
    if w is None:
        w = torch.ones(input.shape[-1], dtype=input.dtype, device=input.device)
        if not (w.is_cuda and torch.cuda.is_current_stream_capturing()):
            _ones[key] = w
    return w
