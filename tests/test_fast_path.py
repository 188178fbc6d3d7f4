"""The C++ entry of the norm and activation families (``torch_kernels/fast_path.py``, ``csrc/fast_path.cpp``).

CPU: the library builds and loads, its kernels sit on its six ops with the Python ones on the twins,
gradients and errors go through it unchanged, and without it the Python kernels sit on the ops. GPU:
the calls it serves match the reference (one-pass and streamed kernels, in place for the fused ops,
on another stream, in a CUDA graph), the calls it does not serve reach the Python kernels, bad input
still raises naming the op and the argument, and a new selection is asked again."""

import json
import os
import subprocess
import sys

import pytest
import torch

from torch_kernels import dispatch, fast_path, registry
from torch_kernels.spec import Backend

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NORM = ["rmsnorm", "gemma_rmsnorm"]
FUSED = ["fused_add_rmsnorm", "gemma_fused_add_rmsnorm"]
ACTIVATIONS = ["silu_and_mul", "gelu_tanh_and_mul"]


def _python(code, fails=False, **env):
    """Run ``code`` in a fresh interpreter: its stdout, or with ``fails`` its stderr after it failed."""
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                         env={**os.environ, **env}, timeout=300)
    assert (out.returncode != 0) == fails, out.stderr or out.stdout
    return out.stderr if fails else out.stdout


_REGISTRATIONS = """
import torch, torch_kernels
from torch_kernels import fast_path
print(fast_path.status().split()[0])
for op in fast_path.OPS:
    for ns in ("deepinfer", fast_path.TWIN_NAMESPACE):
        try:
            dump = torch._C._dispatch_dump(f"{ns}::{op}")
        except RuntimeError:  # no such op
            dump = ""
        for key in ("CUDA", "Autograd[alias]"):
            line = [l for l in dump.splitlines() if l.startswith(key + ":")]
            print(ns, op, key, line[0].split(" registered at ")[1].split(":")[0].rsplit("/", 1)[-1] if line else "-")
"""


def test_built_library_carries_the_cuda_and_autograd_kernels_of_the_norm_ops():
    fast_path.build()  # nothing to do when built (the README's test command builds it first)
    lines = _python(_REGISTRATIONS).splitlines()
    assert lines[0] == "loaded"
    for op in fast_path.OPS:
        for key in ("CUDA", "Autograd[alias]"):
            assert f"deepinfer {op} {key} fast_path.cpp" in lines
            assert f"deepinfer_py {op} {key} library.py" in lines
    assert sorted(fast_path.OPS) == sorted(NORM + FUSED + ACTIVATIONS)


def test_build_failure_says_so_and_leaves_nothing(tmp_path):
    out = _python("from torch_kernels import fast_path; fast_path.build()", fails=True,
                  DEEPINFER_OPS_CACHE_DIR=str(tmp_path), CXX="false")
    assert "building the C++ entry failed (false exit 1)" in out
    assert not any(p.is_file() for p in tmp_path.rglob("*"))


def test_processes_building_at_once_leave_one_sound_library(tmp_path):
    env = {**os.environ, "DEEPINFER_OPS_CACHE_DIR": str(tmp_path)}
    code = "from torch_kernels import fast_path; print(fast_path.build())"
    builds = [subprocess.Popen([sys.executable, "-c", code], cwd=ROOT, env=env, stdout=subprocess.PIPE, text=True)
              for _ in range(2)]
    paths = {b.communicate(timeout=300)[0].strip() for b in builds}
    assert all(b.returncode == 0 for b in builds) and len(paths) == 1
    assert sorted(p.name for p in tmp_path.rglob("*") if p.is_file()) == ["deepinfer_fast_path.so",
                                                                           "deepinfer_fast_path.so.sha256"]
    lines = _python(_REGISTRATIONS, DEEPINFER_OPS_CACHE_DIR=str(tmp_path)).splitlines()
    assert lines[0] == "loaded"
    # a damaged library is built again, not taken as built
    library = paths.pop()
    os.truncate(library, 100 * 1024)
    assert _python(code, DEEPINFER_OPS_CACHE_DIR=str(tmp_path)).strip() == library
    assert _python(_REGISTRATIONS, DEEPINFER_OPS_CACHE_DIR=str(tmp_path)).splitlines()[0] == "loaded"


