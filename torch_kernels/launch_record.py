"""What a Python kernel did on the device, for the C++ entry to do again (``fast_path.run_recording``).

:func:`record` runs a call with its aten ops watched (a ``TorchDispatchMode``) and its Triton launches
captured (``CompiledKernel.launch_metadata``, which Triton 3.6 and 3.9 (the releases read) call before each launch with the
grid, the stream and the bound arguments). The call is *replayable* when all it did was allocate tensors
on the call's device (``empty``, ``empty_strided``, ``empty_like``, ``new_empty``), take views and launch
Triton kernels on the current stream whose every pointer lies in an argument or an allocation; then
:class:`Recorded` holds what the entry's ``record`` takes: the allocations, the returns (views of
allocations, or arguments), and per launch the CUfunction, its geometry, one slot per kernel parameter
(Triton's launcher passes the non-constexpr arguments in order, then its global and profile scratch
pointers) and the pointer parameters as (slot, source, byte offset). Anything else, including a Triton
launch that needs scratch memory, a cluster or PDL, is not replayable and says why.
"""

from __future__ import annotations

import struct
import threading
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch
from torch.utils._python_dispatch import TorchDispatchMode

_aten = torch.ops.aten
_ALLOCATING = {_aten.empty.memory_format, _aten.empty_strided.default, _aten.empty_like.default,
               _aten.new_empty.default, _aten.new_empty_strided.default}
_METADATA = {_aten.sym_size.int, _aten.sym_stride.int, _aten.sym_numel.default, _aten.sym_storage_offset.default,
             _aten.is_contiguous.default, _aten.is_contiguous.memory_format, _aten.dim.default}
_SLOT_BYTES = {"i1": 1, "i8": 1, "u1": 1, "u8": 1, "i16": 2, "u16": 2, "fp16": 2, "bf16": 2,
               "i32": 4, "u32": 4, "fp32": 4, "f32": 4, "i64": 8, "u64": 8, "fp64": 8}


class NotReplayable(Exception):
    """Why a recorded call cannot be done again from C++."""


@dataclass
class Recorded:
    """A replayable call in the entry's ``record`` arguments."""
    allocations: List[int] = field(default_factory=list)
    allocation_dtypes: List[torch.dtype] = field(default_factory=list)
    returns: List[int] = field(default_factory=list)
    launches: List[int] = field(default_factory=list)
    slots: List[int] = field(default_factory=list)
    patches: List[int] = field(default_factory=list)
    kernels: List[Any] = field(default_factory=list)  # the CompiledKernels, held while the recording is


class _Watch(TorchDispatchMode):
    def __init__(self, device: torch.device):
        super().__init__()
        self.device = device
        self.allocations: List[torch.Tensor] = []
        self.refused: Optional[str] = None

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func in _ALLOCATING:
            if not (isinstance(out, torch.Tensor) and out.device == self.device):
                self.refused = self.refused or f"{func} allocated off the call's device"
            self.allocations.append(out)
        elif not (func.is_view or func in _METADATA):
            self.refused = self.refused or f"it ran {func}"
        return out


_lock = threading.Lock()  # one recording at a time: it patches Triton's class
_on_thread = threading.local()  # .launches: this thread's recording, while it runs
_original: List[Callable] = []


def _capturing_launch_metadata(self, grid, stream, *args):
    launches = getattr(_on_thread, "launches", None)
    if launches is not None:  # another thread's launches meanwhile are not this call's
        launches.append((self, tuple(grid), stream, args))
    return _original[0](self, grid, stream, *args)


def recording() -> bool:
    """Whether this thread is inside :func:`record` (a call it makes is part of the one recorded)."""
    return getattr(_on_thread, "launches", None) is not None


def record(call: Callable[[], Any], tensors: Dict[int, torch.Tensor], device: torch.device) -> Tuple[Any, Any]:
    """Run ``call`` (the Python kernels of one call; ``tensors``: its tensor arguments by schema index) and
    return ``(its result, a Recorded or the NotReplayable saying why not)``."""
    from triton.compiler.compiler import CompiledKernel

    with _lock:
        launches: List[tuple] = []
        _original[:] = [CompiledKernel.launch_metadata]
        CompiledKernel.launch_metadata = _capturing_launch_metadata
        _on_thread.launches = launches
        watch = _Watch(device)
        try:
            with watch:
                result = call()
        finally:
            _on_thread.launches = None
            CompiledKernel.launch_metadata = _original[0]
    try:
        if watch.refused:
            raise NotReplayable(watch.refused)
        stream = torch.cuda.current_stream(device).cuda_stream if device.type == "cuda" else None
        return result, replayable(result, tensors, watch.allocations, launches, stream)
    except NotReplayable as e:
        return result, e


