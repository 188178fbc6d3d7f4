"""Triton FP8 quantisation: ``per_token_group_quant_fp8`` and ``scaled_fp8_quant``.

``per_token_group_quant_fp8``: one pass, each program a ``BLOCK_M x BLOCK_G`` block of (row, group)
pairs, loaded as a ``[BLOCK_M, BLOCK_G, GROUP]`` tile and reduced along its last axis; the launch is a
:class:`TritonQuantConfig`. ``scaled_fp8_quant``: static and dynamic per-tensor over a flat grid of
``BLOCK_M x BLOCK_N`` tiles; dynamic per tensor in two launches without a host sync (an ``atomic_max``
of ``|x|``'s int32 bits into a zeroed word, then the quantising pass reading it); dynamic per token a
program per block of rows (whole rows up to 16384 values, else two passes over 4096-value chunks);
the launch is a :class:`TritonScaledQuantConfig`.

Arguments arrive validated (``ops.py``): fp16/bf16/fp32 input, last dim contiguous (rows may be
strided), ``group_size`` a power of two dividing the hidden size. The numerics, shared with the norm and
activation kernels' epilogues, are ``torch_kernels/backends/triton_fp8.py``'s (why each:
``docs/design/quant.md``): scales bit-equal to the reference; ``q`` bit-equal for ``scaled_fp8_quant``
(which multiplies by ``1 / scale`` as the reference does), one fp8 step at most for the groups (the
reference divides), bit-equal there too with UE8M0 scales or ``eps < 2**-100``.

``wrap``: ``None`` in eager calls; ``torch.library.wrap_triton`` when ``torch.compile`` traces the
op's ``inductor_triton`` route (``torch_kernels/library.py``). Traced, the token count is symbolic:
``BLOCK_M`` then comes from the tile alone (not shrunk to a small batch), and an empty grid is
skipped by Triton's launcher instead of an early return. ``config``: the launch, default
``for_shape`` of the op's config record (the sweep and tests pass others).
"""

import functools
from dataclasses import dataclass
from typing import Optional

import torch
import triton
import triton.language as tl
from torch import Tensor

from ... import fp8
from ...backends.rows import rows as _as_rows
from ...backends.triton_fp8 import (EXACT_DIV_EPS as _EXACT_DIV_EPS, INTERPRETED as _INTERPRETED, STATIC, TENSOR,
                                    abs_bits, abs_max, dynamic_scale, group_quantize, group_scales, quantize,
                                    static_inverse, to_e4m3 as _to_e4m3)  # noqa: F401  (_to_e4m3: the tests' kernel)
from .reference import empty_outputs

# 4096 values a program over 4 warps: four 16-byte loads in flight a thread (untuned: `bench_quant.py
# --sweep`; docs/design/quant.md).
_TILE = 4096
_ELEMENTS_PER_WARP = 1024
# Per token, rows up to 16384 values in registers (32 fp32 a thread over 16 warps); wider rows in two passes
# over chunks of 4096, the second from L2.
_ONE_PASS_MAX = 16384
_CHUNK = 4096
# MODE of the per-tensor quant's first launch: each program atomic-maxes its |x| bits, writes nothing else
_AMAX = tl.constexpr(0)


