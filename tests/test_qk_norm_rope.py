"""Numerics of ``qk_rmsnorm_rope``: the reference against an fp64 formula written independently of
the project's norm and rope code; every backend bit for bit its own unfused pair (its ``rmsnorm`` on
the heads, rounded to the dtype, then its ``rotary_embedding``), Triton in its interpreter on CPU; the
fused qkv buffer untouched outside query and key; bad input named before anything is written."""

import dataclasses
import importlib
import os
import re

import pytest
import torch

from torch_kernels import registry
from torch_kernels.families.norm import reference as norm_reference
from torch_kernels.families.rope import ops as rope
from torch_kernels.families.rope import reference as rope_reference
from torch_kernels.spec import Backend
from torch_kernels.testing import assert_close

from conftest import DEVICES, assert_bad_inputs_raise, implementations_on, triton_here

OP = "qk_rmsnorm_rope"
DTYPES = [torch.float32, torch.float16, torch.bfloat16]
REFERENCE = registry.BY_OP[OP][Backend.TORCH].load()

# (tokens, q heads, k heads (0: no key), head_size, rot_dim, is_neox, layout, fp32 weights): one token,
# head sizes 64/128/256, GPT-J, partial rotary, zero tokens, odd head counts, fused qkv slices, 3-D head
# views, no key, a head size that is no power of two, more key heads than query heads.
CASES = [
    (1, 1, 1, 64, 64, True, "2d", False),
    (3, 4, 2, 128, 128, False, "2d", True),
    (5, 3, 1, 128, 64, True, "qkv", False),
    (0, 4, 2, 64, 32, True, "2d", False),
    (2, 5, 3, 256, 256, True, "qkv", True),
    (3, 7, 1, 256, 128, False, "3d", False),
    (2, 3, 1, 80, 40, False, "qkv", False),
    (4, 3, 0, 128, 128, True, "2d", False),
    (2, 1, 3, 64, 64, False, "qkv", True),
]
# Qwen3-8B (32 q heads, 8 kv heads, head 128) at a decode step, 32 tokens and a prefill; partial
# rotary; head size 64 and 256.
GPU_CASES = [
    (1, 32, 8, 128, 128, True, "qkv", False),
    (32, 32, 8, 128, 128, True, "qkv", False),
    (4096, 32, 8, 128, 128, True, "qkv", False),
    (333, 16, 2, 128, 64, False, "2d", True),
    (257, 28, 4, 64, 64, True, "3d", False),
    (100, 16, 4, 256, 256, False, "qkv", True),
    (77, 16, 4, 256, 128, True, "2d", False),
]


def _ids(case):
    t, hq, hk, hs, rd, neox, layout, f32w = case
    return f"T{t}-{hq}q{hk}k-hs{hs}-rot{rd}-{'neox' if neox else 'gptj'}-{layout}{'-f32w' if f32w else ''}"


def _args(case, device, dtype, cache_dtype=torch.float32, positions_dtype=torch.int64, max_position=37):
    t, hq, hk, hs, rd, neox, layout, f32w = case
    return rope.make_qk_args(t, hq, hk, hs, rd, neox, layout, device, dtype, torch.float32 if f32w else dtype,
                             cache_dtype, positions_dtype, max_position)


def _copy(args):
    """A deep copy that keeps the layout (query and key views of one fused base stay views of a copy
    of it): (args, the base or None)."""
    positions, q, k = args[:3]
    base = q._base
    if base is None:
        return (positions, q.clone(), None if k is None else k.clone(), *args[3:]), None
    b = base.clone()
    view = lambda t: None if t is None else b.as_strided(t.size(), t.stride(), t.storage_offset())  # noqa: E731
    return (positions, view(q), view(k), *args[3:]), b


def _formula(positions, x, weight, eps, head_size, rot_dim, is_neox, dtype, base=10000.0):
    """fp64: each head ``x / sqrt(mean(x^2) + eps) * w`` rounded to ``dtype``, then pair ``j`` (``(j, j + r/2)``
    or ``(2j, 2j + 1)``) turned by the angle ``p * base^(-2j/r)``; the dims past ``r`` pass through."""
    heads = (x if x.dim() == 3 else x.unflatten(-1, (-1, head_size))).double()
    y = heads / torch.sqrt((heads * heads).sum(-1, keepdim=True) / head_size + eps) * weight.double()
    y = y.to(dtype).double()
    half = rot_dim // 2
    j = torch.arange(half, dtype=torch.float64)
    angle = positions.double()[:, None, None] * base ** (-2.0 * j / rot_dim)
    a, b = (torch.arange(half), torch.arange(half) + half) if is_neox else (2 * torch.arange(half), 2 * torch.arange(half) + 1)
    out = y.clone()
    out[..., a] = y[..., a] * torch.cos(angle) - y[..., b] * torch.sin(angle)
    out[..., b] = y[..., b] * torch.cos(angle) + y[..., a] * torch.sin(angle)
    return out.reshape(x.shape)


