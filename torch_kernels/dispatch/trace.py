"""The trace file (``DEEPINFER_TRACE_KERNELS``): a line at the first use of each (op, backend) on each
device type, appended so that ranks sharing one file never interleave a line."""

from __future__ import annotations

import errno
import fcntl
import os
from typing import Any

from ..spec import Backend
from .settings import _lock, _notice, selection

_traced: set = set()  # (op, backend, device type) traced since the last configure()
_unwritable: set = set()  # trace paths that failed once: never tried again until configure()


def _describe(a: Any) -> str:
    """An argument as the trace shows it: shapes, dtypes, strides and scalars, never tensor data."""
    if hasattr(a, "shape") and hasattr(a, "dtype"):
        text = f"{str(a.dtype).replace('torch.', '')}{list(a.shape)}@{a.device}"
        return text if a.is_contiguous() else f"{text}stride={list(a.stride())}"
    if isinstance(a, (list, tuple)):
        return "[" + ", ".join(_describe(x) for x in a) + "]"
    return repr(a)


def _device_type(a: Any) -> str:
    device = getattr(a, "device", None)
    return getattr(device, "type", "cpu")


def _trace(op: str, backend: Backend, args: tuple, device: str) -> None:
    """The trace line of the first use of (op, backend) on ``device`` (a device type)."""
    sel = selection()
    path = sel.trace_path
    if not path or (op, backend, device) in _traced:
        return
    _traced.add((op, backend, device))
    line = f"{op}|{backend.value}"
    if sel.trace_args:
        line += "|args=(" + ", ".join(_describe(a) for a in args) + ")"
    append_line(path, line)


def append_line(path: str, line: str) -> bool:
    """Append one line with one ``write`` on an ``O_APPEND`` descriptor under an exclusive lock, so
    that the ranks of a data-parallel job sharing one trace file never interleave a line.

    Never raises: a path that cannot be written (missing directory, a directory, no permission, a
    FIFO nobody reads) gives one notice and is not tried again until :func:`configure`; False then."""
    if path in _unwritable:
        return False
    data = (line.rstrip("\n") + "\n").encode()
    try:
        # O_NONBLOCK: a FIFO with no reader fails at once (ENXIO) instead of hanging the op call
        fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NONBLOCK | os.O_CLOEXEC, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view):]
        finally:
            os.close(fd)  # closing releases the lock
    except (OSError, ValueError) as e:
        with _lock:
            if path not in _unwritable:
                _unwritable.add(path)
                sel = selection()
                name = sel.name_of("trace_path") if path == sel.trace_path else "the trace"
                why = e.strerror if isinstance(e, OSError) and e.strerror else str(e)
                why += " (a FIFO with no reader)" if getattr(e, "errno", None) == errno.ENXIO else ""
                _notice(f"{name}: cannot append to {path!r} ({why}); nothing more is traced there")
        return False
    return True
