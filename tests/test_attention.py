"""Numerics of ``merge_attn_states``: the reference against an independent fp64 formula, the empty-
partial rules exactly (no NaN, ever), and every backend against the reference over dtypes and
awkward shapes and layouts (Triton in its interpreter on CPU)."""

import math
from dataclasses import replace

import pytest
import torch

from torch_kernels import registry
from torch_kernels.families.attention import ops as attention_ops
from torch_kernels.spec import Backend
from torch_kernels.testing import assert_close

from conftest import DEVICES, assert_bad_inputs_raise, implementations_on, triton_here

OP = "merge_attn_states"
DTYPES = [torch.float32, torch.float16, torch.bfloat16]
INF = float("inf")
# (tokens, heads, head_size): one of each, head sizes that are not powers of two, a head wider
# than one program (two head-size blocks), heads that do not fill a program, zero tokens.
SHAPES = [(1, 1, 1), (1, 32, 128), (3, 5, 40), (7, 3, 96), (2, 2, 1500), (4, 12, 64), (0, 8, 128)]
GPU_SHAPES = [(8192, 32, 128), (1000, 128, 512), (33, 7, 80)]


def _reference():
    return registry.BY_OP[OP][Backend.TORCH].load()


def _backends(device):
    return implementations_on(OP, device)


def _inputs(T, H, D, dtype, device, lse_scale=2.0):
    return (torch.randn(T, H, D, dtype=dtype, device=device), torch.randn(T, H, device=device) * lse_scale + 3,
            torch.randn(T, H, D, dtype=dtype, device=device), torch.randn(T, H, device=device) * lse_scale + 3)


def _formula(v_a, lse_a, v_b, lse_b):
    """The definition in fp64 without the max shift (fp64 holds exp of LSEs up to 700)."""
    ea, eb = torch.exp(lse_a.double()), torch.exp(lse_b.double())
    v = (v_a.double() * ea[..., None] + v_b.double() * eb[..., None]) / (ea + eb)[..., None]
    return v, torch.log(ea + eb)


