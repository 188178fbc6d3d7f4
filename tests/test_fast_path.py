"""The C++ entry (``torch_kernels/fast_path.py``, ``csrc/fast_path.cpp``): it serves the ops whose TileLang
spec in the manifests has a ``host``, from that spec's ``HostCall``, and names no op itself.

CPU: the HostCall is validated, the served set is read from the inventory, the sources name no op, the
library builds and loads, its kernels sit on the served ops and their out overloads with the Python ones
on the twins, gradients and errors go through it unchanged, and without it the Python kernels sit on the
ops. GPU: the calls it serves match the reference (one-pass and streamed kernels, in place, on another
stream, in a CUDA graph, into a given output), the calls it does not serve (overlapping written arguments
among them) reach the Python kernels, bad input still raises naming the op and the argument, and a new
selection is asked again."""

import json
import os
import re
import struct
import subprocess
import sys

import pytest
import torch

from torch_kernels import dispatch, fast_path, library, manifest, registry
from torch_kernels.library import mutated_args
from torch_kernels.bench import cases
from torch_kernels.ops import ALL
from torch_kernels.spec import Backend, HostCall, HostKernels, KernelSpec
from torch_kernels.testing import clone_keep_strides, outputs_of

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SERVED = sorted(fast_path.SERVED)
OP_DEFS = {op.name: op for op in ALL}


def _overload(op):
    return getattr(torch.ops.deepinfer, op).default


def _call_of(op) -> HostCall:
    return fast_path.SERVED[op].host_call


def _written(op):
    return mutated_args(_overload(op))


def _default(op, i):
    return _overload(op)._schema.arguments[i].default_value


#: the served ops whose arguments are rows, vectors, floats and strings: the tests below build their arguments
#: by role (a string at its default)
ROW_OPS = [op for op in SERVED if set(_call_of(op).roles) <= set("rwfs")]
#: the others, with tensors passed as they are (t, c) and ints and bools in the signature: rope
AS_GIVEN_OPS = [op for op in SERVED if set(_call_of(op).roles) & set("tc") and not _call_of(op).output]
#: the ops whose outputs each signature lays out over their rows (q and the scales of the FP8 ops)
LAID_OUT_OPS = [op for op in SERVED if _call_of(op).output == "p" and "r" in _call_of(op).roles]
#: the ops whose outputs take the shapes of tensors passed as they are (merge_attn_states)
SHAPED_LIKE_OPS = [op for op in SERVED if _call_of(op).output == "p" and "r" not in _call_of(op).roles]
IN_PLACE = [op for op in ROW_OPS if _written(op)]
#: the served ops with an out overload: the entry serves it too
WITH_OUT = [op for op in SERVED if OP_DEFS[op].out_names and fast_path.serves_out(op)]


def _python(code, fails=False, **env):
    """Run ``code`` in a fresh interpreter: its stdout, or with ``fails`` its stderr after it failed."""
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                         env={**os.environ, **env}, timeout=300)
    assert (out.returncode != 0) == fails, out.stderr or out.stdout
    return out.stderr if fails else out.stdout


_REGISTRATIONS = """
import torch, torch_kernels
from torch_kernels import fast_path, registry
print(fast_path.status().split()[0])
for op in registry.OPS + tuple(f"{op}.out" for op in registry.OPS):
    for ns in ("deepinfer", fast_path.TWIN_NAMESPACE):
        try:
            dump = torch._C._dispatch_dump(f"{ns}::{op}")
        except RuntimeError:  # no such op
            dump = ""
        for key in ("CUDA", "Autograd[alias]"):
            line = [l for l in dump.splitlines() if l.startswith(key + ":")]
            print(ns, op, key, line[0].split(" registered at ")[1].split(":")[0].rsplit("/", 1)[-1] if line else "-")
"""


def test_host_call_is_validated():
    HostCall("rwf", "r", (0, 1, -1, 2))
    HostCall("rrwf", "", (3, 2, 1, 0))
    HostCall("ttticb", "", (0, 1, 2, 4))
    HostCall("rwfoibb", "p", (0, 1, -1, -2, 3, 2))
    HostCall("rs", "h", (0, -1))
    for roles, output, order, words in (("wf", "r", (0, -1, 1), "at least one 'r' or 't'"),
                                        ("rx", "", (0, 1), "letters of rwfetcoibs"),
                                        ("ro", "p", (0, 1), "order must hold"),
                                        ("ro", "p", (0, 1, -2), "order must hold each of [-2, -1, 0, 1] once"),
                                        ("ros", "p", (0, 1, 2, -1), "order must hold each of [-1, 0, 1] once"),
                                        ("tc", "r", (0, 1, -1), "an output is shaped like rows"),
                                        ("tib", "", (0, 1, 2), "order must hold each of [0] once"),
                                        ("r", "x", (0, -1), "output must be one of"),
                                        ("rw", "r", (0, 1), "order must hold each of [-1, 0, 1] once"),
                                        ("rw", "", (0, 1, -1), "order must hold each of [0, 1] once"),
                                        ("rw", "", (0, 0), "order must hold"),
                                        ("rw", "", [0, 1], "order must hold")):
        with pytest.raises(ValueError, match=re.escape(words)):
            HostCall(roles, output, order)
    assert HostCall("frw", "", (0, 1, 2)).data == 1 and HostCall("frw", "", (0, 1, 2)).tensors == (1, 2)
    assert HostCall("ittcbr", "", (1, 2, 3, 5)).data == 5 and HostCall("ittcb", "", (1, 2, 3)).data == 1
    assert HostCall("ittcb", "", (1, 2, 3)).tensors == (1, 2, 3)


def test_a_host_needs_its_host_call_and_a_target():
    spec = registry.BY_OP[SERVED[0]][fast_path.BACKEND]
    for host, call, words in (("m:host", None, "go together"), (None, spec.host_call, "go together"),
                              ("m:host", (0, 1), "go together"), ("nocolon", spec.host_call, "'module:attr'")):
        with pytest.raises(ValueError, match=words):
            KernelSpec(spec.op, spec.backend, spec.target, host=host, host_call=call)
    with pytest.raises(ValueError, match="host_calls for ops it does not implement"):
        manifest.kernels("pkg", Backend.TILELANG, ("a",), "", host_calls={"b": spec.host_call})


def test_the_served_ops_are_the_tilelang_specs_with_a_host():
    with_host = [k for k in registry.KERNELS if k.host is not None]
    assert with_host and all(k.backend is fast_path.BACKEND for k in with_host)  # no other host is ignored
    assert fast_path.SERVED == {k.op: k for k in with_host}


def test_the_recorded_ops_are_the_other_ops_with_a_triton_kernel():
    triton = {k.op for k in registry.KERNELS if k.backend is Backend.TRITON}
    assert set(fast_path.RECORDED) == triton - set(fast_path.SERVED) and fast_path.RECORDED


@pytest.mark.parametrize("op", SERVED)
def test_each_host_call_fits_its_schema(op):
    """What ``install`` checks in C++ at import, checked here without the library."""
    call, schema = _call_of(op), _overload(op)._schema
    assert len(call.roles) == len(schema.arguments)
    types = {"f": torch.FloatType, "e": torch.FloatType, "i": torch.IntType, "b": torch.BoolType, "s": torch.StringType}
    for role, arg in zip(call.roles, schema.arguments):
        t = arg.type.getElementType() if role in "wto" and isinstance(arg.type, torch.OptionalType) else arg.type
        assert isinstance(t, types.get(role, torch.TensorType)), (role, arg)
        assert role != "o" or isinstance(arg.type, torch.OptionalType), arg
    assert len(schema.returns) == (-min(call.order) if call.output == "p" else 1 if call.output else 0)
    assert all(call.roles[i] in "rt" for i in _written(op))


def test_the_entry_names_no_op():
    """No op list, position or kernel choice of an op in the entry's sources: everything comes from the
    manifests."""
    for path in (fast_path.SOURCE, fast_path.SOURCE.parent.parent / "fast_path.py"):
        text = path.read_text()
        named = [op for op in registry.OPS if re.search(rf"\b{op}\b", text)]
        assert not named, f"{path.name} names {named}"
        assert "families" not in text, f"{path.name} names a family"


def test_built_library_carries_the_cuda_and_autograd_kernels_of_the_served_ops():
    fast_path.build()  # nothing to do when built (the README's test command builds it first)
    lines = _python(_REGISTRATIONS).splitlines()
    assert lines[0] == "loaded"
    assert WITH_OUT
    for op in SERVED + [f"{op}.out" for op in WITH_OUT]:
        for key in ("CUDA", "Autograd[alias]"):
            assert f"deepinfer {op} {key} fast_path.cpp" in lines
            assert f"deepinfer_py {op} {key} library.py" in lines
    recorded = [op for op in fast_path.RECORDED] + [f"{op}.out" for op in fast_path.RECORDED if OP_DEFS[op].out_names
                                                    and any(k.out for k in registry.BY_OP[op].values())]
    assert len(recorded) > len(fast_path.RECORDED)
    for op in recorded:
        for key in ("CUDA", "Autograd[alias]"):
            assert f"deepinfer {op} {key} fast_path.cpp" in lines
            assert f"deepinfer_py {op} {key} library.py" in lines
    others = [op for op in registry.OPS if op not in fast_path.SERVED and op not in fast_path.RECORDED]
    assert others and not any(f"deepinfer {op} CUDA fast_path.cpp" in lines or f"deepinfer {op}.out CUDA fast_path.cpp"
                              in lines for op in others)
    for op in LAID_OUT_OPS + SHAPED_LIKE_OPS:  # several outputs: the out overload stays with the Python kernels
        assert OP_DEFS[op].out_names and f"deepinfer {op}.out CUDA fast_path.cpp" not in lines, op


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
    for op in SERVED:
        for key in ("CUDA", "Autograd[alias]"):
            assert f"deepinfer {op} {key} library.py" in lines
    notices = [line for line in err.splitlines() if line.startswith("[deepinfer] the C++ entry refused")]
    assert len(notices) == 1 and why in notices[0] and str(library) in notices[0] and "not loaded" in notices[0], err