@pytest.mark.parametrize("dtype", DTYPES + [torch.float64], ids=str)
@pytest.mark.parametrize("case", CASES, ids=_ids)
def test_qk_rmsnorm_rope_reference_matches_fp64_formula(case, dtype):
    args, _ = _copy(_args(case, "cpu", dtype, torch.float64 if dtype == torch.float64 else torch.float32,
                          max_position=4096))
    positions, q, k, qw, kw, eps, hs, cache, neox = args
    want = [None if x is None else _formula(positions, x, w, eps, hs, cache.shape[1], neox, dtype)
            for x, w in ((q, qw), (k, kw))]
    assert REFERENCE(*args) is None
    # one rounding of the norm before the rotation in both: the rotation's rounding (and the norm's
    # where the fp32 value sits on a tie) apart
    assert_close(q, want[0].to(dtype))
    if k is not None:
        assert_close(k, want[1].to(dtype))


def _assert_equal(got, want, what):
    for i, name in ((1, "query"), (2, "key")):
        if want[i] is not None:
            assert torch.equal(got[i], want[i]), (f"{what}: {name} differs from the unfused pair in "
                                                  f"{(got[i] != want[i]).sum().item()} of {want[i].numel()} values, "
                                                  f"by up to {(got[i].double() - want[i].double()).abs().max().item()}")


def _check_pair(fused, rmsnorm, rotary, cases, device, dtypes=DTYPES):
    """``fused(*args)`` bit for bit ``rope.unfused(*args, rmsnorm, rotary)``, the fused buffer untouched
    past query and key."""
    for dtype in dtypes:
        for i, case in enumerate(cases):
            args = _args(case, device, dtype, dtype if i % 2 else torch.float32, torch.int32 if i % 3 == 1 else torch.int64)
            want, want_base = _copy(args)
            rope.unfused(*want, rmsnorm=rmsnorm, rotary=rotary)
            got, got_base = _copy(args)
            assert fused(*got) is None
            _assert_equal(got, want, f"{_ids(case)} {dtype}")
            if got_base is not None:
                assert torch.equal(got_base, want_base), f"{_ids(case)} {dtype}: fused qkv buffer"
                v = sum(x.shape[-1] if x.dim() == 2 else x.shape[1] * x.shape[2] for x in args[1:3] if x is not None)
                assert torch.equal(got_base[:, v:], args[1]._base[:, v:]), f"{_ids(case)}: wrote outside query and key"


def test_qk_rmsnorm_rope_reference_is_the_unfused_reference_pair_bit_for_bit():
    _check_pair(rope_reference.qk_rmsnorm_rope, norm_reference.rmsnorm, rope_reference.rotary_embedding, CASES, "cpu",
                DTYPES + [torch.float64])


def test_qk_rmsnorm_rope_registered_op_is_the_registered_pair_bit_for_bit_on_cpu():
    _check_pair(torch.ops.deepinfer.qk_rmsnorm_rope.default, None, None, CASES, "cpu")


@pytest.mark.parametrize("device", DEVICES)
def test_qk_rmsnorm_rope_triton_is_its_unfused_pair_bit_for_bit(device):
    """Triton's fused kernel against Triton's rmsnorm then Triton's rotary_embedding: the head's sum of
    squares in the rmsnorm kernel's row layout (so its order), rounded, then the same rotation."""
    triton_rope = triton_here("rope", device)
    triton_norm = importlib.import_module("torch_kernels.families.norm.triton")
    _check_pair(triton_rope.qk_rmsnorm_rope, triton_norm.rmsnorm, triton_rope.rotary_embedding,
                CASES + (GPU_CASES if device == "cuda" else []), device)


