"""Numerics of the gated activations: the reference against an independent fp64 formula, and every
backend against the reference, over dtypes and awkward shapes (Triton in its interpreter on CPU)."""

import inspect
import math
from dataclasses import replace

import pytest
import torch

from torch_kernels import dispatch, ops, registry
from torch_kernels.families.activation import ops as activation_ops
from torch_kernels.spec import Backend
from torch_kernels.testing import assert_close

from conftest import DEVICES, assert_bad_inputs_raise, family_ops, implementations_on, triton_here

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
# (input shape, row stride or None): d = 1, one token, d not a power of two (masked column tail),
# d a multiple of the tile (no masks), several rows a program (d < tile) with and without a row
# tail, 3-D, one 1-D row, zero tokens, strided rows.
SHAPES = [((1, 2), None), ((1, 8192), None), ((7, 2000), None), ((3, 5000), None), ((2, 4096), None),
          ((7, 200), None), ((16, 128), None), ((2, 3, 514), None), ((10,), None), ((0, 128), None),
          ((5, 192), 256)]
GPU_SHAPES = [((8192, 2 * 14336), None), ((33, 2 * 7168), 2 * 8192), ((4097, 2 * 4864), None)]


def activation_cases(backend=None, every_approximation=True):
    """(op, approximate argument or None) for each activation op (that ``backend`` implements): each
    approximation its sample arguments pass, or only its default (the schema's)."""
    out = []
    for op in family_ops("activation", backend):
        if op.endswith("_fp8_quant"):  # tests/test_fp8_epilogues.py
            continue
        opdef = ops.BY_NAME[op]
        seen = dict.fromkeys(args[1] if len(args) > 1 else None for args in opdef.samples("cpu", torch.float32))
        default = inspect.signature(opdef.wrapper).parameters.get("approximate")
        out += [(op, a) for a in seen if every_approximation or a is None or a == default.default]
    return out


CASES = activation_cases()
# the op without "_and_mul" and the approximation (silu, gelu_none, gelu_tanh); the op's name where that is taken
_SHORT = [op.removesuffix("_and_mul") + ("" if a is None else f"_{a}") for op, a in CASES]
CASE_IDS = [short if a is not None or _SHORT.count(short) == 1 else op for short, (op, a) in zip(_SHORT, CASES)]


def _rows(shape, stride, dtype, device, scale=2.0):
    if stride is None:
        return torch.randn(shape, dtype=dtype, device=device) * scale
    return (torch.randn(*shape[:-1], stride, dtype=dtype, device=device) * scale)[..., :shape[-1]]


def _args(op, approximate, x):
    return (x,) if approximate is None else (x, approximate)


def _formula(x, op, approximate):
    """The definition in fp64, written independently of the reference."""
    x64 = x.double()
    d = x.shape[-1] // 2
    g, u = x64[..., :d], x64[..., d:]
    if op == "silu_and_mul":
        act = g / (1.0 + torch.exp(-g))
    elif op == "gelu_and_mul" and approximate == "none":
        act = 0.5 * g * (1.0 + torch.special.erf(g / math.sqrt(2.0)))
    else:
        act = 0.5 * g * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (g + 0.044715 * g ** 3)))
    return act * u


_backends = implementations_on


def _reference(op):
    return registry.BY_OP[op][Backend.TORCH].load()


