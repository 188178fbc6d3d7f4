"""Numerics of the norm family: the reference against an independent fp64 formula, and every
backend against the reference, over dtypes and awkward shapes (Triton in its interpreter on CPU)."""


import pytest
import torch

import torch_kernels
from torch_kernels import ops, registry
from torch_kernels.spec import Backend
from torch_kernels.testing import assert_close

from conftest import DEVICES, assert_bad_inputs_raise, family_ops, implementations_on, triton_here

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
# (shape, row stride or None): one element, one token, hidden sizes that are not powers of two,
# 3-D, zero tokens, strided rows, rows wider than the one-pass limit (two passes), the largest size.
SHAPES = [((1, 1), None), ((1, 4096), None), ((7, 1000), None), ((2, 3, 257), None), ((0, 64), None),
          ((5, 96), 160), ((3, 5120), None), ((2, 20000), None), ((1, 65536), None)]
GPU_SHAPES = [((4096, 8192), None), ((33, 7168), 8192), ((1, 131072), None)]
# the norms that return their output, and the fused ones that write input and residual in place (Tensor(a!));
# the norms with an FP8 epilogue: tests/test_fp8_epilogues.py
_PLAIN = [op for op in family_ops("norm") if not op.endswith("_fp8_quant")]
NORM = [op for op in _PLAIN if "!" not in ops.BY_NAME[op].schema]
FUSED = [op for op in _PLAIN if "!" in ops.BY_NAME[op].schema]
# the ops that take weight=None (vLLM's RMSNorm(has_weight=False)); the others require a weight
UNWEIGHTED = [op for op in family_ops("norm") if "Tensor? weight" in ops.BY_NAME[op].schema]


def _rows(shape, stride, dtype, device, scale=1.0):
    if stride is None:
        return torch.randn(shape, dtype=dtype, device=device) * scale
    return (torch.randn(*shape[:-1], stride, dtype=dtype, device=device) * scale)[..., :shape[-1]]


def _formula(x, weight, eps, gemma):
    """The definition in fp64, written independently of the reference."""
    x64 = x.double()
    w64 = weight.double() + (1.0 if gemma else 0.0)
    return x64 / torch.sqrt((x64 * x64).sum(-1, keepdim=True) / x.shape[-1] + eps) * w64


_backends = implementations_on


def _shape_cases(device):
    return SHAPES + (GPU_SHAPES if device == "cuda" else [])


@pytest.mark.parametrize("dtype", DTYPES + [torch.float64], ids=str)
@pytest.mark.parametrize("shape,stride", SHAPES, ids=str)
@pytest.mark.parametrize("op", NORM + FUSED)
def test_reference_matches_fp64_formula(op, shape, stride, dtype):
    gemma = op.startswith("gemma")
    x, w = _rows(shape, stride, dtype, "cpu"), torch.randn(shape[-1], dtype=dtype)
    ref = registry.BY_OP[op][Backend.TORCH].load()
    if op in NORM:
        assert_close(ref(x, w, 1e-6), _formula(x, w, 1e-6, gemma).to(dtype))
    else:
        res = _rows(shape, stride, dtype, "cpu")
        total = x.double() + res.double()
        xi, ri = x.clone(), res.clone()
        ref(xi, ri, w, 1e-6)
        assert_close(ri, total.to(dtype))
        assert_close(xi, _formula(total, w, 1e-6, gemma).to(dtype))


def _check_backends(op, device, dtype, shape, stride, scale=1.0, poison=None, backends=None):
    """Each backend of ``op`` on ``device`` (or each ``(name, fn)`` of ``backends``) against the reference."""
    w = torch.randn(shape[-1], dtype=dtype, device=device)
    reference = registry.BY_OP[op][Backend.TORCH].load()
    x = _rows(shape, stride, dtype, device, scale)
    if poison is not None and x.numel():
        x.view(-1, shape[-1])[0, 0] = poison
    for name, fn in backends or _backends(op, device):
        if op in NORM:
            x_before = x.clone()
            assert_close(fn(x, w, 1e-5), reference(x, w, 1e-5), msg=f"backend {name}")
            assert torch.equal(x.nan_to_num(), x_before.nan_to_num()), f"{name} clobbered its input"
        else:
            res = _rows(shape, stride, dtype, device)
            xa, ra, xb, rb = x.clone(), res.clone(), x.clone(), res.clone()
            w_before = w.clone()
            if stride is not None:  # keep the strided layout the op receives
                xa, ra = _restride(xa, stride), _restride(ra, stride)
            assert fn(xa, ra, w, 1e-5) is None
            reference(xb, rb, w, 1e-5)
            assert_close(ra, rb, msg=f"backend {name}: residual")
            assert_close(xa, xb, msg=f"backend {name}: output")
            assert torch.equal(w, w_before), f"{name} clobbered the weight"


