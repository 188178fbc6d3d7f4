"""The quant family: FP8 activation quantisation. ``per_token_group_quant_fp8`` (DeepSeek block FP8)
and ``scaled_fp8_quant`` (static or dynamic, per tensor or per token).

Semantics of vLLM's ``per_token_group_quant_fp8`` and ``scaled_fp8_quant`` and sglang's
``sglang_per_token_group_quant_fp8`` (fp32 scales; the packed-int32 UE8M0 layout sglang can produce is not
offered). The numerics are ``torch_kernels/fp8.py``'s, which the fused norm and activation ops share.
"""

from typing import Iterator, Optional, Tuple

import torch
from torch import Tensor

from ... import checks as check, fp8
from ...opdef import BenchCase, OpDef

OP = "per_token_group_quant_fp8"
SCALED = "scaled_fp8_quant"
_DEFAULT_EPS = 1e-10
_DTYPES = fp8.DTYPES
FP8 = fp8.FP8
_NO_GRAD = "quantisation to float8 has no useful gradient (round and clamp)"


def _validate_full(input: Tensor, group_size: int, eps: float) -> None:
    check.tensor(OP, "input", input)
    if input.dtype not in _DTYPES:
        check.fail(OP, "input", f"must be float16, bfloat16 or float32, got {input.dtype}", TypeError)
    check.last_dim_contiguous(OP, "input", input)
    if isinstance(group_size, bool) or not isinstance(group_size, int):
        check.fail(OP, "group_size", f"must be an int, got {type(group_size).__name__}", TypeError)
    if group_size <= 0 or group_size & (group_size - 1):
        check.fail(OP, "group_size", f"must be a positive power of two, got {group_size}")
    check.require(input.shape[-1] != 0, OP, "input", "must have a hidden size (last dimension) of at least 1")
    check.require(input.shape[-1] % group_size == 0, OP, "group_size",
                  lambda: f"must divide the hidden size (last dimension) of 'input', {input.shape[-1]}; got {group_size}")
    if not eps >= 0.0:
        check.fail(OP, "eps", f"must be a non-negative float, got {eps!r}")


def _validate(input: Tensor, group_size: int, eps: float = _DEFAULT_EPS,
              column_major_scales: bool = False, scale_ue8m0: bool = False) -> None:
    # Fast path for the common valid call (see families/norm/ops.py); anything else gets the full checks.
    try:
        if (input.dtype in _DTYPES and input.stride(-1) == 1 and type(group_size) is int and group_size > 0
                and not group_size & (group_size - 1) and input.shape[-1] and not input.shape[-1] % group_size
                and eps >= 0.0):
            return
    except (IndexError, RuntimeError, AttributeError, TypeError):
        pass
    _validate_full(input, group_size, eps)


def _fake(input: Tensor, group_size: int, eps: float = _DEFAULT_EPS,
          column_major_scales: bool = False, scale_ue8m0: bool = False):
    _validate_full(input, group_size, eps)
    groups = input.shape[-1] // group_size
    q = input.new_empty(input.shape, dtype=FP8)
    if column_major_scales:  # the layout of families/quant/reference.py:empty_outputs
        s = input.new_empty((groups, *input.shape[:-1]), dtype=torch.float32).movedim(0, -1)
    else:
        s = input.new_empty((*input.shape[:-1], groups), dtype=torch.float32)
    return q, s


def _validate_scaled_full(input: Tensor, scale: Optional[Tensor] = None, per_token: bool = False,
                          scale_ub: Optional[Tensor] = None) -> None:
    op = SCALED
    check.tensor(op, "input", input)
    if input.dtype not in _DTYPES:
        check.fail(op, "input", f"must be float16, bfloat16 or float32, got {input.dtype}", TypeError)
    check.last_dim_contiguous(op, "input", input)
    if not isinstance(per_token, bool):
        check.fail(op, "per_token", f"must be a bool, got {type(per_token).__name__}", TypeError)
    if scale is not None:
        fp8.validate_scale(op, "scale", scale, input)
        if per_token:
            check.fail(op, "per_token", "must be False with a static 'scale' (one scale for the tensor)")
    if scale_ub is not None:
        if scale is not None or not per_token:
            check.fail(op, "scale_ub", "applies to dynamic per-token scales only (scale=None, per_token=True)")
        fp8.validate_scale(op, "scale_ub", scale_ub, input)


