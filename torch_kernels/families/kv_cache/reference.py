"""Reference paged KV-cache writes (vLLM's ``reshape_and_cache_flash``), without a host sync.

Takes validated arguments (``ops.py``): ``key``/``value`` ``(T, H, D)`` (last dim contiguous),
caches ``(num_blocks, block_size, H, D)`` of any strides but the last, ``slot_mapping (T,)`` int64.
A token whose slot lies outside ``[0, num_blocks * block_size)`` (-1: padding) writes nothing. The
rows are moved as integers of their width (bits kept; fp8 has no ``where``), so every index is a
tensor op and nothing reads the slots back to the host. An fp8 cache may be float8_e4m3fn or uint8
holding its bits (vLLM allocates it as uint8).
"""

import torch
from torch import Tensor

from ... import fp8 as _fp8
from ... import rotary

_BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def e4m3_bits(y: Tensor) -> Tensor:
    """The float8_e4m3fn bits (uint8) of fp32 ``y``: ``clamp(y, -448, 448)`` rounded to nearest even,
    NaN as 0x7F; torch's cast, bit for bit, computed without an fp8 tensor (which no torch op but a
    copy takes, so ``opcheck``'s schema check could not compare it)."""
    a = y.abs()
    nan = a.isnan()
    a = torch.where(nan, torch.zeros_like(a), a).clamp(max=_fp8.FP8_MAX)
    exponent = (torch.frexp(a).exponent - 1).clamp(min=-6)  # e4m3's spacing at |y| is 2^(exponent - 3)
    step = torch.ldexp(torch.ones_like(a), exponent - 3)
    r = torch.round(a / step) * step  # exact (powers of two); ties to even
    e = torch.frexp(r).exponent - 1
    normal = r >= 2.0 ** -6
    mantissa = torch.where(normal, r / torch.ldexp(torch.ones_like(r), e) * 8 - 8, r * 512).to(torch.int32)
    bits = torch.where(normal, (e + 7) * 8, torch.zeros_like(e)) + mantissa + torch.signbit(y).to(torch.int32) * 128
    return torch.where(nan, torch.full_like(bits, 0x7F), bits).to(torch.uint8)


def to_cache(x: Tensor, cache_dtype: torch.dtype, scale) -> Tensor:
    """``x`` as the cache stores it: the same values (``scale`` None), or the bits (uint8) of
    ``fp8(clamp(fp32(x) / scale, -448, 448))``, the IEEE fp32 division vLLM's kernel does."""
    if scale is None:
        return x.to(cache_dtype)
    y = x.to(torch.float32)
    # against an expanded tensor, not a 0-d one: a division by a scalar may multiply by its reciprocal
    return e4m3_bits(y / scale.reshape((1,) * y.dim()).to(torch.float32).expand_as(y))


def write_rows(key_cache: Tensor, value_cache: Tensor, k: Tensor, v: Tensor, slot_mapping: Tensor) -> None:
    """``cache[slot // block_size, slot % block_size] = row`` for every token whose slot is in the cache.

    A token outside it is sent to the first valid token's slot with that token's rows (the same bits
    written twice), or, with none valid, to slot 0 with what slot 0 holds: no write changes a slot
    that no valid token names, and no data-dependent shape is needed."""
    blocks, block_size = key_cache.shape[0], key_cache.shape[1]
    if blocks * block_size == 0:
        return
    bits = _BITS[key_cache.element_size()]
    kc, vc = key_cache.view(bits), value_cache.view(bits)
    k, v = k.view(bits), v.view(bits)  # fp8 rows arrive as their uint8 bits
    s = slot_mapping
    valid = (s >= 0) & (s < blocks * block_size)
    # the first valid token as a mask, its slot and rows as sums over it: no index, no host read, and
    # every step defined at 0 tokens (an unbacked token count is traced without a guard on it)
    first = valid & (valid.to(torch.int32).cumsum(0) == 1)
    any_valid = valid.any()
    slot = torch.where(valid, s, torch.where(first, s, 0).sum())
    index = (slot // block_size, slot % block_size)
    keep = valid[:, None, None]

    def fill(x: Tensor, cache: Tensor) -> Tensor:
        row = torch.where(first[:, None, None], x, 0).sum(0, keepdim=True, dtype=torch.int64).to(x.dtype)
        return torch.where(any_valid, row, cache[0, :1])
    kc.index_put_(index, torch.where(keep, k, fill(k, kc)))
    vc.index_put_(index, torch.where(keep, v, fill(v, vc)))


def reshape_and_cache_flash(key: Tensor, value: Tensor, key_cache: Tensor, value_cache: Tensor, slot_mapping: Tensor,
                            kv_cache_dtype: str, k_scale: Tensor, v_scale: Tensor) -> None:
    quant = kv_cache_dtype != "auto"
    k = to_cache(key, key_cache.dtype, k_scale if quant else None)
    v = to_cache(value, value_cache.dtype, v_scale if quant else None)
    write_rows(key_cache, value_cache, k, v, slot_mapping)


def _positions_checked(positions: Tensor) -> bool:
    """Whether the op's eager check of the positions ran (``CHECK_SLOTS``, data, outside a capture)."""
    from . import ops as op  # loaded before any call reaches here
    return op.indices_checked(positions)


def rotary_embedding_and_cache(positions: Tensor, query: Tensor, key: Tensor, value: Tensor, head_size: int,
                               cos_sin_cache: Tensor, is_neox: bool, key_cache: Tensor, value_cache: Tensor,
                               slot_mapping: Tensor, kv_cache_dtype: str, k_scale: Tensor, v_scale: Tensor) -> None:
    # rotary_embedding's rotation (torch_kernels/rotary.py), then this op's cache write of the rotated key
    cos, sin = rotary.cos_sin(positions, cos_sin_cache, rotary.compute_dtype(query.dtype), _positions_checked(positions))
    rotary.rotate_(rotary.heads(query, head_size), cos, sin, is_neox)
    k = rotary.rotated(rotary.heads(key, head_size), cos, sin, is_neox)
    reshape_and_cache_flash(k, rotary.heads(value, head_size), key_cache, value_cache, slot_mapping, kv_cache_dtype,
                            k_scale, v_scale)