@pytest.mark.gpu
def test_qk_rmsnorm_rope_tilelang_is_its_unfused_pair_bit_for_bit():
    """TileLang's fused kernel against TileLang's rmsnorm then TileLang's rotary_embedding: each head a
    row of the rmsnorm kernel's layout and reduction at head_size, rounded, then the same rotation."""
    pytest.importorskip("tilelang")
    tl_rope = importlib.import_module("torch_kernels.families.rope.tilelang")
    tl_norm = importlib.import_module("torch_kernels.families.norm.tilelang")
    _check_pair(tl_rope.qk_rmsnorm_rope, tl_norm.rmsnorm, tl_rope.rotary_embedding, CASES + GPU_CASES, "cuda")


@pytest.mark.gpu
def test_qk_rmsnorm_rope_misaligned_views_are_the_pair_bit_for_bit():
    """Query, key and weights one element into their buffers (off 16 bytes): the kernels run on aligned
    copies or count the weight's narrower loads, still the pair bit for bit; fp32 at 256 with a bf16
    weight is where the weight's alignment sets rmsnorm's row layout."""
    triton_rope = importlib.import_module("torch_kernels.families.rope.triton")
    triton_norm = importlib.import_module("torch_kernels.families.norm.triton")
    pairs = [(triton_rope.qk_rmsnorm_rope, triton_norm.rmsnorm, triton_rope.rotary_embedding)]
    if importlib.util.find_spec("tilelang") is not None:
        tl_rope = importlib.import_module("torch_kernels.families.rope.tilelang")
        tl_norm = importlib.import_module("torch_kernels.families.norm.tilelang")
        pairs.append((tl_rope.qk_rmsnorm_rope, tl_norm.rmsnorm, tl_rope.rotary_embedding))
    for dtype, wdtype, hs in ((torch.bfloat16, torch.bfloat16, 128), (torch.float16, torch.float16, 128),
                              (torch.float32, torch.float32, 128), (torch.float32, torch.bfloat16, 256)):
        t, hq, hk = 9, 4, 2
        buf = torch.randn(t * (hq + hk) * hs + 1, device="cuda", dtype=dtype)
        positions = torch.randint(0, 37, (t,), device="cuda")
        cache = rope.make_cos_sin_cache(37, hs, device="cuda")
        qw = (1 + 0.3 * torch.randn(hs + 1, device="cuda")).to(wdtype)[1:]
        kw = (1 + 0.3 * torch.randn(hs + 1, device="cuda")).to(wdtype)[1:]
        views = lambda b: (b[1:1 + t * hq * hs].view(t, hq * hs), b[1 + t * hq * hs:].view(t, hk * hs))  # noqa: E731
        for aligned_weights in (False, True):
            w = (qw, kw) if not aligned_weights else (qw.clone(), kw.clone())
            for fused, rmsnorm, rotary in pairs:
                want = [positions, *(v.clone() for v in views(buf)), *w, 1e-6, hs, cache, True]
                rope.unfused(*want, rmsnorm=rmsnorm, rotary=rotary)
                b = buf.clone()
                got = [positions, *views(b), *w, 1e-6, hs, cache, True]
                fused(*got)
                _assert_equal(got, want, f"misaligned {dtype} {wdtype} {hs} weights aligned={aligned_weights} "
                                         f"{fused.__module__}")
                assert b[0] == buf[0]


