"""FlashInfer as this backend loads it: its version, its JIT modules (a build announced once on
stderr with how long it took), and the backend's one-time notices.

FlashInfer compiles each kernel module with nvcc the first time a process uses it: ``gen_<x>_module()``
describes the module (``flashinfer.jit.JitSpec``), ``get_<x>_module()`` (``functools.cache``) builds it
unless its library is already in FlashInfer's cache (``~/.cache/flashinfer/<version>/<arch>/cached_ops``,
or an AOT package) and loads it. A build takes 5-95 s a module on the H200 host, loading a cached one
under 0.1 s. :func:`jit_module` runs that getter once per process itself,
timed, so the FlashInfer functions called afterwards find the module loaded:

* the module was not compiled before the call (``JitSpec.is_compiled``, in 0.6.x and 0.7.x), or loading
  it took over :data:`SLOW_LOAD_S` (ninja rebuilt a stale library): one stderr line
  ``[deepinfer] flashinfer 0.7.4: JIT module 'norm' built on first use in 41.3 s (...)``;
* every first load, built or not, appends ``flashinfer-jit|<module>|built|41.300s`` (or ``loaded``)
  to the trace file when ``DEEPINFER_TRACE_KERNELS`` is set, as TileLang's compiles are traced.
"""

from __future__ import annotations

import functools
import re
import sys
import threading
import time
from typing import Any, Callable, Dict, Set, Tuple

import flashinfer
import torch

from .. import reporting

#: A cached module loads in under 0.1 s on the H200 host; a first load slower than this rebuilt something.
SLOW_LOAD_S = 1.0


def _version(text: str) -> Tuple[int, int, int]:
    """The release numbers: ``"0.6.18.post1"`` -> ``(0, 6, 18)``, ``"0.7.0rc1+cu130"`` -> ``(0, 7, 0)``."""
    parts = [int(p) for p in re.findall(r"\d+", text.split("+")[0])[:3]]
    return tuple(parts + [0] * (3 - len(parts)))  # type: ignore[return-value]


VERSION_TEXT: str = getattr(flashinfer, "__version__", "0")
VERSION: Tuple[int, int, int] = _version(VERSION_TEXT)

_modules: Dict[str, Any] = {}
_said: Set[str] = set()
_lock = threading.Lock()


@functools.lru_cache(maxsize=None)
def max_shared_bytes(device: torch.device) -> int:
    """Opt-in shared memory per block of ``device`` (232448 bytes on an H200), which FlashInfer's kernels
    request; 48 KiB where torch does not report it, what every device grants without opting in."""
    return getattr(torch.cuda.get_device_properties(device), "shared_memory_per_block_optin", 48 * 1024)


def notice(message: str) -> None:
    print(f"[deepinfer] {message}", file=sys.stderr, flush=True)


def notice_once(key: str, message: str) -> None:
    """:func:`notice`, the first time ``key`` is given in this process."""
    with _lock:
        if key in _said:
            return
        _said.add(key)
    notice(message)


def jit_module(name: str, spec: Callable[..., Any], get: Callable[..., Any], *args: Any) -> Any:
    """FlashInfer's JIT module ``name``: ``get(*args)`` (FlashInfer's cached ``get_<x>_module``), run once
    per process and timed; ``spec(*args)`` is its ``gen_<x>_module``, asked beforehand whether it is compiled."""
    module = _modules.get(name)
    if module is not None:
        return module
    with _lock:
        module = _modules.get(name)
        if module is None:
            jit_spec = spec(*args)
            was_compiled = bool(jit_spec.is_compiled)
            start = time.perf_counter()
            module = get(*args)
            seconds = time.perf_counter() - start
            _modules[name] = module
            built = not was_compiled or seconds > SLOW_LOAD_S
            _trace(name, "built" if built else "loaded", seconds)
            if built:
                notice(f"flashinfer {VERSION_TEXT}: JIT module {name!r} built on first use in {seconds:.1f} s "
                       f"(cached as {jit_spec.get_library_path()}; later processes load it)")
    return module


def _trace(name: str, what: str, seconds: float) -> None:
    reporting.trace(f"flashinfer-jit|{name}|{what}|{seconds:.3f}s")
