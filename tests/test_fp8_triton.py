"""The Triton kernels of the FP8 ops: ``scaled_fp8_quant`` (``families/quant/triton.py``), the norms with
an FP8 epilogue (``families/norm/triton.py``) and ``silu_and_mul_fp8_quant`` (``families/activation/
triton.py``), on the epilogue of ``backends/triton_fp8.py``.

* each fused op returns, bit for bit, Triton's unfused pair (the norm or ``silu_and_mul``, then
  ``scaled_fp8_quant`` or ``per_token_group_quant_fp8``), under every launch its norm can take: the
  few-token one, the 4096-token one (fused ops in chunks, rmsnorm reading its row twice), small chunks
  (several, masked, narrower than a group), one pass padded; residual included, input left as it was;
* ``scaled_fp8_quant`` equals the reference bit for bit (both divisions IEEE, ``q = x * (1 / scale)``),
  and each fused op's ``(q, scales)`` equal the reference epilogue on its own unquantised value (exactly
  per token and static, one e4m3 step per group: the reference divides);
* non-finite input, a static scale that is not positive and finite (NaN q, no host sync), zero tokens,
  leading dims that do not collapse, the per-tensor amax across many programs, int64 row offsets;
* the invariant behind the bit contract on the GPU: compiled for sm_90, the fused norm reduces its sum
  of squares over the layout the norm does (Triton's coalescing would otherwise widen the row loads to
  the fp8 store's vector, and the sum would round differently).

On CPU in Triton's interpreter (``conftest.triton_here``); ``@pytest.mark.gpu`` at larger shapes.
"""

import os
import subprocess
import sys

import pytest
import torch

from torch_kernels import fp8

from conftest import DEVICES, triton_here

FP8 = fp8.FP8
DTYPES = [torch.bfloat16, torch.float16, torch.float32]
NORM_OPS = ["rmsnorm_fp8_quant", "fused_add_rmsnorm_fp8_quant", "gemma_rmsnorm_fp8_quant",
            "gemma_fused_add_rmsnorm_fp8_quant"]
#: (scale kind, group_size, column_major_scales, scale_ue8m0)
MODES = [("static", -1, False, False), (None, -1, False, False), (None, 128, False, False), (None, 128, True, False),
         (None, 64, True, True), (None, 64, False, True)]
#: (leading dims, hidden size of the unquantised output, row stride or None): one token, 3 groups, 3-D, zero
#: tokens, strided rows, a size that is no multiple of a vector (per token and static only), rows wider than
#: the one-pass limit (16384)
SHAPES = [((1,), 128, None), ((5,), 384, None), ((2, 3), 256, None), ((0,), 128, None), ((7,), 192, 320),
          ((3,), 100, None), ((2,), 20480, None)]
GPU_SHAPES = [((4096,), 4096, None), ((8192,), 7168, None), ((33,), 7168, 8192), ((1,), 65536, None),
              ((4099,), 5120, None), ((3, 700), 2048, None)]


def _shapes(device):
    return SHAPES + (GPU_SHAPES if device == "cuda" else [])


def _rows(lead, n, stride, dtype, device, scale=1.0):
    """Fresh random rows, last dim contiguous; strided when ``stride`` is given."""
    return (torch.randn(*lead, stride or n, device=device) * scale).to(dtype)[..., :n]


def _modes_for(n, device="cpu", dtype=torch.bfloat16):
    """The modes whose groups divide ``n``; on the GPU, where each is a kernel to compile, all for bf16
    and static, per token and column-major groups of 128 for the other dtypes."""
    modes = MODES if device == "cpu" or dtype == torch.bfloat16 else [MODES[0], MODES[1], MODES[3]]
    return [m for m in modes if m[1] == -1 or n % m[1] == 0]


#: the width whose rows the launches other than the heuristic's are tried on: 3 groups of 128, 6 chunks of 64
OTHER_LAUNCHES_WIDTH = 384


