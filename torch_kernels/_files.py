"""Opening files the package finds in caches it does not own (the C++ entry, tuned tables): regular
files only, never blocking on a FIFO or reading a device without end. Standard library only."""

import os
import stat


def open_regular(path: "os.PathLike[str] | str", limit: int) -> int:
    """A read-only descriptor of ``path`` if it is a regular file of at most ``limit`` bytes (a link to
    one is followed); ``ValueError`` saying why not. Checked by name before opening, so that a device
    or a FIFO is never opened, and by descriptor after, should the name have been replaced meanwhile."""
    try:
        if not stat.S_ISREG(os.stat(path).st_mode):
            raise ValueError("not a regular file")
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as e:
        raise ValueError(f"unreadable: {e.strerror or e}") from None
    info = os.fstat(fd)
    if not stat.S_ISREG(info.st_mode) or info.st_size > limit:
        os.close(fd)
        raise ValueError("not a regular file" if not stat.S_ISREG(info.st_mode)
                         else f"{info.st_size} bytes, larger than the {limit} read")
    return fd
