"""TileLang ``rotary_embedding``, ``per_token_group_quant_fp8`` and ``merge_attn_states``
(``torch_kernels/families/{rope,quant,attention}/tilelang.py``).

Without a GPU:
* launch layouts and key choice: one key per shape whatever the token count, the value-by-value kernel
  exactly for views off the vector (strides of dimensions of size 1 exempt);
* the generated code of the benchmark shapes, as sm_90 PTX: 16-byte global loads and stores only,
  the hardware e4m3 conversion and IEEE divisions in the quantiser, no spills (``ptxas -v``);
* the generated code run on the CPU against the reference: TileLang's compiled host function as it
  is (argument checks, grid), the device code compiled as host C++ with one OS thread per CUDA thread
  (warp shuffles through per-warp barriers) and an alignment sanitizer, so a vector access off its
  size fails the test. Misaligned views, lone rows with odd strides, non-finite values, empty partials
  and launches split at the 32-bit limits are covered there.

With a GPU (``@pytest.mark.gpu``): the registered ops reach TileLang when it is selected; one compiled
kernel serves every batch size; misaligned views and lone rows; positions outside the cache; the
quantiser bit-equal to the Triton kernel; CUDA-graph capture; offsets past 2^31 elements. The numerics
over dtypes and awkward shapes are also covered by ``test_rope.py``, ``test_quant.py`` and
``test_attention.py``, which compare every available backend with the reference.
"""

import os
import re
import shutil
import subprocess
import sys

import pytest
import torch

tilelang = pytest.importorskip("tilelang")

from torch_kernels import dispatch, registry  # noqa: E402
from torch_kernels.backends import tilelang_jit as _jit  # noqa: E402
from torch_kernels.families.attention import tilelang as attention  # noqa: E402
from torch_kernels.families.quant import tilelang as quant  # noqa: E402
from torch_kernels.families.rope import tilelang as rope  # noqa: E402
from torch_kernels.families.attention import reference as attention_ref  # noqa: E402
from torch_kernels.families.quant import reference as quant_ref  # noqa: E402
from torch_kernels.families.rope import reference as rope_ref  # noqa: E402
from torch_kernels.families.rope import ops as rope_op # noqa: E402
from torch_kernels.fp8 import compare as compare_quant  # noqa: E402
from torch_kernels.spec import Backend  # noqa: E402
from torch_kernels.testing import assert_close  # noqa: E402

from conftest import family_ops  # noqa: E402

# the TileLang ops of this file's modules, one family each (scaled_fp8_quant: tests/test_fp8_tilelang.py)
OPS = tuple(op for m in (rope, quant, attention) for op in family_ops(m.__name__.split(".")[2], Backend.TILELANG)
            if op != "scaled_fp8_quant")
INF = float("inf")
# The H200 benchmark shapes' keys: rope neox 32+8 heads x 128 bf16, quant 7168 g128 bf16, merge 32 x 128 bf16.
BENCH_KEYS = {rope: (32, 8, 128, 128, True, "bfloat16", "float32", "int64", 2, True),
              quant: (128, "bfloat16", False, False, True),
              attention: (32, 128, "bfloat16", True)}


# --- launch layouts --------------------------------------------------------------------------------


def test_rope_layouts():
    for heads in (1, 2, 5, 17, 40, 64, 160):
        for rot_dim in (2, 8, 24, 64, 128, 256, 512):
            for dtype in ("float16", "bfloat16", "float32"):
                for neox in (True, False):
                    vec = rope._vec(rot_dim, neox, dtype)
                    assert vec * (1 if neox else 2) * _jit.ELEMENT_BYTES[dtype] <= 16 and rot_dim // 2 % vec == 0
                    lanes, par, iters, tokens = rope._layout(heads, rot_dim, vec)
                    assert lanes * vec == rot_dim // 2
                    assert par * iters >= heads > par * (iters - 1), "every round but the last is full"
                    assert lanes * par * tokens <= max(rope.RopeConfig.block_threads + lanes, lanes) <= 1024
    # the benchmark shape: 160-thread blocks of one token, 2 rounds of 20 heads
    assert rope._vec(128, True, "bfloat16") == 8 and rope._layout(40, 128, 8) == (8, 20, 2, 1)


def test_quant_and_merge_layouts():
    for group in (1, 2, 8, 16, 32, 64, 128, 256, 512, 1024, 4096, 16384):
        e = quant._per_thread(group)
        assert group % e == 0 and group // e <= 32, "a group's lanes share a warp (shuffles)"
        for dtype in ("float16", "bfloat16", "float32"):
            assert e % quant._vec(group, dtype) == 0 and quant._vec(group, dtype) * _jit.ELEMENT_BYTES[dtype] <= 16
    assert quant._per_thread(128) == 16 and quant._vec(128, "bfloat16") == 8  # 2 loads, 1 fp8 store of 16 B
    for d in (1, 3, 40, 64, 80, 96, 128, 512, 1500):
        e = attention._per_thread(d)
        assert d % e == 0 and e & (e - 1) == 0 and e <= attention.MergeConfig.per_thread
        for dtype in ("float16", "bfloat16", "float32"):
            assert e % attention._vec(d, dtype) == 0 and attention._vec(d, dtype) * _jit.ELEMENT_BYTES[dtype] <= 16


