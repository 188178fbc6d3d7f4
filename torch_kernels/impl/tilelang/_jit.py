"""Compiling TileLang kernels: the target, an in-process memo, TileLang's disk cache, the trace.

Every family module builds its ``T.prim_func`` with a symbolic token dimension (``T.symbolic``), so one
compiled kernel serves every batch size; ``compiled(name, build, *key)`` compiles it once per key
(hidden size, dtype, flags) and process:

* in memory: a dict lookup per call after the first;
* on disk: ``tilelang.compile`` keeps the binary under ``TILELANG_CACHE_DIR`` (default
  ``~/.tilelang/cache``) and publishes each entry with one atomic directory rename, so a second process
  loads it instead of compiling (2.5-3 s a kernel on the H200 host, 0.1 s loaded), and two processes
  compiling the same kernel at once both end with a sound entry (``tests/test_tilelang.py`` runs two);
* the first compile of each kernel in a process appends ``tilelang-compile|<name>|<key>|<seconds>s`` to
  the trace file (``DEEPINFER_TRACE_KERNELS``), whether it came from nvcc or from the disk cache.

The target is the current GPU (``"cuda"``) unless ``DEEPINFER_TILELANG_TARGET`` names another, as CI
does to compile every kernel for ``{"kind": "cuda", "arch": "sm_90"}`` on a machine without a GPU.
"""

from __future__ import annotations

import json
import os
import threading
import time
from typing import Any, Callable, Dict, Tuple

ENV_TARGET = "DEEPINFER_TILELANG_TARGET"
#: what CI compiles for (the H200 host's architecture)
SM90 = {"kind": "cuda", "arch": "sm_90"}

_kernels: Dict[Tuple[str, tuple], Any] = {}
_lock = threading.Lock()


def target() -> Any:
    """The TileLang target: ``DEEPINFER_TILELANG_TARGET`` (a JSON dict or a target string), else ``"cuda"``."""
    text = os.environ.get(ENV_TARGET, "").strip()
    if not text:
        return "cuda"
    return json.loads(text) if text.startswith("{") else text


def compiled(name: str, build: Callable[..., Any], *key: Any) -> Any:
    """The kernel ``build(*key)`` compiled for :func:`target` (``key``: hashable specialisation values).
    Thread-safe; compiles at most once per process and key."""
    kernel = _kernels.get((name, key))
    if kernel is not None:
        return kernel
    with _lock:
        kernel = _kernels.get((name, key))
        if kernel is None:
            import tilelang

            start = time.perf_counter()
            kernel = tilelang.compile(build(*key), target=target())
            seconds = time.perf_counter() - start
            _kernels[(name, key)] = kernel
            _trace_compile(name, key, seconds)
    return kernel


def _trace_compile(name: str, key: tuple, seconds: float) -> None:
    from ... import dispatch

    path = dispatch.selection().trace_path
    if path:
        dispatch.append_line(path, f"tilelang-compile|{name}|{','.join(map(str, key))}|{seconds:.3f}s")


def clear_memo() -> None:
    """Forget the in-process kernels (tests: the next call goes to TileLang's disk cache)."""
    with _lock:
        _kernels.clear()