@pytest.mark.parametrize("dtype", DTYPES + [torch.float64], ids=str)
@pytest.mark.parametrize("shape,stride", SHAPES, ids=str)
@pytest.mark.parametrize("op,approximate", CASES, ids=CASE_IDS)
def test_reference_matches_fp64_formula(op, approximate, shape, stride, dtype):
    x = _rows(shape, stride, dtype, "cpu")
    out = _reference(op)(*_args(op, approximate, x))
    assert out.shape == (*shape[:-1], shape[-1] // 2) and out.dtype == dtype and out.is_contiguous()
    assert_close(out, _formula(x, op, approximate).to(dtype))


def _check_backends(op, approximate, device, dtype, x):
    want = _reference(op)(*_args(op, approximate, x))
    for name, fn in _backends(op, device):
        before = x.clone()
        got = fn(*_args(op, approximate, x))
        assert got.shape == want.shape and got.dtype == want.dtype and got.is_contiguous(), name
        assert_close(got, want, msg=f"backend {name} {tuple(x.shape)} {x.stride()}")
        assert torch.equal(x.nan_to_num(), before.nan_to_num()), f"{name} clobbered its input"


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("op,approximate", CASES, ids=CASE_IDS)
def test_backends_match_reference(op, approximate, dtype, device):
    for shape, stride in SHAPES + (GPU_SHAPES if device == "cuda" else []):
        _check_backends(op, approximate, device, dtype, _rows(shape, stride, dtype, device))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("op,approximate", CASES, ids=CASE_IDS)
def test_backends_non_collapsible_and_permuted_rows(op, approximate, device):
    """Leading dims that are not one stride (a slice in the middle dim), and permuted leading dims."""
    sliced = torch.randn(3, 4, 300, device=device)[:, 1:3, :200]
    permuted = torch.randn(4, 3, 66, device=device).transpose(0, 1)
    for x in (sliced, permuted):
        _check_backends(op, approximate, device, torch.float32, x)


@pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")  # the interpreter's numpy, on purpose
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("op,approximate", CASES, ids=CASE_IDS)
def test_backends_large_values_and_nonfinite(op, approximate, device):
    # fp16 products overflow above 65504: computed in fp32, they round to inf as the reference's do.
    _check_backends(op, approximate, device, torch.float16, _rows((4, 600), None, torch.float16, device, scale=300.0))
    # extreme gates: the activations' tails (sigmoid of +-100, erf and tanh saturated)
    x = _rows((3, 40), None, torch.float32, device)
    x[:, :20] = torch.linspace(-100, 100, 20, device=device)
    _check_backends(op, approximate, device, torch.float32, x)
    # NaN and Inf in the gate and in the up half propagate as in the reference
    for poison in (float("nan"), float("inf"), float("-inf")):
        x = _rows((3, 40), None, torch.float32, device)
        x[0, 3] = poison
        x[1, 25] = poison
        # its gate kept moderate: below about -5.5 the gelu rounds to 0 in some backends and not in
        # others, and 0 * inf is NaN where tiny * inf is inf
        x[1, 5] = 0.75
        _check_backends(op, approximate, device, torch.float32, x)


@pytest.mark.parametrize("device", DEVICES)
def test_gelu_tanh_and_mul_is_gelu_and_mul_tanh(device):
    x = torch.randn(5, 300, device=device)
    tanh = dict(_backends("gelu_tanh_and_mul", device))
    for name, fn in _backends("gelu_and_mul", device):
        assert torch.equal(fn(x, "tanh"), tanh[name](x)), name



@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("flat", [True, False], ids=["flat-grid", "2d-grid"])
def test_triton_program_orders_and_split_launches(flat, device, monkeypatch):
    """Both program orders, with the default tiles and with launches split where the grid would
    pass CUDA's limits (shrunk here to 3 programs on axis 0, 2 on axis 1)."""
    triton_activation = triton_here("activation", device)
    Config = triton_activation.TritonActivationConfig
    for act, op, approximate in [("silu", "silu_and_mul", None), ("gelu", "gelu_and_mul", "none"),
                                 ("gelu_tanh", "gelu_tanh_and_mul", None)]:
        x = _rows((7, 600), 640, torch.float32, device)
        want = _reference(op)(*_args(op, approximate, x))
        out = torch.full_like(want, float("nan"))
        triton_activation.launch(x, out, act, replace(Config.for_shape(300), flat=flat))
        assert_close(out, want, msg=f"{act} default tiles")
        with monkeypatch.context() as m:
            m.setattr(triton_activation, "_MAX_GRID_0", 3)
            m.setattr(triton_activation, "_MAX_GRID_1", 2)
            for block_m, block_n in [(1, 32), (2, 64), (4, 16)]:
                out = torch.full_like(want, float("nan"))
                triton_activation.launch(x, out, act, Config(block_m, block_n, 1, flat))
                assert_close(out, want, msg=f"{act} split launches, tile {block_m}x{block_n}")


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("op,approximate", CASES, ids=CASE_IDS)
def test_triton_other_configs_match_reference(op, approximate, device):
    """The entry points under launches other than the heuristic's: tiles of several rows, a row in
    several column blocks, other warp counts, the 2-D grid; fp32 and bf16, strided rows."""
    triton_activation = triton_here("activation", device)
    Config = triton_activation.TritonActivationConfig
    fn = getattr(triton_activation, op)
    for dtype in (torch.float32, torch.bfloat16):
        for shape, stride in (((7, 600), 640), ((5, 128), None)):
            x = _rows(shape, stride, dtype, device)
            want = _reference(op)(*_args(op, approximate, x))
            for config in (Config(4, 16, 1), Config(1, 32, 2, flat=False), Config(8, 128, 4), Config(2, 64, 1)):
                assert_close(fn(*_args(op, approximate, x), config=config), want, msg=f"{dtype} {config}")


def test_triton_heuristic_picks_the_measured_tiles():
    """1024 outputs a program over 4 warps (8 a thread): the row up to 1024 columns, several rows of a
    shorter one; one warp at least, so shorter tiles keep 32 threads."""
    Config = triton_here("activation", "cpu").TritonActivationConfig
    assert Config.for_shape(14336) == Config(1, 1024, 4, True)
    assert Config.for_shape(1024) == Config(1, 1024, 4, True)
    assert Config.for_shape(1000) == Config(1, 1024, 4, True)
    assert Config.for_shape(300) == Config(2, 512, 4, True)
    assert Config.for_shape(64) == Config(16, 64, 4, True)
    assert Config.for_shape(1) == Config(1024, 1, 4, True)
    assert Config.for_shape(14336, tile=2048, per_thread=16) == Config(1, 2048, 4, True)  # the sweep's


@pytest.mark.gpu
def test_triton_int64_offsets_past_2_31_elements():
    """An input of more than 2^31 elements: the last rows are right (int32 offsets would wrap)."""
    from torch_kernels.families.activation import triton as triton_activation
    x = torch.randn(75000, 2 * 14336, device="cuda", dtype=torch.bfloat16)
    assert x.numel() > 2**31
    out = triton_activation.silu_and_mul(x)
    assert_close(out[-5:], _reference("silu_and_mul")(x[-5:]))
    assert_close(out[:5], _reference("silu_and_mul")(x[:5]))


@pytest.mark.gpu
@pytest.mark.parametrize("act", ["silu", "gelu_tanh"])
@pytest.mark.parametrize("d,dtype", [(14336, torch.bfloat16), (14336, torch.float16), (7168, torch.float32)], ids=str)
def test_tilelang_row_loop_is_the_tiles_bit_for_bit(act, d, dtype):
    """Around the L2's size TileLang takes its row loop (``row_loop_tokens``): the tile kernel's bits, at
    the range's ends and beside them, first through Python, then served by the C++ entry."""
    from torch_kernels.families.activation import tilelang as tl
    rows = tl.row_loop_tokens(d, dtype, act, torch.device("cuda"))
    assert rows, f"no row-loop range for {d} {dtype} on this GPU"
    op = getattr(torch.ops.deepinfer, f"{act}_and_mul").default
    tiles = tl._function(d, dtype, act)[0]
    previous = dispatch.configure(backend="tilelang", strict=True)
    try:
        for tokens in (rows.start - 1, rows.start, rows.stop - 1, rows.stop) * 2:
            x = torch.randn(tokens, 2 * d, device="cuda", dtype=dtype) * 3
            want = torch.empty(tokens, d, device="cuda", dtype=dtype)
            tiles(x, want)
            assert torch.equal(op(x), want), tokens
            assert_close(want, _reference(f"{act}_and_mul")(x))
    finally:
        dispatch.configure(previous)


@pytest.mark.gpu
@pytest.mark.parametrize("op,approximate", CASES, ids=CASE_IDS)
def test_matches_flashinfer(op, approximate):
    """FlashInfer's kernels, where installed, agree with our semantics (one rounding off at most)."""
    activation = pytest.importorskip("flashinfer.activation")
    fi_name = "gelu_tanh_and_mul" if approximate == "tanh" else op
    x = torch.randn(37, 2 * 1536, device="cuda", dtype=torch.bfloat16) * 2
    got = getattr(torch.ops.deepinfer, op).default(*_args(op, approximate, x))
    assert_close(got, getattr(activation, fi_name)(x))


def test_zero_tokens_and_leading_dims():
    for x in (torch.randn(0, 64), torch.randn(2, 0, 64), torch.randn(64)):
        for op, approximate in CASES:
            out = getattr(torch.ops.deepinfer, op).default(*_args(op, approximate, x))
            assert out.shape == (*x.shape[:-1], 32)


def test_wrappers_call_the_ops():
    x = torch.randn(3, 64)
    assert torch.equal(activation_ops.silu_and_mul(x), torch.ops.deepinfer.silu_and_mul(x))
    assert torch.equal(activation_ops.gelu_and_mul(x), torch.ops.deepinfer.gelu_and_mul(x, "none"))
    assert torch.equal(activation_ops.gelu_and_mul(x, "tanh"), torch.ops.deepinfer.gelu_tanh_and_mul(x))


@pytest.mark.parametrize("op,approximate", CASES, ids=CASE_IDS)
def test_refuses_autograd(op, approximate):
    x = torch.randn(2, 8, requires_grad=True)
    with pytest.raises(RuntimeError, match=rf"deepinfer::{op} does not support autograd"):
        getattr(torch.ops.deepinfer, op).default(*_args(op, approximate, x))
    with torch.no_grad():
        assert getattr(torch.ops.deepinfer, op).default(*_args(op, approximate, x)).shape == (2, 4)


# --- bad input -----------------------------------------------------------------------------------

def _bad_cases(op, approximate, device):
    cases = [
        ("odd last dim", torch.randn(4, 63, device=device), ValueError, "input"),
        ("integer input", torch.ones(4, 64, dtype=torch.int32, device=device), TypeError, "input"),
        ("boolean input", torch.ones(4, 64, dtype=torch.bool, device=device), TypeError, "input"),
        ("non-contiguous last dim", torch.randn(64, 4, device=device).t(), ValueError, "input"),
        ("0-d input", torch.tensor(1.0, device=device), ValueError, "input"),
        ("zero last dim", torch.randn(4, 0, device=device), ValueError, "input"),
    ]
    out = [(what, _args(op, approximate, x), exc, arg) for what, x, exc, arg in cases]
    if op == "gelu_and_mul":
        x = torch.randn(4, 64, device=device)
        out += [("unknown approximation", (x, "exact"), ValueError, "approximate"),
                ("approximation in capitals", (x, "Tanh"), ValueError, "approximate")]
    return out


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("op,approximate", CASES, ids=CASE_IDS)
def test_bad_input_names_the_op_and_the_argument(op, approximate, device):
    assert_bad_inputs_raise(op, _bad_cases(op, approximate, device))


def test_bad_input_raises_at_trace_time():
    compiled = torch.compile(lambda x: torch.ops.deepinfer.silu_and_mul(x), backend="eager", fullgraph=True)
    with pytest.raises(Exception, match=r"deepinfer::silu_and_mul: argument 'input' must have an even last dimension"):
        compiled(torch.randn(4, 63))