_CALLS = """
import torch_kernels
from torch_kernels import fast_path, registry
from torch_kernels.spec import Backend
op, spec = next((op, s) for op, s in fast_path.SERVED.items() if s.host_call.output)
args = [1e-6 if r == "f" else torch.randn((3, 64) if r == "r" else (64,)) for r in spec.host_call.roles]
assert torch.equal(getattr(torch.ops.deepinfer, op)(*args), registry.BY_OP[op][Backend.TORCH].load()(*args))
assert not any("deepinfer_fast_path" in p for p in torch.ops.loaded_libraries)
assert not [l for l in open("/proc/self/maps") if "deepinfer_fast_path" in l]
print("served")
"""


def test_a_sound_copy_with_its_record_is_loaded(tmp_path):
    library = _copy_build(tmp_path)
    rc, out, err = _run(_REGISTRATIONS, DEEPINFER_OPS_CACHE_DIR=str(tmp_path))
    assert rc == 0 and out.splitlines()[0] == "loaded" and "[deepinfer]" not in err, err
    assert f"deepinfer {SERVED[0]} CUDA fast_path.cpp" in out.splitlines()


def test_switched_off_the_python_kernels_sit_on_the_ops():
    lines = _python(_REGISTRATIONS, DEEPINFER_OPS_FAST_PATH="0").splitlines()
    assert lines[0] == "off"
    for op in SERVED:
        for key in ("CUDA", "Autograd[alias]"):
            assert f"deepinfer {op} {key} library.py" in lines
            assert f"deepinfer_py {op} {key} -" in lines


def test_gradients_and_errors_through_the_cpp_autograd_kernel():
    """Run in a fresh process that has the library loaded (this one may have imported without it)."""
    fast_path.build()
    _python("""
import torch, torch_kernels
from torch_kernels import fast_path, registry
from torch_kernels.library import mutated_args
from torch_kernels.ops import ALL
from torch_kernels.spec import Backend
assert fast_path.loaded(), fast_path.status()
defs = {op.name: op for op in ALL}

def args_of(op, requires_grad):
    roles = fast_path.SERVED[op].host_call.roles
    default = lambda i: getattr(torch.ops.deepinfer, op).default._schema.arguments[i].default_value  # noqa: E731
    return [1e-5 if r == "f" else default(i) if r == "s" else torch.randn((3, 5, 64) if r == "r" else (64,), dtype=torch.float64,
                                               requires_grad=requires_grad) for i, r in enumerate(roles)]

def results(op, args, out):
    written = mutated_args(getattr(torch.ops.deepinfer, op).default)
    return (out,) if fast_path.SERVED[op].host_call.output else tuple(args[i] for i in written)

for op in fast_path.SERVED:
    if not set(fast_path.SERVED[op].host_call.roles) <= set("rwfs"):  # rope: test_rope_... below
        continue
    f, reference = getattr(torch.ops.deepinfer, op), registry.BY_OP[op][Backend.TORCH].load()
    args = args_of(op, True)
    if defs[op].backward is not None:
        tensors = [i for i, a in enumerate(args) if isinstance(a, torch.Tensor)]
        def of(*ts):
            full = list(args)
            for i, t in zip(tensors, ts):
                full[i] = t
            return f(*full)
        assert torch.autograd.gradcheck(of, tuple(args[i] for i in tensors)), op
    else:
        try:
            f(*args)
        except RuntimeError as e:
            assert f"{op} does not support autograd" in str(e), e
        else:
            raise AssertionError(f"{op}: no error")
    args = [a.detach() if isinstance(a, torch.Tensor) else a for a in args]
    copies = [a.clone() if isinstance(a, torch.Tensor) else a for a in args]
    with torch.no_grad():
        out = f(*args)
    assert out is None or not out.requires_grad
    for got, want in zip(results(op, args, out), results(op, copies, reference(*copies))):
        assert torch.equal(got, want), op
    roles = fast_path.SERVED[op].host_call.roles
    bad = roles.index("w") if "w" in roles else roles.index("r")
    args[bad] = args[bad][..., :63]
    name = f.default._schema.arguments[bad].name
    try:
        f(*args)
    except ValueError as e:
        assert f"deepinfer::{op}: argument '{name}'" in str(e), e
    else:
        raise AssertionError(f"{op}: no error")
""")


def test_install_reads_the_schema_and_refuses_what_it_cannot_serve():
    fast_path.build()
    out = _python("""
import torch, torch_kernels
from torch_kernels import fast_path
install = torch.ops.deepinfer_fast_path.install
ops, twins = torch.library.Library("deepinfer", "FRAGMENT"), torch.library.Library(fast_path.TWIN_NAMESPACE, "FRAGMENT")
for lib in (ops, twins):
    lib.define("toy(Tensor(a!) input, Tensor weight, float eps) -> ()")
    lib.define("read(Tensor input, Tensor weight, int n) -> ()")
    lib.define("named(Tensor input, str how) -> Tensor")
    lib.define("pairs(Tensor input, Tensor? scale, int n) -> (Tensor, Tensor)")
ops.define("lonely(Tensor input) -> Tensor")
for args, words in (((next(iter(fast_path.SERVED)), "r", "h", [0, -1]), "installed already"),
                    (("lonely", "r", "h", [0, -1]), f"{fast_path.TWIN_NAMESPACE}::lonely is not defined"),
                    (("no_such_op", "r", "h", [0, -1]), "deepinfer::no_such_op is not defined"),
                    (("toy", "rw", "", [0, 1]), "one letter per schema argument (3"),
                    (("toy", "rff", "", [0, 1, 2]), "argument 'roles': 'f' for argument 'weight'"),
                    (("toy", "rwr", "", [0, 1, 2]), "argument 'roles': 'r' for argument 'eps'"),
                    (("toy", "wwf", "", [0, 1, 2]), "the written argument 'input' must be rows (r) or a token tensor (t)"),
                    (("toy", "cwf", "", [0, 1, 2]), "the written argument 'input' must be rows (r) or a token tensor (t)"),
                    (("read", "wwi", "", [0, 1]), "has no 'r' or 't'"),
                    (("read", "rib", "", [0]), "argument 'roles': 'i' for argument 'weight'"),
                    (("read", "rcf", "", [0, 1, 2]), "argument 'roles': 'f' for argument 'n'"),
                    (("read", "rws", "", [0, 1]), "argument 'roles': 's' for argument 'n'"),
                    (("read", "rwe", "", [0, 1, 2]), "argument 'roles': 'e' for argument 'n'"),
                    (("named", "rs", "r", [0, 1, -1]), "argument 'call'"),
                    (("pairs", "roi", "r", [0, 1, -1]), "argument 'output' 'r'"),
                    (("pairs", "rfi", "p", [0, 1, -1, -2]), "argument 'roles': 'f' for argument 'scale'"),
                    (("pairs", "rci", "p", [0, 1, -1, -2]), "argument 'roles': 'c' for argument 'scale'"),
                    (("pairs", "roi", "p", [0, 1, -1]), "argument 'call'"),
                    (("pairs", "roi", "p", [0, 1, -1, -3]), "argument 'call'"),
                    (("named", "ro", "p", [0, 1, -1]), "argument 'roles': 'o' for argument 'how'"),
                    (("read", "tci", "r", [0, 1, -1]), "an output is shaped like rows"),
                    (("read", "tci", "", [0, 1, 2]), "argument 'call'"),
                    (("toy", "rwf", "r", [0, 1, -1, 2]), "argument 'output' 'r'"),
                    (("toy", "rwf", "", [0, 1, 1]), "argument 'call'"),
                    (("toy", "rwf", "", [0, 1, -1]), "argument 'call'"),
                    (("toy", "rwf", "", [0, 1]), "argument 'call'")):
    try:
        install(*args)
    except RuntimeError as e:
        assert words in str(e), (args, e)
    else:
        raise AssertionError(f"{args}: no error")
assert "fast_path.cpp" not in torch._C._dispatch_dump("deepinfer::toy")  # refused: nothing registered
install("toy", "rwf", "", [2, 1, 0])
install("named", "rs", "h", [0, -1])
for lib in (ops, twins):
    lib.define("specialised(Tensor(a!) input, float eps) -> ()")
install("specialised", "re", "", [1, 0])
install("pairs", "roi", "p", [-2, 0, -1, 1])
for lib in (ops, twins):
    lib.define("pair(Tensor input) -> Tensor")
    lib.define("pair.out(Tensor input, *, Tensor(a!) out) -> Tensor(a!)")
install_out = torch.ops.deepinfer_fast_path.install_out
for name, words in (("pair", "install the op first"), ("toy", "returns no tensor"), ("pairs", "several outputs"),
                    (next(op for op, s in fast_path.SERVED.items() if s.host_call.output), "installed already")):
    try:
        install_out(name)
    except RuntimeError as e:
        assert words in str(e), (name, e)
    else:
        raise AssertionError(f"{name}: no error")
install("pair", "r", "r", [0, -1])
install_out("pair")
print(torch._C._dispatch_dump("deepinfer::toy"))
print(torch._C._dispatch_dump("deepinfer::pair.out").replace("CUDA:", "CUDA(out):").replace("Autograd[alias]:", "Autograd(out):"))
""")
    kernels = {line.split(":")[0]: line for line in out.splitlines() if " registered at " in line}
    for key in ("CUDA", "Autograd[alias]", "CUDA(out)", "Autograd(out)"):
        assert "fast_path.cpp" in kernels[key], out