def _validate_scaled(input: Tensor, scale: Optional[Tensor] = None, per_token: bool = False,
                     scale_ub: Optional[Tensor] = None) -> None:
    # The common GPU calls (a dynamic quant, or a static scale on the GPU) in a few attribute reads.
    try:
        if (input.dtype in _DTYPES and input.stride(-1) == 1 and scale_ub is None and per_token in (True, False)
                and (scale is None or (not per_token and scale.dtype == torch.float32 and scale.numel() == 1
                                       and scale.dim() <= 1 and scale.device == input.device
                                       and scale.device.type != "cpu"))):
            return
    except (IndexError, RuntimeError, AttributeError, TypeError):
        pass
    _validate_scaled_full(input, scale, per_token, scale_ub)


def _fake_scaled(input: Tensor, scale: Optional[Tensor] = None, per_token: bool = False,
                 scale_ub: Optional[Tensor] = None):
    _validate_scaled_full(input, scale, per_token, scale_ub)
    return fp8.empty_outputs(input, input.shape[-1], scale, fp8.PER_TOKEN, False, per_token)


# ----------------------------------------------------------------------------------------------
# The typed wrapper: what IDEs show, and what docs/ops.md is generated from.


def per_token_group_quant_fp8(input: Tensor, group_size: int, eps: float = _DEFAULT_EPS,
                              column_major_scales: bool = False, scale_ue8m0: bool = False) -> Tuple[Tensor, Tensor]:
    """``scale = max(max|x_g|, eps) / 448; q = clamp(x / scale, -448, 448).to(float8_e4m3fn)`` per group ``x_g``

    DeepSeek block FP8 activation quantisation (vLLM's ``per_token_group_quant_fp8``): every
    ``group_size`` consecutive elements of the last dimension share one fp32 scale, chosen so that the
    group's largest magnitude maps to 448, the largest float8_e4m3fn value. Computed in fp32; the
    division is the IEEE one and the fp8 rounding is to nearest even. Dequantise with
    ``q.float() * scale`` broadcast over each group: ``|x - q * scale| <= (2^-4 + 2^-20) |x| + 2^-10 scale``
    per element (half an e4m3 step: relative 2^-4 in e4m3's normal range, 2^-10 scale below it; 2^-20
    covers the fp32 roundings). Backends match the reference's scales to one fp32 ulp and its ``q``
    to one e4m3 step.

    A group holding a NaN gets a NaN scale and NaN values; an infinity gives an infinite scale, zeros
    for the finite values and NaN for the infinite ones. With ``eps = 0`` an all-zero group gets
    scale 0 and NaN values (0/0).

    Args:
        input: ``(..., H)`` fp16/bf16/fp32, last dimension contiguous (rows may be strided); any
            number of tokens, zero included.
        group_size: a power of two dividing ``H`` (64 and 128 in DeepSeek models).
        eps: floor of each group's max magnitude, ``>= 0``; default ``1e-10``.
        column_major_scales: lay the scales out the way DeepGEMM reads them: storage
            ``(H/group_size, T)`` row-major, ``T`` the product of the leading dims, seen as
            ``(..., H/group_size)``; for 2-D input strides ``(1, T)``, vLLM's
            ``torch.empty((G, T)).permute(1, 0)``. ``T`` is not padded to a TMA multiple.
        scale_ue8m0: round each scale up to a power of two (exact ceiling, from the fp32 bits), as the
            UE8M0 scales of DeepGEMM on Blackwell need; the values stay fp32.

    Returns:
        ``(q, scales)``: ``q`` ``(..., H)`` float8_e4m3fn contiguous; ``scales`` ``(..., H/group_size)``
        fp32, row-major (contiguous) or column-major as above. Not differentiable.
    """
    return torch.ops.deepinfer.per_token_group_quant_fp8.default(input, group_size, eps, column_major_scales,
                                                                 scale_ue8m0)


