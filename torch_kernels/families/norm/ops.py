"""The RMSNorm family: ``rmsnorm``, ``fused_add_rmsnorm``, ``gemma_rmsnorm``, ``gemma_fused_add_rmsnorm``,
and each of them with an FP8 quantising epilogue (``rmsnorm_fp8_quant`` and the like).

Semantics of FlashInfer's ``flashinfer.norm`` and vLLM's ``RMSNorm``; the reference is
``torch_kernels/families/norm/reference.py``. The epilogue is ``torch_kernels/fp8.py``'s: a fused op
returns what the norm rounded to the input's dtype, then quantised, returns, bit for bit.
"""

from typing import Iterator, Optional

import torch
from torch import Tensor

from ... import checks as check, fp8
from ...opdef import BenchCase, HostGoal, OpDef, Peer, assert_close

_DEFAULT_EPS = 1e-6


#: the ops whose weight may be None (vLLM's RMSNorm(has_weight=False)): the norm without its scale
UNWEIGHTED_OPS = ("rmsnorm", "fused_add_rmsnorm")


def _validate_norm(op: str, input: Tensor, weight: Optional[Tensor], eps: float) -> None:
    check.tensor(op, "input", input)
    if weight is not None or op not in UNWEIGHTED_OPS:
        check.tensor(op, "weight", weight)
    check.floating(op, "input", input)
    check.last_dim_contiguous(op, "input", input)
    check.require(input.shape[-1] != 0, op, "input", "must have a hidden size (last dimension) of at least 1")
    if not eps >= 0.0:
        check.fail(op, "eps", f"must be a non-negative float, got {eps!r}")
    if weight is None:
        return
    check.floating(op, "weight", weight)
    check.require(weight.dim() == 1 and weight.shape[0] == input.shape[-1], op, "weight",
                  lambda: f"must have shape ({input.shape[-1]},) to match the hidden size of 'input', got {tuple(weight.shape)}")
    check.last_dim_contiguous(op, "weight", weight)
    check.same_device(op, "weight", weight, "input", input)


def _validate_fused(op: str, input: Tensor, residual: Tensor, weight: Optional[Tensor], eps: float) -> None:
    _validate_norm(op, input, weight, eps)
    check.residual(op, residual, input)
    check.no_overlap(op, (("input", input, True), ("residual", residual, True), ("weight", weight, False)))


# The eager validators first test the common valid call in as few tensor attribute reads as they
# can (each read costs 0.05-0.5 µs of host time, on every call); anything else, and every fake
# tensor, goes through the full checks, which name the argument at fault. The in-place ops' common
# call has contiguous input and residual, so three byte ranges apart prove that nothing overlaps
# (0.2 µs a call); strided 2-D rows have their own proof (the full checks cost 16 µs more).


def _strided_rows_apart(input: Tensor, residual: Tensor, x: int, r: int, w: int, m: int) -> bool:
    """2-D ``input`` and ``residual`` with strided rows (slices of wider tensors) proven apart: rows at
    least as wide apart as they are wide, byte spans apart or (one row stride) residual's columns
    between input's modulo it, the weight's ``m`` bytes at ``w`` outside both spans."""
    if input.dim() != 2:
        return False
    (t, n), (sx, ux), (sr, ur), isz = input.shape, input.stride(), residual.stride(), input.itemsize
    t -= 1
    if ux != 1 or ur != 1 or t > 0 and (sx < n or sr < n):
        return False
    if t < 0:
        return True
    nb = n * isz
    xe, re = x + t * sx * isz + nb, r + t * sr * isz + nb
    if x < re and r < xe and not (sx == sr and t > 0 and nb <= (r - x) % (sx * isz) <= (sx - n) * isz):
        return False
    return not x - m < w < xe and not r - m < w < re


def _validator_norm(op: str):
    unweighted = op in UNWEIGHTED_OPS

    def validate(input: Tensor, weight: Optional[Tensor], eps: float = _DEFAULT_EPS) -> None:
        try:
            if weight is None:
                if (unweighted and input.dtype in check.FLOATING and input.shape[-1] != 0 and input.stride(-1) == 1
                        and eps >= 0.0):
                    return
            elif (input.dtype in check.FLOATING and weight.dtype in check.FLOATING and weight.dim() == 1
                    and 0 != input.shape[-1] == weight.shape[0] and input.stride(-1) == 1 and weight.is_contiguous()
                    and input.device == weight.device and eps >= 0.0):
                return
        except (AttributeError, IndexError, RuntimeError, TypeError):  # None, 0-d: the full checks say what
            pass
        _validate_norm(op, input, weight, eps)
    return validate


