"""The kv_cache family: every backend that runs here against a formula written as plain loops over the
tokens (not the reference's vectorised indexing), on padded and out-of-range slots, qkv slices, fp8
caches and strided cache layouts; bad input named and nothing written; entries no slot names untouched."""

import pytest
import torch

import torch_kernels
from torch_kernels import dispatch, fp8 as _fp8
from torch_kernels.families.kv_cache import ops as kv_ops

from conftest import assert_bad_inputs_raise, bits, implementations_on, triton_here

OP = "reshape_and_cache_flash"
DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def _e4m3(x: float) -> float:
    """``x`` rounded to the nearest float8_e4m3fn value, ties to even, saturating at +-448, from the
    format's definition (3 mantissa bits, exponent -6 for normals, subnormal spacing 2^-9)."""
    import math
    if math.isnan(x):
        return x
    a = min(abs(x), 448.0)
    if a == 0:
        return math.copysign(0.0, x)
    e = max(math.floor(math.log2(a)), -6)
    step = 2.0 ** (e - 3)
    q = a / step
    r = math.floor(q)
    if q - r > 0.5 or (q - r == 0.5 and r % 2 == 1):
        r += 1
    return math.copysign(min(r * step, 448.0), x)


def expected_caches(key, value, key_cache, value_cache, slots, kv_cache_dtype, k_scale, v_scale):
    """What the caches must hold after the call, token by token: a slot in the cache receives the
    token's rows (fp8: each value divided by the scale in fp32 and rounded to e4m3); others nothing."""
    kc, vc = key_cache.clone(), value_cache.clone()
    blocks, block_size = kc.shape[:2]
    quant = kv_cache_dtype != "auto"
    for t, s in enumerate(slots.tolist()):
        if not 0 <= s < blocks * block_size:
            continue
        for cache, x, scale in ((kc, key, k_scale), (vc, value, v_scale)):
            row = x[t]
            if quant:
                scale32 = torch.tensor(float(scale.reshape(())), dtype=torch.float32)
                y = (row.float() / scale32).flatten().tolist()  # the IEEE fp32 quotient, element by element
                row = torch.tensor([_e4m3(v) for v in y], dtype=torch.float32).reshape(row.shape).to(_fp8.FP8)
            cache[s // block_size, s % block_size] = row.view(torch.uint8) if cache.dtype == torch.uint8 else row.to(cache.dtype)
    return kc, vc


def assert_caches(got, want, what=""):
    for name, g, w in zip(("key_cache", "value_cache"), got, want):
        differ = bits(g.cpu()) != bits(w.cpu())
        assert not differ.any(), f"{what} {name}: {int(differ.sum())} of {g.numel()} values differ"


def _clone_caches(args):
    from torch_kernels.testing import clone_keep_strides
    return (*args[:2], clone_keep_strides(args[2]), clone_keep_strides(args[3]), *args[4:])


def _impls(device="cpu"):
    return [pytest.param(name, fn, id=name) for name, fn in implementations_on(OP, device)]


CASES = [pytest.param(c, id="-".join(map(str, c))) for c in kv_ops.SAMPLE_CASES]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("case", CASES)
def test_every_backend_matches_the_loop_formula(case, dtype):
    for name, fn in implementations_on(OP, "cpu"):
        args = _clone_caches(kv_ops.cache_args(*case, "cpu", dtype))
        want = expected_caches(*args)
        fn(*args)
        assert_caches(args[2:4], want, name)


def test_uint8_fp8_caches_hold_the_float8_bits():
    """An fp8 cache allocated as uint8 (vLLM's) gets the bits a float8_e4m3fn cache gets."""
    for name, fn in implementations_on(OP, "cpu"):
        args = _clone_caches(kv_ops.cache_args(6, 2, 128, 2, 16, 2, 4, "kv", True, "cpu", torch.bfloat16))
        as_bits = (*args[:2], args[2].view(torch.uint8).clone(), args[3].view(torch.uint8).clone(), *args[4:])
        fn(*args)
        fn(*as_bits)
        assert_caches(as_bits[2:4], (args[2].view(torch.uint8), args[3].view(torch.uint8)), name)


def test_reference_e4m3_bits_are_torchs_cast():
    """The reference's arithmetic e4m3 encoding (no fp8 tensor: opcheck's schema check) against torch's
    ``clamp(-448, 448).to(float8_e4m3fn)``: a million values over 20 binades, the specials, subnormals."""
    from torch_kernels.families.kv_cache.reference import e4m3_bits
    torch.manual_seed(0)
    x = torch.randn(1 << 20) * torch.exp2(torch.randint(-14, 10, (1 << 20,)).float())
    special = torch.tensor([0.0, -0.0, 448.0, 449.0, 464.0, -465.0, 1e30, float("inf"), -float("inf"),
                            2.0 ** -9, 1.5 * 2 ** -9, 0.5 * 2 ** -9, -0.5 * 2 ** -9, 2.5 * 2 ** -9, 2.0 ** -6 * 1.0625])
    x = torch.cat([x, special])
    want = x.clamp(-448, 448).to(_fp8.FP8).view(torch.uint8)
    assert torch.equal(e4m3_bits(x), want)
    assert e4m3_bits(torch.tensor([float("nan"), -float("nan")])).tolist() == [0x7F, 0x7F]


@pytest.mark.parametrize("quant", [False, True], ids=["auto", "fp8"])
def test_out_of_range_slots_write_nothing(quant):
    """Slots past the cache and below -1 are skipped like -1, on every backend; the rest are written."""
    for name, fn in implementations_on(OP, "cpu"):
        args = list(kv_ops.cache_args(6, 2, 64, 3, 4, 0, 0, "nhd", quant, "cpu", torch.bfloat16))
        args[4] = torch.tensor([5, 12, -1, 1000, -7, 0], dtype=torch.int64)  # 12 slots: 12 and 1000 past the end
        args = _clone_caches(args)
        want = expected_caches(*args)
        fn(*args)
        assert_caches(args[2:4], want, name)


def test_only_padded_slots_write_nothing():
    for name, fn in implementations_on(OP, "cpu"):
        args = list(kv_ops.cache_args(3, 2, 64, 2, 4, 3, 0, "nhd", False, "cpu", torch.float32))
        before = (args[2].clone(), args[3].clone())
        fn(*args)
        assert_caches(args[2:4], before, name)


def test_a_repeated_slot_holds_one_writers_values():
    for name, fn in implementations_on(OP, "cpu"):
        k, v, kc, vc, _, dt, ks, vs = kv_ops.cache_args(4, 2, 64, 2, 4, 0, 0, "nhd", False, "cpu", torch.float32)
        slots = torch.tensor([3, 6, 3, 3], dtype=torch.int64)
        fn(k, v, kc, vc, slots, dt, ks, vs)
        for cache, x in ((kc, k), (vc, v)):
            got = cache[0, 3]
            assert ((got == x[0]) | (got == x[2]) | (got == x[3])).all(), name
            assert torch.equal(cache[1, 2], x[1]), name


def test_fp8_divides_by_the_scale_and_saturates():
    """Values whose quotient by the scale is past 448 saturate; NaN stays NaN; and the division is not
    a product by the reciprocal: 1.545452356338501 / 1.4545433521270752 rounds to e4m3 1.0, times the
    fp32 reciprocal to 1.125."""
    k = torch.tensor([[[1000.0, -1000.0, float("nan"), 0.0]]])
    v = torch.tensor([[[1.545452356338501, -1.545452356338501, 1.0, 2.0]]])
    k_scale, v_scale = torch.tensor(0.1), torch.tensor([1.4545433521270752])
    for name, fn in implementations_on(OP, "cpu"):
        kc, vc = kv_ops.make_caches(1, 1, 1, 4, _fp8.FP8, "cpu")
        fn(k, v, kc, vc, torch.tensor([0]), "fp8_e4m3", k_scale, v_scale)
        got = kc.float().flatten().tolist()
        assert got[:2] == [448.0, -448.0] and got[2] != got[2] and got[3] == 0.0, (name, got)
        got = vc.float().flatten().tolist()
        assert got[:2] == [1.0, -1.0], (name, got)
        assert got == [_e4m3(float(x)) for x in (v.flatten() / v_scale.expand(4)).tolist()], name


def test_entries_no_slot_names_are_untouched():
    """Random caches: after the call, every slot but the written ones holds its old bits."""
    for name, fn in implementations_on(OP, "cpu"):
        args = _clone_caches(kv_ops.cache_args(5, 2, 128, 4, 16, 2, 4, "kv", True, "cpu", torch.bfloat16))
        before = (args[2].clone(), args[3].clone())
        fn(*args)
        written = {s for s in args[4].tolist() if s >= 0}
        for b in range(4):
            for o in range(16):
                if b * 16 + o not in written:
                    assert torch.equal(bits(args[2][b, o]), bits(before[0][b, o])), name
                    assert torch.equal(bits(args[3][b, o]), bits(before[1][b, o])), name


def test_triton_kernel_with_each_config():
    triton = triton_here("kv_cache", "cpu")
    for config in (triton.TritonCacheConfig(1, 1), triton.TritonCacheConfig(2, 1), triton.TritonCacheConfig(4, 2)):
        args = _clone_caches(kv_ops.cache_args(5, 3, 64, 3, 4, 1, 2, "hnd", True, "cpu", torch.float16))
        want = expected_caches(*args)
        triton.reshape_and_cache_flash(*args, config=config)
        assert_caches(args[2:4], want, str(config))


_TRITON_SM90 = r"""
import json, sys, warnings
warnings.filterwarnings("ignore")
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from torch_kernels.families.kv_cache import triton as kv

def compile_(fn, types, const, num_warps):
    names = fn.arg_names
    sig = {n: "constexpr" if n in const else types.get(n, "i64") for n in names}
    return triton.compile(ASTSource(fn, sig, const, {}), target=GPUTarget("cuda", 90, 32),
                          options=dict(num_warps=num_warps)).asm["ptx"]

out = []
for dt, cache, bh, bd, quant in (("bf16", "bf16", 8, 128, False), ("bf16", "fp8e4nv", 1, 128, True),
                                 ("fp32", "fp8e4nv", 2, 64, True), ("fp16", "fp16", 4, 256, False)):
    types = dict(k_ptr="*" + dt, v_ptr="*" + dt, kc_ptr="*" + cache, vc_ptr="*" + cache, slot_ptr="*i64",
                 k_scale_ptr="*fp32", v_scale_ptr="*fp32", num_heads="i32", head_size="i32")
    ptx = compile_(kv._cache_kernel, types, dict(BLOCK_H=bh, BLOCK_D=bd, QUANT=quant, EMULATE=False), 4)
    out.append(["cache", dt, cache, quant, "div.rn.f32" in ptx, "cvt.rn.satfinite.e4m3x2.f32" in ptx])
for dt, cache, bh, neox, passed, quant in (("bf16", "bf16", 8, True, False, False), ("bf16", "fp8e4nv", 1, True, False, True),
                                           ("fp16", "fp16", 2, False, True, False), ("fp32", "fp8e4nv", 4, False, True, True)):
    types = dict(pos_ptr="*i64", q_ptr="*" + dt, k_ptr="*" + dt, v_ptr="*" + dt, cs_ptr="*fp32", kc_ptr="*" + cache,
                 vc_ptr="*" + cache, slot_ptr="*i64", k_scale_ptr="*fp32", v_scale_ptr="*fp32", num_q_heads="i32",
                 num_kv_heads="i32", head_size="i32", rot_half="i32", max_position="i32", num_slots="i64", block_size="i32")
    const = dict(BLOCK_H=bh, BLOCK_D=64 if not passed else 32, BLOCK_P=64 if passed else 1, BLOCK_V=128, HAS_PASS=passed,
                 IS_NEOX=neox, QUANT=quant, EMULATE=False)
    ptx = compile_(kv._rope_cache_kernel, types, const, 4)
    out.append(["rope", dt, cache, quant, "div.rn.f32" in ptx, "cvt.rn.satfinite.e4m3x2.f32" in ptx])
print(json.dumps(out))
"""


def test_triton_kernels_compile_for_sm90():
    """Both Triton kernels compile for sm_90 without a GPU (a fresh process: this one runs Triton's
    interpreter), and the fp8 ones divide with div.rn and cast with the saturating cvt."""
    import json
    import os
    import subprocess
    import sys
    pytest.importorskip("triton")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    r = subprocess.run([sys.executable, "-c", _TRITON_SM90], cwd=root, env={**env, "PYTHONPATH": root},
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    rows = json.loads(r.stdout.strip().splitlines()[-1])
    assert len(rows) == 8
    for kernel, dt, cache, quant, div_rn, satfinite in rows:
        assert div_rn == satfinite == quant, (kernel, dt, cache)


# --- bad input ------------------------------------------------------------------------------------

def _bad_cases():
    base = kv_ops.cache_args(4, 2, 64, 3, 4, 1, 0, "nhd", False, "cpu", torch.float32)
    fp8 = kv_ops.cache_args(4, 2, 64, 3, 4, 1, 0, "nhd", True, "cpu", torch.float32)
    k, v, kc, vc, s, dt, ks, vs = base

    def with_(i, x, a=base):
        return tuple(x if j == i else y for j, y in enumerate(a))
    other_heads = kv_ops.make_caches(3, 4, 3, 64, torch.float32, "cpu")
    other_d = kv_ops.make_caches(3, 4, 2, 32, torch.float32, "cpu")
    return [
        ("key 2-D", with_(0, k.flatten(1)), ValueError, "key"),
        ("key int", with_(0, k.to(torch.int32)), TypeError, "key"),
        ("key last dim strided", with_(0, k.transpose(1, 2).contiguous().transpose(1, 2)), ValueError, "key"),
        ("value other dtype", with_(1, v.half()), TypeError, "value"),
        ("value other shape", with_(1, v[:, :1]), ValueError, "value"),
        ("cache of other head count", with_(2, other_heads[0]), ValueError, "key_cache"),
        ("cache of other head size", with_(2, other_d[0]), ValueError, "key_cache"),
        ("value cache other heads", with_(3, other_heads[1]), ValueError, "value_cache"),
        ("cache 3-D", with_(2, kc.flatten(0, 1)), ValueError, "key_cache"),
        ("cache other dtype", with_(2, kc.half()), TypeError, "key_cache"),
        ("cache last dim strided", with_(2, kc.transpose(-1, -2).contiguous().transpose(-1, -2)), ValueError, "key_cache"),
        ("fp8 with a bf16 cache", with_(5, "fp8"), TypeError, "key_cache"),
        ("auto with an fp8 cache", with_(5, "auto", fp8), TypeError, "key_cache"),
        ("unknown cache dtype", with_(5, "fp8_e5m2"), ValueError, "kv_cache_dtype"),
        ("slots int32", with_(4, s.int()), TypeError, "slot_mapping"),
        ("slots of other length", with_(4, s[:3]), ValueError, "slot_mapping"),
        ("slots 2-D", with_(4, s[:, None]), ValueError, "slot_mapping"),
        ("k_scale of 2 values", with_(6, torch.ones(2)), ValueError, "k_scale"),
        ("k_scale fp16", with_(6, ks.half()), TypeError, "k_scale"),
        ("v_scale 2-D", with_(7, torch.ones(1, 1)), ValueError, "v_scale"),
        ("one cache for both", with_(3, kc), ValueError, "value_cache"),
        ("key inside the cache", with_(0, kc[0, :4]), ValueError, "key_cache"),
    ]


def test_bad_input_is_named_and_nothing_is_written():
    assert_bad_inputs_raise(OP, _bad_cases())


def test_bad_input_at_trace_time():
    k, v, kc, vc, s, dt, ks, vs = kv_ops.cache_args(4, 2, 64, 3, 4, 1, 0, "nhd", False, "cpu", torch.float32)
    compiled = torch.compile(torch.ops.deepinfer.reshape_and_cache_flash, backend="eager", fullgraph=True)
    with pytest.raises(Exception, match=r"deepinfer::reshape_and_cache_flash: argument 'key_cache' must have 2 kv heads"):
        compiled(k, v, kc[:, :, :1], vc[:, :, :1], s, dt, ks, vs)


@pytest.fixture
def checking_slots(monkeypatch):
    monkeypatch.setattr(kv_ops, "CHECK_SLOTS", True)


@pytest.mark.parametrize("slots, match", [([0, 12, -1, 3], r"must lie in \[-1, 12\)"), ([0, -2, 1, 3], r"must lie in"),
                                          ([5, 1, 5, -1], "names 1 slot"), ([-1, -1, 2, 3], None)])
def test_slot_check_when_switched_on(checking_slots, slots, match):
    args = list(kv_ops.cache_args(4, 2, 64, 3, 4, 0, 0, "nhd", False, "cpu", torch.float32))
    args[4] = torch.tensor(slots, dtype=torch.int64)
    if match is None:
        torch.ops.deepinfer.reshape_and_cache_flash(*args)  # repeated -1 is padding, not a repeat
        return
    assert_bad_inputs_raise(OP, [("slots", tuple(args), ValueError, "slot_mapping")])


def test_slot_check_is_off_by_default():
    import os
    assert kv_ops.CHECK_SLOTS == (os.environ.get("DEEPINFER_CHECK_KV_SLOTS", "").strip() == "1")
    args = list(kv_ops.cache_args(4, 2, 64, 3, 4, 0, 0, "nhd", False, "cpu", torch.float32))
    args[4] = torch.tensor([0, 1000, 5, 5], dtype=torch.int64)
    if not kv_ops.indices_checked(args[4]):  # DEEPINFER_OPS_CHECK_INDICES=1 checks them too
        torch.ops.deepinfer.reshape_and_cache_flash(*args)


def test_configure_check_indices_decides_over_check_slots(monkeypatch):
    """``configure(check_indices=True)`` checks the slots whatever ``CHECK_SLOTS`` says, ``False`` never,
    ``None`` as ``CHECK_SLOTS`` says."""
    args = list(kv_ops.cache_args(4, 2, 64, 3, 4, 0, 0, "nhd", False, "cpu", torch.float32))
    args[4] = torch.tensor([0, 12, -1, 3], dtype=torch.int64)
    previous = dispatch.configure(check_indices=True)
    try:
        for slots_flag in (False, True):
            monkeypatch.setattr(kv_ops, "CHECK_SLOTS", slots_flag)
            assert_bad_inputs_raise(OP, [("slots", tuple(args), ValueError, "slot_mapping")])
        dispatch.configure(check_indices=False)
        torch.ops.deepinfer.reshape_and_cache_flash(*args)  # slot 12, past the cache, is skipped unchecked
        dispatch.configure(check_indices=None)
        assert_bad_inputs_raise(OP, [("slots", tuple(args), ValueError, "slot_mapping")])
    finally:
        dispatch.configure(previous)


def test_wrapper_is_the_op():
    args = kv_ops.cache_args(3, 2, 64, 3, 4, 0, 0, "nhd", False, "cpu", torch.float32)
    a, b = _clone_caches(args), _clone_caches(args)
    torch_kernels.reshape_and_cache_flash(*a)
    torch.ops.deepinfer.reshape_and_cache_flash(*b)
    assert_caches(a[2:4], b[2:4])


# --- GPU ------------------------------------------------------------------------------------------

@pytest.mark.gpu
@pytest.mark.parametrize("quant", [False, True], ids=["auto", "fp8"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("case", CASES)
def test_every_backend_on_cuda(case, dtype, quant):
    case = (*case[:-1], quant)
    for name, fn in implementations_on(OP, "cuda"):
        args = _clone_caches(kv_ops.cache_args(*case, "cuda", dtype))
        want = expected_caches(*(a.cpu() if isinstance(a, torch.Tensor) else a for a in args))
        fn(*args)
        assert_caches(args[2:4], want, name)


def _outside(num_slots, tokens, device):
    """Slots that name nothing in a cache of ``num_slots``: -5..-1 or past the end, up to 3x."""
    low = torch.randint(-5, 0, (tokens,), device=device)
    high = torch.randint(num_slots, 3 * num_slots, (tokens,), device=device)
    return torch.where(torch.rand(tokens, device=device) < 0.5, low, high)


@pytest.mark.gpu
@pytest.mark.parametrize("tokens", [1, 32, 4096])
@pytest.mark.parametrize("quant", [False, True], ids=["auto", "fp8"])
def test_bench_shapes_on_cuda_with_out_of_range_slots(tokens, quant):
    """Qwen3-8B's shapes, a quarter of the slots padded or outside the cache (never an illegal address)."""
    for name, fn in implementations_on(OP, "cuda"):
        k, v, kc, vc, slots = kv_ops.bench_kv(tokens, "gpu", "cuda", torch.bfloat16, fused_q_heads=32)
        if quant:
            kc, vc = kv_ops.make_caches(kc.shape[0], 16, 8, 128, _fp8.FP8, "cuda")
        n = kc.shape[0] * 16
        bad = torch.rand(tokens, device="cuda") < 0.25
        slots = torch.where(bad, _outside(n, tokens, "cuda"), slots)
        ks, vs = kv_ops.make_scales("cuda")
        args = (k, v, kc, vc, slots, "fp8" if quant else "auto", ks, vs)
        want = expected_caches(*(a.cpu() if isinstance(a, torch.Tensor) else a for a in args)) if tokens <= 32 else None
        if want is None:
            from torch_kernels.families.kv_cache import reference
            want = _clone_caches(tuple(a.clone() if isinstance(a, torch.Tensor) else a for a in args))
            reference.reshape_and_cache_flash(*want)
            want = want[2:4]
        fn(*args)
        torch.cuda.synchronize()
        assert_caches((kc, vc), want, name)


@pytest.mark.gpu
def test_cuda_graph_capture():
    args = kv_ops.cache_args(8, 2, 128, 4, 16, 2, 4, "kv", True, "cuda", torch.bfloat16)
    want = expected_caches(*(a.cpu() if isinstance(a, torch.Tensor) else a for a in args))
    torch.ops.deepinfer.reshape_and_cache_flash(*_clone_caches(args))  # warm: compiles, selects
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        torch.ops.deepinfer.reshape_and_cache_flash(*args)
    graph.replay()
    torch.cuda.synchronize()
    assert_caches(args[2:4], want)


def test_tilelang_launcher_takes_misaligned_views_value_by_value():
    """The vector kernel only where every used stride and pointer is a vector multiple (checked on CPU
    tensors; the kernels compile for sm_90 in tests/test_tilelang.py)."""
    pytest.importorskip("tilelang")
    from torch_kernels.families.kv_cache import tilelang as tl_cache
    k, v, kc, vc, *_ = kv_ops.cache_args(4, 2, 64, 3, 4, 0, 4, "kv", False, "cpu", torch.bfloat16)
    assert tl_cache._aligned(8, (k, v), (kc, vc))
    qkv = torch.randn(4, 8 * 64 + 3, dtype=torch.bfloat16)
    odd = qkv[:, 3:3 + 128].unflatten(1, (2, 64))  # rows start 3 values into a vector
    assert not tl_cache._aligned(8, (odd, v), (kc, vc))
    one_token = kv_ops.make_kv(1, 2, 64, torch.bfloat16, "cpu", 4)[0]  # a size-1 dim's stride is not used
    assert tl_cache._aligned(8, (one_token, one_token), (kc, vc))


@pytest.mark.gpu
def test_tilelang_one_kernel_serves_every_batch_and_cache_size():
    from torch_kernels.backends import tilelang_jit as _jit
    from torch_kernels.families.kv_cache import tilelang as tl_cache
    sizes = None
    for tokens, blocks in ((1, 2), (37, 9), (300, 40), (5, 1000)):
        args = kv_ops.cache_args(tokens, 8, 128, blocks, 16, min(tokens, 2), 32, "nhd", True, "cuda", torch.bfloat16)
        want = _clone_caches(args)
        from torch_kernels.families.kv_cache import reference
        reference.reshape_and_cache_flash(*want)
        tl_cache.reshape_and_cache_flash(*args)
        assert_caches(args[2:4], want[2:4], f"{tokens} tokens")
        sizes = sizes or _jit.memo_size()
    assert _jit.memo_size() == sizes


# --- rotary_embedding_and_cache -------------------------------------------------------------------

ROPE_OP = "rotary_embedding_and_cache"
ROPE_CASES = [pytest.param(c, id="-".join(str(x).replace("torch.", "") for x in c)) for c in kv_ops.ROPE_CASES]


def _rotate_formula(x, positions, cos_sin, is_neox):
    """Heads ``x`` ``(T, H, hs)`` rotated, token by token and head by head, in numpy fp32 (each product
    and sum rounded to fp32, as the ops compute), returned in x's dtype; positions outside the cache NaN."""
    import numpy as np
    out = x.clone()
    half = cos_sin.shape[1] // 2
    for t, p in enumerate(positions.tolist()):
        if 0 <= p < cos_sin.shape[0]:
            c = cos_sin[p, :half].float().numpy()
            s = cos_sin[p, half:].float().numpy()
        else:
            c = s = np.full(half, np.nan, dtype=np.float32)
        for h in range(x.shape[1]):
            row = x[t, h].float().numpy()
            i1 = np.arange(half) if is_neox else 2 * np.arange(half)
            i2 = i1 + (half if is_neox else 1)
            x1, x2 = row[i1], row[i2]
            new = row.copy()
            new[i1] = x1 * c - x2 * s
            new[i2] = x2 * c + x1 * s
            out[t, h] = torch.from_numpy(new).to(x.dtype)
    return out


def expected_rope(positions, q, k, v, hs, cos_sin, neox, kc, vc, slots, dt, ks, vs):
    heads = lambda x: x if x.dim() == 3 else x.unflatten(1, (-1, hs))  # noqa: E731
    q_want = _rotate_formula(heads(q), positions, cos_sin, neox).reshape(q.shape)
    k_rot = _rotate_formula(heads(k), positions, cos_sin, neox)
    return q_want, expected_caches(k_rot, heads(v), kc, vc, slots, dt, ks, vs)


def _clone_rope(args):
    from torch_kernels.testing import clone_keep_strides
    return tuple(clone_keep_strides(a) if i in (1, 2, 3, 7, 8) else a for i, a in enumerate(args))


def _assert_same(got, want, what):
    differ = bits(got.cpu()) != bits(want.cpu())
    assert not differ.any(), f"{what}: {int(differ.sum())} of {got.numel()} values differ"


def _assert_rotated_close(got, want, dtype, what):
    """Rotated values within the dtype's tolerance (fp8: one e4m3 step): Triton's interpreter rounds
    fp32 to bf16/fp16 its own way (not to nearest even), the GPU contracts to FMA."""
    from torch_kernels.testing import assert_close
    if got.dtype in (_fp8.FP8, torch.uint8):
        _fp8.assert_steps(what, got.view(_fp8.FP8).cpu(), want.view(_fp8.FP8).cpu(), 1)
    else:
        assert_close(got.cpu(), want.cpu(), dtype, msg=what)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("case", ROPE_CASES)
def test_rope_every_backend_matches_the_loop_formula(case, dtype):
    """Bit for bit where the backend rounds as the formula does (the reference; fp32 everywhere), else
    within the tolerance; the value cache always exact, the key never written."""
    for name, fn in implementations_on(ROPE_OP, "cpu"):
        args = _clone_rope(kv_ops.rope_case_args(case, "cpu", dtype))
        key_before = args[2].clone()
        q_want, caches_want = expected_rope(*_clone_rope(args))
        fn(*args)
        if name != "triton-interpreted" or dtype == torch.float32:
            _assert_same(args[1], q_want, f"{name} query")
            assert_caches(args[7:9], caches_want, name)
        else:
            _assert_rotated_close(args[1], q_want, dtype, f"{name} query")
            _assert_rotated_close(args[7], caches_want[0], dtype, f"{name} key_cache")
            _assert_same(args[8], caches_want[1], f"{name} value_cache")
        _assert_same(args[2], key_before, f"{name} key (must not be written)")


def _unfused(positions, q, k, v, hs, cos_sin, neox, kc, vc, slots, dt, ks, vs, rope, cache):
    rope(positions, q, k, hs, cos_sin, neox)
    heads = lambda x: x if x.dim() == 3 else x.unflatten(1, (-1, hs))  # noqa: E731
    cache(heads(k), heads(v), kc, vc, slots, dt, ks, vs)


def _backend_pairs(device):
    """(name, fused, rotary_embedding, reshape_and_cache_flash) of each backend that has all three here."""
    from torch_kernels import registry
    from torch_kernels.spec import Backend
    out = []
    for backend in (Backend.TORCH, Backend.TRITON, Backend.TILELANG):
        specs = [registry.BY_OP[op].get(backend) for op in (ROPE_OP, "rotary_embedding", OP)]
        if None in specs:
            continue
        if backend is Backend.TRITON and device == "cpu":
            triton_here("kv_cache", "cpu")
        elif backend is Backend.TILELANG and device == "cpu":
            continue
        out.append((backend.value, *(s.load() for s in specs)))
    return out


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("case", ROPE_CASES)
def test_rope_fused_equals_the_unfused_pair_on_each_backend(case, dtype):
    for name, fused, rope, cache in _backend_pairs("cpu"):
        args = kv_ops.rope_case_args(case, "cpu", dtype)
        a, b = _clone_rope(args), _clone_rope(args)
        fused(*a)
        _unfused(*b, rope, cache)
        _assert_same(a[1], b[1], f"{name} query")
        assert_caches(a[7:9], b[7:9], name)


def test_rope_positions_outside_the_cache_give_nan_by_default():
    """Unchecked (the default: no sync), a token at a position outside the cache gets NaN in its
    rotated dims, in the query and the cached key; the other tokens are exact."""
    for name, fn in implementations_on(ROPE_OP, "cpu"):
        args = list(kv_ops.rope_args(4, 2, 1, 64, 32, True, "2d", 2, 4, 0, False, "cpu", torch.float32))
        args[0] = torch.tensor([3, 37, -1, 0])  # 37 rows in the cache
        args = _clone_rope(args)
        q_want, caches_want = expected_rope(*_clone_rope(args))
        if kv_ops.indices_checked(args[0]):
            pytest.skip("DEEPINFER_CHECK_KV_SLOTS=1 or DEEPINFER_OPS_CHECK_INDICES=1: positions are checked")
        fn(*args)
        _assert_same(args[1], q_want, f"{name} query")
        assert_caches(args[7:9], caches_want, name)
        row = args[1][1].unflatten(0, (2, 64))
        assert row[:, :32].isnan().all() and not row[:, 32:].isnan().any() and not args[1][0].isnan().any()


def test_rope_position_check_when_switched_on(checking_slots):
    args = list(kv_ops.rope_args(4, 2, 1, 64, 64, True, "2d", 2, 4, 0, False, "cpu", torch.float32))
    args[0] = torch.tensor([3, 37, 1, 0])
    slots_bad = list(args)
    slots_bad[0], slots_bad[9] = torch.tensor([3, 1, 1, 0]), torch.tensor([1, 2, 1, 0])
    assert_bad_inputs_raise(ROPE_OP, [("position", tuple(args), ValueError, "positions"),
                                      ("repeated slot", tuple(slots_bad), ValueError, "slot_mapping")])


def _rope_bad_cases():
    base = kv_ops.rope_args(4, 2, 1, 64, 32, True, "qkv", 3, 4, 1, False, "cpu", torch.float32)
    p, q, k, v, hs, cs, neox, kc, vc, s, dt, ks, vs = base

    def with_(i, x):
        return tuple(x if j == i else y for j, y in enumerate(base))
    return [
        ("positions float", with_(0, p.float()), TypeError, "positions"),
        ("positions of other length", with_(0, p[:3]), ValueError, "positions"),
        ("query int", with_(1, q.to(torch.int32)), TypeError, "query"),
        ("query width not heads", with_(1, q[:, :100]), ValueError, "query"),
        ("key other dtype", with_(2, k.half()), TypeError, "key"),
        ("key of other head size", with_(2, k[:, :32]), ValueError, "key"),
        ("value other shape", with_(3, v.unflatten(1, (1, 64))), ValueError, "value"),
        ("head_size 0", with_(4, 0), ValueError, "head_size"),
        ("rot_dim odd", with_(5, cs[:, :31]), ValueError, "cos_sin_cache"),
        ("rot_dim past head_size", with_(5, torch.randn(37, 66)), ValueError, "cos_sin_cache"),
        ("cos_sin fp16", with_(5, cs.half()), TypeError, "cos_sin_cache"),
        ("cache of other head count", with_(7, kv_ops.make_caches(3, 4, 2, 64, torch.float32, "cpu")[0]), ValueError, "key_cache"),
        ("cache of other head size", with_(7, kv_ops.make_caches(3, 4, 1, 32, torch.float32, "cpu")[0]), ValueError, "key_cache"),
        ("fp8 with a float cache", with_(10, "fp8"), TypeError, "key_cache"),
        ("slots int32", with_(9, s.int()), TypeError, "slot_mapping"),
        ("v_scale of 2", with_(12, torch.ones(2)), ValueError, "v_scale"),
        ("query inside the key cache", with_(1, kc[0].flatten(1)[:, :128]), ValueError, "key_cache"),
    ]


def test_rope_bad_input_is_named_and_nothing_is_written():
    assert_bad_inputs_raise(ROPE_OP, _rope_bad_cases())


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("case", ROPE_CASES)
def test_rope_every_backend_on_cuda(case, dtype):
    """Each backend: against the formula (query within the dtype's tolerance: FMA contraction on the
    GPU; caches exact where the rotated key is) and bit for bit against its own unfused pair."""
    from torch_kernels.testing import assert_close
    for name, fn in implementations_on(ROPE_OP, "cuda"):
        args = _clone_rope(kv_ops.rope_case_args(case, "cuda", dtype))
        q_want, _ = expected_rope(*(a.cpu() if isinstance(a, torch.Tensor) else a for a in _clone_rope(args)))
        key_before = args[2].clone()
        fn(*args)
        assert_close(args[1].cpu(), q_want, dtype, msg=f"{name} query")
        _assert_same(args[2], key_before, f"{name} key (must not be written)")
    for name, fused, rope, cache in _backend_pairs("cuda"):
        args = kv_ops.rope_case_args(case, "cuda", dtype)
        a, b = _clone_rope(args), _clone_rope(args)
        fused(*a)
        _unfused(*b, rope, cache)
        _assert_same(a[1], b[1], f"{name} query")
        assert_caches(a[7:9], b[7:9], name)


@pytest.mark.gpu
@pytest.mark.parametrize("tokens", [1, 32, 4096])
@pytest.mark.parametrize("quant", [False, True], ids=["auto", "fp8"])
def test_rope_bench_shapes_on_cuda(tokens, quant):
    """Qwen3-8B (32 q heads, 8 kv heads, head 128, block 16) as qkv slices, some slots padded or past
    the cache: the fused op equals the unfused pair on each backend, bit for bit."""
    for name, fused, rope, cache in _backend_pairs("cuda"):
        args = list(kv_ops.rope_args(tokens, 32, 8, 128, 128, True, "qkv", -(-2 * tokens // 16), 16, 0, quant,
                                     "cuda", torch.bfloat16, max_position=8192))
        n = args[7].shape[0] * 16
        bad = torch.rand(tokens, device="cuda") < 0.25
        args[9] = torch.where(bad, _outside(n, tokens, "cuda"), args[9])
        a, b = _clone_rope(args), _clone_rope(args)
        fused(*a)
        _unfused(*b, rope, cache)
        _assert_same(a[1], b[1], f"{name} query")
        assert_caches(a[7:9], b[7:9], name)


@pytest.mark.gpu
def test_rope_cuda_graph_capture():
    """Captured with the slot and position checks on: they are skipped inside the capture (no sync)."""
    args = kv_ops.rope_args(8, 4, 2, 128, 128, True, "qkv", 4, 16, 2, True, "cuda", torch.bfloat16)
    want = _clone_rope(args)
    torch.ops.deepinfer.rotary_embedding_and_cache(*_clone_rope(args))  # warm: compiles, selects
    torch.ops.deepinfer.rotary_embedding_and_cache(*want)
    graph = torch.cuda.CUDAGraph()
    saved, kv_ops.CHECK_SLOTS = kv_ops.CHECK_SLOTS, True
    try:
        with torch.cuda.graph(graph):
            torch.ops.deepinfer.rotary_embedding_and_cache(*args)
    finally:
        kv_ops.CHECK_SLOTS = saved
    graph.replay()
    torch.cuda.synchronize()
    _assert_same(args[1], want[1], "query")
    assert_caches(args[7:9], want[7:9])


@pytest.mark.gpu
@pytest.mark.parametrize("quant", [False, True], ids=["auto", "fp8"])
def test_misaligned_views_on_cuda(quant):
    """Rows that start 3 values into a 16-byte vector (the value-by-value kernels) on every backend; the
    views themselves are passed (a copy would be aligned anew)."""
    from torch_kernels.families.kv_cache import reference

    def make():
        torch.manual_seed(0)
        buf = torch.randn(6, 3 + (4 + 2 * 2) * 64, device="cuda", dtype=torch.bfloat16)
        q, k, v = buf[:, 3:].split([4 * 64, 2 * 64, 2 * 64], dim=1)
        base = kv_ops.rope_args(6, 4, 2, 64, 64, False, "2d", 3, 4, 1, quant, "cuda", torch.bfloat16)
        return (base[0], q, k, v, *base[4:])

    for name, fn in implementations_on(ROPE_OP, "cuda"):
        got, want = make(), make()
        assert got[1].data_ptr() % 16
        fn(*got)
        reference.rotary_embedding_and_cache(*want)
        _assert_rotated_close(got[1], want[1], torch.bfloat16, f"{name} query")
        _assert_rotated_close(got[7], want[7], torch.bfloat16, f"{name} key_cache")
        _assert_same(got[8], want[8], f"{name} value_cache")
    for name, fn in implementations_on(OP, "cuda"):
        got, want = make(), make()
        got = (got[2].unflatten(1, (2, 64)), got[3].unflatten(1, (2, 64)), *got[7:])
        want = (want[2].unflatten(1, (2, 64)), want[3].unflatten(1, (2, 64)), *want[7:])
        fn(*got)
        reference.reshape_and_cache_flash(*want)
        assert_caches(got[2:4], want[2:4], name)
