"""The TileLang FP8 epilogues: ``scaled_fp8_quant`` and the norms and ``silu_and_mul`` ending in a
quantisation (``torch_kernels/backends/tilelang_fp8.py`` and the families' ``tilelang.py``).

Without a GPU:
* every new kernel compiles for sm_90 (a representative part here, the rest under ``-m tilelang_full``)
  with no spills, opens with the wait of a dependent launch, converts by the hardware's satfinite cvt,
  rounds its divisions and reciprocals correctly, and the benchmark shapes move whole vectors;
* the tilings and the epilogue's slots cover every shape: every vector of a row, whole groups;
* the generated code run on the CPU (TileLang's host function as compiled, the device code as host C++
  with one OS thread per CUDA thread, barriers and shuffles emulated, UBSan's alignment check): the
  contract, bit for bit, of each fused op against its unfused pair as the TileLang backend computes
  them (the norm or the activation, then ``scaled_fp8_quant`` or ``per_token_group_quant_fp8``), and
  ``scaled_fp8_quant`` against the reference, exactly; every mode, strided and misaligned rows, 3-D,
  zero tokens, odd hidden sizes, non-finite values, a bad static scale, rows in two passes.

With a GPU (``@pytest.mark.gpu``): the same contract on fresh random inputs over every mode, dtype and
the awkward shapes (4096x4096, 8192x7168, 33 strided rows, one row of 65536, zero rows, 3-D, an odd
offset), the streamed kernels' token counts included; ``scaled_fp8_quant`` equal to the reference
exactly in every mode; the fused ops' static mode within one e4m3 step of the reference; NaN and
infinities; a bad static scale gives NaN q; the registered ops reach TileLang; CUDA-graph replay.
"""

import itertools
import json
import os
import re
import shutil
import subprocess
import sys

import pytest
import torch

tilelang = pytest.importorskip("tilelang")

from torch_kernels import fp8  # noqa: E402
from torch_kernels.backends import tilelang_fp8 as tfp8  # noqa: E402
from torch_kernels.backends import tilelang_jit as _jit  # noqa: E402
from torch_kernels.families.activation import reference as act_ref  # noqa: E402
from torch_kernels.families.activation import tilelang as act  # noqa: E402
from torch_kernels.families.norm import reference as norm_ref  # noqa: E402
from torch_kernels.families.norm import tilelang as norm  # noqa: E402
from torch_kernels.families.quant import reference as quant_ref  # noqa: E402
from torch_kernels.families.quant import tilelang as quant  # noqa: E402
from conftest import bits  # noqa: E402

NAN, INF = float("nan"), float("inf")
Epilogue = tfp8.Epilogue
NORM_OPS = ("rmsnorm_fp8_quant", "fused_add_rmsnorm_fp8_quant", "gemma_rmsnorm_fp8_quant",
            "gemma_fused_add_rmsnorm_fp8_quant")
#: (scale kind, group_size, column_major_scales, scale_ue8m0) of the fused ops' modes
MODES = [("static", -1, False, False), (None, -1, False, False), (None, 128, False, False), (None, 128, True, False),
         (None, 128, False, True), (None, 128, True, True), (None, 64, False, False), (None, 64, True, True)]


# --- what the fused ops must equal: the unfused pair, on the same backend ---------------------------


def assert_bits(got, want, what=""):
    assert got.shape == want.shape and got.dtype == want.dtype, (what, got.shape, want.shape, got.dtype, want.dtype)
    if not torch.equal(bits(got), bits(want)):
        diff = (bits(got) != bits(want)).nonzero()
        i = tuple(diff[0].tolist())
        raise AssertionError(f"{what}: {len(diff)} of {got.numel()} differ, first at {i}: "
                             f"{got[i].float().item()!r} vs {want[i].float().item()!r}")


def quant_of(y, scale, group_size, column_major, ue8m0):
    """The TileLang quant op the fused op ends in, on the unfused op's output ``y``."""
    if scale is not None:
        return quant.scaled_fp8_quant(y, scale)
    if group_size == -1:
        return quant.scaled_fp8_quant(y, None, True)
    return quant.per_token_group_quant_fp8(y, group_size, fp8.GROUP_EPS, column_major, ue8m0)


def check_norm_contract(op, x, w, eps, scale, group, cm, ue, r=None):
    """``op`` (a norm with an epilogue, the TileLang launcher) against the TileLang norm then the
    TileLang quant: q and scales bit for bit, the fused ops' residual too, their input unchanged."""
    gemma, fused = op.startswith("gemma"), "fused" in op
    fn = getattr(norm, op)
    if fused:
        x_before, r_fused, r_pair, y = x.clone(), r.clone(), r.clone(), x.clone()
        got = fn(x, r_fused, w, eps, scale, group, cm, ue)
        (norm.gemma_fused_add_rmsnorm if gemma else norm.fused_add_rmsnorm)(y, r_pair, w, eps)
        assert_bits(x, x_before, f"{op}: input changed")
        assert_bits(r_fused, r_pair, f"{op}: residual")
    else:
        got = fn(x, w, eps, scale, group, cm, ue)
        y = (norm.gemma_rmsnorm if gemma else norm.rmsnorm)(x, w, eps)
    want = quant_of(y, scale, group, cm, ue)
    assert_bits(got[0], want[0], f"{op} q")
    assert_bits(got[1], want[1], f"{op} scales")
    assert got[1].stride() == want[1].stride() or got[1].numel() <= 1, (got[1].stride(), want[1].stride())
    return got, y


def check_silu_contract(x, scale, group, cm, ue):
    got = act.silu_and_mul_fp8_quant(x, scale, group, cm, ue)
    y = act.silu_and_mul(x)
    want = quant_of(y, scale, group, cm, ue)
    assert_bits(got[0], want[0], "silu_and_mul_fp8_quant q")
    assert_bits(got[1], want[1], "silu_and_mul_fp8_quant scales")
    assert got[1].stride() == want[1].stride() or got[1].numel() <= 1
    return got, y


def scaled_reference(x, scale=None, per_token=False, scale_ub=None):
    return quant_ref.scaled_fp8_quant(x, scale, per_token, scale_ub)


# --- tilings and slots, on the CPU ------------------------------------------------------------------

HIDDEN = [1, 2, 5, 8, 24, 96, 100, 128, 257, 384, 1000, 4096, 5120, 7168, 14336, 16384, 18432, 65536, 131072]