@dataclass(frozen=True)
class TritonQuantConfig:
    """How the quantisation kernel is launched; :meth:`for_shape` is what the launcher uses."""

    block_m: int  # rows per program
    block_g: int  # groups per program: a power of two dividing the group count (no column mask)
    num_warps: int

    @classmethod
    def for_shape(cls, tokens: Optional[int], groups: int, group_size: int, tile: int = _TILE) -> "TritonQuantConfig":
        """The launcher's configuration for ``tokens`` rows (``None``: not known, traced) of ``groups``
        groups: about ``tile`` elements a program; ``block_g`` the largest power of two dividing the
        group count that fits; ``block_m`` no larger than the token count needs; one warp per
        ``_ELEMENTS_PER_WARP`` elements (1 to 16). The sweep passes other ``tile``."""
        full = cls._pick(groups, group_size, tile, None)
        if tokens is None or tokens >= full.block_m:
            return full
        return cls._pick(groups, group_size, tile, tokens)

    @classmethod
    @functools.lru_cache(maxsize=None)
    def _pick(cls, groups: int, group_size: int, tile: int, tokens: Optional[int]) -> "TritonQuantConfig":
        block_g = min(groups & -groups, max(tile // group_size, 1))
        block_m = max(tile // (block_g * group_size), 1)
        if tokens is not None:
            block_m = min(block_m, triton.next_power_of_2(tokens))
        return cls(block_m, block_g, min(max(block_m * block_g * group_size // _ELEMENTS_PER_WARP, 1), 16))


@triton.jit
def _per_token_group_quant_fp8(
    x_ptr, x_row_stride,  # input (T, H) rows, read; last dim contiguous, row stride in elements
    q_ptr,  # q (T, H) float8_e4m3fn, contiguous, written
    s_ptr, s_row_stride, s_group_stride,  # scales (T, G) fp32, written: strides (G, 1) or column-major (1, T)
    T,  # rows (tokens)
    H,  # hidden size, G * GROUP
    num_group_blocks,  # G // BLOCK_G: programs along one row
    eps,  # floor of the group max (fp32)
    GROUP: tl.constexpr,  # group size, a power of two
    BLOCK_M: tl.constexpr,  # rows per program
    BLOCK_G: tl.constexpr,  # groups per program, a power of two dividing G (no column mask)
    UE8M0: tl.constexpr,  # round each scale up to a power of two
    EXACT_DIV: tl.constexpr,  # divide each element by the scale (div_rn) instead of multiplying by 1/scale
    NUMPY_MAX: tl.constexpr,  # running in Triton's interpreter: reduce with tl.max + tl.sum (see _INTERPRETED)
    EMULATE_CAST: tl.constexpr,  # running in Triton's interpreter: round to e4m3 in fp32 before the cast
):
    # Group blocks vary fastest so that consecutive programs walk along the same rows.
    pid = tl.program_id(0)
    pid_m = pid // num_group_blocks
    pid_g = pid - pid_m * num_group_blocks
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)  # [BLOCK_M]
    groups = pid_g * BLOCK_G + tl.arange(0, BLOCK_G)  # [BLOCK_G]
    row_ok = rows < T
    rows64 = rows.to(tl.int64)  # T * row stride may pass 2**31
    cols = groups[:, None] * GROUP + tl.arange(0, GROUP)[None, :]  # [BLOCK_G, GROUP], < H
    mask = row_ok[:, None, None]

    x = tl.load(x_ptr + rows64[:, None, None] * x_row_stride + cols[None, :, :], mask=mask, other=0.0)
    x = x.to(tl.float32)
    scale = group_scales(x, 2, eps, UE8M0, NUMPY_MAX)  # [BLOCK_M, BLOCK_G]
    q = group_quantize(x, scale, 2, EXACT_DIV, q_ptr.dtype.element_ty, EMULATE_CAST)

    tl.store(q_ptr + rows64[:, None, None] * H + cols[None, :, :], q, mask=mask)
    s_offsets = rows64[:, None] * s_row_stride + groups[None, :].to(tl.int64) * s_group_stride
    tl.store(s_ptr + s_offsets, scale, mask=row_ok[:, None])


def launch(x: Tensor, q: Tensor, s: Tensor, group_size: int, eps: float, scale_ue8m0: bool,
           config: Optional[TritonQuantConfig] = None, exact_div=None, emulate_cast=None, wrap=None) -> None:
    """``x (T, H)``, ``q (T, H)`` contiguous, ``s (T, G)`` with any strides. ``exact_div`` and
    ``emulate_cast`` override the numerics' choices (the benchmark's sweep, the tests)."""
    T, H = x.shape[0], int(x.shape[1])
    if wrap is None and T == 0:
        return
    groups = H // group_size
    if config is None:
        config = TritonQuantConfig.for_shape(T if wrap is None else None, groups, group_size)
    block_m, block_g = config.block_m, config.block_g
    num_group_blocks = groups // block_g
    grid = (triton.cdiv(T, block_m) * num_group_blocks,)
    (_per_token_group_quant_fp8 if wrap is None else wrap(_per_token_group_quant_fp8))[grid](
        x, x.stride(0), q, s, s.stride(0), s.stride(1), T, H, num_group_blocks, eps,
        GROUP=group_size, BLOCK_M=block_m, BLOCK_G=block_g, UE8M0=scale_ue8m0,
        EXACT_DIV=eps < _EXACT_DIV_EPS if exact_div is None else exact_div, NUMPY_MAX=_INTERPRETED,
        EMULATE_CAST=_INTERPRETED if emulate_cast is None else emulate_cast,
        num_warps=config.num_warps,
    )


def per_token_group_quant_fp8(input: Tensor, group_size: int, eps: float = 1e-10,
                              column_major_scales: bool = False, scale_ue8m0: bool = False, *, wrap=None, config=None,
                              out=None):
    q, s = empty_outputs(input, group_size, column_major_scales, out)
    H = int(input.shape[-1])
    x = input if input.dim() == 2 else input.reshape(-1, H)  # a view unless the leading dims do not collapse
    if wrap is None and x.shape[0] == 0:
        return q, s
    # The (T, G) views share the outputs' storage: leading dims are contiguous in both layouts.
    launch(x, q.view(-1, H), s.view(-1, H // group_size), group_size, eps, scale_ue8m0, config, wrap=wrap)
    return q, s


# ----------------------------------------------------------------------------------------------
# scaled_fp8_quant


@dataclass(frozen=True)
class TritonScaledQuantConfig:
    """How a ``scaled_fp8_quant`` kernel is launched; :meth:`for_shape` is what the launcher uses."""

    block_m: int  # rows per program
    block_n: int  # columns per program (per token: the whole row padded to a power of two, or a chunk)
    num_warps: int

    @classmethod
    def for_shape(cls, tokens: Optional[int], hidden: int, per_token: bool, tile: int = _TILE) -> "TritonScaledQuantConfig":
        """The launcher's configuration for ``tokens`` rows (``None``: not known, traced) of ``hidden``
        values: per token, the row (up to ``_ONE_PASS_MAX``, else chunks of ``_CHUNK``); otherwise up to
        ``tile`` columns; then rows filling ``tile`` values, no more than the token count needs; one
        warp per ``_ELEMENTS_PER_WARP`` values (1 to 16)."""
        full = cls._pick(hidden, per_token, tile, None)
        if tokens is None or tokens >= full.block_m:
            return full
        return cls._pick(hidden, per_token, tile, tokens)

    @classmethod
    @functools.lru_cache(maxsize=None)
    def _pick(cls, hidden: int, per_token: bool, tile: int, tokens: Optional[int]) -> "TritonScaledQuantConfig":
        row = triton.next_power_of_2(hidden)
        block_n = (row if row <= _ONE_PASS_MAX else _CHUNK) if per_token else min(row, tile)
        block_m = max(tile // block_n, 1)
        if tokens is not None:
            block_m = min(block_m, triton.next_power_of_2(max(tokens, 1)))
        return cls(block_m, block_n, min(max(block_m * block_n // _ELEMENTS_PER_WARP, 1), 16))


@triton.jit
def _scaled_fp8_quant_tiles(
    x_ptr, x_row_stride,  # input (T, H) rows, read; last dim contiguous
    q_ptr,  # q (T, H) float8_e4m3fn, contiguous, written (not with MODE _AMAX)
    s_ptr,  # the (1,) fp32 scale, written by program 0 (not with MODE _AMAX)
    scale_ptr,  # the static scale (MODE STATIC), read
    amax_ptr,  # int32 bits of max |x| (MODE TENSOR: read; _AMAX: atomic max into it)
    T, H,  # rows, hidden size
    n_col_blocks,  # cdiv(H, BLOCK_N): programs along a row
    MODE: tl.constexpr,  # STATIC, TENSOR (quantise with the amax), or _AMAX (the amax pass)
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    EMULATE_CAST: tl.constexpr,  # running in Triton's interpreter: round to e4m3 in fp32 before the cast
):
    # Column blocks vary fastest: consecutive programs stream consecutive memory.
    pid = tl.program_id(0)
    pid_m = pid // n_col_blocks
    pid_n = pid - pid_m * n_col_blocks
    rows = (pid_m * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)  # T * row stride may pass 2**31
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask = (rows < T)[:, None] & (cols < H)[None, :]
    x = tl.load(x_ptr + rows[:, None] * x_row_stride + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    if MODE == _AMAX:
        tl.atomic_max(amax_ptr, tl.max(tl.max(abs_bits(x), 1), 0))  # masked values are 0: below every |x|
    else:
        if MODE == STATIC:
            scale = tl.load(scale_ptr)
            inv = static_inverse(scale_ptr)
        else:
            scale = dynamic_scale(tl.load(amax_ptr).to(tl.float32, bitcast=True), 0.0, False)
            inv = tl.math.div_rn(1.0, scale)
        tl.store(q_ptr + rows[:, None] * H + cols[None, :], quantize(x, inv, q_ptr.dtype.element_ty, EMULATE_CAST),
                 mask=mask)
        if pid == 0:
            tl.store(s_ptr, scale)


@triton.jit
def _scaled_fp8_quant_rows(
    x_ptr, x_row_stride,  # input (T, H) rows, read; last dim contiguous
    q_ptr,  # q (T, H) float8_e4m3fn, contiguous, written
    s_ptr,  # scales (T,) fp32, written
    ub_ptr,  # scale_ub, read with HAS_UB
    T, H,
    HAS_UB: tl.constexpr,
    BLOCK_M: tl.constexpr,  # rows per program
    BLOCK_N: tl.constexpr,  # the row padded to a power of two (ONE_PASS) or a chunk
    ONE_PASS: tl.constexpr,  # BLOCK_N >= H: the row is held in registers
    NUMPY_MAX: tl.constexpr,  # running in Triton's interpreter: reduce with tl.max + tl.sum
    EMULATE_CAST: tl.constexpr,
):
    rows = (tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    row_ok = rows < T
    x_rows = x_ptr + rows[:, None] * x_row_stride
    q_rows = q_ptr + rows[:, None] * H
    cols = tl.arange(0, BLOCK_N)[None, :]
    if ONE_PASS:
        mask = row_ok[:, None] & (cols < H)
        x = tl.load(x_rows + cols, mask=mask, other=0.0).to(tl.float32)
        amax = abs_max(x, 1, NUMPY_MAX)
    else:
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        for start in range(0, H, BLOCK_N):
            mask = row_ok[:, None] & (start + cols < H)
            x = tl.load(x_rows + start + cols, mask=mask, other=0.0, eviction_policy="evict_last").to(tl.float32)
            acc = tl.maximum(acc, tl.abs(x), propagate_nan=tl.PropagateNan.ALL)
        amax = abs_max(acc, 1, NUMPY_MAX)
    if HAS_UB:
        ub = tl.load(ub_ptr)
    else:
        ub = 0.0
    scale = dynamic_scale(amax, ub, HAS_UB)  # [BLOCK_M]
    inv = tl.math.div_rn(tl.full(scale.shape, 1.0, tl.float32), scale)[:, None]
    if ONE_PASS:
        tl.store(q_rows + cols, quantize(x, inv, q_ptr.dtype.element_ty, EMULATE_CAST), mask=mask)
    else:
        for start in range(0, H, BLOCK_N):
            mask = row_ok[:, None] & (start + cols < H)
            x = tl.load(x_rows + start + cols, mask=mask, other=0.0, eviction_policy="evict_first").to(tl.float32)
            tl.store(q_rows + start + cols, quantize(x, inv, q_ptr.dtype.element_ty, EMULATE_CAST), mask=mask)
    tl.store(s_ptr + rows, scale, mask=row_ok)


def scaled_launch(x: Tensor, q: Tensor, s: Tensor, scale: Optional[Tensor], per_token: bool, scale_ub: Optional[Tensor],
                  config: Optional[TritonScaledQuantConfig] = None, emulate_cast=None, wrap=None) -> None:
    """``x (T, H)``, ``q (T, H)`` contiguous, ``s``: ``(T,)`` per token, else ``(1,)``."""
    T, H = x.shape[0], int(x.shape[1])
    if config is None:
        config = TritonScaledQuantConfig.for_shape(T if wrap is None else None, H, per_token)
    emulate = _INTERPRETED if emulate_cast is None else emulate_cast
    bm, bn, warps = config.block_m, config.block_n, config.num_warps
    if scale is None and per_token:
        if wrap is None and T == 0:
            return
        (_scaled_fp8_quant_rows if wrap is None else wrap(_scaled_fp8_quant_rows))[(triton.cdiv(T, bm),)](
            x, x.stride(0), q, s, x if scale_ub is None else scale_ub, T, H,
            HAS_UB=scale_ub is not None, BLOCK_M=bm, BLOCK_N=bn, ONE_PASS=bn >= H, NUMPY_MAX=_INTERPRETED,
            EMULATE_CAST=emulate, num_warps=warps)
        return
    kernel = _scaled_fp8_quant_tiles if wrap is None else wrap(_scaled_fp8_quant_tiles)
    n_col_blocks = triton.cdiv(H, bn)
    amax = x
    if scale is None:
        amax = torch.zeros((1,), dtype=torch.int32, device=x.device)
        if wrap is not None or T:
            kernel[(triton.cdiv(T, bm) * n_col_blocks,)](
                x, x.stride(0), q, s, x, amax, T, H, n_col_blocks, MODE=_AMAX.value, BLOCK_M=bm, BLOCK_N=bn,
                EMULATE_CAST=emulate, num_warps=warps)
    # at least one program, which writes the scale: zero tokens have one too (traced: T + bm, no guard on T)
    row_blocks = max(triton.cdiv(T, bm), 1) if wrap is None else (T + bm) // bm
    kernel[(row_blocks * n_col_blocks,)](
        x, x.stride(0), q, s, x if scale is None else scale, amax, T, H, n_col_blocks,
        MODE=(TENSOR if scale is None else STATIC).value, BLOCK_M=bm, BLOCK_N=bn, EMULATE_CAST=emulate, num_warps=warps)


def scaled_fp8_quant(input: Tensor, scale: Optional[Tensor] = None, per_token: bool = False,
                     scale_ub: Optional[Tensor] = None, *, wrap=None, config=None, out=None):
    H = int(input.shape[-1])
    q, s = fp8.empty_outputs(input, H, scale, fp8.PER_TOKEN, False, per_token, out)
    # s: (1,) per tensor, (..., 1) per token, as (T,) rows (contiguous either way)
    scaled_launch(_as_rows(input), q.view(-1, H), s.view(-1), scale, per_token, scale_ub, config, wrap=wrap)
    return q, s
