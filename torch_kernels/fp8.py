"""FP8 (float8_e4m3fn) activation quantisation as every op that ends in one computes it: the quant
family's ops, and the norm and activation ops with a quantising epilogue. One definition here is what
makes a fused op equal, bit for bit, to its unfused pair: the references of both call these functions,
and each backend's kernels share one epilogue per backend.

Three ways to choose the scales, vLLM's:

* static per tensor (``scale`` given): ``q = fp8(clamp(x * (1 / scale), -448, 448))``;
* dynamic per tensor or per token: ``amax = max|x|`` over the tensor or the row (clamped to
  ``scale_ub`` per token, where given), ``scale = max(amax * fp32(1 / 448), 1 / (448 * 512))``, then
  as static. The product is what torch computes for ``amax / 448.0`` on CUDA, eagerly and compiled
  (a division by a number multiplies by its reciprocal there), and so what vLLM's
  ``QuantFP8.forward_native`` computes when an engine compiles it;
* dynamic per group of ``group_size`` along the row (DeepSeek block FP8, ``per_token_group_quant_fp8``):
  ``scale = max(amax, eps) / 448`` (a power of two above it with UE8M0), ``q = fp8(clamp(x / scale))``.

Each division is the IEEE fp32 one (correctly rounded); the cast rounds to nearest even. A static scale
that is not positive and finite makes every ``q`` NaN on a GPU (reading it there would synchronise the
device); on the CPU the op raises instead. Standard library and torch only; no family imported.
"""

from typing import Optional, Tuple

import torch
from torch import Tensor

from . import checks as check, outputs

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0  # torch.finfo(torch.float8_e4m3fn).max
#: vLLM's floor of a dynamic per-tensor or per-token scale, 1 / (448 * 512) rounded to fp32
MIN_SCALE = float(torch.tensor(1.0 / (FP8_MAX * 512.0), dtype=torch.float32))
#: the dynamic scales' factor, 1 / 448 rounded to fp32
INV_FP8_MAX = float(torch.tensor(1.0 / FP8_MAX, dtype=torch.float32))
#: the group quantisation's floor of a group's max magnitude in the fused ops (vLLM's default)
GROUP_EPS = 1e-10
DTYPES = frozenset((torch.float16, torch.bfloat16, torch.float32))
PER_TOKEN = -1  # group_size meaning one scale per row


# ----------------------------------------------------------------------------------------------
# Output layouts (the fake functions build the same)


def group_scales_empty(lead, groups: int, column_major: bool, like: Tensor) -> Tensor:
    """fp32 scales ``(*lead, groups)``; column-major: storage ``(groups, T)`` seen as ``(*lead, groups)``
    (DeepGEMM's layout, vLLM's ``torch.empty((G, T)).permute(1, 0)`` for 2-D), no TMA padding of ``T``."""
    if column_major:
        return like.new_empty((groups, *lead), dtype=torch.float32).movedim(0, -1)
    return like.new_empty((*lead, groups), dtype=torch.float32)


