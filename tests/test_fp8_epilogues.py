"""The FP8 epilogue ops on every backend: ``scaled_fp8_quant``, and the norms and ``silu_and_mul`` with
a quantising epilogue. The reference against formulas written here in fp64, independently of
``torch_kernels/fp8.py``; every implementation against the reference; and the contract that lets the
compiler pass rewrite graphs: a fused op returns, bit for bit, what its backend's unfused pair returns
(Triton in its interpreter on CPU)."""

import pytest
import torch

from torch_kernels import fp8, ops, registry
from torch_kernels.spec import Backend
from torch_kernels.testing import as_dispatched, compare_outputs, outputs_of

from conftest import DEVICES, assert_bad_inputs_raise, family_ops, implementations_on

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
NORM_QUANT = [op for op in family_ops("norm") if op.endswith("_fp8_quant")]
FUSED_OPS = NORM_QUANT + ["silu_and_mul_fp8_quant"]
ALL_OPS = FUSED_OPS + ["scaled_fp8_quant"]
#: each fused op's unfused first half
UNFUSED = {op: op.removesuffix("_fp8_quant") for op in FUSED_OPS}
#: (scale kind, group_size, column_major_scales, scale_ue8m0): every mode of the epilogue
MODES = [("static", -1, False, False), (None, -1, False, False), (None, 128, False, False), (None, 128, True, False),
         (None, 64, True, True), (None, 64, False, True)]
#: (tokens, hidden, row stride or None): one token, a hidden size of 3 groups, 3-D, zero tokens, strided rows,
#: rows wider than the norms' one-pass limit (16384)
SHAPES = [((1,), 128, None), ((5,), 384, None), ((2, 3), 256, None), ((0,), 128, None), ((7,), 192, 320),
          ((2,), 20480, None)]
GPU_SHAPES = [((4096,), 4096, None), ((8192,), 7168, None), ((33,), 7168, 8192), ((1,), 65536, None),
              ((4099,), 5120, None)]
FP8_MAX, MIN_SCALE = 448.0, 1.0 / (448.0 * 512.0)
SCALED_MODES = [("static", False, None), (None, False, None), (None, True, None), (None, True, 3.0)]


def _rows(lead, n, stride, dtype, device, scale=1.0):
    width = stride or n
    return (torch.randn(*lead, width, device=device, dtype=torch.float32) * scale).to(dtype)[..., :n]


def _hidden_in(op, n):
    return 2 * n if op == "silu_and_mul_fp8_quant" else n


def _args(op, lead, n, stride, dtype, device, mode):
    """Fresh arguments of ``op`` whose unquantised output has ``n`` values a row, in epilogue ``mode``."""
    kind, group, column_major, ue8m0 = mode
    # a static scale that puts a normalised row's largest values (about 4 for randn weights) near 448,
    # some beyond it (saturated)
    scale = torch.full((1,), 0.008, device=device) if kind == "static" else None
    quant = (scale, group, column_major, ue8m0)
    if op == "silu_and_mul_fp8_quant":
        return (_rows(lead, 2 * n, stride and 2 * stride, dtype, device, 2.0), *quant)
    weight = torch.randn(n, device=device, dtype=dtype)
    if "fused_add" in op:
        return (_rows(lead, n, stride, dtype, device), _rows(lead, n, stride, dtype, device), weight, 1e-5, *quant)
    return (_rows(lead, n, stride, dtype, device), weight, 1e-6, *quant)


def _quant_args(args):
    return args[-4:]


def _impl(op, backend, device):
    spec = registry.BY_OP[op][backend]
    return spec.load() if device == "cpu" else as_dispatched(spec)


def _backends(op, device):
    """The backends whose implementation of ``op`` runs on ``device`` here."""
    names = {name for name, _ in implementations_on(op, device)}
    return [b for b in registry.BY_OP[op]
            if b.value in names or (b is Backend.TRITON and "triton-interpreted" in names)]