def replayable(result, tensors: Dict[int, torch.Tensor], allocations: List[torch.Tensor], launches: List[tuple],
               stream: Optional[int]) -> Recorded:
    """What :func:`record` saw as the entry's ``record`` takes it: ``result`` the call's, ``launches``
    ``(CompiledKernel, grid, stream, bound arguments)`` each, ``stream`` the current one; raises
    :class:`NotReplayable`."""
    rec = Recorded()
    for a in allocations:
        rec.allocations += [a.dim(), *a.shape, *a.stride()]
        rec.allocation_dtypes.append(a.dtype)
    outs = [] if result is None else list(result) if isinstance(result, (tuple, list)) else [result]
    for t in outs:
        rec.returns += _return_of(t, tensors, allocations)
    if not launches:
        raise NotReplayable("it launched no Triton kernel")
    for kernel, grid, launch_stream, args in launches:
        if launch_stream != stream:
            raise NotReplayable("a launch on another stream than the current one")
        rec.launches += _launch_of(kernel, grid, args, tensors, allocations, rec)
        rec.kernels.append(kernel)
    return rec


def _return_of(t, tensors: Dict[int, torch.Tensor], allocations: List[torch.Tensor]) -> List[int]:
    if not isinstance(t, torch.Tensor):
        raise NotReplayable(f"it returned a {type(t).__name__}")
    for i, a in tensors.items():
        if t is a:
            return [i, 0, 0]
    for k, a in enumerate(allocations):
        if t.untyped_storage().data_ptr() == a.untyped_storage().data_ptr() and t.dtype == a.dtype:
            return [-1 - k, t.dim(), *t.shape, *t.stride(), t.storage_offset() - a.storage_offset()]
    raise NotReplayable("it returned a tensor neither allocated in the call nor an argument")


def _extent(t: torch.Tensor) -> Tuple[int, int]:
    if t.numel() == 0 or any(s < 0 for s in t.stride()):
        return (0, 0)
    last = sum((n - 1) * s for n, s in zip(t.shape, t.stride()))
    return t.data_ptr(), t.data_ptr() + (last + 1) * t.element_size()


def _source(p: int, tensors: Dict[int, torch.Tensor], allocations: List[torch.Tensor]) -> Tuple[int, int]:
    """(source, byte offset) of pointer ``p``: an argument whose data it is (exactly one), else the
    allocation or the one argument whose bytes hold it."""
    exact = [i for i, t in tensors.items() if t.numel() and t.data_ptr() == p]
    if len(exact) == 1:
        return exact[0], 0
    if exact:
        raise NotReplayable("a pointer is the data of several arguments")
    for k, a in enumerate(allocations):
        start = a.untyped_storage().data_ptr()
        if start <= p < start + a.untyped_storage().nbytes():
            return -1 - k, p - a.data_ptr()
    holding = [i for i, (start, end) in ((i, _extent(t)) for i, t in tensors.items()) if start <= p < end]
    if len(holding) != 1:
        raise NotReplayable("a pointer lies in " + ("no argument or allocation" if not holding else "several arguments"))
    return holding[0], p - tensors[holding[0]].data_ptr()


def _slot_value(ty: str, v) -> int:
    if ty in ("fp32", "f32"):
        return struct.unpack("<i", struct.pack("<f", float(v)))[0]
    if ty == "fp64":
        return struct.unpack("<q", struct.pack("<d", float(v)))[0]
    if ty == "fp16":
        return struct.unpack("<h", struct.pack("<e", float(v)))[0]
    if ty == "bf16":
        return int(torch.tensor(float(v), dtype=torch.bfloat16).view(torch.int16))
    v = int(v)
    return v - (1 << 64) if v >= 1 << 63 else v


def _launch_of(kernel, grid: tuple, args: tuple, tensors, allocations, rec: Recorded) -> List[int]:
    kernel._init_handles()
    meta, launcher = kernel.metadata, kernel.run
    if getattr(meta, "num_ctas", 1) != 1 or getattr(meta, "launch_cooperative_grid", False) or getattr(meta, "launch_pdl", False):
        raise NotReplayable(f"{kernel.name} launches with a cluster, cooperatively or with PDL")
    if getattr(meta, "global_scratch_size", 0) or getattr(meta, "profile_scratch_size", 0):
        raise NotReplayable(f"{kernel.name} needs scratch memory")
    values, sizes, patches = [], [], []
    for ty, arg in zip(kernel.src.signature.values(), args):
        if ty == "constexpr":
            continue
        if not isinstance(ty, str) or not (ty.startswith("*") or ty in _SLOT_BYTES):
            raise NotReplayable(f"{kernel.name} takes a {ty}")
        if ty.startswith("*"):
            p = arg.data_ptr() if hasattr(arg, "data_ptr") else int(arg)
            patches += [len(values), *_source(p, tensors, allocations)]
            values.append(0)
            sizes.append(8)
        else:
            values.append(_slot_value(ty, arg))
            sizes.append(_SLOT_BYTES[ty])
    for scratch in ("global_scratch_size", "profile_scratch_size"):  # the launcher's trailing null pointers
        if hasattr(launcher, scratch):
            values.append(0)
            sizes.append(8)
    grid = tuple(int(g) for g in grid) + (1, 1)
    rec.slots += values + sizes
    rec.patches += patches
    return [kernel.function, grid[0], grid[1], grid[2], 32 * meta.num_warps, meta.shared, len(values), len(patches) // 3]
