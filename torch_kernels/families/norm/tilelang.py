"""TileLang RMSNorm family: ``out = x * rsqrt(mean(x^2, -1) + eps) * w`` per row (Gemma: ``* (1 + w)``);
the fused variants first take ``x = input + residual`` in fp32, write it to ``residual`` and the
normalised ``x`` to ``input``, in place (the reference is ``families/norm/reference.py``).

Shapes: ``input`` and ``residual`` ``(T, N)`` row views (last dim contiguous, any row stride that is a
multiple of the vector), ``weight`` ``(N,)`` of any float dtype; fp32 compute, output in the input's
dtype. One kernel per (N, dtype, weight dtype, fused, gemma); the token count is a runtime value
(``T.dynamic``), so a batch-size change never compiles again.

Each row is spread over ``TR`` threads (a power of two, so the sum of squares is one butterfly
all-reduce), about ``NormConfig.elements_per_thread`` elements each in 16-byte vectors; short rows share a
block of ``norm_rows.BLOCK_THREADS`` threads. The row is padded to ``TR * VEC * k`` columns and the tail is
masked, so odd hidden sizes take the same path with narrower vectors. Rows of up to
``norm_rows.ONE_PASS_MAX`` elements are read once and kept in registers; wider ones are summed in a first
pass and re-read (from L2) in a second, in chunks of ``norm_rows.CHUNK_THREADS * elements_per_thread``.
The launch knobs are a :class:`NormConfig`, part of the compile key; :meth:`NormConfig.for_shape` picks them.
Many-token calls take a second, streamed kernel (:func:`_build_streamed`) whose loads carry L2 hints.

Data pointers not 16-byte aligned (a view at an odd offset), or row strides that are not a multiple of
the vector, are rare: the launcher then runs the kernel on aligned copies, with the same result.

The FP8 ops (``rmsnorm_fp8_quant`` and the like) are these kernels with an epilogue
(``backends/tilelang_fp8.py``): the same layout, reduction and ``rsqrt``, the same kernel at each token
count and the same copies, the output rounded to the dtype and quantised in registers instead of stored
(the fused ops' ``input`` only read), so each equals the norm then ``scaled_fp8_quant`` or
``per_token_group_quant_fp8`` bit for bit.
"""

from dataclasses import dataclass
from typing import Iterator, Optional, Tuple

import tilelang.language as T
import torch
from torch import Tensor

from ... import fp8 as _fp8_core, outputs
from ...backends.rows import rows_view
from ...backends.host_outputs import fp8_outputs
from ...spec import HostKernels
from ...backends import norm_rows as _rows, tilelang_fp8 as _fp8, tilelang_jit as _jit
from .unit_weight import ones_like_row

_NAME = "rmsnorm"
_DTYPES = {torch.float16: "float16", torch.bfloat16: "bfloat16", torch.float32: "float32", torch.float64: "float64"}
# Design notes and the measurements behind each constant: docs/design/norm.md (H200, bf16). The row
# layouts (threads a row, one pass or chunks) are backends/norm_rows.py's.
_ONE_PASS_MAX = _rows.ONE_PASS_MAX