def _quant(mode, device):
    kind, group, column_major, ue8m0 = mode
    # a normalised row's largest values (about 4 with randn weights) land near 448, a few beyond (saturated)
    scale = torch.full((1,), 0.008, device=device) if kind == "static" else None
    return scale, group, column_major, ue8m0


def _bits(t):
    return t.view(torch.uint8) if t.dtype == FP8 else t.contiguous().view(torch.uint8) if t.numel() else t


def _assert_bits(got, want, what):
    assert len(got) == len(want), what
    for i, (g, w) in enumerate(zip(got, want)):
        assert (g.dtype, g.shape) == (w.dtype, w.shape), \
            f"{what}: output {i}: {g.dtype} {tuple(g.shape)} vs {w.dtype} {tuple(w.shape)}"
        assert g.stride() == w.stride() or g.numel() <= 1, f"{what}: output {i}: strides {g.stride()} vs {w.stride()}"
        differ = int((_bits(g) != _bits(w)).sum()) if g.numel() else 0
        assert differ == 0, f"{what}: output {i}: {differ} bytes differ from the unfused pair's"


def _unfused_quant(tq, y, scale, group, column_major, ue8m0):
    """Triton's quant op of the epilogue's mode on ``y``."""
    if scale is not None:
        return list(tq.scaled_fp8_quant(y, scale))
    if group == -1:
        return list(tq.scaled_fp8_quant(y, None, True))
    return list(tq.per_token_group_quant_fp8(y, group, fp8.GROUP_EPS, column_major, ue8m0))


def _assert_epilogue(got, y, scale, group, column_major, ue8m0, what):
    """``(q, scales)`` are the reference epilogue of ``y``: exactly, or one e4m3 step for groups (the
    kernels multiply by ``1 / scale`` where the reference divides)."""
    try:
        fp8.assert_quantized(got[:2], fp8.quantize(y, scale, group, column_major, ue8m0), 0 if group == -1 else 1)
    except AssertionError as e:
        raise AssertionError(f"{what}: {e}") from None


# ----------------------------------------------------------------------------------------------
# The norms


def _norm_configs(tn, op, n):
    """The launches to check ``op`` under: the heuristic's, the 4096-token one, chunks of 64 (several,
    masked, narrower than a group of 128) over 2 warps, one pass padded past the row and read twice."""
    fused = "fused_add" in op
    return {"heuristic": None, "4096 tokens": tn.TritonNormConfig.for_shape(4096, n, fused),
            "chunks of 64": tn.TritonNormConfig(64, False, False, 2),
            "one pass padded": tn.TritonNormConfig(1 << (2 * n - 1).bit_length(), True, True, 4)}


def _norm_case(tn, tq, op, args, config):
    """(fused outputs, unfused outputs, the unquantised value): q, scales (and the residual)."""
    kw = {} if config is None else {"config": config}
    base = getattr(tn, op.removesuffix("_fp8_quant"))
    quant = args[-4:]
    if "fused_add" in op:
        x, residual, w, eps = args[:4]
        x_before, r_fused, r_unfused, y = x.clone(), residual.clone(), residual.clone(), x.clone()
        got = list(getattr(tn, op)(x, r_fused, w, eps, *quant, **kw)) + [r_fused]
        assert torch.equal(_bits(x), _bits(x_before)), f"{op}: 'input' was written"
        base(y, r_unfused, w, eps, **kw)
        return got, _unfused_quant(tq, y, *quant) + [r_unfused], y
    y = base(*args[:3], **kw)
    return list(getattr(tn, op)(*args, **kw)), _unfused_quant(tq, y, *quant), y


def _norm_args(op, lead, n, stride, dtype, device, mode, scale=1.0):
    w = torch.randn(n, device=device).to(dtype)
    x = _rows(lead, n, stride, dtype, device, scale)
    if "fused_add" in op:
        return (x, _rows(lead, n, stride, dtype, device, scale), w, 1e-5, *_quant(mode, device))
    return (x, w, 1e-6, *_quant(mode, device))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("op", NORM_OPS)
