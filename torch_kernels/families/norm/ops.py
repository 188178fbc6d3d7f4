"""The RMSNorm family: ``rmsnorm``, ``fused_add_rmsnorm``, ``gemma_rmsnorm``, ``gemma_fused_add_rmsnorm``.

Semantics of FlashInfer's ``flashinfer.norm`` and vLLM's ``RMSNorm``; the reference is
``torch_kernels/families/norm/reference.py``.
"""

from typing import Iterator, Optional

import torch
from torch import Tensor

from ... import checks as check
from ...opdef import BenchCase, HostGoal, OpDef, Peer

_DEFAULT_EPS = 1e-6


def _validate_norm(op: str, input: Tensor, weight: Tensor, eps: float) -> None:
    check.tensor(op, "input", input)
    check.tensor(op, "weight", weight)
    check.floating(op, "input", input)
    check.floating(op, "weight", weight)
    check.last_dim_contiguous(op, "input", input)
    check.require(input.shape[-1] != 0, op, "input", "must have a hidden size (last dimension) of at least 1")
    check.require(weight.dim() == 1 and weight.shape[0] == input.shape[-1], op, "weight",
                  lambda: f"must have shape ({input.shape[-1]},) to match the hidden size of 'input', got {tuple(weight.shape)}")
    check.last_dim_contiguous(op, "weight", weight)
    check.same_device(op, "weight", weight, "input", input)
    if not eps >= 0.0:
        check.fail(op, "eps", f"must be a non-negative float, got {eps!r}")


def _validate_fused(op: str, input: Tensor, residual: Tensor, weight: Tensor, eps: float) -> None:
    _validate_norm(op, input, weight, eps)
    check.tensor(op, "residual", residual)
    check.same_shape(op, "residual", residual, "input", input)
    if residual.dtype != input.dtype:
        check.fail(op, "residual", f"must have the dtype of 'input' ({input.dtype}), got {residual.dtype}", TypeError)
    check.last_dim_contiguous(op, "residual", residual)
    check.same_device(op, "residual", residual, "input", input)
    if residual is input:
        check.fail(op, "residual", "must not be the same tensor as 'input' (both are written)")
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
    def validate(input: Tensor, weight: Tensor, eps: float = _DEFAULT_EPS) -> None:
        try:
            if (input.dtype in check.FLOATING and weight.dtype in check.FLOATING and weight.dim() == 1
                    and 0 != input.shape[-1] == weight.shape[0] and input.stride(-1) == 1 and weight.is_contiguous()
                    and input.device == weight.device and eps >= 0.0):
                return
        except (AttributeError, IndexError, RuntimeError, TypeError):  # None, 0-d: the full checks say what
            pass
        _validate_norm(op, input, weight, eps)
    return validate


def _validator_fused(op: str):
    def validate(input: Tensor, residual: Tensor, weight: Tensor, eps: float = _DEFAULT_EPS) -> None:
        try:
            if (input.dtype in check.FLOATING and residual.dtype == input.dtype and weight.dtype in check.FLOATING
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
    def fake(input: Tensor, weight: Tensor, eps: float = _DEFAULT_EPS) -> Tensor:
        _validate_norm(op, input, weight, eps)
        return input.new_empty(input.shape)
    return fake


def _fake_fused(op: str):
    def fake(input: Tensor, residual: Tensor, weight: Tensor, eps: float = _DEFAULT_EPS) -> None:
        _validate_fused(op, input, residual, weight, eps)
    return fake


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


def rmsnorm(input: Tensor, weight: Tensor, eps: float = _DEFAULT_EPS) -> Tensor:
    """``out = input * rsqrt(mean(input^2, dim=-1) + eps) * weight``

    Root-mean-square layer normalisation over the last dimension, computed in fp32 (fp64 for fp64
    input) and returned in the input's dtype.

    Args:
        input: ``(..., N)`` fp16/bf16/fp32/fp64, last dimension contiguous (rows may be strided).
        weight: ``(N,)``, any floating dtype, on the device of ``input``.
        eps: added to the mean square; default ``1e-6``.

    Returns:
        ``(..., N)``, the dtype of ``input``, contiguous. Differentiable in ``input`` and ``weight``.
    """
    return torch.ops.deepinfer.rmsnorm.default(input, weight, eps)


def fused_add_rmsnorm(input: Tensor, residual: Tensor, weight: Tensor, eps: float = _DEFAULT_EPS) -> None:
    """``residual += input; input = residual * rsqrt(mean(residual^2, dim=-1) + eps) * weight``, in place

    The pre-norm residual step of a decoder layer (vLLM's ``fused_add_rms_norm``, FlashInfer's
    ``fused_add_rmsnorm``). The sum is taken in fp32 and normalised before it is rounded into
    ``residual``. Both ``input`` and ``residual`` are overwritten; nothing is returned.

    Args:
        input: ``(..., N)`` fp16/bf16/fp32/fp64, last dimension contiguous; receives the normalised output.
        residual: ``(..., N)``, the shape and dtype of ``input``; receives ``residual + input``.
        weight: ``(N,)``, any floating dtype.
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


# ----------------------------------------------------------------------------------------------
# Sample arguments for opcheck, the self-check and the tests: awkward shapes, never zeros.

#: (leading shape, hidden size, row stride or None): one token, many, 3-D, zero tokens, strided rows.
SAMPLE_SHAPES = (((1,), 1, None), ((3,), 128, None), ((2, 3), 257, None), ((0,), 64, None), ((4,), 96, 160))


def _rows(lead, n: int, stride: Optional[int], device, dtype) -> Tensor:
    if stride is None:
        return torch.randn(*lead, n, device=device, dtype=dtype)
    return torch.randn(*lead, stride, device=device, dtype=dtype)[..., :n]


def _samples_norm(device, dtype) -> Iterator[tuple]:
    for lead, n, stride in SAMPLE_SHAPES:
        yield _rows(lead, n, stride, device, dtype), torch.randn(n, device=device, dtype=dtype), 1e-6


def _samples_fused(device, dtype) -> Iterator[tuple]:
    for lead, n, stride in SAMPLE_SHAPES:
        yield (_rows(lead, n, stride, device, dtype), _rows(lead, n, stride, device, dtype),
               torch.randn(n, device=device, dtype=dtype), 1e-5)


def _tokens_norm(n: int, device) -> tuple:
    return (torch.randn(n, 64, device=device), torch.randn(64, device=device), 1e-6), (0,)


def _tokens_fused(n: int, device) -> tuple:
    return (torch.randn(n, 64, device=device), torch.randn(n, 64, device=device), torch.randn(64, device=device), 1e-6), (0, 1)


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


def _norm_op(name: str, wrapper, gemma: bool, bench: BenchCase) -> OpDef:
    return OpDef(f"{name}(Tensor input, Tensor weight, float eps={_DEFAULT_EPS}) -> Tensor",
                 _validator_norm(name), _fake_norm(name), wrapper, _samples_norm, _tokens_norm,
                 backward=_rms_backward(gemma), setup_context=_setup_context, bench=bench)


def _fused_op(name: str, wrapper, bench: BenchCase) -> OpDef:
    return OpDef(f"{name}(Tensor(a!) input, Tensor(b!) residual, Tensor weight, float eps={_DEFAULT_EPS}) -> ()",
                 _validator_fused(name), _fake_fused(name), wrapper, _samples_fused, _tokens_fused,
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
)
