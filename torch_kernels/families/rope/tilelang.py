"""TileLang rotary embedding: ``x1, x2 = x1 cos - x2 sin, x2 cos + x1 sin`` for every head of query
and key, in place (vLLM's ``rotary_embedding``; the reference is ``families/rope/reference.py``).

Shapes: ``positions (T,)`` int32/int64, any stride; ``query (T, Hq*hs)`` or ``(T, Hq, hs)`` and ``key``
the same with ``Hk`` heads (or ``None``), last dimension contiguous, token and head strides free;
``cos_sin_cache (max_position, rot_dim)``, ``rot_dim/2`` cosines then ``rot_dim/2`` sines per row.

One kernel per (heads, head size, rot_dim, pairing, dtypes, 2-D rows or 3-D heads, aligned views);
the token count and every stride are runtime values, so a batch-size change never compiles again. Each thread owns ``VEC`` consecutive
pairs (one lane of a head) of one token: it loads its cosines and sines once, then rotates that lane
in ``ITER`` heads of the token's combined head list (query heads, then key heads), all loads of a
token issued before the first store. Only the first ``rot_dim`` dims of a head are read or written.
Accesses are 16-byte vectors: the two half-rows ``x[i]``, ``x[rot_dim/2 + i]`` (neox) or one row
``x[2i : 2i + 2]`` per pair (GPT-J, pairs split in registers). A call whose strides or data
pointers are not multiples of the vector (a view at an odd offset) runs a second kernel of the same
shape that moves value by value: every valid call is taken, none compiles per batch size.
A position outside the cache reads nothing and rotates by NaN, as the Triton kernel does.
"""

from dataclasses import dataclass
from typing import Iterator, Optional, Tuple

import tilelang.language as T
import torch
from torch import Tensor

from ...backends import norm_rows as _rows, tilelang_jit as _jit
from ...backends.tilelang_rotary import turned_first, turned_second
from ...spec import HostKernels
from .ops import positions_checked
from .tokens import flat_tokens

_NAME = "rotary_embedding"
_DTYPES = {torch.float16: "float16", torch.bfloat16: "bfloat16", torch.float32: "float32"}
_POSITION_DTYPES = {torch.int32: "int32", torch.int64: "int64"}


@dataclass(frozen=True)
class RopeConfig(_jit.LaunchConfig):
    """How a rotary-embedding kernel is launched; :meth:`for_shape` is what the launcher uses."""

    # (thread, head) tasks a block aims at: 4008 GB/s at 16384x(32+8)x128, 512: 3716 (docs/design/rope.md).
    block_threads: int = 256


def _vec(rot_dim: int, is_neox: bool, dtype: str) -> int:
    """Pairs per thread: one 16-byte access per half-row (neox) or per pair row (GPT-J, two values a
    pair), down to what divides ``rot_dim/2``."""
    widest = _jit.lanes(dtype) // (1 if is_neox else 2)
    half = rot_dim // 2
    return min(widest, half & -half)