def _unfused(op, backend, device, args):
    """What the unfused pair on ``backend`` returns: the first op, then the quant op of the mode, and the
    residual where the op has one."""
    scale, group, column_major, ue8m0 = _quant_args(args)
    base = _impl(UNFUSED[op], backend, device)
    if "fused_add" in op:
        x, residual = args[0].clone(), args[1].clone()
        base(x, residual, *args[2:4])
        y, extra = x, [residual]
    else:
        y, extra = base(*args[:-4]), []
    if scale is not None:
        q, s = _impl("scaled_fp8_quant", backend, device)(y, scale, False, None)
    elif group == -1:
        q, s = _impl("scaled_fp8_quant", backend, device)(y, None, True, None)
    else:
        q, s = _impl("per_token_group_quant_fp8", backend, device)(y, group, fp8.GROUP_EPS, column_major, ue8m0)
    return [q, s] + extra


def _fused(op, backend, device, args):
    fn = _impl(op, backend, device)
    if "fused_add" in op:
        x, residual = args[0].clone(), args[1].clone()
        q, s = fn(x, residual, *args[2:])
        bits = lambda t: t.contiguous().view(torch.uint8)  # noqa: E731  (NaN equal to itself)
        assert torch.equal(bits(x), bits(args[0])), f"{op}: 'input' was written"
        return [q, s, residual]
    return list(fn(*args))


def _assert_bits(got, want, what):
    assert len(got) == len(want)
    for i, (g, w) in enumerate(zip(got, want)):
        assert g.dtype == w.dtype and g.shape == w.shape, f"{what}: output {i}: {g.dtype} {tuple(g.shape)} vs {w.dtype} {tuple(w.shape)}"
        assert g.stride() == w.stride() or g.numel() <= 1, f"{what}: output {i}: strides {g.stride()} vs {w.stride()}"
        gb = g.view(torch.uint8) if g.dtype == fp8.FP8 else g.contiguous().view(torch.uint8) if g.numel() else g
        wb = w.view(torch.uint8) if w.dtype == fp8.FP8 else w.contiguous().view(torch.uint8) if w.numel() else w
        if not torch.equal(gb, wb):
            n = int((gb != wb).sum())
            raise AssertionError(f"{what}: output {i}: {n} bytes differ from the unfused pair's")


# ----------------------------------------------------------------------------------------------
# The contract: fused == unfused pair, bit for bit, on each backend


def _contract(op, device, dtype, shapes, modes):
    for backend in _backends(op, device):
        for lead, n, stride in shapes:
            for mode in modes:
                if mode[1] > 0 and n % mode[1]:
                    continue
                args = _args(op, lead, n, stride, dtype, device, mode)
                _assert_bits(_fused(op, backend, device, args), _unfused(op, backend, device, args),
                             f"{op} on {backend.value}, {lead}x{n} stride {stride} {dtype} mode {mode}")


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("op", FUSED_OPS)
def test_fused_op_equals_its_unfused_pair_bit_for_bit(op, dtype, device):
    _contract(op, device, dtype, SHAPES if device == "cpu" else SHAPES + GPU_SHAPES, MODES)


@pytest.mark.gpu
@pytest.mark.parametrize("op", FUSED_OPS)
def test_fused_op_equals_its_unfused_pair_on_large_values_and_nonfinite(op):
    for backend in _backends(op, "cuda"):
        for mode in MODES:
            args = _args(op, (64,), 1024, None, torch.bfloat16, "cuda", mode)
            x = args[0]
            x[3, 5], x[7, 0], x[9, 100] = float("nan"), float("inf"), -float("inf")
            x[11].mul_(1e4)
            _assert_bits(_fused(op, backend, "cuda", args), _unfused(op, backend, "cuda", args),
                         f"{op} on {backend.value}, nonfinite, mode {mode}")


# ----------------------------------------------------------------------------------------------
# Every implementation against the reference; the reference against fp64 formulas


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("op", FUSED_OPS)
def test_implementations_match_the_reference(op, dtype, device):
    opdef = ops.BY_NAME[op]
    reference = registry.BY_OP[op][Backend.TORCH].load()
    mutated = (1,) if "fused_add" in op else ()
    for lead, n, stride in SHAPES if device == "cpu" else SHAPES + GPU_SHAPES:
        for mode in MODES:
            if mode[1] > 0 and n % mode[1]:
                continue
            args = _args(op, lead, n, stride, dtype, device, mode)
            want = outputs_of(reference, args, mutated)
            for name, fn in implementations_on(op, device):
                compare_outputs(opdef, outputs_of(fn, args, mutated), want, dtype)


