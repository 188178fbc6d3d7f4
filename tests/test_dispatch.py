"""Selection: every rule of the DeepInfer dispatcher applied to ops, and every error it raises.

The CUDA selection runs here on CPU tensors: ``cuda_platform`` makes the dispatcher resolve as on an
sm_90 machine, and a slot's ``call`` is what the CUDA entry of the op calls (Triton runs in its
interpreter without a GPU).
"""

import multiprocessing
import os
import subprocess
import sys
import textwrap
import threading
import types

import pytest
import torch

from torch_kernels import dispatch, registry, reporting, spec
from torch_kernels.dispatch import KernelUnavailableError, Selection
from torch_kernels.spec import Backend, KernelSpec, Platform
from torch_kernels.testing import assert_close

from conftest import DEVICES, HAS_CUDA, TORCH_BLOCKED_PRELUDE

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


# Slots run their backend for real: on CUDA tensors on a GPU, on CPU tensors (Triton
# interpreted) elsewhere.
DEV = "cuda" if HAS_CUDA else "cpu"

# The rules are tested in a world of two backends, Triton and the reference, where TileLang and
# FlashInfer implement nothing: their kernels cannot run on the CPU tensors of CI, and a backend that
# lacks every op is what the lacking/fallback/strict rules need. In-process, the inventory is filtered
# (the `triton_world` fixture, tests/conftest.py); in subprocesses, the two packages are hidden, so that they cannot run here.
_HIDE_OTHER_BACKENDS = "import sys; sys.modules['tilelang'] = sys.modules['flashinfer'] = None\n"


pytestmark = pytest.mark.usefixtures("triton_world")


def _args():
    return torch.randn(3, 96, device=DEV), torch.randn(96, device=DEV), 1e-6


def _expected(x, w, eps):
    return registry.BY_OP["rmsnorm"][Backend.TORCH].load()(x, w, eps)


def _served_by(op, tmp_path, *args):
    """Call op's CUDA slot once with a fresh trace file; return the backends the trace names."""
    trace = tmp_path / f"trace-{op}.txt"
    trace.unlink(missing_ok=True)
    dispatch.configure(trace_path=str(trace))
    out = dispatch.slot(op).call(*args)
    return [line.split("|")[1] for line in trace.read_text().splitlines()], out


def _run(code, env=None):
    full_env = {**os.environ, "TRITON_INTERPRET": "1", **(env or {})}
    full_env = {k: v for k, v in full_env.items() if v is not None}
    return subprocess.run([sys.executable, "-c", _HIDE_OTHER_BACKENDS + textwrap.dedent(code)], cwd=ROOT, env=full_env,
                          capture_output=True, text=True, timeout=300)


# --- platform default --------------------------------------------------------------------------


def test_platform_default_on_cuda_is_the_priority_list_filtered_by_capability(cuda_platform):
    chain, notice = dispatch.plan("rmsnorm")
    assert [k.backend for k in chain] == [Backend.TRITON, Backend.TORCH] and notice is None
    old = dispatch.plan("rmsnorm", Platform("cuda", (6, 0), "old GPU"))[0]
    assert [k.backend for k in old] == [Backend.TORCH]


def test_platform_default_elsewhere_is_the_reference():
    chain, notice = dispatch.plan("rmsnorm", Platform())
    assert [k.backend for k in chain] == [Backend.TORCH] and notice is None


def test_default_serves_triton_and_refused_dtype_goes_to_next_backend(cuda_platform, tmp_path, capfd):
    args = _args()
    served, out = _served_by("rmsnorm", tmp_path, *args)
    assert served == ["triton"]
    assert_close(out, _expected(*args))
    x64 = (args[0].double(), args[1].double(), 1e-6)
    capfd.readouterr()
    for _ in range(2):
        out64 = dispatch.slot("rmsnorm").call(*x64)
    assert_close(out64, _expected(*x64))
    assert capfd.readouterr().err.splitlines() == [  # the fallback says so, once
        "[deepinfer] op 'rmsnorm' served by 'torch': 'triton' refuses the call (dtype torch.float64 is not one "
        "of float16, bfloat16, float32)"]
    assert (tmp_path / "trace-rmsnorm.txt").read_text().splitlines()[-1] == "rmsnorm|torch"  # and traces it


