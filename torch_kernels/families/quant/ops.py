"""The quant family: ``per_token_group_quant_fp8``, DeepSeek block FP8 activation quantisation.

Semantics of vLLM's ``per_token_group_quant_fp8`` and sglang's ``sglang_per_token_group_quant_fp8``
(fp32 scales; the packed-int32 UE8M0 layout sglang can produce is not offered). The reference is
``torch_kernels/families/quant/reference.py``.
"""

from typing import Iterator, Optional, Tuple

import torch
from torch import Tensor

from ... import checks as check
from ...opdef import BenchCase, OpDef

OP = "per_token_group_quant_fp8"
_DEFAULT_EPS = 1e-10
_DTYPES = frozenset((torch.float16, torch.bfloat16, torch.float32))
FP8 = torch.float8_e4m3fn


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


# ----------------------------------------------------------------------------------------------
# Comparing FP8 outputs: q within one fp8 step of the reference, scales within one fp32 ulp.


def _ordinal(t: Tensor) -> Tensor:
    """Finite floats as integers in value order, one apart per representable step (+0 and -0 equal)."""
    bits = t.view({torch.float32: torch.int32, FP8: torch.uint8}[t.dtype]).to(torch.int64)
    sign_bit = 1 << (8 * t.element_size() - 1)
    magnitude = bits & (sign_bit - 1)
    return torch.where(bits & sign_bit != 0, -magnitude, magnitude)


def _assert_steps(what: str, got: Tensor, want: Tensor, steps: int) -> None:
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


def compare(got: list, want: list, dtype=None) -> None:
    """A backend's ``(q, scales)`` against the reference's: same shapes, dtypes and scale strides;
    scales within one fp32 ulp; q within one fp8 (e4m3) step. One step is what a last-ulp difference in
    ``x / scale`` (an fp32 division against a multiplication by the reciprocal) can move a value that
    lies on a rounding tie; ``assert_close`` at the input dtype's tolerance would be wrong for fp8."""
    assert len(got) == 2 and len(want) == 2, f"{len(got)} outputs, expected 2"
    (q, s), (q_ref, s_ref) = got, want
    assert q.dtype == FP8 and q.shape == q_ref.shape, f"q: {q.dtype} {tuple(q.shape)}, expected {FP8} {tuple(q_ref.shape)}"
    assert s.dtype == torch.float32 and s.shape == s_ref.shape, \
        f"scales: {s.dtype} {tuple(s.shape)}, expected float32 {tuple(s_ref.shape)}"
    # the layout (row- or column-major scales) shows in the strides of the dims longer than one
    same_layout = all(a == b for a, b, n in zip(s.stride(), s_ref.stride(), s.shape) if n > 1)
    assert same_layout or s.numel() == 0, f"scales: strides {s.stride()}, expected {s_ref.stride()}"
    _assert_steps("scales", s, s_ref.to(s.device), 1)
    _assert_steps("q", q, q_ref.to(q.device), 1)


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


def _bench_args(rows: int, hidden: int, profile: str, device, dtype) -> tuple:
    return torch.randn(rows, hidden, device=device, dtype=dtype) * 4, BENCH_SIZES[profile][1], _DEFAULT_EPS, False, False


def _bench_nbytes(args: tuple) -> int:
    x = args[0]
    return x.numel() * x.element_size() + x.numel() + x.numel() // args[1] * 4  # read x, write fp8 q and fp32 scales


OPS = (
    OpDef(f"{OP}(Tensor input, int group_size, float eps={_DEFAULT_EPS}, bool column_major_scales=False, "
          "bool scale_ue8m0=False) -> (Tensor, Tensor)",
          _validate, _fake, per_token_group_quant_fp8, _samples, _tokens,
          no_grad_reason="quantisation to float8 has no useful gradient (round and clamp)", compare=compare,
          bench=BenchCase(_bench_shape, _bench_args, _bench_nbytes, own_hidden=_bench_hidden, memory_bound=True,
                          flashinfer=lambda args: "FlashInfer 0.7.4 has no per-token-group FP8 quantisation",
                          cpu_default=True)),
)