def _validator_fused(op: str):
    unweighted = op in UNWEIGHTED_OPS

    def validate(input: Tensor, residual: Tensor, weight: Optional[Tensor], eps: float = _DEFAULT_EPS) -> None:
        try:
            if weight is None:
                if (unweighted and input.dtype in check.FLOATING and residual.dtype == input.dtype
                        and 0 != input.shape[-1] and residual.shape == input.shape and residual is not input
                        and input.device == residual.device and eps >= 0.0):
                    x, r = input.data_ptr(), residual.data_ptr()
                    if input.is_contiguous() and residual.is_contiguous():
                        if abs(x - r) >= input.nbytes:
                            return
                    elif _strided_rows_apart(input, residual, x, r, -1, 0):  # no weight: a span of 0 bytes
                        return
            elif (input.dtype in check.FLOATING and residual.dtype == input.dtype and weight.dtype in check.FLOATING
                    and weight.dim() == 1 and 0 != input.shape[-1] == weight.shape[0] and residual.shape == input.shape
                    and residual is not input and weight.is_contiguous()
                    and input.device == residual.device == weight.device and eps >= 0.0):
                x, r, w, m = input.data_ptr(), residual.data_ptr(), weight.data_ptr(), weight.nbytes
                if input.is_contiguous() and residual.is_contiguous():
                    n = input.nbytes
                    if abs(x - r) >= n and not x - m < w < x + n and not r - m < w < r + n:
                        return
                elif _strided_rows_apart(input, residual, x, r, w, m):
                    return
        except (AttributeError, IndexError, RuntimeError, TypeError):
            pass
        _validate_fused(op, input, residual, weight, eps)
    return validate


def _fake_norm(op: str):
    def fake(input: Tensor, weight: Optional[Tensor], eps: float = _DEFAULT_EPS) -> Tensor:
        _validate_norm(op, input, weight, eps)
        return input.new_empty(input.shape)
    return fake


def _fake_fused(op: str):
    def fake(input: Tensor, residual: Tensor, weight: Optional[Tensor], eps: float = _DEFAULT_EPS) -> None:
        _validate_fused(op, input, residual, weight, eps)
    return fake


# The FP8 ops: the norm's checks, then the epilogue's; the common valid call first, as above.


def _validate_norm_quant(op: str, input: Tensor, weight: Tensor, eps: float = _DEFAULT_EPS, scale=None,
                         group_size: int = fp8.PER_TOKEN, column_major_scales: bool = False,
                         scale_ue8m0: bool = False) -> None:
    _validate_norm(op, input, weight, eps)
    fp8.validate_epilogue(op, input, input.shape[-1], scale, group_size, column_major_scales, scale_ue8m0)


def _validate_fused_quant(op: str, input: Tensor, residual: Tensor, weight: Tensor, eps: float = _DEFAULT_EPS,
                          scale=None, group_size: int = fp8.PER_TOKEN, column_major_scales: bool = False,
                          scale_ue8m0: bool = False) -> None:
    _validate_norm(op, input, weight, eps)
    check.tensor(op, "residual", residual)
    check.same_shape(op, "residual", residual, "input", input)
    if residual.dtype != input.dtype:
        check.fail(op, "residual", f"must have the dtype of 'input' ({input.dtype}), got {residual.dtype}", TypeError)
    check.last_dim_contiguous(op, "residual", residual)
    check.same_device(op, "residual", residual, "input", input)
    fp8.validate_epilogue(op, input, input.shape[-1], scale, group_size, column_major_scales, scale_ue8m0)
    if residual is input:
        check.fail(op, "residual", "must not be the same tensor as 'input' (residual is written, input read)")
    check.no_overlap(op, (("input", input, False), ("residual", residual, True), ("weight", weight, False),
                          ("scale", scale, False)))


def _validator_norm_quant(op: str):
    plain, fused = _validator_norm(op), _validator_fused(op)

    def validate(input, weight, eps=_DEFAULT_EPS, scale=None, group_size=fp8.PER_TOKEN, column_major_scales=False,
                 scale_ue8m0=False) -> None:
        try:
            if fp8.epilogue_ok(input, input.shape[-1], scale, group_size, column_major_scales, scale_ue8m0):
                return plain(input, weight, eps)
        except (AttributeError, IndexError, RuntimeError, TypeError):
            pass
        _validate_norm_quant(op, input, weight, eps, scale, group_size, column_major_scales, scale_ue8m0)
    return validate


def _validator_fused_quant(op: str):
    def validate(input, residual, weight, eps=_DEFAULT_EPS, scale=None, group_size=fp8.PER_TOKEN,
                 column_major_scales=False, scale_ue8m0=False) -> None:
        try:
            if (fp8.epilogue_ok(input, input.shape[-1], scale, group_size, column_major_scales, scale_ue8m0)
                    and input.dtype == residual.dtype and weight.dtype in check.FLOATING and weight.dim() == 1
                    and 0 != input.shape[-1] == weight.shape[0] and residual.shape == input.shape
                    and input.is_contiguous() and residual.is_contiguous() and weight.is_contiguous()
                    and input.device == residual.device == weight.device and eps >= 0.0):
                # residual, the one tensor written, shares no byte with input, weight or the scale
                x, r, n = input.data_ptr(), residual.data_ptr(), input.nbytes
                w, m = weight.data_ptr(), weight.nbytes
                c = scale.data_ptr() if scale is not None else r + n
                if abs(x - r) >= n and not r - m < w < r + n and not r - 4 < c < r + n:
                    return
        except (AttributeError, IndexError, RuntimeError, TypeError):
            pass
        _validate_fused_quant(op, input, residual, weight, eps, scale, group_size, column_major_scales, scale_ue8m0)
    return validate