@dataclass(frozen=True)
class NormConfig(_jit.LaunchConfig):
    """How a norm kernel is launched; :meth:`for_shape` is what the launchers use."""

    # 16 values a thread: the Triton warp sweep peaked there (8192 over 16 warps 0.974 of copy).
    elements_per_thread: int = 16
    # Fewer threads that tile the row exactly instead of padding: 1.92 against 2.38 µs at one token of 7168.
    tile_exactly: bool = True
    exact_max_per_thread: int = 64
    # Load the weight before the row's barrier: 4035 against 4005 GB/s at 16384x8192 (padded rows lose).
    prefetch_weight: bool = True
    # The token count from which the streamed kernel serves (where :func:`_streams`).
    streamed_from: int = 4096
    # Threads of the streamed kernel's block: fused 512; rmsnorm 256, row kept in registers (4190 GB/s at
    # 16384x8192; re-read at 512: 3890).
    streamed_threads: int = 512
    # First-pass loads evict_last: evict_first lost from 8192 tokens (3961 against 4198 GB/s, fused 16384x8192).
    first_pass_hint: str = "evict_last"
    # Blocks an SM the fused ops' streamed kernel with an FP8 epilogue asks for: static 8192 took 46
    # registers, two blocks of 512 (0.87 of copy at 16384 tokens) where per token took 40, three (0.98).
    epilogue_min_blocks: int = 3

    @classmethod
    def for_shape(cls, n: int, dtype: str, fused: bool) -> "NormConfig":
        """The launchers' configuration for rows of ``n`` elements of ``dtype`` (a name), fused or not."""
        row_bytes = n * getattr(torch, dtype).itemsize
        if not fused and row_bytes >= _STREAMED_WIDE_ROW_BYTES:
            streamed_from = _STREAMED_MIN_TOKENS
        else:
            streamed_from = max(_STREAMED_MIN_TOKENS, -(-_STREAMED_MIN_BYTES // row_bytes))
        return cls(elements_per_thread=32 if (n, fused) in _THIRTY_TWO_A_THREAD else 16,
                   streamed_from=streamed_from, streamed_threads=512 if fused else 256)


# 32 a thread where it measured faster: rmsnorm 16384x8192 4058 against 3958 GB/s; rmsnorm_fp8_quant
# 4096x4096 static 18 against 19 µs (H100), rmsnorm itself level from 1 to 4096 tokens.
_THIRTY_TWO_A_THREAD = {(8192, False), (4096, True), (4096, False)}  # (hidden size, fused)
# The streamed kernel from 4096 tokens and 128 MB a tensor, rmsnorm's 16 KB rows from 4096 tokens:
# fused 16384x8192 4198 against 4052 GB/s one-pass, rmsnorm 4254 against 4150; below, one pass wins.
_STREAMED_MIN_TOKENS = 4096
_STREAMED_MIN_BYTES = 128 << 20
_STREAMED_WIDE_ROW_BYTES = 16 << 10


_vec = _jit.vector_width


def _layout(n: int, dtype: str, fused: bool = False, config: Optional[NormConfig] = None) -> Tuple[int, int, int, int]:
    """``(VEC, TR, BM, WIDTH)``: vector width, threads per row (a power of two), rows per block, and
    columns a pass covers (:func:`norm_rows.tilelang_layout` under ``config``, default
    :meth:`NormConfig.for_shape`)."""
    config = config or NormConfig.for_shape(n, dtype, fused)
    return _rows.tilelang_layout(n, dtype, config.elements_per_thread, config.tile_exactly, config.exact_max_per_thread)


def _build(n: int, dtype: str, weight_dtype: str, fused: bool, gemma: bool, streamed: bool = False,
           epilogue: Optional[_fp8.Epilogue] = None, config: Optional[NormConfig] = None):
    """The one-pass kernel (the streamed one with ``streamed``) under ``config`` (default
    :meth:`NormConfig.for_shape`); with ``epilogue``, the same kernel ending in that FP8 quantisation of
    its output rounded to ``dtype`` (the fused ops' input then only read), instead of storing it."""
    config = config or NormConfig.for_shape(n, dtype, fused)
    if streamed:
        return _build_streamed(n, dtype, fused, gemma, config, epilogue)
    pdl = _jit.dependent_launch()
    VEC, TR, BM, WIDTH = _layout(n, dtype, fused, config)
    PASSES = -(-n // WIDTH)
    f32 = "float32"
    num_tokens = T.dynamic("num_tokens")
    x_stride, r_stride = T.dynamic("x_row_stride, r_row_stride", "int64")

    live = _jit.in_bounds(num_tokens, BM, n, WIDTH)

    def load(X, R, row, col):
        """``x`` (plus ``residual`` when fused) at (row, col) in fp32; 0 outside the tensor."""
        x = T.cast(X[row, col], f32)
        if R is not None:
            x = x + T.cast(R[row, col], f32)
        ok = live(row, col)
        return x if ok is True else T.if_then_else(ok, x, T.float32(0))

    rows_layout = _rows.tilelang_rows_fragment(T, BM, WIDTH, TR, VEC)

    def scale(w):
        """A weight value in fp32, plus one for Gemma (an expression: a named value would be a let
        binding, which stops TileLang from widening the loop to 16-byte vectors)."""
        w = T.cast(w, f32)
        return w + T.float32(1) if gemma else w

    prefetch = config.prefetch_weight and n == WIDTH

    @T.macro
    def reload(X, R, x, block, p):
        for i, j in T.Parallel(BM, WIDTH):
            x[i, j] = load(X, R, block * BM + i, p * WIDTH + j)

    @T.macro
    def rounded(Wt, w, x, rstd, block, p):
        """``x`` becomes the output of pass ``p`` rounded to the dtype, in fp32 (0 outside the tensor)."""
        for i, j in T.Parallel(BM, WIDTH):
            if live(block * BM + i, p * WIDTH + j):
                wj = w[i, j] if prefetch else Wt[p * WIDTH + j]
                x[i, j] = T.cast(T.cast(x[i, j] * rstd[i] * scale(wj), dtype), f32)

    @T.macro
    def store_residual(R, x, block, p):
        for i, j in T.Parallel(BM, WIDTH):
            if live(block * BM + i, p * WIDTH + j):
                R[block * BM + i, p * WIDTH + j] = T.cast(x[i, j], dtype)

    epi = epilogue
    if epi is not None:
        quantize = _one_pass_epilogue(epi, n, VEC, TR, BM, WIDTH, PASSES, live, reload, rounded, store_residual)
        moved = _quant_bytes_per_token(n, dtype, fused, epi)
    else:
        moved = _bytes_per_token(n, dtype, fused)

    @T.macro
    def normalize(X, R, Wt, O, eps, S=None, Sin=None):
        # One statement per parallel loop: a loop storing two buffers was split into 8-byte accesses.
        with T.Kernel(T.ceildiv(num_tokens, BM), threads=TR * BM) as block:
            if pdl:  # before any access: see _jit.dependent_launch
                T.pdl_sync()
            # the next kernel may be scheduled now: see _jit.EARLY_TRIGGER
            if _jit.triggers_early(num_tokens, moved, config):
                T.pdl_trigger()
            x = T.alloc_fragment((BM, WIDTH), f32)  # this pass's values of the block's rows
            sq = T.alloc_fragment((BM, WIDTH), f32)  # per-thread sums of squares
            rstd = T.alloc_fragment((BM,), f32)
            w = T.alloc_fragment((BM, WIDTH), weight_dtype)  # the weight (each row's copy), prefetched
            T.annotate_layout({x: rows_layout, sq: rows_layout, w: rows_layout})
            if epi is not None and epi.takes_scale:  # the static scale first: its latency under the row's
                sv = T.alloc_local((1,), f32)
                sv[0] = Sin[0]
            T.clear(sq)
            for p in T.serial(PASSES):
                for i, j in T.Parallel(BM, WIDTH):
                    x[i, j] = load(X, R, block * BM + i, p * WIDTH + j)
                if prefetch:
                    for i, j in T.Parallel(BM, WIDTH):
                        w[i, j] = Wt[j]
                for i, j in T.Parallel(BM, WIDTH):
                    sq[i, j] += x[i, j] * x[i, j]
            T.reduce_sum(sq, rstd, dim=1)
            for i in T.Parallel(BM):
                rstd[i] = T.rsqrt(rstd[i] / n + eps)
            if epi is None:
                for p in T.serial(PASSES):
                    if PASSES > 1:  # the row did not fit: read it again (from L2); X and R are unchanged
                        for i, j in T.Parallel(BM, WIDTH):
                            x[i, j] = load(X, R, block * BM + i, p * WIDTH + j)
                    if R is not None:
                        for i, j in T.Parallel(BM, WIDTH):
                            if live(block * BM + i, p * WIDTH + j):
                                R[block * BM + i, p * WIDTH + j] = T.cast(x[i, j], dtype)
                    for i, j in T.Parallel(BM, WIDTH):
                        if live(block * BM + i, p * WIDTH + j):
                            wj = w[i, j] if prefetch else Wt[p * WIDTH + j]
                            O[block * BM + i, p * WIDTH + j] = T.cast(x[i, j] * rstd[i] * scale(wj), dtype)
            elif epi.takes_scale:
                quantize(block, X, R, Wt, w, x, rstd, O, S, sv)
            else:
                quantize(block, X, R, Wt, w, x, rstd, O, S, None)

    return _entry(normalize, n, dtype, weight_dtype, fused, VEC, num_tokens, x_stride, r_stride, epi)


def _one_pass_epilogue(epi: "_fp8.Epilogue", n: int, VEC: int, TR: int, BM: int, WIDTH: int, PASSES: int, live,
                       reload, rounded, store_residual):
    """The one-pass kernel's quantising tail, a macro ``quantize(block, X, R, Wt, w, x, rstd, Q, S, Sin)``
    run once ``rstd`` is known, from the builder's macros: ``reload(X, R, x, block, p)`` loads pass ``p``'s
    values into the fragment ``x``, ``rounded(Wt, w, x, rstd, block, p)`` turns them into the output
    rounded to the dtype (in fp32), ``store_residual(R, x, block, p)`` stores the fused ops' residual.
    Per token, the row's max of magnitudes is one ``reduce_max`` over the row's fragment of their bits;
    per group a ``reduce_max`` over a fragment ``(rows, groups, group_size)`` laid out as the row's (so
    each group reduces across the lanes, or the vectors, that hold it); a scale wider than one pass
    (rows over 16384) takes a pass for the max and one more to quantise, the fused residual stored in
    that last one."""
    f32 = "float32"
    mode, G = epi.mode, epi.group_size
    NG = WIDTH // G if mode == "group" and G <= WIDTH else 1  # groups a pass
    wide = PASSES > 1 and (mode == "token" or G > WIDTH)  # one scale over several passes
    SEGS = 1 if mode == "token" else (n // G if wide else 1)  # scales over passes, per row
    PER_SEG = (n if mode == "token" else G) // WIDTH if wide else 1  # passes a wide scale spans (token: all)
    rows_layout = _rows.tilelang_rows_fragment(T, BM, WIDTH, TR, VEC)
    GW = WIDTH // NG  # a group's columns (within a pass)
    # the rows' layout, the row split in groups: a group's values on the lanes (and vectors) holding them
    groups_layout = T.Fragment((BM, NG, GW), forward_fn=lambda i, g, j: (
        i * TR + (g * GW + j) // VEC % TR, (g * GW + j) // (TR * VEC) * VEC + (g * GW + j) % VEC))
    EPS_BITS = _fp8.eps_bits()

    @T.macro
    def quantize(block, X, R, Wt, w, x, rstd, Q, S, Sin):
        tid = T.get_thread_binding()
        inv = T.alloc_var(f32)
        if mode == "static":
            inv = _fp8.static_inverse(Sin[0])
            if T.And(block == 0, tid == 0):
                S[0] = Sin[0]
            for p in T.serial(PASSES):
                if PASSES > 1:
                    reload(X, R, x, block, p)
                if R is not None:
                    store_residual(R, x, block, p)
                rounded(Wt, w, x, rstd, block, p)
                for i, j in T.Parallel(BM, WIDTH):
                    if live(block * BM + i, p * WIDTH + j):
                        Q[block * BM + i, p * WIDTH + j] = _fp8.to_fp8(x[i, j] * inv)
        elif mode == "token" and PASSES == 1:
            bits = T.alloc_fragment((BM, WIDTH), "int32")
            rmax = T.alloc_fragment((BM,), "int32")
            sc = T.alloc_fragment((BM,), f32)
            ri = T.alloc_fragment((BM,), f32)
            T.annotate_layout({bits: rows_layout})
            if R is not None:
                store_residual(R, x, block, 0)
            rounded(Wt, w, x, rstd, block, 0)
            for i, j in T.Parallel(BM, WIDTH):
                bits[i, j] = _fp8.abs_bits(x[i, j])
            T.reduce_max(bits, rmax, dim=1)
            for i in T.Parallel(BM):  # max(amax * fp32(1/448), MIN_SCALE)
                sc[i] = _fp8.dynamic_scale(T.reinterpret(rmax[i], f32))
            for i in T.Parallel(BM):
                sc[i] = _fp8.floor_scale(sc[i])
            for i in T.Parallel(BM):
                ri[i] = T.ieee_frcp(sc[i])
            for i, j in T.Parallel(BM, WIDTH):
                if live(block * BM + i, j):
                    Q[block * BM + i, j] = _fp8.to_fp8(x[i, j] * ri[i])
            for i in T.Parallel(BM):
                if live(block * BM + i, 0):
                    S[block * BM + i] = sc[i]
        elif not wide:  # groups within a pass
            bits = T.alloc_fragment((BM, NG, G), "int32")
            gmax = T.alloc_fragment((BM, NG), "int32")
            sc = T.alloc_fragment((BM, NG), f32)
            gi = T.alloc_fragment((BM, NG), f32)
            T.annotate_layout({bits: groups_layout})
            for p in T.serial(PASSES):
                if PASSES > 1:
                    reload(X, R, x, block, p)
                if R is not None:
                    store_residual(R, x, block, p)
                rounded(Wt, w, x, rstd, block, p)
                for i, j in T.Parallel(BM, WIDTH):
                    bits[i, j // G, j % G] = _fp8.abs_bits(x[i, j])
                T.reduce_max(bits, gmax, dim=2)
                for i, g in T.Parallel(BM, NG):  # max(amax, eps) / 448 (UE8M0: its power-of-two ceiling)
                    sc[i, g] = _fp8.group_scale(T.reinterpret(T.max(gmax[i, g], EPS_BITS), f32))
                if epi.ue8m0:
                    for i, g in T.Parallel(BM, NG):
                        sc[i, g] = _fp8.pow2_ceil(sc[i, g])
                for i, g in T.Parallel(BM, NG):
                    gi[i, g] = T.ieee_frcp(sc[i, g])
                for i, j in T.Parallel(BM, WIDTH):
                    if live(block * BM + i, p * WIDTH + j):
                        Q[block * BM + i, p * WIDTH + j] = _fp8.to_fp8(x[i, j] * gi[i, j // G])
                for i, g in T.Parallel(BM, NG):
                    if live(block * BM + i, p * WIDTH + g * G):
                        S[block * BM + i, p * NG + g] = sc[i, g]
        else:  # rows over one pass (one row a block): a scale of several passes, the max first
            bits = T.alloc_fragment((1, WIDTH), "int32")
            pmax = T.alloc_fragment((1,), "int32")
            segmax = T.alloc_local((SEGS,), "int32")
            segsc = T.alloc_local((SEGS,), f32)
            T.annotate_layout({bits: rows_layout})
            for s in T.unroll(SEGS):
                segmax[s] = 0 if mode == "token" else EPS_BITS
            for p in T.serial(PASSES):
                reload(X, R, x, block, p)
                rounded(Wt, w, x, rstd, block, p)
                for i, j in T.Parallel(1, WIDTH):
                    bits[i, j] = _fp8.abs_bits(x[i, j])
                T.reduce_max(bits, pmax, dim=1)
                segmax[p // PER_SEG] = T.max(segmax[p // PER_SEG], pmax[0])
            for s in T.unroll(SEGS):
                if mode == "token":
                    segsc[s] = _fp8.dynamic_scale(T.reinterpret(segmax[s], f32))
                    segsc[s] = _fp8.floor_scale(segsc[s])
                else:
                    segsc[s] = _fp8.group_scale(T.reinterpret(segmax[s], f32))
                    if epi.ue8m0:
                        segsc[s] = _fp8.pow2_ceil(segsc[s])
            for p in T.serial(PASSES):
                reload(X, R, x, block, p)
                if R is not None:
                    store_residual(R, x, block, p)
                rounded(Wt, w, x, rstd, block, p)
                inv = T.ieee_frcp(segsc[p // PER_SEG])
                for i, j in T.Parallel(1, WIDTH):
                    if live(block + i, p * WIDTH + j):
                        Q[block + i, p * WIDTH + j] = _fp8.to_fp8(x[i, j] * inv)
            if tid == 0:
                for s in T.unroll(SEGS):
                    if mode == "token":
                        S[block] = segsc[s]
                    else:
                        S[block, s] = segsc[s]

    return quantize


def _entry(normalize, n: int, dtype: str, weight_dtype: str, fused: bool, VEC: int, num_tokens, x_stride, r_stride,
           epi: Optional[_fp8.Epilogue] = None):
    """The kernel's entry point, the launchers' signature, around the ``normalize`` macro of a builder
    (``normalize(X, R, Wt, O, eps[, S, Sin])``, ``R`` None for rmsnorm, ``O`` the input rows for the fused
    ops, or with ``epi`` the fp8 output ``Q``, the scales ``S`` and the one-value input ``Sin``)."""

    def rows(X, stride):
        """``X`` with its row stride rounded down to a multiple of VEC, which lets TileLang prove that
        every row starts on a vector boundary (16-byte accesses). The addresses are the same: the
        launcher passes row strides that are multiples of VEC whenever there are two rows or more
        (the kernels' ``T.assume``, which the compiled host code checks at every call), and a lone
        row's stride is never used (DLPack may report it as 1)."""
        return T.view(X, strides=(stride // VEC * VEC, 1))

    if epi is not None:
        return _quant_entry(normalize, n, dtype, weight_dtype, fused, VEC, num_tokens, x_stride, r_stride, epi, rows)

    if fused:
        @T.prim_func
        def fused_add_rmsnorm(
            X: T.StridedTensor((num_tokens, n), (x_stride, 1), dtype),  # input rows; receive the output
            R: T.StridedTensor((num_tokens, n), (r_stride, 1), dtype),  # residual rows; receive input + residual
            Wt: T.Tensor((n,), weight_dtype),  # weight, read
            eps: T.float32,  # added to mean(x^2)
        ):
            T.assume(T.Or(num_tokens <= 1, x_stride % VEC == 0))  # see rows()
            T.assume(T.Or(num_tokens <= 1, r_stride % VEC == 0))
            normalize(rows(X, x_stride), rows(R, r_stride), Wt, rows(X, x_stride), eps)
        return fused_add_rmsnorm

    @T.prim_func
    def rmsnorm(
        X: T.StridedTensor((num_tokens, n), (x_stride, 1), dtype),  # input rows, read
        Wt: T.Tensor((n,), weight_dtype),  # weight, read
        O: T.Tensor((num_tokens, n), dtype),  # output rows, contiguous; written
        eps: T.float32,  # added to mean(x^2)
    ):
        T.assume(T.Or(num_tokens <= 1, x_stride % VEC == 0))  # see rows()
        normalize(rows(X, x_stride), None, Wt, O, eps)
    return rmsnorm


def _quant_entry(normalize, n: int, dtype: str, weight_dtype: str, fused: bool, VEC: int, num_tokens, x_stride,
                 r_stride, epi: "_fp8.Epilogue", rows):
    """:func:`_entry` of the kernels with an FP8 epilogue: ``(X, [R,] Wt, Q, S, [Sin,] eps)``, ``Q`` the fp8
    rows (contiguous), ``S`` the scales (``(1,)`` static, ``(T,)`` per token, ``(T, N / group_size)`` per
    group through its strides), ``Sin`` the static scale; the fused ops' ``X`` read only."""
    if epi.mode == "group":
        s_t, s_g = T.dynamic("s_token_stride, s_group_stride", "int64")
        S_type = T.StridedTensor((num_tokens, n // epi.group_size), (s_t, s_g), "float32")
    else:
        S_type = T.Tensor((num_tokens,) if epi.mode == "token" else (1,), "float32")
    Q_type = T.Tensor((num_tokens, n), _fp8.FP8)
    X_type = T.StridedTensor((num_tokens, n), (x_stride, 1), dtype)
    R_type = T.StridedTensor((num_tokens, n), (r_stride, 1), dtype)
    W_type = T.Tensor((n,), weight_dtype)

    if fused and epi.takes_scale:
        @T.prim_func
        def fused_add_rmsnorm_fp8_quant(X: X_type, R: R_type, Wt: W_type, Q: Q_type, S: S_type,
                                        Sin: T.Tensor((1,), "float32"), eps: T.float32):
            T.assume(T.Or(num_tokens <= 1, x_stride % VEC == 0))  # see rows()
            T.assume(T.Or(num_tokens <= 1, r_stride % VEC == 0))
            normalize(rows(X, x_stride), rows(R, r_stride), Wt, Q, eps, S, Sin)
        return fused_add_rmsnorm_fp8_quant
    if fused:
        @T.prim_func
        def fused_add_rmsnorm_fp8_quant(X: X_type, R: R_type, Wt: W_type, Q: Q_type, S: S_type, eps: T.float32):
            T.assume(T.Or(num_tokens <= 1, x_stride % VEC == 0))  # see rows()
            T.assume(T.Or(num_tokens <= 1, r_stride % VEC == 0))
            normalize(rows(X, x_stride), rows(R, r_stride), Wt, Q, eps, S, None)
        return fused_add_rmsnorm_fp8_quant
    if epi.takes_scale:
        @T.prim_func
        def rmsnorm_fp8_quant(X: X_type, Wt: W_type, Q: Q_type, S: S_type, Sin: T.Tensor((1,), "float32"),
                              eps: T.float32):
            T.assume(T.Or(num_tokens <= 1, x_stride % VEC == 0))  # see rows()
            normalize(rows(X, x_stride), None, Wt, Q, eps, S, Sin)
        return rmsnorm_fp8_quant

    @T.prim_func
    def rmsnorm_fp8_quant(X: X_type, Wt: W_type, Q: Q_type, S: S_type, eps: T.float32):
        T.assume(T.Or(num_tokens <= 1, x_stride % VEC == 0))  # see rows()
        normalize(rows(X, x_stride), None, Wt, Q, eps, S, None)
    return rmsnorm_fp8_quant


def _quant_bytes_per_token(n: int, dtype: str, fused: bool, epi: "_fp8.Epilogue") -> int:
    """Bytes a row of a norm with an FP8 epilogue moves: input (and the residual read and written) in
    the dtype, q and the scales."""
    return (3 if fused else 1) * n * _jit.ELEMENT_BYTES[dtype] + n + epi.scale_bytes(n)


def _bytes_per_token(n: int, dtype: str, fused: bool) -> int:
    """Bytes a row moves: read and written, the fused ops' residual too (the weight is read once)."""
    return (4 if fused else 2) * n * _jit.ELEMENT_BYTES[dtype]


def _streams(n: int, dtype: str, weight_dtype: str, config: NormConfig) -> bool:
    """Whether rows of ``n`` take :func:`_build_streamed` from ``config.streamed_from`` tokens: rows of
    whole 16-byte vectors of the input and of the weight (the same dtype), at least one a thread, and
    one pass's width at most."""
    lanes = _jit.lanes(dtype)
    return weight_dtype == dtype and n % lanes == 0 and config.streamed_threads * lanes <= n <= _ONE_PASS_MAX


def _build_streamed(n: int, dtype: str, fused: bool, gemma: bool, config: NormConfig,
                    epi: Optional[_fp8.Epilogue] = None):
    """One row a block of ``config.streamed_threads`` threads: the fused ops in chunks of one 16-byte
    vector a thread (4096 bf16 at 512 threads), as the Triton kernel does from 4096 tokens;
    rmsnorm in one chunk of the row, ``NV`` vectors a thread (4 at 8192 bf16 and 256 threads). The
    first pass sums the squares (and stores the fused ops' rounded residual), the block reduces them
    (warp shuffles, then one value a warp through shared memory), the second pass re-reads the fused
    ops' residual and normalises (rmsnorm: the row it kept in registers). With ``epi`` the row's
    outputs stay in registers (the fused ops' chunks unrolled) for the FP8 epilogue, which stores ``q``
    and the scales instead."""
    pdl = _jit.dependent_launch()
    TR, VEC = config.streamed_threads, _jit.lanes(dtype)
    NV = 1 if fused else -(-n // (TR * VEC))  # vectors a thread a chunk
    CHUNK = NV * TR * VEC
    CHUNKS = -(-n // CHUNK)
    f32 = "float32"
    num_tokens = T.dynamic("num_tokens")
    x_stride, r_stride = T.dynamic("x_row_stride, r_row_stride", "int64")

    def live(col):
        return True if n % CHUNK == 0 else col < n

    load16 = _jit.load16

    def scale(w):
        w = T.cast(w, f32)
        return w + T.float32(1) if gemma else w

    if epi is not None:
        K = CHUNKS if fused else NV  # vectors of a row a thread holds: vector k at (k * TR + tid) * VEC
        quant = _fp8.Quantizer(_fp8.Tile(VEC, TR, K), epi, n)
        moved = _quant_bytes_per_token(n, dtype, fused, epi)
    else:
        moved = _bytes_per_token(n, dtype, fused)

    @T.macro
    def normalize(X, R, Wt, O, eps, S=None, Sin=None):
        with T.Kernel(num_tokens, threads=TR) as row:
            if epi is not None and fused and config.epilogue_min_blocks > 1:
                T.annotate_min_blocks_per_sm(config.epilogue_min_blocks)
            if pdl:  # before any access: see _jit.dependent_launch
                T.pdl_sync()
            # the next kernel may be scheduled now: see _jit.EARLY_TRIGGER
            if _jit.triggers_early(num_tokens, moved, config):
                T.pdl_trigger()
            T.import_source(_jit.HINTED_LOADS)
            tid = T.get_thread_binding()
            if epi is not None and epi.takes_scale:  # the static scale first: its latency under the row's
                sv = T.alloc_local((1,), f32)
                sv[0] = Sin[0]
            xr = T.alloc_local((NV, VEC), dtype)  # a chunk's input (then its residual), as loaded
            rr = T.alloc_local((NV, VEC), dtype)  # the fused ops' residual, as loaded
            wr = T.alloc_local((NV, VEC), dtype)  # the weight
            ob = T.alloc_local((NV, VEC), dtype)  # what is stored
            acc = T.alloc_local((1,), f32)  # the sum of squares, then rstd
            warp_sums = T.alloc_shared((TR // 32,), f32)
            acc[0] = T.float32(0)
            for c in T.serial(CHUNKS):
                for k in T.unroll(NV):
                    col = (c * NV + k) * TR * VEC + tid * VEC
                    if live(col):
                        load16(config.first_pass_hint, xr[k, 0], X[row, col])
                        if R is not None:
                            load16(config.first_pass_hint, rr[k, 0], R[row, col])
                for k in T.unroll(NV):
                    col = (c * NV + k) * TR * VEC + tid * VEC
                    if live(col):
                        for v in T.unroll(VEC):
                            x = T.cast(xr[k, v], f32) + T.cast(rr[k, v], f32) if R is not None else T.cast(xr[k, v], f32)
                            acc[0] += x * x
                            if R is not None:
                                ob[k, v] = T.cast(x, dtype)
                        if R is not None:
                            for v in T.vectorized(VEC):
                                R[row, col + v] = ob[k, v]
            acc[0] = T.warp_reduce_sum(acc[0])
            if tid % 32 == 0:
                warp_sums[tid // 32] = acc[0]
            T.sync_threads()
            acc[0] = T.float32(0)
            for w in T.unroll(TR // 32):
                acc[0] += warp_sums[w]
            acc[0] = T.rsqrt(acc[0] / n + eps)
            if epi is not None:
                yq = T.alloc_local((K, VEC), dtype)  # the row's outputs (the fused ops': its residual first)
                wq = T.alloc_local((K, VEC), dtype)
                for k in T.unroll(K):
                    if live((k * TR + tid) * VEC):
                        if R is not None:
                            load16("evict_first", yq[k, 0], R[row, (k * TR + tid) * VEC])
                        load16("evict_last", wq[k, 0], Wt[(k * TR + tid) * VEC])
                for k in T.unroll(K):
                    if live((k * TR + tid) * VEC):
                        for v in T.unroll(VEC):
                            if R is not None:
                                yq[k, v] = T.cast(T.cast(yq[k, v], f32) * acc[0] * scale(wq[k, v]), dtype)
                            else:
                                yq[k, v] = T.cast(T.cast(xr[k, v], f32) * acc[0] * scale(wq[k, v]), dtype)
                if epi.takes_scale:
                    quant.quantize(yq, _vector_live(live, TR, VEC, tid), row, True, 0, O, S, sv, T.And(row == 0, tid == 0))
                else:
                    quant.quantize(yq, _vector_live(live, TR, VEC, tid), row, True, 0, O, S, None, T.And(row == 0, tid == 0))
            else:
                for c in T.serial(CHUNKS):
                    for k in T.unroll(NV):
                        col = (c * NV + k) * TR * VEC + tid * VEC
                        if live(col):
                            if R is not None:  # rmsnorm keeps its row in xr
                                load16("evict_first", xr[k, 0], R[row, col])
                            load16("evict_last", wr[k, 0], Wt[col])
                    for k in T.unroll(NV):
                        col = (c * NV + k) * TR * VEC + tid * VEC
                        if live(col):
                            for v in T.unroll(VEC):
                                ob[k, v] = T.cast(T.cast(xr[k, v], f32) * acc[0] * scale(wr[k, v]), dtype)
                            for v in T.vectorized(VEC):
                                O[row, col + v] = ob[k, v]

    return _entry(normalize, n, dtype, dtype, fused, VEC, num_tokens, x_stride, r_stride, epi)


def _vector_live(live, TR: int, VEC: int, tid):
    """``live(k)`` of the epilogue from the streamed kernel's ``live(col)``: vector ``k`` at ``(k * TR + tid) * VEC``."""
    return lambda k: live((k * TR + tid) * VEC)


def _config_for(n: int, dtype: str, weight_dtype: str, fused: bool, gemma: bool, streamed: bool = False,
                epilogue: Optional[_fp8.Epilogue] = None) -> NormConfig:
    """The launchers' config of the kernel of this key."""
    return NormConfig.for_shape(n, dtype, fused)


_build.config_for = _config_for  # type: ignore[attr-defined]  # what _jit.compiled builds under


# ----------------------------------------------------------------------------------------------
# Launchers: the reference's signatures. Per call, after the first: one dict lookup for the
# compiled host function (its vector width beside it), an alignment test, and the call.

_functions: dict = {}  # (n, dtype, weight dtype, fused, gemma) -> _kernels' tuple


def _kernels(n: int, dtype: torch.dtype, weight_dtype: torch.dtype, fused: bool, gemma: bool):
    """``(one-pass host function, streamed one, token count from which the streamed one serves, vector
    width)`` for these rows under :meth:`NormConfig.for_shape` (the streamed one is the one-pass one where
    the rows do not allow it). Both are compiled at the first call, whatever its token count, so that a
    change of batch size never compiles."""
    key = (n, dtype, weight_dtype, fused, gemma)
    found = _functions.get(key)
    if found is None:
        names = _DTYPES[dtype], _DTYPES[weight_dtype]
        config = NormConfig.for_shape(n, names[0], fused)
        one_pass = streamed = _jit.entry(_jit.compiled(_NAME, _build, n, *names, fused, gemma, config=config))
        if _streams(n, *names, config):
            streamed = _jit.entry(_jit.compiled(_NAME, _build, n, *names, fused, gemma, True, config=config))
        found = _functions[key] = (one_pass, streamed, config.streamed_from, _vec(n, names[0]))
    return found


def _function(n: int, dtype: torch.dtype, weight_dtype: torch.dtype, fused: bool, gemma: bool, tokens: int):
    """``(host function, vector width)`` for ``tokens`` rows of ``n``: the streamed kernel from its
    threshold, else the one-pass one."""
    one_pass, streamed, streamed_from, vec = (_functions.get((n, dtype, weight_dtype, fused, gemma))
                                              or _kernels(n, dtype, weight_dtype, fused, gemma))
    return (streamed if tokens >= streamed_from else one_pass), vec


def host_functions(input: Tensor, weight: Tensor, fused: bool, gemma: bool):
    """The compiled host functions the launchers call for rows like ``input``'s, each with the token
    count from which it serves: ``((0, one_pass), (streamed_from, streamed))``, the one-pass one alone
    for rows that never stream. The C++ entry (``fast_path.py``) calls these for the plain calls
    (contiguous, aligned) it serves."""
    one_pass, streamed, streamed_from = _kernels(input.shape[-1], input.dtype, weight.dtype, fused, gemma)[:3]
    return ((0, one_pass),) + (() if streamed is one_pass else ((streamed_from, streamed),))


# The C++ entry's host providers (the manifest's HostCall): the twin's arguments, trailing defaults left out.
def rmsnorm_host(input: Tensor, weight: Tensor, *_):
    return host_functions(input, weight, fused=False, gemma=False)


def gemma_rmsnorm_host(input: Tensor, weight: Tensor, *_):
    return host_functions(input, weight, fused=False, gemma=True)


def fused_add_rmsnorm_host(input: Tensor, residual: Tensor, weight: Tensor, *_):
    return host_functions(input, weight, fused=True, gemma=False)


def gemma_fused_add_rmsnorm_host(input: Tensor, residual: Tensor, weight: Tensor, *_):
    return host_functions(input, weight, fused=True, gemma=True)


def _aligned_copy(t: Tensor) -> Tensor:
    """A fresh contiguous (so 16-byte aligned, row stride ``N``) copy of ``t``."""
    return t.clone(memory_format=torch.contiguous_format)


def _norm(input: Tensor, weight: Tensor, eps: float, gemma: bool, out=None) -> Tensor:
    n = input.shape[-1]
    x = input if input.dim() == 2 else input.reshape(-1, n)
    if out is None:
        y = torch.empty_like(x, memory_format=torch.contiguous_format)
    else:
        y = outputs.given(out, 0, input.shape, input.dtype, input.device).view(x.shape)
    if x.shape[0]:
        fn, vec = _function(n, x.dtype, weight.dtype, False, gemma, x.shape[0])
        if (x.data_ptr() | weight.data_ptr()) & 15 or x.stride(0) % vec:  # rare: a view at an odd offset
            x, weight = _aligned_copy(x), _aligned_copy(weight)
        fn(x, weight, y, eps)
    return y if input.dim() == 2 else y.view(input.shape)


def _fused_add(input: Tensor, residual: Tensor, weight: Tensor, eps: float, gemma: bool) -> None:
    n = input.shape[-1]
    if input.numel() == 0:
        return
    x, res = rows_view(input), rows_view(residual)
    fn, vec = _function(n, input.dtype, weight.dtype, True, gemma, input.numel() // n)
    if (x is None or res is None or (x.data_ptr() | res.data_ptr() | weight.data_ptr()) & 15
            or x.stride(0) % vec or res.stride(0) % vec):
        # Leading dims that do not collapse, or misaligned rows (rare): run on aligned copies, write back.
        x, res = _aligned_copy(input.reshape(-1, n)), _aligned_copy(residual.reshape(-1, n))
        fn(x, res, _aligned_copy(weight) if weight.data_ptr() & 15 else weight, eps)
        input.copy_(x.view(input.shape))
        residual.copy_(res.view(residual.shape))
        return
    fn(x, res, weight, eps)


def rmsnorm(input: Tensor, weight: Optional[Tensor], eps: float = 1e-6, *, out=None) -> Tensor:
    # no weight: the kernel of a weight of ones in the input's dtype (a product with 1 is exact)
    return _norm(input, ones_like_row(input) if weight is None else weight, eps, gemma=False, out=out)


def gemma_rmsnorm(input: Tensor, weight: Tensor, eps: float = 1e-6, *, out=None) -> Tensor:
    return _norm(input, weight, eps, gemma=True, out=out)


def fused_add_rmsnorm(input: Tensor, residual: Tensor, weight: Optional[Tensor], eps: float = 1e-6) -> None:
    _fused_add(input, residual, ones_like_row(input) if weight is None else weight, eps, gemma=False)


def gemma_fused_add_rmsnorm(input: Tensor, residual: Tensor, weight: Tensor, eps: float = 1e-6) -> None:
    _fused_add(input, residual, weight, eps, gemma=True)


# ----------------------------------------------------------------------------------------------
# The norms with an FP8 epilogue: the norm's own kernels (the same layout, reduction and rsqrt, the
# same choice of the one-pass or the streamed kernel at each token count, the same aligned copies),
# ending in tilelang_fp8's epilogue on the output rounded to the dtype instead of storing it; so each
# returns, bit for bit, the norm's output quantised by scaled_fp8_quant or per_token_group_quant_fp8.

_QUANT_NAME = "rmsnorm_fp8_quant"
_quant_functions: dict = {}  # (n, dtype, weight dtype, fused, gemma, epilogue) -> _kernels' tuple


def _quant_kernels(n: int, dtype: torch.dtype, weight_dtype: torch.dtype, fused: bool, gemma: bool,
                   epi: "_fp8.Epilogue"):
    """:func:`_kernels` of the norm with the epilogue ``epi``: the same config, the same kernels."""
    key = (n, dtype, weight_dtype, fused, gemma, epi)
    found = _quant_functions.get(key)
    if found is None:
        names = _DTYPES[dtype], _DTYPES[weight_dtype]
        config = NormConfig.for_shape(n, names[0], fused)
        one_pass = streamed = _jit.entry(_jit.compiled(_QUANT_NAME, _build, n, *names, fused, gemma, False, epi,
                                                       config=config))
        if _streams(n, *names, config):
            streamed = _jit.entry(_jit.compiled(_QUANT_NAME, _build, n, *names, fused, gemma, True, epi, config=config))
        found = _quant_functions[key] = (one_pass, streamed, config.streamed_from, _vec(n, names[0]))
    return found


def _quant_function(n: int, dtype: torch.dtype, weight_dtype: torch.dtype, fused: bool, gemma: bool,
                    epi: "_fp8.Epilogue", tokens: int):
    """``(host function, vector width)``: the streamed kernel from the norm's threshold, else the one-pass one."""
    one_pass, streamed, streamed_from, vec = (_quant_functions.get((n, dtype, weight_dtype, fused, gemma, epi))
                                              or _quant_kernels(n, dtype, weight_dtype, fused, gemma, epi))
    return (streamed if tokens >= streamed_from else one_pass), vec


def _scales_arg(s: Tensor, epi: "_fp8.Epilogue", n: int) -> Tensor:
    """The scales as the kernels take them: ``(1,)``, ``(T,)`` per token, ``(T, G)`` per group (a view
    of either layout, whose leading dims are contiguous)."""
    if epi.mode == "token":
        return s.view(-1)
    if epi.mode == "group":
        return s.view(-1, n // epi.group_size)
    return s


def _norm_quant(input: Tensor, residual: Optional[Tensor], weight: Tensor, eps: float, scale: Optional[Tensor],
                group_size: int, column_major: bool, ue8m0: bool, gemma: bool, out=None):
    n = input.shape[-1]
    q, s = _fp8_core.empty_outputs(input, n, scale, group_size, column_major, out=out)
    tokens = input.numel() // n
    if tokens == 0:
        if scale is not None:
            s.copy_(scale.reshape(1))
        return q, s
    fused = residual is not None
    epi = _fp8.Epilogue.of(scale, group_size, ue8m0)
    fn, vec = _quant_function(n, input.dtype, weight.dtype, fused, gemma, epi, tokens)
    x = rows_view(input)
    if x is None or (x.data_ptr() | weight.data_ptr()) & 15 or x.stride(0) % vec:  # rare: as the norm, a copy
        x = _aligned_copy(input.reshape(-1, n))
    if weight.data_ptr() & 15:
        weight = _aligned_copy(weight)
    q2, s2 = q.view(-1, n), _scales_arg(s, epi, n)
    extra = (scale.reshape(1),) if scale is not None else ()
    if not fused:
        fn(x, weight, q2, s2, *extra, eps)
        return q, s
    res = rows_view(residual)
    if res is None or res.data_ptr() & 15 or res.stride(0) % vec:  # rare: run on a copy, write it back
        res = _aligned_copy(residual.reshape(-1, n))
        fn(x, res, weight, q2, s2, *extra, eps)
        residual.copy_(res.view(residual.shape))
    else:
        fn(x, res, weight, q2, s2, *extra, eps)
    return q, s


def rmsnorm_fp8_quant(input: Tensor, weight: Tensor, eps: float = 1e-6, scale: Optional[Tensor] = None,
                      group_size: int = -1, column_major_scales: bool = False, scale_ue8m0: bool = False, *, out=None):
    return _norm_quant(input, None, weight, eps, scale, group_size, column_major_scales, scale_ue8m0, gemma=False,
                       out=out)


def gemma_rmsnorm_fp8_quant(input: Tensor, weight: Tensor, eps: float = 1e-6, scale: Optional[Tensor] = None,
                            group_size: int = -1, column_major_scales: bool = False, scale_ue8m0: bool = False, *,
                            out=None):
    return _norm_quant(input, None, weight, eps, scale, group_size, column_major_scales, scale_ue8m0, gemma=True,
                       out=out)


def fused_add_rmsnorm_fp8_quant(input: Tensor, residual: Tensor, weight: Tensor, eps: float = 1e-6,
                                scale: Optional[Tensor] = None, group_size: int = -1,
                                column_major_scales: bool = False, scale_ue8m0: bool = False):
    return _norm_quant(input, residual, weight, eps, scale, group_size, column_major_scales, scale_ue8m0, gemma=False)


def gemma_fused_add_rmsnorm_fp8_quant(input: Tensor, residual: Tensor, weight: Tensor, eps: float = 1e-6,
                                      scale: Optional[Tensor] = None, group_size: int = -1,
                                      column_major_scales: bool = False, scale_ue8m0: bool = False):
    return _norm_quant(input, residual, weight, eps, scale, group_size, column_major_scales, scale_ue8m0, gemma=True)


# The C++ entry's host providers of the FP8 ops: the kernels _norm_quant calls, q and the scales' layout.
def _quant_host(input: Tensor, weight: Tensor, fused: bool, gemma: bool, scale: Optional[Tensor], group_size: int,
                column_major: bool, ue8m0: bool) -> HostKernels:
    n = input.shape[-1]
    epi = _fp8.Epilogue.of(scale, group_size, ue8m0)
    one_pass, streamed, streamed_from = _quant_kernels(n, input.dtype, weight.dtype, fused, gemma, epi)[:3]
    kernels = ((0, one_pass),) + (() if streamed is one_pass else ((streamed_from, streamed),))
    return HostKernels(kernels, outputs=fp8_outputs(n, scale is not None, group_size, column_major))


def rmsnorm_fp8_quant_host(input: Tensor, weight: Tensor, eps: float = 1e-6, scale: Optional[Tensor] = None,
                           group_size: int = -1, column_major_scales: bool = False, scale_ue8m0: bool = False):
    return _quant_host(input, weight, False, False, scale, group_size, column_major_scales, scale_ue8m0)


def gemma_rmsnorm_fp8_quant_host(input: Tensor, weight: Tensor, eps: float = 1e-6, scale: Optional[Tensor] = None,
                                 group_size: int = -1, column_major_scales: bool = False, scale_ue8m0: bool = False):
    return _quant_host(input, weight, False, True, scale, group_size, column_major_scales, scale_ue8m0)


def fused_add_rmsnorm_fp8_quant_host(input: Tensor, residual: Tensor, weight: Tensor, eps: float = 1e-6,
                                     scale: Optional[Tensor] = None, group_size: int = -1,
                                     column_major_scales: bool = False, scale_ue8m0: bool = False):
    return _quant_host(input, weight, True, False, scale, group_size, column_major_scales, scale_ue8m0)


def gemma_fused_add_rmsnorm_fp8_quant_host(input: Tensor, residual: Tensor, weight: Tensor, eps: float = 1e-6,
                                           scale: Optional[Tensor] = None, group_size: int = -1,
                                           column_major_scales: bool = False, scale_ue8m0: bool = False):
    return _quant_host(input, weight, True, True, scale, group_size, column_major_scales, scale_ue8m0)


def ci_kernels() -> Iterator[tuple]:
    """(name, build, key) of the specialisations CI compiles for sm_90: every dtype, both variant
    flags (fused, gemma), a weight dtype other than the input's, and each layout: several rows a
    block (128), a row padded and masked with scalar accesses (257) or 16-byte ones (1000), one row a
    block (4096, 8192), two passes (65536); and the streamed kernel of many-token calls."""
    for n, dtype, weight_dtype, fused, gemma in (
        (8192, "bfloat16", "bfloat16", False, False),  # the benchmark shape
        (8192, "bfloat16", "bfloat16", True, False),
        (4096, "float16", "float16", True, True),
        (4096, "float32", "float32", False, True),
        (1000, "bfloat16", "float32", False, False),  # 125 of 128 vectors live; fp32 weight
        (257, "float16", "float16", True, False),  # odd: scalar accesses, masked tail
        (128, "float32", "float32", True, True),  # 8 rows a block
        (65536, "bfloat16", "bfloat16", True, False),  # two passes
    ):
        yield _NAME, _build, (n, dtype, weight_dtype, fused, gemma)
    for n, dtype, fused, gemma in (  # the streamed kernel (from 4096 tokens): chunks, a masked one
        (8192, "bfloat16", True, False),
        (7168, "float16", True, True),
        (4096, "float32", True, False),
        (8192, "bfloat16", False, False),  # rmsnorm: one chunk, 4 vectors a thread
        (7168, "float16", False, True),  # masked
    ):
        yield _NAME, _build, (n, dtype, dtype, fused, gemma, True)


def ci_fp8_kernels() -> Iterator[tuple]:
    """(name, build, key) of the FP8 epilogues' kernels CI compiles for sm_90: each epilogue on the
    one-pass kernel's layouts (one row a block, several, padded with scalar accesses, two passes with a
    scale over both) and on the streamed kernel (one chunk, chunks, a masked one), every dtype, Gemma,
    a weight dtype other than the input's."""
    E = _fp8.Epilogue
    for n, dtype, weight_dtype, fused, gemma, streamed, epi in (
        (4096, "bfloat16", "bfloat16", True, False, False, E("static")),  # the benchmark shape
        (4096, "bfloat16", "bfloat16", False, False, False, E("token")),
        (7168, "bfloat16", "bfloat16", True, False, False, E("group", 128)),
        (7168, "float16", "float16", False, True, False, E("group", 64, True)),
        (1000, "bfloat16", "float32", False, False, False, E("static")),  # padded
        (257, "float16", "float16", True, False, False, E("token")),  # scalar accesses, masked tail
        (128, "float32", "float32", True, True, False, E("group", 32, True)),  # 8 rows a block
        (65536, "bfloat16", "bfloat16", True, False, False, E("token")),  # two passes, a scale over both
        (65536, "bfloat16", "bfloat16", False, False, False, E("group", 16384)),
        (65536, "bfloat16", "bfloat16", True, False, False, E("group", 128)),
        (8192, "bfloat16", "bfloat16", True, False, True, E("static")),  # streamed: chunks
        (8192, "bfloat16", "bfloat16", False, False, True, E("token")),  # one chunk, 4 vectors a thread
        (7168, "float16", "float16", True, True, True, E("group", 128, True)),  # a masked chunk
        (4096, "float32", "float32", True, False, True, E("group", 64)),
    ):
        yield _QUANT_NAME, _build, (n, dtype, weight_dtype, fused, gemma, streamed, epi)
