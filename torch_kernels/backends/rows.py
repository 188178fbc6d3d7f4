"""``(..., N)`` tensors as ``(T, N)`` rows, for the row-wise kernels of every backend."""

from typing import Optional

from torch import Tensor


def rows(t: Tensor) -> Tensor:
    """``(..., N)`` as ``(T, N)`` rows: a view when the leading dims collapse, else a copy."""
    return t if t.dim() == 2 else t.reshape(-1, t.shape[-1])


def rows_view(t: Tensor) -> Optional[Tensor]:
    """``(..., N)`` as a ``(T, N)`` view of the same memory, or ``None`` when there is none."""
    if t.dim() == 2:
        return t
    try:
        return t.view(-1, t.shape[-1])
    except RuntimeError:
        return None
