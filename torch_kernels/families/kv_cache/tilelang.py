"""TileLang paged KV-cache writes (vLLM's ``reshape_and_cache_flash``, and ``rotary_embedding_and_cache``
below; the reference is ``families/kv_cache/reference.py``).

Shapes: ``key``/``value`` ``(T, H, D)``, last dimension contiguous, token and head strides free;
caches ``(num_blocks, B, H, D)``, block, slot and head strides free; ``slot_mapping (T,)`` int64, any
stride. One kernel per (heads, head size, dtypes, fp8, aligned views); the token count, the cache's
size and every stride are runtime values, so neither a batch size nor a cache size compiles again.

Each thread owns ``VEC`` consecutive values (one 16-byte vector of the input) of one head of one
token, in ``ITER`` heads of the token: it reads the token's slot, and only for a slot in
``[0, num_blocks * B)`` loads key and value and stores them (fp8: ``__fdiv_rn(x, scale)`` then
``cvt.rn.satfinite``, ``backends/tilelang_fp8.py``) at block ``slot // B``, offset ``slot % B``. A
call whose strides or pointers are not multiples of the vector runs a kernel of the same shape that
moves value by value.
"""

from dataclasses import dataclass
from typing import Iterator, Optional, Tuple

import tilelang.language as T
import torch
from torch import Tensor

from ...backends import tilelang_fp8 as _fp8
from ...backends import tilelang_jit as _jit
from ...backends.tilelang_rotary import turned_first, turned_second

_NAME = "reshape_and_cache_flash"
_DTYPES = {torch.float16: "float16", torch.bfloat16: "bfloat16", torch.float32: "float32"}
_FP8 = "float8_e4m3fn"


@dataclass(frozen=True)
class CacheConfig(_jit.LaunchConfig):
    """How a cache-write kernel is launched; :meth:`for_shape` is what the launcher uses."""

    # (thread, head) tasks a block aims at: the rotary kernel's choice (untuned here)
    block_threads: int = 256


