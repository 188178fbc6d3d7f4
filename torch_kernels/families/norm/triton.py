"""Triton RMSNorm family: one program per row.

Rows of up to 16384 elements are held in registers; from 4096 tokens rmsnorm reads them twice
(``RELOAD``). Wider rows, and the fused ops' rows from 4096 tokens, are reduced in a first pass and
normalised in a second, in chunks of 4096. The launch is a :class:`TritonNormConfig`;
:meth:`TritonNormConfig.for_shape` picks it. Arguments arrive validated (``ops.py``): last dim
contiguous, dtype fp16/bf16/fp32, weight ``(N,)``.

The FP8 ops (``rmsnorm_fp8_quant`` and the like) are the same kernel with an epilogue (``QUANT``) and
the same launch: their q and scales are, bit for bit, this module's norm then the quant family's
Triton kernel. The value quantised is the norm's rounded to the input's dtype; per token over rows in
chunks, a pass of its own recomputes it for the row's max; the residual is written as the norm writes
it, the input left as it was.

Every entry point takes ``wrap``: ``None`` in eager calls; ``torch.library.wrap_triton`` when
``torch.compile`` traces the op's ``inductor_triton`` route (``torch_kernels/library.py``), so that
Inductor launches the kernel itself. Traced, the token count is symbolic: it reaches the launch only
as the grid, and an empty grid is skipped by Triton's launcher instead of an early return. And
``config``: the launch, default ``TritonNormConfig.for_shape`` (the sweeps and tests pass others).
"""

import functools
from dataclasses import dataclass
from typing import Optional

import torch
import triton
import triton.language as tl
from torch import Tensor

from ... import fp8, outputs
from ...backends.norm_rows import TRITON_ONE_PASS_MAX, triton_num_warps
from ...backends.rows import rows, rows_view
from ...backends.triton_fp8 import (GROUP, GROUP_EPS, INTERPRETED, NONE, STATIC, TOKEN, abs_max, dynamic_scale,
                                    group_quantize, group_scales, mode, quantize, static_inverse, vector)
from .unit_weight import ones_like_row

# Design notes and the measurements behind each constant: docs/design/norm.md (H200, bf16).
_ONE_PASS_MAX = TRITON_ONE_PASS_MAX  # wider rows loop over chunks
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
            return cls(triton.next_power_of_2(n), True, many, triton_num_warps(n))
        return cls(_CHUNK, False, False, triton_num_warps(_CHUNK))



@triton.jit
def _normalized(x_block, res_block, w_block, cols, mask, rstd, HAS_RESIDUAL: tl.constexpr, GEMMA: tl.constexpr):
    """``x * rstd * w`` (fp32) of one block of a row in the second pass, which re-reads the rounded
    residual (within one ulp of the fp32 sum) or the input; ``*_block`` point at the block's start."""
    if HAS_RESIDUAL:
        x = tl.load(res_block + cols, mask=mask, other=0.0, eviction_policy="evict_first").to(tl.float32)
    else:
        x = tl.load(x_block + cols, mask=mask, other=0.0, eviction_policy="evict_first").to(tl.float32)
    w = tl.load(w_block + cols, mask=mask, other=0.0, eviction_policy="evict_last").to(tl.float32)
    if GEMMA:
        w += 1.0
    return x * rstd * w


