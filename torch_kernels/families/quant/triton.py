"""Triton ``per_token_group_quant_fp8``: one pass, each program a ``BLOCK_M x BLOCK_G`` block of
(row, group) pairs, loaded as a ``[BLOCK_M, BLOCK_G, GROUP]`` tile and reduced along its last axis.
The launch is a :class:`TritonQuantConfig`; :meth:`TritonQuantConfig.for_shape` picks it.

Arguments arrive validated (``ops.py``): fp16/bf16/fp32 input, last dim contiguous
(rows may be strided), ``group_size`` a power of two dividing the hidden size.

Numerics against the reference (``families/quant/reference.py``; why each: ``docs/design/quant.md``):
* the scale is ``div_rn(amax, 448)`` (Triton's ``/`` is ``div.full.f32``, up to 2 ulp off): bit-equal;
* ``q = x * div_rn(1, scale)``: one fp8 step at most from ``x / scale``, exact with UE8M0 scales; with
  ``eps < 2**-100`` the reciprocal could overflow, so those calls divide each element (bit-equal);
* on the GPU ``y.to(float8e4nv)`` is ``cvt.rn.satfinite.e4m3x2.f32``, ``clamp(y, -448, 448)`` cast bit
  for bit. Triton's interpreter (the CPU test path) truncates with a broken carry (3218 of 20,700
  values near the fp8 grid wrong), so there (``EMULATE_CAST``) :func:`_round_to_e4m3` rounds in fp32
  first; ``tests/test_quant.py`` checks both roundings bit for bit.

``wrap``: ``None`` in eager calls; ``torch.library.wrap_triton`` when ``torch.compile`` traces the
op's ``inductor_triton`` route (``torch_kernels/library.py``). Traced, the token count is symbolic:
``BLOCK_M`` then comes from the tile alone (not shrunk to a small batch), and an empty grid is
skipped by Triton's launcher instead of an early return. ``config``: the launch, default
``TritonQuantConfig.for_shape`` (the sweep and tests pass others).
"""

import functools
import os
from dataclasses import dataclass
from typing import Optional

import triton
import triton.language as tl
from torch import Tensor

from .reference import FP8_MAX as _FP8_MAX_FLOAT, empty_outputs

FP8_MAX = tl.constexpr(_FP8_MAX_FLOAT)  # 448.0, the largest float8_e4m3fn

# 4096 values a program over 4 warps: four 16-byte loads in flight a thread (untuned: `bench_quant.py
# --sweep`; docs/design/quant.md).
_TILE = 4096
_ELEMENTS_PER_WARP = 1024
# Below this eps the reciprocal of the scale may overflow: divide every element instead.
_EXACT_DIV_EPS = 2.0 ** -100
# The interpreter takes tl.max plus a NaN-carrying sum: a custom combine there is a Python loop per
# element (0.5 s for one 4096-value program); same result as the GPU's max.NaN.f32 combine.
_INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"


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
def _max_propagate_nan(a, b):
    return tl.maximum(a, b, propagate_nan=tl.PropagateNan.ALL)


@triton.jit
def _pow2_ceil(s):
    """The smallest power of two >= s (fp32, s >= 0), exactly, from the bits; NaN stays NaN."""
    bits = s.to(tl.int32, bitcast=True)
    up = ((bits + 0x7FFFFF) & 0x7F800000).to(tl.float32, bitcast=True)
    return tl.where(s != s, s, up)


@triton.jit
def _round_to_e4m3(y):
    """``clamp(y, -448, 448)`` rounded to the nearest float8_e4m3fn value (ties to even), as an fp32
    holding that value exactly; NaN stays NaN (re-encoded so that the interpreter's cast keeps it).

    Adding ``magic = 1.5 * 2**(e + 20)`` (``e`` the exponent of ``|y|``, floored at e4m3's smallest
    normal exponent -6) puts the sum in a binade whose fp32 ulp is e4m3's spacing ``2**(e - 3)`` at
    ``|y|``, so the fp32 add rounds ``|y|`` to that spacing, ties to even; subtracting ``magic``
    is exact. ``|y| <= 448`` keeps the result <= 448, the largest finite e4m3 value."""
    a = tl.minimum(tl.abs(y), FP8_MAX, propagate_nan=tl.PropagateNan.ALL)
    exponent = tl.maximum(a.to(tl.int32, bitcast=True) >> 23, 121)  # biased; 121 = 127 - 6
    magic = (((exponent + 20) << 23) | 0x400000).to(tl.float32, bitcast=True)
    r = (a + magic) - magic  # >= 0
    # The sign of y, -0.0 included, by the bit: Triton lowers ``-r`` to ``0 - r`` (sub.f32), which
    # turns -0.0 into +0.0 on the GPU (numpy's negation in the interpreter keeps it).
    sign = y.to(tl.int32, bitcast=True) & -2147483648  # 0x80000000
    r = (r.to(tl.int32, bitcast=True) | sign).to(tl.float32, bitcast=True)
    # A NaN whose top three mantissa bits are set: the interpreter's cast keeps it NaN (0x7F);
    # the GPU's cast maps every NaN to NaN.
    nan = tl.full(r.shape, 0x7FF00000, tl.int32).to(tl.float32, bitcast=True)
    return tl.where(a != a, nan, r)


@triton.jit
def _to_e4m3(y, dtype: tl.constexpr, EMULATE: tl.constexpr):
    """fp32 ``y`` as float8_e4m3fn (``dtype``), ``clamp(y, -448, 448).to(float8_e4m3fn)`` bit for bit."""
    if EMULATE:  # the interpreter, whose own cast is wrong: round in fp32 first
        return _round_to_e4m3(y).to(dtype)
    else:  # cvt.rn.satfinite.e4m3x2.f32: nearest even, saturating at +-448, NaN -> NaN
        return y.to(dtype)


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
    if NUMPY_MAX:  # the interpreter: numpy's nanmax, plus a sum that is NaN where the group holds a NaN
        amax = tl.max(tl.abs(x), 2) + tl.sum(tl.where(x != x, x, 0.0), 2)
    else:  # max.NaN.f32: a group holding a NaN gets a NaN max (tl.max would skip it)
        amax = tl.reduce(tl.abs(x), 2, _max_propagate_nan)  # [BLOCK_M, BLOCK_G]
    # eps arrives as fp32 from an eager launch but as fp64 when Inductor launches the kernel itself
    amax = tl.maximum(amax, tl.cast(eps, tl.float32), propagate_nan=tl.PropagateNan.ALL)
    scale = tl.math.div_rn(amax, FP8_MAX)
    if UE8M0:
        scale = _pow2_ceil(scale)
    if EXACT_DIV:
        y = tl.math.div_rn(x, scale[:, :, None])
    else:
        y = x * tl.math.div_rn(tl.full(scale.shape, 1.0, tl.float32), scale)[:, :, None]
    q = _to_e4m3(y, q_ptr.dtype.element_ty, EMULATE_CAST)

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
                              column_major_scales: bool = False, scale_ue8m0: bool = False, *, wrap=None, config=None):
    q, s = empty_outputs(input, group_size, column_major_scales)
    H = int(input.shape[-1])
    x = input if input.dim() == 2 else input.reshape(-1, H)  # a view unless the leading dims do not collapse
    if wrap is None and x.shape[0] == 0:
        return q, s
    # The (T, G) views share the outputs' storage: leading dims are contiguous in both layouts.
    launch(x, q.view(-1, H), s.view(-1, H // group_size), group_size, eps, scale_ue8m0, config, wrap=wrap)
    return q, s