@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32"])
def test_row_plans_cover_every_value_once(dtype):
    """Every column of a row lies in exactly one vector of one thread of one block; a group's values in
    one slot; a thread holds at most MAX_THREAD_BYTES; per token one block a row."""
    for n in HIDDEN:
        modes = [Epilogue("static"), Epilogue("token")] + [Epilogue("group", g) for g in (1, 8, 64, 128, 4096, n & -n)
                                                           if n % g == 0]
        for epi, warp_lanes in itertools.product(modes, (0, 512, 1024)):
            p = tfp8.plan(n, dtype, epi, warp_lanes=warp_lanes)
            t = p.tile
            whole_warps = epi.mode == "token" and t.rows == 1 and t.lanes % 32 == 0 and t.nv * t.lanes * t.vec == n
            assert (t.lanes & (t.lanes - 1) == 0 or whole_warps) and t.threads <= 1024 and n % t.vec == 0, (n, epi, p)
            assert t.nv * t.vec * _jit.ELEMENT_BYTES[dtype] <= tfp8.MAX_THREAD_BYTES or t.nv == 1, (n, epi, p)
            cols = sorted(c0 + (k * t.lanes + lane) * t.vec + v for c0 in range(0, p.col_tiles * p.segment, t.width)
                          for k in range(t.nv) for lane in range(t.lanes) for v in range(t.vec))
            assert cols == list(range(p.col_tiles * p.segment)) and p.col_tiles * p.segment >= n, (n, epi, p)
            assert p.col_tiles * p.segment - n < p.segment, (n, epi, p)  # no block wholly outside
            if epi.mode == "token":
                assert p.col_tiles == 1
            quantizer = tfp8.Quantizer(t, epi, n, p.chunks)
            if epi.mode == "group" and p.chunks == 1:
                # the values a slot holds, on the lanes sharing it, are exactly one group
                for lane0 in range(0, t.lanes, quantizer.slot_lanes):
                    for s in range(quantizer.slots):
                        members = {(k * t.lanes + lane) * t.vec + v for k in range(t.nv) for v in range(t.vec)
                                   for lane in range(lane0, lane0 + quantizer.slot_lanes)
                                   if int(quantizer.slot(k, v)) == s}
                        first = min(members)
                        assert members == set(range(first, first + epi.group_size)), (n, epi, p, s)
            elif epi.mode == "group":
                assert p.segment == epi.group_size


def test_plans_of_the_benchmark_shapes():
    """Per token the row is tiled exactly: 7168 bf16 on 128 threads of 7 vectors (silu_and_mul's: 448 of
    2), 14336 on 256 of 7 (whole warps of 2 would take 896 threads); a row of 65536 bf16 in one pass
    (1024 threads of 8 vectors), of fp32 in two."""
    token = Epilogue("token")
    assert tfp8.plan(7168, "bfloat16", token) == tfp8.Plan(tfp8.Tile(8, 128, 7), 1)
    assert tfp8.plan(7168, "bfloat16", token, warp_lanes=512) == tfp8.Plan(tfp8.Tile(8, 448, 2), 1)
    assert act.ActivationQuantConfig().plan(7168, "bfloat16", token) == tfp8.Plan(tfp8.Tile(8, 448, 2), 1)
    assert act.ActivationQuantConfig().plan(5120, "bfloat16", token) == tfp8.Plan(tfp8.Tile(8, 320, 2), 1)
    assert tfp8.plan(14336, "bfloat16", token) == tfp8.Plan(tfp8.Tile(8, 256, 7), 1)
    assert act.ActivationQuantConfig().plan(14336, "bfloat16", token) == tfp8.Plan(tfp8.Tile(8, 256, 7), 1)
    assert tfp8.plan(8192, "bfloat16", token, warp_lanes=512) == tfp8.Plan(tfp8.Tile(8, 512, 2), 1)
    assert tfp8.plan(65536, "bfloat16", Epilogue("token")) == tfp8.Plan(tfp8.Tile(8, 1024, 8), 1)
    assert tfp8.plan(65536, "float32", Epilogue("token")) == tfp8.Plan(tfp8.Tile(4, 1024, 8), 1, 2)
    assert tfp8.plan(4096, "bfloat16", Epilogue("static")) == tfp8.Plan(tfp8.Tile(8, 128, 2), 2)


def test_epilogue_of_the_quant_arguments():
    assert Epilogue.of(torch.ones(1), -1) == Epilogue("static")
    assert Epilogue.of(None, -1) == Epilogue("token")
    assert Epilogue.of(None, 128, True) == Epilogue("group", 128, True)
    assert [str(e) for e in (Epilogue("static"), Epilogue("token", ub=True), Epilogue("group", 64, True))] == [
        "static", "token_ub", "g64_ue8m0"]
    with pytest.raises(ValueError):
        Epilogue("group")
    with pytest.raises(ValueError):
        Epilogue("static", ue8m0=True)


def test_eps_bits():
    assert tfp8.eps_bits() == torch.tensor([fp8.GROUP_EPS], dtype=torch.float32).view(torch.int32).item()


# --- every new kernel compiles for sm_90 ------------------------------------------------------------
# Each family module's ci_fp8_kernels() (its first key the benchmark shape): a representative part in
# the default run, the rest under `-m tilelang_full`, compiled in this process (two threads: nvcc is a
# subprocess) with the sm_90 target, so with programmatic dependent launch.

FP8_FAMILIES = {"quant": quant, "norm": norm, "activation": act}
#: beside each family's first key, compiled in the default run
DEFAULT_FP8_KEYS = {("norm", 1), ("norm", 10), ("quant", 5), ("quant", 6), ("activation", 1)}


def _fp8_kernel_cases(default: bool):
    out = []
    for family, module in FP8_FAMILIES.items():
        for i, (name, build, key) in enumerate(module.ci_fp8_kernels()):
            if (i == 0 or (family, i) in DEFAULT_FP8_KEYS) == default:
                out.append((family, "_".join(map(str, key)), build, key))
    return out