def _fake_norm_quant(op: str):
    def fake(input, weight, eps=_DEFAULT_EPS, scale=None, group_size=fp8.PER_TOKEN, column_major_scales=False,
             scale_ue8m0=False):
        _validate_norm_quant(op, input, weight, eps, scale, group_size, column_major_scales, scale_ue8m0)
        return fp8.empty_outputs(input, input.shape[-1], scale, group_size, column_major_scales)
    return fake


def _fake_fused_quant(op: str):
    def fake(input, residual, weight, eps=_DEFAULT_EPS, scale=None, group_size=fp8.PER_TOKEN,
             column_major_scales=False, scale_ue8m0=False):
        _validate_fused_quant(op, input, residual, weight, eps, scale, group_size, column_major_scales, scale_ue8m0)
        return fp8.empty_outputs(input, input.shape[-1], scale, group_size, column_major_scales)
    return fake


def _compare_quant(got: list, want: list, dtype=None) -> None:
    """``(q, scales)`` within one step of the reference (:func:`torch_kernels.fp8.compare`); the fused
    ops' residual, where there is one, as any output of the input's dtype."""
    fp8.compare_epilogue(got[:2], want[:2], dtype)
    assert len(got) == len(want), f"{len(got)} outputs, expected {len(want)}"
    for g, w in zip(got[2:], want[2:]):
        assert_close(g, w, dtype)


# ----------------------------------------------------------------------------------------------
# Autograd: rmsnorm and gemma_rmsnorm differentiate in both input and weight; the in-place ops
# refuse (they overwrite what their backward would need).


def _setup_context(ctx, inputs, output) -> None:
    input, weight, *eps = inputs  # the dispatcher drops arguments equal to their default
    ctx.save_for_backward(input, weight)
    ctx.eps = eps[0] if eps else _DEFAULT_EPS


def _rms_backward(gemma: bool):
    def backward(ctx, grad: Tensor):
        x, weight = ctx.saved_tensors
        cd = torch.promote_types(x.dtype, torch.float32)
        xf, g = x.to(cd), grad.to(cd)
        if weight is None:  # the norm without its scale: w = 1, no gradient for it
            r = torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + ctx.eps)
            return (r * (g - xf * r.pow(2) * (g * xf).mean(-1, keepdim=True))).to(x.dtype), None, None
        w = weight.to(cd) + 1.0 if gemma else weight.to(cd)
        # y = x * r * w with r = rsqrt(mean(x^2) + eps):
        # dx = r * (g*w - x * r^2 * mean(g*w*x)),  dw = sum over rows of g * x * r
        r = torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + ctx.eps)
        gw = g * w
        dx = r * (gw - xf * r.pow(2) * (gw * xf).mean(-1, keepdim=True))
        dw = (g * xf * r).reshape(-1, xf.shape[-1]).sum(0)
        return dx.to(x.dtype), dw.to(weight.dtype), None
    return backward


# ----------------------------------------------------------------------------------------------
# Typed wrappers: what IDEs show, and what docs/ops.md is generated from.


def rmsnorm(input: Tensor, weight: Optional[Tensor], eps: float = _DEFAULT_EPS) -> Tensor:
    """``out = input * rsqrt(mean(input^2, dim=-1) + eps) * weight``

    Root-mean-square layer normalisation over the last dimension, computed in fp32 (fp64 for fp64
    input) and returned in the input's dtype.

    Args:
        input: ``(..., N)`` fp16/bf16/fp32/fp64, last dimension contiguous (rows may be strided).
        weight: ``(N,)``, any floating dtype, on the device of ``input``; or ``None``, no scale (vLLM's
            ``RMSNorm(has_weight=False)``): bit for bit the result of a weight of ones.
        eps: added to the mean square; default ``1e-6``.

    Returns:
        ``(..., N)``, the dtype of ``input``, contiguous. Differentiable in ``input`` and ``weight``.
    """
    return torch.ops.deepinfer.rmsnorm.default(input, weight, eps)


