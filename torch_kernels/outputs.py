"""The tensors of an op's ``out`` overload, as a backend that writes them itself takes them.

A backend function whose :class:`~torch_kernels.spec.KernelSpec` has ``out`` takes the keyword ``out``:
``None`` for the default overload (it allocates its results), or the tensors given to
``torch.ops.deepinfer.<op>.out``, in the schema's order. It takes each one through :func:`given`
before it launches anything, so that nothing is written unless every output is one it can write:

* of another shape, dtype or device: :class:`WrongOutput`, which the ``out`` entry reports as a
  ``ValueError`` naming the op and the argument;
* laid out otherwise than the kernel writes (strides, an address off 16 bytes): :class:`Restage`,
  and the entry computes into new tensors and copies them into the given ones, as for a backend
  without ``out``.

The entry has checked already that the given tensors overlap none of the inputs and none of each other.
"""

from __future__ import annotations

from typing import Optional, Sequence, Tuple

import torch
from torch import Tensor

#: the alignment the vectorised kernels assume of every row they write (16-byte stores)
ALIGNMENT = 16


class Restage(Exception):
    """A given output the kernel cannot write as it is: the entry computes into new tensors and copies."""


class WrongOutput(ValueError):
    """A given output of another shape, dtype or device than the op returns."""

    def __init__(self, index: int, shape: Tuple[int, ...], dtype: torch.dtype, device: torch.device) -> None:
        super().__init__(f"output {index} must be {dtype} of shape {tuple(shape)} on {device}")
        self.index, self.shape, self.dtype, self.device = index, tuple(shape), dtype, device


def contiguous_strides(shape: Sequence[int]) -> Tuple[int, ...]:
    """The strides of a contiguous tensor of ``shape``."""
    strides, step = [], 1
    for size in reversed(shape):
        strides.append(step)
        step *= max(int(size), 1)
    return tuple(reversed(strides))


def given(out: Sequence[Tensor], index: int, shape: Sequence[int], dtype: torch.dtype, device: torch.device,
          strides: Optional[Sequence[int]] = None) -> Tensor:
    """``out[index]``, checked to be the op's output ``index``: ``shape``, ``dtype`` and ``device``
    (else :class:`WrongOutput`), laid out with ``strides`` (default: contiguous) at an aligned address
    (else :class:`Restage`)."""
    t = out[index]
    if t.dtype != dtype or t.device != device or tuple(t.shape) != tuple(shape):
        raise WrongOutput(index, tuple(shape), dtype, device)
    laid_out = t.is_contiguous() if strides is None else all(s == w for s, w, n in zip(t.stride(), strides, t.shape) if n > 1)
    if t.data_ptr() % ALIGNMENT or not laid_out:
        raise Restage
    return t