# --- DEEPINFER_OPS_BACKEND -----------------------------------------------------------------------


def test_backend_serves_every_op(cuda_platform, tmp_path):
    dispatch.configure(backend="torch")
    assert _served_by("rmsnorm", tmp_path, *_args())[0] == ["torch"]
    dispatch.configure(backend="triton")
    assert _served_by("rmsnorm", tmp_path, *_args())[0] == ["triton"]


def test_backend_lacking_ops_summary_line_and_first_use_notice(cuda_platform, tmp_path, capfd):
    dispatch.configure(backend="tilelang")
    lacking = [op for op in registry.OPS if Backend.TILELANG not in registry.BY_OP[op]]
    err = capfd.readouterr().err.strip().splitlines()
    assert err == [f"[deepinfer] backend 'tilelang' lacks {len(lacking)} op(s), falling back to the "
                   f"platform default (first: {lacking[0]})"]
    dispatch.configure(backend="tilelang", verbose=True)
    assert str(lacking) in capfd.readouterr().err
    args = _args()
    served, out = _served_by("rmsnorm", tmp_path, *args)
    assert served == ["triton"]
    assert_close(out, _expected(*args))
    dispatch.slot("rmsnorm").call(*args)  # the notice is printed once, at the first use
    notices = [l for l in capfd.readouterr().err.splitlines() if "op 'rmsnorm'" in l]
    assert notices == ["[deepinfer] op 'rmsnorm' used from 'triton': 'tilelang' does not implement it"]


def test_backend_that_cannot_run_here_falls_back_with_the_reason(tmp_path, capfd):
    dispatch.set_platform(Platform("cuda", (6, 0), "old GPU"))
    dispatch.configure(backend="triton")
    assert _served_by("rmsnorm", tmp_path, *_args())[0] == ["torch"]
    assert "needs compute capability >= 7.0, this is 6.0" in capfd.readouterr().err


def test_backend_not_installed_says_so(monkeypatch, capfd):
    for backend, pip in [("tilelang", "tilelang"), ("flashinfer", "flashinfer-python")]:
        monkeypatch.setitem(sys.modules, backend, None)  # find_spec: not installed
        dispatch.configure(backend=backend)
        assert capfd.readouterr().err.splitlines() == [
            f"[deepinfer] backend {backend!r} is not installed (pip install {pip}): all {len(registry.OPS)} ops "
            "from the platform default"]
        dispatch.configure(backend=backend, strict=True)
        assert capfd.readouterr().err.splitlines() == [
            f"[deepinfer] backend {backend!r} is not installed (pip install {pip}); DEEPINFER_OPS_STRICT is set, "
            "so calling any op raises KernelUnavailableError"]
        dispatch.configure(backend=None, strict=False)


# --- DEEPINFER_OPS_FALLBACK ----------------------------------------------------------------------


def test_fallback_ops_come_from_the_platform_default(cuda_platform, tmp_path, capfd):
    dispatch.configure(backend="torch", fallback=["rmsnorm"])
    assert _served_by("rmsnorm", tmp_path, *_args())[0] == ["triton"]
    assert _served_by("gemma_rmsnorm", tmp_path, *_args())[0] == ["torch"]
    assert "used from" not in capfd.readouterr().err  # a requested fallback is silent


def test_fallback_as_one_string_is_comma_separated(cuda_platform):
    dispatch.configure(backend="torch", fallback=" rmsnorm, gemma_rmsnorm,")
    assert dispatch.selection().fallback == {"rmsnorm", "gemma_rmsnorm"}


# --- DEEPINFER_OPS_STRICT ------------------------------------------------------------------------


def test_strict_lacking_op_raises_kernel_unavailable(cuda_platform, capfd):
    dispatch.configure(backend="tilelang", strict=True)
    assert "DEEPINFER_OPS_STRICT is set, so calling them raises KernelUnavailableError" in capfd.readouterr().err
    with pytest.raises(KernelUnavailableError, match="deepinfer::rmsnorm: 'tilelang' does not implement it") as e:
        dispatch.slot("rmsnorm").call(*_args())
    assert isinstance(e.value, AttributeError)