def _unquantised_fp64(op, args):
    """The op's output before quantisation, from its formula in fp64, then rounded to the input dtype;
    and the residual where there is one."""
    x = args[0].double()
    if op == "silu_and_mul_fp8_quant":
        d = x.shape[-1] // 2
        g, u = x[..., :d], x[..., d:]
        return (g / (1 + torch.exp(-g)) * u).to(args[0].dtype), None
    residual = None
    if "fused_add" in op:
        x = x + args[1].double()
        residual = x.to(args[0].dtype)
    w = args[2 if "fused_add" in op else 1].double()
    w = 1 + w if op.startswith("gemma") else w
    y = x / torch.sqrt((x * x).mean(-1, keepdim=True) + args[3 if "fused_add" in op else 2]) * w
    return y.to(args[0].dtype), residual


def _assert_quantised_like(y, q, s, scale, group, column_major, ue8m0, dtype):
    """``(q, s)`` quantise ``y`` (the unquantised output): the scales from their formula, and
    ``q * s`` within half an e4m3 step of ``y`` (plus the input dtype's rounding of ``y``)."""
    y = y.double()
    if scale is not None:
        want_s = scale.double().reshape(1)
        s_rows = want_s.expand(*y.shape[:-1], 1)
    elif group == -1:
        want_s = (y.abs().amax(-1, keepdim=True) / FP8_MAX).clamp(min=MIN_SCALE) if y.numel() else s.double()
        s_rows = want_s
    else:
        amax = y.unflatten(-1, (-1, group)).abs().amax(-1).clamp(min=1e-10) if y.numel() else s.double()
        want_s = amax / FP8_MAX
        if ue8m0:  # a power of two, the first at or above the scale
            assert torch.equal(torch.frexp(s.double())[0], torch.full_like(s.double(), 0.5))
            assert ((s.double() >= want_s * (1 - 2**-23)) & (s.double() < 2 * want_s)).all()
            want_s = s.double()
        s_rows = None
    # y is rounded to the input dtype, the scale computed from it in fp32: a relative 2^-22 at most
    torch.testing.assert_close(s.double(), want_s, rtol=2**-22, atol=0)
    if column_major and y.dim() == 2 and y.shape[0] > 1:
        assert s.stride() == (1, y.shape[0]), f"column-major scales: strides {s.stride()}"
    if s_rows is None:
        s_rows = s.double().repeat_interleave(group, -1)
    want = (y / s_rows).clamp(-FP8_MAX, FP8_MAX)
    got = q.double()
    # half an e4m3 step: 2^-4 relative in the normal range, 2^-10 absolute below it (plus fp32 slack)
    bound = want.abs() * (2**-4 + 2**-20) + 2**-10
    assert ((got - want).abs() <= bound).all(), f"q: {int(((got - want).abs() > bound).sum())} values beyond half a step"


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("op", FUSED_OPS)
def test_reference_matches_fp64_formulas(op, dtype):
    """The registered op on CPU (the reference): its residual and its unquantised value match the
    fp64 formula to the input dtype's rounding, and ``(q, scales)`` quantise that value."""
    unfused = getattr(torch.ops.deepinfer, UNFUSED[op])
    for lead, n, stride in SHAPES:
        for mode in MODES:
            if mode[1] > 0 and n % mode[1]:
                continue
            args = _args(op, lead, n, stride, dtype, "cpu", mode)
            y64, residual64 = _unquantised_fp64(op, args)
            q, s, *residual = _fused(op, Backend.TORCH, "cpu", args)
            if "fused_add" in op:
                x, r = args[0].clone(), args[1].clone()
                unfused(x, r, *args[2:4])
                y = x
                torch.testing.assert_close(residual[0], residual64, atol=0, rtol=2**-7)
            else:
                y = unfused(*args[:-4])
            # the fp32 value and the fp64 one round to the same or neighbouring values of the input dtype
            assert ((y.double() - y64.double()).abs() <= y64.double().abs() * 2**-6 + 1e-5).all()
            _assert_quantised_like(y, q, s, *_quant_args(args), dtype)