def fused_add_rmsnorm(input: Tensor, residual: Tensor, weight: Optional[Tensor], eps: float = _DEFAULT_EPS) -> None:
    """``residual += input; input = residual * rsqrt(mean(residual^2, dim=-1) + eps) * weight``, in place

    The pre-norm residual step of a decoder layer (vLLM's ``fused_add_rms_norm``, FlashInfer's
    ``fused_add_rmsnorm``). The sum is taken in fp32 and normalised before it is rounded into
    ``residual``. Both ``input`` and ``residual`` are overwritten; nothing is returned.

    Args:
        input: ``(..., N)`` fp16/bf16/fp32/fp64, last dimension contiguous; receives the normalised output.
        residual: ``(..., N)``, the shape and dtype of ``input``; receives ``residual + input``.
        weight: ``(N,)``, any floating dtype; or ``None``, no scale: bit for bit a weight of ones.
        eps: added to the mean square; default ``1e-6``.

    ``input``, ``residual`` and ``weight`` must not share memory, nor two elements of ``input`` or of
    ``residual`` (an expanded view): ``ValueError``. Not differentiable: requesting a gradient
    through it raises.
    """
    torch.ops.deepinfer.fused_add_rmsnorm.default(input, residual, weight, eps)


def gemma_rmsnorm(input: Tensor, weight: Tensor, eps: float = _DEFAULT_EPS) -> Tensor:
    """``out = input * rsqrt(mean(input^2, dim=-1) + eps) * (1 + weight)``

    Gemma's RMSNorm, whose weight is stored as an offset from one. Shapes, dtypes and autograd as
    :func:`rmsnorm`.

    Args:
        input: ``(..., N)`` fp16/bf16/fp32/fp64, last dimension contiguous.
        weight: ``(N,)``, any floating dtype.
        eps: added to the mean square; default ``1e-6``.

    Returns:
        ``(..., N)``, the dtype of ``input``, contiguous.
    """
    return torch.ops.deepinfer.gemma_rmsnorm.default(input, weight, eps)


def gemma_fused_add_rmsnorm(input: Tensor, residual: Tensor, weight: Tensor, eps: float = _DEFAULT_EPS) -> None:
    """``residual += input; input = residual * rsqrt(mean(residual^2, dim=-1) + eps) * (1 + weight)``, in place

    :func:`fused_add_rmsnorm` with Gemma's ``(1 + weight)`` scale; the same memory rules.

    Args:
        input: ``(..., N)`` fp16/bf16/fp32/fp64, last dimension contiguous; receives the normalised output.
        residual: ``(..., N)``, the shape and dtype of ``input``; receives ``residual + input``.
        weight: ``(N,)``, any floating dtype.
        eps: added to the mean square; default ``1e-6``.

    Not differentiable: requesting a gradient through it raises.
    """
    torch.ops.deepinfer.gemma_fused_add_rmsnorm.default(input, residual, weight, eps)


_QUANT_ARGS_DOC = """        scale: static per-tensor scale, float32 ``()`` or ``(1,)`` on the device of ``input``
            (``q = clamp(y * (1 / scale))``, as :func:`scaled_fp8_quant`); ``None``: dynamic.
        group_size: with ``scale=None``: ``-1`` one scale per token (``scaled_fp8_quant(y, per_token=True)``),
            or a power of two dividing ``N``: one scale per group (``per_token_group_quant_fp8(y, group_size)``,
            eps ``1e-10``).
        column_major_scales: group scales in DeepGEMM's column-major layout (as ``per_token_group_quant_fp8``).
        scale_ue8m0: group scales rounded up to powers of two (as ``per_token_group_quant_fp8``)."""

_QUANT_RETURNS_DOC = """    Returns:
        ``(q, scales)``: ``q`` ``(..., N)`` float8_e4m3fn contiguous; ``scales`` fp32: ``(1,)`` static
        (a copy of ``scale``), ``(..., 1)`` per token, ``(..., N / group_size)`` per group. Bit for bit
        what the unfused pair returns, on every backend. Not differentiable."""


def rmsnorm_fp8_quant(input: Tensor, weight: Tensor, eps: float = _DEFAULT_EPS, scale: Optional[Tensor] = None,
                      group_size: int = -1, column_major_scales: bool = False, scale_ue8m0: bool = False):
    return torch.ops.deepinfer.rmsnorm_fp8_quant.default(input, weight, eps, scale, group_size, column_major_scales,
                                                         scale_ue8m0)


def fused_add_rmsnorm_fp8_quant(input: Tensor, residual: Tensor, weight: Tensor, eps: float = _DEFAULT_EPS,
                                scale: Optional[Tensor] = None, group_size: int = -1,
                                column_major_scales: bool = False, scale_ue8m0: bool = False):
    return torch.ops.deepinfer.fused_add_rmsnorm_fp8_quant.default(input, residual, weight, eps, scale, group_size,
                                                                   column_major_scales, scale_ue8m0)