def empty_outputs(input: Tensor, hidden: int, scale: Optional[Tensor], group_size: int, column_major: bool,
                  per_token: bool = True, out: Optional[Tuple[Tensor, Tensor]] = None) -> Tuple[Tensor, Tensor]:
    """``q (..., hidden)`` contiguous fp8 and the scales of the mode: ``(1,)`` per tensor (static, or
    dynamic with ``per_token`` False), ``(..., 1)`` per token, ``(..., hidden / group_size)`` per group;
    ``out``: the ``out`` overload's two tensors instead, checked to be those (``outputs.given``)."""
    lead = input.shape[:-1]
    if scale is not None or (group_size == PER_TOKEN and not per_token):
        s_shape, column_major = (1,), False
    elif group_size == PER_TOKEN:
        s_shape, column_major = (*lead, 1), False
    else:
        s_shape = (*lead, hidden // group_size)
    if out is not None:
        s_strides = None
        if column_major:  # storage (groups, *lead) seen as (*lead, groups), as group_scales_empty lays it
            storage = outputs.contiguous_strides((s_shape[-1], *lead))
            s_strides = (*storage[1:], storage[0])
        return (outputs.given(out, 0, (*lead, hidden), FP8, input.device),
                outputs.given(out, 1, s_shape, torch.float32, input.device, s_strides))
    q = input.new_empty((*lead, hidden), dtype=FP8)
    if column_major:
        return q, group_scales_empty(lead, s_shape[-1], True, input)
    return q, input.new_empty(s_shape, dtype=torch.float32)


# ----------------------------------------------------------------------------------------------
# Argument checks of the quantising epilogue, shared by every op that has one


def validate_scale(op: str, arg: str, scale, input: Tensor) -> None:
    """A one-element fp32 tensor ``()`` or ``(1,)`` on the device of ``input``; on the CPU also > 0
    and finite (on a GPU that would need a device sync: the kernels write NaN instead)."""
    check.tensor(op, arg, scale)
    if scale.dtype != torch.float32:
        check.fail(op, arg, f"must be a float32 tensor, got {scale.dtype}", TypeError)
    if scale.dim() > 1 or scale.numel() != 1:
        check.fail(op, arg, f"must have shape () or (1,), got {tuple(scale.shape)}")
    check.same_device(op, arg, scale, "input", input)
    if scale.device.type == "cpu" and not _is_fake(scale):
        value = float(scale.reshape(()))
        if not 0.0 < value < float("inf"):
            check.fail(op, arg, f"must be positive and finite, got {value!r}")


def _is_fake(t: Tensor) -> bool:
    return isinstance(t, torch._subclasses.fake_tensor.FakeTensor) or t.device.type == "meta"


def validate_epilogue(op: str, input: Tensor, hidden, scale, group_size: int, column_major_scales: bool,
                      scale_ue8m0: bool) -> None:
    """The quant arguments of a fused op whose unquantised output has ``hidden`` values a row."""
    if input.dtype not in DTYPES:
        check.fail(op, "input", f"must be float16, bfloat16 or float32 (the quantised ops' dtypes), got {input.dtype}",
                   TypeError)
    if isinstance(group_size, bool) or not isinstance(group_size, int):
        check.fail(op, "group_size", f"must be an int, got {type(group_size).__name__}", TypeError)
    if scale is not None:
        validate_scale(op, "scale", scale, input)
        if group_size != PER_TOKEN:
            check.fail(op, "group_size", f"must be -1 with a static 'scale' (one scale for the tensor), got {group_size}")
    elif group_size != PER_TOKEN:
        if group_size <= 0 or group_size & (group_size - 1):
            check.fail(op, "group_size", f"must be -1 (per token) or a positive power of two, got {group_size}")
        check.require(hidden % group_size == 0, op, "group_size",
                      lambda: f"must divide the hidden size {hidden}; got {group_size}")
    if group_size == PER_TOKEN and column_major_scales:
        check.fail(op, "column_major_scales", "applies to group scales only (group_size > 0)")
    if group_size == PER_TOKEN and scale_ue8m0:
        check.fail(op, "scale_ue8m0", "applies to group scales only (group_size > 0)")


def epilogue_ok(input: Tensor, hidden: int, scale, group_size, column_major_scales, scale_ue8m0) -> bool:
    """The common valid call of :func:`validate_epilogue`, in a few attribute reads (the full checks
    cost several µs of host time a call): a dynamic mode, or a static scale on a GPU."""
    if input.dtype not in DTYPES or type(group_size) is not int:
        return False
    if scale is None:
        if group_size == PER_TOKEN:
            return not column_major_scales and not scale_ue8m0
        return group_size > 0 and not group_size & (group_size - 1) and not hidden % group_size
    return (group_size == PER_TOKEN and not column_major_scales and not scale_ue8m0 and scale.dtype == torch.float32
            and scale.numel() == 1 and scale.dim() <= 1 and scale.device == input.device and scale.device.type != "cpu")


# ----------------------------------------------------------------------------------------------
# The numerics (the references compute with these; fp32 in, fp8 and fp32 scales out)


def _div(a: Tensor, b: float) -> Tensor:
    # By a tensor, not a Python scalar: on CUDA `t / 448` multiplies by fp32(1/448), which is not
    # correctly rounded (one ulp off for about half of all scales).
    return a / torch.full_like(a, b)


def pow2_ceil(scale: Tensor) -> Tensor:
    """The smallest power of two ``>= scale`` for fp32 ``scale >= 0``, exactly, from the bits: a
    nonzero mantissa carries into the exponent, then the mantissa is dropped. 0, inf and NaN stay.
    (vLLM's ``exp2(ceil(log2(s)))`` in fp32 rounds down when ``s`` is a few ulp above a power of two.)"""
    up = ((scale.view(torch.int32) + 0x7FFFFF) & 0x7F800000).view(torch.float32)
    return torch.where(torch.isnan(scale), scale, up)


def _cast(y: Tensor) -> Tensor:
    return y.clamp(-FP8_MAX, FP8_MAX).to(FP8)  # clamp keeps NaN; the cast rounds to nearest even


def inverse(scale: Tensor) -> Tensor:
    """``1 / scale`` (IEEE), NaN where the scale is not positive and finite."""
    ok = (scale > 0) & (scale < float("inf"))
    return torch.where(ok, torch.reciprocal(scale), torch.full_like(scale, float("nan")))


def quantize_static(x: Tensor, scale: Tensor) -> Tuple[Tensor, Tensor]:
    """Static per tensor: ``q = fp8(clamp(x * (1 / scale)))``; the scales returned are a ``(1,)`` copy."""
    s = scale.reshape(1).to(torch.float32)
    return _cast(x.to(torch.float32) * inverse(s)), s.clone()


def dynamic_scale(amax: Tensor, scale_ub: Optional[Tensor] = None) -> Tensor:
    """``max(min(amax, scale_ub) * INV_FP8_MAX, MIN_SCALE)``; NaN propagates."""
    if scale_ub is not None:
        amax = torch.minimum(amax, scale_ub.reshape(()).to(torch.float32).expand_as(amax))
    return (amax * INV_FP8_MAX).clamp(min=MIN_SCALE)


def quantize_per_tensor(x: Tensor) -> Tuple[Tensor, Tensor]:
    """Dynamic per tensor: one amax over the whole tensor; scales ``(1,)``."""
    x = x.to(torch.float32)
    amax = x.abs().amax().reshape(1) if x.numel() else x.new_zeros(1)
    scale = dynamic_scale(amax)
    return _cast(x * torch.reciprocal(scale)), scale


def quantize_per_token(x: Tensor, scale_ub: Optional[Tensor] = None) -> Tuple[Tensor, Tensor]:
    """Dynamic per token: one amax per row (the last dim); scales ``(..., 1)``."""
    x = x.to(torch.float32)
    scale = dynamic_scale(x.abs().amax(-1, keepdim=True), scale_ub)
    return _cast(x * torch.reciprocal(scale)), scale


def quantize_groups(x: Tensor, group_size: int, eps: float = GROUP_EPS, column_major: bool = False,
                    ue8m0: bool = False) -> Tuple[Tensor, Tensor]:
    """Dynamic per group of ``group_size`` along the last dim: ``scale = max(amax, eps) / 448``
    (UE8M0: the power-of-two ceiling), ``q = fp8(clamp(x / scale))``; scales ``(..., H / group_size)``
    row-major or column-major (see :func:`group_scales_empty`)."""
    g = x.to(torch.float32).unflatten(-1, (-1, group_size))  # (..., G, group_size)
    if column_major:
        # scales computed as (G, ...) and returned as a view, so the decomposed graph keeps the layout: a
        # (..., G) result copied into it came back row-major from Inductor with an unbacked token count
        g = g.movedim(-2, 0)  # (G, ..., group_size)
    # amax propagates NaN and clamp keeps it: a group holding a NaN gets a NaN scale and NaN q.
    scale = _div(g.abs().amax(-1).clamp(min=eps), FP8_MAX).contiguous()
    if ue8m0:
        scale = pow2_ceil(scale)
    q = (g / scale.unsqueeze(-1)).clamp(-FP8_MAX, FP8_MAX)
    if column_major:
        q, scale = q.movedim(0, -2), scale.movedim(0, -1)
    return q.flatten(-2).to(FP8), scale


def quantize(y: Tensor, scale: Optional[Tensor], group_size: int, column_major: bool = False,
             ue8m0: bool = False) -> Tuple[Tensor, Tensor]:
    """The epilogue of a fused op on its unquantised output ``y`` (already rounded to its dtype): static
    with ``scale``, else per token (``group_size == -1``) or per group."""
    if scale is not None:
        return quantize_static(y, scale)
    if group_size == PER_TOKEN:
        return quantize_per_token(y)
    return quantize_groups(y, group_size, GROUP_EPS, column_major, ue8m0)


def quant_op(y: Tensor, scale: Optional[Tensor], group_size: int, column_major: bool = False,
             ue8m0: bool = False) -> Tuple[Tensor, Tensor]:
    """The registered quant op a fused op's epilogue stands for, run on ``y``: the unfused pair's second
    half (``scaled_fp8_quant`` static or per token, or ``per_token_group_quant_fp8``)."""
    if scale is not None:
        return torch.ops.deepinfer.scaled_fp8_quant(y, scale)
    if group_size == PER_TOKEN:
        return torch.ops.deepinfer.scaled_fp8_quant(y, None, True)
    return torch.ops.deepinfer.per_token_group_quant_fp8(y, group_size, GROUP_EPS, column_major, ue8m0)


# ----------------------------------------------------------------------------------------------
# Comparing FP8 outputs


def _ordinal(t: Tensor) -> Tensor:
    """Finite floats as integers in value order, one apart per representable step (+0 and -0 equal)."""
    bits = t.view({torch.float32: torch.int32, FP8: torch.uint8}[t.dtype]).to(torch.int64)
    sign_bit = 1 << (8 * t.element_size() - 1)
    magnitude = bits & (sign_bit - 1)
    return torch.where(bits & sign_bit != 0, -magnitude, magnitude)


def assert_steps(what: str, got: Tensor, want: Tensor, steps: int) -> None:
    """``got`` equals ``want`` up to ``steps`` representable values; NaN exactly where ``want`` has NaN."""
    g, w = got.float(), want.float()
    nan = w.isnan()
    assert torch.equal(g.isnan(), nan), f"{what}: NaN at {int((g.isnan() != nan).sum())} other positions than the reference"
    inf = w.isinf()
    assert torch.equal(g[inf], w[inf]), f"{what}: infinities differ from the reference"
    finite = ~(nan | inf)
    far = (_ordinal(got)[finite] - _ordinal(want)[finite]).abs() > steps
    if far.any():
        i = int(far.nonzero()[0])
        raise AssertionError(f"{what}: {int(far.sum())} of {int(finite.sum())} values more than {steps} step(s) "
                             f"from the reference, e.g. {g[finite][i].item()!r} vs {w[finite][i].item()!r}")


def assert_quantized(got, want, steps: int = 1, scale_rtol: Optional[float] = None) -> None:
    """``(q, scales)`` against the reference's: same shapes, dtypes and scale strides; scales within
    ``steps`` fp32 ulp (or ``scale_rtol``), q within ``steps`` e4m3 steps (0: bit for bit). One step is
    what a last-ulp difference in ``x / scale`` (a division against a multiplication by the reciprocal)
    can move a value lying on a rounding tie; ``assert_close`` at the input dtype's tolerance would be
    wrong for fp8."""
    assert len(got) == 2 and len(want) == 2, f"{len(got)} outputs, expected 2"
    (q, s), (q_ref, s_ref) = got, want
    assert q.dtype == FP8 and q.shape == q_ref.shape, f"q: {q.dtype} {tuple(q.shape)}, expected {FP8} {tuple(q_ref.shape)}"
    assert s.dtype == torch.float32 and s.shape == s_ref.shape, \
        f"scales: {s.dtype} {tuple(s.shape)}, expected float32 {tuple(s_ref.shape)}"
    # the layout (row- or column-major scales) shows in the strides of the dims longer than one
    same_layout = all(a == b for a, b, n in zip(s.stride(), s_ref.stride(), s.shape) if n > 1)
    assert same_layout or s.numel() == 0, f"scales: strides {s.stride()}, expected {s_ref.stride()}"
    if scale_rtol is None:
        assert_steps("scales", s, s_ref.to(s.device), steps)
    else:
        torch.testing.assert_close(s, s_ref.to(s.device), rtol=scale_rtol, atol=0, equal_nan=True, msg=lambda m: f"scales: {m}")
    assert_steps("q", q, q_ref.to(q.device), steps)


def compare(got: list, want: list, dtype=None) -> None:
    """An op's ``compare`` for outputs ``(q, scales)``: within one step of the reference."""
    assert_quantized(got, want, 1)


def compare_epilogue(got: list, want: list, dtype=None) -> None:
    """A fused op's ``(q, scales)`` against the reference's. Its unquantised value is within the input
    dtype's tolerance of the reference's (summation order, ``rsqrt``), and so are the dynamic scales taken
    from it, except that a UE8M0 ceiling may land on the next power of two; so the scales are compared
    at that tolerance (or a factor of 2 between powers of two), and ``q * scale`` within one e4m3 step of
    the reference's at the larger of the two scales."""
    from .opdef import TOLERANCES

    rtol = TOLERANCES.get(dtype, TOLERANCES[torch.float32])[1]
    assert len(got) == 2 and len(want) == 2, f"{len(got)} outputs, expected 2"
    (q, s), (q_ref, s_ref) = got, [t.to(got[0].device) for t in want]
    assert q.dtype == FP8 and q.shape == q_ref.shape, f"q: {q.dtype} {tuple(q.shape)}, expected {FP8} {tuple(q_ref.shape)}"
    assert s.dtype == torch.float32 and s.shape == s_ref.shape, \
        f"scales: {s.dtype} {tuple(s.shape)}, expected float32 {tuple(s_ref.shape)}"
    same_layout = all(a == b for a, b, n in zip(s.stride(), s_ref.stride(), s.shape) if n > 1)
    assert same_layout or s.numel() == 0, f"scales: strides {s.stride()}, expected {s_ref.stride()}"
    sd, rd = s.double(), s_ref.double()
    assert torch.equal(sd.isnan(), rd.isnan()), "scales: NaN elsewhere than the reference's"
    ok = sd.isnan() | ((sd - rd).abs() <= rtol * rd.abs())
    pow2 = (torch.frexp(sd)[0].abs() == 0.5) & (torch.frexp(rd)[0].abs() == 0.5)
    ok |= pow2 & ((sd == 2 * rd) | (2 * sd == rd))
    assert ok.all(), f"scales: {int((~ok).sum())} of {s.numel()} beyond rtol {rtol} of the reference"
    if not q.numel():
        return
    lead, n = q.shape[:-1], q.shape[-1]
    per_value = lambda t: (t.expand(*lead, n) if t.shape[-1] == 1 or t.numel() == 1  # noqa: E731
                           else t.repeat_interleave(n // t.shape[-1], -1)).double()
    sv, rv = per_value(sd.reshape(*lead, -1) if s.numel() > 1 else sd), per_value(rd.reshape(*lead, -1) if s.numel() > 1 else rd)
    a, b = q.double() * sv, q_ref.double() * rv
    nan = b.isnan()
    assert torch.equal(a.isnan(), nan), f"q: NaN at {int((a.isnan() != nan).sum())} other positions than the reference"
    big = torch.maximum(sv, rv)
    # one e4m3 step: 2^-3 relative in the normal range, 2^-9 of the scale below it
    far = ~nan & ((a - b).abs() > 2**-3 * torch.maximum(a.abs(), b.abs()) + 2**-9 * big)
    assert not far.any(), f"q: {int(far.sum())} of {q.numel()} values more than a step from the reference's"