def _layout(heads: int, lanes: int, block_threads: int) -> Tuple[int, int, int]:
    """(heads side by side, iterations over the heads, tokens per block): ``lanes * heads * tokens``
    threads a block, about ``block_threads``, the heads split in the fewest rounds that fit."""
    iterations = -(-heads * lanes // block_threads)
    par = -(-heads // iterations)
    return par, iterations, max(1, block_threads // (lanes * par))


def _build(heads: int, head_size: int, dtype: str, cache_dtype: str, aligned: bool,
           config: Optional[CacheConfig] = None):
    config = config or CacheConfig.for_shape()
    pdl = _jit.dependent_launch()
    H, D = heads, head_size
    QUANT = cache_dtype == _FP8
    VEC = _jit.vector_width(D, dtype)
    LANES = D // VEC
    HPAR, ITER, TPAR = _layout(H, LANES, config.block_threads)
    THREADS = LANES * HPAR * TPAR
    MOVED = 2 * H * D * (_jit.ELEMENT_BYTES[dtype] + (1 if QUANT else _jit.ELEMENT_BYTES[dtype])) + 8
    per_access = T.vectorized if aligned else T.unroll
    Tn, NB, BS = T.dynamic("num_tokens, num_blocks, block_size")
    s_s, k_st, k_sh, v_st, v_sh = T.dynamic("s_s, k_st, k_sh, v_st, v_sh", "int64")
    kc_b, kc_p, kc_h, vc_b, vc_p, vc_h = T.dynamic("kc_b, kc_p, kc_h, vc_b, vc_p, vc_h", "int64")

    def down(stride):  # aligned: strides are vector multiples (the launcher checks), said so to the compiler
        return stride // VEC * VEC if aligned else stride

    @T.prim_func
    def cache_write(
        key: T.StridedTensor((Tn, H, D), (k_st, k_sh, 1), dtype),
        value: T.StridedTensor((Tn, H, D), (v_st, v_sh, 1), dtype),
        key_cache: T.StridedTensor((NB, BS, H, D), (kc_b, kc_p, kc_h, 1), cache_dtype),  # written
        value_cache: T.StridedTensor((NB, BS, H, D), (vc_b, vc_p, vc_h, 1), cache_dtype),  # written
        slot_mapping: T.StridedTensor((Tn,), (s_s,), "int64"),
        k_scale: T.Tensor((1,), "float32"),
        v_scale: T.Tensor((1,), "float32"),
    ):
        # a size-1 dim's stride is unused (DLPack may say 1): the views round strides down, no used address moves
        k = T.view(key, shape=(Tn, H, D), strides=(down(k_st), down(k_sh), 1))
        v = T.view(value, shape=(Tn, H, D), strides=(down(v_st), down(v_sh), 1))
        kc = T.view(key_cache, shape=(NB, BS, H, D), strides=(down(kc_b), down(kc_p), down(kc_h), 1))
        vc = T.view(value_cache, shape=(NB, BS, H, D), strides=(down(vc_b), down(vc_p), down(vc_h), 1))
        with T.Kernel(T.ceildiv(Tn, TPAR), threads=THREADS) as block:
            if pdl:  # before any access: see _jit.dependent_launch
                T.pdl_sync()
            if _jit.triggers_early(Tn, MOVED, config):
                T.pdl_trigger()
            tid = T.get_thread_binding()
            t = block * TPAR + tid // (LANES * HPAR)
            h0 = tid // LANES % HPAR
            lane = tid % LANES
            xk = T.alloc_local((ITER, VEC), dtype)
            xv = T.alloc_local((ITER, VEC), dtype)
            qk = T.alloc_local((VEC,), cache_dtype)
            qv = T.alloc_local((VEC,), cache_dtype)
            slot = T.alloc_local((1,), "int64")
            if t < Tn:
                slot[0] = slot_mapping[t]
                # -1 (padding) and slots outside the cache: nothing read, nothing written
                if slot[0] >= 0 and slot[0] < T.cast(NB, "int64") * T.cast(BS, "int64"):
                    blk = T.truncdiv(slot[0], T.cast(BS, "int64"))  # slot >= 0: C's division
                    off = T.truncmod(slot[0], T.cast(BS, "int64"))
                    for it in T.unroll(ITER):  # every load of the token issued before the first store
                        h = h0 + it * HPAR
                        if h < H:
                            for e in per_access(VEC):
                                xk[it, e] = k[t, h, lane * VEC + e]
                            for e in per_access(VEC):
                                xv[it, e] = v[t, h, lane * VEC + e]
                    for it in T.unroll(ITER):
                        h = h0 + it * HPAR
                        if h < H:
                            if QUANT:
                                for e in T.unroll(VEC):
                                    qk[e] = _fp8.to_fp8(T.ieee_fdiv(T.cast(xk[it, e], "float32"), k_scale[0]))
                                    qv[e] = _fp8.to_fp8(T.ieee_fdiv(T.cast(xv[it, e], "float32"), v_scale[0]))
                                for e in per_access(VEC):
                                    kc[blk, off, h, lane * VEC + e] = qk[e]
                                for e in per_access(VEC):
                                    vc[blk, off, h, lane * VEC + e] = qv[e]
                            else:
                                for e in per_access(VEC):
                                    kc[blk, off, h, lane * VEC + e] = xk[it, e]
                                for e in per_access(VEC):
                                    vc[blk, off, h, lane * VEC + e] = xv[it, e]

    return cache_write


# ----------------------------------------------------------------------------------------------
# Launcher: the reference's signature.

_build.config_for = CacheConfig.for_shape  # type: ignore[attr-defined]
_function = _jit.host_functions(_NAME, _build)


def _aligned(vec: int, rows, caches) -> bool:
    """Whether every used stride and data pointer is a multiple of ``vec`` values (``rows`` and
    ``caches``: the tensors, strides of dimensions of size 1 aside)."""
    bits = 0
    for x in (*rows, *caches):
        bits |= x.data_ptr() // x.element_size() | (x.data_ptr() % x.element_size())
        for n, s in zip(x.shape[:-1], x.stride()[:-1]):
            if n > 1:
                bits |= s
    return not bits % vec


def reshape_and_cache_flash(key: Tensor, value: Tensor, key_cache: Tensor, value_cache: Tensor, slot_mapping: Tensor,
                            kv_cache_dtype: str, k_scale: Tensor, v_scale: Tensor) -> None:
    tokens, heads, head_size = key.shape
    if tokens == 0 or key_cache.shape[0] * key_cache.shape[1] == 0:
        return
    quant = kv_cache_dtype != "auto"
    if key_cache.dtype == torch.uint8:  # an fp8 cache allocated as its bits
        key_cache, value_cache = key_cache.view(torch.float8_e4m3fn), value_cache.view(torch.float8_e4m3fn)
    dtype = _DTYPES[key.dtype]
    vec = _jit.vector_width(head_size, dtype)
    aligned = _aligned(vec, (key, value), (key_cache, value_cache))
    fn = _function(heads, head_size, dtype, _FP8 if quant else dtype, aligned)
    fn(key, value, key_cache, value_cache, slot_mapping, k_scale.reshape(1), v_scale.reshape(1))


# ----------------------------------------------------------------------------------------------
# rotary_embedding_and_cache: the rope family's thread layout and rotation, expression for expression
# (each thread ``VEC`` consecutive pairs of one head, cos/sin loaded once), over the combined head list
# query heads then key heads; a query head is rotated in place, a key head rotated in registers and
# stored with the value's same columns into the cache; the pass-through dims (partial rotary) and the
# value's columns past ``rot_dim`` value by value, spread over the head's lanes.

_ROPE_NAME = "rotary_embedding_and_cache"
_POSITION_DTYPES = {torch.int32: "int32", torch.int64: "int64"}


def _rope_vec(rot_dim: int, is_neox: bool, dtype: str) -> int:
    """Pairs per thread: one 16-byte access per half-row (neox) or per pair row (GPT-J)."""
    widest = _jit.lanes(dtype) // (1 if is_neox else 2)
    half = rot_dim // 2
    return min(widest, half & -half)


def _build_rope(q_heads: int, kv_heads: int, head_size: int, rot_dim: int, is_neox: bool, dtype: str,
                cos_dtype: str, positions_dtype: str, cache_dtype: str, aligned: bool,
                config: Optional[CacheConfig] = None):
    config = config or CacheConfig.for_shape()
    pdl = _jit.dependent_launch()
    HQ, HK, HS, ROT = q_heads, kv_heads, head_size, rot_dim
    HALF, PASS = rot_dim // 2, head_size - rot_dim
    QUANT = cache_dtype == _FP8
    VEC = _rope_vec(rot_dim, is_neox, dtype)
    LANES = HALF // VEC
    HPAR, ITER, TPAR = _layout(HQ + HK, LANES, config.block_threads)
    THREADS = LANES * HPAR * TPAR
    PASS_ITER = -(-PASS // LANES)
    SEGS, SEG = (2, VEC) if is_neox else (1, 2 * VEC)
    STEP, OTHER = (1, VEC) if is_neox else (2, 1)
    ISZ = _jit.ELEMENT_BYTES[dtype]
    MOVED = (2 * HQ * ROT + 2 * HK * HS) * ISZ + 2 * HK * HS * (1 if QUANT else ISZ) + ROT * _jit.ELEMENT_BYTES[cos_dtype]
    per_access = T.vectorized if aligned else T.unroll
    Tn, P, NB, BS = T.dynamic("num_tokens, max_position, num_blocks, block_size")
    p_s, c_s, s_s = T.dynamic("p_s, c_s, s_s", "int64")
    q_st, q_sh, k_st, k_sh, v_st, v_sh = T.dynamic("q_st, q_sh, k_st, k_sh, v_st, v_sh", "int64")
    kc_b, kc_p, kc_h, vc_b, vc_p, vc_h = T.dynamic("kc_b, kc_p, kc_h, vc_b, vc_p, vc_h", "int64")

    def down(stride, by):  # aligned: strides are multiples (the launcher checks), said so to the compiler
        return stride // by * by if aligned else stride

    @T.prim_func
    def rope_cache(
        positions: T.StridedTensor((Tn,), (p_s,), positions_dtype),
        query: T.StridedTensor((Tn, HQ, HS), (q_st, q_sh, 1), dtype),  # rotated in place
        key: T.StridedTensor((Tn, HK, HS), (k_st, k_sh, 1), dtype),  # read only
        value: T.StridedTensor((Tn, HK, HS), (v_st, v_sh, 1), dtype),
        cos_sin: T.StridedTensor((P, ROT), (c_s, 1), cos_dtype),
        key_cache: T.StridedTensor((NB, BS, HK, HS), (kc_b, kc_p, kc_h, 1), cache_dtype),  # written
        value_cache: T.StridedTensor((NB, BS, HK, HS), (vc_b, vc_p, vc_h, 1), cache_dtype),  # written
        slot_mapping: T.StridedTensor((Tn,), (s_s,), "int64"),
        k_scale: T.Tensor((1,), "float32"),
        v_scale: T.Tensor((1,), "float32"),
    ):
        q = T.view(query, shape=(Tn, HQ, HS), strides=(down(q_st, SEG), down(q_sh, SEG), 1))
        k = T.view(key, shape=(Tn, HK, HS), strides=(down(k_st, SEG), down(k_sh, SEG), 1))
        v = T.view(value, shape=(Tn, HK, HS), strides=(down(v_st, SEG), down(v_sh, SEG), 1))
        c = T.view(cos_sin, shape=(P, ROT), strides=(down(c_s, VEC), 1))
        kc = T.view(key_cache, shape=(NB, BS, HK, HS), strides=(down(kc_b, SEG), down(kc_p, SEG), down(kc_h, SEG), 1))
        vc = T.view(value_cache, shape=(NB, BS, HK, HS), strides=(down(vc_b, SEG), down(vc_p, SEG), down(vc_h, SEG), 1))
        with T.Kernel(T.ceildiv(Tn, TPAR), threads=THREADS) as block:
            if pdl:  # before any access: see _jit.dependent_launch
                T.pdl_sync()
            if _jit.triggers_early(Tn, MOVED, config):
                T.pdl_trigger()
            tid = T.get_thread_binding()
            t = block * TPAR + tid // (LANES * HPAR)
            h0 = tid // LANES % HPAR
            lane = tid % LANES
            cos = T.alloc_local((VEC,), "float32")
            sin = T.alloc_local((VEC,), "float32")
            x = T.alloc_local((ITER, 2 * VEC), dtype)
            y = T.alloc_local((ITER, 2 * VEC), dtype)
            qk = T.alloc_local((2 * VEC,), cache_dtype)
            qv = T.alloc_local((2 * VEC,), cache_dtype)
            slot = T.alloc_local((1,), "int64")
            if t < Tn:
                pos = T.cast(positions[t], "int64")
                slot[0] = slot_mapping[t]
                if pos >= 0 and pos < P:
                    for e in per_access(VEC):
                        cos[e] = T.cast(c[pos, lane * VEC + e], "float32")
                    for e in per_access(VEC):
                        sin[e] = T.cast(c[pos, HALF + lane * VEC + e], "float32")
                else:  # only without the op's data check: NaN, as rotary_embedding's kernels
                    for e in T.unroll(VEC):
                        cos[e] = T.float32(float("nan"))
                        sin[e] = T.float32(float("nan"))
                live = slot[0] >= 0 and slot[0] < T.cast(NB, "int64") * T.cast(BS, "int64")
                blk = T.truncdiv(slot[0], T.cast(BS, "int64"))  # used only where live (slot >= 0)
                off = T.truncmod(slot[0], T.cast(BS, "int64"))
                for it in T.unroll(ITER):  # every load of the token issued before the first store
                    h = h0 + it * HPAR
                    for sg in T.unroll(SEGS):
                        if h < HQ:
                            for e in per_access(SEG):
                                x[it, sg * SEG + e] = q[t, h, sg * HALF + lane * SEG + e]
                        elif h < HQ + HK and live:
                            for e in per_access(SEG):
                                x[it, sg * SEG + e] = k[t, h - HQ, sg * HALF + lane * SEG + e]
                            for e in per_access(SEG):
                                y[it, sg * SEG + e] = v[t, h - HQ, sg * HALF + lane * SEG + e]
                for it in T.unroll(ITER):
                    h = h0 + it * HPAR
                    for i in T.unroll(VEC):
                        x1 = T.cast(x[it, i * STEP], "float32")
                        x2 = T.cast(x[it, i * STEP + OTHER], "float32")
                        x[it, i * STEP] = T.cast(turned_first(x1, x2, cos[i], sin[i]), dtype)
                        x[it, i * STEP + OTHER] = T.cast(turned_second(x1, x2, cos[i], sin[i]), dtype)
                    if h < HQ:
                        for sg in T.unroll(SEGS):
                            for e in per_access(SEG):
                                q[t, h, sg * HALF + lane * SEG + e] = x[it, sg * SEG + e]
                    elif h < HQ + HK and live:
                        for sg in T.unroll(SEGS):
                            if QUANT:
                                for e in T.unroll(SEG):
                                    qk[sg * SEG + e] = _fp8.to_fp8(T.ieee_fdiv(T.cast(x[it, sg * SEG + e], "float32"), k_scale[0]))
                                    qv[sg * SEG + e] = _fp8.to_fp8(T.ieee_fdiv(T.cast(y[it, sg * SEG + e], "float32"), v_scale[0]))
                                for e in per_access(SEG):
                                    kc[blk, off, h - HQ, sg * HALF + lane * SEG + e] = qk[sg * SEG + e]
                                for e in per_access(SEG):
                                    vc[blk, off, h - HQ, sg * HALF + lane * SEG + e] = qv[sg * SEG + e]
                            else:
                                for e in per_access(SEG):
                                    kc[blk, off, h - HQ, sg * HALF + lane * SEG + e] = x[it, sg * SEG + e]
                                for e in per_access(SEG):
                                    vc[blk, off, h - HQ, sg * HALF + lane * SEG + e] = y[it, sg * SEG + e]
                        for j in T.unroll(PASS_ITER):  # dims rot_dim..head_size: key as it is, and the value
                            d = ROT + j * LANES + lane
                            if d < HS:
                                if QUANT:
                                    kc[blk, off, h - HQ, d] = _fp8.to_fp8(T.ieee_fdiv(T.cast(k[t, h - HQ, d], "float32"), k_scale[0]))
                                    vc[blk, off, h - HQ, d] = _fp8.to_fp8(T.ieee_fdiv(T.cast(v[t, h - HQ, d], "float32"), v_scale[0]))
                                else:
                                    kc[blk, off, h - HQ, d] = k[t, h - HQ, d]
                                    vc[blk, off, h - HQ, d] = v[t, h - HQ, d]

    return rope_cache


_build_rope.config_for = CacheConfig.for_shape  # type: ignore[attr-defined]
_rope_function = _jit.host_functions(_ROPE_NAME, _build_rope)


def _heads(x: Tensor, head_size: int) -> Tensor:
    return x if x.dim() == 3 else x.view(x.shape[0], -1, head_size)


def rotary_embedding_and_cache(positions: Tensor, query: Tensor, key: Tensor, value: Tensor, head_size: int,
                               cos_sin_cache: Tensor, is_neox: bool, key_cache: Tensor, value_cache: Tensor,
                               slot_mapping: Tensor, kv_cache_dtype: str, k_scale: Tensor, v_scale: Tensor) -> None:
    if query.shape[0] == 0:
        return
    quant = kv_cache_dtype != "auto"
    if key_cache.dtype == torch.uint8:  # an fp8 cache allocated as its bits
        key_cache, value_cache = key_cache.view(torch.float8_e4m3fn), value_cache.view(torch.float8_e4m3fn)
    q, k, v = _heads(query, head_size), _heads(key, head_size), _heads(value, head_size)
    dtype, rot_dim = _DTYPES[query.dtype], cos_sin_cache.shape[1]
    vec = _rope_vec(rot_dim, is_neox, dtype)
    seg = vec if is_neox else 2 * vec
    aligned = _aligned(seg, (q, k, v), (key_cache, value_cache)) and _aligned(vec, (), (cos_sin_cache,))
    fn = _rope_function(q.shape[1], k.shape[1], head_size, rot_dim, bool(is_neox), dtype, _DTYPES[cos_sin_cache.dtype],
                        _POSITION_DTYPES[positions.dtype], _FP8 if quant else dtype, aligned)
    fn(positions, q, k, v, cos_sin_cache, key_cache, value_cache, slot_mapping, k_scale.reshape(1), v_scale.reshape(1))


def ci_kernels() -> Iterator[tuple]:
    """(name, build, key) of the specialisations CI compiles for sm_90: the benchmark shape (Qwen3-8B's
    8 kv heads of 128, bf16) with a bf16 and an fp8 cache, every dtype, head sizes 64/80/256, many heads
    (several rounds a thread), and the value-by-value kernels of misaligned calls."""
    for heads, hs, dtype, cache, aligned in (
        (8, 128, "bfloat16", "bfloat16", True),  # the benchmark shape
        (8, 128, "bfloat16", _FP8, True),
        (8, 128, "float16", _FP8, True),
        (4, 64, "float16", "float16", True),
        (2, 256, "float32", "float32", True),
        (2, 256, "float32", _FP8, True),
        (3, 80, "bfloat16", "bfloat16", True),  # a head size that is not a power of two
        (64, 256, "float32", "float32", True),  # 64 vectors a head: several rounds of heads a thread
        (8, 128, "bfloat16", "bfloat16", False),
        (3, 80, "float16", _FP8, False),
    ):
        yield _NAME, _build, (heads, hs, dtype, cache, aligned)
    for key in (
        (32, 8, 128, 128, True, "bfloat16", "float32", "int64", "bfloat16", True),  # Qwen3-8B, the benchmark shape
        (32, 8, 128, 128, True, "bfloat16", "float32", "int64", _FP8, True),
        (32, 8, 128, 128, False, "float16", "float16", "int32", "float16", True),  # GPT-J, cos/sin in the q dtype
        (16, 2, 128, 64, False, "float32", "float32", "int64", _FP8, True),  # partial GPT-J: pass-through dims
        (4, 2, 256, 256, True, "float32", "float32", "int64", "float32", True),
        (3, 1, 40, 24, False, "float16", "float32", "int64", "float16", True),  # rot_dim 24: 4 pairs a vector
        (32, 8, 128, 128, True, "bfloat16", "float32", "int64", "bfloat16", False),
        (3, 1, 96, 48, True, "bfloat16", "float32", "int64", _FP8, False),
    ):
        yield _ROPE_NAME, _build_rope, key