def test_ci_kernels_cover_the_variants():
    keys = [k for name, _, k in rope.ci_kernels() if name == "rotary_embedding"]
    assert {k[5] for k in keys} == {"float16", "bfloat16", "float32"} and {k[4] for k in keys} == {True, False}
    assert any(k[3] < k[2] for k in keys) and any(k[1] == 0 for k in keys)  # partial rotary, no key
    assert {k[6] == "float32" for k in keys} == {True, False} and {k[7] for k in keys} == {"int32", "int64"}
    assert {k[8] for k in keys} == {2, 3} and {k[9] for k in keys} == {True, False} and BENCH_KEYS[rope] in keys
    keys = [k for _, _, k in quant.ci_kernels()]
    assert {k[1] for k in keys} == {"float16", "bfloat16", "float32"} and {64, 128} <= {k[0] for k in keys}
    assert {k[2] for k in keys} == {k[3] for k in keys} == {k[4] for k in keys} == {True, False}
    assert any(k[0] > 32 * quant.QuantConfig.per_thread for k in keys) and BENCH_KEYS[quant] in keys
    keys = [k for _, _, k in attention.ci_kernels()]
    assert {k[2] for k in keys} == {"float16", "bfloat16", "float32"} and {k[3] for k in keys} == {True, False}
    assert any(attention._vec(k[1], k[2]) * _jit.ELEMENT_BYTES[k[2]] < 16 for k in keys)
    assert BENCH_KEYS[attention] in keys


def test_no_call_is_refused():
    """Every valid call has a kernel (misaligned views value by value, any group size, launches
    split at the 32-bit limits): only dtypes restrict these specs, so the dispatcher's per-call path
    is the dtype test alone. fp64 goes to the reference."""
    for op in OPS:
        spec = registry.BY_OP[op][Backend.TILELANG]
        assert spec.check is None and spec.dtypes == ("float16", "bfloat16", "float32"), op
        assert spec in registry.implementations(op), op


# --- the launchers' keys, on CPU --------------------------------------------------------------------
# A stand-in for the compiled host function records each key and runs the reference on the
# arguments the kernel would get, so that the launchers' views and outputs are checked too.


def _stand_in(monkeypatch, module, run):
    keys = []

    def function(*key):
        keys.append(key)
        return lambda *args: run(key, *args)
    monkeypatch.setattr(module, "_function", function)
    return keys


def _rope_stand_in(key, positions, q, k, cache):
    hq, hk, hs, rot_dim, neox, *_, rank, aligned = key
    assert q.shape[1:] == ((hq * hs,) if rank == 2 else (hq, hs)) and (k is None) == (hk == 0)
    assert k is None or k.shape[1:] == ((hk * hs,) if rank == 2 else (hk, hs))
    rope_ref.rotary_embedding(positions, q, k, hs, cache, neox)


def _offset(shape, dtype, elements=1):
    """A view of ``shape`` at ``elements`` past a fresh allocation: off every vector boundary."""
    return torch.randn(torch.Size(shape).numel() + elements, dtype=dtype)[elements:].view(shape)


def _rope_matches_reference(args, what: str = "") -> None:
    """Run the TileLang rope on ``args`` in place and compare query and key with the reference's."""
    want = [a.clone() if isinstance(a, torch.Tensor) else a for a in args]
    rope_ref.rotary_embedding(*want)
    assert rope.rotary_embedding(*args) is None
    assert_close(args[1], want[1], msg=f"{what}query")
    assert_close(args[2], want[2], msg=f"{what}key")


def test_rope_keys(monkeypatch):
    keys = _stand_in(monkeypatch, rope, _rope_stand_in)
    for tokens in (1, 7, 300, 4096):
        args = rope_op.make_args(tokens, 4, 2, 64, 64, True, "qkv", "cpu", torch.bfloat16, max_position=64)
        _rope_matches_reference(args)
    assert keys == [(4, 2, 64, 64, True, "bfloat16", "float32", "int64", 2, True)] * 4
    cache = rope_op.make_cos_sin_cache(16, 64)
    pos = torch.tensor([3])
    cases = [  # (query, key, rank, aligned)
        (torch.randn(1, 4 * 64, dtype=torch.bfloat16), None, 2, True),
        (torch.randn(4 * 64, 1, dtype=torch.bfloat16).t(), None, 2, True),  # a lone row: its stride is never used
        (torch.randn(1, 3, 72, dtype=torch.bfloat16)[:, 1:2, :64], None, 3, True),  # a lone head: likewise
        (torch.randn(2, 4 * 64 + 4, dtype=torch.bfloat16)[:, :256], None, 2, False),  # row stride 260: not of 8
        (_offset((2, 256), torch.bfloat16), None, 2, False),
        (torch.randn(2, 256, dtype=torch.bfloat16), _offset((2, 64), torch.bfloat16), 2, False),
        (torch.randn(2, 256, dtype=torch.bfloat16), torch.randn(2, 1, 64, dtype=torch.bfloat16), 3, True),  # mixed
        (torch.randn(2, 4, 72, dtype=torch.bfloat16)[:, :, :64], None, 3, True),  # head stride 72
        (torch.randn(2, 4, 68, dtype=torch.bfloat16)[:, :, :64], None, 3, False),  # head stride 68
    ]
    for q, k, rank, aligned in cases:
        keys.clear()
        want = [q.clone(), None if k is None else k.clone()]
        rope_ref.rotary_embedding(pos.expand(q.shape[0]), *want, 64, cache, True)
        rope.rotary_embedding(pos.expand(q.shape[0]), q, k, 64, cache, True)
        assert keys[0][-2:] == (rank, aligned), (q.shape, q.stride())
        assert_close(q, want[0])
        if k is not None:
            assert_close(k, want[1])
    keys.clear()
    rope.rotary_embedding(pos, torch.randn(1, 256, dtype=torch.bfloat16), None, 64, torch.randn(16, 65)[:, 1:], True)
    assert keys[0][-1] is False, "cache rows off the vector"
    keys.clear()
    rope.rotary_embedding(pos[:0], torch.randn(0, 256), None, 64, cache, True)
    assert keys == [], "no launch for zero tokens"