def _restride(t, stride):
    wide = torch.full((*t.shape[:-1], stride), float("nan"), dtype=t.dtype, device=t.device)
    wide[..., :t.shape[-1]] = t
    return wide[..., :t.shape[-1]]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("op", NORM + FUSED)
def test_backends_match_reference(op, dtype, device):
    for shape, stride in _shape_cases(device):
        _check_backends(op, device, dtype, shape, stride)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("op", NORM + FUSED)
def test_backends_large_values_and_nonfinite(op, device):
    # fp16 squares overflow above 256: the fp32 accumulation must not.
    _check_backends(op, device, torch.float16, (4, 3000), None, scale=1000.0)
    for poison in (float("nan"), float("inf")):
        _check_backends(op, device, torch.float32, (3, 700), None, poison=poison)



def _triton_with(op, device, config):
    """The Triton entry point of ``op`` launched with ``config(n)`` for rows of ``n``."""
    fn = getattr(triton_here("norm", device), op)
    return lambda x, *args: fn(x, *args, config=config(x.shape[-1]))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("op", NORM + FUSED)
def test_triton_large_batch_routes_match_reference(op, device):
    """The Triton backend's routes from 4096 tokens (the fused ops in chunks, rmsnorm reading its row
    twice) at every token count: a row in one chunk, a masked last chunk, several chunks, strided rows."""
    triton_norm = triton_here("norm", device)
    many = _triton_with(op, device, lambda n: triton_norm.TritonNormConfig.for_shape(4096, n, op in FUSED))
    for dtype in (torch.bfloat16, torch.float32):
        for shape, stride in (((3, 1000), None), ((2, 5120), None), ((5, 96), 160)):
            _check_backends(op, device, dtype, shape, stride, backends=[("triton, 4096-token route", many)])


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("op", NORM + FUSED)
def test_triton_other_configs_match_reference(op, device):
    """Launches other than the heuristic's: small chunks (several, a masked last one), a row padded
    past its width in one pass, read twice or not, other warp counts."""
    triton_norm = triton_here("norm", device)
    Config = triton_norm.TritonNormConfig
    configs = {"two passes of 64, 2 warps": lambda n: Config(64, False, False, 2),
               "two passes of 512, 1 warp": lambda n: Config(512, False, False, 1),
               # the next power of two >= 2n
               "one pass padded twice over, read twice, 8 warps": lambda n: Config(1 << (2 * n - 1).bit_length(),
                                                                                   True, True, 8)}
    for dtype in (torch.bfloat16, torch.float32):
        for shape, stride in (((3, 1000), None), ((5, 96), 160), ((2, 3, 257), None)):
            _check_backends(op, device, dtype, shape, stride,
                            backends=[(name, _triton_with(op, device, c)) for name, c in configs.items()])


def test_triton_heuristic_picks_the_measured_launches():
    """One pass with the row padded up to 16384 wide, ~one warp per 512 values; two passes of 4096
    beyond; from 4096 tokens (eager) rmsnorm reads its row twice and the fused ops go in chunks of
    4096 over 16 warps; traced, the token count is unknown: the few-token launch."""
    Config = triton_here("norm", "cpu").TritonNormConfig
    for fused in (False, True):
        assert Config.for_shape(1, 1, fused) == Config(1, True, False, 1)
        assert Config.for_shape(7, 1000, fused) == Config(1024, True, False, 2)
        assert Config.for_shape(1, 4096, fused) == Config(4096, True, False, 8)
        assert Config.for_shape(4095, 8192, fused) == Config(8192, True, False, 16)
        assert Config.for_shape(1, 16384, fused) == Config(16384, True, False, 16)
        assert Config.for_shape(1, 16385, fused) == Config(4096, False, False, 8)
        assert Config.for_shape(None, 8192, fused) == Config(8192, True, False, 16)
    assert Config.for_shape(4096, 4096, False) == Config(4096, True, True, 8)
    assert Config.for_shape(16384, 65536, False) == Config(4096, False, False, 8)
    assert Config.for_shape(4096, 1000, True) == Config(4096, False, False, 16)
    assert Config.for_shape(16384, 65536, True) == Config(4096, False, False, 16)