def test_publish_refuses_what_the_entry_cannot_serve():
    fast_path.build()
    _python("""
import torch, torch_kernels
from torch_kernels import fast_path, registry
served = {op: s.host_call for op, s in fast_path.SERVED.items()}
other = next(op for op in registry.OPS if op not in served)
op = next(op for op, c in served.items() if set(c.roles) <= set("rwf"))
half = next(op for op, c in served.items() if c.output == "h")
given = next(op for op, c in served.items() if "t" in c.roles)  # tensors as given, ints and bools: rope
n, m, g = len(served[op].tensors), len(served[half].tensors), served[given]
none = lambda o: ([], [0] * len(served[o].roles))  # noqa: E731  (no facts, no granules)
facts = [1, 0, 0, 2, 256, 0, 2, 64, 0, 64, 4096, 64, 1]  # positions (T,), q (T, 256), k (T, 64), head 64, cache, neox
granules = [0, 8, 8, 0, 8, 0]
index = [torch.int64 if r == "t" and i == 0 else torch.float32 if r == "c" else torch.bfloat16
         for i, r in enumerate(g.roles) if r in "tc"]
bf16 = torch.bfloat16
for args, words in (((other, [bf16], 64, 0, [0], [1], [], []), "argument 'op'"),
                    ((op, [torch.float64] + [bf16] * (n - 1), 64, 0, [0], [1], *none(op)), "float16, bfloat16 or float32"),
                    ((op, [torch.int64] + [bf16] * (n - 1), 64, 0, [0], [1], *none(op)), "int32 or int64 for a t or c"),
                    ((op, [bf16] * (n + 1), 64, 0, [0], [1], *none(op)), "argument 'dtypes' must hold"),
                    ((op, [bf16] * n, 0, 0, [0], [1], *none(op)), f"bad entry for {op}"),
                    ((half, [bf16] * m, 63, 0, [0], [1], *none(half)), f"bad entry for {half}"),
                    ((op, [bf16] * n, 64, 0, [], [], *none(op)), "must hold 1 to 4 entries"),
                    ((op, [bf16] * n, 64, 0, [0] * 5, [1] * 5, *none(op)), "must hold 1 to 4 entries"),
                    ((op, [bf16] * n, 64, 0, [8, 16], [1, 1], *none(op)), "'from' starting at 0"),
                    ((op, [bf16] * n, 64, 0, [0, 16], [1], *none(op)), "must hold 1 to 4 entries"),
                    ((op, [bf16] * n, 64, 0, [0, 16, 16], [1, 1, 1], *none(op)), "'from' must ascend"),
                    ((op, [bf16] * n, 64, 0, [0, 16], [1, 0], *none(op)), "every kernel be a handle"),
                    ((op, [bf16] * n, 64, 0, [0], [1], [1], [0] * len(served[op].roles)), "'facts' and 'granules' must hold"),
                    ((op, [bf16] * n, 64, 0, [0], [1], [], [0]), "'facts' and 'granules' must hold"),
                    ((op, [bf16] * n, 64, 0, [0], [1], [], [8] + [0] * (len(served[op].roles) - 1)), "0 but for a t or c"),
                    ((given, index, 0, 0, [0], [1], facts[:-1], granules), "'facts' and 'granules' must hold"),
                    ((given, index, 0, 0, [0], [1], facts, [-1] + granules[1:]), "a granule is >= 0"),
                    ((given, index, 128, 0, [0], [1], facts, granules), f"bad entry for {given}")):
    try:
        torch.ops.deepinfer_fast_path.publish(*args)
    except RuntimeError as e:
        assert words in str(e), e
    else:
        raise AssertionError(f"{args}: no error")
laid = next(op for op, c in served.items() if c.output == "p")
tensors = [bf16] * len(served[laid].tensors)
laid_facts = [0] * sum(r in "oibs" for r in served[laid].roles)
place = [0] * len(served[laid].roles)
fp8 = torch.float8_e4m3fn
for outs, words in (((), "'out_dtypes' and 'out_shapes' must hold 2 and 4"),
                    (([fp8, torch.float32], [0, 64, 1]), "must hold 2 and 4"),
                    (([torch.float64, torch.float32], [0, 64, 1, 1]), "an output is float16"),
                    (([fp8, torch.float32], [0, 64, 4, 1]), "of layout 0-3"),
                    (([fp8, torch.float32], [0, 0, 1, 1]), "width >= 1"),
                    (([fp8, torch.float32], [0, 64, 1, 2]), "(1 for layouts 1 and 2)"),
                    (([fp8, torch.float32], [0, 64, 4, 0]), "or of layout 4 like a t argument")):
    try:
        torch.ops.deepinfer_fast_path.publish(laid, tensors, 64, 0, [0], [1], laid_facts, place, *outs)
    except RuntimeError as e:
        assert words in str(e), e
    else:
        raise AssertionError(f"{outs}: no error")
for outs, words in ((([fp8, torch.float32], [0, 64, 1, 1]), "'max_tokens' must be >= 0"),):
    try:
        torch.ops.deepinfer_fast_path.publish(laid, tensors, 64, 0, [0], [1], laid_facts, place, *outs, max_tokens=-1)
    except RuntimeError as e:
        assert words in str(e), e
    else:
        raise AssertionError(f"{outs}: no error")
try:
    torch.ops.deepinfer_fast_path.publish(op, [bf16] * n, 64, 0, [0], [1], *none(op), [fp8], [0, 64])
except RuntimeError as e:
    assert "must hold 0 and 0" in str(e), e
else:
    raise AssertionError("outputs for an op of one: no error")
like = next(op for op, c in served.items() if c.output == "p" and "r" not in c.roles)  # merge: t arguments
for shapes, words in (([0, 0, 4, 0], "of layout 0-3 over rows"), ([4, 0, 4, 9], "layout 4 like a t argument")):
    try:
        torch.ops.deepinfer_fast_path.publish(like, [bf16, torch.float32] * 2, 0, 0, [0], [1], [0] * 12, [0] * 4,
                                              [bf16, torch.float32], shapes)
    except RuntimeError as e:
        assert words in str(e), e
    else:
        raise AssertionError(f"{shapes}: no error")
assert torch.ops.deepinfer_fast_path.counters() == [0, 0, 0]
import tvm_ffi  # a real TVM-FFI function handle: publishing holds a reference, clearing drops the entry
handle = tvm_ffi.get_global_func("ffi.String").__chandle__()
torch.ops.deepinfer_fast_path.publish(op, [bf16] + [torch.float32] * (n - 1), 64, 0, [0, 128, 4096], [handle] * 3, *none(op))
torch.ops.deepinfer_fast_path.publish(given, index, 0, 0, [0], [handle], facts, granules)
assert torch.ops.deepinfer_fast_path.counters() == [2, 0, 0]
torch.ops.deepinfer_fast_path.clear()
assert torch.ops.deepinfer_fast_path.counters() == [0, 0, 0]
intern = torch.ops.deepinfer_fast_path.intern  # a string argument's fact: one number per string, kept
first, second = intern("none"), intern("tanh")
assert first != second and (intern("none"), intern("tanh")) == (first, second)
""")


# ----------------------------------------------------------------------------------------------
# On the GPU: this process must have loaded the library (the README's and the GPU test
# commands build it before pytest starts).

def _reference(op):
    return registry.BY_OP[op][Backend.TORCH].load()


def _entry_under(backend: str):
    assert fast_path.loaded(), f"the C++ entry is {fast_path.status()}: run python -m torch_kernels build first"
    previous = dispatch.configure(backend=backend, strict=True)
    yield
    dispatch.configure(previous)


@pytest.fixture
def tilelang_entry():
    yield from _entry_under(fast_path.BACKEND.value)


def _args(op, shape, dtype, vector_dtype=None, eps=1e-5):
    """Fresh random arguments of ``op`` by their roles: rows of ``shape``, vectors of its width, floats ``eps``,
    the others at their defaults."""
    return [eps if role == "f" else _default(op, i) if role in "soib" else
            torch.randn(shape if role == "r" else shape[-1:], dtype=vector_dtype if role == "w" and vector_dtype else dtype,
                        device="cuda")
            for i, role in enumerate(_call_of(op).roles)]


def _results(op, args, out):
    """What a call produced: its output, or (in place) the arguments it writes."""
    return (out,) if _call_of(op).output else tuple(args[i] for i in _written(op))


def _expect(op, args):
    """The reference's results, on copies."""
    copies = [a.clone() if isinstance(a, torch.Tensor) else a for a in args]
    return _results(op, copies, _reference(op)(*copies))


def _run_and_compare(op, args):
    expected = _expect(op, args)
    out = getattr(torch.ops.deepinfer, op)(*args)
    for g, e in zip(_results(op, args, out), expected):
        torch.testing.assert_close(g, e, atol=2e-2, rtol=2e-2)


def _each_tensor(op, args, view):
    """``args`` with ``view(tensor, role)`` in place of each tensor."""
    return [a if role in "fs" else view(a, role) for a, role in zip(args, _call_of(op).roles)]


