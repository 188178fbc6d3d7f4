"""Compiling TileLang kernels: the target, an in-process memo, TileLang's disk cache, the trace.

Every family builds its ``T.prim_func`` with a symbolic token dimension (``T.dynamic``), so one compiled
kernel serves every batch size. ``compiled(name, build, *key)`` compiles it once per key (hidden size,
dtype, flags), launch configuration (a frozen :class:`LaunchConfig`) and process, thread-safe (different
keys compile concurrently, nvcc being a subprocess).
``tilelang.compile`` keeps the binary under ``TILELANG_CACHE_DIR`` (default ``~/.tilelang/cache``),
published atomically and checked on load (``tilelang/cache/kernel_cache.py``, 0.1.15), so a later
process loads it: 0.1 s against 2.5-3 s compiling, on the H200 host. The first compile of each kernel
in a process, from nvcc or the disk, appends ``tilelang-compile|<name>|<key>|<seconds>s`` to the trace.

The target is the current GPU (``"cuda"``) unless ``DEEPINFER_TILELANG_TARGET`` names another (CI:
:data:`SM90`, on a machine without a GPU). On sm_90 and later every kernel starts with ``T.pdl_sync()``
(:func:`dependent_launch`).
"""

from __future__ import annotations

import json
import os
import re
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable, Dict, Optional, Tuple

from .. import reporting

ENV_TARGET = "DEEPINFER_TILELANG_TARGET"
#: "0" builds the kernels without programmatic dependent launch.
ENV_PDL = "DEEPINFER_OPS_PDL"
#: what CI compiles for (the H200 host's architecture)
SM90 = {"kind": "cuda", "arch": "sm_90"}
#: pinned against TILELANG_EXECUTION_BACKEND: 'tvm_ffi' takes the tensors and the stream through DLPack in
#: C and checks them in compiled host code; 'cython' calls through ctypes from Python on every launch
EXECUTION_BACKEND = "tvm_ffi"

#: Bytes per element of the data dtypes the kernels take.
ELEMENT_BYTES = {"float16": 2, "bfloat16": 2, "float32": 4}

_kernels: Dict[Tuple[str, tuple, Any], Any] = {}  # (name, key, config) -> kernel
_key_locks: Dict[Tuple[str, tuple, Any], threading.Lock] = {}
_lock = threading.Lock()


def target() -> Any:
    """The TileLang target: ``DEEPINFER_TILELANG_TARGET`` (a JSON dict or a target string), else ``"cuda"``."""
    text = os.environ.get(ENV_TARGET, "").strip()
    if not text:
        return "cuda"
    return json.loads(text) if text.startswith("{") else text


#: Kernels that wait for their predecessor (:func:`dependent_launch`) also let their successor start at
#: once (``T.pdl_trigger`` after the sync, as FlashInfer does): silu_and_mul 64x2*4096 1.04 µs with it,
#: 1.22 without (H200, bf16). ``DEEPINFER_OPS_PDL=0`` turns both off.
EARLY_TRIGGER = True


#: Calls moving this many bytes ``[low, high)`` do not trigger early: there (L2-resident across replays)
#: it lost, silu_and_mul 1024x2*4096 (25 MB) 5.56 µs with it, 3.71 without (H200, bf16).
NO_TRIGGER_BYTES = (4 << 20, 32 << 20)


@dataclass(frozen=True)
class LaunchConfig:
    """The knobs every family's launch configuration carries (a frozen record, part of the compile key:
    :func:`compiled`'s ``config``); each family's subclass adds its own and a heuristic, ``for_shape``."""

    early_trigger: bool = EARLY_TRIGGER
    no_trigger_bytes: Tuple[int, int] = NO_TRIGGER_BYTES

    @classmethod
    def for_shape(cls, *key):
        """The launcher's configuration for a kernel key: the defaults, for families whose choice does
        not depend on the shape (those that do override this)."""
        return cls()


def triggers_early(tokens: Any, bytes_per_token: Any, config: Optional[LaunchConfig] = None) -> Any:
    """Whether a kernel calls ``T.pdl_trigger()`` right after its ``T.pdl_sync()``: ``False`` without
    ``config.early_trigger`` or :func:`dependent_launch`, else the condition over its runtime token count
    that the bytes it moves (``bytes_per_token``: an int or a TIR expression) lie outside
    ``config.no_trigger_bytes`` (``config``: the kernel's :class:`LaunchConfig`, default the defaults)."""
    config = config or LaunchConfig()
    if not (config.early_trigger and dependent_launch()):
        return False
    import tilelang.language as T

    moved = T.cast(tokens, "int64") * bytes_per_token
    low, high = config.no_trigger_bytes
    return T.Or(moved < low, moved >= high)


def dependent_launch() -> bool:
    """Whether kernels begin with ``T.pdl_sync()`` (``cudaGridDependencySynchronize``): TileLang then
    marks them for programmatic dependent launch, so a kernel is scheduled while the previous one on
    the stream drains and waits for it, memory flushed, before its first access. Needs sm_90; off with
    ``DEEPINFER_OPS_PDL=0``. silu_and_mul, one token of 2*8192: 1.15 against 1.39 µs (H200, bf16,
    CUDA-graph replay)."""
    if os.environ.get(ENV_PDL, "1").strip() == "0":
        return False
    t = target()
    if t == "cuda":
        import torch

        return torch.cuda.is_available() and torch.cuda.get_device_capability() >= (9, 0)
    found = re.search(r"sm_(\d+)", t.get("arch", "") if isinstance(t, dict) else str(t))
    return found is not None and int(found.group(1)) >= 90


def lanes(dtype: str) -> int:
    """Elements of ``dtype`` in one 16-byte access, the widest a thread makes."""
    return 16 // ELEMENT_BYTES[dtype]


