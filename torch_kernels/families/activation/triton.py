"""Triton gated activations: ``(..., 2d) -> (..., d)``, ``act(x[..., :d]) * x[..., d:]``.

A streaming kernel, written for bandwidth: a 2-D decomposition over row blocks x column blocks, each
program reading one ``BLOCK_M x BLOCK_N`` tile of the gate and the tile ``d`` columns to its right
(the up half), computing in fp32 and writing one tile of the output. Programs are numbered column
block fastest (one flat grid axis, one scalar division per program), so that consecutive programs
stream consecutive memory as Inductor's flat pointwise grid does; ``FLAT=False`` launches the 2-D
grid instead (rows on axis 0), kept for the GPU sweep to compare. The launch is a
:class:`TritonActivationConfig`; :meth:`TritonActivationConfig.for_shape` picks it. Arguments arrive
validated (``ops.py``): last dim contiguous and even, dtype fp16/bf16/fp32.

``wrap``: ``None`` in eager calls; ``torch.library.wrap_triton`` when ``torch.compile`` traces the
op's ``inductor_triton`` route (``torch_kernels/library.py``). Traced, the row count is symbolic, so
no launch choice reads it: one launch (checked at run time to fit the grid), rows masked unless a
program holds one row, and an empty grid skipped by Triton's launcher instead of an early return.
``config``: the launch, default ``TritonActivationConfig.for_shape`` (the sweep and tests pass others).

``silu_and_mul_fp8_quant``: the same ``act(gate) * up``, rounded to the input's dtype as the output
would be, then the FP8 epilogue (``backends/triton_fp8.py``): static and per group over the same flat
grid of tiles (whole groups a tile), per token a program per block of whole rows (two passes over
chunks beyond 16384 outputs); ``config`` from :meth:`TritonActivationConfig.for_quant`.
"""

import functools
from dataclasses import dataclass
from typing import Optional

import torch
import triton
import triton.language as tl
from torch import Tensor

from ... import fp8, outputs
from ...backends.rows import rows
from ...backends.triton_fp8 import (GROUP_EPS, INTERPRETED, STATIC, TOKEN, abs_max, dynamic_scale, group_quantize,
                                    group_scales, mode, quantize, static_inverse)

# 1024 outputs over 4 warps, one 16-byte load of each half a thread: Inductor's pointwise tile, whose
# kernel ran this op at 4348 GB/s (H200; docs/design/activation.md; `bench_activation.py --sweep`).
_TILE = 1024
_ELEMENTS_PER_THREAD = 8
# CUDA grid limits: axis 0 takes 2^31 - 1 programs, axis 1 only 65535; larger launches are split.
_MAX_GRID_0 = 2**31 - 1
_MAX_GRID_1 = 65535
# silu_and_mul_fp8_quant per token: rows up to 16384 outputs held in registers (32 a thread over 16 warps),
# about one warp per 512 outputs; wider rows in two passes over chunks of 4096, the second from L2.
_ONE_PASS_MAX = 16384
_CHUNK = 4096
_ROW_ELEMENTS_PER_THREAD = 16


