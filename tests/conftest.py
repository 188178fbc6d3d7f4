"""Shared test setup.

* Without a GPU, Triton kernels run on CPU tensors in Triton's interpreter: ``TRITON_INTERPRET``
  must be set before Triton is first imported, so it is set here.
* ``@pytest.mark.gpu`` tests need CUDA; they are skipped (reported as skipped) on machines
  without it; ``python -m pytest -m gpu`` runs them on a machine with one.
* A :class:`~torch_kernels.KernelUnavailableError` raised by a test (the selected backend lacks an
  op under ``DEEPINFER_OPS_STRICT``) turns into a skip that names the op, as in the DeepInfer
  dispatcher: a partial port reports what it lacks instead of failing.
* Each test draws its random inputs from a seed of its own, fixed by its name so that a failure
  reproduces; ``DEEPINFER_TEST_SEED=k`` draws another set of inputs for every test.
"""

import math
import os
import zlib

import torch

HAS_CUDA = torch.cuda.is_available()
if not HAS_CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

import torch_kernels  # noqa: E402
from torch_kernels import dispatch  # noqa: E402

DEVICES = [pytest.param("cpu", id="cpu"),
           pytest.param("cuda", id="cuda", marks=pytest.mark.gpu)]


def pytest_collection_modifyitems(config, items):
    _keep_shard(config, items)
    if HAS_CUDA:
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (python -m pytest -m gpu on a machine with one)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


def _keep_shard(config, items):
    """``DEEPINFER_TEST_SHARD=i/n`` keeps one n-th of the tests, whole test functions at a time (the
    parametrisations of one function share TileLang specialisations, which cost ~3 s of nvcc each
    on an H200's host); ``i/n/item`` shares out single tests, for a few heavy functions.
    ``benchmarks/gpu_parallel_tests.sh`` runs the shards side by side."""
    shard = os.environ.get("DEEPINFER_TEST_SHARD")
    if not shard:
        return
    i, n, *by = shard.split("/")
    keep, drop = [], []
    for item in items:
        name = item.nodeid if by == ["item"] else item.nodeid.split("[")[0]
        (keep if zlib.crc32(name.encode()) % int(n) == int(i) else drop).append(item)
    items[:] = keep
    config.hook.pytest_deselected(items=drop)


@pytest.fixture(autouse=True)
def _seed_per_test(request):
    offset = int(os.environ.get("DEEPINFER_TEST_SEED", "0"))
    torch.manual_seed(zlib.crc32(request.node.nodeid.encode()) + offset)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item):
    try:
        return (yield)
    except torch_kernels.KernelUnavailableError as e:
        if torch.cuda.is_available():  # with a GPU every kernel is expected: a failure, not a skip
            raise
        pytest.skip(f"kernel unavailable: {e}")


@pytest.fixture
def triton_world(monkeypatch):
    """The inventory filtered to the reference and Triton: TileLang and FlashInfer implement nothing.
    Their kernels cannot run on the CPU tensors of CI, and a backend that lacks every op is what the
    selection rules (lacking, fallback, strict) need."""
    from torch_kernels import registry
    from torch_kernels.spec import Backend

    monkeypatch.setattr(registry, "BY_OP", {op: {b: k for b, k in per_op.items() if b in (Backend.TORCH, Backend.TRITON)}
                                            for op, per_op in registry.BY_OP.items()})


def family_ops(family, backend=None):
    """The ops ``family`` defines (``torch_kernels/families/<family>/ops.py``), in definition order; with
    ``backend``, those of them it implements. Tests parametrize by this, so a new op is picked up."""
    import importlib

    from torch_kernels import registry

    names = [d.name for d in importlib.import_module(f"torch_kernels.families.{family}.ops").OPS]
    return names if backend is None else [op for op in names if op in registry.ops_of(backend)]


def arg_names(op):
    """The argument names of ``op``'s schema, in order."""
    return [a.name for a in getattr(torch.ops.deepinfer, op).default._schema.arguments]