def test_fused_norm_is_the_triton_norm_then_the_triton_quant(op, dtype, device):
    tn, tq = triton_here("norm", device), triton_here("quant", device)
    for lead, n, stride in _shapes(device):
        for name, config in _norm_configs(tn, op, n).items():
            if name in ("chunks of 64", "one pass padded") and n != OTHER_LAUNCHES_WIDTH:
                continue  # a kernel each to compile (or to interpret): tried on one width
            for mode in _modes_for(n, device, dtype):
                args = _norm_args(op, lead, n, stride, dtype, device, mode)
                got, want, y = _norm_case(tn, tq, op, args, config)
                what = f"{op} {lead}x{n} stride {stride} {dtype} {name} mode {mode}"
                _assert_bits(got, want, what)
                _assert_epilogue(got, y, *args[-4:], what)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("op", NORM_OPS)
def test_fused_norm_nonfinite_and_large_values(op, device):
    """NaN and infinities in a row, a row of fp16 values whose squares overflow fp16: NaN where the pair
    has NaN (the same bytes), under the few-token launch and the 4096-token one."""
    tn, tq = triton_here("norm", device), triton_here("quant", device)
    for dtype in (torch.float16, torch.float32):
        for mode in (MODES[0], MODES[1], MODES[4]):
            for config in (None, tn.TritonNormConfig.for_shape(4096, 512, "fused_add" in op)):
                args = _norm_args(op, (6,), 512, None, dtype, device, mode)
                x = args[0]
                x[1, 5], x[2, 0], x[3, 300] = float("nan"), float("inf"), -float("inf")
                x[4].mul_(300.0)
                got, want, y = _norm_case(tn, tq, op, args, config)
                _assert_bits(got, want, f"{op} {dtype} non-finite, mode {mode}, {config}")
                assert got[0][1].float().isnan().all(), "a NaN makes its row NaN"


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("op", NORM_OPS)
def test_fused_norm_non_collapsible_leading_dims(op, device):
    """Rows whose leading dims are not one stride (a slice of the middle dim): read through a copy, the
    residual written back in place and nowhere else."""
    tn, tq = triton_here("norm", device), triton_here("quant", device)
    base_x, base_r = torch.randn(3, 4, 320, device=device), torch.randn(3, 4, 320, device=device)
    for mode in _modes_for(256):
        args = list(_norm_args(op, (3, 2), 256, None, torch.float32, device, mode))
        args[0] = base_x[:, 1:3, :256]
        if "fused_add" in op:
            r = base_r.clone()
            args[1] = r[:, 1:3, :256]
        got, want, _ = _norm_case(tn, tq, op, tuple(args), None)
        _assert_bits(got, want, f"{op} non-collapsible, mode {mode}")
        if "fused_add" in op:
            assert torch.equal(r[:, 0], base_r[:, 0]) and torch.equal(r[:, 3], base_r[:, 3]), "wrote outside the view"


# ----------------------------------------------------------------------------------------------
# silu_and_mul_fp8_quant