@triton.jit
def _quant_store(y, start, N, out_row, s_row, s_group_stride, inv, QUANT: tl.constexpr, GROUP_SIZE: tl.constexpr,
                 UE8M0: tl.constexpr, V: tl.constexpr, NUMPY_MAX: tl.constexpr, EMULATE_CAST: tl.constexpr):
    """Quantise the block ``y`` (fp32, values of the input's dtype) of row columns from ``start`` and
    store its ``q`` (static, per token: times ``inv``) and its groups' scales (per group). ``q`` is
    stored as ``[BLOCK // V, V]``: a 1-D fp8 store would widen the row's loads, changing how its sum
    of squares rounds (``backends/triton_fp8.py``)."""
    BLOCK: tl.constexpr = y.shape[0]
    if QUANT == GROUP:
        yg = tl.reshape(y, [BLOCK // GROUP_SIZE, GROUP_SIZE])
        scale = group_scales(yg, 1, GROUP_EPS, UE8M0, NUMPY_MAX)
        q = group_quantize(yg, scale, 1, False, out_row.dtype.element_ty, EMULATE_CAST)
        groups = start // GROUP_SIZE + tl.arange(0, BLOCK // GROUP_SIZE)
        tl.store(s_row + groups.to(tl.int64) * s_group_stride, scale, mask=groups * GROUP_SIZE < N)
    else:
        q = quantize(y, inv, out_row.dtype.element_ty, EMULATE_CAST)
    offs = tl.reshape(start + tl.arange(0, BLOCK), [BLOCK // V, V])
    tl.store(out_row + offs, tl.reshape(q, [BLOCK // V, V]), mask=offs < N)


@triton.jit
def _rmsnorm_rows(
    x_ptr, x_row_stride,  # input rows, read (last dim contiguous)
    res_ptr, res_row_stride,  # residual rows: residual += input, written back, when HAS_RESIDUAL
    out_ptr, out_row_stride,  # output rows; the input rows themselves for the in-place ops; q (fp8) with QUANT
    w_ptr,  # weight (N,), contiguous
    N,  # hidden size (elements per row)
    eps,  # added to mean(x^2) before rsqrt
    s_ptr, s_row_stride, s_group_stride,  # QUANT: the scales, (1,) static, (T, 1) per token, (T, G) per group
    scale_ptr,  # QUANT == STATIC: the static scale, read
    BLOCK_N: tl.constexpr,  # elements per load: the whole row (ONE_PASS) or a chunk
    ONE_PASS: tl.constexpr,  # the row fits in one block
    HAS_RESIDUAL: tl.constexpr,  # fused_add variants
    GEMMA: tl.constexpr,  # scale by (1 + w) instead of w
    RELOAD: tl.constexpr,  # ONE_PASS without residual: read the row again (from L2) to normalise it
    QUANT: tl.constexpr,  # the FP8 epilogue: NONE, STATIC, TOKEN or GROUP (backends/triton_fp8.py)
    GROUP_SIZE: tl.constexpr,  # QUANT == GROUP: values a scale, a power of two dividing N
    UE8M0: tl.constexpr,  # QUANT == GROUP: scales rounded up to powers of two
    V: tl.constexpr,  # QUANT: the q store's vector, 16 bytes of the input's dtype
    NUMPY_MAX: tl.constexpr,  # running in Triton's interpreter: reduce with tl.max + tl.sum
    EMULATE_CAST: tl.constexpr,  # running in Triton's interpreter: round to e4m3 in fp32 before the cast
):
    row = tl.program_id(0).to(tl.int64)
    x_row = x_ptr + row * x_row_stride
    res_row = res_ptr + row * res_row_stride
    out_row = out_ptr + row * out_row_stride
    s_row = s_ptr + row * s_row_stride
    cols = tl.arange(0, BLOCK_N)
    inv = 1.0
    if QUANT == STATIC:
        inv = static_inverse(scale_ptr)
        if row == 0:
            tl.store(s_ptr, tl.load(scale_ptr))
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
        if QUANT == NONE:
            tl.store(out_row + cols, (x * rstd * w).to(out_ptr.dtype.element_ty), mask=mask)
        else:
            y = (x * rstd * w).to(x_ptr.dtype.element_ty).to(tl.float32)  # what rmsnorm writes
            if QUANT == TOKEN:
                scale = dynamic_scale(abs_max(y, 0, NUMPY_MAX), 0.0, False)
                inv = tl.math.div_rn(1.0, scale)
                tl.store(s_row, scale)
            _quant_store(y, 0, N, out_row, s_row, s_group_stride, inv, QUANT, GROUP_SIZE, UE8M0, V, NUMPY_MAX,
                         EMULATE_CAST)
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
        if QUANT == NONE:
            for start in range(0, N, BLOCK_N):
                mask = start + cols < N
                y = _normalized(x_row + start, res_row + start, w_ptr + start, cols, mask, rstd, HAS_RESIDUAL, GEMMA)
                tl.store(out_row + start + cols, y.to(out_ptr.dtype.element_ty), mask=mask)
        else:
            # Whole groups a block, should a group be wider than the chunk: the values do not depend
            # on the block (only the sum of squares above is order-sensitive).
            QBLOCK: tl.constexpr = GROUP_SIZE if QUANT == GROUP and GROUP_SIZE > BLOCK_N else BLOCK_N
            qcols = tl.arange(0, QBLOCK)
            if HAS_RESIDUAL and QBLOCK != BLOCK_N:  # other threads re-read the residual this one wrote
                tl.debug_barrier()
            if QUANT == TOKEN:  # the row's amax first, y recomputed (from L2) in a pass of its own
                amax = tl.zeros([QBLOCK], dtype=tl.float32)
                for start in range(0, N, QBLOCK):
                    y = _normalized(x_row + start, res_row + start, w_ptr + start, qcols, start + qcols < N, rstd, HAS_RESIDUAL,
                                GEMMA)
                    y = y.to(x_ptr.dtype.element_ty).to(tl.float32)
                    amax = tl.maximum(amax, tl.abs(y), propagate_nan=tl.PropagateNan.ALL)
                scale = dynamic_scale(abs_max(amax, 0, NUMPY_MAX), 0.0, False)
                inv = tl.math.div_rn(1.0, scale)
                tl.store(s_row, scale)
            for start in range(0, N, QBLOCK):
                y = _normalized(x_row + start, res_row + start, w_ptr + start, qcols, start + qcols < N, rstd, HAS_RESIDUAL,
                                GEMMA)
                _quant_store(y.to(x_ptr.dtype.element_ty).to(tl.float32), start, N, out_row, s_row, s_group_stride,
                             inv, QUANT, GROUP_SIZE, UE8M0, V, NUMPY_MAX, EMULATE_CAST)


def _launch(x: Tensor, res, out: Tensor, weight: Tensor, eps: float, gemma: bool, wrap=None,
            config: Optional[TritonNormConfig] = None, quant: int = NONE.value, s: Optional[Tensor] = None,
            scale: Optional[Tensor] = None, group_size: int = 1, ue8m0: bool = False) -> None:
    """All of ``x``, ``res`` and ``out`` are 2-D ``(T, N)`` row views; with ``quant``, ``out`` is q
    and ``s`` the scales as ``(1,)`` (static), ``(T, 1)`` (per token) or ``(T, G)`` (per group)."""
    T, N = x.shape[0], int(x.shape[1])  # int(): traced, the heuristics guard on the hidden size
    if wrap is None and T == 0:
        return
    has_res = res is not None
    if config is None:
        config = TritonNormConfig.for_shape(T if wrap is None else None, N, has_res)
    s2 = s.view(1, 1) if s is not None and s.dim() == 1 else s
    (_rmsnorm_rows if wrap is None else wrap(_rmsnorm_rows))[(T,)](
        x, x.stride(0),
        res if has_res else x, res.stride(0) if has_res else 0,
        out, out.stride(0),
        weight, N, eps,
        x if s is None else s, 0 if s is None else s2.stride(0), 0 if s is None else s2.stride(1),
        x if scale is None else scale,
        BLOCK_N=config.block_n, ONE_PASS=config.one_pass, HAS_RESIDUAL=has_res, GEMMA=gemma,
        RELOAD=config.reload and not has_res,
        QUANT=quant, GROUP_SIZE=group_size, UE8M0=ue8m0, V=min(vector(x.element_size()), config.block_n),
        NUMPY_MAX=INTERPRETED, EMULATE_CAST=INTERPRETED,
        num_warps=config.num_warps,
    )


def _norm(input: Tensor, weight: Tensor, eps: float, gemma: bool, wrap, config, out) -> Tensor:
    if out is None:
        y = torch.empty(input.shape, dtype=input.dtype, device=input.device)
    else:
        y = outputs.given(out, 0, input.shape, input.dtype, input.device)
    _launch(rows(input), None, rows(y), weight, eps, gemma, wrap, config)
    return y


def _fused_add(input: Tensor, residual: Tensor, weight: Tensor, eps: float, gemma: bool, wrap, config) -> None:
    x, res = rows_view(input), rows_view(residual)
    if x is None or res is None:  # leading dims that do not collapse: work on copies, write back
        x, res = input.reshape(-1, input.shape[-1]).clone(), residual.reshape(-1, residual.shape[-1]).clone()
        _launch(x, res, x, weight, eps, gemma, wrap, config)
        input.copy_(x.view(input.shape))
        residual.copy_(res.view(residual.shape))
        return
    _launch(x, res, x, weight, eps, gemma, wrap, config)


def rmsnorm(input: Tensor, weight: Optional[Tensor], eps: float = 1e-6, *, wrap=None, config=None, out=None) -> Tensor:
    return _norm(input, ones_like_row(input) if weight is None else weight, eps, False, wrap, config, out)


def gemma_rmsnorm(input: Tensor, weight: Tensor, eps: float = 1e-6, *, wrap=None, config=None, out=None) -> Tensor:
    return _norm(input, weight, eps, True, wrap, config, out)


def fused_add_rmsnorm(input: Tensor, residual: Tensor, weight: Optional[Tensor], eps: float = 1e-6, *, wrap=None,
                      config=None) -> None:
    _fused_add(input, residual, ones_like_row(input) if weight is None else weight, eps, False, wrap, config)


def gemma_fused_add_rmsnorm(input: Tensor, residual: Tensor, weight: Tensor, eps: float = 1e-6, *, wrap=None,
                            config=None) -> None:
    _fused_add(input, residual, weight, eps, True, wrap, config)


# ----------------------------------------------------------------------------------------------
# The FP8 ops: the norm kernel above with its epilogue (QUANT), launched as the norm would be (the same
# TritonNormConfig), so that q and scales equal those of this module's norm then the quant family's
# Triton kernels, bit for bit.


def _quant_outputs(input: Tensor, scale, group_size: int, column_major: bool, wrap, out=None):
    """``q``, the scales, and both as the kernel's rows; a static scale copied when no program may."""
    N = int(input.shape[-1])
    q, s = fp8.empty_outputs(input, N, scale, group_size, column_major, out=out)
    if scale is not None:
        if wrap is not None or q.numel() == 0:  # traced, the token count (the grid) may be 0
            s = scale.reshape(1).clone() if out is None else s.copy_(scale.reshape(1))
        return q, s, q.view(-1, N), s
    return q, s, q.view(-1, N), s.view(-1, s.shape[-1])


def _norm_quant(input: Tensor, weight: Tensor, eps: float, scale, group_size: int, column_major: bool, ue8m0: bool,
                gemma: bool, wrap, config, out=None):
    q, s, q_rows, s_rows = _quant_outputs(input, scale, group_size, column_major, wrap, out)
    _launch(rows(input), None, q_rows, weight, eps, gemma, wrap, config, mode(scale, group_size), s_rows, scale,
            max(group_size, 1), ue8m0)
    return q, s


def _fused_add_quant(input: Tensor, residual: Tensor, weight: Tensor, eps: float, scale, group_size: int,
                     column_major: bool, ue8m0: bool, gemma: bool, wrap, config):
    q, s, q_rows, s_rows = _quant_outputs(input, scale, group_size, column_major, wrap)
    res = rows_view(residual)
    copied = res is None  # leading dims that do not collapse: work on a copy, write back
    if copied:
        res = residual.reshape(-1, residual.shape[-1]).clone()
    _launch(rows(input), res, q_rows, weight, eps, gemma, wrap, config, mode(scale, group_size), s_rows, scale,
            max(group_size, 1), ue8m0)
    if copied:
        residual.copy_(res.view(residual.shape))
    return q, s


def rmsnorm_fp8_quant(input: Tensor, weight: Tensor, eps: float = 1e-6, scale: Optional[Tensor] = None,
                      group_size: int = -1, column_major_scales: bool = False, scale_ue8m0: bool = False, *,
                      wrap=None, config=None, out=None):
    return _norm_quant(input, weight, eps, scale, group_size, column_major_scales, scale_ue8m0, False, wrap, config,
                       out)


def gemma_rmsnorm_fp8_quant(input: Tensor, weight: Tensor, eps: float = 1e-6, scale: Optional[Tensor] = None,
                            group_size: int = -1, column_major_scales: bool = False, scale_ue8m0: bool = False, *,
                            wrap=None, config=None, out=None):
    return _norm_quant(input, weight, eps, scale, group_size, column_major_scales, scale_ue8m0, True, wrap, config,
                       out)


def fused_add_rmsnorm_fp8_quant(input: Tensor, residual: Tensor, weight: Tensor, eps: float = 1e-6,
                                scale: Optional[Tensor] = None, group_size: int = -1, column_major_scales: bool = False,
                                scale_ue8m0: bool = False, *, wrap=None, config=None):
    return _fused_add_quant(input, residual, weight, eps, scale, group_size, column_major_scales, scale_ue8m0, False,
                            wrap, config)


def gemma_fused_add_rmsnorm_fp8_quant(input: Tensor, residual: Tensor, weight: Tensor, eps: float = 1e-6,
                                      scale: Optional[Tensor] = None, group_size: int = -1,
                                      column_major_scales: bool = False, scale_ue8m0: bool = False, *, wrap=None,
                                      config=None):
    return _fused_add_quant(input, residual, weight, eps, scale, group_size, column_major_scales, scale_ue8m0, True,
                            wrap, config)