def _layout(num_heads: int, rot_dim: int, vec: int, block_threads: int = RopeConfig.block_threads) -> Tuple[int, int, int, int]:
    """(lanes per head, heads rotated side by side, iterations over the head list, tokens per block).

    ``lanes * heads * tokens`` threads a block, about ``block_threads``: the head list is split
    into ``iterations`` rounds of ``heads`` heads, the fewest rounds that fit, so that few slots idle
    (40 heads of 8 lanes: 2 rounds of 20 heads); few heads leave room for several tokens."""
    lanes = rot_dim // 2 // vec
    iterations = -(-num_heads * lanes // block_threads)
    heads = -(-num_heads // iterations)
    tokens = max(1, block_threads // (lanes * heads))
    return lanes, heads, iterations, tokens


def _build(num_q_heads: int, num_k_heads: int, head_size: int, rot_dim: int, is_neox: bool, dtype: str,
           cache_dtype: str, positions_dtype: str, rank: int, aligned: bool, config: Optional[RopeConfig] = None):
    config = config or RopeConfig.for_shape()
    pdl = _jit.dependent_launch()
    HQ, HK, HS, ROT = num_q_heads, num_k_heads, head_size, rot_dim
    HALF = rot_dim // 2
    MOVED = 2 * (HQ + HK) * HS * _jit.ELEMENT_BYTES[dtype] + ROT * _jit.ELEMENT_BYTES[cache_dtype]  # bytes a token
    VEC = _vec(rot_dim, is_neox, dtype)
    LANES, HPAR, ITER, TPAR = _layout(HQ + HK, rot_dim, VEC, config.block_threads)
    THREADS = LANES * HPAR * TPAR
    # A thread's pairs as loaded: neox, two segments of VEC (x1 half-row then x2 half-row);
    # GPT-J, one segment of 2*VEC values (x1, x2 interleaved). Pair i of the thread is at
    # (i * STEP, i * STEP + OTHER) in its 2*VEC registers; segment s starts at s * HALF in the head.
    SEGS, SEG = (2, VEC) if is_neox else (1, 2 * VEC)
    STEP, OTHER = (1, VEC) if is_neox else (2, 1)
    # Aligned calls move each segment and each cos/sin row slice as one vector; the others value by
    # value (a vector at an address off its size faults).
    per_access = T.vectorized if aligned else T.unroll
    Tn, P = T.dynamic("num_tokens, max_position")
    p_s, q_st, k_st, c_s = T.dynamic("p_s, q_st, k_st, c_s", "int64")
    # q and k as the caller passes them, (T, H*hs) rows (head stride hs) or (T, H, hs) heads (any head
    # stride): the kernel takes either as it is, rather than the launcher making a view per call.
    if rank == 2:
        q_sh = k_sh = HS
        query_type = T.StridedTensor((Tn, HQ * HS), (q_st, 1), dtype)
        key_type = T.StridedTensor((Tn, HK * HS), (k_st, 1), dtype)
    else:
        q_sh, k_sh = T.dynamic("q_sh, k_sh", "int64")
        query_type = T.StridedTensor((Tn, HQ, HS), (q_st, q_sh, 1), dtype)
        key_type = T.StridedTensor((Tn, HK, HS), (k_st, k_sh, 1), dtype)

    @T.prim_func
    def rope(
        positions: T.StridedTensor((Tn,), (p_s,), positions_dtype),  # read; any stride
        query: query_type,  # rotated in place
        key: key_type,  # rotated in place; None when HK == 0
        cache: T.StridedTensor((P, ROT), (c_s, 1), cache_dtype),  # read; cos then sin per row
    ):
        if aligned:
            # Used strides are vector multiples (launcher and host code check); a size-1 dim's stride is
            # unused (DLPack may say 1), so the views round strides down: no used address moves.
            T.assume(T.Or(Tn <= 1, q_st % SEG == 0))
            T.assume(T.Or(P <= 1, c_s % VEC == 0))
            if HK > 0:  # no key: a null tensor, no strides
                T.assume(T.Or(Tn <= 1, k_st % SEG == 0))
            if rank == 3 and HQ > 1:
                T.assume(q_sh % SEG == 0)
            if rank == 3 and HK > 1:
                T.assume(k_sh % SEG == 0)
        # (T, H, hs) views, strides rounded down to the vector when aligned (no used address changes)
        q = T.view(query, shape=(Tn, HQ, HS), strides=(q_st // SEG * SEG, q_sh // SEG * SEG, 1) if aligned else
                   (q_st, q_sh, 1))
        k = T.view(key, shape=(Tn, HK, HS), strides=(k_st // SEG * SEG, k_sh // SEG * SEG, 1) if aligned else
                   (k_st, k_sh, 1))
        c = T.view(cache, strides=(c_s // VEC * VEC, 1) if aligned else (c_s, 1))
        with T.Kernel(T.ceildiv(Tn, TPAR), threads=THREADS) as block:
            if pdl:  # before any access: see _jit.dependent_launch
                T.pdl_sync()
            # the next kernel may be scheduled now: see _jit.EARLY_TRIGGER
            if _jit.triggers_early(Tn, MOVED, config):
                T.pdl_trigger()
            tid = T.get_thread_binding()
            t = block * TPAR + tid // (LANES * HPAR)
            h0 = tid // LANES % HPAR
            lane = tid % LANES
            cos = T.alloc_local((VEC,), "float32")
            sin = T.alloc_local((VEC,), "float32")
            x = T.alloc_local((ITER, 2 * VEC), dtype)
            if t < Tn:
                pos = T.cast(positions[t], "int64")
                if pos >= 0 and pos < P:
                    for v in per_access(VEC):
                        cos[v] = T.cast(c[pos, lane * VEC + v], "float32")
                    for v in per_access(VEC):
                        sin[v] = T.cast(c[pos, HALF + lane * VEC + v], "float32")
                else:  # a position outside the cache: unchecked on CUDA (ops.positions_checked)
                    for v in T.unroll(VEC):
                        cos[v] = T.float32(float("nan"))
                        sin[v] = T.float32(float("nan"))
                for it in T.unroll(ITER):  # every load of the token issued before the first store
                    h = h0 + it * HPAR
                    for s in T.unroll(SEGS):
                        if h < HQ:
                            for v in per_access(SEG):
                                x[it, s * SEG + v] = q[t, h, s * HALF + lane * SEG + v]
                        elif h < HQ + HK:
                            for v in per_access(SEG):
                                x[it, s * SEG + v] = k[t, h - HQ, s * HALF + lane * SEG + v]
                for it in T.unroll(ITER):
                    h = h0 + it * HPAR
                    for i in T.unroll(VEC):
                        x1 = T.cast(x[it, i * STEP], "float32")
                        x2 = T.cast(x[it, i * STEP + OTHER], "float32")
                        x[it, i * STEP] = T.cast(turned_first(x1, x2, cos[i], sin[i]), dtype)
                        x[it, i * STEP + OTHER] = T.cast(turned_second(x1, x2, cos[i], sin[i]), dtype)
                    for s in T.unroll(SEGS):
                        if h < HQ:
                            for v in per_access(SEG):
                                q[t, h, s * HALF + lane * SEG + v] = x[it, s * SEG + v]
                        elif h < HQ + HK:
                            for v in per_access(SEG):
                                k[t, h - HQ, s * HALF + lane * SEG + v] = x[it, s * SEG + v]

    return rope


# ----------------------------------------------------------------------------------------------
# Launcher: the reference's signature. Per call after the first: an alignment test, one dict lookup
# for the compiled host function (``_jit.entry``: no Python loop over the arguments), the call.

_build.config_for = RopeConfig.for_shape  # type: ignore[attr-defined]  # what _jit.compiled builds under
_function = _jit.host_functions(_NAME, _build)  # key of _build -> compiled host function
_functions = _function.cache


def _heads(x: Tensor, head_size: int) -> Tensor:
    """A validated 2-D or 3-D query/key as a ``(T, H, head_size)`` view."""
    return x if x.dim() == 3 else x.view(x.shape[0], -1, head_size)


def _aligned(q: Tensor, k: Optional[Tensor], cache: Tensor, head_size: int, seg: int, vec: int) -> bool:
    """Whether every q/k token and head stride and data pointer is a multiple of ``seg`` values, and
    the cache's row stride and pointer of ``vec`` values (strides of dimensions of size 1 aside)."""
    bits = head_size if q.dim() == 2 else 0  # the head stride of (T, H*hs) rows
    for x in (q, k):
        if x is not None:
            shape, stride = x.shape, x.stride()
            bits |= (stride[0] if shape[0] > 1 else 0) | x.data_ptr() // x.element_size()
            if len(shape) == 3 and shape[1] > 1:
                bits |= stride[1]
    if bits % seg:
        return False
    return not ((cache.stride(0) if cache.shape[0] > 1 else 0) | cache.data_ptr() // cache.element_size()) % vec


def rotary_embedding(positions: Tensor, query: Tensor, key: Optional[Tensor], head_size: int,
                     cos_sin_cache: Tensor, is_neox: bool) -> None:
    positions, query, key = flat_tokens(positions, query, key)
    num_tokens = query.shape[0]
    if num_tokens == 0:
        return
    rank = query.dim()
    if key is not None and key.dim() != rank:  # rare: one of each; both as (T, H, hs) views
        rank, query, key = 3, _heads(query, head_size), _heads(key, head_size)
    heads = query.shape[1] if rank == 3 else query.shape[1] // head_size
    key_heads = 0 if key is None else key.shape[1] if rank == 3 else key.shape[1] // head_size
    dtype, rot_dim = _DTYPES[query.dtype], cos_sin_cache.shape[1]
    vec = _vec(rot_dim, is_neox, dtype)
    aligned = _aligned(query, key, cos_sin_cache, head_size, vec if is_neox else 2 * vec, vec)
    fn = _function(heads, key_heads, head_size, rot_dim, bool(is_neox), dtype, _DTYPES[cos_sin_cache.dtype],
                   _POSITION_DTYPES[positions.dtype], rank, aligned)
    fn(positions, query, key, cos_sin_cache)  # no key: the kernel for 0 key heads takes a null tensor


def rotary_embedding_host(positions: Tensor, query: Tensor, key: Optional[Tensor], head_size: int,
                          cos_sin_cache: Tensor, is_neox: bool):
    """The C++ entry's host (the manifest's HostCall): the aligned kernel of calls like this one, with
    1-D positions, 2-D query and key rows and their granules, while positions go unchecked on the data
    (``ops.positions_checked``: the entry does not check them); ``()`` for any other call."""
    if (positions.dim() != 1 or query.dim() != 2 or key is None or key.dim() != 2 or not query.shape[0]
            or positions_checked(positions)):
        return ()
    dtype, rot_dim = _DTYPES[query.dtype], cos_sin_cache.shape[1]
    vec = _vec(rot_dim, is_neox, dtype)
    seg = vec if is_neox else 2 * vec
    if not _aligned(query, key, cos_sin_cache, head_size, seg, vec):
        return ()
    fn = _function(query.shape[1] // head_size, key.shape[1] // head_size, head_size, rot_dim, bool(is_neox), dtype,
                   _DTYPES[cos_sin_cache.dtype], _POSITION_DTYPES[positions.dtype], 2, True)
    return HostKernels(((0, fn),), (0, seg, seg, 0, vec, 0))


def ci_kernels() -> Iterator[tuple]:
    """(name, build, key) of the specialisations CI compiles for sm_90: every q/k dtype, both
    pairings, partial rotary, fp32 and q-dtype caches, int32 and int64 positions, 2-D rows and 3-D
    heads, no key, vectors narrower than 16 bytes, and the value-by-value kernel of misaligned calls."""
    for q, k, hs, rot, neox, dtype, cache, pos, rank, aligned in (
        (32, 8, 128, 128, True, "bfloat16", "float32", "int64", 2, True),  # Llama-style, the benchmark shape
        (32, 8, 128, 128, False, "bfloat16", "float32", "int64", 2, True),
        (32, 8, 128, 128, True, "float16", "float16", "int32", 3, True),
        (16, 2, 128, 64, False, "float32", "float32", "int64", 2, True),  # partial GPT-J (ChatGLM)
        (16, 16, 64, 64, True, "float32", "float32", "int32", 3, True),
        (8, 0, 128, 128, True, "bfloat16", "bfloat16", "int64", 2, True),  # no key
        (3, 1, 40, 24, False, "float16", "float32", "int64", 2, True),  # rot_dim 24: 4 pairs a vector
        (37, 5, 16, 8, True, "bfloat16", "float32", "int64", 3, True),  # one 4-pair lane a head, 42 heads
        (32, 8, 128, 128, True, "bfloat16", "float32", "int64", 2, False),
        (3, 1, 40, 24, False, "float16", "float32", "int64", 3, False),
    ):
        yield _NAME, _build, (q, k, hs, rot, neox, dtype, cache, pos, rank, aligned)
    yield from ci_qk_kernels()


# ----------------------------------------------------------------------------------------------
# qk_rmsnorm_rope: every (token, head) of query, then of key, a row of rmsnorm's one-pass kernel (the
# norm family's layout for rows of head_size: the same threads a row, registers, reduction and rsqrt,
# so the same bits), rounded to the dtype into shared memory, rotated there pair by pair with the
# rotation above (backends/tilelang_rotary.py, from the rounded values), then stored whole. Blocks
# [0, ceil(T*Hq / rows)) take query rows, the rest key rows: one launch. Dims rot_dim.. get the rounded
# norm. Views off the vector (strides or pointers) run on aligned copies, as rmsnorm does.

_QK_NAME = "qk_rmsnorm_rope"
_WEIGHT_DTYPES = {**_DTYPES, torch.float64: "float64"}  # any float weight, as rmsnorm takes it


def _qk_build(num_q_heads: int, num_k_heads: int, head_size: int, rot_dim: int, is_neox: bool, dtype: str,
              q_weight_dtype: str, k_weight_dtype: str, cache_dtype: str, positions_dtype: str, rank: int,
              config: Optional[RopeConfig] = None):
    config = config or RopeConfig.for_shape()
    pdl = _jit.dependent_launch()
    HQ, HK, HS, ROT, HALF = num_q_heads, num_k_heads, head_size, rot_dim, rot_dim // 2
    VEC, TR, BM, WIDTH = _rows.tilelang_layout(HS, dtype)  # rmsnorm's row at head_size: its numerics
    f32 = "float32"
    MOVED = 2 * (HQ + HK) * HS * _jit.ELEMENT_BYTES[dtype] + ROT * _jit.ELEMENT_BYTES[cache_dtype]  # bytes a token
    Tn, P = T.dynamic("num_tokens, max_position")
    p_s, q_st, k_st, c_s = T.dynamic("p_s, q_st, k_st, c_s", "int64")
    if rank == 2:
        q_sh = k_sh = HS
        query_type = T.StridedTensor((Tn, HQ * HS), (q_st, 1), dtype)
        key_type = T.StridedTensor((Tn, HK * HS), (k_st, 1), dtype)
    else:
        q_sh, k_sh = T.dynamic("q_sh, k_sh", "int64")
        query_type = T.StridedTensor((Tn, HQ, HS), (q_st, q_sh, 1), dtype)
        key_type = T.StridedTensor((Tn, HK, HS), (k_st, k_sh, 1), dtype)
    rows_layout = _rows.tilelang_rows_fragment(T, BM, WIDTH, TR, VEC)  # rmsnorm's
    # pairs (i1, i2) of pair d: neox (d, d + r/2), GPT-J (2d, 2d + 1)
    first, second = ((lambda d: d), (lambda d: d + HALF)) if is_neox else ((lambda d: 2 * d), (lambda d: 2 * d + 1))

    @T.macro
    def _qk_rows(X, H, Wt, row0, Tn, P, positions, cache, eps, x, sq, rstd, ys, cs):
        rows = Tn * H
        for i, d in T.Parallel(BM, ROT):  # each row's cos/sin, NaN outside the cache (then nothing is read)
            p = T.cast(positions[T.min(row0 + i, rows - 1) // H], "int64")
            cs[i, d] = T.if_then_else(T.And(p >= 0, p < P), T.cast(cache[p, d], f32), T.float32(float("nan")))
        T.clear(sq)
        for i, j in T.Parallel(BM, WIDTH):  # rmsnorm's load: fp32, 0 outside the rows
            r = row0 + i
            ok = r < rows if WIDTH == HS else T.And(r < rows, j < HS)
            x[i, j] = T.if_then_else(ok, T.cast(X[r // H, r % H, j], f32), T.float32(0))
        for i, j in T.Parallel(BM, WIDTH):
            sq[i, j] += x[i, j] * x[i, j]
        T.reduce_sum(sq, rstd, dim=1)
        for i in T.Parallel(BM):
            rstd[i] = T.rsqrt(rstd[i] / HS + eps)
        for i, j in T.Parallel(BM, WIDTH):
            ys[i, j] = T.cast(x[i, j] * rstd[i] * T.cast(Wt[j if WIDTH == HS else T.min(j, HS - 1)], f32), dtype)
        T.sync_threads()
        for i, d in T.Parallel(BM, HALF):  # each pair turned in place by the one iteration that reads it
            x1 = T.cast(ys[i, first(d)], f32)
            x2 = T.cast(ys[i, second(d)], f32)
            ys[i, first(d)] = T.cast(turned_first(x1, x2, cs[i, d], cs[i, HALF + d]), dtype)
            ys[i, second(d)] = T.cast(turned_second(x1, x2, cs[i, d], cs[i, HALF + d]), dtype)
        T.sync_threads()
        # the rows stored whole from shared memory: vector stores (the rounded fp32 calls above are scalar)
        for i, j in T.Parallel(BM, WIDTH):
            r = row0 + i
            if (r < rows) if WIDTH == HS else T.And(r < rows, j < HS):
                X[r // H, r % H, j] = ys[i, j]

    @T.prim_func
    def qk_norm_rope(
        positions: T.StridedTensor((Tn,), (p_s,), positions_dtype),  # read; any stride
        query: query_type,  # normalised and rotated in place
        key: key_type,  # likewise; None when HK == 0
        q_weight: T.Tensor((HS,), q_weight_dtype),  # read
        k_weight: T.Tensor((HS,), k_weight_dtype),  # read; None when HK == 0
        cache: T.StridedTensor((P, ROT), (c_s, 1), cache_dtype),  # read; cos then sin per row
        eps: T.float32,
    ):
        T.assume(T.Or(Tn <= 1, q_st % VEC == 0))  # the launcher passes vector multiples (see the section)
        if HK > 0:
            T.assume(T.Or(Tn <= 1, k_st % VEC == 0))
        if rank == 3 and HQ > 1:
            T.assume(q_sh % VEC == 0)
        if rank == 3 and HK > 1:
            T.assume(k_sh % VEC == 0)
        q = T.view(query, shape=(Tn, HQ, HS), strides=(q_st // VEC * VEC, q_sh // VEC * VEC, 1))
        k = T.view(key, shape=(Tn, HK, HS), strides=(k_st // VEC * VEC, k_sh // VEC * VEC, 1))
        q_blocks = T.ceildiv(Tn * HQ, BM)
        with T.Kernel(q_blocks + T.ceildiv(Tn * HK, BM), threads=TR * BM) as block:
            if pdl:  # before any access: see _jit.dependent_launch
                T.pdl_sync()
            if _jit.triggers_early(Tn, MOVED, config):
                T.pdl_trigger()
            x = T.alloc_fragment((BM, WIDTH), f32)
            sq = T.alloc_fragment((BM, WIDTH), f32)
            rstd = T.alloc_fragment((BM,), f32)
            ys = T.alloc_shared((BM, WIDTH), dtype)  # the rows' norm rounded to the dtype
            cs = T.alloc_shared((BM, ROT), f32)  # the rows' cosines then sines
            T.annotate_layout({x: rows_layout, sq: rows_layout})
            if HK == 0:  # no key: a null tensor, no key blocks
                _qk_rows(q, HQ, q_weight, block * BM, Tn, P, positions, cache, eps, x, sq, rstd, ys, cs)
            elif block < q_blocks:
                _qk_rows(q, HQ, q_weight, block * BM, Tn, P, positions, cache, eps, x, sq, rstd, ys, cs)
            else:
                _qk_rows(k, HK, k_weight, (block - q_blocks) * BM, Tn, P, positions, cache, eps, x, sq, rstd, ys, cs)

    return qk_norm_rope


_qk_build.config_for = RopeConfig.for_shape  # type: ignore[attr-defined]
_qk_function = _jit.host_functions(_QK_NAME, _qk_build)


def _qk_aligned(x: Optional[Tensor], w: Optional[Tensor], vec: int) -> bool:
    """Whether ``x``'s data pointer, token and head strides are multiples of ``vec`` elements (size-1
    dims aside) and the weight 16-byte aligned."""
    if x is None:
        return True
    shape, stride = x.shape, x.stride()
    bits = x.data_ptr() // x.element_size() | (stride[0] if shape[0] > 1 else 0)
    if x.dim() == 3 and shape[1] > 1:
        bits |= stride[1]
    return not bits % vec and not w.data_ptr() % 16


def qk_rmsnorm_rope(positions: Tensor, query: Tensor, key: Optional[Tensor], q_weight: Tensor,
                    k_weight: Optional[Tensor], eps: float, head_size: int, cos_sin_cache: Tensor,
                    is_neox: bool) -> None:
    positions, query, key = flat_tokens(positions, query, key)
    num_tokens = query.shape[0]
    if num_tokens == 0:
        return
    vec = _jit.vector_width(head_size, _DTYPES[query.dtype])
    if not (_qk_aligned(query, q_weight, vec) and _qk_aligned(key, k_weight, vec)
            and (head_size % vec == 0)):  # rare: a view off the vector; aligned copies, written back
        # clones, not .contiguous(): a contiguous view one element into its buffer is its own .contiguous()
        q, k = query.clone(memory_format=torch.contiguous_format), None if key is None else key.clone(
            memory_format=torch.contiguous_format)
        qk_rmsnorm_rope(positions, q, k, q_weight.clone(), None if k_weight is None else k_weight.clone(), eps,
                        head_size, cos_sin_cache, is_neox)
        query.copy_(q)
        if key is not None:
            key.copy_(k)
        return
    rank = query.dim()
    if key is not None and key.dim() != rank:
        rank, query, key = 3, _heads(query, head_size), _heads(key, head_size)
    heads = query.shape[1] if rank == 3 else query.shape[1] // head_size
    key_heads = 0 if key is None else key.shape[1] if rank == 3 else key.shape[1] // head_size
    fn = _qk_function(heads, key_heads, head_size, cos_sin_cache.shape[1], bool(is_neox), _DTYPES[query.dtype],
                      _WEIGHT_DTYPES[q_weight.dtype], _WEIGHT_DTYPES[(k_weight if k_weight is not None else q_weight).dtype],
                      _DTYPES[cos_sin_cache.dtype], _POSITION_DTYPES[positions.dtype], rank)
    fn(positions, query, key, q_weight, q_weight if k_weight is None else k_weight, cos_sin_cache, eps)  # no key: unread


def ci_qk_kernels() -> Iterator[tuple]:
    """(name, build, key) of the qk_rmsnorm_rope specialisations CI compiles for sm_90: head sizes
    64/128/256, both pairings, partial rotary, every q/k dtype, fp32 weights under bf16, 3-D heads, no
    key, a head size that is no power of two (rows padded and masked)."""
    for key in (
        (32, 8, 128, 128, True, "bfloat16", "bfloat16", "bfloat16", "float32", "int64", 2),  # Qwen3-8B, the benchmark
        (32, 8, 128, 128, False, "float16", "float32", "float32", "float16", "int32", 3),
        (16, 2, 64, 64, True, "bfloat16", "bfloat16", "bfloat16", "float32", "int64", 2),
        (8, 1, 256, 128, True, "float32", "float32", "float32", "float32", "int64", 3),  # partial neox
        (8, 0, 256, 256, False, "bfloat16", "float32", "float32", "float32", "int64", 2),  # no key
        (7, 3, 80, 40, False, "bfloat16", "bfloat16", "bfloat16", "float32", "int64", 2),  # padded rows, partial GPT-J
    ):
        yield _QK_NAME, _qk_build, key
