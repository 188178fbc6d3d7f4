"""The C++ entry of the norm and activation families (``csrc/fast_path.cpp``): eager CUDA calls
without Python.

What it is: a small library, built once per machine by ``python -m torch_kernels build`` against the
installed torch and TVM-FFI (TileLang's runtime), that registers the ``CUDA`` and ``Autograd`` kernels of
the :data:`OPS` in C++. It decides nothing:

* the first call of each signature (op, dtypes, width, device) goes on to the op's Python
  kernels, registered on a twin op ``deepinfer_py::<op>``, which validate, select and launch exactly as
  without it; when that call was served by TileLang, which takes every call of its dtypes, the
  selection *publishes* the signature with TileLang's compiled host functions (:func:`offer`);
* a later call with a published signature, contiguous, 16-byte aligned and otherwise plain, is served
  in C++: allocation, torch's current stream handed to TVM-FFI, the host function called through
  TVM-FFI's C ABI. Every other call goes to the Python kernels as before;
* :func:`dispatch.configure <torch_kernels.dispatch.configure>` clears what was published, so a new
  selection is asked again; ``DEEPINFER_OPS_BACKEND=auto`` publishes nothing (it picks per shape).

Why: host µs per eager ``rmsnorm`` 1x4096 bf16 on the H200, Python kernels over TileLang 14 (inference
mode) and 20 (gradients enabled) against ``F.rms_norm``'s 9.2 and 10 (bench_overhead.py).

Loaded at import when built for this torch, TVM-FFI and source (:func:`library_path`); not built, or
``DEEPINFER_OPS_FAST_PATH=0``: the Python kernels sit on the public ops directly, as before.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import os
import subprocess
import sys
from pathlib import Path
from typing import Any, Dict, Optional

import torch

ENV = "DEEPINFER_OPS_FAST_PATH"
#: the ops whose CUDA and Autograd kernels the library registers (csrc/fast_path.cpp: kNames)
NORM_OPS = ("rmsnorm", "gemma_rmsnorm", "fused_add_rmsnorm", "gemma_fused_add_rmsnorm")
# not gelu_and_mul yet: its ``approximate`` string would be part of the signature
ACTIVATION_OPS = ("silu_and_mul", "gelu_tanh_and_mul")
OPS = NORM_OPS + ACTIVATION_OPS
#: the namespace of the twin ops that carry the Python kernels while the library is loaded
TWIN_NAMESPACE = "deepinfer_py"
SOURCE = Path(__file__).resolve().parent / "csrc" / "fast_path.cpp"
_NAME = "deepinfer_fast_path"
_TVM_FFI = "apache-tvm-ffi"
_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
_NEVER = 1 << 62  # an activation has one kernel: its "streamed" one is never taken

_state = {"status": "not loaded"}
_published: set = set()


def _tvm_ffi_version() -> Optional[str]:
    try:
        return importlib.metadata.version(_TVM_FFI)
    except importlib.metadata.PackageNotFoundError:
        return None


def library_path() -> Optional[Path]:
    """Where the built library lives for this source, torch and TVM-FFI (``None``: TVM-FFI is not
    installed): ``$DEEPINFER_OPS_CACHE_DIR`` or ``~/.cache/torch_kernels``, then one folder per build."""
    ffi = _tvm_ffi_version()
    if ffi is None:
        return None
    tag = hashlib.sha256(b"\0".join([SOURCE.read_bytes(), torch.__version__.encode(), ffi.encode(),
                                     sys.version.encode()])).hexdigest()[:16]
    root = Path(os.environ.get("DEEPINFER_OPS_CACHE_DIR") or Path.home() / ".cache" / "torch_kernels")
    return root / f"fast_path-{tag}" / f"{_NAME}.so"


def load() -> bool:
    """Load the built library (``library.py``, at import, before it registers the ops). False when it
    is switched off, not built, or fails to load; :func:`status` says which."""
    if os.environ.get(ENV, "1").strip().lower() in ("0", "false", "no", "off"):
        _state["status"] = f"off ({ENV}=0)"
        return False
    path = library_path()
    if path is None or not path.is_file():
        _state["status"] = "not built (python -m torch_kernels build)" if path else f"unavailable: {_TVM_FFI} is not installed"
        return False
    try:
        torch.ops.load_library(str(path))
    except (OSError, RuntimeError) as e:
        _state["status"] = f"failed to load {path}: {e}"
        print(f"[deepinfer] the C++ entry {_state['status']}; the Python kernels serve", file=sys.stderr, flush=True)
        return False
    _state["status"] = f"loaded ({path})"
    return True


def loaded() -> bool:
    return _state["status"].startswith("loaded")


def status() -> str:
    return _state["status"]


def build(verbose: bool = False) -> Path:
    """Compile the library for this torch and TVM-FFI with the C++ compiler (``$CXX``, else ``c++``):
    about 20 s on 2 cores; nothing to do when built. One compiler call, no ninja; written beside its
    final name and renamed into place, so that processes building at once leave one sound file."""
    path = library_path()
    if path is None:
        raise RuntimeError(f"the C++ entry calls TileLang's kernels through TVM-FFI: install {_TVM_FFI} (TileLang brings it)")
    if path.is_file():
        return path
    import tvm_ffi.libinfo as ffi_info
    from torch.utils import cpp_extension

    path.parent.mkdir(parents=True, exist_ok=True)
    staging = path.with_name(f".{path.name}.{os.getpid()}")
    command = [os.environ.get("CXX", "c++"), "-shared", "-fPIC", "-O2", "-std=c++20",
               f"-D_GLIBCXX_USE_CXX11_ABI={int(torch._C._GLIBCXX_USE_CXX11_ABI)}",
               *(f"-isystem{p}" for p in cpp_extension.include_paths()),
               f"-I{ffi_info.find_include_path()}", f"-I{ffi_info.find_dlpack_include_path()}",
               str(SOURCE), "-o", str(staging),
               *(f"-L{p}" for p in cpp_extension.library_paths()), "-lc10", "-ltorch_cpu", "-ltorch", "-ldl"]
    if verbose:
        print(" ".join(command), file=sys.stderr)
    done = subprocess.run(command, capture_output=not verbose, text=True)
    if done.returncode != 0:
        staging.unlink(missing_ok=True)
        raise RuntimeError(f"building the C++ entry failed ({command[0]} exit {done.returncode}):\n{done.stderr or ''}")
    os.replace(staging, path)
    return path


def offer(op: str, spec: Any, args: tuple) -> None:
    """After the Python kernels served ``op(*args)`` with ``spec``, the implementation that takes every
    call of this dtype (``dispatch.OpSlot.sole_server``): publish the call's signature when that is
    TileLang's. ``args`` are as the twin's Python kernel receives them: trailing arguments left at their
    defaults (``eps``) are not there."""
    if not loaded() or spec is None or spec.backend.value != "tilelang":
        return
    x = args[0]
    w = x if op in ACTIVATION_OPS else args[2] if "fused" in op else args[1]
    key = (op, x.dtype, w.dtype, x.shape[-1], x.device.index)
    if key in _published or x.dtype not in _DTYPES or w.dtype not in _DTYPES:
        return
    if op in ACTIVATION_OPS:
        from .impl.tilelang import activation

        one_pass = streamed = activation.host_function(x, "silu" if op == "silu_and_mul" else "gelu_tanh")
        streamed_from = _NEVER
    else:
        from .impl.tilelang import norm

        one_pass, streamed, streamed_from = norm.host_functions(x, w, fused="fused" in op, gemma=op.startswith("gemma"))
    _publish(op, x.dtype, w.dtype, x.shape[-1], x.device.index, streamed_from, one_pass.__chandle__(), streamed.__chandle__())
    _published.add(key)


def _publish(*entry: Any) -> None:
    torch.ops.deepinfer_fast_path.publish(*entry)


def clear() -> None:
    """Forget every published signature (a new selection)."""
    if loaded():
        torch.ops.deepinfer_fast_path.clear()
        _published.clear()


def counters() -> Dict[str, int]:
    """Signatures published, calls served in C++ and calls passed on to Python since load."""
    if not loaded():
        return {"signatures": 0, "served": 0, "passed_on": 0}
    signatures, served, passed_on = torch.ops.deepinfer_fast_path.counters()
    return {"signatures": signatures, "served": served, "passed_on": passed_on}
