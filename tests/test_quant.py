"""Numerics of ``per_token_group_quant_fp8``: the reference against an independent fp64 formula and
the dequantisation bound, every backend against the reference (the op's ``compare``: scales within one
fp32 ulp, q within one fp8 step), the scale layouts, non-finite input, and bad input.

The dequantisation bound, per element, with ``s`` the group's scale and ``v = x / s`` (``|v| <= 448``
up to one fp32 rounding): ``q`` is ``v`` rounded to float8_e4m3fn, whose step is ``2^-3 * 2^e`` for
``|v|`` in ``[2^e, 2^(e+1))``, ``e >= -6``, and ``2^-9`` below ``2^-6``; rounding to nearest errs by at
most half a step, ``2^-4 |v|`` or ``2^-10``. The fp32 division (or the multiplication by the
reciprocal) and the clamp at 448 add a relative ``2^-23`` at most. Multiplied by ``s``:
``|x - q * s| <= (2^-4 + 2^-20) |x| + 2^-10 * s``.
"""

import math
import os

import pytest
import torch

import torch_kernels  # noqa: F401  (registers the ops)
from torch_kernels import ops, registry
from torch_kernels.families.quant.ops import per_token_group_quant_fp8
from torch_kernels.spec import Backend

from conftest import DEVICES, assert_bad_inputs_raise, implementations_on, triton_here

try:  # after conftest, which switches the interpreter on without a GPU
    import triton
    import triton.language as tl
    from torch_kernels.families.quant.triton import _to_e4m3
except ImportError:
    triton = None

OP = "per_token_group_quant_fp8"
FP8 = torch.float8_e4m3fn
DTYPES = [torch.float32, torch.float16, torch.bfloat16]
compare = ops.BY_NAME[OP].compare
# Every test takes the op name as a parameter so that its id names the op (``pytest -k <op>``).
pytestmark = pytest.mark.parametrize("op", [OP])

# (shape, row stride or None, group_size, column_major_scales, scale_ue8m0): one token; DeepSeek's
# hidden size with groups of 128 (56 groups) and fewer rows than a program takes; 7 groups of 64; 3-D;
# zero tokens; strided rows; a tiny group; groups of 1 and 2; one group per token (4096).
CASES = [((1, 128), None, 128, False, False), ((3, 7168), None, 128, True, False), ((5, 448), None, 64, True, True),
         ((2, 3, 256), None, 128, True, True), ((0, 256), None, 128, True, False), ((6, 384), 512, 128, False, True),
         ((9, 96), None, 32, False, False), ((3, 40), 48, 8, True, False), ((4, 6), None, 2, True, True),
         ((2, 5), None, 1, False, False), ((2, 4096), None, 4096, False, True)]
GPU_CASES = [((8192, 7168), None, 128, False, False), ((8192, 7168), None, 128, True, True),
             ((4097, 7168), 8192, 128, True, False), ((1000, 2048), None, 64, False, True), ((1, 7168), None, 128, True, False)]


def _rows(shape, stride, dtype, device, scale=4.0):
    """Random rows spread over a few binades per group (a per-group factor), last dim contiguous."""
    width = shape[-1] if stride is None else stride
    x = torch.randn(*shape[:-1], width, device=device) * scale
    x = x * torch.exp2(torch.randint(-6, 7, (*shape[:-1], 1), device=device).float())
    return x.to(dtype)[..., :shape[-1]]


def _backends(device):
    return implementations_on(OP, device)


def _reference():
    return registry.BY_OP[OP][Backend.TORCH].load()


def _formula(x, group_size, eps, ue8m0):
    """The definition in fp64, written independently of the reference: (q as fp32 values, scales)."""
    g = x.double().unflatten(-1, (-1, group_size))
    amax = g.abs().amax(-1).clamp(min=eps)
    scale = (amax / 448.0).float()  # one rounding: fp32 division is correctly rounded
    if ue8m0:  # 2 ** ceil(log2(scale)) of the fp32 scale, in fp64
        scale = torch.exp2(torch.ceil(torch.log2(scale.double()))).float()
    # x / scale rounded once to fp32 (the quotient of two 24-bit numbers is never so close to an fp32
    # rounding boundary that rounding through fp64 first changes it), then to e4m3.
    v = (g / scale.double().unsqueeze(-1)).float().clamp(-448.0, 448.0)
    return v.to(FP8).float().flatten(-2), scale