def test_strict_refused_call_raises_instead_of_falling_back(cuda_platform):
    dispatch.configure(backend="triton", strict=True)
    x, w, eps = _args()
    assert_close(dispatch.slot("rmsnorm").call(x, w, eps), _expected(x, w, eps))
    with pytest.raises(KernelUnavailableError, match="triton: dtype torch.float64 is not one of"):
        dispatch.slot("rmsnorm").call(x.double(), w.double(), eps)


def test_strict_never_imports_the_default_backend():
    r = _run("""
        import sys, torch, torch_kernels
        from torch_kernels import dispatch, Platform
        dispatch.set_platform(Platform("cuda", (9, 0), "pretend"))
        try:
            dispatch.slot("rmsnorm").call(torch.randn(2, 8, device="cuda" if torch.cuda.is_available() else "cpu"), torch.randn(8), 1e-6)
        except torch_kernels.KernelUnavailableError as e:
            print("raised:", e)
        print("triton imported:", "torch_kernels.families.norm.triton" in sys.modules)
    """, {"DEEPINFER_OPS_BACKEND": "tilelang", "DEEPINFER_OPS_STRICT": "1"})
    assert r.returncode == 0, r.stderr
    assert "raised: deepinfer::rmsnorm" in r.stdout and "triton imported: False" in r.stdout


def test_conftest_turns_kernel_unavailable_into_a_skip(pytester, monkeypatch):
    monkeypatch.setenv("PYTHONPATH", ROOT)
    pytester.makeconftest(open(os.path.join(ROOT, "tests", "conftest.py")).read())
    pytester.makepyfile("""
        import torch_kernels
        def test_lacking():
            raise torch_kernels.KernelUnavailableError("deepinfer::rmsnorm: not here")
    """)
    result = pytester.runpytest_subprocess("-rs")
    result.assert_outcomes(skipped=1)
    result.stdout.fnmatch_lines(["*kernel unavailable: deepinfer::rmsnorm: not here*"])


# --- misconfiguration: one exception type, naming the variable or the argument ----------------------

# (environment, the start of the ValueError): every misconfiguration the variables can express
ENV_ERRORS = [
    ({"DEEPINFER_OPS_BACKEND": "cutlass"}, "DEEPINFER_OPS_BACKEND: unknown backend 'cutlass'; known backends: torch, triton"),
    ({"DEEPINFER_OPS_FALLBACK": "rms_norm"}, "DEEPINFER_OPS_FALLBACK names unknown op(s) ['rms_norm']; the ops are: rmsnorm"),
    ({"DEEPINFER_OPS_BACKEND": "tilelang", "DEEPINFER_OPS_FALLBACK": "rmsnorm"},
     "DEEPINFER_OPS_FALLBACK names op(s) backend 'tilelang' does not implement: ['rmsnorm']"),
    ({"DEEPINFER_OPS_STRICT": "1", "DEEPINFER_OPS_FALLBACK": "rmsnorm"},
     "DEEPINFER_OPS_STRICT forbids DEEPINFER_OPS_FALLBACK: strict means no fallback of any kind"),
    ({"DEEPINFER_OPS_BACKEND": "triton", "DEEPINFER_OPS_STRICT": "1", "DEEPINFER_OPS_FALLBACK": "nope"},
     "DEEPINFER_OPS_STRICT forbids DEEPINFER_OPS_FALLBACK"),
    ({"DEEPINFER_OPS_BACKEND": "auto", "DEEPINFER_OPS_STRICT": "1"},
     "DEEPINFER_OPS_BACKEND=auto chooses among the usable backends per call: it cannot be combined with "
     "DEEPINFER_OPS_STRICT"),
    ({"DEEPINFER_OPS_COMPILE_ROUTE": "fastest"}, "DEEPINFER_OPS_COMPILE_ROUTE names unknown route 'fastest'"),
    ({"DEEPINFER_OPS_COMPILE_ROUTE": "rms_norm=opaque"}, "DEEPINFER_OPS_COMPILE_ROUTE names unknown op 'rms_norm'"),
    ({"DEEPINFER_OPS_COMPILE_ROUTE": "top_k_top_p_sampling_from_probs=decompose"},
     "DEEPINFER_OPS_COMPILE_ROUTE: op 'top_k_top_p_sampling_from_probs' cannot take route 'decompose'"),
    ({"DEEPINFER_OPS_CHECK_INDICES": "maybe"}, "DEEPINFER_OPS_CHECK_INDICES must be 1 or 0 (or unset for each op's default)"),
]


