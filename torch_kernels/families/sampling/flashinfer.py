"""FlashInfer top-k/top-p sampling: ``ids[b] ~ top_p_renorm(top_k_renorm(probs[b], top_k[b]), top_p[b])``,
one int32 id per row, through the two steps of FlashInfer's ``filter_apply_order="top_k_first"``:
``flashinfer.sampling.top_k_renorm_probs`` then ``top_p_sampling_from_probs(..., deterministic=True,
seed, offset)`` (the ``sampling`` JIT module only: with a per-row ``top_k`` tensor neither 0.6.18 nor
0.7.4 takes the radix top-k fast path of ``top_k_top_p_sampling_from_probs``). The steps are called
directly because the combined function leaves the renormalising sum non-deterministic (0.7.4 passes no
``is_deterministic``; its float atomics across CTAs change the last bits run to run at vocabularies
that need several CTAs a row, over about 57000 on an H200).

Same kept set and distribution as the reference, another random stream: FlashInfer draws with curand's
Philox (``curand_init(seed, row, offset)``), so for one ``(seed, offset)`` the ids differ from the torch
and Triton backends' (announced once on stderr at the first call), while each is deterministic and a row's
draw does not depend on the batch. FlashInfer decides the top-p boundary in fp32 on renormalised
values where the reference compares exact fixed-point masses, so a token within fp32 rounding of the
boundary (or below 2^-44 of the row's largest, massless in the reference) can be in one set and not
the other.

The wrapper converts what FlashInfer reads differently (a few elementwise passes over ``probs``):

* ``probs``: NaN and negatives to 0, ``+inf`` to the largest fp32 (the reference's reading), then scaled
  by a power of two (exact) so each row's largest value lies in [0.5, 1): FlashInfer renormalises by
  ``1 / max(sum, 1e-8)``, which would break rows of smaller total mass (probs need not be normalised);
  the result is contiguous, so strided rows are served;
* ``top_k``: ``<= 0`` or ``>= V`` to ``V``, as int32 (FlashInfer documents ``top_k`` in ``(0, V)``; it reads
  it as ``uint32``, so an int64 past 2^32 would wrap);
* ``top_p``: ``>= 1`` to 2 (FlashInfer keeps a token while the mass above it is ``< top_p`` on sums that
  round to 1), ``<= 0`` and NaN to 1e-30 (the largest value, ties included, as in the reference);
* ``seed``/``offset``: one-element int64 tensors, passed as ``(1,)`` views, read on the device (CUDA
  graphs capture them). FlashInfer releases whose ``seed`` takes no tensor (0.6.0) get ``.item()``,
  refused while a CUDA graph is being captured.

``filter_apply_order="joint"`` is FlashInfer's one-kernel joint sampler, on rows normalised to sum 1
(its top-p test compares the mass above a token with ``top_p`` itself). ``indices`` are passed to
FlashInfer (its top-p step reads ``probs[indices[i]]`` and that row's parameters), the ids cast to
int32. Per-row ``seed``/``offset`` tensors are passed as FlashInfer 0.7 takes them (its stream still
includes the output row's index).

Refused (``top_k_top_p_sampling_from_probs_refuses``): 2^32 elements or more (``uint32`` offsets);
without ``top_k_renorm_probs(is_deterministic=)`` (0.6.x; 0.7.4 has it), vocabularies above one CTA a
row, whose float-atomic sums would make a ``(seed, offset)`` draw differently run to run; per-row seeds
or offsets where FlashInfer takes them as ints only.
"""

import functools
import inspect
from typing import Optional

import flashinfer.sampling as fi_sampling
import torch
from torch import Tensor

from ...backends import flashinfer_jit as _module

_FLT_MAX = torch.finfo(torch.float32).max
_FLT_MIN = torch.finfo(torch.float32).tiny
_TOP_P_OFF = 2.0  # above any sum of renormalised probabilities
_TOP_P_MIN = 1e-30  # below any mass above a token other than the largest
_RADIX_FIXED_SMEM = 2080  # bytes of RadixTopKRenormProb's shared memory besides its chunk of the row

_TENSOR_SEEDS = "Tensor" in str(inspect.signature(fi_sampling.top_p_sampling_from_probs).parameters["seed"].annotation)
_DETERMINISTIC_RENORM = "is_deterministic" in inspect.signature(fi_sampling.top_k_renorm_probs).parameters


def _capturing(probs: Tensor) -> bool:
    return probs.is_cuda and torch.cuda.is_current_stream_capturing()


@functools.lru_cache(maxsize=None)
def _one_cta_vocab(device: torch.device) -> int:
    """The largest vocabulary whose row one CTA of FlashInfer's radix top-k holds in shared memory (fp32)."""
    return (_module.max_shared_bytes(device) - _RADIX_FIXED_SMEM) // 16 * 4  # rounded down to whole 4-element loads