def _run(code, **env):
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                         env={**os.environ, **env}, timeout=120)
    return out.returncode, out.stdout, out.stderr


def _copy_build(tmp_path):
    """The built library and its digest record, copied into a cache folder of their own."""
    import shutil

    built = fast_path.build()
    folder = tmp_path / built.parent.name
    folder.mkdir()
    shutil.copy(built, folder)
    shutil.copy(fast_path.digest_path(built), folder)
    return folder / built.name


def _flip_a_byte(path):
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))


def _rerecord(path, **change):
    record = json.loads(fast_path.digest_path(path).read_text())
    fast_path.digest_path(path).write_text(json.dumps({**record, **change}))


def _replace_with(path, make):
    path.unlink()
    make(path)


_DAMAGE = {
    "truncated to 100 KB": (lambda p: os.truncate(p, 100 * 1024), "102400 bytes where"),
    "no digest record": (lambda p: fast_path.digest_path(p).unlink(), "no digest recorded beside it"),
    "a byte changed": (_flip_a_byte, "SHA-256 differs"),
    "a foreign library": (lambda p: p.write_bytes(open(_libm_path(), "rb").read()), "bytes where"),
    "recorded for another build": (lambda p: _rerecord(p, build="fast_path-0000"), "not built by torch_kernels"),
    "recorded by someone else": (lambda p: _rerecord(p, built_by="me"), "not built by torch_kernels"),
    "a record that is not one": (lambda p: fast_path.digest_path(p).write_text("[" * 3000), "not a digest record"),
    "a record that is a FIFO": (lambda p: _replace_with(fast_path.digest_path(p), os.mkfifo), "not a regular file"),
    "a library that is a FIFO": (lambda p: _replace_with(p, os.mkfifo), "not a regular file"),
    "a library linked to /dev/zero": (lambda p: _replace_with(p, lambda q: q.symlink_to("/dev/zero")), "not a regular file"),
}


def _libm_path():
    """A shared library that is not ours (libm), found through the loader's own map of this process."""
    with open("/proc/self/maps") as maps:
        return next(line.split()[-1] for line in maps if "/libm." in line or "/libm-" in line)


@pytest.mark.parametrize("damage", sorted(_DAMAGE))
def test_a_damaged_or_foreign_library_is_refused_and_the_python_kernels_serve(tmp_path, damage):
    """In a fresh process, so that a crash (a truncated library mapped: SIGBUS) fails the test alone."""
    library = _copy_build(tmp_path)
    make, why = _DAMAGE[damage]
    make(library)
    rc, out, err = _run(_REGISTRATIONS + _CALLS, DEEPINFER_OPS_CACHE_DIR=str(tmp_path))
    assert rc == 0, f"exit {rc}: {err}"
    lines = out.splitlines()
    assert lines[0] == "refused" and lines[-1] == "served", out
    for op in fast_path.OPS:
        for key in ("CUDA", "Autograd[alias]"):
            assert f"deepinfer {op} {key} library.py" in lines
    notices = [line for line in err.splitlines() if line.startswith("[deepinfer] the C++ entry refused")]
    assert len(notices) == 1 and why in notices[0] and str(library) in notices[0] and "not loaded" in notices[0], err


_CALLS = """
import torch_kernels
from torch_kernels import registry
from torch_kernels.spec import Backend
x, w = torch.randn(3, 64), torch.randn(64)
assert torch.equal(torch.ops.deepinfer.rmsnorm(x, w, 1e-6), registry.BY_OP["rmsnorm"][Backend.TORCH].load()(x, w, 1e-6))
assert not any("deepinfer_fast_path" in p for p in torch.ops.loaded_libraries)
assert not [l for l in open("/proc/self/maps") if "deepinfer_fast_path" in l]
print("served")
"""


def test_a_sound_copy_with_its_record_is_loaded(tmp_path):
    library = _copy_build(tmp_path)
    rc, out, err = _run(_REGISTRATIONS, DEEPINFER_OPS_CACHE_DIR=str(tmp_path))
    assert rc == 0 and out.splitlines()[0] == "loaded" and "[deepinfer]" not in err, err
    assert "deepinfer rmsnorm CUDA fast_path.cpp" in out.splitlines()