@pytest.mark.parametrize("env, message", ENV_ERRORS, ids=lambda v: ",".join(v) if isinstance(v, dict) else None)
def test_every_misconfiguration_by_environment_is_a_value_error_naming_the_variable(env, message):
    before = dispatch.selection()
    with pytest.raises(ValueError) as e:
        dispatch.configure(Selection.from_env(env))
    assert str(e.value).startswith(message) and type(e.value) is ValueError
    assert dispatch.selection() is before  # nothing changed


# (configure's arguments, the start of the ValueError)
CONFIGURE_ERRORS = [
    ({"backend": "cutlass"}, "configure(backend=...): unknown backend 'cutlass'; known backends: torch, triton"),
    ({"backend": 3}, "configure(backend=...) must be a backend name, 'auto' or None, got 3"),
    ({"fallback": ["rms_norm"]}, "configure(fallback=...) names unknown op(s) ['rms_norm']"),
    ({"fallback": 5}, "configure(fallback=...) must be op names"),
    ({"fallback": [None]}, "configure(fallback=...) must be op names"),
    ({"backend": "tilelang", "fallback": ["rmsnorm"]},
     "configure(fallback=...) names op(s) backend 'tilelang' does not implement: ['rmsnorm']"),
    ({"backend": "torch", "fallback": ["rmsnorm"], "strict": True},
     "configure(strict=...) forbids configure(fallback=...): strict means no fallback of any kind"),
    ({"backend": "auto", "strict": True},
     "configure(backend='auto') chooses among the usable backends per call: it cannot be combined with configure(strict=...)"),
    ({"auto": True, "backend": "triton"}, "configure(backend='auto') chooses among the usable backends per call"),
    ({"strict": "yes"}, "configure(strict=...) must be True or False, got 'yes'"),
    ({"verbose": "1"}, "configure(verbose=...) must be True or False"),
    ({"trace_args": 2}, "configure(trace_args=...) must be True or False"),
    ({"trace_path": 5}, "configure(trace_path=...) must be a path or None, got 5"),
    ({"compile_route": "fastest"}, "configure(compile_route=...) names unknown route 'fastest'"),
    ({"compile_route": "rms_norm=opaque"}, "configure(compile_route=...) names unknown op 'rms_norm'"),
    ({"compile_route": 5}, "configure(compile_route=...) must be a string ('route' or 'op=route,...')"),
    ({"check_indices": 1}, "configure(check_indices=...) must be True, False or None (each op's default), got 1"),
    ({"bakend": "triton"}, "configure() takes no argument 'bakend'; it takes: backend, fallback, strict"),
]


@pytest.mark.parametrize("kwargs, message", CONFIGURE_ERRORS, ids=lambda v: ",".join(v) if isinstance(v, dict) else None)
def test_every_misconfiguration_by_configure_is_a_value_error_naming_the_argument(kwargs, message):
    before = dispatch.selection()
    with pytest.raises(ValueError) as e:
        dispatch.configure(**kwargs)
    assert str(e.value).startswith(message) and type(e.value) is ValueError
    assert "DEEPINFER_OPS_" not in str(e.value).split(":")[0]  # the argument, not a variable
    assert dispatch.selection() is before


def test_configure_takes_a_selection_not_a_backend_name():
    with pytest.raises(ValueError, match=r"^configure\(selection=\.\.\.\) must be a Selection, got 'triton'; to pick "
                                         r"a backend by name: configure\(backend='triton'\)"):
        dispatch.configure("triton")


def test_errors_name_what_set_each_field():
    """A field read from the environment is named by its variable, one set by configure() by its argument."""
    dispatch.configure(Selection.from_env({"DEEPINFER_OPS_FALLBACK": "rmsnorm"}))
    with pytest.raises(ValueError, match=r"^configure\(strict=\.\.\.\) forbids DEEPINFER_OPS_FALLBACK: "):
        dispatch.configure(strict=True)
    dispatch.configure(fallback=["rmsnorm"])
    with pytest.raises(ValueError, match=r"^configure\(strict=\.\.\.\) forbids configure\(fallback=\.\.\.\): "):
        dispatch.configure(strict=True)


# --- the environment, read at import ---------------------------------------------------------------


