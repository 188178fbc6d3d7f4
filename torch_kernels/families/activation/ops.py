"""The gated-activation family: ``silu_and_mul``, ``gelu_and_mul``, ``gelu_tanh_and_mul``.

The MLP gate of a decoder layer: ``(..., 2d) -> (..., d)``, ``act(x[..., :d]) * x[..., d:]``, with the
semantics of vLLM's ``SiluAndMul``/``GeluAndMul`` and FlashInfer's ``flashinfer.activation``; the
reference is ``torch_kernels/families/activation/reference.py``. ``silu_and_mul_fp8_quant`` adds
``torch_kernels/fp8.py``'s quantising epilogue: bit for bit ``silu_and_mul`` then the quant op.
"""

from typing import Iterator, Optional

import torch
from torch import Tensor

from ... import checks as check, fp8
from ...opdef import BenchCase, OpDef, Peer

_APPROXIMATE = ("none", "tanh")


def _validate_input(op: str, input: Tensor) -> None:
    check.tensor(op, "input", input)
    check.floating(op, "input", input)
    check.last_dim_contiguous(op, "input", input)
    n = input.shape[-1]
    check.require(n != 0, op, "input", "must have a last dimension of at least 2 (gate and up halves), got 0")
    check.require(n % 2 == 0, op, "input",
                  lambda: f"must have an even last dimension (gate and up halves of d each), got {n}")


def _validate_approximate(op: str, approximate: str) -> None:
    if not isinstance(approximate, str):
        check.fail(op, "approximate", f"must be 'none' or 'tanh', got {type(approximate).__name__}", TypeError)
    if approximate not in _APPROXIMATE:
        check.fail(op, "approximate", f"must be 'none' or 'tanh', got {approximate!r}")


# The eager validators first test the common valid call in as few tensor attribute reads as they
# can; anything else, and every fake tensor, goes through the full checks, which name the argument.


def _validator(op: str):
    def validate(input: Tensor) -> None:
        try:
            n = input.shape[-1]
            if input.dtype in check.FLOATING and n and not n % 2 and input.is_contiguous():
                return  # strided rows (allowed) take the full checks; is_contiguous() costs a third of stride(-1)
        except (IndexError, RuntimeError, AttributeError):  # 0-d tensors, non-tensors
            pass
        _validate_input(op, input)
    return validate


def _validate_gelu(input: Tensor, approximate: str = "none") -> None:
    try:
        n = input.shape[-1]
        if (input.dtype in check.FLOATING and n and not n % 2 and input.is_contiguous()
                and approximate in _APPROXIMATE):
            return
    except (IndexError, RuntimeError, AttributeError):
        pass
    _validate_input("gelu_and_mul", input)
    _validate_approximate("gelu_and_mul", approximate)