def test_qk_rmsnorm_rope_tilelang_launcher_runs_misaligned_views_on_aligned_copies(monkeypatch):
    """On CPU, the kernel stood in by the reference: query and key views one element into their buffer
    (contiguous, so ``.contiguous()`` would return them unchanged) reach the kernel as aligned copies,
    whose results land in the views and nowhere else of the buffer."""
    pytest.importorskip("tilelang")
    tl_rope = importlib.import_module("torch_kernels.families.rope.tilelang")
    calls = []

    def kernel(*key):
        def run(positions, q, k, qw, kw, cache, eps):
            vec = tl_rope._jit.vector_width(key[2], tl_rope._DTYPES[q.dtype])
            assert tl_rope._qk_aligned(q, qw, vec) and tl_rope._qk_aligned(k, kw, vec), "a misaligned tensor reached the kernel"
            calls.append(key)
            REFERENCE(positions, q, k, qw, kw, eps, key[2], cache, key[4])
        return run

    monkeypatch.setattr(tl_rope, "_qk_function", kernel)
    t, hq, hk, hs = 5, 4, 2, 128
    buf = torch.randn(t * (hq + hk) * hs + 1, dtype=torch.bfloat16)
    views = lambda b: (b[1:1 + t * hq * hs].view(t, hq * hs), b[1 + t * hq * hs:].view(t, hk * hs))  # noqa: E731
    positions = torch.randint(0, 37, (t,))
    cache = rope.make_cos_sin_cache(37, hs)
    qw, kw = (1 + 0.3 * torch.randn(hs, dtype=torch.bfloat16) for _ in range(2))
    want = buf.clone()
    REFERENCE(positions, *views(want), qw, kw, 1e-6, hs, cache, True)
    got = buf.clone()
    assert tl_rope.qk_rmsnorm_rope(positions, *views(got), qw, kw, 1e-6, hs, cache, True) is None
    assert len(calls) == 1 and torch.equal(got, want)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_qk_rmsnorm_rope_backends_match_reference(dtype, device):
    for i, case in enumerate(CASES + (GPU_CASES if device == "cuda" else [])):
        args = _args(case, device, dtype, dtype if i % 2 else torch.float32)
        want, _ = _copy(args)
        REFERENCE(*want)
        for name, fn in implementations_on(OP, device):
            got, _ = _copy(args)
            assert fn(*got) is None, name
            assert_close(got[1], want[1], msg=f"{name} {_ids(case)}: query")
            if got[2] is not None:
                assert_close(got[2], want[2], msg=f"{name} {_ids(case)}: key")