# ----------------------------------------------------------------------------------------------
# scaled_fp8_quant


def _scaled_args(lead, n, stride, dtype, device, mode):
    kind, per_token, ub = mode
    scale = torch.full((1,), 0.02, device=device) if kind == "static" else None
    return (_rows(lead, n, stride, dtype, device, 4.0), scale, per_token,
            None if ub is None else torch.full((1,), ub, device=device))


@pytest.mark.parametrize("dtype", DTYPES)
def test_scaled_fp8_quant_reference_matches_fp64_formulas(dtype):
    for lead, n, stride in SHAPES:
        for mode in SCALED_MODES:
            x, scale, per_token, ub = _scaled_args(lead, n, stride, dtype, "cpu", mode)
            q, s = torch.ops.deepinfer.scaled_fp8_quant(x, scale, per_token, ub)
            xd = x.double()
            if scale is not None:
                want_s = scale.double()
            elif per_token:
                amax = xd.abs().amax(-1, keepdim=True) if x.numel() else s.double()
                want_s = ((amax.clamp(max=ub) if ub is not None else amax) / FP8_MAX).clamp(min=MIN_SCALE)
            else:
                want_s = ((xd.abs().amax().reshape(1) if x.numel() else torch.zeros(1, dtype=torch.float64))
                          / FP8_MAX).clamp(min=MIN_SCALE)
            assert s.shape == ((*lead, 1) if per_token else (1,)) and s.dtype == torch.float32
            # the scale is amax * fp32(1/448): within two fp32 roundings of the quotient
            torch.testing.assert_close(s.double(), want_s, rtol=2**-22, atol=0)
            want = (xd / s.double()).clamp(-FP8_MAX, FP8_MAX)
            bound = want.abs() * (2**-4 + 2**-20) + 2**-10
            assert q.dtype == fp8.FP8 and q.is_contiguous() and ((q.double() - want).abs() <= bound).all()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_scaled_fp8_quant_implementations_equal_the_reference(dtype, device):
    """Per tensor and per token both divisions are IEEE ones and q is ``x * (1 / scale)``: exact."""
    reference = registry.BY_OP["scaled_fp8_quant"][Backend.TORCH].load()
    for lead, n, stride in SHAPES if device == "cpu" else SHAPES + GPU_SHAPES:
        for mode in SCALED_MODES:
            args = _scaled_args(lead, n, stride, dtype, device, mode)
            want = list(reference(*args))
            for name, fn in implementations_on("scaled_fp8_quant", device):
                fp8.assert_quantized(list(fn(*args)), want, steps=0)


@pytest.mark.gpu
def test_scaled_fp8_quant_per_tensor_over_many_blocks_and_nan():
    x = torch.randn(8192, 7168, device="cuda", dtype=torch.bfloat16)
    x[4000, 17] = 900.0  # the one amax, far from the first block
    reference = registry.BY_OP["scaled_fp8_quant"][Backend.TORCH].load()
    for name, fn in implementations_on("scaled_fp8_quant", "cuda"):
        q, s = fn(x, None, False, None)
        assert s.item() == (torch.tensor(900.0) * fp8.INV_FP8_MAX).item(), name
        fp8.assert_quantized([q, s], list(reference(x, None, False, None)), steps=0)
        y = x.clone()
        y[8000, 3] = float("nan")
        q, s = fn(y, None, False, None)
        assert s.isnan().all() and q.float().isnan().all(), name


