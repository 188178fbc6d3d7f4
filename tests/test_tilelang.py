"""The TileLang backend.

Without a GPU (CI): every family module's ``ci_kernels()`` compiles for sm_90 (modules are discovered,
so a new family is picked up with no change here; a representative part in the default run, the rest
under ``-m tilelang_full``, which CI also runs) and the benchmark shapes compile to 16-byte accesses;
the disk cache is shared soundly by two processes compiling one kernel at once, and a third loads it
without any compiler; the trace line of a first compile; ``_jit``'s memo and locking; the
launchers' heuristics and the contract they keep with the compiled kernels (checked with a stand-in
kernel that computes the reference).

With a GPU (``@pytest.mark.gpu``): one compiled kernel serves every batch size; layouts at their
boundaries, misaligned views, other weight dtypes, offsets past 2^31 elements and CUDA-graph capture,
against the reference. The numerics over dtypes and awkward shapes are also covered by
``test_norm.py``/``test_activation.py``, which compare every available backend.
"""

import concurrent.futures
import dataclasses
import importlib
import itertools
import importlib.util
import json
import os
import re
import subprocess
import sys
import textwrap
import threading
import time

import pytest
import torch

from torch_kernels import dispatch, registry
from torch_kernels.backends import norm_rows, tilelang_jit as _jit
from torch_kernels.spec import Backend
from torch_kernels.testing import assert_close

from conftest import family_ops
from test_activation import activation_cases

pytestmark = pytest.mark.skipif(importlib.util.find_spec("tilelang") is None, reason="tilelang is not installed")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FAMILIES = sorted({k.target.split(".")[2] for k in registry.KERNELS if k.backend is Backend.TILELANG})
# the norms with an FP8 epilogue: tests/test_fp8_tilelang.py
NORM_OPS = [op for op in family_ops("norm", Backend.TILELANG) if not op.endswith("_fp8_quant")]
TRACE_LINE = re.compile(r"^tilelang-compile\|(?P<name>[^|]+)\|(?P<key>[^|]*)\|(?P<seconds>\d+\.\d{3})s$")