@pytest.mark.parametrize("device", DEVICES)
def test_qk_rmsnorm_rope_triton_other_configs_are_the_pair(device):
    """Launches other than the heuristic's (chunks splitting query and key heads, the pairs loaded
    again rather than taken from registers) change which program takes a head, not its bits."""
    triton_rope = triton_here("rope", device)
    triton_norm = importlib.import_module("torch_kernels.families.norm.triton")
    Config = triton_rope.TritonQKNormRopeConfig
    for case in (CASES[1], CASES[2], CASES[7]):
        args = _args(case, device, torch.bfloat16)
        want, _ = _copy(args)
        rope.unfused(*want, rmsnorm=triton_norm.rmsnorm, rotary=triton_rope.rotary_embedding)
        base = Config.for_shape(args[1].shape[0], 8, case[3], case[4] // 2, 2, 2, 2)
        for hpp, in_regs in ((base.block_h, True), (3 * base.block_h, False), (64, True)):
            got, _ = _copy(args)
            triton_rope.qk_rmsnorm_rope(*got, config=dataclasses.replace(base, heads_per_program=hpp, in_regs=in_regs))
            _assert_equal(got, want, f"{_ids(case)} heads_per_program={hpp} in_regs={in_regs}")


@pytest.mark.parametrize("device", DEVICES)
def test_qk_rmsnorm_rope_fp64_weights_are_the_pair(device):
    """Weights of any float dtype, as rmsnorm takes them: fp64 weights under bf16 query and key."""
    pairs = []
    if device == "cuda" or os.environ.get("TRITON_INTERPRET") == "1":
        triton_rope = triton_here("rope", device)
        triton_norm = importlib.import_module("torch_kernels.families.norm.triton")
        pairs.append((triton_rope.qk_rmsnorm_rope, triton_norm.rmsnorm, triton_rope.rotary_embedding))
    if device == "cuda" and importlib.util.find_spec("tilelang") is not None:
        tl_rope = importlib.import_module("torch_kernels.families.rope.tilelang")
        tl_norm = importlib.import_module("torch_kernels.families.norm.tilelang")
        pairs.append((tl_rope.qk_rmsnorm_rope, tl_norm.rmsnorm, tl_rope.rotary_embedding))
    pairs.append((rope_reference.qk_rmsnorm_rope, norm_reference.rmsnorm, rope_reference.rotary_embedding))
    for fused, rmsnorm, rotary in pairs:
        args = list(_args((3, 4, 2, 128, 64, True, "qkv", False), device, torch.bfloat16))
        args[3], args[4] = args[3].double(), args[4].double()
        want, _ = _copy(args)
        rope.unfused(*want, rmsnorm=rmsnorm, rotary=rotary)
        got, _ = _copy(args)
        fused(*got)
        _assert_equal(got, want, f"fp64 weights, {fused.__module__}")


def test_qk_rmsnorm_rope_triton_layout_follows_rmsnorm():
    """A head tile of whole heads a warp exactly where rmsnorm's row is one vector a lane in one warp;
    else one head a tile over rmsnorm's warps (fp32 at 256: two vectors a lane)."""
    Config = triton_here("rope", "cpu").TritonQKNormRopeConfig if os.environ.get("TRITON_INTERPRET") == "1" else \
        importlib.import_module("torch_kernels.families.rope.triton").TritonQKNormRopeConfig
    # one chunk of every head; two heads a warp, each lane 4 values of a head, as rmsnorm's 128-value row
    assert Config.for_shape(4096, 40, 128, 64, 2, 2, 2) == Config(40, 8, 128, 64, 4, 4, True)
    assert Config.for_shape(1, 40, 128, 64, 2, 2, 2) == Config(8, 8, 128, 64, 4, 4, True)  # one tile a program
    assert Config.for_shape(4096, 40, 256, 128, 4, 4, 4) == Config(40, 1, 256, 128, 1)
    assert Config.for_shape(4096, 40, 256, 128, 4, 2, 2) == Config(40, 8, 256, 128, 4, 8, True)  # bf16 weights
    assert Config.for_shape(4096, 40, 256, 128, 4, 4, 2).block_h == 1  # each tensor's layout from its own weight
    assert Config.for_shape(4096, 40, 40, 12, 2, 2, 2).block_h == 1


def test_qk_rmsnorm_rope_without_key():
    args = _args((3, 4, 0, 64, 32, False, "qkv", False), "cpu", torch.bfloat16)
    assert args[2] is None and args[4] is None
    want, _ = _copy(args)
    rope.unfused(*want, rmsnorm=norm_reference.rmsnorm, rotary=rope_reference.rotary_embedding)
    got, _ = _copy(args)
    torch.ops.deepinfer.qk_rmsnorm_rope(*got)
    assert torch.equal(got[1], want[1])


def test_qk_rmsnorm_rope_inplace_op_refuses_autograd():
    args = list(_args(CASES[0], "cpu", torch.float32))
    args[1].requires_grad_()
    with pytest.raises(RuntimeError, match=rf"deepinfer::{OP} does not support autograd"):
        rope.qk_rmsnorm_rope(*args)


# --- bad input -----------------------------------------------------------------------------------

def _bad_cases(device):
    positions = torch.randint(0, 16, (4,), device=device)
    q, k = torch.randn(4, 2 * 32, device=device), torch.randn(4, 32, device=device)
    qw, kw = torch.randn(32, device=device), torch.randn(32, device=device)
    cache = rope.make_cos_sin_cache(16, 32, device=device)

    def args(positions=positions, q=q, k=k, qw=qw, kw=kw, eps=1e-6, head_size=32, cache=cache):
        return (positions, q, k, qw, kw, eps, head_size, cache, True)
    return [
        ("q_weight of another size", args(qw=torch.randn(64, device=device)), ValueError, "q_weight"),
        ("k_weight of another size", args(kw=torch.randn(16, device=device)), ValueError, "k_weight"),
        ("2-D q_weight", args(qw=torch.randn(1, 32, device=device)), ValueError, "q_weight"),
        ("strided q_weight", args(qw=torch.randn(64, device=device)[::2]), ValueError, "q_weight"),
        ("integer k_weight", args(kw=torch.ones(32, dtype=torch.int32, device=device)), TypeError, "k_weight"),
        ("q_weight on another device", args(qw=qw.to("meta")), ValueError, "q_weight"),
        ("k_weight without key", args(k=None), ValueError, "k_weight"),
        ("key without k_weight", args(kw=None), ValueError, "k_weight"),
        ("negative eps", args(eps=-1e-6), ValueError, "eps"),
        ("NaN eps", args(eps=float("nan")), ValueError, "eps"),
        ("head_size not dividing the query width", args(q=torch.randn(4, 70, device=device)), ValueError, "query"),
        ("head_size not dividing the key width", args(k=torch.randn(4, 48, device=device)), ValueError, "key"),
        ("zero head_size", args(head_size=0), ValueError, "head_size"),
        ("odd rot_dim", args(cache=torch.randn(16, 31, device=device)), ValueError, "cos_sin_cache"),
        ("rot_dim larger than head_size", args(cache=rope.make_cos_sin_cache(16, 64, device=device)), ValueError,
         "cos_sin_cache"),
        ("fp16 cache for fp32 query", args(cache=cache.half()), TypeError, "cos_sin_cache"),
        ("key of another dtype", args(k=k.double()), TypeError, "key"),
        ("integer query", args(q=torch.ones(4, 64, dtype=torch.int32, device=device)), TypeError, "query"),
        # vLLM refuses (B, S) positions with (B*S, ...) rows too ("the same batch_size and seq_len")
        ("(B, S) positions with (B*S, H*D) rows", args(positions=positions.view(2, 2)), ValueError, "query"),
        ("3-D positions", args(positions=positions.view(2, 2, 1)), ValueError, "positions"),
        ("positions for another token count", args(positions=positions[:3]), ValueError, "positions"),
        ("float positions", args(positions=positions.float()), TypeError, "positions"),
        ("key that is the query", args(k=q, kw=qw), ValueError, "key"),
        ("q_weight a view of query", args(qw=q[0, :32]), ValueError, "q_weight"),
        ("k_weight a view of key", args(kw=k[1]), ValueError, "k_weight"),
    ] + ([  # checked on the data where that costs no device sync (positions_checked)
        ("position past the cache", args(positions=torch.tensor([0, 3, 16, 2], device=device)), ValueError, "positions"),
    ] if device == "cpu" else [])


@pytest.mark.parametrize("device", DEVICES)
def test_qk_rmsnorm_rope_bad_input_names_the_op_and_the_argument(device):
    assert_bad_inputs_raise(OP, _bad_cases(device))


def test_qk_rmsnorm_rope_bad_input_raises_at_trace_time():
    compiled = torch.compile(lambda p, q, w, c: torch.ops.deepinfer.qk_rmsnorm_rope(p, q, None, w, None, 1e-6, 32, c, True),
                             backend="eager", fullgraph=True)
    with pytest.raises(Exception, match=rf"deepinfer::{OP}: argument 'q_weight' must have shape \(32,\)"):
        compiled(torch.zeros(4, dtype=torch.int64), torch.randn(4, 64), torch.randn(16), rope.make_cos_sin_cache(16, 32))


# --- the reduction is rmsnorm's: the compiled sm_90 code of each backend, without a GPU -------------

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

_TRITON_SM90 = r"""
import json, re, sys, warnings
warnings.filterwarnings("ignore")
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from torch_kernels.families.norm import triton as norm
from torch_kernels.families.rope import triton as rope

BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}

def compile_(fn, types, const, aligned, num_warps):
    names = fn.arg_names
    sig = {n: "constexpr" if n in const else types[n] for n in names}
    attrs = {(names.index(n),): [["tt.divisibility", 16]] for n in aligned}
    return triton.compile(ASTSource(fn, sig, const, attrs), target=GPUTarget("cuda", 90, 32),
                          options=dict(num_warps=num_warps)).asm

def head_layouts(ttgir, shape):
    defs = dict(re.findall(r"^(#\w+) = #ttg\.blocked<(.*?)>", ttgir, re.M))
    return sorted({defs[m.group(2)] for m in re.finditer(r"tt\.load .*tensor<(\d+(?:x\d+)*)x!tt\.ptr<\w+>, (#\w+)>", ttgir)
                   if m.group(1) == shape})

def reduction(ptx, rows=1):
    # the arithmetic from the first square to the rsqrt of each of a lane's rows (the int->float of N
    # aside: hoisted in ours)
    ops, on = [], False
    for line in ptx.splitlines():
        op = line.strip().split("\t")[0].split(" ")[0]
        on = on or op in ("mul.f32", "fma.rn.f32")
        if on and op.startswith(("mul", "fma", "add", "shfl", "rsqrt", "div")):
            ops.append(op)
        if ops.count("rsqrt.approx.ftz.f32") == rows:
            break
    return ops

out = []
for n, dt, wdt, w_aligned in json.loads(sys.argv[1]):
    cfg = norm.TritonNormConfig.for_shape(1, n, False)
    w = ["w_ptr"] if w_aligned else []
    strides = ["x_row_stride", "out_row_stride", "N"] if n % 16 == 0 else []
    asm = compile_(norm._rmsnorm_rows, dict(x_ptr="*" + dt, x_row_stride="i32", res_ptr="*" + dt, res_row_stride="i32",
                   out_ptr="*" + dt, out_row_stride="i32", w_ptr="*" + wdt, N="i32", eps="fp32", s_ptr="*" + dt,
                   s_row_stride="i32", s_group_stride="i32", scale_ptr="*" + dt),
                   dict(BLOCK_N=cfg.block_n, ONE_PASS=True, HAS_RESIDUAL=False, GEMMA=False, RELOAD=False, QUANT=0,
                        GROUP_SIZE=1, UE8M0=False, V=min(16 // BYTES[dt], cfg.block_n), NUMPY_MAX=False,
                        EMULATE_CAST=False),
                   ["x_ptr", "res_ptr", "out_ptr", "s_ptr", "scale_ptr"] + w + strides, cfg.num_warps)
    wb = BYTES[wdt] if w_aligned else 16  # as the launcher counts a weight off 16 bytes
    qk = rope.TritonQKNormRopeConfig.for_shape(1, 40, n, n // 2, BYTES[dt], wb, wb)  # full rotary
    strides = ["q_tok_stride", "q_head_stride", "k_tok_stride", "k_head_stride", "head_size"] if n % 16 == 0 else []
    mine = compile_(rope._qk_norm_rope_kernel, dict(pos_ptr="*i64", pos_stride="i32", q_ptr="*" + dt,
                    q_tok_stride="i32", q_head_stride="i32", k_ptr="*" + dt, k_tok_stride="i32", k_head_stride="i32",
                    qw_ptr="*" + wdt, kw_ptr="*" + wdt, eps="fp32", head_size="i32", cache_ptr="*fp32",
                    cache_stride="i32", max_position="i32", num_q_heads="i32", num_k_heads="i32",
                    heads_per_program="i32", rot_half="i32"),
                    dict(BLOCK_H=qk.block_h, BLOCK_N=qk.block_n, BLOCK_D=qk.block_d, LANE_VEC=qk.lane_vec,
                         HAS_PASS=False, IN_REGS=qk.in_regs and 2 * qk.block_d == qk.block_n, IS_NEOX=True,
                         HAS_KEY=True),
                    ["pos_ptr", "q_ptr", "k_ptr", "cache_ptr"] + (["qw_ptr", "kw_ptr"] if w_aligned else []) + strides,
                    qk.num_warps)
    out.append(dict(case=[n, dt, wdt], rms_layout=head_layouts(asm["ttgir"], str(cfg.block_n)),
                    layout=head_layouts(mine["ttgir"], f"{qk.block_h}x{qk.block_n}"),
                    rms_reduction=reduction(asm["ptx"]), rows=qk.block_h // qk.num_warps,
                    reduction=reduction(mine["ptx"], qk.block_h // qk.num_warps)))
print(json.dumps(out))
"""


def _subprocess(code, env, *args):
    import json
    import subprocess
    import sys

    r = subprocess.run([sys.executable, "-c", code, *args], cwd=ROOT, capture_output=True, text=True, timeout=900,
                       env={**os.environ, "PYTHONPATH": ROOT, **env})
    assert r.returncode == 0, r.stderr[-5000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


def test_qk_rmsnorm_rope_triton_reduces_a_head_as_rmsnorm_reduces_its_row():
    """Compiled for sm_90: each head's load has the rmsnorm kernel's row layout (elements a lane,
    lanes, one warp a row), and the arithmetic from the squares to the rsqrt is rmsnorm's for each of a
    lane's heads, at head sizes 64/128/256, bf16/fp16/fp32, weights of the input's dtype or another
    (aligned or not), a head size of 80."""
    pytest.importorskip("triton")
    import json

    cases = [[64, "bf16", "fp32", True], [128, "bf16", "bf16", True], [256, "bf16", "bf16", True],
             [128, "fp32", "fp32", True], [256, "fp32", "fp32", True], [256, "fp16", "fp32", True], [80, "bf16", "bf16", True],
             [256, "fp32", "bf16", True], [256, "fp32", "bf16", False]]  # a bf16 weight widens fp32's row, unless misaligned
    for got in _subprocess(_TRITON_SM90, {"TRITON_INTERPRET": "0"}, json.dumps(cases)):
        (rms,), layouts = got["rms_layout"], got["layout"]
        spt, tpw, wpc = (re.search(rf"{k} = \[([\d, ]+)\]", rms).group(1) for k in ("sizePerThread", "threadsPerWarp",
                                                                                     "warpsPerCTA"))
        assert len(layouts) == 1 and re.fullmatch(  # the head dim as rmsnorm's row; heads over the other warps
            rf"\{{sizePerThread = \[1, {spt}\], threadsPerWarp = \[1, {tpw}\], warpsPerCTA = \[\d+, {wpc}\], "
            r"order = \[1, 0\]\}", layouts[0]), (got["case"], rms, layouts)
        # a lane's rows interleave, each with rmsnorm's operations (the layout above fixes their order)
        assert sorted(got["reduction"]) == sorted(got["rms_reduction"] * got["rows"]), got["case"]


_TILELANG_SM90 = r"""
import json, os, re, sys
from torch_kernels.backends import tilelang_jit as _jit
from torch_kernels.families.norm import tilelang as norm
from torch_kernels.families.rope import tilelang as rope

def reduction(source):
    # the sum of squares over a thread's registers, the lanes' all-reduce and the rsqrt
    return [re.sub(r"\brv_\d+\b", "rv", line.strip()) for line in source.splitlines()
            if re.match(r"\s*rstd\[0\] = ", line)]

out = []
for qk_key, rms_key in json.loads(sys.argv[1]):
    mine = _jit.compiled("qk_rmsnorm_rope", rope._qk_build, *qk_key).get_kernel_source()
    rms = _jit.compiled("rmsnorm", norm._build, *rms_key).get_kernel_source()
    out.append(dict(case=qk_key, mine=reduction(mine), rms=reduction(rms)))
print(json.dumps(out))
"""


def test_qk_rmsnorm_rope_tilelang_reduces_a_head_as_rmsnorm_reduces_its_row(tmp_path):
    """Compiled for sm_90: the generated sum of squares, all-reduce and rsqrt of each (token, head)
    row are rmsnorm's at head_size (its fragment layout), for query and key, bf16 at 128 and fp32 at 256."""
    pytest.importorskip("tilelang")
    import json

    from torch_kernels.backends import tilelang_jit as _jit

    cases = [[[32, 8, 128, 128, True, "bfloat16", "bfloat16", "bfloat16", "float32", "int64", 2],
              [128, "bfloat16", "bfloat16", False, False]],
             [[8, 1, 256, 128, True, "float32", "float32", "float32", "float32", "int64", 3],
              [256, "float32", "float32", False, False]]]
    env = {_jit.ENV_TARGET: json.dumps(_jit.SM90), "TILELANG_CACHE_DIR": str(tmp_path / "cache")}
    for got in _subprocess(_TILELANG_SM90, env, json.dumps(cases)):
        assert len(got["rms"]) == 4, got["rms"]  # zero, the registers, the all-reduce, the rsqrt
        assert got["mine"] == 2 * got["rms"], got["case"]  # the query rows' and the key rows'


_TILELANG_ROTATIONS = r"""
import json, re
from torch_kernels.backends import tilelang_jit as _jit
from torch_kernels.families.kv_cache import tilelang as kv
from torch_kernels.families.rope import tilelang as rope

kernels = {
    "rotary_embedding": (rope._build, (4, 2, 64, 64, True, "float32", "float32", "int64", 2, True)),
    "qk_rmsnorm_rope": (rope._qk_build, (1, 1, 64, 64, True, "float32", "float32", "float32", "float32", "int64", 2)),
    "rotary_embedding_and_cache": (kv._build_rope, (4, 2, 64, 64, True, "float32", "float32", "int64", "float32", True)),
}
out = {}
for name, (build, key) in kernels.items():
    source = _jit.compiled(name, build, *key).get_kernel_source()
    out[name] = dict(sub=len(re.findall(r"__fsub_rn\(__fmul_rn\(", source)), add=len(re.findall(r"__fadd_rn\(__fmul_rn\(", source)))
print(json.dumps(out))
"""


def test_tilelang_rotations_round_each_product(tmp_path):
    """Compiled for sm_90: every TileLang kernel that rotates (rope's two, the KV cache's fused write)
    writes ``x1 cos - x2 sin`` and ``x2 cos + x1 sin`` with rounded fp32 calls, which nvcc cannot fuse
    into a multiply-add as the surrounding code happens to schedule it (it did, differently in the
    fused kernel, one fp32 ulp from rotary_embedding's), so that they turn a pair to the same bits."""
    pytest.importorskip("tilelang")
    import json

    from torch_kernels.backends import tilelang_jit as _jit

    env = {_jit.ENV_TARGET: json.dumps(_jit.SM90), "TILELANG_CACHE_DIR": str(tmp_path / "cache")}
    got = _subprocess(_TILELANG_ROTATIONS, env)
    assert set(got) == {"rotary_embedding", "qk_rmsnorm_rope", "rotary_embedding_and_cache"}
    for name, counts in got.items():
        assert counts["sub"] >= 1 and counts["sub"] == counts["add"], (name, counts)