@dataclass(frozen=True)
class TritonActivationConfig:
    """How the gated-activation kernel is launched; :meth:`for_shape` is what the launchers use."""

    block_m: int  # rows per program: 1 unless rows are shorter than the tile
    block_n: int  # output columns per program
    num_warps: int
    # Program order: flat, column block fastest, as Inductor's pointwise grid (`--sweep` times the 2-D grid).
    flat: bool = True

    @classmethod
    @functools.lru_cache(maxsize=None)
    def for_shape(cls, d: int, tile: int = _TILE, per_thread: int = _ELEMENTS_PER_THREAD) -> "TritonActivationConfig":
        """The launchers' configuration for output rows of ``d`` elements: ``block_n`` the row up to
        ``tile`` elements, ``block_m`` rows filling the tile when the row is shorter, one warp per
        ``32 * per_thread`` elements of the tile (1 to 16); the sweep passes other ``tile`` and
        ``per_thread``."""
        block_n = min(triton.next_power_of_2(d), tile)
        block_m = max(1, tile // block_n)
        return cls(block_m, block_n, min(max(block_m * block_n // (32 * per_thread), 1), 16))

    @classmethod
    @functools.lru_cache(maxsize=None)
    def for_quant(cls, d: int, group_size: int, tile: int = _TILE) -> "TritonActivationConfig":
        """The FP8 op's configuration for output rows of ``d``: static, :meth:`for_shape`'s tile; per
        group, a tile of whole groups; per token (``group_size`` -1), a program per block of whole rows
        (``block_n`` the row padded to a power of two, or a chunk of ``_CHUNK`` beyond ``_ONE_PASS_MAX``)."""
        if group_size == fp8.PER_TOKEN:
            row = triton.next_power_of_2(d)
            block_n = row if row <= _ONE_PASS_MAX else _CHUNK
            block_m = max(1, tile // block_n)
            return cls(block_m, block_n, min(max(block_m * block_n // (32 * _ROW_ELEMENTS_PER_THREAD), 1), 16))
        base = cls.for_shape(d, tile)
        if group_size <= base.block_n:
            return base
        return cls(1, group_size, min(max(group_size // (32 * _ELEMENTS_PER_THREAD), 1), 16))


@triton.jit
def _activate(g, ACT: tl.constexpr):
    """``act(g)`` in fp32 for ``ACT`` in ``"silu"``, ``"gelu"`` (erf), ``"gelu_tanh"``."""
    if ACT == "silu":
        y = g * tl.sigmoid(g)
    elif ACT == "gelu":
        # 1 + erf(z), z = g / sqrt(2), from erfc(|z|) ~ t * P(t) * exp(-z^2), t = 1 / (1 + 0.3275911 |z|)
        # (Abramowitz & Stegun 7.1.26, within 2.1e-7 absolute): libdevice's erff branches on |z|, and
        # the kernel ran at 3513 GB/s with it against silu's 4351 (8192x2*14336 bf16, H200).
        z = tl.abs(g) * 0.7071067811865476  # 1/sqrt(2)
        t = 1.0 / (1.0 + 0.3275911 * z)
        erfc = t * (0.254829592 + t * (-0.284496736 + t * (1.421413741 + t * (-1.453152027 + t * 1.061405429))))
        erfc = erfc * tl.exp(-z * z)
        y = 0.5 * g * tl.where(g >= 0, 2.0 - erfc, erfc)  # no cancellation for negative g
    else:
        # 0.5 * (1 + tanh(u)) == sigmoid(2u) exactly, so gelu_tanh(g) = g * sigmoid(2u) with
        # u = sqrt(2/pi) * (g + 0.044715 g^3): Triton has no portable tanh (tl.math lacks it, the
        # libdevice path moved between versions), and this form never cancels for negative g.
        y = g * tl.sigmoid(1.5957691216057308 * (g + 0.044715 * g * g * g))  # 2 * sqrt(2/pi)
    return y


@triton.jit
def _act_and_mul_kernel(
    x_ptr,  # input rows (T, 2d): gate at columns [0, d), up at [d, 2d); last dim contiguous; read
    x_row_stride,  # elements between consecutive input rows (>= 2d: rows may be strided)
    out_ptr,  # output rows (T, d); written
    out_row_stride,  # elements between consecutive output rows
    n_rows,  # rows in this launch
    n_cols,  # output columns in this launch (d, or a chunk of it when d needs more than 65535 blocks)
    up_offset,  # d: how far right of the gate its up value lies in the input row
    n_col_blocks,  # cdiv(n_cols, BLOCK_N): programs per row block on the flat grid
    ACT: tl.constexpr,  # "silu", "gelu" (erf) or "gelu_tanh"
    BLOCK_M: tl.constexpr,  # rows per program: 1 unless rows are shorter than the tile
    BLOCK_N: tl.constexpr,  # output columns per program
    EVEN: tl.constexpr,  # n_rows % BLOCK_M == 0 and n_cols % BLOCK_N == 0: no masks
    FLAT: tl.constexpr,  # one grid axis numbered column block fastest; else a (row blocks, column blocks) grid
):
    if FLAT:
        pid_m = tl.program_id(0) // n_col_blocks
        pid_n = tl.program_id(0) - pid_m * n_col_blocks
    else:
        pid_m = tl.program_id(0)
        pid_n = tl.program_id(1)
    # int64 for everything that multiplies a row stride: T x 2d passes 2^31 elements in long prefills
    # (8192 x 28672 is 2^27.8; 128k tokens of the same model 2^31.8).
    row0 = pid_m.to(tl.int64) * BLOCK_M
    rows = tl.arange(0, BLOCK_M).to(tl.int64)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    gate_ptrs = x_ptr + row0 * x_row_stride + rows[:, None] * x_row_stride + cols[None, :]
    out_ptrs = out_ptr + row0 * out_row_stride + rows[:, None] * out_row_stride + cols[None, :]
    if EVEN:
        g = tl.load(gate_ptrs).to(tl.float32)
        u = tl.load(gate_ptrs + up_offset).to(tl.float32)
        tl.store(out_ptrs, (_activate(g, ACT) * u).to(out_ptr.dtype.element_ty))
    else:
        mask = (row0 + rows[:, None] < n_rows) & (cols[None, :] < n_cols)
        g = tl.load(gate_ptrs, mask=mask, other=0.0).to(tl.float32)
        u = tl.load(gate_ptrs + up_offset, mask=mask, other=0.0).to(tl.float32)
        tl.store(out_ptrs, (_activate(g, ACT) * u).to(out_ptr.dtype.element_ty), mask=mask)


def launch(x: Tensor, out: Tensor, act: str, config: TritonActivationConfig, wrap=None) -> None:
    """``out = act(x[:, :d]) * x[:, d:]`` for 2-D row views ``x`` (T, 2d) and ``out`` (T, d)."""
    T, d = out.shape[0], int(out.shape[1])
    if wrap is None and T == 0:
        return
    block_m, block_n = config.block_m, config.block_n
    if config.flat:
        cols_per_launch = _MAX_GRID_0 * block_n
        rows_per_launch = _MAX_GRID_0 // triton.cdiv(min(d, cols_per_launch), block_n) * block_m
    else:
        rows_per_launch, cols_per_launch = _MAX_GRID_0 * block_m, _MAX_GRID_1 * block_n
    if wrap is not None:  # traced: T is symbolic, so one launch, checked when it runs
        torch._check(d <= cols_per_launch)
        torch._check(T <= rows_per_launch, lambda: f"{T} rows of {d} exceed one launch of the traced route")
    elif T > rows_per_launch or d > cols_per_launch:  # no realistic shape: several launches
        for r0 in range(0, T, rows_per_launch):
            for c0 in range(0, d, cols_per_launch):
                xs, os_ = x[r0:r0 + rows_per_launch, c0:], out[r0:r0 + rows_per_launch, c0:]
                _launch_one(xs, os_, xs.shape[0], min(cols_per_launch, d - c0), d, act, config)
        return
    _launch_one(x, out, T, d, d, act, config, wrap)


def _launch_one(x, out, n_rows, n_cols, up_offset, act, config, wrap=None):
    block_m, block_n, flat = config.block_m, config.block_n, config.flat
    row_blocks, col_blocks = triton.cdiv(n_rows, block_m), triton.cdiv(n_cols, block_n)
    # traced, n_rows is symbolic: masked rows unless every program holds one row
    even_rows = block_m == 1 or (wrap is None and n_rows % block_m == 0)
    (_act_and_mul_kernel if wrap is None else wrap(_act_and_mul_kernel))[
        (row_blocks * col_blocks,) if flat else (row_blocks, col_blocks)](
        x, x.stride(0), out, out.stride(0), n_rows, n_cols, up_offset, col_blocks,
        ACT=act, BLOCK_M=block_m, BLOCK_N=block_n, EVEN=even_rows and n_cols % block_n == 0,
        FLAT=flat, num_warps=config.num_warps,
    )


def act_and_mul(input: Tensor, act: str, wrap=None, config: Optional[TritonActivationConfig] = None,
                out=None) -> Tensor:
    d = int(input.shape[-1]) // 2
    shape = (*input.shape[:-1], d)
    y = (torch.empty(shape, dtype=input.dtype, device=input.device) if out is None
         else outputs.given(out, 0, shape, input.dtype, input.device))
    launch(rows(input), y.view(-1, d), act, config or TritonActivationConfig.for_shape(d), wrap=wrap)
    return y


def silu_and_mul(input: Tensor, *, wrap=None, config=None, out=None) -> Tensor:
    return act_and_mul(input, "silu", wrap, config, out)


def gelu_and_mul(input: Tensor, approximate: str = "none", *, wrap=None, config=None, out=None) -> Tensor:
    return act_and_mul(input, "gelu_tanh" if approximate == "tanh" else "gelu", wrap, config, out)


def gelu_tanh_and_mul(input: Tensor, *, wrap=None, config=None, out=None) -> Tensor:
    return act_and_mul(input, "gelu_tanh", wrap, config, out)


# ----------------------------------------------------------------------------------------------
# silu_and_mul_fp8_quant: the activation above, its value rounded to the input's dtype as silu_and_mul
# writes it, then the FP8 epilogue of backends/triton_fp8.py: bit for bit silu_and_mul, then the quant
# family's Triton kernel.


@triton.jit
def _act_tile(x_ptr, offs, up_offset, mask, ACT: tl.constexpr):
    """``act(gate) * up`` at ``offs`` (fp32), rounded to the input's dtype as the output would be."""
    g = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(x_ptr + offs + up_offset, mask=mask, other=0.0).to(tl.float32)
    return (_activate(g, ACT) * u).to(x_ptr.dtype.element_ty).to(tl.float32)


@triton.jit
def _act_and_mul_quant_tiles(
    x_ptr, x_row_stride,  # input rows (T, 2d), read
    q_ptr,  # q (T, d) float8_e4m3fn, contiguous, written
    s_ptr, s_row_stride, s_group_stride,  # scales: (1,) static (written by program 0), (T, G) per group
    scale_ptr,  # the static scale (QUANT STATIC), read
    n_rows, d,
    n_col_blocks,  # cdiv(d, BLOCK_N): programs along a row
    ACT: tl.constexpr,
    QUANT: tl.constexpr,  # STATIC or GROUP
    GROUP_SIZE: tl.constexpr,  # QUANT GROUP: a power of two dividing d and BLOCK_N
    UE8M0: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    NUMPY_MAX: tl.constexpr,  # running in Triton's interpreter: reduce with tl.max + tl.sum
    EMULATE_CAST: tl.constexpr,  # running in Triton's interpreter: round to e4m3 in fp32 before the cast
):
    # Column blocks vary fastest, as the unquantised kernel's flat grid.
    pid = tl.program_id(0)
    pid_m = pid // n_col_blocks
    pid_n = pid - pid_m * n_col_blocks
    rows = (pid_m * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)  # T x 2d may pass 2^31
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask = (rows < n_rows)[:, None] & (cols < d)[None, :]
    y = _act_tile(x_ptr, rows[:, None] * x_row_stride + cols[None, :], d, mask, ACT)
    if QUANT == STATIC:
        q = quantize(y, static_inverse(scale_ptr), q_ptr.dtype.element_ty, EMULATE_CAST)
        if pid == 0:
            tl.store(s_ptr, tl.load(scale_ptr))
    else:
        yg = tl.reshape(y, [BLOCK_M, BLOCK_N // GROUP_SIZE, GROUP_SIZE])
        scale = group_scales(yg, 2, GROUP_EPS, UE8M0, NUMPY_MAX)  # [BLOCK_M, BLOCK_N // GROUP_SIZE]
        q = tl.reshape(group_quantize(yg, scale, 2, False, q_ptr.dtype.element_ty, EMULATE_CAST), [BLOCK_M, BLOCK_N])
        groups = pid_n * (BLOCK_N // GROUP_SIZE) + tl.arange(0, BLOCK_N // GROUP_SIZE)
        tl.store(s_ptr + rows[:, None] * s_row_stride + groups[None, :].to(tl.int64) * s_group_stride, scale,
                 mask=(rows < n_rows)[:, None] & (groups * GROUP_SIZE < d)[None, :])
    tl.store(q_ptr + rows[:, None] * d + cols[None, :], q, mask=mask)


@triton.jit
def _act_and_mul_quant_rows(
    x_ptr, x_row_stride,  # input rows (T, 2d), read
    q_ptr,  # q (T, d) float8_e4m3fn, contiguous, written
    s_ptr,  # scales (T,) fp32, written
    n_rows, d,
    ACT: tl.constexpr,
    BLOCK_M: tl.constexpr,  # rows per program
    BLOCK_N: tl.constexpr,  # the row padded to a power of two (ONE_PASS) or a chunk
    ONE_PASS: tl.constexpr,
    NUMPY_MAX: tl.constexpr,
    EMULATE_CAST: tl.constexpr,
):
    rows = (tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    row_ok = rows < n_rows
    x_rows = rows[:, None] * x_row_stride
    q_rows = q_ptr + rows[:, None] * d
    cols = tl.arange(0, BLOCK_N)[None, :]
    if ONE_PASS:
        mask = row_ok[:, None] & (cols < d)
        y = _act_tile(x_ptr, x_rows + cols, d, mask, ACT)
        amax = abs_max(y, 1, NUMPY_MAX)
    else:  # the row's amax first, y recomputed (from L2) in a second pass
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        for start in range(0, d, BLOCK_N):
            y = _act_tile(x_ptr, x_rows + start + cols, d, row_ok[:, None] & (start + cols < d), ACT)
            acc = tl.maximum(acc, tl.abs(y), propagate_nan=tl.PropagateNan.ALL)
        amax = abs_max(acc, 1, NUMPY_MAX)
    scale = dynamic_scale(amax, 0.0, False)  # [BLOCK_M]
    inv = tl.math.div_rn(tl.full(scale.shape, 1.0, tl.float32), scale)[:, None]
    if ONE_PASS:
        tl.store(q_rows + cols, quantize(y, inv, q_ptr.dtype.element_ty, EMULATE_CAST), mask=mask)
    else:
        for start in range(0, d, BLOCK_N):
            mask = row_ok[:, None] & (start + cols < d)
            y = _act_tile(x_ptr, x_rows + start + cols, d, mask, ACT)
            tl.store(q_rows + start + cols, quantize(y, inv, q_ptr.dtype.element_ty, EMULATE_CAST), mask=mask)
    tl.store(s_ptr + rows, scale, mask=row_ok)


def launch_quant(x: Tensor, q: Tensor, s: Tensor, act: str, scale: Optional[Tensor], group_size: int, ue8m0: bool,
                 config: TritonActivationConfig, wrap=None) -> None:
    """``q = quant(act(x[:, :d]) * x[:, d:])`` for 2-D row views ``x`` (T, 2d), ``q`` (T, d); ``s`` the
    scales as ``(1,)`` static, ``(T,)`` per token, ``(T, G)`` per group."""
    T, d = q.shape[0], int(q.shape[1])
    if wrap is None and T == 0:
        return
    bm, bn = config.block_m, config.block_n
    quant = mode(scale, group_size)
    if quant == TOKEN.value:
        (_act_and_mul_quant_rows if wrap is None else wrap(_act_and_mul_quant_rows))[(triton.cdiv(T, bm),)](
            x, x.stride(0), q, s, T, d, ACT=act, BLOCK_M=bm, BLOCK_N=bn, ONE_PASS=bn >= d,
            NUMPY_MAX=INTERPRETED, EMULATE_CAST=INTERPRETED, num_warps=config.num_warps)
        return
    n_col_blocks = triton.cdiv(d, bn)
    s2 = s.view(1, 1) if s.dim() == 1 else s
    (_act_and_mul_quant_tiles if wrap is None else wrap(_act_and_mul_quant_tiles))[(triton.cdiv(T, bm) * n_col_blocks,)](
        x, x.stride(0), q, s, s2.stride(0), s2.stride(1), x if scale is None else scale, T, d, n_col_blocks,
        ACT=act, QUANT=quant, GROUP_SIZE=max(group_size, 1), UE8M0=ue8m0, BLOCK_M=bm, BLOCK_N=bn,
        NUMPY_MAX=INTERPRETED, EMULATE_CAST=INTERPRETED, num_warps=config.num_warps)


def silu_and_mul_fp8_quant(input: Tensor, scale: Optional[Tensor] = None, group_size: int = -1,
                           column_major_scales: bool = False, scale_ue8m0: bool = False, *, wrap=None, config=None,
                           out=None):
    d = int(input.shape[-1]) // 2
    q, s = fp8.empty_outputs(input, d, scale, group_size, column_major_scales, out=out)
    if scale is not None and (wrap is not None or q.numel() == 0):  # traced, the grid may be empty
        s = scale.reshape(1).clone() if out is None else s.copy_(scale.reshape(1))
    s_rows = s if scale is not None else s.view(-1) if group_size == fp8.PER_TOKEN else s.view(-1, s.shape[-1])
    launch_quant(rows(input), q.view(-1, d), s_rows, "silu", scale, group_size, scale_ue8m0,
                 config or TritonActivationConfig.for_quant(d, group_size), wrap=wrap)
    return q, s