def _act_configs(ta):
    """The heuristic's launch; two rows of 256 a program; 64-wide tiles over one warp (per token: rows
    in chunks of 64, two passes)."""
    return {"heuristic": None, "2 x 256": ta.TritonActivationConfig(2, 256, 2), "1 x 64": ta.TritonActivationConfig(1, 64, 1)}


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_silu_and_mul_fp8_quant_is_triton_silu_and_mul_then_the_triton_quant(dtype, device):
    ta, tq = triton_here("activation", device), triton_here("quant", device)
    for lead, d, stride in _shapes(device) + [((), 48, None)]:
        for name, config in _act_configs(ta).items():
            if config is not None and d != OTHER_LAUNCHES_WIDTH:
                continue  # a kernel each to compile (or to interpret): tried on one width
            for mode in _modes_for(d, device, dtype):
                if config is not None and mode[1] > config.block_n:
                    continue  # a tile holds whole groups
                x = _rows(lead, 2 * d, stride and 2 * stride, dtype, device, 2.0)
                before = x.clone()
                scale, group, column_major, ue8m0 = _quant(mode, device)
                got = list(ta.silu_and_mul_fp8_quant(x, scale, group, column_major, ue8m0,
                                                     **({} if config is None else {"config": config})))
                y = ta.silu_and_mul(x)
                what = f"silu_and_mul_fp8_quant {lead}x2*{d} stride {stride} {dtype} {name} mode {mode}"
                _assert_bits(got, _unfused_quant(tq, y, scale, group, column_major, ue8m0), what)
                _assert_epilogue(got, y, scale, group, column_major, ue8m0, what)
                assert torch.equal(_bits(x), _bits(before)), f"{what}: input written"


@pytest.mark.parametrize("device", DEVICES)
def test_silu_and_mul_fp8_quant_nonfinite(device):
    ta, tq = triton_here("activation", device), triton_here("quant", device)
    for mode in MODES:
        x = _rows((6,), 1024, None, torch.bfloat16, device, 2.0)
        x[1, 5], x[2, 600], x[3, 100], x[4, 0] = float("nan"), float("nan"), float("inf"), -float("inf")
        scale, group, column_major, ue8m0 = _quant(mode, device)
        got = list(ta.silu_and_mul_fp8_quant(x, scale, group, column_major, ue8m0))
        _assert_bits(got, _unfused_quant(tq, ta.silu_and_mul(x), scale, group, column_major, ue8m0),
                     f"non-finite, mode {mode}")


# ----------------------------------------------------------------------------------------------
# scaled_fp8_quant

#: (scale kind, per_token, scale_ub)
SCALED_MODES = [("static", False, None), (None, False, None), (None, True, None), (None, True, 3.0)]


def _scaled_args(lead, n, stride, dtype, device, mode):
    kind, per_token, ub = mode
    scale = torch.rand((1,), device=device) * 0.02 + 0.01 if kind == "static" else None
    return (_rows(lead, n, stride, dtype, device, 4.0), scale, per_token,
            None if ub is None else torch.full((1,), ub, device=device))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_scaled_fp8_quant_equals_the_reference_bit_for_bit(dtype, device):
    """Every mode, under the heuristic's launch, rows of 64 in chunks over one warp (per token: two
    passes; per tensor: many programs a row), and blocks of 4 rows."""
    tq = triton_here("quant", device)
    configs = {"heuristic": None, "1 x 64": tq.TritonScaledQuantConfig(1, 64, 1), "4 x 32": tq.TritonScaledQuantConfig(4, 32, 2)}
    for lead, n, stride in _shapes(device):
        for mode in SCALED_MODES:
            for name, config in configs.items():
                if config is not None and n != OTHER_LAUNCHES_WIDTH:
                    continue  # a kernel each to compile (or to interpret): tried on one width
                args = _scaled_args(lead, n, stride, dtype, device, mode)
                got = tq.scaled_fp8_quant(*args, **({} if config is None else {"config": config}))
                try:
                    fp8.assert_quantized(list(got), list(fp8.quantize_static(args[0], args[1]) if args[1] is not None
                                                         else fp8.quantize_per_token(args[0], args[3]) if args[2]
                                                         else fp8.quantize_per_tensor(args[0])), 0)
                except AssertionError as e:
                    raise AssertionError(f"{lead}x{n} stride {stride} {dtype} mode {mode} {name}: {e}") from None
                assert got[0].is_contiguous()