@pytest.mark.parametrize("lse_scale", [2.0, 100.0], ids=["lse~3+-2", "lse~+-100"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_reference_matches_fp64_formula(shape, dtype, lse_scale):
    """LSEs of +-100 overflow exp in fp32: the reference must shift by the max and still agree."""
    args = _inputs(*shape, dtype, "cpu", lse_scale)
    v, lse = _reference()(*args)
    want_v, want_lse = _formula(*args)
    assert v.shape == shape and v.dtype == dtype and v.is_contiguous()
    assert lse.shape == shape[:2] and lse.dtype == torch.float32 and lse.is_contiguous()
    assert_close(v, want_v.to(dtype))
    assert_close(lse, want_lse.float())


def _check_backends(device, args, dtype):
    want = _reference()(*args)
    for name, fn in _backends(device):
        before = [a.clone() for a in args]
        got = fn(*args)
        assert isinstance(got, tuple) and len(got) == 2, name
        for g, w in zip(got, want):
            assert g.shape == w.shape and g.dtype == w.dtype and g.is_contiguous(), name
        assert_close(got[0], want[0], dtype, msg=f"backend {name}: v {tuple(args[0].shape)}")
        assert_close(got[1], want[1], torch.float32, msg=f"backend {name}: lse")
        for b, a in zip(before, args):
            assert torch.equal(b.nan_to_num(), a.nan_to_num()), f"{name} clobbered an input"


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_backends_match_reference(dtype, device):
    for shape in SHAPES + (GPU_SHAPES if device == "cuda" else []):
        _check_backends(device, _inputs(*shape, dtype, device), dtype)
        _check_backends(device, _inputs(*shape, dtype, device, lse_scale=100.0), dtype)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_backends_strided_layouts(dtype, device):
    """Token and head strides of slices, a head-major buffer seen as (T, H, D), vLLM's (H, T) LSE
    layout passed as ``lse.t()``, LSE slices with a token stride."""
    T, H, D = 6, 5, 72
    wide = torch.randn(T, H + 3, D + 8, dtype=dtype, device=device)[:, 2:H + 2, :D]
    head_major = torch.randn(H, T, D, dtype=dtype, device=device).transpose(0, 1)
    lse_ht = (torch.randn(H, T, device=device) * 2).t()
    lse_sliced = (torch.randn(T, 2 * H, device=device) * 2)[:, ::2]
    _check_backends(device, (wide, lse_ht, head_major, lse_sliced), dtype)
    _check_backends(device, (head_major, lse_sliced, wide, lse_ht), dtype)


# --- empty partials: exact, never NaN ---------------------------------------------------------------

@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_empty_partials_exactly(dtype, device):
    """lse -inf (or FA2's +inf): the other partial's v and lse come back bit for bit, whatever the
    empty partial's v holds (NaN, Inf); both empty: v_a and -inf. No NaN anywhere."""
    T, H, D = 6, 4, 40
    v_a, lse_a, v_b, lse_b = _inputs(T, H, D, dtype, device)
    a_empty = torch.zeros(T, H, dtype=torch.bool, device=device)
    b_empty = torch.zeros_like(a_empty)
    a_empty[0, :2] = b_empty[1, 1:] = True  # one side empty
    a_empty[2, 3] = b_empty[2, 3] = True  # both
    a_empty[3, 0] = b_empty[3, 1] = True  # and FA2's marker below
    lse_a[a_empty] = -INF
    lse_b[b_empty] = -INF
    lse_a[3, 0] = lse_b[3, 1] = INF
    lse_b[2, 3] = INF  # both empty, one written the FA2 way
    # garbage in the empty partials' values, which must not leak into the result
    v_a[0, 0] = float("nan")
    v_a[0, 1] = INF
    v_b[1, 2] = float("nan")
    v_b[3, 1] = -INF
    only_a, only_b, both = a_empty & ~b_empty, b_empty & ~a_empty, a_empty & b_empty
    for name, fn in _backends(device):
        v, lse = fn(v_a, lse_a, v_b, lse_b)
        assert torch.equal(v[only_a], v_b[only_a]), f"{name}: a empty must give v_b exactly"
        assert torch.equal(lse[only_a], lse_b[only_a]), f"{name}: a empty must give lse_b exactly"
        assert torch.equal(v[only_b], v_a[only_b]), f"{name}: b empty must give v_a exactly"
        assert torch.equal(lse[only_b], lse_a[only_b]), f"{name}: b empty must give lse_a exactly"
        assert torch.equal(v[both], v_a[both]), f"{name}: both empty must give v_a"
        assert bool((lse[both] == -INF).all()), f"{name}: both empty must give lse -inf"
        assert not v.isnan().any() and not lse.isnan().any(), f"{name}: NaN in the result"
        mixed = ~(a_empty | b_empty)
        want_v, want_lse = _formula(v_a[mixed], lse_a[mixed], v_b[mixed], lse_b[mixed])
        assert_close(v[mixed], want_v.to(dtype), msg=name)
        assert_close(lse[mixed], want_lse.float(), msg=name)


@pytest.mark.parametrize("device", DEVICES)
def test_all_empty_and_one_side_empty_everywhere(device):
    """Whole tensors of empty partials (a request with no prefix hit): the exact results, no NaN."""
    v_a, lse_a, v_b, lse_b = _inputs(3, 4, 64, torch.bfloat16, device)
    empty = torch.full_like(lse_a, -INF)
    for name, fn in _backends(device):
        v, lse = fn(v_a, empty, v_b, lse_b)
        assert torch.equal(v, v_b) and torch.equal(lse, lse_b), name
        v, lse = fn(v_a, lse_a, v_b, empty)
        assert torch.equal(v, v_a) and torch.equal(lse, lse_a), name
        v, lse = fn(v_a, empty, v_b, empty.clone())
        assert torch.equal(v, v_a) and bool((lse == -INF).all()), name


@pytest.mark.parametrize("device", DEVICES)
def test_nan_lse_propagates(device):
    """A NaN LSE is not an empty partial: it poisons its head as in the reference."""
    v_a, lse_a, v_b, lse_b = _inputs(2, 3, 16, torch.float32, device)
    lse_a[0, 0] = float("nan")  # against a finite LSE: v and lse NaN
    lse_a[1, 2] = float("nan")
    lse_b[1, 2] = -INF  # against an empty partial: v_a, lse NaN
    for name, fn in _backends(device):
        v, lse = fn(v_a, lse_a, v_b, lse_b)
        assert v[0, 0].isnan().all() and lse[0, 0].isnan(), name
        assert torch.equal(v[1, 2], v_a[1, 2]) and lse[1, 2].isnan(), name
        assert not v[0, 1:].isnan().any() and not lse[0, 1:].isnan().any(), name


@pytest.mark.parametrize("device", DEVICES)
def test_equal_lse_averages_and_lse_grows_by_log2(device):
    v_a, lse_a, v_b, _ = _inputs(4, 2, 32, torch.float32, device)
    for name, fn in _backends(device):
        v, lse = fn(v_a, lse_a, v_b, lse_a.clone())
        assert_close(v, (v_a + v_b) / 2, msg=name)
        assert_close(lse, lse_a + math.log(2.0), msg=name)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("flat", [True, False], ids=["flat-grid", "3d-grid"])
def test_triton_program_orders_and_split_launches(flat, device, monkeypatch):
    """Both program orders, with the default tiles and with launches split where the grid would
    pass CUDA's limits (shrunk here to 2 programs an axis), strided inputs and empty partials."""
    triton_attention = triton_here("attention", device)
    T, H, D = 5, 3, 40
    v_a = torch.randn(T, H + 1, D, device=device)[:, 1:]
    v_b = torch.randn(T, H, D, device=device)
    lse_a = (torch.randn(H, T, device=device) * 2).t()
    lse_b = torch.randn(T, H, device=device) * 2
    lse_a[0, 1] = lse_b[1, 0] = -INF
    lse_a[2, 2] = lse_b[2, 2] = -INF
    want_v, want_lse = _reference()(v_a, lse_a, v_b, lse_b)

    Config = triton_attention.TritonMergeConfig

    def run(config):
        out, out_lse = torch.full_like(want_v, float("nan")), torch.full_like(want_lse, float("nan"))
        triton_attention.launch(v_a, lse_a, v_b, lse_b, out, out_lse, replace(config, flat=flat))
        assert_close(out, want_v, msg=f"v, {config}")
        assert_close(out_lse, want_lse, msg=f"lse, {config}")
    run(Config.for_shape(H, D))
    with monkeypatch.context() as m:
        m.setattr(triton_attention, "_MAX_GRID_0", 2)
        m.setattr(triton_attention, "_MAX_GRID_12", 2)
        for block_h, block_d in [(1, 16), (2, 8), (4, 64)]:
            run(Config(block_h, block_d, 1))



@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_triton_other_configs_match_reference(dtype, device):
    """The entry point under launches other than the heuristic's: heads in several blocks, a head
    in several value blocks, other warp counts, the 3-D grid; an empty partial."""
    triton_attention = triton_here("attention", device)
    Config = triton_attention.TritonMergeConfig
    for T, H, D in ((3, 5, 40), (4, 12, 64)):
        args = _inputs(T, H, D, dtype, device)
        args[1][0, 1] = -INF
        want_v, want_lse = _reference()(*args)
        for config in (Config(2, 16, 1), Config(4, 32, 2, flat=False), Config(8, 128, 4), Config(1, 8, 1)):
            v, lse = triton_attention.merge_attn_states(*args, config=config)
            assert_close(v, want_v, msg=f"v, {config}")
            assert_close(lse, want_lse, msg=f"lse, {config}")


def test_triton_heuristic_picks_the_measured_tiles():
    """2048 values a program over 4 warps (16 a thread): the whole head up to 1024 values, as many
    heads as fill the tile, no more heads than there are."""
    Config = triton_here("attention", "cpu").TritonMergeConfig
    assert Config.for_shape(32, 128) == Config(16, 128, 4, True)
    assert Config.for_shape(8, 128) == Config(8, 128, 2, True)
    assert Config.for_shape(32, 512) == Config(4, 512, 4, True)
    assert Config.for_shape(3, 40) == Config(4, 64, 1, True)
    assert Config.for_shape(2, 1500) == Config(2, 1024, 4, True)
    assert Config.for_shape(32, 128, tile=4096, per_thread=8) == Config(32, 128, 16, True)  # the sweep's


@pytest.mark.gpu
def test_triton_int64_offsets_past_2_31_elements():
    """v of more than 2^31 elements: the last tokens are right (int32 offsets would wrap)."""
    from torch_kernels.families.attention import triton as triton_attention
    T, H, D = 540000, 32, 128
    assert T * H * D > 2**31
    args = _inputs(T, H, D, torch.bfloat16, "cuda")
    v, lse = triton_attention.merge_attn_states(*args)
    for sl in (slice(T - 3, T), slice(0, 3)):
        want_v, want_lse = _reference()(*(a[sl] for a in args))
        assert_close(v[sl], want_v)
        assert_close(lse[sl], want_lse)


@pytest.mark.gpu
def test_matches_flashinfer_merge_state():
    """FlashInfer's merge_state (base-2 LSE) agrees once the LSE is converted both ways."""
    cascade = pytest.importorskip("flashinfer.cascade")
    v_a, lse_a, v_b, lse_b = _inputs(257, 32, 128, torch.bfloat16, "cuda")
    log2e = 1.0 / math.log(2.0)
    fi_v, fi_lse2 = cascade.merge_state(v_a, lse_a * log2e, v_b, lse_b * log2e)
    v, lse = torch.ops.deepinfer.merge_attn_states.default(v_a, lse_a, v_b, lse_b)
    assert_close(v, fi_v)
    assert_close(lse, fi_lse2 / log2e, torch.float16)  # FlashInfer's exp2/log2 approximations


def test_wrapper_calls_the_op():
    args = _inputs(3, 2, 16, torch.float32, "cpu")
    for g, w in zip(attention_ops.merge_attn_states(*args), torch.ops.deepinfer.merge_attn_states(*args)):
        assert torch.equal(g, w)


def test_refuses_autograd():
    v_a, lse_a, v_b, lse_b = _inputs(2, 2, 8, torch.float32, "cpu")
    with pytest.raises(RuntimeError, match=rf"deepinfer::{OP} does not support autograd"):
        torch.ops.deepinfer.merge_attn_states(v_a.requires_grad_(), lse_a, v_b, lse_b)


# --- bad input -----------------------------------------------------------------------------------

def _bad_cases(device):
    v, lse = torch.randn(4, 2, 16, device=device), torch.randn(4, 2, device=device)

    def args(v_a=v, lse_a=lse, v_b=v, lse_b=lse):
        return v_a, lse_a, v_b, lse_b
    return [
        ("integer v_a", args(v_a=torch.ones(4, 2, 16, dtype=torch.int32, device=device)), TypeError, "v_a"),
        ("fp64 v_a", args(v_a=v.double(), v_b=v.double()), TypeError, "v_a"),
        ("2-D v_a", args(v_a=torch.randn(4, 32, device=device)), ValueError, "v_a"),
        ("4-D v_a", args(v_a=torch.randn(4, 2, 16, 1, device=device)), ValueError, "v_a"),
        ("zero head size", args(v_a=torch.randn(4, 2, 0, device=device), v_b=torch.randn(4, 2, 0, device=device)),
         ValueError, "v_a"),
        ("non-contiguous head", args(v_a=torch.randn(4, 16, 2, device=device).transpose(1, 2)), ValueError, "v_a"),
        ("v_b of another dtype", args(v_b=v.half()), TypeError, "v_b"),
        ("v_b of another shape", args(v_b=torch.randn(4, 2, 17, device=device)), ValueError, "v_b"),
        ("v_b with other tokens", args(v_b=torch.randn(5, 2, 16, device=device)), ValueError, "v_b"),
        ("non-contiguous v_b head", args(v_b=torch.randn(4, 16, 2, device=device).transpose(1, 2)), ValueError, "v_b"),
        ("v_b on another device", args(v_b=torch.randn(4, 2, 16, device="meta")), ValueError, "v_b"),
        ("fp16 lse_a", args(lse_a=lse.half()), TypeError, "lse_a"),
        ("fp64 lse_b", args(lse_b=lse.double()), TypeError, "lse_b"),
        ("lse_a of (H, T)", args(lse_a=torch.randn(2, 4, device=device)), ValueError, "lse_a"),
        ("lse_a with a head dim of 1", args(lse_a=torch.randn(4, 2, 1, device=device)), ValueError, "lse_a"),
        ("lse_b with other tokens", args(lse_b=torch.randn(3, 2, device=device)), ValueError, "lse_b"),
        ("lse_b on another device", args(lse_b=torch.randn(4, 2, device="meta")), ValueError, "lse_b"),
        ("lse_a not a tensor", args(lse_a=1.0), TypeError, "lse_a"),
    ]


@pytest.mark.parametrize("device", DEVICES)
def test_bad_input_names_the_op_and_the_argument(device):
    def call(*args):  # the schema refuses a float before our checks run: check those directly
        fn = torch.ops.deepinfer.merge_attn_states.default
        return (fn if all(isinstance(a, torch.Tensor) for a in args) else attention_ops._validate)(*args)
    assert_bad_inputs_raise(OP, _bad_cases(device), call)


def test_bad_input_raises_at_trace_time():
    compiled = torch.compile(lambda *a: torch.ops.deepinfer.merge_attn_states(*a), backend="eager", fullgraph=True)
    v = torch.randn(4, 2, 16)
    with pytest.raises(Exception, match=rf"deepinfer::{OP}: argument 'lse_b' must have shape \(tokens, heads\)"):
        compiled(v, torch.randn(4, 2), v, torch.randn(4, 3))


@pytest.mark.gpu
def test_tensors_on_cuda_and_cpu_raise_before_any_kernel():
    v = torch.randn(4, 2, 16, device="cuda")
    with pytest.raises(ValueError, match=rf"deepinfer::{OP}: argument 'lse_a' is on cpu but 'v_a' is on cuda"):
        torch.ops.deepinfer.merge_attn_states.default(v, torch.randn(4, 2), v, torch.randn(4, 2, device="cuda"))
    torch.cuda.synchronize()  # the CUDA context is intact