def vector_width(n: int, dtype: str) -> int:
    """Elements per vector access along rows of ``n``: 16 bytes of ``dtype``, down to the largest power
    of two dividing ``n`` (so that every row starts on a vector boundary)."""
    return min(lanes(dtype), n & -n)


#: 16-byte global loads with an L2 eviction priority (``createpolicy``, ``ld ... .L2::cache_hint``, as
#: Triton lowers ``eviction_policy=``), which TileLang's own loads lack; a kernel imports this source
#: (``T.import_source``) and loads through :func:`load16`. ``asm volatile`` + "memory" keeps them ordered
#: with the stores, at no cost (4143 against 4155 GB/s, fused_add_rmsnorm 16384x8192, H200, bf16).
HINTS = ("evict_last", "evict_first")
HINTED_LOADS = "".join(f"""
__device__ __forceinline__ void tk_load16_{hint}(void* dst, const void* src) {{
  uint4 v; unsigned long long policy;
  asm volatile("createpolicy.fractional.L2::{hint}.b64 %0, 1.0;" : "=l"(policy));
  asm volatile("ld.global.L1::{hint}.L2::cache_hint.v4.u32 {{%0, %1, %2, %3}}, [%4], %5;"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(src), "l"(policy) : "memory");
  *reinterpret_cast<uint4*>(dst) = v;
}}""" for hint in HINTS) + "\n"


def load16(hint: str, dst: Any, src: Any) -> None:
    """16 bytes from global ``src`` (an element of a buffer, 16-byte aligned) into the local ``dst``,
    with L2 eviction priority ``hint`` (one of :data:`HINTS`; the kernel imports :data:`HINTED_LOADS`)."""
    import tilelang.language as T

    T.evaluate(T.call_extern("handle", f"tk_load16_{hint}", T.address_of(dst), T.address_of(src)))


def in_bounds(num_tokens: Any, block_rows: int, n: int, tile: int) -> Callable[[Any, Any], Any]:
    """``live(row, col)``: whether a vector at (row, col) lies inside a ``(num_tokens, n)`` tensor that
    blocks of ``block_rows`` rows and tiles of ``tile`` columns cover (``n`` a multiple of the vector
    width, so a vector is wholly in or out); a Python True where the tiling proves it, so that the
    generated code carries no test there."""
    import tilelang.language as T

    def live(row: Any, col: Any) -> Any:
        ok = True
        if block_rows > 1:
            ok = row < num_tokens
        if n % tile:
            ok = col < n if ok is True else T.And(ok, col < n)
        return ok
    return live


def compiled(name: str, build: Callable[..., Any], *key: Any, config: Optional[LaunchConfig] = None) -> Any:
    """The kernel ``build(*key, config=config)`` compiled for :func:`target` (``key``: hashable
    specialisation values; ``config`` default ``build.config_for(*key)``, the launcher's heuristic, where
    the builder has one). Thread-safe; compiles at most once per process, key and config (a kernel built
    for one config never serves another)."""
    if config is None and hasattr(build, "config_for"):
        config = build.config_for(*key)
    memo = (name, key, config)
    kernel = _kernels.get(memo)
    if kernel is not None:
        return kernel
    with _lock:
        key_lock = _key_locks.setdefault(memo, threading.Lock())
    with key_lock:
        kernel = _kernels.get(memo)
        if kernel is None:
            import tilelang

            _quiet(tilelang)
            start = time.perf_counter()
            prim = build(*key) if config is None else build(*key, config=config)
            kernel = tilelang.compile(prim, target=target(), execution_backend=EXECUTION_BACKEND)
            seconds = time.perf_counter() - start
            _kernels[memo] = kernel
            _trace_compile(name, key, seconds)
    return kernel


_quieted = False


def _quiet(tilelang: Any) -> None:
    """TileLang logs two INFO lines per kernel compiled (about 60 in the GPU tests): WARNING instead,
    unless ``DEEPINFER_OPS_VERBOSE``; the trace file records each compile."""
    global _quieted
    if not _quieted:
        if not reporting.verbose():
            tilelang.set_log_level("WARNING")
        _quieted = True


def entry(kernel: Any) -> Callable[..., Any]:
    """The compiled host function of ``kernel`` (a ``tvm_ffi.Function``): the same call as
    ``kernel(*args)`` for a kernel that allocates no output, without the adapter's Python loop over
    the parameters (launchers that run on every eager call keep this and call it)."""
    adapter = kernel.adapter
    return adapter.get_exportable_executable()[str(adapter.prim_func.attrs["global_symbol"])]


def host_functions(name: str, build: Callable[..., Any]) -> Callable[..., Any]:
    """``function(*key)``: :func:`entry` of ``compiled(name, build, *key)``, kept per key (its dict is
    ``function.cache``; the builder's ``config_for`` runs once per key): a launcher's per-call lookup
    after the first call."""
    cache: Dict[tuple, Any] = {}

    def function(*key: Any) -> Any:
        fn = cache.get(key)
        if fn is None:
            fn = cache[key] = entry(compiled(name, build, *key))
        return fn
    function.cache = cache  # type: ignore[attr-defined]
    return function


def _trace_compile(name: str, key: tuple, seconds: float) -> None:
    reporting.trace(f"tilelang-compile|{name}|{','.join(map(str, key))}|{seconds:.3f}s")


def memo_size() -> int:
    """How many kernels this process has compiled or loaded (tests: a new batch size adds none)."""
    return len(_kernels)


def clear_memo() -> None:
    """Forget this memo (tests: the next call asks ``tilelang.compile`` again, which answers from its
    own in-process cache or the disk, and traces the first compile again)."""
    with _lock:
        _kernels.clear()
        _key_locks.clear()