@pytest.mark.parametrize("device", DEVICES)
def test_scaled_fp8_quant_nonfinite_and_non_collapsible(device):
    """NaN makes the tensor's (per tensor) or the row's (per token) scale and q NaN; an infinity gives
    an infinite scale, zeros and NaN; rows whose leading dims do not collapse."""
    tq = triton_here("quant", device)
    x = _rows((4,), 300, None, torch.float32, device, 4.0)
    x[1, 7], x[2, 0] = float("nan"), float("inf")
    q, s = tq.scaled_fp8_quant(x, None, True)
    assert s[1].isnan().all() and q[1].float().isnan().all() and s[2].isinf().all()
    assert (q[2, 1:].float() == 0).all() and q[2, 0].float().isnan() and s[[0, 3]].isfinite().all()
    fp8.assert_quantized([q, s], fp8.quantize_per_token(x), 0)
    q, s = tq.scaled_fp8_quant(x, None, False)
    assert s.isnan().all() and q.float().isnan().all()
    x[1, 7] = 1.0
    q, s = tq.scaled_fp8_quant(x, None, False)
    assert s.isinf().all() and q[2, 0].float().isnan() and (q[0].float() == 0).all()
    view = _rows((3, 4), 256, None, torch.bfloat16, device, 4.0)[:, 1:3]
    for mode in SCALED_MODES:
        _, scale, per_token, ub = _scaled_args((1,), 1, None, torch.float32, device, mode)
        want = (fp8.quantize_static(view, scale) if scale is not None else fp8.quantize_per_token(view, ub)
                if per_token else fp8.quantize_per_tensor(view))
        fp8.assert_quantized(list(tq.scaled_fp8_quant(view, scale, per_token, ub)), list(want), 0)