def implementations_on(op, device):
    """(name, callable): the registered op, then every implementation of ``op`` that runs on
    ``device`` here (Triton on CPU tensors only in its interpreter). A call an implementation refuses
    goes to the reference, as in the dispatcher (``testing.as_dispatched``); the refusal rules have
    their own tests per backend."""
    from torch_kernels import registry
    from torch_kernels.spec import Backend
    from torch_kernels.testing import as_dispatched

    out = [("registered", getattr(torch.ops.deepinfer, op).default)]
    for spec in registry.implementations(op):
        if spec.backend is Backend.TORCH:
            out.append(("torch", spec.load()))
        elif device == "cuda" and spec.is_available(torch_kernels.Platform.detect()):
            out.append((spec.backend.value, as_dispatched(spec)))
        elif device == "cpu" and spec.backend is Backend.TRITON and os.environ.get("TRITON_INTERPRET") == "1":
            out.append(("triton-interpreted", spec.load()))
    return out


def _same(before, after) -> bool:
    if before.is_floating_point():  # NaN where there was NaN, the same values elsewhere (fp8 via fp64)
        before, after = before.double(), after.double()
        return torch.equal(before.isnan(), after.isnan()) and torch.equal(before.nan_to_num(), after.nan_to_num())
    return torch.equal(before, after)


def assert_bad_inputs_raise(op, cases, call=None):
    """Each ``(what, args, exc, arg)`` case raises ``exc`` with a message that starts
    ``deepinfer::<op>: argument '<arg>' `` and leaves every tensor argument as it was. ``call``
    (default: the registered op) takes the arguments."""
    call = call or getattr(torch.ops.deepinfer, op).default
    for what, args, exc, arg in cases:
        tensors = [a for a in args if isinstance(a, torch.Tensor) and a.device.type != "meta"]
        before = [a.clone() for a in tensors]
        with pytest.raises(exc, match=rf"^deepinfer::{op}: argument '{arg}' "):
            call(*args)
        assert all(_same(b, a) for b, a in zip(before, tensors)), f"{what}: clobbered"


@pytest.fixture(autouse=True)
def _restore_selection():
    """Every test starts from the selection of the environment and the detected platform."""
    saved = dispatch.selection()
    yield
    dispatch.set_platform(None)
    dispatch.configure(saved)


@pytest.fixture
def cuda_platform():
    """Pretend to be an sm_90 CUDA machine, so the CUDA selection resolves as on the H200."""
    dispatch.set_platform(torch_kernels.Platform("cuda", (9, 0), "pretend H200"))
    return dispatch.platform()


def triton_here(family, device):
    """``family``'s Triton module, for a test on ``device`` (CPU tensors: only in Triton's interpreter)."""
    import importlib

    pytest.importorskip("triton")
    if device == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("Triton runs on CPU tensors only in its interpreter (TRITON_INTERPRET=1)")
    return importlib.import_module(f"torch_kernels.families.{family}.triton")


def bits(t):
    """A tensor's bits as integers of its width, so that ``torch.equal`` compares NaN payloads and FP8
    too; integer and bool tensors as they are."""
    if not t.dtype.is_floating_point:
        return t
    return t.view({1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()])


def chi_square_critical(dof: int, z: float = 4.265) -> float:
    """The upper 1e-5 quantile of chi-square(dof), Wilson-Hilferty: a correct sampler fails once in 10^5."""
    return dof * (1 - 2 / (9 * dof) + z * math.sqrt(2 / (9 * dof))) ** 3


def chi_square(counts, expected_probs) -> float:
    """Pearson's statistic of ``counts`` against ``expected_probs`` (every entry positive)."""
    exp = expected_probs * counts.sum()
    return (((counts - exp) ** 2) / exp).sum().item()


#: What a subprocess runs before importing the torch-free modules: importing torch or any kernel
#: framework raises, and ``torch_kernels`` is a bare package (its ``__init__`` registers the ops).
TORCH_BLOCKED_PRELUDE = """\
import sys, types
class Block:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in ("torch", "triton", "tilelang", "flashinfer", "numpy"):
            raise ImportError(f"blocked: {name}")
sys.meta_path.insert(0, Block())
sys.path.insert(0, ".")
pkg = types.ModuleType("torch_kernels"); pkg.__path__ = ["torch_kernels"]; sys.modules["torch_kernels"] = pkg
"""
