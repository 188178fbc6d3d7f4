"""How the row norms lay a row out over threads: the layouts that fix the order of rmsnorm's sum of
squares, shared by the norm family's kernels and every kernel whose values must be rmsnorm's bits
(the rope family's QK-norm). Measurements behind each number: docs/design/norm.md (H200, bf16)."""

import math
from typing import Tuple

from . import tilelang_jit as _jit

#: Triton: rows of up to this many values in one pass (16384 fp32 over 8 warps: 64 registers a thread).
TRITON_ONE_PASS_MAX = 16384


def triton_num_warps(n: int) -> int:
    """About one warp per 512 elements of the row, a power of two in [1, 16] (the warp sweep)."""
    return 1 << min(max(round(math.log2(max(n, 1) / 512)), 0), 4)


#: TileLang: threads a row at most
MAX_THREADS = 1024
#: Short rows (TR < 128 threads) share a block of 128 threads, several rows to it.
BLOCK_THREADS = 128
#: One pass keeps the row in registers: 16 values at 1024 threads use 48 of 64 registers, no spills.
ONE_PASS_MAX = 16384
#: Wider rows: two passes over 8192-value chunks; 512 threads do not spill where 1024 did (131072).
CHUNK_THREADS = 512


def tilelang_layout(n: int, dtype: str, elements_per_thread: int = 16, tile_exactly: bool = True,
                    exact_max_per_thread: int = 64) -> Tuple[int, int, int, int]:
    """``(VEC, TR, BM, WIDTH)`` of a TileLang row kernel over rows of ``n`` values of ``dtype`` (a name):
    vector width, threads per row (a power of two), rows per block, and columns a pass covers (the
    padded row, or a chunk of it when the row is wider than one pass); about ``elements_per_thread``
    values a thread, fewer threads that tile the row exactly where ``tile_exactly`` and a thread holds
    at most ``exact_max_per_thread``."""
    vec = _jit.vector_width(n, dtype)
    if n > ONE_PASS_MAX:
        return vec, CHUNK_THREADS, 1, CHUNK_THREADS * elements_per_thread
    tr = default = 1 << min(max(round(math.log2(n / elements_per_thread)), 0), MAX_THREADS.bit_length() - 1)
    if tile_exactly:
        while n % (tr * vec) and tr > 1 and 2 * n <= tr * exact_max_per_thread:
            tr //= 2
        if n % (tr * vec):  # no power of two tiles the row within the register budget
            tr = default
    step = tr * vec
    return vec, tr, max(1, BLOCK_THREADS // tr), -(-n // step) * step


def tilelang_rows_fragment(T, BM: int, WIDTH: int, TR: int, VEC: int):
    """The fragment of a block's ``(BM, WIDTH)`` rows: element (i, j) in thread i * TR + (j // VEC) % TR,
    register (j // (TR * VEC)) * VEC + j % VEC; stated, not inferred: for VEC = 1 TileLang's own
    inference gave each thread a whole row. ``T``: ``tilelang.language``."""
    return T.Fragment((BM, WIDTH), forward_fn=lambda i, j: (i * TR + j // VEC % TR, j // (TR * VEC) * VEC + j % VEC))