def test_switched_off_the_python_kernels_sit_on_the_ops():
    lines = _python(_REGISTRATIONS, DEEPINFER_OPS_FAST_PATH="0").splitlines()
    assert lines[0] == "off"
    for op in fast_path.OPS:
        for key in ("CUDA", "Autograd[alias]"):
            assert f"deepinfer {op} {key} library.py" in lines
            assert f"deepinfer_py {op} {key} -" in lines


def test_gradients_and_errors_through_the_cpp_autograd_kernel():
    """Run in a fresh process that has the library loaded (this one may have imported without it)."""
    fast_path.build()
    _python("""
import torch, torch_kernels
from torch_kernels import fast_path, registry
from torch_kernels.spec import Backend
assert fast_path.loaded(), fast_path.status()
x = torch.randn(3, 5, 64, dtype=torch.float64, requires_grad=True)
w = torch.randn(64, dtype=torch.float64, requires_grad=True)
for op in ("rmsnorm", "gemma_rmsnorm"):
    f = getattr(torch.ops.deepinfer, op)
    assert torch.autograd.gradcheck(lambda a, b: f(a, b, 1e-5), (x, w))
    with torch.no_grad():
        y = f(x, w)
    assert not y.requires_grad
    assert torch.equal(y, registry.BY_OP[op][Backend.TORCH].load()(x.detach(), w.detach(), 1e-6))
for op in ("silu_and_mul", "gelu_tanh_and_mul"):
    try:
        getattr(torch.ops.deepinfer, op)(x)
    except RuntimeError as e:
        assert f"{op} does not support autograd" in str(e), e
    else:
        raise AssertionError("no error")
    with torch.no_grad():
        assert torch.equal(getattr(torch.ops.deepinfer, op)(x), registry.BY_OP[op][Backend.TORCH].load()(x))
r = torch.randn(3, 5, 64, dtype=torch.float64)
try:
    torch.ops.deepinfer.fused_add_rmsnorm(x, r, w)
except RuntimeError as e:
    assert "fused_add_rmsnorm does not support autograd" in str(e), e
else:
    raise AssertionError("no error")
try:
    torch.ops.deepinfer.rmsnorm(x, w[:63])
except ValueError as e:
    assert "deepinfer::rmsnorm: argument 'weight'" in str(e), e
else:
    raise AssertionError("no error")
""")


def test_publish_refuses_what_the_entry_cannot_serve():
    fast_path.build()
    _python("""
import torch, torch_kernels
for args, words in ((("rotary_embedding", torch.bfloat16, torch.bfloat16, 64, 0, 4096, 1, 1), "argument 'op'"),
                    (("rmsnorm", torch.float64, torch.bfloat16, 64, 0, 4096, 1, 1), "float16, bfloat16 or float32"),
                    (("gelu_and_mul", torch.bfloat16, torch.bfloat16, 64, 0, 0, 1, 1), "argument 'op'"),
                    (("silu_and_mul", torch.bfloat16, torch.bfloat16, 63, 0, 0, 1, 1), "bad entry for silu_and_mul")):
    try:
        torch.ops.deepinfer_fast_path.publish(*args)
    except RuntimeError as e:
        assert words in str(e), e
    else:
        raise AssertionError("no error")
assert torch.ops.deepinfer_fast_path.counters() == [0, 0, 0]
import tvm_ffi  # a real TVM-FFI function handle: publishing holds a reference, clearing drops the entry
handle = tvm_ffi.get_global_func("ffi.String").__chandle__()
torch.ops.deepinfer_fast_path.publish("rmsnorm", torch.bfloat16, torch.float32, 64, 0, 4096, handle, handle)
assert torch.ops.deepinfer_fast_path.counters() == [1, 0, 0]
torch.ops.deepinfer_fast_path.clear()
assert torch.ops.deepinfer_fast_path.counters() == [0, 0, 0]
""")


# ----------------------------------------------------------------------------------------------
# On the GPU: this process must have loaded the library (the README's and the GPU test
# commands build it before pytest starts).