@pytest.mark.parametrize("device", DEVICES)
def test_fused_add_non_collapsible_leading_dims(device):
    """Leading dims that are not one stride (a slice in the middle dim) still update in place."""
    base_x, base_r = (torch.randn(3, 4, 160, device=device) for _ in range(2))
    x, r = base_x[:, 1:3, :100], base_r[:, 1:3, :100]
    w = torch.randn(100, device=device)
    expected_x, expected_r = x.clone(), r.clone()
    registry.BY_OP["fused_add_rmsnorm"][Backend.TORCH].load()(expected_x, expected_r, w, 1e-6)
    for name, fn in _backends("fused_add_rmsnorm", device):
        xa, ra = base_x.clone()[:, 1:3, :100], base_r.clone()[:, 1:3, :100]
        fn(xa, ra, w, 1e-6)
        assert_close(xa, expected_x, msg=name)
        assert_close(ra, expected_r, msg=name)
        assert torch.equal(xa._base[:, 0], base_x[:, 0]), f"{name} wrote outside the view"


@pytest.mark.parametrize("op", NORM)
def test_gradcheck_fp64(op):
    x = torch.randn(2, 3, 19, dtype=torch.float64, requires_grad=True)
    w = torch.randn(19, dtype=torch.float64, requires_grad=True)
    fn = getattr(torch.ops.deepinfer, op)
    assert torch.autograd.gradcheck(lambda a, b: fn(a, b, 1e-5), (x, w))
    assert torch.autograd.gradgradcheck(lambda a, b: fn(a, b, 1e-5), (x, w))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("op", NORM)
def test_backward_matches_autograd_of_formula(op, device):
    x = torch.randn(5, 300, device=device, requires_grad=True)
    w = torch.randn(300, device=device, requires_grad=True)
    g = torch.randn(5, 300, device=device)
    torch.autograd.backward(getattr(torch_kernels, op)(x, w), g)
    got = (x.grad, w.grad)
    x.grad = w.grad = None
    torch.autograd.backward(_formula(x, w, 1e-6, op.startswith("gemma")).float(), g)
    assert_close(got[0], x.grad)
    assert_close(got[1], w.grad, torch.float16)  # a sum over rows: looser


@pytest.mark.parametrize("op", FUSED)
def test_inplace_ops_refuse_autograd(op):
    x = torch.randn(2, 8, requires_grad=True)
    with pytest.raises(RuntimeError, match=rf"deepinfer::{op} does not support autograd"):
        getattr(torch_kernels, op)(x, torch.randn(2, 8), torch.randn(8))
    with torch.no_grad():  # no gradient requested: fine
        getattr(torch_kernels, op)(x, torch.randn(2, 8), torch.randn(8))


@pytest.mark.gpu
def test_cuda_default_selection_is_a_kernel():
    """On the GPU host the CUDA key is served by a compiled backend, not the reference."""
    from torch_kernels import dispatch
    chain, notice = dispatch.plan("rmsnorm")
    assert chain[0].backend is not Backend.TORCH and notice is None


# --- bad input -----------------------------------------------------------------------------------