def _compile_sm90(cases, work):
    """{(family, label): {"source" (a path in ``work``), "ptx", "ptxas"}} of ``cases`` compiled for sm_90."""
    import concurrent.futures

    def one(case):
        family, label, build, key = case
        kernel = tilelang.compile(build(*key), target=_jit.SM90, execution_backend=_jit.EXECUTION_BACKEND)
        ptx, source, ptxas = kernel._get_ptx(), work / f"{family}-{label}.cu", ""
        source.write_text(kernel.get_kernel_source())
        if shutil.which("ptxas"):
            (work / f"{family}-{label}.ptx").write_text(ptx)
            r = subprocess.run(["ptxas", "-v", "-arch=sm_90", str(work / f"{family}-{label}.ptx"), "-o", os.devnull],
                               capture_output=True, text=True)
            assert r.returncode == 0, r.stderr
            ptxas = r.stderr
        return (family, label), {"key": label, "source": str(source), "ptx": ptx, "ptxas": ptxas}

    with pytest.MonkeyPatch.context() as mp:
        mp.setenv(_jit.ENV_TARGET, json.dumps(_jit.SM90))
        mp.delenv(_jit.ENV_PDL, raising=False)
        with concurrent.futures.ThreadPoolExecutor(2) as pool:
            return dict(pool.map(one, cases))


@pytest.fixture(scope="module")
def fp8_sm90(tmp_path_factory):
    return _compile_sm90(_fp8_kernel_cases(True), tmp_path_factory.mktemp("fp8_sm90"))


@pytest.fixture(scope="module")
def fp8_sm90_rest(tmp_path_factory):
    return _compile_sm90(_fp8_kernel_cases(False), tmp_path_factory.mktemp("fp8_sm90_rest"))


def _check_sm90(built):
    from test_tilelang import _check_waits_for_its_predecessor

    _check_waits_for_its_predecessor(list(built.values()))
    for (family, label), r in built.items():
        if r["ptxas"]:
            assert "0 bytes spill stores, 0 bytes spill loads" in r["ptxas"], (label, r["ptxas"])
        if "fp8_absmax" in open(r["source"]).read():
            assert re.search(r"\b(atom|red)\.[.\w]*max[.\w]*\.s32", r["ptx"]), label
            continue
        # the hardware e4m3 conversion; 1 / scale and a group's amax / 448 correctly rounded (the
        # approximate reciprocal only in silu's sigmoid, as silu_and_mul computes it)
        assert "cvt.rn.satfinite.e4m3x2.f32" in r["ptx"], label
        assert "rcp.rn.f32" in r["ptx"], label
        assert "div.rn.f32" in r["ptx"] or "_g" not in label, label
        if family != "activation":
            assert not re.findall(r"\b(div|rcp)\.(approx|full)", r["ptx"]), label


def test_fp8_kernels_compile_for_sm90(fp8_sm90):
    assert {family for family, _ in fp8_sm90} == set(FP8_FAMILIES)
    _check_sm90(fp8_sm90)


@pytest.mark.tilelang_full
def test_the_rest_of_the_fp8_kernels_compile_for_sm90(fp8_sm90_rest):
    _check_sm90(fp8_sm90_rest)


def _accesses(source, buffers):
    """The vector types of the global accesses to ``buffers`` in generated CUDA ('scalar' for ``B[...]``)."""
    names = "|".join(buffers)
    vectors = re.findall(rf"\*\((\w+)\*\)\((?:{names}) \+", source)
    scalars = re.findall(rf"(?<![\w.])(?:{names})\[", source)
    return vectors + ["scalar"] * len(scalars)


@pytest.mark.parametrize("family,buffers,expected", [
    ("norm", ("X", "R", "Wt"), {"uint4"}),  # fused_add_rmsnorm_fp8_quant 4096 bf16 static
    ("norm", ("Q",), {"fp8_e4_8_t"}),
    ("quant", ("Xa",), {"uint4"}),  # scaled_fp8_quant 7168 bf16 per token
    ("quant", ("Q",), {"fp8_e4_8_t"}),
    ("activation", ("Xa",), {"uint4"}),  # silu_and_mul_fp8_quant 14336 bf16 per token
    ("activation", ("Q",), {"fp8_e4_8_t"}),
])
def test_benchmark_shapes_move_whole_vectors(family, buffers, expected, fp8_sm90):
    """The benchmark shapes read 16-byte vectors of bf16 and store 8-byte vectors of fp8 (a warp's
    lanes on consecutive ones: whole 256-byte lines)."""
    label = next(label for f, label, _, _ in _fp8_kernel_cases(True) if f == family)  # the family's first key
    accesses = _accesses(open(fp8_sm90[(family, label)]["source"]).read(), buffers)
    assert accesses and set(accesses) == expected, accesses


# --- the generated code run on the CPU ---------------------------------------------------------------
# As tests/test_tilelang_ops.py runs its kernels (whose prelude and launch glue this extends): the
# compiled host function as it is, CPU tensors standing in for CUDA ones, and the device code compiled
# as host C++, every CUDA thread of a block an OS thread; here also block barriers (__syncthreads,
# named barriers), TileLang's AllReduce butterfly and warp reductions, shared memory (one block at a
# time), atomics, and the norms' hinted loads. The fused op and its unfused pair run the same emulated
# arithmetic, so the contract checks the epilogue's logic exactly; that a GPU's kernels agree as well
# is the GPU tests'.

_EMU_EXTRA = r"""
#include <atomic>
#define __align__(n) alignas(n)
typedef unsigned char uchar;
struct alignas(2) fp8_e4_2_t { fp8_e4_t v[2]; };
#define __shared__ static
static std::barrier<>* emu_block_barrier;
static inline void __syncthreads() { emu_block_barrier->arrive_and_wait(); }
alignas(1024) static unsigned char emu_smem[1 << 17];
static inline int min(int a, int b) { return a < b ? a : b; }
static inline float min(float a, float b) { return fminf(a, b); }
static inline float rsqrtf_emu(float x) { return 1.0f / sqrtf(x); }
#define rsqrtf rsqrtf_emu
static inline float emu_expf(float x) { return expf(x); }
#define __expf emu_expf
static inline void cudaGridDependencySynchronize() {}
static inline void cudaTriggerProgrammaticLaunchCompletion() {}
static inline void emu_load16(void* d, const void* s) {
  if ((uintptr_t)s % 16) __builtin_trap();
  memcpy(d, s, 16);
}
static inline void tk_load16_evict_last(void* d, const void* s) { emu_load16(d, s); }
static inline void tk_load16_evict_first(void* d, const void* s) { emu_load16(d, s); }
template <class T> static void AtomicMax(T* p, T v, int) {
  std::atomic_ref<T> a(*p);
  T old = a.load();
  while (old < v && !a.compare_exchange_weak(old, v)) {}
}
namespace tl {
static inline float fast_rcp(float x) { return 1.0f / x; }
struct SumOp { template <class T> T operator()(T const& x, T const& y) const { return x + y; } };
struct MaxOp {
  template <class T> T operator()(T const& x, T const& y) const { return x < y ? y : x; }
  float operator()(float const& x, float const& y) const { return fmaxf(x, y); }
};
struct SyncThreadsBarrier { template <int phase = 0> static void sync() { __syncthreads(); } };
template <int all_threads> struct NamedBarrier { template <int phase = 1> static void sync() { __syncthreads(); } };
template <class T> static T shfl_xor_sync(unsigned mask, T v, int offset) { return __shfl_xor_sync(mask, v, offset); }
template <class Reducer, int threads, int scale, int thread_offset = 0, class Barrier = SyncThreadsBarrier,
          int batch_size = 1, int workspace_stride = 0>
struct AllReduce {
  template <class T> static T run(T x, T* red_buf = nullptr) {
    if constexpr (threads == scale) {
      return x;
    } else {
      constexpr int offset = threads / 2;
      if constexpr (offset >= 32) {
        Barrier::template sync<1>();
        red_buf[threadIdx.x - thread_offset] = x;
        Barrier::template sync<2>();
        x = Reducer()(x, red_buf[(threadIdx.x - thread_offset) ^ offset]);
      } else {
        x = Reducer()(x, __shfl_xor_sync(0xffffffffu, x, offset));
      }
      if constexpr (offset == scale) return x;
      else return AllReduce<Reducer, threads / 2, scale, thread_offset, Barrier>::run(x, red_buf);
    }
  }
};
template <class T> static T warp_reduce_sum(T v) {
  for (int o = 16; o; o >>= 1) v = v + __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}
template <class T> static T warp_reduce_max(T v) {
  for (int o = 16; o; o >>= 1) { T w = __shfl_xor_sync(0xffffffffu, v, o); v = v < w ? w : v; }
  return v;
}
}
"""