def top_k_top_p_sampling_from_probs_refuses(probs: Tensor, maybe_top_k_arr: Optional[Tensor],
                                            maybe_top_p_arr: Optional[Tensor], seed: Tensor, offset: Tensor,
                                            top_k_val: int = 0, top_p_val: float = 1.0,
                                            filter_apply_order: str = "top_k_first",
                                            indices: Optional[Tensor] = None) -> Optional[str]:
    if probs.numel() >= 2**32:
        return "2^32 elements or more (FlashInfer's offsets are uint32)"
    if not _TENSOR_SEEDS and (seed.numel() != 1 or offset.numel() != 1):
        return f"FlashInfer {_module.VERSION_TEXT} takes seed/offset as ints: per-row seeds or offsets are not taken"
    if (filter_apply_order == "top_k_first" and not _DETERMINISTIC_RENORM
            and probs.shape[1] > _one_cta_vocab(probs.device)):
        return (f"vocabulary {probs.shape[1]} needs several CTAs a row in FlashInfer {_module.VERSION_TEXT}'s "
                "top_k_renorm_probs, whose float-atomic sums are not reproducible per (seed, offset)")
    if not _TENSOR_SEEDS and _capturing(probs):
        return f"FlashInfer {_module.VERSION_TEXT} takes seed/offset as ints: reading them would break the CUDA graph capture"
    return None


def _probs(probs: Tensor) -> Tensor:
    """``probs`` as the reference reads them, each row scaled by a power of two to a maximum in [0.5, 1)."""
    p = torch.fmax(probs, probs.new_zeros(()), out=torch.empty(probs.shape, dtype=torch.float32, device=probs.device))
    p.clamp_(max=_FLT_MAX)
    # max = m * 2^e with m in [0.5, 1); 2^-e built from its exponent bits (exact), e kept to normal scales
    exponent = torch.frexp(p.amax(-1, keepdim=True)).exponent.clamp_(-126, 126)
    p.mul_(((127 - exponent) << 23).view(torch.float32))
    return p


def top_k_top_p_sampling_from_probs(probs: Tensor, maybe_top_k_arr: Optional[Tensor], maybe_top_p_arr: Optional[Tensor],
                                    seed: Tensor, offset: Tensor, top_k_val: int = 0, top_p_val: float = 1.0,
                                    filter_apply_order: str = "top_k_first", indices: Optional[Tensor] = None) -> Tensor:
    B, V = probs.shape
    rows = B if indices is None else indices.shape[0]
    if B == 0 or rows == 0:  # a grid of 0 blocks is a launch error
        return torch.empty(rows, dtype=torch.int32, device=probs.device)
    _module.jit_module("sampling", fi_sampling.gen_sampling_module, fi_sampling.get_sampling_module)
    _module.notice_once("sampling", (
        f"top_k_top_p_sampling_from_probs from 'flashinfer' {_module.VERSION_TEXT}: the reference's kept set and "
        "distribution, FlashInfer's random stream (the ids differ from the torch/Triton backends' for the same "
        "seed and offset; the top-p boundary is decided in fp32)"))
    if maybe_top_k_arr is None:  # scalars stay scalars: FlashInfer takes either
        k = top_k_val if 0 < top_k_val < V else V
    else:
        k = torch.where((maybe_top_k_arr > 0) & (maybe_top_k_arr < V), maybe_top_k_arr, V).to(torch.int32)
    if maybe_top_p_arr is None:
        p = _TOP_P_OFF if top_p_val >= 1.0 else top_p_val if top_p_val > _TOP_P_MIN else _TOP_P_MIN  # NaN: the minimum
    else:
        top_p = maybe_top_p_arr
        p = torch.where(top_p >= 1.0, _TOP_P_OFF, torch.where(top_p > _TOP_P_MIN, top_p, _TOP_P_MIN))
    if _TENSOR_SEEDS:
        seed, offset = seed.reshape(-1), offset.reshape(-1)  # (1,) or one per output row
    else:
        seed, offset = int(seed.item()), int(offset.item())  # int64 values; FlashInfer's FFI casts to uint64
    if filter_apply_order == "joint":
        rows_p = _probs(probs)
        rows_p.div_(rows_p.sum(-1, keepdim=True).clamp_(min=_FLT_MIN))  # its top-p compares masses with top_p
        ids = fi_sampling.top_k_top_p_sampling_from_probs(rows_p, k, p, indices=indices, filter_apply_order="joint",
                                                          deterministic=True, seed=seed, offset=offset)
        return ids.to(torch.int32)
    renorm = fi_sampling.top_k_renorm_probs(_probs(probs), k, **({"is_deterministic": True} if _DETERMINISTIC_RENORM else {}))
    ids = fi_sampling.top_p_sampling_from_probs(renorm, p, indices=indices, deterministic=True, seed=seed, offset=offset)
    return ids.to(torch.int32)  # FlashInfer returns the dtype of indices