def _bad_cases(op, device):
    x, w = torch.randn(4, 64, device=device), torch.randn(64, device=device)
    fused = op in FUSED
    r = torch.randn(4, 64, device=device)

    def args(x=x, w=w, r=r, eps=1e-6):
        return (x, r, w, eps) if fused else (x, w, eps)
    cases = [
        ("integer input", args(x=torch.ones(4, 64, dtype=torch.int32, device=device)), TypeError, "input"),
        ("weight of the wrong size", args(w=torch.randn(63, device=device)), ValueError, "weight"),
        ("2-D weight", args(w=torch.randn(1, 64, device=device)), ValueError, "weight"),
        ("integer weight", args(w=torch.ones(64, dtype=torch.int64, device=device)), TypeError, "weight"),
        ("non-contiguous last dim", args(x=torch.randn(64, 4, device=device).t(),
                                         r=torch.randn(64, 4, device=device).t()), ValueError, "input"),
        ("zero hidden size", args(x=torch.randn(4, 0, device=device), w=torch.randn(0, device=device),
                                  r=torch.randn(4, 0, device=device)), ValueError, "input"),
        ("negative eps", args(eps=-1.0), ValueError, "eps"),
        ("weight on another device", args(w=torch.randn(64, device="meta")), ValueError, "weight"),
    ]
    if fused:
        cases += [
            ("residual of another shape", args(r=torch.randn(5, 64, device=device)), ValueError, "residual"),
            ("residual of another dtype", args(r=r.half()), TypeError, "residual"),
            ("residual that is the input", args(r=x), ValueError, "residual"),
        ]
    return cases


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("op", NORM + FUSED)
def test_bad_input_names_the_op_and_the_argument(op, device):
    assert_bad_inputs_raise(op, _bad_cases(op, device))


@pytest.mark.gpu
@pytest.mark.parametrize("op", NORM + FUSED)
def test_tensors_on_cuda_and_cpu_raise_before_any_kernel(op):
    x, w = torch.randn(4, 64, device="cuda"), torch.randn(64)
    args = (x, torch.randn(4, 64, device="cuda"), w, 1e-6) if op in FUSED else (x, w, 1e-6)
    with pytest.raises(ValueError, match=rf"deepinfer::{op}: argument 'weight' is on cpu but 'input' is on cuda"):
        getattr(torch.ops.deepinfer, op).default(*args)
    torch.cuda.synchronize()  # the CUDA context is intact


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("op", NORM + FUSED)
def test_none_for_a_tensor_names_the_op_and_the_argument(op, device):
    """Through the registered op and the typed wrapper (on CUDA also through the C++ entry)."""
    names = ("input", "residual", "weight") if op in FUSED else ("input", "weight")
    for i, name in enumerate(names):
        if name == "weight" and op in UNWEIGHTED:  # None: no scale (test_no_weight_is_a_weight_of_ones)
            continue
        args = [torch.randn(4, 64, device=device) for _ in names[:-1]] + [torch.randn(64, device=device), 1e-6]
        args[i] = None
        for call in (getattr(torch.ops.deepinfer, op).default, getattr(torch_kernels, op)):
            with pytest.raises(TypeError, match=rf"^deepinfer::{op}: argument '{name}' must be a Tensor, got NoneType"):
                call(*args)


# --- memory overlap of the in-place ops ------------------------------------------------------------

N = 64


