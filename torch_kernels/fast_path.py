"""The C++ entry (``csrc/fast_path.cpp``): eager CUDA calls of the ops it serves without Python.

What it is: a small library, built once per machine by ``python -m torch_kernels build`` against the
installed torch and TVM-FFI (TileLang's runtime), that holds the ``CUDA`` and ``Autograd`` kernels of
the ops it serves: those with a TileLang :class:`~torch_kernels.spec.KernelSpec` that has a ``host``
(:data:`SERVED`, read from the manifests). It knows no op and decides nothing:

* :func:`install` registers an op's kernels in C++ from its spec's ``host_call`` (each argument's
  role, the output, the host function's argument order); ``library.py`` puts the op's Python kernels
  on a twin ``deepinfer_py::<op>`` first;
* the first call of each signature (op, dtypes of its tensors, width or shapes, ints, bools and strings,
  device) goes on to the twin, which validates, selects and launches exactly as without the entry;
  when that call was served by the spec that takes every call of its dtypes, and it has a ``host``,
  the selection *publishes* the signature with the compiled host functions its ``host`` returns and
  the layout of the outputs (:func:`offer`);
* a later call with a published signature, plain as its roles ask (rows contiguous and 16-byte
  aligned, tensors passed as they are on their granule, written ones proven apart), is served
  in C++: allocations, torch's current stream handed to TVM-FFI, the host function called through
  TVM-FFI's C ABI (the one the ``host`` published for the call's token count). Every other call
  goes to the Python kernels as before;
* :func:`install_out` does the same for the op's ``out`` overload, into the given tensor when it is
  contiguous, aligned and apart from the arguments; the twin's ``out`` kernel offers what it wrote;
* the ops with a Triton kernel and no host (:data:`RECORDED`) are served by recorded launches: their
  twin runs a signature's first call under :func:`run_recording`, which keeps what the Python kernels
  did when that was only allocating and launching Triton kernels (``launch_record.py``), and the entry
  does it again for later calls of that exact signature (shapes, strides and values included);
* :func:`dispatch.configure <torch_kernels.dispatch.configure>` clears what was published, so a new
  selection is asked again; ``DEEPINFER_OPS_BACKEND=auto`` publishes nothing (it picks per shape).

Why: host µs per eager 1x4096 bf16 norm on the H200, Python kernels over TileLang 14 (inference mode)
and 20 (gradients enabled) against ``F.rms_norm``'s 9.2 and 10 (bench_overhead.py).

Loaded at import when built for this torch, TVM-FFI and source (:func:`library_path`); not built, or
``DEEPINFER_OPS_FAST_PATH=0``: the Python kernels sit on the public ops directly, as before. The build
records the library's size and SHA-256 beside it (``deepinfer_fast_path.so.sha256``, written after the
library is complete); the library is loaded only when its bytes match that record, so a truncated or
foreign file (a mismatch, or no record) is refused with one notice and never opened by the loader (a
truncated library killed the import with SIGBUS), and the Python kernels serve.
"""

from __future__ import annotations

import contextlib
import ctypes
import hashlib
import importlib.metadata
import json
import os
import struct
import subprocess
import sys
from pathlib import Path
from typing import Any, Dict, Iterator, Optional, Tuple

import torch

from . import checks, launch_record, registry
from ._files import open_regular
from .spec import OUTPUT_LAYOUTS, Backend, HostCall, HostKernels, KernelSpec