def _reference(op):
    return registry.BY_OP[op][Backend.TORCH].load()


@pytest.fixture
def tilelang_entry():
    assert fast_path.loaded(), f"the C++ entry is {fast_path.status()}: run python -m torch_kernels build first"
    previous = dispatch.configure(backend="tilelang", strict=True)
    yield
    dispatch.configure(previous)


def _call(op, x, w, r=None):
    f = getattr(torch.ops.deepinfer, op)
    return f(x, r, w, 1e-5) if r is not None else f(x, w, 1e-5)


def _expect(op, x, w, r=None):
    """The reference's result, on copies: (output,) or (input after, residual after)."""
    if r is None:
        return (_reference(op)(x, w, 1e-5),)
    xe, re = x.clone(), r.clone()
    _reference(op)(xe, re, w, 1e-5)
    return xe, re


def _run_and_compare(op, x, w, r=None):
    expected = _expect(op, x, w, r)
    out = _call(op, x, w, r)
    got = (out,) if r is None else (x, r)
    for g, e in zip(got, expected):
        torch.testing.assert_close(g, e, atol=2e-2, rtol=2e-2)


def _inputs(op, shape, dtype, weight_dtype=None):
    x = torch.randn(shape, dtype=dtype, device="cuda")
    w = torch.randn(shape[-1], dtype=weight_dtype or dtype, device="cuda")
    return x, w, (torch.randn_like(x) if op in FUSED else None)


@pytest.mark.gpu
@pytest.mark.parametrize("op", NORM + FUSED)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
def test_served_calls_match_the_reference(op, dtype, tilelang_entry):
    """The first call of a signature goes to Python and publishes it; the next ones are served in C++,
    one-pass and streamed (from 4096 tokens, the fused ops from 128 MB), with a weight in another dtype
    too."""
    from torch_kernels.families.norm import tilelang as norm
    other = torch.bfloat16 if dtype == torch.float32 else torch.float32  # a weight dtype: a new signature
    for shape, weight_dtype in (((1, 4096), None), ((7, 1000), None), ((2, 3, 5120), None), ((4100, 2048), None),
                                ((5, 4096), other)):
        before = fast_path.counters()
        _run_and_compare(op, *_inputs(op, shape, dtype, weight_dtype))
        published = fast_path.counters()
        assert published["passed_on"] == before["passed_on"] + 1 and published["signatures"] == before["signatures"] + 1
        streamed_from = norm.NormConfig.for_shape(shape[-1], norm._DTYPES[dtype], op in FUSED).streamed_from
        for tokens in (1, 3, 4096, streamed_from + 3):  # both kernels, from the C++ entry
            _run_and_compare(op, *_inputs(op, (tokens, shape[-1]), dtype, weight_dtype))
        after = fast_path.counters()
        assert after["served"] == published["served"] + 4 and after["passed_on"] == published["passed_on"], after


@pytest.mark.gpu
@pytest.mark.parametrize("op", NORM + FUSED)
def test_calls_it_does_not_serve_reach_the_python_kernels(op, tilelang_entry):
    dtype = torch.bfloat16
    _run_and_compare(op, *_inputs(op, (4, 768), dtype))  # publishes
    x, w, r = _inputs(op, (4, 800), dtype)
    cases = [(x[:, :768], w[:768], None if r is None else r[:, :768]),      # strided rows
             (x.flatten()[1:1 + 4 * 768].view(4, 768), w[:768], None if r is None else r[:, 8:776]),  # misaligned
             (x[:0, :768], w[:768], None if r is None else r[:0, :768])]    # no tokens
    for args in cases:
        before = fast_path.counters()
        _run_and_compare(op, *args)
        assert fast_path.counters()["passed_on"] == before["passed_on"] + 1