def _overlapping(device):
    """(what, input, residual, weight, the argument named, the other or None for an internal overlap)."""
    fresh = lambda *shape: torch.randn(*shape, device=device)  # noqa: E731
    x, r, w, rows, cols = fresh(4, N), fresh(4, N), fresh(N), fresh(6, N), fresh(4, 2 * N)
    x3 = fresh(2, 2, N)
    return [
        ("residual a view of input", x, x.view(4, N), w, "residual", "input"),
        ("residual a view of a 3-D input", x3, x3.view(4, N).view(2, 2, N), w, "residual", "input"),
        ("overlapping row slices", rows[:4], rows[2:], w, "residual", "input"),
        ("overlapping column slices", cols[:, :N], cols[:, N // 2:N // 2 + N], w, "residual", "input"),
        ("expanded input", fresh(1, N).expand(4, N), r, w, "input", None),
        ("expanded residual", x, fresh(N).expand(4, N), w, "residual", None),
        ("input rows overlapping each other", rows.view(-1).as_strided((4, N), (N // 2, 1)), r, w, "input", None),
        ("weight a row of input", x, r, x[2], "weight", "input"),
        ("weight a row of residual", x, r, r[0], "weight", "residual"),
        ("weight across two rows of input", x, r, x.view(-1)[N // 2:N // 2 + N], "weight", "input"),
    ]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("op", FUSED)
def test_inplace_ops_refuse_overlapping_memory_before_writing(op, device):
    """Every written argument apart from the others and from itself, or a ValueError naming both
    arguments with nothing written; on CUDA with each backend selected in turn, after a valid call of
    the same signature, so that the C++ entry has published it (TileLang) and would serve these calls
    if it did not check them."""
    call = getattr(torch.ops.deepinfer, op).default
    backends = [None]
    if device == "cuda":
        here = torch_kernels.Platform.detect()
        backends = [s.backend.value for s in registry.implementations(op) if s.is_available(here)]
    for backend in backends:
        if backend is not None:
            torch_kernels.configure(backend=backend)
        for _ in range(2):
            call(torch.randn(4, N, device=device), torch.randn(4, N, device=device), torch.randn(N, device=device), 1e-6)
        for what, x, r, w, arg, other in _overlapping(device):
            bases = {id(t._base if t._base is not None else t): t._base if t._base is not None else t for t in (x, r, w)}
            before = [b.clone() for b in bases.values()]
            said = f"overlaps argument '{other}' in memory$" if other else "has elements that share memory"
            with pytest.raises(ValueError, match=rf"^deepinfer::{op}: argument '{arg}' {said}"):
                call(x, r, w, 1e-6)
            assert all(torch.equal(b, a) for b, a in zip(before, bases.values())), f"{backend}, {what}: written"


# each builds (input, residual, weight) from one (8, 3N) buffer: arguments apart, within one storage
_APART = {
    "row slices of one buffer": lambda b: (b[:4, :N], b[4:, :N], b[0, 2 * N:]),
    "column slices of one buffer": lambda b: (b[:, :N], b[:, N:2 * N], b[3, 2 * N:]),
    "3-D column slices": lambda b: (b[:, :N].unflatten(0, (2, 4)), b[:, 2 * N:].unflatten(0, (2, 4)), b[0, N:2 * N]),
    "weight in the same buffer": lambda b: (b[:3, :N], b[3:6, :N], b[7, :N]),
}


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("op", FUSED)
@pytest.mark.parametrize("layout", list(_APART))
def test_inplace_ops_take_disjoint_views_of_one_buffer(op, device, layout):
    """Views of one buffer that share no element (rows, or interleaved columns as a fused tensor's
    slices) are accepted, and every backend writes exactly the reference's values into them."""
    make, base = _APART[layout], torch.randn(8, 3 * N, device=device)
    want = base.clone()
    registry.BY_OP[op][Backend.TORCH].load()(*make(want), 1e-6)
    for name, fn in _backends(op, device):
        got = base.clone()
        fn(*make(got), 1e-6)
        assert_close(got, want, msg=f"{name}: {layout}")


def test_inplace_overlap_raises_at_trace_time():
    """The fake function refuses views of one input that overlap while compiling (Dynamo keeps the
    aliasing of its inputs), and column halves of one buffer compile with dynamic token counts."""
    compiled = torch.compile(lambda x, w: torch.ops.deepinfer.fused_add_rmsnorm(x, x.view(x.shape), w),
                             backend="eager", fullgraph=True)
    with pytest.raises(Exception, match=r"deepinfer::fused_add_rmsnorm: argument 'residual' overlaps argument 'input'"):
        compiled(torch.randn(4, N), torch.randn(N))

    def halves(buf, w):
        x, r = buf.chunk(2, dim=-1)
        torch.ops.deepinfer.fused_add_rmsnorm(x, r, w)
        return buf
    from torch._dynamo.testing import CompileCounterWithBackend
    torch._dynamo.reset()
    counter = CompileCounterWithBackend("aot_eager")
    halves_compiled = torch.compile(halves, backend=counter, fullgraph=True, dynamic=True)
    for tokens in (2, 3, 7):
        buf, w = torch.randn(tokens, 2 * N), torch.randn(N)
        assert_close(halves_compiled(buf.clone(), w), halves(buf.clone(), w))
    assert counter.frame_count == 1  # the check reads size hints, so it guards on no token count


# --- weight=None ------------------------------------------------------------------------------------


def test_the_unweighted_ops_are_rmsnorm_and_fused_add_rmsnorm():
    assert UNWEIGHTED == ["rmsnorm", "fused_add_rmsnorm"]


def _no_weight_cases(device):
    cases = [((1, 1), None), ((7, 1000), None), ((2, 3, 257), None), ((0, 64), None), ((5, 96), 160),
             ((2, 20000), None)]
    return cases + ([((4096, 8192), None), ((33, 7168), 8192)] if device == "cuda" else [])


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES + [torch.float64], ids=str)
@pytest.mark.parametrize("op", UNWEIGHTED)
def test_no_weight_is_a_weight_of_ones(op, dtype, device):
    """Bit for bit, on every backend here (the registered op, the reference, Triton interpreted on the
    CPU; on CUDA each backend as dispatched), NaN and Inf included."""
    for shape, stride in _no_weight_cases(device):
        ones = torch.ones(shape[-1], dtype=dtype, device=device)
        x = _rows(shape, stride, dtype, device)
        if x.numel() > 2:
            x.view(-1, shape[-1])[0, :2] = torch.tensor([float("nan"), float("inf")])
        for name, fn in _backends(op, device):
            if dtype == torch.float64 and name not in ("registered", "torch"):
                continue
            if op in NORM:
                got, want = fn(x, None, 1e-5), fn(x, ones, 1e-5)
                assert got.dtype == dtype and got.shape == x.shape
                assert torch.equal(got.isnan(), want.isnan()), f"{name} {shape}"
                assert torch.equal(got.nan_to_num(), want.nan_to_num()), f"{name} {shape}"
            else:
                res = _rows(shape, stride, dtype, device)
                xa, ra, xb, rb = x.clone(), res.clone(), x.clone(), res.clone()
                if stride is not None:
                    xa, ra, xb, rb = (_restride(t, stride) for t in (xa, ra, xb, rb))
                assert fn(xa, ra, None, 1e-5) is None
                fn(xb, rb, ones, 1e-5)
                for got, want in ((xa, xb), (ra, rb)):
                    assert torch.equal(got.isnan(), want.isnan()), f"{name} {shape}"
                    assert torch.equal(got.nan_to_num(), want.nan_to_num()), f"{name} {shape}"


def test_no_weight_gradient_is_the_gradient_with_ones():
    x = torch.randn(3, 40, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda x: torch.ops.deepinfer.rmsnorm(x, None, 1e-6), (x,))
    g = torch.randn(3, 40, dtype=torch.float64)
    (dx,) = torch.autograd.grad(torch.ops.deepinfer.rmsnorm(x, None, 1e-6), x, g)
    (want,) = torch.autograd.grad(torch.ops.deepinfer.rmsnorm(x, torch.ones(40, dtype=torch.float64), 1e-6), x, g)
    assert torch.allclose(dx, want, rtol=1e-12, atol=0)


@pytest.mark.parametrize("op", [op for op in family_ops("norm") if op not in UNWEIGHTED])
def test_the_other_norms_require_a_weight(op):
    """Gemma's weight is an offset from one, and the FP8 norms keep theirs: None names the argument."""
    x = torch.randn(4, 64)
    args = (x, x.clone(), None) if "fused" in op else (x, None)
    for call in (getattr(torch.ops.deepinfer, op).default, getattr(torch_kernels, op)):
        with pytest.raises(TypeError, match=rf"^deepinfer::{op}: argument 'weight' must be a Tensor, got NoneType"):
            call(*args, 1e-6)


@pytest.mark.parametrize("op", UNWEIGHTED)
def test_no_weight_bad_input_still_names_the_argument(op):
    fused = op in FUSED
    call = getattr(torch.ops.deepinfer, op).default
    x = torch.randn(4, 64)
    tail = (None, 1e-6)
    for args, name, err in (((torch.randn(4, 0),) + ((torch.randn(4, 0),) if fused else ()), "input", ValueError),
                            ((torch.randn(4, 64).t(),) + ((torch.randn(64, 4),) if fused else ()), "input", ValueError),
                            ((x.int(),) + ((x.int(),) if fused else ()), "input", TypeError)):
        with pytest.raises(err, match=rf"^deepinfer::{op}: argument '{name}'"):
            call(*args, *tail)
    with pytest.raises(ValueError, match=rf"^deepinfer::{op}: argument 'eps'"):
        call(*((x, x.clone()) if fused else (x,)), None, -1.0)
    if fused:
        with pytest.raises(ValueError, match=rf"^deepinfer::{op}: argument 'residual'"):
            call(x, x, None, 1e-6)
        buf = torch.randn(4, 96)
        with pytest.raises(ValueError, match=rf"^deepinfer::{op}: argument '(input|residual)'"):
            call(buf[:, :64], buf[:, 32:], None, 1e-6)  # overlapping columns
        xa, ra = torch.randn(4, 64), torch.randn(4, 32)
        with pytest.raises(ValueError, match=rf"^deepinfer::{op}: argument 'residual'"):
            call(xa, ra, None, 1e-6)


@pytest.mark.parametrize("op", UNWEIGHTED)
def test_no_weight_tilelang_and_flashinfer_take_a_cached_weight_of_ones(op, monkeypatch):
    """The kernels of both read a weight: they get ones in the input's dtype, one tensor per
    (device, dtype, hidden size); the launchers' argument mapping, checked without a GPU."""
    from torch_kernels.families.norm import tilelang as tl_norm, unit_weight

    seen = []

    def host(*args):
        seen.append(args)
    monkeypatch.setattr(tl_norm, "_function", lambda *a: (host, 8))
    fused = op in FUSED
    for dtype in (torch.bfloat16, torch.float32):
        x = torch.randn(3, 96, dtype=dtype)
        args = (x, x.clone()) if fused else (x,)
        for _ in range(2):
            getattr(tl_norm, op)(*args, None, 1e-6)
        w = seen[-1][2 if fused else 1]
        assert w.dtype == dtype and w.shape == (96,) and torch.equal(w, torch.ones(96, dtype=dtype))
        assert seen[-2][2 if fused else 1] is w  # cached
        assert unit_weight.ones_like_row(x) is w


@pytest.mark.parametrize("op", UNWEIGHTED)
def test_no_weight_compiles_to_one_node_without_recompiling(op):
    """weight=None traced (aot_eager, unbacked token count): one node, one graph for 3, 1, 0 and 300 tokens."""
    from torch._dynamo.testing import CompileCounterWithBackend

    torch._dynamo.reset()
    counter = CompileCounterWithBackend("aot_eager")
    fn = getattr(torch.ops.deepinfer, op).default
    fused = op in FUSED

    def block(x, *r):
        if fused:
            fn(x, r[0], None, 1e-6)
            return x + 0, r[0] + 0
        return fn(x, None, 1e-6) + 0

    compiled = torch.compile(block, backend=counter, fullgraph=True)
    for t in (3, 1, 0, 300):
        args = [torch.randn(t, 96) for _ in range(2 if fused else 1)]
        want = block(*(a.clone() for a in args))
        for a in args:
            torch._dynamo.decorators.mark_unbacked(a, 0)
        got = compiled(*args)
        for g, w in zip(got if fused else (got,), want if fused else (want,)):
            assert torch.equal(g, w)
    assert counter.frame_count == 1
    calls = [n for g in counter.graphs for n in g.graph.nodes if "deepinfer" in str(n.target)]
    assert len(calls) == 1, calls


@pytest.mark.parametrize("op", UNWEIGHTED)
def test_no_weight_decomposed_by_inductor_on_cpu_is_the_eager_op(op):
    """The decompose route (the reference traced by Inductor) takes weight=None too."""
    fn = getattr(torch.ops.deepinfer, op).default
    fused = op in FUSED
    x, r = torch.randn(7, 257), torch.randn(7, 257)
    if fused:
        block = lambda x, r: (fn(x, r, None, 1e-6), x * 1, r * 1)[1:]  # noqa: E731
    else:
        block = lambda x: fn(x * 2, None, 1e-6) + 1  # noqa: E731
    torch._dynamo.reset()
    previous = torch_kernels.configure(compile_route={op: "decompose"})
    try:
        args = (x, r) if fused else (x,)
        got = torch.compile(block, fullgraph=True)(*(a.clone() for a in args))
        want = block(*(a.clone() for a in args))
    finally:
        torch_kernels.configure(previous)
        torch._dynamo.reset()
    for g, w in zip(got if fused else (got,), want if fused else (want,)):
        assert_close(g, w)