def _run(code: str, env: dict, *args: str, wait: bool = True):
    """``code`` in a fresh Python (TileLang reads its cache directory when it is first imported)."""
    full_env = {**os.environ, "PYTHONPATH": ROOT, **env}
    cmd = [sys.executable, "-c", textwrap.dedent(code), *args]
    if not wait:
        return subprocess.Popen(cmd, cwd=ROOT, env=full_env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    return subprocess.run(cmd, cwd=ROOT, env=full_env, capture_output=True, text=True, timeout=900)


# --- every kernel compiles for sm_90 ---------------------------------------------------------------
# The default run compiles a representative part of each family's ci_kernels() (DEFAULT_KEYS); the
# rest carries the `tilelang_full` mark, which the default run deselects (setup.cfg) and CI runs too
# (.ci/run), so every kernel is compiled in CI. Both compile in one process per core.

_COMPILE = """
    import concurrent.futures, importlib, json, os, sys, traceback
    from torch_kernels.backends import tilelang_jit as _jit

    out_dir, part, shard, shards = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
    default_keys, families = json.loads(sys.argv[5]), sys.argv[6:]
    results, jobs = {}, []
    for family in families:
        try:
            kernels = list(importlib.import_module(f"torch_kernels.families.{family}.tilelang").ci_kernels())
        except Exception:
            results[family] = {"error": traceback.format_exc()}
            continue
        results[family] = {"kernels": [], "keys": []}
        for i, (name, build, key) in enumerate(kernels):
            label = "_".join(map(str, key))
            default = i == 0 or label in default_keys.get(family, ())  # the first: the benchmark shape
            if default == (part == "default"):
                results[family]["keys"].append(label)
                jobs.append((family, label, (name, build, key)))
    jobs = jobs[shard::shards]

    def compile_one(job):
        family, label, (name, build, key) = job
        try:
            source = _jit.compiled(name, build, *key).get_kernel_source()
        except Exception:
            return family, {"key": label, "error": traceback.format_exc()[-3000:]}
        path = os.path.join(out_dir, family + "-" + label + ".cu")
        with open(path, "w") as f:
            f.write(source)
        return family, {"key": label, "error": None, "source": path}

    # nvcc runs as a subprocess: two threads keep this process's core busy while one waits for it.
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        for family, result in pool.map(compile_one, jobs):
            results[family]["kernels"].append(result)
    print(json.dumps(results))
"""

# Keys the default run compiles beside each family's first: those whose generated code the tests below
# read, and the norms' streamed kernel (a builder of its own). 12 of the 75 kernels.
DEFAULT_KEYS = {
    "norm": ["8192_bfloat16_bfloat16_True_False", "8192_bfloat16_bfloat16_True_False_True"],
    "activation": ["14336_bfloat16_gelu_16_False", "4864_float16_gelu_tanh_8_False", "14336_bfloat16_gelu_tanh_8_False",
                   "14336_bfloat16_silu_8_True"],
}


def _compile_for_sm90(out, part: str) -> dict:
    """``part`` ("default" or "rest") of every family's ci_kernels() compiled for sm_90 in fresh
    processes (one per core) with an empty cache: {family: {"keys": [...], "kernels": [{key, error,
    source}]}} or {family: {"error": traceback}}."""
    env = {_jit.ENV_TARGET: json.dumps(_jit.SM90), "TILELANG_CACHE_DIR": str(out / "cache")}
    shards = min(8, os.cpu_count() or 1)  # each process imports torch and TileLang
    procs = [_run(_COMPILE, env, str(out), part, str(i), str(shards), json.dumps(DEFAULT_KEYS), *FAMILIES, wait=False)
             for i in range(shards)]
    merged = {}
    for p in procs:
        stdout, stderr = p.communicate(timeout=1800)
        assert p.returncode == 0, stderr[-5000:]
        for family, result in json.loads(stdout.strip().splitlines()[-1]).items():
            merged.setdefault(family, {**result, "kernels": []})["kernels"] += result.get("kernels", [])
    return merged


@pytest.fixture(scope="module")
def sm90_build(tmp_path_factory):
    return _compile_for_sm90(tmp_path_factory.mktemp("sm90"), "default")


@pytest.fixture(scope="module")
def sm90_build_rest(tmp_path_factory):
    return _compile_for_sm90(tmp_path_factory.mktemp("sm90_rest"), "rest")


def _check_compiled(family, result):
    assert "error" not in result, f"torch_kernels.families.{family}.tilelang.ci_kernels() failed:\n{result.get('error')}"
    assert sorted(k["key"] for k in result["kernels"]) == sorted(result["keys"]), family
    failed = [f"{k['key']}:\n{k['error']}" for k in result["kernels"] if k["error"]]
    assert not failed, "\n\n".join(failed)


def test_family_modules_are_discovered():
    assert {"norm", "activation"} <= set(FAMILIES)


@pytest.mark.parametrize("family", FAMILIES)
def test_ci_kernels_compile_for_sm90(family, sm90_build):
    result = sm90_build[family]
    _check_compiled(family, result)
    assert result["kernels"], f"{family}.ci_kernels() yields no kernel"


@pytest.mark.tilelang_full
@pytest.mark.parametrize("family", FAMILIES)
def test_the_rest_of_ci_kernels_compile_for_sm90(family, sm90_build_rest):
    _check_compiled(family, sm90_build_rest[family])
    _check_waits_for_its_predecessor(sm90_build_rest[family]["kernels"])


def _global_accesses(source: str, buffers):
    """The vector type of each global access to ``buffers`` in generated CUDA ('scalar' for ``B[...]``)."""
    names = "|".join(buffers)
    vectors = re.findall(rf"\*\((\w+)\*\)\((?:{names}) \+", source)
    scalars = re.findall(rf"(?<![\w.])(?:{names})\[", source)
    return vectors + ["scalar"] * len(scalars)


@pytest.mark.parametrize("family,key,buffers", [
    ("norm", "8192_bfloat16_bfloat16_False_False", ("X", "Wt", "O")),
    ("norm", "8192_bfloat16_bfloat16_True_False", ("X", "R", "Wt")),
    ("activation", "14336_bfloat16_silu_8_False", ("Xa", "O")),
    ("activation", "14336_bfloat16_silu_8_True", ("Xa", "O")),
    ("activation", "14336_bfloat16_gelu_16_False", ("Xa", "O")),
])
def test_benchmark_shapes_compile_to_16_byte_accesses(family, key, buffers, sm90_build):
    """The H200 benchmark shapes read and write every tensor in 16-byte vectors (uint4: 8 bf16)."""
    kernels = {os.path.basename(k["source"]): k for k in sm90_build[family]["kernels"] if k["error"] is None}
    source = open(kernels[f"{family}-{key}.cu"]["source"]).read()
    accesses = _global_accesses(source, buffers)
    assert accesses and set(accesses) == {"uint4"}, accesses


def test_only_the_bf16_tanh_gelu_takes_tanh_approx(sm90_build):
    """ActivationConfig.tanh_approx (activation._TANH_APPROX): the bf16 tanh GELU evaluates tanh by one
    tanh.approx.f32 (no ex2, no rcp); the fp16 one and silu keep the sigmoid form, whose error the
    tighter tolerances need."""
    kernels = {os.path.basename(k["source"]): k for k in sm90_build["activation"]["kernels"] if k["error"] is None}
    source = {key: open(kernels[f"activation-{key}.cu"]["source"]).read()
              for key in ("14336_bfloat16_gelu_tanh_8_False", "4864_float16_gelu_tanh_8_False", "14336_bfloat16_silu_8_False")}
    approx = source["14336_bfloat16_gelu_tanh_8_False"]
    assert "tanh.approx.f32" in approx and "tk_tanh_approx(" in approx.split("tk_tanh_approx(float", 1)[1]
    assert "fast_rcp" not in approx and "__expf" not in approx
    for key in ("4864_float16_gelu_tanh_8_False", "14336_bfloat16_silu_8_False"):
        assert "tanh.approx" not in source[key] and "fast_rcp" in source[key], key


def test_the_row_loop_lets_the_next_kernel_in_as_each_block_ends(sm90_build):
    """The activations' row loop (ActivationConfig.row_loop, FlashInfer's launch): a block loops over its
    row's tiles and triggers its successor after the loop, never before it."""
    kernels = {os.path.basename(k["source"]): k for k in sm90_build["activation"]["kernels"] if k["error"] is None}
    source = open(kernels["activation-14336_bfloat16_silu_8_True.cu"]["source"]).read()
    loop = source.index("for (int tile = 0; tile < 7; ++tile)")
    assert source.count("cudaTriggerProgrammaticLaunchCompletion();") == 1
    assert loop < source.index("cudaTriggerProgrammaticLaunchCompletion();"), source[:3000]


def test_the_early_trigger_skips_the_calls_that_sit_in_l2(sm90_build):
    """Kernels trigger their successor early except where a call moves 4 to 32 MB
    (_jit.NO_TRIGGER_BYTES): silu_and_mul of 2*14336 bf16 moves 86016 bytes a token, so from 49 to 390
    tokens it leaves the trigger to its blocks' exit."""
    kernels = {os.path.basename(k["source"]): k for k in sm90_build["activation"]["kernels"] if k["error"] is None}
    source = open(kernels["activation-14336_bfloat16_silu_8_False.cu"]["source"]).read()
    low, high = (-(-limit // (3 * 14336 * 2)) for limit in _jit.LaunchConfig().no_trigger_bytes)
    assert (low, high) == (49, 391)
    condition = re.search(r"if \(\(num_tokens < (\d+)\) \|\| \((\d+) <= num_tokens\)\) \{\s*"
                          r"cudaTriggerProgrammaticLaunchCompletion\(\);", source)
    assert condition and (int(condition[1]), int(condition[2])) == (low, high), source[:3000]


# --- the disk cache across processes, the trace --------------------------------------------------

_COMPILE_ONE = """
    import json, os, subprocess, sys, time
    from torch_kernels.backends import tilelang_jit as _jit
    from torch_kernels.families.norm import tilelang as norm

    mode, barrier = sys.argv[1], sys.argv[2]
    if mode == "load":  # a cache hit must start no compiler (nvcc, or the C compiler of the host code)
        def no_compiler(*args, **kwargs):
            raise RuntimeError(f"a compiler was started: {args[0] if args else kwargs}")
        subprocess.Popen = no_compiler
    else:  # start compiling at the same moment as the other process
        open(barrier + "." + mode, "w").close()
        while not os.path.exists(barrier + ".go"):
            time.sleep(0.01)
    kernel = _jit.compiled("rmsnorm", norm._build, 384, "float16", "float32", True, True)
    # The launcher reaches the compiled host function, whose checks (argument count and kinds, then
    # the first tensor's ndim, dtype, shape and strides) pass up to its device: this machine's is CPU.
    import torch
    try:
        x = torch.randn(3, 384, dtype=torch.float16)
        norm.gemma_fused_add_rmsnorm(x, torch.randn_like(x), torch.randn(384), 1e-6)
        refused = None
    except RuntimeError as e:
        refused = str(e)
    print(json.dumps({"source": kernel.get_kernel_source(), "cpu_call": refused}))
"""


def test_two_processes_compile_one_kernel_at_once_and_a_third_loads_it(tmp_path):
    cache, trace, barrier = tmp_path / "cache", tmp_path / "trace.txt", str(tmp_path / "barrier")
    env = {_jit.ENV_TARGET: json.dumps(_jit.SM90), "TILELANG_CACHE_DIR": str(cache),
           dispatch.ENV_TRACE: str(trace)}
    writers = [_run(_COMPILE_ONE, env, f"writer{i}", barrier, wait=False) for i in range(2)]
    for _ in range(6000):  # until both are ready (TileLang's import: seconds), at most 5 minutes
        if all(os.path.exists(f"{barrier}.writer{i}") for i in range(2)) or any(w.poll() is not None for w in writers):
            break
        time.sleep(0.05)
    open(f"{barrier}.go", "w").close()
    outputs = [w.communicate(timeout=600) for w in writers]
    for w, (stdout, stderr) in zip(writers, outputs):
        assert w.returncode == 0, stderr[-5000:]
    compiled = [json.loads(stdout.strip().splitlines()[-1]) for stdout, _ in outputs]
    assert compiled[0]["source"] == compiled[1]["source"]

    # One complete entry, published by rename; nothing left in the staging area.
    entries = list(cache.glob("*/*/kernels/*"))
    assert len(entries) == 1, entries
    files = json.loads((entries[0] / "manifest.json").read_text())["files"]
    assert any(name.endswith(".so") for name in files), files
    assert all((entries[0] / name).stat().st_size == meta["size"] for name, meta in files.items())
    assert not list(cache.glob("*/*/.staging/*"))

    r = _run(_COMPILE_ONE, env, "load", barrier)
    assert r.returncode == 0, r.stderr[-5000:]
    loaded = json.loads(r.stdout.strip().splitlines()[-1])
    assert loaded["source"] == compiled[0]["source"]
    assert loaded["cpu_call"].startswith("kernel fused_add_rmsnorm input X device_type mismatch, expected cuda")

    lines = trace.read_text().splitlines()
    assert len(lines) == 3, lines
    for line in lines:
        m = TRACE_LINE.match(line)
        assert m and m["name"] == "rmsnorm" and m["key"] == "384,float16,float32,True,True", line


def test_trace_line_format(tmp_path):
    trace = tmp_path / "trace.txt"
    dispatch.configure(trace_path=str(trace))
    _jit._trace_compile("rmsnorm", (8192, "bfloat16", "bfloat16", False, True), 2.5)
    assert trace.read_text() == "tilelang-compile|rmsnorm|8192,bfloat16,bfloat16,False,True|2.500s\n"


# --- _jit: target, memo, locking (tilelang.compile replaced by a stand-in) -----------------------


def test_target_from_the_environment(monkeypatch):
    monkeypatch.delenv(_jit.ENV_TARGET, raising=False)
    assert _jit.target() == "cuda"
    monkeypatch.setenv(_jit.ENV_TARGET, json.dumps(_jit.SM90))
    assert _jit.target() == {"kind": "cuda", "arch": "sm_90"}
    monkeypatch.setenv(_jit.ENV_TARGET, "cuda -arch=sm_80")
    assert _jit.target() == "cuda -arch=sm_80"


def test_dependent_launch_on_sm90_unless_turned_off(monkeypatch):
    monkeypatch.delenv(_jit.ENV_PDL, raising=False)
    monkeypatch.setenv(_jit.ENV_TARGET, json.dumps(_jit.SM90))
    assert _jit.dependent_launch()
    monkeypatch.setenv(_jit.ENV_PDL, "0")
    assert not _jit.dependent_launch()
    monkeypatch.delenv(_jit.ENV_PDL)
    monkeypatch.setenv(_jit.ENV_TARGET, "cuda -arch=sm_80")
    assert not _jit.dependent_launch()  # griddepcontrol needs sm_90


@pytest.mark.parametrize("family", FAMILIES)
def test_every_kernel_waits_for_its_predecessor_before_any_access(family, sm90_build):
    """With programmatic dependent launch a kernel may start before the previous one on the stream has
    finished: its first statement must be the wait (cudaGridDependencySynchronize). Right after it, it
    lets the next one be scheduled (cudaTriggerProgrammaticLaunchCompletion, _jit.EARLY_TRIGGER)."""
    _check_waits_for_its_predecessor(sm90_build[family]["kernels"])


def _check_waits_for_its_predecessor(kernels):
    for k in kernels:
        source = open(k["source"]).read()
        body = source[source.index("{", source.index("__launch_bounds__")):]
        wait = body.find("cudaGridDependencySynchronize()")
        assert wait >= 0, k["key"]
        # before it only declarations and register-only initialisation: no global buffer indexed yet
        assert not re.search(r"\b[A-Z]\w*(\[| \+ )", body[:wait]), (k["key"], body[:wait])
        assert body.find("cudaTriggerProgrammaticLaunchCompletion()") > wait, k["key"]


def test_compiled_once_per_key_across_threads(monkeypatch, tmp_path):
    """Eight threads ask for two keys: each key compiles once, the two side by side (each compile
    waits for the other to start), and each first compile is traced."""
    tilelang = pytest.importorskip("tilelang")
    calls, both_started = [], threading.Barrier(2, timeout=60)

    def fake_compile(func, target=None, execution_backend=None):
        calls.append((func, execution_backend))
        both_started.wait()
        return object()

    monkeypatch.setattr(tilelang, "compile", fake_compile)
    dispatch.configure(trace_path=str(tmp_path / "trace.txt"))
    _jit.clear_memo()
    try:
        with concurrent.futures.ThreadPoolExecutor(8) as pool:
            futures = [pool.submit(_jit.compiled, "k", lambda s: f"func-{s}", key) for key in "abababab"]
            kernels = [f.result() for f in futures]
        assert len({id(k) for k in kernels[0::2]}) == 1 and len({id(k) for k in kernels[1::2]}) == 1
        assert kernels[0] is not kernels[1]
        assert sorted(calls) == [("func-a", "tvm_ffi"), ("func-b", "tvm_ffi")]
        assert _jit.memo_size() == 2
        lines = (tmp_path / "trace.txt").read_text().splitlines()
        assert sorted(TRACE_LINE.match(l)["key"] for l in lines) == ["a", "b"]
    finally:
        _jit.clear_memo()


def test_a_kernel_built_for_one_config_never_serves_another(monkeypatch):
    """The config record is part of the compile key: the same key under two configs compiles twice,
    and the builder receives the config it was asked for."""
    tilelang = pytest.importorskip("tilelang")
    from torch_kernels.families.norm import tilelang as norm
    monkeypatch.setattr(tilelang, "compile", lambda func, target=None, execution_backend=None: object())
    built = []

    def build(n, config=None):
        built.append(config)
        return f"func-{n}"
    base = norm.NormConfig.for_shape(8192, "bfloat16", True)
    other = dataclasses.replace(base, prefetch_weight=False)
    _jit.clear_memo()
    try:
        kernels = [_jit.compiled("k", build, 8192, config=c) for c in (base, other, base, None)]
        assert kernels[0] is kernels[2] and len({id(k) for k in kernels}) == 3
        assert built == [base, other, None]
    finally:
        _jit.clear_memo()


def test_launchers_take_the_configs_of_their_heuristics(monkeypatch):
    """Each launcher compiles under its family's ``for_shape`` (memoised with the host function)."""
    from torch_kernels.families.activation import tilelang as activation
    from torch_kernels.families.norm import tilelang as norm
    asked = []
    monkeypatch.setattr(_jit, "compiled", lambda name, build, *key, config=None: asked.append((key, config)))
    monkeypatch.setattr(_jit, "entry", lambda kernel: kernel)
    monkeypatch.setattr(norm, "_functions", {})
    monkeypatch.setattr(activation, "_functions", {})
    norm._function(8192, torch.bfloat16, torch.bfloat16, False, False, 1)
    activation._function(7168, torch.bfloat16, "gelu", 64)
    config = norm.NormConfig.for_shape(8192, "bfloat16", False)
    assert asked[:2] == [((8192, "bfloat16", "bfloat16", False, False), config),
                         ((8192, "bfloat16", "bfloat16", False, False, True), config)]
    assert config.elements_per_thread == 32 and config.streamed_threads == 256
    assert asked[2] == ((7168, "bfloat16", "gelu", 16, False), activation.ActivationConfig.for_shape("bfloat16", "gelu", 64))
    # the builders' own default (what ci_kernels() compile) is the launchers': one memo entry for both
    assert all(build.config_for(*key) == config for build, (key, config) in zip(
        (norm._build, norm._build, activation._build), asked))


# --- launcher heuristics --------------------------------------------------------------------------

NORM_SIZES = [1, 2, 3, 8, 64, 96, 100, 128, 257, 1000, 2048, 4096, 5120, 7168, 8192, 12288, 16384, 16385,
              20000, 65536, 131072]


def test_self_check_compiles_tilelang_kernels_from_several_threads(monkeypatch, cuda_platform):
    """``python -m torch_kernels`` first runs every TileLang kernel of its check from a thread pool, so
    that their compiles overlap (nvcc is a subprocess); each (op, dtype, sample) once, errors left to
    the check."""
    import torch_kernels.__main__ as main
    from torch_kernels import ops

    class Usable:
        def is_available(self, platform):
            return True

    threads, calls = set(), []

    def fake_kernel(*args):
        threads.add(threading.get_ident())
        calls.append(args)
        time.sleep(0.02)  # a compile's worth of waiting, so that the pool's threads overlap
        if len(calls) % 7 == 0:
            raise RuntimeError("a kernel that fails here is reported by the check, not by the warm-up")

    with_tilelang = {"rmsnorm", "silu_and_mul"}
    monkeypatch.setattr(registry, "BY_OP", {op: ({**per, Backend.TILELANG: Usable()} if op in with_tilelang else
                                                 {b: k for b, k in per.items() if b is not Backend.TILELANG})
                                            for op, per in registry.BY_OP.items()})
    monkeypatch.setattr(main, "as_dispatched", lambda spec: fake_kernel)
    expected = sum(len(list(ops.BY_NAME[op].samples("cpu", d))) for op in with_tilelang for d in main.CHECK_DTYPES)
    assert main._compile_tilelang_in_parallel(cuda_platform, "cpu") == expected == len(calls) > 0
    assert len(threads) == min(os.cpu_count() or 1, expected)



@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32"])
def test_norm_layouts(dtype):
    from torch_kernels.families.norm import tilelang as norm
    for n, fused in itertools.product(NORM_SIZES, (False, True)):
        config = norm.NormConfig.for_shape(n, dtype, fused)
        vec, tr, bm, width = norm._layout(n, dtype, fused)
        assert vec * _jit.ELEMENT_BYTES[dtype] <= 16 and n % vec == 0 and vec & (vec - 1) == 0, n
        assert tr & (tr - 1) == 0 and tr * bm <= norm_rows.MAX_THREADS, n  # the row sum is one butterfly
        assert width % (tr * vec) == 0, n  # whole stripes of vectors
        per_thread = width // tr
        if n <= norm._ONE_PASS_MAX:
            assert width >= n and width - n < tr * vec, n  # one pass, less than a stripe of padding
            assert bm == 1 or tr * bm == norm_rows.BLOCK_THREADS, n
            # at most twice the target a thread, or a row tiled exactly with up to the exact-tiling budget
            assert per_thread <= 2 * config.elements_per_thread or (
                width == n and per_thread <= config.exact_max_per_thread), n
        else:
            assert bm == 1 and per_thread == config.elements_per_thread, n
    # the benchmark rows: 256 threads, four 16-byte vectors each; fused, 512 threads with two
    assert norm._layout(8192, "bfloat16") == (8, 256, 1, 8192)
    assert norm._layout(8192, "bfloat16", fused=True) == (8, 512, 1, 8192)
    assert norm._layout(4096, "bfloat16", fused=True) == (8, 128, 1, 4096)
    # 7168 tiled exactly by 128 threads of 56 values, not padded to 8192 columns
    assert norm._layout(7168, "bfloat16") == norm._layout(7168, "bfloat16", fused=True) == (8, 128, 1, 7168)


def test_streamed_norm_thresholds():
    """Every norm takes the streamed kernel from tensors of 128 MB; rmsnorm's rows of 16 KB from 4096
    tokens."""
    from torch_kernels.families.norm import tilelang as norm
    assert norm.NormConfig.for_shape(8192, "bfloat16", False).streamed_from == norm._STREAMED_MIN_TOKENS == 4096
    assert norm.NormConfig.for_shape(4096, "float32", False).streamed_from == 4096  # rows of 16 KB
    assert norm.NormConfig.for_shape(4096, "bfloat16", False).streamed_from == 16384  # narrower: from 128 MB
    assert norm.NormConfig.for_shape(7168, "bfloat16", False).streamed_from == 9363
    assert norm.NormConfig.for_shape(4096, "bfloat16", True).streamed_from == 16384
    assert norm.NormConfig.for_shape(8192, "bfloat16", True).streamed_from == 8192
    assert norm.NormConfig.for_shape(7168, "bfloat16", True).streamed_from == 9363  # ceil(2^27 / 14336)
    assert norm.NormConfig.for_shape(4096, "float32", True).streamed_from == 8192
    assert norm.NormConfig.for_shape(65536, "bfloat16", True).streamed_from == 4096  # never below rmsnorm's


def test_activation_tiles():
    from torch_kernels.families.activation import tilelang as activation
    for d, per_thread in itertools.product([1, 2, 3, 5, 8, 100, 128, 200, 257, 1000, 1024, 1536, 4864, 14336, 65536],
                                           [activation.ActivationConfig.per_thread, activation._WIDE_PER_THREAD]):
        tile = per_thread * activation.ActivationConfig.threads
        bm, bn = activation._tile(d, per_thread)
        assert bm * bn == tile and bn & (bn - 1) == 0 and bn >= per_thread, d
        assert bn >= min(d, tile) and (bm == 1 or bn < max(2 * d, 2 * per_thread)), d
        for dtype in ("float16", "bfloat16", "float32"):
            vec = activation._vec(d, dtype)
            assert d % vec == 0 and vec * _jit.ELEMENT_BYTES[dtype] <= 16 and per_thread % vec == 0
    # the erf GELU's 16 a thread from 32 tokens; every other activation and token count 8
    assert [activation._per_thread("gelu", t) for t in (1, 31, 32, 16384)] == [8, 8, 16, 16]
    assert {activation._per_thread(act, t) for act in ("silu", "gelu_tanh") for t in (1, 32, 16384)} == {8}


def test_ci_kernels_cover_every_variant():
    from torch_kernels.families.activation import tilelang as activation
    from torch_kernels.families.norm import tilelang as norm
    keys = [key for _, _, key in norm.ci_kernels()]
    assert {k[1] for k in keys} == {"float16", "bfloat16", "float32"}
    assert {(k[3], k[4]) for k in keys} == {(f, g) for f in (False, True) for g in (False, True)}
    assert any(k[1] != k[2] for k in keys)  # a weight dtype other than the input's
    layouts = {norm._layout(k[0], k[1], k[3])[1:3] for k in keys}
    assert any(bm > 1 for _, bm in layouts) and any(k[0] > norm._ONE_PASS_MAX for k in keys)
    assert any(norm._vec(k[0], k[1]) == 1 for k in keys)
    streamed = [k for k in keys if len(k) > 5 and k[5]]  # the many-token kernel: one chunk, chunks, masked
    assert streamed and all(norm._streams(k[0], k[1], k[2], norm.NormConfig.for_shape(k[0], k[1], k[3])) for k in streamed)
    assert {k[0] % (norm.NormConfig.for_shape(k[0], k[1], k[3]).streamed_threads * _jit.lanes(k[1])) == 0
            for k in streamed} == {False, True}
    assert {k[3] for k in streamed} == {False, True}
    keys = [key for _, _, key in activation.ci_kernels()]
    assert {k[1] for k in keys} == {"float16", "bfloat16", "float32"}
    assert {k[2] for k in keys} == set(activation._ACTIVATIONS)
    assert any(activation._tile(k[0])[0] > 1 for k in keys) and any(k[0] % activation._tile(k[0])[1] for k in keys)
    assert any(activation._vec(k[0], k[1]) == 1 for k in keys)
    assert {k[3] for k in keys} == {activation.ActivationConfig.per_thread, activation._WIDE_PER_THREAD}


# --- the launchers' contract with the kernels, on CPU ---------------------------------------------
# The compiled host function wants (T, N) row views with the last dim contiguous, 16-byte aligned data
# and row strides that are multiples of the vector, a contiguous output, and no launch for zero rows.
# A stand-in checks exactly that and computes the reference, so the launchers' views, copies and
# write-backs are checked here without a GPU.


def _check_contract(vec, rows, others=()):
    for t in rows:
        assert t.dim() == 2 and t.stride(1) == 1 and t.shape[0] > 0, (t.shape, t.stride())
        assert t.stride(0) % vec == 0 and t.data_ptr() % 16 == 0, (t.stride(), t.data_ptr() % 16)
    for t in others:
        assert t.is_contiguous() and t.data_ptr() % 16 == 0


def _stand_in_norm(monkeypatch, calls):
    from torch_kernels.families.norm import tilelang as norm
    from torch_kernels.families.norm import reference as ref

    def function(n, dtype, weight_dtype, fused, gemma, tokens):
        vec = norm._vec(n, norm._DTYPES[dtype])

        def host(*args):
            calls.append(args)
            if fused:
                x, r, w, eps = args
                _check_contract(vec, (x, r), (w,))
                (ref.gemma_fused_add_rmsnorm if gemma else ref.fused_add_rmsnorm)(x, r, w, eps)
            else:
                x, w, out, eps = args
                _check_contract(vec, (x, out), (w, out))
                out.copy_((ref.gemma_rmsnorm if gemma else ref.rmsnorm)(x, w, eps))
        return host, vec
    monkeypatch.setattr(norm, "_function", function)
    return norm


def _views(shape, dtype, layout, device="cpu"):
    """Random ``shape`` data laid out as: contiguous; rows strided by a multiple of 8 elements; rows
    strided by an odd number; at an odd (2- or 4-byte) offset; with leading dims that do not collapse."""
    n = shape[-1]
    if layout == "contiguous":
        return torch.randn(shape, dtype=dtype, device=device)
    if layout in ("stride8", "stride_odd"):
        return torch.randn(*shape[:-1], n + (8 if layout == "stride8" else 3), dtype=dtype, device=device)[..., :n]
    if layout == "offset":
        return torch.randn(torch.Size(shape).numel() + 1, dtype=dtype, device=device)[1:].view(shape)
    assert layout == "sliced" and len(shape) == 3
    return torch.randn(shape[0], shape[1] + 1, n, dtype=dtype, device=device)[:, 1:]


def _written_only_inside(view, base_before):
    """Whether ``view``'s base differs from ``base_before`` (its copy from before the call) only
    where ``view`` lies."""
    expected = base_before.clone()
    expected.as_strided(view.size(), view.stride(), view.storage_offset()).copy_(view)
    return torch.equal(view._base, expected)


LAYOUTS = ["contiguous", "stride8", "stride_odd", "offset", "sliced"]


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("op", NORM_OPS)
def test_norm_launchers_keep_the_kernel_contract(op, layout, monkeypatch):
    calls = []
    norm = _stand_in_norm(monkeypatch, calls)
    reference = registry.BY_OP[op][Backend.TORCH].load()
    for shape in [(3, 4, 96), (2, 5, 257), (1, 1, 8), (0, 2, 64), (2, 0, 16)] + (
            [] if layout == "sliced" else [(5, 257), (1, 8), (0, 64), (10, 1)]):
        for dtype, weight_dtype in [(torch.bfloat16, torch.bfloat16), (torch.float32, torch.float16)]:
            x, w = _views(shape, dtype, layout), torch.randn(shape[-1], dtype=weight_dtype)
            before = len(calls)
            if "fused" in op:
                r = _views(shape, dtype, layout)
                x_base = None if x._base is None else x._base.clone()
                r_base = None if r._base is None else r._base.clone()
                xb, rb = x.clone(), r.clone()
                assert getattr(norm, op)(x, r, w, 1e-5) is None
                reference(xb, rb, w, 1e-5)
                assert_close(r, rb, msg=f"{shape} {layout}")
                assert_close(x, xb, msg=f"{shape} {layout}")
                if x_base is not None:  # written in place, and nowhere else
                    assert _written_only_inside(x, x_base) and _written_only_inside(r, r_base)
            else:
                x_before = x.clone()
                out = getattr(norm, op)(x, w, 1e-5)
                assert out.shape == x.shape and out.dtype == x.dtype and out.is_contiguous()
                assert_close(out, reference(x, w, 1e-5), msg=f"{shape} {layout}")
                assert torch.equal(x, x_before)
            assert len(calls) - before == (0 if x.numel() == 0 else 1), (shape, layout)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_norm_launcher_copies_only_rows_the_kernel_cannot_take(layout, monkeypatch):
    calls = []
    norm = _stand_in_norm(monkeypatch, calls)
    shape = (2, 2, 96) if layout == "sliced" else (4, 96)
    x, r = _views(shape, torch.bfloat16, layout), _views(shape, torch.bfloat16, layout)
    norm.fused_add_rmsnorm(x, r, torch.randn(96, dtype=torch.bfloat16))
    norm.rmsnorm(x, torch.randn(96, dtype=torch.bfloat16))
    copied = [args[0].data_ptr() != x.data_ptr() for args in calls]
    # 96 bf16: 8-element vectors; a row stride of 104 keeps them aligned, 99 does not; leading dims that
    # do not collapse have no row view (rmsnorm reads a reshaped copy, the fused op writes one back)
    assert copied == [layout in ("stride_odd", "offset", "sliced")] * 2, layout


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("op,approximate", activation_cases(Backend.TILELANG))
def test_activation_launchers_keep_the_kernel_contract(op, approximate, layout, monkeypatch):
    from torch_kernels.families.activation import tilelang as activation
    from torch_kernels.families.activation import reference as ref
    calls = []
    reference_of = {"silu": ref.silu_and_mul, "gelu": lambda x: ref.gelu_and_mul(x, "none"),
                    "gelu_tanh": ref.gelu_tanh_and_mul}

    # the row loop's token range is a CUDA device's (its L2 and SMs): here 2 and 3 tokens take it
    row_loop = range(2, 4)

    def function(d, dtype, act, tokens, rows=False):
        vec = activation._vec(d, activation._DTYPES[dtype])

        def host(x, out):
            assert tokens == x.shape[0] and rows == (tokens in row_loop)
            calls.append((x, out))
            _check_contract(vec, (x, out), (out,))
            out.copy_(reference_of[act](x))
        return host, vec
    monkeypatch.setattr(activation, "_function", function)
    monkeypatch.setattr(activation, "row_loop_tokens", lambda d, dtype, act, device: row_loop)
    args = () if approximate is None else (approximate,)
    reference = registry.BY_OP[op][Backend.TORCH].load()
    for shape in [(3, 4, 96), (2, 20, 96), (2, 5, 514), (0, 2, 64), (2, 0, 16)] + (
            [] if layout == "sliced" else [(5, 514), (1, 2), (0, 64), (10,)]):
        x = _views(shape, torch.bfloat16, layout)
        before = len(calls)
        out = getattr(activation, op)(x, *args)
        assert out.shape == (*shape[:-1], shape[-1] // 2) and out.is_contiguous()
        assert_close(out, reference(x, *args), msg=f"{shape} {layout}")
        assert len(calls) - before == (0 if x.numel() == 0 else 1)


# --- with a GPU ------------------------------------------------------------------------------------


def _trace_compiles(path, name):
    if not os.path.exists(path):
        return []
    return [l for l in open(path).read().splitlines() if l.startswith(f"tilelang-compile|{name}|")]


@pytest.mark.gpu
def test_cuda_default_is_tilelang_for_its_ops():
    """TileLang serves every op it implements, except where ``registry.CUDA_PRIORITY`` puts Triton first
    by measurement; then TileLang is next, and nothing says a notice."""
    for spec in (k for k in registry.KERNELS if k.backend is Backend.TILELANG):
        chain, notice = dispatch.plan(spec.op)
        want = registry.cuda_priority(spec.op)
        assert [s.backend for s in chain][:2] == [b for b in want if b in (Backend.TILELANG, Backend.TRITON)], spec.op
        assert notice is None, spec.op


@pytest.mark.gpu
def test_one_compiled_kernel_serves_every_batch_size(tmp_path):
    from torch_kernels.families.activation import tilelang as activation
    from torch_kernels.families.norm import tilelang as norm
    trace = str(tmp_path / "trace.txt")
    dispatch.configure(trace_path=trace)
    _jit.clear_memo()
    norm._functions.clear()
    activation._functions.clear()
    n, d = 4096, 1536  # rows that also take the streamed kernel from 4096 tokens
    w = torch.randn(n, device="cuda", dtype=torch.bfloat16)
    sizes = []
    for tokens in (1, 7, 300, 4096):
        x = torch.randn(tokens, n, device="cuda", dtype=torch.bfloat16)
        r = torch.randn_like(x)
        assert_close(norm.gemma_rmsnorm(x, w, 1e-6), registry.BY_OP["gemma_rmsnorm"][Backend.TORCH].load()(x, w, 1e-6))
        xb, rb = x.clone(), r.clone()
        norm.fused_add_rmsnorm(x, r, w, 1e-6)
        registry.BY_OP["fused_add_rmsnorm"][Backend.TORCH].load()(xb, rb, w, 1e-6)
        assert_close(x, xb)
        assert_close(r, rb)
        g = torch.randn(tokens, 2 * d, device="cuda", dtype=torch.bfloat16)
        assert_close(activation.silu_and_mul(g), registry.BY_OP["silu_and_mul"][Backend.TORCH].load()(g))
        sizes.append(_jit.memo_size())
    torch.cuda.synchronize()
    # five kernels (each norm's one-pass and streamed ones, the activation's), compiled (or loaded) at
    # the first batch size only
    assert sizes == [5, 5, 5, 5], sizes
    assert len(_trace_compiles(trace, "rmsnorm")) == 4 and len(_trace_compiles(trace, "act_and_mul")) == 1


def _check_norm(fn, reference, x, w, msg, r=None):
    """``fn`` against ``reference`` on (``x``, ``w``), or in place on (``x``, ``r``, ``w``) for the fused
    ops (``r`` given)."""
    if r is None:
        assert_close(fn(x, w, 1e-6), reference(x, w, 1e-6), msg=msg)
        return
    xb, rb = x.clone(), r.clone()
    fn(x, r, w, 1e-6)
    reference(xb, rb, w, 1e-6)
    assert_close(r, rb, msg=f"{msg} residual")
    assert_close(x, xb, msg=msg)


@pytest.mark.gpu
@pytest.mark.parametrize("n,dtype", [(4096, torch.float32), (7168, torch.bfloat16), (8192, torch.float16),
                                     (16384, torch.bfloat16)], ids=str)
@pytest.mark.parametrize("op", NORM_OPS)
def test_streamed_norms_match_the_reference(op, n, dtype):
    """The many-token kernel (rows read twice with L2 hints), from NormConfig.streamed_from tokens: one chunk
    or several, a masked last chunk, strided rows."""
    from torch_kernels.families.norm import tilelang as norm
    reference = registry.BY_OP[op][Backend.TORCH].load()
    fused = "fused" in op
    config = norm.NormConfig.for_shape(n, norm._DTYPES[dtype], fused)
    assert norm._streams(n, norm._DTYPES[dtype], norm._DTYPES[dtype], config)
    for layout in ("contiguous", "stride8"):
        x = _views((config.streamed_from, n), dtype, layout, "cuda")
        w = torch.randn(n, device="cuda", dtype=dtype)
        _check_norm(getattr(norm, op), reference, x, w, f"{n} {layout}", _views(x.shape, dtype, layout, "cuda") if fused else None)
    one_pass, streamed = norm._functions[(n, dtype, dtype, fused, op.startswith("gemma"))][:2]
    assert streamed is not one_pass


# (hidden size, dtype): the layouts at their boundaries — several rows a block, one row over 1024
# threads, the last one-pass size and the first two-pass ones (with a masked chunk, and with scalar
# accesses), odd and tiny rows.
GPU_NORM_CASES = [(1, torch.float32), (8, torch.bfloat16), (100, torch.float16), (257, torch.bfloat16),
                  (5120, torch.float16), (7168, torch.bfloat16), (16384, torch.bfloat16), (16385, torch.float32),
                  (40000, torch.bfloat16), (131072, torch.float16)]


@pytest.mark.gpu
@pytest.mark.parametrize("n,dtype", GPU_NORM_CASES, ids=str)
@pytest.mark.parametrize("op", NORM_OPS)
def test_norm_layouts_match_the_reference(op, n, dtype):
    from torch_kernels.families.norm import tilelang as norm
    reference = registry.BY_OP[op][Backend.TORCH].load()
    for tokens, layout, weight_dtype in [(37, "contiguous", dtype), (5, "offset", torch.float32),
                                         (3, "stride_odd", torch.float64), (129, "stride8", dtype)]:
        x = _views((tokens, n), dtype, layout, "cuda")
        w = torch.randn(n, device="cuda", dtype=weight_dtype)
        r = _views((tokens, n), dtype, layout, "cuda") if "fused" in op else None
        _check_norm(getattr(norm, op), reference, x, w, f"{tokens}x{n} {layout}", r)


@pytest.mark.gpu
@pytest.mark.parametrize("d,dtype", [(1, torch.float32), (3, torch.bfloat16), (200, torch.float16),
                                     (1536, torch.bfloat16), (4864, torch.float32), (14336, torch.bfloat16)], ids=str)
@pytest.mark.parametrize("op,approximate", activation_cases(Backend.TILELANG, every_approximation=False))
def test_activation_layouts_match_the_reference(op, approximate, d, dtype):
    from torch_kernels.families.activation import tilelang as activation
    reference = registry.BY_OP[op][Backend.TORCH].load()
    args = () if approximate is None else (approximate,)
    for tokens, layout in [(1, "contiguous"), (37, "offset"), (5, "stride_odd"), (1000, "stride8")]:
        x = _views((tokens, 2 * d), dtype, layout, "cuda")
        x.mul_(3)  # where the activations bend
        assert_close(getattr(activation, op)(x, *args), reference(x, *args), msg=f"{tokens}x{2 * d} {layout}")


@pytest.mark.gpu
def test_offsets_past_2_31_elements():
    """Inputs of more than 2^31 elements: the last rows are right (int32 offsets would wrap)."""
    from torch_kernels.families.activation import tilelang as activation
    from torch_kernels.families.norm import tilelang as norm
    x = torch.randn(75000, 2 * 14336, device="cuda", dtype=torch.bfloat16)
    assert x.numel() > 2**31
    out = activation.silu_and_mul(x)
    assert_close(out[-5:], registry.BY_OP["silu_and_mul"][Backend.TORCH].load()(x[-5:]))
    del x, out
    x = torch.randn(2**31 // 8192 + 3, 8192, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(8192, device="cuda", dtype=torch.bfloat16)
    out = norm.rmsnorm(x, w, 1e-6)
    assert_close(out[-5:], registry.BY_OP["rmsnorm"][Backend.TORCH].load()(x[-5:], w, 1e-6))


@pytest.mark.gpu
def test_cuda_graph_capture_and_replay():
    """The launches go to the current (capturing) stream, so a graph replays them on new data."""
    from torch_kernels.families.activation import tilelang as activation
    from torch_kernels.families.norm import tilelang as norm
    x = torch.randn(64, 4096, device="cuda", dtype=torch.bfloat16)
    r = torch.randn_like(x)
    w = torch.randn(4096, device="cuda", dtype=torch.bfloat16)
    g = torch.randn(64, 2 * 1536, device="cuda", dtype=torch.bfloat16)
    norm.fused_add_rmsnorm(x.clone(), r.clone(), w)  # compile outside the capture
    activation.gelu_tanh_and_mul(g)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        norm.fused_add_rmsnorm(x, r, w, 1e-6)
        y = activation.gelu_tanh_and_mul(g)
    for _ in range(2):
        x.copy_(torch.randn_like(x)), r.copy_(torch.randn_like(r)), g.copy_(torch.randn_like(g))
        xb, rb = x.clone(), r.clone()
        graph.replay()
        torch.cuda.synchronize()
        registry.BY_OP["fused_add_rmsnorm"][Backend.TORCH].load()(xb, rb, w, 1e-6)
        assert_close(x, xb)
        assert_close(r, rb)
        assert_close(y, registry.BY_OP["gelu_tanh_and_mul"][Backend.TORCH].load()(g))
