"""FlashInfer attention-state merge: ``v = (v_a e^(lse_a - m) + v_b e^(lse_b - m)) / (e^(lse_a - m) + e^(lse_b - m))``,
``lse = m + log(e^(lse_a - m) + e^(lse_b - m))`` per token and head, ``v`` ``(T, H, D)``, ``lse`` ``(T, H)``,
through ``flashinfer.cascade.merge_state(v_a, s_a, v_b, s_b) -> (v, s)`` (0.6.0-0.7.4, the ``cascade``
JIT module), whose LSEs are base 2 (``s = lse * log2(e)``; ``exp2``/``log2`` in the kernel).

The wrapper converts both ways and restores our empty-partial rules, which FlashInfer does not have:

* in: ``s = lse * log2(e)`` into a contiguous fp32 tensor (``merge_state`` requires it; our LSEs may be
  strided, e.g. vLLM's ``(H, T)`` layout as ``lse.t()``); ``-inf`` stays ``-inf``;
* out: ``lse = s / log2(e)``;
* a partial whose LSE is ``-inf`` or FA2's ``+inf`` saw no keys: the other partial comes back exactly,
  ``v`` and LSE, and both empty give ``v_a`` and ``-inf``. FlashInfer multiplies the empty side's ``v``
  by a zero weight (NaN/Inf there would leak), gives ``0`` (0.7) or NaN (0.6) when both are empty, and
  NaN for ``+inf`` rows: two masked copies of ``v`` and two of the LSE put ours back;
* a NaN LSE against a non-empty partial makes that head NaN, as in the reference; 0.7 reads it as an
  empty partial (``max(NaN, -inf) = -inf`` before ``exp2``): one masked fill puts the NaN back.

The kernel moves three ``v``-sized tensors (reads ``v_a``, ``v_b``, writes ``v``); the fill and the two
masked copies move eight more, so the op costs about 3.7 times the bare kernel's traffic: the price of
the semantics (FlashInfer's kernel alone: 47 µs at 8192x32x128 bf16 on the H200, 4313 GB/s, against
4045 for torch.compile of the reference; docs/design/attention.md). Calls the kernel cannot take go to the next backend
(``merge_attn_states_refuses``; fp16/bf16 ``v`` only, ``KernelSpec.dtypes``):

* ``D`` other than 64/128/256/512 (the kernel's ``DISPATCH_HEAD_DIM``), or more heads than one block of
  1024 threads holds (``H * D / vec``, ``vec = max(8, D / 32)``: 128 heads of 64, 64 of 128, 32 of 256/512);
* strided ``v`` (``merge_state`` requires contiguous ``v``), misaligned ``v`` (16-byte loads), or 2^32
  elements or more (``uint32`` offsets).
"""

import math
from typing import Optional

import flashinfer.cascade as fi_cascade
import torch
from torch import Tensor

from ...backends import flashinfer_jit as _module

_LOG2E = 1.0 / math.log(2.0)
_HEAD_SIZES = (64, 128, 256, 512)
_MAX_THREADS = 1024
_ALIGN = 16


def merge_attn_states_refuses(v_a: Tensor, lse_a: Tensor, v_b: Tensor, lse_b: Tensor) -> Optional[str]:
    T, H, D = v_a.shape
    if D not in _HEAD_SIZES:
        return f"head size {D}: FlashInfer's merge_state is compiled for {', '.join(map(str, _HEAD_SIZES))}"
    threads = H * (D // max(_ALIGN // v_a.element_size(), D // 32))
    if threads > _MAX_THREADS:
        return f"{H} heads of {D} need {threads} threads in one block (FlashInfer's limit: {_MAX_THREADS})"
    if not (v_a.is_contiguous() and v_b.is_contiguous()):
        return "strided v: FlashInfer's merge_state requires contiguous v_a and v_b"
    if v_a.data_ptr() % _ALIGN or v_b.data_ptr() % _ALIGN:
        return f"v is not {_ALIGN}-byte aligned"
    if v_a.numel() >= 2**32:
        return "2^32 elements or more (FlashInfer's offsets are uint32)"
    return None


def merge_attn_states(v_a: Tensor, lse_a: Tensor, v_b: Tensor, lse_b: Tensor):
    T, H, _ = v_a.shape
    if T == 0:  # a grid of 0 blocks is a launch error
        return torch.empty_like(v_a), torch.empty((T, H), dtype=torch.float32, device=v_a.device)
    _module.jit_module("cascade", fi_cascade.gen_cascade_module, fi_cascade.get_cascade_module)
    s_a = torch.mul(lse_a, _LOG2E, out=torch.empty((T, H), dtype=torch.float32, device=v_a.device))
    s_b = torch.mul(lse_b, _LOG2E, out=torch.empty((T, H), dtype=torch.float32, device=v_a.device))
    v, lse = fi_cascade.merge_state(v_a, s_a, v_b, s_b)
    lse.div_(_LOG2E)
    a_empty, b_empty = lse_a.isinf(), lse_b.isinf()  # -inf, or FA2's +inf: the partial saw no keys
    poisoned = lse_a.isnan() | lse_b.isnan()
    v.masked_fill_(poisoned.unsqueeze(-1), math.nan)
    lse.masked_fill_(poisoned, math.nan)
    # empty partials last: the other partial exactly (NaN LSE included); both empty: v_a and -inf
    torch.where(a_empty.unsqueeze(-1), v_b, v, out=v)
    torch.where(b_empty.unsqueeze(-1), v_a, v, out=v)
    torch.where(a_empty, lse_b, lse, out=lse)
    torch.where(b_empty, lse_a.masked_fill(a_empty, -math.inf), lse, out=lse)
    return v, lse
