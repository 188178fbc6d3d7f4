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
from ...backends.triton_rotary import cos_sin, rotate_pair, rotate_tile

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


# ----------------------------------------------------------------------------------------------
# rotary_embedding_and_cache


@triton.jit
def _put(ptr, x, scale_ptr, mask, QUANT: tl.constexpr, EMULATE: tl.constexpr):
    """Store ``x`` (already in the key's dtype: the value the unfused pair would have written) into a
    cache, quantised with ``QUANT`` exactly as :func:`_store_rows` does."""
    if QUANT:
        s = tl.load(scale_ptr).to(tl.float32)
        tl.store(ptr, _fp8.to_e4m3(tl.math.div_rn(x.to(tl.float32), s), ptr.dtype.element_ty, EMULATE), mask=mask)
    else:
        tl.store(ptr, x.to(ptr.dtype.element_ty), mask=mask)


@triton.jit
def _rope_cache_kernel(
    pos_ptr, pos_stride,  # positions (T,), int32 or int64
    q_ptr, q_tok, q_head,  # query (T, Hq, hs) in elements, last dim contiguous: rotated in place
    k_ptr, k_tok, k_head,  # key (T, Hk, hs): read only
    v_ptr, v_tok, v_head,  # value (T, Hk, hs)
    cs_ptr, cs_stride, max_position,  # cos_sin_cache (max_position, rot_dim)
    kc_ptr, kc_blk, kc_page, kc_head,  # caches (num_blocks, B, Hk, hs)
    vc_ptr, vc_blk, vc_page, vc_head,
    slot_ptr, slot_stride, k_scale_ptr, v_scale_ptr,
    num_slots, block_size, num_q_heads, num_kv_heads, head_size, rot_half,
    BLOCK_H: tl.constexpr,  # heads a program: its chunk of query heads, or of key/value heads
    BLOCK_D: tl.constexpr,  # next power of two >= rot_half
    BLOCK_P: tl.constexpr,  # next power of two >= head_size - 2 * rot_half (the pass-through dims), or 1
    BLOCK_V: tl.constexpr,  # next power of two >= head_size
    HAS_PASS: tl.constexpr, IS_NEOX: tl.constexpr, QUANT: tl.constexpr, EMULATE: tl.constexpr,
):
    tok = tl.program_id(0).to(tl.int64)
    chunk = tl.program_id(1)
    q_chunks = tl.cdiv(num_q_heads, BLOCK_H)
    pos = tl.load(pos_ptr + tok * pos_stride).to(tl.int64)
    d = tl.arange(0, BLOCK_D)
    d_mask = d < rot_half
    cos, sin = cos_sin(cs_ptr, cs_stride, pos, max_position, d, rot_half)  # outside the cache: NaN
    if chunk < q_chunks:  # query heads: rotary_embedding's rotation, in place
        heads = chunk * BLOCK_H + tl.arange(0, BLOCK_H)
        rotate_tile(q_ptr + tok * q_tok + heads.to(tl.int64)[:, None] * q_head, heads < num_q_heads, cos, sin, d,
                    d_mask, rot_half, BLOCK_H, BLOCK_D, IS_NEOX)
    else:  # key and value heads: the rotated key and the value into the cache, key left as it is
        heads = (chunk - q_chunks) * BLOCK_H + tl.arange(0, BLOCK_H)
        slot = tl.load(slot_ptr + tok * slot_stride)
        ok = (slot >= 0) & (slot < num_slots)  # -1 (padding) and slots outside the cache write nothing
        slot = tl.where(ok, slot, 0)
        h_mask = heads < tl.where(ok, num_kv_heads, 0)
        h64 = heads.to(tl.int64)[:, None]
        k_row = k_ptr + tok * k_tok + h64 * k_head
        kc_row = kc_ptr + (slot // block_size) * kc_blk + (slot % block_size) * kc_page + h64 * kc_head
        vc_row = vc_ptr + (slot // block_size) * vc_blk + (slot % block_size) * vc_page + h64 * vc_head
        if IS_NEOX:
            mask = h_mask[:, None] & d_mask[None, :]
            x1 = tl.load(k_row + d[None, :], mask=mask, other=0.0).to(tl.float32)
            x2 = tl.load(k_row + rot_half + d[None, :], mask=mask, other=0.0).to(tl.float32)
            o1, o2 = rotate_pair(x1, x2, cos, sin)
            o1, o2 = o1.to(k_ptr.dtype.element_ty), o2.to(k_ptr.dtype.element_ty)
            _put(kc_row + d[None, :], o1, k_scale_ptr, mask, QUANT, EMULATE)
            _put(kc_row + rot_half + d[None, :], o2, k_scale_ptr, mask, QUANT, EMULATE)
        else:
            r = tl.arange(0, 2 * BLOCK_D)
            m = h_mask[:, None] & (r < 2 * rot_half)[None, :]
            x = tl.load(k_row + r[None, :], mask=m, other=0.0).to(tl.float32)
            x1, x2 = tl.split(tl.reshape(x, (BLOCK_H, BLOCK_D, 2)))
            o1, o2 = rotate_pair(x1, x2, cos, sin)
            out = tl.reshape(tl.join(o1, o2), (BLOCK_H, 2 * BLOCK_D))
            _put(kc_row + r[None, :], out.to(k_ptr.dtype.element_ty), k_scale_ptr, m, QUANT, EMULATE)
        if HAS_PASS:  # dims rot_dim..head_size of the key, as they are
            e = 2 * rot_half + tl.arange(0, BLOCK_P)
            pm = h_mask[:, None] & (e < head_size)[None, :]
            _put(kc_row + e[None, :], tl.load(k_row + e[None, :], mask=pm), k_scale_ptr, pm, QUANT, EMULATE)
        e = tl.arange(0, BLOCK_V)
        vm = h_mask[:, None] & (e < head_size)[None, :]
        v = tl.load(v_ptr + tok * v_tok + h64 * v_head + e[None, :], mask=vm)
        _put(vc_row + e[None, :], v, v_scale_ptr, vm, QUANT, EMULATE)


@dataclass(frozen=True)
class TritonRopeCacheConfig:
    """How the fused rotary + cache-write kernel is launched; :meth:`for_shape` is what the launcher uses."""

    block_h: int  # heads a program (of query, or of key and value)
    num_warps: int

    @classmethod
    @functools.lru_cache(maxsize=None)
    def for_shape(cls, num_tokens: int, heads: int, block_d: int) -> "TritonRopeCacheConfig":
        block_h = 1 if num_tokens < _FEW_TOKENS else min(triton.next_power_of_2(heads), max(1, _TILE // block_d))
        return cls(block_h, max(1, min(4, block_h * block_d // 256)))


def _heads3(x: Tensor, head_size: int):
    """(heads, token stride, head stride) of a validated 2-D or 3-D tensor of heads."""
    if x.dim() == 3:
        return int(x.shape[1]), x.stride(0), x.stride(1)
    return int(x.shape[1]) // head_size, x.stride(0), head_size


def rotary_embedding_and_cache(positions: Tensor, query: Tensor, key: Tensor, value: Tensor, head_size: int,
                               cos_sin_cache: Tensor, is_neox: bool, key_cache: Tensor, value_cache: Tensor,
                               slot_mapping: Tensor, kv_cache_dtype: str, k_scale: Tensor, v_scale: Tensor, *,
                               wrap=None, config: Optional[TritonRopeCacheConfig] = None) -> None:
    tokens = query.shape[0]
    if wrap is None and tokens == 0:
        return
    if key_cache.dtype == torch.uint8:  # an fp8 cache allocated as its bits
        key_cache, value_cache = key_cache.view(torch.float8_e4m3fn), value_cache.view(torch.float8_e4m3fn)
    hq, q_tok, q_head = _heads3(query, head_size)
    hk, k_tok, k_head = _heads3(key, head_size)
    _, v_tok, v_head = _heads3(value, head_size)
    rot_half = int(cos_sin_cache.shape[1]) // 2
    block_d = triton.next_power_of_2(rot_half)
    passed = head_size - 2 * rot_half
    if config is None:
        config = TritonRopeCacheConfig.for_shape(tokens if wrap is None else 0, max(hq, hk), triton.next_power_of_2(head_size))
    bh = config.block_h
    grid = (tokens, triton.cdiv(hq, bh) + triton.cdiv(hk, bh))
    (_rope_cache_kernel if wrap is None else wrap(_rope_cache_kernel))[grid](
        positions, positions.stride(0), query, q_tok, q_head, key, k_tok, k_head, value, v_tok, v_head,
        cos_sin_cache, cos_sin_cache.stride(0), cos_sin_cache.shape[0],
        key_cache, key_cache.stride(0), key_cache.stride(1), key_cache.stride(2),
        value_cache, value_cache.stride(0), value_cache.stride(1), value_cache.stride(2),
        slot_mapping, slot_mapping.stride(0), k_scale, v_scale,
        key_cache.shape[0] * key_cache.shape[1], key_cache.shape[1], hq, hk, head_size, rot_half,
        BLOCK_H=bh, BLOCK_D=block_d, BLOCK_P=triton.next_power_of_2(max(passed, 1)),
        BLOCK_V=triton.next_power_of_2(head_size), HAS_PASS=passed > 0, IS_NEOX=bool(is_neox),
        QUANT=kv_cache_dtype != "auto", EMULATE=_fp8.INTERPRETED, num_warps=config.num_warps,
    )