def test_environment_is_read_at_import():
    r = _run("import torch_kernels", {"DEEPINFER_OPS_BACKEND": "tilelang"})  # hidden: not installed
    assert r.returncode == 0
    assert r.stderr.strip().splitlines() == [
        f"[deepinfer] backend 'tilelang' is not installed (pip install tilelang): all {len(registry.OPS)} ops "
        "from the platform default"]
    for env, message in (ENV_ERRORS[0], ENV_ERRORS[1], ENV_ERRORS[3]):  # the import raises what configure does
        r = _run("import torch_kernels", env)
        assert r.returncode != 0 and f"ValueError: {message}" in r.stderr, (env, r.stderr)


def test_selection_from_env_parses_every_variable():
    s = Selection.from_env({"DEEPINFER_OPS_BACKEND": " Triton ", "DEEPINFER_OPS_FALLBACK": "rmsnorm, gemma_rmsnorm,",
                            "DEEPINFER_OPS_STRICT": "0", "DEEPINFER_OPS_VERBOSE": "1",
                            "DEEPINFER_TRACE_KERNELS": "/tmp/t", "DEEPINFER_TRACE_KERNEL_ARGS": "yes"})
    assert s == Selection(Backend.TRITON, frozenset({"rmsnorm", "gemma_rmsnorm"}), False, True, "/tmp/t", True)
    assert Selection.from_env({}) == Selection()
    for word, asked in (("1", True), (" On ", True), ("0", False), ("off", False), ("", None)):
        assert Selection.from_env({"DEEPINFER_OPS_CHECK_INDICES": word}).check_indices is asked


# --- tracing --------------------------------------------------------------------------------------


def test_trace_first_use_of_each_op_and_backend(cuda_platform, tmp_path):
    trace = tmp_path / "trace.txt"
    dispatch.configure(trace_path=str(trace))
    for _ in range(3):
        dispatch.slot("rmsnorm").call(*_args())
    dispatch.slot("gemma_rmsnorm").call(*_args())
    assert trace.read_text().splitlines() == ["rmsnorm|triton", "gemma_rmsnorm|triton"]


def test_trace_kernel_args_gives_the_signature_never_data(cuda_platform, tmp_path):
    trace = tmp_path / "trace.txt"
    dispatch.configure(trace_path=str(trace), trace_args=True)
    x = torch.full((4, 160), 123.25, device=DEV)[:, :96]
    dispatch.slot("rmsnorm").call(x, torch.randn(96, dtype=torch.float32, device=DEV), 1e-5)
    dev = str(x.device)
    assert trace.read_text().splitlines() == [
        f"rmsnorm|triton|args=(float32[4, 96]@{dev}stride=[160, 1], float32[96]@{dev}, 1e-05)"]
    assert "123.25" not in trace.read_text()


def test_trace_the_reference_on_cpu(tmp_path):
    trace = tmp_path / "trace.txt"
    dispatch.configure(trace_path=str(trace))
    x, w = torch.randn(3, 96), torch.randn(96)
    for _ in range(3):
        torch.ops.deepinfer.rmsnorm(x, w, 1e-6)
    torch.ops.deepinfer.gemma_rmsnorm(x, w, 1e-6)
    assert trace.read_text().splitlines() == ["rmsnorm|torch", "gemma_rmsnorm|torch"]
    dispatch.configure(trace_path=str(trace), trace_args=True)  # a new selection traces anew
    trace.unlink()
    torch.ops.deepinfer.rmsnorm(x[:, :64], w[:64], 1e-5)
    assert trace.read_text().splitlines() == ["rmsnorm|torch|args=(float32[3, 64]@cpustride=[96, 1], float32[64]@cpu, 1e-05)"]


def test_trace_the_reference_on_cpu_from_the_environment(tmp_path):
    trace = tmp_path / "trace.txt"
    r = _run("""
        import torch, torch_kernels
        x, w = torch.randn(2, 8), torch.randn(8)
        for _ in range(3):
            torch_kernels.rmsnorm(x, w, 1e-5)
        torch_kernels.silu_and_mul(torch.randn(2, 8, dtype=torch.float64))
    """, {"DEEPINFER_TRACE_KERNELS": str(trace), "DEEPINFER_TRACE_KERNEL_ARGS": "1"})
    assert r.returncode == 0 and r.stderr == "", r.stderr
    assert trace.read_text().splitlines() == ["rmsnorm|torch|args=(float32[2, 8]@cpu, float32[8]@cpu, 1e-05)",
                                              "silu_and_mul|torch|args=(float64[2, 8]@cpu)"]


