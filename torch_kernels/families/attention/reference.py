"""Reference attention-state merge, computed in fp32 and cast back.

Takes already-validated arguments (``ops.py`` validates): ``v_a``/``v_b``
``(T, H, D)`` fp16/bf16/fp32, ``lse_a``/``lse_b`` ``(T, H)`` fp32 natural-log LSE. Returns contiguous
``(v, lse)``. Empty partials as vLLM's CUDA kernel treats them (see ``families/attention/ops.py``).
"""

import torch
from torch import Tensor

_INF = float("inf")


def merge_attn_states(v_a: Tensor, lse_a: Tensor, v_b: Tensor, lse_b: Tensor):
    # +inf is FlashAttention-2's LSE for a row that saw no keys (FA3 writes -inf): read both as -inf.
    a = lse_a.masked_fill(lse_a == _INF, -_INF)
    b = lse_b.masked_fill(lse_b == _INF, -_INF)
    a_empty, b_empty = a == -_INF, b == -_INF
    m = torch.maximum(a, b)
    ea, eb = torch.exp(a - m), torch.exp(b - m)  # NaN where both are empty: replaced below
    s = ea + eb
    # The weights first, then the values (vLLM's note: never v * exp(lse - m) / s).
    wa, wb = (ea / s).unsqueeze(-1), (eb / s).unsqueeze(-1)
    va, vb = v_a.float(), v_b.float()
    mixed = va * wa + vb * wb
    # An empty partial is not read into the result (its v may be NaN or Inf); both empty: v_a.
    v = torch.where(b_empty.unsqueeze(-1), va, torch.where(a_empty.unsqueeze(-1), vb, mixed))
    lse = torch.where(b_empty, a, torch.where(a_empty, b, m + torch.log(s)))
    return v.to(v_a.dtype).contiguous(), lse.contiguous()
