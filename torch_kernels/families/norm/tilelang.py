"""TileLang RMSNorm family: ``out = x * rsqrt(mean(x^2, -1) + eps) * w`` per row (Gemma: ``* (1 + w)``);
the fused variants first take ``x = input + residual`` in fp32, write it to ``residual`` and the
normalised ``x`` to ``input``, in place (the reference is ``families/norm/reference.py``).

Shapes: ``input`` and ``residual`` ``(T, N)`` row views (last dim contiguous, any row stride that is a
multiple of the vector), ``weight`` ``(N,)`` of any float dtype; fp32 compute, output in the input's
dtype. One kernel per (N, dtype, weight dtype, fused, gemma); the token count is a runtime value
(``T.dynamic``), so a batch-size change never compiles again.

Each row is spread over ``TR`` threads (a power of two, so the sum of squares is one butterfly
all-reduce), about ``NormConfig.elements_per_thread`` elements each in 16-byte vectors; short rows share a
block of :data:`_BLOCK_THREADS` threads. The row is padded to ``TR * VEC * k`` columns and the tail is
masked, so odd hidden sizes take the same path with narrower vectors. Rows of up to
:data:`_ONE_PASS_MAX` elements are read once and kept in registers; wider ones are summed in a first
pass and re-read (from L2) in a second, in chunks of ``_CHUNK_THREADS * elements_per_thread``.
The launch knobs are a :class:`NormConfig`, part of the compile key; :meth:`NormConfig.for_shape` picks them.
Many-token calls take a second, streamed kernel (:func:`_build_streamed`) whose loads carry L2 hints.

Data pointers not 16-byte aligned (a view at an odd offset), or row strides that are not a multiple of
the vector, are rare: the launcher then runs the kernel on aligned copies, with the same result.
"""

import math
from dataclasses import dataclass
from typing import Iterator, Optional, Tuple

import tilelang.language as T
import torch
from torch import Tensor

from ...backends.rows import rows_view
from ...backends import tilelang_jit as _jit

_NAME = "rmsnorm"
_DTYPES = {torch.float16: "float16", torch.bfloat16: "bfloat16", torch.float32: "float32", torch.float64: "float64"}
# Design notes and the measurements behind each constant: docs/design/norm.md (H200, bf16).
_MAX_THREADS = 1024
# Short rows (TR < 128 threads) share a block of 128 threads, several rows to it.
_BLOCK_THREADS = 128
# One pass keeps the row in registers: 16 values at 1024 threads use 48 of 64 registers, no spills.
_ONE_PASS_MAX = 16384
# Wider rows: two passes over 8192-value chunks; 512 threads do not spill where 1024 did (131072).
_CHUNK_THREADS = 512


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


# 32 a thread where it measured faster: rmsnorm 16384x8192 4058 against 3958 GB/s.
_THIRTY_TWO_A_THREAD = {(8192, False), (4096, True)}  # (hidden size, fused)
# The streamed kernel from 4096 tokens and 128 MB a tensor, rmsnorm's 16 KB rows from 4096 tokens:
# fused 16384x8192 4198 against 4052 GB/s one-pass, rmsnorm 4254 against 4150; below, one pass wins.
_STREAMED_MIN_TOKENS = 4096
_STREAMED_MIN_BYTES = 128 << 20
_STREAMED_WIDE_ROW_BYTES = 16 << 10


_vec = _jit.vector_width