def test_trace_off_leaves_the_reference_itself_on_the_hot_path(tmp_path):
    ref = dispatch.reference_slot("rmsnorm", None)  # the registered slot (created at import)
    assert ref.call is ref.fn is registry.BY_OP["rmsnorm"][Backend.TORCH].load()
    dispatch.configure(trace_path=str(tmp_path / "trace.txt"))
    assert ref.call is not ref.fn
    dispatch.configure(trace_path=None)
    assert ref.call is ref.fn


def test_trace_the_first_use_on_each_device_type(cuda_platform, tmp_path):
    """The CUDA key's backends and the reference on other devices trace apart; 8 threads, one line each."""
    trace = tmp_path / "trace.txt"
    dispatch.configure(trace_path=str(trace))
    x, w = torch.randn(3, 96), torch.randn(96)
    _together(8, lambda i: torch.ops.deepinfer.rmsnorm(x, w, 1e-6))
    assert trace.read_text().splitlines() == ["rmsnorm|torch"]
    dispatch.slot("rmsnorm").call(x.double(), w.double(), 1e-6)  # the CUDA key's fallback: traced apart
    assert trace.read_text().splitlines() == ["rmsnorm|torch", "rmsnorm|torch"]


def test_trace_the_reference_on_any_other_device(tmp_path):
    """A device CI has not (an ``mps`` tensor stand-in): its first use is traced as CPU's is."""
    trace = tmp_path / "trace.txt"
    dispatch.configure(trace_path=str(trace))
    ref = dispatch.ReferenceSlot("rmsnorm", lambda *args: "served")
    ref.reset()
    mps = types.SimpleNamespace(is_cpu=False, device=torch.device("mps"))
    for a in (mps, torch.randn(2), mps, torch.randn(2)):
        assert ref.call(a) == "served"
    assert trace.read_text().splitlines() == ["rmsnorm|torch", "rmsnorm|torch"] and ref.seen == {"mps", "cpu"}


@pytest.mark.gpu
def test_trace_cuda_and_cpu_first_uses_on_the_gpu_host(tmp_path):
    trace = tmp_path / "trace.txt"
    dispatch.configure(trace_path=str(trace))
    backend = dispatch.plan("rmsnorm")[0][0].backend.value
    for device in ("cuda", "cpu", "cuda", "cpu"):
        x, w = torch.randn(3, 96, device=device), torch.randn(96, device=device)
        assert_close(torch.ops.deepinfer.rmsnorm(x, w, 1e-6), _expected(x, w, 1e-6))
    assert trace.read_text().splitlines() == [f"rmsnorm|{backend}", "rmsnorm|torch"]


def _fifo(tmp_path):
    path = tmp_path / "fifo"
    os.mkfifo(path)
    return path


@pytest.mark.parametrize("path, why", [
    (lambda t: t / "missing" / "trace.txt", "No such file or directory"),
    (lambda t: t, "Is a directory"),
    (lambda t: "/dev/full", "No space left on device"),  # unwritable for root too
    (_fifo, "No such device or address (a FIFO with no reader)"),  # no hang either
], ids=["missing-directory", "directory", "unwritable", "fifo"])
def test_unusable_trace_path_gives_one_notice_never_an_exception(path, why, cuda_platform, tmp_path, capfd):
    path = str(path(tmp_path))
    dispatch.configure(trace_path=path)
    capfd.readouterr()
    x, w = torch.randn(3, 96), torch.randn(96)
    for _ in range(3):
        assert_close(torch.ops.deepinfer.rmsnorm(x, w, 1e-6), _expected(x, w, 1e-6))
        assert_close(torch.ops.deepinfer.gemma_rmsnorm(x, w, 1e-6), torch.ops.deepinfer.gemma_rmsnorm(x, w, 1e-6))
        dispatch.slot("rmsnorm").call(x, w, 1e-6)  # the CUDA key's backend, too
    assert dispatch.append_line(path, "more") is False  # not tried again
    assert capfd.readouterr().err.splitlines() == [
        f"[deepinfer] configure(trace_path=...): cannot append to {path!r} ({why}); nothing more is traced there"]