def gemma_rmsnorm_fp8_quant(input: Tensor, weight: Tensor, eps: float = _DEFAULT_EPS, scale: Optional[Tensor] = None,
                            group_size: int = -1, column_major_scales: bool = False, scale_ue8m0: bool = False):
    return torch.ops.deepinfer.gemma_rmsnorm_fp8_quant.default(input, weight, eps, scale, group_size,
                                                               column_major_scales, scale_ue8m0)


def gemma_fused_add_rmsnorm_fp8_quant(input: Tensor, residual: Tensor, weight: Tensor, eps: float = _DEFAULT_EPS,
                                      scale: Optional[Tensor] = None, group_size: int = -1,
                                      column_major_scales: bool = False, scale_ue8m0: bool = False):
    return torch.ops.deepinfer.gemma_fused_add_rmsnorm_fp8_quant.default(
        input, residual, weight, eps, scale, group_size, column_major_scales, scale_ue8m0)


rmsnorm_fp8_quant.__doc__ = f"""``y = rmsnorm(input, weight, eps)`` rounded to the input's dtype, then quantised to FP8

    The norm in front of an FP8 GEMM in one pass (vLLM's RMSNorm+quant fusion, FlashInfer's
    ``rmsnorm_quant``, vLLM's ``rms_norm_dynamic_per_token_quant`` and ``rms_norm_per_block_quant``):
    :func:`rmsnorm`, then :func:`scaled_fp8_quant` (static ``scale``, or dynamic per token) or
    :func:`per_token_group_quant_fp8` (``group_size > 0``), without writing ``y``.

    Args:
        input: ``(..., N)`` fp16/bf16/fp32, last dimension contiguous (rows may be strided).
        weight: ``(N,)``, any floating dtype, on the device of ``input``.
        eps: added to the mean square; default ``1e-6``.
{_QUANT_ARGS_DOC}

{_QUANT_RETURNS_DOC}
    """

fused_add_rmsnorm_fp8_quant.__doc__ = f"""``residual += input``; ``y = rmsnorm(residual)`` rounded to the input's dtype, then quantised to FP8

    :func:`fused_add_rmsnorm` followed by the quantisation of its output (vLLM's fused-add RMSNorm+quant,
    FlashInfer's ``fused_add_rmsnorm_quant``), in one pass: ``residual`` is updated in place (the sum
    taken in fp32 and normalised before rounding, as :func:`fused_add_rmsnorm`); ``input`` is left as it
    was; ``y`` is not written.

    Args:
        input: ``(..., N)`` fp16/bf16/fp32, last dimension contiguous; read only.
        residual: ``(..., N)``, the shape and dtype of ``input``; receives ``residual + input``.
        weight: ``(N,)``, any floating dtype.
        eps: added to the mean square; default ``1e-6``.
{_QUANT_ARGS_DOC}

    ``residual`` must share no memory with ``input``, ``weight`` or ``scale``, nor two of its elements
    (``ValueError``).

{_QUANT_RETURNS_DOC}
    """

gemma_rmsnorm_fp8_quant.__doc__ = f"""``y = gemma_rmsnorm(input, weight, eps)`` rounded to the input's dtype, then quantised to FP8

    :func:`rmsnorm_fp8_quant` with Gemma's ``(1 + weight)`` scale.

    Args:
        input: ``(..., N)`` fp16/bf16/fp32, last dimension contiguous (rows may be strided).
        weight: ``(N,)``, any floating dtype, on the device of ``input``.
        eps: added to the mean square; default ``1e-6``.
{_QUANT_ARGS_DOC}

{_QUANT_RETURNS_DOC}
    """

gemma_fused_add_rmsnorm_fp8_quant.__doc__ = f"""``residual += input``; ``y = gemma_rmsnorm(residual)`` rounded to the input's dtype, then quantised to FP8

    :func:`fused_add_rmsnorm_fp8_quant` with Gemma's ``(1 + weight)`` scale; the same memory rules.

    Args:
        input: ``(..., N)`` fp16/bf16/fp32, last dimension contiguous; read only.
        residual: ``(..., N)``, the shape and dtype of ``input``; receives ``residual + input``.
        weight: ``(N,)``, any floating dtype.
        eps: added to the mean square; default ``1e-6``.
{_QUANT_ARGS_DOC}

{_QUANT_RETURNS_DOC}
    """


# ----------------------------------------------------------------------------------------------
# Sample arguments for opcheck, the self-check and the tests: awkward shapes, never zeros.

#: (leading shape, hidden size, row stride or None): one token, many, 3-D, zero tokens, strided rows.
SAMPLE_SHAPES = (((1,), 1, None), ((3,), 128, None), ((2, 3), 257, None), ((0,), 64, None), ((4,), 96, 160))


def _rows(lead, n: int, stride: Optional[int], device, dtype) -> Tensor:
    if stride is None:
        return torch.randn(*lead, n, device=device, dtype=dtype)
    return torch.randn(*lead, stride, device=device, dtype=dtype)[..., :n]