def scaled_fp8_quant(input: Tensor, scale: Optional[Tensor] = None, per_token: bool = False,
                     scale_ub: Optional[Tensor] = None) -> Tuple[Tensor, Tensor]:
    """``q = clamp(x * (1 / scale), -448, 448).to(float8_e4m3fn)``, one scale per tensor or per token

    vLLM's ``scaled_fp8_quant``: the FP8 activation quantisation in front of a per-tensor or per-row
    scaled FP8 GEMM (``torch._scaled_mm``). Computed in fp32; the fp8 rounding is to nearest even.

    * ``scale`` given: static per tensor, ``q = clamp(x * (1 / scale))``.
    * ``scale=None, per_token=False``: dynamic per tensor, ``scale = max(max|x| / 448, 1 / (448 * 512))``
      over the whole tensor, computed on the device (no host sync).
    * ``scale=None, per_token=True``: dynamic per token, the same per row over the last dim, with the
      row's max first clamped to ``scale_ub`` where given.

    Both divisions (``amax / 448`` and ``1 / scale``) are IEEE fp32 divisions. A NaN in the tensor (per
    tensor) or the row (per token) makes the scale and every q it governs NaN. On the CPU a static
    scale (or ``scale_ub``) that is not positive and finite raises; on a GPU, where reading it would
    synchronise the device, every q comes out NaN instead.

    Args:
        input: ``(..., H)`` fp16/bf16/fp32, last dimension contiguous (rows may be strided); any number
            of tokens, zero included.
        scale: static scale, float32 ``()`` or ``(1,)`` on the device of ``input``; or ``None``.
        per_token: with ``scale=None``, one scale per row instead of one for the tensor.
        scale_ub: with ``per_token``, an upper bound on each row's max, float32 ``()`` or ``(1,)``.

    Returns:
        ``(q, scales)``: ``q`` ``(..., H)`` float8_e4m3fn contiguous; ``scales`` fp32 ``(1,)`` per
        tensor (a copy of ``scale`` when static) or ``(..., 1)`` per token. Not differentiable.
    """
    return torch.ops.deepinfer.scaled_fp8_quant.default(input, scale, per_token, scale_ub)


# ----------------------------------------------------------------------------------------------
# Sample arguments for opcheck, the self-check and the tests: awkward shapes, never zeros.

#: (leading shape, hidden size, row stride or None, group_size, column_major_scales, scale_ue8m0):
#: one token, DeepSeek's group 128 and 64, 3-D, zero tokens, strided rows, a group count that is not
#: a power of two (7, 3), a tiny group, both layouts with and without UE8M0.
SAMPLE_SHAPES = (((1,), 128, None, 128, False, False), ((3,), 7 * 64, None, 64, True, False),
                 ((2, 3), 256, None, 128, True, True), ((0,), 256, None, 128, True, False),
                 ((4,), 384, 512, 128, False, True), ((5,), 96, None, 32, False, False), ((2,), 24, 40, 8, True, False))


def _rows(lead, n: int, stride: Optional[int], device, dtype) -> Tensor:
    # Magnitudes up to about 16: scales near 2^-5, q over the whole e4m3 range.
    if stride is None:
        return torch.randn(*lead, n, device=device, dtype=torch.float32).mul_(4).to(dtype)
    return torch.randn(*lead, stride, device=device, dtype=torch.float32).mul_(4).to(dtype)[..., :n]


def _samples(device, dtype) -> Iterator[tuple]:
    for lead, n, stride, group, column_major, ue8m0 in SAMPLE_SHAPES:
        yield _rows(lead, n, stride, device, dtype), group, 1e-10, column_major, ue8m0


def _tokens(n: int, device) -> tuple:
    # Column-major scales: their strides (1, T) depend on the token count.
    return (torch.randn(n, 256, device=device), 128, 1e-10, True, False), (0,)


#: scaled_fp8_quant: (leading shape, hidden size, row stride or None, mode): each mode on one token,
#: 3-D, strided rows, zero tokens, a hidden size that is no multiple of a vector (5, 100); 8 in all,
#: under torch.compile's recompile limit.
SCALED_SAMPLE_SHAPES = (((1,), 128, None, "static"), ((3,), 100, None, "tensor"), ((2, 3), 256, None, "token"),
                        ((4,), 96, 160, "token_ub"), ((0,), 64, None, "token"), ((2,), 24, 40, "tensor"),
                        ((0,), 32, None, "tensor"), ((3,), 5, 64, "static"))