def test_unusable_trace_path_from_the_environment(tmp_path):
    path = str(tmp_path / "missing" / "trace.txt")
    r = _run("""
        import torch, torch_kernels
        x, w = torch.randn(2, 8), torch.randn(8)
        for op in (torch_kernels.rmsnorm, torch_kernels.gemma_rmsnorm, torch_kernels.rmsnorm):
            op(x, w, 1e-6)
        print("ok")
    """, {"DEEPINFER_TRACE_KERNELS": path})
    assert r.returncode == 0 and r.stdout == "ok\n", r.stderr
    assert r.stderr.splitlines() == [
        f"[deepinfer] DEEPINFER_TRACE_KERNELS: cannot append to {path!r} (No such file or directory); nothing more is "
        "traced there"]


def test_trace_path_fixed_is_used_after_configure(tmp_path, capfd):
    path = tmp_path / "later" / "trace.txt"
    dispatch.configure(trace_path=str(path))
    torch.ops.deepinfer.rmsnorm(torch.randn(2, 8), torch.randn(8), 1e-6)
    assert "cannot append" in capfd.readouterr().err
    path.parent.mkdir()
    dispatch.configure(trace_path=str(path))
    torch.ops.deepinfer.rmsnorm(torch.randn(2, 8), torch.randn(8), 1e-6)
    assert path.read_text().splitlines() == ["rmsnorm|torch"] and capfd.readouterr().err == ""


def test_configure_pushes_verbosity_and_the_trace_down_to_the_kernel_compilers(tmp_path, capfd):
    """TileLang's and FlashInfer's loaders, which may not import dispatch, read both from ``reporting``."""
    path = tmp_path / "trace.txt"
    dispatch.configure(verbose=True, trace_path=str(path))
    assert reporting.verbose()
    reporting.trace("tilelang-compile|rmsnorm|8192|2.500s")
    assert path.read_text() == "tilelang-compile|rmsnorm|8192|2.500s\n"
    dispatch.configure(verbose=False, trace_path=None)
    assert not reporting.verbose()
    reporting.trace("tilelang-compile|rmsnorm|4096|2.500s")  # no trace file now: dropped
    assert path.read_text() == "tilelang-compile|rmsnorm|8192|2.500s\n"
    dispatch.configure(trace_path=str(tmp_path / "missing" / "trace.txt"))
    reporting.trace("tilelang-compile|rmsnorm|8192|2.500s")  # never raises: one notice, as for op traces
    assert "cannot append" in capfd.readouterr().err


def test_a_new_selection_notifies_the_layers_above(monkeypatch, cuda_platform):
    """configure and set_platform call back what registered (the C++ entry's clear), after resetting
    every slot; dispatch imports none of them."""
    from torch_kernels import fast_path
    from torch_kernels.dispatch import slots  # the list lives where _reset reads it

    assert fast_path.clear in slots._on_new_selection
    seen = []
    monkeypatch.setattr(slots, "_on_new_selection", [])
    dispatch.on_new_selection(lambda: seen.append(dispatch.slot("rmsnorm").impls))
    dispatch.slot("rmsnorm").call(*_args())
    dispatch.configure(backend="triton")
    dispatch.set_platform(None)
    assert seen == [[], []]


def _append_many(path, rank, n, width):
    for i in range(n):
        dispatch.append_line(path, f"rank{rank}:{i}:" + chr(ord("a") + rank) * width)