ENV = "DEEPINFER_OPS_FAST_PATH"
#: the backend whose host functions the entry calls: TVM-FFI functions
BACKEND = Backend.TILELANG
#: the ops the entry serves, each with the spec whose ``host`` it calls
SERVED: Dict[str, KernelSpec] = {k.op: k for k in registry.KERNELS if k.backend is BACKEND and k.host is not None}
#: the ops it serves by recorded launches: those with a Triton kernel and no host function
RECORDED = tuple(op for op, specs in registry.BY_OP.items() if op not in SERVED and Backend.TRITON in specs)
#: signatures a recorded op's twin tries to record, at most (each distinct call that could not be)
_MAX_TRIED = 256
#: the namespace of the twin ops that carry the Python kernels while the library is loaded
TWIN_NAMESPACE = "deepinfer_py"
SOURCE = Path(__file__).resolve().parent / "csrc" / "fast_path.cpp"
_NAME = "deepinfer_fast_path"
_TVM_FFI = "apache-tvm-ffi"
_DTYPES = (torch.float16, torch.bfloat16, torch.float32)  # what the entry hands TVM-FFI
_INDEX_DTYPES = _DTYPES + (torch.int32, torch.int64)  # of a t or c tensor (positions)
_BUILT_BY = "torch_kernels"
_MAX_LIBRARY_BYTES = 256 << 20  # ours is 164 KB; hashing it costs 0.1 ms at import (5 MB: 4 ms)
_MAX_RECORD_BYTES = 4096

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


def digest_path(path: Path) -> Path:
    """The record of the library's size and SHA-256, beside it."""
    return path.with_name(path.name + ".sha256")


class Refused(Exception):
    """Why a file at the library's place is not loaded."""


def _open_regular(path: Path, limit: int) -> int:
    try:
        return open_regular(path, limit)
    except ValueError as e:
        raise Refused(f"{path.name}: {e}") from None


def _sha256(fd: int) -> str:
    h = hashlib.sha256()
    while True:
        chunk = os.read(fd, 1 << 20)
        if not chunk:
            return h.hexdigest()
        h.update(chunk)


def _record(path: Path) -> dict:
    if not os.path.lexists(digest_path(path)):
        raise Refused(f"no digest recorded beside it ({digest_path(path).name})")
    fd = _open_regular(digest_path(path), _MAX_RECORD_BYTES)
    with os.fdopen(fd, "rb") as f:
        text = f.read(_MAX_RECORD_BYTES + 1)
    try:
        record = json.loads(text.decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError):
        raise Refused(f"{digest_path(path).name} is not a digest record") from None
    if not (isinstance(record, dict) and isinstance(record.get("sha256"), str) and type(record.get("size")) is int):
        raise Refused(f"{digest_path(path).name} is not a digest record")
    if record.get("built_by") != _BUILT_BY or record.get("build") != path.parent.name:
        raise Refused(f"not built by {_BUILT_BY} for this torch, TVM-FFI and source")
    return record


def _verified(path: Path) -> int:
    """A descriptor of the library whose bytes match its digest record, read through that descriptor;
    :class:`Refused` says why not. Nothing here maps or loads the file."""
    record = _record(path)
    fd = _open_regular(path, _MAX_LIBRARY_BYTES)
    try:
        size = os.fstat(fd).st_size
        if size != record["size"]:
            raise Refused(f"{size} bytes where {record['size']} were built: truncated or replaced")
        if _sha256(fd) != record["sha256"]:
            raise Refused("its SHA-256 differs from the one recorded at build: damaged or replaced")
    except BaseException:
        os.close(fd)
        raise
    return fd


def _dlopen(fd: int, path: Path) -> None:
    """Load the library through the descriptor that was verified (on Linux), so that a file renamed into
    its place since is not the one loaded; as ``torch.ops.load_library`` does otherwise."""
    here = f"/proc/self/fd/{fd}"
    ctypes.CDLL(here if os.path.exists(here) else str(path))
    torch.ops.loaded_libraries.add(str(path))