def _quant_stand_in(key, x, q, s, eps):
    group, _, ue8m0, *_ = key
    assert x.dim() == 2 and q.is_contiguous() and q.shape == x.shape and s.shape == (x.shape[0], x.shape[1] // group)
    want_q, want_s = quant_ref.per_token_group_quant_fp8(x, group, eps, False, ue8m0)
    q.copy_(want_q)
    s.copy_(want_s)


def test_quant_keys(monkeypatch):
    keys = _stand_in(monkeypatch, quant, _quant_stand_in)
    for tokens in (1, 7, 300, 4096):
        x = torch.randn(tokens, 512, dtype=torch.bfloat16)
        for column_major in (False, True):
            compare_quant(list(quant.per_token_group_quant_fp8(x, 128, 1e-10, column_major, False)),
                          list(quant_ref.per_token_group_quant_fp8(x, 128, 1e-10, column_major, False)))
    assert keys == [(128, "bfloat16", False, False, True)] * 8
    for x, group, eps, key in [
        (torch.randn(512, 1, dtype=torch.bfloat16).t(), 128, 1e-10, (128, "bfloat16", False, False, True)),
        (torch.randn(3, 520)[:, :512], 128, 1e-10, (128, "float32", False, False, True)),  # stride 520: of 4
        (torch.randn(3, 515)[:, :512], 64, 0.0, (64, "float32", False, True, False)),  # eps 0: divide
        (_offset((3, 2, 4096), torch.float16), 4096, 1e-10, (4096, "float16", False, False, False)),
    ]:
        keys.clear()
        compare_quant(list(quant.per_token_group_quant_fp8(x, group, eps, True, False)),
                      list(quant_ref.per_token_group_quant_fp8(x, group, eps, True, False)))
        assert keys == [key], (x.shape, x.stride())
    keys.clear()
    quant.per_token_group_quant_fp8(torch.randn(0, 256), 128)
    assert keys == []


def _merge_stand_in(key, v_a, lse_a, v_b, lse_b, out, out_lse):
    assert out.is_contiguous() and out_lse.is_contiguous() and v_a.shape[1:] == key[:2]
    v, lse = attention_ref.merge_attn_states(v_a, lse_a, v_b, lse_b)
    out.copy_(v)
    out_lse.copy_(lse)


def test_merge_keys(monkeypatch):
    keys = _stand_in(monkeypatch, attention, _merge_stand_in)
    for tokens in (1, 7, 300, 4096):
        args = (torch.randn(tokens, 4, 64), torch.randn(tokens, 4), torch.randn(tokens, 4, 64), torch.randn(4, tokens).t())
        for g, w in zip(attention.merge_attn_states(*args), attention_ref.merge_attn_states(*args)):
            assert_close(g, w)
    assert keys == [(4, 64, "float32", True)] * 4
    for v, aligned in [(torch.randn(1, 4, 64).as_strided((1, 4, 64), (3, 64, 1)), True),  # a lone token: stride unused
                       (torch.randn(5, 1, 64).as_strided((5, 1, 64), (64, 7, 1)), True),  # a lone head
                       (torch.randn(5, 4, 66)[:, :, :64], False), (_offset((5, 4, 64), torch.float32), False)]:
        keys.clear()
        attention.merge_attn_states(v, torch.randn(v.shape[:2]), torch.randn(v.shape), torch.randn(v.shape[:2]))
        assert keys[0][-1] is aligned, (v.shape, v.stride())


# --- the generated code of the benchmark shapes (sm_90 PTX) ------------------------------------------

_PTX_ACCESS = re.compile(r"\b((?:ld|st)\.global[.\w]*)")


@pytest.fixture(scope="module")
def bench_ptx(tmp_path_factory):
    """{module: (PTX, ptxas -v output)} of the benchmark keys compiled for sm_90."""
    if shutil.which("ptxas") is None:
        pytest.skip("ptxas is not installed")
    out = {}
    for module, key in BENCH_KEYS.items():
        kernel = tilelang.compile(module._build(*key), target=_jit.SM90, execution_backend=_jit.EXECUTION_BACKEND)
        ptx = kernel._get_ptx()
        path = tmp_path_factory.mktemp("ptx") / "k.ptx"
        path.write_text(ptx)
        r = subprocess.run(["ptxas", "-v", "-arch=sm_90", str(path), "-o", os.devnull], capture_output=True, text=True)
        assert r.returncode == 0, r.stderr
        out[module] = ptx, r.stderr
    return out


@pytest.mark.parametrize("module,expected", [
    # rope: q/k half-rows in and out as 16-byte vectors, cos/sin as 16-byte vectors of fp32
    (rope, {"ld.global.v4.u32", "st.global.v4.u32", "ld.global.nc.v4.f32", "ld.global.nc.u64"}),
    # quant: two 16-byte loads of bf16, one 16-byte store of fp8, one 4-byte scale store
    (quant, {"ld.global.nc.v4.u32", "st.global.v4.u32", "st.global.f32"}),
    # merge: 16-byte vectors of both partials and of the output, 4-byte LSE loads and store
    (attention, {"ld.global.v4.u32", "st.global.v4.u32", "ld.global.u32", "st.global.u32"}),
], ids=["rope", "quant", "merge"])
def test_benchmark_shapes_compile_to_16_byte_accesses_without_spills(module, expected, bench_ptx):
    ptx, ptxas = bench_ptx[module]
    assert set(_PTX_ACCESS.findall(ptx)) == expected
    assert "0 bytes spill stores, 0 bytes spill loads" in ptxas, ptxas


def test_quant_converts_with_the_hardware_and_divides_exactly(bench_ptx):
    ptx, _ = bench_ptx[quant]
    assert len(re.findall(r"cvt\.rn\.satfinite\.e4m3x2\.f32", ptx)) == 8  # 16 values, two a conversion
    assert re.findall(r"\b(div\.\w+\.f32|rcp\.\w+\.f32)", ptx) == ["div.rn.f32", "rcp.rn.f32"]
    assert "max.NaN" not in ptx and "ld.local" not in ptx and "st.local" not in ptx


# --- the generated code run on the CPU ----------------------------------------------------------------
# TileLang's host function is compiled as it is, except that CPU tensors stand in for CUDA ones and the
# kernel it launches is the device code compiled as host C++ (CUDA's headers give bf16/fp16/fp8 on the
# host): blocks one after the other, a block's threads one at a time, or as OS threads when the kernel
# shuffles. UBSan's alignment check turns a vector access off its size into a failure, as on the GPU.

_PRELUDE = r"""
#include <algorithm>
#include <barrier>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>
#include <thread>
#include <vector>
#include <vector_types.h>
#include <vector_functions.h>
#include <cuda_fp16.h>
#include <cuda_bf16.h>
#include <cuda_fp8.h>
#include <tvm/ffi/c_api.h>
struct emu_dim3 { unsigned x = 0, y = 0, z = 0; };
static thread_local emu_dim3 threadIdx, blockIdx;
#define __global__
#define __launch_bounds__(...)
#define CUDART_NAN_F NAN
#define CUDART_INF_F INFINITY
typedef __nv_bfloat16 bfloat16_t;
typedef __half half_t;
typedef __nv_fp8_e4m3 fp8_e4_t;
struct alignas(4) fp8_e4_4_t { fp8_e4_t v[4]; };
struct alignas(8) fp8_e4_8_t { fp8_e4_t v[8]; };
struct alignas(16) fp8_e4_16_t { fp8_e4_t v[16]; };
typedef unsigned int uint;
static inline float max(float a, float b) { return fmaxf(a, b); }
static inline int max(int a, int b) { return a > b ? a : b; }
static inline float __fdiv_rn(float a, float b) { volatile float r = a / b; return r; }
static inline float __frcp_rn(float a) { volatile float r = 1.0f / a; return r; }
static inline float __fmul_rn(float a, float b) { volatile float r = a * b; return r; }
static inline float __fadd_rn(float a, float b) { volatile float r = a + b; return r; }
static inline float __fsub_rn(float a, float b) { volatile float r = a - b; return r; }
template <class T> static inline unsigned emu_pack(T x, T y) {
  unsigned short a, b;
  memcpy(&a, &x, 2);
  memcpy(&b, &y, 2);
  return (unsigned)b << 16 | a;
}
static inline unsigned __pack_half2(half_t x, half_t y) { return emu_pack(x, y); }
static inline unsigned __pack_nv_bfloat162(bfloat16_t x, bfloat16_t y) { return emu_pack(x, y); }
namespace tl {
static inline uint32_t load_global_32(const void* p) { return *(const uint32_t*)p; }
static inline uint4 load_global_128(const void* p) { return *(const uint4*)p; }
static inline void store_global_32(void* p, uint32_t v) { *(uint32_t*)p = v; }
static inline void store_global_128(void* p, uint4 v) { *(uint4*)p = v; }
}
struct emu_warp { std::unique_ptr<std::barrier<>> bar; uint64_t slot[32]; };
static std::vector<emu_warp>* emu_warps;
template <class T> static T __shfl_xor_sync(unsigned, T v, int mask, int = 32) {
  unsigned lane = threadIdx.x % 32;
  emu_warp& w = (*emu_warps)[threadIdx.x / 32];
  uint64_t bits = 0, got;
  memcpy(&bits, &v, sizeof(T));
  w.slot[lane] = bits;
  w.bar->arrive_and_wait();
  got = w.slot[(lane ^ mask) % 32];
  w.bar->arrive_and_wait();
  T r;
  memcpy(&r, &got, sizeof(T));
  return r;
}
"""

_GLUE = r"""
static int emu_noop(void*, const TVMFFIAny*, int32_t, TVMFFIAny* result) { result->type_index = kTVMFFINone; return 0; }
static int emu_launch(void*, const TVMFFIAny* a, int32_t n, TVMFFIAny* result) {
  // Arguments: the kernel's, then the extents of the blockIdx axes in use, then threadIdx.x/y/z.
  result->type_index = kTVMFFINone;
  unsigned grid[3] = {1, 1, 1}, nt = a[n - 3].v_int64 * a[n - 2].v_int64 * a[n - 1].v_int64;
  for (int i = NPARAMS; i < n - 3; ++i) grid[i - NPARAMS] = a[i].v_int64;
  std::vector<emu_warp> warps((nt + 31) / 32);
  for (unsigned w = 0; w < warps.size(); ++w) warps[w].bar = std::make_unique<std::barrier<>>(std::min(32u, nt - 32 * w));
  emu_warps = &warps;
  for (unsigned b = 0; b < grid[0] * grid[1] * grid[2]; ++b) {
    auto thread = [&](unsigned t) {
      blockIdx = {b % grid[0], b / grid[0] % grid[1], b / (grid[0] * grid[1])};
      threadIdx = {t, 0, 0};
      KERNEL(ARGS);
    };
    std::vector<std::thread> threads;
    for (unsigned t = 0; t < nt; ++t) {
      if (THREADED) threads.emplace_back(thread, t);
      else thread(t);
    }
    for (auto& x : threads) x.join();
  }
  return 0;
}
extern "C" int emu_get_func(void*, const char* name, TVMFFIObjectHandle* out) {
  return TVMFFIFunctionCreate(nullptr, strcmp(name, "__tvm_set_device") ? emu_launch : emu_noop, nullptr, out);
}
#define TVMBackendGetFuncFromEnv emu_get_func
"""


def _cuda_include():
    for root in (os.environ.get("CUDA_HOME"), getattr(tilelang.env, "CUDA_HOME", None), "/usr/local/cuda"):
        if root and os.path.exists(os.path.join(root, "include", "cuda_fp8.h")):
            return os.path.join(root, "include")
    return None


@pytest.fixture(scope="module")
def emulated(tmp_path_factory):
    """``emulated(module, key)``: the host function of ``module._build(*key)`` compiled for sm_90,
    running its device code on the CPU (built once per key)."""
    import tvm_ffi
    import tvm_ffi.libinfo

    cuda_include = _cuda_include()
    if shutil.which("g++") is None or cuda_include is None or sys.platform != "linux":
        pytest.skip("needs g++ and CUDA's headers")
    includes = [tvm_ffi.libinfo.find_include_path(), cuda_include,
                os.path.join(os.path.dirname(tilelang.__file__), "3rdparty", "tvm", "include")]
    lib = os.path.dirname(tvm_ffi.libinfo.find_libtvm_ffi())
    work, built = tmp_path_factory.mktemp("emulated"), {}

    def build(module, key):
        if (module, key) in built:
            return built[(module, key)]
        kernel = tilelang.compile(module._build(*key), target=_jit.SM90, execution_backend=_jit.EXECUTION_BACKEND)
        device = kernel.get_kernel_source()
        device = device[device.index('extern "C"'):]
        # Local arrays live in registers on the GPU; on the host stack they need the alignment of the
        # vector types the generated code reads them through.
        device = re.sub(r"^(\s+)(\w+ \w+\[\d+\];)", r"\1alignas(16) \2", device, flags=re.M)
        name, params = re.match(r'extern "C" __global__ void (\w+)\((.*?)\);', device).groups()
        args = []
        for i, param in enumerate(params.split(", ")):
            ctype = param.rsplit(" ", 1)[0].replace("__restrict__", "").strip()
            field = "v_ptr" if "*" in ctype else "v_float64" if ctype in ("float", "double") else "v_int64"
            args.append(f"({ctype})a[{i}].{field}")
        glue = (_GLUE.replace("NPARAMS", str(len(args))).replace("KERNEL", name).replace("ARGS", ", ".join(args))
                .replace("THREADED", "1" if "__shfl" in device else "0"))
        host = kernel.get_host_source()
        host = host.replace("device_type) == 2", "device_type) == 1")  # CPU tensors stand in for CUDA ones
        host = re.sub(r"_is_null \|\| \(condval_(\d+) == 2\)\)", r"_is_null || (condval_\1 == 1))", host)
        source = work / f"{name}{len(built)}.cc"
        source.write_text(_PRELUDE + device + glue + host)
        library = source.with_suffix(".so")
        r = subprocess.run(["g++", "-std=c++20", "-O1", "-fsanitize=alignment", "-fno-sanitize-recover=all", "-shared",
                            "-fPIC", "-pthread", "-w", *(f"-I{i}" for i in includes), str(source), "-o", str(library),
                            f"-L{lib}", "-ltvm_ffi", f"-Wl,-rpath,{lib}"], capture_output=True, text=True)
        assert r.returncode == 0, r.stderr[-4000:]
        fn = built[(module, key)] = tvm_ffi.load_module(str(library))[str(kernel.prim_func.attrs["global_symbol"])]
        return fn
    return build



def _run_emulated(monkeypatch, module, emulated):
    """Route ``module``'s launcher to the emulated kernels; returns the keys it asks for."""
    keys = []

    def function(*key):
        keys.append(key)
        return emulated(module, key)
    monkeypatch.setattr(module, "_function", function)
    return keys


def _rope_case(tokens, hq, hk, hs, rot, neox, dtype, cache_dtype, positions_dtype, layout):
    args = rope_op.make_args(tokens, hq, hk, hs, rot, neox, "qkv" if layout == "offset" else layout, "cpu", dtype,
                             cache_dtype, positions_dtype, 37)
    if layout == "offset":  # (T, H, hs) heads one element past a vector boundary, rows of an odd stride
        width = (hq + hk) * hs
        base = torch.randn(tokens, width + 3, dtype=dtype)
        q, k = base[:, 1:1 + hq * hs], base[:, 1 + hq * hs:1 + width]
        args = (args[0], q.unflatten(1, (hq, hs)), k.unflatten(1, (hk, hs)), *args[3:])
    return args


@pytest.mark.parametrize("key,cases", [
    ((4, 2, 64, 64, True, "bfloat16", "float32", "int64", 2, True), [(1, "qkv"), (5, "2d"), (37, "qkv")]),
    ((3, 1, 40, 24, False, "float16", "float16", "int32", 3, False), [(1, "offset"), (9, "offset")]),
], ids=["neox-bf16-rows", "gptj-partial-fp16-misaligned-heads"])
def test_rope_generated_code_on_cpu(key, cases, monkeypatch, emulated):
    keys = _run_emulated(monkeypatch, rope, emulated)
    hq, hk, hs, rot, neox, dtype, cache_dtype, positions_dtype, _, _ = key
    dt = getattr(torch, dtype)
    for tokens, layout in cases:
        args = _rope_case(tokens, hq, hk, hs, rot, neox, dt, getattr(torch, cache_dtype), getattr(torch, positions_dtype),
                          layout)
        base = args[1]._base
        before = None if base is None else base.clone()
        _rope_matches_reference(args, f"{tokens} {layout}: ")
        if base is not None:  # the rest of the fused tensor is untouched
            expected = before.clone()
            for x in args[1:3]:
                expected.as_strided(x.size(), x.stride(), x.storage_offset() - base.storage_offset()).copy_(x)
            assert torch.equal(base, expected), f"{tokens} {layout}: wrote outside query and key"
    # a position outside the cache (the op's data check off) reads nothing and rotates by NaN
    args = _rope_case(4, hq, hk, hs, rot, neox, dt, getattr(torch, cache_dtype), getattr(torch, positions_dtype),
                      cases[0][1])
    positions = args[0].clone()
    positions[1], positions[2] = 2**31 - 1, -3
    want = [x[[0, 3]].clone() for x in args[1:3]]
    rope_ref.rotary_embedding(positions[[0, 3]], *want, *args[3:])
    rope.rotary_embedding(positions, *args[1:])
    for x, w in zip(args[1:3], want):
        heads = x.reshape(4, -1, hs)
        assert heads[1:3, :, :rot].isnan().all() and not heads[1:3, :, rot:].isnan().any()
        assert_close(x[[0, 3]], w)
    assert set(keys) == {key}


def _rows(shape, dtype, stride=None, offset=0):
    """Rows over a few binades per row (as test_quant.py makes them), optionally strided or offset."""
    width = stride or shape[-1]
    x = torch.randn(torch.Size((*shape[:-1], width)).numel() + offset)[offset:].view(*shape[:-1], width) * 4
    x = x * torch.exp2(torch.randint(-6, 7, (*shape[:-1], 1)).float())
    return x.to(dtype)[..., :shape[-1]]


def test_quant_generated_code_on_cpu(monkeypatch, emulated):
    keys = _run_emulated(monkeypatch, quant, emulated)
    aligned = (128, "bfloat16", False, False, True)
    for x in (_rows((1, 512), torch.bfloat16), _rows((9, 896), torch.bfloat16, 1024), _rows((2, 3, 384), torch.bfloat16)):
        for column_major in (False, True):
            compare_quant(list(quant.per_token_group_quant_fp8(x, 128, 1e-10, column_major, False)),
                          list(quant_ref.per_token_group_quant_fp8(x, 128, 1e-10, column_major, False)))
    x = _rows((5, 512), torch.bfloat16)
    x[0, 3], x[1, 130], x[2, 300], x[3, :128] = float("nan"), INF, -INF, 0.0
    compare_quant(list(quant.per_token_group_quant_fp8(x, 128)), list(quant_ref.per_token_group_quant_fp8(x, 128)))
    # launches split where the (row, group) index would pass 32 bits (shrunk here to 5 pairs)
    monkeypatch.setattr(quant, "_MAX_PAIRS", 5)
    x = _rows((9, 384), torch.bfloat16)
    for column_major in (False, True):
        compare_quant(list(quant.per_token_group_quant_fp8(x, 128, 1e-10, column_major, False)),
                      list(quant_ref.per_token_group_quant_fp8(x, 128, 1e-10, column_major, False)))
    assert set(keys) == {aligned}
    # rows off the vector, UE8M0, eps = 0 (each value divided; an all-zero group gives NaN)
    keys.clear()
    x = _rows((7, 256), torch.float32, 259, 1)
    x[2, :64] = 0.0
    compare_quant(list(quant.per_token_group_quant_fp8(x, 64, 0.0, True, True)),
                  list(quant_ref.per_token_group_quant_fp8(x, 64, 0.0, True, True)))
    assert keys == [(64, "float32", True, True, False)]


def test_merge_generated_code_on_cpu(monkeypatch, emulated):
    keys = _run_emulated(monkeypatch, attention, emulated)
    T, H, D = 6, 3, 40
    v_a, v_b = torch.randn(T, H, D, dtype=torch.float16), torch.randn(T, H + 2, D, dtype=torch.float16)[:, 1:H + 1]
    lse_a, lse_b = torch.randn(H, T).t() * 2, torch.randn(T, H) * 2
    lse_a[0, :2] = lse_b[1, 1:] = -INF  # one side empty
    lse_a[2, 2] = lse_b[2, 2] = -INF  # both
    lse_a[3, 0] = lse_b[4, 1] = INF  # FlashAttention-2's mark
    v_a[0, 0] = float("nan")  # an empty partial's values never reach the result
    v_b[1, 2] = INF
    want = attention_ref.merge_attn_states(v_a, lse_a, v_b, lse_b)
    for limit in (attention._MAX_THREADS, 20):  # and launches split at the 32-bit limit, shrunk to 20 threads
        monkeypatch.setattr(attention, "_MAX_THREADS", limit)
        v, lse = attention.merge_attn_states(v_a, lse_a, v_b, lse_b)
        assert not v.isnan().any() and torch.equal(v[0, :2], v_b[0, :2]) and torch.equal(v[1, 1:], v_a[1, 1:])
        assert_close(v, want[0])
        assert_close(lse, want[1])
    assert set(keys) == {(H, D, "float16", True)}
    keys.clear()
    v_a, v_b = _offset((5, 4, 64), torch.bfloat16), torch.randn(5, 4, 64, dtype=torch.bfloat16)
    lse_a, lse_b = torch.randn(5, 4), torch.randn(5, 4)
    for g, w in zip(attention.merge_attn_states(v_a, lse_a, v_b, lse_b), attention_ref.merge_attn_states(v_a, lse_a, v_b, lse_b)):
        assert_close(g, w)
    assert keys == [(4, 64, "bfloat16", False)]


# --- with a GPU ---------------------------------------------------------------------------------------


@pytest.mark.gpu
def test_registered_ops_reach_tilelang(tmp_path):
    """Selected (DEEPINFER_OPS_BACKEND=tilelang), TileLang serves the registered ops; none refused."""
    trace = tmp_path / "trace.txt"
    dispatch.configure(backend="tilelang", trace_path=str(trace))
    positions, q, k, hs, cache, neox = rope_op.make_args(3, 4, 2, 64, 64, True, "qkv", "cuda", torch.bfloat16)
    torch.ops.deepinfer.rotary_embedding(positions, q, k, hs, cache, neox)
    torch.ops.deepinfer.qk_rmsnorm_rope(*rope_op.make_qk_args(3, 4, 2, 64, 64, True, "qkv", "cuda", torch.bfloat16))
    torch.ops.deepinfer.per_token_group_quant_fp8(torch.randn(3, 256, device="cuda"), 128)
    v, lse = torch.randn(3, 2, 64, device="cuda"), torch.randn(3, 2, device="cuda")
    torch.ops.deepinfer.merge_attn_states(v, lse, v, lse)
    lines = [line for line in trace.read_text().splitlines() if not line.startswith("tilelang-compile|")]
    assert lines == [f"{op}|tilelang" for op in OPS]


def _trace_compiles(path, name):
    return [l for l in path.read_text().splitlines() if l.startswith(f"tilelang-compile|{name}|")] if path.exists() else []


@pytest.mark.gpu
def test_one_compiled_kernel_serves_every_batch_size(tmp_path):
    trace = tmp_path / "trace.txt"
    dispatch.configure(trace_path=str(trace))
    _jit.clear_memo()
    for module in (rope, quant, attention):
        module._functions.clear()
    rope._qk_function.cache.clear()
    sizes = []
    for tokens in (1, 7, 300, 4096):
        args = rope_op.make_args(tokens, 32, 8, 128, 128, True, "qkv", "cuda", torch.bfloat16, max_position=8192)
        _rope_matches_reference(args)
        qk = rope_op.make_qk_args(tokens, 32, 8, 128, 128, True, "qkv", "cuda", torch.bfloat16, max_position=8192)
        want = (qk[1].clone(), qk[2].clone())
        rope_ref.qk_rmsnorm_rope(qk[0], *want, *qk[3:])
        rope.qk_rmsnorm_rope(*qk)
        assert_close(qk[1], want[0])
        assert_close(qk[2], want[1])
        x = torch.randn(tokens, 7168, device="cuda", dtype=torch.bfloat16)
        compare_quant(list(quant.per_token_group_quant_fp8(x, 128, 1e-10, True, False)),
                      list(quant_ref.per_token_group_quant_fp8(x, 128, 1e-10, True, False)))
        v = [torch.randn(tokens, 32, 128, device="cuda", dtype=torch.bfloat16) for _ in range(2)]
        lse = [torch.randn(tokens, 32, device="cuda") * 2 for _ in range(2)]
        for g, w in zip(attention.merge_attn_states(v[0], lse[0], v[1], lse[1]),
                        attention_ref.merge_attn_states(v[0], lse[0], v[1], lse[1])):
            assert_close(g, w)
        sizes.append(_jit.memo_size())
    torch.cuda.synchronize()
    assert sizes == [4, 4, 4, 4], sizes  # four kernels, compiled (or loaded) at the first batch size only
    for name in OPS:
        assert len(_trace_compiles(trace, name)) == 1, name


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
def test_misaligned_views_and_lone_rows(dtype):
    """Views one element past a vector boundary run the value-by-value kernels; a lone row or head
    with a stride off the vector runs the vector kernel (the stride is never used)."""
    cache = rope_op.make_cos_sin_cache(64, 64, device="cuda")
    for tokens, offset in [(7, 1), (1, 0)]:
        base = torch.randn(tokens, 6 * 64 + 3, device="cuda", dtype=dtype)
        q, k = base[:, offset:offset + 4 * 64], base[:, offset + 4 * 64:offset + 6 * 64]
        if tokens == 1:
            q = torch.randn(4 * 64, 1, device="cuda", dtype=dtype).t()  # row stride 1
        positions = torch.randint(0, 64, (tokens,), device="cuda")
        qw, kw = q.clone(), k.clone()
        rope_ref.rotary_embedding(positions, qw, kw, 64, cache, True)
        rope.rotary_embedding(positions, q, k, 64, cache, True)
        assert_close(q, qw)
        assert_close(k, kw)
        x = torch.randn(tokens * 512 + 3, device="cuda", dtype=dtype)[offset:offset + tokens * 512].view(tokens, 512)
        for column_major, ue8m0 in [(False, False), (True, True)]:
            compare_quant(list(quant.per_token_group_quant_fp8(x, 128, 1e-10, column_major, ue8m0)),
                          list(quant_ref.per_token_group_quant_fp8(x, 128, 1e-10, column_major, ue8m0)))
        v_a = torch.randn(tokens * 4 * 80 + 1, device="cuda", dtype=dtype)[offset:offset + tokens * 320].view(tokens, 4, 80)
        v_b = torch.randn(tokens, 4, 88, device="cuda", dtype=dtype)[:, :, :80]
        lse_a, lse_b = torch.randn(tokens, 4, device="cuda"), torch.randn(tokens, 4, device="cuda")
        lse_a[0, 1] = -INF
        for g, w in zip(attention.merge_attn_states(v_a, lse_a, v_b, lse_b),
                        attention_ref.merge_attn_states(v_a, lse_a, v_b, lse_b)):
            assert_close(g, w)
    assert any(not key[-1] for key in rope._functions) and any(not key[-1] for key in quant._functions)
    assert any(not key[-1] for key in attention._functions)
    torch.cuda.synchronize()  # no misaligned access


@pytest.mark.gpu
def test_rope_positions_outside_the_cache_read_nothing_and_give_nan():
    """With the op's data check off (as inside a CUDA graph capture), a position outside the cache
    makes the kernel rotate that token by NaN, not read outside the cache; other tokens are right."""
    positions, q, k, hs, cache, neox = rope_op.make_args(4, 32, 8, 128, 128, True, "2d", "cuda", torch.bfloat16)
    positions[1], positions[2] = 1 << 40, -3
    want_q, want_k = q[[0, 3]].clone(), k[[0, 3]].clone()
    rope_ref.rotary_embedding(positions[[0, 3]], want_q, want_k, hs, cache, neox)
    rope.rotary_embedding(positions, q, k, hs, cache, neox)
    torch.cuda.synchronize()
    assert q[1:3].isnan().all() and k[1:3].isnan().all()
    assert_close(q[[0, 3]], want_q)
    assert_close(k[[0, 3]], want_k)


@pytest.mark.gpu
@pytest.mark.parametrize("shape,stride,group,column_major,ue8m0,eps", [
    ((8192, 7168), None, 128, False, False, 1e-10),  # the benchmark shape
    ((4097, 7168), 8192, 128, True, True, 1e-10),
    ((1000, 2048), None, 64, False, False, 0.0),  # eps 0: both kernels divide each value
    ((33, 8192), None, 4096, True, False, 1e-10),
], ids=str)
def test_quant_bit_equal_to_triton(shape, stride, group, column_major, ue8m0, eps):
    """Both kernels compute div.rn scales, multiply by rcp.rn (or divide) and convert with
    cvt.rn.satfinite: the same bytes, NaN and infinities included."""
    from torch_kernels.families.quant import triton as triton_quant
    x = torch.randn(shape[0], stride or shape[1], device="cuda") * 4
    x = (x * torch.exp2(torch.randint(-6, 7, (shape[0], 1), device="cuda").float())).to(torch.bfloat16)[:, :shape[1]]
    x[0, 5], x[1, 200], x[2, :group] = float("nan"), INF, 0.0
    q, s = quant.per_token_group_quant_fp8(x, group, eps, column_major, ue8m0)
    q_triton, s_triton = triton_quant.per_token_group_quant_fp8(x, group, eps, column_major, ue8m0)
    assert s.stride() == s_triton.stride() and torch.equal(s.nan_to_num(), s_triton.nan_to_num())
    assert torch.equal(s.isnan(), s_triton.isnan())
    assert torch.equal(q.view(torch.uint8), q_triton.view(torch.uint8))


@pytest.mark.gpu
def test_cuda_graph_capture_and_replay():
    """The launchers launch on the current stream: captured in a CUDA graph, a replay on new data
    gives the reference's results."""
    positions, q, k, hs, cache, neox = rope_op.make_args(64, 8, 2, 128, 128, True, "qkv", "cuda", torch.bfloat16,
                                                         max_position=4096)
    x = torch.randn(64, 2048, device="cuda", dtype=torch.bfloat16)
    v_a, v_b = torch.randn(64, 8, 128, device="cuda"), torch.randn(64, 8, 128, device="cuda")
    lse_a, lse_b = torch.randn(64, 8, device="cuda"), torch.randn(64, 8, device="cuda")

    def step():
        rope.rotary_embedding(positions, q, k, hs, cache, neox)
        return quant.per_token_group_quant_fp8(x, 128, 1e-10, True, False), attention.merge_attn_states(v_a, lse_a, v_b, lse_b)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        step()  # compile (or load) outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        (q8, s8), (v, lse) = step()
    for t in (positions, q, k, x, v_a, v_b, lse_a, lse_b):
        t.copy_(torch.randint(0, 4096, t.shape, device="cuda") if t is positions else torch.randn_like(t))
    want_q, want_k = q.clone(), k.clone()
    rope_ref.rotary_embedding(positions, want_q, want_k, hs, cache, neox)
    graph.replay()
    torch.cuda.synchronize()
    assert_close(q, want_q)
    assert_close(k, want_k)
    compare_quant([q8, s8], list(quant_ref.per_token_group_quant_fp8(x, 128, 1e-10, True, False)))
    for g, w in zip((v, lse), attention_ref.merge_attn_states(v_a, lse_a, v_b, lse_b)):
        assert_close(g, w)


@pytest.mark.gpu
def test_merge_and_quant_offsets_past_2_31_elements():
    """Inputs of more than 2^31 elements: the last rows are right (32-bit offsets would wrap). Rope's
    TileLang kernel is checked the same way in tests/test_rope.py."""
    T, H, D = 540000, 32, 128
    args = (torch.randn(T, H, D, device="cuda", dtype=torch.bfloat16), torch.randn(T, H, device="cuda"),
            torch.randn(T, H, D, device="cuda", dtype=torch.bfloat16), torch.randn(T, H, device="cuda"))
    v, lse = attention.merge_attn_states(*args)
    for sl in (slice(T - 3, T), slice(0, 3)):
        want_v, want_lse = attention_ref.merge_attn_states(*(a[sl] for a in args))
        assert_close(v[sl], want_v)
        assert_close(lse[sl], want_lse)
    del args, v, lse
    T, N = 300000, 7168
    assert T * N > 2**31
    x = torch.randn(T, N, device="cuda", dtype=torch.bfloat16)
    q, s = quant.per_token_group_quant_fp8(x, 128)
    for sl in (slice(T - 3, T), slice(0, 3)):
        compare_quant([q[sl], s[sl]], list(quant_ref.per_token_group_quant_fp8(x[sl], 128)))
