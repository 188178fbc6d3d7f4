"""Triton RMSNorm family: one program per row.

Rows of up to 16384 elements are held in registers; from 4096 tokens rmsnorm reads them twice
(``RELOAD``). Wider rows, and the fused ops' rows from 4096 tokens, are reduced in a first pass and
normalised in a second, in chunks of 4096. The launch is a :class:`TritonNormConfig`;
:meth:`TritonNormConfig.for_shape` picks it. Arguments arrive validated (``ops.py``): last dim
contiguous, dtype fp16/bf16/fp32, weight ``(N,)``.

Every entry point takes ``wrap``: ``None`` in eager calls; ``torch.library.wrap_triton`` when
``torch.compile`` traces the op's ``inductor_triton`` route (``torch_kernels/library.py``), so that
Inductor launches the kernel itself. Traced, the token count is symbolic: it reaches the launch only
as the grid, and an empty grid is skipped by Triton's launcher instead of an early return. And
``config``: the launch, default ``TritonNormConfig.for_shape`` (the sweeps and tests pass others).
"""

import functools
import math
from dataclasses import dataclass
from typing import Optional

import torch
import triton
import triton.language as tl
from torch import Tensor

from ...backends.rows import rows, rows_view

# Design notes and the measurements behind each constant: docs/design/norm.md (H200, bf16).
# 16384 fp32 values over 8 warps is 64 registers a thread, no spills; wider rows loop over chunks.
_ONE_PASS_MAX = 16384
_CHUNK = 4096
# The fused ops from 4096 tokens in chunks, 16 warps: 4130 against 3992 GB/s at 16384x8192 (traced: one pass).
_FUSED_CHUNKED_MIN_TOKENS = 4096
_FUSED_CHUNK_WARPS = 16
# rmsnorm from 4096 tokens reads its row twice, as Inductor does: 4195 against 4091 GB/s at 16384x8192.
_RELOAD_MIN_TOKENS = 4096


@dataclass(frozen=True)
class TritonNormConfig:
    """How the norm kernel is launched; :meth:`for_shape` is what the launchers use."""

    block_n: int  # elements per load: the row padded to a power of two (one_pass, at least N) or a chunk
    one_pass: bool  # the row is held in registers, in one block; else two passes over chunks
    reload: bool  # one pass, no residual: read the row again (from L2) to normalise it (the fused ops: ignored)
    num_warps: int

    @classmethod
    def for_shape(cls, tokens: Optional[int], n: int, fused: bool) -> "TritonNormConfig":
        """The launchers' configuration for ``tokens`` rows (``None``: not known, traced) of ``n``
        elements, with a residual (``fused``) or not."""
        many = tokens is not None and tokens >= (_FUSED_CHUNKED_MIN_TOKENS if fused else _RELOAD_MIN_TOKENS)
        return cls._pick(n, fused, many)

    @classmethod
    @functools.lru_cache(maxsize=None)
    def _pick(cls, n: int, fused: bool, many: bool) -> "TritonNormConfig":
        if fused and many:
            return cls(_CHUNK, False, False, _FUSED_CHUNK_WARPS)
        if n <= _ONE_PASS_MAX:
            return cls(triton.next_power_of_2(n), True, many, _num_warps(n))
        return cls(_CHUNK, False, False, _num_warps(_CHUNK))


def _num_warps(n: int) -> int:
    """About one warp per 512 elements of the row, a power of two in [1, 16] (the warp sweep:
    docs/design/norm.md)."""
    return 1 << min(max(round(math.log2(max(n, 1) / 512)), 0), 4)