def load() -> bool:
    """Load the built library (``library.py``, at import, before it registers the ops). False when it
    is switched off, not built, refused (its bytes do not match the digest recorded at build) or fails
    to load; :func:`status` says which, and a refusal or failure prints one notice."""
    if os.environ.get(ENV, "1").strip().lower() in ("0", "false", "no", "off"):
        _state["status"] = f"off ({ENV}=0)"
        return False
    path = library_path()
    if path is None or not os.path.lexists(path):
        _state["status"] = "not built (python -m torch_kernels build)" if path else f"unavailable: {_TVM_FFI} is not installed"
        return False
    try:
        fd = _verified(path)
    except Refused as e:
        _state["status"] = f"refused {path}: {e}"
        print(f"[deepinfer] the C++ entry {_state['status']}; not loaded, the Python kernels serve "
              "(python -m torch_kernels build builds it again)", file=sys.stderr, flush=True)
        return False
    try:
        _dlopen(fd, path)
    except (OSError, RuntimeError) as e:
        _state["status"] = f"failed to load {path}: {e}"
        print(f"[deepinfer] the C++ entry {_state['status']}; the Python kernels serve", file=sys.stderr, flush=True)
        return False
    finally:
        os.close(fd)
    _state["status"] = f"loaded ({path})"
    return True


def loaded() -> bool:
    return _state["status"].startswith("loaded")


def status() -> str:
    return _state["status"]


def _is_sound(path: Path) -> bool:
    try:
        os.close(_verified(path))
        return True
    except Refused:
        return False


@contextlib.contextmanager
def _building(folder: Path) -> Iterator[None]:
    """Hold the build folder's lock: one process builds, the others then find its library."""
    import fcntl

    fd = os.open(folder, os.O_RDONLY | os.O_CLOEXEC)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


def _replace(staging: Path, path: Path, data: Optional[bytes] = None) -> None:
    """Write ``data`` to ``staging`` (if given), flush it to disk, and rename it to ``path``."""
    if data is not None:
        staging.write_bytes(data)
    fd = os.open(staging, os.O_RDONLY | os.O_CLOEXEC)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
    os.replace(staging, path)


def build(verbose: bool = False) -> Path:
    """Compile the library for this torch and TVM-FFI with the C++ compiler (``$CXX``, else ``c++``):
    about 20 s on 2 cores; nothing to do when built and its bytes match its digest record. One compiler
    call, no ninja; written beside its final name and renamed into place, then its digest record beside
    it the same way, under the folder's lock, so that processes building at once leave one sound pair
    and a process loading meanwhile finds a complete library or refuses it."""
    path = library_path()
    if path is None:
        raise RuntimeError(f"the C++ entry calls TileLang's kernels through TVM-FFI: install {_TVM_FFI} (TileLang brings it)")
    path.parent.mkdir(parents=True, exist_ok=True)
    with _building(path.parent):
        if not _is_sound(path):
            _compile(path, verbose)
    return path


def _compile(path: Path, verbose: bool) -> None:
    import tvm_ffi.libinfo as ffi_info
    from torch.utils import cpp_extension

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
    with open(staging, "rb") as f:
        record = {"built_by": _BUILT_BY, "build": path.parent.name, "size": os.fstat(f.fileno()).st_size,
                  "sha256": _sha256(f.fileno())}
    _replace(staging, path)
    record_staging = digest_path(path).with_name(f".{digest_path(path).name}.{os.getpid()}")
    _replace(record_staging, digest_path(path), json.dumps(record).encode())


def serves(op: str) -> bool:
    """Whether the loaded entry serves ``op``: ``library.py`` then puts its Python kernels on the twin."""
    return loaded() and (op in SERVED or op in RECORDED)


def records(op: str) -> bool:
    """Whether the entry serves ``op`` by recorded launches: its twin's CUDA kernel then runs the Python
    kernels through :func:`run_recording`."""
    return loaded() and op in RECORDED


def install(op: str) -> None:
    """Register ``op``'s CUDA and Autograd kernels in C++ (after ``deepinfer::<op>`` and its twin are defined)."""
    if op in RECORDED:
        torch.ops.deepinfer_fast_path.install_recorded(op, "")
        return
    call = SERVED[op].host_call
    torch.ops.deepinfer_fast_path.install(op, call.roles, call.output, list(call.order))