@pytest.mark.gpu
@pytest.mark.parametrize("op", ROW_OPS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
def test_served_calls_match_the_reference(op, dtype, tilelang_entry):
    """The first call of a signature goes to Python and publishes it; the next ones are served in C++,
    by each kernel the host publishes (from its token count), at awkward widths, with a vector in
    another dtype too."""
    other = torch.bfloat16 if dtype == torch.float32 else torch.float32  # a vector dtype: a new signature
    signatures = [(4096, None), (1000, None), (5120, None), (2 * 257, None), (2048, None)]
    if "w" in _call_of(op).roles:
        signatures.append((4096, other))
    for width, vector_dtype in signatures:
        before = fast_path.counters()
        args = _args(op, (3, width), dtype, vector_dtype)
        _run_and_compare(op, args)
        published = fast_path.counters()
        assert published["passed_on"] == before["passed_on"] + 1 and published["signatures"] == before["signatures"] + 1
        starts = [start for start, _ in fast_path.SERVED[op].load_host()(*args)]
        shapes = [(1, width), (7, width), (2, 3, width), (4096, width)]
        shapes += [(start + 3, width) for start in starts[1:]]  # each later kernel, from the C++ entry
        shapes += [(start - 1, width) for start in starts[1:]]  # and the one before it, at its last token count
        for shape in shapes:
            _run_and_compare(op, _args(op, shape, dtype, vector_dtype))
        after = fast_path.counters()
        assert after["served"] == published["served"] + len(shapes) and after["passed_on"] == published["passed_on"], after


@pytest.mark.gpu
@pytest.mark.parametrize("op", SERVED)
def test_twin_calls_run_the_python_kernels(op, tilelang_entry):
    """A call of the twin (as the entry passes calls on, or a benchmark times the Python kernels) runs
    the Python kernels even for a published signature: its Autograd kernel goes on to the twin's CUDA
    kernel, not back to the op's C++ one."""
    args, kwargs = (_rope_args(4, torch.bfloat16, "cuda") if op in AS_GIVEN_OPS else _merge_args(4) if op in SHAPED_LIKE_OPS
                    else _args(op, (4, 1024), torch.bfloat16)), {}
    if op in LAID_OUT_OPS:  # the quant ops by keyword, in their first mode
        args, kwargs = (), {**_quant_args(op, (4, 1024), torch.bfloat16), **_kwargs(_quant_modes(op)[0][0])}
    getattr(torch.ops.deepinfer, op)(*args, **kwargs)  # publishes
    before = fast_path.counters()
    _twin(op)(*args, **kwargs)
    assert fast_path.counters() == before


@pytest.mark.gpu
@pytest.mark.parametrize("op", ROW_OPS)
def test_calls_it_does_not_serve_reach_the_python_kernels(op, tilelang_entry):
    width, dtype = 768, torch.bfloat16
    _run_and_compare(op, _args(op, (4, width), dtype))  # publishes
    wide = _args(op, (4, width + 32), dtype)
    cases = [
        _each_tensor(op, wide, lambda a, role: a[..., :width]),  # strided rows
        _each_tensor(op, wide, lambda a, role: a.flatten()[1:1 + 4 * width].view(4, width) if role == "r"
                     else a[:width]),  # misaligned rows
        _each_tensor(op, wide, lambda a, role: a[:0, :width] if role == "r" else a[:width]),  # no tokens
    ]
    for args in cases:
        before = fast_path.counters()
        _run_and_compare(op, args)
        after = fast_path.counters()
        assert after["passed_on"] == before["passed_on"] + 1 and after["served"] == before["served"]


@pytest.mark.gpu
@pytest.mark.parametrize("op", [op for op in SERVED if "Tensor? weight" in OP_DEFS[op].schema])
def test_a_none_weight_goes_to_python_and_is_a_weight_of_ones(op, tilelang_entry):
    """The entry passes weight=None calls on (its vector is not given), after a signature with a weight
    was published; Python serves them with a weight of ones, bit for bit."""
    width, dtype = 768, torch.bfloat16
    _run_and_compare(op, _args(op, (4, width), dtype))  # publishes
    for _ in range(2):
        args = _args(op, (4, width), dtype)
        ones = [torch.ones(width, dtype=dtype, device="cuda") if role == "w" else
                a.clone() if isinstance(a, torch.Tensor) else a for a, role in zip(args, _call_of(op).roles)]
        args = [None if role == "w" else a for a, role in zip(args, _call_of(op).roles)]
        before = fast_path.counters()
        got = _results(op, args, getattr(torch.ops.deepinfer, op)(*args))
        after = fast_path.counters()
        assert after["passed_on"] == before["passed_on"] + 1 and after["served"] == before["served"]
        for g, w in zip(got, _results(op, ones, getattr(torch.ops.deepinfer, op)(*ones))):
            assert torch.equal(g, w)


@pytest.mark.gpu
@pytest.mark.parametrize("op", IN_PLACE)
def test_overlapping_written_arguments_go_to_python(op, tilelang_entry):
    """A written argument sharing bytes with another tensor argument is refused in C++ and passed on: the
    Python validation raises naming the op, before anything is written."""
    width, dtype = 256, torch.bfloat16
    args = _args(op, (4, width), dtype)
    getattr(torch.ops.deepinfer, op)(*args)  # publishes
    roles = _call_of(op).roles
    for i in _written(op):
        for j in _call_of(op).tensors:
            if j == i:
                continue
            base = torch.randn(5, width, dtype=dtype, device="cuda")
            bad = _args(op, (4, width), dtype)
            bad[i] = base[:4]
            bad[j] = base[0] if roles[j] == "w" else base[1:]  # its first row, or the rows one further
            kept = [a.clone() if isinstance(a, torch.Tensor) else a for a in bad]
            before = fast_path.counters()
            with pytest.raises(ValueError, match=f"deepinfer::{op}: argument '"):
                getattr(torch.ops.deepinfer, op)(*bad)
            after = fast_path.counters()
            assert after["passed_on"] == before["passed_on"] + 1 and after["served"] == before["served"]
            assert all(torch.equal(a, k) for a, k in zip(bad, kept) if isinstance(a, torch.Tensor))


@pytest.mark.gpu
@pytest.mark.parametrize("op", ROW_OPS)
def test_bad_input_still_names_the_op_and_the_argument(op, tilelang_entry):
    call, names = _call_of(op), [a.name for a in _overload(op)._schema.arguments]
    args = _args(op, (4, 256), torch.bfloat16)
    getattr(torch.ops.deepinfer, op)(*args)  # publishes the signature
    bad = []  # (argument, value, exception)
    for i, role in enumerate(call.roles):
        if role == "f":
            bad.append((i, -1.0, ValueError))
        elif role == "s":
            bad.append((i, "fast", ValueError))
        elif role == "w":
            bad += [(i, args[i][:255], ValueError), (i, args[i].cpu(), ValueError)]
        elif i != call.data:
            bad += [(i, args[i][:3], ValueError), (i, args[i].half(), TypeError), (i, args[call.data], ValueError)]
    if call.output == "h":
        bad.append((call.data, torch.randn(4, 255, dtype=torch.bfloat16, device="cuda"), ValueError))
    assert bad
    for i, value, exc in bad:
        changed = list(args)
        changed[i] = value
        with pytest.raises(exc, match=f"deepinfer::{op}: argument '{names[i]}'"):
            getattr(torch.ops.deepinfer, op)(*changed)


@pytest.mark.gpu
@pytest.mark.parametrize("op", ROW_OPS)
def test_served_on_the_current_stream_and_in_a_cuda_graph(op, tilelang_entry):
    f, shape, dtype = getattr(torch.ops.deepinfer, op), (64, 4096), torch.bfloat16
    f(*_args(op, shape, dtype))  # publishes
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        args = _args(op, shape, dtype)
        expected = _expect(op, args)
        torch.cuda._sleep(10_000_000)  # delays the copies: a kernel on another stream would read them unwritten
        copies = [a.clone() if isinstance(a, torch.Tensor) else a for a in args]
        got = _results(op, copies, f(*copies))
    torch.cuda.current_stream().wait_stream(side)
    for g, e in zip(got, expected):
        torch.testing.assert_close(g, e, atol=2e-2, rtol=2e-2)

    static = _args(op, shape, dtype)
    graph = torch.cuda.CUDAGraph()
    served = fast_path.counters()["served"]
    with torch.cuda.graph(graph):
        out = f(*static)
    assert fast_path.counters()["served"] == served + 1
    for _ in range(2):  # fresh data each replay
        for i in _call_of(op).tensors:
            if _call_of(op).roles[i] == "r":
                static[i].copy_(torch.randn_like(static[i]))
        expected = _expect(op, static)
        graph.replay()
        torch.cuda.synchronize()
        for g, e in zip(_results(op, static, out), expected):
            torch.testing.assert_close(g, e, atol=2e-2, rtol=2e-2)


@pytest.mark.gpu
@pytest.mark.parametrize("op", ROW_OPS)
def test_a_new_selection_is_asked_again(op, tilelang_entry, tmp_path):
    args = _args(op, (8, 1024), torch.bfloat16)
    f = getattr(torch.ops.deepinfer, op)
    f(*args)
    f(*args)
    assert fast_path.counters()["signatures"] >= 1
    other = next(b for b in registry.backends_of(op) if b not in (fast_path.BACKEND, Backend.TORCH))
    trace = tmp_path / "trace.txt"
    dispatch.configure(backend=other.value, strict=True, trace_path=str(trace))
    assert fast_path.counters()["signatures"] == 0
    before = fast_path.counters()
    for _ in range(3):
        _run_and_compare(op, _args(op, (8, 1024), torch.bfloat16))
    after = fast_path.counters()
    assert after["passed_on"] == before["passed_on"] + 3 and after["served"] == before["served"]
    assert trace.read_text().splitlines() == [f"{op}|{other.value}"]


@pytest.mark.gpu
@pytest.mark.parametrize("op", WITH_OUT)
def test_out_calls_are_served_into_the_given_output(op, tilelang_entry):
    """Once a signature is published, by a default call or an out call (the twin offers it), out calls
    whose output is contiguous, aligned and apart from the inputs are served in C++ into it; a strided
    output, or one that is the input, goes on to Python, which copies the default overload's result
    (that call served in C++) into it: the same bits in every case."""
    f, dtype = getattr(torch.ops.deepinfer, op), torch.bfloat16
    args = _args(op, (5, 1024), dtype)
    want = f(*args)  # publishes
    out = torch.randn_like(want)
    before = fast_path.counters()
    assert f.out(*args, out=out) is out and torch.equal(out, want)
    after = fast_path.counters()
    assert after["served"] == before["served"] + 1 and after["passed_on"] == before["passed_on"], after

    strided = torch.randn(5, want.shape[-1] + 8, dtype=dtype, device="cuda")[:, :want.shape[-1]]
    data = _call_of(op).data
    cases = [(args, strided)]
    if _call_of(op).output == "r":  # the output is the input: Python computes, then copies over it
        copies = [a.clone() if isinstance(a, torch.Tensor) else a for a in args]
        cases.append((copies, copies[data]))
    for call_args, given in cases:
        before, copies = fast_path.counters(), library.out_copies[op]
        assert f.out(*call_args, out=given) is given and torch.equal(given, want)
        after = fast_path.counters()
        assert after["passed_on"] == before["passed_on"] + 1 and after["served"] == before["served"] + 1, after
        assert library.out_copies[op] == copies + 1

    fresh = _args(op, (3, 2048), dtype)  # a new signature, first seen by an out call
    want = f(*[a.clone() if isinstance(a, torch.Tensor) else a for a in fresh])
    fast_path.clear()
    out = torch.empty_like(want)
    for served in (0, 1):
        before = fast_path.counters()
        f.out(*fresh, out=out)
        after = fast_path.counters()
        assert torch.equal(out, want) and after["served"] == before["served"] + served, after
    assert after["signatures"] == 1


@pytest.mark.gpu
@pytest.mark.parametrize("op", [op for op in SERVED if OP_DEFS[op].backward is not None])
def test_gradients_on_cuda_take_the_backward_formula(op, tilelang_entry):
    f, tensors = getattr(torch.ops.deepinfer, op), _call_of(op).tensors
    args = _args(op, (6, 512), torch.float32)
    f(*args)  # publishes: the forward below is served in C++
    leaves = [a.requires_grad_() if isinstance(a, torch.Tensor) else a for a in args]
    served = fast_path.counters()["served"]
    f(*leaves).square().sum().backward()
    assert fast_path.counters()["served"] == served + 1
    copies = [a.detach().clone().requires_grad_() if isinstance(a, torch.Tensor) else a for a in args]
    _reference(op)(*copies).square().sum().backward()
    for i in tensors:
        torch.testing.assert_close(leaves[i].grad, copies[i].grad, atol=1e-4, rtol=1e-4)


@pytest.mark.gpu
def test_a_string_argument_is_part_of_the_signature(tilelang_entry):
    """gelu_and_mul's approximate: "none" and "tanh" are two signatures, each served by its own kernel bit
    for bit as the Python kernels serve it; a string no signature holds goes on to Python's validation."""
    f, twin = torch.ops.deepinfer.gelu_and_mul, _twin("gelu_and_mul")
    x = torch.randn(7, 2 * 1024, dtype=torch.bfloat16, device="cuda")
    for approximate in ("none", "tanh"):
        before = fast_path.counters()
        f(x, approximate)  # publishes
        got = f(x, approximate)
        after = fast_path.counters()
        assert after["signatures"] == before["signatures"] + 1 and after["served"] == before["served"] + 1, after
        assert torch.equal(got, twin(x, approximate))
    assert not torch.equal(f(x, "none"), f(x, "tanh"))
    before = fast_path.counters()
    with pytest.raises(ValueError, match="deepinfer::gelu_and_mul: argument 'approximate'"):
        f(x, "fast")
    assert fast_path.counters()["passed_on"] == before["passed_on"] + 1


def _quant_args(op, shape, dtype):
    """An op's tensors by name, as a layer passes them: rows of ``shape`` and a weight of its width (the
    other arguments go by keyword, at their defaults unless a mode sets them)."""
    schema = _overload(op)._schema.arguments
    return {a.name: torch.randn(shape if r == "r" else shape[-1:], dtype=dtype, device="cuda")
            for a, r in zip(schema, _call_of(op).roles) if r in "rw"}


def _quant_modes(op):
    """``(mode, published)``: each quant mode of the op, a signature of its own, and whether the entry serves it."""
    names = [a.name for a in _overload(op)._schema.arguments]
    if "per_token" in names:  # the dynamic per-tensor scale takes two kernels: never published
        return [({"scale": 0.0625}, True), ({"per_token": True}, True), ({"per_token": True, "scale_ub": 1.5}, True),
                ({}, False)]
    groups = [{"group_size": 128}, {"group_size": 128, "column_major_scales": True}, {"group_size": 64, "scale_ue8m0": True}]
    if "scale" in names:  # the fused ops: per token by default, or static
        return [(m, True) for m in [{}] + groups + [{"scale": 0.0625}]]
    return [(m, True) for m in groups + [{"group_size": 128, "eps": 1e-35}]]  # eps under 2^-100: exact division


def _kwargs(mode):
    return {k: torch.tensor([v], device="cuda") if k in ("scale", "scale_ub") else v for k, v in mode.items()}


def _same(got, want):
    """Bit for bit, in the same shape and strides (q compared as bytes, NaN where NaN)."""
    assert len(got) == len(want)
    for g, w in zip(got, want):
        assert g.shape == w.shape and g.stride() == w.stride() and g.dtype == w.dtype, (g.shape, w.shape, g.stride(), w.stride())
        g, w = (t.view(torch.uint8) if t.dtype == torch.float8_e4m3fn else t for t in (g, w))
        torch.testing.assert_close(g, w, rtol=0, atol=0, equal_nan=True)


def _twin(op):
    return getattr(getattr(torch.ops, fast_path.TWIN_NAMESPACE), op).default


def _written_names(op):
    return [_overload(op)._schema.arguments[i].name for i in _written(op)]


@pytest.mark.gpu
@pytest.mark.parametrize("op", LAID_OUT_OPS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
def test_quant_calls_are_served_bit_for_bit_the_python_kernels(op, dtype, tilelang_entry):
    """The first call of each quant mode publishes its signature with q's and the scales' layout; the next
    ones are served in C++ by each kernel the host publishes, q, the scales (column-major ones included)
    and a written residual bit for bit what the Python kernels (the twin) return, 3-D rows too. A mode
    the host declines is passed on every time."""
    f = getattr(torch.ops.deepinfer, op)
    width = 2 * 2048 if _call_of(op).output == "p" and op.startswith("silu") else 2048
    for mode, served in _quant_modes(op):
        kw = _kwargs(mode)
        before = fast_path.counters()
        f(**_quant_args(op, (3, width), dtype), **kw)  # publishes
        published = fast_path.counters()
        assert published["signatures"] == before["signatures"] + served, (mode, published)
        host = fast_path.SERVED[op].load_host()(**_quant_args(op, (3, width), dtype), **kw)
        starts = [start for start, _ in host.kernels] if served else [0]
        shapes = [(1, width), (7, width), (2, 3, width)] + [(t, width) for start in starts[1:] for t in (start - 1, start + 3)]
        for shape in shapes:
            args = _quant_args(op, shape, dtype)
            copies = {k: a.clone() for k, a in args.items()}
            got, want = f(**args, **kw), _twin(op)(**copies, **kw)
            _same(got + tuple(args[k] for k in _written_names(op)), want + tuple(copies[k] for k in _written_names(op)))
        after = fast_path.counters()
        assert after["served"] == published["served"] + (len(shapes) if served else 0), (mode, after)
        assert after["passed_on"] == published["passed_on"] + (0 if served else len(shapes)), (mode, after)


@pytest.mark.gpu
@pytest.mark.parametrize("op", LAID_OUT_OPS)
def test_quant_calls_it_does_not_serve_reach_the_python_kernels(op, tilelang_entry):
    """No tokens, a scale of another dtype or shape, a scale in the bytes of the written residual: passed
    on, where validation names the op and the argument, nothing written. Served in a CUDA graph, replayed."""
    f, width = getattr(torch.ops.deepinfer, op), 2 * 1024 if op.startswith("silu") else 1024
    mode = _kwargs(next(m for m, served in reversed(_quant_modes(op)) if served))
    f(**_quant_args(op, (4, width), torch.bfloat16), **mode)  # publishes
    cases = [(_quant_args(op, (0, width), torch.bfloat16), mode, None)]
    if "scale" in mode:
        cases += [(_quant_args(op, (4, width), torch.bfloat16), {**mode, "scale": mode["scale"].double()}, TypeError),
                  (_quant_args(op, (4, width), torch.bfloat16), {**mode, "scale": torch.ones(2, device="cuda")}, ValueError)]
        if _written(op):
            args = _quant_args(op, (4, width), torch.bfloat16)
            inside = args[_written_names(op)[0]].view(-1)[:4].view(torch.float32)[:1]
            inside.fill_(0.5)
            cases.append((args, {**mode, "scale": inside}, ValueError))
    for args, kw, error in cases:
        kept = {k: a.clone() for k, a in args.items()}
        before = fast_path.counters()
        if error:
            with pytest.raises(error, match=f"deepinfer::{op}: argument 'scale'"):
                f(**args, **kw)
            assert all(torch.equal(args[k], kept[k]) for k in args)
        else:
            f(**args, **kw)
        after = fast_path.counters()
        assert after["passed_on"] == before["passed_on"] + 1 and after["served"] == before["served"], (kw, after)

    static = _quant_args(op, (8, width), torch.bfloat16)
    graph, served = torch.cuda.CUDAGraph(), fast_path.counters()["served"]
    with torch.cuda.graph(graph):
        got = f(**static, **mode)
    assert fast_path.counters()["served"] == served + 1
    data = _overload(op)._schema.arguments[_call_of(op).data].name
    for _ in range(2):  # fresh data each replay
        static[data].copy_(torch.randn_like(static[data]))
        want = _twin(op)(**{k: a.clone() for k, a in static.items()}, **mode)
        graph.replay()
        torch.cuda.synchronize()
        _same(got, want)


def _merge_args(tokens, dtype=torch.bfloat16, heads=8, head_size=128, device="cuda"):
    """``merge_attn_states``' partials and their LSEs, ``(T, H, D)`` and ``(T, H)``, some heads empty (-inf)."""
    v_a, v_b = (torch.randn(tokens, heads, head_size, dtype=dtype, device=device) for _ in range(2))
    lse_a, lse_b = (torch.randn(tokens, heads, device=device) * 4 for _ in range(2))
    if tokens:
        lse_a[0, 0] = float("-inf")
    return [v_a, lse_a, v_b, lse_b]


@pytest.mark.gpu
@pytest.mark.parametrize("op", SHAPED_LIKE_OPS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
def test_merge_calls_are_served_bit_for_bit_the_python_kernels(op, dtype, tilelang_entry):
    """Partials of each head size publish their signature on the first call; later ones are served in C++,
    the outputs shaped like the partial and its LSE, bit for bit the Python kernels' (the twin's), and so
    are partials sliced from a wider buffer on the vector; partials off the vector, a transposed LSE and
    no tokens go on to Python."""
    f = getattr(torch.ops.deepinfer, op)
    for heads, head_size in ((8, 128), (4, 64), (5, 40)):
        before = fast_path.counters()
        f(*_merge_args(3, dtype, heads, head_size))  # publishes
        published = fast_path.counters()
        assert published["signatures"] == before["signatures"] + 1, published
        wide = torch.randn(7, heads, head_size + 16, dtype=dtype, device="cuda")
        served = [_merge_args(t, dtype, heads, head_size) for t in (1, 7, 300)]
        served.append([wide[..., :head_size], served[1][1], wide[..., 16:], served[1][3]])  # sliced, on the vector
        passed = [_merge_args(0, dtype, heads, head_size),
                  [wide[..., 1:head_size + 1], served[1][1], served[1][2], served[1][3]],  # off the vector
                  [served[1][0], served[1][1].t().contiguous().t(), served[1][2], served[1][3]]]  # LSE (H, T) seen as (T, H)
        for args in served + passed:
            copies = [a.clone() if a.is_contiguous() else a for a in args]
            _same(f(*args), _twin(op)(*copies))
        after = fast_path.counters()
        assert after["served"] == published["served"] + len(served), after
        assert after["passed_on"] == published["passed_on"] + len(passed), after

    static = _merge_args(16, dtype)
    f(*static)
    graph, count = torch.cuda.CUDAGraph(), fast_path.counters()["served"]
    with torch.cuda.graph(graph):
        got = f(*static)
    assert fast_path.counters()["served"] == count + 1
    for _ in range(2):  # fresh data each replay
        for a, b in zip(static, _merge_args(16, dtype)):
            a.copy_(b)
        want = _twin(op)(*[a.clone() for a in static])
        graph.replay()
        torch.cuda.synchronize()
        _same(got, want)


def test_offer_publishes_outputs_shaped_like_an_argument(monkeypatch):
    """merge_attn_states: the signature holds each partial's and LSE's dims and trailing sizes, and the host's
    granules, outputs (shaped like arguments 0 and 1) and the tokens one launch takes go to the entry."""
    published = []
    monkeypatch.setattr(fast_path, "loaded", lambda: True)
    monkeypatch.setattr(fast_path, "_published", set())
    monkeypatch.setattr(fast_path, "_publish", lambda *entry, **limits: published.append((entry, limits)))
    host = HostKernels(((0, _HostFunction(5)),), (8, 0, 8, 0), (("like", torch.bfloat16, 0), ("like", torch.float32, 1)), 1000)
    monkeypatch.setattr(KernelSpec, "load_host", lambda spec: lambda *args: host)
    assert SHAPED_LIKE_OPS
    for op in SHAPED_LIKE_OPS:
        fast_path.offer(op, fast_path.SERVED[op], tuple(_merge_args(3, device="cpu")))
        entry, limits = published[-1]
        assert entry[-4:] == ([3, 8, 128, 2, 8, 0] * 2, [8, 0, 8, 0], [torch.bfloat16, torch.float32], [4, 0, 4, 1])
        assert limits == {"max_tokens": 1000}


def test_offer_publishes_the_outputs_each_signature_lays_out(monkeypatch):
    """An op whose outputs each signature lays out (the FP8 ops): the signature holds whether the static
    scale is given, the group size and the flags, and carries q's and the scales' dtype, layout and width
    as the host returns them."""
    published = []
    monkeypatch.setattr(fast_path, "loaded", lambda: True)
    monkeypatch.setattr(fast_path, "_published", set())
    monkeypatch.setattr(fast_path, "_publish", lambda *entry: published.append(entry))
    outputs = (("rows", torch.float8_e4m3fn, 64), ("column", torch.float32, 4))
    monkeypatch.setattr(KernelSpec, "load_host",
                        lambda spec: lambda *args: HostKernels(((0, _HostFunction(3)),), outputs=outputs))
    assert LAID_OUT_OPS
    for op in LAID_OUT_OPS:
        roles = _call_of(op).roles
        values = {"r": lambda: torch.randn(2, 64, dtype=torch.bfloat16), "w": lambda: torch.randn(64),
                  "f": lambda: 1e-6, "e": lambda: 0.5, "o": lambda: torch.ones(()), "i": lambda: 16, "b": lambda: True}
        args = [values[r]() for r in roles]
        fast_path.offer(op, fast_path.SERVED[op], tuple(args))
        facts = [{"o": 1, "i": 16, "b": 1, "e": 0x3FE0000000000000}[r] for r in roles if r in "oibe"]  # 0.5's bits
        assert published[-1][-4:] == (facts, [0] * len(roles), [torch.float8_e4m3fn, torch.float32], [0, 64, 3, 4])
        count = len(published)
        if "o" in roles:
            fast_path.offer(op, fast_path.SERVED[op], tuple(None if r == "o" else a for a, r in zip(args, roles)))
            assert len(published) == count + 1 and published[-1][-4][0] == 0  # no scale: a signature of its own
        required = max(i for i, a in enumerate(_overload(op)._schema.arguments) if not a.has_default_value())
        fast_path.offer(op, fast_path.SERVED[op], tuple(args[:required + 1]))  # defaults left out
        assert published[-1][-4] == [facts[k] if i <= required else 0 if r == "o" else int(_default(op, i)) if r in "ib"
                                     else struct.unpack("<q", struct.pack("<d", _default(op, i)))[0]
                                     for k, (i, r) in enumerate((i, r) for i, r in enumerate(roles) if r in "oibe")]


class _HostFunction:
    def __init__(self, handle):
        self.handle = handle

    def __chandle__(self):
        return self.handle


def test_offer_reads_the_signature_by_role_with_trailing_defaults_left_out(monkeypatch):
    """The twin's Python kernel gets the call's arguments without the trailing ones left at their
    defaults (eps): each tensor is read by its role's position, never from the end (H200: reading
    gelu_and_mul's approximate from args[1] raised IndexError on every default call), and the
    signature holds every tensor's dtype."""
    published, asked = [], []
    monkeypatch.setattr(fast_path, "loaded", lambda: True)
    monkeypatch.setattr(fast_path, "_published", set())
    monkeypatch.setattr(fast_path, "_publish", lambda *entry: published.append(entry))
    monkeypatch.setattr(fast_path, "_intern", {"none": 5, "tanh": 6}.__getitem__)

    def fake_host(spec):
        def host(*args):
            asked.append((spec.op, args))
            return ((0, _HostFunction(1)), (4096, _HostFunction(2))) if "w" in spec.host_call.roles else ((0, _HostFunction(1)),)
        return host
    monkeypatch.setattr(KernelSpec, "load_host", lambda spec: fake_host(spec))
    x, w32 = torch.randn(2, 64, dtype=torch.bfloat16), torch.randn(64)
    expected = []
    for op in ROW_OPS:
        spec, roles = fast_path.SERVED[op], _call_of(op).roles
        args = [1e-5 if r == "f" else "none" if r == "s" else x.clone() if r == "r" else w32 for r in roles]
        while roles[len(args) - 1] in "fs":  # trailing defaults left out
            args.pop()
        fast_path.offer(op, spec, tuple(args))
        fast_path.offer(op, spec, tuple(args))  # published already
        dtypes = tuple(torch.float32 if r == "w" else torch.bfloat16 for r in roles if r in "rw")
        facts = [5] * roles.count("s")  # a string left at its default: "none"
        expected.append((op, dtypes, 64, None, *(([0, 4096], [1, 2]) if "w" in roles else ([0], [1])), facts,
                         [0] * len(roles)))
        fast_path.offer(op, registry.BY_OP[op][Backend.TRITON], tuple(args))  # not the served spec
        fast_path.offer(op, None, tuple(args))  # no sole server
    assert published == expected
    assert [op for op, _ in asked] == ROW_OPS
    for op in ROW_OPS:  # an optional vector passed as None: never published (the entry passes such calls on)
        roles = _call_of(op).roles
        if "w" in roles and isinstance(_overload(op)._schema.arguments[roles.index("w")].type, torch.OptionalType):
            fast_path.offer(op, fast_path.SERVED[op], tuple(None if r == "w" else x.clone() for r in roles if r in "rw"))
    assert published == expected and len(asked) == len(ROW_OPS)


def _rope_args(tokens=3, dtype=torch.bfloat16, device="cpu", neox=True, qkv=True, positions_dtype=torch.int64):
    """``rotary_embedding``'s arguments as a layer passes them: q and k column slices of one fused qkv
    buffer (32 + 8 + 8 heads of 128 shrunk to 4 + 2 + 2 heads of 64), int positions, an fp32 cache."""
    heads, kv, hs, max_position = 4, 2, 64, 256
    if qkv:
        buf = torch.randn(tokens, (heads + 2 * kv) * hs, dtype=dtype, device=device)
        q, k = buf[:, :heads * hs], buf[:, heads * hs:(heads + kv) * hs]
    else:
        q = torch.randn(tokens, heads * hs, dtype=dtype, device=device)
        k = torch.randn(tokens, kv * hs, dtype=dtype, device=device)
    positions = torch.randint(0, max_position, (tokens,), device=device, dtype=positions_dtype)
    cache = torch.randn(max_position, hs, device=device)
    return [positions, q, k, hs, cache, neox]


def test_offer_reads_the_shapes_ints_and_bools_of_tensors_passed_as_given(monkeypatch):
    """A ``t``/``c`` op (rope): the signature holds its tensors' dtypes (int positions among them), the
    trailing shapes of the token tensors, the cache's shape, head_size and is_neox, and the granules
    the host returns; a call the host declines is not published (a later one is asked again), one the
    entry never serves (4-D q) not even asked."""
    published, answers = [], []
    monkeypatch.setattr(fast_path, "loaded", lambda: True)
    monkeypatch.setattr(fast_path, "_published", set())
    monkeypatch.setattr(fast_path, "_publish", lambda *entry: published.append(entry))
    monkeypatch.setattr(KernelSpec, "load_host", lambda spec: lambda *args: answers.pop(0))
    for op in AS_GIVEN_OPS:
        spec = fast_path.SERVED[op]
        args = _rope_args()
        answers[:] = [(), HostKernels(((0, _HostFunction(7)),), (0, 8, 8, 0, 4, 0))]
        fast_path.offer(op, spec, tuple(args))  # declined
        assert published == [] and len(answers) == 1
        fast_path.offer(op, spec, tuple(args))
        fast_path.offer(op, spec, tuple(args))  # published already: the host is not asked
        assert published == [(op, (torch.int64, torch.bfloat16, torch.bfloat16, torch.float32), 0, None, [0], [7],
                               [1, 0, 0, 2, 256, 0, 2, 128, 0, 64, 256, 64, 1], [0, 8, 8, 0, 4, 0])]
        four_d = list(args)
        four_d[1] = args[1].view(3, 2, 2, 64)
        fast_path.offer(op, spec, tuple(four_d))  # never served: 4-D
        assert not answers and len(published) == 1


def test_the_rope_host_declines_what_its_aligned_kernel_cannot_take(monkeypatch):
    """The TileLang rope host publishes the aligned 2-D kernel only, with its granules (the vector in
    elements for q and k, a cache row's for the cache), and nothing while positions are checked on the
    data."""
    from torch_kernels.families.rope import tilelang as rope_tilelang

    built = []
    monkeypatch.setattr(rope_tilelang, "_function", lambda *key: built.append(key) or _HostFunction(5))
    monkeypatch.setattr(rope_tilelang, "positions_checked", lambda positions: False)
    host = rope_tilelang.rotary_embedding_host
    for neox, vec in ((True, 8), (False, 4)):  # bf16 pairs a 16-byte vector: 8 half-rows apart, 4 side by side
        published = host(*_rope_args(neox=neox))
        seg = vec if neox else 2 * vec
        assert published.kernels[0][0] == 0 and published.granules == (0, seg, seg, 0, vec, 0)
        assert built[-1] == (4, 2, 64, 64, neox, "bfloat16", "float32", "int64", 2, True)
    args = _rope_args()
    for i, value in ((1, args[1].view(3, 4, 64)), (2, None), (0, args[0].view(1, 3))):
        declined = list(args)
        declined[i] = value
        assert host(*declined) == ()
    odd = torch.randn(3 * 256 + 1, dtype=torch.bfloat16)[1:].view(3, 256)  # off the 16-byte vector
    assert host(args[0], odd, args[2], *args[3:]) == ()
    monkeypatch.setattr(rope_tilelang, "positions_checked", lambda positions: True)
    assert host(*args) == ()


def _rope():
    return torch.ops.deepinfer.rotary_embedding


def _python_rope(args):
    """The call through the Python kernels (the twin) on copies: q and k as they rotate them."""
    copies = _rope_copies(args)
    getattr(torch.ops, fast_path.TWIN_NAMESPACE).rotary_embedding(*copies)
    return copies[1], copies[2]


def _rope_copies(args):
    """``args`` with q and k copied into a buffer laid out as theirs (slices of one buffer stay slices)."""
    copies = list(args)
    q, k = args[1], args[2]
    if k is not None and q.dim() == 2 and q.stride(0) == k.stride(0) and q.untyped_storage().data_ptr() == k.untyped_storage().data_ptr():
        base = q.as_strided((q.shape[0], q.stride(0)), (q.stride(0), 1)).clone()
        offset = (k.data_ptr() - q.data_ptr()) // q.element_size()
        copies[1], copies[2] = base[:, :q.shape[1]], base[:, offset:offset + k.shape[1]]
    else:
        copies[1], copies[2] = q.clone(), None if k is None else k.clone()
    return copies


@pytest.mark.gpu
@pytest.mark.parametrize("neox", [True, False], ids=["neox", "gptj"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
def test_rope_calls_are_served_bit_for_bit_the_python_kernels(dtype, neox, tilelang_entry):
    """The first call publishes; later calls of any token count, q and k as column slices of one qkv
    buffer or as tensors of their own, are served in C++, bit for bit what the Python kernels compute
    (their call, made first, publishes int32 positions), and close to the reference."""
    f = _rope()
    before = fast_path.counters()
    f(*_rope_args(5, dtype, "cuda", neox))
    published = fast_path.counters()
    assert published["passed_on"] == before["passed_on"] + 1 and published["signatures"] == before["signatures"] + 1
    calls = 0
    for positions_dtype in (torch.int64, torch.int32):
        for tokens in (1, 2, 7, 300, 4096):
            for qkv in (True, False):
                args = _rope_args(tokens, dtype, "cuda", neox, qkv, positions_dtype)
                want, reference = _python_rope(args), _rope_copies(args)
                _reference("rotary_embedding")(*reference)
                f(*args)
                calls += 1
                assert torch.equal(args[1], want[0]) and torch.equal(args[2], want[1])
                torch.testing.assert_close(args[1], reference[1], atol=2e-2, rtol=2e-2)
    after = fast_path.counters()
    assert after["served"] == published["served"] + calls and after["passed_on"] == published["passed_on"], after


@pytest.mark.gpu
def test_rope_calls_it_does_not_serve_reach_the_python_kernels(tilelang_entry):
    """Views off the vector, 3-D heads, no key, batched positions, q and k that overlap, and every call
    while positions are checked go to Python: the same results, the same errors, nothing written first."""
    f, dtype = _rope(), torch.bfloat16
    f(*_rope_args(4, dtype, "cuda"))  # publishes
    args = _rope_args(4, dtype, "cuda")
    odd = torch.randn(4 * 256 + 1, dtype=dtype, device="cuda")[1:].view(4, 256)
    batched = _rope_args(6, dtype, "cuda")
    cases = [[args[0], odd, *args[2:]],
             [args[0], args[1].view(4, 4, 64), args[2].view(4, 2, 64), *args[3:]],
             [*args[:2], None, *args[3:]],
             [batched[0].view(2, 3), batched[1].view(2, 3, 256), batched[2].view(2, 3, 128), *batched[3:]]]
    for case in cases:
        want = _python_rope(case)
        before = fast_path.counters()
        f(*case)
        after = fast_path.counters()
        assert after["passed_on"] == before["passed_on"] + 1 and after["served"] == before["served"]
        assert torch.equal(case[1], want[0]) and (case[2] is None or torch.equal(case[2], want[1]))

    buf = torch.randn(4, 384, dtype=dtype, device="cuda")
    overlapping = [args[0], buf[:, :256], buf[:, 192:320], *args[3:]]  # k's first head is q's last
    kept = buf.clone()
    with pytest.raises(ValueError, match="deepinfer::rotary_embedding: argument 'key'"):
        f(*overlapping)
    assert torch.equal(buf, kept)

    outside = _rope_args(4, dtype, "cuda")
    outside[0][2] = 256
    f(*_rope_args(4, dtype, "cuda"))  # publishes again
    assert fast_path.counters()["signatures"] == 1
    previous = dispatch.configure(backend=fast_path.BACKEND.value, strict=True, check_indices=True)  # drops it
    try:
        assert fast_path.counters()["signatures"] == 0
        for _ in range(2):  # the check is Python's: nothing is published while it is asked for
            with pytest.raises(ValueError, match="deepinfer::rotary_embedding: argument 'positions' must lie in"):
                f(*outside)
            f(*_rope_args(4, dtype, "cuda"))
            assert fast_path.counters()["signatures"] == 0
    finally:
        dispatch.configure(previous)


@pytest.mark.gpu
def test_rope_served_on_the_current_stream_and_in_a_cuda_graph(tilelang_entry):
    f, dtype = _rope(), torch.bfloat16
    f(*_rope_args(64, dtype, "cuda"))  # publishes
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        args = _rope_args(64, dtype, "cuda")
        want = _python_rope(args)
        torch.cuda._sleep(10_000_000)  # delays the copies: a kernel on another stream would read them unwritten
        copies = _rope_copies(args)
        f(*copies)
    torch.cuda.current_stream().wait_stream(side)
    assert torch.equal(copies[1], want[0]) and torch.equal(copies[2], want[1])

    static = _rope_args(64, dtype, "cuda")
    graph = torch.cuda.CUDAGraph()
    served = fast_path.counters()["served"]
    with torch.cuda.graph(graph):
        f(*static)
    assert fast_path.counters()["served"] == served + 1
    for _ in range(2):  # fresh data each replay
        static[1].copy_(torch.randn_like(static[1]))
        static[2].copy_(torch.randn_like(static[2]))
        static[0].copy_(torch.randint_like(static[0], 0, 256))
        want = _python_rope(static)
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(static[1], want[0]) and torch.equal(static[2], want[1])


# ---- recorded launches: the ops with a Triton kernel and no host function ----

RECORDED = list(fast_path.RECORDED)


@pytest.fixture
def triton_entry():
    yield from _entry_under("triton")


def _fresh(args):
    """The arguments again in new memory, strides kept."""
    return tuple(clone_keep_strides(a) for a in args)


def _produced(op, overload, args):
    """Its returns, then the arguments it writes (on copies of those)."""
    return outputs_of(overload, args, mutated_args(getattr(torch.ops.deepinfer, op).default))


def test_record_refuses_what_it_cannot_replay():
    """``record``'s arguments are checked before anything is kept (on any machine: no driver is needed
    to refuse them)."""
    fast_path.build()
    _python("""
import torch, torch_kernels
from torch_kernels import fast_path
op = fast_path.RECORDED[0]
served = next(iter(fast_path.SERVED))
n = len(getattr(torch.ops.deepinfer, op).default._schema.arguments)
key = [1, 6, 1, 0, 1, 1, 4, 1] + [0] * (n - 1)  # a float tensor (4,) on cuda:0, aligned, then None
launch = [1, 1, 1, 1, 128, 0, 2, 1]  # function 1, grid (1,1,1), 128 threads, no shared memory, 2 slots, 1 patch
as_is = [0, 1, 4, 1, 0] * len(getattr(torch.ops.deepinfer, op).default._schema.returns)  # each return: argument 0
for args, words in (((served, 0, key, [], None, [], [], [], []), "served by its HostCall"),
                    ((op, 0, [], [], None, [], [], [], []), "argument 'key' is empty"),
                    ((op, 0, key + [0], [], None, [], [], [], []), "is not a signature of"),
                    ((op, 0, key[:-1], [], None, [], [], [], []), "argument 'key' ends early"),
                    ((op, 0, [0] * n, [], None, [], launch, [0, 0, 8, 8], [0, 0, 0]), "a bad parameter or source"),
                    ((op, 0, key, [2, 4, 4, 1], None, [], [], [], []), "one dtype per allocation"),
                    ((op, 0, key, [9] + [1] * 18, [torch.float32], [], [], [], []), "dims must be 0 to 8"),
                    ((op, 0, key, [], None, [-1, 0, 0], [], [], []), "a bad source or offset"),
                    ((op, 0, key, [1, 4, -1], [torch.float32], as_is, [], [], []), "negative sizes or strides"),
                    ((op, 0, key, [], None, [99, 0, 0], [], [], []), "a bad source or offset"),
                    ((op, 0, key, [], None, [], [0] + launch[1:], [0, 0, 8, 8], [0, 0, 0]), "needs a function"),
                    ((op, 0, key, [], None, [], launch[:4] + [2048] + launch[5:], [0, 0, 8, 8], [0, 0, 0]), "1-1024 threads"),
                    ((op, 0, key, [], None, [], launch, [0, 0, 8, 3], [0, 0, 0]), "1, 2, 4 or 8 bytes"),
                    ((op, 0, key, [], None, [], launch, [0, 0, 8, 8], [2, 0, 0]), "a bad parameter or source"),
                    ((op, 0, key, [], None, [], launch, [0, 0, 8, 8], [0, -1, 0]), "a bad parameter or source"),
                    ((op, 0, key, [], None, [], launch, [0, 0, 8], [0, 0, 0]), "argument 'slots' ends early"),
                    ((op, 0, key, [], None, [], launch, [0, 0, 8, 8, 1], [0, 0, 0]), "hold more than the launches take")):
    try:
        torch.ops.deepinfer_fast_path.record(*args)
    except RuntimeError as e:
        assert words in str(e), (words, str(e))
    else:
        raise AssertionError(f"{words}: no error")
assert torch.ops.deepinfer_fast_path.pending(op) is None  # no call of it is under way
""")


@pytest.mark.gpu
@pytest.mark.parametrize("op", RECORDED)
def test_recorded_calls_replay_the_python_kernels_bit_for_bit(op, triton_entry):
    """A recorded op's call is recorded the first time its signature is seen and replayed from C++ after:
    on fresh data in new memory, its returns and written arguments are the Python kernels' (the twin's)
    bit for bit, for every dtype and sample shape; at least one of its calls is replayed."""
    overload, twin = getattr(torch.ops.deepinfer, op).default, _twin(op)
    spec = registry.BY_OP[op][Backend.TRITON]
    replayed = 0
    for dtype in (getattr(torch, d) for d in spec.dtypes or ("float32",)):
        for args in OP_DEFS[op].samples("cuda", dtype):
            overload(*_fresh(args))  # recorded, when it can be
            fresh = _fresh(args)
            want = _produced(op, twin, _fresh(fresh))
            before = fast_path.counters()["served"]
            got = _produced(op, overload, fresh)
            replayed += fast_path.counters()["served"] - before
            _same(got, want)
    assert replayed, f"no call of {op} was replayed: {fast_path.not_recorded().get(op)}"


@pytest.mark.gpu
@pytest.mark.parametrize("op", RECORDED)
def test_recorded_ops_replay_a_decode_steps_call(op, triton_entry):
    """The call a decode step makes (one token, the benchmark case's bf16 arguments) is recorded and then
    replayed, as the Python kernels compute it: a one-row route with an aten kernel between its launches
    (a fill) would leave every decode call in Python."""
    args, _ = cases.one_token(op, "cuda")
    overload = getattr(torch.ops.deepinfer, op).default
    overload(*_fresh(args))
    fresh = _fresh(args)
    want = _produced(op, _twin(op), _fresh(fresh))
    before = fast_path.counters()["served"]
    got = _produced(op, overload, fresh)
    assert fast_path.counters()["served"] > before, f"{op}: {fast_path.not_recorded().get(op)}"
    _same(got, want)


@pytest.mark.gpu
def test_recorded_out_calls_write_the_given_outputs(triton_entry):
    ops = [op for op in RECORDED if fast_path.serves_out(op) and OP_DEFS[op].out_names
           and any(k.out for k in registry.BY_OP[op].values())]
    assert ops
    replayed = 0
    for op in ops:
        overload = getattr(torch.ops.deepinfer, op)
        for args in OP_DEFS[op].samples("cuda", torch.float32):
            want = _produced(op, overload.default, _fresh(args))[:len(OP_DEFS[op].out_names)]
            outs = {n: torch.empty_like(t) for n, t in zip(OP_DEFS[op].out_names, want)}
            for _ in range(2):
                fresh, given = _fresh(args), {n: torch.empty_like(t) for n, t in outs.items()}
                before = fast_path.counters()["served"]
                got = overload.out(*fresh, **given)
                replayed += fast_path.counters()["served"] - before
                got = [got] if isinstance(got, torch.Tensor) else list(got)
                assert all(g is given[n] or g.data_ptr() == given[n].data_ptr() for g, n in zip(got, given))
                expected = _produced(op, overload.default, _fresh(fresh))[:len(got)]
                _same(got, expected)
    assert replayed, fast_path.not_recorded()


def _cache_args():
    sample = next(iter(OP_DEFS["reshape_and_cache_flash"].samples("cuda", torch.bfloat16)))
    return list(_fresh(sample))


@pytest.mark.gpu
def test_a_recorded_call_with_overlapping_written_arguments_goes_to_python(triton_entry):
    f = torch.ops.deepinfer.reshape_and_cache_flash.default
    for _ in range(2):
        f(*_cache_args())
    args = _cache_args()
    args[3] = args[2]  # value_cache is key_cache
    before = fast_path.counters()
    with pytest.raises((ValueError, RuntimeError), match="reshape_and_cache_flash"):
        f(*args)
    assert fast_path.counters()["served"] == before["served"]


@pytest.mark.gpu
def test_recorded_calls_run_on_the_current_stream_and_in_a_cuda_graph(triton_entry):
    f = torch.ops.deepinfer.reshape_and_cache_flash.default
    f(*_cache_args())  # recorded
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        args = _cache_args()
        want = _produced("reshape_and_cache_flash", _twin("reshape_and_cache_flash"), _fresh(args))
        torch.cuda._sleep(10_000_000)  # a kernel on another stream would read the copies below unwritten
        copies = _fresh(args)
        served = fast_path.counters()["served"]
        f(*copies)
        assert fast_path.counters()["served"] == served + 1
    torch.cuda.current_stream().wait_stream(side)
    _same([copies[2], copies[3]], want)

    static = _cache_args()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        f(*static)
    for _ in range(2):  # fresh data each replay
        for i in (0, 1):
            static[i].copy_(torch.randn_like(static[i]))
        want = _produced("reshape_and_cache_flash", _twin("reshape_and_cache_flash"), _fresh(static))
        graph.replay()
        torch.cuda.synchronize()
        _same([static[2], static[3]], want)


@pytest.mark.gpu
def test_a_call_that_checks_its_indices_is_not_recorded(triton_entry):
    previous = dispatch.configure(check_indices=True)
    try:
        f = torch.ops.deepinfer.reshape_and_cache_flash.default
        before = fast_path.counters()
        for _ in range(3):
            f(*_cache_args())
        after = fast_path.counters()
        assert after["served"] == before["served"] and after["signatures"] == before["signatures"]
    finally:
        dispatch.configure(previous)


def _fake_kernel(signature, scratch=0, num_ctas=1):
    """What ``launch_record`` reads of a Triton ``CompiledKernel``."""
    from types import SimpleNamespace
    meta = SimpleNamespace(num_warps=4, shared=128, num_ctas=num_ctas, global_scratch_size=scratch, profile_scratch_size=0)
    return SimpleNamespace(name="k", metadata=meta, function=0x1234, _init_handles=lambda: None,
                           run=SimpleNamespace(global_scratch_size=scratch, profile_scratch_size=0),
                           src=SimpleNamespace(signature=signature))


def test_a_recording_holds_each_launch_as_triton_passes_it():
    """Slots in the launcher's order (non-constexpr arguments, then the two scratch pointers), floats as
    their fp32 bits, ints as two's complement; pointers as (slot, source, byte offset): an argument's
    data exactly, an allocation, or inside the one argument that holds them."""
    from torch_kernels import launch_record
    x, out = torch.randn(4, 8), torch.empty(4, 8)
    signature = {"x": "*fp32", "row": "*fp32", "out": "*fp32", "n": "i32", "eps": "fp32", "BLOCK": "constexpr", "flag": "i1"}
    launches = [(_fake_kernel(signature), (3,), None, (x, x[1:], out[:, 2:], -7, 0.5, 128, True))]
    rec = launch_record.replayable(out[1:], {0: x}, [out], launches, None)
    assert rec.allocations == [2, 4, 8, 8, 1] and rec.allocation_dtypes == [torch.float32]
    assert rec.returns == [-1, 2, 3, 8, 8, 1, 8]
    assert rec.launches == [0x1234, 3, 1, 1, 128, 128, 8, 3]
    fp32 = struct.unpack("<i", struct.pack("<f", 0.5))[0]
    assert rec.slots == [0, 0, 0, -7, fp32, 1, 0, 0] + [8, 8, 8, 4, 4, 1, 8, 8]
    assert rec.patches == [0, 0, 0, 1, 0, 32, 2, -1, 8]
    assert launch_record.replayable(x, {0: x}, [], launches[:0] + [(_fake_kernel({"x": "*fp32"}), (1, 2), None, (x,))],
                                    None).returns == [0, 0, 0]


@pytest.mark.parametrize("why, case", [
    ("lies in no argument or allocation", lambda x: ((_fake_kernel({"p": "*fp32"}), (1,), None, (torch.randn(2),)),)),
    ("data of several arguments", lambda x: ((_fake_kernel({"p": "*fp32"}), (1,), None, (x,)),)),
    ("needs scratch memory", lambda x: ((_fake_kernel({"p": "*fp32"}, scratch=64), (1,), None, (x,)),)),
    ("with a cluster", lambda x: ((_fake_kernel({"p": "*fp32"}, num_ctas=2), (1,), None, (x,)),)),
    ("takes a nvTmaDesc", lambda x: ((_fake_kernel({"p": "nvTmaDesc"}), (1,), None, (x,)),)),
    ("another stream", lambda x: ((_fake_kernel({"p": "*fp32"}), (1,), 7, (x,)),)),
    ("launched no Triton kernel", lambda x: ()),
])
def test_a_call_not_replayable_says_why(why, case):
    from torch_kernels import launch_record
    x = torch.randn(4)
    tensors = {0: x, 1: x} if "several" in why else {0: x}
    with pytest.raises(launch_record.NotReplayable, match=why):
        launch_record.replayable(None, tensors, [], list(case(x)), None)


def test_a_call_running_other_aten_ops_is_not_replayable():
    from torch_kernels import launch_record
    x = torch.randn(4)
    result, why = launch_record.record(lambda: x + 1, {0: x}, x.device)
    assert torch.equal(result, x + 1) and isinstance(why, launch_record.NotReplayable) and "aten.add" in str(why)
    _, why = launch_record.record(lambda: torch.empty(3).view(1, 3), {0: x}, x.device)
    assert "launched no Triton kernel" in str(why)


def test_the_signature_server_is_the_kernel_that_takes_the_exact_call(cuda_platform):
    """What ``run_recording`` asks before it records: the MoE kernel's per-call check reads the expert
    count only, so the call's signature decides it; a call it refuses is the reference's; ``auto`` none."""
    from torch_kernels.families.moe.triton import MAX_TILE
    previous = dispatch.configure(backend="triton")
    try:
        slot = dispatch.slot("topk_softmax", 0)
        assert slot.signature_server((torch.randn(4, 64), 2, False)).backend is Backend.TRITON
        assert slot.signature_server((torch.randn(2, MAX_TILE + 1), 2, False)).backend is Backend.TORCH
        dispatch.configure(backend="auto")
        assert slot.signature_server((torch.randn(4, 64), 2, False)) is None
    finally:
        dispatch.configure(previous)