#: the samples of the ops that take ``weight=None``: 3-D, strided rows, zero tokens (few: each sample
#: may cost a recompile where the tests compile them all, at most 8)
UNWEIGHTED_SAMPLE_SHAPES = (((2, 3), 257, None), ((4,), 96, 160), ((0,), 64, None))


def _samples_norm(unweighted: bool):
    def samples(device, dtype) -> Iterator[tuple]:
        for lead, n, stride in SAMPLE_SHAPES:
            yield _rows(lead, n, stride, device, dtype), torch.randn(n, device=device, dtype=dtype), 1e-6
        for lead, n, stride in UNWEIGHTED_SAMPLE_SHAPES if unweighted else ():
            yield _rows(lead, n, stride, device, dtype), None, 1e-6
    return samples


def _samples_fused(unweighted: bool):
    def samples(device, dtype) -> Iterator[tuple]:
        for lead, n, stride in SAMPLE_SHAPES:
            yield (_rows(lead, n, stride, device, dtype), _rows(lead, n, stride, device, dtype),
                   torch.randn(n, device=device, dtype=dtype), 1e-5)
        for lead, n, stride in UNWEIGHTED_SAMPLE_SHAPES if unweighted else ():
            yield _rows(lead, n, stride, device, dtype), _rows(lead, n, stride, device, dtype), None, 1e-5
    return samples


def _tokens_norm(n: int, device) -> tuple:
    return (torch.randn(n, 64, device=device), torch.randn(64, device=device), 1e-6), (0,)


def _tokens_fused(n: int, device) -> tuple:
    return (torch.randn(n, 64, device=device), torch.randn(n, 64, device=device), torch.randn(64, device=device), 1e-6), (0, 1)


#: the FP8 ops: (leading shape, hidden size, row stride or None, (scale mode, group_size,
#: column_major_scales, scale_ue8m0)); each mode on one token, 3-D, strided rows, zero tokens, odd sizes.
QUANT_SAMPLE_SHAPES = (((1,), 1, None, ("static", -1, False, False)), ((3,), 256, None, (None, 128, False, False)),
                       ((2, 3), 257, None, (None, -1, False, False)), ((0,), 64, None, (None, 64, True, False)),
                       ((4,), 96, 160, (None, -1, False, False)), ((5,), 80, 96, ("static", -1, False, False)),
                       ((2,), 384, 512, (None, 128, True, True)), ((3,), 24, None, (None, 8, False, True)))


def quant_args(mode, device) -> tuple:
    """``(scale, group_size, column_major_scales, scale_ue8m0)`` for a mode of :data:`QUANT_SAMPLE_SHAPES`:
    a static scale near a 448th of a normalised row's largest magnitudes (randn weights: about 4)."""
    kind, group, column_major, ue8m0 = mode
    scale = torch.rand((1,), device=device) * 0.01 + 0.005 if kind == "static" else None
    return scale, group, column_major, ue8m0


def _samples_norm_quant(device, dtype) -> Iterator[tuple]:
    for lead, n, stride, mode in QUANT_SAMPLE_SHAPES:
        yield (_rows(lead, n, stride, device, dtype), torch.randn(n, device=device, dtype=dtype), 1e-6,
               *quant_args(mode, device))


def _samples_fused_quant(device, dtype) -> Iterator[tuple]:
    for lead, n, stride, mode in QUANT_SAMPLE_SHAPES:
        yield (_rows(lead, n, stride, device, dtype), _rows(lead, n, stride, device, dtype),
               torch.randn(n, device=device, dtype=dtype), 1e-5, *quant_args(mode, device))


def _tokens_norm_quant(n: int, device) -> tuple:
    return (torch.randn(n, 128, device=device), torch.randn(128, device=device), 1e-6, None, 64, True, False), (0,)


def _tokens_fused_quant(n: int, device) -> tuple:
    return ((torch.randn(n, 128, device=device), torch.randn(n, 128, device=device), torch.randn(128, device=device),
             1e-6, None, -1, False, False), (0, 1))


# ----------------------------------------------------------------------------------------------
# Benchmark cases: tokens x the profile's hidden sizes, eps 1e-6; FlashInfer's flashinfer.norm as peer.

BENCH_EPS = 1e-6


def _size(t: Tensor) -> int:
    return t.numel() * t.element_size()


def _bench_shape(tokens: int, hidden: Optional[int], profile: str):
    return tokens, hidden, f"{tokens}x{hidden}"


def _bench_args_norm(rows: int, hidden: int, profile: str, device, dtype) -> tuple:
    return (torch.randn(rows, hidden, device=device, dtype=dtype), torch.randn(hidden, device=device, dtype=dtype),
            BENCH_EPS)


def _bench_args_fused(rows: int, hidden: int, profile: str, device, dtype) -> tuple:
    return (torch.randn(rows, hidden, device=device, dtype=dtype), torch.randn(rows, hidden, device=device, dtype=dtype),
            torch.randn(hidden, device=device, dtype=dtype), BENCH_EPS)