@pytest.mark.gpu
@pytest.mark.parametrize("op", ALL_OPS)
def test_a_static_scale_that_is_not_positive_gives_nan_without_a_sync(op):
    """On a GPU the scale's value is not read on the host: every q is NaN instead."""
    for bad in (-0.5, 0.0, float("nan"), float("inf")):
        if op == "scaled_fp8_quant":
            args = (torch.randn(8, 256, device="cuda", dtype=torch.bfloat16), torch.full((1,), bad, device="cuda"),
                    False, None)
        else:
            args = list(_args(op, (8,), 256, None, torch.bfloat16, "cuda", ("static", -1, False, False)))
            args[-4] = torch.full((1,), bad, device="cuda")
        for name, fn in implementations_on(op, "cuda"):
            q, s = fn(*[a.clone() if isinstance(a, torch.Tensor) else a for a in args])
            assert q.float().isnan().all(), f"{op} on {name} with scale {bad}"


# ----------------------------------------------------------------------------------------------
# Bad input


def _bad_cases(op, device):
    x = torch.randn(4, 256, device=device)
    scale = torch.full((1,), 0.01, device=device)
    if op == "scaled_fp8_quant":
        return [
            ("fp64 input", (x.double(), None, False, None), TypeError, "input"),
            ("fp16 scale", (x, scale.half(), False, None), TypeError, "scale"),
            ("two scales", (x, torch.full((2,), 0.01, device=device), False, None), ValueError, "scale"),
            ("scale on the meta device", (x, scale.to("meta"), False, None), ValueError, "scale"),
            ("per token with a static scale", (x, scale, True, None), ValueError, "per_token"),
            ("scale_ub per tensor", (x, None, False, scale), ValueError, "scale_ub"),
            ("int64 scale_ub", (x, None, True, torch.ones(1, dtype=torch.int64, device=device)), TypeError, "scale_ub"),
            ("strided last dim", (x[:, ::2], None, True, None), ValueError, "input"),
        ] + ([("negative scale", (x, -scale, False, None), ValueError, "scale"),
              ("NaN scale", (x, scale * float("nan"), False, None), ValueError, "scale")] if device == "cpu" else [])
    hidden = 256 if op != "silu_and_mul_fp8_quant" else 128
    base = list(_args(op, (4,), hidden, None, torch.float32, device, (None, -1, False, False)))

    def args(**quant):
        a = list(base)
        for i, k in enumerate(("scale", "group_size", "column_major_scales", "scale_ue8m0")):
            if k in quant:
                a[len(a) - 4 + i] = quant[k]
        return tuple(a)
    cases = [
        ("fp16 scale", args(scale=scale.half()), TypeError, "scale"),
        ("(1, 1) scale", args(scale=scale.reshape(1, 1)), ValueError, "scale"),
        ("scale elsewhere", args(scale=scale.to("meta")), ValueError, "scale"),
        ("group with a static scale", args(scale=scale, group_size=128), ValueError, "group_size"),
        ("group not dividing", args(group_size=512), ValueError, "group_size"),
        ("group not a power of two", args(group_size=96), ValueError, "group_size"),
        ("group zero", args(group_size=0), ValueError, "group_size"),
        ("column-major per token", args(column_major_scales=True), ValueError, "column_major_scales"),
        ("ue8m0 static", args(scale=scale, scale_ue8m0=True), ValueError, "scale_ue8m0"),
    ]
    if device == "cpu":
        cases += [("negative scale", args(scale=-scale), ValueError, "scale"),
                  ("NaN scale", args(scale=scale * float("nan")), ValueError, "scale")]
    x64 = tuple(a.double() if isinstance(a, torch.Tensor) else a for a in base)
    cases.append(("fp64 input", x64, TypeError, "input"))
    if "fused_add" in op:
        buf = torch.randn(4, 384, device=device)
        overlap = list(base)
        overlap[0], overlap[1] = buf[:, :256], buf[:, 128:]
        cases.append(("residual overlapping input", tuple(overlap), ValueError, "residual"))
        same = list(base)
        same[1] = same[0]
        cases.append(("residual is input", tuple(same), ValueError, "residual"))
    return cases


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("op", ALL_OPS)
def test_bad_input_names_the_op_and_the_argument(op, device):
    assert_bad_inputs_raise(op, _bad_cases(op, device))