@pytest.mark.gpu
@pytest.mark.parametrize("op", NORM + FUSED)
def test_bad_input_still_names_the_op_and_the_argument(op, tilelang_entry):
    x, w, r = _inputs(op, (4, 256), torch.bfloat16)
    _call(op, x, w, r)  # publishes the signature
    bad = [(dict(w=w[:255]), "weight", ValueError), (dict(w=w.cpu()), "weight", ValueError),
           (dict(eps=-1.0), "eps", ValueError)]
    if r is not None:
        bad += [(dict(r=r[:3]), "residual", ValueError), (dict(r=r.half()), "residual", TypeError), (dict(r=x), "residual", ValueError)]
    for change, arg, exc in bad:
        args = {**dict(x=x, w=w, r=r, eps=1e-5), **change}
        f = getattr(torch.ops.deepinfer, op)
        with pytest.raises(exc, match=f"deepinfer::{op}: argument '{arg}'"):
            if r is None:
                f(args["x"], args["w"], args["eps"])
            else:
                f(args["x"], args["r"], args["w"], args["eps"])


@pytest.mark.gpu
@pytest.mark.parametrize("op", NORM + FUSED)
def test_served_on_the_current_stream_and_in_a_cuda_graph(op, tilelang_entry):
    x, w, r = _inputs(op, (64, 4096), torch.bfloat16)
    _call(op, x, w, r)  # publishes
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        x, w, r = _inputs(op, (64, 4096), torch.bfloat16)
        expected = _expect(op, x, w, r)
        torch.cuda._sleep(10_000_000)  # delays the copies: a kernel on another stream would read them unwritten
        x2 = x.clone()
        r2 = None if r is None else r.clone()
        out = _call(op, x2, w, r2)
    torch.cuda.current_stream().wait_stream(side)
    for g, e in zip((out,) if r is None else (x2, r2), expected):
        torch.testing.assert_close(g, e, atol=2e-2, rtol=2e-2)

    xs, ws, rs = _inputs(op, (64, 4096), torch.bfloat16)
    graph = torch.cuda.CUDAGraph()
    served = fast_path.counters()["served"]
    with torch.cuda.graph(graph):
        out = _call(op, xs, ws, rs)
    assert fast_path.counters()["served"] == served + 1
    for _ in range(2):  # fresh data each replay
        xs.copy_(torch.randn_like(xs))
        if rs is not None:
            rs.copy_(torch.randn_like(rs))
        expected = _expect(op, xs, ws, rs)
        graph.replay()
        torch.cuda.synchronize()
        for g, e in zip((out,) if rs is None else (xs, rs), expected):
            torch.testing.assert_close(g, e, atol=2e-2, rtol=2e-2)


@pytest.mark.gpu
def test_a_new_selection_is_asked_again(tilelang_entry, tmp_path):
    x, w, _ = _inputs("rmsnorm", (8, 1024), torch.bfloat16)
    _call("rmsnorm", x, w)
    _call("rmsnorm", x, w)
    assert fast_path.counters()["signatures"] >= 1
    trace = tmp_path / "trace.txt"
    dispatch.configure(backend="triton", strict=True, trace_path=str(trace))
    assert fast_path.counters()["signatures"] == 0
    before = fast_path.counters()
    for _ in range(3):
        _run_and_compare("rmsnorm", x, w)
    after = fast_path.counters()
    assert after["passed_on"] == before["passed_on"] + 3 and after["served"] == before["served"]
    assert trace.read_text().splitlines() == ["rmsnorm|triton"]