def scaled_mode_args(mode: str, device) -> tuple:
    """``(scale, per_token, scale_ub)`` for a mode of :data:`SCALED_SAMPLE_SHAPES`; the static scale
    about a 448th of the samples' largest magnitudes, the bound below some rows' max."""
    if mode == "static":
        return torch.rand((1,), device=device) * 0.02 + 0.02, False, None
    if mode == "token_ub":
        return None, True, torch.full((1,), 6.0, device=device)
    return None, mode == "token", None


def _samples_scaled(device, dtype) -> Iterator[tuple]:
    for lead, n, stride, mode in SCALED_SAMPLE_SHAPES:
        yield (_rows(lead, n, stride, device, dtype), *scaled_mode_args(mode, device))


def _tokens_scaled(n: int, device) -> tuple:
    return (torch.randn(n, 256, device=device), None, True, None), (0,)


# ----------------------------------------------------------------------------------------------
# Benchmark case: tokens x its own hidden size (or the multiples of the group --shapes gives), group 128.

#: per profile: (hidden size, group size); gpu: DeepSeek-V3's hidden size and block
BENCH_SIZES = {"gpu": (7168, 128), "cpu": (512, 128)}


def _bench_hidden(given: Tuple[int, ...], profile: str) -> Tuple[int, ...]:
    hidden, group = BENCH_SIZES[profile]
    return tuple(h for h in given if h % group == 0) or (hidden,)


def _bench_shape(tokens: int, hidden: Optional[int], profile: str):
    default, group = BENCH_SIZES[profile]
    hidden = hidden or default
    return tokens, hidden, f"{tokens}x{hidden} g{group}"


def _bench_shape_scaled(tokens: int, hidden: Optional[int], profile: str):
    return tokens, hidden, f"{tokens}x{hidden}"


def _bench_args(rows: int, hidden: int, profile: str, device, dtype) -> tuple:
    return torch.randn(rows, hidden, device=device, dtype=dtype) * 4, BENCH_SIZES[profile][1], _DEFAULT_EPS, False, False


def _bench_args_scaled(rows: int, hidden: int, profile: str, device, dtype) -> tuple:
    return torch.randn(rows, hidden, device=device, dtype=dtype) * 4, None, True, None  # dynamic per token


def _bench_nbytes_scaled(args: tuple) -> int:
    x = args[0]
    return x.numel() * x.element_size() + x.numel() + x[..., 0].numel() * 4  # read x, write q and a scale a row


def _bench_nbytes(args: tuple) -> int:
    x = args[0]
    return x.numel() * x.element_size() + x.numel() + x.numel() // args[1] * 4  # read x, write fp8 q and fp32 scales


OPS = (
    OpDef(f"{OP}(Tensor input, int group_size, float eps={_DEFAULT_EPS}, bool column_major_scales=False, "
          "bool scale_ue8m0=False) -> (Tensor, Tensor)",
          _validate, _fake, per_token_group_quant_fp8, _samples, _tokens,
          no_grad_reason=_NO_GRAD, compare=fp8.compare,
          bench=BenchCase(_bench_shape, _bench_args, _bench_nbytes, own_hidden=_bench_hidden, memory_bound=True,
                          flashinfer=lambda args: "FlashInfer 0.7.4 has no per-token-group FP8 quantisation",
                          cpu_default=True)),
    OpDef(f"{SCALED}(Tensor input, Tensor? scale=None, bool per_token=False, Tensor? scale_ub=None) -> (Tensor, Tensor)",
          _validate_scaled, _fake_scaled, scaled_fp8_quant, _samples_scaled, _tokens_scaled,
          no_grad_reason=_NO_GRAD, compare=fp8.compare,
          bench=BenchCase(_bench_shape_scaled, _bench_args_scaled, _bench_nbytes_scaled, takes_hidden=True,
                          memory_bound=True,
                          flashinfer=lambda args: "FlashInfer 0.7.4 has no dynamic per-token FP8 quantisation")),
)