def _layout(n: int, dtype: str, fused: bool = False, config: Optional[NormConfig] = None) -> Tuple[int, int, int, int]:
    """``(VEC, TR, BM, WIDTH)``: vector width, threads per row (a power of two), rows per block, and
    columns a pass covers (the padded row, or a chunk of it when the row is wider than one pass);
    ``config`` default :meth:`NormConfig.for_shape`."""
    config = config or NormConfig.for_shape(n, dtype, fused)
    vec = _vec(n, dtype)
    if n > _ONE_PASS_MAX:
        return vec, _CHUNK_THREADS, 1, _CHUNK_THREADS * config.elements_per_thread
    tr = default = 1 << min(max(round(math.log2(n / config.elements_per_thread)), 0), _MAX_THREADS.bit_length() - 1)
    if config.tile_exactly:
        while n % (tr * vec) and tr > 1 and 2 * n <= tr * config.exact_max_per_thread:
            tr //= 2
        if n % (tr * vec):  # no power of two tiles the row within the register budget
            tr = default
    step = tr * vec
    return vec, tr, max(1, _BLOCK_THREADS // tr), -(-n // step) * step


def _build(n: int, dtype: str, weight_dtype: str, fused: bool, gemma: bool, streamed: bool = False,
           config: Optional[NormConfig] = None):
    """The one-pass kernel (the streamed one with ``streamed``) under ``config`` (default
    :meth:`NormConfig.for_shape`)."""
    config = config or NormConfig.for_shape(n, dtype, fused)
    if streamed:
        return _build_streamed(n, dtype, fused, gemma, config)
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

    # Element (i, j) in thread i * TR + (j // VEC) % TR, register (j // (TR * VEC)) * VEC + j % VEC;
    # stated, not inferred: for VEC = 1 TileLang's own inference gave each thread a whole row.
    rows_layout = T.Fragment((BM, WIDTH), forward_fn=lambda i, j: (
        i * TR + j // VEC % TR, j // (TR * VEC) * VEC + j % VEC))

    def scale(w):
        """A weight value in fp32, plus one for Gemma (an expression: a named value would be a let
        binding, which stops TileLang from widening the loop to 16-byte vectors)."""
        w = T.cast(w, f32)
        return w + T.float32(1) if gemma else w

    prefetch = config.prefetch_weight and n == WIDTH

    @T.macro
    def normalize(X, R, Wt, O, eps):
        # One statement per parallel loop: a loop storing two buffers was split into 8-byte accesses.
        with T.Kernel(T.ceildiv(num_tokens, BM), threads=TR * BM) as block:
            if pdl:  # before any access: see _jit.dependent_launch
                T.pdl_sync()
            # the next kernel may be scheduled now: see _jit.EARLY_TRIGGER
            if _jit.triggers_early(num_tokens, _bytes_per_token(n, dtype, fused), config):
                T.pdl_trigger()
            x = T.alloc_fragment((BM, WIDTH), f32)  # this pass's values of the block's rows
            sq = T.alloc_fragment((BM, WIDTH), f32)  # per-thread sums of squares
            rstd = T.alloc_fragment((BM,), f32)
            w = T.alloc_fragment((BM, WIDTH), weight_dtype)  # the weight (each row's copy), prefetched
            T.annotate_layout({x: rows_layout, sq: rows_layout, w: rows_layout})
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

    return _entry(normalize, n, dtype, weight_dtype, fused, VEC, num_tokens, x_stride, r_stride)


def _entry(normalize, n: int, dtype: str, weight_dtype: str, fused: bool, VEC: int, num_tokens, x_stride, r_stride):
    """The kernel's entry point, the launchers' signature, around the ``normalize`` macro of a builder
    (``normalize(X, R, Wt, O, eps)``, ``R`` None for rmsnorm, ``O`` the input rows for the fused ops)."""

    def rows(X, stride):
        """``X`` with its row stride rounded down to a multiple of VEC, which lets TileLang prove that
        every row starts on a vector boundary (16-byte accesses). The addresses are the same: the
        launcher passes row strides that are multiples of VEC whenever there are two rows or more
        (the kernels' ``T.assume``, which the compiled host code checks at every call), and a lone
        row's stride is never used (DLPack may report it as 1)."""
        return T.view(X, strides=(stride // VEC * VEC, 1))

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


def _bytes_per_token(n: int, dtype: str, fused: bool) -> int:
    """Bytes a row moves: read and written, the fused ops' residual too (the weight is read once)."""
    return (4 if fused else 2) * n * _jit.ELEMENT_BYTES[dtype]


def _streams(n: int, dtype: str, weight_dtype: str, config: NormConfig) -> bool:
    """Whether rows of ``n`` take :func:`_build_streamed` from ``config.streamed_from`` tokens: rows of
    whole 16-byte vectors of the input and of the weight (the same dtype), at least one a thread, and
    one pass's width at most."""
    lanes = _jit.lanes(dtype)
    return weight_dtype == dtype and n % lanes == 0 and config.streamed_threads * lanes <= n <= _ONE_PASS_MAX


def _build_streamed(n: int, dtype: str, fused: bool, gemma: bool, config: NormConfig):
    """One row a block of ``config.streamed_threads`` threads: the fused ops in chunks of one 16-byte
    vector a thread (4096 bf16 at 512 threads), as the Triton kernel does from 4096 tokens;
    rmsnorm in one chunk of the row, ``NV`` vectors a thread (4 at 8192 bf16 and 256 threads). The
    first pass sums the squares (and stores the fused ops' rounded residual), the block reduces them
    (warp shuffles, then one value a warp through shared memory), the second pass re-reads the fused
    ops' residual and normalises (rmsnorm: the row it kept in registers)."""
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

    @T.macro
    def normalize(X, R, Wt, O, eps):
        with T.Kernel(num_tokens, threads=TR) as row:
            if pdl:  # before any access: see _jit.dependent_launch
                T.pdl_sync()
            # the next kernel may be scheduled now: see _jit.EARLY_TRIGGER
            if _jit.triggers_early(num_tokens, _bytes_per_token(n, dtype, fused), config):
                T.pdl_trigger()
            T.import_source(_jit.HINTED_LOADS)
            tid = T.get_thread_binding()
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

    return _entry(normalize, n, dtype, dtype, fused, VEC, num_tokens, x_stride, r_stride)


def _config_for(n: int, dtype: str, weight_dtype: str, fused: bool, gemma: bool, streamed: bool = False) -> NormConfig:
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
    """The compiled host functions the launchers call for rows like ``input``'s: the one-pass one, the
    streamed one, and the token count from which they take the streamed one. The C++ entry
    (``fast_path.py``) calls these for the plain calls (contiguous, aligned) it serves."""
    return _kernels(input.shape[-1], input.dtype, weight.dtype, fused, gemma)[:3]


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


def _norm(input: Tensor, weight: Tensor, eps: float, gemma: bool) -> Tensor:
    n = input.shape[-1]
    x = input if input.dim() == 2 else input.reshape(-1, n)
    out = torch.empty_like(x, memory_format=torch.contiguous_format)
    if x.shape[0]:
        fn, vec = _function(n, x.dtype, weight.dtype, False, gemma, x.shape[0])
        if (x.data_ptr() | weight.data_ptr()) & 15 or x.stride(0) % vec:  # rare: a view at an odd offset
            x, weight = _aligned_copy(x), _aligned_copy(weight)
        fn(x, weight, out, eps)
    return out if input.dim() == 2 else out.view(input.shape)


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


def rmsnorm(input: Tensor, weight: Tensor, eps: float = 1e-6) -> Tensor:
    return _norm(input, weight, eps, gemma=False)


def gemma_rmsnorm(input: Tensor, weight: Tensor, eps: float = 1e-6) -> Tensor:
    return _norm(input, weight, eps, gemma=True)


def fused_add_rmsnorm(input: Tensor, residual: Tensor, weight: Tensor, eps: float = 1e-6) -> None:
    _fused_add(input, residual, weight, eps, gemma=False)


def gemma_fused_add_rmsnorm(input: Tensor, residual: Tensor, weight: Tensor, eps: float = 1e-6) -> None:
    _fused_add(input, residual, weight, eps, gemma=True)


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
