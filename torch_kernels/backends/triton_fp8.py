"""The Triton FP8 epilogue every quantising kernel shares (the quant family's ops, and the norm and
activation ops that end in a quant): ``torch_kernels/fp8.py``'s numerics as ``@triton.jit`` helpers,
so that a fused kernel's ``q`` and scales equal, bit for bit, those of the quant kernel run on its
unquantised output.

* static: ``q = x * div_rn(1, scale)``, NaN where the scale is not positive and finite (read on the
  device: no host sync);
* per token or tensor: ``scale = max(min(amax, ub) * fp32(1/448), MIN_SCALE)``, ``q = x * div_rn(1, scale)``;
* per group: ``scale = div_rn(max(amax, eps), 448)`` (UE8M0: the power-of-two ceiling), ``q = x *
  div_rn(1, scale)``: one fp8 step at most from the reference's ``x / scale``; below ``eps = 2^-100``
  the reciprocal may overflow, so those calls divide each element (``EXACT_DIV``, bit-equal).

Triton's ``/`` is ``div.full.f32`` (up to 2 ulp off), hence ``div_rn`` everywhere. On the GPU
``y.to(float8e4nv)`` is ``cvt.rn.satfinite.e4m3x2.f32``: ``clamp(y, -448, 448)`` cast, bit for bit.
Triton's interpreter (the CPU test path) truncates with a broken carry (3218 of 20,700 values near the
fp8 grid wrong), so there (``EMULATE``) :func:`round_to_e4m3` rounds in fp32 first.

Why a fused kernel stores ``q`` as ``[BLOCK // V, V]`` (``V``: one 16-byte vector of the input's dtype)
and not in the input's 1-D shape: Triton's coalescing gives every memory access of one shape the
widest vector among them, so a 1-D fp8 store (16 a thread) would widen the input loads from 8 to 16 a
thread, and the row's sum of squares, reduced over that layout, would round differently from the
unquantised kernel's.
"""

import os

import triton
import triton.language as tl

from .. import fp8

FP8_MAX = tl.constexpr(fp8.FP8_MAX)  # 448.0, the largest float8_e4m3fn
MIN_SCALE = tl.constexpr(fp8.MIN_SCALE)  # an fp32 value: exact as a constant
_FLT_MAX = tl.constexpr(3.4028234663852886e38)
INV_FP8_MAX = tl.constexpr(fp8.INV_FP8_MAX)  # fp32(1/448): exact as a constant
GROUP_EPS = tl.constexpr(fp8.GROUP_EPS)  # the fused ops' group eps, vLLM's default
#: below this group eps the reciprocal of a scale may overflow: divide every element instead
EXACT_DIV_EPS = 2.0 ** -100
#: Triton's interpreter: reduce with tl.max plus a NaN-carrying sum (a custom combine there is a Python
#: loop per element, 0.5 s for one 4096-value program), and round to e4m3 in fp32 before the cast
INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"

# The epilogue of a kernel (a constexpr argument): none, static per tensor, dynamic per token, per group,
# or the quantising pass of a dynamic per-tensor quant (its amax read from the device).
NONE = tl.constexpr(0)
STATIC = tl.constexpr(1)
TOKEN = tl.constexpr(2)
GROUP = tl.constexpr(3)
TENSOR = tl.constexpr(4)


def mode(scale, group_size: int) -> int:
    """The epilogue of a fused op's arguments: static with ``scale``, else per token (``group_size``
    -1) or per group."""
    if scale is not None:
        return STATIC.value
    return TOKEN.value if group_size == fp8.PER_TOKEN else GROUP.value


def vector(dtype_size: int) -> int:
    """Elements of one 16-byte vector of an input element size: the width of a fused kernel's q store."""
    return 16 // dtype_size


@triton.jit
def max_propagate_nan(a, b):
    return tl.maximum(a, b, propagate_nan=tl.PropagateNan.ALL)


@triton.jit
def abs_max(x, AXIS: tl.constexpr, NUMPY_MAX: tl.constexpr):
    """``max |x|`` along ``AXIS``, NaN where the slice holds a NaN (tl.max alone would skip it)."""
    if NUMPY_MAX:  # the interpreter: numpy's nanmax, plus a sum that is NaN (positive) where the slice holds a NaN
        return tl.max(tl.abs(x), AXIS) + tl.sum(tl.where(x != x, tl.abs(x), 0.0), AXIS)
    else:  # max.NaN.f32
        return tl.reduce(tl.abs(x), AXIS, max_propagate_nan)


