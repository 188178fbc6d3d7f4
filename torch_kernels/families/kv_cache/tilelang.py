"""TileLang paged KV-cache writes (vLLM's ``reshape_and_cache_flash``; the reference is
``families/kv_cache/reference.py``).

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