def serves_out(op: str) -> bool:
    """Whether the loaded entry serves ``op``'s ``out`` overload: an op of one output (an op whose
    outputs each signature lays out keeps its ``out`` overload in Python), or a recorded op."""
    return serves(op) and (op in RECORDED or SERVED[op].host_call.output in ("r", "h"))


def install_out(op: str) -> None:
    """Register the CUDA and Autograd kernels of ``op``'s ``out`` overload in C++ (after :func:`install`,
    and after ``deepinfer::<op>.out`` and its twin are defined): served by the signatures published for
    the op, its output the given tensor (a recorded op: by the signatures recorded for the overload)."""
    if op in RECORDED:
        torch.ops.deepinfer_fast_path.install_recorded(op, "out")
        return
    torch.ops.deepinfer_fast_path.install_out(op)


_tried: Dict[str, set] = {}
_unreplayable: Dict[str, str] = {}  # per op overload, the last reason a call of it was not recorded
_refused: Dict[str, str] = {}
_held: set = set()  # the Triton kernels recordings launch: their CUfunctions live as long as they do


def run_recording(name: str, entry, server, args: tuple, outs: dict):
    """The twin's CUDA kernel of a recorded op (``name``: ``op`` or ``op.out``): ``entry(*args, **outs)``,
    the Python kernels, recorded when the entry passed this call on with a signature it may record (not
    yet tried), and published when the call turns out replayable (``launch_record``), was served by a
    Triton kernel that serves every call of its signature (``server()``) and ran no index check."""
    key = torch.ops.deepinfer_fast_path.pending(name)
    tried = _tried.setdefault(name, set())
    if key is None or tuple(key) in tried or len(tried) >= _MAX_TRIED or launch_record.recording():
        return entry(*args, **outs)  # (inside a recording: part of that call, which is then not replayable)
    devices = [a.device for a in (*args, *outs.values()) if isinstance(a, torch.Tensor) and a.is_cuda]
    if not devices:
        return entry(*args, **outs)
    tried.add(tuple(key))
    schema = getattr(torch.ops.deepinfer, name.split(".")[0]).out._schema if outs else None
    n = len(schema.arguments) - len(outs) if outs else 0
    tensors = {i: a for i, a in enumerate(args) if isinstance(a, torch.Tensor)}
    tensors.update({n + j: outs[a.name] for j, a in enumerate(schema.arguments[n:])} if outs else {})
    device = devices[0]
    checks_before = checks.index_checks_run()
    result, recorded = launch_record.record(lambda: entry(*args, **outs), tensors, device)
    spec = server()
    if isinstance(recorded, launch_record.NotReplayable):
        _unreplayable[name] = str(recorded)
    elif spec is None or spec.backend is not Backend.TRITON or checks.index_checks_run() != checks_before:
        _unreplayable[name] = "not served by a Triton kernel for every call of its signature, or it checked its indices"
    else:
        try:
            torch.ops.deepinfer_fast_path.record(name, device.index, key, recorded.allocations,
                                                 recorded.allocation_dtypes or None, recorded.returns,
                                                 recorded.launches, recorded.slots, recorded.patches)
            _held.update(recorded.kernels)
        except RuntimeError as e:  # the driver disagrees with the recorded parameters: say so once, stay in Python
            if name not in _refused:
                print(f"[deepinfer] the C++ entry refused a recording of {name}; its Python kernels serve it: {e}",
                      file=sys.stderr, flush=True)
            _refused[name] = _unreplayable[name] = str(e)
    return result


def not_recorded() -> Dict[str, str]:
    """Per recorded op overload, why its last call that was tried was not recorded."""
    return dict(_unreplayable)