@pytest.mark.gpu
def test_gradients_on_cuda_take_the_backward_formula(tilelang_entry):
    x = torch.randn(6, 512, device="cuda", requires_grad=True)
    w = torch.randn(512, device="cuda", requires_grad=True)
    _call("rmsnorm", x.detach(), w.detach())  # publishes: the forward below is served in C++
    served = fast_path.counters()["served"]
    torch.ops.deepinfer.rmsnorm(x, w, 1e-5).square().sum().backward()
    assert fast_path.counters()["served"] == served + 1
    xr, wr = x.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()
    _reference("rmsnorm")(xr, wr, 1e-5).square().sum().backward()
    torch.testing.assert_close(x.grad, xr.grad, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(w.grad, wr.grad, atol=1e-4, rtol=1e-4)


@pytest.mark.gpu
@pytest.mark.parametrize("op", ACTIVATIONS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
def test_served_activations_match_the_reference(op, dtype, tilelang_entry):
    f, reference = getattr(torch.ops.deepinfer, op), _reference(op)
    for width in (2 * 4096, 2 * 1000):
        before = fast_path.counters()
        x = torch.randn(3, width, dtype=dtype, device="cuda")
        torch.testing.assert_close(f(x), reference(x), atol=2e-2, rtol=2e-2)
        published = fast_path.counters()
        assert published["signatures"] == before["signatures"] + 1 and published["passed_on"] == before["passed_on"] + 1
        for shape in ((1, width), (7, width), (2, 3, width), (4100, width)):
            x = torch.randn(shape, dtype=dtype, device="cuda")
            torch.testing.assert_close(f(x), reference(x), atol=2e-2, rtol=2e-2)
        assert fast_path.counters()["served"] == published["served"] + 4


@pytest.mark.gpu
@pytest.mark.parametrize("op", ACTIVATIONS)
def test_activation_calls_it_does_not_serve_and_bad_input(op, tilelang_entry):
    f, reference = getattr(torch.ops.deepinfer, op), _reference(op)
    x = torch.randn(4, 2 * 768 + 16, dtype=torch.bfloat16, device="cuda")
    f(x[:, :1536].contiguous())  # publishes
    for args in (x[:, :1536], x.flatten()[1:1 + 4 * 1536].view(4, 1536), x[:0, :1536]):  # strided, misaligned, empty
        before = fast_path.counters()["passed_on"]
        torch.testing.assert_close(f(args), reference(args), atol=2e-2, rtol=2e-2)
        assert fast_path.counters()["passed_on"] == before + 1
    with pytest.raises(ValueError, match=f"deepinfer::{op}: argument 'input'"):
        f(torch.randn(4, 1535, dtype=torch.bfloat16, device="cuda"))


class _HostFunction:
    def __init__(self, handle):
        self.handle = handle

    def __chandle__(self):
        return self.handle


def test_offer_reads_the_signature_with_trailing_defaults_left_out(monkeypatch):
    """The twin's Python kernel gets the call's arguments without the trailing ones left at their
    defaults (eps): the weight is read by position, never from the end (H200: reading
    gelu_and_mul's approximate from args[1] raised IndexError on every default call)."""
    from torch_kernels.families.activation import tilelang as activation
    from torch_kernels.families.norm import tilelang as norm

    published = []
    monkeypatch.setattr(fast_path, "loaded", lambda: True)
    monkeypatch.setattr(fast_path, "_published", set())
    monkeypatch.setattr(fast_path, "_publish", lambda *entry: published.append(entry))
    monkeypatch.setattr(norm, "host_functions", lambda x, w, fused, gemma: (_HostFunction(1), _HostFunction(2), 4096))
    monkeypatch.setattr(activation, "host_function", lambda x, act: _HostFunction(3 if act == "silu" else 4))
    tilelang = registry.BY_OP["rmsnorm"][Backend.TILELANG]
    x, w32 = torch.randn(2, 64, dtype=torch.bfloat16), torch.randn(64)
    r = torch.randn_like(x)
    fast_path.offer("rmsnorm", tilelang, (x, w32))                 # eps left at its default
    fast_path.offer("fused_add_rmsnorm", tilelang, (x, r, w32))
    fast_path.offer("gemma_rmsnorm", tilelang, (x, w32, 1e-5))
    fast_path.offer("silu_and_mul", tilelang, (x,))
    fast_path.offer("gelu_tanh_and_mul", tilelang, (x,))
    fast_path.offer("rmsnorm", tilelang, (x, w32))                 # published already
    fast_path.offer("rmsnorm", registry.BY_OP["rmsnorm"][Backend.TRITON], (x, x[0]))  # not TileLang's
    fast_path.offer("rmsnorm", None, (x, x[0]))                    # no sole server
    never = 1 << 62
    assert published == [
        ("rmsnorm", torch.bfloat16, torch.float32, 64, None, 4096, 1, 2),
        ("fused_add_rmsnorm", torch.bfloat16, torch.float32, 64, None, 4096, 1, 2),
        ("gemma_rmsnorm", torch.bfloat16, torch.float32, 64, None, 4096, 1, 2),
        ("silu_and_mul", torch.bfloat16, torch.bfloat16, 64, None, never, 3, 3),
        ("gelu_tanh_and_mul", torch.bfloat16, torch.bfloat16, 64, None, never, 4, 4),
    ]