def _flashinfer(op: str):
    def peer(args: tuple):
        try:
            import flashinfer.norm
        except Exception as e:  # noqa: BLE001  (reported in the results)
            return f"FlashInfer not importable: {type(e).__name__}: {e}"[:200]
        return Peer(f"flashinfer.norm.{op}", getattr(flashinfer.norm, op))
    return peer


#: torch's own fused RMSNorm; its normalized shape bound once, outside the timed call
F_RMS_NORM = Peer("F.rms_norm", torch.nn.functional.rms_norm,
                  prepare=lambda args: (args[0], (args[0].shape[-1],), args[1], args[2]))


def _bench_norm(op: str, cpu_default: bool = False, **extra) -> BenchCase:
    # read x, write the output, read w
    return BenchCase(_bench_shape, _bench_args_norm, lambda args: 2 * _size(args[0]) + _size(args[1]),
                     takes_hidden=True, memory_bound=True, flashinfer=_flashinfer(op), cpu_default=cpu_default, **extra)


def _bench_fused(op: str, cpu_default: bool = False) -> BenchCase:
    # read x and r, write both, read w
    return BenchCase(_bench_shape, _bench_args_fused, lambda args: 4 * _size(args[0]) + _size(args[2]),
                     takes_hidden=True, memory_bound=True, flashinfer=_flashinfer(op), cpu_default=cpu_default)


#: the FP8 ops are timed with a static scale, where FlashInfer has the op too (rmsnorm_quant)
BENCH_SCALE = 0.01


def _bench_args_norm_quant(rows: int, hidden: int, profile: str, device, dtype) -> tuple:
    return _bench_args_norm(rows, hidden, profile, device, dtype) + (torch.full((1,), BENCH_SCALE, device=device),
                                                                      -1, False, False)


def _bench_args_fused_quant(rows: int, hidden: int, profile: str, device, dtype) -> tuple:
    return _bench_args_fused(rows, hidden, profile, device, dtype) + (torch.full((1,), BENCH_SCALE, device=device),
                                                                       -1, False, False)