@triton.jit
def abs_bits(x):
    """``|x|`` of fp32 ``x`` as int32 bits, ordered as the magnitudes, every NaN above +inf: an int
    max (or ``atomic_max``) of them is the NaN-propagating max of ``|x|``."""
    return x.to(tl.int32, bitcast=True) & 0x7FFFFFFF


@triton.jit
def pow2_ceil(s):
    """The smallest power of two >= s (fp32, s >= 0), exactly, from the bits; NaN stays NaN."""
    bits = s.to(tl.int32, bitcast=True)
    up = ((bits + 0x7FFFFF) & 0x7F800000).to(tl.float32, bitcast=True)
    return tl.where(s != s, s, up)


@triton.jit
def round_to_e4m3(y):
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
def to_e4m3(y, dtype: tl.constexpr, EMULATE: tl.constexpr):
    """fp32 ``y`` as float8_e4m3fn (``dtype``), ``clamp(y, -448, 448).to(float8_e4m3fn)`` bit for bit."""
    if EMULATE:  # the interpreter, whose own cast is wrong: round in fp32 first
        return round_to_e4m3(y).to(dtype)
    else:  # cvt.rn.satfinite.e4m3x2.f32: nearest even, saturating at +-448, NaN -> NaN
        return y.to(dtype)


@triton.jit
def static_inverse(scale_ptr):
    """``1 / scale`` (IEEE) of the static scale on the device, NaN unless it is positive and finite."""
    s = tl.load(scale_ptr).to(tl.float32)
    inv = tl.math.div_rn(1.0, s)
    # NaN from its bits: a NaN constexpr never equals itself, so Triton would call the global changed
    return tl.where((s > 0.0) & (s <= _FLT_MAX), inv, tl.full(s.shape, 0x7FC00000, tl.int32).to(tl.float32, bitcast=True))


@triton.jit
def dynamic_scale(amax, ub, HAS_UB: tl.constexpr):
    """``max(min(amax, ub) * fp32(1/448), MIN_SCALE)``; NaN propagates (``ub`` read only with ``HAS_UB``)."""
    if HAS_UB:
        amax = tl.minimum(amax, ub, propagate_nan=tl.PropagateNan.ALL)
    return tl.maximum(amax * INV_FP8_MAX, MIN_SCALE, propagate_nan=tl.PropagateNan.ALL)


@triton.jit
def quantize(y, inv, dtype: tl.constexpr, EMULATE: tl.constexpr):
    """Static, per-token or per-tensor ``q = fp8(clamp(y * inv))``, ``inv`` the scale's inverse."""
    return to_e4m3(y * inv, dtype, EMULATE)


@triton.jit
def group_scales(y, AXIS: tl.constexpr, eps, UE8M0: tl.constexpr, NUMPY_MAX: tl.constexpr):
    """The scales of the groups laid along ``AXIS`` of fp32 ``y``: ``div_rn(max(amax, eps), 448)``,
    the power-of-two ceiling with ``UE8M0``."""
    amax = abs_max(y, AXIS, NUMPY_MAX)
    # eps arrives as fp32 from an eager launch but as fp64 when Inductor launches the kernel itself
    amax = tl.maximum(amax, tl.cast(eps, tl.float32), propagate_nan=tl.PropagateNan.ALL)
    scale = tl.math.div_rn(amax, FP8_MAX)
    if UE8M0:
        scale = pow2_ceil(scale)
    return scale


@triton.jit
def group_quantize(y, scale, AXIS: tl.constexpr, EXACT_DIV: tl.constexpr, dtype: tl.constexpr,
                   EMULATE: tl.constexpr):
    """``q`` of the groups along ``AXIS`` of ``y`` with their ``scale``: times ``div_rn(1, scale)``, or
    divided (``div_rn``) with ``EXACT_DIV``."""
    if EXACT_DIV:
        v = tl.math.div_rn(y, tl.expand_dims(scale, AXIS))
    else:
        v = y * tl.expand_dims(tl.math.div_rn(tl.full(scale.shape, 1.0, tl.float32), scale), AXIS)
    return to_e4m3(v, dtype, EMULATE)