def offer(op: str, spec: Optional[KernelSpec], args: tuple) -> None:
    """After the Python kernels served ``op(*args)`` with ``spec``, the implementation that takes every
    call of this dtype (``dispatch.OpSlot.sole_server``): publish the call's signature when ``spec`` has
    a ``host`` the entry calls and the host returns kernels for it. ``args`` are as the twin's Python
    kernel receives them: trailing arguments left at their defaults (``eps``) are not there."""
    if not loaded() or spec is None or spec.host is None or spec.backend is not BACKEND:
        return
    call = spec.host_call
    if any(args[i] is None for i in call.tensors):  # an optional tensor left out: the entry passes such calls on
        return
    x = args[call.data]
    dtypes = tuple(args[i].dtype for i in call.tensors)
    if not all(d in (_INDEX_DTYPES if call.roles[i] in "tc" else _DTYPES) for i, d in zip(call.tensors, dtypes)):
        return
    facts = _facts(op, call, args)
    hidden = x.shape[-1] if call.roles[call.data] == "r" else 0
    key = (op, dtypes, hidden, x.device.index, facts)
    if key in _published or facts is None:
        return
    published = spec.load_host()(*args)  # once a signature, unless the host declines the call
    if not isinstance(published, HostKernels):
        published = HostKernels(published)
    if not published.kernels:
        return
    outputs = published.outputs  # passed only when there are some: an empty list reaches C++ as int[]
    laid_out = ([dtype for _, dtype, _ in outputs], [v for layout, _, width in outputs
                                                     for v in (OUTPUT_LAYOUTS.index(layout), width)]) if outputs else ()
    _publish(op, dtypes, hidden, x.device.index, [start for start, _ in published.kernels],
             [fn.__chandle__() for _, fn in published.kernels], list(facts), list(published.granules) or [0] * len(call.roles),
             *laid_out, **({"max_tokens": published.max_tokens} if published.max_tokens else {}))
    _published.add(key)


def _facts(op: str, call: HostCall, args: tuple) -> Optional[Tuple[int, ...]]:
    """The call's signature beyond its dtypes and width, as the entry reads it from a call (``csrc``'s
    ``serve``): per ``t`` tensor its dimensions and its second and third sizes (0 where it has fewer
    dimensions), per ``c`` tensor its two sizes, per int and bool its value, per string its number in
    the entry (``intern``), per optional scalar whether it is given, per float in the signature its bits;
    ``None`` for a call the entry never serves (a tensor of more dimensions)."""
    out = []
    for i, role in enumerate(call.roles):
        if role in "ibs":
            value = args[i] if i < len(args) else _default(op, i)
            out.append(_intern(value) if role == "s" else int(value))
        elif role == "o":
            out.append(int(i < len(args) and args[i] is not None))
        elif role == "e":
            value = float(args[i] if i < len(args) else _default(op, i))
            out.append(struct.unpack("<q", struct.pack("<d", value))[0])
        elif role in "tc":
            t = args[i]
            if t.dim() not in ((1, 2, 3) if role == "t" else (2,)):
                return None
            out += [t.dim(), *(t.shape[d] if t.dim() > d else 0 for d in (1, 2))] if role == "t" else list(t.shape)
    return tuple(out)


_interned: Dict[str, int] = {}


def _intern(value: str) -> int:
    found = _interned.get(value)
    if found is None:
        found = _interned[value] = torch.ops.deepinfer_fast_path.intern(value)
    return found


def _default(op: str, i: int):
    return getattr(torch.ops.deepinfer, op).default._schema.arguments[i].default_value


def _publish(op: str, dtypes: tuple, *entry: Any, **limits: int) -> None:
    torch.ops.deepinfer_fast_path.publish(op, list(dtypes), *entry, **limits)


def clear() -> None:
    """Forget every published signature (a new selection)."""
    if loaded():
        torch.ops.deepinfer_fast_path.clear()
        _published.clear()
        _tried.clear()


def counters() -> Dict[str, int]:
    """Signatures published, calls served in C++ and calls passed on to Python since load."""
    if not loaded():
        return {"signatures": 0, "served": 0, "passed_on": 0}
    signatures, served, passed_on = torch.ops.deepinfer_fast_path.counters()
    return {"signatures": signatures, "served": served, "passed_on": passed_on}
