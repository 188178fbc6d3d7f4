"""Triton paged KV-cache writes: one program per (token, chunk of heads).

``reshape_and_cache_flash``: a program reads its token's slot, then copies (or quantises to e4m3)
``BLOCK_H`` heads of ``key`` and ``value`` into their cache rows. ``rotary_embedding_and_cache``: a
program per token rotates the query heads in place and the key heads in registers, and stores the
rotated key and the value into the cache; the rotation is the rope family's, expression for
expression, so that the fused op equals ``rotary_embedding`` then ``reshape_and_cache_flash``.

A slot outside ``[0, num_slots)`` masks every store of its token (nothing is written). The fp8
value is ``div_rn(x, scale)`` (IEEE: Triton's ``/`` is ``div.full.f32``) cast with
``cvt.rn.satfinite`` (emulated in the interpreter, ``backends/triton_fp8.py``). Strides are runtime
values; the token count is the grid, so no batch size compiles again.
"""

import functools
from dataclasses import dataclass
from typing import Optional

import torch
import triton
import triton.language as tl
from torch import Tensor

from ...backends import triton_fp8 as _fp8

# Elements a program moves per tensor when many tokens: 8 heads of 128 (Qwen3-8B's kv heads) in one.
_TILE = 1024
# Below this many tokens each program takes one head, so that a decode batch still fills the SMs.
_FEW_TOKENS = 256


@dataclass(frozen=True)
class TritonCacheConfig:
    """How the cache-write kernel is launched; :meth:`for_shape` is what the launcher uses."""

    block_h: int  # heads a program
    num_warps: int

    @classmethod
    @functools.lru_cache(maxsize=None)
    def for_shape(cls, num_tokens: int, heads: int, block_d: int) -> "TritonCacheConfig":
        block_h = 1 if num_tokens < _FEW_TOKENS else min(triton.next_power_of_2(heads), max(1, _TILE // block_d))
        return cls(block_h, max(1, min(4, block_h * block_d // 256)))


@triton.jit
def _store_rows(k, v, kc_row, vc_row, kc_head, vc_head, heads, d, mask, k_scale_ptr, v_scale_ptr,
                QUANT: tl.constexpr, EMULATE: tl.constexpr):
    """Store ``(BLOCK_H, BLOCK_D)`` fp32-or-native tiles ``k``/``v`` at the cache rows, quantised with ``QUANT``."""
    kp = kc_row + heads.to(tl.int64)[:, None] * kc_head + d[None, :]
    vp = vc_row + heads.to(tl.int64)[:, None] * vc_head + d[None, :]
    if QUANT:
        ks = tl.load(k_scale_ptr).to(tl.float32)
        vs = tl.load(v_scale_ptr).to(tl.float32)
        kq = _fp8.to_e4m3(tl.math.div_rn(k.to(tl.float32), ks), kc_row.dtype.element_ty, EMULATE)
        vq = _fp8.to_e4m3(tl.math.div_rn(v.to(tl.float32), vs), vc_row.dtype.element_ty, EMULATE)
        tl.store(kp, kq, mask=mask)
        tl.store(vp, vq, mask=mask)
    else:
        tl.store(kp, k.to(kc_row.dtype.element_ty), mask=mask)
        tl.store(vp, v.to(vc_row.dtype.element_ty), mask=mask)


@triton.jit
def _cache_kernel(
    k_ptr, k_tok, k_head,  # key (T, H, D): token and head strides in elements
    v_ptr, v_tok, v_head,
    kc_ptr, kc_blk, kc_page, kc_head,  # key cache (num_blocks, B, H, D): block, slot and head strides
    vc_ptr, vc_blk, vc_page, vc_head,
    slot_ptr, slot_stride,  # slot_mapping (T,) int64
    k_scale_ptr, v_scale_ptr,  # fp32 per-tensor scales (read with QUANT only)
    num_slots, block_size, num_heads, head_size,
    BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr, QUANT: tl.constexpr, EMULATE: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    heads = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    slot = tl.load(slot_ptr + t * slot_stride)
    ok = (slot >= 0) & (slot < num_slots)  # -1 (padding) and slots outside the cache write nothing
    slot = tl.where(ok, slot, 0)
    blk = slot // block_size
    page = slot % block_size
    d = tl.arange(0, BLOCK_D)
    # one comparison for both conditions (a scalar & vector mask trips the interpreter)
    mask = (heads < num_heads)[:, None] & (d < tl.where(ok, head_size, 0))[None, :]
    h64 = heads.to(tl.int64)[:, None]
    k = tl.load(k_ptr + t * k_tok + h64 * k_head + d[None, :], mask=mask)
    v = tl.load(v_ptr + t * v_tok + h64 * v_head + d[None, :], mask=mask)
    _store_rows(k, v, kc_ptr + blk * kc_blk + page * kc_page, vc_ptr + blk * vc_blk + page * vc_page,
                kc_head, vc_head, heads, d, mask, k_scale_ptr, v_scale_ptr, QUANT, EMULATE)


def reshape_and_cache_flash(key: Tensor, value: Tensor, key_cache: Tensor, value_cache: Tensor, slot_mapping: Tensor,
                            kv_cache_dtype: str, k_scale: Tensor, v_scale: Tensor, *, wrap=None,
                            config: Optional[TritonCacheConfig] = None) -> None:
    tokens, heads, head_size = key.shape
    if wrap is None and (tokens == 0 or key_cache.shape[0] * key_cache.shape[1] == 0):
        return
    if key_cache.dtype == torch.uint8:  # an fp8 cache allocated as its bits
        key_cache, value_cache = key_cache.view(torch.float8_e4m3fn), value_cache.view(torch.float8_e4m3fn)
    block_d = triton.next_power_of_2(head_size)
    if config is None:
        config = TritonCacheConfig.for_shape(tokens if wrap is None else 0, heads, block_d)
    grid = (tokens, triton.cdiv(heads, config.block_h))
    (_cache_kernel if wrap is None else wrap(_cache_kernel))[grid](
        key, key.stride(0), key.stride(1), value, value.stride(0), value.stride(1),
        key_cache, key_cache.stride(0), key_cache.stride(1), key_cache.stride(2),
        value_cache, value_cache.stride(0), value_cache.stride(1), value_cache.stride(2),
        slot_mapping, slot_mapping.stride(0), k_scale, v_scale,
        key_cache.shape[0] * key_cache.shape[1], key_cache.shape[1], heads, head_size,
        BLOCK_H=config.block_h, BLOCK_D=block_d, QUANT=kv_cache_dtype != "auto", EMULATE=_fp8.INTERPRETED,
        num_warps=config.num_warps,
    )
