"""Verbosity and the trace file, as the layers below selection read them.

Kernel compilers and JIT loaders (``backends/tilelang_jit.py``, ``backends/flashinfer_jit.py``) report what
they build, but may not import ``dispatch``, which selects among them: ``dispatch.configure`` pushes each
new selection's settings here (:func:`update`) and they read them here. Standard library only.
"""

from typing import Callable, Optional

_verbose = False
_trace: Optional[Callable[[str], object]] = None


def update(verbose: bool, trace: Optional[Callable[[str], object]]) -> None:
    """The selection's ``DEEPINFER_OPS_VERBOSE``, and how to append one line to its
    ``DEEPINFER_TRACE_KERNELS`` file (``None``: no trace file)."""
    global _verbose, _trace
    _verbose, _trace = verbose, trace


def verbose() -> bool:
    """Whether ``DEEPINFER_OPS_VERBOSE`` (or ``configure(verbose=True)``) asks for every detail."""
    return _verbose


def trace(line: str) -> None:
    """Append ``line`` to the trace file when one is set; never raises (see ``dispatch.append_line``)."""
    append = _trace
    if append is not None:
        append(line)