_EMU_GLUE = r"""
static int emu_noop(void*, const TVMFFIAny*, int32_t, TVMFFIAny* result) { result->type_index = kTVMFFINone; return 0; }
static int emu_launch(void*, const TVMFFIAny* a, int32_t n, TVMFFIAny* result) {
  // the kernel's arguments, the extents of the blockIdx axes in use, threadIdx.x/y/z, the dynamic shared memory
  result->type_index = kTVMFFINone;
  const int last = n - DYNAMIC;
  unsigned grid[3] = {1, 1, 1}, nt = a[last - 3].v_int64 * a[last - 2].v_int64 * a[last - 1].v_int64;
  for (int i = NPARAMS; i < last - 3; ++i) grid[i - NPARAMS] = a[i].v_int64;
  for (unsigned b = 0; b < grid[0] * grid[1] * grid[2]; ++b) {
    std::vector<emu_warp> warps((nt + 31) / 32);
    for (unsigned w = 0; w < warps.size(); ++w) warps[w].bar = std::make_unique<std::barrier<>>(std::min(32u, nt - 32 * w));
    emu_warps = &warps;
    std::barrier<> block_barrier(nt);
    emu_block_barrier = &block_barrier;
    auto thread = [&](unsigned t) {
      blockIdx = {b % grid[0], b / grid[0] % grid[1], b / (grid[0] * grid[1])};
      threadIdx = {t, 0, 0};
      KERNEL(ARGS);
    };
    std::vector<std::thread> threads;
    for (unsigned t = 0; t < nt; ++t) threads.emplace_back(thread, t);
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
def emulate(tmp_path_factory):
    """``emulate(prim_func)``: its host function compiled for sm_90, running the device code on the CPU."""
    import tvm_ffi
    import tvm_ffi.libinfo

    from test_tilelang_ops import _PRELUDE

    cuda_include = _cuda_include()
    if shutil.which("g++") is None or cuda_include is None or sys.platform != "linux":
        pytest.skip("needs g++ and CUDA's headers")
    includes = [tvm_ffi.libinfo.find_include_path(), cuda_include,
                os.path.join(os.path.dirname(tilelang.__file__), "3rdparty", "tvm", "include")]
    lib = os.path.dirname(tvm_ffi.libinfo.find_libtvm_ffi())
    work, built = tmp_path_factory.mktemp("emulated"), {}

    def build(prim):
        kernel = tilelang.compile(prim, target=_jit.SM90, execution_backend=_jit.EXECUTION_BACKEND)
        device = kernel.get_kernel_source()
        if device in built:
            return built[device]
        body = device[device.index('extern "C"'):]
        body = re.sub(r"^(\s+)(\w+ \w+\[\d+\];)", r"\1alignas(16) \2", body, flags=re.M)
        body = re.sub(r"extern __shared__ __align__\(\d+\) (\w+) (\w+)\[\];", r"\1* \2 = (\1*)emu_smem;", body)
        name, params = re.match(r'extern "C" __global__ void (\w+)\((.*?)\);', body).groups()
        args = []
        for i, param in enumerate(params.split(", ")):
            ctype = param.rsplit(" ", 1)[0].replace("__restrict__", "").strip()
            field = "v_ptr" if "*" in ctype else "v_float64" if ctype in ("float", "double") else "v_int64"
            args.append(f"({ctype})a[{i}].{field}")
        dynamic = "1" if "emu_smem" in body else "0"
        glue = (_EMU_GLUE.replace("NPARAMS", str(len(args))).replace("KERNEL", name).replace("ARGS", ", ".join(args))
                .replace("DYNAMIC", dynamic))
        host = kernel.get_host_source()
        host = host.replace("device_type) == 2", "device_type) == 1")  # CPU tensors stand in for CUDA ones
        host = re.sub(r"_is_null \|\| \(condval_(\d+) == 2\)\)", r"_is_null || (condval_\1 == 1))", host)
        prelude = _PRELUDE.replace("#include <vector>", "#include <vector>\n#include <atomic>")
        source = work / f"{name}{len(built)}.cc"
        source.write_text(prelude + _EMU_EXTRA + body + glue + host)
        library = source.with_suffix(".so")
        r = subprocess.run(["g++", "-std=c++20", "-O1", "-fsanitize=alignment", "-fno-sanitize-recover=all", "-shared",
                            "-fPIC", "-pthread", "-w", *(f"-I{i}" for i in includes), str(source), "-o", str(library),
                            f"-L{lib}", "-ltvm_ffi", f"-Wl,-rpath,{lib}"], capture_output=True, text=True)
        assert r.returncode == 0, r.stderr[-6000:]
        fn = built[device] = tvm_ffi.load_module(str(library))[str(kernel.prim_func.attrs["global_symbol"])]
        return fn
    return build


@pytest.fixture
def on_cpu(monkeypatch, emulate):
    """Route every TileLang launcher of the three families to emulated kernels (built from the same
    builders and keys as on a GPU, under the launchers' configs)."""
    monkeypatch.delenv(_jit.ENV_TARGET, raising=False)  # no dependent launch on the host

    def compiled(name, build, *key, config=None):
        if config is None and hasattr(build, "config_for"):
            config = build.config_for(*key)
        return build(*key) if config is None else build(*key, config=config)

    monkeypatch.setattr(_jit, "compiled", compiled)
    monkeypatch.setattr(_jit, "entry", emulate)
    # the activations' row-loop range is a CUDA device's (its L2 and SMs): here 4 to 6 rows take it, so
    # that the unfused silu of some contracts runs the row loop
    monkeypatch.setattr(act, "row_loop_tokens",
                        lambda d, dtype, a, device: range(4, 7) if a in act._ROW_LOOP_ACTIVATIONS else range(0))
    for module in (norm, act, quant):
        for cache in ("_functions", "_quant_functions"):
            if isinstance(getattr(module, cache, None), dict):
                monkeypatch.setattr(module, cache, {})
    lookups = (quant._function, quant._scaled_function, quant._absmax_function, act._quant_function)
    saved = [dict(f.cache) for f in lookups]
    for f in lookups:  # _jit.host_functions' per-key caches, filled from the patched compiled and entry
        f.cache.clear()
    yield emulate
    for f, cache in zip(lookups, saved):
        f.cache.clear()
        f.cache.update(cache)


def _rows(shape, dtype, stride=None, offset=0, scale=4.0):
    """Random rows over a few binades (magnitudes about ``scale`` times 2^-6..2^6 per row), optionally
    strided (``stride`` elements a row) or at ``offset`` elements past an allocation."""
    width = stride or shape[-1]
    n = torch.Size((*shape[:-1], width)).numel()
    x = torch.randn(n + offset)[offset:].view(*shape[:-1], width) * scale
    x = x * torch.exp2(torch.randint(-6, 7, (*shape[:-1], 1)).float())
    return x.to(dtype)[..., :shape[-1]]


def test_scaled_fp8_quant_generated_code_on_cpu(on_cpu):
    """Static, per token (with and without scale_ub), per tensor: the reference's q and scales exactly;
    rows strided, misaligned, 3-D, a lone row, zero rows, a hidden size of no vector."""
    cases = [_rows((5, 256), torch.bfloat16), _rows((3, 100), torch.float16, 104), _rows((2, 3, 96), torch.float32),
             _rows((4, 64), torch.bfloat16, 67, 1), _rows((1, 5), torch.float32), _rows((0, 64), torch.bfloat16),
             _rows((2, 4096), torch.bfloat16)]
    for x in cases:
        for args in [(torch.rand(1) * 0.05 + 0.01,), (torch.tensor(0.02),), (None, True), (None, True, torch.tensor([3.0])),
                     (None, False)]:
            got = quant.scaled_fp8_quant(x, *args)
            want = scaled_reference(x, *args)
            fp8.assert_quantized(got, want, 0)
            assert_bits(got[1], want[1].contiguous(), f"{tuple(x.shape)} {args} scales")


def _static_scale():
    return torch.rand(1) * 0.01 + 0.005


def _mode_args(mode):
    kind, group, cm, ue = mode
    return (_static_scale() if kind == "static" else None), group, cm, ue


@pytest.fixture
def streamed_early(monkeypatch):
    """The norms' streamed kernel from 3 tokens (its threshold is the config's; fused op and norm read
    the same config), so that a few emulated rows take it."""
    original = norm.NormConfig.for_shape.__func__

    def for_shape(cls, n, dtype, fused):
        config = original(cls, n, dtype, fused)
        return type(config)(**{**config.__dict__, "streamed_from": 3})
    monkeypatch.setattr(norm.NormConfig, "for_shape", classmethod(for_shape))


# (op, hidden, dtype, weight dtype, leading shape, layout, modes): several rows a block (256), odd rows
# (257: scalar accesses, a masked tail, no groups), strided and misaligned rows, 3-D, zero rows
FULL = pytest.mark.tilelang_full  # the rest of the emulated kernels: `-m tilelang_full`, as CI runs it
_NORM_CPU = [
    ("rmsnorm_fp8_quant", 256, torch.bfloat16, torch.bfloat16, (5,), "contiguous", MODES),
    ("fused_add_rmsnorm_fp8_quant", 256, torch.float16, torch.float16, (2, 3), "contiguous", MODES[:3] + MODES[-1:]),
    pytest.param("gemma_fused_add_rmsnorm_fp8_quant", 384, torch.float32, torch.float32, (3,), "strided", MODES[:4],
                 marks=FULL),
    pytest.param("gemma_rmsnorm_fp8_quant", 257, torch.float16, torch.float32, (4,), "offset", MODES[:2], marks=FULL),
    pytest.param("fused_add_rmsnorm_fp8_quant", 96, torch.bfloat16, torch.bfloat16, (3,), "offset",
                 [MODES[1], (None, 32, True, True), (None, 4, False, True)], marks=FULL),
    pytest.param("rmsnorm_fp8_quant", 64, torch.bfloat16, torch.bfloat16, (0,), "contiguous", MODES[:3], marks=FULL),
]


def _ids(cases, fields):
    return ["-".join(str(c.values[i] if hasattr(c, "values") else c[i]).replace("torch.", "") for i in fields)
            for c in cases]


def _layout(shape, dtype, layout):
    if layout == "strided":
        return _rows(shape, dtype, shape[-1] + 8, scale=1.0)
    if layout == "offset":
        return _rows(shape, dtype, shape[-1] + 3, 1, scale=1.0)
    return _rows(shape, dtype, scale=1.0)


@pytest.mark.parametrize("op,n,dtype,wdtype,lead,layout,modes", _NORM_CPU, ids=_ids(_NORM_CPU, (0, 1, 2, 5)))
def test_norm_epilogues_generated_code_on_cpu(op, n, dtype, wdtype, lead, layout, modes, on_cpu):
    for mode in modes:
        x = _layout((*lead, n), dtype, layout)
        w = torch.randn(n).to(wdtype)
        r = _layout((*lead, n), dtype, layout) if "fused" in op else None
        check_norm_contract(op, x, w, 1e-6, *_mode_args(mode), r=r)


def test_norm_epilogues_streamed_on_cpu(on_cpu, streamed_early):
    """The streamed kernels (one chunk of 4 vectors a thread for rmsnorm, chunks of one for the fused
    ops, a masked last chunk) with each epilogue."""
    for op, n, dtype in [("rmsnorm_fp8_quant", 7168, torch.bfloat16), ("fused_add_rmsnorm_fp8_quant", 4096, torch.bfloat16),
                         ("gemma_fused_add_rmsnorm_fp8_quant", 6144, torch.float16)]:
        fused = "fused" in op
        config = norm.NormConfig.for_shape(n, norm._DTYPES[dtype], fused)
        assert norm._streams(n, norm._DTYPES[dtype], norm._DTYPES[dtype], config)
        for mode in (MODES[0], MODES[1], MODES[3], MODES[5]):
            x = _rows((3, n), dtype, scale=1.0)
            w = torch.randn(n).to(dtype)
            r = _rows((3, n), dtype, scale=1.0) if fused else None
            check_norm_contract(op, x, w, 1e-6, *_mode_args(mode), r=r)
        streamed = norm._quant_functions[(n, dtype, dtype, fused, op.startswith("gemma"), Epilogue("static"))]
        assert streamed[1] is not streamed[0]


@FULL
def test_norm_epilogues_in_two_passes_on_cpu(on_cpu):
    """Rows over 16384 values: a pass for the sum, the per-token max (or a group's over several
    passes) in one more, the quantisation (and the fused residual) in the last."""
    for op, mode in [("fused_add_rmsnorm_fp8_quant", MODES[1]), ("rmsnorm_fp8_quant", (None, 32768, True, True)),
                     ("fused_add_rmsnorm_fp8_quant", MODES[4]), ("gemma_rmsnorm_fp8_quant", MODES[0])]:
        x = _rows((2, 65536), torch.bfloat16, scale=1.0)
        w = torch.randn(65536).to(torch.bfloat16)
        r = _rows((2, 65536), torch.bfloat16, scale=1.0) if "fused" in op else None
        check_norm_contract(op, x, w, 1e-6, *_mode_args(mode), r=r)


_SILU_CPU = [((3,), 256, torch.bfloat16, None, MODES),
             pytest.param((2, 2), 7, torch.float32, None, MODES[:2], marks=FULL),
             pytest.param((4,), 384, torch.float16, 1000, MODES[:4], marks=FULL),
             pytest.param((3,), 48, torch.bfloat16, 101, [MODES[1], (None, 8, True, True), (None, 2, True, False)],
                          marks=FULL),
             pytest.param((0,), 64, torch.bfloat16, None, MODES[:3], marks=FULL)]


@pytest.mark.parametrize("lead,d,dtype,stride,modes", _SILU_CPU, ids=_ids(_SILU_CPU, (1, 2)))
def test_silu_epilogues_generated_code_on_cpu(lead, d, dtype, stride, modes, on_cpu):
    for mode in modes:
        x = _rows((*lead, 2 * d), dtype, stride, scale=2.0)
        check_silu_contract(x, *_mode_args(mode))


@FULL
def test_wide_rows_in_two_passes_on_cpu(on_cpu):
    """Per-token rows wider than a thread's registers at 1024 threads (fp32 65536: two spans), and a
    group as wide (silu, 65536 fp32 in one group): the max first, then the values again; one row of
    32768 bf16 in one pass."""
    x = _rows((1, 65536), torch.float32)
    for args in [(None, True), (None, True, torch.tensor([5.0]))]:
        fp8.assert_quantized(quant.scaled_fp8_quant(x, *args), scaled_reference(x, *args), 0)
    check_silu_contract(_rows((1, 2 * 65536), torch.float32, scale=2.0), None, -1, False, False)
    check_silu_contract(_rows((1, 2 * 65536), torch.float32, scale=2.0), None, 65536, True, True)
    check_silu_contract(_rows((1, 2 * 32768), torch.bfloat16, scale=2.0), None, -1, False, False)


def _poison(x):
    """NaN, +-inf and zeros at a few places of 2-D rows (a row of each kind when there are enough)."""
    x = x.clone()
    t, n = x.shape
    x[0, n // 3] = NAN
    if t > 1:
        x[1, n // 2] = INF
    if t > 2:
        x[2, 0] = -INF
    if t > 3:
        x[3, :] = 0.0
    return x


def test_non_finite_values_on_cpu(on_cpu):
    """A NaN makes its scale and what it governs NaN, an infinity its scale infinite (the finite q 0,
    the infinite NaN), a zero row the floor scale: as the unfused pair, as the reference for
    scaled_fp8_quant."""
    x = _poison(_rows((5, 256), torch.bfloat16))
    for args in [(_static_scale(),), (None, True), (None, False), (None, True, torch.tensor([2.0]))]:
        fp8.assert_quantized(quant.scaled_fp8_quant(x, *args), scaled_reference(x, *args), 0)
    w = torch.randn(256).to(torch.bfloat16)
    for op in ("rmsnorm_fp8_quant", "fused_add_rmsnorm_fp8_quant"):
        for mode in MODES[:3]:
            r = _rows((5, 256), torch.bfloat16) if "fused" in op else None
            check_norm_contract(op, x.clone(), w, 1e-6, *_mode_args(mode), r=r)
    g = _poison(_rows((5, 512), torch.bfloat16, scale=2.0))
    for mode in MODES[:3]:
        check_silu_contract(g, *_mode_args(mode))


@pytest.mark.parametrize("bad", [NAN] + [pytest.param(b, marks=FULL) for b in (0.0, -0.5, INF, -0.0, 1e-45)])
def test_a_bad_static_scale_gives_nan_q_on_cpu(bad, on_cpu):
    """A static scale that is not positive and finite: every q NaN, the scale copied as it is, no
    error (reading it on a GPU would synchronise); a positive subnormal scale is valid."""
    scale = torch.tensor([bad])
    x = _rows((3, 256), torch.bfloat16)
    w = torch.randn(256).to(torch.bfloat16)
    results = [quant.scaled_fp8_quant(x, scale), norm.rmsnorm_fp8_quant(x, w, 1e-6, scale),
               norm.fused_add_rmsnorm_fp8_quant(x, _rows((3, 256), torch.bfloat16), w, 1e-6, scale),
               act.silu_and_mul_fp8_quant(_rows((3, 512), torch.bfloat16), scale)]
    for q, s in results:
        assert_bits(s, scale)
        assert q.float().isnan().all() != (bad == 1e-45)
    if bad == 1e-45:
        fp8.assert_quantized(results[0], scaled_reference(x, scale), 0)


# --- with a GPU ----------------------------------------------------------------------------------------
# Each test first compiles what it calls from 16 threads (nvcc runs as a subprocess; ~3 s a kernel),
# calling the ops on one row of each hidden size: the norms compile their streamed kernel at the
# first call too.

DTYPES = [torch.bfloat16, torch.float16, torch.float32]
#: (leading shape, hidden size, layout): the issue's shapes (4096x4096, 8192x7168, 33 strided rows,
#: one row of 65536, zero rows), 3-D, a view at an odd offset, an odd hidden size
GPU_SHAPES = [((4096,), 4096, "contiguous"), ((8192,), 7168, "contiguous"), ((33,), 4096, "strided"),
              ((1,), 65536, "contiguous"), ((0,), 4096, "contiguous"), ((2, 3), 5120, "contiguous"),
              ((5,), 1000, "offset")]
#: the modes a shape's hidden size allows: group 128 and 64 with and without column-major and UE8M0
def _modes_for(n):
    return [m for m in MODES if m[1] == -1 or n % m[1] == 0]


def _warm(calls):
    import concurrent.futures

    with concurrent.futures.ThreadPoolExecutor(16) as pool:
        for f in [pool.submit(c) for c in calls]:
            f.result()
    torch.cuda.synchronize()


def _gpu_view(shape, dtype, layout, scale=1.0):
    """Random rows on the GPU: contiguous, rows strided by 8 more elements, or at an element past a
    16-byte boundary (then rows of an odd stride)."""
    n = shape[-1]
    if layout == "strided":
        return (torch.randn(*shape[:-1], n + 8, device="cuda") * scale).to(dtype)[..., :n]
    if layout == "offset":
        flat = (torch.randn(torch.Size(shape[:-1]).numel() * (n + 3) + 1, device="cuda") * scale).to(dtype)
        return flat[1:].view(*shape[:-1], n + 3)[..., :n]
    return (torch.randn(shape, device="cuda") * scale).to(dtype)


def _scale_gpu():
    return torch.rand(1, device="cuda") * 0.01 + 0.005


def _gpu_mode_args(mode):
    kind, group, cm, ue = mode
    return (_scale_gpu() if kind == "static" else None), group, cm, ue


def _norm_case(op, lead, n, dtype, layout, mode):
    x = _gpu_view((*lead, n), dtype, layout)
    w = torch.randn(n, device="cuda").to(dtype)
    r = _gpu_view((*lead, n), dtype, layout) if "fused" in op else None
    return check_norm_contract(op, x, w, 1e-6, *_gpu_mode_args(mode), r=r)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("op", NORM_OPS)
def test_norm_epilogues_are_the_unfused_pair(op, dtype):
    """Every mode on every shape: q, scales and the residual bit for bit what TileLang's norm then its
    quant op return; the static mode also within one e4m3 step of the reference (the norms' own
    rounding differs from the reference's by an ulp at most)."""
    shapes = GPU_SHAPES if dtype == torch.bfloat16 and not op.startswith("gemma") else GPU_SHAPES[2:3] + GPU_SHAPES[4:]
    _warm([lambda n=n, m=m: _norm_case(op, (1,), n, dtype, "contiguous", m)
           for _, n, _ in shapes for m in _modes_for(n)])
    reference = getattr(norm_ref, op)
    for lead, n, layout in shapes:
        for mode in _modes_for(n):
            (q, s), _ = _norm_case(op, lead, n, dtype, layout, mode)
        x = _gpu_view((*lead, n), dtype, layout)
        w = torch.randn(n, device="cuda").to(dtype)
        scale = _scale_gpu()
        if "fused" in op:
            r = _gpu_view((*lead, n), dtype, layout)
            got = getattr(norm, op)(x, r.clone(), w, 1e-6, scale)
            want = reference(x, r.clone(), w, 1e-6, scale)
        else:
            got, want = getattr(norm, op)(x, w, 1e-6, scale), reference(x, w, 1e-6, scale)
        fp8.assert_quantized(got, want, 1)


@pytest.mark.gpu
@pytest.mark.parametrize("op", ["rmsnorm_fp8_quant", "fused_add_rmsnorm_fp8_quant", "gemma_fused_add_rmsnorm_fp8_quant"])
def test_norm_epilogues_on_the_streamed_kernel(op):
    """From NormConfig.streamed_from tokens the norm takes its streamed kernel; so does the fused op,
    with the same result as the pair (one chunk, chunks, a masked one; strided rows)."""
    cases = [(n, dtype) for n, dtype in [(8192, torch.bfloat16), (7168, torch.float16), (4096, torch.float32)]]
    _warm([lambda n=n, d=d, m=m: _norm_case(op, (1,), n, d, "contiguous", m) for n, d in cases for m in _modes_for(n)])
    fused = "fused" in op
    for n, dtype in cases:
        config = norm.NormConfig.for_shape(n, norm._DTYPES[dtype], fused)
        assert norm._streams(n, norm._DTYPES[dtype], norm._DTYPES[dtype], config)
        for mode in _modes_for(n):
            _norm_case(op, (config.streamed_from,), n, dtype, "strided" if mode[2] else "contiguous", mode)


def _silu_case(lead, d, dtype, layout, mode):
    return check_silu_contract(_gpu_view((*lead, 2 * d), dtype, layout, 2.0), *_gpu_mode_args(mode))


#: (leading shape, d, layout): 4096 tokens of Llama-3-8B's 14336, 8192x7168, 33 strided rows, one row
#: of 65536 (and a d of 65536 in fp32: two passes), zero rows, 3-D, an odd offset, an odd d
SILU_SHAPES = [((4096,), 14336, "contiguous"), ((8192,), 7168, "contiguous"), ((33,), 2048, "strided"),
               ((1,), 32768, "contiguous"), ((0,), 4096, "contiguous"), ((2, 3), 1536, "contiguous"),
               ((5,), 1000, "offset"), ((3,), 7, "contiguous")]


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_silu_epilogue_is_the_unfused_pair(dtype):
    shapes = SILU_SHAPES if dtype == torch.bfloat16 else SILU_SHAPES[2:]
    if dtype == torch.float32:
        shapes = shapes + [((1,), 65536, "contiguous")]
    _warm([lambda d=d, m=m: _silu_case((1,), d, dtype, "contiguous", m) for _, d, _ in shapes for m in _modes_for(d)])
    for lead, d, layout in shapes:
        for mode in _modes_for(d):
            _silu_case(lead, d, dtype, layout, mode)
        x = _gpu_view((*lead, 2 * d), dtype, layout, 2.0)
        scale = _scale_gpu()
        fp8.assert_quantized(act.silu_and_mul_fp8_quant(x, scale), act_ref.silu_and_mul_fp8_quant(x, scale), 1)


SCALED_SHAPES = [((4096,), 4096, "contiguous"), ((8192,), 7168, "contiguous"), ((33,), 4096, "strided"),
                 ((1,), 65536, "contiguous"), ((0,), 4096, "contiguous"), ((2, 3), 5120, "contiguous"),
                 ((5,), 1000, "offset"), ((3,), 5, "contiguous"), ((300,), 128, "contiguous")]


def _scaled_modes():
    ub = lambda: torch.rand(1, device="cuda") * 4 + 1  # noqa: E731  (below some rows' max)
    return [lambda: (_scale_gpu(),), lambda: (None, True), lambda: (None, True, ub()), lambda: (None, False)]


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_scaled_fp8_quant_equals_the_reference(dtype):
    """Static, per token (with and without scale_ub), per tensor without a host sync: q and scales the
    reference's, bit for bit."""
    _warm([lambda n=n, m=m: quant.scaled_fp8_quant(_gpu_view((1, n), dtype, "contiguous", 4.0), *m())
           for _, n, _ in SCALED_SHAPES for m in _scaled_modes()])
    for lead, n, layout in SCALED_SHAPES:
        for mode in _scaled_modes():
            x = _gpu_view((*lead, n), dtype, layout, 4.0)
            x.mul_(torch.exp2(torch.randint(-6, 7, (*lead, 1), device="cuda").float()).to(dtype))  # keeps the layout
            args = mode()
            got, want = quant.scaled_fp8_quant(x, *args), scaled_reference(x, *args)
            fp8.assert_quantized(got, want, 0)
            assert_bits(got[1], want[1].contiguous(), f"{lead} {n} scales")


def _poisoned(rows, n, dtype, scale=1.0):
    return _poison((torch.randn(rows, n, device="cuda") * scale).to(dtype))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_non_finite_values_on_the_gpu(dtype):
    """NaN and infinities (and a zero row) as the unfused pair gives them; scaled_fp8_quant as the
    reference, NaN q where the reference has NaN."""
    x = _poisoned(6, 4096, dtype, 4.0)
    for args in [(_scale_gpu(),), (None, True), (None, False), (None, True, torch.tensor([2.0], device="cuda"))]:
        fp8.assert_quantized(quant.scaled_fp8_quant(x, *args), scaled_reference(x, *args), 0)
    w = torch.randn(4096, device="cuda").to(dtype)
    for op in NORM_OPS:
        for mode in MODES:
            r = torch.randn(6, 4096, device="cuda").to(dtype) if "fused" in op else None
            check_norm_contract(op, x.clone(), w, 1e-6, *_gpu_mode_args(mode), r=r)
    g = _poisoned(6, 2 * 4096, dtype, 2.0)
    for mode in MODES:
        check_silu_contract(g, *_gpu_mode_args(mode))


@pytest.mark.gpu
@pytest.mark.parametrize("bad", [0.0, -1.0, NAN, INF, -0.0])
def test_a_bad_static_scale_gives_nan_q_on_the_gpu(bad):
    """No host read of the scale: every q NaN, the scale copied, no error."""
    scale = torch.tensor([bad], device="cuda")
    x = torch.randn(7, 4096, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(4096, device="cuda", dtype=torch.bfloat16)
    for q, s in [quant.scaled_fp8_quant(x, scale), norm.rmsnorm_fp8_quant(x, w, 1e-6, scale),
                 norm.gemma_fused_add_rmsnorm_fp8_quant(x, torch.randn_like(x), w, 1e-6, scale),
                 act.silu_and_mul_fp8_quant(torch.randn(7, 2 * 4096, device="cuda", dtype=torch.bfloat16), scale)]:
        assert q.float().isnan().all()
        assert_bits(s, scale)


@pytest.mark.gpu
def test_registered_ops_reach_tilelang(tmp_path):
    """On CUDA the registered FP8 ops are TileLang's (the default backend), none refused."""
    from torch_kernels import dispatch

    trace = tmp_path / "trace.txt"
    dispatch.configure(trace_path=str(trace))
    x = torch.randn(3, 256, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(256, device="cuda", dtype=torch.bfloat16)
    ops = torch.ops.deepinfer
    ops.scaled_fp8_quant(x, None, True)
    ops.rmsnorm_fp8_quant(x, w, 1e-6, None, 128)
    ops.fused_add_rmsnorm_fp8_quant(x, torch.randn_like(x), w, 1e-6, None, -1)
    ops.gemma_rmsnorm_fp8_quant(x, w, 1e-6, _scale_gpu())
    ops.gemma_fused_add_rmsnorm_fp8_quant(x, torch.randn_like(x), w, 1e-6, None, 64, True, True)
    ops.silu_and_mul_fp8_quant(x, None, 64)
    lines = [line for line in trace.read_text().splitlines() if not line.startswith("tilelang-compile|")]
    assert lines == [f"{op}|tilelang" for op in ("scaled_fp8_quant",) + NORM_OPS + ("silu_and_mul_fp8_quant",)]


@pytest.mark.gpu
def test_cuda_graph_capture_and_replay():
    """Captured (the per-tensor quant's zeroed max included), a graph replays the ops on new data."""
    x = torch.randn(64, 4096, device="cuda", dtype=torch.bfloat16)
    r = torch.randn_like(x)
    w = torch.randn(4096, device="cuda", dtype=torch.bfloat16)
    g = torch.randn(64, 2 * 1536, device="cuda", dtype=torch.bfloat16)
    scale = _scale_gpu()

    def run():
        return (norm.fused_add_rmsnorm_fp8_quant(x, r, w, 1e-6, scale), norm.rmsnorm_fp8_quant(x, w, 1e-6, None, 128),
                act.silu_and_mul_fp8_quant(g), quant.scaled_fp8_quant(x))
    run()  # compile outside the capture
    r0 = r.clone()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = run()
    for _ in range(2):
        x.copy_(torch.randn_like(x)), g.copy_(torch.randn_like(g))
        r.copy_(r0)
        graph.replay()
        torch.cuda.synchronize()
        got = [tuple(t.clone() for t in o) for o in outs]
        r.copy_(r0)
        want = run()
        for a, b in zip(got, want):
            assert_bits(a[0], b[0])
            assert_bits(a[1], b[1])