def test_trace_lines_from_many_processes_never_interleave(tmp_path):
    path, ranks, n, width = str(tmp_path / "trace.txt"), 4, 200, 20000  # lines far over PIPE_BUF
    ctx = multiprocessing.get_context("spawn")
    procs = [ctx.Process(target=_append_many, args=(path, r, n, width)) for r in range(ranks)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(120)
        assert p.exitcode == 0
    lines = open(path).read().splitlines()
    assert len(lines) == ranks * n
    for line in lines:
        head, _, body = line.rpartition(":")
        rank = int(head.split(":")[0][4:])
        assert body == chr(ord("a") + rank) * width, f"interleaved line starting {line[:40]!r}"


# --- lazy loading from many threads ---------------------------------------------------------------


@pytest.mark.parametrize("device", DEVICES)
def test_first_calls_from_many_threads_select_and_load_once(device, monkeypatch):
    # Triton's interpreter is not thread-safe (it patches triton.language while it runs), so on CPU
    # the threads race through the reference backend; on a GPU through the Triton kernel.
    backend = "triton" if device == "cuda" else "torch"
    dispatch.set_platform(None if device == "cuda" else Platform("cuda", (9, 0), "pretend H200"))
    loads = []
    real = spec._resolve

    def counting(target):
        loads.append(target)
        return real(target)

    monkeypatch.setattr(spec, "_resolve", counting)
    dispatch.configure(backend=backend)  # fresh slots
    n = 8
    results = [None] * n
    inputs = [tuple(a.to(device) if isinstance(a, torch.Tensor) else a for a in _args()) for _ in range(n)]

    def call(i):
        results[i] = dispatch.slot("rmsnorm").call(*inputs[i])

    _together(n, call)
    assert loads.count(registry.BY_OP["rmsnorm"][Backend(backend)].target) == 1
    for i in range(n):
        assert_close(results[i], _expected(*inputs[i]))


def _together(n, fn):
    """Run ``fn(i)`` in ``n`` threads released at once by a barrier; re-raise the first error."""
    barrier, errors = threading.Barrier(n), []

    def worker(i):
        try:
            barrier.wait()
            fn(i)
        except Exception as e:  # re-raised below
            errors.append(e)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]


@pytest.mark.parametrize("case", ["lacking", "refused"])
def test_first_use_notice_printed_once_when_eight_threads_call_together(case, capfd):
    # on CPU tensors the reference serves both cases (Triton's interpreter is not thread-safe)
    if case == "lacking":  # the selected backend cannot run here: its first use names the stand-in
        dispatch.set_platform(Platform("cuda", (6, 0), "old GPU"))
        dispatch.configure(backend="triton")
        args, notice = _args(), "[deepinfer] op 'rmsnorm' used from 'torch': 'triton' cannot run here"
    else:  # the platform default's first backend refuses fp64: its first fallback says so
        dispatch.set_platform(Platform("cuda", (9, 0), "pretend H200"))
        dispatch.configure(backend=None)
        args = tuple(a.double() if isinstance(a, torch.Tensor) else a for a in _args())
        notice = "[deepinfer] op 'rmsnorm' served by 'torch': 'triton' refuses the call"
    for _ in range(5):  # fresh slots each round: every round races on the first use
        dispatch.configure(dispatch.selection())
        capfd.readouterr()
        _together(8, lambda i: assert_close(dispatch.slot("rmsnorm").call(*args), _expected(*args)))
        err = capfd.readouterr().err.splitlines()
        assert [line.startswith(notice) for line in err] == [True], err


# --- the inventory ----------------------------------------------------------------------------------


def test_two_implementations_of_one_op_in_a_backend_raise():
    dup = KernelSpec("rmsnorm", Backend.TRITON, "somewhere.else:rmsnorm")
    with pytest.raises(RuntimeError, match="backend 'triton' implements op 'rmsnorm' twice"):
        registry.validate([*registry.KERNELS, dup])


def test_op_without_reference_raises():
    with pytest.raises(RuntimeError, match="op 'new_op' has no torch reference"):
        registry.validate([*registry.KERNELS, KernelSpec("new_op", Backend.TRITON, "m:new_op")])


def test_kernel_spec_target_must_be_module_attr():
    with pytest.raises(ValueError, match="target must be 'module:attr'"):
        KernelSpec("rmsnorm", Backend.TRITON, "no_colon")


def test_every_spec_loads_its_target_or_names_its_missing_package():
    for k in registry.KERNELS:
        if k.capability.missing_package() is None:
            assert callable(k.load()), k


def test_inventory_imports_and_lists_without_torch():
    """spec and registry are stdlib only: import them with torch (and every framework) blocked."""
    r = subprocess.run([sys.executable, "-c", TORCH_BLOCKED_PRELUDE + textwrap.dedent("""
        from torch_kernels import spec, registry
        print(spec.Platform.detect())
        for k in registry.KERNELS:
            print(k.op, k.backend.value, k.target)
        assert "torch" not in sys.modules
    """)], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    assert lines[0] == "cpu"
    assert "rmsnorm torch torch_kernels.families.norm.reference:rmsnorm" in lines
    assert len(lines) == 1 + len(registry.KERNELS)