def _deq_error_ok(x, q, s, group_size):
    x64 = x.double().unflatten(-1, (-1, group_size))
    s64 = s.double().unsqueeze(-1)
    err = (x64 - q.double().unflatten(-1, (-1, group_size)) * s64).abs()
    bound = (2.0 ** -4 + 2.0 ** -20) * x64.abs() + 2.0 ** -10 * s64
    return bool((err <= bound).all()), float((err / bound).max()) if err.numel() else 0.0


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("case", CASES, ids=str)
def test_reference_matches_fp64_formula(op, case, dtype):
    shape, stride, group, column_major, ue8m0 = case
    x = _rows(shape, stride, dtype, "cpu")
    q, s = _reference()(x, group, 1e-10, column_major, ue8m0)
    q_want, s_want = _formula(x, group, 1e-10, ue8m0)
    assert q.dtype == FP8 and q.shape == x.shape and q.is_contiguous()
    assert s.dtype == torch.float32 and s.shape == (*shape[:-1], shape[-1] // group)
    assert torch.equal(s, s_want), "the scale is max|x| / 448 (or its power-of-two ceiling), exactly"
    assert torch.equal(q.float(), q_want), "q is x / scale rounded to fp32 then to e4m3 (nearest even)"
    ok, worst = _deq_error_ok(x, q, s, group)
    assert ok, f"dequantisation error {worst:.3f} times the bound"
    if x.numel():
        amax = x.float().unflatten(-1, (-1, group)).abs().amax(-1)
        if ue8m0:  # a power of two, within a factor 2 above amax / 448
            assert torch.equal(torch.frexp(s).mantissa, torch.full_like(s, 0.5))
            assert bool(((s * 448 >= amax) & (s * 448 < 2 * amax)).all())
        else:  # the group's largest magnitude quantises to +-448: the whole fp8 range is used
            assert torch.equal(q.float().unflatten(-1, (-1, group)).abs().amax(-1), torch.full_like(s, 448.0))


def test_scale_layouts(op):
    """Row-major scales are contiguous; column-major ones are vLLM's ``empty((G, T)).permute(1, 0)``
    (DeepGEMM's layout): ``s.t()`` is contiguous; N-D input keeps its leading dims in that storage."""
    x = torch.randn(5, 512)
    q, s = per_token_group_quant_fp8(x, 128)  # the typed wrapper, defaults
    assert s.shape == (5, 4) and s.is_contiguous()
    q_c, s_c = torch.ops.deepinfer.per_token_group_quant_fp8(x, 128, 1e-10, True)
    assert s_c.shape == (5, 4) and s_c.stride() == torch.empty(4, 5).permute(1, 0).stride() == (1, 5)
    assert s_c.t().is_contiguous() and torch.equal(s_c, s) and torch.equal(q_c.float(), q.float())
    x3 = torch.randn(2, 3, 256)
    _, s3 = torch.ops.deepinfer.per_token_group_quant_fp8(x3, 64, 1e-10, True)
    assert s3.shape == (2, 3, 4) and s3.stride() == (3, 1, 6)
    _, s2 = torch.ops.deepinfer.per_token_group_quant_fp8(x3.view(6, 256), 64, 1e-10, True)
    assert torch.equal(s3.reshape(6, 4), s2)
    # The fake function gives the same layouts (opcheck checks it on the samples too).
    for args in [(x, 128), (x, 128, 1e-10, True), (x3, 64, 1e-10, True), (torch.randn(0, 256), 128, 1e-10, True)]:
        real = torch.ops.deepinfer.per_token_group_quant_fp8(*args)
        meta = torch.ops.deepinfer.per_token_group_quant_fp8(args[0].to("meta"), *args[1:])
        for r, m in zip(real, meta):
            assert (r.shape, r.stride(), r.dtype) == (m.shape, m.stride(), m.dtype)


def _check_backends(device, x, group, eps, column_major, ue8m0, what=""):
    want = _reference()(x, group, eps, column_major, ue8m0)
    meta = torch.ops.deepinfer.per_token_group_quant_fp8(x.to("meta"), group, eps, column_major, ue8m0)
    for name, fn in _backends(device):
        before = x.clone()
        got = fn(x, group, eps, column_major, ue8m0)
        try:
            compare(list(got), list(want))
        except AssertionError as e:
            raise AssertionError(f"backend {name} {what} {tuple(x.shape)} {x.dtype} group {group}: {e}") from None
        for g, m in zip(got, meta):
            assert (g.shape, g.stride(), g.dtype) == (m.shape, m.stride(), m.dtype), f"{name}: output layout"
        if x.isfinite().all() and (got[1] >= 2.0 ** -126).all():  # normal scales: the bound holds
            ok, worst = _deq_error_ok(x, got[0], got[1], group)
            assert ok, f"backend {name} {what}: dequantisation error {worst:.3f} times the bound"
        assert torch.equal(x.nan_to_num(), before.nan_to_num()), f"{name} clobbered its input"


def _cases(device):
    return CASES + (GPU_CASES if device == "cuda" else [])


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_backends_match_reference(op, dtype, device):
    for shape, stride, group, column_major, ue8m0 in _cases(device):
        x = _rows(shape, stride, dtype, device)
        _check_backends(device, x, group, 1e-10, column_major, ue8m0)


@pytest.mark.parametrize("device", DEVICES)
def test_backends_non_collapsible_leading_dims(op, device):
    """Leading dims that are not one stride (a slice in the middle dim): the backends copy the rows."""
    x = _rows((3, 4, 384), None, torch.bfloat16, device)[:, 1:3, :256]
    for column_major in (False, True):
        _check_backends(device, x, 128, 1e-10, column_major, False)


@pytest.mark.parametrize("device", DEVICES)
def test_backends_nonfinite_and_extreme_values(op, device):
    x = _rows((4, 512), None, torch.float32, device)
    x[0, 3] = float("nan")  # group 0 of row 0: NaN scale, all NaN
    x[1, 130] = float("inf")  # group 1 of row 1: infinite scale, zeros and one NaN
    x[2, 300] = -float("inf")
    x[3, :128] = 0.0  # an all-zero group: scale eps / 448, q zero
    want_q, want_s = _reference()(x, 128, 1e-10, False, False)
    assert want_s[0, 0].isnan() and want_q[0, :128].float().isnan().all()
    assert want_s[1, 1].isinf() and want_q[1, 130].float().isnan() and (want_q[1, 128:130].float() == 0).all()
    # fp32(1e-10) / 448 correctly rounded (the CPU divides; on CUDA, torch's ``tensor / python_scalar``
    # multiplies by fp32(1 / 448) instead, which gives 2.2321430e-13 here: one ulp above)
    assert want_s[3, 0].item() == (torch.tensor(1e-10, dtype=torch.float32) / 448).item() == 2.2321428288629014e-13
    assert (want_q[3, :128].float() == 0).all()
    for column_major, ue8m0 in [(False, False), (True, True)]:
        _check_backends(device, x, 128, 1e-10, column_major, ue8m0, "non-finite")
    # eps = 0: an all-zero group has scale 0 and q = 0/0 = NaN, as in vLLM
    _check_backends(device, x, 128, 0.0, False, False, "eps=0")
    q0, s0 = _reference()(x, 128, 0.0)
    assert s0[3, 0] == 0 and q0[3, :128].float().isnan().all()
    # fp16 near its max, bf16 far beyond fp16's range
    _check_backends(device, _rows((3, 256), None, torch.float16, device, 6e4 / 64 / 5), 128, 1e-10, True, True, "large")
    _check_backends(device, _rows((3, 256), None, torch.bfloat16, device, 1e30), 128, 1e-10, False, False, "huge")
    # Tiny values with eps = 0: scales below 2^-128 (subnormal), where 1/scale overflows: the Triton
    # backend divides each element instead (eps < 2^-100).
    tiny = _rows((3, 256), None, torch.float32, device, 1e-36)
    _check_backends(device, tiny, 128, 0.0, False, False, "tiny")
    _check_backends(device, tiny, 128, 0.0, True, True, "tiny")
    # A large eps: every scale is eps / 448.
    _check_backends(device, x[2:].contiguous(), 64, 1e3, False, False, "large eps")


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_reference_matches_fp64_formula_on_device(op, dtype, device):
    """The reference's divisions are IEEE fp32 divisions on every device (on CUDA, ``tensor / 448``
    with a Python scalar would multiply by the fp32 reciprocal: 55% of random scales one ulp off)."""
    for shape, stride, group, column_major, ue8m0 in CASES[:4] + (GPU_CASES[:2] if device == "cuda" else []):
        x = _rows(shape, stride, dtype, device)
        q, s = _reference()(x, group, 1e-10, column_major, ue8m0)
        q_want, s_want = _formula(x.cpu(), group, 1e-10, ue8m0)
        assert torch.equal(s.cpu(), s_want), f"{shape} {dtype}: scales are max|x| / 448 correctly rounded"
        assert torch.equal(q.float().cpu(), q_want), f"{shape} {dtype}: q is x / scale rounded twice"


def _emulations(device):
    """The Triton fp8 roundings to test: the GPU runs the hardware cast (the kernel's choice there)
    and the fp32 emulation (the interpreter's, so the GPU checks the arithmetic the CPU tests run);
    the interpreter runs only the emulation (its own cast is wrong, see families/quant/triton.py)."""
    return (False, True) if device == "cuda" else (True,)


@pytest.mark.parametrize("device", DEVICES)
def test_triton_division_paths(op, device):
    """The Triton kernel's scales are bit-equal to the fp64 formula (``div_rn`` is ``div.rn.f32``);
    it multiplies by 1/scale (one fp8 step at most from x / scale, and rarely) or, forced, divides
    (``div_rn``: q bit-equal to the formula), with either fp8 rounding."""
    tq = triton_here("quant", device)
    x = _rows((16, 1024), None, torch.float32, device)
    q_want, s_want = _formula(x.cpu(), 128, 1e-10, False)
    q_ref, s_ref = _reference()(x, 128, 1e-10)
    for emulate in _emulations(device):
        for exact in (True, False):
            q, s = torch.empty_like(q_ref), torch.empty_like(s_ref)
            tq.launch(x, q, s, 128, 1e-10, False, exact_div=exact, emulate_cast=emulate)
            what = f"exact_div={exact} emulate_cast={emulate}"
            assert torch.equal(s.cpu(), s_want), f"{what}: scales are bit-equal (div_rn)"
            want_bytes = q_want.to(FP8).view(torch.uint8)
            differ = int((q.cpu().view(torch.uint8) != want_bytes).sum())
            if exact:
                assert differ == 0, f"{what}: {differ} bytes differ"
            else:
                compare([q, s], [q_ref, s_ref])
                assert differ <= x.numel() // 1000, f"{what}: {differ} of {x.numel()} values one step off"


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_triton_other_configs_match_reference(op, dtype, device):
    """The entry point under launches other than the heuristic's: one (row, group) a program, rows
    past the token count (masked), several groups a program, other warp counts; both scale layouts."""
    tq = triton_here("quant", device)
    Config = tq.TritonQuantConfig
    for shape, group, column_major, ue8m0 in (((5, 512), 64, True, True), ((3, 1024), 128, False, False)):
        x = _rows(shape, None, dtype, device)
        want = list(_reference()(x, group, 1e-10, column_major, ue8m0))
        for config in (Config(1, 1, 1), Config(8, 1, 2), Config(2, 2, 1), Config(4, 4, 4)):
            got = tq.per_token_group_quant_fp8(x, group, 1e-10, column_major, ue8m0, config=config)
            compare(list(got), want)


def test_triton_heuristic_picks_the_measured_blocks(op):
    """4096 values a program over 4 warps (1024 a warp): the most groups that divide the row, then
    rows, no more rows than the batch's power of two (traced: the batch is unknown)."""
    if triton is None:
        pytest.skip("needs Triton")
    from torch_kernels.families.quant.triton import TritonQuantConfig as Config
    assert Config.for_shape(8192, 56, 128) == Config(4, 8, 4)  # 7168 in groups of 128
    assert Config.for_shape(3, 56, 128) == Config(4, 8, 4)
    assert Config.for_shape(2, 56, 128) == Config(2, 8, 2)
    assert Config.for_shape(1, 56, 128) == Config(1, 8, 1)
    assert Config.for_shape(None, 56, 128) == Config(4, 8, 4)
    assert Config.for_shape(8192, 7, 64) == Config(64, 1, 4)
    assert Config.for_shape(1, 1, 8192) == Config(1, 1, 8)
    assert Config.for_shape(8192, 56, 128, tile=8192) == Config(8, 8, 8)  # the sweep's


if triton is not None:
    @triton.jit
    def _round_kernel(x_ptr, q_ptr, n, BLOCK: tl.constexpr, EMULATE: tl.constexpr):
        c = tl.arange(0, BLOCK)
        y = tl.load(x_ptr + c, mask=c < n, other=0.0)
        tl.store(q_ptr + c, _to_e4m3(y, q_ptr.dtype.element_ty, EMULATE), mask=c < n)


@pytest.mark.parametrize("device", DEVICES)
def test_triton_fp8_rounding_is_torchs(op, device):
    """The kernel's rounding to e4m3 gives the bits ``Tensor.to(float8_e4m3fn)`` gives (after the
    clamp at +-448), on every value of the fp8 grid, every midpoint and its neighbours, saturation,
    subnormals, signed zero (-0.0 and negatives that round to zero) and NaN: the emulation in the
    interpreter (whose own fp32 -> fp8 cast is wrong) and on the GPU, and the GPU's own cast."""
    if triton is None or device == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("Triton runs on CPU only in its interpreter")
    grid = torch.arange(256, dtype=torch.uint8).view(FP8).float()
    grid = grid[grid.isfinite()].sort().values
    mid = (grid[1:] + grid[:-1]) / 2
    big, small = torch.full_like(mid, 1e9), torch.full_like(mid, -1e9)
    special = [0.0, -0.0, 448.0, -448.0, 463.9, 464.0, 465.0, 1e30, -1e30, -float("inf"), float("inf"),
               float("nan"), 1e-40, -1e-40, 2.0 ** -10, -(2.0 ** -10), 3 * 2.0 ** -11, 2.0 ** -6, 2.0 ** -7,
               -(2.0 ** -11), -1e-5]
    x = torch.cat([grid, mid, torch.nextafter(mid, big), torch.nextafter(mid, small), torch.randn(3000) * 64,
                   torch.randn(1000) * 1e-2, torch.tensor(special)])
    want = x.clamp(-448, 448).to(FP8)  # on the CPU: the device's cast is what is tested
    nan = want.float().isnan()
    assert int((want.view(torch.uint8) == 0x80).sum()) > 10, "negative zeros are in the test"
    for emulate in _emulations(device):
        q = torch.empty(x.shape, dtype=FP8, device=device)
        _round_kernel[(1,)](x.to(device), q, x.numel(), BLOCK=triton.next_power_of_2(x.numel()), EMULATE=emulate)
        q = q.cpu()
        assert torch.equal(q.float().isnan(), nan), f"emulate={emulate}: NaN placement"
        bad = (q.view(torch.uint8) != want.view(torch.uint8)) & ~nan
        assert not bad.any(), f"emulate={emulate}: {x[bad][:8].tolist()} -> {q.view(torch.uint8)[bad][:8].tolist()}, " \
                              f"torch {want.view(torch.uint8)[bad][:8].tolist()}"
    if device == "cuda":  # and the device's own cast agrees with the CPU's
        assert torch.equal(x.cuda().clamp(-448, 448).to(FP8).cpu().view(torch.uint8)[~nan], want.view(torch.uint8)[~nan])


@pytest.mark.parametrize("device", DEVICES)
def test_compare_rejects_wrong_outputs(op, device):
    x = _rows((4, 256), None, torch.bfloat16, device)
    q, s = _reference()(x, 128)
    compare([q, s], [q, s])
    two_steps = (q.view(torch.uint8) + 2 * (q.view(torch.uint8) & 0x7F < 0x70)).view(FP8)  # two steps up
    with pytest.raises(AssertionError, match="q: "):
        compare([two_steps, s], [q, s])
    with pytest.raises(AssertionError, match="scales: "):
        compare([q, s * (1 + 2.0 ** -21)], [q, s])
    with pytest.raises(AssertionError, match="strides"):
        compare([q, s.t().contiguous().t()], [q, s])


@pytest.mark.gpu
def test_cuda_default_selection_is_a_kernel(op):
    from torch_kernels import dispatch
    chain, notice = dispatch.plan(OP)
    assert chain[0].backend is not Backend.TORCH and notice is None


@pytest.mark.gpu
def test_triton_int64_row_offsets(op):
    """Row offsets beyond 2^31 elements (a 2^30 row stride, 3 rows): 6 GiB of bf16, rows only written."""
    base = torch.empty(3 * 2 ** 30, dtype=torch.bfloat16, device="cuda")
    x = base.as_strided((3, 7168), (2 ** 30, 1))
    x.copy_(_rows((3, 7168), None, torch.bfloat16, "cuda"))
    _check_backends("cuda", x, 128, 1e-10, True, False, "int64 offsets")


# --- bad input -----------------------------------------------------------------------------------

def _bad_cases(device):
    x = torch.randn(4, 256, device=device)
    return [
        ("hidden size not divisible by the group", (torch.randn(4, 200, device=device), 128), ValueError, "group_size"),
        ("group larger than the hidden size", (x, 512), ValueError, "group_size"),
        ("integer input", (torch.ones(4, 256, dtype=torch.int32, device=device), 128), TypeError, "input"),
        ("fp64 input", (x.double(), 128), TypeError, "input"),
        ("fp8 input", (x.to(FP8), 128), TypeError, "input"),
        ("group_size 0", (x, 0), ValueError, "group_size"),
        ("negative group_size", (x, -128), ValueError, "group_size"),
        ("group_size not a power of two", (torch.randn(4, 96 * 3, device=device), 96), ValueError, "group_size"),
        ("negative eps", (x, 128, -1e-10), ValueError, "eps"),
        ("NaN eps", (x, 128, float("nan")), ValueError, "eps"),
        ("non-contiguous last dim", (torch.randn(256, 4, device=device).t(), 128), ValueError, "input"),
        ("zero hidden size", (torch.randn(4, 0, device=device), 128), ValueError, "input"),
        ("0-d input", (torch.tensor(1.0, device=device), 1), ValueError, "input"),
    ]


@pytest.mark.parametrize("device", DEVICES)
def test_bad_input_names_the_op_and_the_argument(op, device):
    assert_bad_inputs_raise(OP, _bad_cases(device))


def test_bad_input_raises_at_trace_time(op):
    compiled = torch.compile(lambda x: torch.ops.deepinfer.per_token_group_quant_fp8(x, 128), backend="eager",
                             fullgraph=True)
    with pytest.raises(Exception, match=rf"deepinfer::{OP}: argument 'group_size' must divide the hidden size"):
        compiled(torch.randn(4, 200))


def test_not_differentiable(op):
    x = torch.randn(2, 128, requires_grad=True)
    with pytest.raises(RuntimeError, match=rf"deepinfer::{OP} does not support autograd"):
        torch.ops.deepinfer.per_token_group_quant_fp8(x, 128)
    with torch.no_grad():
        torch.ops.deepinfer.per_token_group_quant_fp8(x, 128)


def test_dequantisation_bound_is_tight(op):
    """The bound in the module docstring is not loose: some element of random data comes within 10%
    of it (so a kernel that rounds worse, e.g. by truncation, would fail it)."""
    x = _rows((64, 1024), None, torch.float32, "cpu")
    q, s = _reference()(x, 128)
    ok, worst = _deq_error_ok(x, q, s, 128)
    assert ok and worst > 0.9, worst
    assert math.isfinite(worst)
