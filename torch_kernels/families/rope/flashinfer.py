"""FlashInfer rotary embedding: vLLM's ``rotary_embedding`` in place, through
``flashinfer.rope.apply_rope_with_cos_sin_cache_inplace(positions, query, key, head_size, cos_sin_cache,
is_neox)`` (0.6.0-0.7.4; the ``rope`` JIT module, kernel ``BatchQKApplyRotaryPosIdsCosSinCache``).

Per token ``t`` at ``p = positions[t]``: ``x1, x2 = x1 * cos[p] - x2 * sin[p], x2 * cos[p] + x1 * sin[p]``
over the first ``rot_dim`` dims of every query and key head, neox (halves) or GPT-J (interleaved)
pairs; dims ``rot_dim..head_size`` untouched. Computed in fp32 from the fp32 cache, rounded once.
Positions int32 and int64 are both read as they are (``DISPATCH_DLPACK_IDTYPE_TO_CTYPE``): no conversion.

Calls the kernel cannot take go to the next backend (``rotary_embedding_refuses``; fp16/bf16 query and
key only, ``KernelSpec.dtypes``):

* no ``key``: FlashInfer rotates query and key together and requires both;
* a cache that is not fp32 and contiguous (the kernel reads ``float*`` rows of ``rot_dim``), or
  positions that are not contiguous;
* ``head_size`` other than 64/128/256/512, the head sizes of this kernel (FlashInfer sends the others to
  its RoPE+quantize kernel, whose limits are not the ones checked here);
* ``rot_dim`` not a multiple of ``2 * vec`` (``vec = max(8, head_size / 32)`` elements a thread): a
  thread's cos/sin vector must not straddle the cos/sin halves of a cache row;
* GPT-J pairing (``is_neox=False``) when the cache's storage ends with its last row: that pairing loads
  ``vec`` sines from ``rot_dim/2 + vec/2 * thread``, i.e. ``vec/2`` floats past the row, which at the last
  row is past the allocation (an illegal address when it ends a segment); a cache with a spare row
  behind it (``torch.empty(max_pos + 1, rot_dim)[:max_pos]``) is served;
* query/key rows or heads off 16-byte alignment (16-byte loads).

FlashInfer's kernel reads a position outside the cache outside it, as vLLM's does, so this launcher
checks the positions on the data (a device sync) on every call but inside a CUDA graph capture.
"""

from typing import Optional

import flashinfer.rope as fi_rope
import torch
from torch import Tensor

from ...backends import flashinfer_jit as _module
from .tokens import flat_tokens

_HEAD_SIZES = (64, 128, 256, 512)  # DISPATCH_HEAD_DIM in BatchQKApplyRotaryPosIdsCosSinCache
_ALIGN = 16  # bytes per vector load


def _strides(x: Tensor, head_size: int):
    """The token and head strides the kernel steps by, of a validated 2-D ``(T, H*head_size)`` or 3-D
    ``(T, H, head_size)`` tensor (a dimension of size 1 is never stepped)."""
    sizes, strides = ((x.shape[0], x.shape[1]), (x.stride(0), x.stride(1))) if x.dim() == 3 else \
        ((x.shape[0], x.shape[1] // head_size), (x.stride(0), head_size))
    return [s for n, s in zip(sizes, strides) if n > 1]


def rotary_embedding_refuses(positions: Tensor, query: Tensor, key: Optional[Tensor], head_size: int,
                             cos_sin_cache: Tensor, is_neox: bool) -> Optional[str]:
    positions, query, key = flat_tokens(positions, query, key)
    if key is None:
        return "no key: FlashInfer's apply_rope_with_cos_sin_cache_inplace rotates query and key together"
    if cos_sin_cache.dtype != torch.float32 or not cos_sin_cache.is_contiguous():
        layout = "" if cos_sin_cache.is_contiguous() else ", strided"
        return f"cos_sin_cache is {cos_sin_cache.dtype}{layout}: FlashInfer reads contiguous float32 rows"
    if not positions.is_contiguous():
        return "positions are strided: FlashInfer reads them contiguous"
    if head_size not in _HEAD_SIZES:
        return f"head_size {head_size}: FlashInfer's kernel is compiled for {', '.join(map(str, _HEAD_SIZES))}"
    vec = max(_ALIGN // query.element_size(), head_size // 32)
    rot_dim = cos_sin_cache.shape[1]
    if rot_dim % (2 * vec):
        return f"rot_dim {rot_dim} is not a multiple of {2 * vec} (FlashInfer rotates {vec} dims a thread)"
    if not is_neox:
        needed = (cos_sin_cache.storage_offset() + cos_sin_cache.numel() + vec // 2) * 4
        if needed > cos_sin_cache.untyped_storage().nbytes():
            return (f"GPT-J pairing reads {vec // 2} floats past a cache row, past this cache's storage at its "
                    "last row (give the cache a spare row behind it)")
    elements = _ALIGN // query.element_size()
    for name, x in (("query", query), ("key", key)):
        if x.data_ptr() % _ALIGN or any(s % elements for s in _strides(x, head_size)):
            return f"{name} heads are not {_ALIGN}-byte aligned (FlashInfer loads 16 bytes at a time)"
    if cos_sin_cache.data_ptr() % _ALIGN:
        return f"cos_sin_cache is not {_ALIGN}-byte aligned"
    return None


def rotary_embedding(positions: Tensor, query: Tensor, key: Optional[Tensor], head_size: int,
                     cos_sin_cache: Tensor, is_neox: bool) -> None:
    positions, query, key = flat_tokens(positions, query, key)
    if query.shape[0] == 0:  # a grid of 0 blocks is a launch error
        return
    if not (positions.is_cuda and torch.cuda.is_current_stream_capturing()):
        from .ops import positions_in_cache  # loaded before any call reaches here

        positions_in_cache(positions, cos_sin_cache.shape[0])
    _module.jit_module("rope", fi_rope.gen_rope_module, fi_rope.get_rope_module)
    fi_rope.apply_rope_with_cos_sin_cache_inplace(positions, query, key, head_size, cos_sin_cache, is_neox=is_neox)