@triton.jit
def _rmsnorm_rows(
    x_ptr, x_row_stride,  # input rows, read (last dim contiguous)
    res_ptr, res_row_stride,  # residual rows: residual += input, written back, when HAS_RESIDUAL
    out_ptr, out_row_stride,  # output rows; the input rows themselves for the in-place ops
    w_ptr,  # weight (N,), contiguous
    N,  # hidden size (elements per row)
    eps,  # added to mean(x^2) before rsqrt
    BLOCK_N: tl.constexpr,  # elements per load: the whole row (ONE_PASS) or a chunk
    ONE_PASS: tl.constexpr,  # the row fits in one block
    HAS_RESIDUAL: tl.constexpr,  # fused_add variants
    GEMMA: tl.constexpr,  # scale by (1 + w) instead of w
    RELOAD: tl.constexpr,  # ONE_PASS without residual: read the row again (from L2) to normalise it
):
    row = tl.program_id(0).to(tl.int64)
    x_row = x_ptr + row * x_row_stride
    res_row = res_ptr + row * res_row_stride
    out_row = out_ptr + row * out_row_stride
    cols = tl.arange(0, BLOCK_N)
    if ONE_PASS:
        mask = cols < N
        x = tl.load(x_row + cols, mask=mask, other=0.0, eviction_policy="evict_last" if RELOAD else "").to(tl.float32)
        if HAS_RESIDUAL:
            x += tl.load(res_row + cols, mask=mask, other=0.0).to(tl.float32)
            tl.store(res_row + cols, x.to(res_ptr.dtype.element_ty), mask=mask)
        rstd = tl.rsqrt(tl.sum(x * x, axis=0) / N + eps)
        # evict_last: every row reads the weight (4064 against 4035 GB/s at 16384x8192)
        w = tl.load(w_ptr + cols, mask=mask, other=0.0, eviction_policy="evict_last").to(tl.float32)
        if GEMMA:
            w += 1.0
        if RELOAD:
            x = tl.load(x_row + cols, mask=mask, other=0.0, eviction_policy="evict_first").to(tl.float32)
        tl.store(out_row + cols, (x * rstd * w).to(out_ptr.dtype.element_ty), mask=mask)
    else:
        acc = tl.zeros([BLOCK_N], dtype=tl.float32)
        for start in range(0, N, BLOCK_N):
            mask = start + cols < N
            x = tl.load(x_row + start + cols, mask=mask, other=0.0, eviction_policy="evict_last").to(tl.float32)
            if HAS_RESIDUAL:
                x += tl.load(res_row + start + cols, mask=mask, other=0.0, eviction_policy="evict_last").to(tl.float32)
                tl.store(res_row + start + cols, x.to(res_ptr.dtype.element_ty), mask=mask)
            acc += x * x
        rstd = tl.rsqrt(tl.sum(acc, axis=0) / N + eps)
        for start in range(0, N, BLOCK_N):
            mask = start + cols < N
            # The second pass re-reads the rounded residual: within one ulp of the fp32 sum.
            if HAS_RESIDUAL:
                x = tl.load(res_row + start + cols, mask=mask, other=0.0, eviction_policy="evict_first").to(tl.float32)
            else:
                x = tl.load(x_row + start + cols, mask=mask, other=0.0, eviction_policy="evict_first").to(tl.float32)
            w = tl.load(w_ptr + start + cols, mask=mask, other=0.0, eviction_policy="evict_last").to(tl.float32)
            if GEMMA:
                w += 1.0
            tl.store(out_row + start + cols, (x * rstd * w).to(out_ptr.dtype.element_ty), mask=mask)


def _launch(x: Tensor, res, out: Tensor, weight: Tensor, eps: float, gemma: bool, wrap=None,
            config: Optional[TritonNormConfig] = None) -> None:
    """All of ``x``, ``res`` and ``out`` are 2-D ``(T, N)`` row views."""
    T, N = x.shape[0], int(x.shape[1])  # int(): traced, the heuristics guard on the hidden size
    if wrap is None and T == 0:
        return
    has_res = res is not None
    if config is None:
        config = TritonNormConfig.for_shape(T if wrap is None else None, N, has_res)
    (_rmsnorm_rows if wrap is None else wrap(_rmsnorm_rows))[(T,)](
        x, x.stride(0),
        res if has_res else x, res.stride(0) if has_res else 0,
        out, out.stride(0),
        weight, N, eps,
        BLOCK_N=config.block_n, ONE_PASS=config.one_pass, HAS_RESIDUAL=has_res, GEMMA=gemma,
        RELOAD=config.reload and not has_res,
        num_warps=config.num_warps,
    )


def _norm(input: Tensor, weight: Tensor, eps: float, gemma: bool, wrap, config) -> Tensor:
    out = torch.empty(input.shape, dtype=input.dtype, device=input.device)
    _launch(rows(input), None, rows(out), weight, eps, gemma, wrap, config)
    return out


def _fused_add(input: Tensor, residual: Tensor, weight: Tensor, eps: float, gemma: bool, wrap, config) -> None:
    x, res = rows_view(input), rows_view(residual)
    if x is None or res is None:  # leading dims that do not collapse: work on copies, write back
        x, res = input.reshape(-1, input.shape[-1]).clone(), residual.reshape(-1, residual.shape[-1]).clone()
        _launch(x, res, x, weight, eps, gemma, wrap, config)
        input.copy_(x.view(input.shape))
        residual.copy_(res.view(residual.shape))
        return
    _launch(x, res, x, weight, eps, gemma, wrap, config)


def rmsnorm(input: Tensor, weight: Tensor, eps: float = 1e-6, *, wrap=None, config=None) -> Tensor:
    return _norm(input, weight, eps, False, wrap, config)


def gemma_rmsnorm(input: Tensor, weight: Tensor, eps: float = 1e-6, *, wrap=None, config=None) -> Tensor:
    return _norm(input, weight, eps, True, wrap, config)


def fused_add_rmsnorm(input: Tensor, residual: Tensor, weight: Tensor, eps: float = 1e-6, *, wrap=None,
                      config=None) -> None:
    _fused_add(input, residual, weight, eps, False, wrap, config)


def gemma_fused_add_rmsnorm(input: Tensor, residual: Tensor, weight: Tensor, eps: float = 1e-6, *, wrap=None,
                            config=None) -> None:
    _fused_add(input, residual, weight, eps, True, wrap, config)