def _out_shape(input: Tensor):
    return (*input.shape[:-1], input.shape[-1] // 2)


def _fake(op: str):
    def fake(input: Tensor) -> Tensor:
        _validate_input(op, input)
        return input.new_empty(_out_shape(input))
    return fake


def _fake_gelu(input: Tensor, approximate: str = "none") -> Tensor:
    _validate_input("gelu_and_mul", input)
    _validate_approximate("gelu_and_mul", approximate)
    return input.new_empty(_out_shape(input))


QUANT = "silu_and_mul_fp8_quant"


def _validate_quant_full(input: Tensor, scale=None, group_size: int = fp8.PER_TOKEN,
                         column_major_scales: bool = False, scale_ue8m0: bool = False) -> None:
    _validate_input(QUANT, input)
    fp8.validate_epilogue(QUANT, input, input.shape[-1] // 2, scale, group_size, column_major_scales, scale_ue8m0)


def _validate_quant(input: Tensor, scale=None, group_size: int = fp8.PER_TOKEN, column_major_scales: bool = False,
                    scale_ue8m0: bool = False) -> None:
    try:
        n = input.shape[-1]
        if (n and not n % 2 and input.is_contiguous()
                and fp8.epilogue_ok(input, n // 2, scale, group_size, column_major_scales, scale_ue8m0)):
            return
    except (IndexError, RuntimeError, AttributeError, TypeError):
        pass
    _validate_quant_full(input, scale, group_size, column_major_scales, scale_ue8m0)


def _fake_quant(input: Tensor, scale=None, group_size: int = fp8.PER_TOKEN, column_major_scales: bool = False,
                scale_ue8m0: bool = False):
    _validate_quant_full(input, scale, group_size, column_major_scales, scale_ue8m0)
    return fp8.empty_outputs(input, input.shape[-1] // 2, scale, group_size, column_major_scales)


# ----------------------------------------------------------------------------------------------
# Typed wrappers: what IDEs show, and what docs/ops.md is generated from.


def silu_and_mul(input: Tensor) -> Tensor:
    """``out = silu(x[..., :d]) * x[..., d:]`` with ``silu(g) = g * sigmoid(g)``, ``x = input``

    The SwiGLU gate of Llama-style MLPs (vLLM's ``SiluAndMul``, FlashInfer's ``silu_and_mul``),
    computed in fp32 (fp64 for fp64 input) and returned in the input's dtype.

    Args:
        input: ``(..., 2d)`` fp16/bf16/fp32/fp64, the gate half then the up half; last dimension
            contiguous and even (rows may be strided; any leading dims, zero tokens included).

    Returns:
        ``(..., d)``, the dtype of ``input``, contiguous. Not differentiable.
    """
    return torch.ops.deepinfer.silu_and_mul.default(input)


def gelu_and_mul(input: Tensor, approximate: str = "none") -> Tensor:
    """``out = gelu(x[..., :d]) * x[..., d:]`` with ``gelu(g) = g/2 * (1 + erf(g/sqrt(2)))``, or with
    ``approximate="tanh"``: ``gelu(g) = g/2 * (1 + tanh(sqrt(2/pi) * (g + 0.044715 g^3)))``

    The GeGLU gate (vLLM's ``GeluAndMul(approximate)``, FlashInfer's ``gelu_and_mul`` and
    ``gelu_tanh_and_mul``), computed in fp32 (fp64 for fp64 input) and returned in the input's dtype.

    Args:
        input: ``(..., 2d)`` fp16/bf16/fp32/fp64, the gate half then the up half; last dimension
            contiguous and even (rows may be strided; any leading dims, zero tokens included).
        approximate: ``"none"`` (exact, erf) or ``"tanh"``, as ``torch.nn.functional.gelu`` takes it.

    Returns:
        ``(..., d)``, the dtype of ``input``, contiguous. Not differentiable.
    """
    return torch.ops.deepinfer.gelu_and_mul.default(input, approximate)


def gelu_tanh_and_mul(input: Tensor) -> Tensor:
    """``out = gelu_tanh(x[..., :d]) * x[..., d:]`` with ``gelu_tanh(g) = g/2 * (1 + tanh(sqrt(2/pi) * (g + 0.044715 g^3)))``

    :func:`gelu_and_mul` with ``approximate="tanh"`` (FlashInfer's ``gelu_tanh_and_mul``; Gemma's MLP).

    Args:
        input: ``(..., 2d)`` fp16/bf16/fp32/fp64, the gate half then the up half; last dimension
            contiguous and even (rows may be strided; any leading dims, zero tokens included).

    Returns:
        ``(..., d)``, the dtype of ``input``, contiguous. Not differentiable.
    """
    return torch.ops.deepinfer.gelu_tanh_and_mul.default(input)


def silu_and_mul_fp8_quant(input: Tensor, scale: Optional[Tensor] = None, group_size: int = -1,
                           column_major_scales: bool = False, scale_ue8m0: bool = False):
    """``y = silu_and_mul(input)`` rounded to the input's dtype, then quantised to FP8

    The MLP gate in front of the FP8 down projection in one pass (vLLM's SiLU-mul+quant fusion and its
    ``silu_and_mul_quant`` / ``silu_mul_per_token_group_quant_fp8``): :func:`silu_and_mul`, then
    :func:`scaled_fp8_quant` (static ``scale``, or dynamic per token) or :func:`per_token_group_quant_fp8`
    (``group_size > 0``, eps ``1e-10``), without writing ``y``.

    Args:
        input: ``(..., 2d)`` fp16/bf16/fp32, the gate half then the up half; last dimension contiguous
            and even (rows may be strided; any leading dims, zero tokens included).
        scale: static per-tensor scale, float32 ``()`` or ``(1,)`` on the device of ``input``; ``None``: dynamic.
        group_size: with ``scale=None``: ``-1`` one scale per token, or a power of two dividing ``d``.
        column_major_scales: group scales in DeepGEMM's column-major layout.
        scale_ue8m0: group scales rounded up to powers of two.

    Returns:
        ``(q, scales)``: ``q`` ``(..., d)`` float8_e4m3fn contiguous; ``scales`` fp32: ``(1,)`` static (a
        copy of ``scale``), ``(..., 1)`` per token, ``(..., d / group_size)`` per group. Bit for bit what
        the unfused pair returns, on every backend. Not differentiable.
    """
    return torch.ops.deepinfer.silu_and_mul_fp8_quant.default(input, scale, group_size, column_major_scales,
                                                              scale_ue8m0)


# ----------------------------------------------------------------------------------------------
# Sample arguments for opcheck, the self-check and the tests: awkward shapes, never zeros.

#: (leading shape, d, row stride or None): d = 1, one token, one 1-D row, d not a power of two,
#: 3-D, zero tokens, strided rows.
SAMPLE_SHAPES = (((1,), 1, None), ((3,), 128, None), ((), 5, None), ((2, 3), 257, None), ((0,), 64, None),
                 ((4,), 48, 160))


def _rows(lead, n: int, stride: Optional[int], device, dtype) -> Tensor:
    """Values spread over [-6, 6] or so, where the activations bend."""
    if stride is None:
        return torch.randn(*lead, n, device=device, dtype=dtype) * 2
    return (torch.randn(*lead, stride, device=device, dtype=dtype) * 2)[..., :n]


def _samples(device, dtype) -> Iterator[tuple]:
    for lead, d, stride in SAMPLE_SHAPES:
        yield (_rows(lead, 2 * d, stride, device, dtype),)


def _samples_gelu(device, dtype) -> Iterator[tuple]:
    for i, (lead, d, stride) in enumerate(SAMPLE_SHAPES):
        yield _rows(lead, 2 * d, stride, device, dtype), _APPROXIMATE[i % 2]


def _tokens(n: int, device) -> tuple:
    return (torch.randn(n, 128, device=device),), (0,)


def _tokens_gelu(n: int, device) -> tuple:
    return (torch.randn(n, 128, device=device), "tanh"), (0,)


#: silu_and_mul_fp8_quant: (leading shape, d, row stride or None, (scale mode, group_size,
#: column_major_scales, scale_ue8m0)); each mode on one token, 3-D, strided rows, zero tokens, odd sizes.
QUANT_SAMPLE_SHAPES = (((1,), 1, None, ("static", -1, False, False)), ((3,), 256, None, (None, 128, False, False)),
                       ((2, 3), 96, None, (None, -1, False, False)), ((0,), 64, None, (None, 64, True, False)),
                       ((4,), 48, 160, ("static", -1, False, False)), ((), 7, None, (None, -1, False, False)),
                       ((2,), 384, 1024, (None, 128, True, True)), ((3,), 24, None, (None, 8, False, True)))


def _samples_quant(device, dtype) -> Iterator[tuple]:
    for lead, d, stride, (kind, group, column_major, ue8m0) in QUANT_SAMPLE_SHAPES:
        # silu(g) * u of values about 2: magnitudes to about 20, a 448th of that a static scale
        scale = torch.rand((1,), device=device) * 0.03 + 0.02 if kind == "static" else None
        yield _rows(lead, 2 * d, stride, device, dtype), scale, group, column_major, ue8m0


def _tokens_quant(n: int, device) -> tuple:
    return (torch.randn(n, 256, device=device), None, 64, True, False), (0,)


# ----------------------------------------------------------------------------------------------
# Benchmark cases: tokens x 2d for d in the profile's hidden sizes; FlashInfer's flashinfer.activation as peer.


def _bench_shape(tokens: int, hidden: Optional[int], profile: str):
    return tokens, hidden, f"{tokens}x2*{hidden}"


def _bench_args(rows: int, hidden: int, profile: str, device, dtype) -> tuple:
    return (torch.randn(rows, 2 * hidden, device=device, dtype=dtype) * 2,)


def _bench_args_gelu(rows: int, hidden: int, profile: str, device, dtype) -> tuple:
    return _bench_args(rows, hidden, profile, device, dtype) + ("none",)


def _bench_nbytes(args: tuple) -> int:
    return args[0].numel() * args[0].element_size() * 3 // 2  # read (T, 2d), write (T, d)


def _flashinfer(op: str):
    def peer(args: tuple):
        try:
            import flashinfer.activation
        except Exception as e:  # noqa: BLE001  (reported in the results)
            return f"FlashInfer not importable: {type(e).__name__}: {e}"[:200]
        name = "gelu_tanh_and_mul" if op == "gelu_and_mul" and args[1] == "tanh" else op
        fn = getattr(flashinfer.activation, name)
        return Peer(f"flashinfer.activation.{name}", lambda x, *_: fn(x))
    return peer


def _bench_args_quant(rows: int, hidden: int, profile: str, device, dtype) -> tuple:
    return _bench_args(rows, hidden, profile, device, dtype) + (None, -1, False, False)  # dynamic per token


def _bench_nbytes_quant(args: tuple) -> int:
    x = args[0]
    return x.numel() * x.element_size() + x.numel() // 2 + x[..., 0].numel() * 4  # read (T, 2d), write q and scales


def _unfused_pair(x, *quant):
    return fp8.quant_op(torch.ops.deepinfer.silu_and_mul(x), *quant)


#: our unfused pair, as the default selection serves it
UNFUSED_PEER = Peer("unfused", _unfused_pair)


def _bench(op: str, args=_bench_args, cpu_default: bool = False) -> BenchCase:
    return BenchCase(_bench_shape, args, _bench_nbytes, takes_hidden=True, memory_bound=True,
                     flashinfer=_flashinfer(op), cpu_default=cpu_default)


_NO_GRAD = "it is an inference kernel; differentiate the formula in its docstring instead"


def _act_op(name: str, wrapper, cpu_default: bool = False) -> OpDef:
    return OpDef(f"{name}(Tensor input) -> Tensor", _validator(name), _fake(name), wrapper, _samples, _tokens,
                 no_grad_reason=_NO_GRAD, bench=_bench(name, cpu_default=cpu_default))


OPS = (
    _act_op("silu_and_mul", silu_and_mul, cpu_default=True),
    OpDef('gelu_and_mul(Tensor input, str approximate="none") -> Tensor', _validate_gelu, _fake_gelu,
          gelu_and_mul, _samples_gelu, _tokens_gelu, no_grad_reason=_NO_GRAD,
          bench=_bench("gelu_and_mul", _bench_args_gelu)),
    _act_op("gelu_tanh_and_mul", gelu_tanh_and_mul),
    OpDef(f"{QUANT}(Tensor input, Tensor? scale=None, int group_size=-1, bool column_major_scales=False, "
          "bool scale_ue8m0=False) -> (Tensor, Tensor)",
          _validate_quant, _fake_quant, silu_and_mul_fp8_quant, _samples_quant, _tokens_quant,
          no_grad_reason="quantisation to float8 has no useful gradient (round and clamp)", compare=fp8.compare_epilogue,
          bench=BenchCase(_bench_shape, _bench_args_quant, _bench_nbytes_quant, takes_hidden=True, memory_bound=True,
                          flashinfer=lambda args: "FlashInfer 0.7.4 has no SiLU-and-mul with FP8 quantisation",
                          peers=(UNFUSED_PEER,))),
)