@pytest.mark.parametrize("device", DEVICES)
def test_scaled_fp8_quant_per_tensor_over_many_programs(device):
    """The amax of |x| over every program of the launch (one atomic max each), its largest value far
    from the first; zero tokens give the floor scale."""
    tq = triton_here("quant", device)
    shape, config = ((8192, 7168), None) if device == "cuda" else ((48, 1000), tq.TritonScaledQuantConfig(1, 128, 1))
    kw = {} if config is None else {"config": config}
    x = torch.randn(*shape, device=device, dtype=torch.bfloat16)
    x[shape[0] - 7, shape[1] - 3] = -900.0
    q, s = tq.scaled_fp8_quant(x, None, False, None, **kw)
    assert s.item() == (torch.tensor(900.0) * fp8.INV_FP8_MAX).item()  # fp8.dynamic_scale
    fp8.assert_quantized([q, s], fp8.quantize_per_tensor(x), 0)
    x[shape[0] // 2, 3] = float("nan")
    q, s = tq.scaled_fp8_quant(x, None, False, None, **kw)
    assert s.isnan().all() and q.float().isnan().all()
    q, s = tq.scaled_fp8_quant(torch.randn(0, 64, device=device), None, False)
    assert q.shape == (0, 64) and s.item() == fp8.MIN_SCALE


# ----------------------------------------------------------------------------------------------
# Every op: a bad static scale, zero tokens


def _every_op(device):
    """(name, call(x, scale) -> (q, scales)) for every Triton FP8 entry point, in static mode."""
    tq, tn, ta = triton_here("quant", device), triton_here("norm", device), triton_here("activation", device)
    w = torch.randn(256, device=device, dtype=torch.bfloat16)
    calls = [("scaled_fp8_quant", lambda x, s: tq.scaled_fp8_quant(x, s)),
             ("silu_and_mul_fp8_quant", lambda x, s: ta.silu_and_mul_fp8_quant(x.repeat(1, 2), s))]
    for op in NORM_OPS:
        fn = getattr(tn, op)
        calls.append((op, (lambda fn: lambda x, s: fn(x, torch.randn_like(x), w, 1e-6, s))(fn) if "fused_add" in op
                      else (lambda fn: lambda x, s: fn(x, w, 1e-6, s))(fn)))
    return calls


@pytest.mark.parametrize("device", DEVICES)
def test_a_static_scale_that_is_not_positive_and_finite_gives_nan(device):
    """Read on the device, never on the host: every q NaN, the scales its copy. (The registered ops
    refuse such a scale on the CPU; the kernels are called here directly.)"""
    for name, call in _every_op(device):
        for bad in (-0.5, 0.0, float("nan"), float("inf")):
            scale = torch.full((1,), bad, device=device)
            q, s = call(torch.randn(8, 256, device=device, dtype=torch.bfloat16), scale)
            assert q.float().isnan().all(), f"{name} with scale {bad}"
            assert torch.equal(s.view(torch.int32), scale.view(torch.int32)), f"{name}: scales {s} for {bad}"


@pytest.mark.parametrize("device", DEVICES)
def test_zero_tokens(device):
    tq, tn, ta = triton_here("quant", device), triton_here("norm", device), triton_here("activation", device)
    scale = torch.full((1,), 0.25, device=device)
    for name, call in _every_op(device):
        q, s = call(torch.randn(0, 256, device=device, dtype=torch.bfloat16), scale)
        assert q.shape[0] == 0 and q.dtype == FP8 and torch.equal(s, scale), name
    w = torch.randn(256, device=device)
    for mode in MODES[1:]:
        scale, group, column_major, ue8m0 = _quant(mode, device)
        for q, s in (tn.rmsnorm_fp8_quant(torch.randn(0, 256, device=device), w, 1e-6, None, group, column_major, ue8m0),
                     ta.silu_and_mul_fp8_quant(torch.randn(0, 512, device=device), None, group, column_major, ue8m0)):
            assert q.shape == (0, 256) and s.shape == (0, 1 if group == -1 else 256 // group)
    assert tq.scaled_fp8_quant(torch.randn(0, 256, device=device), None, True)[1].shape == (0, 1)


# ----------------------------------------------------------------------------------------------
# Launch choices and the layout invariant (no GPU needed)


def test_launch_heuristics():
    """scaled_fp8_quant: 4096-value tiles over 4 warps, per token whole rows up to 16384 (16 warps),
    chunks of 4096 beyond; silu_and_mul_fp8_quant: the activation's 1024-output tile, a tile of whole
    groups, per token whole rows of about 512 outputs a warp."""
    tq, ta = triton_here("quant", "cpu"), triton_here("activation", "cpu")
    Scaled, Act = tq.TritonScaledQuantConfig, ta.TritonActivationConfig
    assert Scaled.for_shape(8192, 7168, False) == Scaled(1, 4096, 4)
    assert Scaled.for_shape(8192, 1000, False) == Scaled(4, 1024, 4)
    assert Scaled.for_shape(2, 1000, False) == Scaled(2, 1024, 2)
    assert Scaled.for_shape(8192, 7168, True) == Scaled(1, 8192, 8)
    assert Scaled.for_shape(None, 100, True) == Scaled(32, 128, 4)
    assert Scaled.for_shape(3, 100, True) == Scaled(4, 128, 1)
    assert Scaled.for_shape(8192, 65536, True) == Scaled(1, 4096, 4)
    assert Act.for_quant(14336, 128) == Act.for_shape(14336) == Act(1, 1024, 4)
    assert Act.for_quant(4096, 2048) == Act(1, 2048, 8)
    assert Act.for_quant(14336, -1) == Act(1, 16384, 16)
    assert Act.for_quant(4096, -1) == Act(1, 4096, 8)
    assert Act.for_quant(65536, -1) == Act(1, 4096, 8)
    assert Act.for_quant(100, -1) == Act(8, 128, 2)


_LAYOUTS = r"""
import re, sys, torch, triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from torch_kernels.families.norm import triton as tn

T = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}

def ttgir(dt, n, config, fused, quant, group):
    ptr = lambda t: "*" + t
    sig = dict(x_ptr=ptr(T[dt]), x_row_stride="i32", res_ptr=ptr(T[dt]), res_row_stride="i32",
               out_ptr=ptr("fp8e4nv" if quant else T[dt]), out_row_stride="i32", w_ptr=ptr(T[dt]), N="i32", eps="fp32",
               s_ptr="*fp32", s_row_stride="i32", s_group_stride="i32", scale_ptr="*fp32")
    const = dict(BLOCK_N=config.block_n, ONE_PASS=config.one_pass, HAS_RESIDUAL=fused, GEMMA=False,
                 RELOAD=config.reload and not fused, QUANT=quant, GROUP_SIZE=group, UE8M0=False,
                 V=min(16 // torch.empty(0, dtype=dt).element_size(), config.block_n), NUMPY_MAX=False, EMULATE_CAST=False)
    sig.update({k: "constexpr" for k in const})
    names = list(sig)
    # what Triton specialises a launch on: 16-byte aligned pointers, sizes and strides multiples of 16
    aligned = {(names.index(k),): [["tt.divisibility", 16]] for k in ("x_ptr", "res_ptr", "out_ptr", "w_ptr", "N",
                                                                       "x_row_stride", "res_row_stride", "out_row_stride")
               if not k.endswith("stride") or n % 16 == 0}
    src = ASTSource(tn._rmsnorm_rows, sig, const, aligned)
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": config.num_warps}).asm["ttgir"]

def sum_layouts(ir):
    # the operand types (layouts resolved) of the reductions that add: the row's sum of squares
    defs = dict(re.findall(r"^(#\w+) = (.*)$", ir, re.M))
    out, lines = [], ir.splitlines()
    for i, line in enumerate(lines):
        if '"tt.reduce"(' in line:
            j = i + 1
            while not re.match(r"\s*\}\) : \(", lines[j]):
                j += 1
            if any("arith.addf" in l for l in lines[i:j]):
                out.append(re.sub(r"#\w+", lambda m: defs.get(m.group(0), m.group(0)),
                                  re.search(r"\}\) : \((.*?)\) ->", lines[j]).group(1)))
    return out

bad = []
for dt in (torch.bfloat16, torch.float32):
    for tokens, n, fused in ((4096, 4096, False), (4096, 7168, True), (1, 7168, False), (1, 1000, True), (1, 20480, False)):
        config = tn.TritonNormConfig.for_shape(tokens, n, fused)
        want = sum_layouts(ttgir(dt, n, config, fused, 0, 1))
        for quant, group in ((1, 1), (2, 1), (3, 128), (3, 8)):
            if n % group == 0:
                got = sum_layouts(ttgir(dt, n, config, fused, quant, group))
                if len(want) != 1 or got != want:
                    bad.append(f"{dt} {tokens}x{n} fused={fused} {config} QUANT={quant} group {group}: {got} vs {want}")
print("\n".join(bad) or "same")
"""


def test_fused_norm_sums_squares_over_the_norms_layout():
    """Compiled for sm_90 (no GPU needed, in a process without the interpreter): the epilogue leaves the
    layout of the row's sum of squares as the norm kernel has it, over the launches and dtypes the
    heuristic picks, so the fused norm's rstd, and with it every value it quantises, is the norm's."""
    pytest.importorskip("triton.backends.nvidia.compiler")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    r = subprocess.run([sys.executable, "-c", _LAYOUTS], cwd=root, env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout.strip().splitlines()[-1] == "same", r.stdout


# ----------------------------------------------------------------------------------------------
# GPU only


@pytest.mark.gpu
def test_int64_row_offsets():
    """Rows 2^30 elements apart (offsets past 2^31): every op reads and writes the right rows."""
    tq, tn, ta = triton_here("quant", "cuda"), triton_here("norm", "cuda"), triton_here("activation", "cuda")
    n = 4096

    def far_rows(width):
        base = torch.empty(3 * 2 ** 30, dtype=torch.bfloat16, device="cuda")
        rows = base.as_strided((3, width), (2 ** 30, 1))
        rows.copy_(torch.randn(3, width, device="cuda"))
        return rows
    x, w = far_rows(n), torch.randn(n, device="cuda", dtype=torch.bfloat16)
    for mode in MODES:
        quant = _quant(mode, "cuda")
        got, want, y = _norm_case(tn, tq, "rmsnorm_fp8_quant", (x, w, 1e-6, *quant), None)
        _assert_bits(got, want, f"rmsnorm_fp8_quant int64 offsets {mode}")
        _assert_epilogue(got, y, *quant, f"int64 offsets {mode}")
    r = far_rows(n)
    got, want, _ = _norm_case(tn, tq, "fused_add_rmsnorm_fp8_quant", (x, r, w, 1e-6, None, -1, False, False), None)
    _assert_bits(got, want, "fused_add_rmsnorm_fp8_quant int64 offsets")
    del r
    for mode in SCALED_MODES:
        _, scale, per_token, ub = _scaled_args((1,), 1, None, torch.float32, "cuda", mode)
        want = (fp8.quantize_static(x, scale) if scale is not None else fp8.quantize_per_token(x, ub) if per_token
                else fp8.quantize_per_tensor(x))
        fp8.assert_quantized(list(tq.scaled_fp8_quant(x, scale, per_token, ub)), list(want), 0)
    del x
    g = far_rows(2 * n)
    for mode in MODES:
        quant = _quant(mode, "cuda")
        _assert_bits(list(ta.silu_and_mul_fp8_quant(g, *quant)), _unfused_quant(tq, ta.silu_and_mul(g), *quant),
                     f"silu_and_mul_fp8_quant int64 offsets {mode}")


@pytest.mark.gpu
@pytest.mark.parametrize("op", NORM_OPS + ["silu_and_mul_fp8_quant"])
def test_compiled_fused_op_equals_the_compiled_unfused_pair(op):
    """Through the inductor_triton route (Inductor launching our kernels, the token count dynamic): the
    fused op's q and scales (and residual) are the unfused pair's, compiled the same way."""
    import torch_kernels

    torch_kernels.configure(backend="triton", compile_route="inductor_triton")
    d = torch.ops.deepinfer
    fused_add = "fused_add" in op
    first = d.silu_and_mul if op == "silu_and_mul_fp8_quant" else getattr(d, op.removesuffix("_fp8_quant"))
    for mode in (MODES[0], MODES[1], MODES[3]):
        scale, group, column_major, ue8m0 = _quant(mode, "cuda")

        def fused(*a):
            a = list(a)
            if fused_add:
                a[1] = a[1].clone()
            q, s = getattr(d, op)(*a, scale, group, column_major, ue8m0)
            return [q, s] + a[1:2] * fused_add

        def unfused(*a):
            a = list(a)
            if fused_add:
                a[0], a[1] = a[0].clone(), a[1].clone()
                first(*a)
                y = a[0]
            else:
                y = first(*a)
            if scale is not None:
                q, s = d.scaled_fp8_quant(y, scale)
            elif group == -1:
                q, s = d.scaled_fp8_quant(y, None, True)
            else:
                q, s = d.per_token_group_quant_fp8(y, group, fp8.GROUP_EPS, column_major, ue8m0)
            return [q, s] + a[1:2] * fused_add

        torch._dynamo.reset()
        compiled_fused = torch.compile(fused, fullgraph=True, dynamic=True)
        compiled_unfused = torch.compile(unfused, fullgraph=True, dynamic=True)
        for tokens in (5, 300):
            if op == "silu_and_mul_fp8_quant":
                args = (_rows((tokens,), 2 * 2048, None, torch.bfloat16, "cuda", 2.0),)
            else:
                args = _norm_args(op, (tokens,), 2048, None, torch.bfloat16, "cuda", mode)[:-4]
            _assert_bits(compiled_fused(*args), compiled_unfused(*args), f"{op} compiled, {tokens} tokens, mode {mode}")