def _quant_nbytes(args: tuple) -> int:
    x, scale, group = args[0], args[-4], args[-3]
    scales = 4 if scale is not None else x[..., 0].numel() * 4 * (1 if group == -1 else x.shape[-1] // group)
    return x.numel() + scales  # q (one byte a value) and the scales, written once


def _flashinfer_quant(op: str):
    # FlashInfer's rmsnorm_quant(out, input, weight, scale, eps), fused_add_rmsnorm_quant(out, input, residual,
    # weight, scale, eps): static scale only, fp8 output given
    def peer(args: tuple):
        if args[-4] is None:
            return "FlashInfer 0.7.4 has static-scale rmsnorm_quant only"
        try:
            import flashinfer.norm
        except Exception as e:  # noqa: BLE001  (reported in the results)
            return f"FlashInfer not importable: {type(e).__name__}: {e}"[:200]
        fn = getattr(flashinfer.norm, op, None)
        if fn is None:
            return f"FlashInfer {flashinfer.__version__} has no flashinfer.norm.{op}"
        fused = op.startswith("fused")

        def call(*a):
            out = torch.empty(a[0].shape, dtype=fp8.FP8, device=a[0].device)
            if fused:
                fn(out, a[0], a[1], a[2], a[4], a[3])
            else:
                fn(out, a[0], a[1], a[3], a[2])
            return out, a[3 if not fused else 4]
        return Peer(f"flashinfer.norm.{op}", call, compare=_compare_flashinfer_quant)
    return peer


def _compare_flashinfer_quant(got: list, want: list, dtype) -> None:
    # FlashInfer quantises the fp32 normalised value, not the one rounded to the input dtype: one e4m3
    # step from ours where the rounding crosses a tie
    fp8.assert_steps("q", got[0], want[0], 1)


#: the peer of the FP8 ops: our norm, then our quant op
UNFUSED = "unfused"


def _unfused_peer(op: str, fused: bool) -> Peer:
    """Our unfused pair, as the default selection serves it: the norm, then the quant op. The in-place
    norm writes ``input``, so it gets its own copy (outside the timed call)."""
    name = op.removesuffix("_fp8_quant")
    if fused:
        def pair(x, r, w, eps, *quant):
            getattr(torch.ops.deepinfer, name)(x, r, w, eps)
            return fp8.quant_op(x, *quant)
        return Peer(UNFUSED, pair, prepare=lambda args: (args[0].clone(), *args[1:]))
    return Peer(UNFUSED, lambda x, w, eps, *quant: fp8.quant_op(getattr(torch.ops.deepinfer, name)(x, w, eps), *quant))


def _bench_norm_quant(op: str, fused: bool, flashinfer: Optional[str]) -> BenchCase:
    x_bytes = (lambda a: 3 * _size(a[0]) + _size(a[2])) if fused else (lambda a: _size(a[0]) + _size(a[1]))
    return BenchCase(_bench_shape, _bench_args_fused_quant if fused else _bench_args_norm_quant,
                     lambda args: x_bytes(args) + _quant_nbytes(args), takes_hidden=True, memory_bound=True,
                     flashinfer=_flashinfer_quant(flashinfer) if flashinfer else
                     (lambda args: "FlashInfer 0.7.4 has no Gemma RMSNorm with quantisation"),
                     peers=(_unfused_peer(op, fused),))


def _norm_quant_op(name: str, wrapper, bench: BenchCase) -> OpDef:
    return OpDef(f"{name}(Tensor input, Tensor weight, float eps={_DEFAULT_EPS}, Tensor? scale=None, "
                 "int group_size=-1, bool column_major_scales=False, bool scale_ue8m0=False) -> (Tensor, Tensor)",
                 _validator_norm_quant(name), _fake_norm_quant(name), wrapper, _samples_norm_quant, _tokens_norm_quant,
                 no_grad_reason="quantisation to float8 has no useful gradient (round and clamp)",
                 compare=_compare_quant, bench=bench)


def _fused_quant_op(name: str, wrapper, bench: BenchCase) -> OpDef:
    return OpDef(f"{name}(Tensor input, Tensor(a!) residual, Tensor weight, float eps={_DEFAULT_EPS}, "
                 "Tensor? scale=None, int group_size=-1, bool column_major_scales=False, bool scale_ue8m0=False) "
                 "-> (Tensor, Tensor)",
                 _validator_fused_quant(name), _fake_fused_quant(name), wrapper, _samples_fused_quant,
                 _tokens_fused_quant, no_grad_reason="it overwrites residual in place and quantises to float8",
                 compare=_compare_quant, bench=bench)


def _weight_type(name: str) -> str:
    return "Tensor?" if name in UNWEIGHTED_OPS else "Tensor"


def _norm_op(name: str, wrapper, gemma: bool, bench: BenchCase) -> OpDef:
    return OpDef(f"{name}(Tensor input, {_weight_type(name)} weight, float eps={_DEFAULT_EPS}) -> Tensor",
                 _validator_norm(name), _fake_norm(name), wrapper, _samples_norm(name in UNWEIGHTED_OPS), _tokens_norm,
                 backward=_rms_backward(gemma), setup_context=_setup_context, bench=bench)


def _fused_op(name: str, wrapper, bench: BenchCase) -> OpDef:
    return OpDef(f"{name}(Tensor(a!) input, Tensor(b!) residual, {_weight_type(name)} weight, float eps={_DEFAULT_EPS}) -> ()",
                 _validator_fused(name), _fake_fused(name), wrapper, _samples_fused(name in UNWEIGHTED_OPS), _tokens_fused,
                 no_grad_reason="it overwrites input and residual in place; use rmsnorm(input + residual, weight) to differentiate",
                 bench=bench)


OPS = (
    # the host goal: an engine's decode step calls rmsnorm at one token, where F.rms_norm is the bar
    _norm_op("rmsnorm", rmsnorm, gemma=False,
             bench=_bench_norm("rmsnorm", cpu_default=True, peers=(F_RMS_NORM,),
                               host_goal=HostGoal(1, 4096, "bfloat16", F_RMS_NORM.name, "tilelang"))),
    _fused_op("fused_add_rmsnorm", fused_add_rmsnorm, bench=_bench_fused("fused_add_rmsnorm", cpu_default=True)),
    _norm_op("gemma_rmsnorm", gemma_rmsnorm, gemma=True, bench=_bench_norm("gemma_rmsnorm")),
    _fused_op("gemma_fused_add_rmsnorm", gemma_fused_add_rmsnorm, bench=_bench_fused("gemma_fused_add_rmsnorm")),
    _norm_quant_op("rmsnorm_fp8_quant", rmsnorm_fp8_quant, _bench_norm_quant("rmsnorm_fp8_quant", False, "rmsnorm_quant")),
    _fused_quant_op("fused_add_rmsnorm_fp8_quant", fused_add_rmsnorm_fp8_quant,
                    _bench_norm_quant("fused_add_rmsnorm_fp8_quant", True, "fused_add_rmsnorm_quant")),
    _norm_quant_op("gemma_rmsnorm_fp8_quant", gemma_rmsnorm_fp8_quant,
                   _bench_norm_quant("gemma_rmsnorm_fp8_quant", False, None)),
    _fused_quant_op("gemma_fused_add_rmsnorm_fp8_quant", gemma_fused_add_rmsnorm_fp8_quant,
                    _bench_norm_quant("gemma_fused_add_rmsnorm_fp8_quant", True, None)),
)
